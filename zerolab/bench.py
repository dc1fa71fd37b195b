"""Benchmark: zl.DDP beside PyTorch's DistributedDataParallel on the same model and machine.

    python -m zerolab bench                 # GPT "small", 2 ranks
    python -m zerolab bench --quick         # fewer steps, well under 2 minutes
    python -m zerolab bench --size tiny --world-size 4 --reps 5

Each repetition launches fresh processes that build both engines on the same initial weights
and alternate them step by step (interleaved, so a slow moment of the machine hits both),
times every training step (forward, backward with gradient averaging, AdamW
step), and reports the median step time of each engine, their ratio, and for zl.DDP the
fraction of all-reduce time hidden behind backward compute.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from .launch import launch
from .models import GPT, gpt_config, gpt_loss
from .data import CharDataset
from .timeline import comm_intervals, overlap_fraction


def _time_steps(step_fn, warmup, steps):
    for _ in range(warmup):
        step_fn()
    times = []
    for _ in range(steps):
        dist.barrier()   # start together: one step's time includes waiting for the slowest rank
        t = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - t)
    return times


def bench_worker(size: str, batch: int, bucket_mb: float, warmup: int, steps: int):
    """Both engines in the same processes, alternating step by step (which one goes first
    alternates too), so a slow moment of a shared machine hits both alike."""
    from torch.nn.parallel import DistributedDataParallel
    from .ddp import DDP

    rank, n = dist.get_rank(), dist.get_world_size()
    opt = partial(torch.optim.AdamW, lr=3e-4)
    data = CharDataset(gpt_config(size).block_size)

    torch.manual_seed(0)
    eng = DDP(GPT(gpt_config(size)), opt, bucket_mb=bucket_mb, track_peak=False)
    torch.manual_seed(0)
    model = GPT(gpt_config(size))
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    optimizer = opt(ddp.parameters())
    fractions = []

    def zl_step(i):
        _, loss = gpt_loss(eng, data.batch(i, batch, rank, n))
        eng.backward(loss)
        eng.step()
        eng.zero_grad()

    def torch_step(i):
        _, loss = gpt_loss(ddp, data.batch(i, batch, rank, n))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()   # PyTorch's default: set_to_none=True

    times = {"zl": [], "torch": []}
    cpu = {"zl": [], "torch": []}   # CPU seconds this process used (all its threads, gloo's too)
    for i in range(warmup + steps):
        order = [("zl", zl_step), ("torch", torch_step)]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            eng.comm.reset()
            dist.barrier()   # start together: a step lasts until its slowest rank is done
            t, c = time.perf_counter(), time.process_time()
            fn(i)
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
            if name == "zl":   # measured outside the timed region
                fractions.append(overlap_fraction(comm_intervals(eng.comm.records, "bucket"),
                                                  eng.last_backward["compute_end"]))
    return {"times": times, "cpu": cpu, "overlap": statistics.median(fractions[warmup:]),
            "buckets": len(eng.buckets.buckets), "params": sum(p.numel() for p in model.parameters())}


def run(size="small", world_size=2, batch=8, bucket_mb=1.0, reps=3, warmup=3, steps=10, log=print):
    """Repetitions (fresh processes each); returns a summary dict (medians in seconds)."""
    times = {"zl": [], "torch": []}
    cpu = {"zl": [], "torch": []}
    overlaps, info = [], {}
    for rep in range(reps):
        res = launch(bench_worker, world_size, args=(size, batch, bucket_mb, warmup, steps), timeout=300)
        for engine in times:
            # a step is as slow as its slowest rank
            times[engine].extend(max(r["times"][engine][i] for r in res) for i in range(steps))
            cpu[engine].extend(statistics.mean(r["cpu"][engine][i] for r in res) for i in range(steps))
        overlaps.append(statistics.median(r["overlap"] for r in res))
        info = res[0]
        log(f"  rep {rep + 1}/{reps}: zl.DDP {statistics.median(times['zl'][-steps:]) * 1e3:7.2f} ms   "
            f"PyTorch DDP {statistics.median(times['torch'][-steps:]) * 1e3:7.2f} ms")
    zl_t, torch_t = statistics.median(times["zl"]), statistics.median(times["torch"])
    pair = statistics.median(a / b for a, b in zip(times["zl"], times["torch"]))
    return {"size": size, "world_size": world_size, "batch": batch, "bucket_mb": bucket_mb,
            "params": info["params"], "buckets": info["buckets"], "steps": len(times["zl"]),
            "zl_ms": zl_t * 1e3, "torch_ms": torch_t * 1e3, "ratio": zl_t / torch_t,
            "pair_ratio": pair, "overlap": statistics.median(overlaps),
            "zl_cpu_ms": statistics.median(cpu["zl"]) * 1e3, "torch_cpu_ms": statistics.median(cpu["torch"]) * 1e3,
            "cpu_ratio": statistics.median(cpu["zl"]) / statistics.median(cpu["torch"])}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m zerolab bench",
                                description="zl.DDP vs PyTorch DDP: median step time, ratio, overlap")
    p.add_argument("--size", default="small", help="GPT size: nano, tiny, small, medium (default small)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size for both engines")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 repetitions of 6 steps")
    a = p.parse_args(argv)
    if a.quick:
        a.reps, a.steps, a.warmup = 2, 6, 2
    for name in ("world_size", "batch", "reps", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not a.bucket_mb > 0:
        p.error("--bucket-mb must be > 0")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    print(f"zl.DDP vs PyTorch DDP: GPT {a.size!r}, {a.world_size} ranks (gloo), batch {a.batch} per rank, "
          f"buckets of {a.bucket_mb:g} MB, {a.reps} x {a.steps} timed steps")
    t0 = time.perf_counter()
    s = run(a.size, a.world_size, a.batch, a.bucket_mb, a.reps, a.warmup, a.steps)
    main.last = s  # the summary, for callers that want the numbers
    print()
    print("| engine      | median step (ms) | step-time ratio | CPU per step and rank (ms) | CPU ratio |")
    print("|-------------|------------------|-----------------|----------------------------|-----------|")
    print(f"| zl.DDP      | {s['zl_ms']:16.2f} | {s['pair_ratio']:15.3f} | {s['zl_cpu_ms']:26.2f} | {s['cpu_ratio']:9.3f} |")
    print(f"| PyTorch DDP | {s['torch_ms']:16.2f} | {1.0:15.3f} | {s['torch_cpu_ms']:26.2f} | {1.0:9.3f} |")
    print(f"\nstep-time ratio: the median over steps of (zl step / the PyTorch step run right next to "
          f"it), robust to the machine's load changing between repetitions; the ratio of the two "
          f"medians is {s['ratio']:.3f}.")
    print()
    print(f"{s['params']:,} parameters in {s['buckets']} zl buckets; zl.DDP hides {s['overlap']:.0%} of its "
          f"all-reduce time behind backward (median over steps; each all-reduce's end is known "
          f"to within one gradient hook). {time.perf_counter() - t0:.0f} s in all.")
    return 0


if __name__ == "__main__":
    main()
