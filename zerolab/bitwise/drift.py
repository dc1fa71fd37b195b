"""The same training at several world sizes, default path against bitwise mode: bits that differ.

    counts = drift_by_world_size((1, 2, 4, 8))
    counts["default"][4]["blocks.0.mlp.fc.weight"]   # {"numel", "elements", "bits"} against 1 rank

The default path is zl.DDP as it ships (each rank's gradient summed inside its own backward
over its share of the batch, the ranks' sums added by the ring all-reduce): its weights after a
few AdamW steps differ from one process's in many low bits, by amounts that change with N.
The bitwise path (BitwiseDataParallel) is the same training with every order fixed: 0 bits.
Both runs start from the same weights and see the same global batches.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import zerolab as zl

from ..data import CharDataset
from ..models import GPT, gpt_config, gpt_loss
from .bits import differing_bits
from .chunks import ChunkPlan
from .trainer import BitwiseDataParallel

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3, foreach=False)


def _gpt(size: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = gpt_config(size)
    return GPT(cfg), CharDataset(cfg.block_size)


def default_ddp_weights(size: str, steps: int, global_rows: int) -> dict:
    """A rank's worker: zl.DDP (fp32, AdamW) for `steps` steps; the weights, by name."""
    model, data = _gpt(size)
    n, r = dist.get_world_size(), dist.get_rank()
    engine = zl.DDP(model, ADAMW)
    for step in range(steps):
        _, loss = gpt_loss(engine, data.batch(step, global_rows // n, r, n))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def bitwise_weights(size: str, steps: int, global_rows: int, num_chunks: int) -> dict:
    """A rank's worker: BitwiseDataParallel (fp32, AdamW) for `steps` steps; the master weights."""
    model, data = _gpt(size)
    trainer = BitwiseDataParallel(model, ADAMW, gpt_loss, ChunkPlan(num_chunks, dist.get_world_size()))
    for step in range(steps):
        trainer.train_step(data.global_batch(step, global_rows))
    return trainer.master_state()


def drift_by_world_size(world_sizes=(1, 2, 4, 8), size: str = "nano", steps: int = 3, global_rows: int = 16,
                        num_chunks: int = 16) -> dict:
    """{"default" | "bitwise": {N: differing_bits(weights at N, weights at world_sizes[0])}}."""
    out = {}
    for name, worker, args in (("default", default_ddp_weights, (size, steps, global_rows)),
                               ("bitwise", bitwise_weights, (size, steps, global_rows, num_chunks))):
        weights = {n: zl.launch(worker, n, args=args)[0] for n in world_sizes}
        first = weights[world_sizes[0]]
        out[name] = {n: differing_bits(weights[n], first) for n in world_sizes}
    return out
