"""python -m zerolab train: a whole run from the shell, plain and under torchrun."""

import os
import socket
import subprocess
import sys

import pytest


def _run(args, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, env=env, **kw)


def _losses(stdout):
    line = next(l for l in stdout.splitlines() if l.strip().startswith("loss:"))
    first, last = line.split("first")[1].split(", last")
    return float(first), float(last.split(",")[0])


def test_train_reports_and_plots(tmp_path):
    png = tmp_path / "loss.png"
    out = _run(["-m", "zerolab", "train", "--world-size", "2", "--steps", "4", "--size", "nano",
                "--plot", str(png), "--no-progress"])
    assert out.returncode == 0, out.stderr
    text = out.stdout
    # no --strategy with 2 ranks: data parallel, as torchrun users expect (never 2 unrelated runs)
    assert "strategy=ddp" in text and "world size 2" in text and "tokens/s" in text
    rows = [l.split() for l in text.splitlines() if l.strip()[:1].isdigit() and "MiB" in l]
    assert [r[0] for r in rows] == ["0", "1"], "one memory line per rank"
    first, last = _losses(text)
    assert last < first, "four AdamW steps on the corpus lower the loss"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, words", [
    (["--strategy", "zero9"], "invalid choice: 'zero9'"),
    (["--size", "huge"], "invalid choice: 'huge'"),
    (["--precision", "fp64"], "invalid choice: 'fp64'"),
    (["--steps", "0"], "steps must be >= 1"),
    (["--lr", "inf"], "lr must be a finite number > 0"),
    (["--lr", "nan"], "lr must be a finite number > 0"),
    (["--bucket-mb", "0"], "bucket_mb must be a finite number > 0"),
    (["--seed", "-1"], "seed must be an int in [0, 2**63)"),
    (["--collective-timeout", "inf"], "collective_timeout must be a finite number"),
    (["--timeout", "-5"], "timeout must be a finite number"),
])
def test_train_rejects_bad_arguments_with_usage(args, words, capsys):
    from zerolab.__main__ import main
    try:
        code = main(["train", *args, "--no-progress"])
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert words in err and ("usage:" in err or "zerolab train: error" in err)


def _train_planning_more_steps_on_rank_1():
    import zerolab as zl
    from zerolab.train import TrainConfig, train_worker
    cfg = TrainConfig(size="nano", strategy="zero2", steps=3 + zl.rank(), world_size=2).check()
    try:
        train_worker(cfg)
    except ValueError as e:
        return str(e)
    return "trained"


def test_ranks_planning_different_runs_stop_before_training():
    # under torchrun each node parses its own command line: a node given --steps 4 would wait
    # at step 3's collectives for ranks that already finished
    import zerolab as zl
    messages = zl.launch(_train_planning_more_steps_on_rank_1, 2)
    for message in messages:   # the same words on every rank, whichever the launcher shows
        assert message.startswith("the ranks' training plans differ: #3 is steps = 4 on rank 1, "
                                  "steps = 3 on rank 0"), messages


def test_train_under_torchrun(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(port), "-m", "zerolab", "train", "--steps", "3", "--size", "nano",
                "--plot", str(tmp_path / "l.png"), "--no-progress"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("zerolab train:") == 1, "only rank 0 prints the report"
    assert "world size 2" in out.stdout


def test_killed_run_resumes_bit_exact_and_consolidates(tmp_path):
    """A rank SIGKILLed at step 3 ends the job naming it; --resume from the step-2 checkpoint
    finishes the run exactly as the run that never stopped; consolidate writes one state dict."""
    import torch

    from zerolab.__main__ import main
    common = ["-m", "zerolab", "train", "--world-size", "2", "--strategy", "zero2", "--size", "nano",
              "--steps", "5", "--batch-size", "2", "--plot", "", "--no-progress"]
    a, b = tmp_path / "a", tmp_path / "b"
    out = _run([*common, "--save-every", "2", "--save-dir", str(a), "--fault", "kill@3:1"])
    assert out.returncode == 1
    assert "rank 1 was killed by signal SIGKILL" in out.stderr and f"--resume {a}" in out.stderr, out.stderr[-2000:]
    resumed = _run([*common, "--resume", str(a), "--save-every", "5", "--save-dir", str(a)])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "(resumed at step 2)" in resumed.stdout
    straight = _run([*common, "--save-every", "5", "--save-dir", str(b)])
    assert straight.returncode == 0, straight.stderr[-2000:]
    assert _losses(resumed.stdout)[1] == _losses(straight.stdout)[1]
    for d in (a, b):
        assert main(["consolidate", str(d), str(d) + ".pt"]) == 0
    sa = torch.load(str(a) + ".pt", weights_only=True)
    sb = torch.load(str(b) + ".pt", weights_only=True)
    assert sa.keys() == sb.keys() and "head.weight" in sa and "tok_emb.weight" in sa
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
