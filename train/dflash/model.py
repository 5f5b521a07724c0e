"""The DFlash drafter: a small block-diffusion transformer conditioned on target hidden states.

For each anchor position `a` of a sequence the drafter gets a block of `block_size` slots: slot 0
is the anchor token (known), slots 1.. are the mask token. It predicts the tokens at a+1 ..
a+block_size-1 in ONE parallel pass. Every layer attends, from the block's slots, to
  - the target's context features at positions 0..a-1, strictly before the anchor (the captured
    layers' hidden states, concatenated and projected to the drafter's width). At inference the
    anchor is the token the target has just sampled and not yet run, so its state does not exist
    (SpecForge's mask is `kv_idx < anchor` for the same reason), and
  - the slots of its own block: all of them in a full-attention layer (bidirectional: block
    diffusion, not autoregressive); in a sliding-window layer only slots j' <= j (causal), within
    the window, because that is how SGLang and vLLM serve a sliding layer (a causal decoder layer
    with a left window; see BlockAttention).
Positions are rotary: context t at t, slot j of anchor a at a+j.

The token embedding and lm_head are the TARGET's, frozen (`TargetHead`). Logits are computed only
for the block slots, never for the whole sequence; so are the verifier (target) logits: the target's
final hidden states are gathered at the anchors' block positions first, then lm_head is applied.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

IGNORE_INDEX = -100


@dataclass
class TargetShape:
    """What the drafter takes from its target's config: width, heads, RoPE and norm settings."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768

    @classmethod
    def from_config(cls, config: Any) -> TargetShape:
        """From a transformers config (object or dict; a multimodal one's text_config)."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        text = get("text_config")
        if text is not None and text != {}:
            return cls.from_config(text)
        rope = get("rope_parameters") or get("rope_scaling") or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        heads = int(get("num_attention_heads"))
        return cls(hidden_size=int(get("hidden_size")), num_hidden_layers=int(get("num_hidden_layers")),
                   num_attention_heads=heads, num_key_value_heads=int(get("num_key_value_heads") or heads),
                   head_dim=int(get("head_dim") or int(get("hidden_size")) // heads),
                   intermediate_size=int(get("intermediate_size")), vocab_size=int(get("vocab_size")),
                   rms_norm_eps=float(get("rms_norm_eps") or 1e-6),
                   rope_theta=float(theta or get("rope_theta") or 1e6),
                   max_position_embeddings=int(get("max_position_embeddings") or 32768))


@dataclass
class DrafterConfig:
    """A Qwen3-style drafter (GQA, q/k RMSNorm, SwiGLU), shaped like its target by default."""

    hidden_size: int  # = the target's hidden size (embedding and lm_head are shared with it)
    target_layer_ids: list[int]  # captured target layers (0-based) feeding the context features
    num_target_layers: int  # the target's depth
    vocab_size: int
    num_layers: int = 5
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 128
    intermediate_size: int = 3584
    block_size: int = 16
    mask_token_id: int = -1  # a real id of the target's tokenizer (train.dflash.train.resolve_mask_token); -1: the last row
    target: str = ""  # the target it is trained for (checkpoint dir or random:<shape>), named in the export
    target_config_sha256: str = ""
    rope_theta: float = 1e6
    rms_eps: float = 1e-6
    max_position_embeddings: int = 32768
    # Per layer "full_attention" or "sliding_attention" (None: all full). A sliding layer's query at
    # position p sees keys at positions >= p - (sliding_window - 1): the HF convention (the window
    # counts the query itself), SGLang's window_left = sliding_window - 1, SpecForge's mask.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # DFlash2 (SpecForge's DFlash2DraftModel; vLLM qwen3_dflash2.py, SGLang's DFlash2 loader): a
    # grouped dynamic depthwise convolution over the block's slots around every attention and MLP
    # (`conv_kernel_size` taps, one dynamic coefficient per `conv_group_size` channels), and a
    # candidate selector of rank `selector_rank` that re-ranks the target head's top
    # `selector_top_k` tokens by the token before. 0 / 0: plain DFlash.
    conv_kernel_size: int = 0
    conv_group_size: int = 16
    selector_rank: int = 0
    selector_top_k: int = 16

    def __post_init__(self) -> None:
        if self.mask_token_id < 0:
            self.mask_token_id = self.vocab_size + self.mask_token_id
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {FULL, SLIDING}:
            raise ValueError(f"layer_types must list {FULL!r} or {SLIDING!r} for each of the {self.num_layers} "
                             f"layers, got {self.layer_types}")
        if SLIDING in self.layer_types and not (self.sliding_window and self.sliding_window >= 1):
            raise ValueError(f"sliding_attention layers need sliding_window >= 1, got {self.sliding_window}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (rotary embedding)")
        if self.block_size < 2:
            raise ValueError("block_size must be >= 2 (anchor + at least one predicted token)")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one captured target layer")
        if (self.conv_kernel_size > 0) != (self.selector_rank > 0) or min(self.conv_kernel_size,
                                                                         self.selector_rank) < 0:
            raise ValueError("DFlash2 takes both its convolution (conv_kernel_size >= 1) and its selector "
                             f"(selector_rank >= 1), got {self.conv_kernel_size} and {self.selector_rank}")
        if self.dflash2:
            if self.conv_kernel_size > self.block_size:
                raise ValueError(f"conv_kernel_size {self.conv_kernel_size} exceeds block_size {self.block_size}")
            if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
                raise ValueError(f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}")
            if not 1 <= self.selector_top_k <= self.vocab_size:
                raise ValueError(f"selector_top_k {self.selector_top_k} must lie in [1, {self.vocab_size}]")

    @property
    def dflash2(self) -> bool:
        """A DFlash2 drafter (convolutions and candidate selector), else plain DFlash."""
        return self.conv_kernel_size > 0

    @property
    def n_target_layers(self) -> int:
        return len(self.target_layer_ids)

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window, None for a full-attention layer."""
        assert self.layer_types is not None
        return self.sliding_window if self.layer_types[i] == SLIDING else None


FULL, SLIDING = "full_attention", "sliding_attention"


# Drafter shapes by name. The width (the embedding and lm_head are the target's), the MLP width,
# RoPE and norm settings and the captured layers always come from the target.
#   qwen3.5: the published Qwen3.5/3.6 DFlash drafters' layout (SpecForge configs/qwen3.*-dflash*.json):
#            5 layers, 32 query heads x 128, 8 key-value heads.
#   qwen3.6-27b: the published Qwen3.6-27B drafter (z-lab's, SpecForge configs/qwen3.6-27b-dflash.json):
#            the qwen3.5 heads, MLP 17,408, four sliding-window layers (2,048 tokens) then one full one.
#   qwen3.6-27b-dflash2: the published Qwen3.6-27B DFlash2 drafter (SpecForge
#            configs/qwen3.6-27b-dflash2.json): the qwen3.6-27b heads and MLP, all five layers
#            sliding (2,048), the DFlash2 parts below; trained with block 8 (args.DFLASH2_BLOCK).
#   target:  5 layers with the target's own full-attention head layout (this project's first preset).
#   tiny:    2 layers with a 512-wide MLP, for CPU tests.
#   dflash2: the DFlash2 parts on the layout `auto` picks for the target (qwen3.6-27b-dflash2 for a
#            Qwen3.6-27B-shaped target); resolved by drafter_config.
# The DFlash2 parts of the published config: 2-tap convolutions with a coefficient per 16 channels,
# a rank-256 selector over the head's top 16.
DFLASH2_PARTS: dict[str, Any] = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                                 "selector_top_k": 16}
DRAFTER_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5": {"num_layers": 5, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128},
    "qwen3.6-27b": {"num_layers": 5, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                    "intermediate_size": 17408, "layer_types": [SLIDING] * 4 + [FULL], "sliding_window": 2048},
    "qwen3.6-27b-dflash2": {"num_layers": 5, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                            "intermediate_size": 17408, "layer_types": [SLIDING] * 5, "sliding_window": 2048,
                            **DFLASH2_PARTS},
    "target": {"num_layers": 5},
    "tiny": {"num_layers": 2, "intermediate_size": 512},
}
DFLASH2 = "dflash2"
SMALL_TARGET = 1024  # `auto` picks `tiny` for targets narrower than this (the test-sized ones)


# The Qwen3.6-27B target's shape (hidden 5,120, 64 layers): `auto` gives it its published drafter.
QWEN36_27B = (5120, 64)


def default_drafter(target: TargetShape) -> str:
    """`--drafter auto`: the published layout for real targets (`qwen3.6-27b` for a target shaped like
    Qwen3.6-27B, else `qwen3.5`), `tiny` for test-sized ones."""
    if target.hidden_size < SMALL_TARGET:
        return "tiny"
    return "qwen3.6-27b" if (target.hidden_size, target.num_hidden_layers) == QWEN36_27B else "qwen3.5"


# The DFlash paper's slot-weight decay per block size (gamma 7 at K=16, 5 at 10, 4 at 8).
PUBLISHED_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """gamma for `--block-size` when `--gamma` is not given: the published value, else 7 scaled by K/16."""
    return PUBLISHED_GAMMA.get(block_size, round(7.0 * block_size / 16, 2))


def drafter_config(spec: str, target: TargetShape, target_layer_ids: list[int], block_size: int
                   ) -> DrafterConfig:
    """A preset name, or a JSON file of DrafterConfig fields (target-derived fields are filled in)."""
    if spec == DFLASH2:
        base = default_drafter(target)
        spec = f"{base}-{DFLASH2}" if f"{base}-{DFLASH2}" in DRAFTER_PRESETS else base
        fields: dict[str, Any] = {**DRAFTER_PRESETS[spec], **DFLASH2_PARTS}
        fields = {k: list(v) if isinstance(v, list) else v for k, v in fields.items()}
    elif spec in DRAFTER_PRESETS:
        fields = {k: list(v) if isinstance(v, list) else v for k, v in DRAFTER_PRESETS[spec].items()}
    else:
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"--drafter {spec!r}: neither a preset ({', '.join(DRAFTER_PRESETS)}, {DFLASH2}, auto) "
                             "nor a JSON file")
        try:
            fields = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"--drafter {path}: not JSON ({exc})") from None
        known = set(DrafterConfig.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"--drafter {path}: unknown field(s) {', '.join(unknown)}")
    shaped = {"num_heads": target.num_attention_heads, "num_kv_heads": target.num_key_value_heads,
              "head_dim": target.head_dim, "intermediate_size": target.intermediate_size,
              "rope_theta": target.rope_theta, "rms_eps": target.rms_norm_eps,
              "max_position_embeddings": target.max_position_embeddings, "block_size": block_size}
    return DrafterConfig(**{"hidden_size": target.hidden_size, "target_layer_ids": list(target_layer_ids),
                            "num_target_layers": target.num_hidden_layers, "vocab_size": target.vocab_size,
                            **shaped, **fields})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype) * self.weight.to(dtype)


def rope_tables(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, N, head_dim] for positions pos [B, N] (full rotary, rotate-half layout)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim)
    ang = pos.to(torch.float32)[:, None, :, None] * inv  # [B, 1, N, d/2]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DrafterAttention(nn.Module):
    """Qwen3 attention (GQA, per-head q/k RMSNorm, RoPE); keys and values cover the target
    context (projected once per layer, shared by every block) and the block's own slots."""

    def __init__(self, cfg: DrafterConfig, layer_idx: int = 0) -> None:
        super().__init__()
        h, self.heads, self.kv_heads, self.d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(h, self.heads * self.d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.d, bias=False)
        self.o_proj = nn.Linear(self.heads * self.d, h, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_eps)
        self.window = cfg.layer_window(layer_idx)

    def project(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
                rope_ctx: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """q, k_ctx, v_ctx, k_blk, v_blk: [B, heads, N, d] / [B, kv_heads, T or N, d], normed and rotated."""
        b = x.shape[0]

        def heads(proj: nn.Linear, norm: RMSNorm | None, inp: torch.Tensor, count: int) -> torch.Tensor:
            out = proj(inp).view(b, inp.shape[1], count, self.d)
            return (norm(out) if norm is not None else out).transpose(1, 2)

        q = apply_rope(heads(self.q_proj, self.q_norm, x, self.heads), *rope_q)
        k_ctx = apply_rope(heads(self.k_proj, self.k_norm, ctx, self.kv_heads), *rope_ctx)
        k_blk = apply_rope(heads(self.k_proj, self.k_norm, x, self.kv_heads), *rope_q)
        v_ctx, v_blk = heads(self.v_proj, None, ctx, self.kv_heads), heads(self.v_proj, None, x, self.kv_heads)
        return q, k_ctx, v_ctx, k_blk, v_blk

    def output(self, out: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.d))

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
                rope_ctx: tuple[torch.Tensor, torch.Tensor], attend: BlockAttention) -> torch.Tensor:
        return self.output(attend(*self.project(x, ctx, rope_q, rope_ctx), window=self.window))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedConv(nn.Module):
    """DFlash2's grouped dynamic depthwise convolution over a block's slots, around one sublayer.

    Slot j's output is sum over taps t < `taps` of c[j, t] * x[j - t], within its block only (slots
    before the block's first count as zero), where c[j, t] = base_kernel[side, t] (per channel) +
    a dynamic coefficient per group of `group` channels, projected from the sublayer's normed input
    at slot j. One projection gives the coefficients of both sides: side 0 convolves the sublayer's
    input, side 1 its output. base_kernel starts as the identity (tap 0 = 1) and the projection at
    zero, so a fresh DFlash2 layer computes what a DFlash layer does. Shapes and names are those of
    SpecForge's DFlashGroupedConv and vLLM's (base_kernel [2, taps, hidden], kernel_projection
    [2 * taps * groups, hidden], its output read as [side, tap, group]).
    """

    def __init__(self, hidden: int, block_size: int, taps: int, group: int) -> None:
        super().__init__()
        self.block_size, self.taps, self.group, self.groups = block_size, taps, group, hidden // group
        base = torch.zeros(2, taps, hidden)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        """x [B, A*K, H] (A blocks of K slots), delta [B, A*K, taps, groups] -> [B, A*K, H]."""
        b, n, h = x.shape
        k = self.block_size
        blocks = x.view(b, n // k, k, self.groups, self.group)
        coef = self.base_kernel[side].view(self.taps, self.groups, self.group).to(x.dtype) + \
            delta.view(b, n // k, k, self.taps, self.groups, 1).to(x.dtype)
        out = coef[:, :, :, 0] * blocks
        for t in range(1, self.taps):
            shifted = F.pad(blocks[:, :, : k - t], (0, 0, 0, 0, t, 0))  # slot j sees slot j - t of its block
            out = out + coef[:, :, :, t] * shifted
        return out.reshape(b, n, h)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input and the output side's coefficients."""
        coef = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.groups)
        return self.convolve(x, coef[..., 0, :, :], 0), coef[..., 1, :, :]

    def finish(self, y: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        return self.convolve(y, coef, 1)


class DrafterLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer; module names match the published DFlash checkpoints (DFlash2
    adds attention_conv and mlp_conv around the two sublayers)."""

    def __init__(self, cfg: DrafterConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = DrafterAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = DrafterMLP(cfg)
        self.attention_conv: GroupedConv | None = None
        self.mlp_conv: GroupedConv | None = None
        if cfg.dflash2:
            args = (cfg.hidden_size, cfg.block_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.attention_conv, self.mlp_conv = GroupedConv(*args), GroupedConv(*args)

        self.regions: tuple[Any, Any] | None = None  # compiled (pre, post), Drafter.compile_regions

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q, rope_ctx, attend: BlockAttention) -> torch.Tensor:
        pre, post = self.regions or (_layer_pre, _layer_post)
        qkv, coef = pre(self, x, ctx, rope_q, rope_ctx)
        out = attend(*qkv, window=self.self_attn.window)
        return post(self, x, out, coef)


# A layer's two regions around the attention kernel. torch.compile fuses what sits between the
# matmuls (RMSNorms, rotary, the SwiGLU product, residual adds), which runs as many small kernels
# in eager mode; the attention itself (flex, compiled on its own, or the dense reference) and its
# per-step mask stay outside, so the regions see plain tensors. Functions of the layer, so the
# layers of one shape share one graph.
def _layer_pre(layer: DrafterLayer, x: torch.Tensor, ctx: torch.Tensor, rope_q, rope_ctx
               ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """(q, k_ctx, v_ctx, k_blk, v_blk), and DFlash2's coefficients for the attention's output side."""
    y, coef = layer.input_layernorm(x), None
    if layer.attention_conv is not None:
        y, coef = layer.attention_conv.prepare(y)
    return layer.self_attn.project(y, ctx, rope_q, rope_ctx), coef


def _layer_post(layer: DrafterLayer, x: torch.Tensor, attn_out: torch.Tensor, coef: torch.Tensor | None
                ) -> torch.Tensor:
    out = layer.self_attn.output(attn_out)
    if layer.attention_conv is not None:
        out = layer.attention_conv.finish(out, coef)
    x = x + out
    y = layer.post_attention_layernorm(x)
    if layer.mlp_conv is None:
        return x + layer.mlp(y)
    y, coef = layer.mlp_conv.prepare(y)
    return x + layer.mlp_conv.finish(layer.mlp(y), coef)


class BlockAttention:
    """The dense reference (attn_impl "dense", the CPU's default): attention of every block's
    slots to (context t < anchor) + (its own block), all blocks of all rows in one call per layer.
    PackedBlockAttention (flex, CUDA's default) computes the same on the packed layout.

    Each query's keys are the T context positions and the K slots of its own block, never the
    other blocks': scores are [queries x (T + K)], linear in the number of anchors (a dense mask
    over all blocks would be quadratic: 512 anchors x 16 slots are 8192 queries per row). The two
    score parts share one softmax. Queries run in chunks of anchors so that no call holds more
    than `max_scores` scores.

    A full-attention layer sees its whole block (bidirectional). A sliding-window layer (`window`
    W) is causal inside the block and narrows both parts by position: slot j of anchor a sits at
    a + j and sees context t >= a + j - (W - 1) and the slots j - (W - 1) <= j' <= j of its block.
    That is the mask the engines run: SGLang makes every `sliding_attention` draft layer a causal
    DECODER layer with window_left W - 1, vLLM's FlashAttention backend gives a sliding decoder
    layer window_size (W - 1, 0), and SpecForge trains the published sliding layouts so
    (`kv_block_offset <= q_block_offset`). tests/dflash_serving.py follows the engines' code.
    """

    def __init__(self, anchors: torch.Tensor, lengths: torch.Tensor, ctx_len: int, block_size: int,
                 max_scores: int = 1 << 27, impl: str = "dense") -> None:
        self.anchors, self.lengths, self.t, self.k = anchors, lengths, ctx_len, block_size
        self.max_scores = max_scores
        if impl not in ATTN_IMPLS:
            raise ValueError(f"unknown drafter attention {impl!r} ({', '.join(ATTN_IMPLS)})")
        self.impl = impl
        # [B, A]: context t is visible to anchor a's block iff t < a (and t is a real token)
        self.ctx_end = torch.minimum(anchors, lengths.to(anchors.device)[:, None])

    def chunks(self, bsz: int, heads: int) -> list[tuple[int, int]]:
        n_anchor = self.anchors.shape[1]
        per_anchor = bsz * heads * self.k * (self.t + self.k)
        step = max(1, min(n_anchor, self.max_scores // max(1, per_anchor)))
        return [(i, min(n_anchor, i + step)) for i in range(0, n_anchor, step)]

    def see_context(self, lo: int, hi: int, window: int | None) -> torch.Tensor:
        """[B, (hi - lo) * K, T] bool: which context positions each query slot of anchors lo..hi sees."""
        bsz, k = self.anchors.shape[0], self.k
        pos = torch.arange(self.t, device=self.anchors.device)
        see = pos < self.ctx_end[:, lo:hi, None, None]  # [B, a, 1, T]
        if window is not None:
            first = self.anchors[:, lo:hi, None, None] + torch.arange(k, device=pos.device)[:, None] - (window - 1)
            see = see & (pos >= first)  # [B, a, K, T]
        return see.expand(-1, -1, k, -1).reshape(bsz, (hi - lo) * k, self.t)

    def see_block(self, window: int | None) -> torch.Tensor | None:
        """[K, K] bool: slot j sees slot j' of its block (None: all of them, a full layer). A
        sliding layer: causal, within the window."""
        if window is None:
            return None
        j = torch.arange(self.k, device=self.anchors.device)
        return (j[None, :] <= j[:, None]) & (j[None, :] >= j[:, None] - (window - 1))

    def __call__(self, q, k_ctx, v_ctx, k_blk, v_blk, window: int | None = None) -> torch.Tensor:
        """q, k_blk, v_blk [B, heads, A*K, d]; k_ctx, v_ctx [B, kv_heads, T, d] -> [B, heads, A*K, d]."""
        bsz, heads, _, d = q.shape
        groups = heads // k_ctx.shape[1]
        if groups > 1:  # GQA: each key/value head serves `groups` query heads
            k_ctx, v_ctx, k_blk, v_blk = (t.repeat_interleave(groups, dim=1) for t in (k_ctx, v_ctx, k_blk, v_blk))
        scale, k, t = d ** -0.5, self.k, self.t
        in_block = self.see_block(window)
        outs = []
        for lo, hi in self.chunks(bsz, heads):
            a = hi - lo
            qc = q[:, :, lo * k: hi * k]
            s_ctx = (qc @ k_ctx.transpose(-1, -2)) * scale  # [B, H, a*K, T]
            s_ctx = s_ctx.masked_fill(~self.see_context(lo, hi, window)[:, None], float("-inf"))
            qb = qc.view(bsz, heads, a, k, d)
            kb = k_blk[:, :, lo * k: hi * k].view(bsz, heads, a, k, d)
            vb = v_blk[:, :, lo * k: hi * k].view(bsz, heads, a, k, d)
            s_blk = (qb @ kb.transpose(-1, -2)) * scale  # [B, H, a, K, K]; see_block masks sliding layers
            if in_block is not None:
                s_blk = s_blk.masked_fill(~in_block, float("-inf"))
            probs = torch.softmax(torch.cat([s_ctx, s_blk.reshape(bsz, heads, a * k, k)], -1).float(), -1)
            probs = probs.to(q.dtype)
            out = probs[..., :t] @ v_ctx + (probs[..., t:].reshape(bsz, heads, a, k, k) @ vb).reshape(
                bsz, heads, a * k, d)
            outs.append(out)
        return torch.cat(outs, dim=2)


class PackedBlockAttention:
    """The flex path: every row's real context tokens one after another ([1, C] keys, no row
    padding) and the valid anchors' blocks one after another ([1, N*K] queries; anchor slots -1,
    which have no labels, never reach the layers), one block-sparse flex_attention call per layer.

    Keys are [context C_pad | block slots Q_pad] (both padded to the 128-token tile). Block n
    (row r, anchor a) sees the context of its row at t < min(a, length) (a sliding layer of window
    W: t >= a + j - (W - 1) for its slot j) and its own block's slots by BlockAttention.see_block's
    rule: the same mask as the dense reference, applied to the packed layout.

    The block mask is made from tile ranges, never from a per-element predicate over queries x
    keys: per 128-query tile, the context keys its slots see form one range per row (anchors are
    sorted), so its key tiles are [min start, max end) of its slots, with the tiles every slot sees
    whole marked full (flex skips the mask there), plus the tile(s) of its own blocks. That is
    O(query tiles x key tiles) tensor ops, once per step and window, shared by the layers."""

    def __init__(self, anchors: torch.Tensor, lengths: torch.Tensor, ctx_len: int, block_size: int) -> None:
        dev, k = anchors.device, block_size
        self.k, self.t, self.bsz = k, ctx_len, anchors.shape[0]
        lengths = lengths.to(dev).long().clamp(max=ctx_len)
        self.rows, self.slots = (anchors >= 0).nonzero(as_tuple=True)  # row-major: rows, then anchors in order
        a = anchors[self.rows, self.slots]
        row_start = lengths.cumsum(0) - lengths  # where each row's context begins in the packed keys
        self.tokens = (torch.arange(ctx_len, device=dev)[None] < lengths[:, None]).flatten().nonzero()[:, 0]
        self.n_ctx, self.n_blocks = int(self.tokens.numel()), int(a.numel())
        self.ctx_pad = padded_queries(max(1, self.n_ctx))
        # at least two query tiles: one tile would be a size-1 dimension of the block mask, which the
        # compiled flex specialises on (a second graph for the smallest batches)
        self.q_pad = padded_queries(max(2 * FLEX_TILE, self.n_blocks * k))
        n_blk = -(-self.q_pad // k)  # padding slots belong to padding blocks, which see no context

        def per_block(v: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(n_blk, dtype=torch.long, device=dev)
            out[: self.n_blocks] = v
            return out

        self.start = per_block(row_start[self.rows])
        self.end = per_block(row_start[self.rows] + torch.minimum(a, lengths[self.rows]))
        self.anchor = per_block(a)
        offs = torch.arange(k, device=dev)
        self.pos_q = (self.anchor[:, None] + offs).flatten()[: self.q_pad]
        self.pos_ctx = F.pad(self.tokens % ctx_len, (0, self.ctx_pad - self.n_ctx))
        self._block_masks: dict[int | None, Any] = {}

    def pack_context(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [1, C_pad, D]: the real tokens of every row, one after another."""
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.tokens)
        return F.pad(flat[None], (0, 0, 0, self.ctx_pad - self.n_ctx))  # not a view: see pack_blocks

    def pack_blocks(self, block_embeds: torch.Tensor) -> torch.Tensor:
        """[B, A, K, H] -> [1, Q_pad, H]: the valid anchors' blocks, one after another."""
        flat = block_embeds[self.rows, self.slots].reshape(1, -1, block_embeds.shape[-1])
        # a tensor of its own, not a view: the compiled regions guard on whether x has a base, and
        # the layers after the first get fresh tensors (a view here would compile the region twice)
        return F.pad(flat, (0, 0, 0, self.q_pad - flat.shape[1]))

    def unpack(self, x: torch.Tensor, bsz: int, n_anchor: int) -> torch.Tensor:
        """[1, Q_pad, H] -> [B, A, K, H]; the slots of anchors -1 are zeros (they carry no label)."""
        h = x.shape[-1]
        out = x.new_zeros(bsz, n_anchor, self.k, h)
        return out.index_put((self.rows, self.slots), x[0, : self.n_blocks * self.k].view(-1, self.k, h))

    def in_block(self, window: int | None) -> torch.Tensor:
        """[K, K] bool: slot j sees slot j' of its block, BlockAttention.see_block's rule."""
        rule = BlockAttention(self.anchor[:1, None], self.anchor.new_ones(1), 1, self.k).see_block(window)
        return torch.ones(self.k, self.k, dtype=torch.bool, device=self.anchor.device) if rule is None else rule

    def tile_ranges(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(partial, full) [query tiles, key tiles] bool: the key tiles each query tile computes
        with the mask applied, and those that all of its slots see whole (no mask)."""
        tile, k, dev = FLEX_TILE, self.k, self.anchor.device
        q = torch.arange(self.q_pad, device=dev)
        blk, j = q // k, q % k
        start, end = self.start[blk], self.end[blk]
        lo = start if window is None else torch.maximum(start, start + self.anchor[blk] + j - (window - 1))
        sees = end > lo  # padding slots and anchors without context see none
        big = self.ctx_pad + self.q_pad
        n_qt = self.q_pad // tile
        lo_any = torch.where(sees, lo, big).view(n_qt, tile).amin(1)  # the union of the tile's ranges
        hi_any = torch.where(sees, end, 0).view(n_qt, tile).amax(1)
        lo_all = torch.where(sees, lo, big).view(n_qt, tile).amax(1)  # the range every slot sees
        hi_all = torch.where(sees, end, 0).view(n_qt, tile).amin(1)
        kt = torch.arange((self.ctx_pad + self.q_pad) // tile, device=dev)[None] * tile  # key tile starts
        first = self.ctx_pad + (torch.arange(n_qt, device=dev) * tile // k) * k  # own blocks' key range
        last = self.ctx_pad + ((torch.arange(n_qt, device=dev) * tile + tile - 1) // k + 1) * k
        full = (kt >= lo_all[:, None]) & (kt + tile <= hi_all[:, None])
        ctx = (kt < hi_any[:, None]) & (kt + tile > lo_any[:, None])
        own = (kt < last[:, None]) & (kt + tile > first[:, None])
        return (ctx & ~full) | own, full

    def block_mask(self, device: torch.device, window: int | None = None):
        """flex_attention's BlockMask for layers of this window, from tile_ranges (once per step)."""
        if window not in self._block_masks:
            from torch.nn.attention.flex_attention import BlockMask

            partial, full = self.tile_ranges(window)

            def ordered(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                idx = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True)
                return m.sum(-1).to(torch.int32)[None, None], idx.to(torch.int32)[None, None]

            k, start, end, anchor, see = self.k, self.start, self.end, self.anchor, self.in_block(window)
            # tensors, not Python ints: the compiled kernel takes them as inputs, never recompiles on them
            ctx_pad = torch.tensor(self.ctx_pad, device=device)
            left = torch.tensor(1 << 40 if window is None else window - 1, device=device)

            def visible(_b, _h, q_idx, kv_idx):
                blk, j = q_idx // k, q_idx % k
                ctx_ok = (kv_idx >= start[blk]) & (kv_idx < end[blk]) & (kv_idx - start[blk] >= anchor[blk] + j - left)
                slot = (kv_idx - ctx_pad).clamp(min=0)
                blk_ok = (slot // k == blk) & see[j, slot % k]
                return torch.where(kv_idx < ctx_pad, ctx_ok, blk_ok)

            (num, idx), (full_num, full_idx) = ordered(partial), ordered(full)
            self._block_masks[window] = BlockMask.from_kv_blocks(
                num, idx, full_num, full_idx, BLOCK_SIZE=FLEX_TILE, mask_mod=visible,
                seq_lengths=(self.q_pad, self.ctx_pad + self.q_pad))
        return self._block_masks[window]

    def __call__(self, q, k_ctx, v_ctx, k_blk, v_blk, window: int | None = None) -> torch.Tensor:
        """q, k_blk, v_blk [1, heads, Q_pad, d]; k_ctx, v_ctx [1, kv_heads, C_pad, d] -> [1, heads, Q_pad, d]."""
        k = torch.cat([k_ctx, k_blk], dim=2).to(q.dtype)
        v = torch.cat([v_ctx, v_blk], dim=2).to(q.dtype)
        fn = _compiled_flex() if q.device.type == "cuda" else _eager_flex()
        return fn(q, k, v, block_mask=self.block_mask(q.device, window), scale=q.shape[-1] ** -0.5,
                  enable_gqa=q.shape[1] != k.shape[1])


ATTN_IMPLS = ("dense", "flex")
FLEX_TILE = 128


def padded_queries(n: int) -> int:
    return -(-n // FLEX_TILE) * FLEX_TILE
_FLEX: dict[str, Any] = {}  # the compiled flex_attention; "dynamic": its compile's dynamic= (compile_regions)


def _eager_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def _compiled_flex():
    """flex_attention compiled once per process (its fused kernel; eager flex is a dense reference).

    Dynamic sizes from the first call (the packed context and slots change every step): one graph
    for forward and one for backward for the whole run, whatever the batch; each new static shape
    would compile again and, past the recompile limit, dynamo would run the eager, dense flex."""
    if "cuda" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX["cuda"] = torch.compile(flex_attention, dynamic=_FLEX.get("dynamic", True))
    return _FLEX["cuda"]


# Bytes per attention score the dense path keeps for backward, per layer: the fp32 softmax output
# and its bf16 copy the value matmuls save (fp32 alone without autocast); one chunk's transients
# (scores, masked scores, the concatenation, its fp32 copy) come on top.
DENSE_SAVED_BYTES = {"bf16": 6, "fp32": 4}
DENSE_CHUNK_BYTES = 12
DENSE_HEADROOM = 0.8  # of the free memory, for the scores; the rest: weights, optimizer, MLP activations, logits


def dense_attention_bytes(cfg: DrafterConfig, token_budget: int, n_anchors: int, amp: bool, rows: int | None = None,
                          training: bool = True, max_scores: int = 1 << 27) -> int:
    """The dense path's attention memory for a batch of `token_budget` padded tokens in `rows` rows
    (None: as many as rows of K tokens): each query slot (anchors x K per row) scores T + K keys,
    so a batch has at most heads x anchors x K x (budget + rows x K) scores per layer, kept for
    backward by every layer (training) or by one (no grad)."""
    rows = token_budget // cfg.block_size if rows is None else rows
    scores = cfg.num_heads * n_anchors * cfg.block_size * (token_budget + rows * cfg.block_size)
    per_layer = scores * DENSE_SAVED_BYTES["bf16" if amp else "fp32"]
    return per_layer * (cfg.num_layers if training else 1) + max_scores * DENSE_CHUNK_BYTES


def dense_budget_refusal(cfg: DrafterConfig, token_budget: int, n_anchors: int, amp: bool, free_bytes: int,
                         rows: int | None = None) -> str | None:
    """One line refusing the dense path when its attention memory exceeds `free_bytes`, naming what
    it needs and the largest token budget that fits (at the same tokens per row); None when it fits."""
    need = dense_attention_bytes(cfg, token_budget, n_anchors, amp, rows)
    usable = int(free_bytes * DENSE_HEADROOM)
    if need <= usable:
        return None
    fixed = dense_attention_bytes(cfg, 0, n_anchors, amp, 0)
    per_token = (need - fixed) / token_budget  # rows scale with the budget
    fits = int(max(0, usable - fixed) / per_token)
    return (f"dense drafter attention at --anchors {n_anchors} and --token-budget {token_budget:,} needs "
            f"~{need / 2**30:,.0f} GiB for its scores ({cfg.num_layers} layers x {cfg.num_heads} heads x "
            f"{n_anchors} anchors x {cfg.block_size} slots per row); {free_bytes / 2**30:,.0f} GiB are free "
            f"({DENSE_HEADROOM:.0%} of it for them): "
            f"use --attn-impl flex, or --token-budget <= {fits:,}")


def default_attn_impl(device: torch.device) -> str:
    """`auto`: block-sparse flex_attention on CUDA; the dense chunked reference on the CPU."""
    return "flex" if device.type == "cuda" else "dense"


def default_loss_impl(device: torch.device) -> str:
    """`auto`: onepass on CUDA (on the H200 the 27B drafter's step at 53.5% MFU against cce's 46.3%,
    its gradient 0.29% off the fp32 logits path against cce's 1.44%: bench/RESULTS.md); the
    logits path on the CPU."""
    return "onepass" if device.type == "cuda" else "logits"


class TargetHead(nn.Module):
    """The target's frozen token embedding and lm_head (loaded from the target or its extraction)."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight.float().clone(), freeze=True)
        self.lm_head = nn.Linear(lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(lm_head_weight.float().clone(), requires_grad=False)


class CandidateSelector(nn.Module):
    """DFlash2's candidate selector: re-ranks the target head's top-k tokens of each draft slot by
    the token before it (SpecForge's CandidateSelector, vLLM's `_score_edges`).

    The score of candidate c after predecessor p at a slot with drafter state h is
    unary_logit(c) + sum_r predecessor_codebook[p, r] * hidden_projection(h)[r] * successor_codebook[c, r].
    Drafting walks the slots greedily (`greedy_path`): slot 1's predecessor is the anchor token,
    each later slot's the candidate chosen before it. successor_codebook starts at zero, so a fresh
    selector ranks by the unary logits alone (plain DFlash's argmax).
    """

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def scores(self, candidates: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor,
               predecessors: torch.Tensor) -> torch.Tensor:
        """[..., k] scores of candidates [..., k] (unary logits [..., k]) after predecessors [...]
        at slots with drafter states hidden [..., H]."""
        context = self.predecessor_codebook[predecessors] * self.hidden_projection(hidden)  # [..., r]
        successors = self.successor_codebook[candidates]  # [..., k, r]
        return unary + (successors * context.unsqueeze(-2).to(successors.dtype)).sum(-1)

    @torch.no_grad()
    def greedy_path(self, logits: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """Draft tokens [..., K-1] from the slots' unary logits [..., K-1, V] and states [..., K-1, H]
        after the anchor tokens [...]: each slot's best candidate given the one chosen before it."""
        unary, candidates = logits.float().topk(self.top_k, dim=-1)
        prev, path = anchor, []
        for j in range(candidates.shape[-2]):
            pick = self.scores(candidates[..., j, :], unary[..., j, :], hidden[..., j, :].float(), prev)
            prev = candidates[..., j, :].gather(-1, pick.argmax(-1, keepdim=True)).squeeze(-1)
            path.append(prev)
        return torch.stack(path, dim=-1)


class Drafter(nn.Module):
    """Module names match the published DFlash checkpoints (z-lab's DFlashDraftModel, SGLang's and
    vLLM's DFlash loaders): layers.*, fc, hidden_norm, norm; no embedding, no lm_head. A DFlash2
    drafter adds layers.*.{attention_conv, mlp_conv} and candidate_selector (DFlash2DraftModel)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.n_target_layers * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.candidate_selector = (CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank,
                                                     cfg.selector_top_k) if cfg.dflash2 else None)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        for m in self.modules():  # DFlash2's dynamic kernels start at zero (the identity convolution)
            if isinstance(m, GroupedConv):
                nn.init.zeros_(m.kernel_projection.weight)

    @torch.no_grad()
    def draft(self, head: TargetHead, hidden: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """The K-1 tokens the trainer's drafter proposes after each block's anchor: final states
        `hidden` [..., K, H] of blocks `blocks` [..., K] (token ids) through the target's lm_head,
        argmax (DFlash), or the selector's greedy walk over the top-k (DFlash2)."""
        logits = head.lm_head(hidden[..., 1:, :])
        if self.candidate_selector is None:
            return logits.argmax(-1)
        return self.candidate_selector.greedy_path(logits, hidden[..., 1:, :], blocks[..., 0])

    def forward(self, hidden: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor,
                lengths: torch.Tensor, max_scores: int = 1 << 27, attn_impl: str = "dense") -> torch.Tensor:
        """Drafter hidden states of the block slots: every anchor of every row in one pass.

        hidden [B, T, n_layers*H] target context; block_embeds [B, A, K, H]; anchors [B, A] (-1 =
        no anchor); lengths [B]. Returns [B, A, K, H]. The block of anchor a sees the context at
        t < a and its own K slots; blocks never see each other.
        """
        bsz, n_anchor, k, h = block_embeds.shape
        x, ctx, rope_q, rope_ctx, attend = self.prepare(hidden, block_embeds, anchors, lengths, max_scores, attn_impl)
        if self.layers[0].regions is not None and torch.is_grad_enabled() and not x.requires_grad:
            # The compiled regions guard on whether x requires grad: the first layer's x (frozen
            # embeddings) would compile each region a second time; its unused input gradient
            # costs ~1% of a step (one layer's q/k/v input GEMMs), a compile costs ~30 s cold.
            x = x.detach().requires_grad_()
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_ctx, attend)
        if isinstance(attend, PackedBlockAttention):
            return attend.unpack(self.norm(x), bsz, n_anchor)
        return self.norm(x).view(bsz, n_anchor, k, h)

    def compile_regions(self, backend: str = "inductor", dynamic: bool | None = True) -> None:
        """torch.compile each layer's regions around the attention (see _layer_pre). Batch shapes
        vary every step (the packed context and block slots of the flex path; rows, context and
        anchors of the dense one): compiled with dynamic sizes from the first step (dynamic=True),
        one graph per region for the whole run; None: torch's default (static, then one dynamic
        recompile at the second shape)."""
        regions = (torch.compile(_layer_pre, backend=backend, dynamic=dynamic),
                   torch.compile(_layer_post, backend=backend, dynamic=dynamic))
        _FLEX["dynamic"] = dynamic
        for layer in self.layers:
            layer.regions = regions

    def prepare(self, hidden: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor, lengths: torch.Tensor,
                max_scores: int = 1 << 27, attn_impl: str = "dense"):
        """What every layer takes: the block slots [B, A*K, H], the projected context, the rotary
        tables of both, and the step's attention (its masks built once, shared by the layers)."""
        bsz, n_anchor, k, h = block_embeds.shape
        t = hidden.shape[1]
        dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else \
            block_embeds.dtype
        if attn_impl == "flex":  # packed: real context tokens and valid blocks only
            attend = PackedBlockAttention(anchors, lengths, t, k)
            ctx = self.hidden_norm(self.fc(attend.pack_context(hidden)))
            rope_q = rope_tables(attend.pos_q[None], self.cfg.head_dim, self.cfg.rope_theta, dtype)
            rope_ctx = rope_tables(attend.pos_ctx[None], self.cfg.head_dim, self.cfg.rope_theta, dtype)
            return attend.pack_blocks(block_embeds), ctx, rope_q, rope_ctx, attend
        ctx = self.hidden_norm(self.fc(hidden))
        x = block_embeds.reshape(bsz, n_anchor * k, h)
        a = anchors.clamp(min=0)
        pos_q = (a[:, :, None] + torch.arange(k, device=x.device)).reshape(bsz, -1)
        pos_ctx = torch.arange(t, device=x.device).expand(bsz, t)
        rope_q = rope_tables(pos_q, self.cfg.head_dim, self.cfg.rope_theta, dtype)
        rope_ctx = rope_tables(pos_ctx, self.cfg.head_dim, self.cfg.rope_theta, dtype)
        # anchor -1 (none): a position no context precedes, so its slots see only their block
        attend = BlockAttention(torch.where(anchors >= 0, anchors, 0), lengths, t, k, max_scores, attn_impl)
        return x, ctx, rope_q, rope_ctx, attend

    @torch.no_grad()
    def match_output_scale(self, lm_head_weight: torch.Tensor) -> None:
        """Initialise the final norm so logits through the frozen head start with unit std.

        A trained target's lm_head rows have norms near 1 and this is close to a no-op; a random-init
        target (std 0.02) would otherwise give near-uniform logits that take many steps to sharpen.
        """
        logit_std = float(lm_head_weight.float().std()) * math.sqrt(self.cfg.hidden_size)
        self.norm.weight.fill_(1.0 / max(logit_std, 1e-6))

    def save(self, path: Path) -> None:
        torch.save({"config": asdict(self.cfg), "state_dict": self.state_dict()}, path)


def anchor_candidates(lengths: torch.Tensor, block_size: int, loss_mask: torch.Tensor | None, width: int
                      ) -> torch.Tensor:
    """[B, width] bool: where an anchor may go.

    SpecForge's rule: the anchor a and the token after it, a+1, are both response tokens (loss mask
    on; at inference the anchor is a token the target sampled), so the block has at least one label;
    the block may run past the end of the row, its labels there are masked (block_inputs). With the
    strict mask a context state must precede the anchor: a >= 1. A 10-token final answer with K=16
    so has 9 candidates (its last token has no next), where a full block after the anchor would
    allow none. `block_size` is kept for callers; the rule does not depend on it.
    """
    del block_size
    pos = torch.arange(width, device=lengths.device)
    ok = (pos[None] >= 1) & (pos[None] + 1 < lengths[:, None])
    if loss_mask is not None:
        on = loss_mask[:, :width].to(torch.bool)
        nxt = torch.zeros_like(on)
        nxt[:, :-1] = on[:, 1:]
        ok &= on & nxt
    return ok


def sample_anchors(lengths: torch.Tensor, n_anchors: int, block_size: int, gen: torch.Generator,
                   loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, A] sorted distinct anchor positions per row, -1 = none; A = min(n_anchors, the most
    candidates any row has): 512 anchors on a row of 300 tokens clamp to what the row offers.

    One random key per position (seeded by `gen`), invalid positions last: the first A of the
    sorted keys are a uniform draw without replacement from each row's candidates.
    """
    width = int(lengths.max()) if len(lengths) else 0
    ok = anchor_candidates(lengths, block_size, loss_mask, width)
    n = min(n_anchors, int(ok.sum(1).max()) if width else 0)
    if n <= 0:
        return torch.full((len(lengths), 0), -1, dtype=torch.long)
    keys = torch.rand(ok.shape, generator=gen).masked_fill(~ok, 2.0)
    order = keys.argsort(dim=1)[:, :n]
    picked = torch.gather(ok, 1, order)
    anchors = torch.where(picked, order, torch.full_like(order, width + 1)).sort(dim=1).values
    return anchors.masked_fill(anchors > width, -1)


def block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int,
                 loss_mask: torch.Tensor | None = None, lengths: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(block token ids [B, A, K]: anchor token then masks; labels [B, A, K-1]: the true next tokens,
    IGNORE_INDEX where there is no anchor, past the end of the row (`lengths`, else the padded
    width) or where the loss mask is off: prompts are never targets)."""
    offs = torch.arange(block_size, device=input_ids.device)
    valid = anchors >= 0
    raw = anchors.clamp(min=0)[:, :, None] + offs  # [B, A, K]
    end = lengths.to(raw.device)[:, None, None] if lengths is not None else input_ids.shape[1]
    idx = raw.clamp(max=input_ids.shape[1] - 1)
    truth = torch.gather(input_ids[:, None, :].expand(-1, anchors.shape[1], -1), 2, idx)
    blocks = torch.full_like(truth, mask_token_id)
    blocks[:, :, 0] = truth[:, :, 0]
    keep = valid[:, :, None] & (raw < end)[:, :, 1:]
    if loss_mask is not None:
        on = torch.gather(loss_mask.to(torch.bool)[:, None, :].expand(-1, anchors.shape[1], -1), 2, idx)
        keep = keep & on[:, :, 1:]
    labels = truth[:, :, 1:].masked_fill(~keep, IGNORE_INDEX)
    return blocks, labels


def gather_block_positions(final: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Target final hidden states that predict the block's tokens: positions a .. a+K-2. [B, A, K-1, H].

    Only these rows ever reach lm_head (verifier logits at the anchors, not over the sequence).
    """
    offs = torch.arange(block_size - 1, device=final.device)
    idx = (anchors.clamp(min=0)[:, :, None] + offs).clamp(max=final.shape[1] - 1)  # [B, A, K-1]
    b, a, k1 = idx.shape
    flat = torch.gather(final, 1, idx.reshape(b, a * k1, 1).expand(-1, -1, final.shape[-1]))
    return flat.view(b, a, k1, final.shape[-1])


def position_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """Loss weight of predicted slot j (1..K-1): exp(-(j-1)/gamma); early slots matter most for acceptance."""
    j = torch.arange(1, block_size, dtype=torch.float32)
    return torch.ones_like(j) if not gamma else torch.exp(-(j - 1) / gamma)


def slot_accuracies(correct: torch.Tensor, valid: torch.Tensor) -> list[float]:
    """Accuracy of each predicted slot j = 1..K-1 (NaN where no label): correct [N] over valid [B, A, K-1]."""
    hits = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    hits[valid] = correct.float()
    n = valid.sum(dim=(0, 1))
    return [float(h / c) if c else math.nan for h, c in zip(hits.sum(dim=(0, 1)).tolist(), n.tolist(), strict=True)]


def acceptance_length(acc_slot: list[float]) -> float:
    """tau: expected tokens per block, 1 (the target's own token) + sum_j prod_{i<=j} acc_i.

    A drafted token j is accepted only if slots 1..j all are; with per-slot accuracies as
    acceptance rates this is the published acceptance-length estimate.
    """
    tau, run = 1.0, 1.0
    for a in acc_slot:
        if math.isnan(a):
            break
        run *= a
        tau += run
    return tau


# The accuracy metrics (acc, acc_slot, tau, target_agree) on the fused path need each row's argmax,
# which the fused kernel does not give: a second no-grad lm_head pass, 2 x rows x vocab x hidden
# FLOPs, ~16% of the 27B drafter's step at 512 anchors over all ~55k rows. The trainer measures
# them on an evenly strided sample of the step's rows (--acc-rows, 4,096 by default; `acc_rows` in
# the record), ~1% of that step.


def metric_sample(n: int, rows: int | None, device: torch.device) -> torch.Tensor | None:
    """Indices of the labelled rows the accuracy metrics are measured on, or None for all n (rows
    None or >= n): `rows` of them evenly strided over the step's rows, which are ordered by batch
    row, anchor and slot, so every slot and every part of the batch is in the sample."""
    if rows is None or rows >= n:
        return None
    if rows < 1:
        raise ValueError(f"metric rows must be >= 1 (got {rows})")
    return torch.linspace(0, n - 1, rows, device=device).round().long()  # distinct: the stride is >= 1


def _sampled_valid(valid: torch.Tensor, pick: torch.Tensor | None) -> torch.Tensor:
    """valid [B, A, K-1] restricted to the picked rows (indices into valid's True entries)."""
    if pick is None:
        return valid
    flat = torch.zeros(int(valid.sum()), dtype=torch.bool, device=valid.device)
    flat[pick] = True
    out = torch.zeros_like(valid)
    out[valid] = flat
    return out


def _accuracy_stats(argmax: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, pick: torch.Tensor | None
                    ) -> dict[str, Any]:
    """acc, acc_slot, acc1, tau and acc_rows from the picked rows' argmax (argmax over the picked
    rows only; y over all rows)."""
    correct = argmax == (y if pick is None else y[pick])
    acc_slot = slot_accuracies(correct, _sampled_valid(valid, pick))
    return {"acc": float(correct.float().mean()), "acc_slot": acc_slot, "acc1": acc_slot[0],
            "tau": acceptance_length(acc_slot), "acc_rows": int(correct.numel())}


def _fused_loss(head: TargetHead, rows: torch.Tensor, y: torch.Tensor, w_rows: torch.Tensor, valid: torch.Tensor,
                verifier_rows: torch.Tensor | None, chunk: int, impl: str, pick: torch.Tensor | None
                ) -> tuple[torch.Tensor, dict[str, Any]]:
    """The CE through stage-1's fused linear-cross-entropy kernel (train.common.losses: no logits
    tensor in forward or backward); the accuracy's argmax is a no-grad pass in chunks over the
    picked rows (metric_sample)."""
    from train.common.losses import fused_operands, token_losses

    # token_losses predicts labels[t] from hidden[t-1]: give it each row with its label one step on.
    # It hands the kernel bf16 rows and a bf16 lm_head (the drafter's fp32 rows under autocast
    # would fail cut-cross-entropy's backward); the argmax below uses the same bf16 operands.
    ce = token_losses(rows[:, None].expand(-1, 2, -1), head.lm_head.weight,
                      torch.stack([torch.full_like(y, IGNORE_INDEX), y], 1), impl)[:, 0]
    loss = (ce * w_rows).sum() / w_rows.sum().clamp(min=1e-9)
    with torch.no_grad():
        picked, weight = fused_operands(rows.detach() if pick is None else rows.detach()[pick], head.lm_head.weight)
    return loss, {"ce": float(ce.detach().mean()), **_head_accuracy(picked, weight, y, valid, pick, verifier_rows, chunk)}


def _ce_rows(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's CE per row (fp32) and the gradient of sum_i w_i * CE_i to its logits, (softmax -
    one-hot(y)) * w, in the logits' dtype: one read of the logits for the log-sum-exp and one for
    the gradient once compiled (inductor fuses it; eager, the CPU's, runs it op by op)."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    ce = lse - lf.gather(1, y[:, None])[:, 0]
    hot = torch.arange(lf.shape[1], device=lf.device)[None] == y[:, None]
    grad = (torch.exp(lf - lse[:, None]) - hot.float()) * w[:, None]
    return ce, grad.to(logits.dtype)


_CE_ROWS: dict[str, Any] = {}


def _ce_rows_fn(device: torch.device):
    """_ce_rows compiled once per process on CUDA (dynamic rows: one graph for every chunk and
    step), eager elsewhere."""
    if device.type != "cuda":
        return _ce_rows
    if "cuda" not in _CE_ROWS:
        _CE_ROWS["cuda"] = torch.compile(_ce_rows, dynamic=True)
    return _CE_ROWS["cuda"]


class _FrozenHeadCE(torch.autograd.Function):
    """sum_i w_i * CE(rows_i @ W^T, y_i) for a FROZEN head W, in one pass: per chunk of rows the
    logits (bf16 operands, fp32 accumulation), their CE and the gradient to the rows, kept for
    backward, which only scales it. 4 x rows x vocab x hidden FLOPs (the logits, the gradient's
    matmul) where a fused kernel that keeps nothing recomputes the logits in backward (6), and no
    logits beyond one chunk. The gradient is exact for this loss only (ce is not differentiable)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, w: torch.Tensor, chunk: int):
        need_grad = ctx.needs_input_grad[0]
        fn = _ce_rows_fn(rows.device)
        with torch.autocast(rows.device.type, enabled=False):
            e = rows.detach().to(weight.dtype).contiguous()
            ce = torch.empty(len(e), dtype=torch.float32, device=e.device)
            grad = torch.empty_like(e) if need_grad else None
            # chunks of equal size (+-1), none of 1 row while there are 2: the compiled graph
            # specialises a size-1 dimension, which would compile it a second time mid-run
            n_chunks = -(-len(e) // chunk)
            bounds = [round(i * len(e) / n_chunks) for i in range(n_chunks + 1)]
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                ce_c, g_c = fn(e[lo:hi] @ weight.T, y[lo:hi], w[lo:hi])
                ce[lo:hi] = ce_c
                if grad is not None:
                    torch.mm(g_c, weight, out=grad[lo:hi])
        ctx.rows_dtype = rows.dtype
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(ce)
        return (ce * w).sum(), ce

    @staticmethod
    def backward(ctx, g_loss: torch.Tensor, _g_ce: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return (grad.to(ctx.rows_dtype) * g_loss).to(ctx.rows_dtype), None, None, None, None


def _onepass_loss(head: TargetHead, rows: torch.Tensor, y: torch.Tensor, w_rows: torch.Tensor, valid: torch.Tensor,
                  verifier_rows: torch.Tensor | None, chunk: int, pick: torch.Tensor | None
                  ) -> tuple[torch.Tensor, dict[str, Any]]:
    """--loss-impl onepass: the CE through _FrozenHeadCE (bf16 head, as the fused kernels take it);
    the accuracy metrics as on the other paths (a no-grad argmax over the picked rows)."""
    from train.common.losses import fused_operands

    e, weight = fused_operands(rows, head.lm_head.weight)  # bf16 rows and head (the head cast once)
    norm = w_rows / w_rows.sum().clamp(min=1e-9)
    loss, ce = _FrozenHeadCE.apply(e, weight, y, norm.float(), chunk)
    picked = e.detach() if pick is None else e.detach()[pick]
    return loss, {"ce": float(ce.mean()), **_head_accuracy(picked, weight, y, valid, pick, verifier_rows, chunk)}


@torch.no_grad()
def _head_accuracy(picked: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, valid: torch.Tensor,
                   pick: torch.Tensor | None, verifier_rows: torch.Tensor | None, chunk: int) -> dict[str, Any]:
    """The accuracy metrics of the fused and onepass paths: the head's argmax over the picked bf16
    rows (chunked, so no full logits exist) and, given the verifier's rows, how often they agree."""
    argmax = torch.cat([(picked[lo:lo + chunk] @ weight.T).argmax(-1) for lo in range(0, len(picked), chunk)])
    stats: dict[str, Any] = _accuracy_stats(argmax, y, valid, pick)
    if verifier_rows is not None:
        ver = verifier_rows if pick is None else verifier_rows[pick]
        agree = sum(int(((ver[lo:lo + chunk].to(weight.dtype) @ weight.T).argmax(-1)
                         == argmax[lo:lo + chunk]).sum()) for lo in range(0, len(ver), chunk))
        stats["target_agree"] = agree / len(ver)
    return stats


def block_predecessors(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """The true token before each predicted slot j = 1..K-1 (the anchor's for slot 1): [B, A, K-1],
    the predecessors DFlash2's selector is trained on (SpecForge's teacher forcing)."""
    idx = (anchors.clamp(min=0)[:, :, None] + torch.arange(block_size - 1, device=input_ids.device))
    idx = idx.clamp(max=input_ids.shape[1] - 1)
    return torch.gather(input_ids[:, None, :].expand(-1, anchors.shape[1], -1), 2, idx)


def _selector_ce(selector: CandidateSelector, logits: torch.Tensor, rows: torch.Tensor, y: torch.Tensor,
                 prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DFlash2's selector term (SpecForge's): CE over the unary top-k of each row, scored after its
    true predecessor, toward the true token; rows whose true token is not among the top-k carry
    none (a miss of the unary head, not of the selector). (ce [N], covered [N], correct [N])."""
    unary, candidates = logits.topk(selector.top_k, dim=-1)
    hit = candidates == y[:, None]
    covered = hit.any(-1)
    scores = selector.scores(candidates, unary, rows.float(), prev)
    ce = F.cross_entropy(scores, hit.long().argmax(-1), reduction="none") * covered
    correct = candidates.gather(-1, scores.detach().argmax(-1, keepdim=True)).squeeze(-1) == y
    return ce, covered, correct


def drafter_loss(head: TargetHead, drafter_hidden: torch.Tensor, labels: torch.Tensor,
                 target_final_at_blocks: torch.Tensor | None, kl_weight: float, gamma: float | None,
                 chunk_rows: int | None = None, loss_impl: str = "logits", selector: CandidateSelector | None = None,
                 predecessors: torch.Tensor | None = None, selector_alpha: float = 1.0,
                 metric_rows: int | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """Weighted CE on the true tokens (+ kl_weight * KL to the verifier) over block slots only;
    with DFlash2's `selector` (and the slots' true `predecessors` [B, A, K-1]) + selector_alpha *
    its CE over the top-k, under the same slot weights (SpecForge's objective).

    The accuracy metrics (acc, acc_slot, acc1, tau, target_agree) are measured on `metric_rows`
    evenly strided rows of the step's (metric_sample; None: all), on every path, and `acc_rows`
    says how many; ce (and kl) are over all rows.

    The rows go through lm_head in chunks of `chunk_rows` (default: 2^30 logits per chunk), each
    recomputed in backward (activation checkpointing), so 512 anchors x 15 slots x a 248k vocab
    never exist as one logits tensor (that would be ~90 GB on the bench's qwen35-0.8b batches).
    """
    pred = drafter_hidden[:, :, 1:]  # slots that predict a token
    valid = labels != IGNORE_INDEX
    rows = pred[valid]  # [N, H]: only anchor-block rows reach lm_head
    y = labels[valid]
    w = position_weights(drafter_hidden.shape[2], gamma).to(rows.device)
    w_rows = w.expand_as(labels)[valid]
    verifier_rows = target_final_at_blocks[valid] if target_final_at_blocks is not None else None
    prev_rows = predecessors[valid] if selector is not None and predecessors is not None else None
    if selector is not None and prev_rows is None:
        raise ValueError("a DFlash2 drafter's loss needs the slots' predecessors")
    vocab = head.lm_head.weight.shape[0]
    chunk = chunk_rows or max(256, (1 << 30) // vocab)
    use_kl = kl_weight > 0 and verifier_rows is not None
    # DFlash2's selector takes the top-k of the logits: the chunked logits path
    pick = metric_sample(len(rows), metric_rows, rows.device)
    if loss_impl == "onepass" and not use_kl and selector is None and len(rows):
        return _onepass_loss(head, rows, y, w_rows, valid, verifier_rows, chunk, pick)
    if loss_impl not in ("logits", "onepass") and not use_kl and selector is None and len(rows):
        return _fused_loss(head, rows, y, w_rows, valid, verifier_rows, chunk, loss_impl, pick)

    def piece(r: torch.Tensor, yc: torch.Tensor, wc: torch.Tensor, vc: torch.Tensor | None, pc: torch.Tensor | None):
        logits = head.lm_head(r).float()
        ce = F.cross_entropy(logits, yc, reduction="none")
        total = (ce * wc).sum()
        kl = torch.zeros_like(ce)
        if vc is not None:
            with torch.no_grad():
                ref = F.log_softmax(head.lm_head(vc.to(r.dtype)).float(), -1)
            kl = F.kl_div(F.log_softmax(logits, -1), ref, log_target=True, reduction="none").sum(-1)
            total = total + kl_weight * (kl * wc).sum()
        sel = torch.zeros(3, len(yc), device=r.device)
        if pc is not None:
            sel_ce, covered, correct = _selector_ce(selector, logits, r, yc, pc)
            total = total + selector_alpha * (sel_ce * wc).sum()
            sel = torch.stack([sel_ce.detach(), covered.float(), correct.float()])
        return total, ce.detach(), kl.detach(), logits.detach().argmax(-1), sel

    totals, ces, kls, preds, sels = [], [], [], [], []
    for lo in range(0, len(rows), chunk):
        sl = slice(lo, lo + chunk)
        args = (rows[sl], y[sl], w_rows[sl], verifier_rows[sl] if use_kl else None,
                prev_rows[sl] if prev_rows is not None else None)
        out = (torch.utils.checkpoint.checkpoint(piece, *args, use_reentrant=False)
               if len(rows) > chunk and torch.is_grad_enabled() else piece(*args))
        for acc, v in zip((totals, ces, kls, preds, sels), out, strict=True):
            acc.append(v)
    if not totals:
        zero = drafter_hidden.sum() * 0.0
        return zero, {"ce": math.nan, "acc": math.nan, "acc_slot": [math.nan] * labels.shape[2], "tau": 1.0,
                      "acc_rows": 0}
    loss = torch.stack(totals).sum() / w_rows.sum().clamp(min=1e-9)
    ce, argmax = torch.cat(ces), torch.cat(preds)
    if pick is not None:  # the same rows as the fused path's (here every row's argmax came free)
        argmax = argmax[pick]
    stats: dict[str, Any] = {"ce": float(ce.mean()), **_accuracy_stats(argmax, y, valid, pick)}
    if verifier_rows is not None:
        ver = verifier_rows if pick is None else verifier_rows[pick]
        with torch.no_grad():
            agree = sum(int((head.lm_head(ver[lo:lo + chunk].to(rows.dtype)).argmax(-1)
                             == argmax[lo:lo + chunk]).sum()) for lo in range(0, len(ver), chunk))
        stats["target_agree"] = agree / len(ver)
        if use_kl:
            stats["kl"] = float(torch.cat(kls).mean())
    if prev_rows is not None:
        sel_ce, covered, correct = torch.cat(sels, dim=1)
        n_cov = float(covered.sum())
        # teacher-forced: the selector's CE and accuracy on the rows whose true token is in the top-k
        stats["selector_ce"] = float(sel_ce.sum()) / n_cov if n_cov else math.nan
        stats["selector_acc"] = float((correct * covered).sum()) / n_cov if n_cov else math.nan
        stats["topk_recall"] = n_cov / len(rows)
    return loss, stats
