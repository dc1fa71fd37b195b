"""p.grad under bitwise=True: a placeholder that says where the gradient is.

In the bitwise mode (engines.options.BITWISE) each backward is one chunk of the global batch,
and its gradient goes into the chunks' fixed tree as soon as the backward ends; the step's
gradient is the tree's sum over every rank's chunks, made at the step. Between a backward and
the step there is no value p.grad could hold. Leaving it None would let a script's own
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) clip nothing, silently; so p.grad holds
a ChunkGradient instead: its shape, dtype and device are the parameter's, it takes no memory
(a view of one zero), and anything that reads its values raises, naming what to call instead.
The next backward takes the placeholders back before it writes p.grad; removing them all
(model.zero_grad(), p.grad = None) or zeroing them (set_to_none=False) zeroes the gradients, as
it does under PyTorch. The tensors the optimizer holds carry placeholders too, so its
zero_grad() is seen the same way (optim.zero_grad_watch), and torch.amp.GradScaler, which would
unscale gradients it cannot see, is refused by the first one it touches.
"""

from __future__ import annotations

import torch

# what looks at a tensor without reading its elements
LOOKS = frozenset({"size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset",
                   "is_contiguous", "is_floating_point", "is_complex", "get_device", "__len__",
                   "requires_grad_", "__get__", "__set__", "__repr__", "data_ptr", "untyped_storage"})

MESSAGE = ("under bitwise=True a parameter's gradient is the sum of every rank's chunks along a fixed "
           "tree, made at the step, so p.grad has no value between backward and step ({what}). Clip "
           "with max_grad_norm= or engine.clip_grad_norm_(max_norm), whose norm is exact at any "
           "world size; read the step's gradients with engine.clip_grad_norm_ (it returns their norm).")


ZEROING = frozenset({"zero_", "_foreach_zero_"})     # zero_grad(set_to_none=False)


class ChunkGradient(torch.Tensor):
    """p.grad between a bitwise backward and its step (see the module docstring). `zeroed`:
    zero_grad(set_to_none=False) zeroed it (there is nothing to write: it is noted)."""

    zeroed = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ZEROING:
            for t in (args[0] if name.startswith("_foreach") else [args[0]]):
                if isinstance(t, ChunkGradient):
                    t.zeroed = True
            return args[0]
        if name not in LOOKS:
            raise RuntimeError(MESSAGE.format(what=name or "a read"))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __repr__(self, *args, **kwargs):
        return f"ChunkGradient(shape={tuple(self.shape)}, dtype={self.dtype}: made at the step)"


def placeholder(p: torch.Tensor) -> ChunkGradient:
    """A ChunkGradient for parameter p: no memory of its own."""
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    return torch.Tensor._make_subclass(ChunkGradient, zero.expand(p.shape))


def hand_out(params) -> None:
    """After a bitwise backward: each trained parameter's p.grad is a placeholder."""
    for p in params:
        p.grad = placeholder(p)


def clear(params) -> None:
    """The step made the gradients: the placeholders go."""
    for p in params:
        if isinstance(p.grad, ChunkGradient):
            p.grad = None


def take_back(params) -> str:
    """Before the next backward of the same step: the placeholders go. "zeroed" if the script
    removed them all since (model.zero_grad(), p.grad = None), "kept" if it removed none;
    removing some but not others is refused."""
    held = [isinstance(p.grad, ChunkGradient) for p in params]
    zeroed = any(h and p.grad.zeroed for p, h in zip(params, held))
    for p, h in zip(params, held):
        if h:
            p.grad = None
    if not any(held) or zeroed:
        return "zeroed"
    if not all(held):
        raise RuntimeError("p.grad was set to None for some parameters but not others between two "
                           "backwards under bitwise=True: the chunks' gradients live in the engine and "
                           "can only be zeroed all together: call zero_grad() (the optimizer's or the "
                           "model's).")
    return "kept"
