"""engines.grad_guard in one process: a ShardedGradient that holds a whole gradient (one rank)
answers every operation it serves as the plain tensor does, through PyTorch's own functions.

Each test builds the same gradients twice, as plain tensors and as ShardedGradients over a copy,
runs PyTorch's function on both (clip_grad_norm_, clip_grad_value_, norms, sums, ...) and
compares. The multi-rank answers (pieces on several ranks, combined by all-reduce) are
tests/conformance/test_sharded_gradients.py's, against FSDP2, PyTorch DDP and one process.
"""

import math

import pytest
import torch

from zerolab.engines.grad_guard import ShardedGradient
from zerolab.engines.partial_result import PartialResult, Reducer

ONE_RANK = Reducer(None, None, 0, 1, "ZeRO-2")


def pair(scale=1.0, seed=0):
    """Three parameters with plain gradients, and three with the same gradients (times `scale`)
    as ShardedGradients."""
    torch.manual_seed(seed)
    plain = [torch.nn.Parameter(torch.randn(*s)) for s in ((3, 4), (5,), (2, 3, 2))]
    sharded = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    for p, q in zip(plain, sharded):
        g = torch.randn_like(p)
        p.grad = g.clone()
        q.grad = ShardedGradient((g * scale).reshape(-1), 0, g.numel(), q.shape, q.dtype, q.device, ONE_RANK, scale)
    return plain, sharded


def values(q):
    return q.grad.to_local().view(q.shape) / q.grad.scale


@pytest.mark.parametrize("scale", [1.0, 1024.0], ids=["unscaled", "fp16 loss scale"])
@pytest.mark.parametrize("foreach", [None, True], ids=["per tensor", "foreach"])
def test_clip_grad_norm_and_value_act_as_on_plain_gradients(foreach, scale):
    plain, sharded = pair(scale)
    want = torch.nn.utils.clip_grad_norm_(plain, 1.0, foreach=foreach)
    got = torch.nn.utils.clip_grad_norm_(sharded, 1.0, foreach=foreach)
    assert isinstance(got, PartialResult) and math.isclose(float(got), float(want), rel_tol=1e-6)
    assert float(want) > 1.0                            # (it clipped)
    for p, q in zip(plain, sharded):
        torch.testing.assert_close(values(q), p.grad, rtol=1e-6, atol=1e-7)
    torch.nn.utils.clip_grad_value_(plain, 0.05, foreach=foreach)
    torch.nn.utils.clip_grad_value_(sharded, 0.05, foreach=foreach)
    for p, q in zip(plain, sharded):
        torch.testing.assert_close(values(q), p.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scale", [1.0, 1024.0], ids=["unscaled", "fp16 loss scale"])
def test_reductions_give_the_plain_answers(scale):
    plain, sharded = pair(scale)
    for p, q in zip(plain, sharded):
        g, s = p.grad, q.grad
        for read in (lambda t: t.norm(), lambda t: torch.linalg.vector_norm(t, 1), lambda t: t.norm(float("inf")),
                     lambda t: torch.linalg.vector_norm(t, 3.0), lambda t: t.sum(), lambda t: t.mean(),
                     lambda t: t.max(), lambda t: t.min(), lambda t: t.abs().max(), lambda t: t.amax(),
                     lambda t: t.sum(dim=tuple(range(t.dim())))):
            assert math.isclose(float(read(s)), float(read(g)), rel_tol=1e-6, abs_tol=1e-7)
        assert bool(s.isfinite().all()) and not bool(s.isnan().any())
        assert torch.equal(s.full_tensor(), g)
        assert s.shape == p.shape and s.dtype == p.dtype and s.view(-1).shape == (p.numel(),)
    norms = [q.grad.norm() for q in sharded]
    stacked = torch.stack(norms)
    assert isinstance(stacked, PartialResult)           # (still one number to combine per norm)
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in plain]))
    assert math.isclose(float(torch.linalg.vector_norm(stacked)), float(want), rel_tol=1e-6)
    assert f"{float(want):.4f}" == f"{torch.linalg.vector_norm(stacked):.4f}"


def test_elementwise_operations_act_on_the_piece_and_zero_is_noted():
    plain, sharded = pair()
    for p, q in zip(plain, sharded):
        p.grad.mul_(0.5).div_(2).clamp_(-0.3, 0.2)
        q.grad.mul_(0.5).div_(2).clamp_(-0.3, 0.2)
        torch.testing.assert_close(values(q), p.grad)
        torch.testing.assert_close((q.grad * 3 + 1).to_local(), (p.grad * 3 + 1).reshape(-1))
        assert isinstance(torch.zeros_like(q.grad), ShardedGradient)
    q = sharded[0]
    q.grad.data.zero_()                                 # (p.grad.data: the same piece)
    assert float(q.grad.abs().max()) == 0.0


def test_reads_that_need_the_whole_values_are_refused_by_name():
    _, sharded = pair()
    g = sharded[0].grad
    for read in (lambda: g[0], lambda: g.tolist(), lambda: g.item(), lambda: g.t(), lambda: torch.cat([g.view(-1)]),
                 lambda: g.copy_(torch.ones(3, 4)), lambda: g.add_(torch.ones(3, 4)),
                 lambda: sharded[0].detach().add_(g),
                 lambda: sharded[1].grad.view(-1) + sharded[2].grad.view(-1)[:5]):
        with pytest.raises(RuntimeError, match=r"p\.grad under ZeRO-2"):
            read()
    assert "elements [0, 12) of 12 on rank 0 of 1" in repr(g)


def test_the_loss_scale_refuses_what_it_would_change():
    _, sharded = pair(scale=1024.0)
    g = sharded[0].grad
    with pytest.raises(RuntimeError, match="loss scale"):
        g.add(1.0).exp()
    assert math.isclose(float((g > 0.5).sum()), float((values(sharded[0]) > 0.5).sum()))
