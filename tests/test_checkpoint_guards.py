"""Checkpoints that lose nothing and let nothing grow: every rank loads the same checkpoint, a
save that fails on one rank leaves no file on any, nothing zerolab writes follows a link planted
at its temporary name, and a crafted file cannot make the reader build gigabytes.

The references are independent of the checkpoint code: the engine's own state before the load
(compared tensor by tensor), the directory's listing before the failed save, a victim file's
bytes, and the process's own memory counters (tracemalloc for Python objects, the kernel's
peak resident set for torch's storages).
"""

import errno
import functools
import hashlib
import io
import json
import os
import subprocess
import sys
import tracemalloc
import zipfile
import zlib

import pytest
import torch

import zerolab as zl
from zerolab import checkpoint, data, models
from zerolab.checkpoint import writer as checkpoint_writer
from zerolab.checkpoint.files import MAX_METADATA_VALUES, encode_metadata, seal
from zerolab.launch import LaunchError

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

ADAM = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.0)


def gpt_engine(kind, seed=0):
    torch.manual_seed(seed)
    model = models.GPT(models.gpt_config("nano"))
    if kind == "ddp":
        return zl.DDP(model, ADAM, bucket_mb=0.002)
    return zl.ZeRO(model, ADAM, stage=int(kind[-1]), bucket_mb=0.002)


def train(engine, start, stop):
    ds = data.CharDataset(32)
    for step in range(start, stop):
        _, loss = models.gpt_loss(engine, ds.batch(step, 2, zl.rank(), zl.world_size()))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()


# ------------------------------------------------------------------ every rank, the same checkpoint


def load_a_different_checkpoint_on_each_rank(root):
    """Rank 0 is given the step-3 checkpoint, rank 1 the step-6 one of the same run (DDP, ZeRO-3),
    or two runs' checkpoints at the same step (ZeRO-2: only the content differs). Returns, per
    case, the error and whether the engine is exactly as it was (weights, steps, optimizer)."""
    out = {}
    for kind, seeds, steps in (("ddp", (0, 0), (3, 6)), ("zero3", (0, 0), (3, 6)), ("zero2", (0, 1), (3, 3))):
        paths = []
        for r, (seed, at) in enumerate(zip(seeds, steps)):
            engine = gpt_engine(kind, seed)
            train(engine, 0, at)
            paths.append(os.path.join(root, f"{kind}-run{seed}-step{at}"))
            checkpoint.save(engine, paths[-1])
        engine = gpt_engine(kind, seed=7)
        train(engine, 0, 1)
        before = {k: v.clone() for k, v in engine.full_state_dict().items()}
        opt_before = [{k: v.clone() for k, v in s.items()} for s in engine.optimizer.state.values()]
        try:
            checkpoint.load(engine, paths[zl.rank()])
            error = None
        except checkpoint.CheckpointError as e:
            error = str(e)
        after = engine.full_state_dict()
        opt_after = list(engine.optimizer.state.values())
        unchanged = engine.steps == 1 and all(torch.equal(before[k], after[k]) for k in before) and \
            len(opt_before) == len(opt_after) and \
            all(torch.equal(a[k], b[k]) for a, b in zip(opt_before, opt_after) for k in a)
        out[kind] = (error, unchanged, paths)
    return out


def _craft_shard(path, rank, change):
    """change(content) applied to `rank`'s shard, its size and SHA-256 and the metadata's seal
    re-recorded: a crafted file that passes every digest."""
    meta = json.loads(open(os.path.join(path, "metadata.json"), "rb").read())
    entry = meta["shards"][rank]
    content = torch.load(os.path.join(path, entry["file"]), weights_only=True)
    change(content)
    buf = io.BytesIO()
    torch.save(content, buf)
    with open(os.path.join(path, entry["file"]), "wb") as f:
        f.write(buf.getvalue())
    entry["bytes"], entry["sha256"] = len(buf.getvalue()), hashlib.sha256(buf.getvalue()).hexdigest()
    with open(os.path.join(path, "metadata.json"), "wb") as f:
        f.write(encode_metadata(meta))


def load_a_checkpoint_only_rank_1_refuses(root):
    """ZeRO-2 at the same world size: each rank reads its own shard's optimizer state, and rank 1's
    holds a step count of -1. Returns (the error, whether the engine is exactly as it was)."""
    path = os.path.join(root, "zero2-crafted")
    engine = gpt_engine("zero2")
    train(engine, 0, 2)
    checkpoint.save(engine, path)
    if zl.rank() == 0:
        _craft_shard(path, 1, lambda c: c["pieces"][0]["scalars"].__setitem__("step", torch.tensor(-1.0)))
    torch.distributed.barrier()
    engine = gpt_engine("zero2", seed=7)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    try:
        checkpoint.load(engine, path)
        error = None
    except checkpoint.CheckpointError as e:
        error = str(e)
    after = engine.full_state_dict()
    return error, engine.steps == 0 and not engine.optimizer.state and all(torch.equal(before[k], after[k])
                                                                             for k in before)


def test_ranks_given_different_checkpoints_are_refused_and_nothing_changes(tmp_path):
    # before: ZeRO-3 took both (steps 4 and 7 after one more step, the gathered model a mixture),
    # DDP took both and its two replicas differed from then on
    results = zl.launch(load_a_different_checkpoint_on_each_rank, 2, args=(str(tmp_path),))
    for kind in ("ddp", "zero3", "zero2"):
        (error0, unchanged0, paths), (error1, unchanged1, _) = results[0][kind], results[1][kind]
        assert error0 is not None and error0 == error1, (kind, error0, error1)   # one error, every rank
        step0, step1 = paths[0].rsplit("step", 1)[1], paths[1].rsplit("step", 1)[1]
        assert error0.startswith("checkpoint.load: the ranks were given different checkpoints: ")
        assert f"rank 0: step {step0} (sha256 " in error0 and f") in {paths[0]}" in error0, error0
        assert f"rank 1: step {step1} (sha256 " in error0 and f") in {paths[1]}" in error0, error0
        assert unchanged0 and unchanged1, f"{kind}: the refused load changed the engine"


def test_a_checkpoint_one_rank_refuses_changes_no_rank(tmp_path):
    # the value is in rank 1's shard, which only rank 1 reads the optimizer state of: rank 0 would
    # have loaded it (and changed its weights) while rank 1 refused
    (error0, unchanged0), (error1, unchanged1) = zl.launch(load_a_checkpoint_only_rank_1_refuses, 2,
                                                           args=(str(tmp_path),))
    shard1 = next(f for f in os.listdir(tmp_path / "zero2-crafted") if f.endswith("-00001-of-00002.pt"))
    assert error1.startswith(str(tmp_path / "zero2-crafted" / shard1)) and "must be a whole number >= 0" in error1
    assert error0 == f"{tmp_path / 'zero2-crafted'}: rank 1 refused this checkpoint (its error says why); no rank has changed anything"
    assert unchanged0 and unchanged1


# ------------------------------------------------------------------ a save that fails on one rank


def save_then_fail_on_one_rank(root, faulty, how):
    """A good save, one more step, then a save in which rank `faulty` fails: its disk is full
    when it writes its shard ("full"), or it dies just before writing it ("kill")."""
    engine = gpt_engine("zero2")
    train(engine, 0, 1)
    checkpoint.save(engine, root)
    train(engine, 1, 2)
    if zl.rank() == faulty:
        def failing_write(path, data):
            if path.endswith(".pt"):
                if how == "kill":
                    os.kill(os.getpid(), 9)
                raise OSError(errno.ENOSPC, "No space left on device")
            raise AssertionError("the shard is written first")
        checkpoint_writer._atomic_write = failing_write
    try:
        checkpoint.save(engine, root)
    except Exception as e:  # noqa: BLE001 - what each rank was told comes back to the test
        return f"{type(e).__name__}: {e}"
    return "saved"


@pytest.mark.parametrize("world, faulty, how", [(2, 1, "full"), (4, 2, "kill")])
def test_a_save_that_fails_on_one_rank_leaves_no_file_on_any(tmp_path, world, faulty, how):
    # before: the other ranks' new shards stayed (1-2 files at world 2, 4-6 at world 4) until the
    # next save, because the launcher stopped them before they could remove them
    root = str(tmp_path / "ck")
    if how == "full":
        said = zl.launch(save_then_fail_on_one_rank, world, args=(root, faulty, how))
        assert said[faulty].startswith(f"CheckpointError: {root}: cannot write rank {faulty}'s shard (No space left "
                                       "on device)"), said
        for r in set(range(world)) - {faulty}:
            assert said[r].startswith(f"CheckpointError: {root}: rank {faulty} could not write its shard"), said
    else:
        with pytest.raises(LaunchError, match=f"rank {faulty} was killed by signal SIGKILL"):
            zl.launch(save_then_fail_on_one_rank, world, args=(root, faulty, how))
    files = sorted(os.listdir(root))
    # exactly the first save: its metadata and one shard and descriptor per rank, no new shard, no
    # temporary file
    assert files[0] == "metadata.json" and len(files) == 1 + 2 * world, files
    assert all(f.startswith("shard-00000001-") for f in files[1:]), files
    assert "head.weight" in checkpoint.consolidate(root)      # the first save, whole


def probe_then_lose_rank_1(path):
    """python -m zerolab train's check of the save directory (every rank writes a probe file
    there and looks for the others'), with rank 1 killed before it writes its own."""
    from zerolab import train_checks
    from zerolab.runtime.comm import Ledger
    if zl.rank() == 1:
        train_checks.check_save_dir = lambda p: os.kill(os.getpid(), 9)
    train_checks.check_shared_save_dir(path, Ledger(), zl.rank(), zl.world_size())


def test_the_save_directory_probe_is_removed_when_a_rank_dies(tmp_path):
    # before: rank 0's .zerolab-probe-* stayed when the launcher stopped it (SIGTERM ended it at once)
    with pytest.raises(LaunchError, match="rank 1 was killed by signal SIGKILL"):
        zl.launch(probe_then_lose_rank_1, 2, args=(str(tmp_path),))
    assert os.listdir(tmp_path) == []


def test_sigterm_during_a_save_runs_its_clean_up_unless_the_program_handles_it_itself():
    import signal

    from zerolab.checkpoint.atomic import signals_held, stopping_cleanly
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)     # (as in a rank; zl.launch's parent has its own)
    try:
        with pytest.raises(SystemExit) as stopped:
            with stopping_cleanly():
                os.kill(os.getpid(), signal.SIGTERM)     # (the default would end this process here)
        assert stopped.value.code == 143 and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        seen = []
        signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
        with stopping_cleanly():                     # a job that saves when preempted keeps its handler
            os.kill(os.getpid(), signal.SIGTERM)
            with signals_held():                     # and a clean-up is not interrupted: held, then delivered
                os.kill(os.getpid(), signal.SIGTERM)
                assert seen == [signal.SIGTERM]
        assert seen == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


# ------------------------------------------------------------------ no link followed


def _small_single(seed=0):
    torch.manual_seed(seed)
    return zl.SingleProcess(models.AwkwardModel(), ADAM)


def _plant(link, victim):
    with open(victim, "wb") as f:
        f.write(b"precious")
    os.symlink(victim, link)


def test_a_link_planted_at_the_temporary_name_is_not_followed(tmp_path):
    # before: the writer and consolidate opened NAME.tmp-<pid> with a plain open(), which follows
    # a link there: the victim was overwritten and NAME became a link to it
    from zerolab.__main__ import main
    ck, victim = tmp_path / "ck", tmp_path / "victim"
    engine = _small_single()
    checkpoint.save(engine, ck)
    for name in ("metadata.json", "out.pt"):
        target = ck / name if name == "metadata.json" else tmp_path / name
        _plant(f"{target}.tmp-{os.getpid()}", victim)
        if name == "metadata.json":
            train_one = engine(torch.randn(4, 13)).pow(2).mean()
            engine.backward(train_one)
            engine.step()
            checkpoint.save(engine, ck)
        else:
            assert main(["consolidate", str(ck), str(target)]) == 0
        assert victim.read_bytes() == b"precious", name
        assert os.path.isfile(target) and not os.path.islink(target), name
        os.remove(victim)
        if os.path.lexists(f"{target}.tmp-{os.getpid()}"):
            os.remove(f"{target}.tmp-{os.getpid()}")
    fresh = _small_single(seed=1)
    checkpoint.load(fresh, ck)
    assert fresh.steps == 1
    state = torch.load(tmp_path / "out.pt", weights_only=True)
    for key, value in engine.full_state_dict().items():
        assert torch.equal(state[key], value), key


def test_consolidate_refuses_an_output_inside_the_checkpoint(tmp_path, capsys):
    # before: consolidate D D/metadata.json replaced the metadata with a zip
    from zerolab.__main__ import main
    ck = tmp_path / "ck"
    checkpoint.save(_small_single(), ck)
    files = {p.name: p.read_bytes() for p in ck.iterdir()}
    os.link(ck / "metadata.json", tmp_path / "hard-link.json")
    (ck / "sub").mkdir()
    for out, words in ((ck / "metadata.json", "is inside the checkpoint directory"),
                       (ck / "model.pt", "is inside the checkpoint directory"),
                       (ck / "sub" / "model.pt", "is inside the checkpoint directory"),
                       (tmp_path / "hard-link.json", "is the checkpoint's own metadata.json under another name")):
        assert main(["consolidate", str(ck), str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    (ck / "sub").rmdir()
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == files


def test_train_never_replaces_a_checkpoint_without_resume_or_overwrite(tmp_path, capsys):
    # before: a 2-step run with --save-dir D replaced the step-20 checkpoint in D without a word
    from zerolab.__main__ import main
    from zerolab.train import TrainConfig
    ck = tmp_path / "ck"
    engine = _small_single()
    engine.steps = 20
    checkpoint.save(engine, ck)
    listing = sorted(os.listdir(ck))
    assert main(["train", "--save-every", "1", "--save-dir", str(ck), "--no-progress", "--plot", ""]) == 2
    err = capsys.readouterr().err
    assert err == (f"zerolab train: error: save_dir: {ck} holds a checkpoint (step 20) already; pass --resume "
                   f"{ck} to continue it, or --overwrite to replace it\n"), err
    assert sorted(os.listdir(ck)) == listing
    common = dict(size="nano", world_size=1, strategy="single", save_every=1, save_dir=str(ck))
    TrainConfig(**common, overwrite=True).check()                 # said in so many words
    TrainConfig(**{**common, "save_dir": str(ck) + "/"}, resume=str(ck)).check()   # continuing it
    other = tmp_path / "other"
    checkpoint.save(_small_single(), other)
    with pytest.raises(ValueError, match="holds a checkpoint"):   # resuming another run would replace it
        TrainConfig(**common, resume=str(other)).check()


# ------------------------------------------------------------------ crafted files, bounded


def _peak_python_bytes(call):
    """(what call() raised, the most memory Python objects took meanwhile)."""
    tracemalloc.start()
    try:
        call()
    except checkpoint.CheckpointError as e:
        raised = e
    else:
        raised = None
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return raised, peak


@pytest.fixture()
def saved(tmp_path):
    ck = tmp_path / "ck"
    checkpoint.save(_small_single(), ck)
    return ck


def test_a_64_mib_metadata_of_empty_objects_is_refused_unread(saved):
    # the attack: 64 MiB of [{},{},...] was parsed before its digest was checked (1.9 GB)
    meta = saved / "metadata.json"
    with open(meta, "wb") as f:
        f.write(b"[" + b"{}," * ((64 << 20) // 3 - 1) + b"{}]")
    error, peak = _peak_python_bytes(lambda: checkpoint.consolidate(saved))
    assert peak < 1 << 20, f"{peak / 2**20:.1f} MiB"       # only its size was asked (fstat)
    assert error is not None and str(error).startswith(f"{meta}: larger than any checkpoint metadata"), error


@pytest.mark.parametrize("sealed, words", [(False, "does not end in its own SHA-256"),
                                           (True, "more than any checkpoint's metadata (1,000,000)")])
def test_crafted_metadata_is_refused_before_it_is_parsed(saved, sealed, words):
    # the same attack under the size bound: 15 MiB of {} would build ~400 MB of dicts. Unsealed,
    # the digest refuses it; sealed by someone who recomputed the digest, the count of JSON values
    # (known from the raw bytes) refuses it. Either way Python holds the file's bytes and no more.
    meta = saved / "metadata.json"
    body = b'{"format": 3, "x": [' + b"{}," * (5 << 20) + b'{}]}'
    raw = seal(body) if sealed else body
    meta.write_bytes(raw)
    for call in (lambda: checkpoint.consolidate(saved), lambda: checkpoint.load(_small_single(), saved)):
        error, peak = _peak_python_bytes(call)
        assert peak < len(raw) + (2 << 20), f"{peak / 2**20:.1f} MiB for a {len(raw) / 2**20:.1f} MiB file"
        assert error is not None and str(error).startswith(f"{meta}: ") and words in str(error), error


def test_a_checkpoint_of_the_format_before_is_named_as_such(saved):
    # format 2 sealed its metadata by a digest over the parsed JSON: checking it meant parsing first
    meta = json.loads((saved / "metadata.json").read_bytes())
    meta["format"] = 2
    (saved / "metadata.json").write_text(json.dumps(meta, indent=1))
    with pytest.raises(checkpoint.CheckpointError, match=r"metadata.json: written by an older zerolab "
                                                         r"\(checkpoint format 2\); this version reads format 3"):
        checkpoint.consolidate(saved)


def _values(node):
    if isinstance(node, dict):
        return len(node) + sum(_values(v) for v in node.values())     # its keys and their values
    if isinstance(node, list):
        return sum(_values(v) for v in node)
    return 1


@pytest.mark.parametrize("text", ['{"a": [1, [2, {}], "x,y:[{"], "b": {"c": null, "d": []}}',
                                  '{"k": [[], [[]], {"": ""}]}', '{"s": "\\"[,:{"}'])
def test_the_count_before_parsing_bounds_the_values_parsing_builds(text, saved):
    # the bound that keeps json.loads small must never undercount (a string holding , : [ { counts
    # extra, never fewer); the reference is a walk over what json.loads built
    built = 1 + _values(json.loads(text))
    counted = 1 + sum(text.encode().count(c) for c in (b",", b":", b"[", b"{"))
    assert counted >= built
    honest = (saved / "metadata.json").read_bytes()
    assert 1 + sum(honest.count(c) for c in (b",", b":", b"[", b"{")) >= 1 + _values(json.loads(honest))
    assert MAX_METADATA_VALUES == 1_000_000


def _write_deflated_zeros(archive, like, size):
    """A member of `size` zero bytes, deflated, written into an open ZipFile a MiB at a time. A
    full flush makes every MiB's deflate stream the same bytes, so one is computed and repeated
    (deflating 2 GiB would take half a minute)."""
    mib = bytes(1 << 20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = deflate.compress(mib) + deflate.flush(zlib.Z_FULL_FLUSH)
    tail = deflate.flush(zlib.Z_FINISH)
    crc = 0
    for _ in range(size >> 20):
        crc = zlib.crc32(mib, crc)
    info = zipfile.ZipInfo(like.filename, like.date_time)
    info.compress_type, info.file_size, info.CRC = zipfile.ZIP_DEFLATED, size, crc
    info.compress_size = len(block) * (size >> 20) + len(tail)
    info.header_offset = archive.fp.tell()
    archive.fp.write(info.FileHeader(zip64=False))
    for _ in range(size >> 20):
        archive.fp.write(block)
    archive.fp.write(tail)
    archive.filelist.append(info)
    archive.NameToInfo[info.filename] = info
    archive.start_dir = archive.fp.tell()


def _craft_extra_bomb(ck, gib=2):
    """The issue's attack: rank 0's shard given an `extra` tensor of `gib` GiB of zeros, its zip
    member deflated (2 GiB of zeros: ~2 MB), every size and digest re-recorded. Built a MiB at a
    time: crafting it never holds the tensor."""
    meta = json.loads((ck / "metadata.json").read_bytes())
    entry = meta["shards"][0]
    content = torch.load(ck / entry["file"], weights_only=True)
    marker = 12_345                                   # the small tensor's length, found in the pickle
    content["extra"] = {"bomb": torch.zeros(marker)}
    buf = io.BytesIO()
    torch.save(content, buf)
    numel = (gib << 30) // 4
    out = io.BytesIO()
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            raw = src.read(info)
            if info.filename.endswith("/data.pkl"):
                # BININT2 12345 -> BININT numel, in the storage's record and in the tensor's size
                old, new = b"M" + marker.to_bytes(2, "little"), b"J" + numel.to_bytes(4, "little")
                assert raw.count(old) >= 2
                dst.writestr(info, raw.replace(old, new))
            elif info.file_size == marker * 4:
                _write_deflated_zeros(dst, info, numel * 4)
            else:
                dst.writestr(info, raw)
    crafted = out.getvalue()
    (ck / entry["file"]).write_bytes(crafted)
    entry["bytes"], entry["sha256"] = len(crafted), hashlib.sha256(crafted).hexdigest()
    (ck / "metadata.json").write_bytes(encode_metadata(meta))
    return ck / entry["file"], len(crafted)


BOMB = r'''
import json, resource, sys
sys.path.insert(0, %(tests)r)
import torch
from test_checkpoint_guards import _small_single
from zerolab import checkpoint
engine = _small_single(seed=1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
said = []
for call in (lambda: checkpoint.load(engine, %(ck)r), lambda: checkpoint.consolidate(%(ck)r)):
    try:
        call()
        said.append("ACCEPTED")
    except checkpoint.CheckpointError as e:
        said.append(str(e))
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
print(json.dumps({"said": said, "grew": grew}))
'''


def test_a_small_shard_declaring_2_gib_in_extra_is_refused_uninflated(saved, tmp_path):
    # before: the 2 MB shard passed the size and hash checks and torch.load inflated it: load and
    # consolidate peaked at 2.3 GB and load handed the 2 GiB tensor back
    shard, size = _craft_extra_bomb(saved)
    assert size < 8 << 20
    script = tmp_path / "bomb.py"
    script.write_text(BOMB % {"tests": os.path.dirname(__file__), "ck": str(saved)})
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # the process read the 2 MB file (twice: load, consolidate) and its zip directory, nothing
    # inflated: its peak resident set grew by far less than the 2 GiB it declares
    assert result["grew"] < 64 << 20, f"{result['grew'] / 2**20:.0f} MiB"
    for said in result["said"]:
        assert said.startswith(f"{shard}: would inflate to 2,147,") and "allows at most" in said, said


def test_extra_is_bounded_when_saved(tmp_path):
    engine = _small_single()
    with pytest.raises(checkpoint.CheckpointError, match=r"extra holds 16.0 MiB of tensors .* at most 16 MiB and 1 MiB"):
        checkpoint.save(engine, tmp_path / "a", extra={"big": torch.zeros((16 << 20) // 4 + 1)})
    with pytest.raises(checkpoint.CheckpointError, match="MiB of other values; at most"):
        checkpoint.save(engine, tmp_path / "b", extra={"list": list(range(300_000))})
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
    checkpoint.save(engine, tmp_path / "c", extra={"fine": torch.zeros(1000), "step": 3})
    assert checkpoint.load(_small_single(1), tmp_path / "c")["step"] == 3
