"""Regional torch.compile of the Qwen3.5 decoder layers: everything but the token-mixer kernels.

Why regions and not the whole model: the GDN kernels (fla's Triton/tilelang recurrence, the
causal conv) and the varlen attention take per-batch document boundaries (``cu_seqlens`` of a
length that changes every batch, ``max_seqlen`` as a Python int); inside a compiled graph those
would recompile or break the graph every step. What is left between the kernels is where the
step was launch-bound on the H200 (bench/RESULTS.md: ~1,000 ``aten::mul`` and ~1,000 ``copy_``
kernels a step): RMSNorms, gates, rotary, the MLP, the GDN gated norm. Those regions see only
tensors of the batch's fixed shape ``[B, T, ...]``, so they compile once and never recompile.

Regions, per decoder layer (each a compiled *function* taking the module, so the 24 layers of a
shape share one graph instead of compiling 24 times):

* ``input_layernorm``
* the token mixer's surroundings: full attention's projections, q/k norms and rotary (``pre``),
  and its output gate and o_proj (``post``), around the attention kernel; the GDN layer's
  projections and gates (``_in_proj``), and its gated RMSNorm and out_proj (``_out``), around the
  conv and recurrence kernels
* the residual add, ``post_attention_layernorm``, the MLP and its residual add, as one region
* the final norm of the model

The compiled functions re-state transformers' ``Qwen3_5DecoderLayer``/``Qwen3_5Attention``
forwards (the same ops in the same order); tests/test_regional_compile.py checks logits and
gradients against the stock modules.

Compile caches: inductor writes under ``TORCHINDUCTOR_CACHE_DIR``; when only
``TRITON_CACHE_DIR`` is set (the node-local cache), :func:`configure_cache_dir` puts the inductor
cache beside it, so a warm node starts in seconds.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

COMPILE_CHOICES = ("auto", "on", "off")


def compile_enabled(requested: str, device: torch.device) -> bool:
    """``auto``: on for CUDA, off on the CPU (the tiny demo must not pay a compile)."""
    if requested not in COMPILE_CHOICES:
        raise ValueError(f"unknown compile mode {requested!r} ({', '.join(COMPILE_CHOICES)})")
    return requested == "on" or (requested == "auto" and device.type == "cuda")


def configure_cache_dir(env: dict[str, str] | None = None) -> str | None:
    """Put inductor's cache beside Triton's node-local one unless TORCHINDUCTOR_CACHE_DIR is set."""
    env = os.environ if env is None else env
    if not env.get("TORCHINDUCTOR_CACHE_DIR") and env.get("TRITON_CACHE_DIR"):
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(env["TRITON_CACHE_DIR"]).parent / "torchinductor")
    return env.get("TORCHINDUCTOR_CACHE_DIR")


# ----------------------------------------------------------------------------- the regions


def _norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(norm).forward(norm, x)


def _mlp_block(layer: torch.nn.Module, residual: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
    hidden = residual + mixed
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _attention_pre(attn: torch.nn.Module, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, attn.head_dim)
    query, gate = torch.chunk(attn.q_proj(hidden_states).view(*input_shape, -1, attn.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(*input_shape, -1)
    query = attn.q_norm(query.view(hidden_shape)).transpose(1, 2)
    key = attn.k_norm(attn.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value = attn.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    return query, key, value, gate


def _attention_post(attn: torch.nn.Module, attn_output: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    attn_output = attn_output.reshape(*gate.shape[:-1], -1)
    return attn.o_proj(attn_output * torch.sigmoid(gate))


def _gdn_in_proj(gdn: torch.nn.Module, hidden_states: torch.Tensor):
    return type(gdn)._in_proj(gdn, hidden_states)


def _gdn_out(gdn: torch.nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return type(gdn)._out(gdn, core, z)


# ----------------------------------------------------------------------------- eager glue


def _with_cache(kwargs: dict[str, Any]) -> bool:
    """A KV cache came along (generation): transformers' own forward then. It is ``cache`` in
    transformers 5.24, ``past_key_values`` in 5.23; both are dropped when None."""
    cached = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
    if not cached:
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
    return cached


def _attention_forward(attn: torch.nn.Module, regions: dict[str, Any], hidden_states: torch.Tensor,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor | None,
                       **kwargs: Any):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3_5.modeling_qwen3_5 import eager_attention_forward

    if _with_cache(kwargs):
        return type(attn).forward(attn, hidden_states, position_embeddings, attention_mask, **kwargs)
    cos, sin = position_embeddings
    query, key, value, gate = regions["attn_pre"](attn, hidden_states, cos, sin)
    impl = attn.config._attn_implementation
    interface = eager_attention_forward if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]
    out, weights = interface(attn, query, key, value, attention_mask,
                             dropout=0.0 if not attn.training else attn.attention_dropout, scaling=attn.scaling,
                             **kwargs)
    return regions["attn_post"](attn, out, gate), weights


def _decoder_forward(layer: torch.nn.Module, regions: dict[str, Any], hidden_states: torch.Tensor,
                     position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    if _with_cache(kwargs):
        return type(layer).forward(layer, hidden_states, position_embeddings, attention_mask, position_ids, **kwargs)
    residual = hidden_states
    hidden_states = regions["norm"](layer.input_layernorm, hidden_states)
    if layer.block_type == "linear_attention":
        mixed = layer.linear_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
    else:
        mixed, _ = layer.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                   position_ids=position_ids, position_embeddings=position_embeddings, **kwargs)
    return regions["mlp_block"](layer, residual, mixed)


def apply_regional_compile(model: torch.nn.Module, backend: str = "inductor", dynamic: bool | None = False,
                           **compile_kwargs: Any) -> int:
    """Compile the regions of every Qwen3.5 decoder layer of ``model`` (a causal LM, or its base
    text model as extraction holds it) in place; returns the layer count. ``dynamic``: False for
    stage-1's fixed [B, T] rows; True where the token count changes every batch (extraction's
    packed stream), one graph per region for all of them.

    Call after :func:`train.common.fastpath.install_kernels` (the GDN regions are those of
    :class:`~train.common.packed_gdn.PackedGatedDeltaNet`; a stock GDN layer keeps its forward).
    Parameters and state_dict are untouched: only instance ``forward`` attributes are set.
    """
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    from train.common.packed_gdn import PackedGatedDeltaNet

    def compiled(fn):
        return torch.compile(fn, backend=backend, dynamic=dynamic, **compile_kwargs)

    regions = {name: compiled(fn) for name, fn in (
        ("norm", _norm), ("mlp_block", _mlp_block), ("attn_pre", _attention_pre), ("attn_post", _attention_post),
        ("gdn_in", _gdn_in_proj), ("gdn_out", _gdn_out))}
    layers = [m for m in model.modules() if isinstance(m, Qwen3_5DecoderLayer)]
    if not layers:
        raise ValueError("apply_regional_compile: the model has no Qwen3.5 decoder layers")
    for layer in layers:
        layer.forward = functools.partial(_decoder_forward, layer, regions)
        if layer.block_type == "linear_attention":
            gdn = layer.linear_attn
            if isinstance(gdn, PackedGatedDeltaNet):
                gdn._in_proj = functools.partial(regions["gdn_in"], gdn)
                gdn._out = functools.partial(regions["gdn_out"], gdn)
        else:
            layer.self_attn.forward = functools.partial(_attention_forward, layer.self_attn, regions)
    text = getattr(model, "model", model)  # a causal LM's base model, or the base model itself
    text = text.language_model if hasattr(text, "language_model") else text
    final_norm = text.norm
    final_norm.forward = functools.partial(regions["norm"], final_norm)
    return len(layers)


# ----------------------------------------------------------------------------- the vision tower


def _vision_pre(block: torch.nn.Module, hidden_states: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb_vision

    attn = block.attn
    seq = hidden_states.shape[0]
    q, k, v = attn.qkv(block.norm1(hidden_states)).reshape(seq, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    return q, k, v


def _vision_post(block: torch.nn.Module, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    hidden_states = residual + block.attn.proj(attn_out)
    return hidden_states + block.mlp(block.norm2(hidden_states))


def _vision_block_forward(block: torch.nn.Module, regions: dict[str, Any], hidden_states: torch.Tensor,
                          cu_seqlens: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                          max_seqlen: int | None = None, **_: Any) -> torch.Tensor:
    """Qwen3_5VisionBlock.forward with its attention on the varlen kernel (all images, one call)."""
    from train.common.varlen_attention import varlen_attention_forward

    attn = block.attn
    _patches_dynamic(hidden_states, *position_embeddings)
    q, k, v = regions["vision_pre"](block, hidden_states, *position_embeddings)
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, N, D], as transformers passes them
    out, _ = varlen_attention_forward(attn, q, k, v, None, scaling=attn.scaling, cu_seq_lens_q=cu_seqlens,
                                      max_length_q=max_seqlen, is_causal=False)
    attn_out = out.reshape(hidden_states.shape[0], -1).contiguous()
    _patches_dynamic(attn_out)
    return regions["vision_post"](block, hidden_states, attn_out)


def _patches_dynamic(*tensors: torch.Tensor) -> None:
    """The patch dimension (dim 0: all images of the step, a total that changes every step) is the
    one symbolic size of the tower's graphs; the feature sizes stay static, so the norms' and the
    MLP's kernels are generated for their real widths. Marking it on every input also keeps
    dynamo's duck sizing from tying it to a feature width it happens to equal in the first step."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


def apply_vision_regional_compile(model: torch.nn.Module, backend: str = "inductor", **compile_kwargs: Any) -> int:
    """Compile every vision tower block around its attention (norm1, qkv, rotary | proj, residual,
    norm2, MLP, residual), with the attention on the varlen kernel; the blocks compiled (0: the
    model has no tower, or its tower is not on the varlen kernel, see
    :func:`train.common.varlen_attention.use_vision_varlen`, and keeps transformers' forward).

    The patch count (all images of a step) changes with every step's images: it alone is marked
    dynamic (:func:`_patches_dynamic`), so one graph per region serves every image set (a static
    one would recompile for every new total) while the feature widths stay static. The two
    regions are compiled functions shared by the 27 blocks, as the decoder layers' are; the first
    block's input is a view (of the patch embedding) and the others' are not, so each region has
    two graphs, both made in step 1 (tests/test_regional_compile.py: no graph after step 1 over
    image sets of varying counts and grids).
    """
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionBlock

    from train.common.varlen_attention import VISION_VARLEN_IMPL

    vision = getattr(model.config, "vision_config", None)
    if vision is None or vision._attn_implementation != VISION_VARLEN_IMPL:
        return 0
    regions = {name: torch.compile(fn, backend=backend, dynamic=None, **compile_kwargs)
               for name, fn in (("vision_pre", _vision_pre), ("vision_post", _vision_post))}
    blocks = [m for m in model.modules() if isinstance(m, Qwen3_5VisionBlock)]
    for block in blocks:
        block.forward = functools.partial(_vision_block_forward, block, regions)
    return len(blocks)


# ----------------------------------------------------------------------------- activation checkpointing


def _checkpointed(forward, *args: Any, **kwargs: Any) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpointed_layers(n_layers: int, count: int) -> list[int]:
    """Which of ``n_layers`` decoder layers recompute their activations: ``count`` of them, spread
    evenly (attention and GDN layers alike), so the memory saved is about ``count / n_layers``."""
    count = max(0, min(count, n_layers))
    return sorted({(i * n_layers) // count for i in range(count)}) if count else []


def apply_activation_checkpointing(model: torch.nn.Module, count: int) -> list[int]:
    """Per-layer activation checkpointing (non-reentrant) of ``count`` decoder layers; their indices.

    Wraps whatever ``forward`` the layer has at the time (the regional-compile one included), so
    call it after :func:`apply_regional_compile`. The backward recomputes those layers' forward.
    """
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    layers = [m for m in model.modules() if isinstance(m, Qwen3_5DecoderLayer)]
    chosen = checkpointed_layers(len(layers), count)
    for i in chosen:
        layers[i].forward = functools.partial(_checkpointed, layers[i].forward)
    return chosen
