"""What every engine does the same way, written once.

An engine wraps a model and an optimizer factory; what differs between SingleProcess, NaiveDDP,
DDP, ZeRO stages 1-2 and ZeRO-3 is where the gradients, masters and optimizer state live and
when they travel. What does not differ lives here:

* calling the engine casts floating inputs to the compute dtype, then runs the forward
  (`_forward`: the data-parallel engines also measure activations there);
* step() measures the step's peak memory around the engine's own `_step` and counts steps;
* full_state_dict() consolidates: the engine says where the full fp32 value of each trained
  parameter is (`_full_values`, which may gather shards), and every key of model.state_dict()
  gets an fp32 CPU copy, tied weights one tensor under both keys, buffers and frozen
  parameters from the model itself;
* memory_report() measures: the engine lists the tensors it holds as parameters, gradients and
  optimizer state (`_memory_tensors`), and live storage is counted once each;
* zerolab.checkpoint asks the engine, never its internals, what to write and read: its name in
  the metadata (`checkpoint_kind`), the pieces of parameters this rank holds
  (`checkpoint_segments`) and how to rebuild the compute copy after a load (`refresh_compute`).

A subclass sets, in its __init__: model, precision, steps, track_peak, last_peak,
last_activations, optimizer, and defines _step, _full_values and _memory_tensors.
"""

from __future__ import annotations

import torch

from ..memory import PeakMemory, live_bytes


def flat_segments(tensor, bucket, shard, names) -> list:
    """Checkpoint segments of `tensor`, which holds slice `shard` of the flat padded `bucket`
    (zerolab.buckets.Bucket): one (tensor, offset in it, parameter name, lo, hi) per parameter
    that overlaps the slice, elements [lo, hi) of that parameter flattened."""
    out = []
    for p, o, n in zip(bucket.params, bucket.offsets, bucket.sizes):
        lo, hi = max(o, shard.start), min(o + n, shard.stop)
        if lo < hi:
            out.append((tensor, lo - shard.start, names[id(p)], lo - o, hi - o))
    return out


class Engine:
    """The shared part of every zerolab engine (see the module docstring)."""

    peak_meter = PeakMemory   # what step() measures its peak with (ZeRO-3 adds its own counts)

    # -------------------------------------------------------------- forward
    def __call__(self, *inputs):
        dtype = self.precision.compute_dtype
        inputs = [x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                  for x in inputs]
        return self._forward(*inputs)

    def _forward(self, *inputs):
        return self.model(*inputs)

    # -------------------------------------------------------------- the step
    def step(self) -> bool:
        """Unscale, check, clip, update. False (and nothing changed) when an fp16 overflow skips it."""
        if self.track_peak:
            with self.peak_meter("cpu") as peak:
                applied = self._step()
            self.last_peak = peak.peak
        else:
            applied = self._step()
        self.steps += 1
        return applied

    def _step(self) -> bool:
        raise NotImplementedError

    # -------------------------------------------------------------- state and memory
    def _full_values(self) -> dict:
        """{id(parameter): its full value} for every parameter the optimizer trains."""
        raise NotImplementedError

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
        raise NotImplementedError

    def memory_report(self) -> dict:
        """MEASURED bytes on this rank: params, grads, optimizer (fp32 masters + moments), total
        (those three), peak (of the last step), activations (left alive by the last forward;
        None where the engine does not track them)."""
        params, grads, optimizer = self._memory_tensors()
        out = {"params": live_bytes(params), "grads": live_bytes(grads, exclude=params),
               "optimizer": live_bytes(optimizer, exclude=params + grads)}
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        out["peak"] = self.last_peak
        out["activations"] = self.last_activations
        return out

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

    def _frozen_segments(self, names: dict) -> list:
        return [(p, 0, names[id(p)], 0, p.numel()) for p in self.model.parameters() if not p.requires_grad]

    @torch.no_grad()
    def refresh_compute(self, fill) -> None:
        """After a load wrote the masters: make the compute copies (what forward uses) match.
        fill(flat, p) copies parameter p's saved value into the flat tensor."""
        if self.precision.policy.needs_master:
            for p, m in zip(self.params, self.masters):
                p.data.copy_(m)
