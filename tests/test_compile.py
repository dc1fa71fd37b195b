"""torch.compile(model) before wrapping, on every engine, against the same engine uncompiled.

torch.compile's default backend (inductor) generates C++ for every graph: tens of seconds per
engine on two cores. The tests use backend="aot_eager": Dynamo captures the graphs and AOTAutograd
builds the compiled backward exactly as with inductor (what meets the engines' hooks: forward
hooks, hooks on outputs and parameters, ZeRO-3's per-unit gathers), and then runs them with
PyTorch's own kernels. `python -m zerolab bench --compile` measures inductor's speed.
"""

import warnings
from functools import partial

import pytest
import torch
import torch.nn as nn

import zerolab as zl
from tolerances import fp32_adamw_tol

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

STEPS = 3


def gpt():
    torch.manual_seed(0)
    return zl.models.GPT(zl.models.gpt_config("nano", n_layer=2, n_embd=32, n_head=2, block_size=16))


def train(name, compile_how):
    rank, n = zl.rank(), zl.world_size()
    model = gpt()
    if compile_how == "torch.compile(model)":
        model = torch.compile(model, backend="aot_eager")
    elif compile_how == "torch.compile(block)":          # as FSDP2's users compile
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = zl.engines.make(name, model, partial(torch.optim.AdamW, lr=1e-3, eps=1e-6))
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 96, (2 * n, 17), generator=g)[2 * rank:2 * rank + 2]
        logits = engine(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        losses.append(loss.item())
    return engine.state_dict(), losses


def every_engine():
    torch._dynamo.reset()
    out = {}
    for name in zl.engines.NAMES:
        out[name, "eager"] = train(name, "eager")
        out[name, "torch.compile(model)"] = train(name, "torch.compile(model)")
    out["zero3", "torch.compile(block)"] = train("zero3", "torch.compile(block)")
    return out


def test_a_model_compiled_before_wrapping_trains_as_the_same_engine_uncompiled():
    for seen in zl.launch(every_engine, 2):
        for (name, how), (state, losses) in seen.items():
            if how == "eager":
                continue
            eager_state, eager_losses = seen[name, "eager"]
            if how == "torch.compile(model)":
                # the engine keeps the model itself: its own keys, loadable compiled or not
                assert set(state) == set(eager_state), (name, sorted(set(state) ^ set(eager_state))[:3])
            else:     # the user's model now holds compiled blocks: their keys say so
                state = {k.replace("._orig_mod", ""): v for k, v in state.items()}
            # AOTAutograd may order a reduction differently from eager: fp32 AdamW round-off
            # (tests/tolerances.py); a missed reduction or a stale unit is ~lr = 1e-3 off
            worst = max((state[k] - v).abs().max().item() for k, v in eager_state.items())
            assert worst <= fp32_adamw_tol(STEPS), (name, how, worst)
            assert max(abs(a - b) for a, b in zip(losses, eager_losses)) < 1e-5, (name, how)


def test_zero3_refuses_a_unit_compiled_in_place_and_says_what_to_do():
    model = gpt()
    model.blocks[0].compile(backend="aot_eager")
    with pytest.raises(ValueError, match=r"torch.compile\(model\)"):
        zl.ZeRO(model, partial(torch.optim.AdamW, lr=1e-3), stage=3)
