"""What p.grad holds after a sharded engine's backward: a guard, not a wrong gradient.

After ZeRO's backward the gradient a rank must use is reduce-scattered: each rank holds the
mean gradient of its 1/N slice, inside the engine (ZeRO-1: the owned slice of a flat bucket;
ZeRO-2 and 3: a gradient shard), and p.grad would hold either nothing (ZeRO-2/3) or this rank's
own, unreduced gradient (ZeRO-1). A script's habit of reading p.grad, above all
torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), would then clip nothing, or clip by
one rank's local norm: a silently different run. So after a synced backward every trainable
p.grad is a GradientElsewhere: its shape and dtype can be looked at, anything that reads its
values raises an error naming engine.clip_grad_norm_. The engine removes the guards before the
next backward and at zero_grad.

The guards also tell the engine when a script zeroed the gradients in its own way: torch's
model.zero_grad() (and a torch optimizer's zero_grad()) sets every p.grad to None, which
removes every guard; with set_to_none=False it calls p.grad.zero_() on each, which the guard
passes on to the engine's zero_grad(). Either way the engine drops the gradients it holds
(Engine._take_back_guards), so a PyTorch loop zeroes what it means to zero.
"""

from __future__ import annotations

import torch


class GradientElsewhere(torch.Tensor):
    """Stands in p.grad after a sharded backward (a zero-stride view of one shared element)."""

    LOOKS = frozenset({"size", "dim", "numel", "stride", "is_floating_point", "get_device", "__get__",
                       "__set__", "requires_grad_", "detach_"})
    engine = None               # the engine whose zero_grad() p.grad.zero_() means

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "zero_" and cls.engine is not None:   # Module.zero_grad(set_to_none=False)
            cls.engine.zero_grad()
            return args[0]
        if name not in cls.LOOKS:
            stage = getattr(cls.engine, "stage", "?")
            raise RuntimeError(
                f"p.grad under ZeRO-{stage}: each rank holds the averaged gradient of its own 1/N "
                "slice inside the engine, not in p.grad, so anything that reads p.grad would see "
                "one rank's piece or nothing: torch.nn.utils.clip_grad_norm_(model.parameters()), a "
                "norm, or an optimizer built on model.parameters() outside the engine. Clip with "
                "engine.clip_grad_norm_(max_norm) (it returns the global norm) or max_grad_norm=; "
                "step with the engine's optimizer (the one you passed: zl.ZeRO(model, optimizer, "
                "...), then optimizer.step() or engine.optimizer.step()).")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


_ONE = {}   # (dtype, device) -> the one zero element every guard of that dtype is a view of


def hide(params, engine) -> None:
    """Put a guard in every trainable parameter's .grad."""
    kind = getattr(engine, "_guard_kind", None)
    if kind is None:            # one guard class per engine: p.grad.zero_() reaches its zero_grad
        kind = engine._guard_kind = type(f"GradientElsewhere[ZeRO-{getattr(engine, 'stage', '?')}]",
                                         (GradientElsewhere,), {"engine": engine})
    for p in params:
        key = (p.dtype, p.device)
        if key not in _ONE:
            _ONE[key] = torch.zeros(1, dtype=p.dtype, device=p.device)
        p.grad = torch.Tensor._make_subclass(kind, _ONE[key].expand(p.shape))


def unhide(params) -> None:
    """Remove the guards (the next backward or zero_grad owns p.grad again)."""
    for p in params:
        if isinstance(p.grad, GradientElsewhere):
            p.grad = None


def count(params) -> int:
    """How many of `params` still hold a guard."""
    return sum(isinstance(p.grad, GradientElsewhere) for p in params)


def real(grads) -> list:
    """The gradients in `grads` that are not guards (for counting memory)."""
    return [g for g in grads if g is not None and not isinstance(g, GradientElsewhere)]
