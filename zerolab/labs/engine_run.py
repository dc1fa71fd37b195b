"""Measuring a graded engine's run, the same way for labs 3 to 6.

`record_run(engine, model, pieces, held)` trains SCHEDULE's steps with PyTorch's loop and keeps,
on this rank: after each step's backward, the gradient this rank holds for each Piece (`held`
reads it) and when backward's compute ended; after each step, the weights and the ledger's
records of the step. The single-process reference for this rank comes along (model.reference),
so the checks in the parent compare without running anything.
"""

from __future__ import annotations

import torch.distributed as dist

from .model import SCHEDULE, reference, train

# collectives the library runs for its own bookkeeping, not to move gradients or parameters
BOOKKEEPING = {"used", "check", "overflow", "grad_norm", "setup", "buffers", "state"}


def record_run(engine, pieces, held, weights, backward=None, after_backward=None, after_step=None) -> dict:
    """Train and measure (see the module docstring). held(engine) -> [flat tensor per piece];
    weights(engine) -> [flat weights per piece]; after_backward(engine, step) and
    after_step(engine, step) -> dicts of what else a lab measures then."""
    rank, n = dist.get_rank(), dist.get_world_size()
    steps = []
    mark = len(engine.comm.records)

    def on_backward(step):
        steps.append({"held": [None if g is None else g.detach().float().clone() for g in held(engine)],
                      "compute_end": engine.last_backward.get("compute_end"),
                      **(after_backward(engine, step) if after_backward else {})})

    def on_step(step):
        nonlocal mark
        steps[-1]["records"] = [(r.op, r.tag, r.numel, r.bytes_sent, r.start, r.end)
                                for r in engine.comm.records[mark:]]
        # (reading the weights may communicate: ZeRO-3 gathers them; that is not the step's traffic)
        steps[-1]["weights"] = [w.detach().float().clone() for w in weights(engine)]
        steps[-1].update(after_step(engine, step) if after_step else {})
        mark = len(engine.comm.records)

    train(engine, on_backward, on_step, backward)
    return {"rank": rank, "n": n, "pieces": pieces, "steps": steps, "ref": reference(rank, n)}


def moved(step_data) -> list:
    """[(op, numel, bytes, tag)] of a step's collectives that move gradients or parameters."""
    return [(op, numel, sent, tag) for op, tag, numel, sent, _, _ in step_data["records"]
            if op in ("all_reduce", "reduce_scatter", "all_gather") and tag not in BOOKKEEPING]


def candidates(ref: dict, step: int) -> dict:
    """What check_gradient compares a rank's gradient with at `step` (model.reference)."""
    return {"expected": ref["expected"][step], "local": ref["local"][step],
            "last_micro": ref["last_micro"][step] if SCHEDULE[step] > 1 else None,
            "previous": ref["expected"][step - 1] if step > 0 else None}


def stub(lab: str, role_class: str, method: str):
    """A seam's body before the student writes it."""
    def missing(self, *args, **kwargs):
        raise NotImplementedError(f"{role_class}.{method} is yours to write ({lab})")
    missing.__name__ = method
    missing.__qualname__ = f"{role_class}.{method}"
    return missing
