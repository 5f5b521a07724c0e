"""Tiny local stand-ins of a target's files for DFlash data tests: a BPE tokenizer trained here
with `tokenizers` (ChatML template, saved with save_pretrained) and chat conversations.

Nothing is downloaded: the tokenizer loads through transformers' AutoTokenizer from its directory,
exactly as a real target checkpoint's tokenizer does.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "red", "green", "blue", "one", "two", "three", "four",
         "cat", "dog", "fish", "bird", "run", "jump", "swim", "fly"]


def conversation(rng: random.Random, n_words: int = 12) -> list[dict[str, str]]:
    """A user turn of random words; the assistant repeats them, counting up: learnable, varied."""
    words = [rng.choice(WORDS) for _ in range(n_words)]
    return [{"role": "system", "content": "You repeat."},
            {"role": "user", "content": " ".join(words)},
            {"role": "assistant", "content": " ".join(f"{w} {i}" for i, w in enumerate(words))}]


def write_conversations(path: Path, n: int, seed: int = 0, n_words: int = 12) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"id": f"c{i}", "conversations": conversation(rng, n_words)}) + "\n"
                            for i in range(n)))
    return path


def make_tokenizer(directory: Path, vocab_size: int = 400) -> Path:
    """Train a byte-level BPE on the fixture words and save it as a transformers tokenizer dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) + f" {rng.randrange(40)}" for _ in range(30)) for _ in range(200)]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus + ["You repeat. system user assistant\n"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return directory
