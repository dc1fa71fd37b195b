"""Lab 3: bucketed DDP whose buckets are all-reduced while backward runs (chapter 5).

The student writes four methods of zl.DDP's reducer (zerolab.engines.ddp.DDP), the ones chapter 5
describes; the rest of the engine (buckets, the step on flat buffers, no_sync) is the library's:

    _take(p, b, i, k)     put p's fresh gradient in its slot of bucket b; p.grad becomes that slot
    _on_grad_ready(p)     autograd's hook: count the gradient in, launch every bucket that is full
    _reduce(b)            divide bucket b by N and start its all-reduce; return the handle
    _finish_backward()    launch what is left, wait for everything in flight

DDPLab is zl.DDP with those four left to write, and with the grader's instruments: it notes which
gradients have arrived, and stops the run the moment a bucket is reduced before it is full, out of
order or inside no_sync, when _reduce returns no handle, or when backward returns with a reduction
still in flight. Overlap is graded by zerolab.labs.overlap's rule: each bucket's all-reduce must be
in flight while at least one autograd node of backward starts, unless backward had nothing left to
compute when it was launched.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..engines import seams
from ..engines.ddp import DDP       # the library's engine: its seams are the reference
from .checks import PARITY, Piece, check_parity, fmt_bytes, per_step, piece_of_bucket, ring_factor
from .engine_run import instrument, moved, record_run, stub
from .lab import Check, Lab, Stop, Wrong
from .overlap import check_handle, check_overlap, defined_at, waited_where
from .plugins import GradedCode
from .model import BUCKET_MB, OPTIMIZER, SCHEDULE, LabNetWithSpare, build, loss_of, micro_batch

SEAMS = seams.of("DDP")
PROTOCOL = "buckets reduced when full, in order, and waited for"
SECTION = 'chapter 5, "The idea" (bucketed, overlapped) and "The code path"'


class DDPLab(DDP):
    """zl.DDP with the reducer's four seams left to write. What you can use:

    self.buckets.buckets[b]   bucket b: .grad (its flat gradient buffer), .grad_view(i) (the slot of
                              its i-th parameter, a view into .grad), .params
    self._slot[id(p)]         (b, i, k): p's bucket, its position in it, its position overall
    self._missing[b]          gradients bucket b still waits for in this backward (reset for you
                              at every backward to the bucket's number of parameters)
    self._next                the next bucket to launch (buckets go in index order, 0 first)
    self._launch(b)           calls self._reduce(b), keeps (b, handle) in self._pending, and sets
                              self._next = b + 1
    self._pending             [(bucket, handle)] launched and not yet waited for, oldest first
    self._wait_oldest()       waits for the oldest pending reduction (handle.wait())
    self._reducing_now        False inside `with engine.no_sync():` (gradients only accumulate)
    self.comm                 the ledger (zerolab.runtime.comm.Ledger): all_reduce(tensor, op="sum",
                              async_op=False, tag=""): a handle with .wait() if async_op, else None
    self.world_size           N
    """

    # -------------------------------------------------------------- the grader's instruments
    def _setup_storage(self):
        super()._setup_storage()
        # the reducer's hooks go through _arrive, which notes which gradients are in
        for h in self._hooks:
            h.remove()
        self._hooks = [p.register_post_accumulate_grad_hook(self._arrive) for p in self.params]

    def _arrive(self, p):
        self._arrived.add(id(p))
        self._on_grad_ready(p)

    def _reset_backward_state(self):
        super()._reset_backward_state()
        self._arrived, self._handles, self._finishing = set(), [], False

    def _launch(self, b):
        bucket = self.buckets.buckets[b]
        if not self._reducing_now:
            raise Stop(PROTOCOL, "reduced_in_no_sync",
                       f"bucket {b} was launched{waited_where(self)} during a backward inside no_sync(), "
                       "which must only "
                       "accumulate gradients (step 1's first micro-batch: steps are numbered from 0).",
                       "in _on_grad_ready, return right after _take when self._reducing_now is False.")
        if b < len(self._handles):
            raise Stop(PROTOCOL, "reduced_twice",
                       f"bucket {b} was launched a second time in one backward{waited_where(self)}: its "
                       "gradients would be "
                       "averaged twice over and sent twice.",
                       "launch each bucket once: from self._next on, never one before it.")
        if b > len(self._handles):
            raise Stop(PROTOCOL, "out_of_order",
                       f"bucket {b} was launched{waited_where(self)} when bucket {len(self._handles)} was "
                       "next: every rank "
                       "must launch the buckets in the same order (index order), or their all-reduces "
                       "pair up wrongly and the ranks deadlock.",
                       "launch the buckets in index order: once a gradient completes a bucket, launch every "
                       "complete bucket from self._next on, one after the other, and stop at the first that still "
                       "waits for a gradient (a bucket that fills early waits for the ones before it).")
        missing = [p for p in bucket.params if id(p) not in self._arrived]
        if missing and not self._finishing:
            raise Stop(PROTOCOL, "launched_early",
                       f"bucket {b} was launched{waited_where(self)} while {len(missing)} of its "
                       f"{len(bucket.params)} "
                       "gradients had not arrived: its all-reduce would average a half-filled buffer "
                       "(and race with the copies still to come).",
                       "launch a bucket only when self._missing[b] reaches 0.")
        super()._launch(b)
        handle = self._pending[-1][1]
        check_handle(PROTOCOL, b, handle, type(self)._reduce, "all-reduce")
        self._handles.append(handle)

    def _end_backward(self):
        self._finishing = True
        super()._end_backward()
        if not self._reducing_now:
            return
        never = [b for b in range(len(self.buckets.buckets)) if b >= len(self._handles)]
        if never:
            raise Stop(PROTOCOL, "not_launched",
                       f"backward returned, after your _finish_backward{defined_at(type(self)._finish_backward)}, "
                       f"with bucket {never[0]} never reduced: its gradients are "
                       f"still this rank's own.{getattr(self, 'probe_note', '')}",
                       "a bucket that never fills (a parameter no backward reached) is reduced all the same, "
                       "by _finish_backward, in order.")
        if any(h.record.end is None for h in self._handles):
            last = max(b for b, h in enumerate(self._handles) if h.record.end is None)
            raise Stop(PROTOCOL, "not_waited",
                       f"backward returned, after your _finish_backward{defined_at(type(self)._finish_backward)}, "
                       f"with the all-reduce of bucket {last} never waited for: the "
                       "optimizer would read a buffer gloo may still be writing.",
                       "_finish_backward waits for every pending reduction (self._wait_oldest()).")


for _name in SEAMS:
    setattr(DDPLab, _name, stub("lab 3", "DDPLab", _name))

# the solution: the library's own methods in the seams
ReferenceDDP = type("ReferenceDDP", (DDPLab,), {name: vars(DDP)[name] for name in SEAMS})


# ------------------------------------------------------------------ one graded run, on every rank


def measure(plugin) -> dict:
    model = build()
    names = {id(p): name for name, p in model.named_parameters()}
    engine = plugin["engine"](model, OPTIMIZER, bucket_mb=BUCKET_MB)
    instrument(engine, GradedCode(LAB, plugin))
    # one piece per parameter: p.grad is what a PyTorch script reads
    pieces = [Piece(f"bucket {b}", [(names[id(p)], 0, p.numel())], p.numel())
              for b, bucket in enumerate(engine.buckets.buckets) for p in bucket.params]
    params = [p for bucket in engine.buckets.buckets for p in bucket.params]
    data = record_run(engine, pieces, held=lambda e: [p.grad for p in params],
                      weights=lambda e: [p for p in params])
    data["buckets"] = [piece_of_bucket(f"bucket {b}", bucket, names) for b, bucket in enumerate(engine.buckets.buckets)]
    data["n_params"] = len(params)
    _probe_unreached(plugin)
    return data


def _probe_unreached(plugin) -> None:
    """One more backward, after the run, on LabNetWithSpare: bucket 0 holds parameters no backward
    reaches, so it never fills, and no bucket after it can start before backward ends. The
    reducer must reduce them all the same (the protocol check stops the run if not)."""
    torch.manual_seed(0)
    engine = plugin["engine"](LabNetWithSpare(), OPTIMIZER, bucket_mb=BUCKET_MB)
    instrument(engine, GradedCode(LAB, plugin))
    engine.probe_note = (" (The grader's second model, after the run: one whose forward never calls a layer, "
                         "spare, whose parameters sort into bucket 0, as an unused branch does.)")
    loss_of(engine, micro_batch(0, 0, dist.get_rank(), dist.get_world_size()), 1).backward()


# ------------------------------------------------------------------ the checks, in the parent


def parity(ranks) -> str:
    check_parity(ranks, "pieces", lambda piece: f"p.grad of {piece.entries[0][0]}", sharded=False,
                 no_grad_hint="in DDP p.grad IS the parameter's slot in its bucket (a view into bucket.grad): the "
                 "all-reduce averages it there and the optimizer reads it there. _take makes p.grad that view "
                 "and leaves it so; setting p.grad to None is ZeRO-2's habit, not DDP's.",
                 hints={"not_reduced": "p.grad must BE the parameter's slot in its bucket (the view "
                        "self.buckets.buckets[b].grad_view(i)), so the all-reduce's result is what p.grad holds; "
                        "a copy in the slot, with p.grad left as autograd made it, leaves p.grad unaveraged."})
    return (f"after every backward p.grad is the global batch's gradient, and after every step the "
            f"weights are one process's, on every rank ({len(SCHEDULE)} steps)")


def bytes_per_step(ranks) -> str:
    def check(step, d, s):
        n, sizes = d["n"], [b.padded for b in d["buckets"]]
        seen = moved(s)
        if (len(seen) == len(sizes) and all(op == "all_reduce" for op, *_ in seen)
                and sorted(x[1] for x in seen[:-1]) == sorted(sizes[:-1])
                # zl.DDP's last bucket also carries one flag per parameter ("reached?")
                and seen[-1][1] in (sizes[-1], sizes[-1] + d["n_params"])):
            return
        want = sum(ring_factor("all_reduce", n) * 4 * x for x in sizes)
        calls = ", ".join(f"{op} of {numel}" for op, numel, *_ in seen[:8]) + (" ..." if len(seen) > 8 else "")
        key, hint = "bytes", "one all-reduce per bucket, of the bucket's whole flat buffer."
        if len(seen) == d["n_params"]:
            key, hint = "per_parameter", "all-reduce the bucket's flat buffer in one call, not each gradient."
        raise Wrong(key, f"step {step}, rank {d['rank']}: {len(seen)} collectives moved gradients "
                    f"({calls} elements), {fmt_bytes(sum(x[2] for x in seen))} sent; a bucketed DDP makes one "
                    f"all-reduce per bucket ({len(sizes)}: {', '.join(map(str, sizes))} elements), 2(N-1)/N x "
                    f"4 B x {sum(sizes)} = {fmt_bytes(want)} per step.", hint)

    per_step(ranks, check)
    n = ranks[0]["n"]
    total = sum(b.padded for b in ranks[0]["buckets"])
    return (f"every step, one all-reduce per bucket: 2(N-1)/N x 4 B x {total} (padded Psi) = "
            f"{fmt_bytes(ring_factor('all_reduce', n) * 4 * total)} per rank")


def overlap(ranks) -> str:
    return check_overlap(ranks, "all_reduce", "all-reduce", "wait for it once backward has no work left "
                         "(_finish_backward), or in a later hook for a bucket already done")


LAB = Lab(
    name="ddp", engine="ddp", number=3, title="bucketed DDP, overlapped with backward",
    chapter="chapter 5, Data parallelism",
    stub_file="lab3_ddp.py", world_size=2,
    roles={"engine": DDPLab}, reference={"engine": ReferenceDDP}, measure=measure,
    checks=(Check(PROTOCOL, None, SECTION, "no bucket launched early or out of order, none left in flight"),
            Check(PARITY, parity, 'chapter 5, "The idea"'),
            Check("bytes per step against 2(N-1)/N Psi", bytes_per_step,
                  'chapter 5, "Bytes per step: measured vs the paper\'s 2 Psi"'),
            Check("overlap: backward computes while buckets are all-reduced", overlap,
                  'chapter 5, "Naive vs bucketed vs overlapped: the timeline"')),
    mistakes_module="zerolab.labs.ddp_mistakes",
    blame={**dict.fromkeys(("not_divided", "divided_twice", "added_to_local", "divided_not_reduced", "zeros",
                            "per_parameter", "bytes", "not_async", "not_the_ledger"), ("_reduce",)),
           **dict.fromkeys(("not_reduced", "not_reset", "lost_micro_batch", "no_grad"), ("_take",)),
           **dict.fromkeys(("launched_early", "out_of_order", "reduced_in_no_sync", "no_overlap"),
                           ("_on_grad_ready",)),
           **dict.fromkeys(("not_launched", "not_waited", "reduced_twice"), ("_finish_backward", "_on_grad_ready")),
           "blocking_reduce": ("_reduce",), "weights": ("_take", "_reduce")},
)
