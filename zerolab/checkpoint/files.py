"""The files of a checkpoint, read so that no file can hang, flood or fool the reader.

A checkpoint directory holds regular files only, and load and consolidate open nothing else:

    fd = open_regular(path)             # not a symbolic link, a FIFO, a device or a directory
    data = read_bounded(path, size)     # at most the size the metadata records (one byte more
                                        # tells a file that grew), so /dev/zero cannot flood memory
    size, sha256 = file_digest(path, expected_size)
    pickled, stored = zip_sizes(data, path)   # what torch.load would inflate, from the zip's directory

The metadata is sealed: its last field, "sha256", is the SHA-256 of the file's bytes before that
field (encode_metadata writes it, seal adds it to any JSON object), so read_metadata checks the
raw bytes before json.loads builds anything from them. Since the metadata records every shard's
size and SHA-256, one digest covers the whole checkpoint end to end: a changed byte anywhere is a
CheckpointError naming the file, never a different model.

A digest stops accidents, not someone who recomputes it; so what a crafted file can make the
reader build is bounded too: metadata.json is at most MAX_METADATA_BYTES of ASCII holding at most
MAX_METADATA_VALUES JSON values (counted on the raw bytes before parsing: the parser then builds at
most about 2 bytes per byte plus 80 per value, ~100 MiB), and each shard's zip members may inflate
to no more than its pieces' shapes and dtypes allow (zerolab.checkpoint.reader), `extra` included:
at most MAX_EXTRA_BYTES of tensors and MAX_EXTRA_PICKLE of other Python values.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import stat
import zipfile

METADATA = "metadata.json"
MAX_METADATA_BYTES = 16 << 20     # ~100 bytes per piece: 150k pieces (ZeRO on 1000 ranks of a 100k-tensor model)
MAX_METADATA_VALUES = 1_000_000   # ~7 per piece and parameter; each costs the parser at most ~80 bytes
MAX_EXTRA_BYTES = 16 << 20        # the tensors in `extra` (a data position, a sampler's state)
MAX_EXTRA_PICKLE = 1 << 20        # the other Python values in `extra` (numbers, strings, lists, dicts)
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


def zip_sizes(data: bytes, path: str) -> tuple[int, int]:
    """(pickled, stored): the bytes torch.load would inflate from the torch.save archive `data`,
    its pickle and everything else (the tensors' storages), read from the zip's central
    directory alone: nothing is inflated to learn them."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError, KeyError) as e:
        raise CheckpointError(f"{path}: cannot be read as a weights-only torch file (not the zip archive "
                              f"torch.save writes: {str(e)[:200]})") from None
    pickled = sum(m.file_size for m in members if m.filename.rsplit("/", 1)[-1] == "data.pkl")
    return pickled, sum(m.file_size for m in members) - pickled


# ------------------------------------------------------------------ the metadata and its seal

_SEAL = b',\n "sha256": "'      # the last field: the digest of every byte before its value
_END = b'"\n}\n'
_FORMAT = re.compile(rb'\A\{\s*"format":\s*(\d{1,9})\s*,')


def seal(body: bytes) -> bytes:
    """A JSON object's bytes with its seal appended as the last field: "sha256", the SHA-256 of
    the bytes before the digest's first character."""
    body = body.rstrip()
    if not (body.startswith(b"{") and body.endswith(b"}") and body[1:-1].strip()):
        raise ValueError("seal: body must be a JSON object with at least one field")
    head = body[:-1].rstrip() + _SEAL
    return head + hashlib.sha256(head).hexdigest().encode() + _END


def encode_metadata(meta: dict) -> bytes:
    """metadata.json's bytes: `meta` as indented ASCII JSON, sealed."""
    rest = {k: v for k, v in meta.items() if k != "sha256"}
    return seal(json.dumps(rest, indent=1, allow_nan=False).encode())


def _no_constants(name):
    raise ValueError(f"{name} is not a JSON number")


def _check_seal(data: bytes, path: str) -> str:
    """The digest the file's seal records, checked against its bytes; raises CheckpointError."""
    digest_at = len(data) - len(_END) - 64
    recorded = data[digest_at:digest_at + 64]
    sealed = digest_at >= len(_SEAL) + 1 and data[digest_at - len(_SEAL):digest_at] == _SEAL \
        and data.endswith(_END) and re.fullmatch(rb"[0-9a-f]{64}", recorded) is not None
    if sealed and hashlib.sha256(memoryview(data)[:digest_at]).hexdigest() == recorded.decode():
        return recorded.decode()
    old = _FORMAT.match(data[:64])
    if old and int(old.group(1)) < 3:
        raise CheckpointError(f"{path}: written by an older zerolab (checkpoint format {int(old.group(1))}); "
                              "this version reads format 3 only: load it with the version that wrote it, "
                              "or consolidate it there and load the weights with engine.load_state_dict")
    if not sealed:
        raise CheckpointError(f"{path}: not valid zerolab checkpoint metadata (it does not end in its own "
                              "SHA-256: cut short, or not written by zerolab)")
    raise CheckpointError(f"{path}: its SHA-256 does not match its contents: the metadata was changed or "
                          "is corrupt")


def read_sealed(path: str, what: str, missing: str) -> dict:
    """A sealed JSON file (metadata.json, a DCP manifest): read (bounded), its seal checked on the
    raw bytes, its size in JSON values counted, and only then parsed. `missing`: what to say when
    it is not there."""
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: missing; {missing}")
    data = read_bounded(path, MAX_METADATA_BYTES, what, exact=False)
    digest = _check_seal(data, path)
    if not data.isascii():
        raise CheckpointError(f"{path}: not valid zerolab {what} (zerolab writes ASCII only)")
    # every value or key but the first follows one of these bytes (a string holding them counts
    # extra, never fewer): an upper bound of what json.loads would build, known before it runs
    values = 1 + sum(data.count(c) for c in (b",", b":", b"[", b"{"))
    if values > MAX_METADATA_VALUES:
        raise CheckpointError(f"{path}: holds up to {values:,} JSON values, more than any checkpoint's "
                              f"metadata ({MAX_METADATA_VALUES:,}); crafted or not a checkpoint")
    try:
        meta = json.loads(data, parse_constant=_no_constants)
    except RecursionError:
        raise CheckpointError(f"{path}: not valid zerolab {what} (nested too deeply)") from None
    except (ValueError, TypeError) as e:      # (JSONDecodeError is a ValueError)
        raise CheckpointError(f"{path}: not valid zerolab {what} ({str(e)[:200]})") from None
    if not isinstance(meta, dict) or meta.get("sha256") != digest:
        raise CheckpointError(f"{path}: not valid zerolab {what} (its seal is not its last field)")
    return meta


def read_metadata(directory: str) -> dict:
    """metadata.json of `directory`, read and checked by read_sealed (the fields themselves are
    checked by zerolab.checkpoint.reader)."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    return read_sealed(os.path.join(directory, METADATA), "checkpoint metadata",
                       "the directory holds no complete checkpoint (a save that never finished leaves none)")


# ------------------------------------------------------------------ which format a directory holds
#
# zerolab's own format is metadata.json and its shards; a torch.distributed.checkpoint (DCP)
# directory is DCP's .metadata and *.distcp files, and, when zerolab wrote it, MANIFEST: every
# file's size and SHA-256, sealed (zerolab.checkpoint.dcp_reader). A directory holding both is
# refused: which one is meant cannot be told, and one of them is stale.

DCP_METADATA = ".metadata"
MANIFEST = "zerolab-dcp.json"
_ZEROLAB_FILES = re.compile(r"\Ametadata\.json(\.tmp-.*)?\Z|\Ashard-.*\Z")
_DCP_FILES = re.compile(r"\A\.metadata(\.tmp)?\Z|\A.*\.distcp\Z|\Azerolab-dcp\.json(\.tmp-.*)?\Z")


def formats_in(path: str) -> list:
    """The checkpoint formats directory `path` holds: "zerolab" (metadata.json), "dcp" (.metadata,
    or the manifest zerolab writes beside it)."""
    held = []
    if os.path.lexists(os.path.join(path, METADATA)):
        held.append("zerolab")
    if any(os.path.lexists(os.path.join(path, f)) for f in (DCP_METADATA, MANIFEST)):
        held.append("dcp")
    return held


def both_formats(path: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: holds two checkpoints, one in zerolab's format ({METADATA}) and one as a "
        f"torch.distributed.checkpoint ({DCP_METADATA}{', ' + MANIFEST if os.path.lexists(os.path.join(path, MANIFEST)) else ''}); "
        "refused, since which one is meant cannot be told. Move one of them into a directory of its own")


def format_of(path) -> str:
    """"zerolab" or "dcp": the one checkpoint format `path` holds (a directory holding none is
    "zerolab", whose reader says what is missing); both is a CheckpointError."""
    held = formats_in(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else []
    if len(held) == 2:
        raise both_formats(os.fspath(path))
    return held[0] if held else "zerolab"


def not_checkpoint_files(path: str) -> list:
    """The entries of directory `path` that are not a checkpoint's files (either format's)."""
    return sorted(f for f in os.listdir(path) if not (_ZEROLAB_FILES.match(f) or _DCP_FILES.match(f)))


def check_other_format(path: str, fmt: str, replace: bool) -> bool:
    """Before a save in format `fmt` into `path`: does a checkpoint of the other format have to be
    replaced (only with replace=True; a CheckpointError otherwise)?"""
    other = {"zerolab": "dcp", "dcp": "zerolab"}[fmt]
    if not os.path.isdir(path) or other not in formats_in(path):
        return False
    names = {"zerolab": f"zerolab's format ({METADATA})", "dcp": f"DCP format ({DCP_METADATA})"}
    if not replace:
        raise CheckpointError(
            f"{path}: holds a checkpoint in {names[other]}; a save in {names[fmt].split(' (')[0]} there would "
            "leave two checkpoints in one directory. Save into another directory, or pass replace=True to "
            "replace it (the old one stays whole until the new one is complete)")
    check_only_checkpoint_files(path)
    return True


def check_only_checkpoint_files(path: str) -> None:
    """A save that replaces directory `path` whole (a DCP save, or replace=True) would take any other
    file in it along: refused (CheckpointError) unless it holds a checkpoint's files only."""
    others = not_checkpoint_files(path)
    if others:
        raise CheckpointError(f"{path}: holds files that are not a checkpoint's ({', '.join(others[:3])}"
                              f"{', ...' if len(others) > 3 else ''}); a save there replaces the whole directory, "
                              "so it is refused: save into a directory of its own")
