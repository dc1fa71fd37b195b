"""A checkpoint verified end to end: a seeded fuzz over its metadata and its shards.

Two kinds of mutation, each applied to a pristine copy of one checkpoint (a SingleProcess fp16
engine over a model with tied, frozen and unused weights and BatchNorm buffers, so that every
field a checkpoint can hold is there: optimizer state and scalars, the loss scaler, RNG states,
float and int buffers, tied keys):

* corruption: the files changed and nothing re-recorded (a flipped byte, a JSON field swapped,
  deleted or retyped, a shard cut short or grown). The only outcomes allowed: a CheckpointError
  before anything in the engine changed, or a load equal to the original; consolidate equals the
  original or raises. (Before the metadata had a digest, 37 of 500 such mutations changed
  consolidate's output silently, and deep nesting raised RecursionError.)
* crafting: the content changed AND every size and SHA-256 re-recorded, as an attacker or a
  buggy tool would. No digest can catch these; the load must still check every field before it
  changes anything: the outcomes allowed are a CheckpointError before any change, or a load after
  which a training step runs (no raw KeyError at the first step, no lr of -5 taken).

Nothing may raise anything but CheckpointError. The reference for "unchanged" and "equal" is a
snapshot of an engine taken independently of the checkpoint code: its state_dict, optimizer
state and loss scale.
"""

import copy
import hashlib
import io
import json
import math
import os
import random
import shutil
from functools import partial

import pytest
import torch

import zerolab as zl
from zerolab import checkpoint
from zerolab.checkpoint.files import encode_metadata, seal
from zerolab.checkpoint.reader import CheckpointError
from zerolab.models import AwkwardModel

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

CASES = 60           # per family: about a second each


class WithBuffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.awk = AwkwardModel()
        self.norm = torch.nn.BatchNorm1d(5)     # float buffers and an int64 one

    def forward(self, x):
        return self.norm(self.awk(x))


def build(seed=0):
    torch.manual_seed(seed)
    return zl.SingleProcess(WithBuffers(), partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
                            precision="fp16")


def train(engine, steps=2):
    for _ in range(steps):
        engine.backward(engine(torch.randn(6, 13)).float().pow(2).mean())
        engine.step()
        engine.zero_grad()


def snapshot(engine):
    opt = engine.optimizer.state_dict()
    return ({k: v.clone() for k, v in engine.state_dict().items()}, repr(opt["param_groups"]),
            [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for s in opt["state"].values()],
            engine.steps, repr(engine.precision.state_dict()))


def same(a, b):
    def eq(x, y):
        if torch.is_tensor(x):
            return torch.is_tensor(y) and x.shape == y.shape and torch.equal(x, y)
        return x == y
    return (a[0].keys() == b[0].keys() and all(eq(a[0][k], b[0][k]) for k in a[0]) and a[1] == b[1]
            and len(a[2]) == len(b[2]) and all(x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
                                               for x, y in zip(a[2], b[2])) and a[3:] == b[3:])


def same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("mutations")
    path = str(root / "pristine")
    engine = build()
    train(engine)
    checkpoint.save(engine, path, extra={"data_step": 2})
    fresh = build(seed=1)
    checkpoint.load(fresh, path)
    return path, snapshot(fresh), checkpoint.consolidate(path), str(root)


def copy_of(pristine, name):
    path, _, _, root = pristine
    target = os.path.join(root, name)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(path, target)
    return target


def outcome(path, loaded, consolidated, crafted):
    """Load into a fresh engine and consolidate; assert that the outcome is one allowed."""
    engine = build(seed=1)
    before = snapshot(engine)
    try:
        checkpoint.load(engine, path)
    except CheckpointError:
        assert same(before, snapshot(engine)), "a refused load changed the engine"
        load = "refused"
    else:
        if crafted:
            train(engine, 1)                 # whatever was taken, the next step runs
            load = "taken"
        else:
            assert same(loaded, snapshot(engine)), "a corrupted checkpoint loaded as something else"
            load = "equal"
    try:
        state = checkpoint.consolidate(path)
    except CheckpointError:
        return load, "refused"
    if not crafted:
        assert same_state(consolidated, state), "a corrupted checkpoint consolidated as something else"
    return load, "returned"


# ------------------------------------------------------------------ mutating JSON and tensors


def _somewhere(tree, rng):
    """A random place in the tree: down a random child at each level, stopping on the way now
    and then (so that the 625 numbers of the Python RNG state do not crowd out everything else)."""
    at, node = (), tree
    while isinstance(node, (dict, list)) and node and (not at or rng.random() < 0.7):
        key = rng.choice(list(node) if isinstance(node, dict) else range(len(node)))
        at, node = at + (key,), node[key]
    return at


def _replacement(rng, old):
    nested = []
    for _ in range(rng.choice([3, 50, 200])):   # (json.dumps and torch.save stop a few hundred deeper)
        nested = [nested]
    choices = [None, True, -1, 0, 2**70, -5.0, 1e308, "x", "", [], {}, nested, "../../etc/passwd",
               "a" * 65, [0, 1], {"a": 1}]
    if isinstance(old, bool):
        choices.append(not old)
    elif isinstance(old, (int, float)):
        choices += [old + 1, old - 1, -old, old * 2, float(old)]
    elif isinstance(old, str):
        choices += [old[::-1], old + "0", old.upper()]
    elif torch.is_tensor(old):
        choices += [old.double(), old.to(torch.int64), old.flatten()[:1], old + 1, torch.full_like(old, float("nan"))
                    if old.is_floating_point() else old + 2, torch.zeros(0)]
    return rng.choice(choices)


def _lists(node):
    """The tree with its tuples as lists (the Python RNG state, betas), so that they can change."""
    if isinstance(node, dict):
        return {k: _lists(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_lists(v) for v in node]
    return node


def mutate(tree, rng):
    """One random change anywhere in the tree: replace, delete, swap two siblings, duplicate."""
    tree = _lists(tree)
    at = _somewhere(tree, rng)
    parent = tree
    for k in at[:-1]:
        parent = parent[k]
    key = at[-1]
    op = rng.choice(["replace", "replace", "delete", "swap", "duplicate"])
    if op == "delete":
        del parent[key]
    elif op == "swap" and len(parent) > 1:
        other = rng.choice([k for k in (parent if isinstance(parent, dict) else range(len(parent))) if k != key])
        parent[key], parent[other] = parent[other], parent[key]
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(parent[key]))
    else:
        parent[key] = _replacement(rng, parent[key])
    mutate.last = (op, at)      # named in a failing assertion's message
    return tree


def read_meta(path):
    with open(os.path.join(path, "metadata.json")) as f:
        return json.load(f)


def write_meta(path, meta, digest):
    text = encode_metadata(meta).decode() if digest else json.dumps(meta)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        f.write(text)


def rewrite_shard(path, change, rank=0):
    """Apply change(content) to a shard and re-record its size, hash and the metadata's digest."""
    meta = read_meta(path)
    entry = meta["shards"][rank]
    content = torch.load(os.path.join(path, entry["file"]), weights_only=True)
    content = change(content)
    buf = io.BytesIO()
    torch.save(content, buf)
    data = buf.getvalue()
    with open(os.path.join(path, entry["file"]), "wb") as f:
        f.write(data)
    entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    write_meta(path, meta, digest=True)


# ------------------------------------------------------------------ the fuzz


@pytest.mark.parametrize("crafted", [False, True], ids=["corrupted", "crafted"])
def test_any_change_to_the_metadata_is_refused_or_harmless(pristine, crafted):
    _, loaded, consolidated, _ = pristine
    rng = random.Random(1 if crafted else 0)
    seen = {}
    for i in range(CASES):
        path = copy_of(pristine, "meta")
        meta = mutate(read_meta(path), rng)
        write_meta(path, meta, digest=crafted)
        result = outcome(path, loaded, consolidated, crafted)
        seen[result] = seen.get(result, 0) + 1
    assert seen.get(("refused", "refused"), 0) >= CASES // 2, seen


@pytest.mark.parametrize("crafted", [False, True], ids=["corrupted", "crafted"])
def test_any_change_to_a_shard_is_refused_or_harmless(pristine, crafted):
    _, loaded, consolidated, _ = pristine
    rng = random.Random(3 if crafted else 2)
    seen = {}
    for i in range(CASES):
        path = copy_of(pristine, "shard")
        shard = os.path.join(path, read_meta(path)["shards"][0]["file"])
        if crafted:
            rewrite_shard(path, lambda content: mutate(content, rng))
        else:
            with open(shard, "rb") as f:
                raw = bytearray(f.read())
            how = rng.choice(["flip", "cut", "grow"])
            if how == "flip":
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
            elif how == "cut":
                raw = raw[:rng.randrange(len(raw))]
            else:
                raw += b"\0" * rng.randrange(1, 100)
            with open(shard, "wb") as f:
                f.write(bytes(raw))
        result = outcome(path, loaded, consolidated, crafted)
        seen[result] = seen.get(result, 0) + 1
        if not crafted:
            assert result == ("refused", "refused"), "a changed shard must be refused"
    assert sum(n for (load, _), n in seen.items() if load == "refused") >= CASES // 2, seen


# ------------------------------------------------------------------ the crafted cases of issue 34


def _set(*path_and_value):
    *at, value = path_and_value

    def change(content):
        node = content
        for k in at[:-1]:
            node = node[k]
        if value is _DELETE:
            del node[at[-1]]
        else:
            node[at[-1]] = value
        return content
    return change


_DELETE = object()
TRAINED = 0      # the index of the first piece with optimizer state (the encoder's weight)


@pytest.mark.parametrize("change, words", [
    (_set("param_groups", 0, "lr", -5.0), "param_groups[0]['lr'] = -5.0: must be in [0, inf]"),
    (_set("param_groups", 0, "maximize", True), "the engine's optimizer has maximize=False"),
    (_set("param_groups", 0, "betas", (0.9, 1.5)), "param_groups[0]['betas']"),
    (_set("param_groups", 0, "weight_decay", float("nan")), "must be a finite number"),
    (_set("pieces", TRAINED, "state", "exp_avg", _DELETE), "a step of AdamW needs ['exp_avg', 'exp_avg_sq', 'step']"),
    (_set("pieces", TRAINED, "scalars", "step", torch.tensor(-1.0)), "'step' of 'awk.encoder.weight' = tensor(-1.): must be a whole number >= 0"),
    (_set("pieces", TRAINED, "scalars", "step", "x"), "must be a torch.float32 tensor"),
    (_set("precision", "scaler", "growth_factor", 0.5), "the loss scaler's state is not valid"),
    (_set("precision", "scaler", "good_steps", -3), "the loss scaler's state is not valid"),
    (_set("rng", "python", (3, (1, 2, 3), None)), "the RNG states are not valid"),
    (_set("buffers", "norm.running_mean", torch.zeros(7)), "buffer 'norm.running_mean' is not the shape or dtype recorded"),
    (_set("buffers", "norm.num_batches_tracked", torch.tensor(2.0)), "'norm.num_batches_tracked' is not the shape or dtype"),
    (_set("pieces", TRAINED, "value", torch.zeros(91, dtype=torch.int64)), "holds tensors of the wrong size or kind"),
    (_set("steps", 7), "steps 7, the metadata records 2"),
])
def test_a_crafted_shard_is_refused_before_anything_changes(pristine, change, words):
    # each of these loaded (or raised a raw error, some after overwriting 29 of 29 parameters)
    path = copy_of(pristine, "crafted")
    rewrite_shard(path, change)
    engine = build(seed=1)
    before = snapshot(engine)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(engine, path)
    assert words in str(info.value), str(info.value)
    # the file that holds the bad value is named: the shard (before: metadata.json for the
    # hyperparameters, the optimizer state, the loss scaler and the RNG states)
    shard = os.path.join(path, read_meta(path)["shards"][0]["file"])
    assert str(info.value).startswith(f"{shard}: "), str(info.value)
    assert same(before, snapshot(engine)), "the refused load changed the engine"


@pytest.mark.parametrize("change, words, inconsistent", [
    # two of the state_dict's keys swapped, one deleted: consolidate wrote 28 tensors, two swapped
    (lambda m: m["keys"].update({"norm.weight": "norm.bias", "norm.bias": "norm.weight"}),
     "a parameter's or buffer's own key must name itself", True),
    (lambda m: m["keys"].pop("awk.head.bias"), "have no key", True),
    (lambda m: m["buffers"].pop("norm.running_var"), "is neither a parameter nor a buffer", True),
    (lambda m: m["shards"][0]["pieces"].append(["awk.head.bias", 0, 2]), "not the pieces the metadata lists", True),
    (lambda m: m["shards"][0].update(rank=1), "shards must be listed in rank order", True),
    # consistent with itself: only the model that loads it can tell (consolidate has no model)
    (lambda m: m["params"]["awk.head.weight"].update(shape=[13, 5]), "'awk.head.weight' has shape [5, 13]", False),
])
def test_crafted_metadata_is_refused_by_load_and_consolidate(pristine, change, words, inconsistent):
    path = copy_of(pristine, "crafted-meta")
    meta = read_meta(path)
    change(meta)
    write_meta(path, meta, digest=True)
    engine = build(seed=1)
    before = snapshot(engine)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(engine, path)
    assert same(before, snapshot(engine))
    assert words in str(info.value), str(info.value)
    if inconsistent:
        with pytest.raises(CheckpointError) as info:
            checkpoint.consolidate(path)
        assert words in str(info.value), str(info.value)
    # and without the digest re-recorded, the digest itself refuses it
    stale = bytearray(encode_metadata(read_meta(path)))
    stale[-68:-4] = b"0" * 64          # the seal's digest, not re-recorded
    with open(os.path.join(path, "metadata.json"), "wb") as f:
        f.write(stale)
    with pytest.raises(CheckpointError, match="its SHA-256 does not match its contents"):
        checkpoint.consolidate(path)


def test_a_metadata_nested_too_deeply_is_a_checkpoint_error(pristine):
    path = copy_of(pristine, "deep")
    with open(os.path.join(path, "metadata.json"), "wb") as f:     # sealed: the digest passes
        f.write(seal(b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"))
    with pytest.raises(CheckpointError, match="nested too deeply"):
        checkpoint.consolidate(path)
    assert math.isfinite(1.0)


# ------------------------------------------------------------------ files that are not regular files

SPECIAL = r'''
import json, os, resource, shutil, signal, sys
sys.path.insert(0, %(tests)r)
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))   # without the fix /dev/zero fills memory
from test_checkpoint_mutations import build, train, read_meta, write_meta
from zerolab import checkpoint
from zerolab.checkpoint.reader import CheckpointError

def out_of_time(*_):
    raise TimeoutError("still reading after 20 s")
signal.signal(signal.SIGALRM, out_of_time)

root = %(root)r
pristine = os.path.join(root, "pristine")
engine = build()
train(engine)
checkpoint.save(engine, pristine)

def shard(path):
    return os.path.join(path, read_meta(path)["shards"][0]["file"])

def link_to(target):
    def change(path, f):
        os.remove(f)
        os.symlink(target, f)
    return change

def fifo(path, f):
    os.remove(f)
    os.mkfifo(f)

def directory(path, f):
    os.remove(f)
    os.mkdir(f)

def outside_copy(path, f):
    copy = os.path.join(root, "identical-copy-outside.pt")
    shutil.copyfile(f, copy)
    os.remove(f)
    os.symlink(copy, f)

def linked_bin_to_dev_zero(path, f):
    # an offload="disk" checkpoint's linked file (crafted into the metadata), pointing at /dev/zero
    meta = read_meta(path)
    meta["shards"][0]["files"] = [{"file": "shard-x-unit0.master.bin", "bytes": 400, "sha256": "0" * 64}]
    write_meta(path, meta, digest=True)
    os.symlink("/dev/zero", os.path.join(path, "shard-x-unit0.master.bin"))

cases = {"shard -> /dev/zero": (shard, link_to("/dev/zero")),
         "metadata -> /dev/zero": (lambda p: os.path.join(p, "metadata.json"), link_to("/dev/zero")),
         "shard is a FIFO": (shard, fifo),
         "shard is a directory": (shard, directory),
         "shard -> an identical copy outside": (shard, outside_copy),
         "linked .bin -> /dev/zero": (shard, linked_bin_to_dev_zero)}
results = {}
for name, (which, change) in cases.items():
    path = os.path.join(root, "case")
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(pristine, path)
    change(path, which(path))
    said = []
    for call in (lambda: checkpoint.load(build(seed=1), path), lambda: checkpoint.consolidate(path)):
        signal.alarm(20)
        try:
            call()
            said.append("ACCEPTED")
        except CheckpointError as e:
            said.append("CheckpointError: " + str(e))
        except BaseException as e:
            said.append("RAW %%s: %%s" %% (type(e).__name__, str(e)[:200]))
        finally:
            signal.alarm(0)
    results[name] = said
print(json.dumps(results))
'''


def test_special_files_in_a_checkpoint_are_refused_at_once(tmp_path):
    """Only regular files inside the directory are read. Before: /dev/zero was read until memory
    ran out (9-44 s), a FIFO hung, a directory raised IsADirectoryError, a linked offload file
    on /dev/zero hung in file_digest, and a symbolic link to an identical shard was accepted."""
    import subprocess
    import sys
    script = tmp_path / "special.py"
    script.write_text(SPECIAL % {"tests": os.path.dirname(__file__), "root": str(tmp_path)})
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    words = {"shard -> /dev/zero": "is a symbolic link", "metadata -> /dev/zero": "is a symbolic link",
             "shard is a FIFO": "is a FIFO", "shard is a directory": "is a directory",
             "shard -> an identical copy outside": "is a symbolic link",
             "linked .bin -> /dev/zero": "is a symbolic link"}
    for name, said in results.items():
        for outcome_ in said:
            assert outcome_.startswith("CheckpointError") and words[name] in outcome_, (name, said)


def test_a_file_larger_than_recorded_is_not_read(pristine):
    # a 1 GiB metadata.json (sparse: it costs no disk) is refused without being read
    path = copy_of(pristine, "huge")
    with open(os.path.join(path, "metadata.json"), "wb") as f:
        f.truncate(1 << 30)

    def bytes_read():                       # by this process's read() calls, all files together
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])
    before = bytes_read()
    with pytest.raises(CheckpointError, match="larger than any checkpoint metadata"):
        checkpoint.consolidate(path)
    assert bytes_read() - before < 1 << 20
