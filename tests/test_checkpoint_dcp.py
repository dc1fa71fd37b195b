"""torch.distributed.checkpoint (DCP) directories keep the promises of zerolab's own format: nothing
in one runs code, a changed byte or a file from another save is refused naming the file, every rank
loads the same checkpoint, a failed save keeps the previous one, and a directory never holds two
checkpoints that could be confused.

The references are independent of the code under test: a marker file that planted code would
create (its absence is the check; the planted pickle is shown to create it when plain pickle reads
it), the engine's own state before a refused load, the weights an uninterrupted run reaches, and
the bytes of the previous checkpoint's files.
"""

import functools
import hashlib
import io
import os
import pickle
import random
import shutil
import subprocess
import warnings
import zipfile

import pytest
import torch

import zerolab as zl
from zerolab import checkpoint
from zerolab.checkpoint import unpickle
from zerolab.checkpoint.files import MANIFEST, CheckpointError, encode_metadata

ADAM = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


class WithBuffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        self.norm = torch.nn.BatchNorm1d(3)     # float buffers and an int64 one

    def forward(self, x):
        return self.norm(self.body(x))


def build(seed=0):
    torch.manual_seed(seed)
    return zl.SingleProcess(WithBuffers(), ADAM, precision="fp16")


def train(engine, steps=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        engine.backward(engine(torch.randn(5, 6, generator=g)).float().pow(2).mean())
        engine.step()
        engine.zero_grad()


def snapshot(engine):
    opt = engine.optimizer.state_dict()
    return ({k: v.clone() for k, v in engine.state_dict().items()},
            [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for s in opt["state"].values()],
            repr(opt["param_groups"]), engine.steps, repr(engine.precision.state_dict()))


def same(a, b):
    def eq(x, y):
        if torch.is_tensor(x):
            return torch.is_tensor(y) and x.shape == y.shape and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return isinstance(y, (list, tuple)) and len(x) == len(y) and all(eq(p, q) for p, q in zip(x, y))
        return x == y
    return eq(a, b)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A zerolab-written DCP directory after 2 steps, one after 4 steps of the same run, one of
    another run; and what a fresh engine holds after loading the first."""
    root = tmp_path_factory.mktemp("dcp")
    engine = build()
    train(engine, 2)
    first = str(root / "step2")
    checkpoint.save(engine, first, extra={"data_step": 2}, format="dcp")
    train(engine, 2, seed=1)
    later = str(root / "step4")
    checkpoint.save(engine, later, format="dcp")
    other = build(seed=5)
    train(other, 2, seed=3)
    another = str(root / "other")
    checkpoint.save(other, another, format="dcp")
    fresh = build(seed=1)
    assert checkpoint.load(fresh, first) == {"data_step": 2}
    return {"root": str(root), "first": first, "later": later, "other": another,
            "loaded": snapshot(fresh), "consolidated": checkpoint.consolidate(first)}


def copy_of(saved, name, source="first"):
    target = os.path.join(saved["root"], name)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(saved[source], target)
    return target


def test_a_dcp_checkpoint_resumes_where_it_was_saved(saved):
    engine = build()
    train(engine, 2)
    expected = snapshot(engine)
    assert same(saved["loaded"], expected)
    assert saved["loaded"][3] == 2 and "'good_steps': 2" in saved["loaded"][4]    # steps and the loss scaler
    assert sorted(os.listdir(saved["first"])) == [".metadata", "__0_0.distcp", MANIFEST]
    assert checkpoint.describe(saved["first"])[:2] == ("dcp", 2)
    assert same(saved["consolidated"], {k: v.float() for k, v in engine.state_dict().items()
                                        if v.is_floating_point()} | {"norm.num_batches_tracked": engine.state_dict()
                                                                      ["norm.num_batches_tracked"]})


# ------------------------------------------------------------------ nothing in a checkpoint runs code


def plant(directory, marker):
    """Replace .metadata with a pickle that creates `marker`, then returns the real metadata."""
    path = os.path.join(directory, ".metadata")
    with open(path, "rb") as f:
        real = f.read()

    class Planted:
        def __reduce__(self):
            return (eval, (f"open({marker!r}, 'w').close() or __import__('pickle').loads({real!r})",))
    with open(path, "wb") as f:
        pickle.dump(Planted(), f)


@pytest.mark.parametrize("how", ["with its manifest", "manifest removed", "beside zerolab's format"])
def test_a_planted_metadata_pickle_never_runs(saved, tmp_path, how):
    d = copy_of(saved, f"planted-{how.replace(' ', '-')}")
    marker = str(tmp_path / "ran")
    plant(d, marker)
    with open(os.path.join(d, ".metadata"), "rb") as f:          # the plant works when plain pickle reads it
        pickle.load(f)
    assert os.path.exists(marker)
    os.remove(marker)
    if how == "manifest removed":
        os.remove(os.path.join(d, MANIFEST))
    elif how == "beside zerolab's format":
        os.remove(os.path.join(d, MANIFEST))
        zl_format = str(tmp_path / "zl")
        checkpoint.save(build(), zl_format)
        for f in os.listdir(zl_format):
            shutil.copy(os.path.join(zl_format, f), d)
    words = {"with its manifest": "does not match the manifest", "manifest removed": "builtins.eval",
             "beside zerolab's format": "holds two checkpoints"}[how]
    for action in (lambda: checkpoint.load(build(1), d), lambda: checkpoint.consolidate(d),
                   lambda: checkpoint.describe(d)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # (a directory without a manifest: "cannot be verified")
            with pytest.raises(CheckpointError, match=words) as e:
                action()
        assert d in str(e.value)
    assert not os.path.exists(marker)


@pytest.mark.slow
def test_train_resume_and_consolidate_from_the_shell_never_run_a_planted_pickle(saved, tmp_path):
    d = copy_of(saved, "planted-cli")
    os.remove(os.path.join(d, MANIFEST))
    marker = str(tmp_path / "ran")
    plant(d, marker)
    train_ = subprocess.run([os.sys.executable, "-m", "zerolab", "train", "--size", "nano", "--steps", "3",
                             "--resume", d, "--no-progress", "--plot", ""], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    cons = subprocess.run([os.sys.executable, "-m", "zerolab", "consolidate", d, str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for out in (train_, cons):
        assert out.returncode != 0 and "builtins.eval" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not os.path.exists(marker)


def test_the_allow_lists_refuse_what_they_do_not_name(tmp_path):
    where = str(tmp_path / "x")
    with pytest.raises(CheckpointError, match="os.system"):
        unpickle.dcp_metadata(b"cos\nsystem\n(S'true'\ntR.", where)
    # a torch.save archive whose pickle names something else than a tensor's parts
    buf = io.BytesIO()
    torch.save({"a": torch.arange(4.0)}, buf)
    good = buf.getvalue()
    assert torch.equal(unpickle.torch_archive(good, where)["a"], torch.arange(4.0))
    evil = _replace_member(good, "data.pkl", b"cbuiltins\neval\n(S'1'\ntR.")
    with pytest.raises(CheckpointError, match="builtins.eval"):
        unpickle.torch_archive(evil, where)
    # a tensor that claims more elements than its storage holds
    buf = io.BytesIO()
    torch.save(torch.arange(4.0)[:2], buf)
    data = _replace_member(buf.getvalue(), "data.pkl", _member(buf.getvalue(), "data.pkl").replace(b"K\x02\x85", b"K\x09\x85"))
    with pytest.raises(CheckpointError, match="reaches element"):
        unpickle.torch_archive(data, where)


def _member(data, suffix):
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(suffix)))


def _replace_member(data, suffix, content):
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as z, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as w:
        for info in z.infolist():
            w.writestr(info, content if info.filename.endswith(suffix) else z.read(info.filename))
    return out.getvalue()


# ------------------------------------------------------------------ a changed byte, a file of another save


def _flip(path, rng):
    data = bytearray(open(path, "rb").read())
    i = rng.randrange(len(data))
    data[i] ^= 1 << rng.randrange(8)
    open(path, "wb").write(bytes(data))


def _mutate(d, saved, rng) -> str:
    """One random change of the files, nothing re-recorded; returns what it did."""
    files = sorted(os.listdir(d))
    f = rng.choice(files)
    path = os.path.join(d, f)
    kind = rng.choice(["flip", "flip", "flip", "truncate", "grow", "swap", "delete", "empty"])
    if kind == "flip":
        _flip(path, rng)
    elif kind == "truncate":
        data = open(path, "rb").read()
        open(path, "wb").write(data[:rng.randrange(len(data))])
    elif kind == "grow":
        with open(path, "ab") as out:
            out.write(os.urandom(rng.randrange(1, 64)))
    elif kind == "swap":                 # the same file from a later save of this run, or of another run
        source = saved[rng.choice(["later", "other"])]
        shutil.copy(os.path.join(source, f), path)
    elif kind == "delete":
        os.remove(path)
    else:
        open(path, "wb").close()
    return f"{kind} {f}"


def test_no_corruption_of_a_dcp_checkpoint_loads_silently(saved):
    rng = random.Random(0)
    refused = 0
    for case in range(150):
        d = copy_of(saved, "mutated")
        what = _mutate(d, saved, rng)
        engine = build(1)
        before = snapshot(engine)
        try:
            checkpoint.load(engine, d)
        except CheckpointError as e:
            assert same(before, snapshot(engine)), (case, what, "a refused load changed the engine")
            assert d in str(e), (case, what, str(e))
            refused += 1
        else:
            assert same(saved["loaded"], snapshot(engine)), (case, what, "loaded something else, silently")
        try:
            state = checkpoint.consolidate(d)
        except CheckpointError as e:
            assert d in str(e), (case, what, str(e))
        else:
            assert same(saved["consolidated"], state), (case, what, "consolidated something else, silently")
    assert refused >= 140       # (a swap of a file with itself, from the same run's later save, is not a change only by chance)


def _reseal(d):
    """Re-record every file's size and SHA-256 in the manifest, as a crafting hand would."""
    from zerolab.checkpoint.files import read_sealed
    m = read_sealed(os.path.join(d, MANIFEST), "m", "")
    for e in m["files"]:
        if not os.path.exists(os.path.join(d, e["file"])):
            continue
        data = open(os.path.join(d, e["file"]), "rb").read()
        e["bytes"], e["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    open(os.path.join(d, MANIFEST), "wb").write(encode_metadata(m))


def test_crafted_dcp_files_raise_only_checkpoint_errors_naming_a_file(saved):
    """The content changed and every digest re-recorded: no digest can catch it; what the reader
    builds must still be checked. Allowed: a CheckpointError naming a file, before anything
    changed, or a load after which a training step runs."""
    rng = random.Random(1)
    outcomes = {"refused": 0, "taken": 0}
    for case in range(60):
        d = copy_of(saved, "crafted")
        what = _mutate(d, saved, rng)
        if os.path.exists(os.path.join(d, MANIFEST)) and what.split()[1] != MANIFEST:
            _reseal(d)
        engine = build(1)
        before = snapshot(engine)
        try:
            checkpoint.load(engine, d)
        except CheckpointError as e:
            assert same(before, snapshot(engine)) and d in str(e), (case, what, str(e))
            outcomes["refused"] += 1
        else:
            train(engine, 1)
            outcomes["taken"] += 1
    assert outcomes["refused"] > 30, outcomes


# ------------------------------------------------------------------ two formats, one directory


def test_a_directory_never_holds_both_formats(saved, tmp_path):
    d = str(tmp_path / "ck")
    engine = build()
    train(engine, 1)
    checkpoint.save(engine, d, format="dcp")
    with pytest.raises(CheckpointError, match="holds a checkpoint in DCP format"):
        checkpoint.save(engine, d)
    train(engine, 1)
    checkpoint.save(engine, d, replace=True)                       # zerolab's format replaces it whole
    assert checkpoint.describe(d)[:2] == ("zerolab", 2) and not os.path.exists(os.path.join(d, ".metadata"))
    with pytest.raises(CheckpointError, match="holds a checkpoint in zerolab's format"):
        checkpoint.save(engine, d, format="dcp")
    train(engine, 1)
    checkpoint.save(engine, d, format="dcp", replace=True)
    assert checkpoint.describe(d)[:2] == ("dcp", 3) and not os.path.exists(os.path.join(d, "metadata.json"))
    assert sorted(os.listdir(tmp_path)) == ["ck"]                  # nothing left beside it
    open(os.path.join(d, "notes.txt"), "w").close()                # a directory that holds more than a checkpoint
    with pytest.raises(CheckpointError, match="notes.txt"):
        checkpoint.save(engine, d, format="dcp")
    os.remove(os.path.join(d, "notes.txt"))
    zl_dir = str(tmp_path / "zl")
    checkpoint.save(engine, zl_dir)
    shutil.copy(os.path.join(d, ".metadata"), os.path.join(zl_dir, ".metadata"))   # DCP saved, then zerolab's, one directory
    for action in (lambda: checkpoint.load(build(1), zl_dir), lambda: checkpoint.consolidate(zl_dir)):
        with pytest.raises(CheckpointError, match="holds two checkpoints") as e:
            action()
        assert "metadata.json" in str(e.value) and ".metadata" in str(e.value)


# ------------------------------------------------------------------ a failed save keeps the last one


def test_a_dcp_save_that_fails_midway_keeps_the_previous_checkpoint(saved, tmp_path, monkeypatch):
    from torch.distributed.checkpoint import filesystem
    d = copy_of(saved, "failing")
    before = {f: open(os.path.join(d, f), "rb").read() for f in os.listdir(d)}
    engine = build()
    train(engine, 5)
    calls = {"n": 0}
    original = filesystem._write_item

    def full_disk(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return original(*args, **kwargs)
    monkeypatch.setattr(filesystem, "_write_item", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device.*previous checkpoint"):
        checkpoint.save(engine, d, format="dcp")
    assert calls["n"] == 3
    assert {f: open(os.path.join(d, f), "rb").read() for f in os.listdir(d)} == before
    assert not [f for f in os.listdir(saved["root"]) if ".tmp-" in f]      # the half-written save is gone
    again = build(1)
    checkpoint.load(again, d)
    assert same(saved["loaded"], snapshot(again))


def _tmpfs(path, size):
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs (a real full disk) needs root")
def test_a_dcp_save_onto_a_full_disk_keeps_the_previous_checkpoint(tmp_path):
    disk = str(tmp_path / "disk")
    if not _tmpfs(disk, "256k"):
        pytest.skip("this machine does not let root mount a tmpfs")
    try:
        engine = build()
        train(engine, 2)
        d = os.path.join(disk, "ck")
        checkpoint.save(engine, d, format="dcp")
        expected = snapshot(engine)
        train(engine, 1)
        with pytest.raises(CheckpointError, match="(No space left on device|bytes free).*previous checkpoint"):
            checkpoint.save(engine, d, format="dcp", extra={"blob": torch.zeros(100_000)})
        assert os.listdir(disk) == ["ck"]
        again = build(1)
        checkpoint.load(again, d)
        assert same(expected, snapshot(again))
    finally:
        subprocess.run(["umount", disk], capture_output=True)


# ------------------------------------------------------------------ every rank, the same checkpoint


def _zero2(seed=0):
    from zerolab import models
    torch.manual_seed(seed)
    return zl.ZeRO(models.GPT(models.gpt_config("nano")), ADAM, stage=2, bucket_mb=0.002)


def _gpt_steps(engine, start, stop):
    from zerolab import data, models
    ds = data.CharDataset(32)
    for step in range(start, stop):
        _, loss = models.gpt_loss(engine, ds.batch(step, 2, zl.rank(), zl.world_size()))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()


def different_dcp_checkpoints_per_rank(root, marker):
    """ZeRO-2 saves DCP at steps 5 and 7 of one run; rank r is given paths[r]. Then each rank is
    given a copy with a planted pickle and no manifest: the error, and whether anything changed."""
    engine = _zero2()
    paths = []
    for stop in (5, 7):
        _gpt_steps(engine, len(paths) and 5, stop)
        paths.append(os.path.join(root, f"step{stop}"))
        checkpoint.save(engine, paths[-1], format="dcp")
    planted = os.path.join(root, "planted")
    if zl.rank() == 0:
        shutil.copytree(paths[0], planted)
        os.remove(os.path.join(planted, MANIFEST))
        plant(planted, marker)
    engine.comm.barrier()
    out = []
    for given in (paths[zl.rank()], planted):
        fresh = _zero2(seed=3)
        before = {k: v.clone() for k, v in fresh.full_state_dict().items()}
        try:
            checkpoint.load(fresh, given)
            error = None
        except CheckpointError as e:
            error = str(e)
        after = fresh.full_state_dict()
        out.append((error, fresh.steps == 0 and all(torch.equal(before[k], after[k]) for k in before)))
    return out, paths


@pytest.mark.slow
def test_ranks_given_different_dcp_checkpoints_are_refused_and_nothing_runs(tmp_path):
    marker = str(tmp_path / "ran")
    results = zl.launch(different_dcp_checkpoints_per_rank, 2, args=(str(tmp_path), marker))
    paths = results[0][1]
    for rank, (((error, unchanged), (planted_error, planted_unchanged)), _) in enumerate(results):
        assert unchanged and planted_unchanged, rank
        assert "the ranks were given different checkpoints" in error and all(p in error for p in paths), error
        assert "step 5 (sha256 " in error and "step 7 (sha256 " in error, error
        assert "builtins.eval" in planted_error, planted_error
    assert not os.path.exists(marker)


# ------------------------------------------------------------------ train --resume takes a DCP directory


@pytest.mark.slow
def test_train_resumes_from_a_dcp_directory_as_from_its_own_format(tmp_path):
    from zerolab.__main__ import main
    from zerolab.train import TrainConfig, make_engine, train_worker
    from zerolab import models
    own = str(tmp_path / "own")
    first = TrainConfig(size="nano", strategy="single", steps=2, batch_size=2, save_every=2, save_dir=own)
    train_worker(first)
    straight = train_worker(TrainConfig(size="nano", strategy="single", steps=4, batch_size=2))
    torch.manual_seed(0)
    engine = make_engine(first, models.GPT(models.gpt_config("nano")))
    extra = checkpoint.load(engine, own)
    d = str(tmp_path / "dcp")
    checkpoint.save(engine, d, extra=extra, format="dcp")
    out = subprocess.run([os.sys.executable, "-m", "zerolab", "train", "--size", "nano", "--steps", "4",
                          "--world-size", "1", "--batch-size", "2", "--resume", d, "--no-progress", "--plot", ""],
                         capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "(resumed at step 2)" in out.stdout
    line = next(l for l in out.stdout.splitlines() if l.strip().startswith("loss:"))
    last = line.split(", last ")[1].split(",")[0]
    assert last == f"{straight['losses'][-1]:.4f}", (line, straight["losses"])     # the uninterrupted run's
    assert main(["consolidate", d, str(tmp_path / "w.pt")]) == 0
    weights = torch.load(str(tmp_path / "w.pt"), weights_only=True)
    assert all(torch.equal(weights[k], v.float()) for k, v in engine.state_dict().items())
