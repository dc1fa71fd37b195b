"""Pickles read with an allow-list: what a torch.distributed.checkpoint (DCP) directory holds, read
without ever running code from it.

DCP stores two kinds of pickle, and PyTorch reads both with pickle machinery that a crafted file
can steer: `.metadata` is one pickle (read by DCP with a plain `pickle.load`, which can call any
function), and every entry in a `.distcp` file is a `torch.save` archive (a zip holding a pickle,
data.pkl, and one raw member per storage). zerolab reads both here, and nowhere else:

    meta = dcp_metadata(data, path)          # .metadata: DCP's own classes, torch's sizes and
                                             # dtypes, plain containers; anything else is refused
    value = torch_archive(data, path)        # one entry: tensors rebuilt from the archive's raw
                                             # bytes by zerolab (never torch.load), plain values

An unpickler builds objects only through find_class (and persistent_load for storages): both are
replaced here by tables of what may be built. A class outside the table is a CheckpointError naming
it and the file, raised before anything it would have built exists.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
import zipfile

import torch

from .files import CheckpointError

# what a tensor's raw bytes may be: the storage classes torch.save names, and their dtypes
STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}
DTYPES = {str(d).removeprefix("torch."): d for d in STORAGE_DTYPES.values()}


def _refuse(path, what):
    raise CheckpointError(f"{path}: {what}; a checkpoint is refused rather than read with code it names")


def _path(*parts):
    """pathlib's paths in DCP's StorageMeta (the directory it was saved to) become plain strings."""
    if not parts or not all(isinstance(p, str) for p in parts):
        raise ValueError("a path made of something other than strings")
    return "/".join(parts)


def _layout(name):
    if name != "torch.strided":
        raise ValueError(f"layout {name!r} (only strided tensors are read)")
    return torch.strided


def _dcp_classes() -> dict:
    """(module, name) -> what .metadata's pickle may build: DCP's metadata classes, nothing else."""
    from torch.distributed.checkpoint import filesystem, metadata
    allowed = {("torch.distributed.checkpoint.metadata", name): getattr(metadata, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _layout
    for module in ("pathlib", "pathlib._local"):
        for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"):
            allowed[(module, name)] = _path
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    return allowed


class _AllowList(pickle.Unpickler):
    """An unpickler that builds only what `allowed` names (and torch's dtypes by name)."""

    def __init__(self, data: bytes, path: str, allowed: dict, what: str):
        super().__init__(io.BytesIO(data))
        self.path, self.allowed, self.what = path, allowed, what

    def find_class(self, module, name):
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and name in DTYPES:
            return DTYPES[name]
        _refuse(self.path, f"its {self.what} names {module}.{name}, which is not among what a checkpoint "
                           "may hold (DCP's metadata classes, tensors, numbers, strings and containers)")

    def persistent_load(self, pid):
        _refuse(self.path, f"its {self.what} refers to a storage outside it")


def _unpickle(unpickler: _AllowList):
    try:
        return unpickler.load()
    except CheckpointError:
        raise
    except RecursionError:
        raise CheckpointError(f"{unpickler.path}: its {unpickler.what} is nested too deeply") from None
    except Exception as e:  # noqa: BLE001 - any malformed pickle is reported the same way
        raise CheckpointError(f"{unpickler.path}: its {unpickler.what} cannot be read "
                              f"({type(e).__name__}: {str(e)[:160]})") from None


def dcp_metadata(data: bytes, path: str):
    """DCP's Metadata object from the bytes of `.metadata` (checked by the caller)."""
    return _unpickle(_AllowList(data, path, _dcp_classes(), "pickle"))


# ------------------------------------------------------------------ torch.save archives


class _Storage:
    """A storage of the archive: its dtype and its raw bytes, read from the zip member."""

    def __init__(self, dtype, raw: bytes):
        self.dtype, self.raw = dtype, raw


class _Archive(_AllowList):
    """data.pkl of a torch.save archive: tensors are rebuilt from the members' raw bytes."""

    def __init__(self, data: bytes, path: str, archive: zipfile.ZipFile, prefix: str):
        allowed = {("torch._utils", "_rebuild_tensor_v2"): self._tensor,
                   ("collections", "OrderedDict"): collections.OrderedDict}
        allowed.update({("torch", name): _StorageType(dtype) for name, dtype in STORAGE_DTYPES.items()})
        super().__init__(data, path, allowed, "torch.save entry")
        self.archive, self.prefix = archive, prefix

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and pid[2].isdigit()
                and isinstance(pid[4], int) and pid[4] >= 0):
            _refuse(self.path, f"its torch.save entry refers to a storage as {str(pid)[:80]}")
        dtype, key, numel = pid[1].dtype, pid[2], pid[4]
        name = f"{self.prefix}data/{key}"
        try:
            info = self.archive.getinfo(name)
        except KeyError:
            _refuse(self.path, f"its torch.save entry names storage {key}, which the archive lacks")
        size = numel * dtype.itemsize
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != size:
            _refuse(self.path, f"storage {key} of a torch.save entry is {info.file_size} bytes "
                               f"({'compressed' if info.compress_type else 'stored'}), not the {size} "
                               f"stored bytes of {numel} {dtype} elements")
        return _Storage(dtype, self.archive.read(name))

    def _tensor(self, storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
        ints = lambda xs: isinstance(xs, tuple) and all(isinstance(x, int) and x >= 0 for x in xs)  # noqa: E731
        if not (isinstance(storage, _Storage) and isinstance(offset, int) and offset >= 0 and ints(size)
                and ints(stride) and len(size) == len(stride) and not metadata and not hooks):
            _refuse(self.path, "a tensor of its torch.save entry is not a plain strided tensor")
        numel = len(storage.raw) // storage.dtype.itemsize
        last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else offset - 1
        if last >= numel:
            _refuse(self.path, f"a tensor of its torch.save entry reaches element {last} of a storage of {numel}")
        flat = torch.frombuffer(bytearray(storage.raw), dtype=storage.dtype) if numel else \
            torch.empty(0, dtype=storage.dtype)
        return flat.as_strided(size, stride, offset).clone()


class _StorageType:
    """torch.FloatStorage and its kind, as a torch.save pickle names them: a dtype, nothing else."""

    def __init__(self, dtype):
        self.dtype = dtype


def torch_archive(data: bytes, path: str):
    """The value one torch.save archive holds (tensors on the CPU, numbers, strings, containers)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError, KeyError) as e:
        raise CheckpointError(f"{path}: an entry is not the zip archive torch.save writes ({str(e)[:120]})") from None
    pickles = [m for m in members if m.filename.endswith("/data.pkl") and m.filename.count("/") == 1]
    if len(pickles) != 1 or pickles[0].compress_type != zipfile.ZIP_STORED or pickles[0].file_size > len(data):
        _refuse(path, "an entry is not one torch.save archive (no single stored data.pkl)")
    prefix = pickles[0].filename[:-len("data.pkl")]
    order = f"{prefix}byteorder"
    if order in archive.namelist() and archive.read(order) != sys.byteorder.encode():
        _refuse(path, f"an entry was written on a {archive.read(order)[:10]!r}-endian machine")
    return _unpickle(_Archive(archive.read(pickles[0].filename), path, archive, prefix))
