"""The frozen target of extraction and online DFlash: the user's checkpoint exactly as it is.

Its config, its vocabulary and its weights are used untouched: no codebook rows are appended
(a stage-1 export has them already, with whatever codebook sizes it was trained with; a plain
Qwen3.5 checkpoint has none and gets none), and the shape comes from its config.json, so no
shape-registry entry is needed. Only the decoder stack is built (transformers' base model:
embedding, layers, final norm): the hidden states are all extraction needs, so no lm_head module
exists; its weight (the embedding's, when tied) is read from the checkpoint only when the caller
asks for the head.

Low-memory loading: the base model is constructed directly on the rank's device in the
checkpoint's dtype with initialisation skipped (transformers' ``no_init_weights``), then every
tensor is copied in from the safetensors files one at a time (``safe_open`` maps the file; a
tensor is read, moved and dropped). The host never holds an fp32 copy or the whole model: on a GPU
rank its peak RSS stays near one shard's mapped pages (bench/target_load.py measures it).

A random-init target (no ``--init-from``) is the model shape's text config (train.common.shapes),
again without codebook rows.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from train.common.hf_local import load_config

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Checkpoint key prefixes of the decoder stack: a CausalLM's, and a conditional-generation
# (vision) model's language model.
BASE_PREFIXES = ("model.language_model.", "model.")
HEAD_KEY = "lm_head.weight"


class TargetError(ValueError):
    """A target checkpoint that cannot be used; the message is one line."""


@dataclass
class Target:
    base: torch.nn.Module  # the decoder stack: embed_tokens, layers, norm (no lm_head)
    config: Any  # its text config (a multimodal checkpoint's text_config)
    source: str  # the checkpoint directory, or "random:<shape>"
    config_sha256: str | None = None  # of the checkpoint's config.json (None: random init)

    @property
    def vocab_size(self) -> int:
        return int(self.base.embed_tokens.weight.shape[0])


def text_config_of(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def resolve_dtype(name: str, config: Any, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's own dtype (config.json's `dtype`/`torch_dtype`); a random-init
    target (config None) computes in bf16 on a GPU and fp32 on the CPU."""
    if name != "auto":
        return DTYPES[name]
    if config is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    got = getattr(config, "dtype", None) or getattr(text_config_of(config), "dtype", None)
    if isinstance(got, str):
        got = DTYPES.get(got.removeprefix("torch."))
    return got if isinstance(got, torch.dtype) else torch.float32


def _build_base(text_cfg: Any, device: torch.device, dtype: torch.dtype, init: bool) -> torch.nn.Module:
    from transformers import AutoModel
    from transformers.initialization import no_init_weights

    text_cfg.use_cache = False
    with torch.device(device):
        if init:
            return AutoModel.from_config(text_cfg, dtype=dtype, attn_implementation="sdpa")
        with no_init_weights():  # every weight is overwritten from the checkpoint next
            return AutoModel.from_config(text_cfg, dtype=dtype, attn_implementation="sdpa")


def checkpoint_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise TargetError(f"--init-from {path}: no *.safetensors weights there (the target must be a "
                          "safetensors checkpoint, as save_pretrained writes)")
    return files


MAPPED_BYTES = 256 << 20  # a shard is re-opened after this many bytes were read from its mapping


def stream_tensors(path: Path, wanted) -> Iterator[tuple[str, list[int], slice, torch.Tensor]]:
    """(key, its full shape, rows, CPU tensor) for the keys `wanted(key)` accepts, shard by shard, in pieces of at
    most MAPPED_BYTES (a large tensor, the embedding, in row slices).

    The file is memory-mapped; pages read stay resident (and count in the process's RSS) until the
    mapping closes, so it is re-opened every MAPPED_BYTES: the host holds at most about that much
    of a shard plus one piece, however large the shards are."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            keys = [k for k in f.keys() if wanted(k)]
            shapes = {k: f.get_slice(k).get_shape() for k in keys}
        pieces = []
        for k in keys:
            shape = shapes[k]
            n_rows = shape[0] if shape else 1
            row_bytes = max(1, math.prod(shape[1:]) * 4) if shape else 4
            step = max(1, MAPPED_BYTES // row_bytes)
            pieces += [(k, slice(lo, min(n_rows, lo + step))) for lo in range(0, n_rows, step)]
        i = 0
        while i < len(pieces):
            read = 0
            with safe_open(str(file), framework="pt", device="cpu") as f:
                while i < len(pieces) and read < MAPPED_BYTES:
                    key, rows = pieces[i]
                    t = f.get_slice(key)[rows] if shapes[key] else f.get_tensor(key)
                    read += t.numel() * t.element_size()
                    yield key, list(shapes[key]), rows, t
                    del t
                    i += 1


def _base_name(key: str) -> str | None:
    for prefix in BASE_PREFIXES:
        if key.startswith(prefix):
            rest = key[len(prefix):]
            return None if rest.startswith(("visual.", "language_model.")) else rest
    return None


def load_target(init_from: str | Path | None, shape: str, device: torch.device, dtype: str = "auto",
                seed: int = 0) -> Target:
    """The target's decoder stack on `device`: the checkpoint `init_from` as it is, or a random-init
    model of `shape`. Raises TargetError (one line) for a checkpoint that does not fit."""
    if init_from is None:
        from train.common.shapes import get_shape
        from train.stage1.model import text_config

        cfg = text_config(get_shape(shape))
        torch.manual_seed(seed)  # the same random-init target on every rank and every resume
        base = _build_base(cfg, device, resolve_dtype(dtype, None, device), init=True)
        return Target(base.eval().requires_grad_(False), cfg, f"random:{shape}")
    path = Path(init_from)
    try:
        config = load_config(path)
    except ValueError as exc:
        raise TargetError(str(exc)) from None
    text_cfg = text_config_of(config)
    want = resolve_dtype(dtype, config, device)
    try:
        base = _build_base(text_cfg, device, want, init=False)
    except (ValueError, KeyError) as exc:
        raise TargetError(f"--init-from {path}: transformers cannot build its config "
                          f"({' '.join(str(exc).split())[:200]})") from None
    params = dict(base.named_parameters()) | dict(base.named_buffers())
    loaded: set[str] = set()
    for key, shape, rows, t in stream_tensors(path, lambda k: (_base_name(k) or "") in params):
        dst = params[_base_name(key)]
        if shape != list(dst.shape):
            raise TargetError(f"--init-from {path}: {key} has shape {shape}, its config.json "
                              f"makes {list(dst.shape)}")
        with torch.no_grad():
            (dst[rows] if dst.dim() else dst).copy_(t.to(dst.dtype))
        loaded.add(_base_name(key))
        del t
    missing = sorted(n for n, _ in base.named_parameters() if n not in loaded)
    if missing:
        raise TargetError(f"--init-from {path}: the checkpoint lacks {len(missing)} weight(s) of its own "
                          f"config's decoder ({', '.join(missing[:3])})")
    digest = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
    return Target(base.eval().requires_grad_(False), text_cfg, str(path), digest)


def load_causal_lm(init_from: str | Path, device: torch.device, dtype: str = "auto") -> torch.nn.Module:
    """The whole checkpoint, lm_head included, on `device`, built and filled as load_target does
    (no host copy of the model): what regeneration needs to generate with the target."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    path = Path(init_from)
    try:
        config = load_config(path)
    except ValueError as exc:
        raise TargetError(str(exc)) from None
    text_config_of(config).use_cache = True
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype, config, device))
    model.tie_weights()  # a tied lm_head is the embedding (save_pretrained stores it once)
    params = dict(model.named_parameters()) | dict(model.named_buffers())  # tied weights: one name
    loaded: set[str] = set()
    for key, shape, rows, t in stream_tensors(path, lambda k: k in params):
        dst = params[key]
        if shape != list(dst.shape):
            raise TargetError(f"--init-from {path}: {key} has shape {shape}, its config.json makes {list(dst.shape)}")
        with torch.no_grad():
            (dst[rows] if dst.dim() else dst).copy_(t.to(dst.dtype))
        loaded.add(key)
    missing = sorted(n for n, _ in model.named_parameters() if n not in loaded)
    if missing:
        raise TargetError(f"--init-from {path}: the checkpoint lacks {len(missing)} weight(s) of its own "
                          f"config's model ({', '.join(missing[:3])})")
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    return model.eval()


def checkpoint_config(path: str | Path) -> Any:
    """The text config of checkpoint `path` (TargetError, one line, if it has none)."""
    try:
        return text_config_of(load_config(Path(path)))
    except ValueError as exc:
        raise TargetError(str(exc)) from None


def checkpoint_head(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding, lm_head) read from the checkpoint's files alone, nothing else built: the head a
    drafter rank needs. A tied checkpoint's lm_head is its embedding."""
    path = Path(path)
    top = json.loads((path / "config.json").read_text())
    tied = bool(top.get("tie_word_embeddings", (top.get("text_config") or {}).get("tie_word_embeddings", False)))
    got: dict[str, list[torch.Tensor]] = {}
    for key, _shape, _rows, t in stream_tensors(path, lambda k: k == HEAD_KEY or _base_name(k) == "embed_tokens.weight"):
        got.setdefault("head" if key == HEAD_KEY else "embed", []).append(t)
    embed = torch.cat(got["embed"]) if "embed" in got else None
    head = torch.cat(got["head"]) if "head" in got else None
    if embed is None:
        raise TargetError(f"--init-from {path}: no embed_tokens.weight in the checkpoint")
    if head is None:
        if not tied:
            raise TargetError(f"--init-from {path}: no {HEAD_KEY} in the checkpoint and tie_word_embeddings is off")
        head = embed.clone()
    return embed, head.to(embed.dtype)


def head_weights(target: Target) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding, lm_head) of a loaded target on the CPU (random init: tied)."""
    if target.config_sha256 is not None:
        return checkpoint_head(target.source)
    embed = target.base.embed_tokens.weight.detach().cpu()
    return embed, embed.clone()


__all__ = ["Target", "TargetError", "checkpoint_config", "checkpoint_head", "head_weights", "load_causal_lm",
           "load_target",
           "resolve_dtype"]
