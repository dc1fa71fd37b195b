"""The benchmark's report: per-engine rows from the ranks' raw timings, the table, the targets.

zerolab.bench runs the engines and collects, per round and rank, every step's time, the
memory and bytes measured, and the final loss; this module turns that into what is printed:

    summarize(results, steps)   rows: median step time, ratios against the floor and the fastest
                                peer of the same kind (per round, the ratio of the two engines'
                                median steps; the median of those over rounds), memory, bytes;
                                and for every timing its spread: the lowest and highest round
                                (each round runs in fresh processes, every engine interleaved)
    format_table(summary)       the Markdown table `python -m zerolab bench` prints (or one half of
                                it: TIMING_COLUMNS, COUNT_COLUMNS)
    format_ratios(summary)      what it prints last: each zerolab engine, through each loop, over
                                the best peer of its kind and over the floor; each bitwise=True
                                row over the same engine's default mode
    format_bitwise_bytes(s)     the bitwise rows' bytes per step beside their closed form
                                (bitwise_bytes)
    targets(summary)            the targets zerolab holds itself to: met, missed, or within the
                                run-to-run spread (a timing difference smaller than the spread
                                between rounds is not a finding)
"""

from __future__ import annotations

import statistics


def bitwise_bytes(world_size, padded, tensors):
    """The bytes a bitwise=True zl.DDP or zl.ZeRO-1/2 books per step on each rank (one backward per
    step, no clipping), in the ledger's ring model:

        2 (N-1)/N * 4 * padded        the fp32 gradient's tree: recursive halving sends (N-1)/N
                                      of the padded buckets (point to point, log2 N rounds), then
                                      an all-gather (N-1)/N again: of the summed gradient (DDP),
                                      of the updated parameters (ZeRO-1/2, the same buckets)
      + 2 (N-1)/N * 8 * (2 + tensors) the step's agreement: one all-reduce of float64 flags (K and
                                      -K, the backwards this step, and one flag per trainable
                                      tensor: did any rank's backward reach it), rounded to a byte
                                      as the ledger rounds every record

    padded: the buckets' elements, each bucket padded to a multiple of N * 256 (the mode's norm
    block); N a power of two, so the first term is a whole number of bytes."""
    n = world_size
    return 2 * (n - 1) * 4 * padded // n + round(2 * (n - 1) / n * 8 * (2 + tensors))


def _spread(per_rep):
    """(lowest, highest) of the per-round medians."""
    return (min(per_rep), max(per_rep))


# the families of rows that are not peers: the floor, and zerolab itself (its engines, an engine
# with a feature off, an engine in its bitwise mode)
NOT_PEERS = ("zerolab", "floor", "ablation", "bitwise")


def summarize(results, steps):
    """Per-engine rows from the ranks' results (lists over rounds of rank lists)."""
    first = results[0][0]
    names = [r[0] for r in first["rows"]]
    # times[name][rep]: one entry per timed step, the slowest rank's (a step lasts until its
    # slowest rank is done)
    times = {nm: [[max(r["times"][nm][i] for r in res) for i in range(steps)] for res in results]
             for nm in names}
    last = results[-1]
    floor = next(nm for nm, kind, _ in first["rows"] if kind == "floor")

    def flat(nm):
        return [t for rep in times[nm] for t in rep]

    def pair(a, b):
        """Round by round, a's median step time over b's (both ran in the same rounds,
        interleaved): the median of those ratios, and the lowest and highest."""
        per_rep = [statistics.median(ta) / statistics.median(tb) for ta, tb in zip(times[a], times[b])]
        return statistics.median(per_rep), _spread(per_rep)

    # the round that measured memory (none with --no-memory)
    mem = next((res for res in reversed(results) if res[0]["peak"]), None)
    world_size = len(last)
    rows = []
    for nm, kind, family in first["rows"]:
        vs_floor, vs_floor_spread = pair(nm, floor)
        layout = last[0].get("layout", {}).get(nm)
        rows.append({"engine": nm, "kind": kind, "family": family, "loop": first.get("loop", {}).get(nm, ""),
                     "ms": statistics.median(flat(nm)) * 1e3,
                     "ms_spread": tuple(1e3 * x for x in _spread([statistics.median(rep) for rep in times[nm]])),
                     "vs_floor": vs_floor, "vs_floor_spread": vs_floor_spread,
                     "held": None if mem is None else max(r["held"][nm] for r in mem),
                     "peak": None if mem is None else max(r["peak"][nm] for r in mem),
                     "bytes": None if last[0]["wrote"][nm] is None else max(r["wrote"][nm] for r in last),
                     "ledger": last[0]["ledger"][nm],
                     "loss": statistics.mean(r["loss"][nm] for r in last), "vs_peer": None, "best_peer": None,
                     "vs_peer_spread": None, "least_peer": None, "vs_zerolab": None, "vs_zerolab_spread": None,
                     "default": None, "layout": layout,
                     "closed_form": None if layout is None else
                     bitwise_bytes(world_size, layout["padded"], layout["tensors"])})
    for row in rows:
        if row["family"] in ("ablation", "bitwise"):
            # zerolab with one feature off, or in another mode: against its default, through the
            # same (zerolab's) loop
            main = next(p for p in rows if p["kind"] == row["kind"] and p["family"] == "zerolab"
                        and p["loop"] in ("zerolab", ""))
            row["default"] = main["engine"]
            row["vs_zerolab"], row["vs_zerolab_spread"] = pair(row["engine"], main["engine"])
        if row["family"] != "zerolab":
            continue
        peers = [p for p in rows if p["kind"] == row["kind"] and p["family"] not in NOT_PEERS]
        if peers:
            best = min(peers, key=lambda p: p["ms"])
            row["best_peer"] = best["engine"]
            row["vs_peer"], row["vs_peer_spread"] = pair(row["engine"], best["engine"])
            if mem is not None:
                row["least_peer"] = min(peers, key=lambda p: p["peak"])["engine"]
    # every data-parallel engine, zerolab's and its peers', trains the same steps: their final
    # losses must agree to fp32 noise (the floor trains on one rank's batch only)
    dist_losses = [r["loss"] for r in rows if r["family"] != "floor"]
    return {"rows": rows, "params": first["params"], "note": first["note"],
            "loss_spread": max(dist_losses) - min(dist_losses) if dist_losses else 0.0,
            "steps": len(flat(floor)), "reps": len(results), "rounds": len(results)}


def _with_spread(value, spread, fmt):
    """'7.3 (6.9-8.1)': the value and, after several rounds, the range of their medians."""
    if spread is None or spread[0] == spread[1]:
        return format(value, fmt)
    return f"{format(value, fmt)} ({format(spread[0], fmt)}–{format(spread[1], fmt)})"


def _cells(s, r):
    """The formatted cells of one row, by column name."""
    psi_bytes = 4 * s["params"]   # fp32: one full copy of the parameters, in bytes
    peer = ""
    if r["vs_peer"] is not None:
        peer = f"{_with_spread(r['vs_peer'], r['vs_peer_spread'], '.2f')} ({r['best_peer']})"
    if r["vs_zerolab"] is not None:
        peer = f"{_with_spread(r['vs_zerolab'], r['vs_zerolab_spread'], '.2f')} (vs {r['default']})"
    return {"engine": r["engine"], "kind": r["kind"], "loop": r.get("loop", ""),
            "step (ms)": _with_spread(r["ms"], r["ms_spread"], ".1f"),
            "vs floor": _with_spread(r["vs_floor"], r["vs_floor_spread"], ".2f"), "vs best peer": peer,
            "held (MB)": "-" if r["held"] is None else f"{r['held'] / 1e6:.2f}",
            "peak/rank (MB)": "-" if r["peak"] is None else f"{r['peak'] / 1e6:.2f}",
            "bytes/step (MB)": "n/a" if r["bytes"] is None else f"{r['bytes'] / 1e6:.2f}",
            "bytes / 4Ψ": "n/a" if r["bytes"] is None else f"{r['bytes'] / psi_bytes:.2f}",
            "ledger / 4Ψ": "" if r["ledger"] is None or r["kind"] == "floor" else f"{r['ledger'] / psi_bytes:.2f}",
            "final loss": f"{r['loss']:.4f}"}


TIMING_COLUMNS = ("engine", "kind", "loop", "step (ms)", "vs floor", "vs best peer")
COUNT_COLUMNS = ("engine", "kind", "bytes/step (MB)", "bytes / 4Ψ", "ledger / 4Ψ", "held (MB)", "peak/rank (MB)",
                 "final loss")


def format_table(s, columns=None) -> str:
    """The Markdown table; columns=TIMING_COLUMNS or COUNT_COLUMNS for one half of it."""
    columns = columns or TIMING_COLUMNS + COUNT_COLUMNS[2:]
    left = ("engine", "kind", "loop")
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" if c in left else "---:" for c in columns) + "|"]
    for r in s["rows"]:
        cells = _cells(s, r)
        lines.append("| " + " | ".join(cells[c] for c in columns) + " |")
    return "\n".join(lines)


def format_ratios(s) -> str:
    """The run's verdict in ratios, printed last: each zerolab engine (through each loop) over the
    fastest peer of its kind and over the floor, each the ratio of the two medians with the
    lowest and highest of the same ratio round by round."""
    rounds = s.get("rounds", s.get("reps", 1))
    lines = [f"zerolab over its best peer and the floor (per round, median step / the other's median step; "
             f"the median over {rounds} round(s), in brackets the lowest and highest):"]
    for r in s["rows"]:
        if r["family"] != "zerolab":
            continue
        peer = "no peer ran" if r["vs_peer"] is None else \
            f"{_with_spread(r['vs_peer'], r['vs_peer_spread'], '.2f')} x {r['best_peer']}"
        lines.append(f"  {r['engine']:<32} {peer};  {_with_spread(r['vs_floor'], r['vs_floor_spread'], '.2f')} x floor")
    bitwise = [r for r in s["rows"] if r["family"] == "bitwise"]
    if bitwise:
        lines.append("bitwise / default: each bitwise=True row over the same engine's default mode, in the same "
                     "rounds (the same per-round medians and brackets):")
        for r in bitwise:
            lines.append(f"  {r['engine']:<32} {_with_spread(r['vs_zerolab'], r['vs_zerolab_spread'], '.2f')} "
                         f"x {r['default']};  {_with_spread(r['vs_floor'], r['vs_floor_spread'], '.2f')} x floor")
    return "\n".join(lines)


def format_bitwise_bytes(s) -> str:
    """The bitwise rows' bytes per step: what the ledger booked beside the closed form
    (bitwise_bytes), and what the operating system saw written; or why no row ran."""
    bitwise = [r for r in s["rows"] if r["family"] == "bitwise"]
    if not bitwise:
        return s.get("bitwise_note") or "bitwise=True: no row ran"
    n = len(s["results"][-1]) if s.get("results") else s.get("world_size")
    lines = [f"bitwise=True, bytes per step and rank: 2 (N-1)/N x 4 B x the padded gradient (the tree, then "
             f"the all-gather) + 2 (N-1)/N x 8 B x (2 + T) (the step's agreement on K and on the tensors "
             f"reached), N = {n}:"]
    for r in bitwise:
        lay = r["layout"]
        wire = "n/a" if r["bytes"] is None else f"{r['bytes']:,}"
        verdict = "=" if r["ledger"] == r["closed_form"] else "!="
        lines.append(f"  {r['engine']:<24} ledger {r['ledger']:,} {verdict} closed form {r['closed_form']:,} "
                     f"(padded {lay['padded']:,} = Ψ {lay['numel']:,} + {lay['padded'] - lay['numel']:,} in "
                     f"{lay['buckets']} bucket(s); T = {lay['tensors']} tensors); written to the sockets {wire}")
    return "\n".join(lines)


def verdict_word(ok, reps) -> str:
    """How a target's verdict is printed: met, MISSED, or why it is neither."""
    if ok is None:
        return "within the spread" if reps > 1 else "not judged: one round has no spread"
    return "met" if ok else "MISSED"


def verdict(spread, reps):
    """Is a ratio at or below 1? True or False when every round's median says the same;
    None when they disagree, or when one round leaves nothing to judge the noise by."""
    if reps < 2 or spread is None:
        return None
    lo, hi = spread
    if hi <= 1.0:
        return True
    if lo > 1.0:
        return False
    return None


# Peak-memory targets are set for ZeRO-1 and ZeRO-2 only. DDP replicates everything by design,
# and ZeRO-3's prefetch deliberately holds one more gathered unit (the table shows both;
# compare zl.ZeRO-3 prefetch=0). Memory is counted, not timed: its verdicts need no spread.
MEMORY_TARGET_KINDS = ("ZeRO-1", "ZeRO-2")


def targets(s) -> list[tuple[str, bool | None]]:
    """zerolab's targets: its step time at or below its fastest peer's, ZeRO-1/2's peak memory
    at or below their least peer's, ZeRO-3 faster with prefetch than without. A timing target
    is True or False only when every round's median lies on the same side; None otherwise."""
    out = []
    reps = s.get("reps", 1)
    rows = {r["engine"]: r for r in s["rows"]}
    for r in s["rows"]:
        if r["family"] == "zerolab" and r["vs_peer"] is not None:
            lo, hi = r["vs_peer_spread"]
            out.append((f"{r['engine']} step time <= best peer ({r['best_peer']}): {r['vs_peer']:.2f} "
                        f"(rounds {lo:.2f}-{hi:.2f})", verdict(r["vs_peer_spread"], reps)))
            least = rows.get(r["least_peer"])
            if r["kind"] in MEMORY_TARGET_KINDS and least is not None:
                out.append((f"{r['engine']} peak memory <= least peer ({least['engine']}): "
                            f"{r['peak'] / 1e6:.2f} vs {least['peak'] / 1e6:.2f} MB", r["peak"] <= least["peak"]))
        if r["family"] == "bitwise":   # exact, so a verdict on one round too
            out.append((f"{r['engine']} bytes per step = closed form: ledger {r['ledger']:,}, closed form "
                        f"{r['closed_form']:,}", r["ledger"] == r["closed_form"]))
        if r["family"] == "ablation":
            lo, hi = r["vs_zerolab_spread"]
            at_most = verdict(r["vs_zerolab_spread"], reps)   # faster with prefetch: the ratio is above 1
            out.append((f"zl.ZeRO-3 faster with prefetch than {r['engine']}: {r['engine']} takes "
                        f"{r['vs_zerolab']:.2f}x as long (rounds {lo:.2f}-{hi:.2f})",
                        None if at_most is None else not at_most))
    bitwise = [r for r in s["rows"] if r["family"] == "bitwise"]
    if len(bitwise) > 1:
        same = all(r["loss"] == bitwise[0]["loss"] for r in bitwise)
        out.append((f"bitwise=True: {' and '.join(r['engine'] for r in bitwise)} end on the same loss, bit for bit "
                    f"({', '.join(repr(r['loss']) for r in bitwise)})", same))
    return out
