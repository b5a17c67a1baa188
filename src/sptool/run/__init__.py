"""``sptool run``'s executor, which knows no recipe: the loop (:mod:`.driver`), declarative steps
(:mod:`.steps`), the run directory (:mod:`.run_dir`), the loaded models (:mod:`.session`),
per-kind metrics (:mod:`.metrics`) and the test-only fault points (:mod:`.faults`)."""
