"""ZeRO-Infinity's NVMe tier: stage 3 with every model state in files, a unit at a time.

    engine = zl.ZeRO(model, partial(torch.optim.AdamW, lr=3e-4), stage=3,
                     offload="disk", offload_dir="/nvme/run1", prefetch=1)

ZeRO-3 already cuts the model into units and holds only this rank's 1/N shard of each. Here
even the shards leave memory: each unit's parameter shard (compute dtype), fp32 master shard,
optimizer state (Adam's two moments) and reduced gradient shard live in files under
offload_dir/rank<r>/ (zerolab.engines.offload.pager: one I/O thread, atomic writes, byte counts from
/proc). What is in memory at any moment is the unit being computed, the units being gathered
ahead of it, and the one being read ahead of those (prefetch=0: each file is read only when
its unit needs it, so nothing is ahead, and nothing of the disk's time is hidden):

* forward and backward: a unit's parameter shard is read just before its all-gather (the
  reader thread started reading it while the unit before it computed: one unit ahead of the
  `prefetch` all-gathers) and freed when the unit is released. It has not changed, so it is
  not written back.
* backward: each reduced gradient shard is written to its file as soon as it is reduced (a
  second micro-batch reads it back and adds to it).
* step, in two passes over the units, because clipping and the fp16 overflow check need the
  WHOLE gradient before any unit may move: pass 1 reads each gradient shard and takes its sum
  and squared norm; pass 2 reads the gradient again with the unit's master and optimizer
  state, moves the gradient to the host (engine.transfers, as offload="optimizer"), unscales
  and clips it, runs the optimizer on that unit alone, and writes master, state and the new
  parameter shard back. Adam is elementwise with its state per tensor, so a step unit by
  unit is the same arithmetic as one step over all: bit for bit the engine without offload.

Disk bytes per rank and step, k = this rank's shard elements (sum over units), c the compute
dtype's bytes, g the gradient's (c, or 4 once micro-batches accumulate in fp32):

    read    (2c + 2g + 12) k     parameters in forward and backward, gradient twice, master and state
    written (c + g + 12) k       gradient, master and state, the new parameter shard

(the first step reads no optimizer state: 8k less). engine.disk_io() reports the OS's count.

Checkpoints (zerolab.checkpoint) keep the bound too. A save copies no tensor: it hard-links
each unit's master, optimizer-state and frozen-shard files into the checkpoint directory and
records where each piece is in them. The pager never writes a file in place (it writes a new
file and renames it over the old one), so the linked file keeps the saved bytes while training
goes on. A load reads each piece from its file into one unit's master at a time, which is then
written back to this engine's files (`resident`).
"""

from __future__ import annotations

import contextlib
import os
import shutil

import torch
import torch.nn as nn

from ...precision import clip_coefficient, found_overflow, global_norm, squared_norm
from .. import options
from ..zero3.engine import ZeRO3
from ..zero3.units import Unit
from ...optim.param_groups import run_update
from .optimizer import OptimizerOffload, host_empty
from .pager import Pager


def check_offload_dir(offload_dir, model) -> None:
    """A clear error before anything is built: the directory must be creatable, writable, and
    hold this run's files: 20 bytes per parameter in fp32 over all ranks (parameter, master,
    two moments, gradient), 24 asked for (a .tmp file beside each one being rewritten)."""
    try:
        os.makedirs(offload_dir, exist_ok=True)
        probe = os.path.join(offload_dir, f".zerolab-probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.remove(probe)
    except OSError as e:
        raise PermissionError(f"offload_dir {offload_dir!r} is not a writable directory ({e.strerror}): "
                              "point offload_dir at a directory on a local disk this process may write to"
                              ) from None
    need = 24 * sum(p.numel() for p in model.parameters())
    free = shutil.disk_usage(offload_dir).free
    if free < need:
        raise OSError(f"offload_dir {offload_dir!r} has {free / 2**20:.1f} MiB free, and offload='disk' "
                      f"needs about {need / 2**20:.1f} MiB for this model's shards (24 bytes per "
                      "parameter: parameters, masters, optimizer state and gradients, all ranks). "
                      "Free space there or choose another offload_dir.")


class DiskUnit(Unit):
    """A Unit whose parameter and gradient shards live in files between uses."""

    def key(self, what: str) -> str:
        return f"unit{self.index}.{what}"

    def gather(self, phase):
        if not (self.gathered or self.handles):
            for kind in self.full:      # the shard must be in memory before its all-gather
                self.pager.wait(self.key(kind))
        super().gather(phase)

    def release(self, phase):
        was_gathered = self.gathered or bool(self.handles)
        super().release(phase)
        if was_gathered:                # unchanged since it was read: freed, not written
            for kind in self.full:
                self.pager.out(self.key(kind), self.shard[kind], dirty=False)

    def finish_reduce(self):
        if self.grad_shard is not None:  # a later micro-batch adds to the shard in the file
            self.pager.wait(self.key("grad"))
        super().finish_reduce()
        self.pager.out(self.key("grad"), self.grad_shard, dirty=True)


class ZeRO3Disk(OptimizerOffload, ZeRO3):
    """ZeRO3 with offload="disk" (module docstring). offload_dir: where each rank keeps its
    files (in offload_dir/rank<r>); prefetch: all-gathers ahead, as ZeRO3's; the files are read
    one unit further ahead."""

    offload = "disk"
    awaits_optimizer = False            # the views are cut as the units go to their files: pass it in
    grads_in_memory = False             # p.grad after backward: shape and dtype; its values are in files

    takes = ZeRO3.takes + options.OFFLOAD
    unit_class = DiskUnit
    pager = None                        # made by the first unit built (it needs this rank's number)

    def _read_options(self, opts, model) -> None:
        check_offload_dir(opts.offload.offload_dir, model)
        self.offload_dir = opts.offload.offload_dir

    # -------------------------------------------------------------- construction
    def _unit_built(self, u):
        """Each unit goes to its files as soon as it exists: at most one is ever in memory."""
        if self.pager is None:
            self.pager = Pager(os.path.join(self.offload_dir, f"rank{self.rank}"))
        u.pager = self.pager
        if u.master is not None:        # the host master (in fp32 a copy of the shard, not it)
            h = host_empty(u.master.shape, torch.float32, u.master.is_cuda)
            h.copy_(u.master.detach())
            u.master = nn.Parameter(h)
            self.pager.out(u.key("master"), u.master.data)
        for kind, shard in u.shard.items():
            self.pager.out(u.key(kind), shard)
        self.pager.flush()              # (or the next units would be built while this one is written)

    @contextlib.contextmanager
    def _master_resident(self, i):
        """Master i in memory while the optimizer's views are cut from it (one unit at a time)."""
        key = self._trained()[i].key("master")
        self.pager.wait(key)
        yield
        self.pager.out(key, self.masters[i].data, dirty=False)

    def _move_masters_to_host(self):
        self._dev = self._compute_shards()   # (the masters were made on the host, unit by unit)
        for u in self._trained():
            if u.key("master") not in self.pager.on_disk:
                self.pager.out(u.key("master"), u.master.data)
        self.pager.flush()

    def _make_host_buffers(self):
        """None kept: a unit's step makes its fp32 gradient and staging buffer and drops them with
        the unit (between steps the files hold everything; whole-shard buffers would undo that)."""
        self._grad32, self._staging, self._shard_of = [], {}, {}

    # -------------------------------------------------------------- reading ahead
    def _prefetch_after(self, order, u, phase):
        super()._prefetch_after(order, u, phase)
        if u not in order:
            return
        i = order.index(u)
        ahead = [v for v in order[i + 1:] if v is not u and not (phase == "backward" and v.reduced)]
        # the files one unit further ahead than the all-gathers (prefetch=0: nothing ahead)
        for v in ahead[:self.prefetch + 1 if self.prefetch else 0]:
            for kind in v.full:
                self.pager.fetch(v.key(kind))

    # -------------------------------------------------------------- the step, unit by unit
    def _state(self, i, u) -> list:
        """(name, tensor) of unit u's optimizer state of its shape (moments; not step counts)."""
        out = []
        for j, t in enumerate(self._opt_tensors(i)):
            for k, v in self.optimizer.state.get(t, {}).items():
                if isinstance(v, torch.Tensor) and v.shape == t.shape:
                    out.append((u.key(f"opt{j}.{k}"), v))
        return out

    def _opt_tensors(self, i) -> list:
        """The tensors the optimizer holds for master i: its views (optim.param_views)."""
        return [] if self.views is None else [v for v, _ in self.views.of_master(i)]

    def _fetch_unit(self, names):
        """Start reading the files among `names` that exist (the first step has no state yet)."""
        for name in names:
            if name in self.pager.on_disk:
                self.pager.fetch(name)

    def _step_names(self, i, u) -> list:
        return [u.key("grad"), u.key("master")] + [n for n, _ in self._state(i, u)]

    def _grad_in(self, u):
        """Unit u's reduced gradient shard, read from its file (zeros if no backward reached it)."""
        if u.grad_shard is None:
            return torch.zeros(u.master.shape, dtype=u.shard["train"].dtype)
        return self.pager.wait(u.key("grad"))

    # The step is Engine's template; its four parts that touch gradients stream them instead,
    # because clipping and the fp16 overflow check need the WHOLE gradient before any unit may move.
    _pass1 = None                       # (finite, per-unit sums, squared norm) of the gradient

    def _step_grads(self) -> list:
        """Pass 1: read each unit's gradient shard once (one in memory at a time) for its sum,
        its finiteness (unscaled, in fp16) and its squared norm. Holds no gradient: returns []."""
        train = self._trained()
        scaler = self.precision.scaler
        inv = None if scaler is None else 1.0 / scaler.scale
        sums, sq, finite = [], None, True
        for i, u in enumerate(train):
            if self.prefetch and i + 1 < len(train) and train[i + 1].grad_shard is not None:
                self.pager.fetch(train[i + 1].key("grad"))
            g = self._grad_in(u).float()
            if inv is not None:
                g = g.mul(inv)          # (the same values the in-place unscale gives)
                finite = finite and bool(torch.isfinite(g).all())
            else:
                sums.append(g.sum())
            if sq is None:              # on the gradients' device (a GPU's, or the CPU)
                sq = torch.zeros(1, dtype=torch.float32, device=g.device)
            squared_norm([g], into=sq)
            if u.grad_shard is not None:
                self.pager.out(u.key("grad"), u.grad_shard, dirty=False)
        self._pass1 = (finite, sums, torch.zeros(1) if sq is None else sq)
        return []

    def _grads_finite(self, grads) -> bool:
        finite, sums, _ = self._pass1
        if self.precision.scaler is not None:   # every rank agrees (the flag is all-reduced)
            return not found_overflow([] if finite else [torch.tensor([float("inf")])],
                                      self.precision.ledger, self.precision.group)
        return super()._grads_finite(sums)      # raises on inf / nan (fp32, bf16), from the sums

    def _grad_sums(self, grads) -> list:
        return grads                            # (pass 1's sums are the "gradients" here)

    def _clip(self, grads, max_norm) -> None:
        """The clip coefficient from pass 1's squared norm; pass 2 applies it unit by unit."""
        self.last_grad_norm = global_norm(self._pass1[2], self.comm, self.norm_group)
        self._coef = clip_coefficient(self.last_grad_norm, max_norm)

    _coef = 1.0

    def _hand_grads(self) -> None:
        """Pass 2: each unit's update (unscaled, clipped), reading the next unit's files meanwhile.
        The engine runs the optimizer itself here, a unit at a time (run_update), so the
        optimizer's own update after this hook finds no gradient and does nothing."""
        scaler = self.precision.scaler
        inv = None if scaler is None else 1.0 / scaler.scale
        train = self._trained()
        for i, u in enumerate(train):
            if self.prefetch and i + 1 < len(train):
                self._fetch_unit(self._step_names(i + 1, train[i + 1]))
            self._update_unit(i, u, inv, self._coef)
        self._pass1, self._coef = None, 1.0

    def _land_update(self) -> None:
        """(Each unit's new shard went up and to its file in pass 2.)"""

    def _update_unit(self, i, u, inv, coef):
        g = self._grad_in(u)
        down = self.transfers.copy(host_empty(g.shape, g.dtype, g.is_cuda), g, "d2h", tag=f"grad{i}").float()
        if u.grad_shard is not None:    # (freed now: the host copy is what the step reads)
            self.pager.out(u.key("grad"), u.grad_shard, dirty=False)
        del g
        if inv is not None:
            down.mul_(inv)
        if coef < 1.0:
            down.mul_(coef)
        self.pager.wait(u.key("master"))
        master = u.master               # (the pager holds its .data: the same storage)
        for name, v in self._state(i, u):
            self.pager.wait(name) if v.untyped_storage().nbytes() == 0 else self.pager.adopt(name, v)
        master.grad = down
        self.views.point_grads(self._unused_params(), only={i})   # this unit's views only
        run_update(self.optimizer)
        self.views.drop_grads()
        master.grad = None
        del down
        for name, v in self._state(i, u):   # (the first step creates the state here)
            if name not in self.pager.resident:
                self.pager.adopt(name, v)
            self.pager.out(name, v)
        shard = self.pager.new(u.key("train"), u.shard["train"])
        self._upload(shard, master)
        self.pager.out(u.key("master"), master.data)
        self.pager.out(u.key("train"), shard)

    def _release_grads(self):
        for u in self.units:
            if u.grad_shard is not None:
                self.pager.forget(u.key("grad"))
        super()._release_grads()

    # -------------------------------------------------------------- whole-state operations
    def _page_in_all(self):
        """Every master and shard in memory, for full_state_dict (which gives every rank the
        whole model anyway: the bound on memory cannot hold there)."""
        for u in self._trained():
            self.pager.wait(u.key("master"))
        for u in self.units:
            for kind in u.shard:
                self.pager.wait(u.key(kind))

    def _page_out_all(self, dirty):
        for i, u in enumerate(self._trained()):
            self.pager.out(u.key("master"), u.master.data, dirty)
            for name, v in self._state(i, u):
                self.pager.out(name, v, dirty)
        for u in self.units:
            if not u.gathered:
                for kind in u.shard:
                    self.pager.out(u.key(kind), u.shard[kind], dirty)

    def _full_values(self) -> dict:
        self._page_in_all()
        try:
            return super()._full_values()
        finally:
            self._page_out_all(dirty=False)

    # -------------------------------------------------------------- checkpoints, a unit at a time
    def _homes(self) -> dict:
        """id(t) -> (unit index, unit, file name, element offset, state prefix) for every tensor a
        checkpoint or load_state_dict reads or writes: each master, each of the optimizer's views
        of it (with the view's optimizer state under its own names) and each frozen shard."""
        homes = {}
        for i, u in enumerate(self._trained()):
            # (load_state_dict writes the masters themselves, a checkpoint the views)
            homes[id(self.masters[i])] = (i, u, u.key("master"), 0, None)
            for j, (v, lo) in enumerate(self.views.of_master(i) if self.views is not None else []):
                homes[id(v)] = (i, u, u.key("master"), lo, u.key(f"opt{j}."))
        for u in self.units:
            if "frozen" in u.shard:
                homes[id(u.shard["frozen"])] = (None, u, u.key("frozen"), 0, None)
        return homes

    def _states_of(self, home) -> list:
        i, u, _, _, prefix = home
        return [] if prefix is None else [(n, v) for n, v in self._state(i, u) if n.startswith(prefix)]

    def checkpoint_files(self) -> dict:
        # every file written and up to date first; then no byte of the states needs memory
        self._page_out_all(dirty=False)
        self.pager.flush()
        out = {}
        for key, home in self._homes().items():
            out[key] = (self.pager.path(home[2]), home[3])
            for name, v in self._states_of(home):
                out[id(v)] = (self.pager.path(name), 0)
        return out

    @contextlib.contextmanager
    def resident(self, t):
        """A load writes a tensor here: its file is read in, and the tensor (with any optimizer
        state the load put beside it) written back and freed after, so at most one unit's
        master is in memory while a checkpoint loads."""
        home = self._homes().get(id(t))
        if home is None:
            yield
            return
        name = home[2]
        self.pager.wait(name)
        yield
        self.pager.out(name, self.pager.tensors[name], dirty=True)
        for state, v in self._states_of(home):
            if v.untyped_storage().nbytes() > 0:    # (new: the old ones were never paged in)
                self.pager.adopt(state, v)
                self.pager.out(state, v)

    def owned_grads(self) -> list:
        # engine.clip_grad_norm_() reads every gradient shard: they come back into memory
        for u in self._trained():
            if u.grad_shard is not None:
                self.pager.wait(u.key("grad"))
        return super().owned_grads()

    def _publish(self):
        # after a load wrote the masters: new parameter shards, to their files
        for u in self._trained():
            master = self.pager.wait(u.key("master"))
            shard = self.pager.new(u.key("train"), u.shard["train"])
            self._upload(shard, master)
            self.pager.out(u.key("train"), shard)
            self.pager.out(u.key("master"), master, dirty=False)
        self.pager.flush()

    def disk_io(self) -> dict:
        """Bytes this rank's I/O thread has read and written (from /proc), after the queue drains."""
        self.pager.flush()
        return self.pager.io()
