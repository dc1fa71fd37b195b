"""ZeRO-1, 2 and 3 as lists of passes over one captured step, and the loop that trains with it.

    stage 1: reduce(at="end")                 every gradient reduce-scattered after the backward
    stage 2: reduce(at="produced")            ... as soon as the backward produces it
    stage 3: shard, then reduce(at="produced") parameters sharded too, gathered where read
    then, optionally: bucket(cap_bytes), prefetch(depth)

The optimizer runs on the shards outside the graph, one tensor per parameter, as eager
zerolab hands them to it. At stages 1 and 2 every rank holds the full parameters, so after the
update the shards are all-gathered back into them; at stage 3 the graph gathers them itself.
"""

from __future__ import annotations

import torch

from . import collectives
from .bucket import bucket
from .capture import capture
from .prefetch import prefetch
from .reduce import reduce
from .shard import shard


def zero_step(model, loss_fn, batch, stage: int, world: int, bucket_bytes: int = 0, depth: int = 0):
    """The captured step with ZeRO-`stage`'s passes applied (and buckets, prefetch if asked)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, not {stage!r}")
    step = capture(model, loss_fn, batch)
    if stage == 3:
        shard(step, world)
    reduce(step, world, at="end" if stage == 1 else "produced")
    if bucket_bytes:
        bucket(step, bucket_bytes)
    if depth:
        prefetch(step, depth)
    return step


class Trainer:
    """Trains `model` with a ZeRO graph on this rank: shards, optimizer and the step's inputs."""

    def __init__(self, model, optimizer, loss_fn, batch, stage: int, ledger, *, bucket_bytes=0, depth=0, step=None):
        import torch.distributed as dist
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.stage, self.ledger = stage, ledger
        collectives.use(ledger)
        # `step`: a step already rewritten (a lab's passes); else ZeRO-`stage`'s own
        self.step_graph = step or zero_step(model, loss_fn, batch, stage, self.world, bucket_bytes, depth)
        self.full = [p.detach().clone() for p in model.parameters()]
        self.shards = [f.reshape(self.world, -1)[self.rank].clone() for f in self.full]
        if stage == 3:
            self.full = None                  # only the shards are kept
        self.optimizer = optimizer(self.shards)

    def inputs(self) -> list:
        return self.shards if self.stage == 3 else self.full

    def train_step(self, *batch):
        loss, *grads = self.step_graph.module(*self.inputs(), *batch)
        for piece, grad in zip(self.shards, grads):
            piece.grad = grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.stage < 3:                    # the updated shards back into every rank's full copy
            for piece, full in zip(self.shards, self.full):
                self.ledger.all_gather(full.view(-1), piece, tag="update")
        return loss

    def full_parameters(self) -> list:
        """The whole model's parameters (stage 3 gathers them: every rank calls this)."""
        if self.full is not None:
            return [f.clone() for f in self.full]
        out = []
        for piece, shape in zip(self.shards, self.step_graph.shapes):
            full = torch.empty(piece.numel() * self.world, dtype=piece.dtype)
            self.ledger.all_gather(full, piece, tag="read")
            out.append(full.view(shape))
        return out
