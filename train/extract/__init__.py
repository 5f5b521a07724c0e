"""Hidden-state extraction (`python -m train.extract`); see train/extract/extract.py."""

from train.extract.extract import main

__all__ = ["main"]
