"""Reading a zerolab checkpoint, and refusing a bad one before anything changes.

zerolab.checkpoint's save writes a directory (metadata.json and one shard file per rank; see
its docstring); load and consolidate read it through a Reader:

    reader = Reader("ckpt/")                  # the metadata, checked
    reader.check_model(model)                 # the same parameters, shapes and buffers
    reader.fill(flat, "blocks.0.attn.qkv.weight", lo, hi, "value")   # elements [lo, hi)
    reader.check_all()                        # every shard read and verified, every element covered

Shards are read on demand and only with torch.load(weights_only=True), so loading never runs
code; each is checked against the size and SHA-256 the metadata records, and the metadata
against its own digest (zerolab.checkpoint.files: only regular files inside the directory, read
with a bound). Before torch.load inflates a shard, its zip members' sizes (from the zip's
directory) are checked against what the metadata's pieces, dtypes and buffers allow, `extra` at
its bounds (_inflates_to_at_most): a small file cannot declare gigabytes. Then every field is
checked before it is used: a malformed or crafted file is a CheckpointError naming the file and
the field, never a raw KeyError, RecursionError or MemoryError.
"""

from __future__ import annotations

import hashlib
import io
import os

import torch

from .files import (MAX_EXTRA_BYTES, MAX_EXTRA_PICKLE, METADATA, CheckpointError, file_digest, open_regular,
                    read_bounded, read_metadata, zip_sizes)

# 2: the metadata is covered by a digest and records its buffers' shapes; 3: the digest seals the
# raw bytes (checked before parsing) and each shard records its optimizer state's dtypes (so
# that what its zip may inflate to is known before torch.load runs)
FORMAT = 3
__all__ = ["FORMAT", "METADATA", "CheckpointError", "Reader", "file_digest",
           "identity"]


def _check_path(path, what="path"):
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"checkpoint: {what} must be a str or os.PathLike directory, got {type(path).__name__}")
    return os.fspath(path)


# ------------------------------------------------------------------ what a valid checkpoint holds
#
# Every field is checked before it is used, so a malformed or crafted file is a CheckpointError
# naming the field, never a KeyError deep in load, a read outside the directory, or a value
# that quietly changes what the optimizer updates.


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _is_int(x, low=0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _dtype(name, floating=False):
    """The torch dtype called `name` ("float32", "int64"...), or None."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or (floating and not dtype.is_floating_point):
        return None
    return dtype


def _is_shape(x) -> bool:
    return isinstance(x, list) and len(x) <= 64 and all(_is_int(d) for d in x)


def _check_metadata(meta) -> None:
    _need(isinstance(meta, dict), "the top level is not an object")
    _need(meta.get("format") == FORMAT, f"format {meta.get('format')!r}, expected {FORMAT}")
    _need(_is_int(meta.get("world_size"), 1), "world_size must be an int >= 1")
    _need(_is_int(meta.get("steps")), "steps must be an int >= 0")
    _need(isinstance(meta.get("engine"), str) and meta.get("precision") in ("fp32", "bf16", "fp16"),
          "engine must be a string and precision one of fp32, bf16, fp16")
    params = meta.get("params")
    _need(isinstance(params, dict), "params must be an object")
    for name, info in params.items():
        _need(isinstance(info, dict) and _is_shape(info.get("shape")) and isinstance(info.get("trainable"), bool)
              and _dtype(info.get("dtype"), floating=True) is not None,
              f"params[{name!r}] must have a shape, a floating dtype and trainable")
    buffers = meta.get("buffers")
    _need(isinstance(buffers, dict) and all(isinstance(b, dict) and _is_shape(b.get("shape"))
                                            and _dtype(b.get("dtype")) is not None for b in buffers.values()),
          "buffers must map names to a shape and a dtype")
    _need(not set(buffers) & set(params), "a name is both a parameter and a buffer")
    _check_keys(meta.get("keys"), params, buffers)
    shards = meta.get("shards")
    _need(isinstance(shards, list) and len(shards) == meta["world_size"], "one shard per rank")
    _need([s.get("rank") if isinstance(s, dict) else None for s in shards] == list(range(len(shards))),
          "shards must be listed in rank order, 0 .. world_size - 1")
    for s in shards:
        f = s.get("file")
        _check_file_entry(s, "shard")
        # offload="disk": the engine's files, linked into the checkpoint (optional)
        _need(isinstance(s.get("files", []), list), f"shard {f!r}: files must be a list")
        for entry in s.get("files", []):
            _check_file_entry(entry, "linked")
        _need(isinstance(s.get("state"), dict) and all(isinstance(k, str) and _dtype(v) is not None
                                                       for k, v in s["state"].items()),
              f"shard {f!r}: state must map optimizer state keys to dtypes")
        _need(isinstance(s.get("pieces"), list), f"shard {f!r} must list its pieces")
        for piece in s["pieces"]:
            _need(isinstance(piece, list) and len(piece) == 3 and isinstance(piece[0], str) and piece[0] in params
                  and _is_int(piece[1]) and _is_int(piece[2]) and piece[1] < piece[2]
                  <= _numel(params[piece[0]]["shape"]), f"piece {piece!r} of shard {f!r} is out of range")
    names = [e["file"] for s in shards for e in [s, *s.get("files", [])]]
    _need(len(names) == len(set(names)) and METADATA not in names, "a file is listed twice")


def _check_keys(keys, params, buffers) -> None:
    """The state_dict's keys: a parameter's own key names it, a tied weight's other keys name the
    parameter they share, a (persistent) buffer's key names itself; every parameter has a key."""
    _need(isinstance(keys, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()),
          "keys must map names to names")
    for key, name in keys.items():
        if name in params:
            _need(key == name or key not in params and key not in buffers,
                  f"keys[{key!r}] = {name!r}: a parameter's or buffer's own key must name itself")
        else:
            _need(key == name and key in buffers, f"keys[{key!r}] = {name!r} is neither a parameter nor a buffer")
    missing = set(params) - set(keys.values())
    _need(not missing, f"keys: parameter(s) {sorted(missing)[:3]} have no key")


def _check_file_entry(entry, what) -> None:
    """{"file", "bytes", "sha256"}: a file name inside the checkpoint directory (no directory
    part, no way out of it), its size and its hash."""
    _need(isinstance(entry, dict), f"{what} file entry {entry!r} must be an object")
    f = entry.get("file")
    _need(isinstance(f, str) and f == os.path.basename(f) and f not in ("", ".", "..")
          and not f.startswith(".") and "/" not in f and "\\" not in f,
          f"{what} file {f!r} must be a plain file name inside the checkpoint directory")
    _need(_is_int(entry.get("bytes")) and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64,
          f"{what} file {f!r} must record its size and SHA-256")


# the dtypes a linked file may hold, and their names in a piece's reference
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _is_values(x, n, files, dtype=None) -> bool:
    """A piece's values: a 1-D tensor of n elements, or a reference {file, dtype, offset} to n
    elements inside one of the shard's linked files; of dtype `dtype` when it is given."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 1 and x.numel() == n and x.dtype.is_floating_point and x.layout == torch.strided \
            and (dtype is None or x.dtype == dtype)
    return (isinstance(x, dict) and set(x) == {"file", "dtype", "offset"} and x["file"] in files
            and x["dtype"] in DTYPES and _is_int(x["offset"]) and (dtype is None or DTYPES[x["dtype"]] == dtype)
            and (x["offset"] + n) * DTYPES[x["dtype"]].itemsize <= files[x["file"]])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _inflates_to_at_most(entry, meta) -> tuple[int, int]:
    """(pickled, stored): the most a shard's torch.save archive may inflate to, from what the
    metadata records of it: its pieces' values in fp32, their element-wise optimizer state in the
    recorded dtypes, other optimizer state no larger than the values again (a step count, an
    Adafactor's row and column factors), rank 0's buffers, 1 MiB (RNG states, the loss scaler) and
    `extra` at its bounds; the pickle (piece names, hyperparameters) 4 KiB a piece besides."""
    pieces = entry["pieces"]
    per_element = 4 + sum(_dtype(d).itemsize for d in entry["state"].values()) + 4
    buffers = sum(_numel(b["shape"]) * _dtype(b["dtype"]).itemsize for b in meta["buffers"].values())
    stored = sum(hi - lo for _, lo, hi in pieces) * per_element + (buffers if entry["rank"] == 0 else 0) \
        + 1024 * len(pieces) + (1 << 20) + MAX_EXTRA_BYTES
    return 4096 * len(pieces) + (64 << 10) + MAX_EXTRA_PICKLE, stored


def _check_shard(content, entry, meta, files) -> None:
    listed = entry["pieces"]
    _need(isinstance(content, dict) and content.get("format") == FORMAT, "not a zerolab shard")
    _need(_is_int(content.get("rank")) and content["rank"] == entry["rank"] and _is_int(content.get("world_size"))
          and content["world_size"] == meta["world_size"],
          "its rank or world size is not the metadata's")
    pieces = content.get("pieces")
    _need(isinstance(pieces, list) and len(pieces) == len(listed), "not the pieces the metadata lists")
    for piece, (name, lo, hi) in zip(pieces, listed):
        _need(isinstance(piece, dict) and [piece.get("name"), piece.get("lo"), piece.get("hi")] == [name, lo, hi],
              f"piece {name!r} [{lo}, {hi}) is not where the metadata says")
        _need(isinstance(piece.get("state"), dict) and all(isinstance(k, str) for k in piece["state"]),
              f"piece {name!r}: state malformed")
        state = entry["state"]
        _need(set(piece["state"]) <= set(state), f"piece {name!r}: state the metadata does not record")
        _need(_is_values(piece.get("value"), hi - lo, files)
              and all(_is_values(v, hi - lo, files, _dtype(state[k])) for k, v in piece["state"].items())
              and isinstance(piece.get("scalars"), dict)
              and all(isinstance(k, str) for k in piece["scalars"]),
              f"piece {name!r} holds tensors of the wrong size or kind, or points outside its files")
    _need(content.get("steps") == meta["steps"] and _is_int(content.get("steps")),
          f"steps {content.get('steps')!r}, the metadata records {meta['steps']}")
    _need(isinstance(content.get("extra"), dict) and isinstance(content.get("rng"), dict)
          and isinstance(content.get("buffers"), dict) and isinstance(content.get("precision"), dict),
          "extra, rng, buffers or precision malformed")
    _need(content["precision"].get("precision") == meta["precision"],
          f"precision {content['precision'].get('precision')!r}, the metadata records {meta['precision']!r}")
    rng = content["rng"]
    _need(isinstance(rng.get("torch"), torch.Tensor) and rng["torch"].dtype == torch.uint8
          and rng["torch"].shape == torch.get_rng_state().shape
          and isinstance(rng.get("python"), (tuple, list)) and len(rng["python"]) == 3, "rng states malformed")
    buffers, saved = content["buffers"], meta["buffers"]
    if entry["rank"] == 0:             # rank 0's shard holds the buffers: exactly the recorded ones
        _need(set(buffers) == set(saved), "its buffers are not the ones the metadata records")
        for n, b in buffers.items():
            _need(isinstance(b, torch.Tensor) and list(b.shape) == saved[n]["shape"]
                  and b.dtype == _dtype(saved[n]["dtype"]), f"buffer {n!r} is not the shape or dtype recorded")
    else:
        _need(buffers == {}, "buffers are rank 0's to hold")
    groups = content.get("param_groups")
    _need(isinstance(groups, list) and all(isinstance(g, dict) and "params" not in g
                                           and all(isinstance(k, str) for k in g) for g in groups),
          "param_groups must hold hyperparameters only")


class Reader:
    """The metadata, and the shards read on demand (checked, weights_only)."""

    def __init__(self, path):
        self.path = path = _check_path(path)
        self.meta_path = os.path.join(path, METADATA)
        self.meta = read_metadata(path)         # the file, bounded, and its digest
        try:
            _check_metadata(self.meta)          # every field
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as e:
            raise CheckpointError(f"{self.meta_path}: not valid zerolab checkpoint metadata ({str(e)[:300]})") from None
        self.by_name: dict = {}   # name -> [(shard index, piece index, lo, hi)]
        for si, s in enumerate(self.meta["shards"]):
            for pi, (name, lo, hi) in enumerate(s["pieces"]):
                self.by_name.setdefault(name, []).append((si, pi, lo, hi))
        self._cache: dict = {}

    def identity(self) -> str:
        """What this checkpoint is, in one line: its step count and its digest, which covers
        every shard's. Ranks that resume must agree on it."""
        return f"step {self.meta['steps']}, sha256 {self.meta['sha256'][:16]}"

    def shard(self, si: int) -> dict:
        if si not in self._cache:
            s = self.meta["shards"][si]
            f = os.path.join(self.path, s["file"])
            if not os.path.lexists(f):
                raise CheckpointError(f"{f}: missing shard (rank {s['rank']} of {self.meta['world_size']})")
            data = read_bounded(f, s["bytes"], f"shard of rank {s['rank']}")
            if hashlib.sha256(data).hexdigest() != s["sha256"]:
                raise CheckpointError(f"{f}: corrupt: its SHA-256 does not match the metadata")
            # what torch.load would inflate, from the zip's directory, before it inflates anything
            (pickled, stored), (most_pickled, most_stored) = zip_sizes(data, f), _inflates_to_at_most(s, self.meta)
            if pickled > most_pickled or stored > most_stored:
                raise CheckpointError(f"{f}: would inflate to {stored:,} bytes of tensors and {pickled:,} of pickle; "
                                      f"what the metadata records of this shard allows at most {most_stored:,} and "
                                      f"{most_pickled:,} (a crafted file, or an `extra` beyond its bounds)")
            try:
                content = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - any unreadable file is reported the same way
                raise CheckpointError(f"{f}: cannot be read as a weights-only torch file "
                                      f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
            for entry in s.get("files", []):
                self._check_linked(entry)
            try:
                _check_shard(content, s, self.meta, {e["file"]: e["bytes"] for e in s.get("files", [])})
            except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as e:
                raise CheckpointError(f"{f}: does not hold what the metadata lists ({str(e)[:300]})") from None
            self._cache[si] = content
        return self._cache[si]

    def shard_path(self, si: int) -> str:
        return os.path.join(self.path, self.meta["shards"][si]["file"])

    def pieces_in_files(self, name, lo, hi):
        """(piece dict, the path of the shard that holds it) of every saved piece of `name`
        overlapping [lo, hi): an error about a piece's contents names its file."""
        for si, pi, plo, phi in self.by_name.get(name, []):
            if plo < hi and lo < phi:
                yield self.shard(si)["pieces"][pi], self.shard_path(si)

    def _check_linked(self, entry) -> None:
        """A linked file (offload="disk"): its size and SHA-256, read a block at a time, at most
        one byte more than recorded."""
        f = os.path.join(self.path, entry["file"])
        if not os.path.lexists(f):
            raise CheckpointError(f"{f}: missing (a file of the offload engine this checkpoint links)")
        size, sha256 = file_digest(f, entry["bytes"])
        if size != entry["bytes"] or sha256 != entry["sha256"]:
            raise CheckpointError(f"{f}: {size}{'+' if size > entry['bytes'] else ''} bytes whose SHA-256 "
                                  f"does not match the metadata (it records {entry['bytes']}): changed or corrupt")

    def _read(self, ref, start, count) -> torch.Tensor:
        """Elements [start, start + count) of a piece's values in a linked file."""
        out = torch.empty(count, dtype=DTYPES[ref["dtype"]])
        buf = memoryview(out.view(torch.uint8).numpy())
        with os.fdopen(open_regular(os.path.join(self.path, ref["file"])), "rb", buffering=0) as f:
            f.seek((ref["offset"] + start) * out.element_size())
            if f.readinto(buf) != len(buf):
                raise CheckpointError(f"{self.path}/{ref['file']}: shorter than the metadata says")
        return out

    def pieces(self, name, lo, hi):
        """(piece dict, lo, hi) of every saved piece of `name` overlapping [lo, hi)."""
        for si, pi, plo, phi in self.by_name.get(name, []):
            if plo < hi and lo < phi:
                yield self.shard(si)["pieces"][pi], plo, phi

    def fill(self, dst, name, lo, hi, field, must_cover=True) -> bool:
        """dst (1-D, hi - lo elements) <- elements [lo, hi) of `name`'s `field` ("value" or a state key)."""
        covered = 0
        for piece, plo, phi in self.pieces(name, lo, hi):
            src = piece["value"] if field == "value" else piece["state"].get(field)
            if src is None:
                continue
            a, b = max(lo, plo), min(hi, phi)
            if isinstance(src, dict):   # in a linked file: only these elements are read
                dst[a - lo:b - lo].copy_(self._read(src, a - plo, b - a))
            else:
                dst[a - lo:b - lo].copy_(src[a - plo:b - plo])
            covered += b - a
        if must_cover and covered != hi - lo:
            raise CheckpointError(f"{self.meta_path}: the shards cover {covered} of elements "
                                  f"[{lo}, {hi}) of {name!r}, not all of them")
        return covered > 0

    def check_model(self, model) -> None:
        """Raise unless `model` has exactly the saved parameters (names, shapes) and buffers."""
        saved = self.meta["params"]
        mine = {n: p for n, p in model.named_parameters()}
        for n, p in mine.items():
            if n not in saved:
                raise CheckpointError(f"{self.meta_path}: the model has parameter {n!r} "
                                      "but the checkpoint does not (a different model?)")
            if list(p.shape) != saved[n]["shape"]:
                raise CheckpointError(f"{self.meta_path}: parameter {n!r} has shape {list(p.shape)} in "
                                      f"the model but {saved[n]['shape']} in the checkpoint")
            if p.requires_grad != saved[n]["trainable"]:
                raise CheckpointError(f"{self.meta_path}: parameter {n!r} is "
                                      f"{'trainable' if p.requires_grad else 'frozen'} in the model "
                                      "but not in the checkpoint")
        for n in saved:
            if n not in mine:
                raise CheckpointError(f"{self.meta_path}: the checkpoint has parameter {n!r} "
                                      "but the model does not (a different model?)")
        buffers = dict(model.named_buffers())
        if sorted(buffers) != sorted(self.meta["buffers"]):
            raise CheckpointError(f"{self.meta_path}: the model's buffers differ from the checkpoint's")
        for n, b in buffers.items():
            saved = self.meta["buffers"][n]
            if list(b.shape) != saved["shape"] or str(b.dtype).replace("torch.", "") != saved["dtype"]:
                raise CheckpointError(f"{self.meta_path}: buffer {n!r} is {list(b.shape)} {b.dtype} in the "
                                      f"model but {saved['shape']} {saved['dtype']} in the checkpoint")

    def check_all(self) -> None:
        """Read every shard (size, hash, weights-only load) and check the pieces tile every parameter."""
        for si in range(len(self.meta["shards"])):
            self.shard(si)
        for name, info in self.meta["params"].items():
            numel = 1
            for d in info["shape"]:
                numel *= d
            spans = sorted((lo, hi) for _, _, lo, hi in self.by_name.get(name, []))
            at = 0
            for lo, hi in spans:            # end to end: no gap, no element saved twice
                if lo != at:
                    raise CheckpointError(f"{self.meta_path}: the pieces of parameter {name!r} "
                                          f"{'overlap' if lo < at else 'leave a gap'} at element {min(lo, at)}")
                at = hi
            if at != numel:
                raise CheckpointError(f"{self.meta_path}: the shards do not cover parameter {name!r} "
                                      f"(elements {at}..{numel} missing)")


def identity(path) -> str:
    """A checkpoint's step count and digest, in one line (see Reader.identity); the metadata is
    read and checked, the shards are not."""
    return Reader(path).identity()
