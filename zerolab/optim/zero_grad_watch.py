"""How an engine learns that the script called optimizer.zero_grad(), without replacing it.

The optimizer an engine steps holds the engine's own tensors (each parameter's view of a flat
master, or its fp32 master), and the gradients the engine keeps are elsewhere (flat buffers, the
low-precision model's p.grad). torch's zero_grad() only sets its own tensors' .grad to None (or
zeroes them in place, set_to_none=False), and PyTorch gives it no hook. So the engine leaves a
gradient where zero_grad() will find it: between a step and the next backward, each of its
tensors in the optimizer carries a mark, a view of one shared zero that takes no memory (expand()
of one element); between a backward and its step, the gradients the engine exposes (fp32: each
view's gradient is the engine's own). Then:

* zero_grad() (set_to_none=True, the default) drops them: a finalizer on each notes it at once
  (torch keeps a tensor's Python object alive exactly as long as .grad holds it);
* zero_grad(set_to_none=False) writes the shared zero.

The engine looks (seen) before it next touches its gradients or reports its memory (a forward, a
backward, a step, memory_report), and then drops its own, as zero_grad() would have. (A finalizer
runs while torch is still inside the .grad setter, so it only notes; the work waits for a look.)

Before the engine itself changes what the optimizer's tensors hold (its step hands them
gradients; a delayed update lands), it takes its marks back (disarm), so no step ever sees one.

Marks are left after a step only. torch.amp.GradScaler's unscale_(), between a backward and its
step, writes into every gradient the optimizer holds, and would write into a mark too.
"""

from __future__ import annotations

import contextlib
import weakref

import torch


class ZeroGradWatch:
    """The gradients an engine left on one optimizer's tensors (see the module docstring).

    `model_params`: the model's own parameters, whose .grad is the script's to read, never marked."""

    def __init__(self, optimizer, model_params):
        self.optimizer = optimizer
        self.model_ids = {id(p) for p in model_params}
        self.left = []                  # (tensor, weak reference to the gradient left on it, a mark?)
        self.finalizers = []
        self.zeros = {}                 # (dtype, device) -> (the shared zero, its version when armed)
        self.marks = False              # were marks left (after a step)?
        self.make = None                # what makes a mark (None: a view of the shared zero)
        self.heard = False              # a gradient left was dropped since arm()

    def _mark(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.dtype, t.device)
        if key not in self.zeros:
            zero = torch.zeros((), dtype=t.dtype, device=t.device)
            self.zeros[key] = (zero, zero._version)
        return self.zeros[key][0].expand(t.shape)

    def arm(self, marks: bool, make=None) -> None:
        """Watch every engine tensor the optimizer holds: its gradient, or a mark where it has none
        (marks=True). `make(t)`: another kind of mark (one whose `zeroed` says that
        zero_grad(set_to_none=False) zeroed it: engines.chunk_grad)."""
        self.disarm()
        self.marks, self.make = marks, make
        for group in self.optimizer.param_groups:
            for t in group["params"]:
                if id(t) in self.model_ids:
                    continue
                marked = t.grad is None and marks
                if marked:
                    t.grad = make(t) if make is not None else self._mark(t)
                if t.grad is not None:
                    self.left.append((t, weakref.ref(t.grad), marked))
                    self.finalizers.append(weakref.finalize(t.grad, self._dropped))
        self.zeros = {k: (zero, zero._version) for k, (zero, _) in self.zeros.items()}

    def _dropped(self) -> None:
        """A gradient the engine left is gone: the script's zero_grad() (or p.grad = None)."""
        self.heard = True

    def seen(self) -> bool:
        """Did zero_grad() run since arm(): a gradient left dropped, or the shared zero written?"""
        return self.heard or any(zero._version != seen for zero, seen in self.zeros.values()) or \
            any(getattr(g(), "zeroed", False) for _, g, _ in self.left)

    def disarm(self) -> bool:
        """Take the marks back and stop watching; True if zero_grad() ran meanwhile."""
        for f in self.finalizers:
            f.detach()
        self.finalizers = []
        ran = self.seen()
        self.heard = False
        for t, g, marked in self.left:
            if marked and t.grad is not None and t.grad is g():    # (our mark, still in place)
                t.grad = None
        self.left = []
        self.zeros = {k: (zero, zero._version) for k, (zero, _) in self.zeros.items()}
        return ran

    @contextlib.contextmanager
    def engine_drops(self):
        """The engine itself drops what the optimizer's tensors hold (outside a step): not the
        script's zero_grad(); the watch goes on afterwards as it was."""
        armed, marks, make = bool(self.finalizers), self.marks, self.make
        self.disarm()
        try:
            yield
        finally:
            if armed:
                self.arm(marks, make)
