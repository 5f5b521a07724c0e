"""3D codebook tokens appended to a text vocabulary.

Stage 1 predicts discrete 3D tokens from three codebooks: sparse structure (SS, 1728 codes),
shape (2048) and texture (2048). Each codebook gets a contiguous block of token ids after the base
text vocabulary, followed by the boundary and task special tokens:

    [0, base_vocab)                      text tokens (Qwen3.5: 248,320)
    [ss_offset, +ss)                     <ss_0> ... <ss_1727>
    [shape_offset, +shape)               <shape_0> ...
    [tex_offset, +tex)                   <tex_0> ...
    [special_offset, +len(specials))     boundary/task tokens
    [used, padded_vocab)                 unused rows, never produced by the tokenizer

``padded_vocab`` rounds the used size up to a multiple of ``vocab_multiple`` (256): the lm_head
GEMM and the cross-entropy then work on tile-aligned shapes (bf16 tensor-core tiles are multiples
of 64/128), the vocab dimension splits evenly over up to 256 tensor-parallel ranks, and the
embedding's row count stays a multiple of 8 that torch's allocator and NCCL like. The unused rows
cost <0.1% of the parameters.

For the full model: 248,320 + 1,728 + 2,048 + 2,048 + 18 specials = 254,162, padded to 254,208.
(The issue's "about 272k" does not follow from these three codebooks; a config with more codes
gives a bigger vocab through the same code path.) The ``tiny`` preset uses a 4,096-token base
vocabulary and scaled-down codebooks, through the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TASKS = ("gen_img", "gen_txt", "und", "replay_img", "replay_text")
CODEBOOK_NAMES = ("ss", "shape", "tex")


def default_specials() -> tuple[str, ...]:
    boundaries = ["<|3d_start|>", "<|3d_end|>"]
    for name in CODEBOOK_NAMES:
        boundaries += [f"<|{name}_start|>", f"<|{name}_end|>"]
    return tuple(boundaries + [f"<|task_{t}|>" for t in TASKS] + ["<|image_ref|>", "<|text_ref|>", "<|pad_3d|>"])


@dataclass(frozen=True)
class CodebookConfig:
    ss: int = 1728
    shape: int = 2048
    tex: int = 2048
    specials: tuple[str, ...] = field(default_factory=default_specials)
    vocab_multiple: int = 256


class CodebookVocab:
    """Token-id layout of the three codebooks and the special tokens after ``base_vocab``."""

    def __init__(self, base_vocab: int, config: CodebookConfig | None = None):
        self.config = config or CodebookConfig()
        self.base_vocab = base_vocab
        self.sizes = {"ss": self.config.ss, "shape": self.config.shape, "tex": self.config.tex}
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
        codes = torch.as_tensor(codes, dtype=torch.long)
        size = self._size(codebook)
        if codes.numel() and (codes.min() < 0 or codes.max() >= size):
            raise ValueError(f"{codebook} codes must lie in [0, {size}), got [{int(codes.min())}, {int(codes.max())}]")
        return codes + self.offsets[codebook]

    def tokens_to_codes(self, codebook: str, tokens: torch.Tensor | list[int]) -> torch.Tensor:
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

    def _size(self, codebook: str) -> int:
        if codebook not in self.sizes:
            raise ValueError(f"unknown codebook {codebook!r}; valid: {', '.join(CODEBOOK_NAMES)}")
        return self.sizes[codebook]


@torch.no_grad()
def extend_embeddings(model: torch.nn.Module, new_vocab: int) -> int:
    """Grow ``model``'s input embeddings (and an untied lm_head) to ``new_vocab`` rows.

    New rows are the mean of the existing rows: a new token then starts as "an average token",
    so the first logits over it are neither huge nor random, and training does not begin with a
    loss spike from the extended part. Returns the old vocab size.
    """
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
