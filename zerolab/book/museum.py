"""When training goes wrong: real users' failures, reproduced on CPU ranks, for the museum chapter.

Each exhibit is a worker (run on every rank by zl.launch) and the one-process reference it is
judged against (zerolab.book.museum_reference). A worker makes the mistake users made, then
the fix, and returns numbers only: weights, norms, bytes, counts. The parent compares them with
one process on the global batch or with a closed form; nothing here prints.

    diverge            a rank runs one more micro-batch than the other (a hang, named at once)
    run_exhibits       every other exhibit in one launch, a dict per exhibit (bitwise=True: and
                       bitwise_exhibit's)

The exhibits run the default mode, as the users did, and are judged within round-off of one process
on the global batch. Two fixes also run with bitwise=True (bitwise_exhibit), where the reference is
one process adding the same chunks in the same fixed tree, and the weights are torch.equal.
"""

from __future__ import annotations

import functools
import math
import os
import re

import torch
import torch.distributed as dist
import torch.nn as nn

import zerolab as zl
from zerolab.runtime import recorder
from zerolab.book import museum_reference as ref

SGD = functools.partial(torch.optim.SGD, lr=0.1)


# ------------------------------------------------------------------ exhibit 1: ranks that diverge


TRAIN_PY = """\
engine = zl.ZeRO(mlp(), SGD, stage=2)
engine.comm.timeout = 5                                # seconds a collective may wait: a hang is bounded
for step in range(3):
    micro = 3 if (rank == 1 and step == 1) else 2     # rank 1's share of the data: one more
    for m in range(micro):
        loss = engine(inputs(step, m, rank)).pow(2).mean() / micro
        engine.backward(loss)
    engine.step()
    engine.zero_grad()
"""


def diverge(root: str):
    """Run TRAIN_PY on every rank, as the script train.py: ZeRO-2, two micro-batches a step, but
    at step 1 rank 1 counted one more micro-batch in its share of the data (DeepSpeed issue
    2223: ranks with different numbers of batches hang). The flight recorder names the lines of
    train.py that led each rank to the collective where they parted."""
    os.environ[recorder.DIR_ENV] = os.path.join(root, "records")
    # compiled under its own file name: the recorder names the first frame outside zerolab's
    # package (the user's script), and this module is inside it
    scope = {"zl": zl, "mlp": ref.mlp, "SGD": SGD, "inputs": ref.inputs, "rank": dist.get_rank()}
    exec(compile(TRAIN_PY, "train.py", "exec"), scope)
    return "never reached"


def diverge_on_torch_ddp() -> dict:
    """The same mistake under PyTorch's DistributedDataParallel, where the two ranks' extra
    micro-batches even out over the run (rank 1's at step 1, rank 0's at step 2): every
    all-reduce finds a partner, nothing hangs, and each rank averages its gradient with another
    step's. Returns this rank's weights at the end."""
    r = dist.get_rank()
    model = ref.mlp()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = SGD(ddp.parameters())
    for step in range(3):
        micro = 3 if (r, step) in ((1, 1), (0, 2)) else 2
        for m in range(micro):
            (ddp(ref.inputs(step, m, r)).pow(2).mean() / micro).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


_PARTED = re.compile(r"The ranks' sequences parted at collective #(\d+): rank 0 (.*?) \((\S+?):(\d+)\), "
                     r"rank 1 (.*?) \((\S+?):(\d+)\)\.")


def parting(message: str) -> dict:
    """The recorder's verdict from an error's text: the collective's number and, per rank, the
    operation and the line of train.py that led to it (its number and its text)."""
    m = _PARTED.search(message)
    if m is None:
        raise AssertionError(f"no parting named in: {message[-1500:]}")
    out = {"collective": int(m.group(1))}
    lines = TRAIN_PY.splitlines()
    for rank, (op, name, line) in enumerate((m.group(2, 3, 4), m.group(5, 6, 7))):
        text = lines[int(line) - 1].strip() if name == "train.py" else "?"
        out[rank] = (op, f"{name}:{line}", text)
    return out


# ------------------------------------------------------------------ the other exhibits, one launch


def _weights(engine) -> dict:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def lamb_exhibit() -> dict:
    """A LAMB step on zl.ZeRO(stage=2): whole parameters, as one process steps them (DeepSpeed
    issue 1285: LAMB's loss differs under ZeRO). Also ZeRO-1 with the same optimizer."""
    r = dist.get_rank()
    out = {}
    for stage in (1, 2):
        engine = zl.ZeRO(ref.mlp(), functools.partial(ref.Lamb, lr=0.05), stage=stage)
        for step in range(2):
            engine.backward(engine(ref.inputs(step, 0, r)).pow(2).mean())
            engine.step()
            engine.zero_grad()
        out[stage] = _weights(engine)
    return out


def clip_exhibit() -> dict:
    """The gradient norm under ZeRO-2: the norm of this rank's shard alone (pytorch issue 170862),
    what torch.nn.utils.clip_grad_norm_(model.parameters()) returns (each p.grad is a piece that
    knows it is sharded; max_norm=inf: nothing clipped) and engine.clip_grad_norm_."""
    r = dist.get_rank()
    model = ref.mlp()
    engine = zl.ZeRO(model, SGD, stage=2)
    engine.backward(engine(ref.inputs(0, 0, r)).pow(2).mean())
    torch_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))
    local = float(torch.cat([g.reshape(-1) for g in engine.owned_grads() if g is not None]).norm())
    before = engine.comm.bytes(tag="grad_norm")
    norm = engine.clip_grad_norm_(0.1)
    sent = engine.comm.bytes(tag="grad_norm") - before
    engine.step()
    return {"torch": torch_norm, "local": local, "global": norm, "bytes": sent, "weights": _weights(engine),
            "fsdp2": _clip_on_fsdp2()}


def _clip_on_fsdp2() -> dict:
    """The same gradient under FSDP2 (each parameter's rows cut over the ranks, DTensor shards):
    the norm of this rank's local shards, and what torch.nn.utils.clip_grad_norm_ returns."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = ref.mlp()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    model(ref.inputs(0, 0, dist.get_rank())).pow(2).mean().backward()
    local = float(torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()]).norm())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return {"local": local, "returned": float(norm)}


def token_exhibit(engine_kind: str, fixed: bool) -> dict:
    """One step on variable-length micro-batches (two per rank), each micro-batch's own mean
    divided by 2 (the habit) or zl.token_weighted_loss (the fix), on zl.ZeRO(stage=2) or
    PyTorch's DistributedDataParallel."""
    r = dist.get_rank()
    model = ref.tiny_lm()
    if engine_kind == "zerolab":
        engine = zl.ZeRO(model, SGD, stage=2)
        backward = engine.backward
    else:
        engine = nn.parallel.DistributedDataParallel(model)
        opt = SGD(engine.parameters())
        backward = torch.Tensor.backward
    batches = [ref.token_batch(r, m) for m in range(2)]
    tokens = zl.count_tokens([labels for _, labels in batches], getattr(engine, "comm", None))
    for ids, labels in batches:
        logits = engine(ids)
        if fixed:
            loss = zl.token_weighted_loss(logits, labels, tokens)
        else:
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)) / 2
        backward(loss)
    if engine_kind == "zerolab":
        engine.step()
        return {"tokens": tokens, "weights": _weights(engine)}
    opt.step()
    return {"tokens": tokens, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def twice_exhibit() -> dict:
    """A layer shared by two checkpointed blocks (reentrant): its gradient arrives twice in one
    backward (DeepSpeed issues 988 and 2103), on plain PyTorch and under zl.ZeRO(stage=2)."""
    r = dist.get_rank()
    model = ref.Shared()
    arrivals = []
    hook = model.shared.weight.register_post_accumulate_grad_hook(lambda p: arrivals.append(p.grad.norm().item()))
    model(ref.inputs(0, 0, r)).pow(2).mean().backward()      # plain PyTorch, this rank's batch
    hook.remove()
    full = model.shared.weight.grad.norm().item()
    engine = zl.ZeRO(ref.Shared(), SGD, stage=2)
    engine.backward(engine(ref.inputs(0, 0, r)).pow(2).mean())
    bytes_reduced = engine.comm.bytes(op="reduce_scatter")
    engine.step()
    small = zl.ZeRO(ref.Shared(), SGD, stage=2, bucket_mb=110 * 4 / 2**20)   # `out` and `shared` share a bucket
    try:
        small.backward(small(ref.inputs(0, 0, r)).pow(2).mean())
        late = ""
    except RuntimeError as err:          # the bucket left after the first part: refused, not lost
        late = str(err)
    return {"arrivals": arrivals, "full": full, "weights": _weights(engine), "reduced": bytes_reduced,
            "late": late}


def memory_exhibit() -> dict:
    """What ZeRO-2 with AdamW holds on this rank at four moments, measured."""
    r = dist.get_rank()
    engine = zl.ZeRO(ref.wide_mlp(), functools.partial(torch.optim.AdamW, lr=1e-3), stage=2, track_peak=True)
    seen = {"built": engine.memory_report()}
    engine.backward(engine(ref.wide_inputs(r)).pow(2).mean())
    seen["after backward"] = engine.memory_report()
    engine.step()
    seen["after step"] = engine.memory_report()
    engine.zero_grad()
    seen["after zero_grad"] = engine.memory_report()
    (bucket,) = engine.buckets.buckets            # (one bucket: 25 MB holds this model)
    return {"seen": seen, "padded": bucket.padded_numel, "sizes": list(bucket.sizes),
            "psi": sum(p.numel() for p in engine.module.parameters())}


def checkpoint_exhibit(path: str) -> dict:
    """Train ZeRO-2 with two small buckets, save a sharded checkpoint, and return each rank's
    flat master slices and the buckets' layout (what a converter that concatenates slices sees)."""
    r = dist.get_rank()
    engine = zl.ZeRO(ref.mlp(), SGD, stage=2, bucket_mb=100 * 4 / 2**20)   # 100 elements a bucket
    for step in range(2):
        engine.backward(engine(ref.inputs(step, 0, r)).pow(2).mean())
        engine.step()
        engine.zero_grad()
    zl.checkpoint.save(engine, path)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    layout = [[(names[id(p)], tuple(p.shape)) for p in b.params] for b in engine.buckets.buckets]
    return {"slices": [s.detach().clone() for s in engine.master_shards], "layout": layout,
            "full": _weights(engine)}


def bitwise_exhibit(root: str) -> dict:
    """Two fixes again with bitwise=True (engines.options.BITWISE): the token-weighted loss on
    zl.ZeRO(stage=2) (two micro-batches a rank: chunk 2 r + m), and ZeRO-2 trained two steps,
    saved as a sharded checkpoint and consolidated. Judged bit for bit against
    museum_reference.tokens_chunked and mlp_chunked; the tolerance of the default-mode exhibits is
    the order of addition alone."""
    r = dist.get_rank()
    engine = zl.ZeRO(ref.tiny_lm(), SGD, stage=2, bitwise=True)
    batches = [ref.token_batch(r, m) for m in range(2)]
    tokens = zl.count_tokens([labels for _, labels in batches], engine.comm)
    for ids, labels in batches:
        engine.backward(zl.token_weighted_loss(engine(ids), labels, tokens))
    engine.step()
    out = {"tokens": _weights(engine)}
    engine = zl.ZeRO(ref.mlp(), SGD, stage=2, bitwise=True)
    for step in range(2):
        engine.backward(engine(ref.inputs(step, 0, r)).pow(2).mean())
        engine.step()
        engine.zero_grad()
    zl.checkpoint.save(engine, os.path.join(root, "ckpt-bitwise"))
    out["checkpoint"] = _weights(engine)
    return out


def run_exhibits(root: str, bitwise: bool = False) -> dict:
    """Every exhibit but the hang, in one launch (each builds its own engine); bitwise=True adds
    bitwise_exhibit's two fixes under "bitwise"."""
    out = {"diverge on torch DDP": diverge_on_torch_ddp(), "lamb": lamb_exhibit(), "clip": clip_exhibit(),
            "tokens": {(kind, fixed): token_exhibit(kind, fixed)
                       for kind in ("zerolab", "torch DDP") for fixed in (False, True)},
            "twice": twice_exhibit(), "memory": memory_exhibit(),
            "checkpoint": checkpoint_exhibit(os.path.join(root, "ckpt"))}
    if bitwise:
        out["bitwise"] = bitwise_exhibit(root)
    return out
