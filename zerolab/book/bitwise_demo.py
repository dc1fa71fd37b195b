"""Chapter 5's bitwise section: the same training on 1, 2, 4 and 8 ranks, in two modes.

    runs = world_size_runs((1, 2, 4, 8))
    runs["bits"]["default"][4]["head.weight"]   # {"numel", "elements", "bits"} against 1 rank
    runs["equal"]["bitwise"][8]                 # True: every tensor torch.equal to 1 rank's

The workers are zerolab.bitwise.drift's: zl.DDP as it ships ("default") and BitwiseDataParallel
("bitwise"), both fp32 AdamW on GPT-nano from the same weights and the same global batches.
This module only keeps the weights long enough to compare them both ways: bit by bit
(zerolab.bitwise.differing_bits) and with torch.equal.
"""

from __future__ import annotations

import torch

import zerolab as zl
from zerolab.bitwise import differing_bits
from zerolab.bitwise.drift import bitwise_weights, default_ddp_weights


def world_size_runs(world_sizes=(1, 2, 4, 8), size: str = "nano", steps: int = 3, global_rows: int = 16,
                    num_chunks: int = 16) -> dict:
    """{"bits" | "equal": {"default" | "bitwise": {N: ...}}}, each N against world_sizes[0]."""
    modes = {"default": (default_ddp_weights, (size, steps, global_rows)),
             "bitwise": (bitwise_weights, (size, steps, global_rows, num_chunks))}
    out = {"bits": {}, "equal": {}}
    for mode, (worker, args) in modes.items():
        weights = {n: zl.launch(worker, n, args=args)[0] for n in world_sizes}
        first = weights[world_sizes[0]]
        out["bits"][mode] = {n: differing_bits(weights[n], first) for n in world_sizes}
        out["equal"][mode] = {n: all(torch.equal(weights[n][k], first[k]) for k in first) for n in world_sizes}
    return out


def totals(per_tensor: dict) -> dict:
    """One run's differing_bits summed over its tensors: {"numel", "elements", "bits"}."""
    return {key: sum(row[key] for row in per_tensor.values()) for key in ("numel", "elements", "bits")}
