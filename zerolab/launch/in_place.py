"""zl.launch under torchrun: the processes already exist, so fn runs in this one.

    values = run_in_place(fn, args, world_size, collective_timeout, timeout)

torchrun has started one process per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set;
this process initialises torch.distributed if nobody has, runs fn, and gathers every rank's value.
What zl.launch promises holds here too:

  * hangs are named per collective: $ZEROLAB_COLLECTIVE_TIMEOUT for zerolab.runtime.watchdog;
  * `timeout` is a whole-job deadline: when it runs out, this rank raises LaunchError (from a
    SIGALRM handler in the main thread; a rank waiting in a collective sees it when the wait ends,
    at most one collective timeout later). Every rank keeps the same deadline, so they all stop;
  * this rank dies with torchrun's agent (PR_SET_PDEATHSIG), even if it is frozen: an agent
    killed by SIGKILL cannot stop its ranks, and they could not go on without its store anyway;
  * the rendezvous store torchrun's agent hosts is unauthenticated, and it listens on every
    interface whatever --master-addr says: the rank that finds it listening so on its node warns.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
import warnings

import torch
import torch.distributed as dist

from .results import LaunchError
from .worker import NCCL_WITH_CPU, die_with_parent
from ..runtime.watchdog import TIMEOUT_ENV

_said: set = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        warnings.warn(message, stacklevel=4)


def run_in_place(fn, args, world_size_, collective_timeout, timeout=None):
    """Under torchrun: run fn here and gather the values (see the module's docstring)."""
    os.environ.setdefault(TIMEOUT_ENV, str(collective_timeout))  # zerolab.runtime.watchdog's default
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None:
        die_with_parent()          # the parent is torchrun's agent
    env_world = int(os.environ["WORLD_SIZE"])
    if world_size_ != env_world and not os.environ.get("ZEROLAB_WORKER"):
        _say_once(f"zerolab.launch: running under torchrun with WORLD_SIZE={env_world}; "
                  f"the world_size={world_size_} argument is ignored.")
    _warn_if_the_store_is_open()
    if not dist.is_initialized():
        start_from_environment(collective_timeout)
    with _deadline(timeout):
        value = fn(*args)
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
    return values


def start_from_environment(collective_timeout: float) -> None:
    """torch.distributed's process group, from torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), on this node's backend (backend_for_this_node)."""
    backend = backend_for_this_node()
    if backend == NCCL_WITH_CPU:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=2 * collective_timeout))


def nccl_fits(ranks: int) -> bool:
    """Whether NCCL can carry `ranks` ranks on this machine: it needs a GPU for each. When a GPU
    exists but too few, say once that every rank uses gloo on the CPU instead. The one rule for
    zl.launch (all ranks on this machine) and for torchrun (the ranks of this node): every rank of
    a machine must decide alike, since a rank on NCCL and one on gloo never meet in a collective."""
    if not torch.cuda.is_available():
        return False
    if torch.cuda.device_count() >= ranks:
        return True
    _say_once(f"zerolab.launch: {ranks} ranks on this machine but {torch.cuda.device_count()} GPU(s); "
              "NCCL needs one GPU per rank, so every rank uses gloo on the CPU.")
    return False


def backend_for_this_node() -> str:
    """Under torchrun: NCCL (with gloo for CPU tensors) when this node has a GPU for each of its
    ranks (LOCAL_WORLD_SIZE), else gloo for all of them."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", int(os.environ.get("LOCAL_RANK", 0)) + 1))
    return NCCL_WITH_CPU if nccl_fits(local_ranks) else "gloo"


@contextlib.contextmanager
def _deadline(timeout):
    """Raise LaunchError in the main thread once `timeout` seconds have passed (None: never)."""
    if timeout is None:
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("launch: timeout= under torchrun is kept with SIGALRM, which only the main "
                         "thread receives: call zl.launch from the main thread, or pass timeout=None "
                         "(hangs are still named per collective)")
    if signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, None):
        raise ValueError("launch: timeout= under torchrun is kept with SIGALRM, which this process "
                         "already uses: pass timeout=None (hangs are still named per collective), "
                         "or give the whole job a limit outside it (your scheduler's, or `timeout`)")

    def out_of_time(signum, frame):
        rank = os.environ.get("RANK", "?")
        raise LaunchError(f"launch: rank {rank} did not finish within the timeout of {timeout:g} s "
                          "and stopped (under torchrun every rank keeps the same deadline). A rank "
                          "waiting in a collective that another rank never called looks like this; "
                          "so does a run that simply needs a longer timeout.", int(rank) if rank.isdigit() else None)

    before = signal.signal(signal.SIGALRM, out_of_time)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def _listening_on_every_interface(port: int) -> bool:
    """Whether this machine has a TCP socket listening on `port` of every interface (0.0.0.0 or ::)."""
    for table, wildcard in (("/proc/net/tcp", "00000000"), ("/proc/net/tcp6", "0" * 32)):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    address, hex_port = cols[1].split(":")
                    if cols[3] == "0A" and int(hex_port, 16) == port and address == wildcard:
                        return True
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return False


def _warn_if_the_store_is_open() -> None:
    """On the node that hosts torchrun's store, warn once that it listens on every interface."""
    if os.environ.get("LOCAL_RANK", "0") != "0" or os.environ.get("ZEROLAB_WORKER"):
        return
    try:
        port = int(os.environ.get("MASTER_PORT", ""))
    except ValueError:
        return
    if _listening_on_every_interface(port):
        _say_once(f"zerolab.launch: torchrun's rendezvous store listens on every interface of this "
                  f"machine (port {port}), whatever --master-addr says, and it is unauthenticated: "
                  "anyone who can reach this machine on that port can join or disturb the job. Run "
                  "on a trusted network, or keep the port behind a firewall.")
