"""Neutral leaf package shared by `launch` (the cluster side) and `train` (the trainers).

It imports neither of them, so both may import it without tying the two packages together:
- `toolkit.fsutil`: atomic writes, fsync, sha256 of a file;
- `toolkit.metrics`: the metrics.jsonl record format, its reader and each trainer's schema;
- `toolkit.outcome`: outcome.json, how a run ended (completed / failed / cancelled at step N);
- `toolkit.pyexec`: the argv of a Python child that never imports from the current directory.
"""
