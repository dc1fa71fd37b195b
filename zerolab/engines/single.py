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

from ..comm import Ledger
from ..precision import MixedPrecision, cast_for_compute
from .base import Engine
from . import param_groups
from . import options
from .options import EngineOptions
from .setup import check_optimizer_factory, compiled_parts


class SingleProcess(Engine):
    """One process, one model: forward, backward, mixed-precision step, measured memory."""

    takes = options.SINGLE      # precision, scaler, max_grad_norm, track_peak

    def __init__(self, model: torch.nn.Module, optimizer, **keywords):
        opts = EngineOptions.parse(type(self).__name__, self.takes, keywords)
        precision, max_grad_norm = opts.training.precision, opts.training.max_grad_norm
        scaler, track_peak = opts.training.scaler, opts.training.track_peak
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.options = opts
        model, self.compiled = compiled_parts(model)
        check_optimizer_factory(optimizer, precision)     # before the model is touched
        self.world_size = 1
        self.comm = Ledger()  # one process: nothing moves, but engines share the interface
        # No ledger for the precision checks: the reference must never talk to other ranks,
        # even when it runs inside a multi-rank job (its verdicts are this process's own).
        self.precision = MixedPrecision(precision, scaler=scaler, ledger=None)
        self.model = model
        self.max_grad_norm = max_grad_norm
        self.track_peak = track_peak
        self.steps = 0          # step() calls so far, applied or skipped
        self.last_peak = 0
        self.last_grad_norm = None
        self.last_activations = None   # not tracked by the reference engine (the others can)

        # model.parameters() yields a tied weight once, so it gets one master and one optimizer slot
        self.params = [p for p in model.parameters() if p.requires_grad]
        if self.precision.policy.needs_master:
            # masters first, from the exact fp32 values; then the model becomes low precision
            self.masters = [p.detach().clone().float() for p in self.params]
            cast_for_compute(model, self.precision.compute_dtype)   # (BatchNorm stays fp32)
        else:
            self.masters = self.params
        # the optimizer sees the model's parameters (its groups too); each then steps on its master
        self.optimizer, state = param_groups.build(optimizer, model, precision)
        self._place_groups()
        param_groups.hand_over(self.optimizer, self, state)
        self._watch_parameters()

    # forward, backward, the step, full_state_dict, memory_report: Engine's, for one master
    # per parameter

    def no_sync(self):
        """As the data-parallel engines' (accumulate micro-batches without communicating): one
        process has nothing to skip, so a loop written for them runs here unchanged."""
        return contextlib.nullcontext()
