"""A trained drafter as a directory serving engines load: config.json + model.safetensors.

The layout is that of the published DFlash drafters (z-lab's `DFlashDraftModel`), which SGLang's
DFlash loader (python/sglang/srt/models/dflash.py, config parsed by
python/sglang/srt/speculative/dflash_utils.py `parse_dflash_draft_config`) and vLLM's
(vllm/model_executor/models/qwen3_dflash.py, registry arch "DFlashDraftModel") read:
  - config.json: a Qwen3 config (`model_type: qwen3`, architectures ["DFlashDraftModel"]) with the
    drafter's shape (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    head_dim, intermediate_size, rms_norm_eps, rope_parameters, max_position_embeddings,
    vocab_size), `num_target_layers`, and `dflash_config` {target_layer_ids, block_size,
    mask_token_id}; `eagle_aux_hidden_state_layer_ids` (= target_layer_ids + 1, vLLM's capture
    points: without it vLLM adds the 1 itself) for vLLM versions that read only that field;
  - causality inside the block: NO `is_causal` and NO `dflash_config.causal` (the published
    drafters have neither). The trainer runs full layers bidirectional and sliding layers causal
    in the block; unset, vLLM (`_dflash_layer_causal`) makes exactly the sliding layers causal and
    SGLang maps `sliding_attention` to a causal decoder layer, `full_attention` to a bidirectional
    one. Either key would set one causality for EVERY layer in vLLM, which no setting makes right
    for a mixed layout;
  - sliding-window layers: `layer_types` (per layer "sliding_attention"/"full_attention"), the
    top-level `sliding_window` W with `use_sliding_window: true` (transformers' Qwen3Config drops
    `sliding_window` without it; SGLang reads it as window_left = W - 1), and
    `dflash_config.{use_swa, swa_window_size}` (vLLM reads swa_window_size first). vLLM serves a
    drafter that mixes sliding and full layers only with VLLM_USE_V2_MODEL_RUNNER=1 (README.md says so);
  - DFlash2 (SpecForge's DFlash2DraftModel; vLLM's qwen3_dflash2.py, registry arch
    "DFlash2DraftModel"): architectures ["DFlash2DraftModel"], `dflash_config.{conv_kernel_size,
    conv_group_size, selector_rank, selector_top_k}` (vLLM and SpecForge require all four),
    `initializer_range`; no `output_multiplier`, `final_logit_softcapping` or
    `input_embedding_scale` (identity transforms, which is what the trainer computes); weights add
    layers.{i}.{attention_conv, mlp_conv}.{base_kernel, kernel_projection.weight} and
    candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight};
  - model.safetensors: layers.{i}.{input_layernorm, post_attention_layernorm}.weight,
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
    layers.{i}.mlp.{gate,up,down}_proj.weight, fc.weight, hidden_norm.weight, norm.weight. No
    embedding and no lm_head: the engines use the target's.
`load_export` is the project's own loader of that directory (tests reload through it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from toolkit.fsutil import atomic_write_bytes, atomic_write_text, check_destination, publish_dir
from train.common.checkpoint import CheckpointError, CheckpointManager, load_state, step_dir_name, verify
from train.dflash.model import FULL, SLIDING, Drafter, DrafterConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


def hf_config(cfg: DrafterConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """The drafter's config.json (see the module docstring for who reads which field)."""
    sliding = SLIDING in (cfg.layer_types or [])
    dflash2 = {"conv_kernel_size": cfg.conv_kernel_size, "conv_group_size": cfg.conv_group_size,
               "selector_rank": cfg.selector_rank, "selector_top_k": cfg.selector_top_k} if cfg.dflash2 else {}
    return {
        "architectures": ["DFlash2DraftModel" if cfg.dflash2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,  # engines that predate rope_parameters
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "layer_types": list(cfg.layer_types or []),
        "sliding_window": cfg.sliding_window if sliding else None,
        "use_sliding_window": sliding,
        "use_cache": False,
        "dtype": dtype,
        "torch_dtype": dtype,
        "num_target_layers": cfg.num_target_layers,
        "block_size": cfg.block_size,
        "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "block_size": cfg.block_size,
                          "mask_token_id": cfg.mask_token_id,
                          **({"use_swa": True, "swa_window_size": cfg.sliding_window} if sliding else {}),
                          **dflash2},
        "initializer_range": 0.02,  # SpecForge's DFlash2DraftModel reads it to build the selector
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        # not read by the engines: which target this drafter was trained for (README.md says it too)
        "dflash_target": {"path": cfg.target, "config_sha256": cfg.target_config_sha256},
    }


def readme(cfg: DrafterConfig) -> str:
    """README.md of an export: the target it belongs to, and what the engines read."""
    return "\n".join([
        "# DFlash2 drafter" if cfg.dflash2 else "# DFlash drafter", "",
        f"Trained for the target `{cfg.target or 'unknown'}` (config.json sha256 "
        f"`{cfg.target_config_sha256 or 'unknown'}`). Serve it next to exactly that target: the drafter "
        "has no embedding or lm_head and uses the target's, and its inputs are that target's hidden states.", "",
        f"- target layers captured (0-based): {list(cfg.target_layer_ids)} of {cfg.num_target_layers}",
        f"- block size: {cfg.block_size}",
        f"- mask token id: {cfg.mask_token_id} (a token of the target's tokenizer; embedded with the target's "
        "embedding)",
        f"- vocab size: {cfg.vocab_size} (the target's)",
        f"- drafter: {cfg.num_layers} layers, {cfg.num_heads} x {cfg.head_dim} query heads, {cfg.num_kv_heads} "
        f"key-value heads, MLP {cfg.intermediate_size}",
        *sliding_notes(cfg), *dflash2_notes(cfg), "",
        "config.json follows the published DFlash drafters (`DFlashDraftModel`, `dflash_config`); "
        "model.safetensors holds `layers.*`, `fc`, `hidden_norm` and `norm`.", ""])


def dflash2_notes(cfg: DrafterConfig) -> list[str]:
    if not cfg.dflash2:
        return []
    return [f"- DFlash2: {cfg.conv_kernel_size}-tap grouped dynamic convolutions ({cfg.conv_group_size} channels a "
            f"group) around every attention and MLP; a rank-{cfg.selector_rank} candidate selector over the "
            f"target head's top {cfg.selector_top_k} (`DFlash2DraftModel`; serve with {cfg.block_size - 1} "
            "speculative tokens: the convolution spans the block)"]


def mixes_attention(cfg: DrafterConfig) -> bool:
    """Sliding-window and full-attention layers in one drafter (vLLM: V2 model runner only)."""
    return {SLIDING, FULL} <= set(cfg.layer_types or [])


def sliding_notes(cfg: DrafterConfig) -> list[str]:
    if SLIDING not in (cfg.layer_types or []):
        return []
    notes = [f"- attention: {', '.join(cfg.layer_types or [])}; sliding window {cfg.sliding_window} tokens "
             "(config.json `sliding_window`; SGLang's window_left is one less); inside the block the "
             "sliding layers are causal and the full ones bidirectional, as SGLang and vLLM serve them "
             "(no `is_causal` key)"]
    if mixes_attention(cfg):
        notes.append("- vLLM: a drafter mixing sliding-window and full-attention layers needs the V2 model "
                     "runner: start vLLM with `VLLM_USE_V2_MODEL_RUNNER=1`")
    return notes


def config_from_hf(data: dict[str, Any]) -> DrafterConfig:
    dflash = data.get("dflash_config") or {}
    causal = data.get("is_causal", dflash.get("causal"))
    types = data.get("layer_types") or [FULL] * int(data.get("num_hidden_layers") or 0)
    if causal is not None and (SLIDING if not causal else FULL) in types:
        # e.g. an earlier export with bidirectional sliding layers: one causality for every layer
        # is not this drafter's mask (sliding layers causal in the block, full ones bidirectional)
        raise ValueError(f"is_causal/dflash_config.causal = {causal} for every layer does not match layer_types "
                         f"{types} (sliding layers causal in the block, full ones not): re-export it")
    rope = data.get("rope_parameters") or {}
    window = dflash.get("swa_window_size", data.get("sliding_window"))
    return DrafterConfig(
        hidden_size=int(data["hidden_size"]), target_layer_ids=[int(i) for i in dflash["target_layer_ids"]],
        num_target_layers=int(data.get("num_target_layers") or dflash.get("num_target_layers")),
        vocab_size=int(data["vocab_size"]), num_layers=int(data["num_hidden_layers"]),
        num_heads=int(data["num_attention_heads"]), num_kv_heads=int(data["num_key_value_heads"]),
        head_dim=int(data["head_dim"]), intermediate_size=int(data["intermediate_size"]),
        block_size=int(dflash.get("block_size", data.get("block_size", 16))),
        mask_token_id=int(dflash["mask_token_id"]), rope_theta=float(rope.get("rope_theta", data.get("rope_theta"))),
        rms_eps=float(data["rms_norm_eps"]), max_position_embeddings=int(data["max_position_embeddings"]),
        layer_types=data.get("layer_types"), sliding_window=int(window) if window else None,
        conv_kernel_size=int(dflash.get("conv_kernel_size") or 0), conv_group_size=int(dflash.get("conv_group_size") or 16),
        selector_rank=int(dflash.get("selector_rank") or 0), selector_top_k=int(dflash.get("selector_top_k") or 16),
        target=str((data.get("dflash_target") or {}).get("path") or ""),
        target_config_sha256=str((data.get("dflash_target") or {}).get("config_sha256") or ""))


def write_export(drafter: Drafter, out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the directory atomically: a temp dir, each file fsynced, renamed into place."""
    from safetensors.torch import save

    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    out = Path(out)
    check_destination(out, lambda d: (d / CONFIG).is_file() and (d / WEIGHTS).is_file())
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    atomic_write_bytes(tmp / WEIGHTS, save(weights, metadata={"format": "pt"}))
    atomic_write_text(tmp / CONFIG, json.dumps(hf_config(drafter.cfg, name), indent=2) + "\n")
    atomic_write_text(tmp / "README.md", readme(drafter.cfg))
    publish_dir(tmp, out)  # an earlier export replaced, the user's other files in it kept
    return out


def load_export(path: str | Path, device: str | torch.device = "cpu") -> Drafter:
    """The project's loader of an exported directory: config.json -> Drafter, weights strict."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        cfg = config_from_hf(json.loads((path / CONFIG).read_text()))
        weights = load_file(str(path / WEIGHTS))
    except (OSError, KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not an exported DFlash drafter ({type(exc).__name__}: {exc})") from None
    drafter = Drafter(cfg)
    drafter.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return drafter.to(device)


def export_checkpoint(job_dir: Path, step: int | None, out: Path | None) -> Path:
    """`launch export JOB` for DFlash runs: the checkpoint at `step` (None: the latest) of the run
    in `job_dir`, written to `out` (None: <job_dir>/export/step_XXXXXXXX). Returns the directory."""
    job_dir = Path(job_dir)
    ckpts = CheckpointManager(job_dir / "checkpoints")
    if step is None:
        ckpt = ckpts.latest()
        if ckpt is None:
            raise CheckpointError(f"{job_dir}: no checkpoints/ to export (has the run saved one yet?)")
    else:
        ckpt = job_dir / "checkpoints" / step_dir_name(step)
        if not ckpt.is_dir():
            have = sorted(p.name for p in (job_dir / "checkpoints").glob("step_*"))
            raise CheckpointError(f"{ckpt}: no checkpoint at step {step} (there are: {', '.join(have) or 'none'})")
        verify(ckpt)
    state = load_state(ckpt / "drafter.pt")
    drafter = Drafter(DrafterConfig(**state["drafter_config"]))
    drafter.load_state_dict(state["model"])
    return write_export(drafter, Path(out) if out else job_dir / "export" / ckpt.name)


__all__ = ["export_checkpoint", "hf_config", "load_export", "write_export"]
