"""The demo and what it stands on: ``grpo-patches demo`` (:mod:`.compare`), the embedded tiny
model (:mod:`.tiny_model`, also used by the tests and benchmarks) and the step timer
(:mod:`.step_timer`).

Those modules use torch, transformers, datasets and TRL; the rest of grpo_patches never imports
this sub-package (``tests/test_core_imports.py``), save the command line, which runs the demo
and reads its defaults from here (this file imports nothing).
"""

#: Optimizer steps per run of ``grpo-patches demo``.
DEFAULT_STEPS = 16
