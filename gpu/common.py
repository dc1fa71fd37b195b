"""What every gpu/ script shares: the machine, the date and the library versions every result file
carries; the memory helpers (settle, state_bytes); and what each rank runs on (compute_device, the
bench's models, the token batches every run draws).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import subprocess
import sys

import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.models import GPTConfig


def _smi(query: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:  # noqa: BLE001 - no nvidia-smi: a CPU machine
        return None


def machine() -> dict:
    """Device name, driver, torch / CUDA / NCCL versions, Python, and today's date (UTC)."""
    cuda = torch.cuda.is_available()
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "device_count": torch.cuda.device_count() if cuda else 0,
        "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
        "compute_capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
        "driver": _smi("driver_version"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
    }
    return info


def bf16_matmul_peak(n: int = 8192, reps: int = 20) -> dict:
    """The measured bf16 dense-matmul rate (FLOP/s): the denominator of MFU (median of `reps`)."""
    if not torch.cuda.is_available():
        return {"flops": None, "note": "no GPU"}
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    t = times[len(times) // 2]
    return {"flops": 2 * n ** 3 / t, "n": n, "median_s": t,
            "note": f"median of {reps} {n}x{n}x{n} bf16 matmuls on random data, after 3 warm-ups"}


def write_json(path: str, payload: dict) -> None:
    """Write a result with the machine record first."""
    out = {"machine": machine(), **payload}
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=False, default=str)
        f.write("\n")


def settle(dev, empty_cache: bool = True) -> int:
    """Bytes the CUDA allocator holds once nothing collectable is left: collect Python's garbage
    (an engine's reference cycles free its buffers only then), wait for the GPU, optionally return
    cached blocks. Every memory figure of gpu/ is taken after it, so none depends on when the
    garbage collector happened to run."""
    gc.collect()
    torch.cuda.synchronize(dev)
    if empty_cache:
        torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(dev)


def state_bytes(engine=None, module=None, optimizer=None) -> int | None:
    """The model states an engine holds, each storage counted once: zerolab's own count
    (engine.memory_report()), else the module's parameters (a DTensor's local shard), their
    gradients and the optimizer's state tensors. Buffers an engine keeps elsewhere (PyTorch DDP's
    gradient buckets) are not reachable from those and not counted; DeepSpeed's flat buffers
    neither, so it gets None."""
    if engine is not None and hasattr(engine, "memory_report"):
        return int(engine.memory_report()["total"])
    if module is None:
        return None
    storages = {}

    def add(t):
        if t is None:
            return
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        storages[(s.device, s.data_ptr())] = s.nbytes()
    for p in module.parameters():
        add(p)
        add(p.grad)
    for state in (optimizer.state.values() if optimizer is not None else ()):
        for v in state.values():
            if torch.is_tensor(v):
                add(v)
    return sum(storages.values())


# ------------------------------------------------------------------ what each rank runs on


def compute_device() -> torch.device:
    """This rank's GPU under NCCL; cuda:0 shared by all ranks under gloo; the CPU without a GPU."""
    if torch.cuda.is_available():
        return zl.device() if zl.device().type == "cuda" else torch.device("cuda", 0)
    return torch.device("cpu")


def backend_name() -> str:
    return str(dist.get_backend())


def bench_cfg(name: str) -> GPTConfig:
    """The models of the GPU bench: GPT-2 medium-like (~406 M params) and GPT-2 small-like (~163 M)."""
    if name == "350m":
        return GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024)
    if name == "124m":
        return GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    if name == "cpu-test":   # for trying the scripts on a CPU
        return GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64)
    raise ValueError(name)


def token_batch(cfg, step, batch, rank, n, dev):
    """Rank `rank`'s `batch` sequences of step `step` (inputs, targets): random tokens, the same global
    batch of batch * n sequences on every rank and in every run, cut by rank."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, cfg.vocab_size, (batch * n, cfg.block_size + 1), generator=g)
    x = x[rank * batch:(rank + 1) * batch]
    return x[:, :-1].to(dev, non_blocking=True), x[:, 1:].to(dev, non_blocking=True)
