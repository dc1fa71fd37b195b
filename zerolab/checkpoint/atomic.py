"""How zerolab writes a file: nothing half-written, nothing followed, nothing left behind.

    with new_file("ckpt/metadata.json") as f:   # created now, exclusively, at a temporary name
        f.write(data)                            # synced, then renamed into place on success;
                                                 # removed on any error (a full disk, Ctrl-C)

The temporary name is created with O_EXCL | O_NOFOLLOW: whatever already sits there (a symbolic
link planted at the name, a leftover of another process with the same pid) is neither followed
nor truncated; the next free name is taken instead. The rename then replaces the entry at the
final name, never what a link there points to. The mode is the one open() gives (0666 less the
umask: 0644 usually).

    with stopping_cleanly():     # SIGTERM raises SystemExit inside: the `except`/`finally` of a
        ...                      # save remove its files before the process ends
    with signals_held():         # the clean-up itself is not cut short by a second SIGTERM or Ctrl-C

zl.launch and torchrun stop the other ranks of a job with SIGTERM when one fails; Python's default
for SIGTERM ends the process at once, without running any clean-up. (A program with a SIGTERM
handler of its own keeps it: it decides.)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def create_exclusive(path: str, mode: int = 0o666) -> int:
    """A new file at `path` (FileExistsError if anything, a link included, is there already)."""
    return os.open(path, _FLAGS, mode)


def _temporary(path: str) -> tuple[str, int]:
    """(name, fd): a new file beside `path`, `path`.tmp-<pid> unless that name is taken."""
    name = f"{path}.tmp-{os.getpid()}"
    for _ in range(16):
        try:
            return name, create_exclusive(name)
        except FileExistsError:
            name = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    raise FileExistsError(f"{path}: no free temporary name beside it")


@contextlib.contextmanager
def new_file(path: str):
    """A binary file object that becomes `path` when the block ends without an error."""
    tmp, fd = _temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with signals_held(), contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_atomically(path: str, data: bytes) -> None:
    with new_file(path) as f:
        f.write(data)


# ------------------------------------------------------------------ being stopped


_held_here = threading.local()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def stopping_cleanly():
    """Inside the block, SIGTERM raises SystemExit (143) instead of ending the process at once,
    so that clean-up code runs; outside, SIGTERM does what it did before. A handler of the
    program's own (a job that saves when it is preempted) is left in charge."""
    if not _main_thread() or getattr(_held_here, "depth", 0) or \
            signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_held():
    """SIGTERM, SIGINT and SIGHUP arriving inside the block wait until it ends (a clean-up that
    takes milliseconds must not be cut in half); then the first takes effect as usual."""
    if not _main_thread() or getattr(_held_here, "depth", 0):
        yield
        return
    held = []
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    saved = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in signals}
    _held_here.depth = 1
    try:
        yield
    finally:
        _held_here.depth = 0
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])


# ------------------------------------------------------------------ a directory replaced whole

_RENAME_EXCHANGE = 2       # renameat2's flag (Linux >= 3.15): swap two paths in one step


def _exchange(a: str, b: str) -> bool:
    """Swap directories a and b in one step where the system can (Linux); False where it cannot."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):   # EINVAL, ENOSYS, EOPNOTSUPP: this file system cannot swap
        return False
    raise OSError(err, os.strerror(err), b)


def _sync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_directory(new: str, path: str) -> None:
    """Put the complete directory `new` at `path`, replacing what is there, so that `path` always
    holds either the old directory or the new one: a rename where nothing is there, a swap in one
    step where the system can (then the old one, now at `new`, is removed). Elsewhere two renames,
    with the old directory parked at `path`.old-<pid> in between: a crash there leaves it there,
    whole (zerolab.checkpoint names it when `path` is found missing)."""
    import shutil
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(path):
        os.rename(new, path)
    elif _exchange(new, path):
        shutil.rmtree(new)
    else:
        parked = f"{path}.old-{os.getpid()}"
        os.rename(path, parked)
        os.rename(new, path)
        shutil.rmtree(parked)
    _sync_directory(parent)
