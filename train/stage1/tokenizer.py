"""Stage-1 tokenization: text, images and 3D assets -> token ids of the extended vocabulary.

Two tokenizers, one interface (what train.stage1.data calls):

* :class:`CheckpointTokenizer` -- with ``--init-from DIR``: DIR's own tokenizer (``AutoTokenizer``,
  local files) for text, DIR's image processor for images, and the image placeholder / vision
  start/end ids of DIR's config. The codebook, boundary and task tokens are added to that
  tokenizer as special tokens at exactly the ids of the extended embedding
  (train.common.codebooks.CodebookVocab); when the checkpoint's ``vocab_size`` exceeds the
  tokenizer's length, the gap is filled with reserved tokens first, so ids line up. Decoding a
  packed row then shows the 3D tokens by name (``<|ss_17|>``). An export of a stage-1 run already
  holds these tokens; they are checked, not added again.
* :class:`ByteTokenizer` -- only for random-init shapes without a checkpoint (the CPU demo): text
  is UTF-8 bytes, and without a vision tower an image is 16 colour stand-in tokens.

:func:`build_tokenizer` picks one and checks, before any model is built, that DIR has a
tokenizer, that its vocab matches the base or the extended size, and that its image token ids are
known to its tokenizer (one-line :class:`TokenizerError`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from tokenizers import AddedToken

from train.common import hf_local
from train.common.codebooks import CodebookConfig, CodebookVocab
from train.common.shapes import ModelShape
from train.stage1.vision import ImageEncoder, check_processor, image_processor_for_shape, open_rgb

IMAGE_GRID = 4  # byte tokenizer's image stand-in: IMAGE_GRID x IMAGE_GRID cells
IMAGE_LEVELS = 4  # per channel -> 64 image tokens
RESERVED = "<|reserved_{}|>"  # fills the gap between a tokenizer's length and its model's vocab


class TokenizerError(ValueError):
    """A tokenizer/checkpoint mismatch; one line, raised before the model is built."""


class Stage1Tokenizer:
    """What the data pipeline needs from a tokenizer (both implementations below)."""

    vocab: CodebookVocab
    encoder: ImageEncoder | None  # images -> vision-tower inputs; None: no vision tower
    name: str  # for the log header
    bos_ids: list[int]
    eos_id: int
    pad_id: int
    vision_ids: dict[str, int]  # image_token_id, video_token_id, vision_start_token_id, vision_end_token_id

    def task_token(self, task: str) -> int:
        return self.vocab.special_ids[f"<|task_{task}|>"]

    def codes3d(self, ss: Any, shape: Any, tex: Any) -> list[int]:
        """<|3d_start|> <|ss_start|> ss.. <|ss_end|> <|shape_start|> .. <|tex_end|> <|3d_end|>."""
        return self.vocab.encode_3d(list(ss), list(shape), list(tex))

    @property
    def codebooks(self) -> CodebookConfig:
        return self.vocab.config

    @property
    def fingerprint(self) -> str:
        """What the token ids mean, as a short hash (a resume compares it): the base vocabulary
        (the byte stand-in's layout, or the checkpoint tokenizer's token -> id map) and the
        3D/special tokens' ids."""
        hf = getattr(self, "hf", None)
        base = sorted(hf.get_vocab().items()) if hf is not None else [type(self).__name__, self.vocab.base_vocab]
        text = json.dumps([base, sorted(self.vocab.special_ids.items())], separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def can_tokenize_images(self) -> bool:
        return self.encoder is not None

    def text(self, s: str) -> list[int]:
        raise NotImplementedError

    def image_standin(self, path: Path) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError


class ByteTokenizer(Stage1Tokenizer):
    """Byte-level text + image stand-in in the base vocabulary, for random-init shapes only.

    Base-vocabulary ids: [<pad> <bos> <eos> <img> </img> <|image_pad|> <|video_pad|> <|endoftext|>]
    [256 bytes] [64 image stand-ins]; task/3D tokens from ``vocab``.

    `<|endoftext|>` (never emitted by the run) is there for the export: transformers loads a
    `qwen3_5` checkpoint's tokenizer as its Qwen3_5Tokenizer whatever tokenizer_config.json names,
    and that class makes `<|endoftext|>` its unknown token, adding it past the last row if the
    vocabulary lacks it (an id the model has no embedding for).
    """

    SPECIALS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<img>", "</img>", "<|image_pad|>", "<|video_pad|>",
                                 "<|endoftext|>")
    BYTE_BASE = 8
    IMAGE_BASE = BYTE_BASE + 256

    def __init__(self, vocab: CodebookVocab, encoder: ImageEncoder | None = None) -> None:
        needed = self.IMAGE_BASE + IMAGE_LEVELS**3
        if vocab.base_vocab < needed:
            raise TokenizerError(f"base vocab {vocab.base_vocab} too small for the byte tokenizer (needs {needed})")
        self.vocab = vocab
        self.encoder = encoder
        self.name = "byte-level stand-in (random init, no checkpoint tokenizer)"
        ids = {t: i for i, t in enumerate(self.SPECIALS)}
        self.bos_ids, self.eos_id, self.pad_id = [ids["<bos>"]], ids["<eos>"], ids["<pad>"]
        self.vision_ids = {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
                           "vision_start_token_id": ids["<img>"], "vision_end_token_id": ids["</img>"]}

    @property
    def can_tokenize_images(self) -> bool:
        return True  # without a vision tower, as colour stand-ins

    def text(self, s: str) -> list[int]:
        return [self.BYTE_BASE + b for b in s.encode("utf-8")]

    def image_standin(self, path: Path) -> list[int]:
        cells = np.asarray(open_rgb(path).resize((IMAGE_GRID, IMAGE_GRID), Image.BOX), dtype=np.int64)
        q = cells * IMAGE_LEVELS // 256  # [g, g, 3] in 0..LEVELS-1
        codes = (q[..., 0] * IMAGE_LEVELS + q[..., 1]) * IMAGE_LEVELS + q[..., 2]
        return [self.IMAGE_BASE + int(c) for c in codes.reshape(-1)]

    def to_hf(self) -> Any:
        """This tokenizer as a real `tokenizers` one (a PreTrainedTokenizerFast, so the export's
        `AutoTokenizer.from_pretrained(DIR)` encodes text exactly as the run did): a byte-level BPE
        without merges (one token per UTF-8 byte, at BYTE_BASE + byte), the specials, image
        stand-ins and 3D tokens as special tokens at their ids, every other row of the embedding a
        reserved token, so that any id the model generates decodes."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from tokenizers.pre_tokenizers import ByteLevel
        from transformers import PreTrainedTokenizerFast

        names = {i: t for i, t in enumerate(self.SPECIALS)}
        names.update({self.IMAGE_BASE + c: f"<|image_standin_{c}|>" for c in range(IMAGE_LEVELS**3)})
        names.update(dict(self.vocab.token_names()))
        byte_chars = ByteLevel.alphabet()  # the 256 printable stand-ins of GPT-2's byte-level BPE
        to_char = _bytes_to_unicode()
        assert set(to_char.values()) == set(byte_chars)
        vocab = {to_char[b]: self.BYTE_BASE + b for b in range(256)}
        specials = []
        for i in range(self.vocab.padded_vocab):
            if self.BYTE_BASE <= i < self.IMAGE_BASE:
                continue
            name = names.get(i, RESERVED.format(i))
            vocab[name] = i
            specials.append(AddedToken(name, special=True, normalized=False))
        tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens(specials)
        return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                       clean_up_tokenization_spaces=False)

    def decode(self, ids: list[int]) -> str:
        names = {i: t for i, t in self.vocab.token_names()}
        out = []
        for i in ids:
            if i in names:
                out.append(names[i])
            elif i < len(self.SPECIALS):
                out.append(self.SPECIALS[i])
            elif self.BYTE_BASE <= i < self.IMAGE_BASE:
                out.append(chr(i - self.BYTE_BASE))
            else:
                out.append(f"<{i}>")
        return "".join(out)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which tokenizers' ByteLevel pre-tokenizer applies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


class CheckpointTokenizer(Stage1Tokenizer):
    """A checkpoint's own tokenizer, extended with the codebook/special tokens at their ids."""

    def __init__(self, hf: Any, vocab: CodebookVocab, encoder: ImageEncoder | None,
                 vision_ids: dict[str, int], where: str) -> None:
        self.hf = hf
        self.vocab = vocab
        self.encoder = encoder
        self.vision_ids = vision_ids
        self.name = f"{where} ({type(hf).__name__}, {len(hf)} tokens incl. the 3D ones)"
        if hf.eos_token_id is None:
            raise TokenizerError(f"checkpoint {where}: its tokenizer has no eos token")
        self.eos_id = int(hf.eos_token_id)
        self.pad_id = int(hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id)
        self.bos_ids = [] if hf.bos_token_id is None else [int(hf.bos_token_id)]

    def text(self, s: str) -> list[int]:
        # split_special_tokens: a "<|ss_5|>" or "<|im_end|>" typed in a caption stays text.
        return list(self.hf(s, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)


def extend_hf_tokenizer(hf: Any, vocab: CodebookVocab, where: str) -> None:
    """Add reserved gap tokens and the codebook/special tokens to ``hf`` at the vocab's ids."""
    names = vocab.token_names()
    if hf.convert_tokens_to_ids(names[0][1]) is not None and names[0][1] in hf.get_vocab():
        _check_ids(hf, names, where)  # an export of a stage-1 run: already extended
        return
    n = len(hf)
    if n > vocab.base_vocab:
        raise TokenizerError(f"checkpoint {where}: its tokenizer has {n} tokens, more than the model's base vocab "
                             f"{vocab.base_vocab}")
    gap = [RESERVED.format(i) for i in range(n, vocab.base_vocab)]
    hf.add_tokens([AddedToken(t, special=True, normalized=False) for t in gap + [t for _, t in names]],
                  special_tokens=True)
    _check_ids(hf, names, where)


def _check_ids(hf: Any, names: list[tuple[int, str]], where: str) -> None:
    got = hf.convert_tokens_to_ids([t for _, t in names])
    for (want, tok), have in zip(names, got, strict=True):
        if have != want:
            raise TokenizerError(f"checkpoint {where}: tokenizer has {tok} at id {have}, the extended vocab "
                                 f"needs it at {want}")


def _vision_ids(hf_config: Any, hf: Any, where: str) -> dict[str, int]:
    ids = {}
    n = len(hf)
    added = getattr(hf, "added_tokens_decoder", {})
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        value = getattr(hf_config, key, None)
        if value is None:
            raise TokenizerError(f"checkpoint {where}: its config.json has no {key}")
        name = hf.convert_ids_to_tokens(int(value)) if 0 <= int(value) < n else None
        if name is None or name.startswith(RESERVED.split("{")[0]):  # none, or a gap filler of ours
            raise TokenizerError(f"checkpoint {where}: its {key} {value} is unknown to its tokenizer")
        if int(value) not in added:  # an ordinary text piece: a tokenizer of another model
            raise TokenizerError(f"checkpoint {where}: its {key} {value} is {name!r}, not one of its tokenizer's "
                                 "special tokens (config.json and tokenizer do not belong together)")
        ids[key] = int(value)
    return ids


def build_tokenizer(shape: ModelShape, init_from: str | Path | None, vision: bool,
                    codebooks: CodebookConfig | None = None) -> Stage1Tokenizer:
    """The run's tokenizer: the checkpoint's (extended) with ``init_from``, else the byte stand-in.

    ``vision``: images go through the vision tower (the checkpoint's image processor, or the
    shape's); without it a checkpoint tokenizer cannot tokenize images (the data refuses image
    tasks), the byte stand-in uses colour tokens.
    """
    vocab = CodebookVocab(shape.base_vocab, codebooks or shape.codebooks)
    if init_from is None:
        encoder = None
        if vision:
            if shape.vision is None:
                raise TokenizerError("this model shape has no vision tower; use --vision off")
            encoder = ImageEncoder(image_processor_for_shape(shape.vision), bucket=shape.vision.size_bucket)
        return ByteTokenizer(vocab, encoder)

    where = str(init_from)
    try:
        hf_config = hf_local.load_config(init_from)
        text_cfg = getattr(hf_config, "text_config", None) or hf_config
        if text_cfg.vocab_size not in (vocab.base_vocab, vocab.padded_vocab):
            raise TokenizerError(
                f"checkpoint {where}: vocab_size {text_cfg.vocab_size} matches neither the model shape's base vocab "
                f"{vocab.base_vocab} nor its extended vocab {vocab.padded_vocab} (wrong --shape, or other codebooks?)")
        hf = hf_local.load_tokenizer(init_from)
        extend_hf_tokenizer(hf, vocab, where)
        encoder, vision_ids = None, {}
        if vision:
            if getattr(hf_config, "vision_config", None) is None:
                raise TokenizerError(f"checkpoint {where}: no vision tower in its config.json; use --vision off")
            vision_ids = _vision_ids(hf_config, hf, where)
            processor = hf_local.load_image_processor(init_from)
            check_processor(processor, hf_config.vision_config, f"checkpoint {where}")
            bucket = shape.vision.size_bucket if shape.vision is not None else 0
            unit = int(processor.patch_size) * int(processor.merge_size)
            encoder = ImageEncoder(processor, bucket=bucket if bucket % unit == 0 else 0)
    except hf_local.HFLocalError as exc:
        raise TokenizerError(str(exc)) from None
    except ValueError as exc:
        if isinstance(exc, TokenizerError):
            raise
        raise TokenizerError(str(exc)) from None
    return CheckpointTokenizer(hf, vocab, encoder, vision_ids, where)
