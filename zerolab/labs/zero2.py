"""Lab 5: ZeRO-2: reduce-scatter each bucket during backward, free the full gradient, accumulate
micro-batches in fp32 (chapter 7).

The student writes the three methods of zl.ZeRO(stage=2) (zerolab.engines.zero2.ZeRO2) that make it
differ from ZeRO-1 in backward; the buffer pool, the reducer that calls them and the step are the
library's:

    _take(p, b, i, k)   copy p's gradient into bucket b's communication buffer, free p.grad
    _reduce(b)          divide the buffer by N, reduce-scatter it into this rank's gradient slice
    _complete(b)        the reduce-scatter is done: accumulate (in fp32), give the buffer back to
                        the pool, release the pool after the last bucket

ZeRO2Lab is zl.ZeRO(stage=2) with those three left to write; the grader stops the run the moment
a bucket is reduce-scattered from a buffer cut to its real size (not its padded one), a buffer is
handed out again while its reduce-scatter is still in flight, _reduce returns no handle, or a
gradient slice is not fp32 when backward ends. Overlap is graded by zerolab.labs.overlap's rule,
as in lab 3.
"""

from __future__ import annotations

import torch.distributed as dist

from ..engines import seams
from ..engines.zero2 import ZeRO2     # the library's engine: its seams are the reference
from .checks import PARITY, check_collectives, check_parity, fmt_bytes, per_step, piece_of_bucket
from .engine_run import WrongDtypeStops, instrument, moved, record_run, stub
from .lab import Check, Lab, Stop, Wrong
from .overlap import check_handle, check_overlap, where
from .plugins import GradedCode
from .model import BUCKET_MB, OPTIMIZER, SCHEDULE, build, loss_of, micro_batch

SEAMS = seams.of("ZeRO2")
POOL = "buffers: padded, and reused only once their reduce-scatter is done"   # (and _reduce returns a handle)


class ZeRO2Lab(WrongDtypeStops, ZeRO2):
    """zl.ZeRO(stage=2) with three seams left to write. What you can use:

    self.buckets.buckets[b]   bucket b: .offsets[i], .sizes[i] (where its i-th parameter sits in the
                              flat buffer), .padded_numel
    self._buffer(b)           bucket b's communication buffer from the pool (taken on first use,
                              zeros; at least padded_numel long: slice it)
    self._buffer_of           bucket -> its buffer, while it has one
    self._free                buffers given back and ready for the next bucket
    self._release_pool()      drops every buffer (the pool starts empty at the next backward)
    self._pending, self._next the reducer's: reductions in flight, the next bucket to launch
    self.grad_shards[b]       this rank's gradient slice of bucket b (None until its first reduction
                              since zero_grad), in the compute dtype
    self._acc32[b]            an fp32 accumulator of that slice (None until you need one)
    self._filled[b]           True once bucket b's slice holds a gradient since zero_grad
    self._out                 a dict you may use: bucket -> a reduce-scatter's output until _complete
    self.rank, self.world_size, self.device
    self.comm                 the ledger (zerolab.runtime.comm.Ledger): reduce_scatter(out, in,
                              async_op=False, tag=""): a handle with .wait() if async_op, else None

    The step reads self.owned_grads(): _acc32[b] if you made one, else grad_shards[b].
    """

    # -------------------------------------------------------------- the grader's instruments
    def _bind_grad_storage(self):
        super()._bind_grad_storage()
        self._in_flight = {}     # data pointer of a buffer -> (bucket, handle) of its reduce-scatter

    def _launch(self, b):
        buf = self._buffer_of.get(b)
        super()._launch(b)
        check_handle(POOL, b, self._pending[-1][1], type(self)._reduce, "reduce-scatter")
        if buf is not None:
            self._in_flight[buf.data_ptr()] = (b, self._pending[-1][1])

    def _acquire(self):
        buf = super()._acquire()
        b, handle = self._in_flight.get(buf.data_ptr(), (None, None))
        if handle is not None and handle.record.end is None:
            raise Stop(POOL, "buffer_reused_in_flight",
                       f"the buffer of bucket {b} was handed to another bucket (and zeroed) while bucket "
                       f"{b}'s reduce-scatter was still in flight: gloo was still reading it.",
                       "give a buffer back to the pool (self._free) in _complete, which runs once the "
                       "reduce-scatter has finished, not in _reduce.")
        return buf


def check_padded(engine, entry, out, inp) -> None:
    """The grader's instrument on every collective the engine issues (GradedLedger.on_issue): a
    bucket's reduce-scatter must take the bucket's PADDED buffer, whose slice r is rank r's."""
    if entry.op != "reduce_scatter" or inp is None or not entry.tag.startswith("bucket"):
        return
    b = int(entry.tag[len("bucket"):])
    bucket = engine.buckets.buckets[b]
    if inp.numel() != bucket.padded_numel:
        pad, size = bucket.padded_numel - bucket.numel, bucket.padded_numel // engine.world_size
        real = " (its real elements, without the padding)" if inp.numel() == bucket.numel else ""
        raise Stop(POOL, "unpadded_buffer",
                   f"bucket {b}'s reduce-scatter was issued {where(engine.graded._graded_code)} on "
                   f"{inp.numel()} elements{real}, into an output of {out.numel()}; the bucket has {bucket.numel} "
                   f"real elements padded to {bucket.padded_numel} ({pad} of padding) so that N = "
                   f"{engine.world_size} divides it: rank r's slice is [r * {size}, (r + 1) * {size}) of the padded "
                   "buffer.",
                   "cut the pool's buffer to the bucket's padded size, self._buffer(b)[:padded_numel] (the buffer "
                   "may be longer: it serves the largest bucket), and make the output padded_numel // N long.")


for _name in SEAMS:
    setattr(ZeRO2Lab, _name, stub("lab 5", "ZeRO2Lab", _name))

ReferenceZeRO2 = type("ReferenceZeRO2", (ZeRO2Lab,), {name: vars(ZeRO2)[name] for name in SEAMS})


# ------------------------------------------------------------------ one graded run, on every rank


def measure(plugin) -> dict:
    model = build()
    names = {id(p): name for name, p in model.named_parameters()}
    engine = plugin["engine"](model, OPTIMIZER, bucket_mb=BUCKET_MB)
    graded = instrument(engine, GradedCode(LAB, plugin))
    graded.on_issue = lambda entry, out, inp: check_padded(engine, entry, out, inp)
    engine.grad_trace = []      # gradient bytes held, sampled at every hook and at the end of backward
    buckets = engine.buckets.buckets

    def trace(e, step):
        held = [b for _, b in e.grad_trace]
        e.grad_trace.clear()
        return {"trace": held}

    pieces = [piece_of_bucket(f"bucket {b} (rank {engine.rank}'s slice)", bucket, names,
                              engine.shards[b].start, engine.shards[b].stop) for b, bucket in enumerate(buckets)]
    data = record_run(engine, pieces, held=lambda e: e.owned_grads(),
                      weights=lambda e: [bucket.data for bucket in buckets], after_backward=trace)
    data["buckets"] = [piece_of_bucket(f"bucket {b}", bucket, names) for b, bucket in enumerate(buckets)]
    data["accumulated"] = _bf16_accumulation(plugin)
    return data


def _bf16_accumulation(plugin) -> list:
    """bf16, one step of two micro-batches: the dtype of each owned gradient slice afterwards."""
    engine = plugin["engine"](build(), OPTIMIZER, bucket_mb=BUCKET_MB, precision="bf16")
    for m in range(2):
        engine.backward(loss_of(engine, micro_batch(1, m, dist.get_rank(), dist.get_world_size()), 2))
    return [str(g.dtype).replace("torch.", "") for g in engine.owned_grads()]


# ------------------------------------------------------------------ the checks, in the parent


def parity(ranks) -> str:
    check_parity(ranks, "buckets", lambda piece: "the owned gradient", sharded=True)
    return (f"after every backward each rank's slices hold the global batch's mean gradient, and after "
            f"every step every rank holds one process's weights ({len(SCHEDULE)} steps)")


def accumulation(ranks) -> str:
    for d in ranks:
        wrong = [b for b, dtype in enumerate(d["accumulated"]) if dtype != "float32"]
        if wrong:
            b, dtype = wrong[0], d["accumulated"][wrong[0]]
            head = f"in bf16, after two micro-batches rank {d['rank']}'s gradient slice of bucket {b} is {dtype}"
            if dtype == "float64":
                raise Wrong("accumulated_fp64", f"{head}, where the chapter accumulates in float32: 8 bytes an "
                            "element instead of 4, for digits the fp32 optimizer step never reads.",
                            "at the second micro-batch, promote the slice to fp32 (self._acc32[b] = "
                            "self.grad_shards[b].float()), not fp64, and add every later one to it.")
            raise Wrong("accumulated_low", f"{head}: the second micro-batch was added in {dtype}, whose "
                        f"{8 if dtype == 'bfloat16' else 11} significant bits lose a small gradient added to a "
                        "large one.", "at the second micro-batch, promote the slice to fp32 (self._acc32[b] = "
                        "self.grad_shards[b].float()) and add every later one to it.")
    return "in bf16, two micro-batches leave every owned gradient slice in fp32"


def bytes_per_step(ranks) -> str:
    def check(step, d, s):
        sizes = [b.padded for b in d["buckets"]]
        want = [("reduce_scatter", x) for x in sizes] * SCHEDULE[step] + [("all_gather", x) for x in sizes]
        check_collectives(d["rank"], step, moved(s), want, d["n"],
                          "per bucket, one reduce-scatter of its gradient per micro-batch and one all-gather "
                          "of its parameters per step, (N-1)/N x 4 B x padded size each")

    per_step(ranks, check)
    total = sum(b.padded for b in ranks[0]["buckets"])
    half = (ranks[0]["n"] - 1) / ranks[0]["n"] * 4 * total
    return (f"a step of one micro-batch sends {fmt_bytes(half)} by reduce-scatter + {fmt_bytes(half)} by "
            f"all-gather = 2(N-1)/N x 4 B x {total} (padded Psi) per rank: ZeRO-1's and DDP's 2 Psi")


def _bound(d) -> tuple:
    psi, n = sum(b.padded for b in d["buckets"]), d["n"]
    slices = 4 * psi // n
    return slices, slices + 2 * 4 * max(b.padded for b in d["buckets"])


def memory(ranks) -> str:
    def check(step, d, s):
        if SCHEDULE[step] != 1:
            return              # (a second micro-batch holds its reduce-scatter's output too)
        slices, most = _bound(d)
        if max(s["trace"]) > most:
            raise Wrong("full_gradient_held", f"step {step}, rank {d['rank']}: during backward it held up to "
                        f"{fmt_bytes(max(s['trace']))} of gradients; ZeRO-2 holds at most its slices, 4 Psi / N "
                        f"= {fmt_bytes(slices)}, plus two communication buffers of the largest bucket (C_B), "
                        f"{fmt_bytes(most - slices)}: {fmt_bytes(most)} in all.",
                        "free each parameter's gradient (p.grad = None) as soon as it is copied into its "
                        "bucket's buffer.")
        if s["trace"][-1] != slices:
            raise Wrong("pool_kept", f"step {step}, rank {d['rank']}: when backward ended it held "
                        f"{fmt_bytes(s['trace'][-1])} of gradients; ZeRO-2 keeps only its slices, 4 Psi / N = "
                        f"{fmt_bytes(slices)}.", "after the last bucket's reduce-scatter, release the pool "
                        "(self._release_pool()): no buffer is kept between backwards.")

    per_step(ranks, check)
    slices, most = _bound(ranks[0])
    return (f"during backward at most 4 Psi / N + 2 C_B = {fmt_bytes(most)} of gradients, and 4 Psi / N = "
            f"{fmt_bytes(slices)} when it ends, on every rank")


def overlap(ranks) -> str:
    return check_overlap(ranks, "reduce_scatter", "reduce-scatter", "the reducer waits for it in a later "
                         "hook or at the end of backward, and then calls your _complete")


LAB = Lab(
    name="zero2", engine="zero2", number=5, title="ZeRO-2", chapter="chapter 7, ZeRO-2",
    stub_file="lab5_zero2.py", world_size=2,
    roles={"engine": ZeRO2Lab}, reference={"engine": ReferenceZeRO2}, measure=measure,
    checks=(Check(POOL, None, 'chapter 7, "The idea" (step 3)',
                  "every bucket reduce-scattered from its padded buffer, none handed out while still in flight"),
            Check(PARITY, parity, 'chapter 7, "The idea"'),
            Check("micro-batches accumulate in fp32", accumulation, 'chapter 7, "The code path" (_complete)'),
            Check("bytes per step: 2 Psi, as ZeRO-1", bytes_per_step, 'chapter 7, "The idea"'),
            Check("memory: 4 Psi / N of gradients, plus 2 C_B during backward", memory,
                  'chapter 7, "Reduce-scattering is not freeing"'),
            Check("overlap: backward computes while buckets are reduce-scattered", overlap,
                  'chapter 7, "The idea" (step 2)')),
    mistakes_module="zerolab.labs.zero2_mistakes",
    blame={**dict.fromkeys(("not_divided", "divided_twice", "all_reduce", "bytes", "unpadded_buffer", "not_async",
                            "not_the_ledger", "blocking_reduce"), ("_reduce",)),
           **dict.fromkeys(("lost_micro_batch", "added_to_local", "not_reduced", "divided_not_reduced"),
                           ("_reduce", "_complete")),
           **dict.fromkeys(("accumulated_low", "accumulated_fp64", "grad_dtype", "pool_kept",
                            "buffer_reused_in_flight"), ("_complete",)),
           "full_gradient_held": ("_take",), "weights": ("_complete",)},
)
