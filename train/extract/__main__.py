"""`python -m train.extract`: always behind the Slurm guard (see train.common.slurm_guard)."""

import sys

from train.extract.extract import main

sys.exit(main(guard=True))
