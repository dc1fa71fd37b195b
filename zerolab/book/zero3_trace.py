"""What one ZeRO-3 step's trace says: the parameter bytes a rank holds over time, and the bytes it
sends in each phase. Chapter 8 draws both from a real run (zerolab.book.zero3_plots).

The trace is the engine's own: `engine.events`, tuples (time, rank, unit, state, phase) with state
one of gathering / gathered / in_use / released / reduce_scatter, and the ledger's records
(op, tag, start, end, bytes sent), as zerolab.book.zero3_demo returns them.

* `gathered_bytes(events, unit_bytes)`: [(time, bytes)] of gathered parameters held, on top of the
  shard a rank always holds. A unit's full buffer is allocated when its all-gather is issued
  ("gathering") and freed when the unit is "released".
* `sent_by_phase(events, records)`: bytes sent by the forward all-gathers, the backward
  all-gathers and the reduce-scatters (and anything else, such as the small all-reduces of the
  checks). The ledger's tag names the unit ("gather:blocks.0"); the k-th all-gather of a unit is
  the one its k-th "gathering" event issued, whose phase the event records.
"""

from __future__ import annotations

from collections import defaultdict

PHASES = ("forward all-gather", "backward all-gather", "reduce-scatter", "other")


def gathered_bytes(events, unit_bytes: dict) -> list:
    """[(time, bytes of gathered parameters held just after that event)], one per event.

    unit_bytes: {unit: bytes of its gathered (full) buffers}."""
    held, gathered, out = 0, set(), []
    for t, _, unit, state, _ in events:
        if state == "gathering" and unit not in gathered:
            gathered.add(unit)
            held += unit_bytes[unit]
        elif state == "released" and unit in gathered:
            gathered.discard(unit)
            held -= unit_bytes[unit]
        out.append((t, held))
    return out


def sent_by_phase(events, records) -> dict:
    """{phase: bytes this rank sent}: PHASES' keys, every record counted once."""
    phases = defaultdict(list)           # unit -> phase of each all-gather it issued, in order
    for _, _, unit, state, phase in events:
        if state == "gathering":
            phases[unit].append(phase)
    seen = defaultdict(int)
    out = dict.fromkeys(PHASES, 0)
    for op, tag, _, _, sent in records:
        if op == "all_gather" and tag.startswith("gather:"):
            unit = tag[len("gather:"):]
            k = seen[unit]
            seen[unit] += 1
            key = f"{phases[unit][k]} all-gather" if k < len(phases[unit]) else "other"
            out[key if key in out else "other"] += sent
        elif op == "reduce_scatter":
            out["reduce-scatter"] += sent
        else:
            out["other"] += sent
    return out
