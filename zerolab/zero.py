"""ZeRO stages 1 and 2: data parallelism where each rank owns one slice of the optimizer.

    engine = zl.ZeRO(model, partial(torch.optim.AdamW, lr=3e-4), stage=2, precision="bf16")
    logits, loss = zl.models.gpt_loss(engine, batch)    # this rank's share of the global batch
    engine.backward(loss)                               # gradients are reduce-scattered
    engine.step()                                       # owners update their slice; all-gather

ZeRO is zl.DDP with one change of collective. DDP all-reduces each flat gradient bucket, so
every rank ends up with the whole averaged gradient and runs the whole optimizer. But an
all-reduce IS a reduce-scatter followed by an all-gather (chapter 4), so ZeRO splits it:

    reduce-scatter the gradients  ->  rank r holds the averaged gradient of its slice only
    rank r updates its slice      ->  its fp32 master weights and Adam moments exist ONLY there
    all-gather the parameters     ->  every rank has the whole updated model again

Same bytes on the wire as DDP (2 (N-1)/N Psi per step), but the optimizer state (K Psi bytes,
the biggest term) is divided by N. The layout comes from zerolab.buckets: each bucket is one
flat buffer padded to a multiple of N, and rank r owns the contiguous slice bucket.shard(r), so
both collectives move a whole bucket with no copies. The optimizer is any elementwise
torch.optim optimizer (SGD, Adam, AdamW...; see zerolab.ddp for what a flat tensor rules out),
built on one flat fp32 tensor per bucket (the owned slice): it cannot tell it is sharded.

* Stage 1 (P_os): gradients land in full flat buffers, exactly as in DDP. After backward, each
  bucket is reduce-scattered; the reduced slice is written back into the owned part of the
  bucket. The full gradient buffers stay allocated until zero_grad: that is stage 1's (2 + 2) Psi.
* Stage 2 (P_os+g): there is no full gradient buffer. When a parameter's gradient is ready
  (a post-accumulate-grad hook) it is copied into its bucket's COMMUNICATION buffer and the
  parameter's .grad is freed. As soon as a bucket is full it is reduce-scattered
  asynchronously, during backward, into the owned gradient slice; its buffer then goes back
  to a small pool and is reused by the next bucket. The pool holds a fixed number (2) of
  buffers of one bucket each: the paper's constant buffer C_B, whatever the model's size
  (it grows only if more buckets are half-filled at once, and is released after backward).

The class extends zerolab.ddp.NaiveDDP, which supplies what the data-parallel engines share
(argument checks, check_same_model, the broadcast of rank 0's weights, the measured forward,
no_sync, loss scaling, build_optimizer's refusal of a built optimizer); what every engine shares
(the step's peak measurement, full_state_dict, memory_report) is zerolab.engines.base.Engine's,
which asks this class for its full values (_full_values) and its tensors (_memory_tensors). The bucket hooks are
DDP's, written again here with a reduce-scatter where DDP all-reduces (DDP's own hooks carry
DDP-only details, so sharing them would couple the two engines' internals).

Choices, stated:

* Gloo has no AVG: backward() (NaiveDDP's, shared by every engine here) divides the loss by
  N, so the reduce-scatter's sum of the ranks' gradients is their mean.
* Stage 1 reduce-scatters after backward (the issue's "after backward"); stage 2 overlaps.
* Gradients are communicated in the compute dtype (bf16/fp16 in mixed precision). The owned
  gradient slice (stage 2) is kept in that dtype too, the paper's 2 Psi / N. When several
  micro-batches accumulate, it is promoted to fp32 on the second one and every later
  contribution is added in fp32 (fp32 accumulation of the owned slice). The step always works
  on fp32 copies of the owned slices.
* Stage 2 cannot honour no_sync by skipping communication (there is no full gradient to
  accumulate into): inside no_sync every micro-batch is still reduce-scattered and added to the
  owned slice. Stage 1 honours no_sync like DDP.
* Gradient storage (stage 1's full buckets, stage 2's owned slices) is allocated when a
  step's backward first needs it and freed by zero_grad, like PyTorch's set_to_none: between
  steps, and during the forward, when activations are at their peak, no gradient is held.
* A parameter no rank reached in a backward (an unused branch) has no gradient in a single
  process, so the optimizer skips it. Here it is one piece of a flat slice: its values and its
  optimizer-state entries are saved before the step and put back after it, so it does not move
  (weight decay included). (A parameter that is unused only sometimes still advances the
  shared step counter of its slice; Adam's bias correction then differs slightly.)
* fp32: the master slice is a view into the model's own flat parameter buffer. bf16/fp16: it
  is a separate fp32 copy of the slice, taken from the exact fp32 values before the cast.
* The fp16 overflow check is all-reduced (every rank skips together); the clip norm is summed
  over ranks (each holds a disjoint slice; padding is zero and tied weights live once).
* stage=3 is zerolab.zero3.ZeRO3.
* mesh=zl.Mesh(dp=, mp=): shard over mesh.dp_group only (engine.world_size = mesh.dp,
  engine.rank = mesh.dp_rank), so a TensorParallelGPT, whose mp ranks hold different
  shards, trains under ZeRO. checkpoint_activations / partition_activations /
  offload_activations switch on ZeRO-R's activation strategies (zerolab.checkpointing).
"""

from __future__ import annotations

import torch

from .buckets import FlatBuckets, held_still, unreached_ranges
from .engines.base import flat_segments
from .ddp import NaiveDDP
from .engines.setup import _check_args
from .memory import live_bytes, optimizer_tensors
from .precision import check_precision, clip_grad_norm_

STAGES = (1, 2, 3)
N_BUFFERS = 2   # stage 2: communication buffers of one bucket each (one filling, one in flight)


def _check_stage(stage):
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ValueError(f"stage must be 1 (shard optimizer state), 2 (also gradients) or 3 (also "
                         f"parameters); got {stage!r}")


class ZeRO(NaiveDDP):
    """ZeRO-1 and ZeRO-2 on flat padded buckets. ZeRO(..., stage=3) builds a zerolab.zero3.ZeRO3."""

    flat_optimizer = "zl.ZeRO"   # the optimizer steps on one flat slice per bucket

    def __new__(cls, model=None, optimizer=None, *, stage=None, **kwargs):
        _check_stage(stage)
        if stage == 3 and cls is ZeRO:
            try:
                from .zero3 import ZeRO3
            except ImportError as e:
                raise NotImplementedError(
                    f"ZeRO stage 3 lives in zerolab.zero3, which could not be imported ({e}); "
                    "use stage=1 or stage=2") from e
            return ZeRO3(model, optimizer, **kwargs)
        return super().__new__(cls)

    def __init__(self, model: torch.nn.Module, optimizer, *, stage, precision="fp32", bucket_mb=25.0,
                 prefetch=1, max_grad_norm=None, scaler=None, track_peak: bool = True, mesh=None,
                 checkpoint_activations=False, partition_activations=False, offload_activations=False,
                 track_activations=None):
        _check_stage(stage)
        check_precision(precision)      # before any collective: a bad argument must not hang
        _check_args(model, bucket_mb, max_grad_norm)
        self.stage = stage
        self.prefetch = prefetch        # used by stage 3 only; kept so the signatures agree
        self.bucket_mb = float(bucket_mb)
        # stage 1 reduce-scatters after backward; stage 2 as soon as each bucket is full
        self.overlap = stage == 2
        # NaiveDDP.__init__: checks every rank has the same model, broadcasts rank 0's
        # weights, calls _setup_storage below, and builds the optimizer on self.masters
        super().__init__(model, optimizer, precision=precision, max_grad_norm=max_grad_norm,
                         scaler=scaler, track_peak=track_peak, mesh=mesh,
                         checkpoint_activations=checkpoint_activations,
                         partition_activations=partition_activations,
                         offload_activations=offload_activations,
                         track_activations=track_activations)
        self._backward_done = False

    # -------------------------------------------------------------- layout
    def _setup_storage(self):
        mixed = self.precision.policy.needs_master
        dtype = self.precision.compute_dtype
        elem = torch.empty((), dtype=dtype).element_size()
        scale = elem / self.params[0].element_size()
        self.buckets = FlatBuckets(self.params, self.bucket_mb * 2**20 / scale, self.world_size)
        buckets = self.buckets.buckets
        self.device = self.params[0].device
        me = self.rank                # this rank's place in the dp group (NaiveDDP.__init__)
        self.shards = [b.shard(me) for b in buckets]
        if mixed:
            # fp32 master SLICES only, taken from the exact fp32 values; the full fp32 copy
            # of each bucket is temporary
            self.master_shards = [b.flat_copy(torch.float32)[s].clone() for b, s in zip(buckets, self.shards)]
            self.model.to(dtype)
        self.buckets.bind_params()
        self.params = self.buckets.params
        if not mixed:
            # fp32: the optimizer updates the owned slice of the model's own flat buffer
            self.master_shards = [b.data[s] for b, s in zip(buckets, self.shards)]
        self.masters = self.master_shards          # what the optimizer is built on
        # Gradient storage exists from a step's backward to its zero_grad only: allocated
        # when the backward first needs it, freed by zero_grad (as PyTorch's set_to_none), so
        # the forward never runs with last step's gradients in memory
        if self.stage == 1:
            self.grad_shards = None                  # full flat gradient buckets, as in DDP
        else:
            # only the owned gradient slice is kept (compute dtype; see the module docstring)
            self.grad_shards = [None] * len(buckets)
            self.buffer_numel = max(b.padded_numel for b in buckets)
            self.max_buffers = 0                     # most buffers alive at once (measured)
            self.max_buffer_bytes = 0                # most bytes in those buffers at once (C_B)
        self._acc32 = [None] * len(buckets)          # fp32 accumulators (stage 2, micro-batches)
        self._filled = [False] * len(buckets)        # owned slice already holds a gradient
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        self._unused = set()
        self._unused_so_far = None                   # over the micro-batches of this step
        self.last_backward = {}
        self.grad_trace = None                       # set to [] to sample gradient bytes in backward
        self._reset_backward_state()
        self._reset_pending()

    def _reset_backward_state(self):
        self._ready = [set() for _ in self.buckets.buckets]   # ids of params whose grad is in
        self._next = 0               # the next bucket to launch: always in index order
        self._handles = []
        self._callback_queued = False

    def _reset_pending(self):
        self._pending = []            # (handle, bucket index, buffer or None, temp or None)
        self._buffer_of = {}          # stage 2: bucket index -> its communication buffer
        self._free = []               # stage 2: buffers ready for reuse
        self._alive = 0

    # -------------------------------------------------------------- stage 2: the buffer pool
    def _acquire(self):
        while not self._free:
            if self._alive < N_BUFFERS or not self._pending:
                self._alive += 1
                self.max_buffers = max(self.max_buffers, self._alive)
                buf = torch.zeros(self.buffer_numel, dtype=self.precision.compute_dtype, device=self.device)
                # C_B, measured: the bytes of every pool buffer alive now (this one included)
                pool = list(self._buffer_of.values()) + self._free + [buf]
                pool += [b for _, _, b, _ in self._pending if b is not None]
                self.max_buffer_bytes = max(self.max_buffer_bytes, live_bytes(pool))
                return buf
            self._complete(self._pending[0])     # wait for the oldest reduce-scatter
        buf = self._free.pop()
        buf.zero_()
        return buf

    def _buffer(self, b):
        if b not in self._buffer_of:
            self._buffer_of[b] = self._acquire()
        return self._buffer_of[b]

    def _grad_bucket(self, b):
        """Stage 1: bucket b's flat gradient buffer, allocated (zeros, p.grad views) on first use."""
        bucket = self.buckets.buckets[b]
        if bucket.grad is None:
            bucket.bind_grads()
        return bucket.grad

    def _release_grads(self):
        if self.stage == 1:
            self.buckets.release_grads()
        else:
            self.grad_shards = [None] * len(self.buckets.buckets)
        for p in self.params:
            p.grad = None

    def _grad_bytes_now(self) -> int:
        held = [p.grad for p in self.params if p.grad is not None]
        if self.stage == 1:
            held += [b.grad for b in self.buckets.buckets if b.grad is not None]
        else:
            held += [g for g in self.grad_shards if g is not None] + [a for a in self._acc32 if a is not None]
            held += list(self._buffer_of.values()) + self._free
            held += [buf for _, _, buf, _ in self._pending if buf is not None]
        return live_bytes(held)

    # -------------------------------------------------------------- the reduction
    def _on_grad_ready(self, p):
        b, i = self.buckets.where[p]
        bucket = self.buckets.buckets[b]
        if self.stage == 1:
            grad = p.grad
            self._grad_bucket(b)     # (allocating it points every p.grad of the bucket at it)
            view = bucket.grad_view(i)
            if grad is not view:     # a fresh gradient (first backward of a step): into the bucket
                if grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                p.grad = view
            if not self._sync:
                # no_sync: gradients just accumulate in the full buckets; remember that this
                # parameter was reached, so the synced backward does not take it for unused
                self._ready[b].add(id(p))
                return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        if self.stage == 2:
            o, n = bucket.offsets[i], bucket.sizes[i]
            self._buffer(b)[o:o + n].copy_(p.grad.reshape(-1))
            p.grad = None            # stage 2: the full gradient is not kept
        self._ready[b].add(id(p))
        if self.overlap:             # stage 2: launch every bucket that is full, in order
            while (self._next < len(self._ready)
                   and len(self._ready[self._next]) == len(self.buckets.buckets[self._next].params)):
                self._launch(self._next)
        if self.grad_trace is not None:
            self.grad_trace.append((self.comm.now(), self._grad_bytes_now()))

    def _launch(self, b):
        bucket = self.buckets.buckets[b]
        if self.stage == 1:
            flat, buf = self._grad_bucket(b), None   # zeros if no gradient reached it
        else:
            buf = self._buffer(b)
            flat = buf[:bucket.padded_numel]
        # (no division here: backward() divided the loss by N, so the sum is the mean)
        size = bucket.padded_numel // self.world_size
        if self.stage == 2 and not self._filled[b]:
            # straight into the owned slice, allocated now (the collective fills all of it)
            self.grad_shards[b] = torch.empty(size, dtype=flat.dtype, device=self.device)
            out, temp = self.grad_shards[b], None
        else:
            out = temp = torch.empty(size, dtype=flat.dtype, device=self.device)
        h = self.comm.reduce_scatter(out, flat, async_op=True, tag=f"bucket{b}")
        self._handles.append(h)
        self._pending.append((h, b, buf, temp))
        self._next = b + 1

    def _complete(self, item):
        """A reduce-scatter is done: put its result in place and recycle its buffer."""
        h, b, buf, temp = item
        h.wait()
        self._pending.remove(item)
        if self.stage == 1:
            self.buckets.buckets[b].grad[self.shards[b]].copy_(temp)
        else:
            if temp is not None:   # a later micro-batch: accumulate the owned slice in fp32
                if self.grad_shards[b].dtype == torch.float32:
                    self.grad_shards[b].add_(temp)
                else:
                    if self._acc32[b] is None:
                        self._acc32[b] = self.grad_shards[b].float()
                    self._acc32[b].add_(temp)
            self._filled[b] = True
            del self._buffer_of[b]
            self._free.append(buf)

    def _finish_backward(self):
        self.last_backward["compute_end"] = self.comm.now()   # autograd has no work left
        # Buckets with a parameter this backward never reached are still waiting: launch them
        # now, in order (their missing gradients are zeros).
        while self._next < len(self.buckets.buckets):
            self._launch(self._next)
        # Which parameters did ANY rank reach? One that no rank reached must not move.
        reached = torch.tensor([float(id(p) in ready) for b, ready in zip(self.buckets.buckets, self._ready)
                                for p in b.params], device=self.device)
        self.comm.all_reduce(reached, op="max", tag="used")
        for item in list(self._pending):
            self._complete(item)
        self._unused = set((reached == 0).nonzero().flatten().tolist())
        self._reset_backward_state()
        self._finished = True
        self.last_backward["end"] = self.comm.now()
        self._reset_pending()            # stage 2: the buffer pool is released between backwards
        # a parameter is unused for the step only if no micro-batch reached it
        if self._unused_so_far is not None:
            self._unused &= self._unused_so_far
        self._unused_so_far = set(self._unused)
        if self.grad_trace is not None:
            self.grad_trace.append((self.comm.now(), self._grad_bytes_now()))

    def _backward(self, loss):
        self.last_backward = {"start": self.comm.now(), "compute_end": None, "end": None}
        self._finished = False
        loss.backward()
        # stage 2 communicates even inside no_sync (see the module docstring)
        if (self._sync or self.stage == 2) and not self._finished:
            self._finish_backward()      # no trainable parameter was reached at all
        self._backward_done = True

    # -------------------------------------------------------------- the step
    def step(self) -> bool:
        if not self._backward_done:
            raise RuntimeError("step() called before backward(): there is no gradient to apply. "
                               "Call engine.backward(loss) first (on every rank).")
        applied = super().step()
        self._backward_done = False
        return applied

    def _owned_grads(self):
        out = []
        for b in range(len(self.buckets.buckets)):
            if self._acc32[b] is not None:
                out.append(self._acc32[b])
            elif self.stage == 1:
                out.append(self.buckets.buckets[b].grad[self.shards[b]])
            else:
                out.append(self.grad_shards[b])
        return out

    @torch.no_grad()
    def _step(self) -> bool:
        mixed = self.precision.policy.needs_master
        for m, g in zip(self.master_shards, self._owned_grads()):
            m.grad = g if g.dtype == torch.float32 else g.float()
        grads = [m.grad for m in self.master_shards]
        ok = self.precision.unscale_and_check(grads)   # fp16: all ranks agree
        if not ok:
            self.precision.update(found_inf=True)
            self._drop_master_grads()
            return False
        if self.max_grad_norm is not None:
            # each rank holds a disjoint slice: the squared norms are summed over ranks
            self.last_grad_norm = clip_grad_norm_(grads, self.max_grad_norm, self.comm)
        # parameters no rank reached must not move: a single process would skip them
        with held_still(self.optimizer, self.master_shards,
                        unreached_ranges(self.buckets, self._unused, self.shards)):
            self.optimizer.step()
        for b, bucket in enumerate(self.buckets.buckets):
            mine = bucket.data[self.shards[b]]
            if mixed:
                mine.copy_(self.master_shards[b])      # cast the updated fp32 slice
            # every rank gathers every slice (the input is a copy: it must not alias the output)
            self.comm.all_gather(bucket.data, mine.clone(), tag=f"param{b}")
        self._drop_master_grads()
        self.precision.update(found_inf=False)
        return True

    def _drop_master_grads(self):
        for m in self.master_shards:
            m.grad = None

    def zero_grad(self) -> None:
        self._unused = set()
        self._unused_so_far = None
        self._release_grads()
        self._acc32 = [None] * len(self.buckets.buckets)
        self._filled = [False] * len(self.buckets.buckets)
        self._drop_master_grads()
        self._reduced = False
        self._backward_done = False

    # -------------------------------------------------------------- state and memory
    @property
    def checkpoint_kind(self) -> str:
        return f"zero{self.stage}"

    def checkpoint_segments(self, names):
        # this rank's master slices (its own); frozen parameters are replicated
        opt = [s for b, bucket in enumerate(self.buckets.buckets)
               for s in flat_segments(self.master_shards[b], bucket, self.shards[b], names)]
        return opt, self._frozen_segments(names), False, True

    @torch.no_grad()
    def refresh_compute(self, fill) -> None:
        # every rank holds the whole compute model (in fp32 the master slice is a view into
        # it): read each parameter whole, as the all-gather after a step would
        for p in self.params:
            fill(p.data.view(-1), p)

    def _full_values(self) -> dict:
        """The fp32 master slices, all-gathered bucket by bucket (every rank must call
        full_state_dict). Frozen parameters and buffers are replicated: Engine takes this rank's."""
        full_of = {}
        for b, bucket in enumerate(self.buckets.buckets):
            full = torch.empty(bucket.padded_numel, dtype=torch.float32, device=self.device)
            self.comm.all_gather(full, self.master_shards[b].detach().clone(), tag="state")
            for p, view in zip(bucket.params, bucket.views(full)):
                full_of[id(p)] = view
        return full_of

    def _memory_tensors(self):
        params = list(self.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        if self.stage == 2:
            grads += [g for g in self.grad_shards if g is not None] + [a for a in self._acc32 if a is not None]
        return params, grads, list(self.master_shards) + optimizer_tensors(self.optimizer)

    def __repr__(self):
        return (f"ZeRO(stage={self.stage}, precision={self.precision.name!r}, world_size={self.world_size}, "
                f"{self.buckets!r})")

