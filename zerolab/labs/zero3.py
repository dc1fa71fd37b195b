"""Lab 6: ZeRO-3: a unit's gather, release and reduce-scatter, with one-unit prefetch (chapter 8).

The student writes the lifecycle of a unit (zerolab.engines.zero3.units.Unit, the methods chapter 8
prints) and the choice of what to prefetch (zerolab.engines.zero3.schedule.UnitSchedule); WHEN the
hooks call them, the step and everything else are the library's:

    Unit.gather(phase)       start the all-gather of the full buffer (nothing if done or under way)
    Unit.wait(phase)         block until gathered; the parameters may be read from then on
    Unit.release(phase)      free the full buffer; only this rank's shard is kept
    Unit.reduce_scatter()    start reducing the full gradient (divided by N) to this rank's shard
    Unit.finish_reduce()     wait for it, keep (or add to) the gradient shard, free the full gradient
    ZeRO3._prefetch_after(order, u, phase)   gather the unit that `order` needs after u

UnitLab and ZeRO3Lab are the library's classes with those left to write. The grader's instruments
(zerolab.labs.overlap) note every collective a unit issues, when, and where it is waited for, and
every time the engine starts using a unit; they stop the run the moment the lifecycle breaks: a unit
used before its all-gather has finished, or with its parameters still released or without memory, a
gather into a freed buffer, a buffer freed under a gather in flight, or freed memory left readable;
and the moment a reduce-scatter's sizes leave out the padding, or a gradient shard is not fp32.
After the run the grader asks the graded _prefetch_after what it would gather in backward when a
unit ahead had already finished its backward (a model whose backward runs out of the forward's
order does that), and releases what it gathered, as before a step: a prefetch nobody used.
"""

from __future__ import annotations

import torch
import torch.nn as nn

# the library's code: its seams are the reference
from ..engines import seams
from ..engines.zero3 import units as library_units
from ..engines.zero3.unit_state import GradState
from ..engines.zero3.units import Unit
from ..engines.zero3 import ZeRO3
from ..engines.zero3.schedule import UnitSchedule
from .checks import PARITY, Piece, adam_state_bytes, check_collectives, check_parity, fmt_bytes, per_step
from .engine_run import WrongDtypeStops, instrument, moved, record_run, stub
from .lab import Check, Lab, Stop, Wrong
from .model import OPTIMIZER, SCHEDULE, build
from .overlap import blocked, defined_at, overlapped, where
from .plugins import GradedCode

UNIT_SEAMS = seams.of("Unit")
ENGINE_SEAMS = seams.of("UnitSchedule")
LIFECYCLE = "a unit is used only once gathered, and freed only once its gather is done"
PREFETCH_SECTION = 'chapter 8, "Prefetch: hide the gathers behind compute"'
BYTES = "bytes per step: 3 Psi"

_RUN = {"in_flight": {}, "graded": None}   # the run in progress: data pointer -> its all-gather's Entry


# ------------------------------------------------------------------ the helpers a unit's lifecycle uses


def storage_alloc(t: torch.Tensor) -> None:
    """Give the tensor `t`, whose memory storage_free took, its memory back, in place: t and every
    view of it (the unit's parameters) can be read again, but the values are garbage until
    something writes them (gather into it). Nothing happens if t has its memory. Example:
    storage_alloc(self.full["train"])."""
    library_units.storage_alloc(t)


def mark_released(params, released: bool) -> None:
    """Mark the parameters `params` (a list of nn.Parameter) released (released=True) or readable
    again (released=False). A released parameter keeps its shape, dtype, device, .grad and hooks,
    but any operation that reads its values (print(p), p + 1, a forward outside the engine) raises
    an error that says where the values are, instead of reading memory that storage_free gave
    back. Marking twice is harmless. Example: mark_released(self.params, True)."""
    library_units.mark_released(params, released)


def storage_free(t: torch.Tensor) -> None:
    """Free the tensor `t`'s memory, in place: t keeps its shape, and so does every view of it (the
    unit's parameters), but it holds 0 bytes until storage_alloc gives them back; reading it then
    would fail with a bare out-of-bounds error, or read freed memory, so mark the parameters
    released first. Freeing a tensor whose memory is already freed does nothing. (The grader's
    version of the library's helper also refuses to free a buffer an all-gather is still writing
    into: gloo would go on writing into memory given back.) Example: storage_free(self.full["train"])."""
    entry = _RUN["in_flight"].get(t.untyped_storage().data_ptr()) if t.untyped_storage().nbytes() else None
    if entry is not None and entry.waited is None:
        raise Stop(LIFECYCLE, "released_in_flight",
                   f"unit {entry.owner}'s full buffer was freed {where(_RUN['graded'])} while its all-gather was "
                   "still in flight (issued, never waited for): gloo would go on writing into memory given back. "
                   "It happens to a prefetch nobody used (here: a unit gathered ahead, then released before a "
                   "step).", "release() first finishes a gather still in flight (waits for its handles), and only "
                   "then frees the buffer.")
    library_units.storage_free(t)


def _allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


class UnitLab(Unit):
    """A ZeRO-3 unit with its lifecycle left to write. What you can use:

    self.name, self.params        its name ("blocks.0") and parameters
    self.full["train"]            the full flat parameter buffer (its memory freed while released)
    self.shard["train"]           this rank's shard of it: what all-gather sends
    self.buckets["train"]         the layout: .padded_numel (a multiple of N), .world_size
    self.handles                  a dict you may use: kind -> handle of an all-gather in flight
    self.gathered                 True between a finished gather and the next release
    self.grad_full                the unit's full gradient, flat and padded, filled during backward
                                  (None if none arrived); the full buffer's dtype and device
    self.grad_shard               this rank's reduced gradient shard, kept until zero_grad
    self._rs                      yours: (handle, output) of the reduce-scatter in flight
    self.comm                     the ledger (zerolab.runtime.comm.Ledger): all_gather(out, in,
                                  async_op=False, tag="") and reduce_scatter(out, in, ...): a
                                  handle with .wait() if async_op, else None once done
    self.record(self, state, phase)   optional: notes an event for chapter 8's lifecycle plot

    and the helpers of zerolab.labs.zero3: storage_alloc(t) gives a freed buffer its memory back
    (its values are then garbage), storage_free(t) frees it (the tensor keeps its shape, views of
    it keep theirs), mark_released(params, True | False) marks parameters released (reading one
    raises an error that says where the values are) or readable again. (Each unit here has one
    kind of buffer, "train".)

    `phase`, the argument of gather, wait and release, says why they are called: "forward" or
    "backward" (the unit's own, or a prefetch for it), "step" (every unit is released before the
    optimizer step) or "inspect" (engine.gathered_parameters()).
    """


class ZeRO3Lab(WrongDtypeStops, ZeRO3):
    """zl.ZeRO(stage=3) with _prefetch_after left to write, and its units made of `unit_class`.
    What you can use in it: self.prefetch (how many units to gather ahead: 1 here), and each
    unit's .gather(phase) and .reduced (True once its backward is done in this step)."""

    unit_class = UnitLab

    # -------------------------------------------------------------- the grader's instruments
    def _grad_label(self, i: int) -> str:
        return f"unit {self._trained()[i].name} (rank {self.rank}'s shard)"

    def watch(self, graded) -> None:
        """Give each unit its view of the graded ledger, and check every unit's release."""
        self.trace = []             # ("gather" | "use", unit name, phase), in order
        self.graded = graded
        graded.on_issue = self._issued
        for u in self.units:
            u.comm = graded.for_owner(u.name)
            u.release = _checked_release(u, u.release)

    def _issued(self, entry, out, inp=None):
        if entry.op == "reduce_scatter":
            self._check_padded(entry, out, inp)
        if entry.op != "all_gather":
            return
        if out is not None and not _allocated(out):
            raise Stop(LIFECYCLE, "not_allocated",
                       f"unit {entry.owner}'s all-gather was issued {where(self.graded._graded_code)} into a "
                       "buffer whose memory is freed (0 bytes): there is nowhere for the gathered values to go.",
                       "give the full buffer its memory back (storage_alloc) before gathering into it.")
        if self.graded.clock.phase is not None:     # (not the gathers that read the weights between steps)
            self.trace.append(("gather", entry.owner, "backward" if self._in_backward else "forward"))
        if out is not None:
            _RUN["in_flight"][out.untyped_storage().data_ptr()] = entry

    def _check_padded(self, entry, out, inp) -> None:
        """A unit's reduce-scatter takes its padded gradient and gives this rank padded_numel / N."""
        unit = next((u for u in self.units if u.name == entry.owner and "train" in u.buckets), None)
        if unit is None or out is None or inp is None:
            return
        b, n = unit.buckets["train"], self.world_size
        if (inp.numel(), out.numel()) != (b.padded_numel, b.padded_numel // n):
            raise Stop(BYTES, "unpadded_shard",
                       f"unit {unit.name}'s reduce-scatter was issued {where(self.graded._graded_code)} from "
                       f"{inp.numel()} elements into a shard of {out.numel()}; the unit has {b.numel} real elements, "
                       f"padded to {b.padded_numel} ({b.padded_numel - b.numel} of padding) so that N = {n} divides "
                       f"it: its gradient is {b.padded_numel} elements and each rank's shard padded_numel / N = "
                       f"{b.padded_numel // n}" + (f", not numel // N = {b.numel // n}" if out.numel() == b.numel // n
                                                   else "") + ".",
                       "size the output from the PADDED length: self.buckets[\"train\"].padded_numel // N, as the "
                       "shard the all-gather sends.")

    def _use(self, u, phase):
        at = self.graded.clock.count
        super()._use(u, phase)
        self.trace.append(("use", u.name, phase))
        mine = [e for e in self.graded.entries if e.owner == u.name and e.op == "all_gather"]
        for e in mine:
            if e.needed is None:
                e.needed = at       # (overlap: the compute between a prefetch's launch and now)
        if any(e.record.end is None for e in mine):
            raise Stop(LIFECYCLE, "used_before_gathered",
                       f"unit {u.name} was used in {phase} while its all-gather was still in flight, once your "
                       f"wait{defined_at(type(u).wait)} had returned: its parameters were read before they had "
                       "arrived.",
                       "wait() returns only once every all-gather of the unit has been waited for.")
        if not all(_allocated(p) for p in u.params):
            raise Stop(LIFECYCLE, "gathered_elsewhere",
                       f"unit {u.name} was used in {phase} with its parameters' memory still freed (0 bytes), "
                       f"although your gather{defined_at(type(u).gather)} and wait had run: the parameters are "
                       "views into the unit's full buffer as it was built, and the all-gather wrote somewhere "
                       "else.",
                       "gather into the buffers of self.full themselves, after giving each its memory back "
                       "(storage_alloc); a new tensor is not what the parameters look at.")
        if any(type(p) is not nn.Parameter for p in u.params):
            raise Stop(LIFECYCLE, "still_released",
                       f"unit {u.name} was used in {phase} after your wait{defined_at(type(u).wait)} returned, "
                       "but its parameters are still marked released: the gathered values are there, and "
                       "reading them raises the error meant for released parameters.",
                       "once the gather is complete, wait() makes the parameters readable again "
                       "(mark_released with False).")


def _checked_release(u, release):
    """u.release, then: freed memory must not be readable (a read would crash, or worse)."""
    def checked(phase):
        release(phase)
        readable = [p for p in u.params if type(p) is nn.Parameter and not _allocated(p)]
        if readable:
            raise Stop(LIFECYCLE, "release_not_marked",
                       f"unit {u.name} was released in {phase} by your release{defined_at(type(u).release)}: "
                       "its memory is freed, but its parameters are not marked released, so reading one "
                       "(print(p), a forward outside the engine) would fail with a bare out-of-bounds error, or "
                       "read freed memory.",
                       "release() marks the parameters released (mark_released with True) as it frees them.")
    return checked


for _name in UNIT_SEAMS:
    setattr(UnitLab, _name, stub("lab 6", "UnitLab", _name))
for _name in ENGINE_SEAMS:
    setattr(ZeRO3Lab, _name, stub("lab 6", "ZeRO3Lab", _name))

ReferenceUnit = type("ReferenceUnit", (UnitLab,), {name: vars(Unit)[name] for name in UNIT_SEAMS})
ReferenceZeRO3 = type("ReferenceZeRO3", (ZeRO3Lab,), {name: vars(UnitSchedule)[name] for name in ENGINE_SEAMS})


# ------------------------------------------------------------------ one graded run, on every rank


def measure(plugin) -> dict:
    model = build()
    names = {id(p): name for name, p in model.named_parameters()}
    engine_class = type("Graded", (plugin["engine"],), {"unit_class": plugin["unit"]})
    engine = engine_class(model, OPTIMIZER, prefetch=1)
    graded = GradedCode(LAB, plugin)
    _RUN.update(in_flight={}, graded=graded)
    engine.watch(instrument(engine, graded, replace_comm=False))
    units = [u for u in engine.units if "train" in u.buckets]

    def piece(u, whole=False):
        b = u.buckets["train"]
        s = b.shard(engine.rank)
        return Piece(f"unit {u.name}" + ("" if whole else f" (rank {engine.rank}'s shard)"),
                     [(names[id(p)], o, n) for p, o, n in zip(b.params, b.offsets, b.sizes)], b.padded_numel,
                     0 if whole else s.start, None if whole else s.stop)

    def weights(e):
        with e.gathered_parameters():
            return [u.full["train"].clone() for u in units]

    def trace(e, step):
        out = {"trace": list(e.trace), "memory": e.memory_report()}
        e.trace.clear()
        return out

    data = record_run(engine, [piece(u) for u in units], held=lambda e: [u.grad_shard for u in units],
                      weights=weights, after_backward=trace,
                      after_step=lambda e, step: {"memory_after_step": e.memory_report()})
    data["units"] = [piece(u, whole=True) for u in units]
    data["probe"] = _probe_backward_prefetch(engine)
    data["prefetch_at"] = defined_at(type(engine)._prefetch_after)
    data["prefetch"] = engine.prefetch
    return data


def _probe_backward_prefetch(engine) -> list:
    """What the graded _prefetch_after gathers in backward, as blocks.2 is about to compute, when
    blocks.1's backward is already done (the lab's model runs its units' backwards in order; a
    model whose backward runs a unit out of the forward's order does this). Then every unit is
    released, as before a step: the prefetch was never used. Returns the units it gathered."""
    by = {u.name: u for u in engine.units}
    order = [by[name] for name in ("root", "blocks.2", "blocks.1", "blocks.0")]
    for u in engine.units:          # (set, not moved: the scenario a schedule is asked about)
        u.grad_state = GradState.REDUCED if u is by["blocks.1"] else GradState.WAITING
    mark = len(engine.graded.entries)
    engine._prefetch_after(order, by["blocks.2"], "backward")
    gathered = [e.owner for e in engine.graded.entries[mark:] if e.op == "all_gather"]
    for u in engine.units:
        u.release("step")
    return gathered


# ------------------------------------------------------------------ the checks, in the parent


def parity(ranks) -> str:
    check_parity(ranks, "units", lambda piece: "the gradient shard", sharded=True)
    return (f"after every backward each rank's gradient shards hold the global batch's mean gradient, and "
            f"after every step the gathered weights are one process's ({len(SCHEDULE)} steps)")


def bytes_per_step(ranks) -> str:
    def check(step, d, s):
        sizes = [u.padded for u in d["units"]]
        per_micro = [("all_gather", x) for x in sizes] * 2 + [("reduce_scatter", x) for x in sizes]
        check_collectives(d["rank"], step, moved(s), per_micro * SCHEDULE[step], d["n"],
                          "per unit and micro-batch, an all-gather before its forward, another before its "
                          "backward, and a reduce-scatter of its gradient: 3 Psi in the paper's units")

    per_step(ranks, check)
    total = sum(u.padded for u in ranks[0]["units"])
    third = (ranks[0]["n"] - 1) / ranks[0]["n"] * 4 * total
    return (f"a step of one micro-batch sends {fmt_bytes(2 * third)} by all-gather (forward and backward) + "
            f"{fmt_bytes(third)} by reduce-scatter = 3(N-1)/N x 4 B x {total} (padded Psi) per rank: 1.5 x DDP's")


def memory(ranks) -> str:
    def check(step, d, s):
        psi, n = sum(u.padded for u in d["units"]), d["n"]
        shards = 4 * psi // n
        after_backward, after_step = s["memory"], s["memory_after_step"]
        if after_backward["grads"] != shards:
            raise Wrong("full_gradient_kept", f"step {step}, rank {d['rank']}: after backward it holds "
                        f"{fmt_bytes(after_backward['grads'])} of gradients; ZeRO-3 keeps only its gradient "
                        f"shards, 4 Psi / N = {fmt_bytes(shards)}.",
                        "once a unit's reduce-scatter has finished, drop its full gradient (self.grad_full = None).")
        if after_step["params"] != shards:
            raise Wrong("parameters_kept", f"step {step}, rank {d['rank']}: after the step it holds "
                        f"{fmt_bytes(after_step['params'])} of parameters; between uses ZeRO-3 holds only its "
                        f"shards, 4 Psi / N = {fmt_bytes(shards)}.",
                        "release() frees the full buffer's memory (storage_free), not only the flag.")
        state = adam_state_bytes(d["units"], n, d["rank"])
        if after_step["optimizer"] != state:
            raise Wrong("memory", f"step {step}, rank {d['rank']}: the optimizer holds "
                        f"{fmt_bytes(after_step['optimizer'])}; AdamW on the shards holds 8 B per real element "
                        f"of them (8 Psi / N, less the padding) + 4 B of step count per parameter it holds "
                        f"a part of = {fmt_bytes(state)}.", "")

    per_step(ranks, check)
    psi, n = sum(u.padded for u in ranks[0]["units"]), ranks[0]["n"]
    return (f"after backward 4 Psi / N of gradients, after the step 4 Psi / N of parameters and 8 Psi / N of "
            f"optimizer state: (4 + 4 + 8) Psi / N = {fmt_bytes(16 * psi // n)} (+ step counts) per rank")


def prefetch(ranks) -> str:
    def check(step, d, s):
        for phase in ("forward", "backward"):
            _check_prefetch([(kind, name) for kind, name, ph in s["trace"] if ph == phase], phase, step, d["rank"],
                            d["prefetch"], d["prefetch_at"])

    per_step(ranks, check)
    for d in ranks:
        _check_probe(d["probe"], d["rank"], d["prefetch_at"])
    return (f"in forward and in backward, the next unit's all-gather was issued before the unit before it "
            f"started computing, and never more than prefetch = {ranks[0]['prefetch']} unit ahead; and in backward "
            "a unit whose backward was done was not gathered again")


def _check_probe(gathered: list, rank: int, at: str) -> None:
    """The probe (_probe_backward_prefetch): with blocks.1's backward done, the unit to gather
    ahead of blocks.2 is blocks.0."""
    asked = ("(The grader asked your _prefetch_after after the run: in backward, as blocks.2 is about to "
             "compute, with blocks.1's backward already done, which happens when a model's backward runs a "
             "unit out of the forward's order.)")
    if "blocks.1" in gathered:
        raise Wrong("stale_prefetch", f"rank {rank}: in backward, as blocks.2 was about to compute, your "
                    f"_prefetch_after{at} gathered blocks.1, whose backward was already done: a stale gathered copy. "
                    "Its backward will not run again in this step, so the all-gather moves its bytes for nothing "
                    f"and holds its memory until the step. {asked}",
                    "in backward, skip the units whose backward is done (v.reduced) and gather the next ones "
                    "that still need theirs.")
    if "blocks.0" not in gathered:
        raise Wrong("prefetch_not_past_done", f"rank {rank}: in backward, as blocks.2 was about to compute and "
                    f"blocks.1's backward was already done, your _prefetch_after{at} gathered "
                    f"{', '.join(gathered) or 'nothing'}: blocks.0, the next unit whose backward is still to "
                    f"run, was not gathered ahead, so its backward will wait for its all-gather. {asked}",
                    "skip the units whose backward is done, and gather the next `self.prefetch` units after "
                    "them, not fewer.")


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' * (n != 1)}"


def overlap(ranks) -> str:
    least = {"all_gather": [], "reduce_scatter": []}

    def check(step, d, s):
        entries = [e for e in s["entries"] if e[0] in least]
        bad = blocked(entries, tuple(least))
        if bad:
            op, _, unit, phase, launched, waited, needed, where_, blocking = bad[0]
            how = (f"was issued without async_op=True {where_}, so it returned finished" if blocking else
                   f"was waited for {where_} right after it was launched")
            if op == "all_gather":
                work = "module forward" if phase == "forward" else "autograd operation"
                raise Wrong("blocking_gather",
                            f"step {step}, rank {d['rank']}, {phase}: the all-gather of unit {unit}, issued ahead "
                            f"of its use (a prefetch), {how}: {_count(needed - launched, work)} started between its "
                            "launch and the unit's use, and none of them while it was in flight. The prefetch "
                            "hid nothing: compute stood still while the unit's parameters travelled.",
                            "gather() only starts the all-gather (async_op=True) and returns at once, keeping "
                            "the handle in self.handles; wait() waits for it, when the unit is about to compute.")
            raise Wrong("blocking_reduce_scatter",
                        f"step {step}, rank {d['rank']}: unit {unit}'s reduce-scatter {how}: backward still had "
                        f"{needed - launched} autograd operations to start, and none of them started while it "
                        "was in flight. Backward stood still while the gradient travelled.",
                        "reduce_scatter() only starts it (async_op=True) and keeps (handle, output) in "
                        "self._rs; finish_reduce() waits for it, which the engine calls a unit later.")
        for op in least:
            least[op] += [events for _, events in overlapped(entries, (op,))]

    per_step(ranks, check)
    gathers = (f"every all-gather issued ahead was in flight while at least "
               f"{_count(min(least['all_gather']), 'module forward or autograd operation')} started"
               if least["all_gather"] else "no all-gather was issued ahead (the prefetch check says why)")
    reduces = (f"every reduce-scatter with backward left to run while at least "
               f"{_count(min(least['reduce_scatter']), 'autograd operation')} did" if least["reduce_scatter"] else
               "no reduce-scatter had backward left to run")
    return f"{gathers}, and {reduces} (graded by the order of events, not by time)"


def _check_prefetch(events, phase, step, rank, prefetch, at):
    """events: [("gather" | "use", unit)] of one phase, in order (a step of two micro-batches has
    each phase twice). Each unit's gather must come before the previous unit's use, and when a
    unit starts computing at most `prefetch` units may be gathered ahead of it (gathered, not yet
    used)."""
    uses = [i for i, (kind, _) in enumerate(events) if kind == "use"]
    for a, b in zip(uses, uses[1:] + [None]):
        current = events[a][1]
        ahead = []              # gathered, and not used since: what is in memory ahead of `current`
        for kind, name in events[:a + 1]:
            ahead = ahead + [name] if kind == "gather" else [v for v in ahead if v != name]
        if len(ahead) > prefetch:
            raise Wrong("prefetch_too_far", f"step {step}, rank {rank}, {phase}: when {current} started computing, "
                        f"{len(ahead)} units had been gathered ahead of it ({', '.join(ahead)}), by your "
                        f"_prefetch_after{at}; with prefetch = {prefetch} the engine gathers {prefetch} ahead. Each "
                        "unit gathered beyond that holds its full parameters from the moment its gather is "
                        "issued: the memory prefetch was set to bound (and in backward a unit may be needed in "
                        "another order than the one guessed).",
                        "gather at most `self.prefetch` of the units after u (after skipping, in backward, those "
                        "whose backward is done).")
        if b is None:
            break
        following = events[b][1]
        start = max([i for i in uses if i < a], default=-1)
        gathered = [name for kind, name in events[:a] if kind == "gather"]
        if following in gathered:
            continue
        ahead = [name for kind, name in events[start + 1:a] if kind == "gather" and name != current]
        if ahead:
            raise Wrong("prefetch_wrong_unit", f"step {step}, rank {rank}, {phase}: when {current} started "
                        f"computing, the unit {phase} needs next, {following}, had not been gathered; the "
                        f"gather issued ahead was for {', '.join(ahead)}.",
                        "prefetch the unit right after u in `order` (order[i + 1], skipping in backward the "
                        "units whose backward is already done).")
        raise Wrong("no_prefetch", f"step {step}, rank {rank}, {phase}: when {current} started computing, "
                    f"nothing had been gathered ahead: {following}, the unit {phase} needs next, was gathered "
                    "only when it was needed, and compute waited for it.",
                    "_prefetch_after gathers the next `self.prefetch` units of `order` after u.")


LAB = Lab(
    name="zero3", engine="zero3", number=6, title="ZeRO-3", chapter="chapter 8, ZeRO-3",
    stub_file="lab6_zero3.py", world_size=2,
    roles={"unit": UnitLab, "engine": ZeRO3Lab}, reference={"unit": ReferenceUnit, "engine": ReferenceZeRO3},
    measure=measure,
    checks=(Check(LIFECYCLE, None, 'chapter 8, "The idea" and "The lifecycle, from a real trace"',
                  "no unit used before its all-gather finished, none freed under a gather in flight"),
            Check(PARITY, parity, 'chapter 8, "The idea"'),
            Check(BYTES, bytes_per_step, 'chapter 8, "Bytes per step: 3 Psi against 2 Psi"'),
            Check("memory: (4 + 4 + K) Psi / N", memory, 'chapter 8, "Memory per rank against N_d"'),
            Check("prefetch: the next unit is gathered ahead", prefetch, PREFETCH_SECTION),
            Check("overlap: compute runs while units are gathered and reduced", overlap, PREFETCH_SECTION)),
    mistakes_module="zerolab.labs.zero3_mistakes",
    blame={**dict.fromkeys(("not_divided", "divided_twice", "all_reduce", "bytes", "zeros", "unpadded_shard"),
                           ("reduce_scatter",)),
           **dict.fromkeys(("lost_micro_batch", "added_to_local", "not_reduced", "divided_not_reduced",
                            "full_gradient_kept", "grad_dtype"), ("finish_reduce",)),
           **dict.fromkeys(("parameters_kept", "released_in_flight", "release_not_marked"), ("release",)),
           **dict.fromkeys(("used_before_gathered", "still_released"), ("wait",)),
           **dict.fromkeys(("not_allocated", "gathered_elsewhere", "blocking_gather"), ("gather",)),
           "blocking_reduce_scatter": ("reduce_scatter",), "weights": ("finish_reduce",),
           **dict.fromkeys(("prefetch_too_far", "prefetch_wrong_unit", "no_prefetch", "stale_prefetch",
                            "prefetch_not_past_done"), ("_prefetch_after",))},
)
