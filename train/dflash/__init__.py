"""DFlash drafter training (`python -m train.dflash`); see train/dflash/train.py."""

from train.dflash.train import main

__all__ = ["main"]
