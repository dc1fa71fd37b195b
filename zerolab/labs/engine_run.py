"""Measuring a graded engine's run, the same way for labs 3 to 6.

`record_run(engine, model, pieces, held)` trains SCHEDULE's steps with PyTorch's loop and keeps,
on this rank: after each step's backward, the gradient this rank holds for each Piece (`held`
reads it) and when backward's compute ended; after each step, the weights and the ledger's
records of the step. The single-process reference for this rank comes along (model.reference),
so the checks in the parent compare without running anything.

`instrument(engine, graded_code)` puts a GradedLedger (zerolab.labs.overlap) between the engine and its
ledger, and a ComputeClock on its model: record_run then also keeps, for every collective of a step,
the compute that ran while it was in flight (the labs whose idea is overlap: 3, 5 and 6).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .checks import BOOKKEEPING, PARITY
from .lab import Stop
from .model import reference, train
from .overlap import ComputeClock, GradedLedger


def instrument(engine, graded_code, replace_comm: bool = True) -> GradedLedger:
    """A ComputeClock on the engine's model and a GradedLedger on its ledger (as engine.comm, unless
    replace_comm=False: ZeRO-3 gives each unit its own view instead); graded_code: a
    zerolab.labs.plugins.GradedCode."""
    clock = ComputeClock()
    clock.watch_forward(engine.module)
    graded = GradedLedger(engine.comm, clock, graded_code)
    if replace_comm:
        engine.comm = graded
    engine.graded = graded
    return graded


def record_run(engine, pieces, held, weights, after_backward=None, after_step=None) -> dict:
    """Train and measure (see the module docstring). held(engine) -> [flat tensor per piece];
    weights(engine) -> [flat weights per piece]; after_backward(engine, step) and
    after_step(engine, step) -> dicts of what else a lab measures then. If the engine was
    instrumented, each step also keeps "entries": its collectives' Entry rows (zerolab.labs.overlap)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    steps = []
    mark = len(engine.comm.records)
    graded = getattr(engine, "graded", None)
    seen = 0

    def backward(loss):
        if graded is None:
            loss.backward()
            return
        clock = graded.clock
        with clock.during("backward"):
            clock.watch_backward(loss)
            loss.backward()
        for e in graded.entries:        # a reduction is needed by the end of its backward
            if e.needed is None and e.phase is not None:
                e.needed = clock.count

    def on_backward(step):
        _check_dtypes(held(engine), pieces, step, rank)
        steps.append({"held": [None if g is None else g.detach().float().clone() for g in held(engine)],
                      "compute_end": engine.last_backward.get("compute_end"),
                      **(after_backward(engine, step) if after_backward else {})})

    def on_step(step):
        nonlocal mark, seen
        steps[-1]["records"] = [(r.op, r.tag, r.numel, r.bytes_sent, r.start, r.end)
                                for r in engine.comm.records[mark:]]
        if graded is not None:
            steps[-1]["entries"] = [e.row() for e in graded.entries[seen:]]
        # (reading the weights may communicate: ZeRO-3 gathers them; that is not the step's traffic)
        steps[-1]["weights"] = [w.detach().float().clone() for w in weights(engine)]
        steps[-1].update(after_step(engine, step) if after_step else {})
        mark = len(engine.comm.records)
        seen = len(graded.entries) if graded is not None else 0

    train(engine, on_backward, on_step, backward, clock=None if graded is None else graded.clock)
    return {"rank": rank, "n": n, "pieces": pieces, "steps": steps, "ref": reference(rank, n)}


def _check_dtypes(grads, pieces, step, rank) -> None:
    """Stop the run if a gradient held after backward is not fp32 (see WrongDtypeStops)."""
    for piece, g in zip(pieces, grads):
        if g is not None and g.dtype != torch.float32:
            raise _dtype_stop(step, rank, piece.label, g)


def _dtype_stop(step, rank, label, g) -> Stop:
    bits = {torch.float64: "8 bytes an element where the chapter counts 4, and torch refuses to hand a float64 "
                           "gradient to a float32 parameter",
            torch.float16: "rounded to fp16's 11 significant bits (and any gradient above 65,504 is inf)",
            torch.bfloat16: "rounded to bf16's 8 significant bits"}.get(g.dtype, "")
    return Stop(PARITY, "grad_dtype",
                f"step {step}, rank {rank}, {label}: the gradient held after backward is "
                f"{str(g.dtype).replace('torch.', '')}, shape {tuple(g.shape)}; the model, its optimizer and one "
                f"process's gradient are float32" + (f": {bits}." if bits else "."),
                "keep the gradient in the parameters' dtype (float32 here): no .double(), .half() or .to() on the "
                "way; a new tensor takes the dtype of the one it is made from (torch.empty(n, dtype=flat.dtype)).")


class WrongDtypeStops:
    """A lab engine's instrument (first among its bases): the moment backward ends, before the
    library hands the gradients to the optimizer (which would refuse an fp64 gradient with torch's
    own words, or round an fp16 one silently), every gradient this rank holds must be fp32, the
    dtype of the lab's model and optimizer. `_grad_label(i)` names the i-th ("bucket 2 (rank 0's
    slice)")."""

    def _expose_grads(self):
        for i, (m, g) in enumerate(zip(self._flat_masters(), self.owned_grads())):
            if g is not None and g.dtype != m.dtype:
                raise _dtype_stop(self.steps, self.rank, self._grad_label(i), g)
        super()._expose_grads()

    def _grad_label(self, i: int) -> str:
        return f"bucket {i} (rank {self.rank}'s slice)"


def moved(step_data) -> list:
    """[(op, numel, bytes, tag)] of a step's collectives that move gradients or parameters."""
    return [(op, numel, sent, tag) for op, tag, numel, sent, _, _ in step_data["records"]
            if op in ("all_reduce", "reduce_scatter", "all_gather") and tag not in BOOKKEEPING]


class StubCalled(NotImplementedError):
    """A blank seam ran: the student's class does not define `method` (zerolab.labs.worker names
    the class and its line, not this file)."""

    def __init__(self, lab: str, role_class: str, method: str):
        super().__init__(f"{role_class}.{method} is yours to write ({lab})")
        self.role_class, self.method = role_class, method


def stub(lab: str, role_class: str, method: str):
    """A seam's body before the student writes it."""
    def missing(self, *args, **kwargs):
        raise StubCalled(lab, role_class, method)
    missing.__name__ = method
    missing.__qualname__ = f"{role_class}.{method}"
    return missing
