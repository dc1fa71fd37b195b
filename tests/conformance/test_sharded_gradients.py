"""p.grad and p under zl.ZeRO read as under FSDP2: PyTorch's own code on them runs unchanged.

After a sharded backward each p.grad is this rank's piece of the averaged gradient, a tensor that
knows it is sharded (zerolab.engines.grad_guard), as FSDP2's are DTensors. Each test runs the
same script on FSDP2 (fully_shard on each block, then on the root), PyTorch's own
DistributedDataParallel or one process on the global batch, and on zerolab's engines, in the same
processes, and compares zerolab's result with theirs, never with zerolab's own:

* torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) on a GPT with a tied embedding:
  through its per-tensor path (foreach=None: PyTorch takes it for any tensor subclass) and its
  foreach path (foreach=True: torch._foreach_norm and _foreach_mul_), the norm it returns and the
  weights after the step, against one process on the global batch and FSDP2; clip_grad_value_;
* after backward, p.grad.shape == p.shape == p.data.shape and p.grad.dtype == p.dtype on every
  parameter, as FSDP2's, in fp32 and bf16; under ZeRO-3 the values stay unreadable outside
  gathered_parameters(), and reading them says so;
* torch.autograd.grad(loss, model.parameters()): this rank's own gradients, unreduced, exactly
  PyTorch DDP's; no step follows from it, and the next real backward trains as before;
* nanoGPT's training loop (Karpathy's train.py, its step section as written: gradient
  accumulation with require_backward_grad_sync, GradScaler, scaler.unscale_, then
  torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip) with grad_clip = 1.0) on every
  engine, against PyTorch DDP running the same loop.

The weights are compared within cases.TOL (1e-6; AdamW's within tests/tolerances.py's bound); the
norms within 1e-6 relative. The ranks and the one process add the batch's gradients in different
orders, so both differ by round-off only.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import zerolab as zl

from cases import TOL
from tolerances import fp32_adamw_tol

pytestmark = pytest.mark.slow     # launches ranks (make test-fast leaves it out)

ENGINES = ("single", "naive", "ddp", "zero1", "zero2", "zero3")
STEPS, ROWS, MAX_NORM, CLIP_VALUE = 3, 8, 0.5, 2e-3


def gpt(**overrides):
    torch.manual_seed(0)
    cfg = zl.models.gpt_config("nano", n_layer=2, n_embd=24, n_head=2, block_size=8, vocab_size=61,
                               tie_weights=True, **overrides)
    return zl.models.GPT(cfg)


def batch(step, rows=ROWS):
    g = torch.Generator().manual_seed(500 + step)
    data = torch.randint(0, 61, (rows, 9), generator=g)
    return data[:, :-1], data[:, 1:]


def mine(step):
    """This rank's rows of the global batch (all of them in one process)."""
    x, y = batch(step)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x, y
    n, r = dist.get_world_size(), dist.get_rank()
    per = ROWS // n
    return x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]


def loss_of(model, rows):
    x, y = rows
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def weights(model_or_engine) -> dict:
    if isinstance(model_or_engine, nn.Module):
        sd = model_or_engine.state_dict()
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
                for k, v in sd.items()}
    return {k: v.detach().float().clone() for k, v in model_or_engine.full_state_dict().items()}


def worst(a, b) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def wrap(name, model, optimizer=None, **options):
    if name == "single":
        return zl.SingleProcess(model, optimizer, **options)
    return zl.engines.make(name, model, optimizer, **options)


# ------------------------------------------------------------------ clip_grad_norm_ and clip_grad_value_


def clipped_loop(kind, foreach=None, value=False):
    """PyTorch's loop with torch.nn.utils' clipping between backward and step: (the norms the
    clip returned at each step, the weights after the last step)."""
    model = gpt()
    if kind == "one process":
        net, rows = model, batch
    elif kind == "fsdp2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        net, rows = fully_shard(model, mesh=mesh), mine
    else:
        net, rows = wrap(kind, model), mine
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    norms, sent = [], []
    for step in range(STEPS):
        loss_of(net, rows(step)).backward()
        params = (net.module if hasattr(net, "module") else net).parameters()
        before = net.comm.bytes() if hasattr(net, "comm") else 0
        if value:
            torch.nn.utils.clip_grad_value_(params, CLIP_VALUE, foreach=foreach)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=foreach)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        sent.append(net.comm.bytes() - before if hasattr(net, "comm") else None)
        opt.step()
        opt.zero_grad()
    if kind not in ("one process", "fsdp2"):
        norms = (norms, sent)
    return norms, weights(net)


def clip_runs():
    out = {}
    for foreach in (None, True):
        for kind in ("fsdp2",) + ENGINES[1:]:
            out[kind, foreach] = clipped_loop(kind, foreach)
    for kind in ("fsdp2", "zero1", "zero2", "zero3"):
        out[kind, "value"] = clipped_loop(kind, value=True)
    return out


# ------------------------------------------------------------------ shapes and dtypes after backward


def shapes_after_backward(kind, precision="fp32"):
    """After a backward: [(name, p.shape, p.data.shape, p.grad.shape, p.dtype, p.grad.dtype)], and
    what reading a released weight's values says (ZeRO-3)."""
    model = gpt()
    if kind == "fsdp2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        net = fully_shard(model, mesh=mesh)
        params = net.named_parameters()
    else:
        net = wrap(kind, model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)
        params = net.module.named_parameters()
    loss_of(net, mine(0)).backward()
    rows = [(n, tuple(p.shape), tuple(p.data.shape), tuple(p.grad.shape), p.dtype, p.grad.dtype,
             p.grad.numel(), p.numel()) for n, p in params]
    read = None
    if kind == "zero3":
        try:
            net.module.head.weight.data.sum()
            read = "read"
        except RuntimeError as e:
            read = str(e)
    return rows, read


def shape_runs():
    out = {("fsdp2", "fp32"): shapes_after_backward("fsdp2")}
    for kind in ENGINES[1:]:
        for precision in ("fp32", "bf16"):
            out[kind, precision] = shapes_after_backward(kind, precision)
    return out


# ------------------------------------------------------------------ autograd.grad w.r.t. the parameters


def grads_by_autograd(kind):
    """torch.autograd.grad(loss, parameters) on this rank's rows; then whether a step is refused
    (no backward ran), then one real backward and step: (the gradients, the refusal, the weights)."""
    model = gpt()
    if kind == "torch ddp":
        net = DistributedDataParallel(model)
        params = list(net.parameters())
    else:
        net = wrap(kind, model, torch.optim.SGD(model.parameters(), lr=0.5))
        params = list(net.module.parameters())
    grads = torch.autograd.grad(loss_of(net, mine(0)), params)
    got = [g.detach().clone() for g in grads]
    refused = None
    if kind != "torch ddp":
        try:
            net.optimizer.step()
        except RuntimeError as e:
            refused = str(e)
        opt = net.optimizer
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
    loss_of(net, mine(1)).backward()
    opt.step()
    opt.zero_grad()
    return got, refused, weights(model if kind == "torch ddp" else net)


def autograd_runs():
    return {kind: grads_by_autograd(kind) for kind in ("torch ddp",) + ENGINES[1:]}


# ------------------------------------------------------------------ nanoGPT's loop, clip line included


def get_lr(it, learning_rate=1e-3, warmup_iters=2, lr_decay_iters=6, min_lr=1e-4):
    """nanoGPT's get_lr: linear warmup, then cosine decay to min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def configure_optimizers(model, weight_decay, learning_rate, betas):
    """nanoGPT's GPT.configure_optimizers: decay the matrices, not the biases and LayerNorms."""
    param_dict = {pn: p for pn, p in model.named_parameters() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    optim_groups = [{"params": decay_params, "weight_decay": weight_decay},
                    {"params": nodecay_params, "weight_decay": 0.0}]
    return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, eps=1e-6)   # (tolerances.py)


NANO_ITERS = 4


def nanogpt(kind, max_iters=NANO_ITERS, gradient_accumulation_steps=2, grad_clip=1.0):
    """train.py's loop, as written there, around the wrap line: DDP(model) or zerolab's engine.
    Returns the norms its clip line saw and the weights after max_iters iterations."""
    ddp_rank, ddp_world_size = dist.get_rank(), dist.get_world_size()
    model = gpt()
    scaler = torch.amp.GradScaler("cpu", enabled=False)       # (dtype == 'float16' only)
    optimizer = configure_optimizers(model, 0.1, 1e-3, (0.9, 0.95))
    if kind == "torch ddp":
        model = DistributedDataParallel(model)
    else:
        model = wrap(kind, model, optimizer)
    raw_model = model.module
    norms = []

    def get_batch(it, micro):             # 4 rows a micro-step over all ranks, whatever N
        g = torch.Generator().manual_seed(10_000 + 100 * it + micro)
        data = torch.randint(0, 61, (4, 9), generator=g)
        per = 4 // ddp_world_size
        rows = data[per * ddp_rank:per * ddp_rank + per]
        return rows[:, :-1], rows[:, 1:]

    X, Y = get_batch(0, 0)
    for iter_num in range(max_iters):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        for micro_step in range(gradient_accumulation_steps):
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
            logits = model(X)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), Y.reshape(-1))
            loss = loss / gradient_accumulation_steps
            X, Y = get_batch(iter_num, micro_step + 1)
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return norms, weights(raw_model if kind == "torch ddp" else model)


def nanogpt_runs():
    return {kind: nanogpt(kind) for kind in ("torch ddp",) + ENGINES[1:]}


# ------------------------------------------------------------------ one launch per world size


def everything():
    return {"clip": clip_runs(), "shapes": shape_runs(), "autograd": autograd_runs(), "nanogpt": nanogpt_runs()}


@pytest.fixture(scope="module", params=[2, 4], ids=["N=2", "N=4"])
def seen(request):
    return request.param, zl.launch(everything, request.param)


def test_clip_grad_norm_on_model_parameters_returns_one_processs_norm_and_clips_to_its_weights(seen):
    n, ranks = seen
    for foreach in (None, True):
        norms, want = clipped_loop("one process", foreach)
        assert min(norms) > MAX_NORM                    # (every step clipped)
        for r in ranks:
            for kind in ("fsdp2",) + ENGINES[1:]:
                got_norms, got = r["clip"][kind, foreach]
                if kind != "fsdp2":             # what the clip sent: one fp64 number's all-reduce
                    got_norms, sent = got_norms
                    one = 2 * (n - 1) / n * 8 if kind.startswith("zero") else 0
                    assert sent == [one] * STEPS, (kind, foreach, sent)
                for a, b in zip(got_norms, norms):
                    assert math.isclose(a, b, rel_tol=1e-6), (kind, foreach, got_norms, norms)
                assert worst(got, want) <= TOL, (kind, foreach, worst(got, want))
        assert worst(want, weights(gpt())) > 1e3 * TOL  # (it trained)


def test_clip_grad_value_clamps_each_piece_as_one_process_clamps_the_whole(seen):
    n, ranks = seen
    _, want = clipped_loop("one process", value=True)
    _, unclipped = clipped_loop("one process", foreach=None)
    assert worst(want, unclipped) > 1e3 * TOL           # (the clamp changed the steps)
    for r in ranks:
        for kind in ("fsdp2", "zero1", "zero2", "zero3"):
            sent, got = r["clip"][kind, "value"]
            assert kind == "fsdp2" or sent[1] == [0] * STEPS, (kind, sent)   # (a clamp sends nothing)
            assert worst(got, want) <= TOL, (kind, worst(got, want))


def test_gradient_and_parameter_shapes_and_dtypes_read_as_under_fsdp2(seen):
    n, ranks = seen
    for r in ranks:
        theirs, _ = r["shapes"]["fsdp2", "fp32"]
        for (kind, precision), (rows, read) in r["shapes"].items():
            assert [row[0] for row in rows] == [row[0] for row in theirs], kind
            for name, shape, data_shape, grad_shape, dtype, grad_dtype, grad_numel, numel in rows:
                assert shape == data_shape == grad_shape, (kind, precision, name)
                assert grad_dtype == dtype, (kind, precision, name)
                assert grad_numel == numel, (kind, precision, name)
                if kind != "fsdp2":
                    assert dtype == (torch.bfloat16 if precision == "bf16" else torch.float32), (kind, name)
            # FSDP2's sharded parameters report the same shapes
            assert [row[1:4] for row in rows] == [row[1:4] for row in theirs], (kind, precision)
            if kind == "zero3":
                assert "gathered_parameters" in read, read


def test_autograd_grad_with_respect_to_the_parameters_returns_pytorch_ddps_local_gradients(seen):
    n, ranks = seen
    for r in ranks:
        theirs, _, their_weights = r["autograd"]["torch ddp"]
        for kind in ENGINES[1:]:
            got, refused, trained = r["autograd"][kind]
            assert len(got) == len(theirs)
            for a, b in zip(got, theirs):
                assert a.shape == b.shape and float((a - b).abs().max()) <= TOL, kind
            assert "before backward" in refused, (kind, refused)
            assert worst(trained, their_weights) <= TOL, (kind, worst(trained, their_weights))
    # the gradients are each rank's own: they differ between ranks
    first = ranks[0]["autograd"]["torch ddp"][0]
    assert any(float((a - b).abs().max()) > 1e-4 for a, b in zip(first, ranks[1]["autograd"]["torch ddp"][0]))


def test_nanogpts_loop_with_its_clip_line_trains_every_engine_as_pytorch_ddp(seen):
    n, ranks = seen
    for r in ranks:
        norms, want = r["nanogpt"]["torch ddp"]
        assert max(norms) > 1.0                         # (the clip line clipped)
        for kind in ENGINES[1:]:
            got_norms, got = r["nanogpt"][kind]
            for a, b in zip(got_norms, norms):
                assert math.isclose(a, b, rel_tol=1e-6), (kind, got_norms, norms)
            # (AdamW turns round-off into steps where a gradient is near zero: tests/tolerances.py)
            assert worst(got, want) <= fp32_adamw_tol(NANO_ITERS), (kind, worst(got, want))


def test_autograd_grad_with_respect_to_the_parameters_in_one_process_is_the_models_own():
    model = gpt()
    want = torch.autograd.grad(loss_of(model, batch(0)), list(model.parameters()))
    net = gpt()
    engine = zl.SingleProcess(net, torch.optim.SGD(net.parameters(), lr=0.5))
    got = torch.autograd.grad(loss_of(engine, batch(0)), list(net.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(RuntimeError, match="before backward"):
        engine.optimizer.step()


# ------------------------------------------------------------------ what p.grad answers, parameter by parameter


def per_parameter(kind):
    """cases.Branchy (odd sizes cut at the shards' edges, a frozen layer, a tied pair, a branch that
    steps 1 and 4 skip) on step 1: for each parameter what p.grad answers (None where no rank's
    backward reached it), and what a read that needs values this rank lacks says."""
    from cases import engine_for, loss_of as branchy_loss, model
    net = model()
    engine = engine_for(kind, net, torch.optim.SGD(net.parameters(), lr=0.1))
    branchy_loss(engine, 1).backward()
    out = {}
    for name, p in engine.module.named_parameters():
        g = p.grad
        if g is None:
            out[name] = None
            continue
        out[name] = {"norm": float(g.norm()), "l1": float(torch.linalg.vector_norm(g, 1)),
                     "inf": float(torch.linalg.vector_norm(g, float("inf"))), "sum": float(g.sum()),
                     "mean": float(g.mean()), "absmax": float(g.abs().max()), "max": float(g.max()),
                     "finite": bool(g.isfinite().all()), "whole": g.full_tensor().clone()}
    w = engine.module.a.weight.grad
    refused = []
    for read in (lambda: w[0, 0], lambda: w.tolist(), lambda: print(w.sum(dim=0)), lambda: torch.cat([w.view(-1)]),
                 lambda: w.copy_(torch.ones(w.shape)), lambda: engine.module.a.weight.detach().add_(w)):
        try:
            read()
            refused.append("accepted")
        except RuntimeError as e:
            refused.append(str(e))
    return out, refused


def per_parameter_runs():
    return {kind: per_parameter(kind) for kind in ("zero1", "zero2", "zero3")}


def fp16_norms():
    """torch.nn.utils.clip_grad_norm_ on fp16 gradients that carry the loss scale (2^16): the
    norm it returns, and the weights' change, on ZeRO-2 and 3 (engine.backward scales the loss)."""
    out = {}
    for kind in ("zero2", "zero3"):
        net = gpt()
        engine = wrap(kind, net, torch.optim.SGD(net.parameters(), lr=0.5), precision="fp16")
        engine.backward(loss_of(engine, mine(0)))
        scale = engine.precision.scale
        norm = float(torch.nn.utils.clip_grad_norm_(engine.module.parameters(), MAX_NORM))
        torch.nn.utils.clip_grad_value_(engine.module.parameters(), 1.0)     # (above every element)
        out[kind] = {"norm": norm, "scale": scale, "applied": engine.step()}
    return out


def awkward():
    return {"per_parameter": per_parameter_runs(), "fp16": fp16_norms()}


@pytest.fixture(scope="module", params=[2, 4], ids=["N=2", "N=4"])
def awkward_seen(request):
    return request.param, zl.launch(awkward, request.param)


def test_each_p_grad_answers_reductions_as_the_whole_gradient_and_none_where_no_rank_reached_it(awkward_seen):
    from cases import batch as branchy_batch, model, takes_branch
    n, ranks = awkward_seen
    ref = model()                               # one process on step 1's global batch
    x, y = branchy_batch(1)
    nn.functional.mse_loss(ref(x, takes_branch(1)), y).backward()
    want = dict(ref.named_parameters())
    assert want["branch.weight"].grad is None   # (step 1 skips the branch)
    for r in ranks:
        for kind, (got, refused) in r["per_parameter"].items():
            assert set(got) == set(want)
            for name, p in want.items():
                if p.grad is None:
                    assert got[name] is None, (kind, name)
                    continue
                g = p.grad
                expect = {"norm": g.norm(), "l1": g.abs().sum(), "inf": g.abs().max(), "sum": g.sum(),
                          "mean": g.mean(), "absmax": g.abs().max(), "max": g.max()}
                for key, value in expect.items():
                    assert math.isclose(got[name][key], float(value), rel_tol=1e-5, abs_tol=1e-7), (kind, name, key)
                assert got[name]["finite"]
                assert float((got[name]["whole"] - g).abs().max()) <= TOL, (kind, name)
            *reads, update = refused            # (reads of p.grad; a whole tensor updated from it)
            for message in reads:
                assert "p.grad under ZeRO" in message and "full_tensor()" in message, (kind, message)
            assert "p.grad under ZeRO" in update or "sharded by ZeRO-3" in update, (kind, update)


def test_fp16_gradients_carrying_the_loss_scale_clip_by_the_true_norm(awkward_seen):
    n, ranks = awkward_seen
    model = gpt()
    loss_of(model, batch(0)).backward()         # one process, fp32, on the global batch
    want = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    for r in ranks:
        for kind, seen in r["fp16"].items():
            assert seen["scale"] > 1 and seen["applied"], (kind, seen)
            # fp16's forward and backward: a few fp16 ulps (1e-3) of each gradient
            assert math.isclose(seen["norm"], want, rel_tol=1e-2), (kind, seen["norm"], want)
