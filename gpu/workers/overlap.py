"""Overlap and prefetch on the GPU (gpu/overlap.py), measured by the ledger: chapter 5's three DDPs
and chapter 8's ZeRO-3 with and without prefetch."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gpu.common import backend_name, bench_cfg, compute_device, token_batch
from gpu.workers.engines import OPT
from zerolab.book.timeline import overlap_fraction
from zerolab.engines.ddp import DDP
from zerolab.engines.naive_ddp import NaiveDDP
from zerolab.engines.zero3 import ZeRO3
from zerolab.models import GPT, gpt_loss


def ddp_overlap_worker(cfg_name, batch, bucket_mb=25.0, warmup=2, steps=5, precision="bf16"):
    """Chapter 5's three DDPs (naive, bucketed, overlapped) on CUDA tensors: median step, and in
    the last step how much of the gradient communication ran before backward's compute ended
    (zerolab.book.timeline.overlap_fraction over the ledger's records, host clock)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = compute_device()
    cuda = dev.type == "cuda"
    cfg = bench_cfg(cfg_name)
    out = {"backend": backend_name(), "device": str(dev), "rows": {}}
    for mode in ("naive", "bucketed", "overlapped"):
        torch.manual_seed(0)
        model = GPT(cfg).to(dev)
        eng = (NaiveDDP(model, OPT, precision=precision, track_peak=False) if mode == "naive" else
               DDP(model, OPT, precision=precision, bucket_mb=bucket_mb, track_peak=False,
                   overlap=(mode == "overlapped")))
        times = []
        for i in range(warmup + steps):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            eng.comm.reset()
            t0 = eng.comm.now()
            _, loss = gpt_loss(eng, token_batch(cfg, i, batch, rank, n, dev))
            eng.backward(loss)
            eng.step()
            eng.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(eng.comm.now() - t0)
        lb = eng.last_backward
        comm = [(c.start, c.end, c.tag) for c in eng.comm.records if c.tag.startswith(("bucket", "grad"))]
        times.sort()
        out["rows"][mode] = {"step_s": times[len(times) // 2], "calls": len(comm),
                             "overlap": overlap_fraction(comm, lb["compute_end"]),
                             "wait_after_backward_s": lb["end"] - lb["compute_end"]}
        del eng, model
    return out


def prefetch_worker(cfg_name, batch, warmup=2, steps=8):
    """Chapter 8's prefetch timing on CUDA tensors: ZeRO-3 prefetch=0 and 1 interleaved step by
    step (alternating order), synchronised; the seconds each step spent blocked in all-gather waits."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = compute_device()
    cuda = dev.type == "cuda"
    cfg = bench_cfg(cfg_name)
    engines = {}
    for pf in (0, 1):
        torch.manual_seed(0)
        engines[pf] = ZeRO3(GPT(cfg).to(dev), OPT, precision="bf16", prefetch=pf, track_peak=False)
    times, waits = {0: [], 1: []}, {0: [], 1: []}
    for s in range(warmup + steps):
        b = token_batch(cfg, s, batch, rank, n, dev)
        for pf in ((0, 1) if s % 2 == 0 else (1, 0)):
            eng = engines[pf]
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            w0, t0 = eng.gather_wait_s, time.perf_counter()
            eng.backward(gpt_loss(eng, b)[1])
            eng.step()
            eng.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            if s >= warmup:
                times[pf].append(time.perf_counter() - t0)
                waits[pf].append(eng.gather_wait_s - w0)
    return {"backend": backend_name(), "device": str(dev), "times": times, "waits": waits}
