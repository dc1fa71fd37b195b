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

UnitLab and ZeRO3Lab are the library's classes with those left to write. The grader notes every
all-gather a unit issues and every time the engine starts using a unit, and stops the run the
moment a unit is used before its all-gather has finished.
"""

from __future__ import annotations

# the library's code: its seams are the reference
from ..engines.zero3.units import Unit, _mark_released, _storage_alloc, _storage_free
from ..engines.zero3 import ZeRO3
from ..engines.zero3.schedule import UnitSchedule
from .checks import Piece, check_collectives, check_parity, fmt_bytes, per_step
from .engine_run import moved, record_run, stub
from .lab import Check, Lab, Stop, Wrong
from .model import OPTIMIZER, SCHEDULE, build

UNIT_SEAMS = ("gather", "wait", "release", "reduce_scatter", "finish_reduce")
ENGINE_SEAMS = ("_prefetch_after",)
LIFECYCLE = "a unit is used only once its all-gather has finished"

# the helpers a unit's lifecycle needs, under the names the stubs use
storage_alloc = _storage_alloc      # give a released buffer its memory back (before gathering into it)
storage_free = _storage_free        # free a buffer's memory; the tensor keeps its shape
mark_released = _mark_released      # mark_released(params, True): reading them raises a clear error


class UnitLab(Unit):
    """A ZeRO-3 unit with its lifecycle left to write. What you can use:

    self.name, self.params        its name ("blocks.0") and parameters
    self.full["train"]            the full flat parameter buffer (its memory freed while released)
    self.shard["train"]           this rank's shard of it: what all-gather sends
    self.buckets["train"]         the layout: .padded_numel (a multiple of N), .world_size
    self.handles                  a dict you may use: kind -> handle of an all-gather in flight
    self.gathered                 True between a finished gather and the next release
    self.grad_full                the unit's full gradient, filled during backward (None if none arrived)
    self.grad_shard               this rank's reduced gradient shard, kept until zero_grad
    self._rs                      yours: (handle, output) of the reduce-scatter in flight
    self.comm                     the ledger: all_gather(out, in, async_op=True, tag=...) and
                                  reduce_scatter(out, in, async_op=True, tag=...) -> handle
    self.record(self, state, phase)   optional: notes an event for chapter 8's lifecycle plot

    and the helpers storage_alloc(t), storage_free(t), mark_released(params, True | False) of
    zerolab.labs.zero3. (Each unit here has one kind of buffer, "train".)
    """


class ZeRO3Lab(ZeRO3):
    """zl.ZeRO(stage=3) with _prefetch_after left to write, and its units made of `unit_class`.
    What you can use in it: self.prefetch (how many units to gather ahead: 1 here), and each
    unit's .gather(phase) and .reduced (True once its backward is done in this step)."""

    unit_class = UnitLab

    def _build_units(self, found, init_fn, group_of):
        super()._build_units(found, init_fn, group_of)
        self.trace = []             # the grader's: ("gather" | "use", unit name, phase), in order
        for u in self.units:
            u.comm = _UnitLedger(self, u)

    def _use(self, u, phase):
        super()._use(u, phase)
        self.trace.append(("use", u.name, phase))
        late = [r for r in u.comm.gathers if r.end is None]
        if late:
            raise Stop(LIFECYCLE, "used_before_gathered",
                       f"unit {u.name} was used in {phase} while its all-gather was still in flight: its "
                       "parameters were read before they had arrived.",
                       "wait() waits for every handle of the unit's all-gather before it marks the unit "
                       "gathered.")


class _UnitLedger:
    """The engine's ledger as one unit sees it: every all-gather it issues is noted."""

    def __init__(self, engine, unit):
        self._engine, self._unit, self.gathers = engine, unit, []

    def all_gather(self, *args, **kwargs):
        handle = self._engine.comm.all_gather(*args, **kwargs)
        self.gathers.append(self._engine.comm.records[-1])
        self._engine.trace.append(("gather", self._unit.name,
                                   "backward" if self._engine._in_backward else "forward"))
        return handle

    def __getattr__(self, name):
        return getattr(self._engine.comm, name)


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
    return data


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
        psi, n, units = sum(u.padded for u in d["units"]), d["n"], len(d["units"])
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
        if after_step["optimizer"] != 2 * shards + 4 * units:
            raise Wrong("memory", f"step {step}, rank {d['rank']}: the optimizer holds "
                        f"{fmt_bytes(after_step['optimizer'])}; AdamW on the shards holds 8 Psi / N (+ 4 B of "
                        f"step count per unit) = {fmt_bytes(2 * shards + 4 * units)}.", "")

    per_step(ranks, check)
    psi, n = sum(u.padded for u in ranks[0]["units"]), ranks[0]["n"]
    return (f"after backward 4 Psi / N of gradients, after the step 4 Psi / N of parameters and 8 Psi / N of "
            f"optimizer state: (4 + 4 + 8) Psi / N = {fmt_bytes(16 * psi // n)} (+ step counts) per rank")


def prefetch(ranks) -> str:
    def check(step, d, s):
        for phase in ("forward", "backward"):
            _check_prefetch([(kind, name) for kind, name, ph in s["trace"] if ph == phase], phase, step, d["rank"])

    per_step(ranks, check)
    return ("in forward and in backward, the next unit's all-gather was issued before the unit before it "
            "started computing")


def _check_prefetch(events, phase, step, rank):
    """events: [("gather" | "use", unit)] of one phase, in order (the last micro-batch's phase wins
    for a unit used twice). Each unit's gather must come before the previous unit's use."""
    uses = [i for i, (kind, _) in enumerate(events) if kind == "use"]
    for a, b in zip(uses, uses[1:]):
        current, following = events[a][1], events[b][1]
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
    name="zero3", number=6, title="ZeRO-3", chapter="chapter 8, ZeRO-3",
    stub_file="lab6_zero3.py", world_size=2,
    roles={"unit": UnitLab, "engine": ZeRO3Lab}, reference={"unit": ReferenceUnit, "engine": ReferenceZeRO3},
    measure=measure,
    checks=(Check(LIFECYCLE, None, 'chapter 8, "The lifecycle, from a real trace"',
                  "no unit used before its all-gather finished"),
            Check("parity with one process on the global batch", parity, 'chapter 8, "The idea"'),
            Check("bytes per step: 3 Psi", bytes_per_step, 'chapter 8, "Bytes per step: 3 Psi against 2 Psi"'),
            Check("memory: (4 + 4 + K) Psi / N", memory, 'chapter 8, "Memory per rank against N_d"'),
            Check("prefetch: the next unit is gathered ahead", prefetch,
                  'chapter 8, "Prefetch: hide the gathers behind compute"')),
    mistakes_module="zerolab.labs.zero3_mistakes",
)
