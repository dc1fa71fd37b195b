"""The one private directory zl.launch uses in a process, and the sweeping of dead ones.

A process that calls zl.launch gets one directory, $TMPDIR/zerolab-launch-<pid>-XXXXXXXX, made
by mkdtemp (mode 0700: nobody else can read it or plant a file or a symbolic link in it). It
holds the fork server's socket (multiprocessing would otherwise make a pymp-* directory for it)
(unless $TMPDIR is so long that the socket's path would not fit a Unix socket's) and the
traceback of a rank that fails while starting (zerolab.launch.startup). It is removed when the
process exits.

A process killed with SIGKILL (or a Jupyter kernel shut down: its exit runs no clean-up) removes
nothing itself; its fork server, which outlives it by a moment, removes it
(zerolab.launch.startup_hook). Should both be killed at once, every launch first sweeps the
directories of processes that no longer exist: the pid in the name says whose it was. A pid that has been
reused by another process keeps its directory until that process is gone too (nothing is
removed that might still be in use).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import re
import shutil
import stat
import sys
import tempfile

PREFIX = "zerolab-launch-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-[A-Za-z0-9_]+$")
_mine: dict = {}    # pid -> this process's directory (a fork of it makes its own)
# sun_path, the longest path of a Unix socket (with its final NUL): 108 bytes on Linux, 104 on macOS
SOCKET_PATH_MAX = 108 if sys.platform.startswith("linux") else 104


def private_dir() -> str:
    """This process's private directory (made on first use, removed at exit), after sweeping
    the directories of launchers that are gone (at every launch)."""
    pid = os.getpid()
    sweep()
    if pid not in _mine:
        path = tempfile.mkdtemp(prefix=f"{PREFIX}{pid}-")
        _mine[pid] = path
        atexit.register(_remove, path, pid)
        # the fork server's socket goes here too, instead of a pymp-* directory of its own,
        # unless this process's multiprocessing already has a directory, or the socket's path
        # would be longer than a Unix socket's path may be (a long $TMPDIR)
        config = getattr(mp.current_process(), "_config", None)
        if isinstance(config, dict) and config.get("tempdir") is None and len(path) + len("/listener-12345678") < SOCKET_PATH_MAX:
            config["tempdir"] = path
    return _mine[pid]


def _remove(path: str, pid: int) -> None:
    if os.getpid() == pid:          # not in a forked child that inherited the atexit hook
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:         # someone else's process: alive
        return True
    return True


def sweep(directory: str | None = None) -> list:
    """Remove the private directories of processes that are gone; returns what was removed.
    Only this user's own directories, never through a symbolic link."""
    directory = directory or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if not m or _alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
