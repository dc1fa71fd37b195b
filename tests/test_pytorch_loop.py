"""PyTorch's own training loop, unchanged, on every engine, against one process on the global batch.

A student arrives with PyTorch's loop, not zerolab's: loss.backward(), optimizer.step(),
optimizer.zero_grad() (or model.zero_grad()), an LR scheduler, nanoGPT's
require_backward_grad_sync. Each test writes a loop as its source writes it (PyTorch's DDP
tutorial, nanoGPT's train.py) and checks the weights against one process on the global batch.
SGD moves a weight by lr * g; two summation orders change g by a few ulp, so a handful of steps
differ by < 1e-6, while a missed or doubled reduction is off by ~1e-2.
"""

import math
import warnings
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zerolab as zl
from tolerances import fp32_adamw_tol

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

DP = [n for n in zl.engines.NAMES if n != "single"]
N, STEPS, LR = 2, 3, 0.1
SGD_TOL = 1e-6


class ToyModel(nn.Module):
    """The model of PyTorch's "Getting Started with Distributed Data Parallel" tutorial."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def toy():
    torch.manual_seed(0)
    return ToyModel()


def toy_rows(step, rank, n, per_rank=4):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(per_rank * n, 10, generator=g), torch.randn(per_rank * n, 5, generator=g)
    return x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]


def quiet_make(name, model, optimizer, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # ZeRO-3's note that a small model is one unit
        return zl.engines.make(name, model, optimizer, **options)


# ------------------------------------------------------------------ the DDP tutorial's loop, and its variants

def lr_at(step):
    return 0.5 ** step          # a LambdaLR factor: every step's learning rate differs


def tutorial_loop(name, variant):
    """The tutorial's step (zero_grad, forward, loss.backward(), optimizer.step()), repeated;
    `variant` changes one habit. Returns this rank's final weights."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = toy()
    if variant == "own optimizer":           # DistributedDataParallel's way: no optimizer inside
        ddp_model = zl.NaiveDDP(model) if name == "naive" else zl.DDP(model)
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LR, momentum=0.9)
    else:                                    # DeepSpeed's way: the optimizer goes in, built
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        ddp_model = quiet_make(name, model, optimizer)
    loss_fn = nn.MSELoss()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at) if variant == "scheduler" else None
    for step in range(STEPS):
        inputs, labels = toy_rows(step, rank, n)
        if variant == "zero_grad between forward and backward":
            outputs = ddp_model(inputs)
            optimizer.zero_grad()
        else:
            if variant == "model.zero_grad()":
                ddp_model.module.zero_grad()
            elif variant == "model.zero_grad(set_to_none=False)":
                ddp_model.module.zero_grad(set_to_none=False)
            elif variant == "optimizer.zero_grad(set_to_none=False)":
                optimizer.zero_grad(set_to_none=False)
            else:
                optimizer.zero_grad()
            outputs = ddp_model(inputs)
        loss_fn(outputs, labels).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return {k: v.detach().clone().float() for k, v in ddp_model.state_dict().items()}


def one_process(variant, n=N):
    model = toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at) if variant == "scheduler" else None
    for step in range(STEPS):
        x, y = toy_rows(step, 0, 1, per_rank=4 * n)
        optimizer.zero_grad()
        nn.MSELoss()(model(x), y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return model.state_dict()


VARIANTS = ["as written", "scheduler", "model.zero_grad()", "model.zero_grad(set_to_none=False)",
            "optimizer.zero_grad(set_to_none=False)", "zero_grad between forward and backward"]


def every_variant():
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # e.g. "lr_scheduler.step() before optimizer.step()"
        for name in DP:
            for variant in VARIANTS + (["own optimizer"] if name in ("naive", "ddp") else []):
                out[name, variant] = tutorial_loop(name, variant)
    return out


@pytest.fixture(scope="module")
def ranks():
    return zl.launch(every_loop, N)


@pytest.fixture(scope="module")
def tutorial(ranks):
    return [r["tutorial"] for r in ranks]


@pytest.mark.parametrize("variant", VARIANTS + ["own optimizer"])
def test_the_ddp_tutorials_loop_trains_every_engine_as_one_process(tutorial, variant):
    ref = one_process("scheduler" if variant == "scheduler" else "plain")
    for rank, seen in enumerate(tutorial):
        for (name, v), state in seen.items():
            if v != variant:
                continue
            worst = max((state[k] - ref[k]).abs().max().item() for k in ref)
            assert worst < SGD_TOL, (name, variant, rank, worst)


# ------------------------------------------------------------------ nanoGPT's step section


class NanoGPT(zl.models.GPT):
    """zerolab's GPT called as nanoGPT's is: model(X, Y) -> (logits, loss)."""

    def forward(self, idx, targets=None):
        logits = super().forward(idx)
        loss = None if targets is None else nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def nano_model():
    torch.manual_seed(0)
    return NanoGPT(zl.models.gpt_config("nano", n_layer=2, n_embd=32, n_head=2, block_size=16))


def configure_optimizers(model, weight_decay, learning_rate, betas):
    """nanoGPT's GPT.configure_optimizers: decay the matrices, not the biases and LayerNorms."""
    params = {pn: p for pn, p in model.named_parameters() if p.requires_grad}
    decay = [p for p in params.values() if p.dim() >= 2]
    nodecay = [p for p in params.values() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": nodecay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=1e-6)


def get_batch(it, micro, rank, n, rows=2, block=16):
    g = torch.Generator().manual_seed(1000 * it + micro)
    data = torch.randint(0, 96, (rows * n, block + 1), generator=g)
    mine = data[rank * rows:(rank + 1) * rows]
    return mine[:, :-1], mine[:, 1:]


def get_lr(it, learning_rate=1e-3, warmup_iters=2, lr_decay_iters=5, min_lr=1e-4):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(decay_ratio, 1.0))) * (learning_rate - min_lr)


NANO_ITERS, ACCUM = 4, 2


def nanogpt_train(name, grad_clip):
    """nanoGPT's train.py around its step section, as written there (ddp branch), with the
    engine where DistributedDataParallel was."""
    ddp_rank, n = (dist.get_rank(), dist.get_world_size()) if name != "one process" else (0, 1)
    model = nano_model()
    optimizer = configure_optimizers(model, 0.1, 1e-3, (0.9, 0.95))
    if name != "one process":
        model = quiet_make(name, model, optimizer)
    ddp = name != "one process"
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    gradient_accumulation_steps = ACCUM
    for iter_num in range(NANO_ITERS):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr
        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
            X, Y = get_batch(iter_num, micro_step, ddp_rank, n if ddp else N, rows=2 if ddp else 2 * N)
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone().float() for k, v in model.state_dict().items()}


def nanogpt_every_engine():
    return {name: nanogpt_train(name, 1.0) for name in DP}       # nanoGPT's grad_clip = 1.0


def test_nanogpts_step_section_trains_every_engine_as_one_process(ranks):
    ref = nanogpt_train("one process", 1.0)
    for rank, seen in enumerate(r["nanogpt"] for r in ranks):
        for name, state in seen.items():
            worst = max((state[k] - ref[k]).abs().max().item() for k in ref)
            assert worst <= fp32_adamw_tol(NANO_ITERS), (name, rank, worst)


# ------------------------------------------------------------------ loss.backward() is engine.backward(loss)


def both_loops(name, precision):
    out = []
    for loop in ("pytorch", "zerolab"):
        model = nano_model()
        engine = quiet_make(name, model, partial(torch.optim.AdamW, lr=1e-3), precision=precision,
                            **({} if name in ("single", "naive", "zero3") else {"bucket_mb": 0.005}))
        for it in range(2):
            for micro in range(ACCUM):
                X, Y = get_batch(it, micro, dist.get_rank(), dist.get_world_size())
                loss = engine(X, Y)[1] / ACCUM
                last = micro == ACCUM - 1
                with engine.no_sync() if not last else torch.enable_grad():
                    if loop == "pytorch":
                        loss.backward()
                    else:
                        engine.backward(loss)
            if loop == "pytorch":
                engine.optimizer.step()
                engine.optimizer.zero_grad()
            else:
                engine.step()
                engine.zero_grad()
        out.append(engine.state_dict())
    return all(torch.equal(out[0][k], out[1][k]) for k in out[0])


def loops_every_engine():
    return {(name, precision): both_loops(name, precision)
            for name in zl.engines.NAMES for precision in ("fp32", "bf16")}


def test_loss_backward_then_optimizer_step_is_bit_for_bit_engine_backward_then_step(ranks):
    for seen in (r["bitwise"] for r in ranks):
        assert all(seen.values()), [k for k, same in seen.items() if not same]


# ------------------------------------------------------------------ your own optimizer on zl.DDP


class TiedAndFrozen(nn.Module):
    """A tied embedding / head, a frozen matrix, and a branch some ranks use."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(12, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.mid = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx, use_branch=False):
        h = torch.tanh(self.mid(self.frozen(self.emb(idx))))
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


def own_optimizer_run(name, bucket_mb, n=N, rank=0):
    distributed = name != "one process"
    model = TiedAndFrozen()
    if distributed:
        rank, n = dist.get_rank(), dist.get_world_size()
        engine = zl.NaiveDDP(model) if name == "naive" else zl.DDP(model, bucket_mb=bucket_mb)
    else:
        engine = model
    opt = torch.optim.SGD([p for p in engine.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, 12, (3 * n, 5), generator=g)
        if distributed:
            out = engine(idx[3 * rank:3 * rank + 3], use_branch=(rank == step % n))
            loss = nn.functional.cross_entropy(out.reshape(-1, 12), idx[3 * rank:3 * rank + 3].reshape(-1))
        else:          # one process: one rank's rows through the branch (a rank that changes)
            losses = [nn.functional.cross_entropy(model(idx[3 * r:3 * r + 3], use_branch=(r == step % n)).reshape(-1, 12),
                                                  idx[3 * r:3 * r + 3].reshape(-1)) for r in range(n)]
            loss = sum(losses) / n
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


BUCKETS = {"one tensor per bucket": 1e-6, "a few": 0.0003, "one for all": 100.0}


def own_optimizers():
    out = {("naive", None): own_optimizer_run("naive", None)}
    for label, mb in BUCKETS.items():
        out[("ddp", label)] = own_optimizer_run("ddp", mb)
    return out


def test_your_own_optimizer_on_zl_ddp_steps_averaged_gradients_tied_frozen_and_unused_too(ranks):
    ref = own_optimizer_run("one process", None)
    for rank, seen in enumerate(r["own"] for r in ranks):
        for key, state in seen.items():
            worst = max((state[k] - ref[k]).abs().max().item() for k in ref)
            assert worst < SGD_TOL, (key, rank, worst)


# ------------------------------------------------------------------ a forgotten zero_grad() accumulates


def no_zero_grad_run(name, n=N, rank=0):
    """Two steps without zero_grad() in between; the branch is used in the first only, so the
    second step applies its first gradient again (one process keeps it in p.grad)."""
    distributed = name != "one process"
    model = TiedAndFrozen()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    if distributed:
        rank, n = dist.get_rank(), dist.get_world_size()
        model = quiet_make(name, model, opt, **({"bucket_mb": 1e-6} if name in ("ddp", "zero2") else {}))
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, 12, (3 * n, 5), generator=g)
        mine = idx[3 * rank:3 * rank + 3] if distributed else idx
        out = model(mine, use_branch=(step == 0))
        nn.functional.cross_entropy(out.reshape(-1, 12), mine.reshape(-1)).backward()
        opt.step()
    return {k: v.detach().clone().float() for k, v in model.state_dict().items()}


def no_zero_grad_every_engine():
    return {name: no_zero_grad_run(name) for name in DP if name != "zero1"}


def test_a_forgotten_zero_grad_accumulates_as_in_one_process(ranks):
    # (ZeRO-1 refuses it instead: tests/test_engines.py and test_habits_table.py)
    ref = no_zero_grad_run("one process")
    for rank, seen in enumerate(r["no_zero_grad"] for r in ranks):
        for name, state in seen.items():
            worst = max((state[k] - ref[k]).abs().max().item() for k in ref)
            assert worst < SGD_TOL, (name, rank, worst)


def every_loop():
    """Everything this file trains, in one launch (starting ranks costs seconds each time)."""
    return {"tutorial": every_variant(), "nanogpt": nanogpt_every_engine(), "bitwise": loops_every_engine(),
            "own": own_optimizers(), "no_zero_grad": no_zero_grad_every_engine()}
