"""What the bitwise mode costs: step time and bytes beside zl.DDP's default ring all-reduce.

    rows = measure_cost(world_sizes=(2, 4), size="tiny", global_rows=16, num_chunks=8)
    rows[2]["bitwise"]["step_s"]      # {"min", "median", "max"} over the timed steps
                                      # (also "bitwise_interleaved": chunks r, r+N, ...)
    rows[2]["ring"]["bytes_per_step"], rows[2]["ring"]["bytes_closed_form"]
    rows[2]["params"], rows[2]["ring_numel"], rows[2]["bitwise_numel"]   # elements reduced

Where the time goes: the bitwise step runs one forward and backward per chunk (C/N small
ones per rank instead of one on the rank's whole share), adds the chunks in a tree, and adds
across ranks in log2 N point-to-point rounds. The bytes are the ring's: recursive halving
sends (N-1)/N of the gradient per rank, the all-gather (N-1)/N again, as the ring all-reduce's
2 (N-1)/N; the flat vector is padded to a multiple of N * block, so a little more. With
interleaved chunks (ZeRO-2/3's memory) each of the C/N rounds is reduce-scattered: (C/N + 1)
(N-1)/N of the gradient per step, as ZeRO-2 does with gradient accumulation.
All three run in the same launch, their steps taken in turn, so a busy machine slows them all.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.distributed as dist

import zerolab as zl

from ..data import CharDataset
from ..models import GPT, gpt_config, gpt_loss
from .chunks import ChunkPlan
from .trainer import BitwiseDataParallel

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3, foreach=False)


def _spread(times) -> dict:
    return {"min": min(times), "median": statistics.median(times), "max": max(times)}


def cost_worker(size: str, global_rows: int, num_chunks: int, steps: int, warmup: int) -> dict:
    """A rank's worker: zl.DDP and BitwiseDataParallel (chunks in runs, and interleaved) on the
    same GPT, their steps taken in turn."""
    n, r = dist.get_world_size(), dist.get_rank()
    cfg = gpt_config(size)
    data = CharDataset(cfg.block_size)
    torch.manual_seed(0)
    ring = zl.DDP(GPT(cfg), ADAMW)
    torch.manual_seed(0)
    bitwise = BitwiseDataParallel(GPT(cfg), ADAMW, gpt_loss, ChunkPlan(num_chunks, n))
    torch.manual_seed(0)
    interleaved = BitwiseDataParallel(GPT(cfg), ADAMW, gpt_loss, ChunkPlan(num_chunks, n, interleaved=True))

    def ring_step(step):
        _, loss = gpt_loss(ring, data.batch(step, global_rows // n, r, n))
        ring.backward(loss)
        ring.step()
        ring.zero_grad()

    def bitwise_step(step):
        bitwise.train_step(data.global_batch(step, global_rows))

    def interleaved_step(step):
        interleaved.train_step(data.global_batch(step, global_rows))

    engines = {"ring": (ring_step, ring.comm), "bitwise": (bitwise_step, bitwise.comm),
               "bitwise_interleaved": (interleaved_step, interleaved.comm)}
    times = {name: [] for name in engines}
    for step in range(warmup + steps):
        if step == warmup:
            for _, ledger in engines.values():
                ledger.reset()
        for name, (run, _) in engines.items():
            dist.barrier()
            start = time.perf_counter()
            run(step)
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
    out = {name: {"step_s": _spread(times[name]), "bytes_per_step": ledger.bytes() / steps}
           for name, (_, ledger) in engines.items()}
    # closed forms, bytes this rank sends per step: 2 (N-1)/N * S for an all-reduce of S bytes,
    # S being what each engine reduces: DDP's fp32 buckets (the gradient, with the buckets'
    # alignment padding), the bitwise mode's padded flat vector (reduce-scatter + all-gather)
    ring_numel = sum(rec.numel for rec in ring.comm.records if rec.op == "all_reduce") // steps
    out["ring"]["bytes_closed_form"] = 2 * (n - 1) / n * ring_numel * 4
    out["bitwise"]["bytes_closed_form"] = 2 * (n - 1) / n * bitwise.layout.padded * 4
    # interleaved: a reduce-scatter per round (C/N rounds), then one all-gather of the gradient
    rounds = num_chunks // n
    out["bitwise_interleaved"]["bytes_closed_form"] = (rounds + 1) * (n - 1) / n * bitwise.layout.padded * 4
    out["params"] = sum(p.numel() for p in bitwise.layout.params)
    out["ring_numel"], out["bitwise_numel"] = ring_numel, bitwise.layout.padded
    return out


def measure_cost(world_sizes=(2, 4), size: str = "tiny", global_rows: int = 16, num_chunks: int = 8,
                 steps: int = 10, warmup: int = 2) -> dict:
    """{N: {"ring" | "bitwise" | "bitwise_interleaved": {"step_s": {min, median, max}, "bytes_per_step", "bytes_closed_form"},
    "params", "ring_numel", "bitwise_numel"}}, rank 0's view (every rank sends the same bytes)."""
    return {n: zl.launch(cost_worker, n, args=(size, global_rows, num_chunks, steps, warmup))[0]
            for n in world_sizes}
