"""What zerolab's instruments cost per collective: the ledger, its flight recorder, its watchdog.

Measured on `world_size` ranks (gloo) with a small tensor (`numel` fp32 values), for all-reduce,
reduce-scatter and all-gather: the same collective called through torch.distributed directly, through
a Ledger with nothing else on (timeout=None, recorder off), with the flight recorder (zerolab.runtime.recorder)
on, and with the watchdog too (a Ledger as the engines use it). One call of each in turn, in a
rotating order, `calls` times per round: a slow moment of the machine hits them all alike, and the
cost of a variant is the median over calls of its time minus the plain call's in the same turn.
The spread is the lowest and highest of the `rounds` rounds' medians: on a shared machine the
collective itself varies by far more than the instruments cost, so only the medians of many
paired differences mean anything.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..runtime.comm import Ledger
from ..launch import launch
from ..runtime.recorder import RECORDER

VARIANTS = ("ledger", "+ recorder", "+ watchdog")
OPS = ("all_reduce", "reduce_scatter", "all_gather")

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _calls(op, n, numel):
    """{variant: a function that runs one `op`} (None: torch.distributed itself)."""
    full, part = torch.ones(numel * n), torch.empty(numel)
    plain, watched = Ledger(timeout=None), Ledger()

    def through(ledger, recorder):
        def call():
            RECORDER.enabled = recorder
            if op == "all_reduce":
                ledger.all_reduce(full)
            elif op == "reduce_scatter":
                ledger.reduce_scatter(part, full)
            else:
                ledger.all_gather(full, part)
            if len(ledger.records) > 64:
                ledger.reset()
        return call

    raw = {"all_reduce": lambda: dist.all_reduce(full), "reduce_scatter": lambda: _reduce_scatter(part, full),
           "all_gather": lambda: _all_gather(full, part)}[op]
    return {None: raw, "ledger": through(plain, False), "+ recorder": through(plain, True),
            "+ watchdog": through(watched, True)}


def overhead_worker(numel: int, calls: int, rounds: int) -> dict:
    """{op: {"collective": [round medians, us], variant: [round medians of the paired extra, us]}}."""
    n, was = dist.get_world_size(), RECORDER.enabled
    out = {}
    try:
        for op in OPS:
            fns = _calls(op, n, numel)
            order = list(fns)
            for fn in fns.values():      # warm up every path (and the recorder's file)
                for _ in range(10):
                    fn()
            rows = {k: [] for k in ["collective", *VARIANTS]}
            for _ in range(rounds):
                extra = {v: [] for v in VARIANTS}
                base = []
                dist.barrier()
                for i in range(calls):
                    took = {}
                    for k in order[i % len(order):] + order[:i % len(order)]:   # a rotating order
                        t = time.perf_counter()
                        fns[k]()
                        took[k] = time.perf_counter() - t
                    base.append(took[None] * 1e6)
                    for v in VARIANTS:
                        extra[v].append((took[v] - took[None]) * 1e6)
                rows["collective"].append(statistics.median(base))
                for v in VARIANTS:
                    rows[v].append(statistics.median(extra[v]))
            out[op] = rows
    finally:
        RECORDER.enabled = was
    return out


def measure(world_size: int = 2, numel: int = 256, calls: int = 200, rounds: int = 5) -> dict:
    """Rank 0's figures (see overhead_worker), and the instruments' total per collective:
    {"per_op": ..., "total_us": median over ops of "+ watchdog", "spread_us": (lowest, highest) round
    median of it, "collective_us": median time of the collective itself, "numel": numel}."""
    per_op = launch(overhead_worker, world_size, args=(numel, calls, rounds))[0]
    all_rounds = [x for rows in per_op.values() for x in rows["+ watchdog"]]
    return {"per_op": per_op, "numel": numel, "world_size": world_size, "calls": calls, "rounds": rounds,
            "total_us": statistics.median(statistics.median(r["+ watchdog"]) for r in per_op.values()),
            "spread_us": (min(all_rounds), max(all_rounds)),
            "collective_us": statistics.median(x for rows in per_op.values() for x in rows["collective"])}


def format_overhead(m: dict) -> str:
    """The benchmark's line: the instruments' extra time per collective, by instrument."""
    def med(v):
        return statistics.median(statistics.median(r[v]) for r in m["per_op"].values())
    ledger, recorder, watchdog = med("ledger"), med("+ recorder"), med("+ watchdog")
    lo, hi = m["spread_us"]
    return (f"zerolab's instruments per collective ({m['world_size']} ranks, gloo, {4 * m['numel']:,} bytes, "
            f"median of {m['rounds']} x {m['calls']} paired calls): {watchdog:+.1f} us in all "
            f"[rounds {lo:+.1f} to {hi:+.1f}] (ledger {ledger:+.1f}, with the flight recorder {recorder:+.1f}, "
            f"with the watchdog {watchdog:+.1f}) beside {m['collective_us']:.0f} us for the collective itself")
