"""zl.precision against independent references: torch.amp.GradScaler, torch's clip, exact values."""

import math
from functools import partial

import pytest
import torch

import zerolab as zl
from zerolab.precision import (POLICIES, LossScaler, MixedPrecision, Policy, check_precision,
                               clip_grad_norm_, found_overflow, policy)

# ------------------------------------------------------------------ policies and bad input


def test_policies():
    assert POLICIES == ("fp32", "bf16", "fp16")
    assert policy("fp32") == Policy("fp32", torch.float32, torch.float32, False)
    assert policy("bf16") == Policy("bf16", torch.bfloat16, torch.float32, False)
    assert policy("fp16") == Policy("fp16", torch.float16, torch.float32, True)
    assert zl.precision.policy("fp16").needs_master and not policy("fp32").needs_master


@pytest.mark.parametrize("bad", ["fp8", "float16", "FP16", None, 16])
def test_unknown_precision_names_value_and_choices(bad):
    with pytest.raises(ValueError) as e:
        check_precision(bad)
    assert repr(bad) in str(e.value) and "'bf16'" in str(e.value)
    with pytest.raises(ValueError):
        MixedPrecision(bad)


@pytest.mark.parametrize("kwargs", [dict(init_scale=0), dict(init_scale=-1.0), dict(growth_factor=1.0),
                                    dict(backoff_factor=0.0), dict(backoff_factor=1.5),
                                    dict(growth_interval=0), dict(hysteresis=0), dict(min_scale=0),
                                    dict(min_scale=-2.0), dict(init_scale=float("inf")),
                                    dict(growth_interval=2.5)])
def test_scaler_rejects_bad_settings(kwargs):
    (key, value), = kwargs.items()
    with pytest.raises(ValueError) as e:
        LossScaler(**kwargs)
    assert key in str(e.value) and repr(value) in str(e.value)


def test_scaler_only_with_fp16():
    with pytest.raises(ValueError, match="fp16"):
        MixedPrecision("bf16", scaler=LossScaler())
    assert MixedPrecision("bf16").scaler is None
    assert MixedPrecision("fp16").scaler.scale == 2.0**16


# ------------------------------------------------------------------ the scaler against GradScaler


def _grad_sequence(n=60, seed=0):
    """Gradients with infs and nans injected at fixed steps, some in runs."""
    g = torch.Generator().manual_seed(seed)
    seq = []
    for i in range(n):
        grad = torch.randn(5, generator=g)
        if i in (3, 4, 10, 11, 12, 30, 41, 42):
            grad[i % 5] = float("inf") if i % 2 else float("nan")
        seq.append(grad)
    return seq


@pytest.mark.parametrize("settings", [dict(init_scale=2.0**10, growth_interval=3),
                                      dict(init_scale=256.0, growth_factor=4.0, backoff_factor=0.25,
                                           growth_interval=5),
                                      dict(init_scale=2.0**16, growth_interval=1)])
def test_loss_scaler_matches_gradscaler(settings):
    seq = _grad_sequence()
    # reference: torch.amp.GradScaler driving SGD on one parameter
    p = torch.nn.Parameter(torch.zeros(5))
    opt = torch.optim.SGD([p], lr=0.1)
    ref = torch.amp.GradScaler("cpu", **settings)
    ref_scales, ref_applied, ref_unscaled = [], [], []
    for grad in seq:
        opt.zero_grad()
        ref.scale((p * grad).sum()).backward()  # d(loss)/dp = grad, times the scale
        before = p.detach().clone()
        ref.unscale_(opt)
        ref_unscaled.append(p.grad.clone())
        ref.step(opt)
        ref.update()
        ref_applied.append(not torch.equal(before, p.detach()))
        ref_scales.append(ref.get_scale())

    mp = MixedPrecision("fp16", scaler=LossScaler(hysteresis=1, min_scale=1e-30, **settings))
    scales, applied = [], []
    for grad, unscaled in zip(seq, ref_unscaled):
        g = grad * mp.scale
        ok = mp.unscale_and_check([g])
        if ok:
            torch.testing.assert_close(g, unscaled, rtol=0, atol=0)
        mp.update(found_inf=not ok)
        scales.append(mp.scale)
        applied.append(ok)
    assert applied == ref_applied
    assert scales == ref_scales
    assert mp.scaler.skipped == ref_applied.count(False) == 8


def test_hysteresis_and_min_scale_exact():
    s = LossScaler(init_scale=64.0, growth_interval=2, hysteresis=2, min_scale=16.0)
    trajectory = []
    for found_inf in [True, False, True, True, True, True, False, False, True, True]:
        s.update(found_inf)
        trajectory.append(s.scale)
    # one overflow is tolerated; a finite step resets the count; two in a row back off, down
    # to min_scale; two finite steps grow it
    assert trajectory == [64, 64, 64, 32, 32, 16, 16, 32, 32, 16]
    assert s.skipped == 7
    # an overflow with the scale at its floor: the run gives up, naming the step
    with pytest.raises(FloatingPointError, match="at step 11: .* already at its minimum"):
        s.update(True, step=11)


def test_too_many_skips_in_a_row_give_up_and_a_finite_step_resets_the_count():
    s = LossScaler(init_scale=2.0**100, min_scale=1e-30, max_skips=4)
    for found_inf in [True, True, True, False, True, True, True]:
        s.update(found_inf)
    with pytest.raises(FloatingPointError, match="4 steps in a row were skipped"):
        s.update(True)


def fp16_that_overflows_every_step():
    import torch.distributed as dist
    engine = zl.engines.make("zero2", torch.nn.Linear(4, 4), partial(torch.optim.SGD, lr=0.1),
                             precision="fp16", scaler=LossScaler(init_scale=8.0))
    applied = []
    try:
        for step in range(10):
            engine.backward(engine(torch.randn(2, 4)).float().sum() * float("inf"))
            applied.append(engine.step())
            engine.zero_grad()
    except FloatingPointError as e:
        return applied, str(e), dist.get_rank()
    return applied, "never gave up", dist.get_rank()


@pytest.mark.slow
def test_an_fp16_run_that_only_overflows_stops_loudly_on_every_rank():
    for applied, message, rank in zl.launch(fp16_that_overflows_every_step, 2):
        # 8 -> 4 -> 2 -> 1: three skipped steps back off to the floor, the fourth gives up
        assert applied == [False, False, False], (rank, applied)
        assert "fp16 gives up at step 3" in message and "first_nonfinite" in message, message


class Boost(torch.nn.Module):
    """Multiplies by 1e6: in fp16 (largest value 65504) its output is inf."""
    def forward(self, x):
        return x * 1e6


def fp16_gives_up_naming_the_module(kind):
    from collections import OrderedDict
    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(proj=torch.nn.Linear(4, 4), boost=Boost(), head=torch.nn.Linear(4, 1)))
    engine = zl.engines.make(kind, model, partial(torch.optim.SGD, lr=0.1),
                             precision="fp16", scaler=LossScaler(init_scale=8.0))
    try:
        for step in range(10):
            engine.backward(engine(torch.randn(2, 4)).float().sum())
            engine.step()
            engine.zero_grad()
    except FloatingPointError as e:
        return str(e)
    return "never gave up"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "zero3"])
def test_the_fp16_give_up_names_the_module_that_overflowed(kind):
    # an independent reference for "which module": Boost is the only module whose output can
    # exceed fp16's range; ZeRO-3 re-runs the forward with its gathering hooks on every rank
    for message in zl.launch(fp16_gives_up_naming_the_module, 2, args=(kind,)):
        assert "fp16 gives up at step 3" in message, message
        assert "boost produced inf" in message and "its inputs were finite" in message, message


def test_scaler_state_roundtrip():
    s = LossScaler(init_scale=8.0, growth_interval=3, hysteresis=2)
    for f in [False, True, False]:
        s.update(f)
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    for f in [True, True, False, False, False]:
        s.update(f)
        t.update(f)
        assert s.scale == t.scale
    mp = MixedPrecision("fp16")
    mp.scaler.update(True)
    other = MixedPrecision("fp16")
    other.load_state_dict(mp.state_dict())
    assert other.scale == 2.0**15
    with pytest.raises(ValueError, match="bf16"):
        MixedPrecision("bf16").load_state_dict(mp.state_dict())


# ------------------------------------------------------------------ NaN losses and checks


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_nan_loss_raises_naming_step(name):
    mp = MixedPrecision(name)
    loss = torch.tensor(float("nan"), dtype=mp.compute_dtype)
    with pytest.raises(FloatingPointError, match="step 7"):
        mp.scale_loss(loss, step=7)
    assert mp.scale_loss(torch.tensor(2.0), step=0).item() == 2.0


def test_fp16_scale_loss_in_fp32():
    mp = MixedPrecision("fp16")
    scaled = mp.scale_loss(torch.tensor(4.5, dtype=torch.float16))
    # 4.5 * 65536 overflows fp16 (max 65504) but not fp32
    assert scaled.dtype == torch.float32 and scaled.item() == 4.5 * 65536


def test_found_overflow_local():
    assert not found_overflow([torch.ones(3), torch.zeros(2, dtype=torch.float16)])
    assert found_overflow([torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert found_overflow([torch.tensor([float("-inf")], dtype=torch.bfloat16)])
    assert not found_overflow([])


def test_clip_matches_torch_and_counts_tied_once():
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(7, 3, generator=g) * 4, torch.randn(11, generator=g)]
    params = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads]
    for p, x in zip(params, grads):
        p.grad = x.clone()
    ref = torch.nn.utils.clip_grad_norm_(params, max_norm=1.5)
    mine = [x.clone() for x in grads]
    total = clip_grad_norm_(mine + [mine[0]], 1.5)  # tied: the first tensor passed twice
    assert math.isclose(total, ref.item(), rel_tol=1e-6)
    for p, x in zip(params, mine):
        torch.testing.assert_close(x, p.grad)
    small = [torch.full((4,), 0.1)]
    assert math.isclose(clip_grad_norm_(small, 10.0), 0.2, rel_tol=1e-6)
    assert torch.equal(small[0], torch.full((4,), 0.1))  # below the limit: untouched
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(small, 0.0)


# ------------------------------------------------------------------ across ranks


def _sharded_worker(seed):
    """Each rank holds a disjoint half of the same gradients; rank 1 also holds an inf in step 2."""
    ledger = zl.comm.Ledger()
    r, n = zl.rank(), zl.world_size()
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(10, generator=g) * 3
    shard = full.chunk(n)[r].clone()
    norm = clip_grad_norm_([shard], 1.0, ledger)
    clean = found_overflow([shard], ledger)
    bad = shard.clone()
    if r == 1:
        bad[0] = float("inf")
    dirty = found_overflow([bad], ledger)
    mp = MixedPrecision("fp16", scaler=LossScaler(init_scale=4.0), ledger=ledger)
    ok = mp.unscale_and_check([bad * 4.0])
    return norm, shard, clean, dirty, ok, [rec.op for rec in ledger.records]


@pytest.mark.slow
def test_sharded_clip_and_agreed_overflow():
    out = zl.launch(_sharded_worker, world_size=2, args=(3,))
    full = torch.randn(10, generator=torch.Generator().manual_seed(3)) * 3
    p = torch.nn.Parameter(torch.zeros(10))
    p.grad = full.clone()
    ref = torch.nn.utils.clip_grad_norm_([p], 1.0)
    for norm, _, clean, dirty, ok, ops in out:
        assert math.isclose(norm, ref.item(), rel_tol=1e-6)
        assert clean is False and dirty is True and ok is False  # rank 0 agrees with rank 1
        assert ops == ["all_reduce"] * 4
    torch.testing.assert_close(torch.cat([o[1] for o in out]), p.grad)
