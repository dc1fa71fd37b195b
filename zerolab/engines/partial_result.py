"""A reduction of a tensor sharded over ranks, each rank holding its part until it is read:
PartialResult, DTensor's Partial placement for zerolab's ledger (used by engines.grad_guard).

    r = p.grad.norm()              # a PartialResult: this rank's sum of squares, not combined yet
    total = torch.stack([...])     # stacked with others of its kind, reduced again: still partial
    float(total)                   # combined on first read: ONE all-reduce (fp64, through the
                                   # engine's ledger) for every partial read together; kept after

How each kind combines: a p-norm's parts are sums of |x|^p (they add, then the p-th root); a
maximum's, the largest of the ranks'; all/any, the smallest/largest of their flags. Every rank
must read it (a collective), as DTensor.full_tensor() under FSDP2.
"""

from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten

# ------------------------------------------------------------------ how partial results travel


class Reducer:
    """The engine's ledger and group: where the ranks' parts of a reduction are combined."""

    def __init__(self, ledger, group, rank: int, world_size: int, engine_name: str):
        self.ledger, self.group = ledger, group
        self.rank, self.world_size = rank, world_size
        self.engine_name = engine_name          # "ZeRO-2", for messages

    def all_reduce(self, t: torch.Tensor, op: str, tag: str) -> None:
        if self.world_size > 1:
            self.ledger.all_reduce(t, op=op, group=self.group, tag=tag)


# How each kind of reduction combines over ranks: (the local part, the all-reduce's op).
# A p-norm's parts are sums of |x|^p (they add); the largest element's, the largest of the ranks'.
def combine_op(kind) -> str:
    if isinstance(kind, tuple):                 # ("norm", ord)
        p = kind[1]
        return "max" if p == math.inf else "min" if p == -math.inf else "sum"
    return {"sum": "sum", "max": "max", "min": "min", "all": "min", "any": "max"}[kind]


def identity(kind) -> float:
    """A reduction's value over no element (an empty piece: the parameter lies on other ranks)."""
    if isinstance(kind, tuple):
        return math.inf if kind[1] == -math.inf else 0.0
    return {"sum": 0.0, "max": -math.inf, "min": math.inf, "all": 1.0, "any": 0.0}[kind]


def finish(kind, acc: torch.Tensor, divisor: float) -> torch.Tensor:
    """The whole answer from the combined parts (float64), before its cast to the result dtype."""
    if isinstance(kind, tuple):
        p = kind[1]
        if p == 0:
            return acc                          # a count of non-zero elements: no scale
        value = acc if p in (math.inf, -math.inf) else acc.pow(1.0 / p)
        return value / divisor
    if kind in ("all", "any"):
        return acc > 0.5
    return acc / divisor


# ------------------------------------------------------------------ the partial result


class PartialResult(torch.Tensor):
    """A reduction of a sharded tensor (engines.grad_guard.ShardedGradient): this rank's part,
    combined over the ranks when first read.

    Staying partial, it can be stacked with others of the same kind and reduced again (the norm of
    partial norms, the sum of partial sums): clip_grad_norm_'s per-tensor norms become one
    number before a single all-reduce. Any other operation, .item(), float() or full_tensor()
    combines it (an all-reduce on every rank), and it keeps its value from then on."""

    @staticmethod
    def __new__(cls, acc, kind, reducer, divisor, shape, dtype, device):
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        r._acc, r._kind, r._reducer, r._divisor, r._value = acc, kind, reducer, divisor, None
        return r

    # a __torch_dispatch__ subclass's way (DTensor's): operations reach __torch_dispatch__ only
    __torch_function__ = torch._C._disabled_torch_function_impl

    def _like(self, acc, shape=None, dtype=None) -> PartialResult:
        return PartialResult(acc, self._kind, self._reducer, self._divisor,
                             self.shape if shape is None else shape, dtype or self.dtype, self.device)

    def full_tensor(self) -> torch.Tensor:
        """The whole answer on every rank (a collective the first time: every rank calls it)."""
        combine([self])
        return self._value

    def __repr__(self):
        if self._value is not None:
            return repr(self._value)
        return (f"PartialResult({self._kind!r} over {self._reducer.world_size} ranks, not combined yet: "
                f"read it on every rank)")

    def __format__(self, spec):
        return self.item().__format__(spec) if self.dim() == 0 else super().__format__(spec)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _partial_op(func, args, kwargs)
        if out is not NotImplemented:
            return out
        flat, _ = tree_flatten((args, kwargs))
        combine([t for t in flat if isinstance(t, PartialResult)])
        plain = lambda t: t._value if isinstance(t, PartialResult) else t   # noqa: E731
        return func(*tree_map(plain, args), **tree_map(plain, kwargs))


def combine(partials) -> None:
    """Combine every PartialResult in `partials` not combined yet: one all-reduce per reducer and
    op, their parts side by side (clip_grad_norm_'s foreach path hands several at once)."""
    groups: dict = {}
    seen: set = set()
    for t in partials:
        if t._value is None and id(t) not in seen:
            seen.add(id(t))
            groups.setdefault((id(t._reducer), combine_op(t._kind)), []).append(t)
    for (_, op), ts in groups.items():
        flat = torch.cat([t._acc.reshape(-1) for t in ts])
        tag = "grad_norm" if all(isinstance(t._kind, tuple) for t in ts) else "grad_reduce"
        ts[0]._reducer.all_reduce(flat, op, tag)
        at = 0
        for t in ts:
            n = t._acc.numel()
            whole = finish(t._kind, flat[at:at + n].reshape(t._acc.shape), t._divisor)
            t._value = whole.to(dtype=t.dtype, device=t.device).reshape(t.shape)
            at += n


def _same_partial(ts) -> bool:
    first = ts[0]
    return all(isinstance(t, PartialResult) and t._value is None and t.dim() == 0 and t._kind == first._kind
               and t._reducer is first._reducer and t._divisor == first._divisor for t in ts)


def _partial_op(func, args, kwargs):
    """The operations under which a PartialResult stays partial; NotImplemented for the others."""
    x = args[0] if args else None
    if func is aten.stack.default:
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if x and dim == 0 and _same_partial(x):
            out = meta_out(func, args, kwargs)
            return x[0]._like(torch.stack([t._acc for t in x]), out.shape, out.dtype)
        return NotImplemented
    if not isinstance(x, PartialResult) or x._value is not None:
        return NotImplemented
    if func in (aten.detach.default, aten.alias.default, aten.clone.default):
        return x._like(x._acc)
    if func is aten._to_copy.default and set(kwargs) <= {"dtype"}:
        return x._like(x._acc, dtype=kwargs.get("dtype") or x.dtype)
    kind = reduction_kind(func, args, kwargs)
    if kind is None or kind != x._kind or kind == ("norm", 0.0) or not over_every_element(func, args, kwargs):
        return NotImplemented                   # (ord 0 of partial counts: combine first)
    op = combine_op(kind)
    acc = x._acc.sum() if op == "sum" else x._acc.max() if op == "max" else x._acc.min()
    out = meta_out(func, args, kwargs)
    return x._like(acc.reshape(out.shape), out.shape, out.dtype)


# ------------------------------------------------------------------ reductions


def reduction_kind(func, args, kwargs):
    """The kind of a reduction over every element (None: not one served here)."""
    if func is aten.linalg_vector_norm.default:
        ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        return ("norm", float(ord_))
    if func in (aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim):
        return "sum"
    if func in (aten.max.default, aten.amax.default):
        return "max"
    if func in (aten.min.default, aten.amin.default):
        return "min"
    if func in (aten.all.default, aten.all.dims):
        return "all"
    if func in (aten.any.default, aten.any.dims):
        return "any"
    return None


def over_every_element(func, args, kwargs) -> bool:
    """Does the reduction run over every element (no dim, or every dim)?"""
    x = args[0]
    if func is aten.linalg_vector_norm.default:
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
    elif func in (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
                  aten.all.dims, aten.any.dims):
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
    else:
        return True
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return True
    dims = {d % max(x.dim(), 1) for d in ([dim] if isinstance(dim, int) else dim)}
    return dims == set(range(x.dim()))


def meta_out(func, args, kwargs) -> torch.Tensor:
    """What the operation gives for the whole tensors: its shape and dtype, worked out on the
    meta device (no data)."""
    def meta(t):
        if isinstance(t, torch.Tensor) and type(t) is not torch.Tensor:   # a wrapper: its metadata
            return torch.empty(t.shape, dtype=t.dtype, device="meta")
        if isinstance(t, torch.Tensor) and t.dim() == 0:
            return t.to("meta")
        return t
    out = func(*tree_map(meta, args), **tree_map(meta, kwargs))
    return out if isinstance(out, torch.Tensor) else out[0]
