"""When ZeRO-3's units gather, release and reduce-scatter: the hooks and their order.

A Unit (zerolab.engines.zero3.units) knows HOW to gather, release and reduce-scatter itself; this
mixin of zerolab.engines.zero3.engine.ZeRO3 decides WHEN, from hooks on the model:

* a unit's forward pre-hook issues its all-gather (unless a prefetch did), the all-gathers of
  the next `prefetch` units in the last forward's order, then waits for its own; its forward
  post-hook releases it and hooks the unit's outputs, so that
* the gradient of those outputs gathers the unit again before its backward, prefetching the
  units backward needs next (the reverse of the order in which their forwards ENDED);
* when every trainable parameter's gradient is accumulated and the gradient of the unit's
  inputs computed (_InputsGradDone), the unit's gradient is reduce-scattered and it is released;
* at the end of backward (an autograd callback) units whose gradients never all arrived are
  reduced, and the ranks check they ran the same units (a mismatch is named, not a hang).
"""

from __future__ import annotations

from collections import deque

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..base import tensors_in
from .unit_state import GradState
from .units import Event, _InputsGradDone

EVENTS_KEPT = 4096      # engine.events keeps the most recent: several steps of any model in the book


class UnitSchedule:
    """The hooks of ZeRO3 (see the module docstring). Expects units, prefetch, comm, rank and
    the order bookkeeping set up by ZeRO3.__init__."""

    _held_for_graph = False     # an autograd pass that was not a backward went through the units

    # -------------------------------------------------------------- the lifecycle (units.Unit)
    def _event(self, u, state, phase=""):
        self.events.append(Event(self.comm.now(), self.rank, u.name, state, phase))

    def _use(self, u, phase):
        """Unit u is needed now: gather it (if no prefetch did) and wait; compute stands still
        for the time waited, which is what prefetch hides (gather_wait_s)."""
        self.gather_wait_s += u.wait(phase)
        self._event(u, "in_use", phase)

    def _prefetch_after(self, order, u, phase):
        """Start the all-gathers of the `prefetch` units that follow u in `order`."""
        if self.prefetch == 0 or u not in order:
            return
        i = order.index(u)
        ahead = [v for v in order[i + 1:] if v is not u and not (phase == "backward" and v.reduced)]
        for v in ahead[:self.prefetch]:
            v.gather(phase)

    # -------------------------------------------------------------- hooks
    def _install_hooks(self):
        # the lifecycle's events, oldest first: the last EVENTS_KEPT only, so that a long run holds
        # the same memory (a chapter that draws one step clears them before it)
        self.events = deque(self.events, maxlen=EVENTS_KEPT)
        self.model.register_state_dict_pre_hook(self._refuse_released_state_dict)
        self.model.register_state_dict_post_hook(lambda *a: self._copy_gathered_values(*a))
        for u in self.units:
            u.module.register_forward_pre_hook(self._make_pre_forward(u), with_kwargs=True)
            u.module.register_forward_hook(self._make_post_forward(u))
            for p in (u.buckets["train"].params if "train" in u.buckets else []):
                p.register_post_accumulate_grad_hook(self._on_grad_accumulated)

    def _make_pre_forward(self, u):
        def hook(module, args, kwargs):
            recompute = u.in_backward   # activation checkpointing re-runs forward in backward
            if u.index == 0 and not recompute:
                self._start_forward()
            phase = "backward" if recompute else "forward"
            if recompute:
                self._use(u, phase)
                return None
            self._cur_order.append(u)
            self._fwd_counts[u.index] += 1
            # issue this unit's gather (if no prefetch did), then the next units', THEN wait:
            # the gathers ahead travel while this unit waits and computes
            u.gather(phase)
            self._prefetch_after(self._fwd_order or self.units, u, "forward")
            self._use(u, phase)
            if torch.is_grad_enabled():
                flat, spec = tree_flatten((args, kwargs))
                idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
                if idx:
                    out = _InputsGradDone.apply(self, u, *[flat[i] for i in idx])
                    out = (out,) if isinstance(out, torch.Tensor) else out
                    for i, t in zip(idx, out):
                        flat[i] = t
                    u.input_hooks_out += 1
                    return tree_unflatten(flat, spec)
            return None
        return hook

    def _make_post_forward(self, u):
        def hook(module, args, output):
            if u.in_backward:           # a recompute inside backward: keep the unit gathered
                return None
            if not self._held_for_graph:
                u.release("forward")
            self._done_order.append(u)
            if torch.is_grad_enabled():
                outs = [t for t in tensors_in(output) if t.requires_grad]
                for t in outs:
                    t.register_hook(lambda g, u=u: self._pre_backward(u))
            if u.index == 0:
                self._end_forward()
            return None
        return hook

    def _start_forward(self):
        self._held_for_graph = False
        if self._cur_order:
            self._fwd_order = self._dedupe(self._cur_order)
        self._cur_order, self._done_order = [], []
        self._fwd_counts = [0] * len(self.units)
        for u in self.units:
            u.reset_backward()

    @staticmethod
    def _dedupe(order):
        return list(dict.fromkeys(order))   # each unit once, at its first place

    def _end_forward(self):
        # Ranks must run the same units, or their collectives pair up wrongly: compare the
        # counts now (one small all-reduce) and name the unit instead of hanging later.
        counts = torch.tensor(self._fwd_counts + [-c for c in self._fwd_counts], dtype=torch.float32)
        self.comm.all_reduce(counts, op="max", tag="check")
        n = len(self.units)
        hi, lo = counts[:n].tolist(), [-c for c in counts[n:].tolist()]
        bad = [u.name for u, a, b in zip(self.units, hi, lo) if a != b]
        if self._cur_order:
            self._fwd_order = self._dedupe(self._cur_order)
        # backward runs the units in the reverse order of their forwards' ENDS: the root (whose
        # forward ends last) first, then the last block... (a unit called twice: its last call)
        self._bwd_order = self._dedupe(self._done_order[::-1])
        if bad:
            for u in self.units:
                u.release("forward")
            raise RuntimeError(f"ZeRO3: ranks ran different code paths: unit(s) {', '.join(bad)} "
                               f"ran a different number of times on different ranks in this forward "
                               f"(this rank: {[self._fwd_counts[u.index] for u in self.units]}). "
                               "Every rank must call every unit the same number of times.")

    # Which autograd pass is a backward is known only when autograd first adds a gradient to a
    # parameter's .grad (Engine._param_grad), after the first units are gathered for it. Until then
    # the units a pass gathers stay gathered (a tentative hold); the backward's beginning lifts
    # the hold. A pass that ends without one keeps it: torch.autograd.grad(out.sum(), x,
    # create_graph=True), a gradient penalty's first half, is not a backward of the model, but its
    # graph holds the gathered weights it went through, and the backward to come reads them there.
    # Every unit then stays gathered until that backward ends (_finish_backward), or until the next
    # forward (which gathers and releases each unit as usual: a penalty is taken on the forward it
    # belongs to). torch.autograd.grad(loss, model.parameters()) is the same kind of pass.
    _hold_tentative = False

    def _pass_opened(self):
        if not self._held_for_graph:
            self._held_for_graph = self._hold_tentative = True

    def _begin_backward(self, synced, queue=True):
        super()._begin_backward(synced, queue)
        if self._hold_tentative:        # a backward after all: units are released as it goes
            self._held_for_graph = self._hold_tentative = False

    def _pass_closed(self, was_backward):
        self._hold_tentative = False    # (no backward began: the hold stays, for the graph)

    def _pre_backward(self, u):
        if not self._in_backward:
            self._open_pass(self.life.sync)     # (the root's output: before the engine's hook)
        if u.reduced:
            return
        if not u.in_backward:
            u.move_grads(GradState.IN_BACKWARD)
            u.gather("backward")
            self._prefetch_after(self._bwd_order, u, "backward")
            self._use(u, "backward")

    def _on_grad_accumulated(self, p):
        u = self.param_unit[id(p)]
        u.accumulate(p, p._zero3_pos)
        p.grad = None                    # the full gradient lives in the unit's flat buffer
        self._maybe_done(u)

    def _on_inputs_grad(self, u):
        u.input_hooks_in += 1
        self._maybe_done(u)

    def _maybe_done(self, u):
        # A trainable parameter's backward is over when its gradient is accumulated; a frozen
        # one's has no such sign, only the gradient of the unit's inputs comes after it. A unit
        # with frozen parameters and no input that needs a gradient (the root, under a frozen
        # embedding) stays gathered until the end of backward (_finish_backward).
        if "frozen" in u.buckets and u.input_hooks_out == 0:
            return
        if u.n_acc == u.n_train and u.input_hooks_in >= u.input_hooks_out and u.in_backward:
            self._post_backward(u)

    def _post_backward(self, u):
        """The unit's backward is over: reduce-scatter its gradient, free its parameters."""
        if u.reduced:
            return
        u.move_grads(GradState.REDUCING)
        if "train" in u.buckets and self.bitwise:     # a chunk: into the unit's tree (zero3.chunks)
            self._add_unit_chunk(u)
        elif "train" in u.buckets:
            u.reduce_scatter()
            self._reducing.append(u)
        if not self._held_for_graph:
            u.release("backward")
        # at most two full unit gradients in flight: the older ones have had a whole unit's
        # backward to finish, so waiting for them here costs (almost) nothing and frees them
        while len(self._reducing) > 1:
            self._reducing.pop(0).finish_reduce()

    def _finish_backward(self):
        """End of autograd's work: reduce units whose gradients never all arrived, in order."""
        for u in self.units:
            if u.in_backward and not u.reduced:
                self._post_backward(u)
        for u in self.units:            # nothing stays gathered past backward: the step changes it
            u.release("backward")
        self._held_for_graph = False
        # which parameters got a gradient on ANY rank (the others keep no gradient, as in one
        # process) and did every rank reduce the same units?
        flags = []
        for u in self.units:
            flags += [float(i in u.used) for i in range(u.n_train)]
        flags += [float(u.reduced) for u in self.units] + [-float(u.reduced) for u in self.units]
        flags = torch.tensor(flags)
        self.comm.all_reduce(flags, op="max", tag="used")
        n = len(self.units)
        red_hi, red_lo = flags[len(flags) - 2 * n:len(flags) - n], -flags[len(flags) - n:]
        bad = [u.name for u, a, b in zip(self.units, red_hi.tolist(), red_lo.tolist()) if a != b]
        if bad:
            raise RuntimeError(f"ZeRO3: ranks ran different code paths: the backward of unit(s) "
                               f"{', '.join(bad)} ran on some ranks but not on others")
        used = flags[:len(flags) - 2 * n].tolist()
        while self._reducing:
            self._reducing.pop(0).finish_reduce()
        k = 0
        for u in self.units:
            n_train = u.n_train
            unused = {i for i in range(n_train) if used[k + i] == 0.0}
            # over micro-batches, a parameter is unused only if no backward reached it
            if u.unused_positions is not None:
                unused &= set(u.unused_positions)
            u.unused_positions = sorted(unused)
            k += n_train
            if u.reduced:
                u.move_grads(GradState.REDUCED)     # (a unit no backward reached stays WAITING)
        if self.bitwise:
            self._end_chunk()
