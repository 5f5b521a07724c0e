"""Response regeneration with the target (`python -m train.regen`); see train/regen/regen.py."""

from train.regen.regen import main

__all__ = ["main"]
