"""Every engine by name, built in one place.

    engine = zl.engines.make("zero2", model, partial(torch.optim.AdamW, lr=3e-4), bucket_mb=25)

The command line's --strategy, the benchmark and the chapters all build their engines here, so
a name means the same engine everywhere. The classes live in zerolab.single (SingleProcess),
zerolab.ddp (NaiveDDP, DDP), zerolab.zero (ZeRO stages 1 and 2) and zerolab.zero3 (ZeRO3, which
zl.ZeRO(stage=3) builds).
"""

import importlib

# name -> (module, class, the keyword arguments the name fixes)
ENGINES = {
    "single": ("zerolab.single", "SingleProcess", {}),
    "naive": ("zerolab.ddp", "NaiveDDP", {}),
    "ddp": ("zerolab.ddp", "DDP", {}),
    "zero1": ("zerolab.zero", "ZeRO", {"stage": 1}),
    "zero2": ("zerolab.zero", "ZeRO", {"stage": 2}),
    "zero3": ("zerolab.zero", "ZeRO", {"stage": 3}),
}
NAMES = tuple(ENGINES)


def make(name: str, model, optimizer, **options):
    """Build the engine called `name` around `model`; `options` go to its constructor
    (precision=, bucket_mb=, max_grad_norm=, ...: each engine refuses one it does not take)."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {list(NAMES)}")
    module, cls, fixed = ENGINES[name]
    engine_class = getattr(importlib.import_module(module), cls)
    return engine_class(model, optimizer, **fixed, **options)
