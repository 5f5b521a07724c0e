"""What runs inside the Slurm allocation: prepare node-local caches, preflight, then the entrypoint.

submitit pickles an `EntrypointRun` and calls it in every task. It is Checkpointable, so on a
timeout or preemption submitit requeues the same command line; the trainers resume from their
own latest checkpoint in $LAUNCH_JOB_DIR.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import submitit

CACHE_VARS = {"TRITON_CACHE_DIR": "triton", "HF_HOME": "hf", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


class EntrypointFailed(RuntimeError):
    """The entrypoint returned a non-zero exit code."""


class EntrypointRun(submitit.helpers.Checkpointable):
    def __init__(self, module: str, argv: list[str], job_name: str, preflight: bool = True) -> None:
        self.module = module
        self.argv = list(argv)
        self.job_name = job_name
        self.preflight = preflight

    def __call__(self) -> int:
        prepare_node_local_dirs()
        if self.preflight:
            run_preflight(self.job_name)
        entry = importlib.import_module(self.module)
        if not hasattr(entry, "main"):
            # A package entrypoint (`train.stage1`) keeps main() in its __main__ or train module.
            for sub in ("train", "__main__"):
                try:
                    entry = importlib.import_module(f"{self.module}.{sub}")
                except ModuleNotFoundError:
                    continue
                if hasattr(entry, "main"):
                    break
        print(f"[launch] running {self.module} {' '.join(self.argv)}", flush=True)
        code = entry.main(self.argv)
        sys.stdout.flush()
        if code:
            raise EntrypointFailed(f"{self.module} exited with code {code}")
        return 0


def prepare_node_local_dirs() -> None:
    """Every task makes its node's scratch and cache dirs (setup lines run on the first node only)."""
    for var in ("LAUNCH_SCRATCH", *CACHE_VARS):
        value = os.environ.get(var)
        if value:
            Path(value).mkdir(parents=True, exist_ok=True)


def run_preflight(job_name: str) -> None:
    """The doctor's fast subset, when the doctor is installed; a FAIL stops the job early."""
    try:
        doctor = importlib.import_module("launch.doctor")
    except ModuleNotFoundError:
        return
    fast_subset = getattr(doctor, "fast_subset", None)
    if fast_subset is not None:
        fast_subset(job_name)
