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
            with open(self.meta_path) as f:
                self.meta = json.load(f)
            if self.meta.get("format") != FORMAT:
                raise ValueError(f"format {self.meta.get('format')!r}, expected {FORMAT}")
            for key in ("params", "shards", "keys", "world_size", "buffers"):
                self.meta[key]
        except (ValueError, KeyError, TypeError) as e:
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
            if not isinstance(content, dict) or content.get("format") != FORMAT or \
                    len(content.get("pieces", ())) != len(s["pieces"]):
                raise CheckpointError(f"{f}: does not hold the pieces the metadata lists")
            self._cache[si] = content
        return self._cache[si]

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
