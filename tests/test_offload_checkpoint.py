"""zl.checkpoint with offload="disk": a checkpoint that points at the engine's own files.

The references are independent of the linked format: the same engine without offload, whose
checkpoints hold every value inside their .pt files, and the uninterrupted run. (offload="disk"
equals that engine bit for bit: tests/test_offload.py.)

* format: a disk engine's checkpoint holds its masters and optimizer state in the offload files
  themselves, hard-linked (os.path.samefile at save time), and its .pt files hold none of it;
* the linked bytes are the save's: after two more steps have rewritten every offload file,
  consolidate() of the disk checkpoint equals the in-memory engine's checkpoint, torch.equal;
* another world size or stage: one process, and ZeRO-2 (whose pieces start inside the saved
  ones), load the disk checkpoint as they load the in-memory one;
* another file system (os.link fails with EXDEV): the files are copied, and load the same;
* resume: a fresh disk engine, a fresh in-memory engine, and a disk engine loading the
  in-memory checkpoint all continue bit for bit as the uninterrupted run, in bf16 with a frozen
  parameter (its shard is linked in bf16) and in fp32 with two parameter groups (the optimizer
  holds views of the masters, with state per view);
* memory: saving and loading the GPT at 4x a memory budget grows the resident set by less than
  the budget (the whole model was paged in for both before);
* engine.load_state_dict(), a unit at a time, then a step: as the engine in memory;
* damage: a linked file that changed, or is missing, is refused by name before anything loads.

One launch at N = 2 runs every case.
"""

import errno
import os
import shutil
import tempfile
from functools import lru_cache, partial

import pytest
import torch
import torch.distributed as dist

import zerolab as zl

from helpers import PARITY_ADAMW
from zerolab import checkpoint
from zerolab.book.offload_demo import checkpoint_worker
from zerolab.checkpoint.reader import CheckpointError
from zerolab.data import CharDataset
from zerolab.models import GPT, gpt_config, gpt_loss

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

OPT = PARITY_ADAMW


def grouped(params):
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=1e-3, eps=1e-6)


CASES = {"bf16, frozen": dict(precision="bf16", opt=OPT, freeze=True),
         "fp32, groups": dict(precision="fp32", opt=grouped, freeze=False)}


def engine(case, offload_dir=None, stage=3):
    torch.manual_seed(0)
    model = GPT(gpt_config("nano", bias=False))
    if case["freeze"]:
        model.pos_emb.weight.requires_grad_(False)
    kw = {} if offload_dir is None else {"offload": "disk", "offload_dir": offload_dir}
    return zl.ZeRO(model, case["opt"], stage=stage, precision=case["precision"], **kw)


def steps(eng, first, last):
    rank, n = dist.get_rank(), dist.get_world_size()
    data = CharDataset(eng.module.cfg.block_size)
    for s in range(first, last):
        eng.backward(gpt_loss(eng, data.batch(s, 2, rank, n))[1])
        eng.step()
        eng.zero_grad()
    return eng.full_state_dict()


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def linked_files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".bin"))


def _no_link(code, src, dst):
    raise OSError(code, os.strerror(code))


def save_id(path):
    """The save id in a checkpoint's file names (shard-<steps>-<token>-...)."""
    return "-".join(linked_files(path)[0].split("-")[1:3])


def case_worker(root, name):
    case = CASES[name]
    rank = dist.get_rank()
    d = os.path.join(root, name.replace(", ", "-"))
    mem, disk = engine(case), engine(case, os.path.join(d, "offload"))
    steps(mem, 0, 2)
    steps(disk, 0, 2)
    checkpoint.save(mem, os.path.join(d, "ckpt-memory"))
    checkpoint.save(disk, os.path.join(d, "ckpt-disk"))
    ckpt = os.path.join(d, "ckpt-disk")
    mine = [f for f in linked_files(ckpt) if f.split("-")[3] == f"{rank:05d}"]
    # each linked file IS the offload file (same inode), not a copy of it
    links = [os.path.samefile(os.path.join(ckpt, f), os.path.join(disk.pager.directory, f.split("-", 4)[4]))
             for f in mine]
    if name == "bf16, frozen":          # another file system (no hard links): copies instead
        link, os.link = os.link, partial(_no_link, errno.EXDEV)
        try:
            checkpoint.save(disk, os.path.join(d, "ckpt-copied"))
        finally:
            os.link = link
        copied = os.path.join(d, "ckpt-copied")
        copies = (not any(os.path.samefile(os.path.join(copied, f), os.path.join(ckpt, f.replace(
            save_id(copied), save_id(ckpt)))) for f in linked_files(copied)))
    want = steps(mem, 2, 4)
    out = {"links": links, "copies": copies if name == "bf16, frozen" else True, "linked": [f.split("-", 4)[4] for f in mine],
           "uninterrupted disk": same(steps(disk, 2, 4), want)}
    # the disk checkpoint, after two more steps rewrote every offload file
    if rank == 0:
        out["consolidated"] = same(checkpoint.consolidate(ckpt), checkpoint.consolidate(os.path.join(d, "ckpt-memory")))
    loads = [("disk from disk", "ckpt-disk", "resumed"), ("memory from disk", "ckpt-disk", None),
             ("disk from memory", "ckpt-memory", "resumed2")]
    if name == "bf16, frozen":
        loads.append(("disk from a copy", "ckpt-copied", "resumed3"))
    for who, src, offload in loads:
        eng = engine(case, offload and os.path.join(d, offload))
        checkpoint.load(eng, os.path.join(d, src))
        out[who] = same(steps(eng, 2, 4), want)
    # ZeRO-2 cuts one flat buffer into other pieces: each is read from inside the saved ones
    zero2 = []
    for src in ("ckpt-disk", "ckpt-memory"):
        eng = engine(case, stage=2)
        checkpoint.load(eng, os.path.join(d, src))
        zero2.append(steps(eng, 2, 3))
    out["zero2"] = same(*zero2)
    # engine.load_state_dict (the model's weights only, optimizer fresh), a unit at a time
    sd = checkpoint.consolidate(os.path.join(d, "ckpt-memory"))
    after = []
    for offload in (None, "from-state-dict"):
        eng = engine(case, offload and os.path.join(d, offload))
        eng.load_state_dict(sd)
        after.append(steps(eng, 2, 3))
    out["load_state_dict"] = same(*after)
    return out


def worker(root):
    out = {name: case_worker(root, name) for name in CASES}
    out["memory"] = checkpoint_worker(os.path.join(root, "memory"))
    return out


ROOT = None


@lru_cache(maxsize=None)
def results():
    global ROOT
    ROOT = tempfile.mkdtemp(prefix="zl-offload-ckpt-")
    return zl.launch(worker, 2, args=(ROOT,))


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    if ROOT is not None:
        shutil.rmtree(ROOT, ignore_errors=True)


@pytest.mark.parametrize("name", CASES)
def test_a_disk_checkpoint_links_the_offload_files_and_copies_no_values(name):
    kinds = set()
    for r in results():
        c = r[name]
        assert c["links"] and all(c["links"]), "every linked file must be the offload file itself"
        assert c["copies"], "without hard links, the files must be copies"
        kinds |= {f.split(".")[1] for f in c["linked"]}
    # masters, Adam's moments (one file per key and parameter of the shard: opt0, opt1, ...) and
    # frozen shards
    assert {k for k in kinds if not k.startswith("opt")} == ({"master", "frozen"} if name == "bf16, frozen"
                                                            else {"master"}), kinds
    assert {"opt0", "opt1"} <= kinds, kinds
    # the .pt files say where the values are; they hold none (the in-memory one holds them all)
    ckpt = os.path.join(ROOT, name.replace(", ", "-"), "ckpt-disk")
    for f in os.listdir(ckpt):
        if f.endswith(".pt"):
            content = torch.load(os.path.join(ckpt, f), weights_only=True)
            for piece in content["pieces"]:
                assert all(isinstance(v, dict) for v in [piece["value"], *piece["state"].values()]), piece


@pytest.mark.parametrize("name", CASES)
def test_a_disk_checkpoint_keeps_the_saved_bytes_and_resumes_bit_for_bit(name):
    c0 = results()[0][name]
    assert c0["consolidated"], "the disk checkpoint must hold what the in-memory one holds"
    for r in results():
        c = r[name]
        assert c["uninterrupted disk"], "offload='disk' must equal the engine without it"
        assert c["zero2"], "ZeRO-2 must load the disk checkpoint as it loads the in-memory one"
        assert c["load_state_dict"], "engine.load_state_dict from disk must equal it in memory"
        for who in ("disk from disk", "memory from disk", "disk from memory", "disk from a copy"):
            assert c.get(who, True), f"{who}: the resumed run must equal the uninterrupted one bit for bit"


def test_saving_and_loading_a_model_four_times_the_budget_stays_under_it():
    """The GPT of 8 x 256 (6.3 M parameters, 50 MB of model states per rank) against a budget
    of a quarter of that: saving and loading it page one unit in at a time (before, both held
    every state at once and grew by more than the states)."""
    for r in results():
        m = r["memory"]
        budget = m["states"] / 4
        assert m["growth"]["save"] <= budget, (m["growth"], budget)
        assert m["growth"]["load"] <= budget, (m["growth"], budget)
        assert m["linked"] == m["files"] > 0
        assert m["losses"][0] == m["losses"][1], "the loaded engine must take the same next step"


def test_a_disk_checkpoint_loads_into_one_process_as_the_in_memory_one_does():
    """Another world size and engine: the pieces are cut differently, read from the files."""
    results()
    d = os.path.join(ROOT, "bf16-frozen")
    loaded = []
    for src in ("ckpt-disk", "ckpt-memory"):
        torch.manual_seed(1)
        model = GPT(gpt_config("nano", bias=False))
        model.pos_emb.weight.requires_grad_(False)
        eng = zl.SingleProcess(model, OPT, precision="bf16")
        checkpoint.load(eng, os.path.join(d, src))
        state = [v for s in eng.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        loaded.append((eng.full_state_dict(), state))
    assert same(loaded[0][0], loaded[1][0])
    assert len(loaded[0][1]) == len(loaded[1][1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(loaded[0][1], loaded[1][1]))


def test_a_changed_or_missing_linked_file_is_refused_by_name(tmp_path):
    results()
    src = os.path.join(ROOT, "bf16-frozen", "ckpt-disk")
    for damage in ("changed", "missing"):
        ckpt = tmp_path / damage
        shutil.copytree(src, ckpt)
        victim = ckpt / linked_files(ckpt)[0]
        if damage == "changed":
            data = bytearray(victim.read_bytes())
            data[5] ^= 1
            victim.write_bytes(bytes(data))
        else:
            victim.unlink()
        with pytest.raises(CheckpointError, match=f"{victim.name}.*{'SHA-256' if damage == 'changed' else 'missing'}"):
            checkpoint.consolidate(str(ckpt))
