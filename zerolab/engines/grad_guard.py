"""What p.grad holds after a sharded engine's backward: this rank's piece of the averaged gradient,
in a tensor that knows it is sharded (FSDP2 hands out DTensors for the same reason).

After ZeRO's backward each rank holds the mean gradient of its own 1/N slice of the flat buffers,
inside the engine: ZeRO-1 the owned slice of a bucket's gradient, ZeRO-2 a gradient shard, ZeRO-3
a unit's gradient shard. Each trainable p.grad is then a ShardedGradient over p's part of that
slice, so a script's own code runs on it unchanged:

    p.grad.shape, .dtype, .device        the parameter's (p.grad.shape == p.shape)
    p.grad.to_local()                    this rank's piece: elements [lo, hi) of p's flattened
                                         gradient, a view of the engine's shard (what the step reads)
    p.grad.norm(), torch.linalg.vector_norm(p.grad, ord), .sum(), .mean(), .max(), .min(),
    .abs().max(), .isfinite().all()      the whole gradient's answer, as a PartialResult: each
                                         rank's part, combined by one all-reduce when it is read
    p.grad.mul_(c), .div_(c), .clamp_(lo, hi), .zero_(), and any elementwise operation with numbers
                                         on this rank's piece (out of place: a new ShardedGradient)
    p.grad.view(...), .reshape(...)      the same piece (row-major order does not change)
    p.grad.full_tensor()                 the whole gradient on every rank (a collective)

So torch.nn.utils.clip_grad_norm_ and clip_grad_value_ run unchanged through both of their paths:
with foreach=None, PyTorch takes the per-tensor path for any tensor subclass (torch.linalg.
vector_norm of each gradient, torch.stack, the norm of the norms, then g.mul_(coef) or
g.clamp_(-c, c)); with foreach=True, torch._foreach_norm, torch._foreach_mul_,
torch._foreach_clamp_min_ and _max_. Each norm is a PartialResult, stacking and taking the norm of
partial norms stays partial, and `total_norm + 1e-6` combines it: ONE all-reduce of one number
(fp64, tag "grad_norm") whatever the number of parameters, as DTensor's Partial placement does.
What needs values this rank does not hold is refused by name: indexing, .tolist(), printing the
values, torch.cat of pieces, copy_ from a full tensor, an optimizer built on model.parameters()
outside the engine (its p.add_(p.grad) would mix a whole tensor with a piece).

Why not DTensor itself, as FSDP2:
* the layout: DTensor's Shard(d) cuts each tensor into torch.chunk's pieces along one dimension.
  The flat buffers cut at any element: a rank may hold the tail of one parameter and the head of
  the next, and none of a third; Shard(0) of the flattened parameter describes that only when the
  cuts happen to fall on chunk boundaries. One class for every parameter keeps one code path;
* the ledger: every collective zerolab makes goes through engine.comm (zerolab.runtime.comm), where its
  bytes are counted and a mismatch between ranks is named; DTensor's redistribute calls
  torch.distributed's functional collectives directly.
The design is DTensor's all the same: a wrapper tensor with the whole tensor's metadata over a
local piece (torch.Tensor._make_wrapper_subclass, __torch_dispatch__), reductions that return a
partial result (engines.partial_result), elementwise operations on the piece.

Every rank must read a reduction, as under FSDP2 (DTensor.full_tensor() is a collective too):
`if rank == 0: print(p.grad.norm())` leaves rank 0 in an all-reduce the others never join. A
PartialResult read once keeps its value, so printing clip_grad_norm_'s result on one rank after
every rank clipped communicates nothing.

Tied weights are one parameter with one p.grad: counted once. Padding lies in no parameter's
piece: never counted. A parameter no rank's backward reached keeps p.grad None, as in one process.

fp16 with loss scaling: until the step unscales them, the engine's gradients are S times the
gradient (S the loss scale), where PyTorch's recipe calls GradScaler.unscale_ before clipping. A
ShardedGradient carries S: norms, sums, maxima and minima are divided by it, clamp bounds and
compared numbers are multiplied by it, so clip_grad_norm_ and clip_grad_value_ act on the true
gradient; other operations that would see the scaled values are refused while S != 1.
"""

from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .partial_result import PartialResult, identity, meta_out, over_every_element, reduction_kind

aten = torch.ops.aten

# ------------------------------------------------------------------ reductions


def _local_part(func, kind, g: ShardedGradient, args, kwargs) -> torch.Tensor:
    """This rank's part of the reduction, in float64, in the combining domain (|x|^p summed for a
    p-norm); an empty piece gives the reduction's identity."""
    local = g._local
    if local.numel() == 0:
        return torch.tensor(identity(kind), dtype=torch.float64, device=local.device)
    if isinstance(kind, tuple):
        p = kind[1]
        norm = torch.linalg.vector_norm(local, p).double()
        return norm if p in (0.0, math.inf, -math.inf) else norm.pow(p)
    if kind == "sum":
        part = local.sum(dtype=torch.float64)
        if func in (aten.mean.default, aten.mean.dim):
            part = part / g.numel()
        return part
    if kind == "max":
        return local.max().double()
    if kind == "min":
        return local.min().double()
    return torch.tensor(float(bool(local.all() if kind == "all" else local.any())), dtype=torch.float64,
                        device=local.device)


def _reduce(func, g: ShardedGradient, args, kwargs):
    kind = reduction_kind(func, args, kwargs)
    if kind is None or not over_every_element(func, args, kwargs):
        return None
    out = meta_out(func, args, kwargs)
    divisor = 1.0 if kind in ("all", "any") or kind == ("norm", 0.0) else g._scale
    acc = _local_part(func, kind, g, args, kwargs).reshape(out.shape)
    return PartialResult(acc, kind, g._reducer, divisor, out.shape, out.dtype, g.device)


# ------------------------------------------------------------------ the gradient


_LIKE = {aten.zeros_like.default, aten.empty_like.default, aten.ones_like.default, aten.full_like.default}
_NEW = {aten.new_zeros.default, aten.new_empty.default, aten.new_ones.default, aten.new_full.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._reshape_alias.default,
          aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default}


class ShardedGradient(torch.Tensor):
    """p.grad under a sharded engine: this rank's piece of the averaged gradient (module docstring).

    local: elements [lo, hi) of the flattened gradient on this rank (1-D, a view of the engine's
    shard; None where the engine keeps it in files, offload="disk"); shape, dtype: the
    parameter's; reducer: how reductions combine (Reducer); scale: fp16's loss scale the values
    carry (1 otherwise); owner: the engine that handed it out (its zero_() tells it)."""

    @staticmethod
    def __new__(cls, local, lo, hi, shape, dtype, device, reducer, scale=1.0, owner=None, key=None):
        g = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        g._local, g._lo, g._hi = local, lo, hi
        g._reducer, g._scale, g._owner, g._key = reducer, scale, owner, key
        return g

    __torch_function__ = torch._C._disabled_torch_function_impl

    def _like(self, local, shape=None, dtype=None, scale=None, owned=False) -> ShardedGradient:
        return ShardedGradient(local, self._lo, self._hi, self.shape if shape is None else shape,
                               dtype or self.dtype, self.device, self._reducer,
                               self._scale if scale is None else scale,
                               self._owner if owned else None, self._key if owned else None)

    def _same_piece(self, other) -> bool:
        return (other._lo, other._hi, other.numel(), other._reducer) == (self._lo, self._hi, self.numel(),
                                                                           self._reducer)

    # -------------------------------------------------------------- DTensor's names
    def to_local(self) -> torch.Tensor:
        """This rank's piece: elements [lo, hi) of the flattened gradient (a view: writing it writes
        what the step reads). Times the loss scale in fp16 with loss scaling (see .scale)."""
        return self._values("to_local()")

    @property
    def piece(self) -> tuple:
        """(lo, hi): the elements of the flattened gradient this rank holds."""
        return self._lo, self._hi

    @property
    def scale(self) -> float:
        """The loss scale the values carry (fp16 with loss scaling; 1 otherwise)."""
        return self._scale

    def full_tensor(self) -> torch.Tensor:
        """The whole gradient on every rank (every rank must call it: one all-reduce of the
        parameter's size), unscaled."""
        local = self._values("full_tensor()")
        whole = torch.zeros(self.numel(), dtype=torch.float64 if self._scale != 1 else local.dtype,
                            device=local.device)
        whole[self._lo:self._hi] = local
        self._reducer.all_reduce(whole, "sum", "grad_gather")
        if self._scale != 1:
            whole /= self._scale
        return whole.to(self.dtype).view(self.shape)

    def tolist(self):
        raise RuntimeError(_refusal(self, "tolist()"))

    def item(self):
        raise RuntimeError(_refusal(self, "item()"))

    def numpy(self, *args, **kwargs):
        raise RuntimeError(_refusal(self, "numpy()"))

    def __repr__(self):
        where = (f"elements [{self._lo}, {self._hi}) of {self.numel()} on rank {self._reducer.rank} of "
                 f"{self._reducer.world_size}")
        scale = f", times the loss scale {self._scale:g}" if self._scale != 1 else ""
        local = "" if self._local is None else f": {self._local!r}"
        return f"ShardedGradient(shape={tuple(self.shape)}, dtype={self.dtype}, {where}{scale}{local})"

    def _values(self, what: str) -> torch.Tensor:
        if self._local is None:
            raise RuntimeError(
                f"{what} on p.grad under {self._reducer.engine_name} with offload='disk': the gradient "
                "shards are in files until the step reads them. Clip with max_grad_norm= or "
                "engine.clip_grad_norm_(max_norm); p.grad's shape and dtype can be read.")
        return self._local

    # -------------------------------------------------------------- operations
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name.startswith("_foreach_"):
            return _foreach(func, name, args, kwargs)
        g = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, ShardedGradient))
        if func in _NEW:                        # a new tensor of a given size: no value is read
            return func(torch.empty(0, dtype=g.dtype, device=g.device), *args[1:], **kwargs)
        x = args[0] if isinstance(args[0], ShardedGradient) else None
        if x is not None:
            if func in (aten.detach.default, aten.alias.default):     # (p.grad.data too)
                return x._like(None if x._local is None else x._local.detach(), owned=True)
            if func in _VIEWS:                  # row-major order, so the same piece
                return x._like(x._local, shape=meta_out(func, args, kwargs).shape, owned=True)
            if func in _LIKE:                   # zeros_like(p.grad): a new gradient of the same layout
                out = func(x._values(str(func)), *args[1:], **kwargs)
                return x._like(out, dtype=meta_out(func, args, kwargs).dtype, scale=1.0)
            if reduction_kind(func, args, kwargs) is not None and over_every_element(func, args, kwargs):
                x._values(f"{name}()")
                return _reduce(func, x, args, kwargs)
        if torch.Tag.pointwise in func.tags or func in _ALSO_ELEMENTWISE:
            return _elementwise(func, name, g, args, kwargs)
        raise RuntimeError(_refusal(g, func))


_ALSO_ELEMENTWISE = {aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten._to_copy.default,
                     aten.copy_.default}


def _elementwise(func, name, g, args, kwargs):
    """An elementwise operation on the pieces: ShardedGradients of the same piece, numbers and
    0-d tensors (a whole tensor would need values this rank does not hold)."""
    if name.endswith("_") and not isinstance(args[0], ShardedGradient):
        raise RuntimeError(_refusal(g, func, "it would update a whole tensor from one piece of the gradient"))
    if func is aten._to_copy.default and kwargs.get("device") is not None \
            and torch.device(kwargs["device"]) != g.device:
        raise RuntimeError(_refusal(g, func, "it moves one piece to another device"))
    grads = []
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, ShardedGradient):
            if not t._same_piece(g):
                raise RuntimeError(_refusal(g, func, "the gradients hold different pieces on each rank"))
            grads.append(t)
        elif isinstance(t, torch.Tensor) and not isinstance(t, PartialResult) and t.numel() > 1:
            raise RuntimeError(_refusal(g, func, "its other operand is a whole tensor, of which this rank "
                                                 "would need the piece"))
    s = grads[0]._scale
    if any(t._scale != s for t in grads):
        raise RuntimeError(_refusal(g, func, "the gradients carry different loss scales"))
    scale = _scale_after(name, grads, s)
    if scale is None:
        raise RuntimeError(_refusal(g, func, f"its result would see the values times {s:g} (fp16's loss "
                                             "scale) before the step unscales them"))
    if s != 1 and _base(name) in _SCALES_NUMBERS:
        args, kwargs = _times_scale(args, kwargs, s, g._values(str(func)).dtype)
    piece = lambda t: (t._values(str(func)) if isinstance(t, ShardedGradient)          # noqa: E731
                       else t.full_tensor() if isinstance(t, PartialResult) else t)
    out = func(*tree_map(piece, args), **tree_map(piece, kwargs))
    if name.endswith("_"):
        x = args[0]
        if func is aten.zero_.default and x._owner is not None:
            x._owner._grad_zeroed(x._key)       # (Module.zero_grad(set_to_none=False) zeroes each)
        return x
    meta = meta_out(func, args, kwargs)
    return g._like(out, shape=meta.shape, dtype=meta.dtype, scale=scale)


def _base(name: str) -> str:
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


# Under fp16's loss scale S the values are S g. Operations after which the result is S times the
# true result (the scale carries over), those whose numbers are scaled to match (clamp(S g, S lo,
# S hi) = S clamp(g, lo, hi); S g > S c is g > c), and those whose result carries none (isnan,
# sign: the same for S g as for g; an overflow of S g is the step's own overflow check).
_CARRY_SCALE = {"abs", "neg", "clone", "_to_copy", "copy", "zero", "fill", "clamp", "clamp_min", "clamp_max",
                "mul", "div"}
_COMPARES = {"eq", "ne", "lt", "le", "gt", "ge"}
_SCALE_FREE = {"isnan", "isinf", "isposinf", "isneginf", "isfinite", "signbit", "sign", "sgn"}
_SCALES_NUMBERS = {"fill", "copy", "clamp", "clamp_min", "clamp_max"} | _COMPARES


def _scale_after(name: str, grads, s):
    """The loss scale the result of operation `name` carries (None: it cannot carry one)."""
    if s == 1:
        return 1.0
    base = _base(name)
    if base in _COMPARES or base in _SCALE_FREE or all(t.dtype == torch.bool for t in grads):
        return 1.0
    if base in _CARRY_SCALE and not (base in ("mul", "div") and len(grads) > 1):
        return s
    return None


def _times_scale(args, kwargs, s, dtype):
    """The numbers of an operation on S g, in the same units (every ShardedGradient left as it is).
    One beyond the largest value of the gradient's dtype is infinite there (clamping fp16 values
    at 2^16 clamps nothing)."""
    top = torch.finfo(dtype).max if dtype.is_floating_point else math.inf

    def up(v):
        if isinstance(v, bool) or v is None or isinstance(v, ShardedGradient):
            return v
        if isinstance(v, (int, float)):
            return v * s if abs(v * s) <= top else math.copysign(math.inf, v)
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            scaled = v.double() * s
            return torch.where(scaled.abs() <= top, scaled, v.double().sign() * math.inf).to(v.dtype)
        return v
    return (args[0],) + tuple(up(v) for v in args[1:]), {k: up(v) for k, v in kwargs.items()}


def _foreach(func, name, args, kwargs):
    """torch._foreach_X(tensors, ...) as X on each tensor (ShardedGradients through the rules above):
    an argument that is a list gives each tensor its own element."""
    tensors = args[0]
    base = name[len("_foreach_"):]
    n = len(tensors)
    per = lambda v, i: v[i] if isinstance(v, (list, tuple)) and len(v) == n else v   # noqa: E731
    outs = []
    for i, t in enumerate(tensors):
        rest = [per(v, i) for v in args[1:]]
        kw = {k: per(v, i) for k, v in kwargs.items()}
        if base == "norm":
            ord_ = rest[0] if rest else kw.get("ord", 2)
            dtype = rest[1] if len(rest) > 1 else kw.get("dtype")
            outs.append(torch.linalg.vector_norm(t, ord_, dtype=dtype))
        else:
            outs.append(getattr(torch.Tensor, base)(t, *rest, **kw))
    return None if base.endswith("_") else outs


def _refusal(g, func, why=None) -> str:
    name = g._reducer.engine_name
    r = g._reducer
    why = why or "it needs values this rank does not hold"
    return (f"{func} on p.grad under {name}: {why}. Each rank holds the averaged gradient of its own "
            f"1/N slice (here elements [{g._lo}, {g._hi}) of this gradient's {g.numel()}, rank {r.rank} of "
            f"{r.world_size}). What works on p.grad as on a whole gradient: its shape and dtype, norms, "
            "sums, max and min, isfinite, torch.nn.utils.clip_grad_norm_ and clip_grad_value_, in-place "
            "scaling and clamping, and elementwise operations with numbers; p.grad.full_tensor() gives the "
            "whole gradient (every rank calls it). To update the weights, step with the engine's "
            "optimizer (the one you passed: zl.ZeRO(model, optimizer, ...), then optimizer.step() or "
            "engine.optimizer.step()), not one built on model.parameters() outside the engine.")


# ------------------------------------------------------------------ handing them out


def plan(buckets, shards) -> list:
    """Where each parameter's piece is: [(parameter, shard index, lo, hi in the shard, lo, hi in the
    flattened parameter)] for every parameter of the flat `buckets` (zerolab.buckets.Bucket), whose
    slice `shards[i]` this rank holds."""
    out = []
    for i, (b, s) in enumerate(zip(buckets, shards)):
        for pc in b.pieces(s):      # (an empty piece sits at the slice's nearest edge)
            out.append((pc.param, i, *pc.in_slice, *pc.in_param))
    return out


def hand_out(where, owned, reducer, scale, owner, skip=(), in_memory=True, generation=0) -> int:
    """p.grad = this rank's piece of each parameter's gradient (a view of owned[i]: the engine's
    reduced shard i), for every parameter of plan `where`; a parameter in `skip` (no rank reached
    it) or whose shard holds nothing keeps None. Returns how many were handed out."""
    handed = 0
    for p, i, t_lo, t_hi, lo, hi in where:
        if id(p) in skip or owned[i] is None:
            p.grad = None
            continue
        local = owned[i][t_lo:t_hi] if in_memory else None
        p.grad = ShardedGradient(local, lo, hi, p.shape, p.dtype, p.device, reducer, scale, owner,
                                 (generation, id(p)))
        handed += 1
    return handed


def take_back(params) -> None:
    """Remove them (the next backward, or zero_grad, owns p.grad again)."""
    for p in params:
        if isinstance(p.grad, ShardedGradient):
            p.grad = None


def count(params) -> int:
    """How many of `params` still hold a ShardedGradient."""
    return sum(isinstance(p.grad, ShardedGradient) for p in params)


def real(grads) -> list:
    """The gradients in `grads` that hold memory of their own (a ShardedGradient is a view of the
    engine's shard, counted there): what memory_report counts."""
    return [g for g in grads if g is not None and not isinstance(g, ShardedGradient)]
