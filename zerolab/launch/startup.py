"""What a rank says if it fails while starting, before zerolab.launch.worker.run is reached.

A rank of zl.launch is forked from a fork server, which first re-imports the caller's script
(so that a function defined there can be found) and unpickles fn and args. An error there (a
script that cannot be imported twice, an argument whose class is gone) happens before the rank
redirects its output to its pipes, so its traceback would go to the terminal that started
Python, which a notebook's reader never sees, and the launch would only say "exited with code 1".

The fork server alone calls `install` (it imports zerolab.launch.startup_hook, on zl.launch's
preload list): its excepthook then also writes the traceback to a file named after the failing
process's pid, in the launching process's private directory (zerolab.launch.tempdir: mode 0700,
so nobody else can plant a file or a link there; the file is created with O_EXCL | O_NOFOLLOW
all the same). The parent quotes it in its LaunchError and removes it. The caller's own
excepthook is never touched.

The fork server learns the directory from $ZEROLAB_LAUNCH_DIR, which the parent sets only while
it starts the fork server, and which the fork server removes from its environment at once.
"""

from __future__ import annotations

import os
import sys
import traceback

DIR_ENV = "ZEROLAB_LAUNCH_DIR"
_directory: list = []   # the fork server: where its ranks write


def path(directory: str, pid: int) -> str:
    """Where the process `pid` writes its start-up traceback, if it fails while starting."""
    return os.path.join(directory, f"start-{pid}.txt")


def take(directory: str, pid: int) -> str:
    """The start-up traceback of process `pid` ("" if it wrote none), removing its file."""
    where = path(directory, pid)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
        os.remove(where)
    except OSError:
        return ""
    return text


def _write(text: str) -> None:
    if not _directory:
        return
    fd = os.open(path(_directory[0], os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def install() -> None:
    """Make this process's excepthook (inherited by the ranks it forks) write the traceback
    to path(directory, pid) before printing it as usual."""
    directory = os.environ.pop(DIR_ENV, None)
    if directory:
        _directory.append(directory)
    show = sys.excepthook

    def write_then_show(kind, value, tb):
        try:
            _write("".join(traceback.format_exception(kind, value, tb)))
        except OSError:
            pass
        show(kind, value, tb)

    sys.excepthook = write_then_show
