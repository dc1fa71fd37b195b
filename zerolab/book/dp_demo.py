"""Worker functions that chapters 4 (collectives) and 5 (data parallelism) launch.

Each returns plain Python values (lists, floats, dicts) so the notebook prints them in rank
order. Nothing here prints.
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from .. import engines
from ..theory.collectives import naive_reduce, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from ..runtime.comm import Ledger
from ..data import CharDataset
from ..models import GPT, gpt_config, gpt_loss

# ------------------------------------------------------------------ chapter 4


def start_values(rank: int, numel: int = 4) -> torch.Tensor:
    """Rank r starts with [10r+1, 10r+2, ...]: easy to follow by eye."""
    return torch.arange(1, numel + 1, dtype=torch.float32) + 10 * rank


def who_holds_what(with_bytes: bool = False):
    """Every collective on the same small tensors: what this rank holds before and after.

    with_bytes: return (holdings, {op: bytes this rank's ledger booked for it}) instead."""
    r, n = dist.get_rank(), dist.get_world_size()
    led = Ledger()
    out = {}
    x = start_values(r, n)

    t = x.clone()
    led.broadcast(t, src=0)
    out["broadcast"] = (x.tolist(), t.tolist())

    t = x.clone()
    naive_reduce(t, dst=0, ledger=led)      # only rank 0 ends up with the sum
    out["reduce"] = (x.tolist(), t.tolist() if r == 0 else [None] * n)

    t = x.clone()
    led.all_reduce(t)
    out["all_reduce"] = (x.tolist(), t.tolist())

    shard = torch.empty(1)
    led.reduce_scatter(shard, x.clone())
    out["reduce_scatter"] = (x.tolist(), [None] * r + shard.tolist() + [None] * (n - r - 1))

    mine = x[r:r + 1].clone()            # each rank starts with one piece
    full = torch.empty(n)
    led.all_gather(full, mine)
    out["all_gather"] = ([None] * r + mine.tolist() + [None] * (n - r - 1), full.tolist())
    if not with_bytes:
        return out
    sent = dict.fromkeys(out, 0)
    for rec in led.records:
        op = "reduce" if rec.tag == "naive_reduce" else rec.op
        if op in sent:
            sent[op] += rec.bytes_sent
    return out, sent


def ring_steps():
    """Ring all-reduce on 4 ranks, one element per chunk: this rank's buffer after every step."""
    r = dist.get_rank()
    record = []
    x = start_values(r, dist.get_world_size())
    before = x.tolist()
    ring_all_reduce(x, Ledger(), record=record)
    return [before] + [e["buffer"].tolist() for e in record], [(e["phase"], e["step"], e["sent"], e["received"])
                                                                 for e in record]


def ring_bytes_measured(numel: int):
    """Bytes this rank sent in each hand-written ring collective, and whether it matched torch."""
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(r)
    x = torch.randn(numel, generator=g)
    out = {}

    led = Ledger()
    mine = ring_all_reduce(x.clone(), led)
    ref = x.clone()
    dist.all_reduce(ref)   # torch's own, as the reference
    out["all_reduce"] = (led.bytes("send"), bool(torch.allclose(mine, ref, atol=1e-5)))

    led = Ledger()
    shard = ring_reduce_scatter(torch.empty(numel // n), x, led)
    out["reduce_scatter"] = (led.bytes("send"), bool(torch.allclose(shard, ref.chunk(n)[r], atol=1e-5)))

    led = Ledger()
    full = ring_all_gather(torch.empty(numel), shard, led)
    out["all_gather"] = (led.bytes("send"), bool(torch.allclose(full, ref, atol=1e-5)))
    return out


def all_reduce_times(sizes_numel, repeats: int = 10, warmup: int = 2):
    """Seconds of each of `repeats` fp32 all-reduces per size on this rank (after `warmup`).

    A barrier before each call lines the ranks up, so a repeat times the collective, not the
    wait for a late peer. The caller shows the spread: on a shared CPU it is wide.
    """
    out = []
    for numel in sizes_numel:
        x = torch.ones(int(numel))
        times = []
        for i in range(warmup + repeats):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            if i >= warmup:
                times.append(time.perf_counter() - t)
        out.append(times)
    return out


# ------------------------------------------------------------------ chapter 5


def _gpt(size, seed=0, bias=True):
    torch.manual_seed(seed)
    model = GPT(gpt_config(size, bias=bias))
    return model, CharDataset(model.cfg.block_size)


def _engine(mode, model, bucket_mb, precision="fp32"):
    opt = partial(torch.optim.AdamW, lr=3e-4)
    if mode == "naive":
        return engines.make("naive", model, opt, precision=precision, track_peak=False)
    return engines.make("ddp", model, opt, precision=precision, bucket_mb=bucket_mb, track_peak=False,
                        overlap=(mode == "overlapped"))


def timeline(mode: str, size: str = "small", batch: int = 4, bucket_mb: float = 1.0,
             warmup: int = 2, steps: int = 3):
    """Run a few steps; return every step's time, their median, and the last step's timeline (seconds)."""
    r, n = dist.get_rank(), dist.get_world_size()
    model, data = _gpt(size)
    eng = _engine(mode, model, bucket_mb)
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        eng.comm.reset()
        t0 = eng.comm.now()
        _, loss = gpt_loss(eng, data.batch(i, batch, r, n))
        t1 = eng.comm.now()
        eng.backward(loss)
        t2 = eng.comm.now()
        eng.step()
        eng.zero_grad()
        t3 = eng.comm.now()
        if i >= warmup:
            times.append(t3 - t0)
    lb = eng.last_backward
    compute = [(t0, t1, "forward"), (lb["start"], lb["compute_end"], "backward"), (t2, t3, "step")]
    comm = [(c.start, c.end, c.tag) for c in eng.comm.records if c.tag.startswith(("bucket", "grad"))]
    from .timeline import overlap_fraction
    return {"step_s": statistics.median(times), "step_times": times, "compute": compute, "comm": comm,
            "calls": len(comm), "overlap": overlap_fraction(comm, lb["compute_end"]),
            "wait_after_backward_s": lb["end"] - lb["compute_end"]}


def bucket_sweep(sizes_mb, size: str = "small", batch: int = 4, steps: int = 3):
    """Step times of the overlapped DDP for each bucket size (one engine per size), and their median."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = []
    for mb in sizes_mb:
        model, data = _gpt(size)
        eng = _engine("overlapped", model, mb)
        times = []
        for i in range(steps + 1):
            dist.barrier()
            t = time.perf_counter()
            _, loss = gpt_loss(eng, data.batch(i, batch, r, n))
            eng.backward(loss)
            eng.step()
            eng.zero_grad()
            if i:   # the first step warms up
                times.append(time.perf_counter() - t)
        out.append({"bucket_mb": mb, "buckets": len(eng.buckets.buckets), "step_s": statistics.median(times),
                    "step_times": times})
    return out


def bytes_per_step(size: str = "small", batch: int = 2, bucket_mb: float = 1.0, precision: str = "fp32"):
    """Bytes this rank sent in one training step, with the numbers the formula needs."""
    r, n = dist.get_rank(), dist.get_world_size()
    model, data = _gpt(size)
    eng = _engine("overlapped", model, bucket_mb, precision)
    eng.comm.reset()
    _, loss = gpt_loss(eng, data.batch(0, batch, r, n))
    eng.backward(loss)
    eng.step()
    grad_bytes = sum(c.bytes_sent for c in eng.comm.records if c.tag.startswith("bucket"))
    return {"psi": sum(p.numel() for p in model.parameters()), "padded": eng.buckets.padded_numel,
            "flags": len(eng.params), "element_size": eng.buckets.buckets[0].grad.element_size(),
            "bytes": grad_bytes, "other_bytes": eng.comm.bytes() - grad_bytes,
            "calls": sum(1 for c in eng.comm.records if c.tag.startswith("bucket"))}


def duplicated_memory(size: str = "small", precision: str = "bf16", batch: int = 2):
    """engine.memory_report() after one step: what this rank holds."""
    r, n = dist.get_rank(), dist.get_world_size()
    model, data = _gpt(size)
    eng = _engine("overlapped", model, 25.0, precision)
    _, loss = gpt_loss(eng, data.batch(0, batch, r, n))
    eng.backward(loss)
    eng.step()
    report = eng.memory_report()
    report["psi"] = sum(p.numel() for p in model.parameters())
    return report


def train_losses(steps: int = 5, size: str = "nano", batch: int = 4, bucket_mb: float = 0.02):
    """Train with zl.DDP from rank-dependent initial weights; return losses and final weights."""
    r, n = dist.get_rank(), dist.get_world_size()
    # bias=False here and in the reference: the attention key bias has an exactly-zero gradient,
    # pure round-off that AdamW would turn into visible steps in whichever order it was summed
    model, data = _gpt(size, seed=0 if r == 0 else 1000 + r, bias=False)   # the broadcast must make them equal
    eng = _engine("overlapped", model, bucket_mb)
    losses = []
    for i in range(steps):
        _, loss = gpt_loss(eng, data.batch(i, batch, r, n))
        eng.backward(loss)
        eng.step()
        eng.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": eng.full_state_dict(), "buckets": len(eng.buckets.buckets)}


def single_process_losses(steps: int = 5, size: str = "nano", global_batch: int = 8):
    """The reference: one process, plain PyTorch, the whole global batch each step."""
    model, data = _gpt(size, seed=0, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    losses = []
    for i in range(steps):
        _, loss = gpt_loss(model, data.batch(i, global_batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def timelines(modes=("naive", "bucketed", "overlapped"), size: str = "small", batch: int = 4,
              bucket_mb: float = 1.0, warmup: int = 1, steps: int = 2):
    """`timeline` for several engines in one launch (starting processes is not free)."""
    return {m: timeline(m, size, batch, bucket_mb, warmup, steps) for m in modes}


def bytes_and_memory(with_memory: bool = True):
    """bytes_per_step (fp32) and, optionally, duplicated_memory (bf16), in one launch."""
    return {"bytes": bytes_per_step(batch=1), "memory": duplicated_memory(batch=1) if with_memory else None}


def optimizer_step_times(size: str = "small", bucket_mb: float = 1.0, steps: int = 30) -> dict:
    """AdamW steps on a GPT's parameters three ways: one tensor at a time (torch's default on a
    CPU), all parameters in each operation (foreach=True, what the engines turn on), and the same
    numbers laid out in flat buckets as zl.DDP lays them out. Every step's ms for each (the three
    alternate, so a busy moment of the machine hits all of them), the largest difference between
    the parameter-wise and the flat results after `steps` steps (the same random gradients), and
    the operator calls one more step of each makes (aten_calls)."""
    from ..buckets import FlatBuckets, bucket_order
    torch.manual_seed(0)
    separate = GPT(gpt_config(size))
    together = GPT(gpt_config(size))
    flat_model = GPT(gpt_config(size))
    together.load_state_dict(separate.state_dict())
    flat_model.load_state_dict(separate.state_dict())
    fb = FlatBuckets(bucket_order(flat_model), bucket_mb * 2**20, world_size=1)
    fb.bind_params()
    fb.bind_grads()
    params, params_together = list(separate.parameters()), list(together.parameters())
    flats = [b.data for b in fb.buckets]
    optimizers = {"per_parameter": torch.optim.AdamW(params, lr=1e-3, foreach=False),
                  "foreach": torch.optim.AdamW(params_together, lr=1e-3, foreach=True),
                  "flat": torch.optim.AdamW(flats, lr=1e-3, foreach=False)}
    times = {k: [] for k in optimizers}
    for _ in range(steps):
        for p, p2, q in zip(params, params_together, flat_model.parameters()):
            p.grad = torch.randn_like(p)
            p2.grad = p.grad.clone()
            q.grad.copy_(p.grad)            # q.grad is q's view of its bucket's flat gradient
        for f, b in zip(flats, fb.buckets):
            f.grad = b.grad
        for name, opt in optimizers.items():
            t = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t)
    diff = max(max((p - q).abs().max().item(), (p2 - q).abs().max().item())
               for p, p2, q in zip(params, params_together, flat_model.parameters()))
    # then one more step of each, counting the calls it makes into PyTorch's operators (exact)
    ops = {name: aten_calls(opt.step) for name, opt in optimizers.items()}
    return {"tensors": len(params), "buckets": len(flats), "max_abs_diff": diff,
            **{k: statistics.median(v) * 1e3 for k, v in times.items()},
            "ms": {k: [t * 1e3 for t in v] for k, v in times.items()}, "ops": ops}


def aten_calls(fn) -> dict:
    """Run fn() once, counting its calls into PyTorch's operator library (aten): {"calls": all of
    them, "scalar_reads": those that copy one number back to Python (a tensor's .item())}.

    Each call pays a fixed cost on the CPU (dispatch, checks) however small its tensor: that is
    what a step over many small tensors spends its time on."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"calls": 0, "scalar_reads": 0}

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if name.startswith("aten."):
                counts["calls"] += 1
                counts["scalar_reads"] += name.startswith("aten._local_scalar_dense")
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return counts
