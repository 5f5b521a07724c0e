"""Load a checkpoint directory's config, tokenizer and image processor from LOCAL files only.

transformers' own loaders (``AutoConfig``, ``AutoTokenizer``, ``AutoImageProcessor``) with
``local_files_only=True``: nothing is downloaded, and a directory that lacks a piece gives one
line naming the directory and the missing file (:class:`HFLocalError`), instead of transformers'
multi-line hub advice. The file checks come first because transformers' messages for a missing
tokenizer ("Couldn't instantiate the backend tokenizer ...") do not say which file was expected.

Used by the stage-1 trainer (its checkpoint's tokenizer and processor) and by DFlash (the
target's tokenizer and chat template).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# transformers is imported where a loader runs: a config check without --init-from (launch
# submit's parse of the arguments) needs none of it.

# Either is enough for a fast tokenizer; vocab.json + merges.txt is the older BPE pair.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


class HFLocalError(ValueError):
    """A local checkpoint directory that cannot be loaded; the message is one line."""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def checkpoint_dir(path: str | os.PathLike[str], what: str = "checkpoint") -> Path:
    p = Path(path)
    if not p.is_dir():
        raise HFLocalError(f"{what} {p}: not a directory (give a local transformers checkpoint directory)")
    return p


def check_init_from(path: str | os.PathLike[str] | None, flag: str = "--init-from",
                    model_types: tuple[str, ...] | None = None) -> None:
    """At parse time (so `launch submit` says it in one line, before anything is queued): the
    checkpoint a run starts from is a local transformers directory whose config.json loads, of
    one of `model_types` (when given), and whose safetensors files are whole (their headers read
    and cover each file; a truncated copy fails here, not as a traceback in the job)."""
    if not path:
        return
    from train.common.config import ConfigError

    try:
        config = load_config(path)
        if model_types and getattr(config, "model_type", None) not in model_types:
            raise HFLocalError(f"checkpoint {Path(path)}: a {getattr(config, 'model_type', None)!r} model "
                               f"({', '.join(getattr(config, 'architectures', None) or ['no architectures'])}), "
                               f"not {' or '.join(map(repr, model_types))}: this trainer cannot start from it")
        check_weight_files(path)
    except HFLocalError as exc:
        said = str(exc).removeprefix(f"checkpoint {Path(path)}: ").removeprefix(f"checkpoint {Path(path)} ")
        raise ConfigError(f"{flag} {path}: {said}") from None


PICKLED_WEIGHTS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


def check_weight_files(path: str | os.PathLike[str]) -> None:
    """Every *.safetensors file of DIR has a header that reads and covers the file, and an index
    (model.safetensors.index.json) names only files that are there. Header reads only: cheap."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            named = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError) as exc:
            raise HFLocalError(f"checkpoint {p}: {index.name} does not load ({_one_line(exc)})") from None
        absent = sorted(n for n in named if not (p / n).is_file())
        if absent:
            raise HFLocalError(f"checkpoint {p}: {index.name} names {absent[0]}, which is not there "
                               f"({len(absent)} file(s) missing)")
    for file in sorted(p.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise HFLocalError(f"checkpoint {p}: {file.name} is damaged or truncated ({_one_line(exc)})") from None
    pickled = sorted(f.name for pattern in PICKLED_WEIGHTS for f in p.glob(pattern))
    if pickled and not any(p.glob("*.safetensors")):
        raise HFLocalError(f"checkpoint {p}: its weights are pickles ({', '.join(pickled[:2])}), and only safetensors "
                           "weights are loaded (unpickling a file can run code): save it with "
                           "save_pretrained(..., safe_serialization=True) where it came from")


def has_tokenizer(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return any((p / f).is_file() for f in TOKENIZER_FILES) or (p / "vocab.json").is_file()


def has_image_processor(path: str | os.PathLike[str]) -> bool:
    return any((Path(path) / f).is_file() for f in IMAGE_PROCESSOR_FILES)


def load_config(path: str | os.PathLike[str]) -> Any:
    """``AutoConfig`` of DIR/config.json."""
    p = checkpoint_dir(path)
    if not (p / "config.json").is_file():
        training = ("a training checkpoint (MANIFEST.json)" if (p / "MANIFEST.json").is_file() else
                    "a training run's directory" if (p / "checkpoints").is_dir() else None)
        if training:
            raise HFLocalError(f"{p} is {training}, not a transformers checkpoint directory: export it first "
                               "(`launch export`)")
        raise HFLocalError(f"checkpoint {p}: no config.json there (give a local transformers checkpoint directory)")
    try:
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HFLocalError(f"checkpoint {p}: config.json does not load ({_one_line(exc)})") from None


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """``AutoTokenizer`` of DIR (a fast tokenizer: tokenizer.json, or vocab.json + merges.txt)."""
    p = checkpoint_dir(path)
    if not has_tokenizer(p):
        raise HFLocalError(f"checkpoint {p}: no tokenizer there (expected {' or '.join(TOKENIZER_FILES)})")
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        raise HFLocalError(f"checkpoint {p}: its tokenizer does not load ({_one_line(exc)})") from None


def load_image_processor(path: str | os.PathLike[str]) -> Any:
    """``AutoImageProcessor`` of DIR (preprocessor_config.json or processor_config.json)."""
    p = checkpoint_dir(path)
    if not has_image_processor(p):
        raise HFLocalError(
            f"checkpoint {p}: no image processor there (expected {' or '.join(IMAGE_PROCESSOR_FILES)})")
    try:
        from transformers import AutoImageProcessor
        return AutoImageProcessor.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        raise HFLocalError(f"checkpoint {p}: its image processor does not load ({_one_line(exc)})") from None


def chat_template(path: str | os.PathLike[str]) -> str:
    """The tokenizer's chat template (DFlash renders conversations with it)."""
    tok = load_tokenizer(path)
    template = getattr(tok, "chat_template", None)
    if not template:
        raise HFLocalError(f"checkpoint {path}: its tokenizer has no chat template (chat_template.jinja or "
                           "tokenizer_config.json's chat_template)")
    return template


def has_vision_tower(path: str | os.PathLike[str]) -> bool:
    """DIR/config.json names a vision tower (a conditional-generation checkpoint); False if unreadable
    (the loaders above then say what is wrong)."""
    try:
        return "vision_config" in json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
