"""Reading a zerolab checkpoint, and refusing a bad one before anything changes.

zerolab.checkpoint's save writes a directory (metadata.json and one shard file per rank; see
its docstring); load and consolidate read it through a Reader:

    reader = Reader("ckpt/")                  # the metadata, checked
    reader.check_model(model)                 # the same parameters, shapes and buffers
    reader.fill(flat, "blocks.0.attn.qkv.weight", lo, hi, "value")   # elements [lo, hi)
    reader.check_all()                        # every shard read and verified, every element covered

Shards are read on demand and only with torch.load(weights_only=True), so loading never runs
code; each is checked against the size and SHA-256 the metadata records.
"""

from __future__ import annotations

import hashlib
import io
import json
import os

import torch

FORMAT = 1
METADATA = "metadata.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the file and the problem."""


def _check_path(path, what="path"):
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"checkpoint: {what} must be a str or os.PathLike directory, got {type(path).__name__}")
    return os.fspath(path)


def check_save_dir(path) -> str:
    """Raise CheckpointError now (before training) unless `path` is, or can become, a writable
    directory: a save that fails only at step 1000 loses 1000 steps."""
    path = _check_path(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path}: exists and is not a directory; checkpoints are directories")
    parent = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"{path}: cannot write there ({parent} is not writable)")
    return path


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


def _check_metadata(meta) -> None:
    _need(isinstance(meta, dict), "the top level is not an object")
    _need(meta.get("format") == FORMAT, f"format {meta.get('format')!r}, expected {FORMAT}")
    _need(_is_int(meta.get("world_size"), 1), "world_size must be an int >= 1")
    _need(_is_int(meta.get("steps")), "steps must be an int >= 0")
    _need(isinstance(meta.get("engine"), str) and isinstance(meta.get("precision"), str),
          "engine and precision must be strings")
    params = meta.get("params")
    _need(isinstance(params, dict), "params must be an object")
    for name, info in params.items():
        _need(isinstance(info, dict) and isinstance(info.get("shape"), list)
              and all(_is_int(d) for d in info["shape"]) and isinstance(info.get("trainable"), bool)
              and isinstance(info.get("dtype"), str), f"params[{name!r}] must have shape, dtype, trainable")
    _need(isinstance(meta.get("buffers"), list) and all(isinstance(b, str) for b in meta["buffers"]),
          "buffers must be a list of names")
    _need(isinstance(meta.get("keys"), dict) and all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in meta["keys"].items()), "keys must map names to names")
    shards = meta.get("shards")
    _need(isinstance(shards, list) and len(shards) == meta["world_size"], "one shard per rank")
    _need(sorted(s.get("rank") for s in shards if isinstance(s, dict)) == list(range(len(shards))),
          "shard ranks must be 0 .. world_size - 1")
    for s in shards:
        f = s.get("file")
        _check_file_entry(s, "shard")
        # offload="disk": the engine's files, linked into the checkpoint (optional)
        _need(isinstance(s.get("files", []), list), f"shard {f!r}: files must be a list")
        for entry in s.get("files", []):
            _check_file_entry(entry, "linked")
        _need(isinstance(s.get("pieces"), list), f"shard {f!r} must list its pieces")
        for piece in s["pieces"]:
            _need(isinstance(piece, list) and len(piece) == 3 and piece[0] in params
                  and _is_int(piece[1]) and _is_int(piece[2]) and piece[1] < piece[2]
                  <= _numel(params[piece[0]]["shape"]), f"piece {piece!r} of shard {f!r} is out of range")


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


def file_digest(path) -> tuple[int, str]:
    """(size, SHA-256) of a file, read a block at a time (a linked file may be the model)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


# the dtypes a linked file may hold, and their names in a piece's reference
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _is_values(x, n, files) -> bool:
    """A piece's values: a 1-D tensor of n elements, or a reference {file, dtype, offset} to n
    elements inside one of the shard's linked files."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 1 and x.numel() == n
    return (isinstance(x, dict) and set(x) == {"file", "dtype", "offset"} and x["file"] in files
            and x["dtype"] in DTYPES and _is_int(x["offset"])
            and (x["offset"] + n) * DTYPES[x["dtype"]].itemsize <= files[x["file"]])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_shard(content, listed, files) -> None:
    _need(isinstance(content, dict) and content.get("format") == FORMAT, "not a zerolab shard")
    pieces = content.get("pieces")
    _need(isinstance(pieces, list) and len(pieces) == len(listed), "not the pieces the metadata lists")
    for piece, (name, lo, hi) in zip(pieces, listed):
        _need(isinstance(piece, dict) and [piece.get("name"), piece.get("lo"), piece.get("hi")] == [name, lo, hi],
              f"piece {name!r} [{lo}, {hi}) is not where the metadata says")
        _need(isinstance(piece.get("state"), dict), f"piece {name!r}: state malformed")
        values = [piece.get("value")] + list(piece["state"].values())
        _need(all(_is_values(v, hi - lo, files) for v in values) and isinstance(piece.get("scalars"), dict),
              f"piece {name!r} holds tensors of the wrong size, or points outside its files")
    _need(_is_int(content.get("steps")) and isinstance(content.get("extra"), dict)
          and isinstance(content.get("rng"), dict) and isinstance(content.get("buffers"), dict)
          and isinstance(content.get("precision"), dict), "steps, extra, rng, buffers or precision malformed")
    _need(isinstance(content["precision"].get("precision"), str), "precision malformed")
    rng = content["rng"]
    _need(isinstance(rng.get("torch"), torch.Tensor) and rng["torch"].dtype == torch.uint8
          and rng["torch"].shape == torch.get_rng_state().shape
          and isinstance(rng.get("python"), (tuple, list)) and len(rng["python"]) == 3, "rng states malformed")
    _need(all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in content["buffers"].items()),
          "buffers malformed")
    groups = content.get("param_groups")
    _need(isinstance(groups, list) and all(isinstance(g, dict) and "params" not in g for g in groups),
          "param_groups must hold hyperparameters only")


class Reader:
    """The metadata, and the shards read on demand (checked, weights_only)."""

    def __init__(self, path):
        self.path = path = _check_path(path)
        self.meta_path = os.path.join(path, METADATA)
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: no such checkpoint directory")
        if not os.path.exists(self.meta_path):
            raise CheckpointError(f"{self.meta_path}: missing; the directory holds no complete "
                                  "checkpoint (a save that never finished leaves none)")
        try:
            with open(self.meta_path, encoding="utf-8") as f:
                self.meta = json.load(f)
            _check_metadata(self.meta)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise CheckpointError(f"{self.meta_path}: not valid zerolab checkpoint metadata ({e})") from None
        self.by_name: dict = {}   # name -> [(shard index, piece index, lo, hi)]
        for si, s in enumerate(self.meta["shards"]):
            for pi, (name, lo, hi) in enumerate(s["pieces"]):
                self.by_name.setdefault(name, []).append((si, pi, lo, hi))
        self._cache: dict = {}

    def shard(self, si: int) -> dict:
        if si not in self._cache:
            s = self.meta["shards"][si]
            f = os.path.join(self.path, s["file"])
            if not os.path.exists(f):
                raise CheckpointError(f"{f}: missing shard (rank {s['rank']} of {self.meta['world_size']})")
            with open(f, "rb") as fh:
                data = fh.read()
            if len(data) != s["bytes"]:
                raise CheckpointError(f"{f}: truncated or wrong size: {len(data)} bytes, the metadata "
                                      f"records {s['bytes']}")
            if hashlib.sha256(data).hexdigest() != s["sha256"]:
                raise CheckpointError(f"{f}: corrupt: its SHA-256 does not match the metadata")
            try:
                content = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - any unreadable file is reported the same way
                raise CheckpointError(f"{f}: cannot be read as a weights-only torch file "
                                      f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
            for entry in s.get("files", []):
                self._check_linked(entry)
            try:
                _check_shard(content, s["pieces"], {e["file"]: e["bytes"] for e in s.get("files", [])})
            except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
                raise CheckpointError(f"{f}: does not hold what the metadata lists ({e})") from None
            self._cache[si] = content
        return self._cache[si]

    def _check_linked(self, entry) -> None:
        """A linked file (offload="disk"): its size and SHA-256, read a block at a time."""
        f = os.path.join(self.path, entry["file"])
        if not os.path.exists(f):
            raise CheckpointError(f"{f}: missing (a file of the offload engine this checkpoint links)")
        size, sha256 = file_digest(f)
        if size != entry["bytes"] or sha256 != entry["sha256"]:
            raise CheckpointError(f"{f}: {size} bytes whose SHA-256 does not match the metadata "
                                  f"(it records {entry['bytes']}): changed or corrupt")

    def _read(self, ref, start, count) -> torch.Tensor:
        """Elements [start, start + count) of a piece's values in a linked file."""
        out = torch.empty(count, dtype=DTYPES[ref["dtype"]])
        buf = memoryview(out.view(torch.uint8).numpy())
        with open(os.path.join(self.path, ref["file"]), "rb", buffering=0) as f:
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
        if sorted(n for n, _ in model.named_buffers()) != sorted(self.meta["buffers"]):
            raise CheckpointError(f"{self.meta_path}: the model's buffers differ from the checkpoint's")

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
            for lo, hi in spans:
                if lo != at:
                    break
                at = hi
            if at != numel:
                raise CheckpointError(f"{self.meta_path}: the shards do not cover parameter {name!r} "
                                      f"(elements {at}..{numel} missing)")
