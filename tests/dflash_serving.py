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
followed by the block's own, masked as the engine's attention call masks them; the final norm, then the target's lm_head, give the K-1
draft tokens. What this does not model: KV caches, tensor parallelism, verification.

DFlash2 (architectures ["DFlash2DraftModel"]) as vLLM's qwen3_dflash2.py and its DFlash2Speculator
(v1/worker/gpu/spec_decode/dflash2/speculator.py, both at 030da62) run it: dflash_config's
conv_kernel_size, conv_group_size, selector_rank, selector_top_k (required), output_multiplier,
final_logit_softcapping, input_embedding_scale (optional); around every attention and MLP the
grouped convolution over the request's query tokens (`_grouped_conv`: a tap reaches back only within
the 1 + num_speculative_tokens tokens of the block, by position); the drafts: the target head's
top-k of each slot (`compute_candidates`), the K x K transition scores from the previous slot's
candidates (`_score_edges`, the anchor token before slot 1), walked greedily at temperature 0
(`_selector_walk_kernel`: start at candidate 0, take the best successor of the one taken, the lowest
index on ties).

Each engine's reading of the attention layout (which target hidden states feed fc; per layer, the
flash-attn call it makes: `causal` and `window_size` (left, right), -1 = unbounded) comes from its
own code, on the config as transformers parses it (both engines read the AutoConfig object):
  - SGLang: its released code, executed (tests/engine_code.py: `_get_dflash_layer_attention_params`,
    the FlashAttention backend's `causal`/`window_size` statements, `parse_dflash_draft_config`,
    `set_dflash_layers_to_capture`);
  - vLLM: followed at commit 036a00d (vllm/model_executor/models/qwen3_dflash.py) and its
    FlashAttention backend at 5704f34 (vllm/v1/attention/backends/flash_attn.py), the lines quoted
    at each function below: its release cannot be had small (tests/README.md).
The mask a flash-attn call runs is flash-attn's documented one: the queries are the LAST K
positions of the keys; a query at position q sees a key at k iff k <= q when causal, and
q - left <= k <= q + right for each bound that is not -1 (`flash_mask`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

SLIDING = "sliding_attention"
VLLM_COMMIT = "036a00d1f5d00d449d02dce9babdd15a5b4d06c9"  # qwen3_dflash.py
VLLM_FA_COMMIT = "5704f34f361c6c59a9c092c4e1e96730cc6dc14d"  # v1/attention/backends/flash_attn.py

Layout = tuple[bool, tuple[int, int]]  # (causal, window_size) of one draft layer's flash-attn call


def hf_config(export_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(export_dir), local_files_only=True)


def vllm_layer_causal(config, i: int) -> bool:
    """qwen3_dflash.py@036a00d:58-67 `_dflash_layer_causal`:
        is_causal = getattr(config, "is_causal", None)
        if is_causal is not None: return bool(is_causal)
        override = (getattr(config, "dflash_config", None) or {}).get("causal")
        if override is not None: return bool(override)
        layer_types = getattr(config, "layer_types", None)
        return bool(layer_types) and layer_types[layer_idx] == _SLIDING_ATTENTION
    """
    if getattr(config, "is_causal", None) is not None:
        return bool(config.is_causal)
    override = (getattr(config, "dflash_config", None) or {}).get("causal")
    if override is not None:
        return bool(override)
    types = getattr(config, "layer_types", None)
    return bool(types) and types[i] == SLIDING


def vllm_layer_attention(config, i: int, v2_runner: bool) -> tuple[int | None, bool]:
    """qwen3_dflash.py@036a00d:89-149 `_resolve_layer_attention` -> (sliding_window, causal):
        use_swa = dflash_config.get("use_swa", False)                              # :115
        if 0 < num_sliding < len(layer_types) and not ...use_v2_model_runner:      # :122-125
            raise NotImplementedError("... relaunch with VLLM_USE_V2_MODEL_RUNNER=1.")
        if layer_types is None or (use_swa and not any_sliding): is_sliding = use_swa   # :133-134
        else: is_sliding = layer_types[layer_idx] == _SLIDING_ATTENTION            # :136
        sliding_window = dflash_config.get("swa_window_size", getattr(config, "sliding_window", None))  # :140-142
        return sliding_window, _dflash_layer_causal(config, layer_idx)            # :149
    """
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


def vllm_flash_window(sliding_window: int | None) -> tuple[int, int]:
    """flash_attn.py@5704f34 `FlashAttentionImpl.__init__`, for the attn_type a DFlash layer has
    (qwen3_dflash.py@036a00d `DFlashQwen3DecoderLayer.__init__`: `attn_type = AttentionType.DECODER`):
        if sliding_window is None: self.sliding_window = (-1, -1)
        elif attn_type == AttentionType.ENCODER_ONLY: self.sliding_window = (sliding_window - 1, sliding_window - 1)
        else: self.sliding_window = (sliding_window - 1, 0)
    passed as `window_size`, with `causal=attn_metadata.causal`, the layer's
    `get_draft_attn_causal()` entry (= `self_attn.causal`)."""
    return (-1, -1) if sliding_window is None else (int(sliding_window) - 1, 0)


def vllm_capture_layers(config) -> list[int]:
    """vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py `get_eagle3_aux_layers_from_config` (as
    qwen3_dflash.py@036a00d imports it): the target's aux hidden-state ids, hidden_states[id]:
        layer_ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
        if not layer_ids: ... layer_ids = [i + 1 for i in (dflash_config.get("target_layer_ids") or [])]
    """
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    if not ids:
        ids = [i + 1 for i in ((getattr(config, "dflash_config", None) or {}).get("target_layer_ids") or [])]
    return [int(i) for i in ids]


def vllm_layouts(config, v2_runner: bool = True) -> list[Layout]:
    layers = [vllm_layer_attention(config, i, v2_runner) for i in range(int(config.num_hidden_layers))]
    return [(causal, vllm_flash_window(window)) for window, causal in layers]


def sglang_layouts(config, sglang: Any) -> list[Layout]:
    """SGLang's own code (an engine_code.SGLangCode): the layer's (window_left, AttentionType),
    then its FlashAttention backend's causal and window_size; extend and decode agree."""
    out = []
    for i in range(int(config.num_hidden_layers)):
        window_left, attn_type = sglang.layer_attention(config, i)
        extend = sglang.flash_window(window_left, attn_type, "forward_extend")
        if sglang.flash_window(window_left, attn_type, "forward_decode") != extend:
            raise AssertionError(f"SGLang's extend and decode paths differ for layer {i}")
        out.append(extend)
    return out


def sglang_capture_layers(config, sglang: Any, target_num_layers: int) -> list[int]:
    """hidden_states indices SGLang feeds fc: parse_dflash_draft_config's target_layer_ids, captured
    by the target "before layer id + 1" (set_dflash_layers_to_capture), i.e. hidden_states[id + 1]."""
    ids = sglang.draft_config(config).resolve_target_layer_ids(target_num_layers=target_num_layers,
                                                              draft_num_layers=int(config.num_hidden_layers))
    return sglang.target_capture(ids)


def layer_layouts(export_dir: Path, engine: str, target_num_layers: int, sglang: Any = None
                  ) -> tuple[list[Layout], list[int]]:
    """Per layer (causal, window_size), and the hidden_states indices fc reads, as `engine` has them."""
    config = hf_config(export_dir)
    if engine == "vllm":
        return vllm_layouts(config), vllm_capture_layers(config)
    if engine == "sglang":
        if sglang is None:
            raise ValueError("engine 'sglang' runs SGLang's own code: pass an engine_code.SGLangCode")
        return sglang_layouts(config, sglang), sglang_capture_layers(config, sglang, target_num_layers)
    raise ValueError(f"unknown engine {engine!r}")


def flash_mask(layout: Layout, n_ctx: int, k: int) -> torch.Tensor:
    """[k, n_ctx + k] bool: the keys each of the k block queries sees in one flash-attn call over the
    n_ctx context keys followed by the block's own (queries = the last k key positions)."""
    causal, (left, right) = layout
    q = torch.arange(n_ctx, n_ctx + k)[:, None]
    key = torch.arange(n_ctx + k)[None]
    allowed = torch.ones(k, n_ctx + k, dtype=torch.bool)
    if causal:
        allowed &= key <= q
    if left >= 0:
        allowed &= key >= q - left
    if right >= 0:
        allowed &= key <= q + right
    return allowed


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
    CONV_NAMES = ("attention_conv.base_kernel", "attention_conv.kernel_projection.weight", "mlp_conv.base_kernel",
                  "mlp_conv.kernel_projection.weight")
    SELECTOR_NAMES = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                      "candidate_selector.hidden_projection.weight")

    def __init__(self, export_dir: Path, target_embed: torch.Tensor, target_lm_head: torch.Tensor,
                 engine: str = "vllm", sglang: Any = None) -> None:
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
        self.layouts, self.capture = layer_layouts(Path(export_dir), engine, self.num_target_layers, sglang)
        self.block_size = int(dflash.get("block_size", c.get("block_size", 16)))
        self.mask_id = dflash.get("mask_token_id")
        if self.mask_id is None or not 0 <= int(self.mask_id) < target_embed.shape[0]:
            raise ValueError(f"mask_token_id {self.mask_id} is not a row of the target's embedding "
                             f"({target_embed.shape[0]} rows)")
        self.mask_id = int(self.mask_id)
        self.dflash2 = c.get("architectures") == ["DFlash2DraftModel"]
        names = self.NAMES
        if self.dflash2:
            self.taps, self.group = int(dflash["conv_kernel_size"]), int(dflash["conv_group_size"])
            self.rank, self.top_k = int(dflash["selector_rank"]), int(dflash["selector_top_k"])
            self.output_multiplier = float(dflash.get("output_multiplier", 1.0))
            self.softcap = float(dflash.get("final_logit_softcapping") or 0.0) or None
            self.embed_scale = float(dflash.get("input_embedding_scale", 1.0))
            names = names + self.CONV_NAMES
        w = load_file(str(Path(export_dir) / "model.safetensors"))
        want = {f"layers.{i}.{n}" for i in range(self.n_layers) for n in names} | {
            "fc.weight", "hidden_norm.weight", "norm.weight"} | (set(self.SELECTOR_NAMES) if self.dflash2 else set())
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
        if self.dflash2:
            x = x * self.embed_scale
        pos_ctx, pos_blk = torch.arange(n), torch.arange(n, n + k)
        for i in range(self.n_layers):
            allowed = flash_mask(self.layouts[i], n, k)  # [query, key] by position
            p = f"layers.{i}."
            y = rms(x, w[p + "input_layernorm.weight"], self.eps)
            if self.dflash2:
                y, attn_coef = self.conv_prepare(y, p + "attention_conv.")

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
            out = att.transpose(0, 1).reshape(k, -1) @ w[p + "self_attn.o_proj.weight"].T
            if self.dflash2:
                out = self.conv(out, attn_coef, p + "attention_conv.", 1)
            x = x + out
            y = rms(x, w[p + "post_attention_layernorm.weight"], self.eps)
            if self.dflash2:
                y, mlp_coef = self.conv_prepare(y, p + "mlp_conv.")
            out = (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) @ \
                w[p + "mlp.down_proj.weight"].T
            if self.dflash2:
                out = self.conv(out, mlp_coef, p + "mlp_conv.", 1)
            x = x + out
        return rms(x, w["norm.weight"], self.eps)

    def conv(self, x: torch.Tensor, delta: torch.Tensor, prefix: str, side: int) -> torch.Tensor:
        """vLLM's `_grouped_conv` over one request's block of K query tokens: x [K, h], delta [K, taps, groups]."""
        groups = self.h // self.group
        blocks = x.unflatten(-1, (groups, self.group))
        coef = self.w[prefix + "base_kernel"][side].view(1, self.taps, groups, self.group) + delta.unsqueeze(-1)
        out = coef[:, 0] * blocks
        position = torch.arange(x.shape[0]) % self.block_size
        for tap in range(1, self.taps):
            shifted = F.pad(blocks[:-tap], (0, 0, 0, 0, tap, 0))
            out = out + coef[:, tap] * shifted * (position >= tap).view(-1, 1, 1)
        return out.flatten(-2)

    def conv_prepare(self, x: torch.Tensor, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        coef = (x @ self.w[prefix + "kernel_projection.weight"].T).reshape(x.shape[0], 2, self.taps, -1)
        return self.conv(x, coef[:, 0], prefix, 0), coef[:, 1]

    def draft(self, ctx_feats: torch.Tensor, anchor_token: int) -> list[int]:
        """The K-1 draft tokens after `anchor_token`: greedy through the target's lm_head (DFlash);
        DFlash2: the candidates' transition lattice walked as vLLM's speculator does at temperature 0."""
        states = self.block_states(ctx_feats, anchor_token)
        logits = states[1:] @ self.lm_head.T
        if not self.dflash2:
            return logits.argmax(-1).tolist()
        values, ids = torch.topk(logits, self.top_k, dim=-1)  # compute_candidates
        values = values.float() * self.output_multiplier
        if self.softcap is not None:
            values = torch.tanh(values / self.softcap) * self.softcap
        sel = "candidate_selector."
        hidden = states[1:] @ self.w[sel + "hidden_projection.weight"].T  # [K-1, r]
        prev = torch.cat([torch.full((1, self.top_k), anchor_token), ids[:-1]])  # [K-1, k]: _score_edges
        edges = values[:, None] + torch.einsum("lpr,lcr->lpc", self.w[sel + "predecessor_codebook"][prev]
                                               * hidden[:, None], self.w[sel + "successor_codebook"][ids])
        tokens, previous = [], 0
        for step in range(edges.shape[0]):
            scores = edges[step, previous]
            previous = int(torch.nonzero(scores == scores.max())[0])  # the lowest index among the best
            tokens.append(int(ids[step, previous]))
        return tokens
