"""The engines, and every engine by name, built in one place.

    engine = zl.engines.make("zero2", model, partial(torch.optim.AdamW, lr=3e-4), bucket_mb=25)

Each engine is a small change of the one before it:

    base.Engine         what every engine does the same way (backward, the step template, guards,
                        full_state_dict, memory_report, checkpoint pieces)
    single.SingleProcess    the reference: one process, one model
    naive_ddp.NaiveDDP  all-reduce each gradient after backward
    ddp.DDP             flat buckets, all-reduced while backward runs
    zero1.ZeRO1         DDP, but reduce-scatter, step on the owned slice, all-gather
    zero2.ZeRO2         ZeRO-1, but the full gradient is freed as soon as it is reduced
    zero3.ZeRO3         parameters sharded too, gathered unit by unit (units.Unit; when:
                        zero3_schedule)
    offload.*           ZeRO-Offload: any stage, masters and optimizer state in host memory;
                        stage 3 with offload="disk": shards in files (offload_disk)

The command line's --strategy, the benchmark and the chapters all build their engines here, so
a name means the same engine everywhere; zl.ZeRO(stage=k) picks among the three ZeRO stages.
"""

import importlib

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


def ZeRO(model, optimizer, *, stage=None, **options):
    """zl.ZeRO(model, optimizer, stage=1 | 2 | 3, ...): the ZeRO engine of that stage
    (ZeRO1, ZeRO2 or ZeRO3), with the same options for every stage; offload="optimizer" (any
    stage) or "disk" (stage 3, with offload_dir=) moves model states off the device
    (zerolab.engines.offload)."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1 (shard optimizer state), 2 (also gradients) or 3 (also "
                         f"parameters); got {stage!r}")
    given = [k for k in ("quantize_weights", "secondary_partition", "quantize_gradients", "shard_group",
                          "topology") if options.get(k) not in (None, False)]
    if stage != 3 and given:
        raise ValueError(f"{', '.join(given)}: ZeRO++ and HSDP options act on sharded parameters, "
                         f"which only stage 3 has; got stage={stage}. Use stage=3 (or drop the options).")
    offload = options.pop("offload", None)
    if offload is not None or options.get("offload_dir") is not None or options.get("delay_update"):
        if given:
            raise ValueError(f"offload with {', '.join(given)}: offloading and ZeRO++ / HSDP are not "
                             "supported together; choose one.")
        from .offload import offloaded      # ZeRO-Offload / ZeRO-Infinity (engines.offload)
        return offloaded(stage, offload)(model, optimizer, offload=offload, **options)
    options.pop("offload_dir", None)
    options.pop("delay_update", None)
    return make(f"zero{stage}", model, optimizer, **options)
