"""The communication ledger: zerolab's one door to torch.distributed.

Every collective zerolab runs goes through a Ledger, which records what moved:

    op, dtype, elements of the full tensor, bytes THIS rank sends, group size, and time.

Bytes follow the ring algorithm, where S is the size of the full (unsharded) tensor:

    all-reduce        2 (N-1)/N * S    (a reduce-scatter followed by an all-gather)
    reduce-scatter      (N-1)/N * S
    all-gather          (N-1)/N * S
    broadcast           S for every rank of the pipeline chain except its last, which sends 0
    all-to-all          (N-1)/N * S    (S: this rank's input; 1/N of it goes to each other rank)

That is the number the paper reasons with ("2 Psi per step for data parallelism"), so a
chapter can print the measured total beside it. With a Topology (Ledger.topology, chapter 12)
each record also books how many of those bytes cross to another node (`bytes_inter`): in a ring
this rank sends everything to the next rank of its group, in an all-to-all 1/N to each. Async operations return a Handle whose
wait() stamps the end time, which gives the timelines of chapters 5 and 8.

The ledger keeps the last KEEP_RECORDS records (`records`, oldest first) and, exactly, running
totals per operation and tag, which `bytes()` and `summary()` read: a run of any length holds the
same memory, and a chapter that wants one step's records calls reset() before that step.

A collective that never completes (a rank stuck, crashed, or running different code) would
block its peers until the process group's own timeout. A Ledger with a `timeout` (the default:
$ZEROLAB_COLLECTIVE_TIMEOUT, else 300 s, wherever torch.distributed is initialised: under
zl.launch, torchrun, or a process group you made) waits at most that long and then raises
CollectiveTimeout naming the operation and the ranks that did not arrive (zerolab.runtime.watchdog).
Every collective is first noted in this rank's flight recorder (zerolab.runtime.recorder); a rank that
finds a neighbour already at the same place of the sequence in another collective raises
CollectiveMismatch at once, naming where the ranks' sequences parted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import watchdog
from .recorder import RECORDER

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}

# torch >= 2.12 names these *_single; older releases call them *_tensor / *_into_tensor.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


KEEP_RECORDS = 1024     # records a ledger keeps: several steps of every model in the book


@dataclass(slots=True)
class CommRecord:
    """One collective as seen by this rank."""

    op: str
    dtype: str
    numel: int          # elements of the full tensor S
    bytes_sent: int     # bytes this rank sends under the ring algorithm
    group_size: int
    start: float        # seconds since the ledger was created
    end: float | None = None
    tag: str = ""
    async_op: bool = False
    bytes_inter: int | None = None   # of bytes_sent, those that cross to another node (with a topology)

    @property
    def seconds(self) -> float:
        return float("nan") if self.end is None else self.end - self.start


class CollectiveError(RuntimeError):
    """A collective failed (a peer closed its connection...); the message names the ranks that
    had not arrived, from their flight records."""


class CollectiveTimeout(CollectiveError):
    """A collective did not complete within the ledger's timeout."""


class CollectiveMismatch(CollectiveError):
    """A peer is at this collective's place of the sequence in another collective: the ranks'
    programs parted, and waiting would hang. Raised before this rank enters it."""


class RecordWindow(deque):
    """A ledger's most recent records, oldest first: at most `maxlen`, older ones fall out as new
    ones come. Read it as a list (len, iteration, [i], [a:b])."""

    def __init__(self, records=(), maxlen: int = KEEP_RECORDS):
        super().__init__(records, maxlen)

    def __getitem__(self, i):
        return list(self)[i] if isinstance(i, slice) else super().__getitem__(i)


class Handle:
    """An async collective in flight. wait() blocks until it is done and records the end time."""

    def __init__(self, work, record: CommRecord, ledger: "Ledger", group=None, noted=None, watched=False):
        self._work, self.record, self._ledger = work, record, ledger
        self._group, self._noted, self._watched = group, noted, watched
        self._generation = ledger._generation

    def wait(self) -> None:
        if self._work is not None:
            timeout = self._ledger.timeout
            if not self._watched or timeout is None:   # as long as the process group allows
                self._work.wait()
            else:
                try:
                    if self._work.is_completed():
                        self._work.wait()       # done (or failed) already: nothing to watch
                    else:
                        watchdog.wait(self._work, timeout)
                except RuntimeError as exc:
                    # it waited too long, or it failed at once (a peer closed its connection)
                    raise self._ledger._failed(self, exc) from None
            self._work = None
        if self._noted is not None:
            RECORDER.done(self._noted[0])
            self._noted = None
        if self.record.end is None:
            self.record.end = self._ledger.now()
            self._ledger._finished(self)

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype) -> str:
    """"float32" for torch.float32 (kept: it is asked for at every collective)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def _reduce_op(op: str):
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduce op {op!r}; choose one of {sorted(_OPS)}") from None


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _group_ranks(group) -> list:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


TIMEOUT_ENV = watchdog.TIMEOUT_ENV


def default_timeout() -> float:
    """Seconds a collective may take: $ZEROLAB_COLLECTIVE_TIMEOUT (zl.launch sets it), else 300."""
    return watchdog.default_timeout()


@dataclass
class Ledger:
    """Runs collectives and records each one. Engines own one: `engine.comm`.

    timeout: seconds a collective may take before CollectiveTimeout names the op and the
    ranks that did not arrive (default: default_timeout(), 300 s unless $ZEROLAB_COLLECTIVE_TIMEOUT
    says otherwise; None: wait as long as the process group allows).
    records: the last KEEP_RECORDS records; bytes() and summary() count every collective since the
    last reset(), from running totals.
    """

    group: object = None
    records: RecordWindow = field(default_factory=RecordWindow)
    timeout: float | None = field(default_factory=watchdog.default_timeout)
    topology: object = None          # a zl.Topology: then each record books its cross-node bytes

    def __post_init__(self):
        self._epoch = time.perf_counter()
        self._totals: dict = {}      # (op, tag) -> [calls, bytes sent, of them inter-node, seconds]
        self._generation = 0         # handles from before a reset() add nothing to the new totals

    # --- bookkeeping
    def now(self) -> float:
        return time.perf_counter() - self._epoch

    def reset(self) -> None:
        """Forget all records and totals (the clock keeps running)."""
        self.records.clear()
        self._totals.clear()
        self._generation += 1

    def keep_last(self, n: int) -> None:
        """Keep the last n records from now on (the totals stay exact whatever n is)."""
        self.records = RecordWindow(self.records, maxlen=n)

    def _book(self, rec: CommRecord) -> None:
        self.records.append(rec)
        row = self._totals.get((rec.op, rec.tag))
        if row is None:
            row = self._totals[(rec.op, rec.tag)] = [0, 0, 0, 0.0]
        row[0] += 1
        row[1] += rec.bytes_sent
        row[2] += rec.bytes_inter or 0

    def _finished(self, handle: Handle) -> None:
        if handle._generation == self._generation:
            rec = handle.record
            self._totals[(rec.op, rec.tag)][3] += rec.end - rec.start

    def bytes(self, op: str | None = None, tag: str | None = None, link: str | None = None) -> int:
        """Total bytes this rank sent, optionally only for one op, one tag (a prefix ending in ':'
        matches every tag that starts with it) or one link class ("intra" | "inter": needs a
        topology)."""
        if link not in (None, "intra", "inter"):
            raise ValueError(f"link must be None, 'intra' or 'inter', got {link!r}")
        if link is not None and self.topology is None:
            raise ValueError("bytes by link class need a topology: set ledger.topology = zl.Topology(...)")
        total = 0
        for (r_op, r_tag), (_calls, sent, inter, _s) in self._totals.items():
            if (op is None or r_op == op) and (tag is None or r_tag == tag
                                              or (tag.endswith(":") and r_tag.startswith(tag))):
                total += sent if link is None else inter if link == "inter" else sent - inter
        return total

    def summary(self) -> dict:
        """{op: {"calls": n, "bytes": b, "seconds": s}} over every collective since the last reset."""
        out: dict[str, dict] = {}
        for (op, _tag), (calls, sent, _inter, seconds) in self._totals.items():
            row = out.setdefault(op, {"calls": 0, "bytes": 0, "seconds": 0.0})
            row["calls"] += calls
            row["bytes"] += sent
            row["seconds"] += seconds
        return out

    def _run(self, op, tensor_full_numel, dtype, factor, call, group, async_op, tag, shape=()):
        group = self.group if group is None else group
        n = _group_size(group)
        elem = dtype.itemsize
        rec = CommRecord(op=op, dtype=_dtype_name(dtype), numel=int(tensor_full_numel),
                         bytes_sent=round(factor(n) * tensor_full_numel * elem), group_size=n,
                         start=self.now(), tag=tag, async_op=async_op)
        if self.topology is not None and op not in ("send", "recv"):
            rec.bytes_inter = self._inter_bytes(op, group, rec.bytes_sent)
        self._book(rec)
        if n == 1 or not dist.is_initialized():
            handle = Handle(None, rec, self)  # one rank: the result is already in place, nothing moves
        else:
            pg = group if group is not None else dist.group.WORLD
            noted = RECORDER.note(op, tag, shape, rec.dtype, rec.numel, rec.bytes_sent, pg, n)
            clash = None if noted is None else RECORDER.clash(noted)
            if clash is not None:
                raise CollectiveMismatch(watchdog.mismatch_message(noted, clash, dist.get_rank(), _group_ranks(group))
                                         + watchdog.records_note())
            watched = self.timeout is not None
            work = call(group, async_op or watched)   # watched: asynchronous, so the wait can be bounded
            if not (async_op or watched):
                work = None  # done already (dist.recv even returns the sender's rank, not a Work)
            handle = Handle(work, rec, self, group, noted, watched)
        if async_op:
            return handle
        handle.wait()
        return None

    def _inter_bytes(self, op, group, sent) -> int:
        """How many of the `sent` bytes cross to another node: a ring sends them all to the next
        rank of the group (so does a broadcast's chain), an all-to-all sends an equal part to
        every other rank. Point-to-point sends (zl.collectives' demos) are not booked by link."""
        if not sent or not dist.is_initialized():
            return 0
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        me = dist.get_rank()
        topo = self.topology
        if op == "all_to_all":
            others = [r for r in ranks if r != me]
            return round(sent * sum(topo.link(me, r) == "inter" for r in others) / len(others))
        nxt = ranks[(ranks.index(me) + 1) % len(ranks)]
        return sent if topo.link(me, nxt) == "inter" else 0

    # --- the watchdog (only with a timeout): zerolab.runtime.watchdog
    def _failed(self, handle: Handle, exc) -> CollectiveError:
        rec, noted = handle.record, handle._noted
        waited = "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
        me = dist.get_rank()
        who = watchdog.failure_message(noted, _group_ranks(handle._group), me, self.timeout, waited)
        watchdog.keep_until_exit(handle._group)     # (so that this process can exit at once)
        number = f"collective #{noted[0]}" if noted else "a collective"
        what = f"{rec.op}{f' {rec.tag!r}' if rec.tag else ''} ({number} of rank {me})"
        kind, how = (CollectiveTimeout, f"did not complete within {self.timeout:g} s") if waited else \
            (CollectiveError, "failed: a peer left it")
        return kind(f"{what} {how}. {who} A rank that crashed, hangs, finished early or runs a different "
                    f"sequence of collectives causes this.{watchdog.records_note()} [{exc}]")

    # --- collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group=None, async_op=False, tag=""):
        """tensor <- op over ranks of tensor, in place."""
        red = _reduce_op(op)
        return self._run("all_reduce", tensor.numel(), tensor.dtype, lambda n: 2 * (n - 1) / n,
                         lambda g, a: dist.all_reduce(tensor, op=red, group=g, async_op=a),
                         group, async_op, tag, tensor.shape)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", group=None,
                       async_op=False, tag=""):
        """output <- this rank's 1/N slice of op over ranks of the full `input`."""
        red = _reduce_op(op)
        self._one_nth("reduce_scatter", output, input, group, whole="input")
        return self._run("reduce_scatter", input.numel(), input.dtype, lambda n: (n - 1) / n,
                         lambda g_, a: _reduce_scatter(output, input, op=red, group=g_, async_op=a),
                         group, async_op, tag, input.shape)

    def _one_nth(self, op, output, input, group, whole: str) -> None:
        """`whole` ("input" or "output") must hold N times the other's elements; with a group of
        one there is nothing to communicate: output <- input."""
        n = _group_size(self.group if group is None else group)
        big, small = (input, output) if whole == "input" else (output, input)
        part = "output" if whole == "input" else "input"
        if big.numel() != small.numel() * n:
            raise ValueError(f"{op}: {whole} has {big.numel()} elements; it must be "
                             f"{part} ({small.numel()}) times the group size ({n})")
        if n == 1:
            output.copy_(input.view_as(output))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group=None, async_op=False, tag=""):
        """output <- the concatenation of every rank's `input`."""
        self._one_nth("all_gather", output, input, group, whole="output")
        return self._run("all_gather", output.numel(), output.dtype, lambda n: (n - 1) / n,
                         lambda g_, a: _all_gather(output, input, group=g_, async_op=a),
                         group, async_op, tag, output.shape)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, group=None, async_op=False, tag=""):
        """tensor <- rank src's tensor (src is a rank of the default group)."""
        g = self.group if group is None else group
        n = _group_size(g)
        src_in_group = dist.get_group_rank(g, src) if (dist.is_initialized() and g is not None) else src
        last_in_chain = (src_in_group + n - 1) % n
        sends = 0.0 if _group_rank(g) == last_in_chain else 1.0
        return self._run("broadcast", tensor.numel(), tensor.dtype, lambda n_: sends if n_ > 1 else 0.0,
                         lambda g_, a: dist.broadcast(tensor, src=src, group=g_, async_op=a),
                         group, async_op, tag, tensor.shape)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group=None, tag=""):
        """output[i-th 1/N] <- the i-th rank's input[this rank's 1/N] (equal splits; blocking)."""
        g = self.group if group is None else group
        if output.numel() != input.numel() or input.numel() % _group_size(g):
            raise ValueError(f"all_to_all: input ({input.numel()}) and output ({output.numel()}) must "
                             f"have the same number of elements, a multiple of the group size ({_group_size(g)})")
        if _group_size(g) == 1:
            output.copy_(input)
        return self._run("all_to_all", input.numel(), input.dtype, lambda n: (n - 1) / n,
                         lambda g_, a: dist.all_to_all_single(output, input, group=g_, async_op=a),
                         group, False, tag, input.shape)

    def barrier(self, group=None) -> None:
        """Wait for every rank of the group (recorded with 0 bytes)."""
        self._run("barrier", 0, torch.uint8, lambda n: 0.0,
                  lambda g, a: dist.barrier(group=g, async_op=a), group, False, "")

    # --- point to point (the ring algorithms of zl.collectives are built from these)
    def send(self, tensor: torch.Tensor, dst: int, group=None, tag=""):
        self._run("send", tensor.numel(), tensor.dtype, lambda n: 1.0,
                  lambda g, a: (dist.isend if a else dist.send)(tensor, dst=dst, group=g), group, False, tag, tensor.shape)

    def recv(self, tensor: torch.Tensor, src: int, group=None, tag=""):
        self._run("recv", tensor.numel(), tensor.dtype, lambda n: 0.0,
                  lambda g, a: (dist.irecv if a else dist.recv)(tensor, src=src, group=g), group, False, tag, tensor.shape)

    def isend(self, tensor: torch.Tensor, dst: int, group=None, tag="") -> Handle:
        return self._run("send", tensor.numel(), tensor.dtype, lambda n: 1.0,
                         lambda g, a: dist.isend(tensor, dst=dst, group=g), group, True, tag, tensor.shape)

    def irecv(self, tensor: torch.Tensor, src: int, group=None, tag="") -> Handle:
        return self._run("recv", tensor.numel(), tensor.dtype, lambda n: 0.0,
                         lambda g, a: dist.irecv(tensor, src=src, group=g), group, True, tag, tensor.shape)
