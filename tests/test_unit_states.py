"""A ZeRO-3 unit keeps its state in two enums (ParamState, GradState), moved only along the legal
transitions (as FSDP2's ShardedState and TrainingState): a schedule that frees a buffer an
all-gather is still filling, or gathers a unit twice, is stopped where it happens."""

import functools
import warnings

import pytest
import torch

import zerolab as zl
from zerolab.engines.zero3.unit_state import GradState, ParamState


def _unit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # one rank, no process group: meant here
        eng = zl.ZeRO(model, functools.partial(torch.optim.SGD, lr=0.1), stage=3)
    return eng, eng.units[-1]


def test_a_unit_moves_partitioned_in_flight_gathered_and_back():
    eng, u = _unit()
    assert u.params_state is ParamState.PARTITIONED and u.grad_state is GradState.WAITING
    u.gather("forward")
    assert u.params_state is ParamState.IN_FLIGHT
    u.wait("forward")
    assert u.params_state is ParamState.GATHERED and u.gathered
    u.release("forward")
    assert u.params_state is ParamState.PARTITIONED and not u.gathered


def test_after_backward_every_reached_unit_is_reduced():
    eng, _ = _unit()
    eng(torch.randn(2, 4)).sum().backward()
    assert {u.grad_state for u in eng.units if u.n_train} == {GradState.REDUCED}
    assert all(u.reduced and not u.in_backward for u in eng.units if u.n_train)


@pytest.mark.parametrize("now, to", [(ParamState.IN_FLIGHT, ParamState.PARTITIONED),
                                     (ParamState.GATHERED, ParamState.IN_FLIGHT)])
def test_an_illegal_move_of_the_parameters_is_refused_by_name(now, to):
    _, u = _unit()
    u.params_state = now
    with pytest.raises(RuntimeError, match=f"from {now.name} to {to.name}"):
        u.move_params(to)


def test_a_gradient_cannot_be_reduced_before_its_backward_began():
    _, u = _unit()
    with pytest.raises(RuntimeError, match="from WAITING to REDUCING"):
        u.move_grads(GradState.REDUCING)
