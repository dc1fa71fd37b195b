"""In which dtype does a gradient all-reduce add? (chapter 1)

    zl.launch(all_reduce_fp16, 3)   # every rank: its fp16 tensor, summed by gloo
    compare(results)                # against the same sum accumulated in fp32, rounded once

A sum inside one kernel (torch.sum of an fp16 tensor, a matrix multiply) keeps its running
total in fp32 and rounds once at the end. A collective does not: gloo and NCCL add the chunks
arriving from other ranks into the tensor itself, in its own dtype, so an fp16 all-reduce over N
ranks rounds to fp16 after each of its N - 1 additions. The inputs here are exact fp16 numbers
of mixed magnitudes, built from integers so that every machine builds the same ones.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ..runtime.comm import Ledger


def inputs(rank: int, numel: int = 4096) -> torch.Tensor:
    """Rank `rank`'s fp16 tensor: m * 2^e with |m| < 2^11 and e in [-14, 0], all exact in fp16."""
    g = torch.Generator().manual_seed(1000 + rank)
    m = torch.randint(-2047, 2048, (numel,), generator=g).double()
    e = torch.randint(-14, 1, (numel,), generator=g).double()
    return (m * torch.pow(2.0, e)).to(torch.float16)


def all_reduce_fp16(numel: int = 4096) -> dict:
    """All-reduce this rank's fp16 inputs through the ledger (gloo on CPU); return the sum."""
    x = inputs(dist.get_rank(), numel)
    Ledger().all_reduce(x)
    return {"dtype": str(x.dtype), "sum": x}


def compare(results: list, numel: int = 4096) -> dict:
    """What the collective returned against two references computed here, in one process:
    the sum accumulated exactly (float64) and rounded once to fp16, as an fp32
    accumulator nearly always gives, and every order of fp16 additions."""
    world = len(results)
    xs = [inputs(r, numel) for r in range(world)]
    got = results[0]["sum"]
    once = sum(x.double() for x in xs).to(torch.float16)       # exact in float64, rounded once
    some_order = torch.zeros(numel, dtype=torch.bool)
    for order in itertools.permutations(range(world)):
        acc = xs[order[0]].clone()
        for r in order[1:]:
            acc = acc + xs[r]                                # fp16 + fp16, rounded to fp16
        some_order |= acc == got
    return {"world": world, "numel": numel, "dtype": results[0]["dtype"],
            "ranks agree": all(torch.equal(r["sum"], got) for r in results),
            "differ from the exact sum rounded once": int((got != once).sum()),
            "match an fp16 order": int(some_order.sum())}
