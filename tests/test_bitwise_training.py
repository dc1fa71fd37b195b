"""Bit for bit at any world size: BitwiseDataParallel on 1, 2, 4 and 8 gloo ranks ends with
torch.equal master weights and optimizer state, and those equal an independent one-process
reference written here (per-parameter tensors, a recursive tree, the norm by math.fsum,
torch's own optimizer on one tensor per parameter). No tolerance anywhere.

The matrix: a two-layer MLP, the nano GPT (also with tied embeddings), AwkwardModel (frozen,
unused, reused and tied weights, odd sizes) and a Hugging Face GPT-2 called with keywords; fp32, and bf16 compute with fp32 masters; SGD
with momentum and AdamW; gradient accumulation (2 micro-batches per rank); global-norm
clipping that binds; the optimizer on the whole vector (DDP) or on this rank's shard (ZeRO);
chunks shared out in runs or interleaved (the same tree, reduced at the end or chunk by chunk).

And the reason for the mode: zl.DDP's default path on the same GPT and the same global
batches does NOT end with the same bits at 2, 4 and 8 ranks as on one (zerolab.bitwise.drift).
"""

import functools
import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.bitwise import BitwiseDataParallel, ChunkPlan, differing_bits
from zerolab.bitwise.drift import drift_by_world_size
from zerolab.data import CharDataset, SyntheticRegression
from zerolab.models import GPT, AwkwardModel, TinyMLP, gpt_config, gpt_loss, regression_loss

from helpers import hf_gpt2, tokens

pytestmark = pytest.mark.slow     # launches ranks

CHUNKS, STEPS, BLOCK = 16, 3, 256
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=False)
ADAMW = functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1, foreach=False)


@dataclass(frozen=True)
class Case:
    kind: str                  # "mlp" | "gpt" | "gpt_tied" | "awkward"
    precision: str             # "fp32" | "bf16"
    optimizer: object
    max_grad_norm: float | None
    micro_batches: int
    shard_optimizer: bool
    interleaved: bool = False  # chunks r, r+N, ... (reduce-scattered chunk by chunk) instead of a run

    @property
    def name(self):
        return (f"{self.kind}-{self.precision}-{self.optimizer.func.__name__}-clip{self.max_grad_norm}"
                f"-micro{self.micro_batches}-{'shard' if self.shard_optimizer else 'whole'}"
                f"{'-interleaved' if self.interleaved else ''}")


CASES = [
    Case("mlp", "fp32", SGD, None, 1, False),
    Case("mlp", "fp32", ADAMW, 0.05, 2, True),
    Case("mlp", "bf16", ADAMW, 0.05, 2, False),
    Case("gpt", "fp32", ADAMW, 0.3, 2, True),
    Case("gpt", "bf16", SGD, 0.3, 1, True),
    Case("gpt", "bf16", ADAMW, 0.3, 2, False),
    Case("gpt_tied", "fp32", ADAMW, 0.3, 2, True),
    Case("awkward", "fp32", ADAMW, 0.05, 2, True),
    Case("awkward", "bf16", SGD, 0.05, 1, False),
    Case("gpt", "fp32", ADAMW, 0.3, 2, True, interleaved=True),
    Case("mlp", "bf16", SGD, 0.05, 2, False, interleaved=True),
    Case("hf", "fp32", ADAMW, 0.3, 2, True),
    Case("hf", "bf16", ADAMW, 0.3, 1, False, interleaved=True),
]


def build(kind, seed):
    """(model, data, loss_fn, global batch rows): the same model from the same seed."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return TinyMLP(16, 32, 4), SyntheticRegression(16, 4), regression_loss, 32
    if kind == "awkward":       # odd sizes, a frozen layer, an unused branch, a reused and a tied weight
        return AwkwardModel(), SyntheticRegression(d_in=13, d_out=5), regression_loss, 32
    if kind == "hf":            # a Hugging Face GPT-2 (tied embeddings), called with keywords
        return hf_gpt2(), Tokens(), hf_loss, 16
    return GPT(gpt_config("nano", tie_weights=(kind == "gpt_tied"))), CharDataset(32), gpt_loss, 16


class Tokens:
    """Global batches of random token ids for the Hugging Face model: (ids,), its own labels."""

    def global_batch(self, step, rows):
        return (tokens(step, rows),)


def hf_loss(model, batch):
    return model(input_ids=batch[0], labels=batch[0]).loss


# ------------------------------------------------------------------ the ranks


def train_worker(cases):
    """Every case on this rank: master weights, optimizer state, clip coefficients."""
    out = []
    for case in cases:
        # rank 0's weights are broadcast: the other ranks start from different ones on purpose
        model, data, loss_fn, rows = build(case.kind, 0 if dist.get_rank() == 0 else 100 + dist.get_rank())
        plan = ChunkPlan(CHUNKS, dist.get_world_size(), interleaved=case.interleaved)
        trainer = BitwiseDataParallel(model, case.optimizer, loss_fn, plan,
                                      precision=case.precision, max_grad_norm=case.max_grad_norm,
                                      shard_optimizer=case.shard_optimizer, block=BLOCK)
        coefs = []
        for step in range(STEPS):
            trainer.train_step(data.global_batch(step, rows), micro_batches=case.micro_batches)
            coefs.append(trainer.last_clip_coefficient)
        assert trainer.conditions()["threads_per_rank"] == 1     # (zl.launch: one thread per rank)
        out.append((trainer.master_state(), trainer.optimizer_state(), coefs))
    return out


# ------------------------------------------------------------------ the independent reference


def tree(xs):
    """The perfect binary tree over a power-of-two list: (left half) + (right half)."""
    return xs[0] if len(xs) == 1 else tree(xs[:len(xs) // 2]) + tree(xs[len(xs) // 2:])


def reference_run(case):
    """One process, one tensor per parameter: what the bitwise mode promises, written plainly."""
    model, data, loss_fn, rows = build(case.kind, 0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case.precision]
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    model.to(dtype)
    opt = case.optimizer(masters)
    per_chunk = rows // CHUNKS
    names = {id(p): n for n, p in model.named_parameters()}
    def cast(t):
        return t.to(dtype) if t.is_floating_point() else t

    def forward(*args, **kwargs):
        return model(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})

    for step in range(STEPS):
        batch = data.global_batch(step, rows)
        chunk_grads = []
        for c in range(CHUNKS):
            chunk = tuple(t[c * per_chunk:(c + 1) * per_chunk] for t in batch)
            model.zero_grad(set_to_none=True)
            out = loss_fn(forward, chunk)
            (out[1] if isinstance(out, tuple) else out).backward()
            chunk_grads.append([torch.zeros(p.shape) if p.grad is None else p.grad.float() for p in params])
        grads = [tree([cg[i] for cg in chunk_grads]) * (1.0 / CHUNKS) for i in range(len(params))]
        if case.max_grad_norm is not None:
            # the exact squared norm, correctly rounded: math.fsum of the fp64 squares (each exact)
            squares = (v * v for g in grads for v in g.double().reshape(-1).tolist())
            total = torch.tensor(math.fsum(squares), dtype=torch.float64).float()
            coef = (case.max_grad_norm / (total.sqrt() + 1e-6)).clamp(max=1.0)
            grads = [g * coef for g in grads]
        for m, g in zip(masters, grads):
            m.grad = g
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    weights = {names[id(p)]: m.detach() for p, m in zip(params, masters)}
    state = {k: torch.cat([opt.state[m][k].reshape(-1) for m in masters])
             for k in opt.state[masters[0]] if k != "step"}
    return weights, state


# ------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def runs():
    """{N: rank 0's results for every case}, plus a check that every rank agrees with rank 0."""
    out = {}
    for n in (1, 2, 4, 8):
        ranks = zl.launch(train_worker, n, args=(CASES,))
        for r, results in enumerate(ranks[1:], start=1):
            for case, (weights, _state, _c), (weights0, _s0, _c0) in zip(CASES, results, ranks[0]):
                assert all(torch.equal(weights[k], weights0[k]) for k in weights0), f"{case.name}: rank {r} at N={n}"
        out[n] = ranks[0]
    return out


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c.name for c in CASES])
def test_one_process_is_the_plain_reference(runs, i):
    case = CASES[i]
    weights, state, coefs = runs[1][i]
    ref_weights, ref_state = reference_run(case)
    assert weights.keys() == ref_weights.keys()
    for k in weights:
        assert torch.equal(weights[k], ref_weights[k]), f"{case.name}: {k}"
    for k in ref_state:
        assert torch.equal(state[k], ref_state[k]), f"{case.name}: optimizer state {k}"
    if case.max_grad_norm is not None:           # the clip must bind, or it proves nothing
        assert any(c.item() < 1.0 for c in coefs), f"{case.name}: clip never bound {coefs}"


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("i", range(len(CASES)), ids=[c.name for c in CASES])
def test_every_world_size_is_one_process_bit_for_bit(runs, i, n):
    case = CASES[i]
    weights, state, coefs = runs[n][i]
    weights1, state1, coefs1 = runs[1][i]
    for k in weights1:
        assert torch.equal(weights[k], weights1[k]), \
            f"{case.name} at N={n}: {k} differs in {differing_bits({k: weights[k]}, {k: weights1[k]})[k]}"
    assert state.keys() == state1.keys()
    for k in state1:
        assert torch.equal(state[k], state1[k]), f"{case.name} at N={n}: optimizer state {k}"
    for c, c1 in zip(coefs, coefs1):
        assert (c is None and c1 is None) or torch.equal(c, c1), f"{case.name} at N={n}: clip coefficient"


def test_the_default_path_is_not_bit_for_bit():
    """zl.DDP as it ships: the same GPT, batches and optimizer, and other bits at every N > 1,
    while the bitwise trainer on the same run differs in none."""
    counts = drift_by_world_size((1, 2, 4, 8), steps=2)
    for n in (2, 4, 8):
        assert sum(c["bits"] for c in counts["default"][n].values()) > 0, f"default path at N={n}"
        assert sum(c["bits"] for c in counts["bitwise"][n].values()) == 0, f"bitwise at N={n}"
