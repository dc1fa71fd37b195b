"""A ZeRO-3 unit's state: where its parameters are and where its backward is, two small state
machines whose legal moves are written down once (FSDP2 keeps the same in ShardedState and
TrainingState). zerolab.engines.zero3.units.Unit holds one of each and moves them only through
`moved`, so a schedule that frees a buffer an all-gather is still filling, or reduces a gradient
twice, is stopped where it happens, by name.

    parameters:  PARTITIONED --gather()--> IN_FLIGHT --wait()--> GATHERED --release()--> PARTITIONED
    gradient:    WAITING --backward reaches it--> IN_BACKWARD --its backward is over--> REDUCING
                 --the pass is over--> REDUCED          (a new pass: WAITING again, reset_backward)
"""

from __future__ import annotations

from enum import Enum


class ParamState(Enum):
    """Where a unit's parameters are (FSDP2 keeps the same in its ShardedState)."""
    PARTITIONED = "partitioned: this rank holds its shard only"
    IN_FLIGHT = "in flight: an all-gather is filling the full buffers"
    GATHERED = "gathered: the full parameters are in memory"


class GradState(Enum):
    """Where a unit's backward is, in the pass under way (FSDP2: its TrainingState)."""
    WAITING = "waiting: no backward has reached it since the pass began"
    IN_BACKWARD = "in backward: its gradients are arriving"
    REDUCING = "reducing: its backward is over, its gradient is being reduce-scattered"
    REDUCED = "reduced: the pass is over, this rank holds its gradient shard"


# the legal moves; anything else is a bug in the schedule, raised where it happens. (A gather
# may complete at once, without an all-gather in flight: a node-local copy, a lab's own gather.)
PARAM_MOVES = {(ParamState.PARTITIONED, ParamState.IN_FLIGHT), (ParamState.PARTITIONED, ParamState.GATHERED),
               (ParamState.IN_FLIGHT, ParamState.GATHERED), (ParamState.GATHERED, ParamState.PARTITIONED)}
GRAD_MOVES = {(GradState.WAITING, GradState.IN_BACKWARD), (GradState.IN_BACKWARD, GradState.REDUCING),
              (GradState.REDUCING, GradState.REDUCED)}


def moved(unit, kind: str, now: Enum, to: Enum, legal: set) -> Enum:
    """`to`, if a unit in state `now` may go there (or is there already); else a RuntimeError."""
    if now is not to and (now, to) not in legal:
        raise RuntimeError(f"ZeRO-3 unit {unit.name}: its {kind} cannot go from {now.name} to {to.name} "
                           f"({now.value}). Legal moves: "
                           + ", ".join(f"{a.name} -> {b.name}" for a, b in sorted(legal, key=str)))
    return to
