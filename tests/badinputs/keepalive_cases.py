"""Bad inputs: keepalive (see tests/badinputs/__init__.py for what a case is)."""

from __future__ import annotations

from tests.badinputs import Case

CASES: list[Case] = []
