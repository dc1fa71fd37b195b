"""Lab 4: ZeRO-1: reduce-scatter the gradients, step the owned slice, all-gather the parameters
(chapter 6).

The student writes the four methods of zl.ZeRO(stage=1) (zerolab.engines.zero1.ZeRO1) that make it
differ from chapter 5's DDP; the reducer that calls them (hooks, launch order, the end of backward)
and the step template are the library's:

    _lay_out_masters()   which slice of each bucket this rank owns, and its master (fp32: a view)
    _reduce(b)           reduce-scatter bucket b's gradient into this rank's slice; return the handle
    _complete(b)         write the result into the owned slice of the bucket's gradient
    _publish()           after the optimizer stepped the owned slices: every rank gets every slice

ZeRO1Lab is zl.ZeRO(stage=1) with those four left to write; the grader checks the slices and the
masters' dtype the moment they are laid out.
"""

from __future__ import annotations

from ..engines import seams
from ..engines.zero1 import ZeRO1     # the library's engine: its seams are the reference
from .checks import PARITY, adam_state_bytes, check_collectives, check_parity, fmt_bytes, per_step, piece_of_bucket
from .engine_run import moved, record_run, stub
from .lab import Check, Lab, Stop, Wrong
from .overlap import defined_at
from .model import BUCKET_MB, OPTIMIZER, SCHEDULE, build

SEAMS = seams.of("ZeRO1")
OWNERSHIP = "each rank owns slice r of every padded bucket"


class ZeRO1Lab(ZeRO1):
    """zl.ZeRO(stage=1) with four seams left to write. What you can use:

    self.buckets.buckets[b]   bucket b: .data (its flat parameter buffer, once bind_params ran),
                              .grad (its flat gradient buffer), .numel (real elements),
                              .padded_numel (a multiple of N: zeros at the end)
    self.buckets.bind_params()  makes every parameter a view into its bucket's .data
    self._grad_bucket(b)      bucket b's flat gradient (allocated on first use)
    self._ready_to_reduce(b, flat)  zeroes the slots no gradient reached and divides by N (chapter 5)
    self._out                 a dict you may use: bucket -> the reduce-scatter's output until _complete
    self.rank, self.world_size, self.device
    self.comm                 the ledger (zerolab.runtime.comm.Ledger): reduce_scatter(out, in,
                              async_op=False, tag="") (`in` N times `out`: rank r gets the sum of
                              slice r) and all_gather(out, in, async_op=False, tag="") (`out` N
                              times `in`, every rank's `in` in rank order); each returns a handle
                              with .wait() if async_op, else None once done

    and what you set in _lay_out_masters: self.shards[b], the slice of bucket b this rank owns,
    and self.master_shards[b], the tensor the optimizer updates for it; you also set
    self.flat_masters and self.masters to that same list (the names the step reads).
    """

    def _setup_storage(self):
        super()._setup_storage()
        for b, bucket in enumerate(self.buckets.buckets):
            size = bucket.padded_numel // self.world_size
            mine = self.shards[b]
            master = self.master_shards[b]
            if master.dtype != bucket.data.dtype and not self.precision.policy.needs_master:
                raise Stop(OWNERSHIP, "master_dtype",
                           f"rank {self.rank}'s master of bucket {b}, as your _lay_out_masters"
                           f"{defined_at(type(self)._lay_out_masters)} set it, is "
                           f"{str(master.dtype).replace('torch.', '')}, shape {tuple(master.shape)}; the model "
                           f"trains in {str(bucket.data.dtype).replace('torch.', '')}, so the master is the owned "
                           "slice of the bucket's own flat buffer, a view: no cast, no copy. A master in another "
                           "dtype is a copy, and what the optimizer writes into it never reaches the model.",
                           "self.master_shards[b] = bucket.data[self.shards[b]]: slicing keeps the dtype and "
                           "the memory.")
            if (mine.start, mine.stop) != (self.rank * size, (self.rank + 1) * size):
                raise Stop(OWNERSHIP, "wrong_slice",
                           f"rank {self.rank}'s slice of bucket {b}, as your _lay_out_masters"
                           f"{defined_at(type(self)._lay_out_masters)} set it, is elements {mine.start}-{mine.stop} "
                           f"of its {bucket.padded_numel} ({bucket.numel} real, "
                           f"{bucket.padded_numel - bucket.numel} of padding); with N = {self.world_size} "
                           f"each rank owns padded_numel / N = {size} elements, rank {self.rank} elements "
                           f"{self.rank * size}-{(self.rank + 1) * size}: the slices reduce-scatter hands out.",
                           "cut the PADDED buffer into N equal slices: slice r is "
                           "[r * padded_numel // N, (r + 1) * padded_numel // N).")


for _name in SEAMS:
    setattr(ZeRO1Lab, _name, stub("lab 4", "ZeRO1Lab", _name))

ReferenceZeRO1 = type("ReferenceZeRO1", (ZeRO1Lab,), {name: vars(ZeRO1)[name] for name in SEAMS})


# ------------------------------------------------------------------ one graded run, on every rank


def measure(plugin) -> dict:
    model = build()
    names = {id(p): name for name, p in model.named_parameters()}
    engine = plugin["engine"](model, OPTIMIZER, bucket_mb=BUCKET_MB)
    buckets = engine.buckets.buckets
    pieces = [piece_of_bucket(f"bucket {b} (rank {engine.rank}'s slice)", bucket, names,
                              engine.shards[b].start, engine.shards[b].stop) for b, bucket in enumerate(buckets)]
    # after backward, the whole of each bucket's gradient too: a result written at another slice's
    # offset is found there (checks.check_parity)
    data = record_run(engine, pieces, held=lambda e: e.owned_grads(),
                      weights=lambda e: [bucket.data for bucket in buckets],
                      after_backward=lambda e, step: {"full": [b.grad.detach().float().clone() for b in buckets]},
                      after_step=lambda e, step: {"memory": e.memory_report()})
    data["buckets"] = [piece_of_bucket(f"bucket {b}", bucket, names) for b, bucket in enumerate(buckets)]
    return data


# ------------------------------------------------------------------ the checks, in the parent


def parity(ranks) -> str:
    check_parity(ranks, "buckets", lambda piece: "the owned gradient", sharded=True)
    return (f"after every backward each rank's slices hold the global batch's mean gradient, and after "
            f"every step every rank holds one process's weights ({len(SCHEDULE)} steps)")


def bytes_per_step(ranks) -> str:
    def check(step, d, s):
        sizes = [b.padded for b in d["buckets"]]
        want = [("reduce_scatter", x) for x in sizes] + [("all_gather", x) for x in sizes]
        check_collectives(d["rank"], step, moved(s), want, d["n"],
                          "per bucket, one reduce-scatter of its gradient and one all-gather of its "
                          "parameters, (N-1)/N x 4 B x padded size each: 2 Psi in the paper's units")

    per_step(ranks, check)
    total = sum(b.padded for b in ranks[0]["buckets"])
    half = (ranks[0]["n"] - 1) / ranks[0]["n"] * 4 * total
    return (f"every step, a reduce-scatter and an all-gather per bucket: {fmt_bytes(half)} + "
            f"{fmt_bytes(half)} = 2(N-1)/N x 4 B x {total} (padded Psi) per rank, as DDP's all-reduce")


def memory(ranks) -> str:
    def check(step, d, s):
        psi, n, m = sum(b.padded for b in d["buckets"]), d["n"], s["memory"]
        # AdamW keeps two fp32 moments per element of this rank's part of each parameter (K = 8)
        # and one step count (4 B) per parameter it holds a part of
        want = {"params": 4 * psi, "grads": 4 * psi, "optimizer": adam_state_bytes(d["buckets"], n, d["rank"])}
        for kind, bytes_ in want.items():
            if m[kind] != bytes_:
                raise Wrong("memory", f"after step {step}, rank {d['rank']} holds {fmt_bytes(m[kind])} of {kind}; "
                            f"ZeRO-1 in fp32 with AdamW holds params 4 Psi = {fmt_bytes(want['params'])}, grads "
                            f"4 Psi = {fmt_bytes(want['grads'])} (until zero_grad) and optimizer state "
                            f"K Psi / N = 8 x (the real elements of its slices) + 4 B of step count per "
                            f"parameter it holds a part of = {fmt_bytes(want['optimizer'])} (Psi = {psi}, padded).",
                            "the optimizer must see this rank's slices only, and the masters in fp32 are "
                            "views of the model's own flat buffers, not copies.")

    per_step(ranks, check)
    psi, n = sum(b.padded for b in ranks[0]["buckets"]), ranks[0]["n"]
    state = adam_state_bytes(ranks[0]["buckets"], n, 0)
    return (f"params 4 Psi + grads 4 Psi + optimizer 8 Psi / N (+ step counts) = "
            f"{fmt_bytes(8 * psi + state)} on rank 0, exactly")


LAB = Lab(
    name="zero1", engine="zero1", number=4, title="ZeRO-1", chapter="chapter 6, ZeRO-1",
    stub_file="lab4_zero1.py", world_size=2,
    roles={"engine": ZeRO1Lab}, reference={"engine": ReferenceZeRO1}, measure=measure,
    checks=(Check(OWNERSHIP, None, 'chapter 6, "The idea" (who owns what)',
                  "slice r of bucket b is [r P / N, (r + 1) P / N) of its padded size P, on every rank, and every "
                  "master is in the model's dtype"),
            Check(PARITY, parity, 'chapter 6, "The idea"'),
            Check("bytes per step: reduce-scatter + all-gather = 2 Psi", bytes_per_step,
                  'chapter 6, "Two designs: all-reduce or reduce-scatter"'),
            Check("memory: (4 + 4) Psi + K Psi / N", memory, 'chapter 6, "Memory per rank against N_d"')),
    mistakes_module="zerolab.labs.zero1_mistakes",
    blame={**dict.fromkeys(("not_divided", "divided_twice", "all_reduce", "bytes", "zeros"), ("_reduce",)),
           **dict.fromkeys(("divided_not_reduced", "added_to_local", "not_reduced", "result_elsewhere"),
                           ("_complete",)),
           "not_updated": ("_publish",), "not_updated_own": ("_lay_out_masters", "_publish"),
           "memory": ("_lay_out_masters",), "weights": ("_publish",)},
)
