"""What an engine holds, as the outside sees it: consolidated state dicts, measured memory,
and the pieces a checkpoint writes. A mixin of engines.base.Engine, written once for every engine.

* full_state_dict() consolidates: the engine says where the full fp32 value of each trained
  parameter is (`_full_values`, which may gather shards), and every key of model.state_dict()
  gets an fp32 CPU copy, tied weights one tensor under both keys; state_dict() is the same, and
  load_state_dict() writes a full state dict wherever this rank keeps each piece;
* memory_report() measures: the engine lists the tensors it holds (`_memory_tensors`), and
  live storage is counted once each;
* gathered_parameters(): ZeRO-3 gathers the full weights inside it; the others hold them always;
* zerolab.checkpoint asks the engine, never its internals, what to write and read: its name
  (`checkpoint_kind`), the pieces of parameters this rank holds (`checkpoint_segments`) and how
  to rebuild the compute copy after a load (`refresh_compute`).

The defaults suit one fp32 master per parameter (SingleProcess, NaiveDDP); the flat engines
redefine _full_values, _memory_tensors and the checkpoint pieces.
"""

from __future__ import annotations

import contextlib

import torch

from ..memory import live_bytes, optimizer_tensors
from . import grad_guard


def flat_segments(tensor, bucket, shard, names) -> list:
    """Checkpoint segments of `tensor`, which holds slice `shard` of the flat padded `bucket`
    (zerolab.buckets.Bucket): one (tensor, offset in it, parameter name, lo, hi) per parameter
    that overlaps the slice, elements [lo, hi) of that parameter flattened."""
    return [(tensor, pc.in_slice[0], names[id(pc.param)], *pc.in_param)
            for pc in bucket.pieces(shard) if pc.size]


class EngineState:
    """Consolidated state, measured memory and checkpoint pieces (see the module docstring)."""

    def _full_values(self) -> dict:
        """{id(parameter): its full value} for every parameter the optimizer trains."""
        return {id(p): m for p, m in zip(self.params, self.masters)}

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """fp32 tensors on CPU, same keys as model.state_dict(), no padding, tied weights shared.

        With sharded engines every rank must call it (the shards are gathered)."""
        value_of = self._full_values()
        converted: dict = {}   # id -> copy, so a tied weight stays one tensor under both keys
        out = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            if id(t) not in converted:
                src = value_of.get(id(t), t).detach()
                converted[id(t)] = src.float().cpu().clone() if src.is_floating_point() else src.cpu().clone()
            out[key] = converted[id(t)]
        return out

    def _memory_tensors(self) -> tuple[list, list, list]:
        """(parameter tensors, gradient tensors, optimizer tensors) this rank holds now."""
        params = list(self.model.parameters())
        grads = grad_guard.real(p.grad for p in params)
        masters = self.masters if self.masters is not self.params else []
        return params, grads, list(masters) + optimizer_tensors(self.optimizer)

    def memory_report(self) -> dict:
        """MEASURED bytes on this rank: params, grads, optimizer (fp32 masters + moments), total
        (those three), peak (allocated during the last step, above what it began with; None
        unless the engine was built with track_peak=True), activations (left alive by the last
        forward; None where the engine does not track them)."""
        self._zero_grad_seen(disarm=False)     # (the script's zero_grad() freed what it held)
        params, grads, optimizer = self._memory_tensors()
        grads = grads + self._chunk_tensors()   # (bitwise=True: the chunks' trees)
        out = {"params": live_bytes(params), "grads": live_bytes(grads, exclude=params),
               "optimizer": live_bytes(optimizer, exclude=params + grads)}
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        out["peak"] = self.last_peak if self.track_peak else None
        out["activations"] = self.last_activations
        return out

    @contextlib.contextmanager
    def gathered_parameters(self):
        """Inside, every parameter of the model holds its full value (ZeRO-3 gathers them; the
        other engines always hold them whole, so here it does nothing)."""
        yield

    def state_dict(self) -> dict:
        """The model's own keys, consolidated fp32 values on CPU (full_state_dict: with sharded
        engines every rank must call it). torch.save it; any nn.Module of the same shape, or
        this engine's load_state_dict, reads it back."""
        return self.full_state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Set every parameter and buffer from a full state dict (the model's keys), wherever
        this rank keeps it: fp32 masters, owned slices, unit shards; then the compute copies.
        Optimizer state is untouched (zerolab.checkpoint saves and restores it too)."""
        mine = self.model.state_dict(keep_vars=True)
        missing, extra = sorted(set(mine) - set(state_dict)), sorted(set(state_dict) - set(mine))
        bad = [k for k in mine if k in state_dict and tuple(state_dict[k].shape) != tuple(mine[k].shape)]
        if missing or extra or bad:
            raise ValueError(f"load_state_dict: the state dict does not fit the model: missing keys {missing}, "
                             f"unexpected keys {extra}, wrong shapes {bad}")
        names = {id(p): n for n, p in self.model.named_parameters()}
        opt, frozen, _, _ = self.checkpoint_segments(names)
        for t, t_lo, name, lo, hi in opt + frozen:
            with self.resident(t):
                t.view(-1)[t_lo:t_lo + hi - lo].copy_(state_dict[name].reshape(-1)[lo:hi])
        self.refresh_compute(lambda flat, p: flat.copy_(state_dict[names[id(p)]].reshape(-1)))
        for name, b in self.model.named_buffers():
            b.copy_(state_dict[name])

    # -------------------------------------------------------------- what a checkpoint holds
    checkpoint_kind = "single"     # the engine's name in a checkpoint's metadata

    def checkpoint_segments(self, names: dict):
        """(optimizer segments, frozen segments, optimizer replicated?, frozen replicated?).

        A segment (tensor, t_lo, name, lo, hi) says: elements [t_lo, t_lo + hi - lo) of
        tensor.view(-1) are elements [lo, hi) of parameter `name` flattened; `names` maps
        id(parameter) to its name. Optimizer segments are the tensors the optimizer updates (the
        fp32 masters), whose optimizer state is saved beside them. Replicated pieces are held
        whole by every rank, so each rank writes 1/N of them. Here: one master per parameter."""
        opt = [(m, 0, names[id(p)], 0, p.numel()) for p, m in zip(self.params, self.masters)]
        return opt, self._frozen_segments(names), True, True

    def optimizer_segments(self, names: dict):
        """checkpoint_segments: each optimizer segment is on the tensor the optimizer holds (a
        master, or a flat engine's per-parameter view), where its state is kept."""
        return self.checkpoint_segments(names)

    def _frozen_segments(self, names: dict) -> list:
        return [(p, 0, names[id(p)], 0, p.numel()) for p in self.model.parameters() if not p.requires_grad]

    @torch.no_grad()
    def refresh_compute(self, fill) -> None:
        """After a load wrote the masters: make the compute copies (what forward uses) match.
        fill(flat, p) copies parameter p's saved value into the flat tensor."""
        self._publish()

    def resident(self, tensor):
        """A context inside which a segment's tensor is in memory, and after which what was
        written into it (or put in its optimizer state) is kept. Everything is in memory here;
        offload="disk" pages the tensor in and writes it back."""
        return contextlib.nullcontext()

    def checkpoint_files(self) -> dict:
        """{id(tensor): (path, element offset)} of the segment and optimizer-state tensors whose
        latest values are in a file, not in memory (offload="disk"): zerolab.checkpoint links
        those files instead of copying their bytes. Here: none."""
        return {}
