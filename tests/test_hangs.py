"""A run lasts as long as it trains; a rank that stops is named within the collective timeout,
whichever rank it is (rank 0, which hosts the rendezvous store, included).

Times are asserted against the collective timeout the test sets (a few seconds), with slack for
2 shared cores: the point is seconds, not the old whole-job deadline of minutes.
"""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.comm import Ledger


def collectives_for(seconds):
    """A healthy rank: a small all-reduce every 0.2 s for `seconds`, through a zerolab Ledger."""
    ledger = Ledger()                      # its timeout: the launch's collective_timeout
    t = torch.ones(4)
    end = time.monotonic() + seconds
    n = 0
    while True:
        flag = torch.tensor([float(time.monotonic() < end)])
        ledger.all_reduce(flag, op="min")   # every rank stops at the same iteration
        if flag.item() == 0:
            return n, ledger.timeout
        ledger.all_reduce(t)
        n += 1
        time.sleep(0.2)


def test_a_run_longer_than_any_collective_timeout_finishes():
    start = time.monotonic()
    (n0, timeout0), (n1, _) = zl.launch(collectives_for, 2, args=(6.0,), collective_timeout=2.0)
    assert time.monotonic() - start > 6.0 and n0 == n1 > 5
    assert timeout0 == 2.0                 # the ranks' ledgers took the launch's setting


def freeze(rank_to_freeze):
    ledger = Ledger()
    t = torch.ones(4)
    for i in range(1000):
        if i == 3 and dist.get_rank() == rank_to_freeze:
            os.kill(os.getpid(), signal.SIGSTOP)     # frozen: alive, silent, holding its sockets
        ledger.all_reduce(t, tag=f"step{i}")
    return "never"


@pytest.mark.parametrize("frozen", [0, 1])
def test_a_frozen_rank_is_named_within_seconds_rank_0_included(frozen):
    start = time.monotonic()
    with pytest.raises(zl.LaunchError) as info:
        zl.launch(freeze, 2, args=(frozen,), collective_timeout=3.0)
    took = time.monotonic() - start
    message = str(info.value)
    assert "did not complete within 3 s" in message, message[-1500:]
    if frozen == 0:
        assert "rank 0 (frozen or gone" in message, message[-1500:]
    else:
        assert "rank 1 (last at #" in message and "step2" in message, message[-1500:]
    assert took < 40, f"{took:.1f} s to name the frozen rank"


def test_under_torchrun_a_hanging_rank_is_named_by_the_collective_timeout_too(tmp_path):
    import socket
    import subprocess
    import sys
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    with socket.socket() as s:                # a free port for torchrun's own rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    out = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                          "--master-port", str(port), "-m", "zerolab", "train", "--size", "nano",
                          "--steps", "8", "--batch-size", "2", "--fault", "hang@3:1",
                          "--collective-timeout", "4", "--no-progress"],
                         capture_output=True, text=True, timeout=180, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    took = time.monotonic() - start
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "did not complete within 4 s. Ranks that did not arrive: rank 1" in text, text[-2000:]
    assert took < 90, f"{took:.1f} s"


def different_collectives():
    ledger = Ledger()
    t = torch.ones(4)
    ledger.all_reduce(t, tag="same")
    if dist.get_rank() == 0:
        ledger.all_reduce(t, tag="clip")          # rank 0 alone clips, say
    else:
        ledger.broadcast(t, src=1, tag="other")   # rank 1 does something else
    return "never"


def test_ranks_in_different_collectives_are_named_as_such():
    with pytest.raises(zl.LaunchError) as info:
        zl.launch(different_collectives, 2, collective_timeout=3.0)
    message = str(info.value)
    assert "in a different collective, #2" in message, message[-1500:]
