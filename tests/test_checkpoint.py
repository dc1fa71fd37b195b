"""zl.checkpoint: bit-exact resume in a fresh launch, resharding across world sizes and stages,
consolidation without processes, and clear errors for broken checkpoints."""

import functools
import os

import pytest
import torch

import zerolab as zl
from zerolab import checkpoint, data, models
from zerolab.checkpoint.files import encode_metadata

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

# (name, model, engine, precision); GPT nano and the awkward model (frozen, unused, tied, odd sizes)
SPECS = [
    ("gpt-ddp", "gpt", "ddp", "fp32"),
    ("gpt-zero1-bf16", "gpt", "zero1", "bf16"),
    ("gpt-zero3", "gpt", "zero3", "fp32"),
    ("awk-naive", "awk", "naive", "fp32"),
    ("awk-zero2", "awk", "zero2", "fp32"),
    ("awk-zero3-bf16", "awk", "zero3", "bf16"),
    ("awk-ddp-fp16", "awk", "ddp", "fp16"),     # the loss scaler's state comes back too
]


def build(model_kind, engine_kind, precision, seed=0):
    torch.manual_seed(seed)
    model = models.GPT(models.gpt_config("nano")) if model_kind == "gpt" else models.AwkwardModel()
    opt = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    if engine_kind == "single":
        return zl.SingleProcess(model, opt, precision=precision)
    if engine_kind == "naive":
        return zl.NaiveDDP(model, opt, precision=precision)
    if engine_kind == "ddp":
        return zl.DDP(model, opt, precision=precision, bucket_mb=0.002)
    return zl.ZeRO(model, opt, stage=int(engine_kind[-1]), precision=precision, bucket_mb=0.002)


def train_steps(engine, model_kind, start, stop, rank=0, world=1, noise=True):
    """Steps [start, stop) on a fixed GLOBAL batch (4 sequences / 8 samples), split over `world` ranks."""
    gpt_data = data.CharDataset(32)
    reg_data = data.SyntheticRegression(d_in=13, d_out=5)
    for step in range(start, stop):
        if model_kind == "gpt":
            _, loss = models.gpt_loss(engine, gpt_data.batch(step, 4 // world, rank, world))
        else:
            x, y = reg_data.batch(step, 8 // world, rank, world)
            if noise:   # draws from the global RNG: a bit-exact resume must restore it
                x = x + 0.01 * torch.randn(x.shape)
            _, loss = models.regression_loss(engine, (x, y))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()


def run_and_save(root, save_at, steps):
    """Every spec: train `steps` steps, saving at `save_at`; the full state at the end."""
    out = {}
    for name, mk, ek, prec in SPECS:
        engine = build(mk, ek, prec)
        train_steps(engine, mk, 0, save_at, zl.rank(), zl.world_size())
        checkpoint.save(engine, os.path.join(root, name), extra={"data_step": save_at})
        train_steps(engine, mk, save_at, steps, zl.rank(), zl.world_size())
        out[name] = engine.full_state_dict()
    return out


def resume(root, steps):
    """Every spec, in a fresh launch: build with ANOTHER seed, load, train to `steps`."""
    out = {}
    for name, mk, ek, prec in SPECS:
        engine = build(mk, ek, prec, seed=123)
        extra = checkpoint.load(engine, os.path.join(root, name))
        train_steps(engine, mk, extra["data_step"], steps, zl.rank(), zl.world_size())
        out[name] = engine.full_state_dict()
    return out


def test_resume_is_bit_exact_in_a_fresh_launch(tmp_path):
    root = str(tmp_path)
    before = zl.launch(run_and_save, 2, args=(root, 3, 6))
    after = zl.launch(resume, 2, args=(root, 6))
    for name, *_ in SPECS:
        ref, got = before[0][name], after[0][name]
        assert ref.keys() == got.keys()
        for key in ref:
            assert torch.equal(ref[key], got[key]), f"{name}: {key} differs after resume"
    # the single-process engine, in this process
    engine = build("awk", "single", "fp32")
    train_steps(engine, "awk", 0, 3)
    checkpoint.save(engine, tmp_path / "single", extra={"data_step": 3})
    train_steps(engine, "awk", 3, 6)
    fresh = build("awk", "single", "fp32", seed=7)
    train_steps(fresh, "awk", checkpoint.load(fresh, tmp_path / "single")["data_step"], 6)
    for key, value in engine.full_state_dict().items():
        assert torch.equal(value, fresh.full_state_dict()[key]), key


def save_zero3(root, steps):
    out = {}
    for mk in ("gpt", "awk"):
        engine = build(mk, "zero3", "fp32")
        train_steps(engine, mk, 0, steps, zl.rank(), zl.world_size(), noise=False)
        checkpoint.save(engine, os.path.join(root, mk), extra={"data_step": steps})
        state = engine.full_state_dict()
        train_steps(engine, mk, steps, steps + 1, zl.rank(), zl.world_size(), noise=False)
        out[mk] = (state, engine.full_state_dict())
    return out


def load_zero2(root, steps):
    out = {}
    for mk in ("gpt", "awk"):
        engine = build(mk, "zero2", "fp32", seed=99)
        checkpoint.load(engine, os.path.join(root, mk))
        state = engine.full_state_dict()
        train_steps(engine, mk, steps, steps + 1, zl.rank(), zl.world_size(), noise=False)
        out[mk] = (state, engine.full_state_dict())
    return out


def test_reshard_zero3_on_2_ranks_to_zero2_on_4_and_one_process(tmp_path):
    root = str(tmp_path)
    saved = zl.launch(save_zero3, 2, args=(root, 2))[0]
    loaded = zl.launch(load_zero2, 4, args=(root, 2))[0]
    for mk in ("gpt", "awk"):
        at_save, next_step = saved[mk]
        at_load, next_step_4 = loaded[mk]
        for key in at_save:
            assert torch.equal(at_save[key], at_load[key]), f"{mk}: {key} differs after resharding"
        # the optimizer state came along: one more step (on 4 ranks, another summation order)
        # lands where the 2-rank run landed; without its Adam moments it would not
        for key in next_step:
            torch.testing.assert_close(next_step_4[key], next_step[key], rtol=1e-5, atol=1e-6)
        # consolidate needs no process group, drops padding, keeps tied weights
        full = checkpoint.consolidate(os.path.join(root, mk))
        assert full.keys() == at_save.keys()
        for key in full:
            assert torch.equal(full[key], at_save[key]), key
        if mk == "awk":
            assert full["decoder.weight"] is full["encoder.weight"]
        # and the single-process reference loads it too
        single = build(mk, "single", "fp32", seed=5)
        checkpoint.load(single, os.path.join(root, mk))
        for key, value in single.full_state_dict().items():
            assert torch.equal(value, at_save[key]), key


# ------------------------------------------------------------------ broken checkpoints


@pytest.fixture()
def saved_single(tmp_path):
    engine = build("awk", "single", "fp32")
    train_steps(engine, "awk", 0, 2)
    path = tmp_path / "ck"
    checkpoint.save(engine, path)
    shard = next(p for p in path.iterdir() if p.name.endswith(".pt"))
    return path, shard


def _fresh_and_check_unchanged(path, words):
    engine = build("awk", "single", "fp32", seed=11)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(engine, path)
    for w in words:
        assert w in str(info.value), str(info.value)
    assert info.value.__cause__ is None and "pickle" not in str(info.value).lower()
    for k, v in engine.full_state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a failed load"
    assert engine.steps == 0 and not engine.optimizer.state


def test_truncated_shard_is_named(saved_single):
    path, shard = saved_single
    shard.write_bytes(shard.read_bytes()[:100])
    _fresh_and_check_unchanged(path, [shard.name, "truncated"])


def test_corrupt_shard_is_named(saved_single):
    path, shard = saved_single
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    _fresh_and_check_unchanged(path, [shard.name, "corrupt"])


def test_missing_shard_is_named(saved_single):
    path, shard = saved_single
    shard.unlink()
    _fresh_and_check_unchanged(path, [shard.name, "missing shard"])


def test_missing_metadata_is_named(saved_single):
    path, _ = saved_single
    (path / "metadata.json").unlink()
    _fresh_and_check_unchanged(path, ["metadata.json", "missing"])
    with pytest.raises(checkpoint.CheckpointError, match="metadata.json"):
        checkpoint.consolidate(path)


def test_garbage_metadata_is_named(saved_single):
    path, _ = saved_single
    (path / "metadata.json").write_text("{not json")
    _fresh_and_check_unchanged(path, ["metadata.json", "not valid"])


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_shard_that_would_run_code_is_refused(saved_single):
    path, shard = saved_single
    import hashlib
    import json
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned > " + str(path / "owned"),))
    raw = pickle.dumps({"format": 1, "x": Evil()})
    shard.write_bytes(raw)
    meta = json.loads((path / "metadata.json").read_text())
    meta["shards"][0].update(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    # a crafted checkpoint: the metadata's own digest re-recorded too
    (path / "metadata.json").write_bytes(encode_metadata(meta))
    _fresh_and_check_unchanged(path, [shard.name, "weights-only"])
    assert not (path / "owned").exists()


def test_mismatched_model_is_named(saved_single):
    path, _ = saved_single
    torch.manual_seed(0)
    other = zl.SingleProcess(models.AwkwardModel(d_hidden=8), functools.partial(torch.optim.AdamW, lr=1e-2))
    with pytest.raises(checkpoint.CheckpointError, match=r"metadata.json.*'encoder.weight' has shape \[8, 13\]"):
        checkpoint.load(other, path)
    gpt = zl.SingleProcess(models.GPT(models.gpt_config("nano")), functools.partial(torch.optim.AdamW, lr=1e-2))
    with pytest.raises(checkpoint.CheckpointError, match="a different model"):
        checkpoint.load(gpt, path)


def test_precision_mismatch_is_named(saved_single):
    path, _ = saved_single
    torch.manual_seed(0)
    bf16 = zl.SingleProcess(models.AwkwardModel(), functools.partial(torch.optim.AdamW, lr=1e-2), precision="bf16")
    with pytest.raises(checkpoint.CheckpointError, match="precision 'fp32'.*'bf16'"):
        checkpoint.load(bf16, path)


def test_a_second_save_replaces_the_first_and_leaves_one_set_of_shards(saved_single):
    path, first = saved_single
    engine = build("awk", "single", "fp32")
    train_steps(engine, "awk", 0, 4)
    checkpoint.save(engine, path)
    shards = sorted(p.name for p in path.iterdir() if p.name.startswith("shard-"))
    assert len(shards) == 2 and first.name not in shards     # the .pt and its descriptor
    assert not any(".tmp-" in p.name for p in path.iterdir())
    fresh = build("awk", "single", "fp32", seed=3)
    checkpoint.load(fresh, path)
    assert fresh.steps == 4


def checkpoint_on_a_tensor_parallel_mesh(path):
    from zerolab.zero_r.mesh import Mesh
    from zerolab.zero_r.tensor_parallel import TensorParallelGPT
    mesh = Mesh(dp=1, mp=2)
    torch.manual_seed(0)
    model = TensorParallelGPT.from_dense(models.GPT(models.gpt_config("nano", n_head=4)), mesh)
    engine = zl.DDP(model, functools.partial(torch.optim.AdamW, lr=1e-2), mesh=mesh)
    errors = []
    for call in (lambda: checkpoint.save(engine, path), lambda: checkpoint.load(engine, path)):
        try:
            call()
        except checkpoint.CheckpointError as e:
            errors.append(str(e))
    return errors


def test_a_tensor_parallel_mesh_is_refused_before_anything_is_written(tmp_path):
    # the two mp ranks share dp rank 0: without the check, both would write the same file name
    out = zl.launch(checkpoint_on_a_tensor_parallel_mesh, 2, args=(str(tmp_path / "ck"),))
    for errors in out:
        assert len(errors) == 2
        assert "checkpoint.save: the engine runs on a Mesh with mp=2" in errors[0]
        assert "checkpoint.load" in errors[1]
    assert not (tmp_path / "ck").exists()
