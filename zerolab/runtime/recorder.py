"""The collective flight recorder: each rank's last collectives, where its peers and you can read them.

Every collective a Ledger runs is noted here before it starts: the operation, its tag, dtype and
shape, the bytes this rank sends, its process group and its place in that group's sequence, and
the line of YOUR script that led to it (the first frame outside zerolab, torch and the standard
library). A rank keeps its last SLOTS collectives in a small file mapped into memory:

    $ZEROLAB_RECORD_DIR/run-<date>-<time>-<pid>/rank<r>.rec

(default directory: ~/.cache/zerolab/records, or $XDG_CACHE_HOME/zerolab/records; the newest
KEEP_RUNS runs are kept, and any run an error named, which holds the file KEPT, until you remove it;
ZEROLAB_RECORD_DIR=off turns the recorder off). Noting a collective is a
few writes into that memory: no system call, no message, no thread. The file outlives the rank, so
its record can be read while the rank is frozen (by a peer on the same machine) and after the run,
whether it failed or not (`python -m zerolab doctor DIR`, zerolab.runtime.doctor).

Two uses. When a rank enters a collective it looks at its two neighbours' latest records: a
neighbour that recorded a DIFFERENT collective at this place of the group's sequence (or the
place before: two ranks that enter at the same moment may each look before the other wrote) means
the ranks' programs parted, and waiting would hang until the collective timeout, or exchange
tensors that do not match, so the rank stops at once (`clash`). When a collective fails or times
out, zerolab.runtime.watchdog reads every peer's record to name who did not arrive, and zerolab.runtime.doctor
finds where the ranks' sequences parted.
"""

from __future__ import annotations

import atexit
import mmap
import os
import shutil
import socket
import struct
import sys
import sysconfig
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

DIR_ENV = "ZEROLAB_RECORD_DIR"
SLOTS = 1024            # collectives kept per rank (the file: about 270 KB, written as it fills)
KEEP_RUNS = 20          # runs kept in the default directory (older ones whose processes are gone go)
KEPT = "kept"           # a run's file that keeps it: written when an error names its records
P2P = ("send", "recv")  # pairwise: no place in a group's sequence (a pipeline's ranks differ)

# The file: a header, then SLOTS records in a ring (collective #i lives in slot (i - 1) % SLOTS).
# A slot: index, seq, nbytes, start, group size, done | numel, op, dtype, group, tag | shape, site.
# The middle part is what every rank must agree on at one place of a sequence: compared as bytes.
_HEADER = struct.Struct("<8s i i i i i i q d 64s 64s")   # magic, version, rank, world, pid, slots,
_MAGIC, _HEADER_SIZE = b"ZLREC2\0\0", 256                # state, count, opened, host, run
_STATE_AT, _COUNT_AT = 28, 32                             # byte offsets of header fields
_SLOT = struct.Struct("<q q q d i ? 3x q 16s 12s 16s 48s 40s 80s")
_DONE_AT, _SAME_FROM, _GROUP_FROM, _GROUP_TO, _SAME_TO = 36, 40, 76, 92, 140
_Q, _QQ, _SAME = struct.Struct("<q"), struct.Struct("<q q"), struct.Struct("<q 16s 12s 16s 48s")
RUNNING, FAILED, EXITED = 0, 1, 2
STATES = {RUNNING: "running", FAILED: "raised a collective error", EXITED: "exited"}
SIZE = _HEADER_SIZE + SLOTS * _SLOT.size


@dataclass(frozen=True)
class Entry:
    """One collective as a rank's recorder keeps it."""

    index: int          # this rank's count: "collective #index of rank r"
    seq: int            # its place in its group's sequence (0: point to point)
    nbytes: int         # bytes this rank sends (the ledger's ring model)
    start: float        # time.time() when it was noted
    group_size: int
    done: bool
    numel: int
    op: str
    dtype: str
    group: str          # the process group's name ("0": the default group)
    tag: str
    shape: str
    site: str           # "train.py:41": the line of the user's code that led to it

    def same_call(self, other: "Entry") -> bool:
        """What every rank must agree on at one place of a group's sequence."""
        return (self.op, self.tag, self.dtype, self.numel) == (other.op, other.tag, other.dtype, other.numel)

    def label(self) -> str:
        return f"{self.op}{f' {self.tag!r}' if self.tag else ''}"

    def where(self) -> str:
        return f"{self.label()} ({self.site or 'no line of yours'})"


@dataclass
class RankRecord:
    """A rank's file, read: who wrote it and its last collectives, oldest first."""

    rank: int
    world: int
    pid: int
    host: str
    run: str
    state: int
    count: int          # collectives noted so far
    entries: list

    def in_group(self, group: str) -> dict:
        return {e.seq: e for e in self.entries if e.group == group and e.seq}

    def process(self) -> str:
        """How its process is, in words, where this machine can see it ("" if running normally)."""
        if self.host != socket.gethostname():
            return ""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "its process has ended"
        return {"T": "its process is stopped: SIGSTOP or a debugger", "t": "its process is stopped by a debugger",
                "Z": "its process has ended", "X": "its process has ended"}.get(state, "")


def _decode(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def _slot(index: int) -> int:
    return _HEADER_SIZE + (index - 1) % SLOTS * _SLOT.size


def _entry(buf, index: int) -> Entry | None:
    """Collective #index from a file's bytes, or None if its slot holds another one by now."""
    fields = _SLOT.unpack_from(buf, _slot(index))
    if fields[0] != index:
        return None
    return Entry(*fields[:7], *(_decode(b) for b in fields[7:]))


def parse(buf) -> RankRecord | None:
    """A recorder file's bytes (an mmap or bytes) as a RankRecord; None if it is not one."""
    if len(buf) < SIZE or bytes(buf[:8]) != _MAGIC:
        return None
    _magic, _version, rank, world, pid, _slots, state, count, _t, host, run = _HEADER.unpack_from(buf, 0)
    entries = [_entry(buf, i) for i in range(max(1, count - SLOTS + 1), count + 1)]
    return RankRecord(rank, world, pid, _decode(host), _decode(run), state, count,
                      [e for e in entries if e is not None])   # (a slot rewritten just now is left out)


def read(path: str) -> RankRecord | None:
    try:
        with open(path, "rb") as f:
            return parse(f.read(SIZE))
    except OSError:
        return None


def read_run(run_dir: str) -> dict:
    """{rank: RankRecord} of every rank's file in a run's directory."""
    out = {}
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("rank") and name.endswith(".rec"):
            rec = read(os.path.join(run_dir, name))
            if rec is not None:
                out[rec.rank] = rec
    return out


# ------------------------------------------------------------------ the line of the user's code

_ZEROLAB = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # (this file is in zerolab/runtime/)
_INTERNAL = (_ZEROLAB + os.sep, os.path.dirname(torch.__file__) + os.sep,
             sysconfig.get_paths()["stdlib"] + os.sep)
_sites: dict = {}       # code object -> its file's name (bytes), or None for zerolab, torch, the stdlib


def user_site() -> bytes:
    """b"file:line" of the innermost frame outside zerolab, torch and the standard library.
    Cheap: each code object is classified once. (b"" where there is none: autograd's own thread.)"""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        name = _sites.get(code, False)
        if name is False:
            path = code.co_filename
            internal = path.startswith(_INTERNAL) or path.startswith("<frozen")
            name = _sites[code] = None if internal else os.path.basename(path).encode()
        if name is not None:
            return b"%s:%d" % (name, frame.f_lineno)
        frame = frame.f_back
    return b""


# ------------------------------------------------------------------ the directory of runs


def record_root() -> str | None:
    """$ZEROLAB_RECORD_DIR, else ~/.cache/zerolab/records; None when recording is off."""
    value = os.environ.get(DIR_ENV, "").strip()
    if value.lower() == "off":
        return None
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return value or os.path.join(cache, "zerolab", "records")


def _prune(root: str, current: str) -> None:
    """Remove runs beyond the newest KEEP_RUNS whose processes on this machine have all ended
    (only folders that hold nothing but recorder files)."""
    runs = sorted(d for d in os.listdir(root) if d.startswith("run-") and d != current)
    for old in runs[:max(0, len(runs) - KEEP_RUNS + 1)]:
        path = os.path.join(root, old)
        try:
            names = [] if os.path.islink(path) else os.listdir(path)
            if not names or any(not (n.startswith("rank") and n.endswith(".rec")) for n in names):
                continue
            if any(rec.process() == "" for rec in read_run(path).values()):
                continue          # a rank of it still runs (or was stopped, or is on another machine)
            shutil.rmtree(path)
        except OSError:
            pass


def _agree_on_run() -> str:
    """The run's folder name, the same on every rank: the first rank to ask the store sets it."""
    mine = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    try:
        store = dist.distributed_c10d._get_default_store()
        return store.compare_set("zerolab/record-run", "", mine).decode()
    except Exception:  # noqa: BLE001 - no store (MPI) or a store that failed: a folder of its own
        return mine + "-alone"


# ------------------------------------------------------------------ this rank's recorder


class Recorder:
    """This process's flight recorder (one per process: RECORDER), shared by every Ledger."""

    def __init__(self):
        self.enabled = True
        self.count = 0                  # collectives noted in this run (all groups)
        self.run_dir = None
        self._mm = None
        self._seq: dict = {}            # group name -> (its collectives so far, # of the last, its bytes)
        self._groups: dict = {}         # id(process group) -> (weakref, name, name bytes, neighbours)
        self._peers: dict = {}          # rank -> a read-only mmap of its file, or when to look again
        self._world = None              # the default process group this run belongs to
        self._names: dict = {}          # (op, tag, dtype, shape, group) -> their bytes

    # -- opening a run
    def _open(self) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self._world = weakref.ref(dist.distributed_c10d._get_default_group())
        self.count, self._seq, self._peers, self._groups = 0, {}, {}, {}
        self._mm, self.run_dir, root = None, None, record_root()
        if root is None:                # ZEROLAB_RECORD_DIR=off
            self.enabled = False
            return
        run = _agree_on_run()
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
            self.run_dir = os.path.join(root, run)
            try:
                os.mkdir(self.run_dir, 0o700)
                _prune(root, run)       # the first rank of this machine in the run tidies up
            except FileExistsError:
                pass
            fd = os.open(os.path.join(self.run_dir, f"rank{rank}.rec"),
                         os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.ftruncate(fd, SIZE)
                self._mm = mmap.mmap(fd, SIZE)
            finally:
                os.close(fd)
        except OSError:                 # a read-only or full disk: keep the record in memory only
            self._mm, self.run_dir = mmap.mmap(-1, SIZE), None
        _HEADER.pack_into(self._mm, 0, _MAGIC, 2, rank, world, os.getpid(), SLOTS, RUNNING, 0,
                          time.time(), socket.gethostname().encode(), run.encode())

    def _join(self, pg):
        """A process group seen for the first time: its name and this rank's two neighbours in it."""
        world = dist.distributed_c10d._get_default_group()
        if self._mm is None or self._world() is not world:
            self._open()                # the first collective of this run (or of a new one)
            if not self.enabled:
                return None
        ranks = dist.get_process_group_ranks(pg)
        if dist.get_rank() not in ranks:
            return None                 # (torch does nothing for a rank outside the group)
        me = ranks.index(dist.get_rank())
        neighbours = sorted({ranks[(me - 1) % len(ranks)], ranks[(me + 1) % len(ranks)]} - {ranks[me]})
        info = self._groups[id(pg)] = (weakref.ref(pg), pg.group_name, pg.group_name.encode(), neighbours)
        return info

    def _encode(self, op, tag, dtype, shape, name, name_b, numel) -> tuple:
        """The bytes of a collective's names, and the bytes every rank must agree on (what its
        slot holds from _SAME_FROM to _SAME_TO); kept: they repeat (at most 4096 kinds kept)."""
        if len(self._names) > 4096:
            self._names.clear()
        op_b, dtype_b, tag_b = op.encode(), dtype.encode(), tag.encode()
        names = (op_b, dtype_b, tag_b, "x".join(map(str, shape)).encode(),
                 _SAME.pack(numel, op_b, dtype_b, name_b, tag_b))
        self._names[(op, tag, dtype, shape, name)] = names
        return names

    # -- the hot path: note, wait, done
    def note(self, op: str, tag: str, shape, dtype: str, numel: int, nbytes: int, pg, group_size: int):
        """Record the collective this rank is about to enter; returns (index, seq, neighbours, its
        bytes to agree on, those of the one before in its group) for `clash` and `done`, or None
        when the recorder is off.
        pg: the process group object (not None)."""
        if not self.enabled:
            return None
        info = self._groups.get(id(pg))
        if info is None or info[0]() is not pg:
            info = self._join(pg)
            if info is None:            # ZEROLAB_RECORD_DIR=off, or not a member of the group
                return None
        _, name, name_b, neighbours = info
        names = self._names.get((op, tag, dtype, shape, name))
        if names is None:
            names = self._encode(op, tag, dtype, shape, name, name_b, numel)
        self.count = index = self.count + 1
        seq, before = 0, None
        if op not in P2P:
            seq, _, before = self._seq.get(name, (0, 0, None))
            seq += 1
            self._seq[name] = (seq, index, names[4])
        _SLOT.pack_into(self._mm, _HEADER_SIZE + (index - 1) % SLOTS * _SLOT.size, index, seq, nbytes, time.time(),
                        group_size, False, numel, names[0], names[1], name_b, names[2], names[3], user_site())
        _Q.pack_into(self._mm, _COUNT_AT, index)
        return index, seq, neighbours, names[4], before

    def done(self, index: int) -> None:
        """Collective #index completed."""
        if self._mm is not None and self.count - index < SLOTS:
            self._mm[_HEADER_SIZE + (index - 1) % SLOTS * _SLOT.size + _DONE_AT] = 1

    def mark(self, state: int) -> None:
        if self._mm is not None:
            struct.pack_into("<i", self._mm, _STATE_AT, state)

    # -- reading peers
    def peer_buffer(self, rank: int, now: bool = False):
        """A read-only view of a peer's file when it is on this machine, else None. A file not
        there yet (the peer has not reached its first collective, or it runs on another machine)
        is looked for again at this rank's 2nd, 4th, 8th ... collective, or `now`."""
        view = self._peers.get(rank, 0)
        if not isinstance(view, int):
            return view
        if self.run_dir is None or (self.count < view and not now):
            return None
        try:
            with open(os.path.join(self.run_dir, f"rank{rank}.rec"), "rb") as f:
                self._peers[rank] = mmap.mmap(f.fileno(), SIZE, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            self._peers[rank] = 2 * self.count
            return None
        return self._peers[rank]

    def peer(self, rank: int) -> RankRecord | None:
        buf = self.peer_buffer(rank, now=True)
        return None if buf is None else parse(buf)

    def own(self) -> RankRecord | None:
        return None if self._mm is None else parse(self._mm)

    def clash(self, noted) -> tuple | None:
        """(neighbour, its Entry) when a neighbour recorded a different collective than this rank
        at this place of the group's sequence or the place before (the ranks' programs parted).
        Two ranks that enter a place at the same moment may each look before the other wrote;
        the place before catches that at the next collective. Looks at the neighbours' last 8
        records only: a few microseconds."""
        index, seq, neighbours, same, before = noted
        if not seq:
            return None
        mine = {seq: same, seq - 1: before}
        group = same[_GROUP_FROM - _SAME_FROM:_GROUP_TO - _SAME_FROM]
        for rank in neighbours:
            buf = self._peers.get(rank)
            if not isinstance(buf, mmap.mmap):
                buf = self.peer_buffer(rank)
                if buf is None:
                    continue
            count = _Q.unpack_from(buf, _COUNT_AT)[0]
            for i in range(count, max(0, count - 8), -1):
                at = _HEADER_SIZE + (i - 1) % SLOTS * _SLOT.size
                their_index, their_seq = _QQ.unpack_from(buf, at)
                if their_index != i or not 0 < their_seq <= seq or buf[at + _GROUP_FROM:at + _GROUP_TO] != group:
                    continue            # another group's, a point-to-point one, or a later one of this group
                theirs = buf[at + _SAME_FROM:at + _SAME_TO]
                if mine.get(their_seq, theirs) != theirs:
                    return rank, _entry(buf, i)
                if their_seq < seq:
                    break               # it has not reached this place yet (the one before agrees)
        return None


RECORDER = Recorder()


@atexit.register
def _exiting():
    """A process that ends normally says so in its record (zl.launch's ranks skip this: os._exit;
    their peers then see that the process ended)."""
    if RECORDER._mm is not None and struct.unpack_from("<i", RECORDER._mm, _STATE_AT)[0] == RUNNING:
        RECORDER.mark(EXITED)
