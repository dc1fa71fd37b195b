"""The GPU bench (gpu/bench.py): each engine's step time, the memory it holds and its peak, every
engine built alone on the same model and batches."""

from __future__ import annotations

import time
import traceback

import torch
import torch.distributed as dist

from gpu.common import backend_name, bench_cfg, compute_device, settle, state_bytes, token_batch
from gpu.workers.engines import build
from zerolab.models import gpt_loss

BENCH_ENGINES = ("zl.DDP", "zl.ZeRO-1", "zl.ZeRO-2", "zl.ZeRO-3", "zl.ZeRO-3 prefetch=0",
                 "PyTorch DDP", "FSDP2 reshard=False", "FSDP2 reshard=True",
                 "DeepSpeed ZeRO-1", "DeepSpeed ZeRO-2", "DeepSpeed ZeRO-3")


def bench_worker(cfg_name, batch, bucket_mb, warmup, steps, engines=BENCH_ENGINES):
    """Each engine built ALONE (fresh allocator stats), warmed up, then timed with CUDA events.

    Time: median step (forward, backward, step, zero_grad), synchronised. Memory, every figure taken
    after gpu.common.settle (garbage collected, GPU idle), against the allocator's level when no
    engine is alive: the lower of its level before the engine was built and after it was deleted
    (a previous engine whose buffers are freed only during this one's run moves the first; this
    one's leftovers would move the second; both are recorded, as leftover_bytes and after_bytes,
    beside the level at the bench's start). held: allocated when a step begins (gradients freed by
    zero_grad); peak: torch.cuda.max_memory_allocated over the timed steps; state_bytes: the model
    states counted storage by storage (gpu.common.state_bytes), None where they cannot be reached.
    """
    dev = compute_device()
    cfg = bench_cfg(cfg_name)
    cuda = dev.type == "cuda"
    rows = {}
    start = settle(dev) if cuda else None
    for name in engines:
        row = {"engine": name}
        base = settle(dev) if cuda else None
        try:
            row.update(_timed(name, cfg, batch, bucket_mb, warmup, steps, dev))   # the engine lives only in there
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                       where=traceback.format_exc()[-1200:])
        if cuda:
            after = settle(dev)
            row.update(leftover_bytes=base - start, after_bytes=after - start)
            if row["ok"]:
                empty = min(base, after)
                row.update(held=row["held_abs"] - empty, peak=row["peak_abs"] - empty)
        else:
            row.update(held=None, peak=None)
        rows[name] = row
    return {"backend": backend_name(), "device": str(dev), "rows": rows}


def _timed(name, cfg, batch, bucket_mb, warmup, steps, dev) -> dict:
    """Engine `name` built, warmed up, then timed; what bench_worker's row records of the run. Nothing of
    the engine outlives this call (the loss is returned as a float)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    cuda = dev.type == "cuda"
    run = build(name, cfg, batch, bucket_mb, dev)

    def one(s):
        x, y = token_batch(cfg, s, batch, rank, n, dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=run.autocast):
            _, loss = gpt_loss(run.forward, (x, y))
        run.backward(loss)
        run.step()
        run.zero_grad()
        return loss.item()
    for s in range(warmup):
        one(s)
    dist.barrier()
    held = settle(dev, empty_cache=False) if cuda else None
    state = state_bytes(**run.counted) if run.counted else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for s in range(warmup, warmup + steps):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = one(s)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return dict(ok=True, psi=run.psi, times=times, loss=loss, held_abs=held, state_bytes=state,
                peak_abs=torch.cuda.max_memory_allocated(dev) if cuda else None,
                reserved_peak=torch.cuda.max_memory_reserved(dev) if cuda else None)
