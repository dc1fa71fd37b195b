"""The engines the benchmark compares, each built the way its own users build it.

* zerolab's, by the names the tables print (ZEROLAB: "zl.DDP", "zl.ZeRO-3 prefetch=0", ...), all
  built by zerolab.engines.make; the GPU scripts (gpu/) use the same names and make_zerolab;
* PyTorch's DistributedDataParallel, ZeroRedundancyOptimizer beside it, and FSDP2 (fully_shard);
* DeepSpeed's stages 1-3, when it is installed and starts here;
the peers built by zerolab.bench.peers, which the GPU scripts use too.

Each comes as a Runner: a name, a kind (which ZeRO stage it is a peer of), a family, the loop
that drives it, and a function that runs one training step. Every zerolab engine is driven twice,
each copy on its own model: through zerolab's loop (`engine.backward(loss); engine.step();
engine.zero_grad()`) under its own name, and through PyTorch's (`loss.backward();
optimizer.step(); optimizer.zero_grad()`, what a PyTorch user's script does) as "NAME [PyTorch loop]".
"""

from __future__ import annotations

import os
from functools import partial

import torch

from ..engines import make
from ..models import GPT, gpt_config, gpt_loss
from .peers import deepspeed_config, fsdp2, quiet_deepspeed, torch_ddp, zero_redundancy

KINDS = ("floor", "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
LOOPS = ("zerolab", "PyTorch")   # the loops that drive zerolab's engines
FLOOR = "local"                  # the floor's row: the same per-rank work, nothing sent

# zerolab's engines by the name the tables print: (zerolab.engines.make's name, its options)
ZEROLAB = {"zl.SingleProcess": ("single", {}), "zl.DDP": ("ddp", {}), "zl.ZeRO-1": ("zero1", {}),
           "zl.ZeRO-2": ("zero2", {}), "zl.ZeRO-3": ("zero3", {}), "zl.ZeRO-3 prefetch=0": ("zero3", {"prefetch": 0}),
           "zl.DDP bitwise=True": ("ddp", {"bitwise": True}), "zl.ZeRO-2 bitwise=True": ("zero2", {"bitwise": True})}
BITWISE_ROWS = ("zl.DDP bitwise=True", "zl.ZeRO-2 bitwise=True")   # the same bits at any world size


def make_zerolab(name, model, optimizer, **options):
    """The zerolab engine the tables call `name` (ZEROLAB), built by zerolab.engines.make."""
    engine, own = ZEROLAB[name]
    if engine == "single":                  # one process has no buckets to size
        options.pop("bucket_mb", None)
    return make(engine, model, optimizer, **{**own, **options})


class Runner:
    """One engine: what it is, and a function that runs one training step (returns the loss)."""

    def __init__(self, name, kind, family, step, comm=None, loop="PyTorch", layout=None):
        self.name, self.kind, self.family = name, kind, family
        self.step, self.comm, self.loop = step, comm, loop
        self.layout = layout    # bitwise rows: what their bytes' closed form needs (bitwise_layout)


def bitwise_layout(engine) -> dict:
    """What a bitwise=True engine's bytes per step follow from: its flat buckets' elements
    (`numel`), the same padded to a multiple of N * 256 per bucket (`padded`), and its trainable
    tensors (`tensors`: one flag each in the step's agreement all-reduce)."""
    return {"numel": engine.buckets.numel, "padded": engine.buckets.padded_numel,
            "buckets": len(engine.buckets.buckets), "tensors": len(engine.params)}


def pytorch_loop_name(name):
    """The row of zerolab engine `name` driven through PyTorch's loop."""
    return f"{name} [PyTorch loop]"


def _zl_runner(name, kind, engine, loop="zerolab"):
    if loop == "zerolab":
        def step(batch):
            _, loss = gpt_loss(engine, batch)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            return loss.item()
    else:   # what a PyTorch script runs: the engine's hooks do the rest
        def step(batch):
            _, loss = gpt_loss(engine, batch)
            loss.backward()
            engine.optimizer.step()
            engine.optimizer.zero_grad()
            return loss.item()
    return Runner(name, kind, "zerolab", step, engine.comm, loop,
                  bitwise_layout(engine) if getattr(engine, "bitwise", False) else None)


def _torch_runner(name, kind, family, model, optimizer):
    def step(batch):
        _, loss = gpt_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()
    return Runner(name, kind, family, step)


def _deepspeed_factories(make_model, lr, batch, bucket_mb, stages=(1, 2, 3)):
    """DeepSpeed engines when the package is installed and imports here; else (name, reason)."""
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
    except Exception as e:  # not installed, or cannot import on this machine
        return [], f"DeepSpeed: not run ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"
    quiet_deepspeed()

    def make_stage(stage):
        model = make_model()
        cfg = deepspeed_config(stage, batch, bucket_mb)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)

        def step(b):
            _, loss = gpt_loss(eng, b)
            eng.backward(loss)
            eng.step()
            return loss.item()
        return Runner(f"DeepSpeed ZeRO-{stage}", f"ZeRO-{stage}", "DeepSpeed", step, loop="DeepSpeed")
    return [(f"DeepSpeed ZeRO-{s}", partial(make_stage, s)) for s in stages], "DeepSpeed: ran stages " + \
        ", ".join(str(s) for s in stages) + f" with buckets of {bucket_mb:g} MB like the other engines"


def engine_factories(size, batch, bucket_mb, lr=3e-4, deepspeed=True, kinds=KINDS, compile_models=False,
                     loops=LOOPS, bitwise=True):
    """[(name, make)] for every engine of the table, and a note on DeepSpeed.

    Each factory builds the engine on its own copy of the same initial model and returns its Runner.
    The timing phase builds them all; the memory phase builds one at a time, so each one's
    allocations are counted alone. compile_models: each side's torch.compile, the way its users
    apply it: zerolab's engines take the model compiled before wrapping (ZeRO-3 then compiles it
    unit by unit), PyTorch DDP is compiled around the wrapper (its DDPOptimizer splits the graph
    at the buckets), FSDP2 after fully_shard; DeepSpeed is left out. loops: the loops that drive
    zerolab's engines (LOOPS; the ablation zl.ZeRO-3 prefetch=0 and the bitwise rows run through
    zerolab's only). bitwise: also zl.DDP and zl.ZeRO-2 with bitwise=True (BITWISE_ROWS), each
    beside its default; the AdamW they get is the same (foreach left unset: the mode steps with
    torch's single-tensor kernels, and refuses foreach=True).
    """
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
        # The per-rank work every data-parallel engine must do, and nothing else: the plain model
        # and AdamW on this rank's batch, through PyTorch's loop, no wrapper, nothing sent. Its
        # AdamW takes the foreach path, as zerolab's engines ask for (the peers keep PyTorch's
        # default, the per-parameter loop on a CPU). What an engine adds to it is the engine.
        m = compiled(make_model())
        return _torch_runner(FLOOR, "floor", "floor", m, opt(m.parameters(), foreach=True))

    def pytorch_ddp():
        m = torch_ddp(make_model(), bucket_mb)
        return _torch_runner("PyTorch DDP", "DDP", "PyTorch", compiled(m), opt(m.parameters()))

    def pytorch_zero1():
        m, zro = zero_redundancy(make_model(), bucket_mb, lr)
        return _torch_runner("ZeroRedundancyOptimizer", "ZeRO-1", "PyTorch", compiled(m), zro)

    def pytorch_fsdp2(reshard):   # reshard=False keeps parameters gathered from forward to backward
        m = fsdp2(make_model(), reshard, "cpu")
        return _torch_runner(f"FSDP2 reshard={reshard}", f"ZeRO-{2 if not reshard else 3}", "PyTorch",
                             compiled(m), opt(m.parameters()))

    def zl_engine(name, loop="zerolab"):
        kind = "DDP" if name.startswith("zl.DDP") else name[3:9]
        r = _zl_runner(name if loop == "zerolab" else pytorch_loop_name(name), kind,
                       # track_peak=False: no peer traces its step's allocations either (the
                       # memory columns measure every engine's peak, the same way, instead)
                       make_zerolab(name, zl_model(), opt, bucket_mb=bucket_mb, track_peak=False), loop)
        if name in BITWISE_ROWS:
            r.family = "bitwise"    # zerolab in another mode: compared with its default, not peers
        elif ZEROLAB[name][1]:
            r.family = "ablation"   # zerolab with a feature off: compared with zerolab, not peers
        return r

    def bitwise_row(name):
        return [(name, partial(zl_engine, name))] if bitwise else []

    def zl_rows(name):
        return [(name if loop == "zerolab" else pytorch_loop_name(name), partial(zl_engine, name, loop))
                for loop in loops]

    bad = [loop for loop in loops if loop not in LOOPS]
    if bad or not loops:
        raise ValueError(f"loops must name one or more of {LOOPS}; got {tuple(loops)!r}")
    out = [(FLOOR, floor)]
    if "DDP" in kinds:
        out += zl_rows("zl.DDP") + bitwise_row("zl.DDP bitwise=True") + [("PyTorch DDP", pytorch_ddp)]
    if "ZeRO-1" in kinds:
        out += zl_rows("zl.ZeRO-1") + [("ZeroRedundancyOptimizer", pytorch_zero1)]
    if "ZeRO-2" in kinds:
        out += zl_rows("zl.ZeRO-2") + bitwise_row("zl.ZeRO-2 bitwise=True") + \
            [("FSDP2 reshard=False", partial(pytorch_fsdp2, False))]
    if "ZeRO-3" in kinds:
        out += zl_rows("zl.ZeRO-3") + [("zl.ZeRO-3 prefetch=0", partial(zl_engine, "zl.ZeRO-3 prefetch=0")),
                                       ("FSDP2 reshard=True", partial(pytorch_fsdp2, True))]
    note = "DeepSpeed: not requested" if not compile_models else "DeepSpeed: left out of the compiled run"
    if deepspeed and not compile_models:
        stages = [s for s in (1, 2, 3) if f"ZeRO-{s}" in kinds]
        ds, note = _deepspeed_factories(make_model, lr, batch, bucket_mb, stages)
        out += ds
    return out, note


def build_runners(size, batch, bucket_mb, lr=3e-4, deepspeed=True, kinds=KINDS, compile_models=False,
                  loops=LOOPS, bitwise=True):
    """Every engine of the table, each on its own copy of the same initial model."""
    factories, note = engine_factories(size, batch, bucket_mb, lr, deepspeed, kinds, compile_models, loops,
                                       bitwise)
    runners = []
    for name, build in factories:
        if name.startswith("DeepSpeed") and note.startswith("DeepSpeed: not run"):
            continue
        try:
            runners.append(build())
        except Exception as e:
            if not name.startswith("DeepSpeed"):
                raise
            # DeepSpeed installed but failing to start here: the table goes on without it
            runners = [r for r in runners if r.family != "DeepSpeed"]
            note = f"DeepSpeed: not run (initialize failed: {type(e).__name__}: {str(e).splitlines()[0][:80]})"
    return runners, note
