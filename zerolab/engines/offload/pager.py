"""Tensors that live in files: page them in before use, out after (ZeRO-Infinity's NVMe tier).

    pager = Pager("/nvme/run1/rank0")
    pager.out("unit3.master", t, dirty=True)   # written to its file, then its memory is freed
    pager.fetch("unit3.master", t)             # the reader thread starts filling it again ...
    pager.wait("unit3.master")                 # ... and this blocks until it is in memory

A paged-out tensor keeps its shape and dtype; its STORAGE is resized to 0 bytes (as ZeRO-3
frees a gathered buffer), so everything that holds the tensor (the optimizer's state dict, a
unit) keeps holding the same object, and paging in resizes the storage and reads the file into
it. A tensor paged out `dirty=False` (unchanged since it was read) is not written again.

One thread does ALL the file I/O, reads and writes, in the order they were asked for (a queue):
a read of a tensor queued after its write sees the new bytes, and compute on the main thread
overlaps the I/O (file reads and writes release Python's GIL). That one thread is also how the
bytes are counted: /proc/self/task/<tid>/io of the I/O thread counts exactly the bytes its
read() and write() calls moved (rchar, wchar). The process-wide /proc/self/io would also count
the sockets gloo reads and writes, and its read_bytes / write_bytes count only what reached
the block device: a file just written is read back from the page cache, which read_bytes does
not see. (On a real NVMe tier, open the files with O_DIRECT to bypass the page cache; here the
page cache is simply the operating system's part of the hierarchy.)

Files are written atomically: bytes go to `<name>.tmp`, then os.replace() puts them in place,
so a process killed in the middle of a write leaves the previous file whole (the .tmp is left
behind and overwritten by the next write). There is no fsync: a killed process loses nothing
the kernel already has; a power cut is what fsync is for, and a run restarts from a checkpoint,
which syncs the files it links. Never writing a file in place is also what lets a checkpoint
hard-link these files (zerolab.checkpoint): a write gives the name a new file, and the
checkpoint's name keeps the old bytes.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time

import torch


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A memoryview of a contiguous CPU tensor's bytes. (Not t.numpy(): numpy would share the
    storage, which then can never be resized, so never paged out again.)"""
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def write_file(path: str, t: torch.Tensor) -> None:
    """t's bytes to `path`, atomically (a temporary file, then os.replace). A GPU tensor goes
    through host memory first: over the bus, then to the disk (ZeRO-Infinity's path)."""
    if t.device.type != "cpu":
        t = t.to("cpu")                 # synchronous: the copy is done before t can be freed
    tmp = path + ".tmp"
    with open(tmp, "wb", buffering=0) as f:
        f.write(_bytes_of(t))
    os.replace(tmp, path)


def read_file(path: str, t: torch.Tensor) -> None:
    """`path`'s bytes into t (whose storage is allocated); refuses a file of the wrong size.
    A GPU tensor is read into host memory, then copied up."""
    if t.device.type != "cpu":
        host = torch.empty(t.shape, dtype=t.dtype)
        read_file(path, host)
        t.copy_(host)
        return
    buf = _bytes_of(t)
    with open(path, "rb", buffering=0) as f:
        n = f.readinto(buf)
    if n != len(buf):
        raise IOError(f"offload file {path} holds {n} bytes, expected {len(buf)}: it was not "
                      "written by this run (or the disk lost it)")


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


def thread_io(tid: int) -> dict:
    """{'rchar', 'wchar', ...} of one thread of this process, from /proc."""
    out = {}
    with open(f"/proc/self/task/{tid}/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v)
    return out


class Pager:
    """Tensors by name, each resident or in its file under `directory` (module docstring)."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.tensors: dict = {}         # name -> tensor
        self.resident: set = set()      # names whose storage holds their values now
        self.on_disk: set = set()       # names whose file holds their latest values
        self._done: dict = {}           # name -> Event set when its queued read is finished
        self._errors: list = []
        self.busy_s = 0.0               # seconds the I/O thread spent reading and writing
        self.wait_s = 0.0               # seconds the main thread spent blocked on the I/O thread
        self.trace = None               # a list to record (what, name, start, end) in: timelines
        self._jobs: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._work, name="zerolab-pager", daemon=True)
        self._thread.start()
        self._ready.wait()

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name + ".bin")

    # -------------------------------------------------------------- the I/O thread
    def _work(self):
        self.tid = threading.get_native_id()
        self._ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, name, t, done = job
            t0 = time.perf_counter()
            try:
                if kind == "write":
                    write_file(self.path(name), t)
                    _free(t)
                else:                   # (its memory was allocated by fetch, on the main thread)
                    read_file(self.path(name), t)
            except BaseException as e:   # re-raised on the main thread by wait() / flush()
                self._errors.append(e)
            t1 = time.perf_counter()
            self.busy_s += t1 - t0
            if self.trace is not None:
                self.trace.append((kind, name, t0, t1))
            done.set()

    def _wait_for(self, name: str) -> None:
        """Block until the job queued for `name` (if any) is done; the time counts as waited."""
        done = self._done.pop(name, None)
        if done is not None and not done.is_set():
            t0 = time.perf_counter()
            done.wait()
            t1 = time.perf_counter()
            self.wait_s += t1 - t0
            if self.trace is not None:
                self.trace.append(("wait", name, t0, t1))
        self._check()

    def _check(self):
        if self._errors:
            raise self._errors.pop(0)

    # -------------------------------------------------------------- the main thread's side
    def out(self, name: str, t: torch.Tensor, dirty: bool = True) -> None:
        """Page t out: write it (if dirty or never written) and free its memory."""
        self._wait_for(name)            # a read still filling it (a prefetch nobody used)
        self.tensors[name] = t
        self.resident.discard(name)
        self._done.pop(name, None)
        if dirty or name not in self.on_disk:
            self.on_disk.add(name)
            done = threading.Event()
            self._done[name] = done     # a read must not start before this write ends
            self._jobs.put(("write", name, t, done))
        else:
            _free(t)

    def fetch(self, name: str) -> None:
        """Start reading `name` back (returns at once; nothing if resident or on its way)."""
        if name in self.resident:
            return
        if name not in self.on_disk:
            raise KeyError(f"pager: {name!r} was never paged out")
        self._wait_for(name)            # (a write of it still queued: let it finish first)
        t = self.tensors[name]
        # allocate here, not on the I/O thread: memory allocated by one thread and freed by
        # another stays in the first thread's malloc arena, and the resident set grows
        _alloc(t)
        done = threading.Event()
        self._done[name] = done
        self.resident.add(name)         # (its values are only valid after wait)
        self._jobs.put(("read", name, t, done))

    def wait(self, name: str) -> torch.Tensor:
        """Block until `name` is in memory (fetching it if nobody did); return its tensor."""
        self.fetch(name)
        self._wait_for(name)
        return self.tensors[name]

    def new(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Give a paged-out tensor memory WITHOUT reading it (it is about to be overwritten)."""
        if name in self.resident:
            return self.wait(name)
        self._wait_for(name)            # its write must finish before the storage comes back
        _alloc(t)
        self.tensors[name] = t
        self.resident.add(name)
        return t

    def adopt(self, name: str, t: torch.Tensor) -> None:
        """Register t, resident, under `name` (a tensor made in memory: new optimizer state, or
        one a checkpoint load put in place of the paged one); its file is now stale."""
        self._wait_for(name)
        self.tensors[name] = t
        self.resident.add(name)
        self.on_disk.discard(name)

    def forget(self, name: str) -> None:
        """Drop `name` (its file too): a gradient after the step that used it."""
        self._wait_for(name)
        self.tensors.pop(name, None)
        self.resident.discard(name)
        if name in self.on_disk:
            self.on_disk.discard(name)
            os.remove(self.path(name))

    def flush(self) -> None:
        """Wait for every queued read and write."""
        for name in list(self._done):
            self._wait_for(name)

    def io(self) -> dict:
        """Bytes the I/O thread has read and written so far ({'read': rchar, 'written': wchar})."""
        io = thread_io(self.tid)
        return {"read": io["rchar"], "written": io["wchar"]}

    def close(self) -> None:
        self.flush()
        self._jobs.put(None)
        self._thread.join()
