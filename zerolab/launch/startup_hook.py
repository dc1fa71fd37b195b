"""Imported only by zl.launch's fork server (its preload list): see zerolab.launch.startup.

Besides the start-up tracebacks, it makes the fork server end when the process that launched it
ends. multiprocessing's fork server exits only once every rank it forked has exited (each holds
its `alive` pipe), so a rank frozen by SIGSTOP would keep it, and itself, forever. A thread here
waits for the launching process to die, removes its private directory (zerolab.launch.tempdir:
a process killed with SIGKILL, or a Jupyter kernel shut down, never runs its own clean-up) and
ends the fork server; every rank has asked the kernel to kill it when the fork server dies
(zerolab.launch.worker: PR_SET_PDEATHSIG), which reaches a frozen rank too.
"""

import os
import select
import shutil
import threading
import time

from .startup import _directory, install


def _end_with_the_launcher() -> None:
    launcher = os.getppid()

    def watch():
        try:
            fd = os.pidfd_open(launcher)        # Linux 5.3+: readable when the launcher exits
            select.select([fd], [], [])
        except (AttributeError, OSError):      # elsewhere: watch for this process being re-parented
            while os.getppid() == launcher:
                time.sleep(1.0)
        for directory in _directory:           # the launcher's private directory
            shutil.rmtree(directory, ignore_errors=True)
        os._exit(0)

    threading.Thread(target=watch, name="zerolab-end-with-launcher", daemon=True).start()


install()
_end_with_the_launcher()
