"""What an operator is told when something is off: one line that says what and where, never a
traceback, a silent default or a number that reads 0.0.

The references are independent of the messages' code: the exit status, a file that must or must
not exist, one process trained on the global batch, and the per-rank losses the report averages.
"""

import os
import subprocess
import sys
import warnings
from functools import partial

import pytest
import torch

import zerolab as zl


def test_the_doctor_refuses_files_that_are_not_flight_records(tmp_path, capsys):
    from zerolab.runtime import doctor
    (tmp_path / "rank0.rec").write_bytes(b"garbage")
    assert doctor.main(str(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "none of them a flight record zerolab wrote" in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_a_run_an_error_named_outlives_the_newest_runs(tmp_path, monkeypatch):
    from zerolab.runtime import recorder, watchdog
    root = tmp_path / "records"
    runs = [root / f"run-2026010{i // 10}-{i:06d}-1" for i in range(recorder.KEEP_RUNS + 5)]
    for d in runs:
        d.mkdir(parents=True)
        (d / "rank0.rec").write_bytes(b"")        # (unreadable: no process of it is alive)
    monkeypatch.setattr(recorder.RECORDER, "run_dir", str(runs[0]))
    assert str(runs[0]) in watchdog.records_note()  # an error names the oldest run's records
    recorder._prune(str(root), current="none")
    left = sorted(p.name for p in root.iterdir())
    assert runs[0].name in left and runs[1].name not in left and len(left) == recorder.KEEP_RUNS


def test_a_step_too_large_for_the_machine_is_said_in_units_that_show_it(capsys):
    from zerolab.__main__ import main
    assert main(["train", "--world-size", "100000", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "0.0 GiB" not in err and "KiB per rank" in err and "100,000 rank(s)" in err and "--world-size" in err, err


def test_a_data_parallel_engine_without_a_process_group_says_it_trains_as_one_rank(monkeypatch):
    from zerolab.engines import setup
    monkeypatch.setattr(setup, "_warned_alone", False)
    with pytest.warns(UserWarning, match="no process group.*trains as one rank.*zl.launch") as seen:
        zl.ZeRO(torch.nn.Linear(3, 3), partial(torch.optim.AdamW, lr=1e-3), stage=2)
    assert seen[0].filename == __file__            # the line of the script that built it
    with warnings.catch_warnings():
        warnings.simplefilter("error")                # once per process
        zl.DDP(torch.nn.Linear(3, 3), partial(torch.optim.AdamW, lr=1e-3))


def test_the_train_report_gives_each_steps_loss_over_the_global_batch():
    from zerolab.train import TrainConfig, format_report
    memory = {"params": 0, "grads": 0, "optimizer": 0, "total": 0}
    results = [{"rank": r, "losses": [4.0 + r, 3.0 + r], "skipped": 0, "params": 10, "tokens_per_s": 1.0,
                "seconds": 1.0, "memory": memory, "bytes_sent": 0} for r in range(2)]
    report = format_report(TrainConfig(size="nano", world_size=2, strategy="ddp"), results)
    assert "loss: first 4.5000, last 3.5000, each the mean over the 2 ranks' batches" in report, report


def test_one_round_of_the_bench_judges_no_timing():
    from zerolab.bench.report import verdict_word
    assert verdict_word(None, 1) == "not judged: one round has no spread"
    assert verdict_word(None, 3) == "within the spread" and verdict_word(True, 1) == "met"
    assert verdict_word(False, 2) == "MISSED"


def _sequential_zero3():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = zl.ZeRO(torch.nn.Sequential(*layers), partial(torch.optim.SGD, lr=0.1), stage=3)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    r = zl.rank()
    for _ in range(3):
        engine.backward(engine(x[4 * r:4 * r + 4]).pow(2).mean())
        engine.step()
        engine.zero_grad()
    return engine.full_state_dict(), [str(w.message) for w in seen], len(engine.units)


@pytest.mark.slow
def test_zero3_cuts_a_model_that_is_a_sequential_into_units():
    # it said "Sequential has no nn.ModuleList or nn.Sequential to cut into units" and gathered it whole
    got = zl.launch(_sequential_zero3, 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    for weights, said, units in got:
        assert units == 4 and not said, (units, said)         # the root and the three Linear layers
        assert max((weights[k] - v).abs().max().item() for k, v in model.state_dict().items()) < 1e-6


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs (a real full disk) needs root")
def test_a_full_disk_during_train_is_one_line_naming_the_step_and_the_directory(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("this machine does not let root mount a tmpfs")
    try:
        out = subprocess.run([sys.executable, "-m", "zerolab", "train", "--size", "nano", "--steps", "4",
                              "--save-every", "2", "--save-dir", str(disk / "ck"), "--no-progress", "--plot", ""],
                             capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(errors) == 1 and "step 4 was not saved" in errors[0] and "No space left on device" in errors[0], errors
    assert f"--resume {disk / 'ck'}" in out.stderr
