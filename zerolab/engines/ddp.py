"""Bucketed data parallelism: gradients are all-reduced in flat buckets while backward runs.

    engine = zl.DDP(model, partial(torch.optim.AdamW, lr=3e-4), precision="bf16", bucket_mb=25)
    logits, loss = zl.models.gpt_loss(engine, batch)    # this rank's share of the global batch
    loss.backward()                                     # gradients are averaged over ranks here
    engine.optimizer.step()                             # every rank takes the same step

Gradients land in flat bucket buffers (zerolab.buckets: p.grad is a view into bucket.grad).
Buckets follow the reverse forward order, so the first one fills first; as soon as a bucket's
last gradient is accumulated (a post-accumulate-grad hook) it is divided by N and reduced
asynchronously while backward continues. An end-of-backward callback launches any bucket still
waiting (parameters the backward never reached) and waits for them all, so when backward
returns every p.grad is the mean. Buckets are always launched in index order, so every rank
issues the same collectives in the same order and nothing can deadlock.

Like DistributedDataParallel it may be built without an optimizer (zl.DDP(model), fp32): the
script's own optimizer over engine.parameters() then steps the averaged p.grad, parameter by
parameter.

This class is also the reducer of ZeRO-1 and ZeRO-2, which change four small steps of it:

    _take(p, b, i)    where a fresh gradient goes        (ZeRO-2: a pool buffer; p.grad freed)
    _reduce(b)        the collective of bucket b           (ZeRO-1: reduce-scatter, not all-reduce)
    _complete(b)      what happens when it has finished    (ZeRO-1: keep the owned slice)
    _agree_unused()   which parameters no rank reached     (ZeRO: one small all-reduce of flags)

and the layout: `shards[b]` is the slice of bucket b this rank updates (DDP: all of it).

Three choices keep the work per step small (on a CPU, where every operation costs time on the
same cores, they matter):
- zero_grad() sets every p.grad to None, so the next backward copies each fresh gradient into
  its slot of the bucket once, instead of zeroing the buckets and adding into them;
- the division by N is one pass over each bucket's flat buffer, just before its collective;
- the engine's optimizer is handed one tensor per parameter, a view into the flat masters
  (optim.param_views): whole and in its own shape here, since DDP updates whole buckets. So
  the optimizer is PyTorch's, parameter by parameter (step counts, a parameter skipped when no
  rank reached it, its groups' hyperparameters, its state dict), while the buffers stay flat
  for the collectives; the engine asks torch.optim for its foreach path, one call per operation
  over every parameter instead of one per parameter and operation.

Each rank sends 2 (N-1)/N of the gradient bytes per step: the paper's "2 Psi".

bitwise=True (engines.options.BITWISE) changes two moments and nothing else: the end of each
backward adds the buckets' gradients into the chunks' trees instead of reducing them
(_add_chunk), and the step's gradients are the trees' sums across ranks (_chunk_sum: ZeRO-1 and
ZeRO-2 take their shard of them); the hooks only fill the buckets.
"""

from __future__ import annotations

import torch

from ..bitwise import buckets as bitwise_buckets
from ..buckets import FlatBuckets
from ..precision import cast_for_compute
from . import options
from ..optim.param_views import ParamViews
from .state import flat_segments
from .naive_ddp import NaiveDDP


_LATE = ("a second part of the gradient of a parameter of shape {shape} arrived after its bucket was "
         "reduced (the parameter is used inside two reentrant activation checkpoints, so its gradient "
         "arrives once per checkpoint): that part would be lost. Use torch.utils.checkpoint(..., "
         "use_reentrant=False), or overlap=False (buckets are then reduced after the whole backward).")


class DDP(NaiveDDP):
    """Bucketed data parallelism whose all-reduces overlap the backward pass.

    overlap=False keeps the buckets but launches them all at the end of backward (chapter 5
    uses it to show what overlap buys).
    """

    checkpoint_kind = "ddp"
    overlap_default = True      # launch each bucket as soon as it is full
    reduces_in_no_sync = False  # inside no_sync gradients only accumulate (ZeRO-2 differs)

    takes = options.BUCKETED    # NaiveDDP's options, and bucket_mb, overlap
    takes_bitwise = True        # bitwise=True: the chunks' fixed tree (engines.options.BITWISE)

    def _read_options(self, opts, model) -> None:
        self.bucket_mb = float(opts.layout.bucket_mb)
        overlap = opts.layout.overlap
        self.overlap = self.overlap_default if overlap is None else bool(overlap)

    # -------------------------------------------------------------- layout
    def _setup_storage(self):
        # bucket sizes count bytes in the dtype that is communicated (the compute dtype)
        elem = torch.empty((), dtype=self.precision.compute_dtype).element_size()
        scale = elem / self.params[0].element_size()
        # (bitwise: padded to N * the norm's block, so every shard holds whole blocks)
        self.buckets = FlatBuckets(self.params, self.bucket_mb * 2**20 / scale, self.world_size,
                                   quantum=bitwise_buckets.quantum(self.world_size) if self.bitwise else None)
        if self.bitwise:
            self._trees, self._summed = bitwise_buckets.ChunkTrees(len(self.buckets)), None
        self.device = self.params[0].device
        self._lay_out_masters()
        self.params = self.buckets.params     # the buckets' order: position k below
        self._bind_grad_storage()
        # per parameter: (its bucket, its position in the bucket, its position k in self.params)
        self._slot = {id(p): (b, i, k) for k, (p, (b, i)) in
                      enumerate((p, self.buckets.where[p]) for p in self.params)}
        self._sizes = [len(b.params) for b in self.buckets.buckets]
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        self._unused = set()      # positions of params no rank reached since zero_grad
        self._reset_backward_state()
        self._release_grads()     # no gradient until the first backward, as in PyTorch

    def _lay_out_masters(self):
        """What the optimizer updates: one flat tensor per bucket (fp32: the parameters' own buffer)."""
        buckets = self.buckets.buckets
        self.shards = [slice(0, b.padded_numel) for b in buckets]   # DDP updates whole buckets
        mixed = self.precision.policy.needs_master
        if mixed:   # fp32 masters in the same flat layout, taken from the exact fp32 values
            self.flat_masters = [b.flat_copy(torch.float32) for b in buckets]
            cast_for_compute(self.model, self.precision.compute_dtype)   # (BatchNorm stays fp32)
        self.buckets.bind_params()
        if mixed:
            self.masters = [v for b, f in zip(buckets, self.flat_masters) for v in b.views(f)]
        else:
            self.flat_masters = [b.data for b in buckets]
            self.masters = self.buckets.params

    def _bind_grad_storage(self):
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
        self._grad_views = [self.buckets.buckets[b].grad_view(i)
                            for b, i in (self.buckets.where[p] for p in self.buckets.params)]

    def _place_groups(self):
        """The optimizer steps one view per parameter of the flat masters (optim.param_views)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.views = ParamViews(self.flat_masters, self.buckets.buckets, self.shards, names)
        self.views.place(self.optimizer)

    def _flat_masters(self) -> list:
        return self.flat_masters

    def _grad_layout(self) -> tuple:
        """(ZeRO-1 and 2: p.grad after backward is a piece of the reduced slices: engines.grad_guard)"""
        return self.buckets.buckets, self.shards

    # -------------------------------------------------------------- the reducer
    # Engine._begin_backward resets it (_reset_backward_state); the hooks below fill and launch
    # the buckets; the end-of-backward callback (_finish_backward) launches the rest and waits.
    def _reset_backward_state(self):
        self._missing = list(self._sizes)   # per bucket: gradients this backward has not delivered
        self._counted = [False] * len(self.params)   # by position k: delivered in this backward
        self._next = 0               # the next bucket to launch: always in index order
        self._pending = []           # (bucket, handle) launched and not completed, oldest first
        self._bucket_sums = []       # DDP: each reduced bucket's sum, for the step's finite check

    def _on_grad_ready(self, p):
        # The hot path: it runs once per parameter per backward, so it does as little as it can
        # (plain attributes and lists indexed by position: a CPU rank pays for every Python step).
        b, i, k = self._slot[id(p)]
        if self.bitwise:             # a chunk: into its bucket; nothing travels until the step
            self._take_whole(p, b, i, k)
            self._reached[k] = True
            return
        reducing = self.life.reducing
        if reducing and b < self._next and self._counted[k]:
            raise RuntimeError(_LATE.format(shape=tuple(p.shape)))
        self._take(p, b, i, k)
        self._reached[k] = True      # (ZeRO-1 and 2 agree on these; DDP on p.grad itself)
        if not reducing:
            return                   # no_sync: the gradient just accumulates in its bucket
        if not self._counted[k]:     # (a hook can fire twice, e.g. reentrant checkpointing)
            self._counted[k] = True
            self._missing[b] -= 1
        # collectives finish in launch order: complete the oldest ones that are done (this also
        # stamps their end time within one hook of when they really finished, for timelines)
        pending = self._pending
        while pending and pending[0][1].is_completed():
            self._wait_oldest()
        if self.overlap:
            missing = self._missing
            while self._next < len(missing) and missing[self._next] == 0:
                self._launch(self._next)

    def _take(self, p, b, i, k):
        """Put p's gradient in its slot of bucket b."""
        view = self._grad_views[k]
        if p.grad is not view:
            # The step's first gradient for p: autograd made a fresh tensor (zero_grad set
            # p.grad to None). Copy it into the bucket, over last step's value, and make p.grad
            # the view, so later micro-batches accumulate in the bucket directly.
            view.copy_(p.grad)
            p.grad = view

    def _take_whole(self, p, b, i, k):
        """bitwise: p's gradient into its slot of bucket b's full gradient buffer."""
        DDP._take(self, p, b, i, k)

    def _launch(self, b):
        self._pending.append((b, self._reduce(b)))
        self._next = b + 1

    def _ready_to_reduce(self, b, flat):
        """Bucket b's buffer `flat`, about to be reduced: a slot whose p.grad is not its view (no
        gradient since zero_grad) still holds an old value and contributes zeros; a slot that is
        p.grad holds p's gradient, whichever backward added it. Then the buffer is divided by N,
        so the SUM the collective computes is the mean (gloo has no average)."""
        if self._missing[b]:
            bucket = self.buckets.buckets[b]
            for i, p in enumerate(bucket.params):
                if not self._counted[self._slot[id(p)][2]] and p.grad is not bucket.grad_view(i):
                    bucket.grad_view(i).zero_()
        if self.world_size > 1:
            flat.div_(self.world_size)

    def _reduce(self, b):
        """Start bucket b's collective; return its handle."""
        bucket, buf = self.buckets.buckets[b], self._flats[b]
        self._ready_to_reduce(b, bucket.grad)
        if b == len(self._flats) - 1:   # the last one carries the "has a gradient" flags
            self._held = [p.grad is v for p, v in zip(self.params, self._grad_views)]
            buf[bucket.padded_numel:] = torch.tensor(self._held, dtype=buf.dtype)
        return self.comm.all_reduce(buf, async_op=True, tag=f"bucket{b}")

    def _wait_oldest(self):
        b, handle = self._pending.pop(0)
        handle.wait()
        self._complete(b)

    def _complete(self, b):
        # sum the finished bucket now: the step's finite check (fp32/bf16) then costs no pass
        # of its own, and this rank would otherwise idle waiting for the next one
        self._bucket_sums.append(self.buckets.buckets[b].grad.sum())

    def _finish_backward(self):
        self.last_backward["compute_end"] = self.comm.now()   # autograd has no work left
        if self.bitwise:
            return self._add_chunk()
        # Buckets with a parameter the backward never reached are still waiting: launch them
        # now, in order. Their missing gradients are zeros (or what no_sync accumulated).
        while self._next < len(self.buckets.buckets):
            self._launch(self._next)
        self._unused = self._agree_unused()
        while self._pending:
            self._wait_oldest()

    def _agree_unused(self) -> set:
        """Positions of the parameters with a gradient on NO rank (p.grad None everywhere: no
        backward reached them since their gradient was last set to None; read from the last
        bucket, so every all-reduce is waited for first)."""
        while self._pending:
            self._wait_oldest()
        if all(self._held):
            return set()
        held = self._tail[self.buckets.buckets[-1].padded_numel:]   # summed over ranks
        unused = set((held == 0).nonzero().flatten().tolist())
        # one with no gradient anywhere keeps grad None, as in a single process, and the step
        # holds it still; one with a gradient on another rank only gets the averaged gradient
        for k, p in enumerate(self.params):
            if not self._held[k] and k not in unused:
                p.grad = self._grad_views[k]
        return unused

    # -------------------------------------------------------------- bitwise=True (engines.options.BITWISE)
    def _add_chunk(self):
        """The end of a backward: its gradient, bucket by bucket in fp32, is this rank's next leaf
        of each bucket's tree; p.grad is freed, so the next chunk starts from nothing."""
        leaves = []
        for bucket in self.buckets.buckets:
            grad = bucket.grad
            if grad is None:          # (ZeRO-1/2: no parameter of this bucket was reached yet)
                leaves.append(torch.zeros(bucket.padded_numel, dtype=torch.float32, device=self.device))
                continue
            leaf = grad[:bucket.padded_numel].to(torch.float32, copy=True)
            for i, p in enumerate(bucket.params):     # a slot this backward did not write: zeros
                if p.grad is not bucket.grad_view(i):
                    leaf[bucket.offsets[i]:bucket.offsets[i] + bucket.sizes[i]].zero_()
            leaves.append(leaf)
        self._chunk_done(leaves)
        if self.optimizer is None and self.life.sync:
            self._write_sums()

    def _write_sums(self) -> None:
        """bitwise=True beside the script's own optimizer (zl.DDP(model) with no optimizer, as
        torch's DDP): a synced backward ends the step's chunks (nanoGPT's
        require_backward_grad_sync), so p.grad gets the fixed tree's average now, a parameter no
        rank reached keeps None. The script zeroes them before the next step's chunks."""
        self._clear_placeholders()
        for bucket, total in zip(self.buckets.buckets, self._chunk_sum()):
            for i, p in enumerate(bucket.params):
                if self._slot[id(p)][2] not in self._unused:
                    piece = total[bucket.offsets[i]:bucket.offsets[i] + bucket.sizes[i]]
                    p.grad = piece.view(p.shape).to(p.dtype)
        self._summed = None
        self._sums_out = True

    def _chunk_sum(self) -> list:
        if self._summed is None:
            self._unused = bitwise_buckets.agree_backwards(self._trees.backwards, self._reached, self.comm,
                                                           self.world_size)
            self._summed = bitwise_buckets.reduce_buckets(self._trees.roots(), self.comm, self.world_size,
                                                          self.sharded)
            self._reached = [False] * len(self.params)
        return self._summed

    # -------------------------------------------------------------- the step on flat tensors (Engine._step)
    def owned_grads(self) -> list:
        """Per bucket, the reduced gradient of the slice this rank updates (DDP: all of it)."""
        return [b.grad for b in self.buckets.buckets]

    def _step_grads(self) -> list:
        # one flat fp32 gradient per bucket (.float() is free in fp32): one check, scale and
        # norm per bucket instead of per parameter (padding and unused slots are zeros)
        if self.bitwise:
            for m, g in zip(self.flat_masters, self._chunk_sum()):
                m.grad = g
            return [m.grad for m in self.flat_masters]
        for m, g in zip(self.flat_masters, self.owned_grads()):
            m.grad = g.float()
        return [m.grad for m in self.flat_masters]

    def _grad_sums(self, grads) -> list:
        # the bucket sums taken while backward waited for its last all-reduces
        if len(self._bucket_sums) == len(grads):
            return self._bucket_sums
        return super()._grad_sums(grads)

    def _unused_params(self) -> set:
        # parameters no rank reached: the optimizer skips them, as a single process does
        return {id(self.params[k]) for k in self._unused}

    def _publish(self):
        if self.precision.policy.needs_master:
            for b, f in zip(self.buckets.buckets, self.flat_masters):
                b.data.copy_(f)  # one cast-and-copy per bucket

    def _drop_step_grads(self):
        self.life.grads_dropped()
        self._clear_placeholders()      # (bitwise: the step made the gradients)
        if self.views is not None:
            self.views.drop_grads()
        for m in self.flat_masters:
            m.grad = None
        self._bucket_sums = []
        if self.bitwise:
            self._summed = None

    def _release_grads(self):
        # gradients to None (PyTorch's set_to_none): the buckets keep their memory, and the
        # next backward copies each first gradient into its slot instead of adding to zeros
        for p in self.params:
            p.grad = None
        # did a backward since zero_grad reach param k? (one no rank reached has no gradient in
        # one process, forgotten zero_grad or not: the step holds it still)
        self._reached = [False] * len(self.params)
        self._unused = set()
        if self.bitwise:              # the chunks added so far go too
            self._trees.reset()
            self._summed = None

    # -------------------------------------------------------------- state (memory_report,
    # full_state_dict: Engine's, whose masters here are views into the flat tensors)
    def checkpoint_segments(self, names):
        # what the optimizer updates: its views (slice shards[b] of each bucket's masters)
        if self.views is not None:
            opt = self.views.segments(names)
        else:                       # (no optimizer: the flat masters themselves)
            opt = [s for b, bucket in enumerate(self.buckets.buckets)
                   for s in flat_segments(self.flat_masters[b], bucket, self.shards[b], names)]
        return opt, self._frozen_segments(names), not self.sharded, True
