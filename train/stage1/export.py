"""Export a stage-1 checkpoint as a transformers checkpoint directory (``from_pretrained`` loads it).

An export holds ``config.json`` (the extended vocab), ``model.safetensors``, the extended
tokenizer (with ``<|ss_0|>`` ... at the embedding's ids), the image processor's config when the
run trained the vision tower, and a README.md saying what was trained and which weights these are.

The trainer writes everything but the weights once, at its start, into ``<job>/model_files/``
(:func:`write_model_files`), so an export needs nothing but the job directory: not the
``--init-from`` directory, which may be gone by then. The weights come from a checkpoint:

* plain torch: ``model.pt`` holds the module's weights; when those were bf16 the optimizer's fp32
  masters (``optim.pt``, train.common.master_weights) are taken instead;
* DeepSpeed ZeRO-2: the fp32 masters gathered from every rank's optimizer partition
  (DeepSpeed's own ``zero_to_fp32``), with the wrapper's ``model.`` prefix stripped.

``export_checkpoint(job_dir, step, out)`` is what ``launch export JOB`` calls, and what the trainer
calls at the end of a run.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

from toolkit.fsutil import atomic_write_text, disk_full, free_space, publish_dir
from toolkit.fsutil import check_destination as fs_check_destination
from train.common.checkpoint import (
    CheckpointError,
    CheckpointManager,
    load_state,
    only_weights,
    step_dir_name,
    verify,
)

MODEL_FILES = "model_files"
EXPORT_DIR = "export"
README_TITLE = "# Stage-1 export"


class ExportError(RuntimeError):
    """An export that cannot be made; one line."""


def write_model_files(job_dir: Path, model: torch.nn.Module, tok: Any, info: dict[str, Any]) -> Path:
    """<job>/model_files: config.json, the extended tokenizer, the image processor, stage1.json."""
    final = Path(job_dir) / MODEL_FILES
    tmp = final.with_name(f".tmp-{MODEL_FILES}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.config.save_pretrained(tmp)
    # The checkpoint's own tokenizer (extended), or the byte stand-in as a real tokenizer: every
    # export loads with AutoTokenizer and encodes text as the run did.
    hf = getattr(tok, "hf", None) or (tok.to_hf() if hasattr(tok, "to_hf") else None)
    if hf is not None:
        try:
            hf.save_pretrained(tmp)
        except OSError:
            raise
        except Exception as exc:  # the Rust tokenizer's write errors are plain Exceptions: keep their errno
            number = next((n for n in (errno.ENOSPC, errno.EDQUOT) if f"os error {n})" in str(exc)), None)
            if number is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise OSError(number, os.strerror(number), str(tmp / "tokenizer.json")) from None
    if tok.encoder is not None:
        tok.encoder.processor.save_pretrained(tmp)
    atomic_write_text(tmp / "stage1.json", json.dumps(info, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def _checkpoint(job_dir: Path, step: int | None) -> Path:
    root = job_dir / "checkpoints"
    if step is None:
        path = CheckpointManager(root).latest()
        if path is None:
            raise ExportError(f"{job_dir}: no checkpoint to export ({root} has none)")
        return path
    path = root / step_dir_name(step)
    if not path.is_dir():
        have = sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []
        raise ExportError(f"{job_dir}: no checkpoint at step {step} (have: {', '.join(have) or 'none'})")
    verify(path)
    return path


def _strip(state: dict[str, torch.Tensor], names: set[str]) -> dict[str, torch.Tensor]:
    """Drop wrapper prefixes (DDP's ``module.``, the loss wrapper's ``model.``) until keys match."""
    for prefix in ("module.", "model."):
        if set(state) <= names:
            break
        if all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def load_weights(ckpt: Path, model: torch.nn.Module) -> str:
    """Load checkpoint ``ckpt``'s weights into ``model``; return which weights they were."""
    names = {n for n, _ in model.named_parameters()} | set(model.state_dict())
    if (ckpt / "deepspeed").is_dir():
        # imported here: deepspeed is slow to import and only DeepSpeed checkpoints need it
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with only_weights(ckpt / "deepspeed"):
            state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="deepspeed")
        what = "fp32 master weights of a DeepSpeed ZeRO-2 checkpoint (gathered over its ranks)"
    elif (ckpt / "model.pt").is_file():
        state = load_state(ckpt / "model.pt")
        what = "the module's weights of a plain-torch checkpoint"
        low = {v.dtype for v in state.values() if v.is_floating_point()} - {torch.float32}
        optim = ckpt / "optim.pt"
        if low and optim.is_file():
            saved = load_state(optim)
            if not isinstance(saved, dict) or not isinstance(saved.get("optimizer"), dict):
                keys = ", ".join(map(str, saved)) if isinstance(saved, dict) else type(saved).__name__
                raise ExportError(f"{optim} is not this trainer's optimizer state (it holds {keys[:120]}, no "
                                  "'optimizer'): written by another layout or trainer; nothing written")
            masters = saved["optimizer"].get("fp32_masters")
            if masters is not None:
                state = _strip(state, names)
                # the masters are in the order of the trained parameters (train.common.master_weights)
                trained = [(n, p.shape) for n, p in model.named_parameters() if p.requires_grad]
                if len(trained) == len(masters) and all(m.shape == shape for (_, shape), m in
                                                        zip(trained, masters, strict=True)):
                    state.update((n, m) for (n, _), m in zip(trained, masters, strict=True))
                    what = "fp32 master weights of a plain-torch checkpoint (its module weights are bf16)"
                else:
                    what = ("the bf16 module weights of a plain-torch checkpoint (its fp32 masters do not line "
                            "up with the parameters)")
    else:
        raise ExportError(f"{ckpt}: neither model.pt nor a deepspeed/ directory: not a stage-1 checkpoint")
    state = _strip(state, names)
    # Only parameters and buffers by their own names: a tied weight's second name (lm_head.weight)
    # would otherwise load last and overwrite the masters just put under the first.
    own = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    unknown = sorted(set(state) - names)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items() if k in own}
    missing, unexpected = model.load_state_dict(state, strict=False)
    unexpected = list(unexpected) + unknown
    tied = {"lm_head.weight"} if model.config.get_text_config().tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ExportError(f"{ckpt}: weights do not fit the model (missing {sorted(set(missing) - tied)[:3]}, "
                          f"unexpected {sorted(unexpected)[:3]})")
    return what


def _manifest_step(ckpt: Path) -> int:
    """The step MANIFEST.json records (a file a user can edit: it must be the directory's own)."""
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    step = manifest.get("step") if isinstance(manifest, dict) else None
    if type(step) is not int or step_dir_name(step) != ckpt.name:
        raise ExportError(f"{ckpt / 'MANIFEST.json'}: its step is {step!r:.40}, the checkpoint is {ckpt.name}: the "
                          "manifest was edited; nothing written")
    return step


def export_checkpoint(job_dir: Path, step: int | None = None, out: Path | None = None) -> Path:
    """Write checkpoint ``step`` (default: the latest) of stage-1 job ``job_dir`` as a transformers
    checkpoint into ``out`` (default ``<job>/export/step_XXXXXXXX``); return ``out``."""
    job_dir = Path(job_dir)
    files = job_dir / MODEL_FILES
    if not (files / "config.json").is_file():
        raise ExportError(f"{job_dir}: no {MODEL_FILES}/config.json (not a stage-1 job directory, or one "
                          "that never started training)")
    try:
        ckpt = _checkpoint(job_dir, step)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    step_no = _manifest_step(ckpt)
    out = Path(out) if out is not None else job_dir / EXPORT_DIR / step_dir_name(step_no)
    check_destination(out)
    try:
        config = AutoConfig.from_pretrained(files, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ExportError(f"{files / 'config.json'} does not load ({' '.join(str(exc).split())[:160]}); "
                          "nothing written") from None
    if config.model_type not in ("qwen3_5", "qwen3_5_text"):
        raise ExportError(f"{files / 'config.json'} is a {config.model_type!r} model's config, not the stage-1 "
                          "model's (qwen3_5 or qwen3_5_text): the run folder was edited; nothing written")
    cls = Qwen3_5ForConditionalGeneration if getattr(config, "vision_config", None) is not None else Qwen3_5ForCausalLM
    model = cls._from_config(config, dtype=torch.float32)
    for c in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        c.use_cache = True  # the trainer ran without a cache; the export is for generation, which wants it
    what = load_weights(ckpt, model)
    info = json.loads((files / "stage1.json").read_text())

    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        for f in files.iterdir():
            if f.is_file() and f.name not in ("config.json", "stage1.json") and not (tmp / f.name).exists():
                shutil.copy2(f, tmp / f.name)
        has_tokenizer = (tmp / "tokenizer.json").is_file()
        atomic_write_text(tmp / "README.md", _readme(info, ckpt, step_no, what, cls.__name__, config, has_tokenizer))
        # One mode for every file, as the exporting user's umask gives a new file: transformers writes
        # the weights 0600 through a temp file, and the tokenizer/processor files copied from the run
        # keep the job's private 0600 (jobs run under umask 077).
        mask = os.umask(0)
        os.umask(mask)
        for f in tmp.iterdir():
            if f.is_file():
                f.chmod(0o666 & ~mask)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if disk_full(exc):
            raise ExportError(f"cannot write the export next to {out}: {os.strerror(errno.ENOSPC)} "
                              f"({free_space(out.parent)} free); nothing written, {out} is as it was") from None
        raise
    publish_dir(tmp, out)
    return out


def check_destination(out: Path) -> None:
    """DestinationError unless `out` is absent, empty, or an earlier export (replaced, the user's
    other files kept): never a user's own directory, never through a symbolic link."""
    def is_export(d: Path) -> bool:
        readme = d / "README.md"
        return readme.is_file() and readme.read_text(errors="replace").startswith(README_TITLE)

    fs_check_destination(out, is_export)


def _readme(info: dict[str, Any], ckpt: Path, step: int, what: str, cls: str, config: Any,
            has_tokenizer: bool = True) -> str:
    text = config.get_text_config()
    lines = [
        README_TITLE,
        "",
        f"A {cls} (Qwen3.5 hybrid, model shape `{info.get('shape')}`) after {step} steps of stage-1 AR "
        "pretraining on text, images and 3D codebook tokens.",
        "",
        f"- weights: {what}, from `{ckpt}`, saved in fp32",
        f"- vocab: {text.vocab_size} rows = base {info.get('base_vocab')} + 3D codebooks "
        f"{info.get('codebook_sizes')} + {info.get('n_specials')} special tokens, padded to 256",
        f"- asset format (codes per asset, ss/shape/tex): {info.get('asset_lengths')}",
        f"- initialised from: {info.get('init_from') or 'random init'}",
        f"- tokenizer: {info.get('tokenizer')}",
        f"- vision tower trained: {'yes' if info.get('vision') else 'no'}",
        "",
    ]
    if has_tokenizer:
        lines += [f"Load it with `{cls}.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)`; the 3D tokens "
                  "are special tokens named `<|ss_N|>`, `<|shape_N|>`, `<|tex_N|>` between `<|3d_start|>` and "
                  "`<|3d_end|>`."]
    else:  # an export of a run whose model_files predate the byte tokenizer's save: say so, promise nothing
        lines += [f"Load it with `{cls}.from_pretrained(DIR)`. No tokenizer files are included (the run's "
                  "model_files have none): its token ids are the byte-level stand-in's (UTF-8 byte b is id 8 + b)."]
    if not info.get("has_tokenizer") and has_tokenizer:
        lines += ["", "This run used the byte-level stand-in tokenizer (random init, no checkpoint tokenizer), "
                  "saved here as a `tokenizers` byte-level BPE: UTF-8 byte b is id 8 + b, `<bos>` 1, `<eos>` 2."]
    return "\n".join(lines) + "\n"
