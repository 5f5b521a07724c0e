"""Response regeneration with the target (`python -m train.regen`); see train/regen/regen.py."""

from typing import Any

__all__ = ["main"]


def __getattr__(name: str) -> Any:
    # `main` on first use: `launch submit` imports train.regen.args (the flags, no torch) through
    # this package, and must not import the trainer with it.
    if name == "main":
        from train.regen.regen import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
