"""The single-process engine: the reference every parallel engine is compared to.

    engine = SingleProcess(model, functools.partial(torch.optim.AdamW, lr=3e-4), precision="bf16")
    logits, loss = zl.models.gpt_loss(engine, batch)
    engine.backward(loss)        # (or loss.backward(), except in fp16, whose loss it scales)
    applied = engine.step()      # False when an fp16 overflow skipped the step
    engine.zero_grad()

In fp32 the optimizer updates the model's own parameters. In bf16 and fp16 it follows the
canonical mixed-precision protocol: the model holds 2-byte parameters and gradients, the
engine holds an fp32 master copy of every trainable parameter, the optimizer (and so its
moments) lives on the masters, and after each applied step the masters are cast back into
the model.

bitwise=True (engines.options.BITWISE): each backward is one chunk, added bucket by bucket into
the fixed tree, in the same buckets zl.DDP lays out (bucket_mb=), so that one process is the
same bits as 2, 4 or 8 ranks of zl.DDP or zl.ZeRO(stage=1 | 2) in the same mode.
"""

from __future__ import annotations

import contextlib

import torch

from ..bitwise import buckets as bitwise_buckets
from ..buckets import FlatBuckets, bucket_order
from ..runtime.comm import Ledger
from ..precision import MixedPrecision
from . import options
from .base import Engine
from ..optim.checks import check_optimizer_factory


class SingleProcess(Engine):
    """One process, one model: forward, backward, mixed-precision step, measured memory."""

    takes = options.SINGLE      # precision, scaler, max_grad_norm, track_peak, bitwise (and its bucket_mb)
    takes_bitwise = True

    def _read_options(self, opts, model) -> None:
        self.bucket_mb = float(opts.layout.bucket_mb)

    def _join(self, model, optimizer, opts) -> None:
        """One process: nothing to join, nothing moves (a ledger all the same, as every engine has)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        check_optimizer_factory(optimizer)     # before the model is touched
        self.world_size, self.rank = 1, 0
        self.comm = Ledger()
        # No ledger for the precision checks: the reference must never talk to other ranks,
        # even when it runs inside a multi-rank job (its verdicts are this process's own).
        self.precision = MixedPrecision(opts.training.precision, scaler=opts.training.scaler, ledger=None)

    # forward, backward, the step, full_state_dict, memory_report: Engine's, for one master
    # per parameter; bitwise=True changes the four methods below

    def _setup_storage(self) -> None:
        if self.bitwise:    # zl.DDP's buckets, at N = 1 (sized in the compute dtype, as there)
            elem = torch.empty((), dtype=self.precision.compute_dtype).element_size()
            params = bucket_order(self.model)
            scale = elem / params[0].element_size()
            self.layout = FlatBuckets(params, self.bucket_mb * 2**20 / scale, 1,
                                      quantum=bitwise_buckets.quantum(1))
            self._trees, self._summed, self._reached = bitwise_buckets.ChunkTrees(len(self.layout)), None, set()
        super()._setup_storage()

    def _finish_backward(self) -> None:
        """bitwise: this backward's gradient, bucket by bucket in fp32, is the next leaf of each
        bucket's tree; p.grad is freed for the next chunk."""
        if not self.bitwise:
            return
        leaves = []
        for bucket in self.layout.buckets:
            leaf = torch.zeros(bucket.padded_numel, dtype=torch.float32, device=bucket.params[0].device)
            for p, o, n in zip(bucket.params, bucket.offsets, bucket.sizes):
                if p.grad is not None:
                    self._reached.add(id(p))
                    leaf[o:o + n].copy_(p.grad.reshape(-1))     # an exact cast up: no arithmetic
            leaves.append(leaf)
        self._chunk_done(leaves)

    def _chunk_sum(self) -> list:
        if self._summed is None:
            bitwise_buckets.agree_backwards(self._trees.backwards, [], self.comm, 1)
            self._summed = self._trees.roots()
        return self._summed

    def _step_grads(self) -> list:
        if not self.bitwise:
            return super()._step_grads()
        sums = self._chunk_sum()
        master_of = {id(p): m for p, m in zip(self.params, self.masters)}
        for bucket, flat in zip(self.layout.buckets, sums):
            for p, view in zip(bucket.params, bucket.views(flat)):
                master_of[id(p)].grad = view if id(p) in self._reached else None
        self._reached = set()
        return sums

    def _drop_step_grads(self) -> None:
        super()._drop_step_grads()
        if self.bitwise:            # (fp32: the masters are the parameters, their .grad the sums')
            for m in self.masters:
                m.grad = None
            self._summed = None

    def _release_grads(self) -> None:
        super()._release_grads()
        if self.bitwise:
            self._trees.reset()
            self._reached = set()

    def no_sync(self):
        """As the data-parallel engines' (accumulate micro-batches without communicating): one
        process has nothing to skip, so a loop written for them runs here unchanged."""
        return contextlib.nullcontext()
