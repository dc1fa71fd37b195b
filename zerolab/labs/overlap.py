"""Overlap, graded as overlap: what compute ran while each collective was in flight (labs 3, 5, 6).

THE RULE. A collective OVERLAPPED if at least one piece of compute STARTED after the graded code
launched it and before the graded code waited for it. A collective COULD overlap if compute started
between its launch and the moment it is needed: for a gradient's reduction, the end of backward;
for a unit's all-gather, the unit's use. Only those are graded: the last bucket (full only when
backward's last gradient arrives) and a unit gathered just as it is needed have nothing to hide
behind, and no rule asks them to.

Compute is counted in EVENTS, not seconds: in backward, each autograd node that starts (a matmul's
backward, a gradient accumulated into a leaf); in forward, each leaf module whose forward starts (a
Linear). "Waited for" is the moment the graded code calls wait() on the collective's handle (or, for
a collective issued without async_op=True, the moment it was issued, since it returns finished).

Why events and not a fraction of wall-clock time: on 2 CPU cores shared by two ranks (and whatever
else runs there), whether a 300-byte all-gather is over before the next operation starts is
scheduling noise. The ORDER of events on one rank is not: autograd runs the backward of a CPU model
on the thread that called backward, so a wait() the graded code calls right after the launch comes
before every later node, however fast or slow the machine, and a wait() called one hook later comes
after at least the node that fired that hook. The library's own code passes on any machine; a
reduce or gather that waits in place fails on any machine.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

from .checks import BOOKKEEPING, per_step
from .lab import Stop, Wrong


class ComputeClock:
    """Counts compute as it starts: leaf modules' forwards (watch_forward) and autograd nodes
    (watch_backward, once per backward: the graph is new every forward). `phase` is "forward",
    "backward" or None (not training: reading weights, the step), set by phase()."""

    def __init__(self):
        self.count = 0
        self.phase = None

    def tick(self, *_):
        self.count += 1

    def watch_forward(self, model) -> None:
        for m in model.modules():
            if next(m.children(), None) is None:        # a leaf: where forward's compute is
                m.register_forward_pre_hook(self.tick)

    def watch_backward(self, loss) -> None:
        """A pre-hook on every node of loss's graph: it ticks as the node starts."""
        seen, todo = set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            node.register_prehook(self.tick)
            todo += [nxt for nxt, _ in node.next_functions]

    @contextlib.contextmanager
    def during(self, phase: str):
        self.phase = phase
        try:
            yield
        finally:
            self.phase = None


@dataclass
class Entry:
    """One collective issued by the engine: the clock when it was launched, when it was waited for
    (None: not yet), and when it was needed (None: not yet known); where the wait was, in the
    graded code; the phase it was launched in; the unit that issued it (ZeRO-3)."""

    op: str
    tag: str
    record: object              # the ledger's CommRecord
    launched: int
    phase: str | None
    owner: str = ""
    waited: int | None = None
    needed: int | None = None
    where: str = ""             # "in _reduce (lab3_ddp.py, line 40)": the graded code that waited
    blocking_call: bool = False  # issued without async_op=True: it returned finished

    def row(self) -> tuple:
        """What the parent reads (picklable)."""
        return (self.op, self.tag, self.owner, self.phase, self.launched, self.waited, self.needed,
                self.where, self.blocking_call)


class GradedLedger:
    """The engine's ledger as the graded code sees it: the same collectives on the same records,
    and for each all-reduce, reduce-scatter and all-gather an Entry. Anything else is the ledger's.
    for_owner(name) gives a unit its own view (its entries carry its name)."""

    GRADED_OPS = ("all_reduce", "reduce_scatter", "all_gather")

    def __init__(self, ledger, clock: ComputeClock, graded_code, owner: str = "", entries=None, on_issue=None):
        """graded_code: a zerolab.labs.plugins.GradedCode (whose frames a message may name);
        on_issue(entry, output tensor, input tensor or None), if given, hears of every collective
        as it is issued."""
        self._ledger, self._clock, self._graded_code, self._owner = ledger, clock, graded_code, owner
        self.entries = [] if entries is None else entries
        self.on_issue = on_issue

    @property
    def clock(self) -> ComputeClock:
        return self._clock

    def for_owner(self, owner: str) -> "GradedLedger":
        return GradedLedger(self._ledger, self._clock, self._graded_code, owner, self.entries, self.on_issue)

    def _issue(self, op, args, kwargs):
        launched = self._clock.count
        entry = Entry(op, kwargs.get("tag", ""), None, launched, self._clock.phase, self._owner)
        if self.on_issue is not None:
            self.on_issue(entry, args[0] if args else kwargs.get("output", kwargs.get("tensor")),
                          args[1] if len(args) > 1 else kwargs.get("input"))
        handle = getattr(self._ledger, op)(*args, **kwargs)
        entry.record = self._ledger.records[-1]
        self.entries.append(entry)
        if handle is None:              # issued without async_op=True: it returned finished
            entry.waited, entry.blocking_call = launched, True
            entry.where = where(self._graded_code)
            return None
        return GradedHandle(handle, entry, self)

    def all_reduce(self, *args, **kwargs):
        return self._issue("all_reduce", args, kwargs)

    def reduce_scatter(self, *args, **kwargs):
        return self._issue("reduce_scatter", args, kwargs)

    def all_gather(self, *args, **kwargs):
        return self._issue("all_gather", args, kwargs)

    def __getattr__(self, name):
        return getattr(self._ledger, name)


class GradedHandle:
    """A collective's handle that notes, at the first wait(), the compute clock and where the
    graded code waited."""

    def __init__(self, handle, entry: Entry, ledger: GradedLedger):
        self._handle, self.entry, self._graded = handle, entry, ledger

    @property
    def record(self):
        return self._handle.record

    def is_completed(self) -> bool:
        return self._handle.is_completed()

    def wait(self) -> None:
        e = self.entry
        if e.waited is None:
            e.waited = self._graded._clock.count
            e.where = where(self._graded._graded_code)
        self._handle.wait()


# ------------------------------------------------------------------ where in the graded code


def frames_in(graded, frame=None) -> list:
    """[(function, file name, line)] of the frames of the graded code (a plugins.GradedCode) on the
    stack, innermost first."""
    out = []
    frame = frame or sys._getframe(1)
    while frame is not None:
        if frame.f_code in graded:
            out.append((frame.f_code.co_name, os.path.basename(frame.f_code.co_filename), frame.f_lineno))
        frame = frame.f_back
    return out


def waited_where(engine) -> str:
    """where() for an instrumented engine (engine_run.instrument), with a leading space; '' if the
    engine is not instrumented or no graded code is on the stack."""
    graded = getattr(engine, "graded", None)
    text = where(graded._graded_code) if graded is not None else ""
    return f" {text}" if text else ""


def where(graded) -> str:
    """'in _reduce (lab3_ddp.py, line 40)', or 'in wait (lab6_zero3.py, line 30), called from
    gather (line 22)': the innermost frame of the graded code, and the method that called it when
    that is another method of the graded code. '' if no graded code is on the stack."""
    frames = [] if graded is None else frames_in(graded, sys._getframe(1))
    if not frames:
        return ""
    name, file, line = frames[0]
    text = f"in {name} ({file}, line {line})"
    # the method that called it, when the same file writes it (not the library's own reducer, which a
    # planted mistake or a partial solution keeps)
    outer = next((f for f in frames[1:] if f[0] != name), None)
    if outer is not None and outer[1] == file:
        text += f", called from {outer[0]} (line {outer[2]})"
    return text


# ------------------------------------------------------------------ the check, in the parent


def blocked(entries: list, ops: tuple) -> list:
    """The entries of `ops` that could have overlapped and did not (see the module docstring),
    in launch order. entries: Entry.row() tuples."""
    out = []
    for e in entries:
        op, _, _, phase, launched, waited, needed, *_ = e
        if op in ops and phase is not None and needed is not None and needed > launched \
                and waited is not None and waited <= launched:
            out.append(e)
    return out


def overlapped(entries: list, ops: tuple) -> list:
    """[(entry, events that started while it was in flight)] for the entries that could overlap."""
    out = []
    for e in entries:
        op, _, _, phase, launched, waited, needed, *_ = e
        if op in ops and phase is not None and needed is not None and needed > launched:
            out.append((e, (needed if waited is None else waited) - launched))
    return out


# ------------------------------------------------------------------ labs 3 and 5: a bucket's reduction


def not_async(check: str, b: int, method, name: str) -> Stop:
    """The Stop for a _reduce that returned no handle (its collective ran without async_op=True)."""
    return Stop(check, "not_async",
                f"bucket {b}: your _reduce{defined_at(method)} returned None, not the handle of the {name} it started: "
                f"issued without async_op=True, the {name} ran to the end inside _reduce (backward stood "
                "still meanwhile) and left nothing to wait for.",
                "start the collective asynchronously and return its handle; the reducer waits for it later.")


def check_handle(check: str, b: int, handle, method, name: str) -> None:
    """Raise the Stop for a _reduce whose return is not the ledger's handle of its collective."""
    if handle is None:
        raise not_async(check, b, method, name)
    if not hasattr(handle, "record"):
        raise Stop(check, "not_the_ledger",
                   f"bucket {b}: your _reduce{defined_at(method)} returned a {type(handle).__name__}, not a handle of "
                   f"the engine's ledger: the {name} went straight to torch.distributed, where nothing counts "
                   "its bytes or notes when it was waited for.",
                   "issue every collective through self.comm, the engine's ledger: it takes the same arguments.")


def defined_at(method) -> str:
    """' (lab3_ddp.py, line 40)': where a method is written ('' if unknown)."""
    code = getattr(method, "__code__", None)
    return "" if code is None else f" ({os.path.basename(code.co_filename)}, line {code.co_firstlineno})"


def gradient_entries(s, op: str) -> list:
    """A step's collectives of `op` that move gradients, in launch order: bucket 0 first (the
    protocol check holds the reducer to index order, and one backward per step reduces)."""
    return [e for e in s["entries"] if e[0] == op and e[1] not in BOOKKEEPING]


def check_overlap(ranks, op: str, name: str, waits: str) -> str:
    """Every bucket's `op` launched while backward had compute left must be in flight while some
    of it starts (the module's rule). name: 'all-reduce'; waits: who waits for it instead."""
    least = []

    def check(step, d, s):
        entries = gradient_entries(s, op)
        if not any(needed is not None and needed > launched for *_, launched, _, needed, _, _ in entries):
            raise Wrong("no_overlap", f"step {step}, rank {d['rank']}: every bucket's {name} was launched after "
                        "backward's last autograd operation had started: they all waited for the end of "
                        "backward, so nothing overlapped.", "launch each bucket as soon as its last gradient is "
                        "in (and every bucket before it has been launched), from the gradient hook.")
        for e in blocked(entries, (op,)):
            b = entries.index(e)
            *_, launched, waited, needed, where, blocking = e
            how = (f"was issued without async_op=True {where}, so it returned finished" if blocking else
                   f"was waited for {where} right after it was launched")
            raise Wrong("blocking_reduce",
                        f"step {step}, rank {d['rank']}: bucket {b}'s {name} {how}: backward still had "
                        f"{needed - launched} autograd operations to start, and none of them started while it "
                        "was in flight. Backward stood still for every such bucket: the reduction was "
                        "bucketed, not overlapped.",
                        f"_reduce starts the collective (async_op=True) and returns its handle at once; {waits}.")
        least.extend(events for _, events in overlapped(entries, (op,)))

    per_step(ranks, check)
    return (f"in every step, every bucket launched while backward had work left was in flight while at "
            f"least {min(least)} of backward's autograd operations started (graded by the order of events, "
            "not by time)")
