"""Fifty steps of the bench GPT in the bitwise mode: one process, and 2, 4 and 8 gloo ranks on
zl.DDP and zl.ZeRO(stage=1, 2, 3), end with torch.equal weights and optimizer state.

The run: GPT "tiny" (the smallest of the bench's GPTs), AdamW, a 16-row global batch cut into
C = 8 chunks (K = 8, 4, 2, 1 backwards per step on 1, 2, 4, 8 ranks: gradient accumulation as
nanoGPT writes it), a clip that binds on some steps and not on others, in fp32 and in bf16 with
fp32 masters. The loop is a PyTorch user's: loss.backward(), engine.clip_grad_norm_ (torch's
own clip line is refused in this mode), optimizer.step(), optimizer.zero_grad().

The reference is zl.SingleProcess(bitwise=True) on one process, on the same chunks. Fifty
steps let a one-bit difference grow where it could hide after three: AdamW divides by the
square root of the second moment, so early low bits reach the weights' high bits.
"""

import functools

import pytest
import torch

import zerolab as zl
from zerolab.data import CharDataset
from zerolab.engines import make
from zerolab.models import GPT, gpt_config, gpt_loss

STEPS, CHUNKS, ROWS, CLIP = 50, 8, 16, 0.5
ADAMW = functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
PRECISIONS = ("fp32", "bf16")
ENGINES = ("ddp", "zero1", "zero2", "zero3")


def run(engine_name: str, precision: str):
    """STEPS steps on this rank; rank r's k-th backward is chunk r*K + k of each global batch.
    Returns (weights by name, optimizer state, the clip's norms)."""
    n, r = zl.world_size(), zl.rank()
    torch.manual_seed(0 if r == 0 else 100 + r)        # every rank starts from rank 0's weights
    cfg = gpt_config("tiny")
    model, data = GPT(cfg), CharDataset(cfg.block_size)
    engine = make(engine_name, model, ADAMW, precision=precision, bitwise=True)
    K, per = CHUNKS // n, ROWS // CHUNKS
    norms = []
    for step in range(STEPS):
        x, y = data.global_batch(step, ROWS)
        for k in range(K):
            rows = slice((r * K + k) * per, (r * K + k + 1) * per)
            _, loss = gpt_loss(engine, (x[rows], y[rows]))
            (loss / K).backward()
        norms.append(engine.clip_grad_norm_(CLIP))
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
    weights = {k: v.clone() for k, v in engine.full_state_dict().items()}
    return weights, engine.optimizer.state_dict()["state"], norms


def worker(engines):
    return {(name, p): run(name, p) for name in engines for p in PRECISIONS}


def same(a, b) -> bool:
    """torch.equal on every tensor of two nested dicts (weights, or optimizer state)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return torch.equal(torch.as_tensor(a), torch.as_tensor(b))


@pytest.fixture(scope="module")
def one_process():
    return zl.launch(worker, 1, args=(("single",),))[0]


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4, 8])
def test_fifty_steps_are_the_same_bits_on_every_engine_and_world_size(one_process, n):
    ranks = zl.launch(worker, n, args=(ENGINES,))
    for p in PRECISIONS:
        weights1, state1, norms1 = one_process["single", p]
        assert any(x > CLIP for x in norms1) and any(x < CLIP for x in norms1), f"{p}: the clip {norms1}"
        for name in ENGINES:
            for r, results in enumerate(ranks):
                weights, state, norms = results[name, p]
                assert same(weights, weights1), f"{name} {p} at N={n}, rank {r}: weights"
                assert norms == norms1, f"{name} {p} at N={n}, rank {r}: the clip's norms"
            assert same(ranks[0][name, p][1], state1), f"{name} {p} at N={n}: optimizer state"


# ------------------------------------------------------------------ the README's example


def readme_example() -> str:
    """The README's bitwise example, exactly as it is shown there."""
    readme = open(__file__.replace("tests/test_bitwise_fifty_steps.py", "README.md")).read()
    section = readme[readme.index("**The same bits at any world size.**"):]
    return section[section.index("```python\n") + len("```python\n"):section.index("```\n", 10)]


def readme_worker(code: str):
    """The example on this rank: its K chunks are rank r's of one 16-row global batch."""
    n, r = zl.world_size(), zl.rank()
    torch.manual_seed(0 if r == 0 else 100 + r)
    cfg = gpt_config("nano")
    model, data = GPT(cfg), CharDataset(cfg.block_size)
    K, per = CHUNKS // n, ROWS // CHUNKS
    x, y = data.global_batch(0, ROWS)
    chunks = [(x[(r * K + k) * per:(r * K + k + 1) * per], y[(r * K + k) * per:(r * K + k + 1) * per])
              for k in range(K)]
    scope = {"zl": zl, "torch": torch, "functools": functools, "gpt_loss": gpt_loss,
             "model": model, "chunks": chunks, "K": K}
    exec(code, scope)
    return {k: v.clone() for k, v in scope["engine"].full_state_dict().items()}


@pytest.mark.slow
def test_the_readme_example_runs_as_shown_and_gives_one_process_bits():
    code = readme_example()
    assert "stage=3, bitwise=True" in code and "clip_grad_norm_" in code
    one = zl.launch(readme_worker, 1, args=(code,))[0]
    for weights in zl.launch(readme_worker, 4, args=(code,)):
        assert same(weights, one)
