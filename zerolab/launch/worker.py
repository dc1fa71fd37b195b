"""One rank of zl.launch: what runs inside each started process.

zerolab.launch (the parent side) starts `run` in a fresh process per rank. The rank meets the
others through a key-value store on 127.0.0.1 (rank 0 hosts it), initialises torch.distributed,
runs fn(*args) and sends back what it returned, or its traceback. Its stdout and stderr go to
two pipes of its own (zerolab.launch.output), which the parent shows, prefixed by rank (rank 0's
as they come, the others' when the launch ends; the end of a failed rank's in the error). It ends
if the parent goes away, so no orphan is left running: a thread watches the parent, and the
kernel kills the rank when the fork server it was forked from dies (which it does when the
parent dies: zerolab.launch.startup_hook), even a rank frozen by SIGSTOP, whose threads cannot run.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import sys
import pickle
import socket
import threading
import time
import traceback
import multiprocessing as mp
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from . import output as launch_output

# Under NCCL, CPU tensors travel over gloo: NCCL alone has no CPU path, and a chapter or test
# that builds its model on the CPU (as they all do) must still run when a GPU happens to be
# there (world_size 1 picks NCCL on any GPU box). CUDA tensors still go over NCCL.
NCCL_WITH_CPU = "cpu:gloo,cuda:nccl"

LISTEN_ENV = "ZEROLAB_LAUNCH_ADDR"


def listen_address() -> str:
    """The IPv4 address zl.launch's rendezvous store listens on: 127.0.0.1, unless
    $ZEROLAB_LAUNCH_ADDR names another in so many words.

    The store is unauthenticated: anything that reaches it can join the job or disturb it, and
    zl.launch starts every rank on this machine, so loopback is all it needs. MASTER_ADDR
    (torchrun's, often 0.0.0.0 in cluster scripts) is not taken as that request.
    """
    addr = os.environ.get(LISTEN_ENV)
    if not addr:
        master = os.environ.get("MASTER_ADDR")
        if master and master not in ("127.0.0.1", "localhost") and not os.environ.get("ZEROLAB_WORKER"):
            import warnings
            warnings.warn(f"zl.launch starts every rank on this machine and listens on 127.0.0.1; "
                          f"MASTER_ADDR={master!r} is ignored (set {LISTEN_ENV} to listen elsewhere).",
                          stacklevel=3)
        return "127.0.0.1"
    try:
        ip = socket.getaddrinfo(addr, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))                 # an address of this machine?
    except (socket.gaierror, OSError) as e:
        raise ValueError(f"{LISTEN_ENV}={addr!r}: not an IPv4 address of this machine "
                         f"({getattr(e, 'strerror', None) or e}); zl.launch listens on IPv4 only") from None
    if not ip.startswith("127."):
        import warnings
        warnings.warn(f"zl.launch: the rendezvous store listens on {ip} ({LISTEN_ENV}); it is "
                      "unauthenticated: anyone who reaches that address can join or disturb the job.",
                      stacklevel=3)
    return ip


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent process dies (Linux only): the one
    way to end a process that is frozen (SIGSTOP), since none of its own code runs then."""
    if not sys.platform.startswith("linux"):
        return
    try:
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _watch_parent() -> None:
    """End this worker if the launching process goes away, so no orphan is left running."""
    parent = mp.parent_process()
    if parent is not None:
        wait([parent.sentinel])  # becomes ready when the parent exits
        os._exit(1)


_LISTENER = []  # rank 0's listening socket: kept alive as long as its store


def _rendezvous(rank_, world_size_, addr, port, timeout):
    """The key-value store the ranks meet through, listening on `addr` only.

    TCPStore on its own listens on every interface; handing it a socket we bound ourselves
    keeps it on 127.0.0.1, so nothing a launch starts is reachable from another machine.
    """
    wait = datetime.timedelta(seconds=timeout)
    if rank_ == 0:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(128)
        _LISTENER.append(sock)
        return dist.TCPStore(addr, port, world_size_, True, timeout=wait, wait_for_workers=False,
                             master_listen_fd=sock.fileno())
    return dist.TCPStore(addr, port, world_size_, False, timeout=wait)


def _count_in(store, key: str, world_size_: int, add: bool = True) -> None:
    """Add this rank to a counter in the store, then wait until every rank has."""
    count = store.add(key, 1 if add else 0)
    while count < world_size_:
        time.sleep(0.001)
        count = store.add(key, 0)


def run(fn, args, rank_, world_size_, addr, port, backend, collective_timeout, conn, output):
    """The body of one started rank: its output into two pipes, torch.distributed up, fn(*args),
    the value (or the traceback) sent back through `conn`, then a quick exit.

    collective_timeout bounds every store access and (through $ZEROLAB_COLLECTIVE_TIMEOUT) every
    collective of a zerolab Ledger; the process group's own timeout, twice that, is the backstop
    for collectives called outside a Ledger."""
    die_with_parent()
    # stdout and stderr (also of C++ code) go to this rank's two pipes; the parent shows them.
    launch_output.redirect(*output)
    threading.Thread(target=_watch_parent, daemon=True).start()

    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank_),
                      WORLD_SIZE=str(world_size_), LOCAL_RANK=str(rank_),
                      LOCAL_WORLD_SIZE=str(world_size_), ZEROLAB_WORKER="1",
                      ZEROLAB_COLLECTIVE_TIMEOUT=str(collective_timeout))
    if addr.startswith("127."):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own sockets on loopback too
    torch.set_num_threads(1)  # one compute thread per CPU rank: ranks must not fight for cores
    store = None
    try:
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank_)
            kwargs["device_id"] = torch.device("cuda", rank_)
        store = _rendezvous(rank_, world_size_, addr, port, collective_timeout)
        dist.init_process_group(NCCL_WITH_CPU if backend == "nccl" else backend, store=store,
                                rank=rank_, world_size=world_size_,
                                timeout=datetime.timedelta(seconds=2 * collective_timeout), **kwargs)
        _count_in(store, "zerolab/initialised", world_size_)  # nobody starts before all are connected
        value = fn(*args)
        try:
            payload = pickle.dumps(("ok", value))
        except Exception as exc:  # noqa: BLE001
            payload = pickle.dumps(("error", f"the value returned by fn cannot be sent back "
                                             f"to the parent: {exc!r}"))
    except BaseException:  # noqa: BLE001 - any failure is reported, with its traceback
        payload = pickle.dumps(("error", traceback.format_exc()))
    launch_output.flush()  # everything fn printed is in the files before the parent hears back
    conn.send_bytes(payload)
    conn.close()
    if store is not None:
        # rank 0 hosts the store the others still talk to: it leaves last
        try:
            store.add("zerolab/finished", 1)
            if rank_ == 0:
                _count_in(store, "zerolab/finished", world_size_, add=False)
        except BaseException:  # noqa: BLE001 - the result is already sent; a Ctrl-C can end
            pass               # rank 0 (and its store) first, and that is not this rank's failure
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the result is already sent
            pass
    launch_output.flush()
    os._exit(0)  # skip interpreter teardown: nothing is left to do and it can be slow
