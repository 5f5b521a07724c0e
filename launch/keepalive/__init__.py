"""Keepalive GPU holder: keeps idle GPUs occupied and yields them only to Slurm jobs.

- `daemon`: the holder (`launch keepalive run`), serving a root-only unix socket.
- `holders`: how one GPU is held: CUDA memory plus a light kernel, or a lock on a stand-in.
- `protocol`: the JSON-line request/response format and the client side.
- `hooks`: the Slurm Prolog/Epilog commands and the wrapper scripts slurmd runs.
- `slurm_state`: which GPUs running Slurm jobs own on this node (read after a holder restart).
"""
