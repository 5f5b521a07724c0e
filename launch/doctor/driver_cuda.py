"""The NVIDIA driver branch each CUDA runtime major needs: the one table, for the doctor and the role.

A CUDA runtime (the one torch brings in its wheels) runs on any driver of at least the
branch its major needs (NVIDIA's minor-version compatibility): CUDA 13.x needs R580+, 12.x
R525+, 11.x R450+. Below it, `cudaGetDeviceCount` fails with error 35
(cudaErrorInsufficientDriver, "CUDA driver version is insufficient for CUDA runtime version").

`python -m launch.doctor.driver_cuda DRIVER [CUDA]` checks one pair (CUDA defaults to the
build of the torch this interpreter sees): exit 0 and one line when it works, 1 and one line
when it does not, 2 on a malformed version. The provisioning's python_env role runs it in the
container's venv against the host driver's version.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

# CUDA runtime major -> the lowest driver branch that runs it.
MIN_DRIVER_BRANCH = {13: 580, 12: 525, 11: 450}


def _major(version: str, what: str) -> int:
    match = re.match(r"^\s*(\d+)(\.\d+)*\s*$", version)
    if not match:
        raise ValueError(f"{what} version {version!r} is not N.N")
    return int(match[1])


def driver_cuda_problem(driver: str, cuda: str) -> str | None:
    """None when driver `driver` runs CUDA runtime `cuda`, else the reason in one line."""
    branch, major = _major(driver, "driver"), _major(cuda, "CUDA")
    need = MIN_DRIVER_BRANCH.get(major)
    if need is None:
        return f"CUDA {cuda} is not in the driver table (CUDA {', '.join(map(str, sorted(MIN_DRIVER_BRANCH)))})"
    if branch < need:
        return (f"driver {driver} (R{branch}) is too old for CUDA {cuda}, which needs R{need}+; CUDA initialisation "
                "fails with error 35 (insufficient driver)")
    return None


def torch_cuda_version() -> str | None:
    """torch.version.cuda without importing torch (3+ s): read the literal from torch/version.py."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "cuda" and isinstance(node.value, ast.Constant):
            return node.value.value
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m launch.doctor.driver_cuda DRIVER [CUDA]", file=sys.stderr)
        return 2
    if len(args) == 2:
        cuda = args[1]
    else:
        cuda = torch_cuda_version() or ""
        if not cuda:
            print("no CUDA build of torch here: nothing to check")
            return 0
    try:
        problem = driver_cuda_problem(args[0], cuda)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(problem or f"driver {args[0]} runs CUDA {cuda}")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
