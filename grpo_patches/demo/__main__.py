"""``python -m grpo_patches.demo --worker on|off ...``: one training run of the demo (internal;
``grpo-patches demo`` starts two, see :mod:`grpo_patches.demo.compare`)."""

import sys

from grpo_patches.demo.compare import main

sys.exit(main())
