"""The stages the command line exposes, one module or package each: ``verify``, ``solve``,
``challenge``, ``novelty``, ``tree`` (``tree expand``, ``posterior update``), ``corpus``
(``corpus fetch``), ``decontaminate``, ``evaluate`` (``eval``) and ``problemsets`` (the labelled
sets ``--data``, ``--eval`` and ``--benchmark`` read). Each turns records into records
(:class:`sptool.core.stage.Stage`)."""
