"""A PyTorch user's habits, under every engine, against plain PyTorch on the global batch.

The model is called the way Hugging Face models are: keywords, a nested dict of inputs, an
output object with .loss; the loop uses engine.clip_grad_norm_ between backward and step, and
the results leave through engine.state_dict() and torch.save, to be read back by a plain
nn.Module (weights_only=True) and by another engine.
"""

import pytest
import io
from functools import partial

import torch
import torch.distributed as dist

import zerolab as zl

from helpers import KwNet, batch, hf_gpt2, one_step_fewer, tokens

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

LR, MAX_NORM, STEPS = 0.1, 0.5, 3


def plain_pytorch(world_size):
    """The reference: one process, the global batch, torch's own clip and SGD."""
    torch.manual_seed(0)
    model = KwNet()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        x, y = batch(step, 2 * world_size)
        model(features={"x": x}, target=y, scale=0.5).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return model.state_dict(), norms


def habits(name, other):
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = KwNet()
    engine = zl.engines.make(name, model, partial(torch.optim.SGD, lr=LR))
    api = {"module": engine.module is model,
           "parameters": [id(p) for p in engine.parameters()] == [id(p) for p in model.parameters()],
           "eval": engine.eval() is engine and not model.training,
           "train": engine.train() is engine and model.training}
    norms = []
    for step in range(STEPS):
        x, y = batch(step, 2 * n)
        out = engine(features={"x": x[2 * r:2 * r + 2]}, target=y[2 * r:2 * r + 2], scale=0.5)
        engine.backward(out.loss)
        norms.append(engine.clip_grad_norm_(MAX_NORM))
        engine.step()
        engine.zero_grad()
    state = engine.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    plain = KwNet()
    plain.load_state_dict(saved)                 # any nn.Module of the same shape reads it
    torch.manual_seed(1)
    again = zl.engines.make(other, KwNet(), partial(torch.optim.SGD, lr=LR))
    again.load_state_dict(saved)                 # and so does another engine
    reloaded = again.state_dict()
    return {"api": api, "norms": norms, "state": state,
            "plain_same": all(torch.equal(plain.state_dict()[k], state[k]) for k in state),
            "reloaded_same": all(torch.equal(reloaded[k], state[k]) for k in state)}


OTHERS = {"single": "single", "naive": "zero2", "ddp": "zero3", "zero1": "ddp", "zero2": "zero1", "zero3": "single"}


def habits_every_engine():
    return {name: habits(name, OTHERS[name]) for name in zl.engines.NAMES}


def test_keywords_nested_inputs_clip_and_state_dict_under_every_engine():
    ref, ref_norms = plain_pytorch(2)
    assert min(ref_norms) > MAX_NORM            # the clip really clips
    for rank_out in zl.launch(habits_every_engine, 2):     # (one launch: every engine in turn)
        for name, out in rank_out.items():
            assert all(out["api"].values()), (name, out["api"])
            # one process on the global batch (single: this rank's half only, so no comparison)
            if name != "single":
                # the norm of the same gradient summed in another order: a few ulp apart; a norm
                # over one rank's shard only would be ~30% off
                for mine, theirs in zip(out["norms"], ref_norms):
                    assert abs(mine - theirs) <= 1e-5 * theirs, (name, out["norms"], ref_norms)
                # SGD moves a weight by lr * clipped g (< 0.05); two summation orders change g by a
                # few ulp, so 3 steps differ by < 1e-7. A missed reduction or a per-rank clip: ~1e-2
                worst = max((out["state"][k] - ref[k]).abs().max().item() for k in ref)
                assert worst < 1e-6, (name, worst)
            assert out["plain_same"] and out["reloaded_same"], name


# ------------------------------------------------------------------ misuses that must be named


def test_a_rank_that_finishes_early_is_named_as_such():
    import time
    import pytest
    start = time.monotonic()
    with pytest.raises(zl.LaunchError) as info:
        zl.launch(one_step_fewer, 2, timeout=60)
    text = str(info.value)
    assert "rank(s) [1] finished and returned while rank 0 was still in a collective" in text, text[:800]
    assert "no rank crashed" in text
    assert time.monotonic() - start < 30       # the peer's exit ends it, not the deadline


def test_a_script_on_stdin_gets_a_clear_error(tmp_path):
    import subprocess
    import sys
    script = ("import zerolab as zl\n\ndef f():\n    return 1\n\n"
              "if __name__ == '__main__':\n    zl.launch(f, 2)\n")
    out = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode != 0
    assert "standard input" in out.stderr and "Save the script to a file" in out.stderr, out.stderr[-800:]


def full_weights_under_zero3():
    import warnings
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = KwNet()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    engine = zl.ZeRO(model, partial(torch.optim.SGD, lr=LR), stage=3)
    out = {}
    try:
        model.state_dict()
    except RuntimeError as e:
        out["outside"] = str(e)
    # every way a user reads a released weight: a clear error each, never a crash
    w = model.head.weight
    reads = {"print": lambda: repr(w), "sum": lambda: w.sum(), "data": lambda: w.data.norm(),
             "save": lambda: torch.save(w, io.BytesIO()), "format": lambda: f"{w}",
             "load_state_dict": lambda: model.load_state_dict(reference),
             "matmul": lambda: torch.ones(1, w.shape[1]) @ w.t()}
    out["reads"] = {}
    for what, read in reads.items():
        try:
            read()
            out["reads"][what] = "no error"
        except RuntimeError as e:
            out["reads"][what] = str(e)
    out["shape_kept"] = tuple(w.shape) == tuple(reference["head.weight"].shape) and w.dim() == 2
    with engine.gathered_parameters():
        taken_inside = model.state_dict()           # used after the context closed
        out["weight_sum"] = float(model.head.weight.sum())
    buffer = io.BytesIO()
    torch.save(taken_inside, buffer)
    buffer.seek(0)
    inside = torch.load(buffer, weights_only=True)
    out["inside_same"] = all(torch.equal(inside[k], reference[k]) for k in reference)
    out["released_after"] = all(f.untyped_storage().nbytes() == 0 for u in engine.units for f in u.full.values())
    out["reference_sum"] = float(reference["head.weight"].sum())
    plain = zl.DDP(KwNet(), partial(torch.optim.SGD, lr=LR))
    with plain.gathered_parameters():          # every engine takes it; here it changes nothing
        out["ddp_state_dict"] = len(plain.module.state_dict())
    return out


def test_zero3_full_weights_are_read_inside_gathered_parameters_only():
    for out in zl.launch(full_weights_under_zero3, 2):
        # outside: a clear error that names the ways to get the full weights, not a crash
        assert "full_state_dict" in out.get("outside", "") and "gathered_parameters" in out["outside"]
        for what, message in out["reads"].items():
            assert "gathered_parameters" in message, (what, message)
        assert out["shape_kept"]
        assert out["inside_same"] and out["weight_sum"] == out["reference_sum"]
        assert out["released_after"]
        assert out["ddp_state_dict"] == len(KwNet().state_dict())


# ------------------------------------------------------------------ a model nobody here wrote


def hf_plain(world_size):
    model = hf_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        ids = tokens(step, 2 * world_size)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def hf_under(name):
    import warnings
    r, n = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # (nothing to cut into units is not the case here)
        engine = zl.engines.make(name, hf_gpt2(), partial(torch.optim.SGD, lr=LR))
    for step in range(STEPS):
        ids = tokens(step, 2 * n)[2 * r:2 * r + 2]
        out = engine(input_ids=ids, labels=ids)      # as the Hugging Face docs call it
        engine.backward(out.loss)
        engine.step()
        engine.zero_grad()
    return engine.state_dict()


def hf_every_engine():
    # (single: one process, nothing to compare on 2 ranks)
    return {name: hf_under(name) for name in zl.engines.NAMES if name != "single"}


def test_a_hugging_face_gpt2_trains_under_every_engine_as_one_process_does():
    ref = hf_plain(2)
    for rank_out in zl.launch(hf_every_engine, 2):         # (one launch: every engine in turn)
        for name, state in rank_out.items():
            assert set(state) == set(ref), name      # the model's own keys (tied lm_head included)
            # SGD: a weight moves by lr * g; two summation orders change g by a few ulp, so after 3
            # steps the weights differ by < 1e-6. A missed reduction moves them by ~lr * g ~ 1e-3
            worst = max((state[k] - ref[k]).abs().max().item() for k in ref if ref[k].is_floating_point())
            assert worst < 1e-6, (name, worst)


# ------------------------------------------------------------------ optimizers a PyTorch script builds
