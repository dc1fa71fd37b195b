"""zl.ShardedOptimizer against PyTorch's ZeroRedundancyOptimizer and a plain optimizer: its whole contract.

The three run beside each other under PyTorch's own DistributedDataParallel, on the same model,
data and processes: the weights must agree (each element is updated by the same AdamW
arithmetic, so any difference is summation-order round-off: tests/tolerances.py), and the state
each rank holds must be the paper's K Psi / N. The consolidated state_dict must be a plain
AdamW's, loadable both ways.
"""

import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import zerolab as zl
from zerolab.memory import optimizer_tensors
from tolerances import fp32_adamw_tol

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

STEPS = 3
ADAMW = dict(lr=1e-3, eps=1e-6, weight_decay=0.1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(7, 33)        # odd sizes: the flat buffers need padding at N=2 and 4
        self.mid = nn.Linear(33, 17)
        self.head = nn.Linear(17, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(torch.tanh(self.embed(x)))))


def groups(model):
    """nanoGPT's split: weight decay on matrices, none on biases."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def rows(step, rank, n, per_rank=4):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(per_rank * n, 7, generator=g), torch.randn(per_rank * n, 3, generator=g)
    return x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]


def train(kind, steps=STEPS, scheduler=False):
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    if kind == "sharded-first":          # built before DDP wraps the model
        opt = zl.ShardedOptimizer(groups(model), torch.optim.AdamW, **ADAMW)
        ddp = DistributedDataParallel(model)
    else:
        ddp = DistributedDataParallel(model)
        if kind == "plain":
            opt = torch.optim.AdamW(groups(model), **ADAMW)
        elif kind == "torch-zero":
            opt = ZeroRedundancyOptimizer(groups(model)[0]["params"], torch.optim.AdamW, **ADAMW)
            opt.add_param_group(groups(model)[1])
        else:
            opt = zl.ShardedOptimizer(groups(model), torch.optim.AdamW, **ADAMW)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    for step in range(steps):
        x, y = rows(step, rank, n)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    return model, opt


def compare():
    out = {}
    weights = {}
    for kind in ("plain", "torch-zero", "sharded", "sharded-first"):
        model, opt = train(kind)
        weights[kind] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if kind == "sharded":
            out["state_bytes"] = sum(t.numel() * t.element_size() for t in optimizer_tensors(opt.optim)
                                     if t.dim() > 0)
            out["padded"] = sum(b.padded_numel for b in opt.buckets)
            out["numel"] = sum(p.numel() for p in model.parameters())
            out["gather_bytes"] = opt.comm.bytes("all_gather")
            opt.consolidate_state_dict(to=0)
            out["consolidated"] = opt.state_dict() if dist.get_rank() == 0 else None
            try:
                opt.state_dict() if dist.get_rank() == 1 else None
                out["rank1_state_dict"] = "returned"
            except RuntimeError as e:
                out["rank1_state_dict"] = str(e)
            sharded_opt, sharded_model = opt, model
        if kind == "torch-zero":
            out["torch_zero_state_bytes"] = sum(t.numel() * t.element_size() for t in optimizer_tensors(opt.optim)
                                                if t.dim() > 0)
        if kind == "plain":
            out["plain_state"] = copy.deepcopy(opt.state_dict())   # (the resume below steps it)
            plain_model, plain_opt = model, opt
    out["weights"] = weights
    # the consolidated state resumes a plain AdamW, and a plain one resumes the sharded optimizer:
    # one more step each on the same batch lands where the uninterrupted plain run does
    x, y = rows(STEPS, dist.get_rank(), dist.get_world_size())
    sd = [out["consolidated"]]
    dist.broadcast_object_list(sd, src=0)
    resumed = torch.optim.AdamW(groups(plain_model), **ADAMW)
    resumed.load_state_dict(plain_opt.state_dict())
    sharded_opt.load_state_dict(sd[0])                  # its own consolidated state, back in
    for model, opt in ((plain_model, plain_opt), (sharded_model, sharded_opt)):
        ddp = DistributedDataParallel(model)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    out["after_resume"] = {k: (sharded_model.state_dict()[k] - v).abs().max().item()
                           for k, v in plain_model.state_dict().items()}
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["N=2", "N=4"])
def seen(request):
    return request.param, zl.launch(compare_and_schedule, request.param)


def test_the_weights_match_zero_redundancy_optimizer_and_a_plain_adamw(seen):
    n, results = seen
    for r in results:
        ref = r["weights"]["plain"]
        for kind in ("torch-zero", "sharded", "sharded-first"):
            worst = max((r["weights"][kind][k] - ref[k]).abs().max().item() for k in ref)
            assert worst <= fp32_adamw_tol(STEPS), (kind, worst)
        # every rank holds the same whole model after the all-gather
    assert all(torch.equal(results[0]["weights"]["sharded"][k], results[-1]["weights"]["sharded"][k])
               for k in results[0]["weights"]["sharded"])


def test_each_rank_holds_k_psi_over_n_of_state_and_gathers_the_rest(seen):
    n, results = seen
    for r in results:
        # Adam's two fp32 moments (K = 8 bytes) of the parameters' pieces in this rank's slices
        # (padding has none): at most K * padded / N, at most K * (padding) below it
        assert 8 * (r["padded"] // n - (r["padded"] - r["numel"])) <= r["state_bytes"] <= 8 * r["padded"] // n
        assert r["padded"] - r["numel"] < n * 2          # padding: under N per group (2 groups)
        # one all-gather per group per step: (N-1)/N of the flat buffers, fp32
        assert r["gather_bytes"] == STEPS * (n - 1) * r["padded"] // n * 4
    # every element's state lives on exactly one rank: K Psi over all of them, as
    # ZeroRedundancyOptimizer's (which gives whole parameters to ranks, unevenly split)
    assert sum(r["state_bytes"] for r in results) == 8 * results[0]["numel"]
    assert sum(r["torch_zero_state_bytes"] for r in results) == 8 * results[0]["numel"]


def test_the_consolidated_state_is_a_plain_adamw_state_dict_and_resumes_both_ways(seen):
    n, results = seen
    plain, mine = results[0]["plain_state"], results[0]["consolidated"]
    assert [g["params"] for g in mine["param_groups"]] == [g["params"] for g in plain["param_groups"]]
    assert mine["param_groups"][1]["weight_decay"] == 0.0 and mine["param_groups"][0]["weight_decay"] == 0.1
    assert set(mine["state"]) == set(plain["state"])
    for i, st in plain["state"].items():
        for key, value in st.items():
            torch.testing.assert_close(mine["state"][i][key], value, rtol=0, atol=1e-6)
    assert "consolidate_state_dict" in results[1]["rank1_state_dict"]
    for r in results:
        assert max(r["after_resume"].values()) <= fp32_adamw_tol(STEPS + 1)


def with_a_scheduler():
    model, _ = train("plain", scheduler=True)
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model, opt = train("sharded", scheduler=True)
    return max((model.state_dict()[k] - v).abs().max().item() for k, v in ref.items()), opt.param_groups[0]["lr"]


def compare_and_schedule():
    out = compare()
    if dist.get_world_size() == 2:      # (the scheduler run needs only one world size)
        out["scheduled"] = with_a_scheduler()
    return out


def test_a_learning_rate_scheduler_drives_it_as_it_drives_a_plain_optimizer(seen):
    n, results = seen
    if n != 2:
        pytest.skip("the scheduler runs at N=2")
    for worst, lr in (r["scheduled"] for r in results):
        assert lr == ADAMW["lr"] * 0.5 ** STEPS
        assert worst <= fp32_adamw_tol(STEPS)


def test_refuses_optimizers_that_need_a_closure():
    # (whole-matrix optimizers are accepted: tests/conformance/test_whole_matrix.py)
    model = Net()
    with pytest.raises(TypeError, match="needs a closure"):
        zl.ShardedOptimizer(model.parameters(), torch.optim.LBFGS)
    with pytest.raises(TypeError, match="optimizer_class"):
        zl.ShardedOptimizer(model.parameters(), partial(torch.optim.AdamW, lr=1e-3))


def test_one_process_is_the_plain_optimizer():
    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    plain = torch.optim.AdamW(groups(a), **ADAMW)
    sharded = zl.ShardedOptimizer(groups(b), torch.optim.AdamW, **ADAMW)
    for step in range(STEPS):
        x, y = rows(step, 0, 1)
        for model, opt in ((a, plain), (b, sharded)):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    for k, v in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[k], v, rtol=0, atol=0)


# ------------------------------------------------------------------ the rest of the contract
# Scenarios of PyTorch's test_zero_redundancy_optimizer.py, each run with zl.ShardedOptimizer,
# ZeroRedundancyOptimizer and (where it has the same contract) the plain optimizer side by side.


class SGDWithNewKey(torch.optim.SGD):
    """Adds a key to its groups when it steps (torch's test_step_with_extra_inner_key)."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            group["new_key"] = 0.1


class SGDWithStepKWArg(torch.optim.SGD):
    """Takes a keyword at step() (torch's test_step_with_kwargs)."""

    def step(self, closure=None, kwarg=None):
        super().step()              # (as torch's: the closure is not called)
        kwarg.append(5)


def skipping_net():
    """cases.Branchy: a frozen layer, a tied pair and a branch skipped on some steps."""
    from cases import model
    return model()


def contract():
    from cases import loss_of
    out = {}
    # the constructor: torch's exception types, and a misspelt keyword named
    for kind in ("torch-zero", "sharded"):
        def make(params, cls=torch.optim.AdamW, **kw):
            if kind == "torch-zero":
                return ZeroRedundancyOptimizer(params, cls, **kw)
            return zl.ShardedOptimizer(params, cls, **kw)
        errors = {}
        for case, build in {
            "misspelt keyword": lambda: make(Net().parameters(), lr=1e-3, weight_deacy=0.1),
            "mixed dtypes": lambda: make([nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, dtype=torch.float64))]),
            "sparse": lambda: make([nn.Parameter(torch.zeros(3, 3).to_sparse())]),
            "a tensor, not an iterable": lambda: make(nn.Parameter(torch.zeros(3))),
        }.items():
            try:
                build()
                errors[case] = "accepted"
            except Exception as e:
                errors[case] = (type(e).__name__, str(e))
        out[("errors", kind)] = errors
        # a key the inner optimizer adds shows outside; step's keywords reach the inner step
        model = Net()
        opt = make(model.parameters(), SGDWithNewKey, lr=0.1)
        model(torch.randn(2, 7)).sum().backward()
        opt.step()
        out[("new key", kind)] = [g.get("new_key") for g in opt.param_groups]
        model = Net()
        opt = make(model.parameters(), SGDWithStepKWArg, lr=0.1)
        model(torch.randn(2, 7)).sum().backward()
        seen = []
        opt.step(kwarg=seen)
        opt.step(0, kwarg=seen)         # (the closure goes to the inner step, which ignores it)
        out[("step kwargs", kind)] = seen
    # closure, add_param_group after a step, and a parameter without a gradient on some steps,
    # against the plain optimizer; then the consolidated state: per-parameter step counts, every
    # hyperparameter, loadable into a plain optimizer that then steps the same
    for kind in ("plain", "sharded"):
        net = skipping_net()
        params = [p for n, p in net.named_parameters() if not n.startswith("out.")]
        opt = (torch.optim.AdamW(params, lr=1e-2) if kind == "plain" else
               zl.ShardedOptimizer(params, torch.optim.AdamW, lr=1e-2))
        for step in range(6):
            if step == 3:
                opt.add_param_group({"params": list(net.out.parameters()), "lr": 3e-2})
            def again(step=step):
                opt.zero_grad()
                loss = loss_of(net, step, None if kind == "sharded" else _global(step))
                loss.backward()
                if kind == "sharded":           # (what the script's own DDP does: average)
                    for p in net.parameters():
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
                            p.grad /= dist.get_world_size()
                return loss
            opt.step(again)
        out[("weights", kind)] = {k: v.clone() for k, v in net.state_dict().items()}
        if kind == "sharded":
            opt.consolidate_state_dict(to=0)
            out["consolidated"] = opt.state_dict() if dist.get_rank() == 0 else None
        else:
            out["plain state"] = opt.state_dict()
    return out


def state_by_parameter():
    """SGD with momentum after one step, beside the plain SGD on the same gradients: opt.optim.state[p]
    for the script's parameter p (its momentum_buffer: p's whole gradient where p lies in this
    rank's slice; the piece of it the slice holds where an edge cuts it; nothing where it is
    elsewhere); and the shares of a group added after construction."""
    out = {}
    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    plain = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    sharded = zl.ShardedOptimizer(b.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(3))
    for model, opt in ((a, plain), (b, sharded)):
        model(x).pow(2).mean().backward()
        opt.step()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        lo, hi = sharded.views.piece[id(q)]
        mine = sharded.optim.state[q]
        out[name] = (plain.state[p]["momentum_buffer"].reshape(-1)[lo:hi],
                     None if "momentum_buffer" not in mine else mine["momentum_buffer"].reshape(-1), lo, hi, q.numel())
    # ZeroRedundancyOptimizer's add_param_group test: 45 elements, then a group of 3
    params = [torch.rand(n, 1, requires_grad=True) for n in [9, 7, 5, 3, 9, 7, 5]]
    opt = zl.ShardedOptimizer(params, torch.optim.SGD, lr=0.01)
    opt.add_param_group({"params": [torch.rand(3, 1, requires_grad=True)]})
    out["shares"] = sum(v.numel() for g in opt.optim.param_groups for v in g["params"])
    return out


def uneven_inputs():
    """Rank r runs 2 + r steps inside Join([setter, opt]): a rank that ran out keeps stepping with the
    others, its gradients set by the first joinable's hook (as ZeroRedundancyOptimizer's users do).
    The gradient of step k is the same on every rank; the weights after the last step must be a
    plain Adam's after 2 + N - 1 steps on those gradients."""
    from torch.distributed.algorithms.join import Join, Joinable, JoinHook
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    opt = zl.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    grads = [[torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * k + i))
              for i, p in enumerate(model.parameters())] for k in range(2 + n - 1)]
    done = [0]

    def set_grads():
        for p, g in zip(model.parameters(), grads[done[0]]):
            p.grad = g.clone()
        done[0] += 1

    class Setter(Joinable):
        def __init__(self):
            super().__init__()

        def join_hook(self, **kwargs):
            hook = JoinHook()
            hook.main_hook = set_grads
            return hook

        @property
        def join_device(self):
            return torch.device("cpu")

        @property
        def join_process_group(self):
            return dist.group.WORLD

    setter = Setter()
    with Join([setter, opt]):
        for _ in range(2 + rank):
            Join.notify_join_context(setter)
            set_grads()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, done[0]


def _global(step):
    from cases import batch
    return batch(step)


def contract_and_the_rest():
    return {**contract(), "state": state_by_parameter(), "uneven": uneven_inputs()}


@pytest.fixture(scope="module")
def contract_seen():
    return zl.launch(contract_and_the_rest, 2)


def test_the_inner_state_answers_to_the_scripts_parameters(contract_seen):
    for r in contract_seen:
        held = 0
        for name, (want, got, lo, hi, numel) in ((k, v) for k, v in r["state"].items() if k != "shares"):
            if lo == hi:
                assert got is None or got.numel() == 0, name     # (wholly on the other rank)
                continue
            held += hi - lo
            assert got is not None and torch.equal(got, want), name
        assert held > 0
    # every parameter's state is on exactly one rank, whole or in pieces
    pieces = [v for r in contract_seen for k, v in r["state"].items() if k != "shares"]
    assert sum(hi - lo for _, _, lo, hi, _ in pieces) == sum(v[4] for k, v in contract_seen[0]["state"].items()
                                                             if k != "shares")
    # a group added later joins its dtype's one flat buffer: each rank holds half of all 48 elements
    assert [r["state"]["shares"] for r in contract_seen] == [24, 24]


def test_a_rank_out_of_inputs_keeps_stepping_inside_join(contract_seen):
    torch.manual_seed(0)
    model = Net()
    plain = torch.optim.Adam(model.parameters(), lr=0.01)
    n = len(contract_seen)
    for k in range(2 + n - 1):
        for i, p in enumerate(model.parameters()):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * k + i))
        plain.step()
    for rank, (got, steps) in enumerate(r["uneven"] for r in contract_seen):
        assert steps == 2 + n - 1, (rank, steps)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6)


def test_constructor_errors_are_zero_redundancy_optimizers(contract_seen):
    r = contract_seen[0]
    mine, theirs = r[("errors", "sharded")], r[("errors", "torch-zero")]
    for case in mine:
        assert mine[case] != "accepted" and theirs[case] != "accepted", case
        assert mine[case][0] == theirs[case][0], (case, mine[case], theirs[case])
    assert "weight_deacy" in mine["misspelt keyword"][1]


def test_groups_sync_both_ways_and_step_takes_keywords(contract_seen):
    r = contract_seen[0]
    assert r[("new key", "sharded")] == r[("new key", "torch-zero")] == [0.1]
    assert r[("step kwargs", "sharded")] == r[("step kwargs", "torch-zero")] == [5, 5]


def test_closure_added_group_and_skipped_parameters_match_the_plain_optimizer(contract_seen):
    r = contract_seen[0]
    want, got = r[("weights", "plain")], r[("weights", "sharded")]
    assert max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-6
    plain, mine = r["plain state"], r["consolidated"]
    assert mine["param_groups"] == plain["param_groups"]       # every hyperparameter, both groups
    assert sorted(mine["state"]) == sorted(plain["state"])
    assert {float(st["step"]) for st in mine["state"].values()} == {3.0, 4.0, 6.0}   # added, skipped
    for k, st in plain["state"].items():
        for key, value in st.items():
            torch.testing.assert_close(mine["state"][k][key], value, rtol=0, atol=1e-6)
    # loaded into a plain AdamW (every key it needs is there), it steps as the plain one does
    after = []
    for state in (mine, plain):
        net = skipping_net()
        params = [p for n, p in net.named_parameters() if not n.startswith("out.")]
        resumed = torch.optim.AdamW([{"params": params}, {"params": list(net.out.parameters())}])
        net.load_state_dict(want)
        resumed.load_state_dict(state)
        for p in net.parameters():
            p.grad = torch.ones_like(p) if p.requires_grad else None
        resumed.step()
        after.append(net.state_dict())
    assert max(float((after[0][k] - after[1][k]).abs().max()) for k in want) <= 1e-6
