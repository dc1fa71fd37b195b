"""python -m zerolab train: a whole run from the shell, plain and under torchrun."""

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)


def _run(args, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, env=env, **kw)


def _losses(stdout):
    line = next(l for l in stdout.splitlines() if l.strip().startswith("loss:"))
    first, last = line.split("first")[1].split(", last")
    return float(first), float(last.split(",")[0])


@pytest.mark.parametrize("argv", [
    # the README's "From the shell" line, exactly as a newcomer types it (progress bar and plot on)
    "python -m zerolab train --world-size 2 --steps 100 --size tiny",
    "python -m zerolab train --strategy zero3 --world-size 2 --steps 4",
])
def test_the_default_path_runs_as_the_readme_shows_it(argv, tmp_path):
    """No flag that avoids a code path: the progress bar (the default) is drawn in the parent from
    rank 0's messages, and the loss curve lands in the working directory."""
    words = argv.split()
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    assert "--strategy zero3" in argv or argv in readme, "the README's line changed: test the new one"
    out = _run(words[1:], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    steps = words[words.index("--steps") + 1]
    assert f"{steps}/{steps}" in out.stderr, "the progress bar reached the last step"
    text = out.stdout
    assert "loss:" in text and "tokens/s" in text and "world size 2" in text
    if "--strategy" not in words:
        # no --strategy with 2 ranks: data parallel, as torchrun users expect (never 2 unrelated runs)
        assert "strategy=ddp" in text
    rows = [l.split() for l in text.splitlines() if l.strip()[:1].isdigit() and "MiB" in l]
    assert [r[0] for r in rows] == ["0", "1"], "one memory line per rank"
    first, last = _losses(text)
    assert last < first, "a few AdamW steps on the corpus lower the loss"
    assert (tmp_path / "zerolab-loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
    # zl.launch ran train_worker in place on each of torchrun's two ranks (no ranks of its own) and
    # handed every rank's result to rank 0, in rank order: one memory line per rank
    rows = [l.split() for l in out.stdout.splitlines() if l.strip()[:1].isdigit() and "MiB" in l]
    assert [r[0] for r in rows] == ["0", "1"], out.stdout
    # torchrun's agent's store listens on every interface whatever --master-addr says: the README
    # says that zerolab warns, once, on the node that hosts it
    assert out.stderr.count("torchrun's rendezvous store listens on every interface") == 1, out.stderr[-3000:]


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
    png = tmp_path / "loss.png"       # (--plot PATH: the curve lands where it is asked to)
    straight = _run([*common, "--save-every", "5", "--save-dir", str(b), "--plot", str(png)])
    assert straight.returncode == 0, straight.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _losses(resumed.stdout)[1] == _losses(straight.stdout)[1]
    for d in (a, b):
        assert main(["consolidate", str(d), str(d) + ".pt"]) == 0
    sa = torch.load(str(a) + ".pt", weights_only=True)
    sb = torch.load(str(b) + ".pt", weights_only=True)
    assert sa.keys() == sb.keys() and "head.weight" in sa and "tok_emb.weight" in sa
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


# ---- checked before training: the checkpoint to resume, the save directory, the plot, timeouts


def _two_checkpoints(root):
    """Two different checkpoints of the nano GPT at the same step (0): what two ranks would find
    in two runs' directories."""
    import functools

    import torch

    import zerolab as zl
    from zerolab import checkpoint, models
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        engine = zl.SingleProcess(models.GPT(models.gpt_config("nano")),
                                  functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.0))
        paths.append(str(root / f"run{seed}"))
        checkpoint.save(engine, paths[-1])
    return paths


def _train_with_per_rank(field, values):
    import zerolab as zl
    from zerolab.train import TrainConfig, train_worker
    cfg = TrainConfig(size="nano", strategy="zero2", steps=3, batch_size=2, world_size=2,
                      **{field: values[zl.rank()]}, **({"save_every": 1} if field == "save_dir" else {}))
    cfg.check()
    try:
        train_worker(cfg)
    except ValueError as e:
        return str(e)
    return "trained"


def test_ranks_resuming_different_checkpoints_stop_before_training(tmp_path):
    # the plan said only "resume: True": rank 0 with one run's checkpoint and rank 1 with
    # another's, at the same step, trained a mixture of both and exited 0
    import zerolab as zl
    a, b = _two_checkpoints(tmp_path)
    messages = zl.launch(_train_with_per_rank, 2, args=("resume", [a, b]))
    for message in messages:
        assert message.startswith("the ranks' training plans differ: #11 is resume = 'step 0, sha256 "), messages


def test_a_save_directory_not_shared_by_every_rank_stops_before_training(tmp_path):
    # a --save-dir of its own per node failed only at the first save (a raw FileNotFoundError)
    import zerolab as zl
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    messages = zl.launch(_train_with_per_rank, 2, args=("save_dir", dirs))
    for message in messages:
        assert "does not see the files the other ranks write there" in message, messages
    assert not [f for d in dirs for f in os.listdir(d)], "the probes are removed"


def test_ctrl_c_ends_with_one_line_and_where_to_resume(tmp_path):
    import signal
    import time
    ckpt = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "zerolab", "train", "--world-size", "2", "--size", "nano",
                             "--steps", "100000", "--batch-size", "2", "--save-every", "1", "--save-dir", str(ckpt),
                             "--plot", "", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGHUP)])
    deadline = time.monotonic() + 120
    while not (ckpt / "metadata.json").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)          # a terminal's Ctrl-C reaches the whole job
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-2000:]
    assert f"zerolab train: interrupted: the last checkpoint is in {ckpt}; continue with --resume {ckpt}" in err, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]


def test_timeout_is_honoured_under_torchrun(tmp_path):
    # a 5 s --timeout ran 40 s to the end under torchrun, without a word. Under torchrun (RANK and
    # WORLD_SIZE set) zl.launch runs in place: the same path with one rank, started here by hand.
    # The run would take hours; the whole job's 5 s end it
    import signal
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-m", "zerolab", "train", "--size", "nano", "--steps", "1000000",
                             "--batch-size", "2", "--plot", "", "--no-progress", "--timeout", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, out[-3000:]
    assert "zerolab train: error: launch: rank 0 did not finish within the timeout of 5 s" in out, out[-3000:]


def test_consolidate_names_an_output_it_cannot_write_in_one_line(tmp_path, capsys):
    # before: a raw FileNotFoundError traceback, after the whole checkpoint had been read
    import functools

    import torch

    import zerolab as zl
    from zerolab import checkpoint, models
    from zerolab.__main__ import main
    ck = tmp_path / "ck"
    checkpoint.save(zl.SingleProcess(models.AwkwardModel(), functools.partial(torch.optim.AdamW, lr=1e-3)), ck)
    for out, words in ((tmp_path / "missing" / "x.pt", f"the directory '{tmp_path / 'missing'}' does not exist"),
                       ("/proc/x.pt", "cannot write '/proc/x.pt': ")):
        assert main(["consolidate", str(ck), str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("zerolab consolidate: error: ") and err.count("\n") == 1 and words in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
