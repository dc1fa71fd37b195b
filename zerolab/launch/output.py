"""What launched workers print, and how zl.launch shows it.

Each rank of zl.launch writes its stdout and its stderr into two pipes of its own. The
redirection is os.dup2 on file descriptors 1 and 2, so output of C and C++ code (a torch warning
from C++, os.write(1, ...)) is captured as well as Python's print and warnings.warn. In the
parent one thread (RankOutputs' pump) reads every pipe as the ranks write, so no rank ever waits
on a full pipe and nothing is held whole: a rank that prints gigabytes costs the parent a
bounded amount of memory.

Rank 0's lines are shown AS THEY COME, each prefixed `[rank 0] `, its stdout to the caller's
sys.stdout and its stderr to sys.stderr: an hour-long run shows its progress. The other ranks'
output is shown when the launch ends, rank by rank, stdout then stderr, each line prefixed
`[rank r] ` (the last KEEP characters of each stream; the number of characters left out is
said). Which ranks and streams are shown is the `output` choice:

    "rank0"  rank 0's stdout and stderr, and the stderr (warnings, errors) of every other rank
    "all"    every rank's stdout and stderr
    "none"   nothing

Why only rank 0 live, and why two streams rather than one interleaved: the ranks run at the
same time, so showing every rank's lines as they come would mix them differently on every run,
and a notebook's committed output must be the same each time. Keeping the streams apart is what
lets "rank0" show only the other ranks' warnings and lets stderr land in sys.stderr (Jupyter
keeps the two streams apart as well).
"""

from __future__ import annotations

import codecs
import ctypes
import os
import selectors
import sys
import threading
from collections import deque
from multiprocessing.connection import Connection

CHOICES = ("rank0", "all", "none")
ENV = "ZEROLAB_LAUNCH_OUTPUT"   # the default when launch(..., output=None)

KEEP = 1 << 20          # characters of a stream shown at the end that are kept (its last ones)
KEEP_LIVE = 1 << 16     # characters kept of a live stream: for the error message of a failed rank 0
LONGEST_LINE = 1 << 16  # a live "line" without a newline is shown once it is this long


def resolve(output: str | None) -> str:
    """The output choice in force: the keyword if given, else $ZEROLAB_LAUNCH_OUTPUT, else "rank0"."""
    listed = ", ".join(repr(c) for c in CHOICES)
    if output is None:
        env = os.environ.get(ENV, "").strip()
        if not env:
            return "rank0"
        if env not in CHOICES:
            raise ValueError(f"launch: the environment variable {ENV}={env!r} must be one of {listed}")
        return env
    if output not in CHOICES:
        raise ValueError(f"launch: output must be one of {listed} (rank 0's output and the other "
                         f"ranks' stderr / every rank's output / nothing), got {output!r}")
    return output


# --------------------------------------------------------------------- in the worker


def redirect(out: Connection, err: Connection) -> None:
    """Send this process's file descriptors 1 and 2 (Python's and C's output) into the two pipes."""
    flush()
    for fd, conn in ((1, out), (2, err)):
        os.dup2(conn.fileno(), fd)
        conn.close()
    if sys.stdout is not None and hasattr(sys.stdout, "reconfigure"):
        # line by line: the parent shows rank 0's lines as they come, and a rank that dies mid-run
        # (a signal, os._exit) still leaves what it printed
        sys.stdout.reconfigure(line_buffering=True)


def flush() -> None:
    """Write out what Python and the C library still hold (the worker ends with os._exit)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - a closed or odd stream must not hide the result
            pass
    try:
        ctypes.CDLL(None).fflush(None)   # C stdio buffers: printf from C/C++ code
    except Exception:  # noqa: BLE001 - not every platform exposes libc this way
        pass


# --------------------------------------------------------------------- in the parent


def prefixed(text: str, rank: int) -> str:
    """Every line of `text` prefixed `[rank r] `; a last line without a newline is kept, nothing
    else is stripped; empty text stays empty."""
    if not text:
        return ""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return "".join(f"[rank {rank}] {line}\n" for line in lines)


def _write(name: str, text: str) -> None:
    stream = sys.stdout if name == "out" else sys.stderr   # looked up now: pytest and Jupyter swap them
    if text and stream is not None:
        try:
            stream.write(text)
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed terminal must not stop the draining
            pass


class _Stream:
    """One pipe of one rank: decoded as it comes, its last characters kept, shown live or not."""

    def __init__(self, fd: int, rank: int, name: str, live: bool):
        self.fd, self.rank, self.name, self.live = fd, rank, name, live
        self.keep = KEEP_LIVE if live else KEEP
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.kept: deque = deque()
        self.kept_chars = 0
        self.dropped = 0           # characters no longer kept
        self.partial = ""          # live: the last line, not finished yet
        self.ended = threading.Event()
        self.lock = threading.Lock()   # the pump appends while a failed rank's tail is read

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self.decoder.decode(data, final=final)
        with self.lock:
            self._keep(text)
        if self.live:
            pending = self.partial + text
            cut = len(pending) if final or len(pending) >= LONGEST_LINE else pending.rfind("\n") + 1
            self.partial = pending[cut:]
            _write(self.name, prefixed(pending[:cut], self.rank))

    def _keep(self, text: str) -> None:
        if text:
            self.kept.append(text)
            self.kept_chars += len(text)
            while self.kept_chars - len(self.kept[0]) >= self.keep:
                self.kept_chars -= len(self.kept[0])
                self.dropped += len(self.kept.popleft())

    def text(self) -> tuple[str, int]:
        """(the last `keep` characters, how many came before them and are not kept)."""
        with self.lock:
            text, dropped = "".join(self.kept), self.dropped
        if len(text) > self.keep:
            dropped += len(text) - self.keep
            text = text[-self.keep:]
        return text, dropped


class RankOutputs:
    """The parent's side: two pipes per rank, read by one thread as the ranks write.

        outputs = RankOutputs(world_size, mode)
        out, err = outputs.ends(r)         # pass to the rank (launch_worker.run), then:
        outputs.started(r)                 # the parent's copies of the writing ends closed
        ...
        outputs.tail(r)                    # a failed rank's last words, for the error
        outputs.close(); outputs.show_rest(skip)
    """

    def __init__(self, world_size: int, mode: str):
        self.mode = mode
        self.streams: list = []
        self._ends: list = []
        self._selector = selectors.DefaultSelector()
        for r in range(world_size):
            pair, ends = [], []
            for name in ("out", "err"):
                read, write = os.pipe()
                os.set_blocking(read, False)
                stream = _Stream(read, r, name, live=(r == 0 and mode != "none"))
                self._selector.register(read, selectors.EVENT_READ, stream)
                pair.append(stream)
                ends.append(Connection(write, readable=False))
            self.streams.append(pair)
            self._ends.append(ends)
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._run, name="zerolab-launch-output", daemon=True)
        self._pump.start()

    def ends(self, r: int):
        """The writing ends of rank r's stdout and stderr pipes, to hand to the rank."""
        return tuple(self._ends[r])

    def started(self, r: int) -> None:
        """Rank r holds its own copies now: close the parent's, so that its death is end of file."""
        for conn in self._ends[r]:
            conn.close()

    def _run(self) -> None:
        while not self._stop.is_set() and self._selector.get_map():
            for key, _ in self._selector.select(timeout=0.2):
                self._read(key.data)

    def _read(self, stream: _Stream) -> None:
        try:
            data = os.read(stream.fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            stream.feed(data)
        else:
            self._end(stream)

    def _end(self, stream: _Stream) -> None:
        self._selector.unregister(stream.fd)
        os.close(stream.fd)
        stream.feed(b"", final=True)
        stream.ended.set()

    def wait_for(self, r: int, seconds: float = 2.0) -> None:
        """Until rank r's pipes are at end of file (it is dead), at most `seconds` (a process it
        started may still hold them)."""
        for stream in self.streams[r]:
            stream.ended.wait(seconds)

    def close(self, seconds: float = 2.0) -> None:
        """After the ranks have ended: read what is left (at most `seconds` for end of file),
        then stop reading and close every pipe. Idempotent."""
        for r in range(len(self.streams)):
            for conn in self._ends[r]:
                conn.close()               # a rank that was never started
        for pair in self.streams:
            for stream in pair:
                stream.ended.wait(seconds)
                seconds = 0.05             # one bounded wait in all, then only what is there
        self._stop.set()
        self._pump.join()
        for pair in self.streams:
            for stream in pair:
                if not stream.ended.is_set():
                    while True:            # what is in the pipe now, then the end
                        try:
                            data = os.read(stream.fd, 1 << 16)
                        except OSError:
                            data = b""
                        if not data:
                            break
                        stream.feed(data)
                    self._end(stream)
        self._selector.close()

    def show_rest(self, skip: int | None = None) -> None:
        """Write what was not shown live to sys.stdout / sys.stderr in rank order, as the output
        choice selects. `skip`: a rank whose output is already in the error being raised."""
        if self.mode == "none":
            return
        for r, (out, err) in enumerate(self.streams):
            if r == skip or r == 0:        # rank 0 was shown as it came
                continue
            for stream in ((out, err) if self.mode == "all" else (err,)):
                text, dropped = stream.text()
                if dropped:
                    text = f"... ({dropped:,} earlier characters not kept)\n" + text
                _write(stream.name, prefixed(text, r))

    def tail(self, r: int, limit: int = 3000) -> str:
        """The end of a failed rank's output for an error message: its stderr (tracebacks, C++
        errors) first in importance, then as much of its stdout's end as leaves room (at least a
        few lines). Empty when the rank wrote nothing."""
        self.wait_for(r)
        out, err = self.streams[r]
        err_text = _last(err.text()[0].strip(), limit)
        out_text = _last(out.text()[0].strip(), max(limit - len(err_text), 1000))
        text = ""
        if out_text:
            text += "\n--- its stdout (last lines) ---\n" + out_text
        if err_text:
            text += "\n--- its stderr (last lines) ---\n" + err_text
        return text


def _last(text: str, limit: int) -> str:
    """The last `limit` characters of text, starting at a line boundary when cut."""
    if len(text) <= limit:
        return text
    cut = text[-limit:]
    newline = cut.find("\n")
    return cut[newline + 1:] if 0 <= newline < len(cut) - 1 else cut
