"""Teaching variants and launched workers for chapters 6 (ZeRO-1) and 7 (ZeRO-2).

Two short ZeRO engines, each a design that real systems have used, and each paying for it
with something zl.ZeRO does not pay:

* AllReduceZeRO1 all-reduces every gradient, whole, keeps only the slice it owns, and after the
  step all-gathers the updated parameters: 2 Psi + Psi = 3 Psi per step, where a reduce-scatter
  (which leaves each rank exactly its slice) sends Psi for the gradients. These are the bytes of
  PyTorch's ZeroRedundancyOptimizer beside DDP (DDP's all-reduce, then each updated parameter
  broadcast from the rank that owns it) and of DeepSpeed's first stage 1, which all-reduced until
  its 2020 update to a reduce-scatter. What the design buys is simplicity: backward and the
  gradient reduction stay plain data parallelism's.
* KeepGradsZeRO2 reduce-scatters (2 Psi per step, like zl.ZeRO) but only after backward, and it
  never frees the full gradients: its memory is stage 1's, not stage 2's.

Both work parameter by parameter (one collective per tensor, each padded on its own), fp32
only. Everything goes through a zerolab.runtime.comm.Ledger, so the bytes are measured.
The run_* functions at the bottom are what the chapters launch with zl.launch.
"""

from __future__ import annotations

from functools import partial

import torch

from .. import engines
from ..runtime.comm import Ledger
from ..data import CharDataset
from ..engines.setup import broadcast_from_rank0
from ..launch import rank as _rank, world_size as _world_size
from ..memory import live_bytes, model_state_bytes, optimizer_tensors
from ..models import GPT, gpt_config, gpt_loss, num_params
from ..optim.checks import build_optimizer


class AllReduceZeRO1:
    """ZeRO-1 with an all-reduce: reduce every whole gradient, then keep your slice (3 Psi per step)."""

    reduce_op = "all_reduce"

    def __init__(self, model, optimizer):
        self.comm = Ledger()
        self.model = model
        self.n, self.rank = _world_size(), _rank()
        broadcast_from_rank0(list(model.parameters()) + list(model.buffers()), self.comm)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shards, self.slices = [], []
        for p in self.params:
            padded = -(-p.numel() // self.n) * self.n
            size = padded // self.n
            sl = slice(self.rank * size, (self.rank + 1) * size)
            flat = torch.zeros(padded)
            flat[:p.numel()] = p.detach().reshape(-1)
            self.slices.append((sl, padded))
            self.shards.append(flat[sl].clone())   # this rank's fp32 slice: the optimizer's
        self.optimizer = build_optimizer(optimizer, self.shards)

    def __call__(self, *inputs):
        return self.model(*inputs)

    def backward(self, loss):
        loss.backward()
        self._sync_gradients()

    def _padded_grad(self, p, padded):
        flat = torch.zeros(padded)
        if p.grad is not None:
            flat[:p.numel()] = p.grad.reshape(-1)
        return flat

    def _sync_gradients(self):
        for p, shard, (sl, padded) in zip(self.params, self.shards, self.slices):
            full = self._padded_grad(p, padded)
            full.div_(self.n)
            self.comm.all_reduce(full, tag="grad")   # every rank gets ALL of it...
            shard.grad = full[sl].clone()            # ...and keeps 1/N
            p.grad = full[:p.numel()].view_as(p)     # the full gradient stays on every rank

    @torch.no_grad()
    def step(self) -> bool:
        self.optimizer.step()
        for p, shard, (sl, padded) in zip(self.params, self.shards, self.slices):
            full = torch.empty(padded)
            self.comm.all_gather(full, shard.clone(), tag="param")
            p.copy_(full[:p.numel()].view_as(p))
        return True

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        for s in self.shards:
            s.grad = None

    def memory_report(self) -> dict:
        params = list(self.model.parameters())
        grads = [p.grad for p in params if p.grad is not None] + [s.grad for s in self.shards
                                                                   if s.grad is not None]
        opt = self.shards + optimizer_tensors(self.optimizer)
        out = {"params": live_bytes(params), "grads": live_bytes(grads, exclude=params),
               "optimizer": live_bytes(opt, exclude=params + grads)}
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        return out

    def full_state_dict(self) -> dict:
        return {k: v.detach().float().clone() for k, v in self.model.state_dict().items()}


class KeepGradsZeRO2(AllReduceZeRO1):
    """ZeRO-2 with a reduce-scatter after backward that keeps the full gradients (stage 1's memory)."""

    reduce_op = "reduce_scatter"

    def _sync_gradients(self):
        for p, shard, (sl, padded) in zip(self.params, self.shards, self.slices):
            full = self._padded_grad(p, padded)
            full.div_(self.n)
            out = torch.empty(padded // self.n)
            self.comm.reduce_scatter(out, full, tag="grad")
            shard.grad = out
            # the shortcut: p.grad (the whole local gradient) is never freed


# ------------------------------------------------------------------ launched by the chapters

OPT = partial(torch.optim.AdamW, lr=1e-3, eps=1e-6, weight_decay=0.1)


def _gpt(size="nano"):
    torch.manual_seed(0)
    return GPT(gpt_config(size, bias=False))


def _train(engine, steps, batch=2):
    """`steps` steps of GPT training. Returns the losses, the bytes each collective moved in the
    last step, and the memory measured after the last step, before zero_grad (gradients held)."""
    import torch.distributed as dist
    data = CharDataset(32)
    r, n = dist.get_rank(), dist.get_world_size()
    losses = []
    for s in range(steps):
        engine.comm.reset()              # the ledger keeps the last step only
        logits, loss = gpt_loss(engine, data.batch(s, batch, r, n))
        engine.backward(loss)
        engine.step()
        if s == steps - 1:
            memory = engine.memory_report()
        engine.zero_grad()
        losses.append(loss.item())
    sent = {op: engine.comm.bytes(op=op) for op in ("all_reduce", "reduce_scatter", "all_gather")}
    return losses, sent, memory


def run_variant(variant: str, steps: int = 3, size: str = "nano"):
    """One rank's view: bytes of the last step by collective, losses, final weights (full, fp32)."""
    model = _gpt(size)
    psi = num_params(model, trainable_only=True)
    if variant == "allreduce1":
        eng = AllReduceZeRO1(model, OPT)
    elif variant == "keepgrads2":
        eng = KeepGradsZeRO2(model, OPT)
    else:   # "ddp", "zero1", "zero2": zerolab's own engines
        eng = engines.make(variant, model, OPT, bucket_mb=0.05)
    losses, sent, memory = _train(eng, steps)
    state = eng.full_state_dict()
    return {"psi": psi, "bytes": sent, "losses": losses, "memory": memory, "state": state}


def agree(run, ref, tol: float = 2e-5) -> bool:
    """Whether two runs of run_variant reached the same losses and weights within `tol`.

    Not bit for bit: an all-reduce and a reduce-scatter add the ranks' gradients in different
    orders, and AdamW turns the round-off of a near-zero gradient into an update of up to
    lr * round-off / eps, about 3e-6 a step here (lr=1e-3, eps=1e-6); 2e-5 covers 3 steps.
    A real difference (a missed reduction, a wrong shard) moves weights by about lr = 1e-3."""
    if len(run["losses"]) != len(ref["losses"]) or run["state"].keys() != ref["state"].keys():
        return False
    losses = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))
    weights = max((run["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"])
    return losses <= tol and weights <= tol


def run_memory(stage: int, precision: str, size: str = "nano", bucket_mb: float = 0.05):
    """Measured model-state bytes on this rank after two steps, and the paper's formula."""
    from ..engines import ZeRO
    model = _gpt(size)
    psi = num_params(model, trainable_only=True)
    eng = ZeRO(model, OPT, stage=stage, precision=precision, bucket_mb=bucket_mb)
    losses, sent, memory = _train(eng, 2)
    n = eng.world_size
    if precision == "fp32":
        formula = model_state_bytes(psi, n, stage, k=8, param_bytes=4, grad_bytes=4)
    else:
        formula = model_state_bytes(psi, n, stage, k=12, param_bytes=2, grad_bytes=2)
    elem = torch.empty((), dtype=eng.precision.compute_dtype).element_size()
    return {"psi": psi, "n": n, "measured": memory, "formula": formula,
            "comm_bytes": sent["reduce_scatter"] + sent["all_gather"], "comm_other": sent["all_reduce"], "comm_paper": 2 * (n - 1) / n * psi * elem,
            "padded": eng.buckets.padded_numel}


def run_grad_timeline(stage: int, size: str = "tiny", bucket_mb: float = 0.05):
    """Gradient bytes this rank holds at each gradient hook of one backward (measured storages)."""
    from ..engines import ZeRO
    import torch.distributed as dist
    model = _gpt(size)
    psi = num_params(model, trainable_only=True)
    eng = ZeRO(model, OPT, stage=stage, bucket_mb=bucket_mb)
    data = CharDataset(32)
    r, n = dist.get_rank(), dist.get_world_size()
    _train(eng, 1)
    eng.grad_trace = []
    logits, loss = gpt_loss(eng, data.batch(1, 2, r, n))
    eng.backward(loss)
    trace = [b for _, b in eng.grad_trace]
    eng.grad_trace = None
    out = {"psi": psi, "trace": trace, "bucket_bytes": eng.bucket_mb * 2**20,
           "buckets": len(eng.buckets)}
    if stage == 2:
        out["buffer_bytes"] = eng.buffer_numel * 4
        out["max_buffers"] = eng.max_buffers
    return out


def run_variants(variants, steps: int = 3, size: str = "nano"):
    """run_variant for several engines in one launch: {variant: result}."""
    return {v: run_variant(v, steps, size) for v in variants}


def run_memory_many(configs, size: str = "nano"):
    """run_memory for several (stage, precision) pairs in one launch."""
    return {(stage, precision): run_memory(stage, precision, size) for stage, precision in configs}


def run_grad_timelines(size: str = "tiny", bucket_mb: float = 0.05):
    """run_grad_timeline for stage 1 and stage 2 in one launch."""
    return {stage: run_grad_timeline(stage, size, bucket_mb) for stage in (1, 2)}


def run_optimizer_half(steps: int = 3, size: str = "nano"):
    """Under PyTorch's own DistributedDataParallel, the same GPT trained with a plain AdamW,
    with PyTorch's ZeroRedundancyOptimizer and with zl.ShardedOptimizer (ZeRO-1's optimizer half):
    this rank's final weights and the bytes of optimizer state it holds with each."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    from ..optim.sharded_optimizer import ShardedOptimizer
    data = CharDataset(32)
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind in ("AdamW", "ZeroRedundancyOptimizer", "zl.ShardedOptimizer"):
        model = _gpt(size)
        ddp = DistributedDataParallel(model)
        if kind == "AdamW":
            opt = OPT(model.parameters())
        else:
            cls = ZeroRedundancyOptimizer if kind == "ZeroRedundancyOptimizer" else ShardedOptimizer
            opt = cls(model.parameters(), torch.optim.AdamW, **OPT.keywords)
        for s in range(steps):
            gpt_loss(ddp, data.batch(s, 2, r, n))[1].backward()
            opt.step()
            opt.zero_grad()
        inner = opt if kind == "AdamW" else opt.optim
        moments = [t for t in optimizer_tensors(inner) if t.dim() > 0]     # (not the step counters)
        out[kind] = {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                     "state_bytes": live_bytes(moments)}
        if kind == "zl.ShardedOptimizer":
            out["padded"] = sum(b.padded_numel for b in opt.buckets)
            out["gathered"] = opt.comm.bytes("all_gather") // steps
    out["psi"] = num_params(model, trainable_only=True)
    return out


# ------------------------------------------------------------------ what the optimizer is handed


def _decay_groups(params_by_name):
    """nanoGPT's configure_optimizers: weight decay on matrices, none on the rest."""
    named = list(params_by_name)
    return [{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]


def _plain_run(steps, start=None, first=0, size="nano"):
    """One process on the global batch with a plain AdamW: (model, optimizer)."""
    import torch.distributed as dist
    data = CharDataset(32)
    n = dist.get_world_size() if dist.is_initialized() else 1
    model = _gpt(size)
    opt = torch.optim.AdamW(_decay_groups(model.named_parameters()), lr=1e-3, eps=1e-6)
    if start is not None:
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["optimizer"])
    for s in range(first, steps):
        # the global batch: every rank's rows, in rank order, as one process sees them
        rows = [data.batch(s, 2, r, n) for r in range(n)]
        batch = tuple(torch.cat([b[i] for b in rows]) for i in range(2))
        gpt_loss(model, batch)[1].backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _zero1_run(steps, start=None, first=0, size="nano"):
    """zl.ZeRO(stage=1) on this rank's share, PyTorch's loop; `start` loaded nanoGPT's way
    (model and optimizer state first, then the model is wrapped)."""
    import torch.distributed as dist
    data = CharDataset(32)
    r, n = dist.get_rank(), dist.get_world_size()
    model = _gpt(size)
    if start is not None:
        model.load_state_dict(start["model"])
    opt = torch.optim.AdamW(_decay_groups(model.named_parameters()), lr=1e-3, eps=1e-6)
    if start is not None:
        opt.load_state_dict(start["optimizer"])
    engine = engines.ZeRO(model, opt, stage=1, bucket_mb=0.02)
    for s in range(first, steps):
        gpt_loss(engine, data.batch(s, 2, r, n))[1].backward()
        opt.step()
        opt.zero_grad()
    return engine, opt


def _gap(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


def run_optimizer_views(path: str, steps: int = 4, size: str = "nano"):
    """Chapter 6's look at what ZeRO-1's optimizer is handed and what its state dict holds, on
    this rank: the view of each parameter, then the state dict against a plain AdamW's, then
    nanoGPT's checkpoint habit (rank 0 saves, the resumed run loads before wrapping) and a plain
    run's checkpoint imported, each against the run that never stopped."""
    import torch.distributed as dist
    engine, opt = _zero1_run(steps, size=size)
    uninterrupted = engine.state_dict()
    names = [n for n, _ in engine.module.named_parameters()]
    held = [t for g in opt.param_groups for t in g["params"]]
    order = [n for g in _decay_groups(engine.module.named_parameters()) for n in
             [m for m, p in engine.module.named_parameters() if any(p is q for q in g["params"])]]
    out = {"views": [(n, tuple(p.shape), tuple(t.shape)) for n, t, p in
                     zip(order, held, [dict(engine.module.named_parameters())[n] for n in order])],
           "params": len(names), "held": len(held), "nonempty": sum(t.numel() > 0 for t in held),
           "state_entries": len(opt.state)}
    mine = opt.state_dict()                         # a collective: every rank calls it
    plain_model, plain_opt = _plain_run(steps, size=size)
    want = plain_opt.state_dict()
    out["same_groups"] = mine["param_groups"] == want["param_groups"]
    out["same_entries"] = sorted(mine["state"]) == sorted(want["state"])
    out["steps"] = sorted({int(st["step"]) for st in mine["state"].values()})
    out["state_gap"] = max(float((mine["state"][k][key] - v).abs().max())
                           for k, st in want["state"].items() for key, v in st.items())
    out["weights_gap"] = _gap(engine.state_dict(), plain_model.state_dict())
    # nanoGPT's habit: rank 0 saves halfway, every rank loads it and goes on
    half = steps // 2
    engine, opt = _zero1_run(half, size=size)
    checkpoint = {"model": engine.state_dict(), "optimizer": opt.state_dict()}
    if dist.get_rank() == 0:
        torch.save(checkpoint, path)
    dist.barrier()
    saved = torch.load(path, weights_only=True)
    resumed, _ = _zero1_run(steps, start=saved, first=half, size=size)
    out["resume_gap"] = _gap(resumed.state_dict(), plain_model.state_dict())
    out["resume_bitwise"] = _gap(resumed.state_dict(), uninterrupted) == 0.0
    # a plain PyTorch run's checkpoint, imported
    p_model, p_opt = _plain_run(half, size=size)
    imported, _ = _zero1_run(steps, start={"model": p_model.state_dict(), "optimizer": p_opt.state_dict()},
                             first=half, size=size)
    out["import_gap"] = _gap(imported.state_dict(), plain_model.state_dict())
    # and ours back into a plain optimizer in one process
    back, _ = _plain_run(steps, start=saved, first=half, size=size)
    out["export_gap"] = _gap(back.state_dict(), plain_model.state_dict())
    return out
