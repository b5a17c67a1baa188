"""The floor everything stands on: the record model and its errors (``records``), JSONL reading
(``jsonl``), atomic output files (``fsguard``), the stage contract (``stage``), name registries
(``registry``), process pools with deadlines (``workers``), the files shipped in the package
(``packaged``: ``package:NAME``) and test-only fault points (``faults``).
Nothing here imports the rest of sptool."""
