"""`python -m train.stage1`: always behind the Slurm guard (see train.common.slurm_guard)."""

import sys

from train.stage1.train import main

if __name__ == "__main__":
    sys.exit(main(guard=True))
