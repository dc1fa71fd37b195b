"""Checkpoints no crafted file can bend: malformed metadata, crafted shards, paths that leave the
directory, leftovers of interrupted saves, a save directory that is a file.

Every malformed checkpoint must raise CheckpointError (never a KeyError or a read outside the
directory) and leave the engine exactly as it was: load checks everything before it changes
anything. The reference for "untouched" is a copy of the engine's state taken before the load.
"""

import hashlib
import io
import json
import os
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zerolab as zl
from zerolab import checkpoint
from zerolab.checkpoint.files import encode_metadata
from zerolab.checkpoint.reader import CheckpointError


def small_engine(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    return zl.SingleProcess(model, partial(torch.optim.AdamW, lr=1e-2))


def one_step(engine):
    engine.backward(engine(torch.randn(4, 4)).pow(2).mean())
    engine.step()
    engine.zero_grad()


def snapshot(engine):
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    opt = engine.optimizer.state_dict()
    return state, repr(opt["param_groups"]), [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                                              for s in opt["state"].values()]


def same(a, b):
    return all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1] == b[1] and \
        all(torch.equal(x[k], y[k]) for x, y in zip(a[2], b[2]) for k in x)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "run")
    engine = small_engine()
    one_step(engine)
    checkpoint.save(engine, path)
    with open(os.path.join(path, "metadata.json"), "rb") as f:
        return path, f.read()


def write_metadata(path, data: bytes):
    with open(os.path.join(path, "metadata.json"), "wb") as f:
        f.write(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_one_byte_change_to_the_metadata_is_a_checkpoint_error_or_harmless(saved, data):
    path, original = saved
    pos = data.draw(st.integers(0, len(original) - 1))
    byte = data.draw(st.integers(0, 255))
    mutated = original[:pos] + bytes([byte]) + original[pos + 1:]
    engine = small_engine(seed=1)
    before = snapshot(engine)
    write_metadata(path, mutated)
    try:
        checkpoint.load(engine, path)
    except CheckpointError:
        assert same(before, snapshot(engine)), "a refused load changed the engine"
    finally:
        write_metadata(path, original)


def rewrite_shard(path, change):
    """Apply change(content) to rank 0's shard and re-record its size and hash: a crafted file
    that passes the integrity check."""
    meta_path = os.path.join(path, "metadata.json")
    with open(meta_path) as f:
        meta = json.load(f)
    shard = meta["shards"][0]
    content = torch.load(os.path.join(path, shard["file"]), weights_only=True)
    change(content)
    buf = io.BytesIO()
    torch.save(content, buf)
    data = buf.getvalue()
    with open(os.path.join(path, shard["file"]), "wb") as f:
        f.write(data)
    shard["bytes"], shard["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    with open(meta_path, "w") as f:
        f.write(encode_metadata(meta).decode())


def test_a_crafted_shard_cannot_replace_what_the_optimizer_updates(tmp_path):
    engine = small_engine()
    one_step(engine)
    path = str(tmp_path / "run")
    checkpoint.save(engine, path)
    rewrite_shard(path, lambda c: c["param_groups"][0].__setitem__("params", [torch.zeros(1)]))
    fresh = small_engine(seed=1)
    before = snapshot(fresh)
    with pytest.raises(CheckpointError, match="hyperparameters only"):
        checkpoint.load(fresh, path)
    assert same(before, snapshot(fresh))
    # a hyperparameter is taken (it is what a checkpoint is for), and nothing else changes
    rewrite_shard(path, lambda c: (c["param_groups"][0].pop("params"), c["param_groups"][0].__setitem__("lr", 0.5)))
    checkpoint.load(fresh, path)
    assert fresh.optimizer.param_groups[0]["lr"] == 0.5
    assert fresh.optimizer.param_groups[0]["params"][0] is fresh.masters[0]


@pytest.mark.parametrize("name", ["../outside.pt", "/etc/hostname", "sub/shard.pt", ".hidden", ""])
def test_a_shard_path_cannot_leave_the_checkpoint_directory(saved, name):
    path, original = saved
    meta = json.loads(original)
    meta["shards"][0]["file"] = name
    write_metadata(path, encode_metadata(meta))      # crafted: the digest re-recorded
    try:
        with pytest.raises(CheckpointError, match="plain file name inside the checkpoint directory"):
            checkpoint.load(small_engine(), path)
    finally:
        write_metadata(path, original)


def test_the_next_save_removes_what_an_interrupted_save_left(tmp_path):
    path = str(tmp_path / "run")
    engine = small_engine()
    checkpoint.save(engine, path)
    leftovers = ["shard-00000001-00000000000000aa-00000-of-00001.pt.tmp-4242", "metadata.json.tmp-4242"]
    for name in leftovers:
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"x" * 1000)
    one_step(engine)
    checkpoint.save(engine, path)
    assert not any(os.path.exists(os.path.join(path, name)) for name in leftovers)
    checkpoint.load(small_engine(), path)          # and the checkpoint itself is whole


@pytest.mark.slow
def test_a_save_directory_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    from zerolab.__main__ import main
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        checkpoint.save(small_engine(), str(not_a_dir))
    # the command line (its main(), in this process: refused before any rank starts)
    code = main(["train", "--world-size", "1", "--steps", "2", "--save-every", "1", "--save-dir", str(not_a_dir),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "not a directory" in err, err[-500:]


@pytest.mark.parametrize("failing_write", [1, 2, 3], ids=["shard", "its descriptor", "metadata"])
def test_a_save_that_fails_leaves_no_file_of_its_own(tmp_path, monkeypatch, failing_write):
    # a full disk: _atomic_write left its temporary file (623 KB of it on a 2 MB disk), and a
    # failed save left its shard until the next save
    import errno
    path = str(tmp_path / "run")
    engine = small_engine()
    checkpoint.save(engine, path)
    before = sorted(os.listdir(path))
    one_step(engine)
    calls, fsync = [], os.fsync

    def disk_full_at_the_nth_write(fd):
        calls.append(fd)
        if len(calls) == failing_write:
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)
    monkeypatch.setattr(os, "fsync", disk_full_at_the_nth_write)
    with pytest.raises(checkpoint.CheckpointError, match="No space left on device.*previous checkpoint"):
        checkpoint.save(engine, path)
    monkeypatch.undo()
    assert sorted(os.listdir(path)) == before
    fresh = small_engine(seed=1)
    checkpoint.load(fresh, path)            # the previous checkpoint, whole
    assert fresh.steps == 0


def save_into_a_directory_of_its_own(root):
    engine = zl.ZeRO(torch.nn.Linear(4, 2), partial(torch.optim.SGD, lr=0.1), stage=2)
    try:
        checkpoint.save(engine, os.path.join(root, f"node{zl.rank()}"))
    except CheckpointError as e:
        return str(e)
    return "saved"


@pytest.mark.slow
def test_ranks_saving_into_directories_that_are_not_shared_are_told_so(tmp_path):
    # rank 0 could not find rank 1's shard: a raw FileNotFoundError on rank 0, a collective
    # error on rank 1; now both ranks say the same thing, and nothing is left
    messages = zl.launch(save_into_a_directory_of_its_own, 2, args=(str(tmp_path),))
    for message in messages:
        assert "the ranks must save into one directory they all share" in message, messages
    assert not [f for d in os.listdir(tmp_path) for f in os.listdir(tmp_path / d)], "no shard left"
