"""zl.launch: real processes, values in rank order, every failure surfaced fast, nothing left behind."""

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import zerolab as zl

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)
launch_module = sys.modules["zerolab.launch.parent"]  # the module (zl.launch is the function)


# ---- worker functions: top level of an importable module, as launch requires


def identity_and_sum(tag):
    t = torch.tensor([float(zl.rank() + 1)])
    dist.all_reduce(t)  # a real collective across the real processes
    return {"tag": tag, "rank": zl.rank(), "world": zl.world_size(), "sum": t.item(),
            "pid": os.getpid(), "threads": torch.get_num_threads(), "device": str(zl.device()),
            "backend": dist.get_backend()}


def raise_on_rank_1():
    if zl.rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 waits here for a rank that will never come
    return "unreachable"


def exit_on_rank_1():
    if zl.rank() == 1:
        os._exit(7)
    dist.barrier()
    return "unreachable"


def sigkill_rank_0():
    if zl.rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return "unreachable"


def sleep_forever():
    time.sleep(3600)


def print_something():
    print(f"printed by rank {zl.rank()}")
    return zl.rank()


def chatty(tag):
    """Every kind of output: print, C-level writes to fd 1 and 2, a warning, no final newline."""
    r = zl.rank()
    print(f"print from rank {r}")
    os.write(1, f"C write to stdout from rank {r}\n".encode())
    os.write(2, f"C write to stderr from rank {r}\n".encode())
    warnings.warn(f"warning from rank {r}")
    sys.stdout.write(f"no newline from rank {r}")
    return (tag, r)


def print_then_die_on_rank_1():
    print(f"rank {zl.rank()} was here")
    if zl.rank() == 1:
        os.write(2, b"rank 1 is about to exit\n")
        os._exit(5)
    dist.barrier()


def return_tensor():
    return torch.arange(3) * (zl.rank() + 1)


def return_unpicklable():
    return lambda: None


def add(a, b):
    return a + b + zl.rank()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


# ---- the happy path


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_values_come_back_in_rank_order(world_size):
    out = zl.launch(identity_and_sum, world_size, args=("x",))
    assert [o["rank"] for o in out] == list(range(world_size))
    expected = world_size * (world_size + 1) / 2  # closed form of 1 + 2 + ... + N
    for o in out:
        assert o["world"] == world_size and o["sum"] == expected and o["tag"] == "x"
        assert o["threads"] == 1, "one compute thread per CPU rank"
        # NCCL when every rank has a GPU of its own (then CPU tensors go over gloo beside it)
        if torch.cuda.is_available() and world_size <= torch.cuda.device_count():
            assert "nccl" in str(o["backend"]) and o["device"] == f"cuda:{o['rank']}", o
        else:
            assert o["backend"] == "gloo" and o["device"] == "cpu", o
    assert len({o["pid"] for o in out}) == world_size
    assert os.getpid() not in {o["pid"] for o in out}, "ranks are separate processes"


def test_partial_and_tensor_results(capfd):
    assert zl.launch(functools.partial(add, 10), 2, args=(5,)) == [15, 16]
    tensors = zl.launch(return_tensor, 2)
    assert torch.equal(tensors[1], torch.tensor([0, 2, 4]))
    capfd.readouterr()
    assert zl.launch(print_something, 2) == [0, 1]
    assert capfd.readouterr().out == "[rank 0] printed by rank 0\n", "rank 0's print, once, after the launch"


# ---- what workers print: shown after the launch, in rank order, prefixed by rank


@pytest.fixture
def no_output_env(monkeypatch):
    monkeypatch.delenv("ZEROLAB_LAUNCH_OUTPUT", raising=False)


def _stdout_of(r):
    return (f"[rank {r}] print from rank {r}\n[rank {r}] C write to stdout from rank {r}\n"
            f"[rank {r}] no newline from rank {r}\n")


def test_default_output_is_rank_0s_and_the_other_ranks_warnings(capfd, no_output_env):
    assert zl.launch(chatty, 2, args=("t",)) == [("t", 0), ("t", 1)]
    out, err = capfd.readouterr()
    assert out == _stdout_of(0), "rank 0's stdout only, C-level writes and the unfinished last line too"
    for r in (0, 1):  # rank 0's stderr, and rank 1's: its warnings and errors
        assert f"[rank {r}] C write to stderr from rank {r}\n" in err, err
        assert f"UserWarning: warning from rank {r}" in err, err
    assert all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in err.splitlines()), err
    assert "print from rank 1" not in out + err and "no newline from rank 1" not in out + err
    assert err.index("[rank 0]") < err.index("[rank 1]"), "in rank order"


def test_output_all_shows_every_rank_in_order(capfd, no_output_env):
    assert zl.launch(chatty, 3, args=("t",), output="all") == [("t", 0), ("t", 1), ("t", 2)]
    out, err = capfd.readouterr()
    assert out == _stdout_of(0) + _stdout_of(1) + _stdout_of(2)
    starts = [err.index(f"[rank {r}] C write to stderr from rank {r}") for r in range(3)]
    assert starts == sorted(starts), err


def test_output_none_shows_nothing(capfd, no_output_env):
    assert zl.launch(chatty, 2, args=("t",), output="none") == [("t", 0), ("t", 1)]
    out, err = capfd.readouterr()
    assert "[rank" not in out + err and "from rank" not in out + err


def test_quiet_workers_add_no_lines(capfd, no_output_env):
    assert zl.launch(add, 2, args=(1, 2), output="all") == [3, 4]
    assert capfd.readouterr() == ("", "")


def test_environment_variable_sets_the_default_and_the_keyword_wins(capfd, monkeypatch):
    monkeypatch.setenv("ZEROLAB_LAUNCH_OUTPUT", "all")
    zl.launch(print_something, 2)
    assert capfd.readouterr().out == "[rank 0] printed by rank 0\n[rank 1] printed by rank 1\n"
    zl.launch(print_something, 2, output="none")
    assert capfd.readouterr().out == ""


def test_a_dead_ranks_output_is_in_the_error_and_the_others_are_shown(capfd, no_output_env):
    with pytest.raises(zl.LaunchError) as info:
        zl.launch(print_then_die_on_rank_1, 2, timeout=60)
    msg = str(info.value)
    assert info.value.rank == 1 and "exited with code 5" in msg
    assert "rank 1 was here" in msg and "rank 1 is about to exit" in msg, msg
    assert msg.index("rank 1 was here") < msg.index("rank 1 is about to exit"), "stderr last"
    out, err = capfd.readouterr()
    assert out == "[rank 0] rank 0 was here\n", "the others' output is still shown"
    assert "[rank 1]" not in out + err, "the dead rank's output is in the error, not shown twice"


@pytest.mark.parametrize("text, shown", [
    ("", ""),
    ("a\n", "[rank 3] a\n"),
    ("a\n\nb", "[rank 3] a\n[rank 3] \n[rank 3] b\n"),
    ("  x \r\n", "[rank 3]   x \r\n"),
])
def test_prefixed_keeps_every_line_and_strips_nothing(text, shown):
    from zerolab.launch.output import prefixed
    assert prefixed(text, 3) == shown


# ---- failures


def test_rank_that_raises_is_named_with_traceback():
    start = time.monotonic()
    with pytest.raises(zl.LaunchError) as info:
        zl.launch(raise_on_rank_1, 2, timeout=60)
    assert time.monotonic() - start < 10, "a raising rank must surface in seconds, not at the timeout"
    assert info.value.rank == 1
    msg = str(info.value)
    assert "rank 1" in msg and "deliberate failure on rank 1" in msg and "Traceback" in msg


@pytest.mark.parametrize("worker, bad_rank, how", [(exit_on_rank_1, 1, "exited with code 7"),
                                                   (sigkill_rank_0, 0, "SIGKILL")])
def test_rank_that_dies_is_named_and_nothing_is_left(worker, bad_rank, how):
    zl.launch(add, 2, args=(0, 0))     # the fork server and resource tracker stay: started before
    before = set(_children())
    start = time.monotonic()
    with pytest.raises(zl.LaunchError) as info:
        zl.launch(worker, 2, timeout=60)
    assert time.monotonic() - start < 10
    assert info.value.rank == bad_rank and how in str(info.value)
    time.sleep(0.2)
    assert not [p for p in set(_children()) - before if _alive(p)], "no worker may outlive launch"


def test_timeout_stops_every_rank():
    before = set(_children())
    start = time.monotonic()
    with pytest.raises(zl.LaunchError, match="did not finish within the timeout of 2 s"):
        zl.launch(sleep_forever, 2, timeout=2)
    assert 2 <= time.monotonic() - start < 8
    time.sleep(0.2)
    assert not [p for p in set(_children()) - before if _alive(p)]


def test_unpicklable_result_is_explained():
    with pytest.raises(zl.LaunchError, match="cannot be sent back"):
        zl.launch(return_unpicklable, 2)


def _children():
    """PIDs of this process's live descendants (the fork server's children included)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    pairs = [tuple(map(int, l.split())) for l in out.strip().splitlines()]
    kids, frontier = set(), {os.getpid()}
    while frontier:
        nxt = {pid for pid, ppid in pairs if ppid in frontier} - kids
        kids |= nxt
        frontier = nxt
    return kids


# ---- bad input, rejected before any process starts


def nested_holder():
    def inner():
        return 1
    return inner


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(fn=42), TypeError, "fn must be a function"),
    (dict(fn=lambda: 1), ValueError, "lambda"),
    (dict(fn=nested_holder()), ValueError, "inside another function"),
    (dict(fn=add, world_size=0), ValueError, "world_size must be >= 1"),
    (dict(fn=add, world_size=2.0), TypeError, "world_size must be an int"),
    (dict(fn=add, timeout=0), ValueError, "timeout must be a finite number of seconds > 0 or None"),
    (dict(fn=add, timeout=-3), ValueError, "timeout must be a finite number of seconds > 0 or None"),
    (dict(fn=add, timeout=float("inf")), ValueError, "timeout must be a finite number"),
    (dict(fn=add, collective_timeout=None), ValueError, "collective_timeout must be a finite number"),
    (dict(fn=add, collective_timeout=float("nan")), ValueError, "collective_timeout must be a finite"),
    (dict(fn=add, backend="mpi"), ValueError, "backend must be"),
    (dict(fn=add, args=5), TypeError, "args must be a tuple"),
    (dict(fn=add, output="rank1"), ValueError, "output must be one of 'rank0', 'all', 'none'"),
    (dict(fn=add, output=True), ValueError, "output must be one of"),
])
def test_bad_input_is_rejected_before_start(kwargs, error, words, monkeypatch):
    def no_processes_please():
        raise AssertionError("launch tried to start processes for bad input")
    monkeypatch.setattr(launch_module, "process_context", no_processes_please)
    with pytest.raises(error, match=words):
        zl.launch(**{"world_size": 2, **kwargs})


def test_bad_output_environment_variable_is_rejected_before_start(monkeypatch):
    def no_processes_please():
        raise AssertionError("launch tried to start processes for bad input")
    monkeypatch.setattr(launch_module, "process_context", no_processes_please)
    monkeypatch.setenv("ZEROLAB_LAUNCH_OUTPUT", "everything")
    with pytest.raises(ValueError, match="ZEROLAB_LAUNCH_OUTPUT='everything' must be one of"):
        zl.launch(add, 2, args=(1, 2))


def test_notebook_defined_function_gets_a_clear_error():
    # `python -c` has an interactive __main__ without __file__, exactly like a notebook kernel.
    code = textwrap.dedent("""
        import sys, zerolab as zl
        def work():
            return 1
        try:
            zl.launch(work, 2)
        except ValueError as e:
            print("ERROR:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "notebook cell or an interactive session" in out.stdout, out.stdout + out.stderr
    assert "Move it into a .py file" in out.stdout


# (under torchrun zl.launch runs fn in place on each rank and hands every rank's value back in rank
# order: tests/test_cli.py's test_train_under_torchrun, whose report shows each rank's row)


# ---- security: nothing a launch starts listens beyond loopback


def _listening_sockets():
    """(address, port) of every listening TCP socket this process owns, from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == "0A" and inode in inodes:        # 0A = LISTEN
                    hex_addr, hex_port = local.split(":")
                    if len(hex_addr) == 8:                    # IPv4, little-endian bytes
                        addr = ".".join(str(int(hex_addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
                    else:
                        addr = "ipv6:" + hex_addr
                    found.append((addr, int(hex_port, 16)))
    return found


def listeners_after_a_collective():
    t = torch.ones(1)
    dist.all_reduce(t)
    return _listening_sockets()


def test_workers_listen_on_loopback_only(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    per_rank = zl.launch(listeners_after_a_collective, 2)
    assert per_rank[0], "rank 0 hosts the rendezvous store, so it must be listening somewhere"
    for rank, sockets in enumerate(per_rank):
        for addr, port in sockets:
            assert addr == "127.0.0.1", f"rank {rank} listens on {addr}:{port}"


@pytest.mark.parametrize("addr, words", [("::1", "not an IPv4 address of this machine"),
                                         ("no-such-host.invalid", "not an IPv4 address of this machine"),
                                         ("192.0.2.1", "not an IPv4 address of this machine")])
def test_a_bad_listen_address_is_named_before_start(addr, words, monkeypatch):
    def no_processes_please():
        raise AssertionError("launch tried to start processes for bad input")
    monkeypatch.setattr(launch_module, "process_context", no_processes_please)
    monkeypatch.setenv("ZEROLAB_LAUNCH_ADDR", addr)
    with pytest.raises(ValueError, match=words) as info:
        zl.launch(add, 2, args=(1, 2))
    assert repr(addr) in str(info.value)


def test_master_addr_of_a_cluster_script_does_not_open_the_store_to_the_network(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "0.0.0.0")
    monkeypatch.delenv("ZEROLAB_LAUNCH_ADDR", raising=False)
    with pytest.warns(UserWarning, match="MASTER_ADDR='0.0.0.0' is ignored"):
        per_rank = zl.launch(listeners_after_a_collective, 2)
    assert all(addr == "127.0.0.1" for sockets in per_rank for addr, _ in sockets), per_rank


def as_from_a_terminal():
    """preexec_fn: the job's SIGINT, SIGTERM and SIGHUP as a terminal gives them. A shell starts a
    background job with SIGINT ignored, and nohup ignores SIGHUP; zl.launch rightly leaves an
    ignored signal ignored, so run under either these tests would wait for nothing."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


@pytest.fixture
def scratch():
    """An empty $TMPDIR for a launcher the test starts, with a short path: the fork server's socket
    goes in it, and a Unix socket's path may be 107 bytes at most (pytest's tmp_path is longer
    under pytest-xdist, whose workers add a directory of their own). Inside the suite's own
    temporary directory, removed after the test."""
    import pathlib
    import shutil
    import tempfile
    path = pathlib.Path(tempfile.mkdtemp(prefix="zl-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_to_the_parent_stops_the_ranks_and_removes_their_files(tmp_path, scratch, sig):
    script = tmp_path / "job.py"
    script.write_text("import sys\nsys.path.insert(0, %r)\nimport zerolab as zl\nfrom test_launch import sleep_forever\n"
                      "if __name__ == '__main__':\n    print('started', flush=True)\n    zl.launch(sleep_forever, 2)\n"
                      % os.path.dirname(__file__))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(scratch)}, preexec_fn=as_from_a_terminal)
    assert proc.stdout.readline().strip() == "started"
    time.sleep(3.0)                                  # the ranks are up and sleeping
    proc.send_signal(sig)
    assert proc.wait(timeout=30) != 0
    time.sleep(0.5)
    left = [p.name for p in scratch.iterdir() if p.name.startswith("zerolab-launch-")]
    assert not left, left


def test_a_signal_while_a_rank_starts_stops_that_rank_too(tmp_path, scratch):
    """SIGHUP arriving inside Process.start(), just after the second rank was started: before
    that rank is in the list of ranks to stop. It must be stopped too; otherwise it sleeps on,
    and Python's exit waits for it forever."""
    script = tmp_path / "job.py"
    script.write_text(
        "import contextlib, os, signal, sys\nsys.path.insert(0, %r)\nimport zerolab as zl\n"
        "L = sys.modules['zerolab.launch.parent']\nfrom test_launch import sleep_forever\n"
        "hidden, started = L._main_module_hidden, []\n"
        "@contextlib.contextmanager\n"
        "def hup_after_the_second_start(fn):\n"
        "    with hidden(fn):\n"
        "        yield\n"
        "    started.append(1)\n"
        "    if len(started) == 2:\n"
        "        os.kill(os.getpid(), signal.SIGHUP)\n"
        "L._main_module_hidden = hup_after_the_second_start\n"
        "if __name__ == '__main__':\n    zl.launch(sleep_forever, 2)\n" % os.path.dirname(__file__))
    proc = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "TMPDIR": str(scratch)},
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=as_from_a_terminal)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGHUP
    # (left out of the ranks to stop, the rank either slept on, and exit hung, or found its log
    # directory removed and died with a traceback: whichever came first)
    assert "Traceback" not in err, err
    time.sleep(0.5)
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("zerolab-launch-")]


def sleep_ignoring_sigterm():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # the parent's clean-up must kill it: ~3 s
    time.sleep(3600)


def test_a_second_ctrl_c_during_the_clean_up_leaves_nothing_behind(tmp_path, scratch):
    script = tmp_path / "job.py"
    script.write_text("import sys\nsys.path.insert(0, %r)\nimport zerolab as zl\n"
                      "from test_launch import sleep_ignoring_sigterm\n"
                      "if __name__ == '__main__':\n    print('started', flush=True)\n"
                      "    zl.launch(sleep_ignoring_sigterm, 2)\n" % os.path.dirname(__file__))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "TMPDIR": str(scratch)},
                            preexec_fn=as_from_a_terminal)
    assert proc.stdout.readline().strip() == "started"
    time.sleep(3.0)                       # the ranks are up and sleeping
    proc.send_signal(signal.SIGINT)       # the clean-up starts: SIGTERM, then 3 s, then SIGKILL
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)       # a second Ctrl-C in the middle of it
    assert proc.wait(timeout=30) != 0
    left = [p.name for p in scratch.iterdir() if p.name.startswith("zerolab-")]
    assert not left, left
    assert "KeyboardInterrupt" in proc.stderr.read()


@pytest.mark.parametrize("body, words", [
    # a script whose top level calls zl.launch: every rank re-runs it while starting
    ("def f():\n    return 1\nzl.launch(f, 2)\n",
     "Put it under `if __name__ == \"__main__\":`"),
    # a script that cannot be imported a second time (here: in a rank)
    ("import multiprocessing as mp\nif mp.current_process().name != 'MainProcess':\n"
     "    raise ImportError('needs the main process')\ndef f():\n    return 1\n"
     "if __name__ == '__main__':\n    zl.launch(f, 2)\n",
     "ImportError: needs the main process"),
])
def test_a_rank_that_fails_while_starting_shows_its_traceback_in_the_error(tmp_path, scratch, body, words):
    # before fn runs, a rank's output is not yet redirected to its files: without
    # zerolab.launch.startup the error said only "exited with code 1"
    script = tmp_path / "job.py"
    script.write_text("import zerolab as zl\n" + body)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TMPDIR": str(scratch)})
    assert out.returncode != 0
    error = out.stderr[out.stderr.index("LaunchError"):]
    assert "exited with code 1 before returning a result" in error, out.stderr[-2000:]
    assert "it failed while starting (before fn was called)" in error and words in error, error
    assert not list(scratch.iterdir()), "no start-up file or log left behind"


def test_a_tmpdir_too_long_for_the_fork_servers_socket_says_so(tmp_path):
    # the fork server listens on a Unix socket in $TMPDIR, whose path may be ~107 bytes at most:
    # the error names $TMPDIR and what to do, not a missing fork server
    long_dir = tmp_path / ("d" * 60) / ("e" * 60)
    long_dir.mkdir(parents=True)
    script = tmp_path / "job.py"
    script.write_text("import zerolab as zl\ndef f():\n    return 1\n"
                      "if __name__ == '__main__':\n    zl.launch(f, 2)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TMPDIR": str(long_dir)})
    assert out.returncode != 0
    assert "Set TMPDIR to a shorter directory" in out.stderr and str(long_dir) in out.stderr, out.stderr[-2000:]


def test_a_script_launches_its_own_function_then_a_rank_that_cannot_start_is_reported(tmp_path):
    # a script's `if __name__ == "__main__":` launches a function the script defines; then the
    # fork server's socket removed (a clean-up of the temporary directory): the next rank
    # cannot be started. Before, every exception while starting a rank was reported as "Every
    # argument in args must be picklable", this one included
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os
        from multiprocessing import forkserver
        import torch.distributed as dist
        import zerolab as zl
        from zerolab.launch import LaunchError
        def work(x):                    # a function of the script itself: the ranks import it
            return x * 10 + dist.get_rank()
        if __name__ == "__main__":
            print(zl.launch(work, 2, args=(4,)))
            os.remove(forkserver._forkserver._forkserver_address)
            try:
                zl.launch(zl.rank, 1)
                print("STARTED")
            except LaunchError as e:
                print(str(e).splitlines()[0])
            class Lock:                 # and an argument that cannot be sent is still named so
                def __reduce__(self):
                    raise TypeError("cannot pickle 'Lock' object")
            try:
                zl.launch(zl.rank, 1, args=(Lock(),))
            except LaunchError as e:
                print(str(e).splitlines()[0])
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    script_main, socket_gone, unpicklable = out.stdout.strip().splitlines()[-3:]
    assert script_main == "[40, 41]", out.stdout     # a script's own functions run on its ranks
    assert socket_gone.startswith("launch: could not start rank 0: the operating system refused "
                                  "(FileNotFoundError(2, 'No such file or directory'))"), socket_gone
    assert "fork server" in socket_gone and "picklable" not in socket_gone, socket_gone
    assert "cannot pickle 'Lock' object" in unpicklable and "must be picklable" in unpicklable, unpicklable


# ---- rank 0's output as it comes; the others' bounded; every rank's finding in the error


class _Watching:
    """A stand-in for sys.stdout that creates `flag` once it has been sent `line`."""

    def __init__(self, line, flag):
        self.line, self.flag, self.text = line, flag, ""

    def write(self, text):
        self.text += text
        if self.line in self.text and not os.path.exists(self.flag):
            open(self.flag, "w").close()
        return len(text)

    def flush(self):
        pass


def print_then_wait_to_be_seen(flag, seconds):
    if zl.rank() == 0:
        print("half-way there")            # a plain print: no flush, no newline tricks
        deadline = time.monotonic() + seconds
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        return os.path.exists(flag)        # the parent showed the line while this rank still ran
    return None


def test_rank_0s_lines_are_shown_while_the_launch_runs(tmp_path, monkeypatch, no_output_env):
    flag = str(tmp_path / "seen")
    watcher = _Watching("[rank 0] half-way there\n", flag)
    monkeypatch.setattr(sys, "stdout", watcher)
    values = zl.launch(print_then_wait_to_be_seen, 2, args=(flag, 30.0))
    monkeypatch.undo()
    assert values == [True, None], "rank 0's line reached the terminal only when the launch ended"
    assert watcher.text == "[rank 0] half-way there\n", "and it is shown once"


def print_a_lot(megabytes):
    if zl.rank() == 1:
        line = "x" * 1023 + "\n"
        for _ in range(megabytes * 1024):
            sys.stdout.write(line)
        print("the last line of rank 1")
    return zl.rank()


def test_a_rank_that_prints_a_lot_costs_the_parent_bounded_memory(tmp_path):
    # in a fresh process, so that its peak resident memory says what this launch cost
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import zerolab as zl
        from test_launch import print_a_lot
        if __name__ == "__main__":
            zl.launch(print_a_lot, 2, args=(1,), output="all")     # everything warmed up
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            zl.launch(print_a_lot, 2, args=(100,), output="all")   # rank 1 prints 100 MB
            after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            print("GREW_KB", after - before, file=sys.stderr)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    grew = int(out.stderr.split("GREW_KB")[1].split()[0]) / 1024
    # held whole, 200 MB of output cost the parent 1.3 GB (100 MB: 0.5 GB); kept bounded, the last
    # 1 MiB per stream
    assert grew < 50, f"the parent grew by {grew:.0f} MB"
    tail = out.stdout[-200_000:]
    assert "[rank 1] the last line of rank 1\n" in tail and "earlier characters not kept)" in out.stdout


def both_ranks_raise():
    dist.barrier()
    raise FloatingPointError(f"what rank {zl.rank()} found")


def test_ranks_that_raise_together_are_all_quoted():
    # whichever rank's error arrives first, the other's finding is in the message too
    with pytest.raises(zl.LaunchError) as info:
        zl.launch(both_ranks_raise, 2, output="none")
    message = str(info.value)
    assert "what rank 0 found" in message and "what rank 1 found" in message, message
    assert "Traceback" in message and "raised as well" in message


class Boost(torch.nn.Module):
    def forward(self, x):
        return x * (1e6 if zl.rank() == 1 else 1.0)    # fp16 overflows on rank 1 only


def fp16_overflows_on_rank_1():
    from collections import OrderedDict
    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(proj=torch.nn.Linear(4, 4), boost=Boost(), head=torch.nn.Linear(4, 1)))
    engine = zl.DDP(model, functools.partial(torch.optim.SGD, lr=0.1), precision="fp16")
    for _ in range(100):
        engine.backward(engine(torch.randn(2, 4)).float().sum())
        engine.step()
        engine.zero_grad()


def test_the_fp16_give_up_quotes_the_rank_that_found_the_module():
    # rank 0's forward is finite, so it says "the overflow is in the backward"; rank 1 names the
    # module. Before, the launch quoted whichever error arrived first: rank 0's in 2 runs of 4
    with pytest.raises(zl.LaunchError) as info:
        zl.launch(fp16_overflows_on_rank_1, 2, output="none")
    assert "boost produced inf" in str(info.value), str(info.value)[-3000:]


# ---- the launching process dies: nothing of the launch stays


def stop_rank_1_and_sleep(pid_dir):
    with open(os.path.join(pid_dir, f"rank{zl.rank()}"), "w") as f:
        f.write(str(os.getpid()))
    if zl.rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)     # frozen: none of its own code can end it
    time.sleep(3600)


def _started(pid):
    """When process `pid` started (clock ticks since boot), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _descendants(pid):
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    pairs = [tuple(map(int, l.split())) for l in out.strip().splitlines()]
    kids, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in pairs if pp in frontier} - kids
        kids |= frontier
    return kids


def test_a_launcher_killed_with_sigkill_leaves_no_process_and_no_file(tmp_path, scratch):
    _launcher_killed(tmp_path, scratch)


def _launcher_killed(tmp_path, scratch):
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "job.py"
    script.write_text("import sys\nsys.path.insert(0, %r)\nimport zerolab as zl\n"
                      "from test_launch import stop_rank_1_and_sleep\n"
                      "if __name__ == '__main__':\n    zl.launch(stop_rank_1_and_sleep, 2, args=(%r,))\n"
                      % (os.path.dirname(__file__), str(pids)))
    env = {**os.environ, "TMPDIR": str(scratch)}
    proc = subprocess.Popen([sys.executable, str(script)], env=env)
    deadline = time.monotonic() + 120
    while len(os.listdir(pids)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(os.listdir(pids)) == 2, "the ranks did not start"
    frozen = int((pids / "rank1").read_text())
    for _ in range(100):                     # rank 1 has stopped itself
        with open(f"/proc/{frozen}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                break
        time.sleep(0.05)
    launched = {p: _started(p) for p in _descendants(proc.pid)}   # ranks, fork server, resource tracker
    assert frozen in launched and len(launched) >= 4, launched

    def still_running():                     # (the same processes: not a pid reused since)
        return [p for p, started in launched.items() if _alive(p) and _started(p) == started]
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while still_running() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = still_running()
    for p in left:                           # (the test leaves nothing behind either way)
        os.kill(p, signal.SIGKILL)
    assert not left, f"{left} outlived the launcher (rank 1, frozen: {frozen})"
    # its fork server removed the launcher's private directory as it ended
    assert not list(scratch.iterdir()), list(scratch.iterdir())


def test_a_launch_sweeps_the_directories_of_launchers_that_are_gone():
    # a launcher and its fork server killed together (a Jupyter kernel's process group, shut
    # down) leave their private directory: the next launch removes it; a live one's stays
    import tempfile
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = tempfile.mkdtemp(prefix=f"zerolab-launch-{dead.pid}-")
    alive = tempfile.mkdtemp(prefix=f"zerolab-launch-{os.getppid()}-")
    try:
        assert zl.launch(add, 2, args=(1, 2)) == [3, 4]
        assert not os.path.exists(gone) and os.path.isdir(alive)
    finally:
        os.rmdir(alive)


def test_start_up_tracebacks_go_to_a_private_directory_and_follow_no_link(tmp_path, monkeypatch):
    # the start-up file was $TMPDIR/zerolab-start-<pid>.txt, opened following links: a planted
    # link overwrote its target (on a system without protected_symlinks)
    from zerolab.launch import startup as launch_startup, tempdir as launch_tempdir
    private = launch_tempdir.private_dir()
    assert os.stat(private).st_mode & 0o777 == 0o700 and os.path.basename(private).startswith(
        f"zerolab-launch-{os.getpid()}-")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, launch_startup.path(str(tmp_path), os.getpid()))
    monkeypatch.setattr(launch_startup, "_directory", [str(tmp_path)])
    with pytest.raises(OSError):
        launch_startup._write("a traceback")
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("gpus, local_ranks, want", [(0, 2, "gloo"), (1, 2, "gloo"), (2, 2, "cpu:gloo,cuda:nccl"),
                                                     (8, 4, "cpu:gloo,cuda:nccl"), (1, 1, "cpu:gloo,cuda:nccl")])
def test_under_torchrun_every_rank_of_a_node_picks_the_same_backend(gpus, local_ranks, want, monkeypatch):
    """One GPU and two ranks: both on gloo (rank 0 on NCCL and rank 1 on gloo would never meet)."""
    from zerolab.launch import in_place
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    for local in range(local_ranks):
        monkeypatch.setenv("LOCAL_RANK", str(local))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert in_place.backend_for_this_node() == want, (gpus, local_ranks, local)
    # zl.launch starts all its ranks on this machine and decides by the same rule
    from zerolab.launch import parent
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert parent._choose_backend(local_ranks, None) == ("gloo" if want == "gloo" else "nccl")
