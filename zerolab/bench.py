"""Benchmark: every zerolab engine beside its PyTorch (and DeepSpeed) peers, one table.

    python -m zerolab bench                 # GPT "small", 2 ranks
    python -m zerolab bench --quick         # one repetition of a few steps, under 2 minutes
    python -m zerolab bench --plot figs/    # also write the figures chapter 10 shows
    python -m zerolab bench --compile       # every model torch.compile'd (inductor) first

Engines, all fp32 with AdamW on the same model, data and processes:

    kind    zerolab        peers
    floor   zl.DDP alone   (on a mesh of dp=1: each rank steps the same flat optimizer as DDP
                           on its per-rank batch, with no communication at all)
    DDP     zl.DDP         PyTorch DistributedDataParallel
    ZeRO-1  zl.ZeRO(1)     ZeroRedundancyOptimizer (+ DDP), DeepSpeed stage 1
    ZeRO-2  zl.ZeRO(2)     FSDP2 reshard_after_forward=False, DeepSpeed stage 2
    ZeRO-3  zl.ZeRO(3)     FSDP2 reshard_after_forward=True, DeepSpeed stage 3
            (and zl.ZeRO(3, prefetch=0): the same engine without prefetch, to show what it buys)

DeepSpeed runs only when it is installed and can start on this machine; otherwise the table
says why. Every engine that has buckets gets the same size (bucket_mb): zerolab's, PyTorch
DDP's bucket_cap_mb and DeepSpeed's reduce/all-gather buckets (deepspeed_config). Every rank
builds every engine from the same seed and runs them in turn step by step, in a new shuffled
order each step (interleaved, so a slow moment of the machine hits them all
alike; shuffled, not rotated, so no engine always runs right after the same other one and
inherits, say, the allocator state it left behind).

What each column measures:
  step time    median over timed steps of the slowest rank's time for one step
               (forward, backward, optimizer step, zero_grad); in brackets, with several
               repetitions, the lowest and highest of the repetitions' medians. Each
               repetition runs in fresh processes: the bracket is the run-to-run noise, and
               a difference inside it is not a finding (the same for the two ratios below)
  vs floor     median over steps of (engine step / floor step of the same step)
  vs best peer median over steps of (engine / fastest peer of the same kind), zerolab rows only
  held, peak   bytes this rank held when a step began, and the most it held at any moment of
               the step: everything the engine allocated since it was built (model, optimizer
               state, gradients, communication buffers, activations), counted by malloc
               after every op (zerolab.memory.MallocTrace). Each engine is built alone for
               this, in the last repetition, so no engine's memory is counted for another.
  bytes/step   bytes this rank wrote to gloo's sockets during one step, read from the
               operating system (/proc/self/io), so it is measured the same way for every engine
  ledger       zerolab only: the bytes its ledger books for the step under the ring model
               (gloo implements reduce-scatter with an all-reduce, so the wire carries more)
  final loss   the last step's loss, mean over ranks; all distributed engines must agree
"""

from __future__ import annotations

import argparse
import os
import random
import time
from functools import partial

import torch
import torch.distributed as dist

from .bench_report import COUNT_COLUMNS, TIMING_COLUMNS, format_table, summarize, targets
from .data import CharDataset
from .launch import launch
from .models import GPT, gpt_config, gpt_loss

KINDS = ("floor", "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
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


class Runner:
    """One engine: what it is, and a function that runs one training step (returns the loss)."""

    def __init__(self, name, kind, family, step, comm=None):
        self.name, self.kind, self.family = name, kind, family
        self.step, self.comm = step, comm


def _zl_runner(name, kind, engine):
    def step(batch):
        _, loss = gpt_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        return loss.item()
    return Runner(name, kind, "zerolab", step, engine.comm)


def _torch_runner(name, kind, family, model, optimizer):
    def step(batch):
        _, loss = gpt_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()
    return Runner(name, kind, family, step)


def deepspeed_config(stage, batch, bucket_mb):
    """DeepSpeed's config for one stage, with the same bucket size as every other engine.

    zerolab's bucket_mb counts MiB of fp32 (the dtype communicated here); DeepSpeed's bucket
    sizes count ELEMENTS, and default to 5e8 (reduce_bucket_size, allgather_bucket_size) and 5e7
    (stage3_prefetch_bucket_size): buffers of gigabytes, sized for GPUs, which would swamp the
    memory column of a model of a few MB (deepspeed/runtime/zero/config.py).
    """
    elements = max(1, int(bucket_mb * 2 ** 20 / 4))
    zero = {"stage": stage, "reduce_bucket_size": elements}
    if stage in (1, 2):
        zero["allgather_bucket_size"] = elements        # the parameter all-gather after the step
    else:
        zero["stage3_prefetch_bucket_size"] = elements  # stage 3 gathers by this one instead
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
            "zero_optimization": zero, "steps_per_print": 10 ** 9, "zero_allow_untested_optimizer": True}


def quiet_deepspeed():
    """DeepSpeed logs to stdout with a timestamp on every line: keep only its errors, so what
    a run prints is the same from one run to the next."""
    import logging
    ds_logger = logging.getLogger("DeepSpeed")
    ds_logger.setLevel(logging.ERROR)
    for handler in ds_logger.handlers:
        handler.setLevel(logging.ERROR)


def _deepspeed_factories(make_model, lr, batch, bucket_mb, stages=(1, 2, 3)):
    """DeepSpeed engines when the package is installed and imports here; else (name, reason)."""
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
    except Exception as e:  # not installed, or cannot import on this machine
        return [], f"DeepSpeed: not run ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"
    quiet_deepspeed()

    def make(stage):
        model = make_model()
        cfg = deepspeed_config(stage, batch, bucket_mb)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)

        def step(b):
            _, loss = gpt_loss(eng, b)
            eng.backward(loss)
            eng.step()
            return loss.item()
        return Runner(f"DeepSpeed ZeRO-{stage}", f"ZeRO-{stage}", "DeepSpeed", step)
    return [(f"DeepSpeed ZeRO-{s}", partial(make, s)) for s in stages], "DeepSpeed: ran stages " + \
        ", ".join(str(s) for s in stages) + f" with buckets of {bucket_mb:g} MB like the other engines"


def engine_factories(size, batch, bucket_mb, lr=3e-4, deepspeed=True, kinds=KINDS, compile_models=False):
    """[(name, make)] for every engine of the table, and a note on DeepSpeed.

    make() builds the engine on its own copy of the same initial model and returns its Runner.
    The timing phase builds them all; the memory phase builds one at a time, so each one's
    allocations are counted alone. compile_models: each side's torch.compile, the way its users
    apply it: zerolab's engines take the model compiled before wrapping (ZeRO-3 then compiles it
    unit by unit), PyTorch DDP is compiled around the wrapper (its DDPOptimizer splits the graph
    at the buckets), FSDP2 after fully_shard; DeepSpeed is left out.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    from .engines import make

    cfg = gpt_config(size)
    opt = partial(torch.optim.AdamW, lr=lr)

    def make_model():
        torch.manual_seed(0)
        return GPT(cfg)

    def compiled(module):
        return torch.compile(module) if compile_models else module

    def zl_model():
        return compiled(make_model())

    def floor():
        # zl.DDP over a data-parallel group of one rank: the same buckets and flat optimizer as
        # every zerolab engine, nothing sent. No engine does less work, so none can beat it.
        from .mesh import Mesh
        alone = Mesh(dp=1, mp=dist.get_world_size())
        r = _zl_runner("zl.DDP alone", "floor", make("ddp", zl_model(), opt, bucket_mb=bucket_mb, mesh=alone,
                                                     track_peak=False, track_activations=False))
        r.family = "floor"
        return r

    def torch_ddp():
        m = DistributedDataParallel(make_model(), bucket_cap_mb=bucket_mb)
        return _torch_runner("PyTorch DDP", "DDP", "PyTorch", compiled(m), opt(m.parameters()))

    def zero_redundancy():
        m = DistributedDataParallel(make_model(), bucket_cap_mb=bucket_mb)
        zro = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
        return _torch_runner("ZeroRedundancyOptimizer", "ZeRO-1", "PyTorch", compiled(m), zro)

    def fsdp2(reshard):   # reshard=False keeps parameters gathered from forward to backward
        from torch.distributed.device_mesh import init_device_mesh
        m = make_model()
        # the models here live on the CPU: say so, or FSDP2's default mesh picks CUDA whenever a
        # GPU exists and sets device `rank` (which fails for rank 1 on a one-GPU box)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in m.blocks:
            fully_shard(block, reshard_after_forward=reshard, mesh=mesh)
        fully_shard(m, reshard_after_forward=reshard, mesh=mesh)
        return _torch_runner(f"FSDP2 reshard={reshard}", f"ZeRO-{2 if not reshard else 3}", "PyTorch",
                             compiled(m), opt(m.parameters()))

    def zl_zero(stage, **kw):
        name = f"zl.ZeRO-{stage}" + "".join(f" {k}={v}" for k, v in kw.items())
        r = _zl_runner(name, f"ZeRO-{stage}", make(f"zero{stage}", zl_model(), opt, bucket_mb=bucket_mb,
                                                     track_peak=False, **kw))
        if kw:
            r.family = "ablation"   # zerolab with a feature off: compared with zerolab, not peers
        return r

    out = [("zl.DDP alone", floor)]
    if "DDP" in kinds:
        out += [("zl.DDP", lambda: _zl_runner("zl.DDP", "DDP", make("ddp", zl_model(), opt, bucket_mb=bucket_mb,
                                                                      track_peak=False))),
                ("PyTorch DDP", torch_ddp)]
    if "ZeRO-1" in kinds:
        out += [("zl.ZeRO-1", partial(zl_zero, 1)), ("ZeroRedundancyOptimizer", zero_redundancy)]
    if "ZeRO-2" in kinds:
        out += [("zl.ZeRO-2", partial(zl_zero, 2)), ("FSDP2 reshard=False", partial(fsdp2, False))]
    if "ZeRO-3" in kinds:
        out += [("zl.ZeRO-3", partial(zl_zero, 3)), ("zl.ZeRO-3 prefetch=0", partial(zl_zero, 3, prefetch=0)),
                ("FSDP2 reshard=True", partial(fsdp2, True))]
    note = "DeepSpeed: not requested" if not compile_models else "DeepSpeed: left out of the compiled run"
    if deepspeed and not compile_models:
        stages = [s for s in (1, 2, 3) if f"ZeRO-{s}" in kinds]
        ds, note = _deepspeed_factories(make_model, lr, batch, bucket_mb, stages)
        out += ds
    return out, note


def build_runners(size, batch, bucket_mb, lr=3e-4, deepspeed=True, kinds=KINDS, compile_models=False):
    """Every engine of the table, each on its own copy of the same initial model."""
    factories, note = engine_factories(size, batch, bucket_mb, lr, deepspeed, kinds, compile_models)
    runners = []
    for name, make in factories:
        if name.startswith("DeepSpeed") and note.startswith("DeepSpeed: not run"):
            continue
        try:
            runners.append(make())
        except Exception as e:
            if not name.startswith("DeepSpeed"):
                raise
            # DeepSpeed installed but failing to start here: the table goes on without it
            runners = [r for r in runners if r.family != "DeepSpeed"]
            note = f"DeepSpeed: not run (initialize failed: {type(e).__name__}: {str(e).splitlines()[0][:80]})"
    return runners, note


def measure_memory(make, data, batch, warmup=2):
    """(held, peak): bytes one engine holds when a step begins, and the most it holds during it.

    Counted by malloc itself (zerolab.memory.MallocTrace) from before the engine is built, so
    every engine is measured the same way, C++ buffers and resized storages included.
    """
    import gc
    from .memory import MallocTrace
    rank, n = dist.get_rank(), dist.get_world_size()
    gc.collect()
    with MallocTrace() as trace:
        runner = make()
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
                 compile_models=False):
    """All engines in the same processes, one step each in turn, in a new shuffled order each step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    data = CharDataset(gpt_config(size).block_size)
    runners, note = build_runners(size, batch, bucket_mb, deepspeed=deepspeed, kinds=kinds,
                                  compile_models=compile_models)
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
    del runners
    # memory: each engine alone, built inside the allocator trace
    held, peak = {}, {}
    if memory:
        factories = dict(engine_factories(size, batch, bucket_mb, deepspeed=deepspeed, kinds=kinds,
                                          compile_models=compile_models)[0])
        for name, _, _ in rows:
            # measured on a second build: the first in this trace may pay one-off lazy set-up
            # (op and dispatch caches, first-time shapes) that is the process's, not the engine's
            measure_memory(factories[name], data, batch)
            held[name], peak[name] = measure_memory(factories[name], data, batch)
    dist.barrier()
    params = sum(p.numel() for p in GPT(gpt_config(size)).parameters())
    return {"rows": rows, "times": times, "loss": losses, "held": held,
            "peak": peak, "wrote": wrote, "ledger": ledger, "note": note, "params": params}


def run(size="small", world_size=2, batch=8, bucket_mb=1.0, reps=2, warmup=2, steps=6,
        deepspeed=True, kinds=KINDS, log=print, compile_models=False, memory=True):
    """Launch the benchmark `reps` times (fresh processes each); returns the summary dict."""
    for name, v in (("world_size", world_size), ("batch", batch), ("reps", reps), ("steps", steps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1; got {v!r}")
    if "floor" not in kinds:
        raise ValueError("kinds must include 'floor': every ratio is taken against it")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"unknown kinds {bad}; choose from {KINDS}")
    results = []
    for rep in range(reps):
        # memory is measured once, in the last repetition (each engine built alone, traced)
        res = launch(bench_worker, world_size, timeout=1800 if compile_models else 600,
                     args=(size, batch, bucket_mb, warmup, steps, deepspeed, kinds,
                           memory and rep == reps - 1, compile_models))
        results.append(res)
        if log:
            log(f"  repetition {rep + 1}/{reps} done")
    s = summarize(results, steps)
    s.update(size=size, world_size=world_size, batch=batch, bucket_mb=bucket_mb, reps=reps, compiled=compile_models)
    return s


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m zerolab bench",
                                description="zerolab DDP and ZeRO-1/2/3 beside PyTorch DDP, "
                                            "ZeroRedundancyOptimizer, FSDP2 and DeepSpeed: one table")
    p.add_argument("--size", default="small", help="GPT size: nano, tiny, small, medium (default small)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size for the engines that have one")
    p.add_argument("--reps", type=int, default=3, help="repetitions, fresh processes each")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1 repetition of 6 timed steps")
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out even if installed")
    p.add_argument("--plot", metavar="DIR", help="write the figures (PNG) into DIR")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every model first (inductor; minutes of compiling), DeepSpeed left out")
    p.add_argument("--no-memory", action="store_true", help="skip the memory columns (each engine built alone)")
    a = p.parse_args(argv)
    if a.quick:
        a.reps, a.steps, a.warmup = 1, 6, 2
    for name in ("world_size", "batch", "reps", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not a.bucket_mb > 0:
        p.error("--bucket-mb must be > 0")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    print(f"GPT {a.size!r}, {a.world_size} ranks (gloo, CPU), batch {a.batch} per rank, fp32 AdamW, "
          f"buckets of {a.bucket_mb:g} MB, {a.reps} x {a.steps} timed steps after {a.warmup} warm-up"
          f"{', every model torch.compiled' if a.compile else ''}")
    t0 = time.perf_counter()
    s = run(a.size, a.world_size, a.batch, a.bucket_mb, a.reps, a.warmup, a.steps, deepspeed=not a.no_deepspeed,
            compile_models=a.compile, memory=not a.no_memory)
    main.last = s  # the summary, for callers that want the numbers
    print()
    print(format_table(s))
    print()
    print(f"{s['params']:,} parameters (Ψ). Final losses of the zerolab and PyTorch engines agree to "
          f"{'below 1e-4' if s['loss_spread'] < 1e-4 else format(s['loss_spread'], '.2e')}; the floor trains "
          f"on one rank's batch only, so its loss differs.")
    if s["deepspeed_gap"] is not None:
        print(f"DeepSpeed's final loss is {s['deepspeed_gap']:.2e} from PyTorch DDP's: its steps drift from "
              f"the others by more than fp32 rounding (cause not found; same seed, data and AdamW).")
    print(s["note"])
    print(GPU_NOTE)
    for text, ok in targets(s):
        print(f"  [{ {True: 'met', False: 'MISSED', None: 'within the spread'}[ok]}] {text}")
    if a.plot:
        from .book.bench_plots import plot_bench
        paths = plot_bench(s, a.plot)
        print("figures: " + ", ".join(paths))
    print(f"{time.perf_counter() - t0:.0f} s in all.")
    return 0


if __name__ == "__main__":
    main()
