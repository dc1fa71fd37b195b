"""Data that ships with zerolab: a character corpus and a synthetic regression task.

Both are deterministic per (seed, step) and split by rank: the global batch of a step is
the same whatever the world size, and rank r of N gets rows [r*B, (r+1)*B). So N ranks
with per-rank batch B see exactly the batch a single process sees with batch N*B, which
is what every parity test relies on. Nothing is downloaded.
"""

from __future__ import annotations

from importlib import resources

import torch

# A fixed vocabulary (newline + printable ASCII), so it never depends on the text.
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(VOCAB)  # 96
_INDEX = {ch: i for i, ch in enumerate(VOCAB)}


def encode(text: str) -> torch.Tensor:
    """Characters -> token ids. Characters outside the vocabulary become spaces."""
    space = _INDEX[" "]
    return torch.tensor([_INDEX.get(ch, space) for ch in text], dtype=torch.long)


def decode(ids) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


def corpus_text() -> str:
    """The character corpus that ships with the package."""
    return resources.files("zerolab").joinpath("corpus.txt").read_text(encoding="utf-8")


def _check_split(batch_size, rank, world_size):
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size (per rank) must be an int >= 1, got {batch_size!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")


class CharDataset:
    """Random windows of the corpus: inputs x and next-character targets y, each (B, T)."""

    def __init__(self, block_size: int = 64, seed: int = 0, text: str | None = None):
        self.tokens = encode(corpus_text() if text is None else text)
        if block_size < 1 or len(self.tokens) <= block_size + 1:
            raise ValueError(f"block_size must be between 1 and {len(self.tokens) - 2}, got {block_size}")
        self.block_size = block_size
        self.seed = seed

    def global_batch(self, step: int, global_batch_size: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.block_size - 1, (global_batch_size,), generator=g)
        offsets = torch.arange(self.block_size + 1)
        windows = self.tokens[starts[:, None] + offsets]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1):
        """Rank `rank`'s share (batch_size rows) of step `step`'s global batch."""
        _check_split(batch_size, rank, world_size)
        x, y = self.global_batch(step, batch_size * world_size)
        rows = slice(rank * batch_size, (rank + 1) * batch_size)
        return x[rows], y[rows]


class SyntheticRegression:
    """y = tanh(x A) B + noise, with fixed random A, B: a task any small MLP can learn."""

    def __init__(self, d_in: int = 16, d_out: int = 4, seed: int = 0, noise: float = 0.01):
        g = torch.Generator().manual_seed(10_007 + seed)
        self.A = torch.randn(d_in, 2 * d_in, generator=g) / d_in ** 0.5
        self.B = torch.randn(2 * d_in, d_out, generator=g) / (2 * d_in) ** 0.5
        self.d_in, self.seed, self.noise = d_in, seed, noise

    def global_batch(self, step: int, global_batch_size: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.randn(global_batch_size, self.d_in, generator=g)
        y = torch.tanh(x @ self.A) @ self.B + self.noise * torch.randn(global_batch_size, self.B.shape[1], generator=g)
        return x, y

    def batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1):
        _check_split(batch_size, rank, world_size)
        x, y = self.global_batch(step, batch_size * world_size)
        rows = slice(rank * batch_size, (rank + 1) * batch_size)
        return x[rows], y[rows]
