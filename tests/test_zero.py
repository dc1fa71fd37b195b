"""zl.ZeRO stages 1 and 2 against independent references.

* parity: a single process on the global batch (plain torch, and zl.SingleProcess for bf16/fp16),
  zl.DDP, and PyTorch's ZeroRedundancyOptimizer, on the GPT and on AwkwardModel, N = 1..4;
* memory: MEASURED model states (memory_report) against the paper's closed-form formula;
* communication: the ledger's bytes per step against 2 (N-1)/N Psi;
* fp16 overflow on one rank, clipping, accumulation, other optimizers, bad input.

Each world size is ONE launch (ranks are slow to start on a shared CPU): a worker runs every
check for that N and the tests below read its results.
"""

from functools import lru_cache, partial

import pytest
import torch
import torch.distributed as dist

import zerolab as zl

from helpers import PARITY_ADAMW, backward_in_micro_batches, build
from tolerances import fp32_adamw_tol
from zerolab.data import CharDataset, SyntheticRegression
from zerolab.memory import model_state_bytes
from zerolab.models import GPT, AwkwardModel, gpt_config, gpt_loss, num_params, regression_loss
from zerolab.engines.single import SingleProcess

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

STEPS = 3
# eps=1e-6 bounds how much Adam amplifies rounding noise on near-zero gradients (tests/tolerances.py)
OPT = PARITY_ADAMW
OPTIMIZERS = {"adamw": OPT, "adam": partial(torch.optim.Adam, lr=1e-3, eps=1e-6),
              "sgd": partial(torch.optim.SGD, lr=0.05, momentum=0.9)}
BUCKET_MB = {"gpt": 0.02, "awkward": 0.0002}   # small, so there are several buckets
# fp32: two summation orders after STEPS AdamW steps (tests/tolerances.py); bf16/fp16 gradients
# are rounded once more when they are summed
TOL = {"fp32": fp32_adamw_tol(STEPS), "bf16": 2e-3, "fp16": 2e-3}




def train(make_engine, kind, rank, n, steps=STEPS, micro=1):
    # ranks build DIFFERENT initial weights: the broadcast from rank 0 must fix that
    model, data, loss_fn, B = build(kind, 0 if rank == 0 else 100 + rank)
    eng = make_engine(model)
    applied = []
    for s in range(steps):
        x, y = data.batch(s, B * micro, rank, n)
        backward_in_micro_batches(
            eng, lambda m: loss_fn(eng, (x[m * B:(m + 1) * B], y[m * B:(m + 1) * B]))[1] / micro, micro)
        applied.append(eng.step())
        eng.zero_grad()
    return eng, applied


def zero(stage, kind, precision="fp32", opt="adamw", **kw):
    return lambda model: zl.ZeRO(model, OPTIMIZERS[opt], stage=stage, precision=precision,
                                 bucket_mb=BUCKET_MB[kind], **kw)


def run_zero_redundancy(kind, rank, n):
    """PyTorch's own sharded optimizer on a PyTorch DDP model: the same run."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    model, data, loss_fn, B = build(kind, 0 if rank == 0 else 100 + rank)
    ddp = DistributedDataParallel(model, find_unused_parameters=(kind == "awkward"))
    opt = ZeroRedundancyOptimizer([p for p in ddp.parameters() if p.requires_grad],
                                  optimizer_class=torch.optim.AdamW, lr=1e-3, eps=1e-6, weight_decay=0.1)
    for s in range(STEPS):
        loss_fn(ddp, data.batch(s, B, rank, n))[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def memory_run(stage, precision, bucket_mb=0.05):
    """Two GPT steps; memory measured after the second (gradients held), bytes of that step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model, data, loss_fn, B = build("gpt", 0)
    eng = zl.ZeRO(model, OPT, stage=stage, precision=precision, bucket_mb=bucket_mb)
    for s in range(2):
        eng.zero_grad()
        eng.comm.reset()
        eng.backward(loss_fn(eng, data.batch(s, B, rank, n))[1])
        eng.step()
    by_op = {op: eng.comm.bytes(op=op) for op in ("reduce_scatter", "all_gather", "all_reduce")}
    return {"memory": eng.memory_report(), "bytes": by_op, "padded": eng.buckets.padded_numel,
            "buckets": len(eng.buckets), "records": [(r.op, r.tag) for r in eng.comm.records]}


def overflow_run(stage):
    """fp16: rank 1's loss is inf in step 1. Every rank must skip, nothing may change."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model, data, loss_fn, B = build("awkward", 0)
    eng = zl.ZeRO(model, OPT, stage=stage, precision="fp16", bucket_mb=BUCKET_MB["awkward"])
    out = []
    for s in range(3):
        loss = loss_fn(eng, data.batch(s, B, rank, n))[1]
        if s == 1 and rank == 1:
            loss = loss * float("inf")
        before = ([m.detach().clone() for m in eng.master_shards],
                  [{k: v.clone() for k, v in st.items()} for st in eng.optimizer.state.values()],
                  eng.full_state_dict())
        eng.backward(loss)
        applied = eng.step()
        eng.zero_grad()
        after = ([m.detach() for m in eng.master_shards], list(eng.optimizer.state.values()),
                 eng.full_state_dict())
        unchanged = (all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
                     and all(torch.equal(b[k], a[k]) for b, a in zip(before[1], after[1]) for k in b)
                     and all(torch.equal(before[2][k], after[2][k]) for k in after[2]))
        out.append((applied, unchanged, eng.precision.scale))
    return out


def grad_bytes_during_backward(size, bucket_mb=0.05):
    """Stage 2: the most gradient bytes held at any hook, minus the owned slices, and the pool."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(gpt_config(size, bias=False))
    eng = zl.ZeRO(model, OPT, stage=2, bucket_mb=bucket_mb)
    eng.grad_trace = []
    eng.backward(gpt_loss(eng, CharDataset(32).batch(0, 2, rank, n))[1])
    owned = sum(g.numel() * g.element_size() for g in eng.grad_shards)
    largest = max(p.numel() for p in model.parameters()) * 4
    return {"extra": max(b for _, b in eng.grad_trace) - owned, "largest_param": largest,
            "buffer_bytes": eng.buffer_numel * 4, "max_buffers": eng.max_buffers,
            "psi": num_params(model)}


def tiny_model_run():
    """A model with one-element buckets at N = 4: three of four slices are all padding."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    eng = zl.ZeRO(model, OPT, stage=2, bucket_mb=1e-7)
    x = torch.arange(8, dtype=torch.float32).view(8, 1) / 8
    for s in range(2):
        xs = x[rank::n]
        eng.backward(((eng(xs) - 2 * xs) ** 2).sum() / 8)
        eng.step()
        eng.zero_grad()
    return eng.full_state_dict(), [b.padded_numel for b in eng.buckets.buckets]


def worker(n_expected):
    rank, n = dist.get_rank(), dist.get_world_size()
    assert n == n_expected
    out = {}
    for kind in ("gpt", "awkward"):
        for stage in (1, 2):
            eng, applied = train(zero(stage, kind), kind, rank, n)
            out["parity", kind, stage] = (eng.full_state_dict(), applied)
        ddp = lambda model: zl.DDP(model, OPT, bucket_mb=BUCKET_MB[kind])  # noqa: E731
        out["parity", kind, "ddp"] = (train(ddp, kind, rank, n)[0].full_state_dict(), None)
        if n > 1:
            out["parity", kind, "zero_redundancy"] = (run_zero_redundancy(kind, rank, n), None)
    if n in (1, 2, 4):
        for stage in (1, 2):
            for precision in ("fp32", "bf16"):
                out["memory", stage, precision] = memory_run(stage, precision)
    if n == 2:
        # other precisions, optimizers, accumulation over micro-batches, clipping
        for key, kind, stage, kw, micro in [
                ("bf16", "gpt", 2, {"precision": "bf16"}, 1),
                ("fp16", "awkward", 1, {"precision": "fp16"}, 1),
                ("adam", "awkward", 2, {"opt": "adam"}, 1),
                ("sgd", "awkward", 1, {"opt": "sgd"}, 1),
                ("sgd", "awkward", 2, {"opt": "sgd"}, 1),
                ("micro_clip", "gpt", 1, {"max_grad_norm": 0.5}, 2),
                ("micro_clip", "gpt", 2, {"max_grad_norm": 0.5}, 2),
                ("micro_bf16", "gpt", 2, {"precision": "bf16"}, 2)]:
            eng, applied = train(zero(stage, kind, **kw), kind, rank, n, micro=micro)
            out["extra", key, stage] = (eng.full_state_dict(), applied)
        out["overflow"] = {stage: overflow_run(stage) for stage in (1, 2)}
        out["buffers"] = {size: grad_bytes_during_backward(size) for size in ("nano", "tiny")}
    if n == 4:
        out["tiny"] = tiny_model_run()
    return out


@lru_cache(maxsize=None)
def results(n):
    return zl.launch(worker, world_size=n, args=(n,), timeout=280)


# ------------------------------------------------------------------ references


@lru_cache(maxsize=None)
def reference(kind, n, precision="fp32", opt="adamw", micro=1, max_grad_norm=None):
    """One process, the global batch (n ranks x micro micro-batches x B rows)."""
    model, data, loss_fn, B = build(kind, 0)
    if precision == "fp32" and max_grad_norm is None:
        o = OPTIMIZERS[opt](model.parameters())   # not even zerolab: plain torch
        for s in range(STEPS):
            loss_fn(model, data.batch(s, B * micro * n))[1].backward()
            o.step()
            o.zero_grad(set_to_none=True)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    eng = SingleProcess(model, OPTIMIZERS[opt], precision=precision, max_grad_norm=max_grad_norm,
                        track_peak=False)
    for s in range(STEPS):
        eng.backward(loss_fn(eng, data.batch(s, B * micro * n))[1])
        eng.step()
        eng.zero_grad()
    return eng.full_state_dict()


def assert_close(got, want, tol, what):
    assert got.keys() == want.keys(), what
    for k in want:
        assert got[k].shape == want[k].shape, (what, k)
        err = (got[k].float() - want[k].float()).abs().max().item()
        assert err <= tol, f"{what}: {k} differs by {err:.3g} > {tol}"


# ------------------------------------------------------------------ parity


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_parity_with_single_process_ddp_and_pytorch_zero(n):
    res = results(n)
    for kind in ("gpt", "awkward"):
        ref = reference(kind, n)
        init = build(kind, 0)[0].state_dict()
        for r in range(n):
            for stage in (1, 2):
                state, applied = res[r]["parity", kind, stage]
                what = f"{kind} stage {stage} N={n} rank {r}"
                assert all(applied), what
                assert_close(state, ref, TOL["fp32"], what + " vs single process")
                assert_close(state, res[r]["parity", kind, "ddp"][0], TOL["fp32"], what + " vs zl.DDP")
                if n > 1:
                    assert_close(state, res[r]["parity", kind, "zero_redundancy"][0], TOL["fp32"],
                                 what + " vs ZeroRedundancyOptimizer")
            moved = sum((ref[k] - init[k]).abs().sum().item() for k in ref)
            assert moved > 0.1, "the reference did not train"
        if kind == "awkward":
            state = res[0]["parity", kind, 2][0]
            # the unused branch and the frozen layer never move, not even by weight decay
            for k in ("unused.weight", "unused.bias", "frozen.weight", "frozen.bias"):
                assert torch.equal(state[k], init[k]), k
            # tied weights: one tensor under both keys, and only the original keys
            assert state["decoder.weight"] is state["encoder.weight"]
            assert list(state) == list(init)


def test_precisions_optimizers_accumulation_and_clipping():
    res = results(2)
    cases = {("bf16", 2): dict(kind="gpt", precision="bf16"),
             ("fp16", 1): dict(kind="awkward", precision="fp16"),
             ("adam", 2): dict(kind="awkward", opt="adam"),
             ("sgd", 1): dict(kind="awkward", opt="sgd"),
             ("sgd", 2): dict(kind="awkward", opt="sgd"),
             ("micro_clip", 1): dict(kind="gpt", micro=2, max_grad_norm=0.5),
             ("micro_clip", 2): dict(kind="gpt", micro=2, max_grad_norm=0.5),
             ("micro_bf16", 2): dict(kind="gpt", micro=2, precision="bf16")}
    for (key, stage), c in cases.items():
        c = dict(c)
        kind = c.pop("kind")
        ref = reference(kind, 2, **c)
        tol = TOL[c.get("precision", "fp32")]
        for r in range(2):
            state, applied = res[r]["extra", key, stage]
            assert all(applied), (key, stage)
            assert_close(state, ref, tol, f"{key} stage {stage} rank {r}")
    # clipping really clipped: the clipped run differs from the unclipped one
    unclipped = reference("gpt", 2, micro=2)
    clipped = res[0]["extra", "micro_clip", 2][0]
    assert max((clipped[k] - unclipped[k]).abs().max().item() for k in clipped) > 1e-4


# ------------------------------------------------------------------ memory and communication


@pytest.mark.parametrize("n", [1, 2, 4])
def test_measured_memory_matches_the_paper_formula(n):
    psi = num_params(build("gpt", 0)[0])
    for r, res in enumerate(results(n)):
        for stage in (1, 2):
            for precision, kw in (("fp32", dict(k=8, param_bytes=4, grad_bytes=4)),
                                  ("bf16", dict(k=12, param_bytes=2, grad_bytes=2))):
                got = res["memory", stage, precision]["memory"]
                formula = model_state_bytes(psi, n, stage, **kw)
                what = f"N={n} rank {r} stage {stage} {precision}: measured {got}, formula {formula}"
                assert abs(got["total"] - formula) <= 0.03 * formula, what
                # term by term too: the gradient term is what stage 2 divides
                elem = kw["param_bytes"]
                assert abs(got["params"] - elem * psi) <= 0.03 * elem * psi, what
                want_grads = elem * psi / (n if stage == 2 else 1)
                assert abs(got["grads"] - want_grads) <= 0.03 * want_grads, what


@pytest.mark.parametrize("n", [2, 4])
def test_bytes_per_step_are_2_psi(n):
    psi = num_params(build("gpt", 0)[0])
    for res in results(n):
        for stage in (1, 2):
            for precision, elem in (("fp32", 4), ("bf16", 2)):
                m = res["memory", stage, precision]
                padded = m["padded"]
                assert padded - psi < n * m["buckets"]            # padding only
                b = m["bytes"]
                # reduce-scatter the gradients + all-gather the parameters: (N-1)/N S each
                assert b["reduce_scatter"] == round((n - 1) / n * padded * elem), b
                assert b["all_gather"] == round((n - 1) / n * padded * elem), b
                paper = 2 * (n - 1) / n * psi * elem
                assert abs(b["reduce_scatter"] + b["all_gather"] - paper) <= 0.001 * paper
                # the rest (which parameters were reached, one float each) is tiny
                assert b["all_reduce"] < 0.01 * paper
                # and no all-reduce of a gradient bucket: only the "used" flags
                assert {tag for op, tag in m["records"] if op == "all_reduce"} == {"used"}


def test_stage2_buffers_are_constant():
    nano, tiny = results(2)[0]["buffers"]["nano"], results(2)[0]["buffers"]["tiny"]
    assert tiny["psi"] > 3 * nano["psi"]
    for b in (nano, tiny):
        assert b["max_buffers"] <= 3
        # one bucket of bucket_mb (or one parameter, if a single parameter is larger)
        assert b["buffer_bytes"] <= max(0.05 * 2**20, b["largest_param"]) + 8
        # beyond its owned slices, stage 2 holds at most its buffers and one fresh .grad
        assert b["extra"] <= b["max_buffers"] * b["buffer_bytes"] + b["largest_param"]
    # the same buffers serve a model 3.6 times larger: far less than its full gradient
    assert tiny["extra"] < 0.5 * 4 * tiny["psi"], tiny


def test_fp16_overflow_on_one_rank_skips_everywhere():
    for r, res in enumerate(results(2)):
        for stage in (1, 2):
            (a0, _, s0), (a1, same1, s1), (a2, _, s2) = res["overflow"][stage]
            assert a0 and not a1 and a2, (r, stage)
            assert same1, f"rank {r} stage {stage}: the skipped step changed something"
            assert s1 == s0 / 2          # the loss scale backed off on every rank
    assert results(2)[0]["overflow"] == results(2)[1]["overflow"]


def test_world_size_larger_than_smallest_bucket():
    state, padded = results(4)[0]["tiny"]
    assert padded == [4, 4]                 # one element + three of padding, per bucket
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    opt = OPT(model.parameters())
    x = torch.arange(8, dtype=torch.float32).view(8, 1) / 8
    for s in range(2):
        (((model(x) - 2 * x) ** 2).sum() / 8).backward()
        opt.step()
        opt.zero_grad()
    assert_close(state, model.state_dict(), 1e-6, "Linear(1, 1) at N=4")
    for res in results(4)[1:]:
        assert all(torch.equal(state[k], res["tiny"][0][k]) for k in state)


# ------------------------------------------------------------------ bad input (one process)


def test_bad_input_is_refused_clearly():
    model = AwkwardModel()
    for stage in (0, 4, "1", True, None):
        with pytest.raises(ValueError, match="stage must be"):
            zl.ZeRO(model, OPT, stage=stage)
    with pytest.raises(ValueError, match="unknown precision"):
        zl.ZeRO(model, OPT, stage=1, precision="fp8")
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        zl.ZeRO(AwkwardModel(), lambda params: list(params), stage=2)
    with pytest.raises(TypeError, match="not this model's parameters"):
        zl.ZeRO(model, torch.optim.SGD(AwkwardModel().parameters(), lr=0.1), stage=1)
    frozen = torch.nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        zl.ZeRO(frozen, OPT, stage=2)
    for stage in (1, 2):
        eng = zl.ZeRO(AwkwardModel(), OPT, stage=stage)
        with pytest.raises(RuntimeError, match="before backward"):
            eng.step()
        data = SyntheticRegression(d_in=13, d_out=5)
        eng.backward(regression_loss(eng, data.batch(0, 4))[1])
        assert eng.step() is True
        eng.zero_grad()
        with pytest.raises(RuntimeError, match="before backward"):
            eng.step()


def test_every_stage_dispatches_to_its_engine():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # ZeRO3's note that AwkwardModel is one unit
        eng = zl.ZeRO(AwkwardModel(), OPT, stage=3)
    assert isinstance(eng, zl.ZeRO3)
    assert type(zl.ZeRO(AwkwardModel(), OPT, stage=1)) is zl.ZeRO1
    assert type(zl.ZeRO(AwkwardModel(), OPT, stage=2)) is zl.ZeRO2


def test_one_process_stage2_equals_plain_torch_in_process():
    # no launch at all: N = 1 without torch.distributed, against plain torch
    model = AwkwardModel()
    ref_model = AwkwardModel()
    ref_model.load_state_dict(model.state_dict())
    eng = zl.ZeRO(model, OPT, stage=2, bucket_mb=0.0002)
    opt = OPT(ref_model.parameters())
    data = SyntheticRegression(d_in=13, d_out=5)
    for s in range(3):
        eng.backward(regression_loss(eng, data.batch(s, 4))[1])
        eng.step()
        eng.zero_grad()
        regression_loss(ref_model, data.batch(s, 4))[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert_close(eng.full_state_dict(), ref_model.state_dict(), 1e-6, "N=1 in process")
