"""Profiler traces on the GPU (gpu/profile_steps.py): each engine's kernels in a profiled step."""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from gpu.common import backend_name, bench_cfg, compute_device, token_batch
from gpu.workers.engines import build
from zerolab.models import gpt_loss


def profile_worker(cfg_name, batch, trace_dir, engines=("zl.DDP", "zl.ZeRO-3", "zl.ZeRO-3 prefetch=0", "PyTorch DDP")):
    """Two profiled steps per engine (after two warm-ups); returns each kernel's (name, stream,
    start, duration) for the last step, and the ledger's records, for a summary in the parent."""
    dev = compute_device()
    cfg = bench_cfg(cfg_name)
    res = {"backend": backend_name(), "device": str(dev), "engines": {}}
    for name in engines:
        res["engines"][name] = _profiled(name, cfg, batch, trace_dir, dev)   # the engine lives only in there
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return res


def _profiled(name, cfg, batch, trace_dir, dev) -> dict:
    """Engine `name` (zerolab's or a PyTorch peer, buckets of 25 MB) warmed up two steps, then two steps
    profiled: the CUDA kernels and the CPU range of the last one (rank 0 also writes the Chrome trace)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    cuda = dev.type == "cuda"
    run = build(name, cfg, batch, 25.0, dev)

    def one(s):
        x, y = token_batch(cfg, s, batch, rank, n, dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=run.autocast):
            _, loss = gpt_loss(run.forward, (x, y))
        run.backward(loss)
        run.step()
        run.zero_grad()
    for s in range(2):
        one(s)
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for s in range(2, 4):
            with torch.profiler.record_function(f"step{s}"):
                one(s)
        if cuda:
            torch.cuda.synchronize()
    if trace_dir and rank == 0:
        prof.export_chrome_trace(os.path.join(trace_dir, name.replace(" ", "_").replace("=", "") + ".json"))
    events = []
    steps = []
    for e in prof.events():
        if e.name == "step3" and e.device_type.name == "CPU":
            steps.append((e.time_range.start, e.time_range.end))
        if e.device_type.name == "CUDA":
            events.append((e.name[:120], getattr(e, "device_resource_id", 0), e.time_range.start,
                           e.time_range.end - e.time_range.start))
    return {"kernels": events, "step_cpu_range": steps[:1]}
