"""A tiny chat target to walk regen -> extract -> dflash on CPU: `make sample-target`.

Writes, with nothing downloaded:
- `<out>/model/`: the tiny Qwen3.5 shape (random init) saved with transformers' save_pretrained,
  and a byte-level BPE tokenizer trained here with the `tokenizers` library, with a ChatML chat
  template (its `<|im_end|>` is the end of a turn); AutoModelForCausalLM and AutoTokenizer load it;
- `<out>/chat.jsonl`: conversations (system, user, assistant) in the format regen reads.

The assistant turn repeats the user's words, counting up: learnable and varied, so a drafter
trained on the target's regenerated answers has something to learn. The tests build their
target the same way (tests/dflash_fixtures.py).

    python -m train.common.sample_target --out runs/sample-target [--conversations 64]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from toolkit.fsutil import atomic_write_text

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
    atomic_write_text(path, "".join(json.dumps({"id": f"c{i}", "conversations": conversation(rng, n_words)}) + "\n"
                                    for i in range(n)))
    return path


def make_tokenizer(directory: Path, vocab_size: int = 400) -> Path:
    """Train a byte-level BPE on the sample words and save it as a transformers tokenizer dir."""
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


def make_target(directory: Path, seed: int = 0) -> Path:
    """The tiny stage-1 shape, random init, saved with save_pretrained, its tokenizer beside it."""
    import torch

    from train.stage1.model import build_model

    torch.manual_seed(seed)
    model, _ = build_model("tiny")
    model.save_pretrained(str(directory))
    make_tokenizer(directory)
    return directory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m train.common.sample_target", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/sample-target", help="directory for model/ and chat.jsonl")
    p.add_argument("--conversations", type=int, default=64, help="conversations in chat.jsonl")
    args = p.parse_args(argv)
    if args.conversations < 1:
        print(f"sample_target: error: --conversations must be >= 1, got {args.conversations}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    if out.exists() and not out.is_dir():
        print(f"sample_target: error: --out {out} is a file; give a directory", file=sys.stderr)
        return 2
    there = [p for p in (out / "model", out / "chat.jsonl") if p.exists() or p.is_symlink()]
    if there:  # a model someone may have trained or edited: never replaced without a word
        print(f"sample_target: error: {there[0]} already exists: nothing written; remove it or give another --out "
              "(make sample-target SAMPLE_TARGET_DIR=DIR)", file=sys.stderr)
        return 2
    model = make_target(out / "model")
    chat = write_conversations(out / "chat.jsonl", args.conversations)
    print(f"target:        {model}")
    print(f"conversations: {chat}")
    print(f"next: launch submit regen --preset tiny --arg init_from={model} --arg data={chat} --follow")
    return 0


if __name__ == "__main__":
    sys.exit(main())
