"""Running the benchmark: every engine in the same processes, step by step in a shuffled order,
timed, counted and measured, in several rounds (fresh processes each); `python -m zerolab bench`
is main()."""

from __future__ import annotations

import argparse
import gc
import logging
import math
import random
import sys
import time
import warnings

import torch
import torch.distributed as dist

from ..data import CharDataset
from ..launch import launch
from ..models import GPT, SIZES, gpt_config
from .engines import KINDS, LOOPS, ZEROLAB, build_runners, engine_factories, pytorch_loop_name
from .overhead import format_overhead, measure as measure_overhead
from .report import format_bitwise_bytes, format_ratios, format_table, summarize, targets, verdict_word

GPU_NOTE = "GPU path: not run, no device was available"


def written_bytes() -> int | None:
    """Bytes this process (all its threads) has written: gloo's socket traffic lands here."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def measure_memory(build, data, batch, warmup=2):
    """(held, peak): bytes one engine holds when a step begins, and the most it holds during it.

    Counted by malloc itself (zerolab.memory.MallocTrace) from before the engine is built, so
    every engine is measured the same way, C++ buffers and resized storages included.
    """
    from ..memory import MallocTrace
    rank, n = dist.get_rank(), dist.get_world_size()
    gc.collect()
    with MallocTrace() as trace:
        runner = build()
        for i in range(warmup):
            runner.step(data.batch(i, batch, rank, n))
        b = data.batch(warmup, batch, rank, n)
        dist.barrier()
        trace.mark("step")
        runner.step(b)
        trace.mark("end")
        del runner
        gc.collect()
    return trace.held("step"), trace.peak("step", "end")


def bench_worker(size, batch, bucket_mb, warmup, steps, deepspeed=True, kinds=KINDS, memory=True,
                 compile_models=False, loops=LOOPS, bitwise=True):
    """All engines in the same processes, one step each in turn, in a new shuffled order each step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    # the peers' deprecation notices (DeepSpeed's collectives print one per call) and Dynamo's
    # notes would bury the progress lines: this process prints what the table needs only
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    if compile_models:
        torch._logging.set_logs(dynamo=logging.ERROR, inductor=logging.ERROR)
    data = CharDataset(gpt_config(size).block_size)
    runners, note = build_runners(size, batch, bucket_mb, deepspeed=deepspeed, kinds=kinds,
                                  compile_models=compile_models, loops=loops, bitwise=bitwise)
    times = {r.name: [] for r in runners}
    losses = {}
    for i in range(warmup + steps):
        b = data.batch(i, batch, rank, n)
        # the same order on every rank (seeded by the step), a different one each step
        for r in random.Random(i).sample(runners, len(runners)):
            dist.barrier()   # start together: a step lasts until its slowest rank is done
            t = time.perf_counter()
            losses[r.name] = r.step(b)
            if i >= warmup:
                times[r.name].append(time.perf_counter() - t)
    # one more step per engine, untimed, to measure the bytes it sends
    b = data.batch(warmup + steps, batch, rank, n)
    wrote, ledger = {}, {}
    for r in runners:
        dist.barrier()
        if r.comm is not None:
            r.comm.reset()
        w0 = written_bytes()
        r.step(b)
        w1 = written_bytes()
        wrote[r.name] = None if w0 is None else w1 - w0
        ledger[r.name] = None if r.comm is None else r.comm.bytes()
    rows = [(r.name, r.kind, r.family) for r in runners]
    loop = {r.name: r.loop for r in runners}
    layout = {r.name: r.layout for r in runners if r.layout is not None}
    del runners
    # memory: each engine alone, built inside the allocator trace
    held, peak = {}, {}
    if memory:
        factories = dict(engine_factories(size, batch, bucket_mb, deepspeed=deepspeed, kinds=kinds,
                                          compile_models=compile_models, loops=loops, bitwise=bitwise)[0])
        # measure_memory collects garbage around each engine, and a full collection walks every
        # object the process holds (torch's and DeepSpeed's modules: most of a second each time).
        # Frozen (gc.freeze), what is alive now is left out of those walks: the collector then
        # walks the engines' own objects only, and measures the same bytes in a third of the time
        gc.collect()
        gc.freeze()
        for name, _, _ in rows:
            twin = next((zl for zl in ZEROLAB if pytorch_loop_name(zl) == name), None)
            if twin in held:
                # the same engine through PyTorch's loop holds the same storages and runs the same
                # step: its memory is measured once, through zerolab's loop (saves two builds)
                held[name], peak[name] = held[twin], peak[twin]
                continue
            # measured on a second build: the first in this trace may pay one-off lazy set-up
            # (op and dispatch caches, first-time shapes) that is the process's, not the engine's
            measure_memory(factories[name], data, batch)
            held[name], peak[name] = measure_memory(factories[name], data, batch)
        gc.unfreeze()
    dist.barrier()
    params = sum(p.numel() for p in GPT(gpt_config(size)).parameters())
    return {"rows": rows, "loop": loop, "times": times, "loss": losses, "held": held,
            "peak": peak, "wrote": wrote, "ledger": ledger, "note": note, "params": params, "layout": layout}


def run(size="small", world_size=2, batch=8, bucket_mb=1.0, reps=2, warmup=2, steps=6,
        deepspeed=True, kinds=KINDS, log=print, compile_models=False, memory=True, loops=LOOPS, rounds=None,
        bitwise=True):
    """Launch the benchmark in `rounds` interleaved rounds (`reps`, its older name): each round
    fresh processes in which every engine runs its steps in turn, one step each, in a new
    shuffled order every step, so a busy moment of the machine hits them all. Returns the
    summary dict (zerolab.bench.report.summarize). bitwise: the rows of zl.DDP and zl.ZeRO-2
    with bitwise=True too (left out, with a note, on a world size that is not a power of two,
    and under compile_models)."""
    reps = reps if rounds is None else rounds
    for name, v in (("world_size", world_size), ("batch", batch), ("rounds", reps), ("steps", steps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1; got {v!r}")
    if "floor" not in kinds:
        raise ValueError("kinds must include 'floor': every ratio is taken against it")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"unknown kinds {bad}; choose from {KINDS}")
    if not loops or any(loop not in LOOPS for loop in loops):
        raise ValueError(f"loops must name one or more of {LOOPS}; got {tuple(loops)!r}")
    bitwise_note = bitwise_left_out(bitwise, world_size, compile_models, kinds)
    bitwise = bitwise and bitwise_note is None
    results = []
    for rep in range(reps):
        # memory is measured once, in the last round (each engine built alone, traced)
        res = launch(bench_worker, world_size, timeout=1800 if compile_models else 600,
                     args=(size, batch, bucket_mb, warmup, steps, deepspeed, kinds,
                           memory and rep == reps - 1, compile_models, tuple(loops), bitwise))
        results.append(res)
        if log:
            log(f"  round {rep + 1}/{reps} done")
    s = summarize(results, steps)
    s["results"] = results    # what every rank measured, round by round (the table's raw data)
    s["bitwise_note"] = bitwise_note
    s.update(size=size, world_size=world_size, batch=batch, bucket_mb=bucket_mb, reps=reps, compiled=compile_models)
    return s


def bitwise_left_out(bitwise, world_size, compile_models, kinds) -> str | None:
    """Why the bitwise rows do not run (None: they do)."""
    if not bitwise:
        return "bitwise=True: not requested"
    if not any(k in kinds for k in ("DDP", "ZeRO-2")):
        return "bitwise=True: not run (its rows are of kinds DDP and ZeRO-2, which were left out)"
    if world_size & (world_size - 1):
        return f"bitwise=True: not run ({world_size} ranks: the mode needs a power of two)"
    if compile_models:
        return "bitwise=True: left out of the compiled run"
    return None


def main(argv=None, plot=None):
    """The command line. plot(summary, directory) -> [paths] draws --plot's figures: the book's
    (zerolab.book.bench_plots), which `python -m zerolab bench` passes in; the library never
    imports the book."""
    p = argparse.ArgumentParser(prog="python -m zerolab bench",
                                description="zerolab DDP and ZeRO-1/2/3 beside PyTorch DDP, "
                                            "ZeroRedundancyOptimizer, FSDP2 and DeepSpeed: one table")
    p.add_argument("--size", default="small", choices=sorted(SIZES), help="GPT size (default small)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size for the engines that have one")
    p.add_argument("--rounds", "--reps", dest="reps", type=int, default=3,
                   help="interleaved rounds, fresh processes each: every engine in turn, step by step "
                        "(default 3; medians come with their lowest and highest round)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1 round of 6 timed steps (with --rounds: that many)")
    p.add_argument("--zerolab-loop-only", action="store_true",
                   help="drive zerolab's engines through engine.backward/step only, not PyTorch's loop too")
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out even if installed")
    p.add_argument("--no-bitwise", action="store_true",
                   help="leave out the rows of zl.DDP and zl.ZeRO-2 with bitwise=True")
    p.add_argument("--plot", metavar="DIR", help="write the figures (PNG) into DIR")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every model first (inductor; minutes of compiling), DeepSpeed left out")
    p.add_argument("--no-memory", action="store_true", help="skip the memory columns (each engine built alone)")
    argv_list = list(argv) if argv is not None else sys.argv[1:]
    a = p.parse_args(argv)
    if a.quick:
        rounds_given = any(x.split("=")[0] in ("--rounds", "--reps") for x in argv_list)
        a.reps, a.steps, a.warmup = a.reps if rounds_given else 1, 6, 2
    for name, flag in (("world_size", "world-size"), ("batch", "batch"), ("reps", "rounds"), ("steps", "steps")):
        if getattr(a, name) < 1:
            p.error(f"--{flag} must be >= 1")
    if not (math.isfinite(a.bucket_mb) and a.bucket_mb > 0):
        p.error(f"--bucket-mb must be a finite number > 0, got {a.bucket_mb!r}")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    print(f"GPT {a.size!r}, {a.world_size} ranks (gloo, CPU), batch {a.batch} per rank, fp32 AdamW, "
          f"buckets of {a.bucket_mb:g} MB, {a.reps} interleaved round(s) x {a.steps} timed steps after {a.warmup} warm-up"
          f"{', every model torch.compiled' if a.compile else ''}")
    t0 = time.perf_counter()
    s = run(a.size, a.world_size, a.batch, a.bucket_mb, a.reps, a.warmup, a.steps, deepspeed=not a.no_deepspeed,
            compile_models=a.compile, memory=not a.no_memory,
            loops=("zerolab",) if a.zerolab_loop_only else LOOPS, bitwise=not a.no_bitwise)
    main.last = s  # the summary, for callers that want the numbers
    print()
    print(format_table(s))
    print()
    spread = "below 1e-4" if s["loss_spread"] < 1e-4 else format(s["loss_spread"], ".2e")
    print(f"{s['params']:,} parameters (Ψ). Final losses of the data-parallel engines (zerolab's and its "
          f"peers') agree to {spread}; the floor (local) trains on one rank's batch only, so its loss differs.")
    print(s["note"])
    print(format_bitwise_bytes(s))
    # what zerolab's ledger, flight recorder and watchdog add to each collective: its own measurement
    print(format_overhead(measure_overhead(a.world_size, calls=60 if a.quick else 200, rounds=3 if a.quick else 5)))
    print(GPU_NOTE)
    for text, ok in targets(s):
        print(f"  [{verdict_word(ok, a.reps)}] {text}")
    if a.plot:
        if plot is None:
            p.error("--plot draws the book's figures: run it as python -m zerolab bench --plot DIR")
        paths = plot(s, a.plot)
        print("figures: " + ", ".join(paths))
    print(f"{time.perf_counter() - t0:.0f} s in all.")
    print()
    print(format_ratios(s))   # last: what the run says about zerolab against its peers
    return 0


if __name__ == "__main__":
    main()
