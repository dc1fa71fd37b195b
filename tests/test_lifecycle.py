"""The engine's training state (zerolab.engines.lifecycle) and the edges it closes.

The transitions are checked on their own (no ranks), then the edges a user meets, each against
one process: a gradient penalty (torch.autograd.grad through the engine's output with
create_graph=True, then loss.backward()), which is one backward, not two; an autograd.grad pass
alone, which is no backward at all; a training forward that raises inside BatchNorm under bf16
(a batch of one), after which the model must be what it was; and a script under torchrun that
never called init_process_group, which must train as the global batch does, not each rank alone.
"""

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zerolab as zl
from zerolab.engines.lifecycle import Lifecycle, Phase

ENGINES = ("ddp", "zero1", "zero2", "zero3")


# ------------------------------------------------------------------ the transitions alone


def test_a_backward_a_step_and_zero_grad_move_the_phase():
    life = Lifecycle("DDP", 2)
    assert life.phase is Phase.IDLE
    with pytest.raises(RuntimeError, match="before backward"):
        life.check_step(True, False, "fp32")
    life.backward_began(synced=True)
    assert life.in_backward and life.reducing
    life.backward_ended()
    assert life.phase is Phase.REDUCED and life.reduced
    life.check_step(True, False, "fp32")
    life.stepped()
    with pytest.raises(RuntimeError, match="before backward"):
        life.check_step(True, False, "fp32")      # (a second step: nothing new to apply)
    life.zeroed()
    assert life.phase is Phase.IDLE and not life.reduced


def test_no_sync_accumulates_and_a_step_on_it_is_refused():
    life = Lifecycle("DDP", 2)
    life.sync = False
    life.backward_began(synced=False)
    life.backward_ended()
    assert life.phase is Phase.ACCUMULATED
    with pytest.raises(RuntimeError, match="never averaged"):
        life.check_step(True, False, "fp32")
    one = Lifecycle("DDP", 1)                     # one rank: nothing to average
    one.backward_began(synced=False)
    one.backward_ended()
    one.check_step(True, False, "fp32")


def test_zero1_refuses_a_second_reducing_backward_and_fp16_a_bare_one():
    life = Lifecycle("ZeRO1", 2, accumulates_after_reduce=False)
    life.backward_began(True)
    life.backward_ended()
    with pytest.raises(RuntimeError, match="second backward"):
        life.backward_began(True)
    fp16 = Lifecycle("DDP", 2, loss_scaling=True)
    fp16.backward_began(True)                     # not inside engine.backward: unscaled
    fp16.backward_ended()
    with pytest.raises(RuntimeError, match="engine.backward"):
        fp16.check_step(True, False, "fp16")
    with pytest.raises(RuntimeError, match="GradScaler"):
        Lifecycle("DDP", 2).check_step(True, True, "bf16")
    with pytest.raises(RuntimeError, match="without an optimizer"):
        Lifecycle("DDP", 2).check_step(False, False, "fp32")


def test_a_backward_that_raised_is_over_at_the_next_forward_and_guards_are_all_or_none():
    life = Lifecycle("ZeRO2", 2)
    life.backward_began(True)
    assert life.forward(training=True) == (True, True)
    assert life.phase is Phase.IDLE
    assert life.guards_left(0, 4, 2) == "zeroed" and life.guards_left(4, 4, 2) == "kept"
    with pytest.raises(RuntimeError, match="some parameters but not others"):
        life.guards_left(1, 4, 2)


# ------------------------------------------------------------------ the edges, on ranks


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(step, rows=8):
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 5, generator=g), torch.randn(rows, 3, generator=g)


def _penalised(model, x, y):
    """The loss with a gradient penalty on the inputs (WGAN-GP's, a saliency regulariser's)."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    return nn.functional.mse_loss(out.float(), y) + 0.1 * g.float().pow(2).mean()


def _reference(steps=3):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        _penalised(model, *_batch(s)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _engine(name, model, opt, **kw):
    if name == "zero3":
        kw.setdefault("units", ["0", "2"])
    return zl.engines.make(name, model, opt, **kw)


def penalty_and_grad_alone():
    n, r = dist.get_world_size(), dist.get_rank()
    per = 8 // n
    out = {}
    for name in ENGINES:
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        eng = _engine(name, model, opt)
        for s in range(3):
            x, y = _batch(s)
            _penalised(eng, x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]).backward()
            opt.step()
            opt.zero_grad()
        out[name] = eng.full_state_dict()
        # an autograd.grad pass alone is no backward: nothing reduced, nothing to step
        x = _batch(9)[0][r * per:(r + 1) * per].requires_grad_(True)
        torch.autograd.grad(eng(x).sum(), x)
        try:
            opt.step()
            out[(name, "step after autograd.grad")] = "stepped"
        except RuntimeError as e:
            out[(name, "step after autograd.grad")] = str(e)
    return out


class BatchNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.lin(x))))


def a_forward_that_raises():
    out = {}
    for name in ("single",) + ENGINES:
        torch.manual_seed(0)
        model = BatchNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        kw = {"units": ["lin", "out"]} if name == "zero3" else {}
        eng = zl.engines.make(name, model, opt, precision="bf16", **kw)
        weight = model.bn.weight
        try:
            eng(torch.randn(1, 4))          # a batch of one: BatchNorm cannot normalise it
            out[(name, "raised")] = False
        except ValueError:
            out[(name, "raised")] = True
        out[(name, "same parameter")] = model.bn.weight is weight and model.bn._parameters["weight"] is weight
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        for _ in range(2):
            eng(torch.randn(4, 4, generator=g)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        out[(name, "bn trained")] = {k: v for k, v in eng.full_state_dict().items() if k.startswith("bn.")}
    return out


@pytest.mark.slow
def test_a_gradient_penalty_is_one_backward_on_every_engine():
    want = _reference()
    for r in zl.launch(penalty_and_grad_alone, 2):
        for name in ENGINES:
            worst = max(float((r[name][k] - want[k]).abs().max()) for k in want)
            assert worst <= 1e-6, (name, worst)        # round-off of other summation orders only
            assert "before backward" in r[(name, "step after autograd.grad")], name


@pytest.mark.slow
def test_a_forward_that_raises_leaves_the_model_as_it_was():
    for r in zl.launch(a_forward_that_raises, 2):
        fresh = {k: v for k, v in BatchNet().state_dict().items() if k.startswith("bn.")}
        for name in ("single",) + ENGINES:
            assert r[(name, "raised")] and r[(name, "same parameter")], name
            bn = r[(name, "bn trained")]
            assert float((bn["bn.weight"] - fresh["bn.weight"]).abs().max()) > 1e-3, name   # it trains


SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist, zerolab as zl
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = zl.DDP(model, opt)                  # (no init_process_group: torchrun's environment)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    r, n = dist.get_rank(), dist.get_world_size()
    torch.nn.functional.mse_loss(engine(x[r * 4:(r + 1) * 4]), y[r * 4:(r + 1) * 4]).backward()
    opt.step()
    with open(f"{OUT}/rank{r}.txt", "w") as f:          # (one file per rank: stdout lines interleave)
        f.write(f"{n} {model.weight.detach().flatten().tolist()}")
""")


@pytest.mark.slow
def test_under_torchrun_without_init_process_group_the_ranks_average(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(f"OUT = {str(tmp_path)!r}\n" + SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)],
                         capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [(tmp_path / f"rank{r}.txt").read_text().split(" ", 1) for r in (0, 1)]
    assert {n for n, _ in rows} == {"2"}
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    opt.step()
    for _, weight in rows:
        got = torch.tensor(eval(weight))
        assert torch.allclose(got, ref.weight.detach().flatten(), atol=1e-6), (got, ref.weight)
    assert "started it from the environment" in run.stderr
