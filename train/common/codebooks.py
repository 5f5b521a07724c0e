"""3D codebook tokens appended to a text vocabulary.

Stage 1 predicts discrete 3D tokens from three codebooks: sparse structure (SS), shape and
texture. One asset is 1,728 SS codes (a 12^3 grid) + 2,048 shape codes + 2,048 texture codes =
5,824 codebook tokens (the per-asset LENGTHS), and each codebook has 8,192 entries (its VOCAB
SIZE). Both are per model shape and per job (``CodebookConfig``); a length of None accepts assets
whose length varies. Each codebook gets a contiguous block of token ids after the base text
vocabulary, followed by the boundary and task special tokens:

    [0, base_vocab)                      text tokens (Qwen3.5: 248,320)
    [ss_offset, +ss)                     <|ss_0|> ... <|ss_8191|>
    [shape_offset, +shape)               <|shape_0|> ...
    [tex_offset, +tex)                   <|tex_0|> ...
    [special_offset, +len(specials))     boundary/task tokens
    [used, padded_vocab)                 unused rows, never produced by the tokenizer

``padded_vocab`` rounds the used size up to a multiple of ``vocab_multiple`` (256): the lm_head
GEMM and the cross-entropy then work on tile-aligned shapes (bf16 tensor-core tiles are multiples
of 64/128), the vocab dimension splits evenly over up to 256 tensor-parallel ranks, and the
embedding's row count stays a multiple of 8 that torch's allocator and NCCL like. The unused rows
cost <0.1% of the parameters.

For the Qwen3.5 shapes: 248,320 + 3 x 8,192 + 16 specials = 272,912 used, padded to 273,152.
The ``tiny`` shape uses a 4,096-token base vocabulary and scaled-down codebooks and lengths,
through the same code. The names (``<|ss_17|>``, ``<|3d_start|>``) are what a checkpoint's
tokenizer gets as special tokens at exactly these ids (train.stage1.tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# torch is imported where a tensor is made: `launch submit` parses a config (shapes, codebook
# sizes) without it.

TASKS = ("gen_img", "gen_txt", "und", "replay_img", "replay_text")
CODEBOOK_NAMES = ("ss", "shape", "tex")


def default_specials() -> tuple[str, ...]:
    boundaries = ["<|3d_start|>", "<|3d_end|>"]
    for name in CODEBOOK_NAMES:
        boundaries += [f"<|{name}_start|>", f"<|{name}_end|>"]
    return tuple(boundaries + [f"<|task_{t}|>" for t in TASKS] + ["<|image_ref|>", "<|text_ref|>", "<|pad_3d|>"])


@dataclass(frozen=True)
class CodebookConfig:
    ss: int = 8192  # codebook vocab sizes: entries per codebook
    shape: int = 8192
    tex: int = 8192
    # codes per asset in each codebook (ss, shape, tex); None: any length (assets that vary)
    lengths: tuple[int | None, int | None, int | None] = (1728, 2048, 2048)
    specials: tuple[str, ...] = field(default_factory=default_specials)
    vocab_multiple: int = 256

    @property
    def sizes(self) -> dict[str, int]:
        return {"ss": self.ss, "shape": self.shape, "tex": self.tex}

    def check_asset(self, arrays: dict[str, np.ndarray]) -> None:
        """ValueError (one line) unless each codebook's codes have its length and lie in [0, size).

        ``arrays``: codebook name -> 1-D integer numpy array.
        """
        for name, length in zip(CODEBOOK_NAMES, self.lengths, strict=True):
            arr = arrays[name]
            size = self.sizes[name]
            if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.size == 0 or not np.issubdtype(
                    arr.dtype, np.integer):
                raise ValueError(f"{name} codes must be a non-empty 1-D integer array")
            if length is not None and arr.size != length:
                raise ValueError(f"{name} has {arr.size} codes, the asset format wants {length}")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= size:
                raise ValueError(f"{name} codes out of range [0, {size}): found [{lo}, {hi}]")


def parse_lengths(text: str) -> tuple[int | None, int | None, int | None]:
    """"1728,2048,2048" or "any" (all three) or "any,2048,any" -> per-codebook lengths."""
    parts = [p.strip() for p in text.split(",")]
    if parts == ["any"]:
        parts = ["any"] * 3
    if len(parts) != 3:
        raise ValueError(f"asset lengths must be 3 comma-separated numbers or 'any' (ss,shape,tex), got {text!r}")
    out: list[int | None] = []
    for p in parts:
        if p == "any":
            out.append(None)
        elif p.isdigit() and int(p) > 0:
            out.append(int(p))
        else:
            raise ValueError(f"asset length {p!r} must be a positive integer or 'any' (in {text!r})")
    return out[0], out[1], out[2]


def parse_sizes(text: str) -> tuple[int, int, int]:
    """"8192,8192,8192" or one number for all three -> codebook vocab sizes (ss, shape, tex)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 1:
        parts = parts * 3
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"codebook sizes must be 1 or 3 comma-separated positive integers (ss,shape,tex), got {text!r}")
    return int(parts[0]), int(parts[1]), int(parts[2])


def code_token_name(codebook: str, code: int) -> str:
    return f"<|{codebook}_{code}|>"


class CodebookVocab:
    """Token-id layout of the three codebooks and the special tokens after ``base_vocab``."""

    def __init__(self, base_vocab: int, config: CodebookConfig | None = None):
        self.config = config or CodebookConfig()
        self.base_vocab = base_vocab
        self.sizes = self.config.sizes
        self.offsets: dict[str, int] = {}
        offset = base_vocab
        for name in CODEBOOK_NAMES:
            self.offsets[name] = offset
            offset += self.sizes[name]
        self.special_offset = offset
        self.special_ids = {tok: offset + i for i, tok in enumerate(self.config.specials)}
        self.used_vocab = offset + len(self.config.specials)
        m = self.config.vocab_multiple
        self.padded_vocab = -(-self.used_vocab // m) * m

    def codes_to_tokens(self, codebook: str, codes: torch.Tensor | list[int]) -> torch.Tensor:
        import torch

        codes = torch.as_tensor(codes, dtype=torch.long)
        size = self._size(codebook)
        if codes.numel() and (codes.min() < 0 or codes.max() >= size):
            raise ValueError(f"{codebook} codes must lie in [0, {size}), got [{int(codes.min())}, {int(codes.max())}]")
        return codes + self.offsets[codebook]

    def tokens_to_codes(self, codebook: str, tokens: torch.Tensor | list[int]) -> torch.Tensor:
        import torch

        tokens = torch.as_tensor(tokens, dtype=torch.long)
        lo, hi = self.offsets[codebook], self.offsets[codebook] + self._size(codebook)
        if tokens.numel() and (tokens.min() < lo or tokens.max() >= hi):
            raise ValueError(f"tokens are not {codebook} codebook tokens (ids must lie in [{lo}, {hi}))")
        return tokens - lo

    def codebook_of(self, token_id: int) -> str | None:
        """Which codebook a token id belongs to, or None for text/special/unused ids."""
        for name in CODEBOOK_NAMES:
            if self.offsets[name] <= token_id < self.offsets[name] + self.sizes[name]:
                return name
        return None

    def encode_3d(self, ss: list[int], shape: list[int], tex: list[int]) -> list[int]:
        """One 3D asset as a token sequence: <3d_start> <ss_start> ss.. <ss_end> ... <3d_end>."""
        sp = self.special_ids
        out = [sp["<|3d_start|>"]]
        for name, codes in zip(CODEBOOK_NAMES, (ss, shape, tex), strict=True):
            out.append(sp[f"<|{name}_start|>"])
            out += self.codes_to_tokens(name, codes).tolist()
            out.append(sp[f"<|{name}_end|>"])
        out.append(sp["<|3d_end|>"])
        return out

    def decode_3d(self, tokens: list[int]) -> dict[str, list[int]]:
        """Inverse of :meth:`encode_3d`: the codes of each codebook, in order."""
        out: dict[str, list[int]] = {name: [] for name in CODEBOOK_NAMES}
        for tok in tokens:
            name = self.codebook_of(tok)
            if name is not None:
                out[name].append(tok - self.offsets[name])
        return out

    def token_names(self) -> list[tuple[int, str]]:
        """(id, name) of every codebook and special token, in id order: what a tokenizer adds."""
        out = [(self.offsets[name] + c, code_token_name(name, c)) for name in CODEBOOK_NAMES
               for c in range(self.sizes[name])]
        return out + [(i, tok) for tok, i in self.special_ids.items()]

    def _size(self, codebook: str) -> int:
        if codebook not in self.sizes:
            raise ValueError(f"unknown codebook {codebook!r}; valid: {', '.join(CODEBOOK_NAMES)}")
        return self.sizes[codebook]


def extend_embeddings(model: torch.nn.Module, new_vocab: int) -> int:
    """Grow ``model``'s input embeddings (and an untied lm_head) to ``new_vocab`` rows.

    New rows are the mean of the existing rows: a new token then starts as "an average token",
    so the first logits over it are neither huge nor random, and training does not begin with a
    loss spike from the extended part. Returns the old vocab size.
    """
    import torch

    with torch.no_grad():
        return _extend_embeddings(model, new_vocab)


def _extend_embeddings(model: torch.nn.Module, new_vocab: int) -> int:
    old_emb = model.get_input_embeddings()
    old_vocab = old_emb.weight.shape[0]
    if new_vocab < old_vocab:
        raise ValueError(f"new vocab {new_vocab} is smaller than the current {old_vocab}")
    if new_vocab == old_vocab:
        return old_vocab
    old_head = model.get_output_embeddings()
    head_mean = None
    tied = old_head is not None and old_head.weight is old_emb.weight
    if old_head is not None and not tied:
        head_mean = old_head.weight.mean(0)
    emb_mean = old_emb.weight.mean(0)
    model.resize_token_embeddings(new_vocab, mean_resizing=False)
    model.get_input_embeddings().weight[old_vocab:] = emb_mean
    new_head = model.get_output_embeddings()
    if head_mean is not None and new_head is not None:
        new_head.weight[old_vocab:] = head_mean
    return old_vocab
