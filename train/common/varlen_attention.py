"""Varlen attention for the full-attention layers: each document attends to itself, no dense mask.

With sdpa, transformers turns the per-document ``position_ids`` into a dense block-diagonal mask
of ``[B, 1, T, T]`` and sdpa computes (and masks away) every cross-document score: with rows of
8192 tokens that is the whole T x T matrix per row, and with the flat layout (one stream of
B*T tokens) it would be (B*T)^2. Here the layer instead gets the documents' boundaries
(``cu_seq_lens_q``, over the batch flattened to one stream, see
:func:`train.common.packing.collate`) and runs attention per document.

Kernels, chosen by :func:`select_attention`:

* ``torch-varlen``: ``torch.nn.attention.varlen.varlen_attn`` (flash-attention kernels built
  into PyTorch >= 2.10, CUDA, bf16/fp16). No extra wheel.
* ``sdpa-per-doc``: ``scaled_dot_product_attention(is_causal=True)`` on each document in turn.
  Exact, any device; the CPU path, and the CUDA fallback when torch has no varlen kernel or its
  kernel fails the first-use check (:func:`check_torch_varlen`: forward and backward of a small
  packed bf16 input against sdpa per document); the log header then says which, and why.

Registered with transformers' ``AttentionInterface`` under :data:`VARLEN_IMPL`, and NOT with
its mask interface, so transformers builds no mask at all for it (the layer needs none).
flash-attn-4's CuTe kernels would be a third choice; their CUDA 13 library wheel
(nvidia-cutlass-dsl-libs-cu13) is 92 MB, which is why the built-in kernel comes first.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

VARLEN_IMPL = "packed_varlen"
# The vision tower's: transformers' Qwen3.5 vision attention passes cu_seqlens (one call over all
# of a step's images) only to an implementation whose name says "flash"; any other (sdpa) splits
# q/k/v per image, with a device-to-host `lengths.tolist()` in each of its 27 blocks, and runs
# attention once per image per block. This name takes the varlen branch with our kernels.
VISION_VARLEN_IMPL = "packed_varlen_flash_vision"
ATTENTION_CHOICES = ("auto", "sdpa", "varlen")


_TORCH_VARLEN_PROBLEM: dict[str, str | None] = {}  # device -> why torch's kernel is not used (None: used)


def _torch_varlen() -> Callable[..., torch.Tensor] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _problem_key(device: torch.device | str, head_dim: int) -> str:
    return str(device) if head_dim == 256 else f"{device}:{head_dim}"


def check_torch_varlen(device: torch.device, tolerance: float = 5e-2, head_dim: int = 256) -> str | None:
    """Why torch's varlen kernel cannot serve on ``device`` (None when it can). Runs once per device
    and head dim: 3 documents, 8 query heads on 2 kv heads of ``head_dim`` (256: the Qwen3.5 text
    attention; the vision tower's is 72), fwd + bwd in bf16, causal and not."""
    key = _problem_key(device, head_dim)
    if key in _TORCH_VARLEN_PROBLEM:
        return _TORCH_VARLEN_PROBLEM[key]
    if _torch_varlen() is None:
        problem: str | None = "torch has no torch.nn.attention.varlen"
    else:
        try:
            g = torch.Generator().manual_seed(0)
            cu = torch.tensor([0, 37, 101, 200], dtype=torch.int32, device=device)
            q, k, v = (torch.randn(200, h, head_dim, generator=g).to(device, torch.bfloat16).requires_grad_()
                       for h in (8, 2, 2))
            errors = []
            for causal in (True, False):  # the text layers' and the vision tower's
                got = torch_varlen(q, k, v, cu, 99, None, causal)
                got_grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
                want = sdpa_per_document(q, k, v, cu, None, causal)
                want_grads = torch.autograd.grad(want.float().square().sum(), (q, k, v))
                errors += [float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
                           for a, b in zip((got, *got_grads), (want, *want_grads), strict=True)]
            problem = None if max(errors) <= tolerance else f"disagrees with sdpa per document ({max(errors):.3g})"
        except Exception as exc:  # the kernel's own refusal (arch, head dim, dtype) is the reason to report
            problem = f"{type(exc).__name__}: {str(exc)[:200]}"
    _TORCH_VARLEN_PROBLEM[key] = problem
    return problem


def _row_bounds(batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device)


def sdpa_per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      scale: float | None, causal: bool = True) -> torch.Tensor:
    """q [N, H, D], k/v [N, H_kv, D] (N tokens of the flattened batch) -> [N, H, D], per document
    (causal, or every token of a document attending to all of it: an image in the vision tower)."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    n_rep = q.shape[1] // k.shape[1]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b <= a:
            continue
        qd, kd, vd = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, L, D]
        if n_rep > 1:
            kd, vd = kd.repeat_interleave(n_rep, dim=1), vd.repeat_interleave(n_rep, dim=1)
        out[a:b] = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale)[0].transpose(0, 1)
    return out


def torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                 scale: float | None, causal: bool = True) -> torch.Tensor:
    varlen_attn = _torch_varlen()
    assert varlen_attn is not None
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, object] = {"scale": scale}
    # torch 2.10 spelled causality is_causal=True; 2.11 on take a window: (-1, 0) is causal, (-1, -1) none
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    cu = cu_seqlens.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                             is_causal: bool | None = None, **_: object) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: query [B, H, T, D] -> ([B, T, H, D], None).
    Causal unless the caller says ``is_causal=False`` (the vision tower) or the module is not."""
    causal = bool(getattr(module, "is_causal", True)) if is_causal is None else bool(is_causal)
    if dropout:
        raise ValueError("varlen attention: attention dropout is not supported")
    batch, heads, seq_len, dim = query.shape
    cu = cu_seq_lens_q if cu_seq_lens_q is not None else _row_bounds(batch, seq_len, query.device)
    cu = cu.to(query.device)
    q, k, v = (x.transpose(1, 2).reshape(batch * seq_len, x.shape[1], dim) for x in (query, key, value))
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and not _TORCH_VARLEN_PROBLEM.get(
            _problem_key(query.device, dim), "unchecked"):
        max_len = int(max_length_q) if max_length_q is not None else int((cu[1:] - cu[:-1]).max())
        out = torch_varlen(q, k, v, cu, max_len, scaling, causal)
    else:
        out = sdpa_per_document(q, k, v, cu, scaling, causal)
    return out.view(batch, seq_len, heads, dim), None


def register() -> str:
    """Register :func:`varlen_attention_forward` with transformers (idempotent); its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_IMPL, varlen_attention_forward)
    AttentionInterface.register(VISION_VARLEN_IMPL, varlen_attention_forward)
    return VARLEN_IMPL


def use_vision_varlen(model: torch.nn.Module) -> bool:
    """Point the vision tower (if the model has one) at the varlen kernel: all of a step's images
    in one attention call per block, no per-image split, no host sync per block. True if it did."""
    vision = getattr(model.config, "vision_config", None)
    if vision is None:
        return False
    register()
    vision._attn_implementation = VISION_VARLEN_IMPL
    device = next(model.parameters()).device
    if device.type == "cuda":  # decides, once, for the tower's head dim too
        check_torch_varlen(device, head_dim=int(vision.hidden_size) // int(vision.num_heads))
    return True


def describe_vision(model: torch.nn.Module) -> str:
    """The vision tower's attention line of the log header."""
    vision = model.config.vision_config
    device = next(model.parameters()).device
    head_dim = int(vision.hidden_size) // int(vision.num_heads)
    problem = check_torch_varlen(device, head_dim=head_dim) if device.type == "cuda" else "not on CUDA"
    kernel = "torch varlen_attn" if problem is None else f"sdpa per image ({problem})"
    return (f"vision attention: varlen, non-causal per image, all of a step's images in one call per block "
            f"({kernel}, head dim {head_dim})")


def select_attention(requested: str, device: torch.device) -> str:
    """``auto``: varlen on CUDA, sdpa (block-diagonal mask) on CPU; returns sdpa or varlen."""
    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"unknown attention {requested!r} ({', '.join(ATTENTION_CHOICES)})")
    if requested == "auto":
        return "varlen" if device.type == "cuda" else "sdpa"
    return requested


def describe(choice: str, device: torch.device) -> str:
    """The kernel line of the log header."""
    if choice == "sdpa":
        return "sdpa, per-document causal mask from position_ids (no KV cache, so transformers builds it)"
    if device.type == "cuda":
        problem = check_torch_varlen(device)
        if problem is None:
            return "varlen: torch.nn.attention.varlen.varlen_attn over cu_seqlens, no KV cache"
        return (f"varlen: sdpa per document (is_causal) over cu_seqlens, no KV cache; torch's varlen kernel not "
                f"used: {problem}")
    return "varlen: sdpa per document (is_causal) over cu_seqlens, no KV cache"


def use_attention(model: torch.nn.Module, choice: str) -> None:
    """Point the text model's full-attention layers at ``choice`` (sdpa | varlen)."""
    impl = register() if choice == "varlen" else "sdpa"
    device = next(model.parameters()).device
    if choice == "varlen" and device.type == "cuda":
        check_torch_varlen(device)  # decides, once, between torch's kernel and sdpa per document
    config = getattr(model.config, "text_config", model.config)
    config._attn_implementation = impl
    # A training forward never caches: with a cache transformers derives no per-document mask from
    # position_ids (every checkpoint's config says use_cache=true), and sdpa attends across documents.
    for c in {id(c): c for c in (model.config, config)}.values():
        c.use_cache = False
