"""The single-process engine: the reference every parallel engine is compared to.

    engine = SingleProcess(model, functools.partial(torch.optim.AdamW, lr=3e-4), precision="bf16")
    logits, loss = zl.models.gpt_loss(engine, batch)
    engine.backward(loss)
    applied = engine.step()      # False when an fp16 overflow skipped the step
    engine.zero_grad()

In fp32 the optimizer updates the model's own parameters. In bf16 and fp16 it follows the
canonical mixed-precision protocol: the model holds 2-byte parameters and gradients, the
engine holds an fp32 master copy of every trainable parameter, the optimizer (and so its
moments) lives on the masters, and after each applied step the masters are cast back into
the model.
"""

from __future__ import annotations

import torch

from .comm import Ledger
from .engines.base import Engine
from .memory import optimizer_tensors
from .precision import MixedPrecision, clip_grad_norm_


# Optimizers whose update of an element depends on the rest of its tensor (Adafactor's
# factored moments and relative step size, Muon's orthogonalized matrices). On one flat
# tensor per bucket they would compute something else than on the parameters one by one.
WHOLE_TENSOR_OPTIMIZERS = tuple(getattr(torch.optim, n) for n in ("Adafactor", "Muon") if hasattr(torch.optim, n))


def _check_elementwise(optimizer, flat_engine: str) -> None:
    kind = optimizer if isinstance(optimizer, type) else (
        type(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else getattr(optimizer, "func", None))
    if isinstance(kind, type) and issubclass(kind, WHOLE_TENSOR_OPTIMIZERS):
        raise TypeError(
            f"{flat_engine} runs the optimizer on flat buffers (one tensor per bucket), but "
            f"{kind.__name__} updates each element from its whole tensor (norms, matrix shape), so it "
            "would compute something else than on the parameters one by one. Use an elementwise "
            "optimizer (SGD, Adam, AdamW, ...), or zl.NaiveDDP / zl.SingleProcess, which step "
            "parameter by parameter.")


def check_optimizer_factory(optimizer, precision: str, flat_engine: str | None = None) -> None:
    """Refuse anything but a factory, before an engine touches the model.

    flat_engine: the engine's name if it steps the optimizer on flat buffers; then optimizers
    that are not elementwise are refused too (when the factory shows its class: the class
    itself, or a functools.partial of it; build_optimizer checks what any factory built).
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a factory (a callable params -> torch.optim.Optimizer), not an "
            f"already-built {type(optimizer).__name__}: the engine decides which tensors the "
            f"optimizer updates (with precision={precision!r} those are fp32 master copies it creates). "
            "Pass e.g. functools.partial(torch.optim.AdamW, lr=3e-4).")
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a callable params -> torch.optim.Optimizer, "
                        f"e.g. functools.partial(torch.optim.AdamW, lr=3e-4); got {optimizer!r}")
    if flat_engine is not None:
        _check_elementwise(optimizer, flat_engine)


def build_optimizer(optimizer, params, precision: str, flat_engine: str | None = None) -> torch.optim.Optimizer:
    """Call an optimizer factory on `params`, refusing an already-built optimizer."""
    check_optimizer_factory(optimizer, precision, flat_engine)
    opt = optimizer(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
    if flat_engine is not None:
        _check_elementwise(opt, flat_engine)
    return opt


class SingleProcess(Engine):
    """One process, one model: forward, backward, mixed-precision step, measured memory."""

    def __init__(self, model: torch.nn.Module, optimizer, *, precision="fp32", max_grad_norm=None,
                 scaler=None, track_peak: bool = True):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not
                                          isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be None or a number > 0; got {max_grad_norm!r}")
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
            model.to(self.precision.compute_dtype)
        else:
            self.masters = self.params
        self.optimizer = build_optimizer(optimizer, self.masters, precision)

    # ---------------------------------------------------------------- backward (forward: Engine)
    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), on loss * scale in fp16 (raises on a NaN loss in fp32/bf16)."""
        self.precision.scale_loss(loss, step=self.steps).backward()

    # ---------------------------------------------------------------- the step (Engine.step calls it)
    @torch.no_grad()
    def _step(self) -> bool:
        mixed = self.precision.policy.needs_master
        if mixed:
            # cast: fp32 copies of the low-precision gradients, short-lived, on the masters
            for p, m in zip(self.params, self.masters):
                m.grad = None if p.grad is None else p.grad.float()
        grads = [m.grad for m in self.masters if m.grad is not None]
        ok = self.precision.unscale_and_check(grads)
        if not ok:  # fp16 overflow: parameters and optimizer state stay as they are
            self.precision.update(found_inf=True)
            self._drop_master_grads()
            return False
        if self.max_grad_norm is not None:
            self.last_grad_norm = clip_grad_norm_(grads, self.max_grad_norm)
        self.optimizer.step()
        if mixed:
            # refresh: the compute copy is the cast of the authoritative fp32 master
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
            self._drop_master_grads()
        self.precision.update(found_inf=False)
        return True

    def _drop_master_grads(self):
        if self.masters is not self.params:
            for m in self.masters:
                m.grad = None

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self._drop_master_grads()

    # ---------------------------------------------------------------- state (Engine consolidates)
    def _full_values(self) -> dict:
        # the fp32 masters (in fp32 training, the parameters themselves)
        return {id(p): m for p, m in zip(self.params, self.masters)}

    def _memory_tensors(self):
        params = list(self.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        extra = self.masters if self.masters is not self.params else []
        return params, grads, list(extra) + optimizer_tensors(self.optimizer)

    def state_dict(self) -> dict:
        return {"model": self.full_state_dict(), "optimizer": self.optimizer.state_dict(),
                "precision": self.precision.state_dict(), "steps": self.steps}
