"""SingleProcess against plain torch loops (fp32), fp32 runs (bf16/fp16) and exact byte counts."""

import copy
import functools

import pytest
import torch

import zerolab as zl
from zerolab.precision import LossScaler
from zerolab.engines.single import SingleProcess

ADAMW = functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)


def _gpt(seed=0, **kw):
    torch.manual_seed(seed)
    return zl.models.GPT(zl.models.gpt_config("nano", **kw))


def _train(engine, steps, batch_size=8):
    ds = zl.data.CharDataset(32)
    losses = []
    for s in range(steps):
        _, loss = zl.models.gpt_loss(engine, ds.batch(s, batch_size))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("clip", [None, 0.5])
def test_fp32_matches_plain_torch_loop(clip):
    # torch.nn.utils.clip_grad_norm_ sums the norm in another order than zerolab, so with clipping
    # the weights differ by an ulp after the first step. The attention key bias has an exactly-zero
    # gradient in real arithmetic: its pure round-off changes completely with any ulp elsewhere,
    # and AdamW (default eps=1e-8) turns that noise into lr-sized steps. So the clipped run uses
    # bias=False; the unclipped one keeps the bias and must be bitwise equal.
    model = _gpt(bias=clip is None)
    ref = copy.deepcopy(model)
    engine = SingleProcess(model, ADAMW, max_grad_norm=clip)
    _train(engine, 5)
    opt = ADAMW(ref.parameters())
    ds = zl.data.CharDataset(32)
    for s in range(5):
        _, loss = zl.models.gpt_loss(ref, ds.batch(s, 8))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
    # bitwise without clipping; with it, torch sums the norm in another order (~1e-7 relative)
    tol = dict(rtol=0, atol=0) if clip is None else dict(rtol=1e-5, atol=1e-6)
    for (k, a), b in zip(engine.full_state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, **tol, msg=k)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32(precision):
    ref = _train(SingleProcess(_gpt(), ADAMW), 25)
    engine = SingleProcess(_gpt(), ADAMW, precision=precision)
    got = _train(engine, 25)
    assert ref[-1] < ref[0] - 1.0  # the reference really learns
    # stated tolerance: low-precision compute moves the loss curve by a few hundredths
    assert abs(sum(got[-5:]) - sum(ref[-5:])) / 5 < 0.05
    # the protocol: the model holds exactly cast16(master) after every applied step
    for p, m in zip(engine.params, engine.masters):
        assert p.dtype == engine.precision.compute_dtype and m.dtype == torch.float32
        assert torch.equal(p, m.to(p.dtype))
    sd = engine.full_state_dict()
    assert list(sd) == list(engine.model.state_dict())
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in sd.values())


def test_fp16_overflow_skips_and_touches_nothing():
    engine = SingleProcess(_gpt(), ADAMW, precision="fp16", scaler=LossScaler(init_scale=1024.0))
    _train(engine, 2)
    masters = [m.clone() for m in engine.masters]
    state = copy.deepcopy(engine.optimizer.state_dict())
    params = [p.clone() for p in engine.params]
    ds = zl.data.CharDataset(32)
    _, loss = zl.models.gpt_loss(engine, ds.batch(99, 8))
    engine.backward(loss)
    engine.params[3].grad[0] = float("inf")  # an overflow in one gradient
    assert engine.step() is False
    assert engine.precision.scale == 512.0
    assert all(torch.equal(a, b) for a, b in zip(masters, engine.masters))
    assert all(torch.equal(a, b) for a, b in zip(params, engine.params))
    after = engine.optimizer.state_dict()
    for k, st in state["state"].items():
        for name, v in st.items():
            assert torch.equal(v, after["state"][k][name]), name
    engine.zero_grad()
    _, loss = zl.models.gpt_loss(engine, ds.batch(100, 8))
    engine.backward(loss)
    assert engine.step() is True


def test_nan_loss_raises_with_step():
    engine = SingleProcess(_gpt(), ADAMW, precision="bf16")
    _train(engine, 3)
    with pytest.raises(FloatingPointError, match="step 3"):
        engine.backward(torch.tensor(float("nan"), requires_grad=True))


def test_memory_report_measures_16_bytes_per_param():
    model = _gpt()
    engine = SingleProcess(model, ADAMW, precision="fp16", track_peak=True)
    ds = zl.data.CharDataset(32)
    _, loss = zl.models.gpt_loss(engine, ds.batch(0, 8))
    engine.backward(loss)
    engine.step()
    r = engine.memory_report()
    n = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    # 2 (fp16 params) + 2 (fp16 grads) + 4 + 4 + 4 (fp32 master, exp_avg, exp_avg_sq),
    # plus AdamW's one fp32 step counter per tensor
    assert r["params"] == 2 * n and r["grads"] == 2 * n
    assert r["optimizer"] == 12 * n + 4 * n_tensors
    assert r["total"] == r["params"] + r["grads"] + r["optimizer"]
    assert r["peak"] >= 4 * n  # the short-lived fp32 gradient copies exist during the step
    fp32 = SingleProcess(_gpt(), ADAMW)
    _train(fp32, 1)
    r32 = fp32.memory_report()
    assert r32["params"] == 4 * n and r32["grads"] == 0 and r32["optimizer"] == 8 * n + 4 * n_tensors


def test_tied_weights_one_master():
    model = _gpt(tie_weights=True)
    engine = SingleProcess(model, ADAMW, precision="bf16")
    _train(engine, 2)
    assert len(engine.masters) == len(list(model.parameters()))
    sd = engine.full_state_dict()
    assert sd["head.weight"] is sd["tok_emb.weight"]


def test_frozen_and_float_inputs():
    torch.manual_seed(0)
    model = zl.models.AwkwardModel()
    engine = SingleProcess(model, functools.partial(torch.optim.SGD, lr=0.1), precision="bf16")
    x, y = zl.data.SyntheticRegression(d_in=13, d_out=5).batch(0, 4)
    out, loss = zl.models.regression_loss(engine, (x, y))
    assert out.dtype == torch.bfloat16
    engine.backward(loss.float())
    frozen = model.frozen.weight.clone()
    assert engine.step()
    assert torch.equal(frozen, model.frozen.weight)


def test_an_optimizer_that_holds_state_already_keeps_it():
    """Adagrad makes its state when built (nanoGPT loads a checkpoint's state before wrapping):
    the engine moves that state onto what it updates, and the run is a plain Adagrad's."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    plain = torch.optim.Adagrad(a.parameters(), lr=0.1, initial_accumulator_value=0.5)
    engine = SingleProcess(b, torch.optim.Adagrad(b.parameters(), lr=0.1, initial_accumulator_value=0.5))
    x = torch.randn(4, 3)
    for _ in range(3):
        a(x).pow(2).sum().backward()
        plain.step()
        plain.zero_grad()
        engine(x).pow(2).sum().backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_bad_optimizer_and_precision():
    model = _gpt()
    with pytest.raises(TypeError, match="callable"):
        SingleProcess(model, "adamw")
    with pytest.raises(ValueError, match="'fp8'"):
        SingleProcess(model, ADAMW, precision="fp8")
    with pytest.raises(ValueError, match="max_grad_norm"):
        SingleProcess(model, ADAMW, max_grad_norm=-1)


def test_no_sync_accumulates_as_the_data_parallel_engines_loop_expects():
    # a loop written for zl.DDP (no_sync on all but the last micro-batch) runs unchanged here
    from functools import partial
    import zerolab as zl
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 3)
    engine = zl.SingleProcess(a, partial(torch.optim.SGD, lr=0.1))
    with engine.no_sync():
        engine.backward(engine(x[:2]).pow(2).sum())
    engine.backward(engine(x[2:]).pow(2).sum())
    engine.step()
    opt = torch.optim.SGD(b.parameters(), lr=0.1)
    b(x).pow(2).sum().backward()
    opt.step()
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(a.parameters(), b.parameters()))
