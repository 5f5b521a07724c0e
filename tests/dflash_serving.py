"""A serving engine's view of an exported DFlash drafter, to check the export the way SGLang's
(python/sglang/srt/models/dflash.py, config via speculative/dflash_utils.py) and vLLM's
(vllm/model_executor/models/qwen3_dflash.py) loaders read it. Written independently of
train/dflash/model.py, from what those loaders do:

  - config.json: only the keys they read (hidden_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim, intermediate_size, rms_norm_eps, rope_theta or
    rope_parameters.rope_theta, num_target_layers, dflash_config.{target_layer_ids, block_size,
    mask_token_id}, block_size as a fallback);
  - model.safetensors: layers.{i}.{input_layernorm, post_attention_layernorm}.weight,
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
    layers.{i}.mlp.{gate,up,down}_proj.weight, fc.weight, hidden_norm.weight, norm.weight; the
    engines map q/k/v into one qkv and gate/up into one gate_up, so every one must be there;
  - no embedding and no lm_head: the TARGET's embed the block (its first slot the token the target
    just sampled, the rest the mask id, which must be a row of the target's embedding) and turn the
    drafter's states into tokens.

Drafting one block: the target runs the prompt; its captured layers (layer i's output is
hidden_states[i + 1], as the engines capture them) for the prompt tokens are the context, projected
by fc and hidden_norm; the block is [sampled token, mask x (K-1)] at positions n .. n+K-1; every
layer's queries are the block's, its keys and values the projected context's (positions 0..n-1)
followed by the block's own, non-causal; the final norm, then the target's lm_head, give the K-1
draft tokens. What this does not model: KV caches, tensor parallelism, verification.

Each engine's reading of the attention layout (full or sliding window, causal or not inside the
block, which target layers feed fc) is written out below from its parsing code, on the config as
transformers parses it (both engines read the AutoConfig object, not the raw JSON):
  - vLLM (qwen3_dflash.py `_resolve_layer_attention`, `_dflash_layer_causal`;
    v1/worker/gpu/spec_decode/eagle/eagle3_utils.py `get_eagle3_aux_layers_from_config`);
  - SGLang (speculative/dflash_utils.py `parse_dflash_draft_config`,
    `get_dflash_attention_sliding_window_size`; its per-layer causality as SpecForge's
    `resolve_dflash_is_causal` restates it for training).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

SLIDING = "sliding_attention"


def hf_config(export_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(export_dir), local_files_only=True)


def vllm_layer_causal(config, i: int) -> bool:
    """vLLM: top-level is_causal, else dflash_config.causal, else causal exactly on sliding layers."""
    if getattr(config, "is_causal", None) is not None:
        return bool(config.is_causal)
    override = (getattr(config, "dflash_config", None) or {}).get("causal")
    if override is not None:
        return bool(override)
    types = getattr(config, "layer_types", None)
    return bool(types) and types[i] == SLIDING


def vllm_layer_attention(config, i: int, v2_runner: bool) -> tuple[int | None, bool]:
    """vLLM: (sliding window or None, causal) of draft layer i. Mixed sliding/full layers need the
    V2 model runner (NotImplementedError otherwise); use_swa makes every layer sliding only when
    layer_types has none; the window is dflash_config.swa_window_size, else the top-level one."""
    dflash = getattr(config, "dflash_config", None) or {}
    types = getattr(config, "layer_types", None)
    use_swa = dflash.get("use_swa", False)
    any_sliding = False
    if types is not None:
        n_sliding = sum(t == SLIDING for t in types)
        any_sliding = n_sliding > 0
        if 0 < n_sliding < len(types) and not v2_runner:
            raise NotImplementedError("DFlash drafters with mixed sliding/full attention require the V2 model "
                                      "runner; relaunch with VLLM_USE_V2_MODEL_RUNNER=1.")
    sliding = use_swa if types is None or (use_swa and not any_sliding) else types[i] == SLIDING
    window = None
    if sliding:
        window = dflash.get("swa_window_size", getattr(config, "sliding_window", None))
        if window is None:
            raise ValueError("DFlash sliding attention requires a window size")
    return window, vllm_layer_causal(config, i)


def vllm_capture_layers(config) -> list[int]:
    """vLLM: the target's aux hidden-state ids (hidden_states[id], the output of layer id - 1):
    eagle_aux_hidden_state_layer_ids, else dflash_config.target_layer_ids + 1."""
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    if not ids:
        ids = [i + 1 for i in ((getattr(config, "dflash_config", None) or {}).get("target_layer_ids") or [])]
    return [int(i) for i in ids]


def sglang_window_left(config) -> int | None:
    """SGLang: None without sliding layers; else the top-level sliding_window minus one (HF windows
    count the query itself), an error if it is missing."""
    types = getattr(config, "layer_types", None)
    if types is None or SLIDING not in types:
        return None
    window = getattr(config, "sliding_window", None)
    if window is None:
        raise ValueError("DFLASH sliding_attention layers require config.sliding_window.")
    return int(window) - 1


def sglang_layer_causal(config, i: int) -> bool:
    """SGLang (models/dflash.py `_get_dflash_layer_attention_params` at 003b23d): a
    `sliding_attention` layer is AttentionType.DECODER (causal), a `full_attention` layer and a
    config without layer_types ENCODER_ONLY (bidirectional); it does not read is_causal."""
    types = getattr(config, "layer_types", None)
    return bool(types) and types[i] == SLIDING


def sglang_target_layer_ids(config, target_num_layers: int) -> list[int]:
    """SGLang: dflash_config.target_layer_ids (0-based, each in range); its hook captures layer i's
    output, hidden_states[i + 1]."""
    ids = (getattr(config, "dflash_config", None) or {}).get("target_layer_ids")
    if ids is None:
        ids = getattr(config, "target_layer_ids", None)
    ids = [int(i) for i in ids]
    if not ids or any(not 0 <= i < target_num_layers for i in ids):
        raise ValueError(f"target_layer_ids {ids} out of range for {target_num_layers} target layers")
    return ids


def layer_layouts(export_dir: Path, engine: str, target_num_layers: int) -> tuple[list[tuple[int | None, bool]],
                                                                                  list[int]]:
    """Per layer (window_left or None, causal), and the hidden_states indices fc reads, as `engine` has them."""
    config = hf_config(export_dir)
    n = int(config.num_hidden_layers)
    if engine == "vllm":
        layers = [vllm_layer_attention(config, i, v2_runner=True) for i in range(n)]
        return [(w - 1 if w is not None else None, c) for w, c in layers], vllm_capture_layers(config)
    if engine == "sglang":
        left = sglang_window_left(config)
        types = config.layer_types or []
        return ([(left if types and types[i] == SLIDING else None, sglang_layer_causal(config, i)) for i in range(n)],
                [i + 1 for i in sglang_target_layer_ids(config, target_num_layers)])
    raise ValueError(f"unknown engine {engine!r}")


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rotary(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """neox-style rotary over the whole head (the engines' default for Qwen3 drafters): x [N, h, d]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None]  # [N, d/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class ServingDrafter:
    NAMES = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
             "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
             "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
             "mlp.down_proj.weight")

    def __init__(self, export_dir: Path, target_embed: torch.Tensor, target_lm_head: torch.Tensor,
                 engine: str = "sglang") -> None:
        c = json.loads((Path(export_dir) / "config.json").read_text())
        dflash = c.get("dflash_config") or {}
        self.h, self.n_layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
        self.heads, self.kv_heads = int(c["num_attention_heads"]), int(c.get("num_key_value_heads",
                                                                             c["num_attention_heads"]))
        self.d = int(c.get("head_dim") or self.h // self.heads)
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        rope = c.get("rope_parameters") or {}
        self.theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
        self.layer_ids = [int(i) for i in dflash["target_layer_ids"]]
        self.num_target_layers = int(c.get("num_target_layers", self.n_layers))
        self.layouts, self.capture = layer_layouts(Path(export_dir), engine, self.num_target_layers)
        self.block_size = int(dflash.get("block_size", c.get("block_size", 16)))
        self.mask_id = dflash.get("mask_token_id")
        if self.mask_id is None or not 0 <= int(self.mask_id) < target_embed.shape[0]:
            raise ValueError(f"mask_token_id {self.mask_id} is not a row of the target's embedding "
                             f"({target_embed.shape[0]} rows)")
        self.mask_id = int(self.mask_id)
        w = load_file(str(Path(export_dir) / "model.safetensors"))
        want = {f"layers.{i}.{n}" for i in range(self.n_layers) for n in self.NAMES} | {
            "fc.weight", "hidden_norm.weight", "norm.weight"}
        if set(w) != want:
            raise ValueError(f"weights: missing {sorted(want - set(w))[:3]}, unexpected {sorted(set(w) - want)[:3]}")
        if tuple(w["fc.weight"].shape) != (self.h, len(self.layer_ids) * self.h):
            raise ValueError(f"fc.weight {tuple(w['fc.weight'].shape)} does not fit {len(self.layer_ids)} target layers")
        self.w = {k: v.float() for k, v in w.items()}
        self.embed, self.lm_head = target_embed.float(), target_lm_head.float()

    def context(self, target_hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """[n, len(layers) * h]: the captured layers of one sequence (batch 1) as the engines take them."""
        return torch.cat([target_hidden_states[i][0] for i in self.capture], dim=-1).float()

    def block_states(self, ctx_feats: torch.Tensor, anchor_token: int) -> torch.Tensor:
        """The drafter's final states [K, h] of the block after the n context tokens."""
        n, k = ctx_feats.shape[0], self.block_size
        w = self.w
        ctx = rms(ctx_feats @ w["fc.weight"].T, w["hidden_norm.weight"], self.eps)  # [n, h]
        x = self.embed[torch.tensor([anchor_token] + [self.mask_id] * (k - 1))]  # [K, h]
        pos_ctx, pos_blk = torch.arange(n), torch.arange(n, n + k)
        pos_keys = torch.cat([pos_ctx, pos_blk])
        for i in range(self.n_layers):
            window_left, causal = self.layouts[i]
            allowed = torch.ones(k, n + k, dtype=torch.bool)  # [query, key] by position
            if causal:
                allowed &= pos_keys[None] <= pos_blk[:, None]
            if window_left is not None:
                allowed &= pos_keys[None] >= pos_blk[:, None] - window_left
            p = f"layers.{i}."
            y = rms(x, w[p + "input_layernorm.weight"], self.eps)

            def proj(inp, name, heads, norm=None, p=p):
                out = (inp @ w[p + f"self_attn.{name}_proj.weight"].T).view(inp.shape[0], heads, self.d)
                return rms(out, w[p + f"self_attn.{norm}_norm.weight"], self.eps) if norm else out

            q = rotary(proj(y, "q", self.heads, "q"), pos_blk, self.theta)
            keys = torch.cat([rotary(proj(ctx, "k", self.kv_heads, "k"), pos_ctx, self.theta),
                              rotary(proj(y, "k", self.kv_heads, "k"), pos_blk, self.theta)])
            vals = torch.cat([proj(ctx, "v", self.kv_heads), proj(y, "v", self.kv_heads)])
            rep = self.heads // self.kv_heads
            keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
            att = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
                                                 attn_mask=allowed)
            x = x + att.transpose(0, 1).reshape(k, -1) @ w[p + "self_attn.o_proj.weight"].T
            y = rms(x, w[p + "post_attention_layernorm.weight"], self.eps)
            x = x + (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) @ \
                w[p + "mlp.down_proj.weight"].T
        return rms(x, w["norm.weight"], self.eps)

    def draft(self, ctx_feats: torch.Tensor, anchor_token: int) -> list[int]:
        """The K-1 draft tokens after `anchor_token` (greedy through the target's lm_head)."""
        states = self.block_states(ctx_feats, anchor_token)
        return (states[1:] @ self.lm_head.T).argmax(-1).tolist()
