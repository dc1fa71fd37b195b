"""What every engine does the same way, written once.

An engine wraps a model and an optimizer factory; what differs between SingleProcess, NaiveDDP,
DDP, ZeRO-1, ZeRO-2 and ZeRO-3 is where the gradients, masters and optimizer state live and
when they travel. What does not differ lives here:

* calling the engine casts floating inputs to the compute dtype, then runs the forward;
* backward(loss) guards against misuse, divides the loss by N (the one place it is divided:
  gloo has no average, so the sum the collectives compute is then the mean), scales it in
  fp16 and hands it to the engine's `_backward`, which runs autograd and the reduction;
* step() refuses to run before a backward, measures the step's peak memory and runs ONE
  template (`_step`): the fp32 gradients of what the optimizer updates (`_step_grads`), one
  finite check (`_grads_finite`), clipping, then the update (`_update`): the optimizer inside
  `held_still` (parameters no rank reached do not move, `_unreached`), then the updated masters
  are published to the compute copies (`_publish`: a cast, an all-gather, ...);
* zero_grad() drops the gradients (`_release_grads`) and resets the guards;
* what PyTorch's wrappers offer: module, parameters(), named_parameters(), train(), eval(),
  state_dict() / load_state_dict() (consolidated, the model's own keys), clip_grad_norm_(max)
  (the norm over every rank's shard, applied by the next step) and gathered_parameters()
  (ZeRO-3 gathers the full weights inside it; the other engines always hold them);
* full_state_dict() consolidates: the engine says where the full fp32 value of each trained
  parameter is (`_full_values`, which may gather shards), and every key of model.state_dict()
  gets an fp32 CPU copy, tied weights one tensor under both keys;
* memory_report() measures: the engine lists the tensors it holds (`_memory_tensors`), and
  live storage is counted once each;
* zerolab.checkpoint asks the engine, never its internals, what to write and read: its name
  (`checkpoint_kind`), the pieces of parameters this rank holds (`checkpoint_segments`) and how
  to rebuild the compute copy after a load (`refresh_compute`).

A subclass sets, in its __init__: model, precision, world_size, comm, max_grad_norm, steps,
track_peak, last_peak, last_activations, last_grad_norm, optimizer (engines.setup does most
of it), params and masters. The defaults suit one fp32 master per parameter; the flat
engines redefine _step_grads, _publish, _release_grads, _full_values and _memory_tensors.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.utils._pytree import tree_map

from ..buckets import held_still
from ..memory import PeakMemory, live_bytes, optimizer_tensors
from ..precision import clip_grad_norm_
from . import grad_guard
from .setup import check_max_grad_norm, measured_forward


def flat_segments(tensor, bucket, shard, names) -> list:
    """Checkpoint segments of `tensor`, which holds slice `shard` of the flat padded `bucket`
    (zerolab.buckets.Bucket): one (tensor, offset in it, parameter name, lo, hi) per parameter
    that overlaps the slice, elements [lo, hi) of that parameter flattened."""
    out = []
    for p, o, n in zip(bucket.params, bucket.offsets, bucket.sizes):
        lo, hi = max(o, shard.start), min(o + n, shard.stop)
        if lo < hi:
            out.append((tensor, lo - shard.start, names[id(p)], lo - o, hi - o))
    return out


class Engine:
    """The shared part of every zerolab engine (see the module docstring)."""

    peak_meter = PeakMemory     # what step() measures its peak with (ZeRO-3 adds its own counts)
    sharded = False             # does each rank hold only a slice of the gradients and masters?
    # May backward() run again after a synced backward, before step()? Yes where the reduced
    # gradients accumulate correctly (one process; ZeRO-2 and 3 add into their shards); no where
    # the reduction averaged the full gradient in place (NaiveDDP, DDP, ZeRO-1): a second
    # backward would add a local gradient to an averaged one.
    accumulates_after_reduce = True
    _sync = True                # False inside no_sync()
    _backward_done = False      # a backward ran since the last step() / zero_grad()
    _reduced = False            # a synced backward reduced the gradients held now (until zero_grad)
    track_activations = False   # measure the activations each forward leaves (engines.setup)
    _clip_next = None           # max_norm of a clip_grad_norm_() call, for the next step
    _group_views = None         # flat engines with several parameter groups: param_groups.GroupViews
    broadcast_buffers = False   # data-parallel engines: True by default (engines.setup)
    norm_group = None           # the group whose shards make up the whole gradient once (None: all)
    _last_batch = None          # fp16: the last training forward's inputs, to diagnose a give-up

    # -------------------------------------------------------------- forward
    def __call__(self, *args, **kwargs):
        """The forward, called as the model is (keywords and nested inputs too: a Hugging Face
        model's input_ids=..., labels=...). Floating tensors are cast to the compute dtype."""
        if self.broadcast_buffers and self._sync and torch.is_grad_enabled():
            # as PyTorch DDP: every rank starts a training forward from rank 0's buffers
            # (BatchNorm's running statistics), which its own batches would otherwise pull apart
            for b in self.model.buffers():
                self.comm.broadcast(b, src=self._src, tag="buffers")
        dtype = self.precision.compute_dtype
        args, kwargs = tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                                else x, (args, kwargs))
        if self.precision.scaler is not None and torch.is_grad_enabled():
            self._last_batch = (args, kwargs)   # a reference, not a copy: the batch is alive anyway
        return self._forward(*args, **kwargs)

    def _forward(self, *args, **kwargs):
        # the model's forward; with track_activations, also the bytes it leaves alive
        return measured_forward(self, *args, **kwargs)

    # -------------------------------------------------------------- what a PyTorch wrapper offers
    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model (as DistributedDataParallel.module)."""
        return self.model

    def parameters(self, recurse: bool = True):
        return self.model.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.model.named_parameters(*args, **kwargs)

    def train(self, mode: bool = True):
        self.model.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # -------------------------------------------------------------- backward
    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() (on loss / N, scaled in fp16); the engine reduces the gradients."""
        if self._reduced and not self.accumulates_after_reduce:
            if self._backward_done:
                raise RuntimeError(
                    "backward() called twice without step() or zero_grad() in between: the "
                    "gradients of the first backward were already averaged over ranks. To "
                    "accumulate over micro-batches, run all but the last backward inside "
                    "`with engine.no_sync():`.")
            raise RuntimeError(
                "backward() after step() without zero_grad(): the gradients of the last step were "
                "averaged over ranks, and adding a new backward to them would count them N times. "
                "Call engine.zero_grad() after each step (or before each forward).")
        if self.world_size > 1:
            # a scalar divide instead of a pass over every gradient (exact when N is a power of 2)
            loss = loss / self.world_size
        trainable = [p for p in self.model.parameters() if p.requires_grad] if self.sharded else []
        grad_guard.unhide(trainable)
        self._backward(self.precision.scale_loss(loss, step=self.steps))
        if self._sync:          # p.grad is not what this rank updates with: guard it
            grad_guard.hide(trainable, f"ZeRO-{getattr(self, 'stage', '?')}")
        self._backward_done = True
        self._reduced = self._reduced or self._sync

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    # -------------------------------------------------------------- the step
    def step(self) -> bool:
        """Unscale, check, clip, update. False (and nothing changed) when an fp16 overflow skips it."""
        if not self._backward_done:
            raise RuntimeError("step() called before backward(): there is no gradient to apply. "
                               "Call engine.backward(loss) first (on every rank).")
        if self.track_peak:
            with self.peak_meter("cpu") as peak:
                applied = self._step()
            self.last_peak = peak.peak
        else:
            applied = self._step()
        self.steps += 1
        self._backward_done = False     # (_reduced stays until zero_grad: see backward)
        return applied

    @torch.no_grad()
    def _step(self) -> bool:
        grads = self._step_grads()
        if not self._grads_finite(grads):    # fp16 overflow: nothing changes, the scale drops
            self._drop_step_grads()
            try:
                self.precision.update(found_inf=True, step=self.steps)
            except FloatingPointError as gave_up:
                raise FloatingPointError(f"{gave_up} {self._diagnose()}") from None
            return False
        max_norm, self._clip_next = self._clip_next or self.max_grad_norm, None
        if max_norm is not None:
            # sharded engines hold disjoint slices: their squared norms are summed over ranks
            self.last_grad_norm = clip_grad_norm_(grads, max_norm, self.comm if self.sharded else None,
                                                  group=self.norm_group)
        self._update(self._held_ranges())   # the optimizer, then the compute copies
        self.precision.update(found_inf=False)
        return True

    def _update(self, held) -> None:
        """Apply the checked, clipped gradients: the optimizer updates the masters, then the
        compute copies catch up (_publish). offload's delay_update overrides it: the optimizer
        runs on a thread during the next forward and backward, and the next step publishes."""
        self._optimizer_step(held)
        self._publish()
        self._drop_step_grads()

    def _optimizer_step(self, held) -> None:
        """optimizer.step() on the masters; the ranges in `held` (_held_ranges) stay as they are."""
        views = self._group_views        # parameter groups on flat tensors (param_groups)
        if views is not None:
            views.point_grads()
        with held_still(self.optimizer, held):
            self.optimizer.step()
        if views is not None:
            views.drop_grads()

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
        first one whose output is not finite (zerolab.debug). Every rank gets here at the same
        step (the overflow verdict is all-reduced), so ZeRO-3's gathering forward is safe."""
        if self._last_batch is None:
            return ""
        from ..debug import first_nonfinite
        args, kwargs = self._last_batch
        self._last_batch = None
        found = first_nonfinite(self.model, *args, **kwargs)
        if found is None:
            return ("The last batch's forward is finite on this rank, so the overflow is in the "
                    "backward: look at the loss's scale and at the gradients of the last layers.")
        return f"In the last batch's forward on this rank, {found}."

    def _grad_sums(self, grads) -> list:
        return [g.sum() for g in grads if g is not None]

    def _unreached(self):
        """(flat tensors, (index, lo, hi) ranges) the optimizer must leave as they are."""
        return [], []

    def _held_ranges(self) -> list:
        """_unreached() as (tensor the optimizer holds, lo, hi)."""
        flats, ranges = self._unreached()
        if self._group_views is not None:
            return self._group_views.ranges(flats, ranges)
        return [(flats[b], lo, hi) for b, lo, hi in ranges]

    def _publish(self) -> None:
        """After the update: make the compute copies (what forward uses) match the masters."""
        if self.masters is not self.params:
            for p, m in zip(self.params, self.masters):
                p.data.copy_(m)     # the compute copy is the cast of the authoritative master

    def _drop_step_grads(self) -> None:
        """Free the fp32 gradients _step_grads gave the masters."""
        if self.masters is not self.params:
            for m in self.masters:
                m.grad = None

    # -------------------------------------------------------------- gradients
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient. zerolab always frees them (set_to_none=False is accepted and
        does the same): the next backward writes fresh ones."""
        self._release_grads()
        self._drop_step_grads()
        grad_guard.unhide(self.model.parameters())
        self._backward_done = self._reduced = False

    def _release_grads(self) -> None:
        self.model.zero_grad(set_to_none=True)

    # -------------------------------------------------------------- state and memory
    def _full_values(self) -> dict:
        """{id(parameter): its full value} for every parameter the optimizer trains."""
        return {id(p): m for p, m in zip(self.params, self.masters)}

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """fp32 tensors on CPU, same keys as model.state_dict(), no padding, tied weights shared.

        With sharded engines every rank must call it (the shards are gathered)."""
        value_of = self._full_values()
        converted: dict = {}   # id -> copy, so a tied weight stays one tensor under both keys
        out = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            if id(t) not in converted:
                src = value_of.get(id(t), t).detach()
                converted[id(t)] = src.float().cpu().clone() if src.is_floating_point() else src.cpu().clone()
            out[key] = converted[id(t)]
        return out

    def _memory_tensors(self) -> tuple[list, list, list]:
        """(parameter tensors, gradient tensors, optimizer tensors) this rank holds now."""
        params = list(self.model.parameters())
        grads = grad_guard.real(p.grad for p in params)
        masters = self.masters if self.masters is not self.params else []
        return params, grads, list(masters) + optimizer_tensors(self.optimizer)

    def memory_report(self) -> dict:
        """MEASURED bytes on this rank: params, grads, optimizer (fp32 masters + moments), total
        (those three), peak (of the last step), activations (left alive by the last forward;
        None where the engine does not track them)."""
        params, grads, optimizer = self._memory_tensors()
        out = {"params": live_bytes(params), "grads": live_bytes(grads, exclude=params),
               "optimizer": live_bytes(optimizer, exclude=params + grads)}
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        out["peak"] = self.last_peak
        out["activations"] = self.last_activations
        return out

    @contextlib.contextmanager
    def gathered_parameters(self):
        """Inside, every parameter of the model holds its full value (ZeRO-3 gathers them; the
        other engines always hold them whole, so here it does nothing)."""
        yield

    def state_dict(self) -> dict:
        """The model's own keys, consolidated fp32 values on CPU (full_state_dict: with sharded
        engines every rank must call it). torch.save it; any nn.Module of the same shape, or
        this engine's load_state_dict, reads it back."""
        return self.full_state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Set every parameter and buffer from a full state dict (the model's keys), wherever
        this rank keeps it: fp32 masters, owned slices, unit shards; then the compute copies.
        Optimizer state is untouched (zerolab.checkpoint saves and restores it too)."""
        mine = self.model.state_dict(keep_vars=True)
        missing, extra = sorted(set(mine) - set(state_dict)), sorted(set(state_dict) - set(mine))
        bad = [k for k in mine if k in state_dict and tuple(state_dict[k].shape) != tuple(mine[k].shape)]
        if missing or extra or bad:
            raise ValueError(f"load_state_dict: the state dict does not fit the model: missing keys {missing}, "
                             f"unexpected keys {extra}, wrong shapes {bad}")
        names = {id(p): n for n, p in self.model.named_parameters()}
        opt, frozen, _, _ = self.checkpoint_segments(names)
        for t, t_lo, name, lo, hi in opt + frozen:
            with self.resident(t):
                t.view(-1)[t_lo:t_lo + hi - lo].copy_(state_dict[name].reshape(-1)[lo:hi])
        self.refresh_compute(lambda flat, p: flat.copy_(state_dict[names[id(p)]].reshape(-1)))
        for name, b in self.model.named_buffers():
            b.copy_(state_dict[name])

    def clip_grad_norm_(self, max_norm) -> float:
        """torch.nn.utils.clip_grad_norm_ for an engine: call it between backward() and step().

        Returns the L2 norm of the whole gradient (every rank's shard, tied weights once,
        unscaled in fp16); the next step() scales the gradients so it is at most max_norm (as
        max_grad_norm= does at every step). Clipping model.parameters() yourself would see only
        this rank's piece, or no gradient at all, in the sharded engines."""
        check_max_grad_norm(max_norm)
        if max_norm is None or not self._backward_done:
            raise (ValueError("clip_grad_norm_: max_norm must be a number > 0") if max_norm is None else
                   RuntimeError("clip_grad_norm_() called before backward(): there is no gradient to clip"))
        sq = torch.zeros(1, dtype=torch.float32)
        for g in self._owned_grads():
            if g is not None:
                sq += g.detach().float().pow(2).sum()
        if self.sharded:
            self.comm.all_reduce(sq, group=self.norm_group, tag="grad_norm")
        self._clip_next = float(max_norm)
        return math.sqrt(sq.item()) / self.precision.scale    # (1 unless fp16 scales the loss)

    def _owned_grads(self) -> list:
        """The gradients this rank holds for the tensors it updates (here: one per parameter)."""
        return [p.grad for p in self.params]

    # -------------------------------------------------------------- what a checkpoint holds
    checkpoint_kind = "single"     # the engine's name in a checkpoint's metadata

    def checkpoint_segments(self, names: dict):
        """(optimizer segments, frozen segments, optimizer replicated?, frozen replicated?).

        A segment (tensor, t_lo, name, lo, hi) says: elements [t_lo, t_lo + hi - lo) of
        tensor.view(-1) are elements [lo, hi) of parameter `name` flattened; `names` maps
        id(parameter) to its name. Optimizer segments are the tensors the optimizer updates (the
        fp32 masters), whose optimizer state is saved beside them. Replicated pieces are held
        whole by every rank, so each rank writes 1/N of them. Here: one master per parameter."""
        opt = [(m, 0, names[id(p)], 0, p.numel()) for p, m in zip(self.params, self.masters)]
        return opt, self._frozen_segments(names), True, True

    def optimizer_segments(self, names: dict):
        """checkpoint_segments, with each optimizer segment on the tensor the optimizer holds
        (with parameter groups on flat tensors: the group's view), where its state is kept."""
        opt, frozen, opt_replicated, frozen_replicated = self.checkpoint_segments(names)
        if self._group_views is not None:
            opt = self._group_views.segments(opt)
        return opt, frozen, opt_replicated, frozen_replicated

    def _frozen_segments(self, names: dict) -> list:
        return [(p, 0, names[id(p)], 0, p.numel()) for p in self.model.parameters() if not p.requires_grad]

    @torch.no_grad()
    def refresh_compute(self, fill) -> None:
        """After a load wrote the masters: make the compute copies (what forward uses) match.
        fill(flat, p) copies parameter p's saved value into the flat tensor."""
        self._publish()

    def resident(self, tensor):
        """A context inside which a segment's tensor is in memory, and after which what was
        written into it (or put in its optimizer state) is kept. Everything is in memory here;
        offload="disk" pages the tensor in and writes it back."""
        return contextlib.nullcontext()

    def checkpoint_files(self) -> dict:
        """{id(tensor): (path, element offset)} of the segment and optimizer-state tensors whose
        latest values are in a file, not in memory (offload="disk"): zerolab.checkpoint links
        those files instead of copying their bytes. Here: none."""
        return {}
