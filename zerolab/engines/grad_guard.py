"""What p.grad holds after a sharded engine's backward: a guard, not a wrong gradient.

After ZeRO's backward the gradient a rank must use is reduce-scattered: each rank holds the
mean gradient of its 1/N slice, inside the engine (ZeRO-1: the owned slice of a flat bucket;
ZeRO-2 and 3: a gradient shard), and p.grad would hold either nothing (ZeRO-2/3) or this rank's
own, unreduced gradient (ZeRO-1). A script's habit of reading p.grad, above all
torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), would then clip nothing, or clip by
one rank's local norm: a silently different run. So after a synced backward every trainable
p.grad is a GradientElsewhere: its shape and dtype can be looked at, anything that reads its
values raises an error naming engine.clip_grad_norm_. The engine removes the guards before the
next backward and at zero_grad (model.zero_grad() does it too: it sets p.grad to None).
"""

from __future__ import annotations

import torch


class GradientElsewhere(torch.Tensor):
    """Stands in p.grad after a sharded backward (a zero-stride view of one shared element)."""

    LOOKS = frozenset({"size", "dim", "numel", "stride", "is_floating_point", "get_device", "__get__", "__set__"})
    engine = "ZeRO"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in cls.LOOKS:
            raise RuntimeError(
                f"p.grad under {cls.engine}: each rank holds the averaged gradient of its own 1/N "
                "slice inside the engine, not in p.grad, so torch.nn.utils.clip_grad_norm_"
                "(model.parameters()) or a norm read from p.grad would see one rank's piece or "
                "nothing. Clip with engine.clip_grad_norm_(max_norm) (it returns the global norm) "
                "or pass max_grad_norm= to the engine.")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


_ONE = {}   # dtype -> the one zero element every guard of that dtype is a view of


def hide(params, engine_name: str) -> None:
    """Put a guard in every trainable parameter's .grad."""
    kind = type(f"GradientElsewhere[{engine_name}]", (GradientElsewhere,), {"engine": engine_name})
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


def real(grads) -> list:
    """The gradients in `grads` that are not guards (for counting memory)."""
    return [g for g in grads if g is not None and not isinstance(g, GradientElsewhere)]
