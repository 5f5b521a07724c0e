"""`python -m train.regen`: always behind the Slurm guard (see train.common.slurm_guard)."""

import sys

from train.regen.regen import main

sys.exit(main(guard=True))
