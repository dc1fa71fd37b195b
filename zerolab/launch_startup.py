"""What a rank says if it fails while starting, before zerolab.launch_worker.run is reached.

A rank of zl.launch is forked from a fork server, which first re-imports the caller's script
(so that a function defined there can be found) and unpickles fn and args. An error there (a
script that cannot be imported twice, an argument whose class is gone) happens before the rank
redirects its output to its own files, so its traceback would go to the terminal that started
Python, which a notebook's reader never sees, and the launch would only say "exited with code 1".

The fork server alone calls `install` (it imports zerolab.launch_startup_hook, on zl.launch's
preload list): its excepthook then also writes the traceback to a file named after the failing
process's pid, which the parent quotes in its LaunchError and removes. The caller's own
excepthook is never touched.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback


def path(pid: int) -> str:
    """Where the process `pid` writes its start-up traceback, if it fails while starting."""
    return os.path.join(tempfile.gettempdir(), f"zerolab-start-{pid}.txt")


def take(pid: int) -> str:
    """The start-up traceback of process `pid` ("" if it wrote none), removing its file."""
    try:
        with open(path(pid)) as f:
            text = f.read()
        os.remove(path(pid))
    except OSError:
        return ""
    return text


def install() -> None:
    """Make this process's excepthook (inherited by the ranks it forks) write the traceback
    to path(pid) before printing it as usual."""
    show = sys.excepthook

    def write_then_show(kind, value, tb):
        try:
            with open(path(os.getpid()), "w") as f:
                f.write("".join(traceback.format_exception(kind, value, tb)))
        except OSError:
            pass
        show(kind, value, tb)

    sys.excepthook = write_then_show
