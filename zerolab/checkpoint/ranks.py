"""What the ranks of an engine agree on when they save or load, in either format.

Every collective here goes through the engine's ledger, and every rank takes part in the same
collectives whatever it found, so a rank that refuses ends the save or load on every rank with an
error instead of leaving the others waiting:

    agree(engine, value, "min")                     # one int, the same on every rank
    check_same_checkpoint(engine, path, text, key)  # every rank was given the same checkpoint
    refuse_together(engine, path, problem)          # one rank's refusal stops every rank
"""

from __future__ import annotations

import zlib

import torch

from .files import CheckpointError
from ..engines.base import Engine
from ..engines.setup import compare_rows, described_by


def engine_kind(engine) -> str:
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a zerolab engine (SingleProcess, DDP, NaiveDDP, ZeRO, ZeRO3), "
                        f"got {type(engine).__name__}")
    return engine.checkpoint_kind


def group(engine):
    return getattr(engine.comm, "group", None)


def dist_rank(engine):
    g = group(engine)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(g) if g is not None else torch.distributed.get_rank()
    return 0


def rank_size(engine):
    """(rank, size) of the group the engine shards or replicates over; SingleProcess: (0, 1)."""
    if engine_kind(engine) == "single":
        return 0, 1
    return int(getattr(engine, "rank", dist_rank(engine))), int(engine.world_size)


def together(engine) -> bool:
    """Do the engine's ranks save and load one checkpoint together (and so agree on it)?"""
    return engine_kind(engine) != "single" and rank_size(engine)[1] > 1


def agree(engine, value: int, op: str) -> int:
    """One int agreed by every rank of the engine's group (through its ledger)."""
    if not together(engine):
        return value
    t = torch.tensor([value], dtype=torch.int64)
    engine.comm.all_reduce(t, op=op, group=group(engine), tag="checkpoint")
    return int(t.item())


def check_same_checkpoint(engine, path, seen: tuple | None, problem: Exception | None) -> None:
    """Every rank of the engine's group was given the same checkpoint, or every rank raises one
    CheckpointError naming each rank's directory and what it holds (engines.setup.compare_rows).
    seen: (what this rank read, in words: "step 40 (sha256 ...)"; the digest that covers every
    file), or None for a rank that could not read its checkpoint (`problem`). Ranks that all
    failed to read theirs raise their own errors after it."""
    if not together(engine):
        return
    if seen is None:
        row = (f"{path} (cannot be read: {str(problem)[-60:]})", -1)
    else:
        row = (f"{seen[0]} in {path}", zlib.crc32(seen[1].encode()))
    try:
        compare_rows([row], engine.comm, engine.src_rank, lambda i: "checkpoints")
    except ValueError:
        g = group(engine)
        ranks = (torch.distributed.get_process_group_ranks(g) if g is not None
                 else list(range(torch.distributed.get_world_size())))
        said = [f"rank {r}: {described_by(row[0], r, engine.comm)}" for r in ranks[:16]]
        more = f"; and {len(ranks) - 16} more ranks" if len(ranks) > 16 else ""
        raise CheckpointError(f"checkpoint.load: the ranks were given different checkpoints: {'; '.join(said)}{more}. "
                              "Every rank must load the same checkpoint (one directory all ranks share); "
                              "nothing was loaded") from None


def refuse_together(engine, path, problem: Exception | None, doing: str = "refused this checkpoint") -> None:
    """Raise `problem` on the rank that has one, and on every other rank an error naming the first
    rank that did; return on every rank when none did."""
    rank, size = rank_size(engine)
    first = agree(engine, size if problem is None else rank, "min")
    if problem is not None:
        raise problem
    if first < size:
        raise CheckpointError(f"{path}: rank {first} {doing} (its error says why); no rank has changed anything")
