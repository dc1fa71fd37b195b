"""Chapter 9's memory on the GPU (gpu/memsnap.py): the CUDA caching allocator's history over ZeRO-3
steps, and the same step's allocations replayed in zerolab.theory.allocator's model."""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

import zerolab as zl
from gpu.common import backend_name, bench_cfg, compute_device, token_batch
from gpu.workers.engines import OPT
from zerolab.memory import AllocationTracker
from zerolab.models import GPT, gpt_loss
from zerolab.theory import allocator


def memsnap_worker(cfg_name, batch, snapshot_path, checkpoint_activations=True, steps=3):
    """ZeRO-3 bf16 steps under the CUDA allocator's history recorder, and the same step's
    allocation trace (zerolab.memory.AllocationTracker) replayed in chapter 9's allocator model."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = compute_device()
    cuda = dev.type == "cuda"
    cfg = bench_cfg(cfg_name)
    torch.manual_seed(0)
    eng = zl.ZeRO(GPT(cfg).to(dev), OPT, stage=3, precision="bf16", track_peak=False,
                  checkpoint_activations=checkpoint_activations, track_activations=False)

    def one(s):
        _, loss = gpt_loss(eng, token_batch(cfg, s, batch, rank, n, dev))
        eng.backward(loss)
        eng.step()
        eng.zero_grad()
    one(0)                                # first step: optimizer state is created
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        try:   # alloc/free events only: no stack traces (cheap, and a small snapshot)
            torch.cuda.memory._record_memory_history(max_entries=200000, context=None, stacks="python")
        except Exception:  # noqa: BLE001 - older signatures
            torch.cuda.memory._record_memory_history(max_entries=200000)
    for s in range(1, steps):
        one(s)
    out = {"backend": backend_name(), "device": str(dev), "checkpoint_activations": checkpoint_activations}
    if cuda:
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        if snapshot_path:
            with open(snapshot_path, "wb") as f:
                pickle.dump(snap, f)
        out["cuda"] = _recorded(snap, dev)
    # the same step again, followed op by op, replayed in chapter 9's allocator model
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        before_alloc = torch.cuda.memory_allocated(dev)
        before_res = torch.cuda.memory_reserved(dev)
    with AllocationTracker(record_trace=True) as tr:
        one(steps)
    out["model"] = _replayed(tr.trace)
    if cuda:
        torch.cuda.synchronize()
        st = torch.cuda.memory_stats(dev)
        out["traced_step_cuda"] = {"allocated_at_start": before_alloc, "reserved_at_start": before_res,
                                   "allocated_peak": st["allocated_bytes.all.peak"],
                                   "reserved_peak": st["reserved_bytes.all.peak"]}
    with torch.device("meta"):
        out["psi"] = sum(p.numel() for p in GPT(cfg).parameters())
    return out


def _recorded(snap, dev) -> dict:
    """What the CUDA allocator's snapshot says of the recorded steps: its peaks and retries, the
    segments at the end and the free blocks inside them, and the timeline of allocated and reserved
    bytes, event by event."""
    stats = torch.cuda.memory_stats(dev)
    segs = snap["segments"]
    free_blocks = [b["size"] for s_ in segs for b in s_["blocks"] if b["state"] == "inactive"]
    out = {
        "allocated_peak": stats["allocated_bytes.all.peak"], "reserved_peak": stats["reserved_bytes.all.peak"],
        "active_peak": stats["active_bytes.all.peak"],
        "inactive_split_peak": stats["inactive_split_bytes.all.peak"],
        "num_alloc_retries": stats["num_alloc_retries"], "num_ooms": stats["num_ooms"],
        "segments_end": len(segs), "reserved_end": sum(s_["total_size"] for s_ in segs),
        "allocated_end": sum(s_["allocated_size"] for s_ in segs),
        "free_in_segments_end": sum(free_blocks), "largest_free_block_end": max(free_blocks, default=0),
        "free_blocks_end": len(free_blocks),
        "segment_sizes_end": sorted((s_["total_size"] for s_ in segs), reverse=True)[:40],
    }
    # the timeline: allocated bytes after each alloc/free of the recorded steps, and reserved
    tl, alloc, reserved = [], 0, 0
    for ev in snap["device_traces"][dev.index or 0]:
        a, size = ev["action"], ev["size"]
        if a == "alloc":
            alloc += size
        elif a == "free_completed":
            alloc -= size
        elif a == "segment_alloc":
            reserved += size
        elif a == "segment_free":
            reserved -= size
        else:
            continue
        tl.append((alloc, reserved))
    out["timeline"] = tl[:: max(1, len(tl) // 3000)]
    out["timeline_events"] = len(tl)
    out["note"] = ("timeline: allocated bytes (alloc / free_completed) and segment bytes "
                   "(segment_alloc / segment_free) RELATIVE to the start of recording; "
                   "the steps before recording had already reserved segments")
    out["start_allocated"] = None
    return out


def _replayed(trace) -> dict:
    """One step's op-level allocation trace replayed in chapter 9's allocator model, with and
    without moving the long-lived blocks (M_D)."""
    life = allocator.lifetimes(trace)
    longl = allocator.long_lived(trace)
    plain = allocator.replay(trace)
    md = allocator.replay(trace, defragment=longl)
    return {"events": len(trace), "blocks": len(life), "long_lived_blocks": len(longl),
            "without_MD": plain.__dict__ | {"fragmentation": plain.fragmentation},
            "with_MD": md.__dict__ | {"fragmentation": md.fragmentation},
            "note": "zerolab.theory.allocator.replay (best-fit, coalescing, 512-byte rounding) of the "
                    "step's op-level allocation trace; long-lived = alive > 25% of the step or "
                    "past its end (zerolab.theory.allocator.long_lived), the blocks M_D would move"}
