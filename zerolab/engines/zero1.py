"""ZeRO stage 1 (P_os): DDP, but each rank owns one slice of the optimizer.

    engine = zl.ZeRO(model, partial(torch.optim.AdamW, lr=3e-4), stage=1, precision="bf16")
    logits, loss = zl.models.gpt_loss(engine, batch)    # this rank's share of the global batch
    engine.backward(loss)                               # gradients are reduce-scattered
    engine.step()                                       # owners update their slice; all-gather

DDP all-reduces each flat gradient bucket, so every rank ends up with the whole averaged
gradient and runs the whole optimizer. But an all-reduce IS a reduce-scatter followed by an
all-gather (chapter 4), so ZeRO-1 splits it:

    reduce-scatter the gradients  ->  rank r holds the averaged gradient of its slice only
    rank r updates its slice      ->  its fp32 master weights and Adam moments exist ONLY there
    all-gather the parameters     ->  every rank has the whole updated model again

Same bytes on the wire as DDP (2 (N-1)/N Psi per step), but the optimizer state (K Psi bytes,
the biggest term) is divided by N. Each bucket is padded to a multiple of N (zerolab.buckets), so
rank r's slice is the contiguous `bucket.shard(r)` and both collectives move a whole bucket with
no copies. The optimizer is built on one flat fp32 tensor per owned slice: it cannot tell it is
sharded.

What this class changes in DDP, and nothing else:

* the layout: `shards[b]` is this rank's slice, and the fp32 masters exist for it only;
* gradient buffers are allocated when a step's backward first needs them and freed by
  zero_grad (PyTorch's set_to_none), so the forward never runs with last step's gradients in
  memory; while they exist they are full, as in DDP: stage 1's (2 + 2) Psi;
* _reduce: a reduce-scatter into this rank's slice, launched after backward (overlap=True
  launches each bucket when it is full, as DDP does); _complete writes it into the bucket;
* _agree_unused: the reached flags travel in a small all-reduce of their own (a reduce-scatter
  cannot carry them to every rank);
* the step updates the owned slices, sums the clip norm over ranks (each holds a disjoint
  slice; padding is zero and tied weights live once) and all-gathers the parameters.

fp32: the master slice is a view into the model's own flat parameter buffer. bf16/fp16: it is
a separate fp32 copy of the slice, taken from the exact fp32 values before the cast. The fp16
overflow check is all-reduced (every rank skips together).
"""

from __future__ import annotations

import torch

from ..memory import live_bytes
from ..precision import cast_for_compute
from . import grad_guard, options
from .ddp import DDP


class ZeRO1(DDP):
    """ZeRO stage 1 on flat padded buckets. Takes DDP's options (precision=, bucket_mb=, ...).

    prefetch is ZeRO-3's; it is accepted so zl.ZeRO(stage=k) takes the same arguments for every k.
    """

    stage = 1
    takes_no_optimizer = False    # the optimizer state is what it shards: it needs one ...
    awaits_optimizer = True       # ... given, or built over engine.parameters() afterwards (FSDP2's order)
    sharded = True
    accumulates_after_reduce = False   # (Engine._begin_backward) this rank holds its slice's mean only
    overlap_default = False   # reduce-scatter after backward (ZeRO-2 overlaps)

    takes = options.ZERO_1_2    # DDP's options, and prefetch (see the class docstring)
    grad_trace = None             # set it to [] to sample the gradient bytes held during backward

    def _read_options(self, opts, model) -> None:
        super()._read_options(opts, model)
        self.prefetch = opts.layout.prefetch

    @property
    def checkpoint_kind(self) -> str:
        return f"zero{self.stage}"

    # -------------------------------------------------------------- layout
    def _lay_out_masters(self):
        buckets = self.buckets.buckets
        self.shards = [b.shard(self.rank) for b in buckets]    # this rank's slice of each bucket
        mixed = self.precision.policy.needs_master
        if mixed:
            # fp32 master SLICES only, from the exact fp32 values; the full fp32 copy is temporary
            self.master_shards = [b.flat_copy(torch.float32)[s].clone() for b, s in zip(buckets, self.shards)]
            cast_for_compute(self.model, self.precision.compute_dtype)   # (BatchNorm stays fp32)
        self.buckets.bind_params()
        if not mixed:   # the owned slice of the model's own flat buffer
            self.master_shards = [b.data[s] for b, s in zip(buckets, self.shards)]
        self.flat_masters = self.masters = self.master_shards     # what the optimizer updates
        self._out = {}            # bucket -> the reduce-scatter's output, until _complete

    def _bind_grad_storage(self):
        pass                      # allocated by the step's first backward (_grad_bucket)

    def _grad_bucket(self, b):
        """Bucket b's flat gradient buffer, allocated (zeros, p.grad views) on first use."""
        bucket = self.buckets.buckets[b]
        if bucket.grad is None:
            bucket.bind_grads()
        return bucket.grad

    # -------------------------------------------------------------- the reducer's steps
    def _take(self, p, b, i, k):
        grad = p.grad
        self._grad_bucket(b)      # (allocating it points every p.grad of the bucket at it)
        view = self.buckets.buckets[b].grad_view(i)
        if grad is not view:      # a fresh gradient (first backward of a step): into the bucket
            if grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            p.grad = view

    def _take_whole(self, p, b, i, k):
        ZeRO1._take(self, p, b, i, k)     # (ZeRO-2 too: bitwise keeps full buckets during backward)

    def _reduce(self, b):
        flat = self._grad_bucket(b)          # zeros where no gradient arrived
        self._ready_to_reduce(b, flat)
        self._out[b] = torch.empty(flat.numel() // self.world_size, dtype=flat.dtype, device=self.device)
        return self.comm.reduce_scatter(self._out[b], flat, async_op=True, tag=f"bucket{b}")

    def _complete(self, b):
        self.buckets.buckets[b].grad[self.shards[b]].copy_(self._out.pop(b))

    def _agree_unused(self) -> set:
        # (before waiting for the reduce-scatters: a blocking all-reduce is where a rank that
        # never arrives is detected; gloo's reduce-scatter wait ignores the ledger's timeout)
        reached = torch.tensor(self._reached, dtype=torch.float32, device=self.device)
        self.comm.all_reduce(reached, op="max", tag="used")
        return set((reached == 0).nonzero().flatten().tolist())

    def _on_grad_ready(self, p):
        super()._on_grad_ready(p)
        if self.grad_trace is not None:
            self.grad_trace.append((self.comm.now(), live_bytes(self._grad_tensors())))

    def _finish_backward(self):
        super()._finish_backward()
        if self.grad_trace is not None:
            self.grad_trace.append((self.comm.now(), live_bytes(self._grad_tensors())))

    def _grad_tensors(self) -> list:
        """Every gradient tensor this rank holds now."""
        held = grad_guard.real(p.grad for p in self.params)
        return held + [b.grad for b in self.buckets.buckets if b.grad is not None]

    def _memory_tensors(self):
        params, _, optimizer = super()._memory_tensors()
        return params, self._grad_tensors(), optimizer   # (after backward p.grad holds a guard)

    # -------------------------------------------------------------- the step (Engine._step)
    def owned_grads(self) -> list:
        return [b.grad[s] for b, s in zip(self.buckets.buckets, self.shards)]

    def _publish(self):
        for b, bucket in enumerate(self.buckets.buckets):
            mine = bucket.data[self.shards[b]]
            self._upload(mine, self.master_shards[b])
            # every rank gathers every slice (the input is a copy: it must not alias the output)
            self.comm.all_gather(bucket.data, mine.clone(), tag=f"param{b}")

    def _compute_shards(self) -> list:
        """The compute copy of each master slice (this rank's slice of each bucket), in order."""
        return [b.data[s] for b, s in zip(self.buckets.buckets, self.shards)]

    def _set_masters(self, masters: list) -> None:
        """Every name the engine has for its master slices now means `masters` (offload)."""
        self.master_shards[:] = masters     # (flat_masters and masters are this same list)

    def _upload(self, mine, master):
        """The updated fp32 master slice -> this rank's slice of the compute copy: a cast in
        bf16/fp16; nothing in fp32, where the master IS the slice (offload: a host copy goes up)."""
        if self.precision.policy.needs_master:
            mine.copy_(master)

    def _release_grads(self):
        self.buckets.release_grads()
        super()._release_grads()

    # -------------------------------------------------------------- state
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

    def __repr__(self):
        return (f"ZeRO(stage={self.stage}, precision={self.precision.name!r}, world_size={self.world_size}, "
                f"{self.buckets!r})")
