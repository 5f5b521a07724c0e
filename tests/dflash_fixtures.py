"""Tiny local stand-ins of a target's files for DFlash data tests: a BPE tokenizer trained here
with `tokenizers` (ChatML template, saved with save_pretrained) and chat conversations.

Nothing is downloaded: the tokenizer loads through transformers' AutoTokenizer from its directory,
exactly as a real target checkpoint's tokenizer does. The pieces are the user-facing sample
target's (`make sample-target`, train/common/sample_target.py), so the tests walk what it ships.
"""

from __future__ import annotations

from train.common.sample_target import CHATML, WORDS, conversation, make_tokenizer, write_conversations

__all__ = ["CHATML", "WORDS", "conversation", "make_tokenizer", "write_conversations"]
