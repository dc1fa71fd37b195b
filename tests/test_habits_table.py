"""Every habit of a PyTorch script, one row each, with what each engine must do.

A row is (habit, engines, expected) and a function that tries the habit the way a script
would and reports what happened: "ok" (it worked, and matched the reference where there is
one) or the error it raised. The expected outcome is "ok", or a phrase the error must contain:
a misuse gets a clear error that says what to do, never a crash and never a silent result.
The rows that need their own processes (a rank that finishes early, a script on stdin, the
command line, workers' output) run outside the 2-rank launch.
"""

import io
from functools import partial

import pytest
import torch
import torch.distributed as dist

import zerolab as zl

from helpers import BatchNormNet, KwNet, batch, hf_gpt2, make_grouped, my_rows, one_step_fewer, tokens, train_groups

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

ALL = list(zl.engines.NAMES)
DP = [n for n in ALL if n != "single"]
SGD = partial(torch.optim.SGD, lr=0.1)


def quiet_make(name, model, factory=None, **options):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zl.engines.make(name, model, SGD if factory is None else factory, **options)


def a_step(engine, **inputs):
    out = engine(**inputs)
    engine.backward(out.loss)
    return out


# ------------------------------------------------------------------ the habits


def hf_keywords(name):
    engine = quiet_make(name, hf_gpt2())
    ids = tokens(0, 2)
    out = a_step(engine, input_ids=ids, labels=ids)       # as the Hugging Face docs call it
    engine.step()
    return "ok" if torch.isfinite(out.loss) else "loss not finite"


def read_a_released_weight(name):
    engine = quiet_make(name, KwNet())
    w = engine.module.head.weight
    outcomes = []
    for read in (lambda: repr(w), lambda: w.sum(), lambda: engine.module.state_dict()):
        try:
            read()
            outcomes.append("ok")
        except RuntimeError as e:
            outcomes.append("guarded" if GUARD in str(e) else str(e))
    return {("ok",): "ok", ("guarded",): "every read guarded"}.get(tuple(set(outcomes)), str(outcomes))


def save_model_state_dict(name):
    engine = quiet_make(name, KwNet())
    buffer = io.BytesIO()
    with engine.gathered_parameters():                    # every engine takes it
        torch.save(engine.module.state_dict(), buffer)
    full = engine.full_state_dict()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    if not all(torch.equal(loaded[k].float(), full[k]) for k in full):
        return "the file saved inside gathered_parameters() differs"
    try:
        torch.save(engine.module.state_dict(), io.BytesIO())  # outside it
        return "ok"
    except RuntimeError as e:
        return f"inside: ok; outside: {e}"


def user_side_clip(name):
    engine = quiet_make(name, KwNet())
    x, y = batch(0, 2)
    a_step(engine, features={"x": x}, target=y)
    torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.1)
    return "ok"


def nanogpt_groups(name):
    # (that they move to the right values: tests/test_param_groups.py)
    engine = make_grouped(name, "nanogpt")
    before = engine.state_dict()
    after = train_groups(engine, 2).state_dict()
    frozen = [k for k in before if torch.equal(before[k], after[k])]
    return "ok" if not frozen else f"never moved: {frozen}"


def batchnorm_in_bf16(name):
    engine = quiet_make(name, BatchNormNet(), precision="bf16")
    x, y = my_rows(0)
    engine.backward((engine(x).float() - y).pow(2).mean())
    engine.step()
    dtypes = {b.dtype for b in engine.module.buffers() if b.is_floating_point()}
    return "ok" if dtypes == {torch.float32} else f"buffers in {dtypes}"


def batchnorm_buffers_over_steps(name):
    engine = quiet_make(name, BatchNormNet())
    for step in range(3):
        x, y = my_rows(step)
        engine.backward((engine(x) - y).pow(2).mean())
        engine.step()
        engine.zero_grad()
    engine(my_rows(0)[0] * 0)      # one more forward, the same batch on every rank
    mine = torch.cat([b.float().flatten() for b in engine.module.buffers()])
    theirs = mine.clone()
    dist.broadcast(theirs, 0)
    return "ok" if torch.equal(mine, theirs) else "ranks' buffers differ"


def step_before_backward(name):
    quiet_make(name, KwNet()).step()
    return "ok"


def forgotten_zero_grad(name):
    engine = quiet_make(name, KwNet())
    x, y = batch(0, 2)
    a_step(engine, features={"x": x}, target=y)
    engine.step()
    a_step(engine, features={"x": x}, target=y)           # no zero_grad() in between
    return "ok"


def lbfgs(name):
    quiet_make(name, KwNet(), lambda ps: torch.optim.LBFGS(ps))
    return "ok"


def pytorch_loop_in_fp16(name):
    engine = quiet_make(name, KwNet(), precision="fp16")
    x, y = batch(0, 2)
    engine(features={"x": x}, target=y).loss.backward()     # the loss scale never applied
    engine.optimizer.step()
    return "ok"


def step_after_no_sync(name):
    engine = quiet_make(name, KwNet())
    x, y = batch(0, 2)
    with engine.no_sync():
        engine(features={"x": x}, target=y).loss.backward()
    engine.optimizer.step()                                # the last micro-batch was inside no_sync
    return "ok"


def own_optimizer_after_wrapping(name):
    engine = quiet_make(name, KwNet())
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)     # the DDP tutorial's order
    x, y = batch(0, 2)
    engine(features={"x": x}, target=y).loss.backward()
    opt.step()
    return "ok"


def add_a_group_later(name):
    """Refused at the next step, before it changes anything (the optimizer itself is left as the
    script built it: its add_param_group is torch's own)."""
    engine = quiet_make(name, KwNet())
    engine.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    x, y = batch(0, 2)
    engine(features={"x": x}, target=y).loss.backward()
    engine.optimizer.step()
    return "ok"


def some_grads_to_none(name):
    engine = quiet_make(name, KwNet())
    x, y = batch(0, 2)
    engine(features={"x": x}, target=y).loss.backward()
    engine.optimizer.step()
    engine.module.head.weight.grad = None                 # one parameter "zeroed", not the others
    engine(features={"x": x}, target=y).loss.backward()
    engine.optimizer.step()
    return "ok"


def a_stepped_optimizer(name):
    model = KwNet()
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    model.zero_grad()
    quiet_make(name, model, opt)
    return "ok"


def no_optimizer_then_engine_step(name):
    engine = zl.NaiveDDP(KwNet()) if name == "naive" else zl.DDP(KwNet())
    x, y = batch(0, 2)
    engine(features={"x": x}, target=y).loss.backward()
    engine.step()
    return "ok"


GUARD = "gathered_parameters"
ROWS = {
    # habit: (function, {engine: expected})
    "engine(input_ids=ids, labels=ids)": (hf_keywords, {n: "ok" for n in ALL}),
    "read a weight (print(p), p.sum(), model.state_dict())":
        (read_a_released_weight, {**{n: "ok" for n in ALL}, "zero3": "every read guarded"}),
    "torch.save(model.state_dict())":
        (save_model_state_dict, {**{n: "ok" for n in ALL},
                                 "zero3": "inside: ok; outside: model.state_dict() under ZeRO-3"}),
    "torch.nn.utils.clip_grad_norm_(model.parameters()) before step()": (user_side_clip, {n: "ok" for n in ALL}),
    "nanoGPT's decay / no-decay groups": (nanogpt_groups, {n: "ok" for n in ALL}),
    "BatchNorm with precision='bf16'": (batchnorm_in_bf16, {n: "ok" for n in ALL}),
    "BatchNorm buffers over steps": (batchnorm_buffers_over_steps, {n: "ok" for n in DP}),
    "step() before backward()": (step_before_backward, {n: "step() called before backward()" for n in ALL}),
    # they accumulate, as one process does (that they match it: tests/test_pytorch_loop.py)
    "a forgotten zero_grad()":
        (forgotten_zero_grad, {**{n: "ok" for n in ALL if n != "zero1"}, "zero1": "Call zero_grad()"}),
    "LBFGS": (lbfgs, {n: "needs a closure" for n in ALL}),
    "loss.backward() with precision='fp16'": (pytorch_loop_in_fp16, {n: "needs engine.backward(loss)" for n in ALL}),
    "step() after a backward inside no_sync()":
        (step_after_no_sync, {**{n: "never averaged" for n in ("naive", "ddp", "zero1")},
                              **{n: "ok" for n in ("single", "zero2", "zero3")}}),   # (they always reduce)
    "a torch optimizer on engine.parameters(), built after wrapping":
        (own_optimizer_after_wrapping, {**{n: "ok" for n in ("single", "naive", "ddp")},
                                        **{n: "step with the engine's optimizer" for n in ("zero1", "zero2", "zero3")}}),
    "optimizer.add_param_group() after wrapping": (add_a_group_later, {n: "before building the engine" for n in ALL}),
    "p.grad = None for one parameter only":
        (some_grads_to_none, {**{n: "ok" for n in ("single", "naive", "ddp")},
                              **{n: "some parameters but not others" for n in ("zero1", "zero2", "zero3")}}),
    # (its state moves onto what the engine updates: tests/conformance/ checks it resumes exactly)
    "an optimizer that has already stepped": (a_stepped_optimizer, {n: "ok" for n in ALL}),
    "zl.DDP(model) with no optimizer, then engine.step()":
        (no_optimizer_then_engine_step, {n: "step your own" for n in ("naive", "ddp")}),
}


def try_every_row():
    seen = {}
    for habit, (fn, expected) in ROWS.items():
        for name in expected:
            try:
                seen[habit, name] = fn(name)
            except (RuntimeError, TypeError, ValueError) as e:
                seen[habit, name] = f"{type(e).__name__}: {e}"
            dist.barrier()
    return seen


@pytest.fixture(scope="module")
def seen():
    return zl.launch(try_every_row, 2)


@pytest.mark.parametrize("habit", list(ROWS))
def test_each_habit_does_what_a_pytorch_user_expects(seen, habit):
    _, expected = ROWS[habit]
    for rank, outcomes in enumerate(seen):
        for name, want in expected.items():
            got = outcomes[habit, name]
            assert (got == "ok") if want == "ok" else (want in got), (habit, name, rank, got)


# ------------------------------------------------------------------ rows with their own processes


def test_a_rank_that_runs_one_step_fewer_is_named_not_blamed_on_a_crash():
    with pytest.raises(zl.LaunchError, match="finished and returned while rank") as e:
        zl.launch(one_step_fewer, 2)
    assert "crash" not in str(e.value).split("no rank crashed")[0]


# (a script on standard input is refused with what to do: tests/test_habits.py)


def test_the_command_line_shows_its_defaults_and_helps_every_flag():
    # (that torchrun with 2 ranks trains data parallel by default: tests/test_cli.py)
    import argparse
    from zerolab import train as cli
    parser = argparse.ArgumentParser(formatter_class=cli.HelpWithDefaults)
    cli.add_arguments(parser)
    text = parser.format_help()
    text = " ".join(text.split())     # (argparse wraps lines to the terminal width)
    assert "(default: tiny)" in text and "default: ddp with more than one rank" in text
    assert all(a.help for a in parser._actions)


def print_and_warn():
    import warnings
    print(f"hello from rank {dist.get_rank()}")
    warnings.warn(f"careful on rank {dist.get_rank()}")
    return dist.get_rank()


def test_what_workers_print_and_warn_is_shown_by_rank(capfd, monkeypatch):
    monkeypatch.delenv("ZEROLAB_LAUNCH_OUTPUT", raising=False)
    capfd.readouterr()
    assert zl.launch(print_and_warn, 2) == [0, 1]
    out, err = capfd.readouterr()
    assert out == "[rank 0] hello from rank 0\n"                   # rank 0's prints
    assert "[rank 0]" in err and "careful on rank 0" in err         # every rank's warnings
    assert "[rank 1]" in err and "careful on rank 1" in err
    assert err.index("careful on rank 0") < err.index("careful on rank 1")
