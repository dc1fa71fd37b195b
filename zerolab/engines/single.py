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
"""

from __future__ import annotations

import contextlib

import torch

from ..runtime.comm import Ledger
from ..precision import MixedPrecision
from . import options
from .base import Engine
from ..optim.checks import check_optimizer_factory


class SingleProcess(Engine):
    """One process, one model: forward, backward, mixed-precision step, measured memory."""

    takes = options.SINGLE      # precision, scaler, max_grad_norm, track_peak

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
    # per parameter

    def no_sync(self):
        """As the data-parallel engines' (accumulate micro-batches without communicating): one
        process has nothing to skip, so a loop written for them runs here unchanged."""
        return contextlib.nullcontext()
