"""An engine's training state, as one object: where the engine is, and every misuse it refuses.

A PyTorch user drives an engine through calls it does not see coming: the model's forward,
loss.backward(), optimizer.step(), optimizer.zero_grad() or model.zero_grad(), no_sync(). Each
call is a transition of one small state machine (FSDP2 keeps the same kind of state in its
TrainingState), and the transitions, not scattered flags, decide what each call may do:

    IDLE --backward began--> IN_BACKWARD --backward ended--> REDUCED      (averaged: step may run)
                                                        \\--> ACCUMULATED  (inside no_sync: not yet)
    REDUCED --step began--> STEPPING --step ended--> STEPPED   (the gradients stay until zero_grad,
                                                                as in PyTorch)
    any --zeroed--> IDLE              a backward may begin again from any state but IN_BACKWARD

and beside the phase, what the transitions remember: whether the script is inside no_sync()
(`sync`), inside engine.backward (`scaling`: fp16 scaled the loss), whether a reducing backward
ran since zero_grad (`reduced`), whether fp16 gradients came from a bare loss.backward()
(`unscaled`), whether p.grad holds a sharded engine's pieces (`guarded`), whether the
optimizer's tensors hold the engine's gradients (`exposed`), PyTorch DDP's buffer rule
(`buffers_next`), a clip asked for the next step (`clip_next`) and the step under way
(`open_step`: an OpenStep, from the optimizer's step pre-hook to its post-hook).

The engine (engines.base.Engine) calls a transition at each of those moments and does the work
(reducing, handing out the pieces, stepping); this object owns the decisions and the errors, and
nothing else writes its fields.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from enum import Enum


class Phase(Enum):
    IDLE = "idle: no gradient held"
    IN_BACKWARD = "in backward: gradients are arriving"
    REDUCED = "reduced: the gradients are averaged and a step may run"
    ACCUMULATED = "accumulated inside no_sync(): not averaged yet"
    STEPPING = "stepping: inside optimizer.step()"
    STEPPED = "stepped: the gradients were applied"


@dataclass
class OpenStep:
    """A step under way, from the optimizer's step pre-hook to its post-hook."""
    applied: bool = False       # were the gradients finite, so the update runs? (fp16 may skip)
    peak: object = None         # the step's peak-memory meter (track_peak=True)
    foreach_groups: list = field(default_factory=list)   # groups whose foreach this step set


class Lifecycle:
    """One engine's training state (see the module docstring).

    engine: the engine's name, for messages; world_size: its data-parallel group's size;
    accumulates_after_reduce: may a reducing backward add to gradients already reduced (ZeRO-1:
    no); reduces_in_no_sync: does every backward reduce (ZeRO-2 and 3); loss_scaling: fp16."""

    def __init__(self, engine: str, world_size: int, *, accumulates_after_reduce=True,
                 reduces_in_no_sync=False, loss_scaling=False):
        self.engine, self.world_size = engine, world_size
        self.accumulates_after_reduce = accumulates_after_reduce
        self.reduces_in_no_sync = reduces_in_no_sync
        self.loss_scaling = loss_scaling
        self._phase = Phase.IDLE
        self.in_backward = False        # phase is IN_BACKWARD (read in every gradient hook: a plain attribute)
        self._before = Phase.IDLE       # the phase a backward in progress began from
        self.sync = True                # outside no_sync() (require_backward_grad_sync)
        self.scaling = False            # inside engine.backward(loss)
        self.began = False              # a backward began since engine.backward() was called
        self.reducing = True            # does the backward in progress (or the last) reduce?
        self.reduced = False            # a reducing backward ran since zero_grad
        self.unscaled = False           # fp16: a backward ran without engine.backward since zero_grad
        self.guarded = False            # p.grad holds pieces (sharded engines, after a reducing backward)
        self.exposed = False            # the optimizer's tensors hold the engine's gradients (fp32)
        self.buffers_next = True        # broadcast rank 0's buffers at the next forward
        self.clip_next = None           # max_norm of a clip_grad_norm_() call, for the next step
        self.open_step = None           # the OpenStep under way
        self.last_applied = False       # did the last step apply its update?

    @property
    def phase(self) -> Phase:
        return self._phase

    @phase.setter
    def phase(self, value: Phase) -> None:
        self._phase = value
        self.in_backward = value is Phase.IN_BACKWARD

    @property
    def backward_done(self) -> bool:
        """A backward ended since the last step or zero_grad."""
        return self.phase in (Phase.REDUCED, Phase.ACCUMULATED)

    # -------------------------------------------------------------- forward
    def forward(self, training: bool) -> tuple[bool, bool]:
        """A forward begins: (broadcast rank 0's buffers now?, is this forward synced?). PyTorch
        DDP's rule: buffers are synced at the forward that FOLLOWS a synced training forward, so
        the first eval forward after training sees rank 0's statistics; and the forward decides
        whether its backward syncs. A backward that never ended (it raised) is over now."""
        sync_buffers = self.buffers_next
        self.buffers_next = training and self.sync
        if training and self.phase is Phase.IN_BACKWARD:
            self.phase = self._before
        return sync_buffers, self.sync

    # -------------------------------------------------------------- what the script switches
    def set_sync(self, value: bool) -> None:
        """no_sync() and require_backward_grad_sync: does the next forward's backward reduce?"""
        self.sync = bool(value)

    @contextlib.contextmanager
    def engine_backward(self):
        """engine.backward(loss): the loss was scaled (fp16). After it, `began` says whether a
        backward began (a gradient hook fired); if not, the engine still takes part in the ranks'
        collectives. A backward that raised before is over."""
        self.began = False
        self.forward(True)
        self.scaling = True
        try:
            yield
        finally:
            self.scaling = False

    # -------------------------------------------------------------- backward
    def backward_began(self, synced: bool) -> None:
        """The first parameter gradient of a backward is about to arrive: refuse a backward its
        gradients cannot take, before any of them is touched."""
        reducing = (synced and self.sync) or self.reduces_in_no_sync
        if reducing and self.reduced and not self.accumulates_after_reduce:
            raise RuntimeError(
                f"a second backward on gradients that {self.engine} already reduced, with no "
                "zero_grad() in between: its reduction cannot add a new backward to them. Call "
                "zero_grad() (engine.optimizer.zero_grad(), model.zero_grad()) after each step; to "
                "accumulate over micro-batches, run all but the last backward inside "
                "`with engine.no_sync():`.")
        if self.loss_scaling and not self.scaling:
            self.unscaled = True
        self.reducing = reducing
        self._before = self.phase
        self.phase = Phase.IN_BACKWARD
        self.began = True
        self.exposed = False

    def backward_ended(self) -> None:
        self.reduced = self.reduced or self.reducing
        self.phase = Phase.REDUCED if self.reducing or self.world_size == 1 else Phase.ACCUMULATED

    # -------------------------------------------------------------- step
    def check_step(self, has_optimizer: bool, grad_scaler: bool, precision: str,
                   sharded: bool = False, bitwise: bool = False) -> None:
        """Refuse a step whose gradients are not what it should apply."""
        if not has_optimizer:
            raise RuntimeError(
                f"{self.engine} was built without an optimizer, as DistributedDataParallel is: "
                "step your own (built on engine.parameters()) after loss.backward(); the gradients "
                "in p.grad are already averaged over ranks.")
        if grad_scaler and bitwise:
            raise RuntimeError(
                f"torch.amp.GradScaler on {self.engine} with bitwise=True: the gradients exist only as "
                "the chunks' sum, made at the step, so the scaler finds none to unscale or check, and "
                "the update would apply the scaled gradients. Drop the GradScaler: bitwise=True trains "
                "in fp32 or bf16, which need no loss scaling.")
        if grad_scaler and precision == "fp32":
            raise RuntimeError(
                f"torch.amp.GradScaler on {self.engine}: each rank holds only its slice of the "
                "averaged gradient, so each rank's scaler would look for an overflow in a different "
                "slice, and the ranks would disagree on skipping a step (one updates and gathers, the "
                "other waits). Drop the GradScaler and use precision='fp16' with engine.backward(loss): "
                "the engine scales the loss and every rank agrees on each skip. (zl.DDP, whose "
                "gradients are whole on every rank, takes a GradScaler.)")
        if grad_scaler:
            raise RuntimeError(
                f"torch.amp.GradScaler with precision={precision!r}: the engine keeps fp32 master "
                "weights and, in fp16, scales the loss itself. Drop the GradScaler and use "
                "precision='fp16' with engine.backward(loss) (or precision='bf16', which needs no "
                "scaling); a GradScaler fits precision='fp32' under your own autocast.")
        if not self.backward_done:
            raise RuntimeError("step() called before backward(): there is no gradient to apply. "
                               "Call loss.backward() (or engine.backward(loss)) first, on every rank.")
        if self.unscaled:
            raise RuntimeError(
                "precision='fp16' needs engine.backward(loss): it multiplies the loss by the loss "
                "scale before backward, and a bare loss.backward() skipped that (its small gradients "
                "may have flushed to zero, and step() would divide by a scale never applied). "
                "Call engine.zero_grad(), then use engine.backward(loss); or build the engine with "
                "scaler=False to train fp16 without loss scaling.")
        if self.phase is Phase.ACCUMULATED:
            raise RuntimeError(
                "step() after a backward inside no_sync(): those gradients were never averaged over "
                "ranks. Run the last micro-batch's forward and backward outside no_sync().")

    def step_began(self) -> OpenStep:
        """The optimizer's step pre-hook accepted the step (check_step): it is under way."""
        self._before_step, self.phase = self.phase, Phase.STEPPING
        self.open_step = OpenStep()
        return self.open_step

    def step_ended(self) -> OpenStep | None:
        """The step's scope closes (its post-hook, or a step that raised inside the optimizer,
        found open by the next one): the OpenStep, for the engine to close its meters."""
        scope, self.open_step = self.open_step, None
        if scope is not None:
            self.last_applied = scope.applied
        if self.phase is Phase.STEPPING:    # (stepped() follows, unless the step raised)
            self.phase = self._before_step
        return scope

    def stepped(self) -> None:
        self.phase = Phase.STEPPED      # (reduced stays until zero_grad: see backward_began)

    def clip_at_next_step(self, max_norm: float) -> None:
        """engine.clip_grad_norm_(max_norm): the next step clips to it."""
        self.clip_next = float(max_norm)

    def take_clip(self, default):
        """The step's max_norm: a clip asked for since the last step, else `default`."""
        max_norm, self.clip_next = self.clip_next or default, None
        return max_norm

    # -------------------------------------------------------------- the optimizer's gradients
    def grads_exposed(self) -> None:
        """The optimizer's tensors hold the engine's averaged gradients (fp32, after backward)."""
        self.exposed = True

    def grads_dropped(self) -> None:
        self.exposed = False

    # -------------------------------------------------------------- zero_grad and the pieces in p.grad
    def zeroed(self) -> None:
        self.phase = Phase.IDLE
        self.reduced = self.unscaled = self.guarded = self.exposed = False

    def pieces_handed(self) -> None:
        """A sharded engine's backward put this rank's pieces in p.grad (engines.grad_guard)."""
        self.guarded = True

    def pieces_taken_back(self) -> None:
        self.guarded = False

    def guards_left(self, kept: int, total: int, stage) -> str:
        """A backward begins while p.grad holds the pieces: "zeroed" if the script removed them all
        (model.zero_grad(), p.grad = None: it zeroed the gradients), "kept" if it removed none
        (the gradients accumulate); some but not all is refused."""
        if kept == 0:
            return "zeroed"
        if kept < total:
            raise RuntimeError(
                f"p.grad was set to None for some parameters but not others since the last backward: "
                f"under ZeRO-{stage} the gradients live in the engine, sharded, so they can only be "
                "zeroed all together: call zero_grad() (engine.optimizer.zero_grad() or "
                "model.zero_grad()).")
        return "kept"

    def __repr__(self):
        return (f"Lifecycle({self.phase.name}, sync={self.sync}, reduced={self.reduced}, "
                f"guarded={self.guarded})")
