"""`python -m train.dflash`: always behind the Slurm guard (see train.common.slurm_guard)."""

import sys

from train.dflash.train import main

sys.exit(main(guard=True))
