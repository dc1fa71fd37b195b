"""The grader's premise, shown exact: the library's engine with bitwise=True IS one process, bit for bit.

The parity checks (zerolab.labs.checks) let a correct engine differ from one process by round-off,
because a rank sums its own rows and the all-reduce adds the ranks' sums: the same numbers added in
another order. That tolerance stands for the order of addition alone. This path proves it: the
library's own engine of a lab (zl.DDP, zl.ZeRO(stage=1 | 2 | 3)) trains the lab's model and schedule
with bitwise=True (engines.options.BITWISE: every order of addition fixed), and after every step
each rank's weights and AdamW state are torch.equal to zl.SingleProcess(bitwise=True) on the same
chunks in one process. No tolerance.

    grade("ddp", bitwise=True)
    python -m zerolab.labs grade ddp --bitwise

Only the library's engine runs this way, never the graded code: a student's reducer all-reduces in
the ring's order, so its check keeps the tolerance. Labs whose engine has no bitwise mode have no
exact path: lab 1 (a ring of integers, compared exactly already), lab 2 (fp16's loss scaler: the bitwise mode
refuses fp16), lab 7 (its own model, groups and schedule: not wired here), lab 8 (bit for bit
against eager ZeRO-3 already).

The chunks: step s has K = SCHEDULE[s] backwards on each of N ranks, so C = N * K chunks; rank r's
k-th backward is chunk r * K + k (its rows of micro-batch k), its loss divided by K, and the engine
divides the tree's sum by N. One process runs the C chunks in that order, each loss divided by C.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..engines import engine_class, make
from .checks import digits
from .lab import Check, Wrong
from .model import BUCKET_MB, OPTIMIZER, SCHEDULE, build, loss_of, micro_batch, train

EXACT = "bit for bit: bitwise=True gives one process's weights and AdamW state, torch.equal"
SECTION = 'chapter 5, "Bit for bit at any world size"'
NAMES = {"ddp": "zl.DDP", "zero1": "zl.ZeRO(stage=1)", "zero2": "zl.ZeRO(stage=2)", "zero3": "zl.ZeRO(stage=3)"}


def engine_of(lab) -> str | None:
    """The name of the library engine (zerolab.engines.make) that runs `lab` with bitwise=True, or
    None: the lab has no engine, or its engine has no bitwise mode."""
    name = getattr(lab, "engine", "")
    return name if name and engine_class(name).takes_bitwise else None


def _snapshot(engine) -> dict:
    """The weights by name and the optimizer's state by parameter index, as plain tensors."""
    weights = {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
    state = {k: {key: (v.detach().clone() if torch.is_tensor(v) else v) for key, v in st.items()}
             for k, st in engine.optimizer.state_dict()["state"].items()}
    return {"weights": weights, "state": state}


def one_process(n: int) -> list:
    """zl.SingleProcess(bitwise=True) on the C = n * K chunks of every step, in the ranks' order:
    a _snapshot after each step."""
    engine = make("single", build(), OPTIMIZER, bucket_mb=BUCKET_MB, bitwise=True)
    steps = []
    for step, micros in enumerate(SCHEDULE):
        chunks = n * micros
        for c in range(chunks):
            rank, k = divmod(c, micros)
            loss_of(engine, micro_batch(step, k, rank, n), chunks).backward()
        engine.optimizer.step()
        steps.append(_snapshot(engine))
        engine.optimizer.zero_grad()
    return steps


def measure(lab) -> dict:
    """On every rank: the lab's training (model.train: PyTorch's loop, no_sync included) on the
    library's engine with bitwise=True, a _snapshot after each step; rank 0 also runs one process."""
    name = engine_of(lab)
    if name is None:
        raise ValueError(f"lab {lab.name!r} has no exact path: {no_path(lab)}")
    engine = make(name, build(), OPTIMIZER, bucket_mb=BUCKET_MB, bitwise=True)
    steps = []
    train(engine, after_step=lambda step: steps.append(_snapshot(engine)))
    rank, n = dist.get_rank(), dist.get_world_size()
    return {"rank": rank, "n": n, "engine": NAMES[name], "steps": steps,
            "one": one_process(n) if rank == 0 else None}


def no_path(lab) -> str:
    if not getattr(lab, "engine", ""):
        return "it grades no engine of the library's that has a bitwise mode"
    return f"{NAMES.get(lab.engine, lab.engine)} has no bitwise mode"


def _differ(what: str, seen, want, d, step) -> Wrong:
    s, w = seen.reshape(-1), want.reshape(-1)
    if s.shape != w.shape or s.dtype != w.dtype:
        return Wrong("not_exact", f"after step {step}, rank {d['rank']}: {what} is {str(s.dtype)[6:]} of "
                     f"{s.numel()} elements; one process's is {str(w.dtype)[6:]} of {w.numel()}.", "", step)
    bad = (s != w).nonzero().reshape(-1)
    i = int(bad[0])
    a, b = digits(float(w[i]), float(s[i]))
    return Wrong("not_exact", f"after step {step}, rank {d['rank']} on {d['engine']}: {what} differs from one "
                 f"process's (zl.SingleProcess(bitwise=True)) in {bad.numel()} of its {s.numel()} elements; "
                 f"element {i}: expected {a}, seen {b}.",
                 "with bitwise=True every order of addition is fixed: a difference is a bug in the "
                 "library's bitwise mode (zerolab.engines.bitwise_mode), not round-off.", step)


def check(ranks) -> str:
    """Every rank's weights and AdamW state after every step against one process's, torch.equal."""
    one = ranks[0]["one"]
    for step in range(len(one)):
        want = one[step]
        for d in ranks:
            seen = d["steps"][step]
            if sorted(seen["weights"]) != sorted(want["weights"]) or sorted(seen["state"]) != sorted(want["state"]):
                raise Wrong("not_exact", f"after step {step}, rank {d['rank']}: its weights or optimizer state "
                            "name other tensors than one process's.", "", step)
            for name, w in want["weights"].items():
                if not torch.equal(seen["weights"][name], w):
                    raise _differ(f"the weight {name}", seen["weights"][name], w, d, step)
            for k, st in want["state"].items():
                for key, v in st.items():
                    s = seen["state"][k].get(key)
                    same = torch.equal(s, v) if torch.is_tensor(v) and torch.is_tensor(s) else s == v
                    if not same:
                        if torch.is_tensor(v) and torch.is_tensor(s):
                            raise _differ(f"AdamW's {key} of parameter {k}", s, v, d, step)
                        raise Wrong("not_exact", f"after step {step}, rank {d['rank']}: AdamW's {key} of "
                                    f"parameter {k} is {s!r}; one process's is {v!r}.", "", step)
    d = ranks[0]
    return (f"{d['engine']} on {d['n']} ranks with bitwise=True: after each of {len(one)} steps every rank's "
            f"weights and AdamW state are torch.equal to zl.SingleProcess(bitwise=True) on the same "
            f"{' / '.join(str(d['n'] * k) for k in SCHEDULE)} chunks: the parity check's tolerance stands for the "
            "order of addition alone")


CHECKS = (Check(EXACT, check, SECTION),)
