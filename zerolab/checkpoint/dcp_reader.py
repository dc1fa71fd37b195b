"""Reading a torch.distributed.checkpoint (DCP) directory: verified first, bounded, and without
running any code from it.

    reader = DcpReader("ckpt/")       # the manifest (if zerolab wrote it) and every file it lists
                                      # checked, then .metadata read through an allow-list and checked
    reader.identity                   # "step 40, sha256 ..." : what the ranks compare
    entries = reader.read_all()       # {flattened key: tensor or value}, every chunk in place

A directory zerolab wrote carries MANIFEST (zerolab-dcp.json) beside DCP's files: each file's name,
size and SHA-256, the step, sealed by its own SHA-256 as metadata.json is (zerolab.checkpoint.files).
It is read and every file it lists is hashed before anything else is read, so a changed byte, a
file from another save or a planted .metadata is refused naming the file. A directory written by
FSDP2 or torchtitan has no manifest: it is read the same way, but its bytes cannot be verified,
and load says so once.

Either way nothing is read through DCP's own reader, which unpickles .metadata with no allow-list
and can run code planted in it: .metadata is unpickled by zerolab.checkpoint.unpickle (DCP's
metadata classes, torch's sizes and dtypes, containers), every entry is decoded from its
torch.save archive by the same module (tensors rebuilt from raw bytes, never torch.load), and
every field is checked before it is used: where each chunk lies in which file, that the chunks of
a tensor tile it exactly, that no entry is larger than its file.
"""

from __future__ import annotations

import hashlib
import os
import warnings

import torch

from . import unpickle
from .files import (DCP_METADATA, MANIFEST, CheckpointError, file_digest, open_regular, read_bounded,
                    read_sealed)

MANIFEST_FORMAT = "zerolab-dcp"
OWN_STEPS = "zerolab.steps"        # the entry zerolab's DCP save always writes (zerolab.checkpoint.dcp)
MAX_DCP_METADATA = 256 << 20     # .metadata: ~200 bytes a chunk, a million chunks
MAX_BYTES_ENTRY = 16 << 20       # a value that is not a tensor (a hyperparameter, a step count, `extra`)


def _plain_name(f) -> bool:
    return isinstance(f, str) and f == os.path.basename(f) and f not in ("", ".", "..") and "/" not in f \
        and "\\" not in f and "\0" not in f


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _size(x, dims=None) -> bool:
    return isinstance(x, torch.Size) and len(x) <= 64 and all(_int(d) for d in x) and (dims is None or len(x) == dims)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class DcpReader:
    """A DCP directory, checked; read_all() reads its entries."""

    def __init__(self, path, *, say_unverified: bool = False):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"checkpoint: path must be a str or os.PathLike directory, got {type(path).__name__}")
        self.path = path = os.fspath(path)
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: no such checkpoint directory")
        self.meta_path = os.path.join(path, DCP_METADATA)
        self.manifest = self._manifest() if os.path.lexists(os.path.join(path, MANIFEST)) else None
        if self.manifest is None:
            if not os.path.lexists(self.meta_path):
                raise CheckpointError(f"{self.meta_path}: missing; not a torch.distributed.checkpoint directory")
            data = read_bounded(self.meta_path, MAX_DCP_METADATA, "DCP metadata", exact=False)
        else:
            entry = self.files[DCP_METADATA]
            data = read_bounded(self.meta_path, entry["bytes"], "DCP metadata")
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise CheckpointError(f"{self.meta_path}: changed since the manifest was written "
                                      "(its SHA-256 does not match)")
        self.digest = hashlib.sha256(data).hexdigest()
        self.meta = unpickle.dcp_metadata(data, self.meta_path)
        try:
            self._check_metadata()
        except (ValueError, TypeError, AttributeError, KeyError) as e:
            raise CheckpointError(f"{self.meta_path}: not valid DCP metadata ({str(e)[:300]})") from None
        if self.manifest is None and OWN_STEPS in self.meta.state_dict_metadata:
            raise CheckpointError(f"{os.path.join(path, MANIFEST)}: missing; zerolab wrote this checkpoint "
                                  f"({DCP_METADATA} holds its {OWN_STEPS!r}) and always writes the manifest of its "
                                  "files beside it: a file was removed, so none of them can be trusted")
        if self.manifest is None and say_unverified:
            # (named by the call, not by a line of zerolab's: the same text wherever the library is installed)
            warnings.warn_explicit(f"{path} was not written by zerolab (it has no {MANIFEST}): its files cannot be "
                                   "checked for changed bytes; it is read with checks of its structure only",
                                   UserWarning, "zl.checkpoint", 0)

    # ------------------------------------------------------------------ what was written

    @property
    def steps(self):
        return self.manifest["steps"] if self.manifest is not None else None

    @property
    def identity(self) -> str:
        """What this checkpoint is, in one line: the ranks that load it must agree on it."""
        if self.manifest is not None:
            return f"step {self.manifest['steps']}, sha256 {self.manifest['sha256'][:16]}"
        return f"DCP metadata sha256 {self.digest[:16]}"

    @property
    def seen(self) -> tuple:
        """(this checkpoint in words, the digest that covers it): what the ranks compare."""
        if self.manifest is not None:
            m = self.manifest
            return f"step {m['steps']} (sha256 {m['sha256'][:12]})", f"{m['steps']}:{m['sha256']}"
        return f"DCP metadata sha256 {self.digest[:12]}", self.digest

    def _manifest(self) -> dict:
        where = os.path.join(self.path, MANIFEST)
        m = read_sealed(where, "DCP manifest", "")
        files = m.get("files")
        if not (m.get("format") == MANIFEST_FORMAT and _int(m.get("steps")) and isinstance(files, list)
                and all(isinstance(e, dict) and _plain_name(e.get("file")) and e["file"] != MANIFEST
                        and _int(e.get("bytes")) and isinstance(e.get("sha256"), str) and len(e["sha256"]) == 64
                        for e in files)
                and len({e["file"] for e in files}) == len(files)
                and DCP_METADATA in {e["file"] for e in files}):
            raise CheckpointError(f"{where}: not a valid zerolab DCP manifest (format, steps and a list of "
                                  f"files with their sizes and SHA-256, {DCP_METADATA} among them)")
        self.files = {e["file"]: e for e in files}
        for e in files:                 # every file, before anything is read from any of them
            f = os.path.join(self.path, e["file"])
            if not os.path.lexists(f):
                raise CheckpointError(f"{f}: missing (the manifest {MANIFEST} lists it)")
            size, sha256 = file_digest(f, e["bytes"])
            if size != e["bytes"] or sha256 != e["sha256"]:
                raise CheckpointError(f"{f}: {size}{'+' if size > e['bytes'] else ''} bytes whose SHA-256 does not "
                                      f"match the manifest (it records {e['bytes']}): changed, corrupt, or a file "
                                      "of another save")
        return m

    def _check_metadata(self) -> None:
        from torch.distributed.checkpoint import filesystem, metadata as md
        m = self.meta
        if not isinstance(m, md.Metadata):
            raise ValueError(f"its top level is a {type(m).__name__}, not DCP's Metadata")
        entries, storage = m.state_dict_metadata, m.storage_data
        if not (isinstance(entries, dict) and isinstance(storage, dict)):
            raise ValueError("state_dict_metadata and storage_data must be dicts")
        sizes: dict = {}                # file -> its size, looked up once
        for key, info in storage.items():
            if not (isinstance(key, md.MetadataIndex) and isinstance(key.fqn, str)
                    and (key.offset is None or _size(key.offset))):
                raise ValueError(f"storage_data has a key {str(key)[:80]} that is not an index")
            if not (isinstance(info, filesystem._StorageInfo) and _plain_name(info.relative_path)
                    and _int(info.offset) and _int(info.length) and not info.transform_descriptors):
                raise ValueError(f"storage_data[{key.fqn!r}] is not a plain file name, offset and length "
                                 "(compressed or transformed entries are not read)")
            f = info.relative_path
            if self.manifest is not None and f not in self.files:
                raise ValueError(f"{key.fqn!r} is stored in {f}, which the manifest {MANIFEST} does not list")
            if f not in sizes:
                sizes[f] = os.lstat(os.path.join(self.path, f)).st_size if os.path.lexists(
                    os.path.join(self.path, f)) else -1
            if sizes[f] < 0:
                raise CheckpointError(f"{os.path.join(self.path, f)}: missing (it holds {key.fqn!r})")
            if info.offset + info.length > sizes[f]:
                raise CheckpointError(f"{os.path.join(self.path, f)}: {sizes[f]} bytes, shorter than where "
                                      f"{self.meta_path} says {key.fqn!r} ends ({info.offset + info.length})")
        for fqn, entry in entries.items():
            if not isinstance(fqn, str):
                raise ValueError(f"a key {str(fqn)[:60]} that is not a string")
            if isinstance(entry, md.BytesStorageMetadata):
                info = storage.get(md.MetadataIndex(fqn))
                if info is None or info.length > MAX_BYTES_ENTRY:
                    raise ValueError(f"{fqn!r} has no stored bytes, or more than {MAX_BYTES_ENTRY >> 20} MiB")
                continue
            if not (isinstance(entry, md.TensorStorageMetadata) and isinstance(entry.properties, md.TensorProperties)
                    and entry.properties.dtype in unpickle.DTYPES.values() and _size(entry.size)
                    and isinstance(entry.chunks, list)):
                raise ValueError(f"{fqn!r} is neither bytes nor a tensor of a known dtype and size")
            total = 0
            for chunk in entry.chunks:
                if not (isinstance(chunk, md.ChunkStorageMetadata) and _size(chunk.offsets, len(entry.size))
                        and _size(chunk.sizes, len(entry.size))
                        and all(o + s <= d for o, s, d in zip(chunk.offsets, chunk.sizes, entry.size))):
                    raise ValueError(f"a chunk of {fqn!r} lies outside its size {list(entry.size)}")
                info = storage.get(md.MetadataIndex(fqn, chunk.offsets))
                itemsize = entry.properties.dtype.itemsize
                if info is None or info.length < _numel(chunk.sizes) * itemsize:
                    raise ValueError(f"a chunk of {fqn!r} at {list(chunk.offsets)} has no stored bytes, or "
                                     "fewer than its elements")
                total += _numel(chunk.sizes)
            if total != _numel(entry.size):
                raise ValueError(f"the chunks of {fqn!r} hold {total} elements, its size {list(entry.size)} "
                                 f"{_numel(entry.size)}")

    # ------------------------------------------------------------------ what it holds

    def read_all(self) -> dict:
        """Every entry, by its flattened key ("model.embed.weight", "optim.state.w.exp_avg"):
        tensors on the CPU, whole, and the other values as they were saved."""
        from torch.distributed.checkpoint import metadata as md
        fds: dict = {}
        try:
            out = {}
            for fqn, entry in self.meta.state_dict_metadata.items():
                if isinstance(entry, md.BytesStorageMetadata):
                    out[fqn] = self._entry(fds, fqn, md.MetadataIndex(fqn))
                else:
                    out[fqn] = self._tensor(fds, fqn, entry)
            return out
        finally:
            for fd in fds.values():
                os.close(fd)

    def _entry(self, fds, fqn, index):
        info = self.meta.storage_data[index]
        f = os.path.join(self.path, info.relative_path)
        if f not in fds:
            fds[f] = open_regular(f, "a DCP data file")
        data = os.pread(fds[f], info.length, info.offset)
        if len(data) != info.length:
            raise CheckpointError(f"{f}: shorter than {self.meta_path} records ({fqn!r})")
        return unpickle.torch_archive(data, f"{f} ({fqn!r})")

    def _tensor(self, fds, fqn, entry):
        from torch.distributed.checkpoint import metadata as md
        whole = torch.empty(entry.size, dtype=entry.properties.dtype)
        covered = torch.zeros(entry.size, dtype=torch.bool)
        for chunk in entry.chunks:
            value = self._entry(fds, fqn, md.MetadataIndex(fqn, chunk.offsets))
            where = f"{os.path.join(self.path, self.meta.storage_data[md.MetadataIndex(fqn, chunk.offsets)].relative_path)}"
            if not (isinstance(value, torch.Tensor) and value.shape == chunk.sizes and value.dtype == entry.properties.dtype):
                got = f"{list(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise CheckpointError(f"{where}: the chunk of {fqn!r} at {list(chunk.offsets)} is {got}, "
                                      f"{self.meta_path} records {list(chunk.sizes)} {entry.properties.dtype}")
            region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            if covered[region].any():
                raise CheckpointError(f"{self.meta_path}: the chunks of {fqn!r} overlap at {list(chunk.offsets)}")
            covered[region] = True
            whole[region] = value
        return whole
