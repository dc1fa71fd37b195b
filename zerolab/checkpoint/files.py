"""The files of a checkpoint, read so that no file can hang, flood or fool the reader.

A checkpoint directory holds regular files only, and load and consolidate open nothing else:

    fd = open_regular(path)             # not a symbolic link, a FIFO, a device or a directory
    data = read_bounded(path, size)     # at most the size the metadata records (one byte more
                                        # tells a file that grew), so /dev/zero cannot flood memory
    size, sha256 = file_digest(path, expected_size)

The metadata itself is covered by a digest: metadata.json holds "sha256", the SHA-256 of the
rest of it written canonically (sorted keys, no spaces), and read_metadata refuses a file whose
digest does not match. Since the metadata records every shard's size and SHA-256, one digest
covers the whole checkpoint end to end: a changed byte anywhere is a CheckpointError naming the
file, never a different model.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat

METADATA = "metadata.json"
MAX_METADATA_BYTES = 256 << 20    # a model with 100k parameters on 1000 ranks needs ~10 MiB
BLOCK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the file and the problem."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_regular(path: str, what: str = "file") -> int:
    """A file descriptor for reading `path`, which must be a regular file and not a symbolic
    link (a link could lead outside the checkpoint, or to /dev/zero). Opened without blocking,
    so that a FIFO is refused instead of waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing ({what})") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path}: is a symbolic link; a checkpoint holds regular files only, "
                                  f"inside its directory ({what})") from None
        raise CheckpointError(f"{path}: cannot be opened ({what}): {e.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise CheckpointError(f"{path}: is {kind}; a checkpoint holds regular files only ({what})")
    os.set_blocking(fd, True)
    return fd


def read_bounded(path: str, size: int, what: str = "file", exact: bool = True) -> bytes:
    """The bytes of regular file `path`: exactly `size` of them (exact) or at most `size`."""
    fd = open_regular(path, what)
    with os.fdopen(fd, "rb") as f:
        # (a regular file says its size: one larger than allowed is not read at all; the bounded
        # read is for one that grows meanwhile)
        data = b"" if os.fstat(fd).st_size > size else f.read(size + 1)
    if len(data) > size or not data and os.stat(path).st_size > size:
        raise CheckpointError(f"{path}: larger than {'the metadata records' if exact else 'any'} "
                              f"{what} ({size} bytes); changed or not a checkpoint's file")
    if exact and len(data) != size:
        raise CheckpointError(f"{path}: truncated or wrong size: {len(data)} bytes, the metadata "
                              f"records {size}")
    return data


def file_digest(path: str, expected_size: int | None = None) -> tuple[int, str]:
    """(size, SHA-256) of a regular file, read a block at a time (a linked file may be the
    model); at most expected_size + 1 bytes are read when the size is known."""
    digest, size = hashlib.sha256(), 0
    limit = None if expected_size is None else expected_size + 1
    with os.fdopen(open_regular(path), "rb") as f:
        while limit is None or size < limit:
            block = f.read(BLOCK if limit is None else min(BLOCK, limit - size))
            if not block:
                break
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


# ------------------------------------------------------------------ the metadata and its digest


def canonical(meta: dict) -> bytes:
    """The bytes the metadata's digest is taken over: everything but "sha256", keys sorted."""
    rest = {k: v for k, v in meta.items() if k != "sha256"}
    return json.dumps(rest, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def with_digest(meta: dict) -> dict:
    return {**meta, "sha256": hashlib.sha256(canonical(meta)).hexdigest()}


def _no_constants(name):
    raise ValueError(f"{name} is not a JSON number")


def read_metadata(directory: str) -> dict:
    """metadata.json of `directory`, parsed and checked against its own digest (the fields
    themselves are checked by zerolab.checkpoint.reader)."""
    path = os.path.join(directory, METADATA)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: missing; the directory holds no complete checkpoint "
                              "(a save that never finished leaves none)")
    data = read_bounded(path, MAX_METADATA_BYTES, "checkpoint metadata", exact=False)
    try:
        meta = json.loads(data.decode("utf-8"), parse_constant=_no_constants)
        ok = isinstance(meta, dict) and isinstance(meta.get("sha256"), str) \
            and hashlib.sha256(canonical(meta)).hexdigest() == meta["sha256"]
    except RecursionError:
        raise CheckpointError(f"{path}: not valid zerolab checkpoint metadata (nested too deeply)") from None
    except (ValueError, TypeError) as e:      # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise CheckpointError(f"{path}: not valid zerolab checkpoint metadata ({str(e)[:200]})") from None
    if not ok:
        if isinstance(meta, dict) and meta.get("format") == 1:
            raise CheckpointError(f"{path}: written by an older zerolab (format 1, which no digest "
                                  "covers); load it with that version and save it again")
        raise CheckpointError(f"{path}: its SHA-256 does not match its contents: the metadata was "
                              "changed or is corrupt")
    return meta
