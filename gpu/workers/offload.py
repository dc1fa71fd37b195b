"""ZeRO-R's activation options on the GPU (gpu/offload.py), and the PCIe copy rates they ride on."""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

import zerolab as zl
from gpu.common import backend_name, bench_cfg, compute_device, token_batch
from gpu.workers.engines import OPT
from zerolab.models import GPT, gpt_loss
from zerolab.zero_r.tensor_parallel import TensorParallelGPT


def pcie_bandwidth(nbytes=1 << 30, reps=5):
    """Pinned host <-> device copy rates (bytes/s), median of `reps` after one warm-up."""
    if not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("host_to_device", dev, host), ("device_to_host", host, dev)):
        times = []
        for i in range(reps + 1):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src, non_blocking=True)
            e.record()
            e.synchronize()
            if i:
                times.append(s.elapsed_time(e) / 1e3)
        times.sort()
        out[name] = nbytes / times[len(times) // 2]
    return out


OFFLOAD_CONFIGS = {"no checkpointing": {}, "checkpointing": {"checkpoint_activations": True},
                   "P_a": {"checkpoint_activations": True, "partition_activations": True},
                   "P_a+cpu (offload)": {"checkpoint_activations": True, "partition_activations": True,
                                         "offload_activations": True}}


def offload_worker(cfg_name, batch, warmup=2, steps=5, stage=2):
    """ZeRO-2 bf16 with ZeRO-R's activation options: step time, peak memory, bytes offloaded."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = compute_device()
    cuda = dev.type == "cuda"
    cfg = bench_cfg(cfg_name)
    out = {"backend": backend_name(), "device": str(dev), "world_size": n,
           "pcie": pcie_bandwidth() if cuda and rank == 0 else None, "rows": {}}
    for name, kw in OFFLOAD_CONFIGS.items():
        if n == 1 and kw.get("partition_activations"):
            continue          # P_a needs a model-parallel group (mp >= 2)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        try:
            row = _offload_row(kw, cfg, batch, warmup, steps, stage, dev)   # the engine lives only in there
        except Exception as e:  # noqa: BLE001
            row = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        out["rows"][name] = row
    return out


def _offload_row(kw, cfg, batch, warmup, steps, stage, dev) -> dict:
    """One row of offload_worker: ZeRO-`stage` with the activation options `kw`, warmed up, then timed
    step by step; the peak above the level before the engine was built, and the bytes offloaded a step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    cuda = dev.type == "cuda"
    base = torch.cuda.memory_allocated(dev) if cuda else None
    torch.manual_seed(0)
    if n == 1:
        mesh, model = None, GPT(cfg)
    else:                     # all ranks in one mp group: tensor parallel blocks
        mesh = zl.Mesh(dp=1, mp=n)
        model = TensorParallelGPT.from_dense(GPT(cfg), mesh)
    eng = zl.ZeRO(model.to(dev), OPT, stage=stage, precision="bf16", track_peak=False,
                  mesh=mesh, track_activations=False, **kw)
    del model
    ck = getattr(eng, "checkpointing", None)
    sent = []

    def one(s):
        # the mp ranks of a group see the same sequences (dp = 1 here: all of them)
        dp_rank, dp = (rank, n) if mesh is None else (mesh.dp_rank, mesh.dp)
        _, loss = gpt_loss(eng, token_batch(cfg, s, batch, dp_rank, dp, dev))
        sent.append(getattr(ck, "offloaded_bytes", 0) if ck is not None else 0)   # after this forward
        eng.backward(loss)
        eng.step()
        eng.zero_grad()
    for s in range(warmup):
        one(s)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for s in range(warmup, warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        one(s)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return dict(ok=True, step_ms=sorted(times)[len(times) // 2] * 1e3, times=times,   # in step order
                peak=(torch.cuda.max_memory_allocated(dev) - base) if cuda else None,
                offloaded_bytes_per_step=sent[-1] - sent[-2])   # the counter only grows
