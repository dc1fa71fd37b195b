"""zl.DDP beside PyTorch's DistributedDataParallel, in the same processes, step by step.

Both wrap a copy of cases.py's model (a frozen layer, a tied pair, odd sizes, a branch skipped
on some steps: DistributedDataParallel needs find_unused_parameters=True for it) and run
PyTorch's loop with AdamW, the second half with two micro-batches per step (no_sync on the
first). After every backward each rank's p.grad must be DistributedDataParallel's (None where
no rank reached the parameter), and after every step the weights; at the end the optimizer's
state dict is the one AdamW holds under DistributedDataParallel. Scenarios from PyTorch's
test_c10d / DistributedDataParallel tests (unused parameters, no_sync, tied weights) and
DeepSpeed's tests/unit/v1/zero/ (frozen parameters, uneven shapes).
"""

import contextlib

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import zerolab as zl

from cases import STEPS, TOL, model, my_rows, takes_branch

pytestmark = pytest.mark.slow     # launches ranks (make test-fast leaves it out)


def side_by_side():
    mine_net, theirs_net = model(), model()
    mine_opt = torch.optim.AdamW(mine_net.parameters(), lr=1e-2)
    theirs_opt = torch.optim.AdamW(theirs_net.parameters(), lr=1e-2)
    mine = zl.DDP(mine_net, mine_opt)
    theirs = DistributedDataParallel(theirs_net, find_unused_parameters=True)
    gaps, nones = [], []
    for step in range(STEPS):
        x, y = my_rows(step)
        micro = 2 if step >= STEPS // 2 else 1
        for m in range(micro):
            rows = slice(m * len(x) // micro, (m + 1) * len(x) // micro)
            last = m == micro - 1
            for wrapper in (mine, theirs):
                with contextlib.nullcontext() if last else wrapper.no_sync():
                    out = wrapper(x[rows], takes_branch(step))
                    (torch.nn.functional.mse_loss(out, y[rows]) / micro).backward()
        grads = [(p.grad, q.grad) for p, q in zip(mine_net.parameters(), theirs_net.parameters())
                 if p.requires_grad]
        nones.append([(a is None, b is None) for a, b in grads])
        gaps.append(max(float((a - b).abs().max()) for a, b in grads if a is not None and b is not None))
        mine_opt.step()
        theirs_opt.step()
        mine_opt.zero_grad()
        theirs_opt.zero_grad()
        gaps.append(max(float((p - q).abs().max()) for p, q in zip(mine_net.parameters(), theirs_net.parameters())))
    states = (mine_opt.state_dict(), theirs_opt.state_dict())
    return gaps, nones, states


@pytest.fixture(scope="module", params=[2, 4], ids=["N=2", "N=4"])
def seen(request):
    return zl.launch(side_by_side, request.param)


def test_gradients_and_weights_are_distributed_data_parallels_at_every_step(seen):
    for gaps, nones, _ in seen:
        assert max(gaps) <= TOL, gaps
        for step, pairs in enumerate(nones):
            assert all(a == b for a, b in pairs), (step, pairs)
            # the skipped branch has no gradient on either (no rank reached it)
            assert any(a for a, _ in pairs) == (not takes_branch(step)), (step, pairs)


def test_the_optimizer_state_is_adamws_under_distributed_data_parallel(seen):
    for _, _, (mine, theirs) in seen:
        assert mine["param_groups"] == theirs["param_groups"]
        assert sorted(mine["state"]) == sorted(theirs["state"])
        for k, st in theirs["state"].items():
            for key, value in st.items():
                assert float((mine["state"][k][key] - value).abs().max()) <= TOL, (k, key)
