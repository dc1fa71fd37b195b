"""Mixed precision: one component that every engine holds.

A training step in mixed precision (the canonical protocol of chapter 2):

    forward and backward in the compute dtype (bf16 or fp16) on a low-precision copy
    cast the gradients to fp32, into the fp32 master copy's .grad
    fp16 only: unscale them (they were computed from loss * scale), and check for inf/nan;
               on overflow, skip the step and lower the scale
    clip the gradient norm if asked (the norm is summed over every rank's shard)
    the optimizer updates the fp32 master weights and its fp32 moments
    refresh the low-precision copy: cast16(master)

This module holds the pieces that do not depend on how an engine lays out its tensors:
the policy (which dtypes), the dynamic loss scaler, the agreed overflow check, and the
sharded gradient clip. Anything that crosses ranks goes through a zerolab.runtime.comm.Ledger.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

POLICIES = ("fp32", "bf16", "fp16")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(name) -> str:
    """Return `name` if it is a known precision policy, else raise a ValueError naming the choices."""
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"unknown precision {name!r}; choose one of {', '.join(map(repr, POLICIES))}")
    return name


@dataclass(frozen=True)
class Policy:
    """Which dtype the model computes in, which dtype the optimizer keeps, and whether to scale."""

    name: str
    compute_dtype: torch.dtype
    master_dtype: torch.dtype = torch.float32
    loss_scaling: bool = False

    @property
    def needs_master(self) -> bool:
        """True when the model's own params are not the fp32 weights the optimizer updates."""
        return self.compute_dtype != self.master_dtype


def policy(name) -> Policy:
    """The Policy for "fp32", "bf16" or "fp16"."""
    name = check_precision(name)
    # bf16 has fp32's exponent range, so its gradients do not underflow: no loss scaling needed.
    return Policy(name, _DTYPES[name], torch.float32, loss_scaling=(name == "fp16"))


# ------------------------------------------------------------------ dynamic loss scaling


class LossScaler:
    """Dynamic loss scaling, with torch.amp.GradScaler's rules plus hysteresis and a floor.

    The loss is multiplied by `scale` before backward so that small fp16 gradients do not
    underflow to zero. After backward the gradients are divided by `scale` again.

    * a step whose gradients hold an inf or nan is skipped; after `hysteresis` such steps
      in a row the scale is multiplied by `backoff_factor` (never below `min_scale`);
    * after `growth_interval` finite steps in a row it is multiplied by `growth_factor`;
    * it gives up, raising FloatingPointError, when a step overflows with the scale already at
      `min_scale`, or after `max_skips` skipped steps in a row: then the loss or the activations
      themselves are inf or nan, and skipping forever would train nothing while looking alive
      (DeepSpeed raises at its minimum scale too; GradScaler never gives up).

    With hysteresis=1 the scale trajectory is exactly GradScaler's (for scales above min_scale).
    """

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, hysteresis=1, min_scale=1.0, max_skips=50):
        def bad(what, value):
            return ValueError(f"LossScaler: {what}; got {value!r}")

        for key, value in (("init_scale", init_scale), ("growth_factor", growth_factor),
                           ("backoff_factor", backoff_factor), ("min_scale", min_scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(f"{key} must be a finite number", value)
        if not init_scale > 0:
            raise bad("init_scale must be > 0", init_scale)
        if not min_scale > 0:
            raise bad("min_scale must be > 0", min_scale)
        if init_scale < min_scale:
            raise bad(f"init_scale must be >= min_scale ({min_scale})", init_scale)
        if not growth_factor > 1:
            raise bad("growth_factor must be > 1", growth_factor)
        if not 0 < backoff_factor < 1:
            raise bad("backoff_factor must be in (0, 1)", backoff_factor)
        for key, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis),
                           ("max_skips", max_skips)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(f"{key} must be an int >= 1", value)
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.max_skips = max_skips
        self._good_steps = 0                  # finite steps since the last overflow or growth
        self._overflows_left = hysteresis     # overflows still tolerated before backing off
        self.skipped = 0                      # total skipped steps, for reports
        self.skipped_in_a_row = 0

    def update(self, found_inf: bool, step=None) -> None:
        """Advance the scale after one step; found_inf says whether that step was skipped."""
        if found_inf:
            at_floor = self.scale <= self.min_scale
            self.skipped += 1
            self.skipped_in_a_row += 1
            if at_floor or self.skipped_in_a_row >= self.max_skips:
                why = (f"the loss scale is already at its minimum ({self.min_scale:g})" if at_floor
                       else f"{self.skipped_in_a_row} steps in a row were skipped (max_skips)")
                raise FloatingPointError(
                    f"fp16 gives up{'' if step is None else f' at step {step}'}: the gradients "
                    f"overflowed again and {why}. The loss or the activations themselves are inf "
                    "or nan, not only the scaled gradients: find the first module that makes them "
                    "with zl.debug.first_nonfinite(model, batch), lower the learning rate, or train "
                    "in bf16.")
            self._good_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self._overflows_left = self.hysteresis
        else:
            self.skipped_in_a_row = 0
            self._overflows_left = self.hysteresis  # hysteresis counts consecutive overflows
            self._good_steps += 1
            if self._good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self._good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "hysteresis": self.hysteresis, "min_scale": self.min_scale,
                "good_steps": self._good_steps, "overflows_left": self._overflows_left,
                "skipped": self.skipped, "max_skips": self.max_skips,
                "skipped_in_a_row": self.skipped_in_a_row}

    def load_state_dict(self, d: dict) -> None:
        self.__init__(d["scale"], d["growth_factor"], d["backoff_factor"], d["growth_interval"],
                      d["hysteresis"], d["min_scale"], d.get("max_skips", 50))
        self._good_steps = int(d["good_steps"])
        self._overflows_left = int(d["overflows_left"])
        self.skipped = int(d["skipped"])
        self.skipped_in_a_row = int(d.get("skipped_in_a_row", 0))

    def __repr__(self):
        return (f"LossScaler(scale={self.scale:g}, growth_interval={self.growth_interval}, "
                f"hysteresis={self.hysteresis}, min_scale={self.min_scale:g}, skipped={self.skipped})")


# ------------------------------------------------------------------ checks that span ranks


def _unique(grads):
    """The gradient tensors, each storage region once (a tied weight counts once)."""
    seen, out = set(), []
    for g in grads:
        if g is None:
            continue
        key = (g.untyped_storage().data_ptr(), g.storage_offset(), g.numel())
        if key not in seen:
            seen.add(key)
            out.append(g)
    return out


def found_overflow(grads, ledger=None, group=None) -> bool:
    """True if any rank's gradients hold an inf or nan.

    Each rank checks its own tensors, then the flags are all-reduced with max through the
    ledger, so every rank returns the same verdict and they all skip (or all step) together.
    Without a ledger the verdict is this process's alone.
    """
    flag = torch.zeros(1, dtype=torch.float32)
    for g in _unique(grads):
        if not bool(torch.isfinite(g).all()):
            flag.fill_(1.0)
            break
    if ledger is not None:
        ledger.all_reduce(flag, op="max", group=group, tag="overflow")
    return bool(flag.item() > 0)


def squared_norm(grads, into: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's share of the squared L2 norm: the sum of squares of every element of
    `grads` in fp32, a tensor passed twice (a tied weight) once; added to `into` if given (a
    gradient seen a piece at a time, as offload="disk" streams it)."""
    sq = torch.zeros(1, dtype=torch.float32) if into is None else into
    for g in _unique(grads):
        sq += g.detach().float().pow(2).sum()
    return sq


def global_norm(sq: torch.Tensor, ledger=None, group=None) -> float:
    """The L2 norm of a gradient from its ranks' squared shares (squared_norm): with sharded
    gradients each rank holds a disjoint piece, so the shares are summed over the ranks (one
    all-reduce) before the square root. The one norm every engine clips by."""
    if ledger is not None:
        ledger.all_reduce(sq, op="sum", group=group, tag="grad_norm")
    return math.sqrt(sq.item())


def clip_coefficient(total: float, max_norm: float) -> float:
    """What to multiply the gradients by so their norm is at most max_norm (never above 1)."""
    return min(1.0, max_norm / (total + 1e-6))


def clip_grad_norm_(grads, max_norm, ledger=None, group=None) -> float:
    """Scale gradients in place so that their global L2 norm is at most max_norm.

    `grads` are the tensors this rank holds (global_norm sums the ranks' shares). Returns the
    total norm before clipping, as torch.nn.utils.clip_grad_norm_ does.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be a number > 0; got {max_norm!r}")
    grads = _unique(grads)
    total = global_norm(squared_norm(grads), ledger, group)
    coef = clip_coefficient(total, max_norm)
    if coef < 1.0:  # only ever shrink
        for g in grads:
            g.mul_(coef)
    return total


# ------------------------------------------------------------------ the model in the compute dtype


def cast_for_compute(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the model's parameters to the compute dtype (model.to(dtype) would cast its
    floating-point buffers too); buffers stay as they are, see fp32_where_buffers."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    fp32_where_buffers(model, dtype)


def fp32_where_buffers(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Modules that hold floating-point buffers (BatchNorm's running mean and variance) compute
    in fp32: their inputs and parameters are cast up on the way in, their output back to
    `dtype` on the way out, and the buffers themselves stay fp32. A running average kept in
    bf16 (8 significant bits) stops moving once each update is below its spacing; autocast
    runs batch_norm in fp32, and FSDP's MixedPrecision leaves BatchNorm in full precision, for
    the same reason. The cast of a parameter is part of the graph, so its gradient comes back
    in its own dtype to wherever the engine keeps it."""
    if dtype == torch.float32:
        return
    for m in model.modules():
        if any(b.is_floating_point() for b in m.buffers(recurse=False)):
            for b_name, b in m._buffers.items():
                if b is not None and b.is_floating_point():
                    m._buffers[b_name] = b.float()
            m.register_forward_pre_hook(_compute_in_fp32, with_kwargs=True)
            # always_call: a forward that raises (BatchNorm on a batch of one) still gets its real
            # parameters back, or the fp32 copies would stay in the module and never train again
            m.register_forward_hook(lambda mod, args, out, dtype=dtype: _back_to(mod, out, dtype),
                                    always_call=True)


def _floats_to(x, dtype):
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                    else t, x)


def _compute_in_fp32(module, args, kwargs):
    low = {n: p for n, p in module._parameters.items()
           if p is not None and p.is_floating_point() and p.dtype != torch.float32}
    module._zerolab_low_params = low
    for n, p in low.items():
        module._parameters[n] = p.float()     # for this forward only: a cast autograd sees
    return _floats_to(args, torch.float32), _floats_to(kwargs, torch.float32)


def _back_to(module, out, dtype):
    module._parameters.update(getattr(module, "_zerolab_low_params", {}))   # the real parameters again
    module._zerolab_low_params = {}
    return _floats_to(out, dtype)


# ------------------------------------------------------------------ the component


class MixedPrecision:
    """The precision component of an engine: policy, loss scaler, agreed overflow check.

        mp = MixedPrecision("fp16", ledger=engine.comm)
        mp.scale_loss(loss, step).backward()
        ok = mp.unscale_and_check(fp32_grads)   # same verdict on every rank
        if ok: optimizer.step()
        mp.update(found_inf=not ok)
    """

    def __init__(self, name="fp32", *, scaler: LossScaler | None | bool = None, ledger=None, group=None):
        """scaler: None (fp16: the default dynamic LossScaler), a LossScaler, or False: fp16 with
        no loss scaling at all (FSDP2's fp16 parameters without a GradScaler: gradients below
        fp16's smallest subnormal flush to zero), so a bare loss.backward() is a whole backward."""
        self.policy = policy(name)
        if scaler is not None and scaler is not False and not isinstance(scaler, LossScaler):
            raise TypeError(f"scaler must be a zerolab.precision.LossScaler or False, got {type(scaler).__name__}")
        if scaler is not None and not self.policy.loss_scaling:
            raise ValueError(f"a loss scaler is only used with precision 'fp16'; got precision {name!r}")
        if self.policy.loss_scaling and scaler is None:
            scaler = LossScaler()
        self.scaler = scaler or None
        self.ledger, self.group = ledger, group

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.compute_dtype

    @property
    def scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor, step=None) -> torch.Tensor:
        """loss * scale for fp16 (in fp32, so the product itself cannot overflow); loss otherwise.

        fp32 and bf16 have no scale to lower, so a NaN loss there can only mean a bug or a
        divergence: it raises FloatingPointError naming the step instead of training on.
        """
        if self.scaler is None:
            if bool(torch.isnan(loss.detach()).any()):
                where = f" at step {step}" if step is not None else ""
                raise FloatingPointError(
                    f"the loss is NaN{where} in {self.name} training; with no loss scaler there is "
                    "nothing to back off, so training stops here (check the learning rate and the data)")
            return loss
        return loss.float() * self.scaler.scale

    def unscale_and_check(self, grads) -> bool:
        """Unscale fp32 gradients in place (fp16), then check for inf/nan. True = finite.

        For fp16 the verdict is all-reduced through the ledger so that every rank agrees.
        For fp32 and bf16 a non-finite gradient is checked on this rank only and raises
        FloatingPointError: there is no loss scale to lower, so skipping would not help.
        """
        grads = [g for g in grads if g is not None]
        if self.scaler is None:
            if found_overflow(grads):
                raise FloatingPointError(f"non-finite gradients in {self.name} training")
            return True
        inv = 1.0 / self.scaler.scale
        for g in _unique(grads):
            g.mul_(inv)
        return not found_overflow(grads, self.ledger, self.group)

    def update(self, found_inf: bool, step=None) -> None:
        """Advance the loss scaler after a step (nothing to do without one)."""
        if self.scaler is not None:
            self.scaler.update(bool(found_inf), step)

    def state_dict(self) -> dict:
        return {"precision": self.name,
                "scaler": None if self.scaler is None else self.scaler.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        if d["precision"] != self.name:
            raise ValueError(f"state is for precision {d['precision']!r}, this component is {self.name!r}")
        if self.scaler is not None and d.get("scaler") is not None:
            self.scaler.load_state_dict(d["scaler"])

    def __repr__(self):
        return f"MixedPrecision({self.name!r}, scaler={self.scaler!r})"
