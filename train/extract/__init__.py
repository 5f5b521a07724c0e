"""Hidden-state extraction (`python -m train.extract`); see train/extract/extract.py."""

from typing import Any

__all__ = ["main"]


def __getattr__(name: str) -> Any:
    # `main` on first use: `launch submit` imports train.extract.args (the flags, no torch) through
    # this package, and must not import the trainer with it.
    if name == "main":
        from train.extract.extract import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
