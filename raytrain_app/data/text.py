"""Text as byte-level token blocks for `task: language_model`.

Every byte is a token (a vocabulary of 256, no tokenizer to train or ship), and a sample is a
block of `block + 1` consecutive tokens: the model reads the first `block` and is scored on
predicting each next one. Files go wholly to training or to evaluation (a document-level split),
so eval text is text the model has never seen. The default corpus is the Python standard
library's own source, which every Python install carries.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path
from typing import Sequence

import torch
from torch.utils.data import Dataset

from raytrain_app.errors import UserError

VOCAB = 256


class TokenBlocks(Dataset):
    """(N, block + 1) token ids held as uint8; a batch is one indexing op, returned as int64."""

    num_classes = VOCAB  # the model's output width: the vocabulary

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i].long()

    def __getitems__(self, idx: Sequence[int]) -> torch.Tensor:
        return self.tokens[torch.as_tensor(idx)].long()


def text(eval_fraction: float, split_seed: int, path: str = "stdlib", pattern: str = "*.py",
         max_bytes: int = 2_000_000, block: int = 128):
    """Files matching `pattern` under `path` ("stdlib": this Python's standard library), drawn in
    a seeded random order until `max_bytes`; the first `eval_fraction` of the bytes are eval files."""
    root = Path(sysconfig.get_paths()["stdlib"] if path == "stdlib" else path)
    files = sorted(root.glob(pattern)) if root.is_dir() else [root] if root.is_file() else []
    files = [f for f in files if f.is_file()]
    if not files:
        raise UserError(f"data: no files match {pattern} under {root}")
    random.Random(split_seed).shuffle(files)
    eval_bytes, train_bytes, budget = bytearray(), bytearray(), max_bytes
    for f in files:
        if budget <= 0:
            break
        content = f.read_bytes()[:budget]
        budget -= len(content)
        (eval_bytes if len(eval_bytes) < eval_fraction * max_bytes else train_bytes).extend(content)
    return blocks(train_bytes, block, "training"), blocks(eval_bytes, block, "eval")


def blocks(data: bytes, block: int, split: str) -> TokenBlocks:
    """Consecutive blocks of block + 1 tokens, each overlapping the next by one (its last target)."""
    n = (len(data) - 1) // block
    if n < 1:
        raise UserError(f"data: the {split} text ({len(data)} bytes) is shorter than one block of {block + 1}")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return TokenBlocks(tokens[: n * block + 1].unfold(0, block + 1, block).clone())
