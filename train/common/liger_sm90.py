"""Liger-Kernel's Hopper fused linear cross-entropy (``--loss-impl liger-sm90``) as a per-token loss.

Liger-Kernel (0.8.3+) has an SM90 fused linear cross-entropy written in the CuTe DSL
(``liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90``): a persistent WGMMA/TMA logits
GEMM, a one-read cross-entropy that overwrites the bf16 logits in place with dZ = softmax - onehot,
and two WGMMA GEMMs for dX = dZ W and dW = dZ^T X ("gradient in forward"). Its public autograd
function does not fit the trainer as it is:

* it returns only the reduced (``mean``/``sum``) loss, and the trainer logs the loss per task from
  the per-token values;
* it keeps the whole [M, V] dZ alive until the backward: at 4 x 8,192 rows and a ~273k vocab that is
  17.9 GB of bf16 on top of the step's peak.

So this module drives the same four kernel primitives over chunks of rows: each chunk's logits
buffer is dZ, dX and dW are made from it at once, and only dX [N, D] and dW [V, D] are kept for the
backward (as Liger's Triton FLCE and cut-cross-entropy keep nothing of the vocab dimension).
The per-token losses come straight from the kernel's nll output.

The one contract: the gradient reaching the per-token losses must be the same for every row that
has a target (the trainer's loss is sum / count, train/stage1/train.py ``losses``), because dW is
summed over rows in the forward. dX is scaled per row, so it is exact for any weights; a backward
that hands non-uniform weights fails a device-side assertion instead of training on a wrong dW.
The DFlash trainer weights positions, so it does not offer this choice.

Kernel limits (Liger's own): Hopper (sm_90) only, bf16 operands, the vocab a multiple of 256 (the
model's padded vocab is), the hidden size a multiple of 256, rows a multiple of 128 (padded here
with ignored rows). On a CPU the same chunked autograd runs over :func:`torch_primitives`, which is
how tests/test_losses.py checks the chunking, the padding and the backward against full logits.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from train.common.packing import IGNORE_INDEX

ROW_TILE = 128  # the kernel's M tile: rows are padded to a multiple of it
VOCAB_TILE = 256  # the kernel's N tile: the vocab and the hidden size must be multiples of it
# Rows per chunk: one chunk's bf16 logits are CHUNK_ROWS x V x 2 bytes (4.5 GB at a 273k vocab).
# Larger chunks feed the GEMMs better; this bounds the step's peak to that one buffer.
CHUNK_ROWS = 8192


@dataclass(frozen=True)
class Primitives:
    """The four kernels of a gradient-in-forward fused linear cross-entropy (bf16 operands)."""

    logits: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (x [m, D], w [V, D], out [m, V]): out = x w^T
    ce_dz: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (logits, target [m], nll [m]): nll, logits := dZ
    dx: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (dz [m, V], w [V, D]) -> dz w  [m, D]
    dw: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (dz [m, V], x [m, D]) -> dz^T x  [V, D]


# What liger_primitives imports, in dependency order, each with the distribution that brings it: the
# probe imports them one by one so a refusal names the missing package, not Liger's wrapper message
# ("cutedsl backend requires the NVIDIA CUTLASS Python DSL") that hides which part is missing.
LIGER_OPS = "liger_kernel.ops.cutedsl.ops"
IMPORTS: tuple[tuple[str, str], ...] = (
    ("liger_kernel", "liger-kernel"),
    ("cuda.bindings.driver", "cuda-bindings"),
    ("google.protobuf", "protobuf"),
    ("cutlass", "nvidia-cutlass-dsl-libs-core"),
    ("cutlass.cute", "nvidia-cutlass-dsl-libs-base and nvidia-cutlass-dsl-libs-cu12"),
    (f"{LIGER_OPS}._fused_linear_cross_entropy_forward_sm90", "liger-kernel >= 0.8.3"),
    (f"{LIGER_OPS}._fused_linear_cross_entropy_backward_sm90", "liger-kernel >= 0.8.3"),
    (f"{LIGER_OPS}.utils", "liger-kernel >= 0.8.3"),
)
# A module a failed import names -> the distribution that ships it (the CUTLASS DSL's parts split one
# `cutlass` package across three wheels; the flavour wheel holds the compiled IR module).
PROVIDERS: tuple[tuple[str, str], ...] = (
    ("cutlass._mlir", "nvidia-cutlass-dsl-libs-base"),
    ("cutlass", "nvidia-cutlass-dsl-libs-core"),
    ("cuda", "cuda-bindings"),
    ("google", "protobuf"),
    ("liger_kernel", "liger-kernel"),
)


def _provider(module: str, default: str) -> str:
    """The distribution that ships `module` (PROVIDERS), else `default`."""
    for prefix, dist in PROVIDERS:
        if module == prefix or module.startswith(prefix + "."):
            return dist
    return default


def _cutlass_off_path() -> str | None:
    """Why `cutlass` does not import although the CUTLASS DSL's files are there, else None.

    The `cutlass` package lives in <site>/nvidia_cutlass_dsl/dsl_packages, which only the
    nvidia-cutlass-dsl wheel's nvidia_cutlass_dsl_packages.pth puts on sys.path, and Python runs .pth
    files in site directories alone: a `pip install --target DIR` put on PYTHONPATH has every wheel
    but no `cutlass`."""
    try:
        spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        packages = Path(root) / "dsl_packages"
        if not (packages / "cutlass").is_dir() or str(packages) in sys.path:
            continue
        if not (Path(root).parent / "nvidia_cutlass_dsl_packages.pth").is_file():
            return (f"nvidia-cutlass-dsl missing (its libs are in {root}, but the wheel whose "
                    "nvidia_cutlass_dsl_packages.pth puts `cutlass` on sys.path is not installed)")
        return (f"nvidia-cutlass-dsl is installed but its .pth file was not read (Python reads .pth files "
                f"only in site directories, not from PYTHONPATH): add {packages} to PYTHONPATH")
    return None


def import_problem(ce: str = "liger") -> str | None:
    """None when every module liger_primitives(ce) needs imports, else one line naming the package
    that is missing or broken and the error (the liger-sm90 probe of train.common.losses)."""
    for module, dist in IMPORTS + ((("triton", "triton"),) if ce == "triton" else ()):
        try:
            importlib.import_module(module)
        except Exception as exc:  # a broken native library surfaces as any exception type
            missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
            if missing and missing.split(".")[0] == "cutlass" and (why := _cutlass_off_path()):
                return why
            if missing and not (module.startswith(LIGER_OPS) and missing.startswith("liger_kernel")):
                dist = _provider(missing, f"the package of `{missing.split('.')[0]}` (needed by {dist})")
            elif "No CTK flavor installed" in str(exc):  # the CUTLASS DSL without its compiled flavour wheel
                dist = "nvidia-cutlass-dsl-libs-cu12"
            detail = " ".join(f"{type(exc).__name__}: {exc}".split())
            return f"{dist} missing or broken (import {module}: {detail[:300]})"
    return None


# Liger's one-read cluster CE kernel takes a row in CE_PARTITIONS (8) CTAs of at most 16,384 values
# each, i.e. a vocab up to 131,072; above it (the 2B model's 273,152) cross_entropy_dz runs its
# fallback: two passes of one bf16 value per thread per load. The Triton pass below reads with
# wide vector loads instead (same traffic: two reads and one write of the logits); which one is
# faster at the model's vocab is measured side by side (bench/loss_head.py: liger-sm90-tce).
CE_IMPLS = ("liger", "triton")
TRITON_CE_BLOCK = 8192  # 16 bf16 a thread a pass-step at 16 warps: two 16-byte loads in flight


@functools.cache
def _triton_ce_dz_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def ce_dz_kernel(z_ptr, target_ptr, nll_ptr, vocab, stride, ignore_index, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        z_row = z_ptr + row.to(tl.int64) * stride
        target = tl.load(target_ptr + row)
        ignore = target == ignore_index
        # pass 1: running max and sum of exp, in fp32, block by block
        run_max = tl.full((), float("-inf"), tl.float32)
        run_sum = tl.zeros((), tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(z_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(run_max, tl.max(x, axis=0))
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            run_max = new_max
        lse = run_max + tl.log(run_sum)
        safe = tl.where(ignore, 0, target)
        target_logit = tl.load(z_row + safe).to(tl.float32)
        tl.store(nll_ptr + row, tl.where(ignore, 0.0, lse - target_logit))
        # pass 2: dZ = softmax - onehot (0 for an ignored row), rounded to bf16, over the logits
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab
            x = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
            g = tl.where(ignore, 0.0, g)
            tl.store(z_row + cols, g.to(z_ptr.dtype.element_ty), mask=mask)

    return ce_dz_kernel


def triton_ce_dz(z: torch.Tensor, target: torch.Tensor, nll: torch.Tensor) -> None:
    """The ce_dz primitive in Triton: nll [m] (fp32), and z [m, V] (bf16) overwritten with dZ."""
    if not z.is_contiguous():
        raise ValueError("triton_ce_dz: the logits must be contiguous")
    _triton_ce_dz_kernel()[(z.shape[0],)](z, target, nll, z.shape[1], z.stride(0), IGNORE_INDEX,
                                          BLOCK=TRITON_CE_BLOCK, num_warps=16)


def liger_primitives(ce: str = "liger") -> Primitives:
    """Liger-Kernel's SM90 CuTe DSL kernels (import errors propagate: the caller probes them with
    import_problem, which imports the same modules); `ce="triton"`: triton_ce_dz for the CE pass."""
    if ce not in CE_IMPLS:
        raise ValueError(f"liger-sm90: unknown CE pass {ce!r} ({', '.join(CE_IMPLS)})")
    import cuda.bindings.driver as cuda
    from liger_kernel.ops.cutedsl.ops._fused_linear_cross_entropy_backward_sm90 import flce_dw, flce_dx
    from liger_kernel.ops.cutedsl.ops._fused_linear_cross_entropy_forward_sm90 import (
        cross_entropy_dz,
        tile_gemm,
    )
    from liger_kernel.ops.cutedsl.ops.utils import ensure_cuda_context

    def stream(t: torch.Tensor):
        return cuda.CUstream(torch.cuda.current_stream(t.device).cuda_stream)

    def logits(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        with torch.cuda.device(x.device):
            ensure_cuda_context()
            tile_gemm(x, w, out, a_leading=1, b_leading=1, stream=stream(x))

    def ce_dz(z: torch.Tensor, target: torch.Tensor, nll: torch.Tensor) -> None:
        with torch.cuda.device(z.device):
            cross_entropy_dz(z, target, nll, 1.0, IGNORE_INDEX, stream(z))

    def dw(dz: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # a (unit) output scale selects Liger's clustered persistent dW GEMM, its fastest
        return flce_dw(dz, x, out_dtype=torch.bfloat16, output_scale=torch.ones((), device=dz.device))

    return Primitives(logits=logits, ce_dz=triton_ce_dz if ce == "triton" else ce_dz,
                      dx=lambda dz, w: flce_dx(dz, w, out_dtype=torch.bfloat16), dw=dw)


def torch_primitives() -> Primitives:
    """The same contract in torch, as the kernel rounds: bf16 logits, softmax and nll in fp32, dZ
    rounded to bf16, fp32-accumulated GEMMs with bf16 results. The CPU tests' stand-in."""

    def logits(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(F.linear(x.float(), w.float()))

    def ce_dz(z: torch.Tensor, target: torch.Tensor, nll: torch.Tensor) -> None:
        zf = z.float()
        valid = target != IGNORE_INDEX
        safe = torch.where(valid, target, 0)
        lse = torch.logsumexp(zf, dim=-1)
        nll.copy_(torch.where(valid, lse - zf.gather(1, safe[:, None])[:, 0], 0.0))
        dz = torch.softmax(zf, dim=-1)
        dz.scatter_add_(1, safe[:, None], -torch.ones_like(dz[:, :1]))
        z.copy_(dz * valid[:, None])

    return Primitives(logits=logits, ce_dz=ce_dz,
                      dx=lambda dz, w: (dz.float() @ w.float()).to(torch.bfloat16),
                      dw=lambda dz, x: (dz.float().t() @ x.float()).to(torch.bfloat16))


def shape_problem(hidden: int, vocab: int) -> str | None:
    """Why the kernel cannot take this lm_head shape, or None."""
    bad = [f"{name} {n} is not a multiple of {VOCAB_TILE}" for name, n in (("vocab", vocab), ("hidden size", hidden))
           if n % VOCAB_TILE]
    return "; ".join(bad) or None


class _ChunkedFusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor, prims: Primitives,
                chunk_rows: int) -> torch.Tensor:
        n = e.shape[0]
        pad = (-n) % ROW_TILE
        if pad:  # ignored rows: nll 0 and a zero dZ row
            e = F.pad(e, (0, 0, 0, pad))
            targets = F.pad(targets, (0, pad), value=IGNORE_INDEX)
        targets = targets.long().contiguous()
        rows, vocab = e.shape[0], c.shape[0]
        want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nll = torch.empty(rows, device=e.device, dtype=torch.float32)
        dx = torch.empty_like(e) if want_dx else None
        dw = None  # fp32 sum of the chunks' bf16 dW (the first chunk's is taken as it is)
        step = max(ROW_TILE, chunk_rows // ROW_TILE * ROW_TILE)
        for lo in range(0, rows, step):
            x = e[lo:lo + step]
            z = torch.empty(x.shape[0], vocab, device=e.device, dtype=torch.bfloat16)
            prims.logits(x, c, z)
            prims.ce_dz(z, targets[lo:lo + step], nll[lo:lo + step])
            if dx is not None:
                dx[lo:lo + step] = prims.dx(z, c)
            if want_dw:
                part = prims.dw(z, x)
                dw = part.float() if dw is None else dw.add_(part)
            del z
        ctx.c_dtype = c.dtype
        ctx.save_for_backward(dx[:n] if dx is not None else None, dw, targets[:n] != IGNORE_INDEX)
        return nll[:n]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dx, dw, valid = ctx.saved_tensors
        grad = grad.float()
        weight = valid.to(grad.dtype)
        scale = (grad * weight).sum() / weight.sum().clamp(min=1)
        # dW was summed over rows in the forward: exact only for one gradient shared by every row
        # that has a target (see the module docstring); fail rather than train on a wrong dW
        spread = ((grad - scale).abs() * weight).max() if grad.numel() else grad.new_zeros(())
        torch._assert_async(spread <= 1e-6 * scale.abs() + 1e-30,
                            "liger-sm90: the per-token loss weights differ between rows (only sum/mean losses)")
        grad_e = (dx.float() * grad[:, None]).to(dx.dtype) if dx is not None else None
        grad_c = (dw * scale).to(ctx.c_dtype) if dw is not None else None
        return grad_e, grad_c, None, None, None


def linear_cross_entropy(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                         prims: Primitives | None = None, chunk_rows: int = CHUNK_ROWS, ce: str = "liger") -> torch.Tensor:
    """Per-row loss [N] in fp32 (0 at IGNORE_INDEX) of e [N, D] against classifier c [V, D], both
    bf16; its gradients are valid for losses whose per-row weights are all equal (sum, mean).
    `ce`: the CE pass of liger_primitives when `prims` is not given (CE_IMPLS)."""
    problem = shape_problem(e.shape[1], c.shape[0])
    if problem:
        raise ValueError(f"liger-sm90: {problem}")
    return _ChunkedFusedLinearCE.apply(e.contiguous(), c.contiguous(), targets, prims or liger_primitives(ce),
                                       chunk_rows)
