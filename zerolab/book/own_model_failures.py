"""What breaks when you train your own model, reproduced on purpose, for chapter 11.

Each worker makes one mistake on the chapter's Hugging Face GPT-2 and returns (or raises)
what zerolab's own tools say about it: a LaunchError or a CollectiveTimeout that names the
operation and the rank, zl.debug.first_nonfinite naming the first module that produced a NaN
or an inf, the loss scaler's trajectory. `summarise` turns an error into the lines worth
printing: no addresses, ports, process ids or timings.
"""

from __future__ import annotations

import re
import time

import torch

import zerolab as zl
from zerolab.book.own_model_demo import first_line, gpt2, make, tokens, where
from zerolab.precision import LossScaler


def _step(engine, step, rank, world):
    ids = tokens(step, 0, rank, world)
    out = engine(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    applied = engine.step()
    engine.zero_grad()
    return out.loss, applied


# ------------------------------------------------------------------ (a) ranks that diverge


def uneven_steps(then: str = "return", timeout: float | None = None):
    """Rank 0 runs 3 steps, rank 1 only 2 (each counted its steps from its own share of the
    data). Then rank 1 either returns, or goes on to work of its own (`then="work"`: it sleeps,
    standing for a long evaluation) while rank 0 waits in a collective.
    timeout: seconds the engine's ledger lets one collective take (None: no watchdog)."""
    engine = make("zero3")
    engine.comm.timeout = timeout
    rank, world = where()
    for step in range(3 if rank == 0 else 2):
        _step(engine, step, rank, world)
    if then == "work":
        time.sleep(10 * (timeout or 1))
    return rank


_TIMEOUT = re.compile(r"CollectiveTimeout: (?P<op>\w+(?: '[^']*')?) \(collective #\d+ of rank (?P<me>\d+)\) "
                      r"did not complete within (?P<s>[\d.]+) s\. Ranks that did not arrive: (?P<who>[^.]*)\.")


def summarise(err: BaseException) -> list:
    """The lines of a launch error worth printing: its first line, and what a collective timeout
    in it says (op, waiting rank, missing ranks with their last collective), without collective
    numbers, ports or addresses (the rank's traceback and gloo's own message carry those)."""
    text = str(err)
    lines = [re.sub(r" Rank \d+'s error:$", "", first_line(err))]
    m = _TIMEOUT.search(text)
    if m:
        who = re.sub(r"#\d+ ", "", m["who"])
        lines.append(f"rank {m['me']} waited {m['s']} s in {m['op']}; did not arrive: {who}")
    return lines


# ------------------------------------------------------------------ (b) a NaN, found at its first module


def nan_hunt(bad_step: int = 1):
    """ZeRO-2, fp32. Before step `bad_step` one weight of block 1's MLP becomes NaN on every rank
    (as a corrupt checkpoint or a bad update would leave it). The engine refuses the NaN loss;
    zl.debug.first_nonfinite then finds the first module whose output is not finite."""
    engine = make("zero2")
    rank, world = where()
    for step in range(3):
        if step == bad_step:
            with torch.no_grad():
                engine.module.transformer.h[1].mlp.c_fc.weight[0, 5] = float("nan")
        ids = tokens(step, 0, rank, world)
        out = engine(input_ids=ids, labels=ids)
        try:
            engine.backward(out.loss)
        except FloatingPointError as e:
            report = zl.debug.first_nonfinite(engine.module, input_ids=ids)
            return {"step": step, "error": first_line(e), "report": str(report)}
        engine.step()
        engine.zero_grad()
    return {"step": None}


# ------------------------------------------------------------------ (d) an fp16 loss scale that collapses


def outlier_model(boost: float = 3000.0):
    """The GPT-2 with block 1's MLP weights `boost` times larger: its output is then far beyond
    fp16's largest number (65504), as the activations of some pretrained models are."""
    model = gpt2()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(boost)
        model.transformer.h[1].mlp.c_proj.weight.mul_(boost)
    return model


def overflow(precision: str = "fp16", steps: int = 6, init_scale: float = 16.0):
    """ZeRO-2 on the outlier model: each step's loss scale, whether step() applied it, whether the
    loss was finite, until the scaler gives up (a FloatingPointError); then the first module that
    produced a non-finite value."""
    options = {"scaler": LossScaler(init_scale=init_scale)} if precision == "fp16" else {}
    engine = make("zero2", outlier_model(), precision=precision, **options)
    rank, world = where()
    rows, gave_up = [], None
    for step in range(steps):
        scale = engine.precision.scale
        ids = tokens(step, 0, rank, world)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        finite = bool(torch.isfinite(out.loss.detach()))
        try:
            applied = engine.step()
        except FloatingPointError as e:     # the scaler gives up
            gave_up = first_line(e)
            rows.append((step, scale, "raised", finite))
            break
        engine.zero_grad()
        rows.append((step, scale, applied, finite))
    ids = tokens(steps, 0, rank, world)
    report = zl.debug.first_nonfinite(engine.module, input_ids=ids)
    return {"rows": rows, "gave_up": gave_up,
            "report": None if report is None else (report.module, report.kind, report.inputs_finite)}


def overflow_runs():
    return {p: overflow(p) for p in ("fp16", "bf16")}
