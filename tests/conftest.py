import os
import sys
import tempfile

import pytest

# Worker functions live in test modules; the launched ranks import them from here.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


# ---- nothing left behind: every process and temporary file the suite makes is accounted for
#
# The suite's temporary directory ($TMPDIR for the suite and everything it starts) is one of
# its own, and every process it starts inherits a marker in its environment. When the session
# ends, no process carrying the marker may still run (the fork server and the resource tracker
# of this process excepted: they end with it), and the directory may hold nothing but this
# process's own zl.launch directory, which it removes when it exits. pytest's tmp_path
# directories stay where pytest keeps them (PYTEST_DEBUG_TEMPROOT), with its own retention.
MARKER = "ZEROLAB_TEST_SESSION"
if MARKER not in os.environ:          # (not again in a process the suite started)
    import getpass
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    # torch.compile's cache stays where it always is, warm from run to run (a cache, not a leftover)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
    _SESSION_TMP = tempfile.mkdtemp(prefix="zl-tests-")
    os.environ["TMPDIR"] = _SESSION_TMP
    tempfile.tempdir = None
    os.environ[MARKER] = _SESSION_TMP
else:
    _SESSION_TMP = None


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    import torch
    torch.set_num_threads(1)


def _marked_processes(marker: str) -> dict:
    """pid -> command line of every live process whose environment carries the marker."""
    needle = f"{MARKER}={marker}".encode()
    found = {}
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{d}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        helper = int(ppid) == os.getpid() and ("multiprocessing.forkserver" in cmd or "resource_tracker" in cmd)
        if state != "Z" and not helper:
            found[int(d)] = cmd[:160]
    return found


def _leftovers() -> tuple[dict, list]:
    import shutil
    import signal
    import time
    deadline = time.monotonic() + 15          # a rank or a kernel may be a moment from its exit
    while (procs := _marked_processes(_SESSION_TMP)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in procs:                          # reported below; not left running all the same
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    # A launcher killed together with its fork server (nbval shuts each chapter's kernel down by
    # killing its process group) cannot remove its private directory: the next launch does
    # (zerolab.launch.tempdir.sweep). The suite's last kernel has no next launch: sweep as one would.
    from zerolab.launch.tempdir import sweep
    sweep(_SESSION_TMP)
    own = f"zerolab-launch-{os.getpid()}-"
    files = []
    for name in sorted(os.listdir(_SESSION_TMP)):
        if name.startswith(own):
            continue
        if name.startswith("torchelastic_"):
            # torchrun's agent never removes its run directory (empty directories): not zerolab's
            shutil.rmtree(os.path.join(_SESSION_TMP, name), ignore_errors=True)
            continue
        files.append(name)
    return procs, files


def pytest_sessionfinish(session, exitstatus):
    if _SESSION_TMP is None or not os.path.isdir("/proc"):
        return
    import shutil
    procs, files = _leftovers()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if procs or files:
        lines = [f"left behind by the suite: {len(procs)} process(es), {len(files)} file(s) in {_SESSION_TMP}"]
        lines += [f"  process {pid}: {cmd}" for pid, cmd in procs.items()]
        lines += [f"  file {name}" for name in files]
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line("\n".join(lines), red=True)
        else:
            print("\n".join(lines), file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    else:
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line("nothing left behind: no process, no temporary file")
        shutil.rmtree(_SESSION_TMP, ignore_errors=True)
