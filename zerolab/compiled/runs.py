"""Workers that ranks run (zl.launch): the graph's training beside eager zerolab's, and memory.

Every rank trains the same tiny GPT on its own slice of the same global batches, so the
compiled and the eager runs can be compared weight for weight.
"""

from __future__ import annotations

import warnings
from functools import partial

import torch

import zerolab as zl

from .capture import gpt_loss
from .liveness import liveness, measured_after_alloc
from .zero import Trainer

SEQ = 16


def tiny_gpt(n_layer: int = 2, n_embd: int = 32, size: str | None = None):
    """The runs' GPT: a small nano by default; `size`: one of zerolab.models' named sizes (the
    benchmark's is "tiny"), with this module's sequence length."""
    torch.manual_seed(0)
    if size is not None:
        return zl.models.GPT(zl.models.gpt_config(size, block_size=SEQ))
    return zl.models.GPT(zl.models.gpt_config("nano", n_layer=n_layer, n_embd=n_embd, n_head=2, block_size=SEQ))


def batch(step: int, rank: int, world: int, per_rank: int = 2):
    """This rank's (tokens, targets) of the global batch number `step`."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 96, (per_rank * world, SEQ + 1), generator=g)[per_rank * rank:per_rank * (rank + 1)]
    return tokens[:, :-1], tokens[:, 1:]


def adamw():
    return partial(torch.optim.AdamW, lr=1e-3, eps=1e-6)


def train_compiled(stage: int, steps: int = 3, bucket_bytes: int = 0, depth: int = 0, size=None) -> dict:
    """The graph's weights after `steps` steps, and the ledger's bytes by operation."""
    rank, world = zl.rank(), zl.world_size()
    model = tiny_gpt(size=size)
    ledger = zl.comm.Ledger(timeout=None)
    trainer = Trainer(model, adamw(), gpt_loss, batch(0, rank, world), stage, ledger,
                      bucket_bytes=bucket_bytes, depth=depth)
    step_bytes = None
    for step in range(steps):
        ledger.reset()
        trainer.train_step(*batch(step, rank, world))
        step_bytes = {op: row["bytes"] for op, row in ledger.summary().items()}
    names = [n for n, _ in model.named_parameters()]
    return {"weights": dict(zip(names, trainer.full_parameters())), "bytes": step_bytes}


def train_eager(stage: int, steps: int = 3, size=None) -> dict:
    """zl.ZeRO(stage=k)'s weights after the same steps, and its ledger's bytes of the last step."""
    rank, world = zl.rank(), zl.world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = zl.ZeRO(tiny_gpt(size=size), adamw(), stage=stage)
    step_bytes = None
    for step in range(steps):
        engine.comm.reset()
        tokens, targets = batch(step, rank, world)
        loss = gpt_loss(engine, tokens, targets)
        loss.backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        step_bytes = {op: row["bytes"] for op, row in engine.comm.summary().items()}
    return {"weights": engine.full_state_dict(), "bytes": step_bytes}


def peak_memory(stage: int, bucket_bytes: int = 0, depth: int = 0) -> dict:
    """The step's peak as the liveness pass predicts it and as the allocation tracker measures it."""
    rank, world = zl.rank(), zl.world_size()
    model = tiny_gpt()
    trainer = Trainer(model, adamw(), gpt_loss, batch(0, rank, world), stage, zl.comm.Ledger(timeout=None),
                      bucket_bytes=bucket_bytes, depth=depth)
    inputs = trainer.inputs()
    tokens, targets = batch(0, rank, world)
    with zl.memory.AllocationTracker(record_trace=True) as tracker:
        out = trainer.step_graph.module(*inputs, tokens, targets)
    del out
    timeline = liveness(trainer.step_graph)
    return {"predicted": timeline.peak, "measured": tracker.peak,
            "predicted_timeline": timeline.after_alloc, "measured_timeline": measured_after_alloc(tracker.trace)}


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


def compare(configs: list, steps: int = 3, size=None) -> list:
    """For each (stage, bucket_bytes, depth): the graph's largest weight difference from eager
    zl.ZeRO(stage) after `steps` steps, and the graph's ledger bytes of its last step (`size`:
    a named GPT size instead of the small nano)."""
    eager = {stage: train_eager(stage, steps, size) for stage in sorted({c[0] for c in configs})}
    out = []
    for stage, bucket_bytes, depth in configs:
        mine = train_compiled(stage, steps, bucket_bytes, depth, size)
        out.append({"difference": max_difference(mine["weights"], eager[stage]["weights"]),
                    "bytes": mine["bytes"], "eager_bytes": eager[stage]["bytes"]})
    return out


def peaks(configs: list) -> list:
    """peak_memory for each (stage, bucket_bytes, depth)."""
    return [peak_memory(*c) for c in configs]
