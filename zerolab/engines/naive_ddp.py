"""Data parallelism the obvious way: after backward, all-reduce each gradient, one by one.

    engine = zl.NaiveDDP(model, partial(torch.optim.AdamW, lr=3e-4), precision="bf16")
    logits, loss = zl.models.gpt_loss(engine, batch)    # this rank's share of the global batch
    loss.backward()                                     # gradients are averaged over ranks here
    engine.optimizer.step()                             # every rank takes the same step

Every rank holds the whole model and the whole optimizer; after backward each gradient is
divided by N and all-reduced on its own, with a blocking call (a sum of grad/N: the mean).
Simple, and slow: many small messages, and the network sits idle during the whole backward.
zerolab.engines.ddp.DDP is the fast version.

Like DistributedDataParallel it may be built without an optimizer (zl.NaiveDDP(model)): the
script's own optimizer over engine.parameters() then steps the averaged p.grad.

What every data-parallel engine shares is here, and DDP, ZeRO-1 and ZeRO-2 inherit it:
the set-up (engines.base.Engine's _join: engines.setup.join_data_parallel's checks, the group,
ZeRO-R's options, then the broadcast of rank 0's weights), the measured forward and no_sync.

Buffers (BatchNorm's running statistics) are not gradients: each rank's own batches would pull
them apart. As in PyTorch DDP, the forward that follows a training forward (grad enabled,
outside no_sync) first broadcasts rank 0's buffers to every rank (broadcast_buffers=True, the
default of every data-parallel engine, ZeRO-3's included; False leaves each rank its own).
"""

from __future__ import annotations

import contextlib

import torch

from ..buckets import bucket_order
from . import options
from .base import Engine


class NaiveDDP(Engine):
    """Data parallelism the obvious way: after backward, all-reduce each gradient, one by one."""

    flat_optimizer = None   # the optimizer steps parameter by parameter (DDP, ZeRO: flat buffers)
    takes_no_optimizer = True   # optimizer=None: the script steps its own (DistributedDataParallel's way)
    awaits_optimizer = False    # optimizer=None: adopt the one the script builds afterwards (ZeRO: FSDP2's way)
    checkpoint_kind = "naive_ddp"
    takes = options.DATA_PARALLEL   # the option names it takes (zerolab.engines.options)

    def _order(self, model) -> list:
        return bucket_order(model)      # the reverse of the forward: the order gradients arrive

    # -------------------------------------------------------------- forward and backward
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients over micro-batches without communicating.

        The backward after the block (outside it, of a forward outside it) reduces the
        accumulated sum once.
        """
        self.life.set_sync(False)
        try:
            yield
        finally:
            self.life.set_sync(True)

    def _finish_backward(self):
        # Which parameters did any rank reach? One no rank reached keeps grad None (the
        # optimizer skips it, as in a single process); the others are reduced by every rank.
        used = torch.tensor([float(p.grad is not None) for p in self.params])
        self.comm.all_reduce(used, op="max", tag="used")
        for p, u in zip(self.params, used.tolist()):
            if u == 0.0:
                continue
            if p.grad is None:  # reached on another rank only: this rank contributes zeros
                p.grad = torch.zeros_like(p)
            elif self.world_size > 1:
                p.grad.div_(self.world_size)
            self.comm.all_reduce(p.grad, tag="grad")   # a sum of grad/N: the mean

    # the step, full_state_dict and memory_report: Engine's, one master per parameter. The
    # gradients are identical on every rank after the all-reduce, so every rank's finite check
    # and clip norm (local: full, replicated gradients) agree.
