"""Start real worker processes with torch.distributed initialised.

    zl.launch(fn, world_size=2, args=(...))  ->  [value of rank 0, value of rank 1]

Every rank is a fresh operating-system process. The parent picks one free port on
127.0.0.1 (nothing listens on any other interface unless $ZEROLAB_LAUNCH_ADDR names one), starts the
ranks, and waits. What `fn` returns is sent back to the parent, so a notebook shows results
in rank order, the same on every run. What the workers print (stdout and stderr, C++ output
too) goes into pipes, one pair per rank, that the parent reads as they write: rank 0's lines
are shown as they come, the other ranks' when all are done, rank by rank, each line prefixed
`[rank r] ` -- by default rank 0's output and the other ranks' warnings and errors
(output="rank0" | "all" | "none"; see zerolab.launch.output).

Failures end the whole launch quickly and leave no process behind:
  * a rank that raises -> LaunchError naming the rank, with the worker's traceback;
  * a rank that dies (os._exit, a signal) -> LaunchError naming the rank and how it died;
  * a rank that stops (hangs, freezes, runs other collectives) -> the ranks waiting for it raise
    zerolab.runtime.comm.CollectiveTimeout after `collective_timeout` seconds (300 by default), naming it
    and the operation it last entered; there is no whole-job deadline unless `timeout` sets one
    (then: LaunchError naming the ranks still running);
  * the launching process dies (even by SIGKILL) -> the ranks and the fork server end with it,
    a frozen rank included, and the next launch removes the private directory it left
    (zerolab.launch.tempdir).

Under torchrun (RANK and WORLD_SIZE in the environment) there is nothing to start:
`launch` runs fn in the current process and returns every rank's value, gathered.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import signal
import socket
import sys
import tempfile
import threading
import time
import multiprocessing as mp

import torch
import torch.distributed as dist

from . import output as launch_output, startup as launch_startup, tempdir as launch_tempdir, worker as launch_worker
from .in_place import nccl_fits, run_in_place
from .results import LaunchError, collect
from ..runtime.watchdog import DEFAULT_TIMEOUT, check_timeout


# --------------------------------------------------------------------- who am I?


def rank() -> int:
    """This process's rank (0 outside any distributed run)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    """Number of ranks in the run (1 outside any distributed run)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------- checks


def _check_launchable(fn, world_size, timeout, backend, collective_timeout=DEFAULT_TIMEOUT) -> None:
    """Reject bad input before any process starts."""
    if not callable(fn):
        raise TypeError(f"launch: fn must be a function, got {type(fn).__name__} ({fn!r})")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"launch: world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"launch: world_size must be >= 1, got {world_size}")
    check_timeout(timeout, "timeout", allow_none=True)
    check_timeout(collective_timeout, "collective_timeout", allow_none=False)
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"launch: backend must be None, 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and (not torch.cuda.is_available() or torch.cuda.device_count() < world_size):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(
            f"launch: backend='nccl' needs one GPU per rank: {world_size} ranks, {have} GPUs. "
            "NCCL refuses two ranks on one GPU; use backend='gloo' (or None) instead.")

    target = fn
    while hasattr(target, "func"):  # functools.partial: check what it wraps
        target = target.func
    name = getattr(target, "__qualname__", getattr(target, "__name__", repr(target)))
    why = ("Worker processes import fn by name, so it must be a plain function defined at the "
           "top level of an importable .py module (for example zerolab.workers or a file "
           "next to your notebook), not ")
    if name == "<lambda>":
        raise ValueError(f"launch: fn is a lambda. {why}a lambda.")
    if "<locals>" in name:
        raise ValueError(f"launch: fn {name!r} is defined inside another function. {why}a nested function.")
    if getattr(target, "__module__", None) == "__main__":
        main = sys.modules.get("__main__")
        if main is None or not getattr(main, "__file__", None):
            raise ValueError(
                f"launch: fn {name!r} was defined in a notebook cell or an interactive session. "
                f"{why}a cell. Move it into a .py file and import it.")
        if not os.path.isfile(main.__file__):   # `python - < script.py`: __file__ is '<stdin>'
            raise ValueError(
                f"launch: fn {name!r} was defined in a script read from standard input "
                f"({main.__file__}). {why}a stream. Save the script to a file and run that file.")
    try:
        pickle.dumps(fn)
    except Exception as exc:  # noqa: BLE001 - report any pickling failure the same way
        raise ValueError(f"launch: fn {name!r} cannot be sent to a worker process ({exc}). {why}this.") from None


def _choose_backend(world_size: int, backend: str | None) -> str:
    if backend is not None:
        return backend
    return "nccl" if nccl_fits(world_size) else "gloo"


# --------------------------------------------------------------------- the worker side
#
# What runs inside each started process (meeting the others, initialising torch.distributed,
# running fn, sending its value back) is zerolab.launch.worker.


def _free_port(addr: str) -> int:
    """A port that is free now on `addr` (chosen once, in the parent), below the range the
    kernel hands out to outgoing connections when it can: rank 0 binds it a moment later, and
    a port from that range may meanwhile become the local end of some other connection (gloo
    opens many), which rank 0's bind would then find in use."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(max(1024, low - 12288), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))               # (every try taken: any free port)
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port of the kernel's range for outgoing connections (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# --------------------------------------------------------------------- the parent side

_CONTEXT = None


def process_context():
    """Processes come from a fork server that has imported torch and nothing of the caller.

    Each rank is still a fresh process that never ran the caller's code, but it starts in
    a fraction of a second instead of re-importing torch (seconds per rank). Platforms
    without a fork server use plain spawn.
    """
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in mp.get_all_start_methods():
            _CONTEXT = mp.get_context("forkserver")
            # (zerolab.launch.startup: a rank that fails while starting leaves its traceback;
            # torch._dynamo: building any torch optimizer imports it, over a second per rank
            # when each rank does it, ~0 when the fork server has done it once)
            _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "zerolab",
                                             "zerolab.launch.startup_hook"])
        else:
            _CONTEXT = mp.get_context("spawn")
    return _CONTEXT


@contextlib.contextmanager
def _main_module_hidden(fn):
    """Keep workers from re-running the caller's script when fn lives in another module.

    multiprocessing re-executes the parent's __main__ in every child so that functions
    defined there can be found. When fn comes from an importable module that is pure cost,
    and it breaks for `python -` or scripts without an `if __name__ == "__main__"` guard.
    """
    target = fn
    while hasattr(target, "func"):
        target = target.func
    main = sys.modules.get("__main__")
    if main is None or getattr(target, "__module__", None) == "__main__":
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _stop(procs) -> None:
    """Terminate, then kill, every process still alive; reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
            with contextlib.suppress(OSError):    # a frozen rank (SIGSTOP) takes SIGTERM once it runs
                os.kill(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def launch(fn, world_size: int = 2, args: tuple = (), backend: str | None = None,
           timeout: float | None = None, output: str | None = None,
           collective_timeout: float = DEFAULT_TIMEOUT) -> list:
    """Run fn(*args) on `world_size` ranks and return their values in rank order.

    timeout: seconds the whole job may take (None, the default: as long as it trains).
    collective_timeout: seconds one collective (or one access to the rendezvous store) may wait
    before the rank waiting names the ranks that did not arrive (zerolab.runtime.comm); the same under
    torchrun, where this call runs fn in place.

    What the ranks print is shown with each line prefixed `[rank r] `, stdout to sys.stdout and
    stderr to sys.stderr: rank 0's as it comes, the other ranks' after they have all returned (or
    before the LaunchError, whose message quotes the end of a dead rank's output instead of
    showing it), rank by rank.
    output: "rank0" (rank 0's stdout and stderr, the other ranks' stderr: warnings, errors),
    "all" (every rank's stdout and stderr) or "none"; None takes $ZEROLAB_LAUNCH_OUTPUT, else
    "rank0". Under torchrun each process prints for itself and `output` has no effect; `timeout`
    ends this rank with a LaunchError when it runs out (zerolab.launch.in_place).
    """
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError(
            "zl.launch was called while a rank was starting: every rank re-runs the script that "
            "defines fn, so a call at the script's top level runs again in each rank. Put it under "
            "`if __name__ == \"__main__\":`.")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"launch: args must be a tuple of arguments for fn, got {type(args).__name__}")
    output = launch_output.resolve(output)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if not callable(fn):
            raise TypeError(f"launch: fn must be a function, got {type(fn).__name__}")
        check_timeout(timeout, "timeout", allow_none=True)
        check_timeout(collective_timeout, "collective_timeout", allow_none=False)
        return run_in_place(fn, tuple(args), world_size, collective_timeout, timeout)
    _check_launchable(fn, world_size, timeout, backend, collective_timeout)
    backend = _choose_backend(world_size, backend)
    addr = launch_worker.listen_address()   # loopback, unless asked otherwise in so many words

    ctx = process_context()
    port = _free_port(addr)
    private = launch_tempdir.private_dir()   # (sweeps the directories of dead launchers first)
    outputs = launch_output.RankOutputs(world_size, output)
    procs, conns = [], []
    quoted = None   # a failed rank whose output's end is in the error message
    try:
        _end_on_signals()
        for r in range(world_size):
            receive, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=launch_worker.run, name=f"zerolab-rank{r}",
                            args=(fn, tuple(args), r, world_size, addr, port, backend,
                                  collective_timeout, send, outputs.ends(r)))
            try:
                # Ctrl-C, SIGTERM or SIGHUP wait until the rank is in procs: arriving inside
                # start() (the first one starts the fork server: seconds), they would leave a
                # running rank that nothing stops and that Python's exit would wait for forever
                with _interrupts_held(), _main_module_hidden(fn), _fork_server_told(private):
                    p.start()
                    procs.append(p)
            except Exception as exc:  # noqa: BLE001 - said as what it is: see _start_failure
                raise LaunchError(_start_failure(r, exc), r) from None
            send.close()  # the child holds the only sending end: EOF means it died
            outputs.started(r)
            conns.append(receive)
        values = collect(procs, conns, outputs, private, timeout)
        _let_finish(procs)  # they have sent their values and are exiting: keep their last words
        return values
    except LaunchError as exc:
        quoted = exc.rank if exc.quoted_output else None
        raise
    finally:
        with _interrupts_held():
            _stop(procs)
            for c in conns:
                c.close()
            for p in procs:
                launch_startup.take(private, p.pid)   # a start-up traceback nobody quoted: remove its file
            outputs.close()
            outputs.show_rest(skip=quoted)


def _start_failure(r: int, exc: Exception) -> str:
    """Why rank r could not be started, as what it is: an argument that cannot be sent to a new
    process (pickling fails), the operating system refusing (no fork server to ask, no processes
    or memory left), or anything else, quoted."""
    if isinstance(exc, pickle.PicklingError) or "pickle" in str(exc).lower():
        return (f"launch: could not start rank {r}: {exc!r}. Every argument in args must be picklable "
                "(tensors, numbers, dataclasses...).")
    if isinstance(exc, OSError) and "path too long" in str(exc):
        where = tempfile.gettempdir()
        return (f"launch: could not start rank {r}: the fork server's socket cannot be made in $TMPDIR "
                f"({where!r}, {len(where)} characters): a Unix socket's path may be "
                f"{launch_tempdir.SOCKET_PATH_MAX - 1} bytes at most, file name included. Nothing of fn "
                "ran. Set TMPDIR to a shorter directory (TMPDIR=/tmp, say) and run again.")
    if isinstance(exc, OSError):
        return (f"launch: could not start rank {r}: the operating system refused ({exc!r}); nothing of fn "
                "ran. The fork server that starts the ranks may be gone (its socket removed, e.g. by a "
                "clean-up of the temporary directory), or the machine out of processes or memory.")
    return f"launch: could not start rank {r}: {exc!r}"


@contextlib.contextmanager
def _fork_server_told(directory: str):
    """While a rank starts (the first start starts the fork server), $ZEROLAB_LAUNCH_DIR names
    the private directory where a rank that fails while starting leaves its traceback
    (zerolab.launch.startup); the fork server takes it from its environment at once."""
    os.environ[launch_startup.DIR_ENV] = directory
    try:
        yield
    finally:
        os.environ.pop(launch_startup.DIR_ENV, None)


def _let_finish(procs, grace: float = 2.0) -> None:
    """Wait briefly for ranks that have sent their value to exit, so whatever they write while
    shutting down is shown on every run, not only when it beats _stop."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


def _end_on_signals() -> None:
    """SIGTERM or SIGHUP to this process (a job scheduler, a closed terminal) ends the launch as
    Ctrl-C does: the ranks are stopped and their files removed (launch's finally)."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, stop)


@contextlib.contextmanager
def _interrupts_held():
    """Stopping the ranks and removing their files takes a moment (up to a few seconds): a
    second Ctrl-C, or a SIGTERM, arriving then is held until the clean-up is done, so that it
    cannot leave processes or files behind. It then takes effect as usual."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    saved = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])     # now, with the handler it had before
