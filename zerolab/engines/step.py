"""The step, written once for every engine: optimizer.step() with the engine's parts around it.

A mixin of engines.base.Engine. A step is optimizer.step(), whoever calls it (engine.step() does
too): PyTorch's step hooks, registered by optim.param_groups.hand_over, run

    _before_update   refuse gradients it should not apply (none, fp16 unscaled, never averaged,
                     a torch.amp.GradScaler on fp32 masters), start measuring the step's peak
                     (track_peak=True), then _prepare_update: the fp32 gradients of what the
                     optimizer updates (_step_grads), one finite check (_grads_finite), clipping,
                     and each tensor the optimizer holds gets its gradient (_hand_grads);
    (the optimizer's own update: the tensors that were handed a gradient)
    _after_update    the compute copies catch up with the masters (_land_update -> _publish: a
                     cast, an all-gather...), the step's gradients go, the loss scale moves on.

A parameter no rank's backward reached keeps no gradient, so the optimizer skips it, as it does
in one process. The defaults suit one master per parameter (SingleProcess, NaiveDDP: in fp32
the masters ARE the parameters); the flat engines hand the optimizer per-parameter views of
their flat masters (optim.param_views) and redefine _step_grads, _publish and the gradient
pieces. ZeRO-3 and offload change _start_step, _hand_grads and _land_update.
"""

from __future__ import annotations

import torch

from ..precision import clip_grad_norm_
from ..optim import param_groups
from ..optim.param_views import gather_bytes, use_foreach
from ..optim.zero_grad_watch import ZeroGradWatch


class Step:
    """optimizer.step()'s engine parts (see the module docstring)."""

    # -------------------------------------------------------------- the optimizer
    def _place_groups(self) -> None:
        """Move the optimizer's groups onto what this engine updates: here one master per
        parameter (the flat engines: one view per parameter, optim.param_views)."""
        param_groups.place_per_parameter(self.optimizer, self.params, self.masters)

    def gather_bytes(self, data: bytes) -> list:
        """Every rank's `data`, in rank order, over the ranks whose shards make up the whole (a
        collective, through the ledger): how the optimizer's state dict is put together."""
        from ..launch import device
        return gather_bytes(self.comm, self.norm_group, device())(data)

    def adopt(self, optimizer) -> None:
        """FSDP2's order: the optimizer the script built over engine.parameters() after wrapping
        becomes the engine's at its first step (param_groups.await_optimizer), exactly as if it
        had been passed in: checked, its groups moved onto the engine's tensors, handed over."""
        self.optimizer, state = param_groups.build(optimizer, self.model)
        self._take_over(state)

    _watch = None               # the script's optimizer.zero_grad(), seen (optim.zero_grad_watch)
    _groups = 0                 # how many parameter groups the optimizer was handed over with

    def _take_over(self, state=None) -> None:
        """The script's optimizer, built: its groups moved onto the engine's tensors, its step
        hooked (optim.param_groups.hand_over), its zero_grad() watched."""
        if self.bitwise:    # elementwise updates, single-tensor kernels (engines.options.BITWISE)
            from ..bitwise.buckets import check_elementwise_optimizer
            check_elementwise_optimizer(self.optimizer)
        self._place_groups()
        param_groups.hand_over(self.optimizer, self, state)
        self._groups = len(self.optimizer.param_groups)
        self._watch = ZeroGradWatch(self.optimizer, self.model.parameters())

    def _zero_grad_seen(self, disarm: bool = True) -> None:
        """Before a forward, a backward, a step or a memory report: if the script's
        optimizer.zero_grad() ran since the engine last looked, the gradients were zeroed: drop the
        engine's, as engine.zero_grad() does. A backward or a step also takes the marks back."""
        if self._watch is None:
            return
        if self._watch.disarm() if disarm else self._watch.seen():
            self.zero_grad()

    def _watch_zero_grad(self, marks: bool, make=None) -> None:
        if self._watch is not None:
            self._watch.arm(marks, make)

    # -------------------------------------------------------------- the step
    # optimizer.step() is the step, whoever calls it (engine.step() calls it too): PyTorch's step
    # hooks (param_groups.hand_over) run _before_update, then the optimizer's own update of the
    # tensors that were handed a gradient, then _after_update.
    views = None                # flat engines: optim.param_views.ParamViews (what the optimizer steps)

    def step(self) -> bool:
        """Unscale, check, clip, update. False (and nothing changed) when an fp16 overflow skips it."""
        if self.optimizer is None:
            self._check_step(None)      # (says what to do instead)
        self.optimizer.step()
        return self.life.last_applied

    def _before_update(self, optimizer=None) -> None:
        """Before the optimizer's own update: refuse gradients it should not apply, then unscale,
        check, clip and hand each tensor the optimizer holds its gradient (_prepare_update)."""
        self._close_step()              # (a step that raised inside the optimizer left it open)
        marked = self._watch is not None and self._watch.marks
        make = self._watch.make if self._watch is not None else None
        self._zero_grad_seen()
        try:
            param_groups.check_no_new_group(self.optimizer, self._groups)
            self._check_step(optimizer)
        except BaseException:           # refused: nothing changed, the watch goes on
            self._watch_zero_grad(marked, make)
            raise
        scope = self.life.step_began()
        if self.track_peak:
            scope.peak = self.peak_meter("cpu")
            scope.peak.__enter__()
        if self.views is not None:      # one foreach call per operation, not one per parameter
            scope.foreach_groups = use_foreach(self.optimizer)
        try:
            self._start_step()
            with torch.no_grad():
                scope.applied = self._prepare_update()
        except BaseException:
            self._close_step()
            raise

    def _after_update(self) -> None:
        """After the optimizer's own update: the compute copies catch up (_land_update: a cast, an
        all-gather), the step's gradients go, the loss scale moves on."""
        scope = self.life.open_step
        try:
            with torch.no_grad():
                if scope is not None and scope.applied:
                    self._land_update()
                    self.precision.update(found_inf=False)
                self._drop_step_grads()
        finally:
            self._close_step()
        self.steps += 1
        self.life.stepped()
        self._watch_zero_grad(marks=True)

    def _close_step(self) -> None:
        """The end of a step's scope: the peak meter read, the groups' foreach as the script left it."""
        scope = self.life.step_ended()
        if scope is None:
            return
        for group in scope.foreach_groups:
            group["foreach"] = None
        if scope.peak is not None:
            scope.peak.__exit__(None, None, None)
            self.last_peak = scope.peak.peak

    def _check_step(self, optimizer) -> None:
        """Refuse a step whose gradients are not what it should apply (engines.lifecycle)."""
        self.life.check_step(self.optimizer is not None, getattr(optimizer, "found_inf", None) is not None,
                             self.precision.name, self.sharded, self.bitwise)

    def _start_step(self) -> None:
        """The first thing a step does once it is accepted (ZeRO-3 releases gathered units;
        offload lands the update still in flight)."""

    def _prepare_update(self) -> bool:
        """The step's fp32 gradients, one finite check, clipping, then each tensor the optimizer
        updates gets its gradient (_hand_grads). False: an fp16 overflow, nothing is handed."""
        grads = self._step_grads()
        if not self._grads_finite(grads):    # fp16 overflow: nothing changes, the scale drops
            self._drop_step_grads()
            try:
                self.precision.update(found_inf=True, step=self.steps)
            except FloatingPointError as gave_up:
                raise FloatingPointError(f"{gave_up} {self._diagnose()}") from None
            return False
        max_norm = self.life.take_clip(self.max_grad_norm)
        if max_norm is not None:
            self._clip(grads, max_norm)
        self._hand_grads()
        return True

    def _clip(self, grads, max_norm) -> None:
        """Scale the step's gradients so that the whole gradient's norm is at most max_norm
        (sharded engines hold disjoint slices: their squared norms are summed over ranks).
        bitwise=True: the exact squared norm (zerolab.bitwise.norm), whatever the layout."""
        if self.bitwise:
            from ..bitwise.norm import clip_coefficient, exact_sum_of_squares
            sumsq = exact_sum_of_squares(grads, self.comm, self.sharded)
            coefficient = clip_coefficient(sumsq, max_norm)
            for g in grads:
                g.mul_(coefficient)
            self.last_grad_norm = float(sumsq.sqrt())
            return
        self.last_grad_norm = clip_grad_norm_(grads, max_norm, self.comm if self.sharded else None,
                                              group=self.norm_group)

    def _hand_grads(self) -> None:
        """Give each tensor the optimizer holds the gradient it steps with. One master per
        parameter: done by _step_grads (a parameter no backward reached keeps None, so the
        optimizer skips it). Flat engines: each view gets its range of the flat gradient, except
        a parameter no rank reached (_unused_params). offload's delay_update and offload="disk"
        run the update here themselves (run_update) and hand nothing to the optimizer's own."""
        if self.views is not None and not self.life.exposed:
            self.views.point_grads(self._unused_params())
        self._gather_whole_matrices()

    def _unused_params(self) -> set:
        """ids of the trained parameters no rank's backward reached since zero_grad()."""
        return set()

    def _land_update(self) -> None:
        """After an applied update: the compute copies catch up with the masters."""
        self._return_whole_matrices()
        self._publish()

    # Whole-matrix optimizers (Muon, Adafactor: optim.whole_matrix): a parameter a shard's edge
    # cuts is stepped whole by one rank; its pieces travel to it before the update and back after.
    def _gather_whole_matrices(self) -> None:
        whole = self.views.whole if self.views is not None else None
        if whole is not None:
            if getattr(self, "offload", None):
                raise TypeError(f"offload={self.offload!r} with a whole-matrix optimizer (Muon, "
                                "Adafactor): the matrices a shard's edge cuts are put together on the "
                                "device, outside the offloaded update. Use offload=None, or an "
                                "elementwise optimizer.")
            whole.gather(self.comm, self.norm_group, self._unused_params())

    def _return_whole_matrices(self) -> None:
        if self.views is not None and self.views.whole is not None:
            self.views.whole.give_back(self.comm, self.norm_group)

    # The defaults below are for one master per parameter (SingleProcess, NaiveDDP): in fp32
    # the masters ARE the parameters; in bf16/fp16 they are fp32 copies. The flat engines
    # (DDP, ZeRO) override them.
    def _step_grads(self) -> list:
        """Give each tensor the optimizer updates its fp32 gradient; return those gradients."""
        if self.masters is not self.params:
            # cast: fp32 copies of the low-precision gradients, short-lived, on the masters
            for p, m in zip(self.params, self.masters):
                m.grad = None if p.grad is None else p.grad.float()
        return [m.grad for m in self.masters if m.grad is not None]

    def _grads_finite(self, grads) -> bool:
        """The one finite check. fp16: unscale, and every rank agrees (zerolab.precision).
        fp32/bf16: there is no scale to lower, so a non-finite gradient is an error."""
        if self.precision.scaler is not None:
            return self.precision.unscale_and_check(grads)
        # one sum per tensor finds it (inf and nan survive a sum) at a fraction of the cost
        # of isfinite over every element
        sums = [s.float() for s in self._grad_sums(grads)]
        if sums and not bool(torch.isfinite(torch.stack(sums).sum())):
            where = f" on rank {self.rank}" if getattr(self, "world_size", 1) > 1 else ""
            raise FloatingPointError(
                f"non-finite gradients at step {self.steps}{where} in {self.precision.name} training "
                "(there is no loss scale to lower): find the first module that makes inf or nan with "
                "zl.debug.first_nonfinite(model, batch), or lower the learning rate.")
        return True

    def _diagnose(self) -> str:
        """fp16 gave up: re-run the last training batch with a hook on every module and name the
        first one whose output is not finite (zerolab.runtime.debug). Every rank gets here at the same
        step (the overflow verdict is all-reduced), so ZeRO-3's gathering forward is safe."""
        if self._last_batch is None:
            return ""
        from ..runtime.debug import first_nonfinite
        args, kwargs = self._last_batch
        self._last_batch = None
        found = first_nonfinite(self.model, *args, **kwargs)
        if found is None:
            return ("The last batch's forward is finite on this rank, so the overflow is in the "
                    "backward: look at the loss's scale and at the gradients of the last layers.")
        return f"In the last batch's forward on this rank, {found}."

    def _grad_sums(self, grads) -> list:
        return [g.sum() for g in grads if g is not None]

    def _publish(self) -> None:
        """After the update: make the compute copies (what forward uses) match the masters."""
        if self.masters is not self.params:
            for p, m in zip(self.params, self.masters):
                p.data.copy_(m)     # the compute copy is the cast of the authoritative master

    def _drop_step_grads(self) -> None:
        """Free the fp32 gradients _step_grads gave the masters (and the views' ranges of them)."""
        self.life.grads_dropped()
        self._clear_placeholders()      # (bitwise: the step made the gradients)
        if self.views is not None:
            self.views.drop_grads()
        if self.masters is not self.params:
            for m in self.masters:
                m.grad = None

    # -------------------------------------------------------------- gradients for the optimizer
    def _expose_grads(self) -> None:
        """fp32 flat engines, after a reducing backward: each of the optimizer's views already
        holds its averaged gradient (a view of the engine's, no copy), as each parameter's .grad
        holds it after PyTorch DDP's backward: so what reads the optimizer's gradients between
        backward and step (torch.amp.GradScaler's unscale_ under autocast, a script's own
        inspection) sees them. (bf16 / fp16 masters get fp32 gradients only inside the step.)"""
        for m, g in zip(self._flat_masters(), self.owned_grads()):
            m.grad = g
        self.views.point_grads(self._unused_params())
        self.life.grads_exposed()       # (the step then finds them in place: _hand_grads)

    def _flat_masters(self) -> list:
        """The tensors the views are cut from, in the order of owned_grads()."""
        return self.masters
