"""DFlash drafter training (`python -m train.dflash`); see train/dflash/train.py."""

from typing import Any

__all__ = ["main"]


def __getattr__(name: str) -> Any:
    # `main` on first use: `launch submit` imports train.dflash.args (the flags, no torch) through
    # this package, and must not import the trainer with it.
    if name == "main":
        from train.dflash.train import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
