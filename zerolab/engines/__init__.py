"""The engines, and every engine by name, built in one place.

    engine = zl.engines.make("zero2", model, partial(torch.optim.AdamW, lr=3e-4), bucket_mb=25)

Each engine is a small change of the one before it:

    base.Engine         what every engine does the same way (forward, backward whoever calls it,
                        the step template, zero_grad, misuse refused; state.EngineState: what it holds)
    single.SingleProcess    the reference: one process, one model
    naive_ddp.NaiveDDP  all-reduce each gradient after backward
    ddp.DDP             flat buckets, all-reduced while backward runs
    zero1.ZeRO1         DDP, but reduce-scatter, step on the owned slice, all-gather
    zero2.ZeRO2         ZeRO-1, but the full gradient is freed as soon as it is reduced
    zero3/              ZeRO3: parameters sharded too, gathered unit by unit (units.Unit; when:
                        schedule; how they travel under ZeRO++ and HSDP: zeropp)
    offload/            ZeRO-Offload: any stage, masters and optimizer state in host memory
                        (optimizer); stage 3 with offload="disk": shards in files (disk, pager)

and what they share: state (what an engine holds and reports), lifecycle (the training state
and its transitions), step (the step around the optimizer's own), options (every option, checked
once), setup (before training: the same model on every rank), grad_guard (p.grad under ZeRO:
this rank's piece of the averaged gradient), seams (the methods the labs have a student write:
their protected API). The optimizer's half stands one floor down, in zerolab.optim; the runtime
(the ledger, the recorder, the watchdog) in zerolab.runtime.

The command line's --strategy, the benchmark and the chapters all build their engines here, so
a name means the same engine everywhere; zl.ZeRO(stage=k) picks among the three ZeRO stages.
"""

import importlib

from .options import OFFLOAD, disk_needs_stage_3

# name -> (module, class)
ENGINES = {
    "single": ("zerolab.engines.single", "SingleProcess"),
    "naive": ("zerolab.engines.naive_ddp", "NaiveDDP"),
    "ddp": ("zerolab.engines.ddp", "DDP"),
    "zero1": ("zerolab.engines.zero1", "ZeRO1"),
    "zero2": ("zerolab.engines.zero2", "ZeRO2"),
    "zero3": ("zerolab.engines.zero3", "ZeRO3"),
}
NAMES = tuple(ENGINES)


def engine_class(name: str):
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {list(NAMES)}")
    module, cls = ENGINES[name]
    return getattr(importlib.import_module(module), cls)


def make(name: str, model, optimizer, **options):
    """Build the engine called `name` around `model`; `options` go to its constructor
    (precision=, bucket_mb=, max_grad_norm=, ...: each engine refuses one it does not take)."""
    return engine_class(name)(model, optimizer, **options)


def ZeRO(model, optimizer=None, *, stage=None, **options):
    """zl.ZeRO(model, optimizer, stage=1 | 2 | 3, ...): the ZeRO engine of that stage
    (ZeRO1, ZeRO2 or ZeRO3), with the same options for every stage (zerolab.engines.options);
    offload="optimizer" (any stage) or "disk" (stage 3, with offload_dir=) moves model states
    off the device (zerolab.engines.offload)."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1 (shard optimizer state), 2 (also gradients) or 3 (also "
                         f"parameters); got {stage!r}")
    offload = options.get("offload")
    if offload is None and not any(options.get(k) for k in ("offload_dir", "delay_update")):
        for k in ("offload", "offload_dir", "delay_update"):
            options.pop(k, None)
        return make(f"zero{stage}", model, optimizer, **options)
    return offloaded(stage, offload)(model, optimizer, **options)   # (its options check the rest)


def offloaded(stage: int, offload):
    """The class of zl.ZeRO(stage=..., offload=...): ZeRO-Offload's mixin on the stage's engine, or
    ZeRO-Infinity's disk engine (stage 3)."""
    from .offload import OptimizerOffload
    if offload == "disk":
        disk_needs_stage_3(stage)
        from .offload import ZeRO3Disk
        return ZeRO3Disk
    base = engine_class(f"zero{stage}")
    return type(f"{base.__name__}Offload", (OptimizerOffload, base),
                {"__module__": OptimizerOffload.__module__, "takes": base.takes + OFFLOAD,
                 "__doc__": f"{base.__name__} with offload='optimizer'."})
