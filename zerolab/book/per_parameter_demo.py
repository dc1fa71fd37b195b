"""Runs for chapter 14 (sharding per parameter): zerolab's flat units beside FSDP2's per-parameter
shards, the persistence threshold, Muon's bytes. Launched workers; the parent prints.

Every number comes from a run: zerolab's collectives from its ledger, FSDP2's from the calls it
makes to torch.distributed (counted here by wrapping all_gather_single, reduce_scatter_single and
all_reduce for the length of the run), memory from the storages each rank holds. The closed
forms the chapter compares them with are computed from the model's shapes alone
(`flat_padding`, `dim0_padding`, `cut_exchange_bytes`), never from what a run recorded.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from zerolab.data import CharDataset
from zerolab.engines.zero3 import ZeRO3
from zerolab.engines.zero3.units import Unit
from zerolab.memory import live_bytes
from zerolab.models import GPT, gpt_config, gpt_loss

SIZE = "small"
ROWS = 2                                    # sequences per rank per step
ADAMW = dict(lr=1e-3, weight_decay=0.0, foreach=True)   # (the engines ask for it anyway: the same arithmetic everywhere)
MUON = dict(lr=0.02)


def gpt(size=SIZE):
    """The chapter's GPT: 126 wide (3 heads), so that neither layout divides evenly by N."""
    torch.manual_seed(0)
    return GPT(gpt_config(size, n_embd=126, n_head=3, bias=True))


def _batch(step, size=SIZE, same=False):
    """This rank's share of step `step`'s batch; same=True: every rank the same rows (then the
    averaged gradient at N = 2 is the one process's bit for bit: (g/2 + g/2) is exact)."""
    data = CharDataset(gpt_config(size).block_size)
    return data.batch(step, ROWS) if same else data.batch(step, ROWS, dist.get_rank(), dist.get_world_size())


def _median_spread(xs):
    return statistics.median(xs), min(xs), max(xs)


# ------------------------------------------------------------------ closed forms (shapes only)


def flat_padding(unit_sizes, n) -> int:
    """Elements of padding when each unit is one flat buffer padded to a multiple of n."""
    return sum(-(-k // n) * n - k for k in unit_sizes)


def dim0_padding(shapes, n) -> int:
    """Elements of padding when each parameter is cut on dim 0 into n chunks of ceil(d0 / n) rows
    (FSDP2: every rank's shard of a parameter has the same number of rows, the last padded)."""
    out = 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        rest = 1
        for d in shape[1:]:
            rest *= d
        out += (-(-rows // n) * n - rows) * rest
    return out


def cut_pieces(buckets, n) -> list:
    """The parameters a shard's edge cuts, among those stepped whole: one dict per cut parameter,
    {"bucket", "offset", "size", "pieces": {rank: elements it holds}, "owner"}, the owner being the
    rank with the largest piece (the lowest on a tie). buckets: [(padded size, [(offset, size,
    stepped whole?)])], as `cut_exchange_bytes` takes them."""
    out = []
    for b, (padded, params) in enumerate(buckets):
        shard = padded // n
        for o, k, whole in params:
            ranks = list(range(o // shard, (o + k - 1) // shard + 1))
            if not whole or len(ranks) < 2:
                continue
            piece = {r: min(o + k, (r + 1) * shard) - max(o, r * shard) for r in ranks}
            owner = min(ranks, key=lambda r: (-piece[r], r))
            out.append({"bucket": b, "offset": o, "size": k, "pieces": piece, "owner": owner})
    return out


def exchange_blocks(buckets, n) -> list:
    """held[r][o]: the elements rank r holds of the parameters rank o owns (r != o), summed over the
    buckets: the blocks of the exchange's all-to-all before they are padded to the largest, L."""
    held = [[0] * n for _ in range(n)]
    for cut in cut_pieces(buckets, n):
        for r, k in cut["pieces"].items():
            if r != cut["owner"]:
                held[r][cut["owner"]] += k
    return held


def cut_exchange_bytes(buckets, n) -> int:
    """12 (N-1) X, the bytes each rank sends per step for the matrices a shard's edge cuts:
    buckets: [(padded size, [(offset, size, stepped whole?)])]; X: the most elements one rank holds
    of the parameters one other rank owns (the owner: the rank with the largest piece)."""
    return 12 * (n - 1) * max(max(row) for row in exchange_blocks(buckets, n))


# ------------------------------------------------------------------ FSDP2's collectives, counted


@contextlib.contextmanager
def counted_collectives(calls: list):
    """Every all_gather_single / reduce_scatter_single / all_reduce made inside, as (op, bytes this
    rank sends by the ring accounting of zerolab.runtime.comm). FSDP2 calls them through torch.distributed."""
    n = dist.get_world_size()
    names = ("all_gather_single", "reduce_scatter_single", "all_reduce")
    saved = {name: getattr(dist, name) for name in names}

    def wrap(name, fn):
        def call(*args, **kwargs):
            if name == "all_reduce":
                t = kwargs.get("tensor", args[0] if args else None)
                calls.append((name, round(2 * (n - 1) / n * t.numel() * t.element_size())))
            else:
                whole = kwargs.get("output", kwargs.get("output_tensor", args[0] if args else None)) \
                    if name == "all_gather_single" else kwargs.get("input", args[1] if len(args) > 1 else None)
                calls.append((name, round((n - 1) / n * whole.numel() * whole.element_size())))
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _fsdp2(model, reshard_root=True):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_root)   # (the root too: 3 passes, as ZeRO-3)
    return model


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


# ------------------------------------------------------------------ the two designs, side by side


def _train(step_fn, steps):
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        step_fn(s)
        times.append(time.perf_counter() - t0)
    return times[1:]                        # (the first step makes the optimizer's state)


def side_by_side(steps=5):
    """zl.ZeRO(stage=3) on flat units and FSDP2's fully_shard on the same GPT, AdamW, the same
    batches: per step, each rank's collectives and bytes, the model states it holds, the step's
    time; the layout of one block on every rank (the chapter's figure)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    out = {"n": n}

    engine = ZeRO3(gpt(), partial(torch.optim.AdamW, **ADAMW))

    def zl_step(s):
        if s == steps - 1:
            engine.comm.reset()
        gpt_loss(engine, _batch(s))[1].backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    times = _train(zl_step, steps)
    ops = [r.op for r in engine.comm.records]
    mem = engine.memory_report()
    out["zerolab"] = {"collectives": len(ops), "by_op": {op: ops.count(op) for op in set(ops)},
                      "bytes": engine.comm.bytes(), "reduced_flags": engine.comm.bytes("all_reduce"),
                      "times": times, "memory": mem["total"],
                      "units": {u.name: (sum(b.numel for b in u.buckets.values()), u.numel) for u in engine.units},
                      "weights": engine.full_state_dict()}
    unit = engine.units[1]                  # blocks.0: the figure's block
    names = {id(p): name for name, p in unit.module.named_parameters()}
    bucket = unit.buckets["train"]
    out["zerolab"]["layout"] = {"shard": bucket.padded_numel // n, "params": [
        (names[id(p)], o, k) for p, o, k in zip(bucket.params, bucket.offsets, bucket.sizes)]}

    model = _fsdp2(gpt())
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    calls: list = []

    def fsdp_step(s):
        if s == steps - 1:
            calls.clear()
        gpt_loss(model, _batch(s))[1].backward()
        opt.step()
        opt.zero_grad()
    with counted_collectives(calls):
        times = _train(fsdp_step, steps)
    held = [_local(p) for p in model.parameters()] + [_local(v) for st in opt.state.values()
                                                       for v in st.values() if torch.is_tensor(v)]
    out["fsdp2"] = {"collectives": len(calls), "by_op": {op: [c[0] for c in calls].count(op) for op, _ in calls},
                    "bytes": sum(b for _, b in calls), "times": times, "memory": live_bytes(held),
                    "shapes": {name: tuple(p.shape) for name, p in model.named_parameters()},
                    "local_rows": {name: _local(p).shape[0] if _local(p).dim() else 1
                                   for name, p in model.blocks[0].named_parameters()},
                    "weights": {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                                for k, v in model.state_dict().items()}}
    out["rank"] = rank
    return out


# ------------------------------------------------------------------ the persistence threshold


def persistent_unit_class(threshold: int):
    """A ZeRO-3 unit that stays gathered from its first gather until the step when it holds at
    most `threshold` elements: DeepSpeed's stage3_param_persistence_threshold (small parameters
    whole on every rank, one all-gather per step instead of two)."""
    class PersistentUnit(Unit):
        def release(self, phase):
            if phase in ("forward", "backward") and self.numel <= threshold:
                return                      # (whole on every rank until the step)
            super().release(phase)
    return PersistentUnit


def fine_units(model) -> list:
    """Every LayerNorm, attention and MLP of every block its own unit (DeepSpeed gathers module by
    module): the LayerNorms are the small parameters."""
    return [f"blocks.{i}.{part}" for i in range(len(model.blocks)) for part in ("ln1", "attn", "ln2", "mlp")]


def persistence(thresholds=(0, 1000, 100_000), steps=5):
    """ZeRO-3 on fine units at each threshold: collectives and bytes per step, the parameters
    held at the end of backward, the step's time."""
    out = {}
    for threshold in thresholds:
        engine_class = type("PersistentZeRO3", (ZeRO3,), {"unit_class": persistent_unit_class(threshold)})
        model = gpt()
        engine = engine_class(model, partial(torch.optim.AdamW, **ADAMW), units=fine_units(model))
        held = []

        def step(s):
            if s == steps - 1:
                engine.comm.reset()
            gpt_loss(engine, _batch(s))[1].backward()
            held.append(engine.memory_report()["params"])
            engine.optimizer.step()
            engine.optimizer.zero_grad()
        times = _train(step, steps)
        persistent = [u for u in engine.units if u.numel <= threshold]
        out[threshold] = {"collectives": len([r for r in engine.comm.records if r.op == "all_gather"]),
                          "bytes": engine.comm.bytes("all_gather"), "params_held": held[-1], "times": times,
                          "persistent_units": len(persistent),
                          "persistent_elements": sum(u.numel for u in persistent),
                          "weights": engine.full_state_dict()}
    out["unit_sizes"] = sorted({u.numel for u in engine.units})
    return out


# ------------------------------------------------------------------ Muon


def _muon_and_adamw(named):
    """Muon's rule (Keller Jordan's, nanochat's): the blocks' matrices to Muon; embeddings, head,
    biases and norms to AdamW."""
    import zerolab as zl
    named = list(named)
    matrices = [p for n, p in named if p.ndim == 2 and n.startswith("blocks.")]
    rest = [p for n, p in named if not (p.ndim == 2 and n.startswith("blocks."))]
    return zl.CombinedOptimizer(torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(rest, **ADAMW))


def _buckets(engine):
    return [u.buckets["train"] for u in engine.units if "train" in u.buckets] \
        if hasattr(engine, "units") else engine.buckets.buckets


def _layout(engine, whole):
    return [(b.padded_numel, [(o, k, id(p) in whole) for p, o, k in zip(b.params, b.offsets, b.sizes)])
            for b in _buckets(engine)]


def _names(engine, model):
    """Each bucket's parameter names, in the order `_layout` lists them."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [[names.get(id(p), "?") for p in b.params] for b in _buckets(engine)]


def muon_on_zero(stages=(2, 3), steps=5):
    """Muon beside AdamW on ZeRO-2 and ZeRO-3, and AdamW alone: per step, the bytes of the engine's
    own collectives and of the exchange of the cut matrices (ledger) beside 12 (N-1) X, the
    optimizer's bytes on each rank, the step's time."""
    import zerolab as zl
    out = {}
    for stage in stages:
        for name in ("adamw", "muon + adamw"):
            model = gpt()
            opt = torch.optim.AdamW(model.parameters(), **ADAMW) if name == "adamw" else \
                _muon_and_adamw(model.named_parameters())
            engine = zl.ZeRO(model, opt, stage=stage)

            def step(s):
                if s == steps - 1:
                    engine.comm.reset()
                gpt_loss(engine, _batch(s))[1].backward()
                opt.step()
                opt.zero_grad()
            times = _train(step, steps)
            whole = {id(p) for n_, p in model.named_parameters() if p.ndim == 2 and n_.startswith("blocks.")} \
                if name != "adamw" else set()
            out[(stage, name)] = {
                "exchange": engine.comm.bytes(tag="whole:"),
                "engine": engine.comm.bytes() - engine.comm.bytes(tag="whole:"),
                "predicted": cut_exchange_bytes(_layout(engine, whole), engine.world_size),
                "layout": _layout(engine, whole), "names": _names(engine, model),
                "optimizer": engine.memory_report()["optimizer"], "times": times,
                "weights": engine.full_state_dict()}
    return out


def muon_on_fsdp2(steps=3):
    """torch.optim.Muon over FSDP2's DTensor shards, as written: the collectives its last step makes
    (DTensor redistributes inside the Newton-Schulz iteration, through torch's functional
    collectives: counted by its CommDebugMode) and the weights after `steps`."""
    from torch.distributed.tensor.debug import CommDebugMode
    model = _fsdp2(gpt())
    opt = _muon_and_adamw(model.named_parameters())
    for s in range(steps):
        gpt_loss(model, _batch(s, same=True))[1].backward()
        mode = CommDebugMode()
        with mode:
            opt.step()
        opt.zero_grad()
    counts = {str(op).split(".")[-1]: k for op, k in mode.get_comm_counts().items()}
    return {"collectives": sum(counts.values()), "by_op": counts, "weights": _full(model)}


def muon_steps_on_zero(steps=3, stage=3):
    """The same Muon and AdamW on zl.ZeRO: the weights after `steps`."""
    import zerolab as zl
    model = gpt()
    opt = _muon_and_adamw(model.named_parameters())
    engine = zl.ZeRO(model, opt, stage=stage)
    for s in range(steps):
        gpt_loss(engine, _batch(s, same=True))[1].backward()
        opt.step()
        opt.zero_grad()
    return engine.full_state_dict()


def one_process_muon(steps=3):
    """The reference: one process on the batch every rank had (same=True), Muon beside AdamW."""
    model = gpt()
    opt = _muon_and_adamw(model.named_parameters())
    data = CharDataset(gpt_config(SIZE).block_size)
    for s in range(steps):
        gpt_loss(model, data.batch(s, ROWS))[1].backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def worst(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)



# ------------------------------------------------------------------ checkpoints that cross engines


def _full(model) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
            for k, v in model.state_dict().items()}


def fsdp2_saves(directory, steps=3):
    """FSDP2 trains and saves as PyTorch's recipe does: get_state_dict, dcp.save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = _fsdp2(gpt())
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for s in range(steps):
        gpt_loss(model, _batch(s))[1].backward()
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    return _full(model)


def zerolab_loads(directory, stage=3):
    """zl.ZeRO at this world size reads it, and saves itself as DCP beside it."""
    import zerolab as zl
    model = gpt()
    engine = zl.ZeRO(model, torch.optim.AdamW(model.parameters(), **ADAMW), stage=stage)
    zl.checkpoint.load(engine, directory)
    loaded = engine.full_state_dict()
    zl.checkpoint.save(engine, directory + "-zerolab", format="dcp")
    return loaded


def fsdp2_loads(directory):
    """FSDP2 reads zerolab's directory with its own code."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = _fsdp2(gpt())
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    steps = {float(st["step"]) for st in opt.state.values()}
    return _full(model), steps
