"""How an engine learns that the script called optimizer.zero_grad(), without replacing it.

The optimizer an engine steps holds the engine's own tensors (each parameter's view of a flat
master, or its fp32 master), and the gradients the engine keeps are elsewhere (flat buffers, the
low-precision model's p.grad). torch's zero_grad() only sets its own tensors' .grad to None (or
zeroes them in place, set_to_none=False), and PyTorch gives it no hook. So the engine leaves a
mark where zero_grad() will find it: between a step (or a backward) and the next, each of its
tensors in the optimizer carries a gradient, the real one where the engine exposes it, else a
mark, a view of one shared zero that takes no memory (expand() of one element). Before the next
backward or step the engine looks once: a mark or gradient gone (set_to_none) or the shared zero
written (set_to_none=False) means zero_grad() ran, and the engine drops its own gradients as
zero_grad() would have; then the marks go, so no step ever sees one.

Marks are left after a step only. Between a backward and its step the engine watches just the
gradients it exposes (fp32: each view's gradient is the engine's own): torch.amp.GradScaler's
unscale_() writes into every gradient the optimizer holds, and would write into a mark too.
"""

from __future__ import annotations

import torch


class ZeroGradWatch:
    """The marks on one optimizer's tensors (see the module docstring). `model_params`: the
    model's own parameters, whose .grad is the script's to read, so they are never marked."""

    def __init__(self, optimizer, model_params):
        self.optimizer = optimizer
        self.model_ids = {id(p) for p in model_params}
        self.left = []                  # (tensor, what its .grad was when armed)
        self.marks = False              # were marks left (after a step)?
        self.zeros = {}                 # (dtype, device) -> (the shared zero, its version when armed)

    def _mark(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.dtype, t.device)
        if key not in self.zeros:
            zero = torch.zeros((), dtype=t.dtype, device=t.device)
            self.zeros[key] = (zero, zero._version)
        return self.zeros[key][0].expand(t.shape)

    def arm(self, marks: bool) -> None:
        """Watch every engine tensor the optimizer holds: its gradient, or a mark where it has none
        (marks=True)."""
        self.disarm()
        self.marks = marks
        for group in self.optimizer.param_groups:
            for t in group["params"]:
                if id(t) in self.model_ids:
                    continue
                if t.grad is None and marks:
                    t.grad = self._mark(t)
                if t.grad is not None:
                    self.left.append((t, t.grad))
        self.zeros = {k: (zero, zero._version) for k, (zero, _) in self.zeros.items()}

    def disarm(self) -> bool:
        """Take the marks back; True if zero_grad() ran since arm()."""
        ran = any(t.grad is not g for t, g in self.left) or \
            any(zero._version != seen for zero, seen in self.zeros.values())
        for t, g in self.left:
            if t.grad is not None and self._is_mark(t.grad):
                t.grad = None
        self.left = []
        return ran

    def _is_mark(self, g: torch.Tensor) -> bool:
        entry = self.zeros.get((g.dtype, g.device))
        return entry is not None and g.untyped_storage().data_ptr() == entry[0].untyped_storage().data_ptr()
