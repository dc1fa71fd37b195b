"""The collective flight recorder names the first collective at which the ranks' sequences parted.

Each case makes the ranks diverge the way users' runs do (an extra micro-batch, a skipped
collective, a branch taken on one rank, ranks that disagree about skipping a step, a call made on
rank 0 only) and checks the error against an independent log: a wrapper around Ledger._run, set
up in the worker, appends every collective's operation, tag and the line of this file that led to
it (from Python's own stack) to a file, and the test finds the first place where the ranks' logs
differ. `python -m zerolab doctor` must say the same from the records the run left.
"""

import functools
import inspect
import json
import os
import subprocess
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab import bench
from zerolab.runtime import doctor, recorder
from zerolab.runtime.comm import Ledger

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

SGD = functools.partial(torch.optim.SGD, lr=0.1)
HERE = os.path.basename(__file__)


def _log_collectives(path):
    """Log every collective this rank enters through any Ledger (a group of more than one rank):
    [op, tag, the line of this file that led to it], read from the stack, not from the recorder.
    (A profile hook, not a wrapper: a wrapper here would be the first frame outside zerolab.)"""
    code = Ledger._run.__code__

    def hook(frame, event, arg):
        if event == "call" and frame.f_code is code:
            args = frame.f_locals
            group = args["self"].group if args["group"] is None else args["group"]
            if dist.get_world_size(group) > 1:
                line = next(f.lineno for f in reversed(traceback.extract_stack(frame)) if f.filename == __file__)
                with open(path, "a") as f:
                    f.write(json.dumps([args["op"], args["tag"], line]) + "\n")
    sys.setprofile(hook)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


class Branchy(torch.nn.Module):
    """A model whose `extra` layer runs only when the caller asks for it (a conditional parameter)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
        self.extra = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x, branch=False):
        for b in self.blocks:
            x = b(x)
        if branch:
            x = self.extra(x)
        return self.head(x)


def diverging(case, root):
    r = dist.get_rank()
    os.environ[recorder.DIR_ENV] = os.path.join(root, "records")
    _log_collectives(os.path.join(root, f"log{r}.jsonl"))
    torch.manual_seed(r)
    if case == "extra micro-batch":         # rank 1 counted one more micro-batch in its shard
        eng = zl.ZeRO(mlp(), SGD, stage=2)
        for step in range(3):
            micro = 3 if (r == 1 and step == 1) else 2
            for _ in range(micro):
                eng.backward(eng(torch.randn(4, 8)).pow(2).mean() / micro)
            eng.step()
            eng.zero_grad()
    elif case == "skipped collective":      # rank 1 does not average its loss for the log at step 1
        eng = zl.ZeRO(mlp(), SGD, stage=1)
        for step in range(3):
            loss = eng(torch.randn(4, 8)).pow(2).mean()
            eng.backward(loss)
            eng.step()
            eng.zero_grad()
            if not (r == 1 and step == 1):
                eng.comm.all_reduce(loss.detach().clone(), tag="loss")
    elif case == "conditional parameter":   # the branch is taken on rank 0 only, at step 1
        eng = zl.ZeRO(Branchy(), SGD, stage=3, units=["blocks.0", "blocks.1", "extra"])
        for step in range(3):
            out = eng(torch.randn(4, 8), branch=(r == 0 and step == 1))
            eng.backward(out.pow(2).mean())
            eng.step()
            eng.zero_grad()
    elif case == "skipping a step":         # rank 0 alone finds its loss too large and skips
        eng = zl.ZeRO(mlp(), SGD, stage=2)
        for step in range(3):
            loss = eng(torch.randn(4, 8)).pow(2).mean()
            eng.backward(loss)
            if not (r == 0 and step == 1):
                eng.step()
            eng.zero_grad()
    return "never"


def _logs(root):
    out = []
    for r in (0, 1):
        with open(os.path.join(root, f"log{r}.jsonl")) as f:
            out.append([json.loads(line) for line in f])
    return out


def _named(op, tag, line):
    return f"{op}{f' {tag!r}' if tag else ''} ({HERE}:{line})"


def _first_parting(logs, by_line=False):
    """The words for the first place where the ranks' logs differ (op and tag; or the line too)."""
    key = (lambda e: tuple(e)) if by_line else (lambda e: tuple(e[:2]))
    for i, (a, b) in enumerate(zip(*logs)):
        if key(a) != key(b):
            return f"collective #{i + 1}: rank 0 {_named(*a)}, rank 1 {_named(*b)}"
    raise AssertionError(f"the logs never differ: {logs}")


def _doctor(root, capsys=None):
    """What `python -m zerolab doctor DIR` prints: in a new interpreter, as a user types it, or
    (capsys given) the same command line's main() in this process, without starting Python again."""
    if capsys is None:
        out = subprocess.run([sys.executable, "-m", "zerolab", "doctor", os.path.join(root, "records")],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout
    from zerolab.__main__ import main
    capsys.readouterr()
    assert main(["doctor", os.path.join(root, "records")]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("case", ["extra micro-batch", "skipped collective", "conditional parameter",
                                  "skipping a step"])
def test_the_first_divergent_collective_is_named_at_once(case, tmp_path, capsys):
    start = time.monotonic()
    with pytest.raises(zl.LaunchError) as info:
        zl.launch(diverging, 2, args=(case, str(tmp_path)), collective_timeout=120, output="none")
    took = time.monotonic() - start
    message = str(info.value)
    parted = _first_parting(_logs(tmp_path))
    assert f"The ranks' sequences parted at {parted}." in message, (parted, message[-2000:])
    assert "CollectiveMismatch" in message, message[-2000:]
    assert took < 60, f"{took:.0f} s: named at the collective timeout (120 s), not when the ranks parted"
    # the command in a new interpreter once; in this process for the other cases
    doctor_says = _doctor(tmp_path, None if case == "extra micro-batch" else capsys)
    assert f"The ranks' sequences parted at {parted}." in doctor_says


def rank_0_only(call, root):
    """Train ZeRO-3; at step 1 rank 0 alone samples from the model (or takes full_state_dict())
    while rank 1 goes on training, as a script that prints a sample from rank 0 does."""
    r = dist.get_rank()
    os.environ[recorder.DIR_ENV] = os.path.join(root, "records")
    _log_collectives(os.path.join(root, f"log{r}.jsonl"))
    cfg = zl.models.gpt_config("nano")
    torch.manual_seed(0)
    eng = zl.ZeRO(zl.models.GPT(cfg), SGD, stage=3)
    data = zl.data.CharDataset(cfg.block_size, seed=0)
    for step in range(4):
        _, loss = zl.models.gpt_loss(eng, data.batch(step, 2, r, 2))
        eng.backward(loss)
        eng.step()
        eng.zero_grad()
        if step == 1 and r == 0:
            with open(os.path.join(root, "t0"), "w") as f:
                f.write(repr(time.time()))
            if call == "sample":
                with torch.no_grad():
                    eng(torch.zeros(1, 4, dtype=torch.long))
            else:
                eng.full_state_dict()
    return "never"


@pytest.mark.parametrize("call", ["sample", "full_state_dict"])
def test_a_collective_entered_by_rank_0_only_is_named_in_seconds(call, tmp_path, capsys):
    # before, it waited for the whole collective timeout (300 s by default), or gloo aborted the
    # process on the first message whose size did not match ("Received data size doesn't match")
    with pytest.raises(zl.LaunchError) as info:
        zl.launch(rank_0_only, 2, args=(call, str(tmp_path)), collective_timeout=120, output="none")
    took = time.time() - float((tmp_path / "t0").read_text())
    message = str(info.value)
    logs = _logs(tmp_path)
    # the rank-0-only call and where rank 1 was: the first place where the lines differ ...
    first = _first_parting(logs, by_line=True)
    assert first in message, (first, message[-2500:])
    assert f"rank 0 all_gather 'gather:root' ({HERE}:" in first or f"rank 0 all_gather 'state' ({HERE}:" in first
    # ... and the first where the collectives themselves differ
    assert f"The ranks' sequences parted at {_first_parting(logs)}." in message, message[-2500:]
    assert took < 10, f"{took:.1f} s after the rank-0-only call (collective timeout 120 s)"
    assert first in _doctor(tmp_path, capsys)


def published_records(root):
    """Two ranks that see no file of the other (as on two machines): each its own record directory."""
    r = dist.get_rank()
    os.environ[recorder.DIR_ENV] = os.path.join(root, f"machine{r}")
    ledger = Ledger()
    t = torch.ones(4)
    ledger.all_reduce(t, tag="same")
    if r == 0:
        ledger.all_reduce(t, tag="clip")
    else:
        ledger.broadcast(t, src=1, tag="other")
    return "never"


def test_ranks_on_other_machines_publish_their_records_when_a_collective_fails(tmp_path):
    with pytest.raises(zl.LaunchError) as info:
        zl.launch(published_records, 2, args=(str(tmp_path),), collective_timeout=3.0, output="none")
    message = str(info.value)
    assert "did not complete within 3 s" in message, message[-2000:]
    assert ("rank 1 (in a different collective, #2 broadcast 'other')" in message
            or "rank 0 (in a different collective, #2 all_reduce 'clip')" in message), message[-2000:]
    lines, first = inspect.getsourcelines(published_records)
    clip, other = (first + next(i for i, l in enumerate(lines) if w in l) for w in ('tag="clip"', 'tag="other"'))
    assert (f"The ranks' sequences parted at collective #2: rank 0 all_reduce 'clip' ({HERE}:{clip}), "
            f"rank 1 broadcast 'other' ({HERE}:{other})") in message, message[-2000:]


def test_the_recorder_reads_back_what_it_wrote_and_finds_the_parting():
    """No processes: two records written by hand, compared (a parting, a rank that stopped early,
    the same collectives from different lines)."""
    def entry(i, op, tag, site, seq=None):
        return recorder.Entry(i, i if seq is None else seq, 64, 0.0, 2, True, 16, op, "float32", "0", tag, "16", site)

    def record(rank, entries):
        return recorder.RankRecord(rank, 2, 1, "host", "run", 0, len(entries), entries)

    same = [entry(1, "all_reduce", "a", "t.py:1"), entry(2, "all_gather", "b", "t.py:2")]
    a = record(0, same + [entry(3, "all_reduce", "c", "t.py:3")])
    b = record(1, same + [entry(3, "reduce_scatter", "c", "t.py:9")])
    hard, soft = doctor.parting({0: a, 1: b})
    assert (hard.seq, soft) == (3, None)
    assert str(hard) == "collective #3: rank 0 all_reduce 'c' (t.py:3), rank 1 reduce_scatter 'c' (t.py:9)"
    early = record(1, same[:1])
    assert doctor.parting({0: a, 1: early}) == (None, None)      # stopped early: not parted
    moved = record(1, [same[0], entry(2, "all_gather", "b", "u.py:7"), entry(3, "reduce_scatter", "c", "t.py:9")])
    hard, soft = doctor.parting({0: a, 1: moved})
    assert (hard.seq, soft.seq) == (3, 2) and "rank 1 all_gather 'b' (u.py:7)" in str(soft)


def test_the_instruments_overhead_is_measured_for_every_collective_and_instrument():
    m = bench.measure_overhead(world_size=2, numel=16, calls=5, rounds=2)
    assert set(m["per_op"]) == {"all_reduce", "reduce_scatter", "all_gather"}
    for rows in m["per_op"].values():
        assert set(rows) == {"collective", "ledger", "+ recorder", "+ watchdog"}
        assert all(len(v) == 2 for v in rows.values()) and min(rows["collective"]) > 0
    line = bench.format_overhead(m)
    assert line.startswith("zerolab's instruments per collective (2 ranks, gloo, 64 bytes") and " us in all" in line
