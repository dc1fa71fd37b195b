"""zl.DDP against independent references: a single process on the global batch, and PyTorch's
own DistributedDataParallel, on the GPT and on AwkwardModel (odd sizes, a frozen layer, an
unused branch, a weight used twice, tied weights)."""


import contextlib
import functools

import pytest
import torch
import torch.utils.checkpoint
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import zerolab as zl

from helpers import PARITY_ADAMW, backward_in_micro_batches, build
from tolerances import fp32_adamw_tol
from zerolab.models import AwkwardModel
from zerolab.engines.single import SingleProcess

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

STEPS = 4
# Adam divides by sqrt(v) + eps, so a gradient component that is nearly zero turns rounding
# noise into an update of up to ~lr: two correct summation orders (N ranks vs one process,
# PyTorch DDP vs one process alike) then differ by a few 1e-6. eps=1e-6 bounds that
# amplification (update change <= lr * dgrad / eps); tests/tolerances.py derives the fp32
# tolerance from it and checks its premise on this CPU's kernels.
OPT = PARITY_ADAMW
BUCKET_MB = {"gpt": 0.02, "awkward": 0.0002}   # small, so there are several buckets
# stated tolerances on the fp32 master weights after STEPS AdamW steps, against the same
# precision in one process: bf16/fp16 gradients are rounded once more when they are summed
TOL = {"fp32": fp32_adamw_tol(STEPS), "bf16": 2e-3, "fp16": 2e-3}




def run_zl(kind, precision, rank, n, steps=STEPS, micro=1):
    # ranks build DIFFERENT initial weights: the broadcast from rank 0 must fix that
    model, data, loss_fn, B = build(kind, 0 if rank == 0 else 100 + rank)
    eng = zl.DDP(model, OPT, precision=precision, bucket_mb=BUCKET_MB[kind])
    applied = []
    for s in range(steps):
        x, y = data.batch(s, B * micro, rank, n)
        backward_in_micro_batches(
            eng, lambda m: loss_fn(eng, (x[m * B:(m + 1) * B], y[m * B:(m + 1) * B]))[1] / micro, micro)
        applied.append(eng.step())
        eng.zero_grad()
    return eng, applied


def run_torch_ddp(kind, rank, n):
    model, data, loss_fn, B = build(kind, 0 if rank == 0 else 100 + rank)
    ddp = DistributedDataParallel(model, find_unused_parameters=(kind == "awkward"))
    opt = OPT(ddp.parameters())
    for s in range(STEPS):
        loss_fn(ddp, data.batch(s, B, rank, n))[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def worker_parity(configs):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind, precision in configs:
        eng, applied = run_zl(kind, precision, rank, n)
        out[kind, precision] = {"state": eng.full_state_dict(), "applied": applied}
        if precision == "fp32":
            out[kind, "torch"] = run_torch_ddp(kind, rank, n)
    return out


def reference(kind, precision, n, micro=1):
    """One process, the global batch (n ranks x micro micro-batches x B rows)."""
    model, data, loss_fn, B = build(kind, 0)
    eng = SingleProcess(model, OPT, precision=precision, track_peak=False)
    for s in range(STEPS):
        eng.backward(loss_fn(eng, data.batch(s, B * micro * n))[1])
        eng.step()
        eng.zero_grad()
    return eng.full_state_dict()


def worker_reference(configs, n):
    """The single-process references, run in a launched process set up like the ranks (one
    thread, the same kernels), so that at N=1 the comparison is exact even in bf16."""
    return {(kind, precision): reference(kind, precision, n) for kind, precision in configs}


def plain_torch_reference(kind, n):
    """Not even zerolab's single engine: model, AdamW, global batch."""
    model, data, loss_fn, B = build(kind, 0)
    opt = OPT(model.parameters())
    for s in range(STEPS):
        loss_fn(model, data.batch(s, B * n))[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict()


def assert_close_states(got, want, tol, what):
    assert got.keys() == want.keys(), what
    for k in want:
        err = (got[k].float() - want[k].float()).abs().max().item()
        assert err <= tol, f"{what}: {k} differs by {err:.3g} > {tol}"


CONFIGS = [("gpt", "fp32"), ("awkward", "fp32"), ("gpt", "bf16"), ("awkward", "fp16")]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_parity_with_single_process_and_pytorch_ddp(n):
    configs = CONFIGS if n != 4 else CONFIGS[:2] + [("gpt", "fp16")]
    results = zl.launch(worker_parity, world_size=n, args=(configs,), timeout=240)
    refs = zl.launch(worker_reference, world_size=1, args=(configs, n), timeout=240)[0]
    for kind, precision in configs:
        tol = TOL[precision]
        ref = refs[kind, precision]
        init, *_ = build(kind, 0)
        init = init.state_dict()
        moved = sum((ref[k] - init[k]).abs().sum().item() for k in ref)
        for r, res in enumerate(results):
            what = f"{kind} {precision} N={n} rank {r}"
            assert all(res[kind, precision]["applied"]), what
            assert_close_states(res[kind, precision]["state"], ref, tol, what + " vs single process")
            # on average the ranks' weights sit much closer to the reference than to where
            # training started (the max tolerance alone is about two lr-sized steps)
            off = sum((res[kind, precision]["state"][k] - ref[k]).abs().sum().item() for k in ref)
            assert off <= 0.02 * moved, (what, off, moved)
            if precision == "fp32":
                assert_close_states(res[kind, precision]["state"], plain_torch_reference(kind, n), tol,
                                    what + " vs plain torch")
                assert_close_states(res[kind, precision]["state"], res[kind, "torch"], tol,
                                    what + " vs PyTorch DDP")
        # the unused branch and the frozen layer never move; the model really trained
        if kind == "awkward":
            state = results[0][kind, precision]["state"]
            for k in ("unused.weight", "unused.bias", "frozen.weight"):
                # in fp16 the frozen layer is held in fp16, like every compute copy
                want = init[k]
                if k.startswith("frozen"):
                    want = want.to(zl.precision.policy(precision).compute_dtype).float()
                assert torch.equal(state[k], want), k
            assert not torch.equal(state["encoder.weight"], init["encoder.weight"])


def worker_features():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    # gradient accumulation: 2 micro-batches, the first under no_sync (no communication)
    eng, _ = run_zl("gpt", "fp32", rank, n, steps=2, micro=2)
    out["accum"] = eng.full_state_dict()
    model, data, loss_fn, B = build("gpt", 0 if rank == 0 else 100 + rank)
    ddp = DistributedDataParallel(model)
    opt = OPT(ddp.parameters())
    for s in range(2):
        x, y = data.batch(s, B * 2, rank, n)
        with ddp.no_sync():
            (loss_fn(ddp, (x[:B], y[:B]))[1] / 2).backward()
        (loss_fn(ddp, (x[B:], y[B:]))[1] / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["accum_torch"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["accum_calls"] = sum(1 for r in eng.comm.records if r.tag.startswith("bucket"))
    out["buckets"] = len(eng.buckets.buckets)

    # overlap: buckets launched during backward, before the end-of-backward callback
    model, data, loss_fn, B = build("gpt", 0)
    eng = zl.DDP(model, OPT, bucket_mb=0.02)
    eng.comm.reset()
    eng.backward(loss_fn(eng, data.batch(0, B, rank, n))[1])
    recs = eng.comm.records
    out["launched_early"] = sum(1 for r in recs if r.tag.startswith("bucket")
                                and r.start < eng.last_backward["compute_end"])
    out["order"] = [r.tag for r in recs]
    out["bytes"] = sum(r.bytes_sent for r in recs if r.tag.startswith("bucket"))
    out["padded"] = eng.buckets.padded_numel
    out["n_params"] = len(eng.params)
    out["memory"] = eng.memory_report()

    # fp16 overflow on ONE rank: every rank skips, nothing changes
    model, data, loss_fn, B = build("awkward", 0)
    eng = zl.DDP(model, OPT, precision="fp16")
    before = eng.full_state_dict()
    loss = loss_fn(eng, data.batch(0, B, rank, n))[1]
    if rank == n - 1:
        loss = loss * float("inf")
    eng.backward(loss)
    out["overflow_applied"] = eng.step()
    out["overflow_same"] = all(torch.equal(before[k], v) for k, v in eng.full_state_dict().items())
    out["scale"] = eng.precision.scaler.scale

    # (backward twice without step accumulates, as one process does: tests/test_engines.py)

    # fp32: an inf in ONE rank's loss makes every rank's averaged gradient non-finite: each raises,
    # before the optimizer touches anything (no hang, no half-applied step)
    model, data, loss_fn, B = build("awkward", 0)
    eng = zl.DDP(model, OPT)
    before = eng.full_state_dict()
    loss = loss_fn(eng, data.batch(0, B, rank, n))[1]
    eng.backward(loss * float("inf") if rank == 0 else loss)
    try:
        eng.step()
        out["nonfinite"] = None
    except FloatingPointError as e:
        out["nonfinite"] = str(e)
    out["nonfinite_same"] = all(torch.equal(before[k], v) for k, v in eng.full_state_dict().items())

    # ranks whose models differ in shape: detected at construction, naming the parameter
    torch.manual_seed(0)
    odd = AwkwardModel(d_hidden=7 if rank == 0 else 8)
    try:
        zl.DDP(odd, OPT)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


def test_accumulation_overlap_overflow_and_errors():
    n = 2
    res = zl.launch(worker_features, world_size=n, timeout=240)
    # accumulation over 2 micro-batches equals one process on the whole global batch
    model, data, loss_fn, B = build("gpt", 0)
    opt = OPT(model.parameters())
    for s in range(2):
        loss_fn(model, data.batch(s, B * 2 * n))[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for r in res:
        assert_close_states(r["accum"], r["accum_torch"], fp32_adamw_tol(2), "no_sync vs PyTorch DDP no_sync")
        # against one process the micro-batch sums round differently, and Adam amplifies that
        # in near-zero gradient components (see OPT): two steps of that (tests/tolerances.py)
        assert_close_states(r["accum"], model.state_dict(), fp32_adamw_tol(2), "no_sync vs single process")
        assert r["accum_calls"] == 2 * r["buckets"]   # one all-reduce per bucket per step, not per micro-batch
        assert r["buckets"] >= 3
        assert r["launched_early"] >= 2, r["order"]
        assert r["order"][:r["buckets"]] == [f"bucket{i}" for i in range(r["buckets"])]
        # bytes each rank sends per step: 2 (N-1)/N of the padded gradient buffers (fp32),
        # plus one "reached" flag per parameter riding on the last bucket
        assert r["bytes"] == 2 * (n - 1) / n * (r["padded"] + r["n_params"]) * 4
        assert r["memory"]["grads"] == (r["padded"] + r["n_params"]) * 4 and r["memory"]["params"] >= r["padded"] * 4
        assert r["overflow_applied"] is False and r["overflow_same"] and r["scale"] == 2.0**15
        assert r["mismatch"] is not None and "encoder.weight" in r["mismatch"]
        assert r["nonfinite"] is not None and "non-finite gradients" in r["nonfinite"] and r["nonfinite_same"]


class Branchy(torch.nn.Module):
    """A branch that only some micro-batches use."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(4, 4)
        self.branch = torch.nn.Linear(4, 4)

    def forward(self, x, use_branch):
        h = self.trunk(x)
        return self.branch(h) if use_branch else h


def test_no_sync_keeps_gradients_of_a_branch_only_early_micro_batches_used():
    # one process (world size 1): the bookkeeping, against plain autograd accumulation
    torch.manual_seed(0)
    model = Branchy()
    ref = Branchy()
    ref.load_state_dict(model.state_dict())
    eng = zl.DDP(model, OPT)
    x = torch.randn(3, 4)
    with eng.no_sync():
        eng.backward(eng(x, True).pow(2).mean())
    eng.backward(eng(x, False).pow(2).mean())
    ref(x, True).pow(2).mean().backward()
    ref(x, False).pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name     # reached in the first micro-batch: not "unused"
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    eng.step()
    eng.zero_grad()
    eng.backward(eng(x, False).pow(2).mean())   # now the branch is truly unused: no gradient
    assert model.branch.weight.grad is None and model.trunk.weight.grad is not None


class SharedInAndOut(torch.nn.Module):
    """One layer used inside two reentrant activation checkpoints and once after them: in one
    backward its gradient reaches the engine in three parts, the outer one first. And a branch
    that only some micro-batches use."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.shared, self.out, self.branch = (torch.nn.Linear(8, 8) for _ in range(4))

    def block(self, x):
        return torch.tanh(self.shared(x))

    def forward(self, x, use_branch):
        x = self.inp(x)
        for _ in range(2):
            x = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=True)
        x = self.out(torch.tanh(self.shared(x)))
        return self.branch(x) if use_branch else x


def _rows(step, rank, micro):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + 10 * rank + micro))


PART_RANKS = 3      # not a power of two: there dividing each part rounds unlike dividing their sum
EVERY = tuple(range(PART_RANKS))
PART_SGD = functools.partial(torch.optim.SGD, lr=0.1)   # (not Adam: it would amplify round-off, see OPT)
# Steps; in each, its micro-batches in order (all but the last under no_sync), each given as the
# ranks that use the branch. The last step's gradients are compared.
PARTS = {"one backward": [((),)],
         "branch in the last micro-batch only": [((), EVERY)],
         "branch in the first micro-batch only": [(EVERY, ())],
         "branch on rank 0 only, a step after every rank used it": [(EVERY,), ((0,),)]}


def worker_parts():
    rank = dist.get_rank()
    grads = {}
    for case, steps in PARTS.items():
        model = SharedInAndOut()
        eng = zl.DDP(model, PART_SGD)     # one bucket: a gradient's three parts all arrive before it leaves
        for s, micro in enumerate(steps):
            if s:
                eng.step()
                eng.zero_grad()
            for m, users in enumerate(micro):
                with eng.no_sync() if m < len(micro) - 1 else contextlib.nullcontext():
                    eng(_rows(s, rank, m), rank in users).pow(2).mean().backward()
        grads[case] = {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}
    return grads


def test_a_gradient_in_parts_or_in_micro_batches_is_averaged_whole():
    # a gradient that reaches its bucket in parts (reentrant checkpointing: three here, the outer
    # one first) or over micro-batches (no_sync) is averaged whole, each part divided by N once;
    # a slot this rank's backward did not reach sends zeros, not last step's gradient
    n = PART_RANKS
    res = zl.launch(worker_parts, n, timeout=120)
    for case, steps in PARTS.items():
        ref = SharedInAndOut()            # one process, every rank's micro-batches: the global mean
        opt = PART_SGD(ref.parameters())
        for s, micro in enumerate(steps):
            if s:
                opt.step()
                opt.zero_grad()
            for r in range(n):
                for m, users in enumerate(micro):
                    (ref(_rows(s, r, m), r in users).pow(2).mean() / n).backward()
        for rank, got in enumerate(res):
            for k, p in ref.named_parameters():
                if p.grad is None:
                    assert got[case][k] is None, (case, k)
                else:   # fp32, summed in another order
                    torch.testing.assert_close(got[case][k], p.grad, rtol=1e-5, atol=1e-7,
                                               msg=lambda m: f"{case}, rank {rank}, {k}: {m}")


def test_bad_input_single_process():
    model = AwkwardModel()
    with pytest.raises(ValueError, match="bucket_mb"):
        zl.DDP(model, OPT, bucket_mb=0)
    with pytest.raises(ValueError, match="bucket_mb"):
        zl.DDP(model, OPT, bucket_mb=-1.0)
    with pytest.raises(TypeError, match="optimizer"):
        zl.DDP(AwkwardModel(), "adam")
    frozen = AwkwardModel().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        zl.DDP(frozen, OPT)
    split = AwkwardModel()
    split.head.to("meta")
    with pytest.raises(ValueError, match="one device"):
        zl.DDP(split, OPT)
    with pytest.raises(ValueError, match="precision"):
        zl.DDP(AwkwardModel(), OPT, precision="fp8")
    with pytest.raises(ValueError, match="no trainable"):
        zl.NaiveDDP(frozen, OPT)


def worker_naive():
    rank, n = dist.get_rank(), dist.get_world_size()
    model, data, loss_fn, B = build("awkward", 0 if rank == 0 else 7)
    eng = zl.NaiveDDP(model, OPT)
    for s in range(STEPS):
        eng.backward(loss_fn(eng, data.batch(s, B, rank, n))[1])
        eng.step()
        eng.zero_grad()
    return eng.full_state_dict()


def test_naive_ddp_matches_single_process():
    res = zl.launch(worker_naive, world_size=2, timeout=120)
    ref = plain_torch_reference("awkward", 2)
    for r in res:
        assert_close_states(r, ref, 1e-6, "NaiveDDP")
