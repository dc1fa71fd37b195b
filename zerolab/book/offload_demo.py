"""Chapter 13's runs: what offload moves, where the bytes live, and a model 4x a memory budget.

Workers for zl.launch (they run in fresh processes). Every number is measured: bytes from the
engines' ledgers (engine.transfers, engine.comm) and from /proc (the disk I/O thread's rchar
and wchar, the process's VmRSS and VmHWM); model sizes from parameter counts.
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import time
from functools import partial

import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.data import CharDataset
from zerolab.models import GPT, gpt_config, gpt_init, gpt_loss

OPT = partial(torch.optim.AdamW, lr=1e-3, eps=1e-6, weight_decay=0.1)


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS: resident now; VmHWM: the peak so far)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> bool:
    """Reset VmHWM to the current VmRSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def shard_numel(model, n) -> int:
    """Psi_pad / N for ZeRO-3 on the GPT: every unit (block, and the root) padded on its own."""
    psi = sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    return sum(math.ceil(b / n) for b in blocks) + math.ceil((psi - sum(blocks)) / n)


def return_freed_memory() -> bool:
    """Make glibc give every large freed block back to the OS at once, so that VmRSS and VmHWM
    measure what is LIVE. By default glibc raises its mmap threshold after the first large free
    (up to 32 MiB) and then serves blocks of that size from its heaps, which it keeps: a run
    that pages a unit in and out a thousand times would show every byte it ever allocated.
    (mallopt(M_MMAP_THRESHOLD, 64 KiB), as MALLOC_MMAP_THRESHOLD_=65536 in the environment.)"""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, 64 * 1024))     # M_MMAP_THRESHOLD = -3
    except (OSError, AttributeError):
        return False


def meta_gpt(n_layer, n_embd, block_size=16):
    cfg = gpt_config("nano", n_layer=n_layer, n_embd=n_embd, n_head=4, block_size=block_size, bias=False)
    with torch.device("meta"):
        return GPT(cfg), cfg


def train_measured(mode, offload_dir=None, *, n_layer=24, n_embd=256, steps=4, prefetch=1, batch=1):
    """Train the GPT (built on the meta device: the full model never exists in memory) with ZeRO-3
    in `mode` ("memory" | "optimizer" | "disk"); measure resident-set growth and step times."""
    rank, n = dist.get_rank(), dist.get_world_size()
    return_freed_memory()
    model, cfg = meta_gpt(n_layer, n_embd)
    data = CharDataset(cfg.block_size)
    batches = [data.batch(s, batch, rank, n) for s in range(steps)]
    kw = {"memory": {}, "optimizer": {"offload": "optimizer"},
          "disk": {"offload": "disk", "offload_dir": offload_dir}}[mode]
    base = status_kib("VmRSS")
    reset_peak()
    eng = zl.ZeRO(model, OPT, stage=3, prefetch=prefetch, init_fn=gpt_init(n_layer), **kw)
    hwm = [(status_kib("VmHWM") - base) * 1024]
    losses, times, fb_times, waits, fb_waits, busy, io = [], [], [], [], [], [], []
    pager = getattr(eng, "pager", None)
    timeline = None
    for s in range(steps):
        if pager and s == steps - 1:    # the last step's file I/O and waits, for a timeline
            pager.trace = []
        w0, b0 = (pager.wait_s, pager.busy_s) if pager else (0.0, 0.0)
        io0 = eng.disk_io() if pager else None
        t0 = time.perf_counter()
        loss = gpt_loss(eng, batches[s])[1]
        eng.backward(loss)
        t1 = time.perf_counter()
        w1 = pager.wait_s if pager else 0.0
        eng.step()
        eng.zero_grad()
        if pager:
            pager.flush()               # the step's writes belong to the step
        times.append(time.perf_counter() - t0)
        fb_times.append(t1 - t0)
        hwm.append((status_kib("VmHWM") - base) * 1024)
        losses.append(loss.item())
        if pager and pager.trace is not None:
            timeline = {"start": t0, "backward_end": t1, "end": t0 + times[-1], "events": pager.trace}
            pager.trace = None
        if pager:
            io1 = eng.disk_io()
            waits.append(pager.wait_s - w0)
            fb_waits.append(w1 - w0)
            busy.append(pager.busy_s - b0)
            io.append((io1["read"] - io0["read"], io1["written"] - io0["written"]))
    psi = sum(p.numel() for p in model.parameters())
    out = {"mode": mode, "psi": psi, "k": shard_numel(model, n), "losses": losses, "times": times,
           "growth": (status_kib("VmHWM") - base) * 1024, "hwm": hwm, "states": 16 * psi // n,
           "fb_times": fb_times, "disk_wait": waits, "fb_disk_wait": fb_waits, "disk_busy": busy, "disk_io": io,
           "transfers": [b // steps for b in (eng.transfers.bytes("d2h"), eng.transfers.bytes("h2d"))]
           if mode != "memory" else [0, 0],
           "network": eng.comm.bytes() // steps, "memory": eng.memory_report(), "prefetch": prefetch,
           "timeline": timeline}
    if pager:
        pager.close()
        shutil.rmtree(pager.directory, ignore_errors=True)   # this rank's files: hundreds of MB
    return out


def budget_worker(offload_dir, n_layer=24, n_embd=256, steps=3):
    """The headline: disk offload first (so nothing the in-memory run allocated inflates its
    measurement), then the same run in memory, in one process. Returns both."""
    disk = train_measured("disk", os.path.join(offload_dir, "disk"), n_layer=n_layer, n_embd=n_embd,
                          steps=steps)
    memory = train_measured("memory", n_layer=n_layer, n_embd=n_embd, steps=steps)
    return {"disk": disk, "memory": memory}


def checkpoint_worker(root, n_layer=8, n_embd=256):
    """A checkpoint of a run from disk, saved and loaded within a budget 4x smaller than the model
    states: resident-set growth (VmHWM after - VmRSS before) of the save and of the load into a
    fresh engine, what the checkpoint directory holds, and the next step's loss of the saving
    engine and of the loading one."""
    from zerolab import checkpoint
    rank, n = dist.get_rank(), dist.get_world_size()
    return_freed_memory()
    data = CharDataset(16)
    ckpt = os.path.join(root, "ckpt")
    out = {"losses": [], "growth": {}}
    for which in ("save", "load"):
        model, _ = meta_gpt(n_layer, n_embd)
        eng = zl.ZeRO(model, OPT, stage=3, init_fn=gpt_init(n_layer), offload="disk",
                      offload_dir=os.path.join(root, which))
        if which == "save":
            eng.backward(gpt_loss(eng, data.batch(0, 1, rank, n))[1])
            eng.step()
            eng.zero_grad()
        base = status_kib("VmRSS")
        reset_peak()
        (checkpoint.save if which == "save" else checkpoint.load)(eng, ckpt)
        out["growth"][which] = max(0, status_kib("VmHWM") - base) * 1024   # (RSS may fall meanwhile)
        if which == "save":             # which files are the engine's own (hard links)
            mine = [f for f in os.listdir(ckpt) if f.endswith(".bin") and f"-{rank:05d}-unit" in f]
            out["linked"] = sum(os.path.samefile(os.path.join(ckpt, f), eng.pager.path(f.split("-", 4)[4][:-4]))
                                for f in mine)
            out["files"] = len(mine)
            sizes = {f: os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)}
            out["bin_bytes"] = sum(v for f, v in sizes.items() if f.endswith(".bin"))
            out["pt_bytes"] = sum(v for f, v in sizes.items() if f.endswith(".pt"))
        loss = gpt_loss(eng, data.batch(1, 1, rank, n))[1]
        eng.backward(loss)
        eng.step()
        out["losses"].append(loss.item())
        eng.pager.close()
        shutil.rmtree(eng.pager.directory, ignore_errors=True)
    out["states"] = 16 * sum(p.numel() for p in model.parameters()) // n
    out["k"] = shard_numel(model, n)
    return out


def modes_worker(offload_dir, n_layer=24, n_embd=256, steps=3):
    """Chapter 13's table: the same training in every mode, one after the other in one process
    (with return_freed_memory, each run's resident-set growth is its own): offload="disk" with
    prefetch 1 and 0, offload="optimizer", and in memory."""
    runs = {}
    for name, mode, prefetch in (("disk", "disk", 1), ("disk, prefetch=0", "disk", 0),
                                 ("optimizer", "optimizer", 1), ("memory", "memory", 1)):
        runs[name] = train_measured(mode, os.path.join(offload_dir, name.replace(", ", "-").replace("=", "")),
                                    n_layer=n_layer, n_embd=n_embd, steps=steps, prefetch=prefetch)
    return runs


def bytes_worker(offload_dir):
    """Bytes per step (the second step: the first has no optimizer state to read) of the nano
    GPT in bf16 at N ranks: device<->host copies, disk reads and writes, and the network, for
    offload="optimizer" at stages 1-3 and offload="disk" at stage 3, with memory_report's
    device / host split and the tensors the optimizer holds state for (each has a 4-byte step
    count). Beside them the closed forms, from parameter counts."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    out = {}
    for stage, mode in ((1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "disk")):
        model = GPT(gpt_config("nano", bias=False))
        data = CharDataset(model.cfg.block_size)
        kw = {"offload": mode}
        if mode == "disk":
            kw["offload_dir"] = os.path.join(offload_dir, f"stage{stage}")
        eng = zl.ZeRO(model, OPT, stage=stage, precision="bf16", bucket_mb=25.0, **kw)
        for s in range(2):
            io0 = eng.disk_io() if mode == "disk" else None
            eng.transfers.reset()
            eng.comm.reset()
            eng.backward(gpt_loss(eng, data.batch(s, 2, rank, n))[1])
            eng.step()
            eng.zero_grad()
            io1 = eng.disk_io() if mode == "disk" else None
        psi = sum(p.numel() for p in model.parameters())
        k = shard_numel(model, n) if stage == 3 else math.ceil(psi / n)
        out[(stage, mode)] = {
            "k": k, "psi": psi,
            "d2h": eng.transfers.bytes("d2h"), "h2d": eng.transfers.bytes("h2d"),
            "read": io1["read"] - io0["read"] if io0 else 0,
            "written": io1["written"] - io0["written"] if io0 else 0,
            "network": eng.comm.bytes(), "memory": eng.memory_report(), "tensors": len(eng.optimizer.state),
            "files": files_bytes(eng.pager.directory) if mode == "disk" else 0}
    return out


def closed_bytes(k: int, mode: str, c: int, g: int) -> dict:
    """The closed forms of what one rank moves per step (one micro-batch), k elements in its shard,
    c bytes per element of the compute dtype, g of the reduced gradient: d2h = g k, h2d = c k, and
    from disk read = (2c + 2g + 12) k, written = (c + g + 12) k (fp32 master and Adam's moments)."""
    out = {"d2h": g * k, "h2d": c * k, "read": 0, "written": 0}
    if mode == "disk":
        out.update(read=(2 * c + 2 * g + 12) * k, written=(c + g + 12) * k)
    return out


def files_bytes(directory) -> int:
    """Bytes in this rank's offload files (the .bin files; a .tmp is a write in progress)."""
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".bin"))
