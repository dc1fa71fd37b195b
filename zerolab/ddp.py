"""Data parallelism: every rank holds the whole model and averages gradients with all-reduce.

    engine = zl.DDP(model, partial(torch.optim.AdamW, lr=3e-4), precision="bf16", bucket_mb=25)
    logits, loss = zl.models.gpt_loss(engine, batch)    # this rank's share of the global batch
    engine.backward(loss)                               # gradients are averaged over ranks here
    engine.step()                                       # every rank takes the same step

Two versions, so chapter 5 can compare them:

* NaiveDDP: after backward, one blocking all-reduce per parameter. Simple, and slow: many
  small messages, and the network sits idle during the whole backward.
* DDP: gradients land in flat bucket buffers (zerolab.buckets: p.grad is a view into
  bucket.grad). Buckets follow the reverse forward order, so the first one fills first; as
  soon as a bucket's last gradient is accumulated (a post-accumulate-grad hook) it is
  all-reduced asynchronously while backward continues. An end-of-backward callback
  launches any bucket still waiting (parameters the backward never reached) and waits for
  them all. Buckets are always launched in index order, so every rank issues the same
  collectives in the same order and nothing can deadlock.

  Three choices keep the work per step small (on a CPU, where every operation costs time
  on the same cores, they make zl.DDP faster than PyTorch's C++ DDP):
  - backward() divides the LOSS by N (gloo has no average, and a scalar divide replaces a
    pass over every bucket; the all-reduce's sum is then the mean);
  - zero_grad() sets every p.grad to None, so the next backward copies each fresh gradient
    into its slot of the bucket once, instead of zeroing the buckets and adding into them;
  - the optimizer is built on one flat tensor per bucket (the parameters' own buffers, or
    the fp32 masters' in bf16/fp16), as ZeRO's is on its slices: AdamW makes a dozen calls
    per tensor it updates, so 4 buckets instead of 53 parameter tensors (the book's GPT)
    more than halve the optimizer's time. Any elementwise torch.optim optimizer computes
    the same numbers as on the parameters one by one (zerolab.buckets). What it cannot do:
    per-parameter param groups (the factory sees flat tensors), optimizers that look at a
    whole tensor (LAMB's trust ratio; torch.optim's Adafactor and Muon are refused with an
    error, zerolab.single), and a step counter per parameter: for a parameter that only
    SOME steps reach, Adam's bias correction is the bucket's. (One that no rank reached is
    held still, as a single process would skip it.)

Each rank sends 2 (N-1)/N of the gradient bytes per step: the paper's "2 Psi".

Every engine also takes mesh= (data parallelism over mesh.dp_group only, for a model that
is tensor-parallel over mesh.mp_group) and the activation-checkpointing options of ZeRO-R;
see data_parallel_layout and check_residual_options in zerolab.engines.setup.
"""

from __future__ import annotations

import contextlib

import torch

from .buckets import FlatBuckets, bucket_order, held_still, unreached_ranges
from .engines.base import Engine, flat_segments
from .engines.setup import (_check_args, broadcast_from_rank0, check_residual_options, check_same_model,
                            data_parallel_layout, enable_residual, measured_forward)
from .memory import optimizer_tensors
from .precision import MixedPrecision, clip_grad_norm_
from .single import build_optimizer, check_optimizer_factory


# ------------------------------------------------------------------ the engines


class NaiveDDP(Engine):
    """Data parallelism the obvious way: after backward, all-reduce each gradient, one by one."""

    flat_optimizer = None   # the optimizer steps parameter by parameter (DDP, ZeRO: flat buffers)
    checkpoint_kind = "naive_ddp"

    def __init__(self, model: torch.nn.Module, optimizer, *, precision="fp32", max_grad_norm=None,
                 scaler=None, track_peak: bool = True, mesh=None, checkpoint_activations=False,
                 partition_activations=False, offload_activations=False,
                 track_activations=None):
        _check_args(model, 1.0, max_grad_norm)
        check_optimizer_factory(optimizer, precision, self.flat_optimizer)   # before the model is touched
        check_residual_options(model, mesh, precision=precision, max_grad_norm=max_grad_norm,
                               checkpoint_activations=checkpoint_activations,
                               partition_activations=partition_activations,
                               offload_activations=offload_activations,
                               track_activations=track_activations)
        self.mesh = mesh
        self.comm, self.world_size, self.rank, self._src = data_parallel_layout(mesh)
        self.precision = MixedPrecision(precision, scaler=scaler, ledger=self.comm)
        self.checkpointing = enable_residual(model, mesh, checkpoint_activations,
                                             partition_activations, offload_activations)
        # measuring activations costs an allocation tracker around every forward: on by
        # default only where ZeRO-R is in use (a mesh or checkpointing); None in the report otherwise
        self.track_activations = (mesh is not None or checkpoint_activations) \
            if track_activations is None else bool(track_activations)
        self.last_activations = None
        self.model = model
        self.max_grad_norm = max_grad_norm
        self.track_peak = track_peak
        self.steps = 0
        self.last_peak = 0
        self.last_grad_norm = None
        self._sync = True
        self._reduced = False   # gradients of a synced backward are waiting for step()

        check_same_model(model, self.comm, self._src)
        # ranks start identical: rank 0's parameters and buffers (frozen ones too)
        broadcast_from_rank0(list(model.parameters()) + list(model.buffers()), self.comm, self._src)

        self.params = bucket_order(model)
        self._setup_storage()
        self.optimizer = build_optimizer(optimizer, self._optimized_tensors(), precision, self.flat_optimizer)

    # -------------------------------------------------------------- layout (DDP overrides)
    def _setup_storage(self):
        if self.precision.policy.needs_master:
            self.masters = [p.detach().clone().float() for p in self.params]
            self.model.to(self.precision.compute_dtype)
        else:
            self.masters = self.params

    def _optimized_tensors(self) -> list:
        # the parameters (or their fp32 masters) in model.parameters() order, like a single process
        return self.masters[::-1]

    def _reduce_after_backward(self):
        # Which parameters did any rank reach? One no rank reached keeps grad None (the
        # optimizer skips it, as in a single process); the others are reduced by every rank.
        used = torch.tensor([float(p.grad is not None) for p in self.params])
        self.comm.all_reduce(used, op="max", tag="used")
        for p, u in zip(self.params, used.tolist()):
            if u == 0.0:
                continue
            if p.grad is None:  # reached on another rank only: this rank contributes zeros
                p.grad = torch.zeros_like(p)
            self.comm.all_reduce(p.grad, tag="grad")   # a sum of grads/N: the mean

    def _grads_to_masters(self):
        """Put the gradients where the optimizer reads them (fp32: p.grad already is)."""
        if self.masters is self.params:
            return
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()

    def _masters_to_params(self):
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    # -------------------------------------------------------------- forward and backward
    def _forward(self, *inputs):
        return measured_forward(self, *inputs)   # Engine.__call__ cast the inputs

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients over micro-batches without communicating.

        The backward after the block (outside it) reduces the accumulated sum once.
        """
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() (scaled in fp16), then average the gradients over ranks.

        The loss is divided by N first (gloo has no average): every rank's gradients come
        out divided by N, so the sum the collectives compute is the mean. One divide of a
        scalar instead of a pass over every gradient (exact when N is a power of 2).
        """
        if self._reduced:
            raise RuntimeError(
                "backward() called twice without step() or zero_grad() in between: the "
                "gradients of the first backward were already averaged over ranks. To "
                "accumulate over micro-batches, run all but the last backward inside "
                "`with engine.no_sync():`.")
        if self.world_size > 1:
            loss = loss / self.world_size
        self._backward(self.precision.scale_loss(loss, step=self.steps))
        if self._sync:
            self._reduced = True

    def _backward(self, loss):
        self.last_backward = {"start": self.comm.now()}
        loss.backward()
        self.last_backward["compute_end"] = self.comm.now()
        if self._sync:
            self._reduce_after_backward()
        self.last_backward["end"] = self.comm.now()

    # -------------------------------------------------------------- the step
    def step(self) -> bool:
        """Unscale, check, clip, update, refresh. False (nothing changed) on an fp16 overflow."""
        applied = super().step()
        self._reduced = False
        return applied

    @torch.no_grad()
    def _step(self) -> bool:
        mixed = self.precision.policy.needs_master
        self._grads_to_masters()
        grads = self._step_grads()
        # gradients are identical on every rank after the all-reduce, so every rank's verdict
        # is the same; the precision component still agrees through the ledger (fp16)
        ok = self._unscale_and_check(grads)
        if not ok:
            self.precision.update(found_inf=True)
            self._drop_master_grads()
            return False
        if self.max_grad_norm is not None:
            # full (replicated) gradients: the local norm is the global norm, no communication
            self.last_grad_norm = clip_grad_norm_(grads, self.max_grad_norm)
        self._optimizer_step()
        if mixed:
            self._masters_to_params()
        self._drop_master_grads()
        self.precision.update(found_inf=False)
        return True

    def _optimizer_step(self):
        self.optimizer.step()

    def _unscale_and_check(self, grads) -> bool:
        if self.precision.scaler is None:
            # fp32/bf16: nothing to unscale, and a non-finite gradient is an error. One sum per
            # tensor finds it (inf and nan propagate through a sum) at a fraction of the cost
            # of isfinite over every element.
            sums = self._grad_sums(grads)
            if sums and not bool(torch.isfinite(torch.stack(sums).sum())):
                raise FloatingPointError(f"non-finite gradients in {self.precision.name} training")
            return True
        return self.precision.unscale_and_check(grads)

    def _grad_sums(self, grads) -> list:
        return [g.sum() for g in grads]

    def _step_grads(self) -> list:
        """The gradient tensors the step checks, unscales and clips."""
        return [m.grad for m in self.masters if m.grad is not None]

    def _drop_master_grads(self):
        if self.masters is not self.params:
            for m in self.masters:
                m.grad = None

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self._drop_master_grads()
        self._reduced = False

    # -------------------------------------------------------------- state and memory
    def _master_of(self) -> dict:
        return {id(p): m for p, m in zip(self.params, self.masters)}

    def _full_values(self) -> dict:
        return self._master_of()     # Engine.full_state_dict consolidates

    def _master_tensors(self) -> list:
        return self.masters if self.masters is not self.params else []

    def _memory_tensors(self):
        # activations (Engine.memory_report) are None unless track_activations, which is on by
        # default with a mesh or checkpointing
        params = list(self.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        return params, grads, list(self._master_tensors()) + optimizer_tensors(self.optimizer)


class DDP(NaiveDDP):
    """Bucketed data parallelism whose all-reduces overlap the backward pass.

    overlap=False keeps the buckets but launches them all at the end of backward (chapter 5
    uses it to show what overlap buys).
    """

    flat_optimizer = "zl.DDP"   # the optimizer steps on one flat tensor per bucket
    checkpoint_kind = "ddp"

    def __init__(self, model: torch.nn.Module, optimizer, *, precision="fp32", bucket_mb=25.0,
                 max_grad_norm=None, scaler=None, track_peak: bool = True, overlap: bool = True,
                 mesh=None, checkpoint_activations=False, partition_activations=False,
                 offload_activations=False, track_activations=None):
        _check_args(model, bucket_mb, max_grad_norm)
        self.bucket_mb = float(bucket_mb)
        self.overlap = overlap
        super().__init__(model, optimizer, precision=precision, max_grad_norm=max_grad_norm,
                         scaler=scaler, track_peak=track_peak, mesh=mesh,
                         checkpoint_activations=checkpoint_activations,
                         partition_activations=partition_activations,
                         offload_activations=offload_activations,
                         track_activations=track_activations)

    def _setup_storage(self):
        mixed = self.precision.policy.needs_master
        dtype = self.precision.compute_dtype
        # bucket sizes count bytes in the dtype that is communicated (the compute dtype)
        elem = torch.empty((), dtype=dtype).element_size()
        scale = elem / self.params[0].element_size()
        self.buckets = FlatBuckets(self.params, self.bucket_mb * 2**20 / scale, self.world_size)
        if mixed:
            # fp32 masters in the same flat layout, taken from the exact fp32 values
            self.master_flats = [b.flat_copy(torch.float32) for b in self.buckets.buckets]
            self.masters = [v for b, f in zip(self.buckets.buckets, self.master_flats) for v in b.views(f)]
            self.model.to(dtype)
        else:
            self.master_flats = None
            self.masters = None
        self.buckets.bind_params()
        # what the optimizer updates: one flat tensor per bucket (module docstring)
        self.param_flats = self.master_flats if mixed else [b.data for b in self.buckets.buckets]
        self.buckets.bind_grads()
        # The last bucket's buffer carries one extra slot per parameter: "did this rank's
        # backward reach it?". When the last bucket is launched every other bucket has been,
        # so those flags are known, and the same all-reduce tells every rank which parameters
        # NO rank reached (their gradients stay None, as in a single process) for free.
        last = self.buckets.buckets[-1]
        self._tail = torch.zeros(last.padded_numel + len(self.buckets.params), dtype=last.grad.dtype,
                                 device=last.grad.device)
        last.bind_grads(out=self._tail[:last.padded_numel])
        self._flats = [b.grad for b in self.buckets.buckets[:-1]] + [self._tail]   # what is all-reduced
        self._tags = [f"bucket{b}" for b in range(len(self.buckets.buckets))]
        self.params = self.buckets.params     # same order as the masters
        if not mixed:
            self.masters = self.params
        # per parameter: (its bucket, its position k in self.params, its view of the bucket)
        self._slot = {id(p): (b, k, self.buckets.buckets[b].grad_view(i))
                      for k, (p, (b, i)) in enumerate((p, self.buckets.where[p]) for p in self.params)}
        self._sizes = [len(b.params) for b in self.buckets.buckets]
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        self._unused = set()    # positions of params no rank reached in the last backward
        self.last_backward = {}
        self._new_step()
        self.zero_grad()

    def _new_step(self):
        # reached[k]: did any backward of this step (no_sync micro-batches included) reach
        # parameter k? Until it does, its bucket slot holds a stale value, not a gradient.
        self._reached = [False] * len(self.params)
        self._reset_backward_state()

    def _stamp_finished(self):
        # a Handle stamps its end time when waited on; checking in every hook stamps a
        # finished all-reduce within one hook's time of when it really finished (timelines)
        # all-reduces finish in launch order, so look only at the oldest unstamped one(s)
        while self._stamped < len(self._handles) and self._handles[self._stamped].is_completed():
            self._handles[self._stamped].wait()
            self._stamped += 1

    def _reset_backward_state(self):
        self._missing = list(self._sizes)   # per bucket: gradients this backward has not delivered
        self._counted = set()        # ids of params delivered in this backward
        self._next = 0               # the next bucket to launch: always in index order
        self._handles = []
        self._stamped = 0            # handles before this index have their end time
        self._callback_queued = False

    # -------------------------------------------------------------- the reduction
    def _on_grad_ready(self, p):
        # The hot path: it runs once per parameter per backward, so it does as little as it can.
        b, k, view = self._slot[id(p)]
        grad = p.grad
        if grad is not view:
            # The step's first gradient for p: autograd made a fresh tensor (zero_grad set
            # p.grad to None). Copy it into the bucket, over last step's value, and make p.grad
            # the view, so later micro-batches accumulate in the bucket directly.
            view.copy_(grad)
            p.grad = view
        self._reached[k] = True
        if not self._sync:
            return                   # no_sync: the gradient just accumulates in its bucket
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        if id(p) not in self._counted:   # (a hook can fire twice, e.g. reentrant checkpointing)
            self._counted.add(id(p))
            self._missing[b] -= 1
        if self._stamped < len(self._handles):
            self._stamp_finished()
        if self.overlap:
            while self._next < len(self._missing) and self._missing[self._next] == 0:
                self._launch(self._next)

    def _launch(self, b):
        bucket, buf = self.buckets.buckets[b], self._flats[b]
        if self._missing[b]:
            # some parameter of this bucket was not reached by this step on this rank: its
            # slot still holds last step's value, and it contributes zeros
            for p in bucket.params:
                _, k, view = self._slot[id(p)]
                if not self._reached[k]:
                    view.zero_()
        if b == len(self._flats) - 1:   # the last one carries the "reached" flags
            buf[bucket.padded_numel:] = torch.tensor(self._reached, dtype=buf.dtype)
        # the loss was divided by N in backward(): the SUM of the ranks' gradients is the mean
        self._handles.append(self.comm.all_reduce(buf, async_op=True, tag=self._tags[b]))
        self._next = b + 1

    def _finish_backward(self):
        self.last_backward["compute_end"] = self.comm.now()   # autograd has no work left
        # Buckets with a parameter the backward never reached are still waiting: launch them
        # now, in order. Their missing gradients are zeros (or what no_sync accumulated).
        while self._next < len(self.buckets.buckets):
            self._launch(self._next)
        # While the last all-reduces are still in flight, sum each finished bucket: the step's
        # finite check (fp32/bf16) then costs no pass of its own, and this rank idles anyway
        self._bucket_sums = []
        for b, h in enumerate(self._handles):
            h.wait()
            self._bucket_sums.append(self.buckets.buckets[b].grad.sum())
        # A parameter no rank reached keeps no gradient (grad None), as in a single process,
        # and the step holds it still (_optimizer_step); one reached on another rank only
        # gets the averaged gradient in its bucket view.
        self._unused = set()
        if not all(self._reached):
            reached = self._tail[self.buckets.buckets[-1].padded_numel:]   # summed over ranks
            self._unused = set((reached == 0).nonzero().flatten().tolist())
            for k, p in enumerate(self.params):
                if not self._reached[k] and k not in self._unused:
                    p.grad = self._slot[id(p)][2]
        self._new_step()
        self._finished = True
        self.last_backward["end"] = self.comm.now()

    def _backward(self, loss):
        # times on the ledger's clock, for timelines: backward start, end of autograd's
        # work, end of the last all-reduce wait
        self.last_backward = {"start": self.comm.now(), "compute_end": None, "end": None}
        self._finished = False
        loss.backward()
        if self._sync and not self._finished:
            # no trainable parameter was reached at all, so no hook queued the callback
            self._finish_backward()

    # -------------------------------------------------------------- the step on flat buffers
    def _optimized_tensors(self) -> list:
        return self.param_flats

    def _grads_to_masters(self):
        # one flat gradient per bucket; in mixed precision an fp32 copy (.float() is free in fp32)
        for f, b in zip(self.param_flats, self.buckets.buckets):
            f.grad = b.grad.float()

    def _optimizer_step(self):
        # parameters no rank reached must not move, as a single process would skip them
        with held_still(self.optimizer, self.param_flats, unreached_ranges(self.buckets, self._unused)):
            self.optimizer.step()

    def _grad_sums(self, grads) -> list:
        # the bucket sums taken while backward waited for its last all-reduces
        return self._bucket_sums or super()._grad_sums(grads)

    def _step_grads(self) -> list:
        # whole flat buffers: one isfinite / scale / norm per bucket instead of per parameter
        # (their padding and unused slots are zeros, which change neither check nor norm)
        return [f.grad for f in self.param_flats]

    def _masters_to_params(self):
        for b, f in zip(self.buckets.buckets, self.master_flats):
            b.data.copy_(f)  # one cast-and-copy per bucket

    def _drop_master_grads(self):
        for f in self.param_flats:
            f.grad = None
        self._bucket_sums = None

    def zero_grad(self) -> None:
        """Gradients to None (PyTorch's set_to_none): the buckets keep their memory, and the
        next backward copies each first gradient into its slot instead of adding to zeros."""
        self._unused = set()
        for p in self.params:
            p.grad = None
        self._new_step()
        self._drop_master_grads()
        self._reduced = False

    def _master_tensors(self) -> list:
        return self.master_flats or []

    def checkpoint_segments(self, names):
        # the optimizer updates one flat tensor per whole bucket, replicated on every rank
        opt = [s for f, bucket in zip(self.param_flats, self.buckets.buckets)
               for s in flat_segments(f, bucket, slice(0, bucket.padded_numel), names)]
        return opt, self._frozen_segments(names), True, True
