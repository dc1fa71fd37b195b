"""The script's optimizer stays the script's: an engine replaces none of its methods and sets no
attribute of its own on it, and still sees its zero_grad() (zerolab.optim.zero_grad_watch).

In fp32 the flat engines' optimizer gradients are the engine's own, so PyTorch's loop with
optimizer.zero_grad() is checked against one process in test_pytorch_loop. In bf16 the optimizer
steps fp32 masters whose gradients exist only inside the step: there the engine learns of
zero_grad() from its marks alone. The reference for that is the same loop calling
engine.zero_grad() instead, on the same ranks (the two must give the same bits: the same
arithmetic on the same gradients); a forgotten zero_grad() must not (it accumulates), which
shows the marks are what carries the call.
"""

import functools
import warnings

import pytest
import torch

import zerolab as zl

pytestmark = pytest.mark.slow     # launches ranks

ENGINES = zl.engines.NAMES
# torch's protocol for an optimizer whose step handles loss scaling itself: torch.amp.GradScaler
# then calls step() on every rank, which refuses it by name (see Lifecycle.check_step), instead
# of unscaling gradients the optimizer does not hold and stepping a scaled update
ALLOWED = {"_step_supports_amp_scaling"}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _make(name, model, optimizer, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # ZeRO-3's note that a small model is one unit
        return zl.engines.make(name, model, optimizer, **options)


def untouched(names):
    """{engine: (attributes the engine added to the optimizer, its methods now on the instance)}."""
    out = {}
    for name in names:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = set(vars(opt))
        eng = _make(name, model, opt)
        for step in range(2):
            eng(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        added = set(vars(opt)) - before - ALLOWED
        methods = {m for m in ("step", "zero_grad", "add_param_group", "state_dict", "load_state_dict")
                   if m in vars(opt)}
        out[name] = (sorted(added), sorted(methods))
    return out


def test_no_engine_changes_the_scripts_optimizer():
    for rank, seen in enumerate(zl.launch(untouched, 2, args=(ENGINES,))):
        for name, (added, methods) in seen.items():
            assert not added, f"rank {rank}, {name} set {added} on the script's optimizer"
            assert not methods, f"rank {rank}, {name} replaced {methods} of the script's optimizer"


def bf16_loops(names, steps=3):
    """{(engine, how the loop zeroes): final fp32 weights}, bf16 compute with fp32 masters."""
    out = {}
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    batches = [torch.randn(4, 8, generator=g) for _ in range(steps)]
    for name in names:
        for how in ("engine.zero_grad()", "optimizer.zero_grad()", "optimizer.zero_grad(set_to_none=False)",
                    "never"):
            if how == "never" and name == "zero1":
                continue                # (ZeRO-1 refuses a second backward on reduced gradients)
            eng = _make(name, _model(), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
                        precision="bf16")
            for x in batches:
                if how == "engine.zero_grad()":
                    eng.zero_grad()
                elif how == "optimizer.zero_grad()":
                    eng.optimizer.zero_grad()
                elif how == "optimizer.zero_grad(set_to_none=False)":
                    eng.optimizer.zero_grad(set_to_none=False)
                eng(x).float().pow(2).mean().backward()
                eng.optimizer.step()
            out[name, how] = [t.detach().clone() for t in eng.full_state_dict().values()]
    return out


def test_optimizer_zero_grad_zeroes_a_bf16_engines_gradients_as_engine_zero_grad_does():
    for rank, seen in enumerate(zl.launch(bf16_loops, 2, args=(ENGINES,))):
        for name in ENGINES:
            ref = seen[name, "engine.zero_grad()"]
            for how in ("optimizer.zero_grad()", "optimizer.zero_grad(set_to_none=False)"):
                assert all(torch.equal(a, b) for a, b in zip(seen[name, how], ref)), (rank, name, how)
            if (name, "never") in seen:     # without zero_grad the gradients accumulate: other bits
                assert not all(torch.equal(a, b) for a, b in zip(seen[name, "never"], ref)), (rank, name)
