"""ZeRO stage 3 (P_os+g+p): every model state is sharded, parameters included.

    engine = ZeRO3(model, functools.partial(torch.optim.AdamW, lr=3e-4), prefetch=1)
    logits, loss = zl.models.gpt_loss(engine, batch)
    engine.backward(loss)
    engine.step()

The model is cut into UNITS: by default each child of its largest nn.ModuleList /
nn.Sequential (the GPT's `blocks`), plus a ROOT unit holding every other parameter (and any
parameter shared by two units). Each unit keeps its parameters in one flat padded buffer
(zerolab.buckets.Bucket layout) and each rank keeps only its 1/N shard of it. A unit's
parameters live the life of a state machine (the events in `engine.events`):

    partitioned --all-gather--> gathered --forward/backward--> in use --free--> partitioned

* forward:  a unit's pre-forward hook issues its all-gather (unless the prefetch of the unit
  before it already did), issues the all-gathers of the next `prefetch` units, and only
  then waits for its own; its post-forward hook frees the gathered buffer by RESIZING ITS
  STORAGE TO 0 (the parameters stay views into it, so tensors autograd saved keep pointing
  at the right memory once it is gathered again).
* backward: a hook on the unit's outputs gathers it again, prefetching the units backward
  needs next (the reverse of the order in which their forwards ENDED: the root, whose
  forward ends last, then the last block, ...); when every trainable parameter's gradient
  has been accumulated and the gradient of the unit's inputs has been computed, the full
  gradient is reduce-scattered (each rank keeps its shard) and the parameters are freed.
  A full gradient is freed once its reduce-scatter is done, which is checked when the next
  unit's starts: at most two are in flight (plus the root's, filled from the first to the
  last moment of backward: its head runs first, its embeddings last).
* step:     the optimizer updates this rank's fp32 shard. Nothing is gathered: the next
  forward gathers what it needs.

Per step each rank sends (N-1)/N of the parameter bytes three times: all-gather in forward,
all-gather in backward, reduce-scatter of the gradients, the paper's 3 Psi (1.5x DDP).

What a unit is and does (Unit: gather, wait, release, accumulate, reduce_scatter; find_units;
freeing storage by resizing it, and measure_peak, which counts those resizes) lives in
zerolab.engines.zero3.units; WHEN they do it (hooks, prefetch order, the end of backward) is the
mixin zerolab.engines.zero3.schedule.UnitSchedule; bitwise=True (the same bits at any N) is the mixin
zerolab.engines.zero3.chunks.UnitChunks.
What every engine shares (backward's loss / N, p.grad's pieces, the step template, full_state_dict,
memory_report) is zerolab.engines.base.Engine's; initialising a GPT built on the meta device
(gpt_init) is zerolab.models'.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn as nn

from ...memory import optimizer_tensors
from ...precision import fp32_where_buffers
from .. import options
from ..base import Engine
from ...optim.param_views import ParamViews
from ..setup import broadcast_from_rank0, join_data_parallel
from ..state import flat_segments
from . import zeropp
from .chunks import UnitChunks
from .schedule import UnitSchedule
from .units import Unit, find_units, group_params, measure_peak


# ------------------------------------------------------------------ the engine


class ZeRO3(UnitChunks, UnitSchedule, Engine):
    """ZeRO stage 3: parameters, gradients and optimizer state sharded over the ranks.

    precision  "fp32" | "bf16" | "fp16": units are gathered, computed and reduce-scattered in
               the compute dtype; each rank's fp32 master shard (taken from the exact fp32
               values before the cast) and its optimizer state stay fp32. A gradient shard
               accumulated over several micro-batches is kept in fp32 from the second one on.
    prefetch   units whose all-gather is issued ahead of need (0: each unit is gathered only
               when it runs; 1: the next unit travels while this one computes; more: further).
    units      submodules (or their names) to gather and free as one; default: the children
               of the largest nn.ModuleList / nn.Sequential, plus the root (everything else).
    bucket_mb  accepted (and checked) so every engine takes the same arguments, but IGNORED:
               stage 3 communicates one unit at a time (one all-gather and one reduce-scatter
               per unit), because a unit is what one forward needs whole. Splitting it into
               buckets would add collectives without lowering the peak; merging units would
               raise the peak. The knob for communication granularity is `units`.
    init_fn    init_fn(name, module) for a model built on the meta device (see zerolab.models.gpt_init).
    """

    peak_meter = measure_peak   # step()'s peak also sees storage resized by gathers and releases
    checkpoint_kind = "zero3"
    awaits_optimizer = True               # optimizer=None: FSDP2's order (param_groups.await_optimizer)
    stage = 3
    sharded = True
    accumulates_after_reduce = True       # (Engine._begin_backward) the gradient shards add up
    reduces_in_no_sync = True             # every backward reduces (see no_sync)

    takes = options.ZERO_3      # the data-parallel options, units', and ZeRO++ / HSDP's
    unit_class = Unit           # what the model is cut into (offload="disk": DiskUnit; the labs': yours)

    def _join(self, model, optimizer, opts) -> None:
        """The data-parallel group (engines.setup.join_data_parallel), how units' collectives
        travel (zeropp.Route), and which modules are the units. No parameter is broadcast here:
        each unit starts from rank 0's values as it is built (_lay_out)."""
        in_place = [n or type(model).__name__ for n, m in model.named_modules()
                    if getattr(m, "_compiled_call_impl", None) is not None] if isinstance(model, nn.Module) else []
        if in_place:
            raise ValueError(
                f"{in_place[0]} was compiled in place (module.compile()), which compiles the hooks "
                "ZeRO-3 puts on it too: they gather and free parameters, which a graph cannot hold. "
                "Compile the whole model before wrapping it (torch.compile(model): ZeRO-3 then "
                "compiles each unit's forward), or replace a block by torch.compile(block).")
        layout, z = opts.layout, opts.zeropp
        if isinstance(model, nn.Module) and layout.init_fn is None \
                and any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError("the model is on the meta device: pass init_fn(name, module) to "
                             "initialise its parameters unit by unit")
        self.prefetch = layout.prefetch
        self._keep(join_data_parallel(type(self), model, optimizer, opts))
        self.broadcast_buffers = opts.training.broadcast_buffers
        self.bucket_mb = float(layout.bucket_mb)
        # how units' collectives travel; HSDP shards over a node, so a unit's shard index is the
        # rank in the node (engine.rank stays the global rank: the loss is still divided by N)
        self.route = zeropp.Route(self.comm, self.world_size, self.rank, z)
        self.shard_rank, self.replicas = self.route.shard_rank, self.route.replicas
        self.replica_index = self.route.replica_index
        self.norm_group = self.route.shard_group     # replicas hold the same shards: count them once
        self.events: list = []
        self.gather_wait_s = 0.0        # seconds spent blocked waiting for all-gathers (what prefetch hides)
        self._fwd_order: list = []      # units in the order the last forward ran them
        self._cur_order: list = []      # units in the order their forwards began ...
        self._done_order: list = []     # ... and ended (this forward)
        self._bwd_order: list = []      # the order backward will need them
        self._fwd_counts = None
        self._reducing: list = []       # units whose reduce-scatter is in flight, oldest first
        self._found, self.note = find_units(model, layout.units)
        if self.note:
            warnings.warn(self.note, stacklevel=3)
        if self.compiled is not None:   # each unit's forward compiled; the model's runs eagerly
            self._compile_units(self._found, self.compiled)
            self.compiled = None
        self._init_fn = layout.init_fn

    def _lay_out(self, model) -> None:
        """One Unit per group of parameters (_build_units); the optimizer, built on the model's
        parameters (meta ones included), then steps a view per parameter of this rank's shards."""
        self._replaced: dict = {}       # id(meta parameter) -> the parameter that replaced it
        self._build_units(self._found, self._init_fn, self._replaced)
        self.masters = [u.master for u in self.units if u.master is not None]
        if self.bitwise:                # each unit's chunks in its own tree (zero3.chunks)
            self._start_chunk_trees()

    def _accumulator_of(self, p):
        return self.param_unit[id(p)].accumulators[id(p)]   # (taken while the unit was whole)

    def _ready(self) -> None:
        self._install_hooks()
        fp32_where_buffers(self.model, self.precision.compute_dtype)   # after the units' hooks: BatchNorm in fp32
        self.comm.reset()               # setup traffic is not a training step's traffic

    # -------------------------------------------------------------- reading the full weights
    @contextlib.contextmanager
    def gathered_parameters(self):
        """Inside, every parameter holds its full value on every rank (every rank must enter it):
        read weights, call model.state_dict(). Read-only: changes made inside are not kept
        (load_state_dict writes weights). Outside, a rank holds only its 1/N shard."""
        for u in self.units:
            u.gather("inspect")
        try:
            for u in self.units:
                u.wait("inspect")
            yield
        finally:
            for u in self.units:
                u.release("inspect")

    def _refuse_released_state_dict(self, module, prefix, keep_vars):
        # model.state_dict() would copy parameters whose storage is freed (a crash, or garbage
        # saved). keep_vars=True hands out the Parameter objects without reading them.
        if keep_vars or all(u.gathered for u in self.units if u.full):
            return
        raise RuntimeError(
            "model.state_dict() under ZeRO-3: this rank holds only a 1/N shard of each parameter "
            "and has released the rest. Use engine.full_state_dict() or engine.state_dict() (every "
            "rank calls it) or zl.checkpoint.save(engine, path), or read the full weights inside "
            "`with engine.gathered_parameters():`.")

    def _copy_gathered_values(self, module, state_dict, prefix, local_metadata):
        # inside gathered_parameters(), model.state_dict()'s tensors share the gathered buffers'
        # storage, which is freed on leaving it: hand out copies, so the dict stays valid after
        fulls = {f.untyped_storage().data_ptr() for u in self.units for f in u.full.values()
                 if u.gathered}
        for key, t in state_dict.items():
            if not isinstance(t, nn.Parameter) and t.untyped_storage().data_ptr() in fulls:
                state_dict[key] = t.clone()

    # -------------------------------------------------------------- construction
    def _build_units(self, found, init_fn, replaced):
        """One Unit per group of parameters (units.group_params), each materialized in turn, so
        at most ONE unit is ever held in full; then the replicated buffers (rank 0's values).
        replaced: filled with id(meta parameter) -> the parameter made in its place."""
        specs, groups, refs = group_params(self.model, found)
        self.units = []
        for i, ((name, module), params) in enumerate(zip(specs, groups)):
            u = self.unit_class(i, name, module, params, self.comm, self._event, self.route)
            u.materialize(self.model, refs, init_fn, self.route.shard_size, self.shard_rank, self.src_rank,
                          self.precision.compute_dtype, self.precision.policy.needs_master, replaced)
            self.units.append(u)
            self._unit_built(u)
        self.param_unit = {id(p): u for u in self.units for b in u.buckets.values() for p in b.params}
        bufs = list(self.model.buffers())
        if any(b.device.type == "meta" for b in bufs):
            raise ValueError("meta-device buffers are not supported: build buffers on the CPU")
        if bufs:
            broadcast_from_rank0(bufs, self.comm, self.src_rank)

    def _read_options(self, opts, model) -> None:
        """The engine's own checks of its options against the model (offload='disk': its directory)."""

    @staticmethod
    def _compile_units(found, compiled):
        """torch.compile(model) under ZeRO-3. A graph of the whole model cannot hold the units'
        hooks, which gather and free parameters between units (and it would read released
        parameters while tracing), so each unit's forward is compiled instead, as FSDP2's users
        compile each block, with the wrapper's own settings; its hooks, and the root's forward,
        run eagerly around the compiled code."""
        for _, module in found:
            module.forward = compiled.dynamo_ctx(module.forward)

    def _unit_built(self, u):
        """Called as each unit is built (offload='disk' pages it out at once)."""

    # -------------------------------------------------------------- forward and backward
    @contextlib.contextmanager
    def no_sync(self):
        """For the training loop of zl.DDP; here every micro-batch STILL communicates.

        Inside it, each backward's unit gradients are reduce-scattered as usual and added to
        this rank's gradient shards (what DeepSpeed's stage 3 does). Skipping the reduction
        would mean keeping every unit's FULL gradient until the last micro-batch: Psi
        gradients per rank, the very memory stage 3 shards away. And it would save little:
        every micro-batch gathers each unit twice anyway (forward and backward), so the
        reduce-scatter is only a third of its traffic. backward() may be called several
        times before step(), inside no_sync or not: the shards accumulate either way.
        """
        yield

    # -------------------------------------------------------------- the step (Engine._step)
    def _start_step(self) -> None:
        for u in self.units:            # a gathered copy would be stale after the update
            u.release("step")

    def _place_groups(self) -> None:
        """The optimizer steps one view per parameter of this rank's master shards."""
        trained = self._trained()
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.views = ParamViews(self.masters, [u.buckets["train"] for u in trained],
                                [u.buckets["train"].shard(self.shard_rank) for u in trained], names,
                                resident=self._master_resident)
        self.views.place(self.optimizer, moved=self._replaced)

    def _master_resident(self, i):
        """A context in which master i is in memory (offload="disk" pages it in)."""
        return contextlib.nullcontext()

    def _trained(self) -> list:
        return [u for u in self.units if u.master is not None]

    def owned_grads(self) -> list:
        return [u.grad_shard for u in self._trained()]

    def _grad_layout(self) -> tuple:
        trained = self._trained()       # (p.grad after backward: engines.grad_guard)
        return ([u.buckets["train"] for u in trained],
                [u.buckets["train"].shard(self.shard_rank) for u in trained])

    def _held_grad_shards(self) -> list:
        return [u.grad_shard for u in self._trained()]     # (offload="disk" pages none in)

    def _norm_rank_and_size(self) -> tuple:
        return self.shard_rank, self.route.shard_size

    def _step_grads(self) -> list:
        mixed = self.precision.policy.needs_master
        if self.bitwise:                # the chunks' trees across ranks: each unit's grad_shard
            self._chunk_sum()
        for u, g in zip(self._trained(), self.owned_grads()):
            g = g if g is not None else torch.zeros_like(u.master)
            u.master.grad = g.float() if mixed else g
        return [u.master.grad for u in self._trained()]

    def _unused_params(self) -> set:
        # a parameter no rank used keeps no gradient in one process: the optimizer skips it
        out = set()
        for u in self._trained():
            params = u.buckets["train"].params
            out |= {id(params[i]) for i in (u.unused_positions or ())}
        return out

    def _publish(self):
        for u in self._trained():
            self._upload(u.shard["train"], u.master)

    def _upload(self, shard, master):
        # the fp32 master -> the compute shard (fp32: they are one tensor; offload: a host copy)
        if self.precision.policy.needs_master:
            shard.copy_(master)

    def _drop_step_grads(self):
        self.life.grads_dropped()
        if self.views is not None:
            self.views.drop_grads()
        for u in self._trained():       # (fp32: the master's grad IS the gradient shard)
            u.master.grad = None
        if self.bitwise:
            self._summed = None

    def _release_grads(self):
        for u in self.units:
            u.grad_shard = None
            u.unused_positions = None
        if self.bitwise:
            self._forget_chunks()

    def _compute_shards(self) -> list:
        """The compute copy of each master shard (what forward gathers), in master order."""
        return [u.shard["train"] for u in self._trained()]

    def _set_masters(self, masters: list) -> None:
        """Every name the engine has for its master shards now means `masters` (offload)."""
        for u, m in zip(self._trained(), masters):
            u.master = m
        self.masters = list(masters)

    # -------------------------------------------------------------- state and memory
    def checkpoint_segments(self, names):
        # each unit's own shards: the fp32 master of what trains, the shard of what is frozen
        opt, frozen = [], []
        if self.views is not None:      # what the optimizer updates: its views of the master shards
            opt = self.views.segments(names)
        for u in self.units:
            if "train" in u.buckets and self.views is None:
                b = u.buckets["train"]
                opt += flat_segments(u.master, b, b.shard(self.shard_rank), names)
            if "frozen" in u.buckets:
                b = u.buckets["frozen"]
                frozen += flat_segments(u.shard["frozen"], b, b.shard(self.shard_rank), names)
        return opt, frozen, False, False

    def _full_values(self) -> dict:
        """Each unit's fp32 shards, all-gathered (every rank calls full_state_dict): gathered on
        the shards' own device (a collective takes one device); Engine copies them to the CPU."""
        value_of = {}
        for u in self.units:
            for kind, b in u.buckets.items():
                src = u.master.data if (kind == "train") else u.shard[kind]
                full = torch.empty(b.padded_numel, dtype=src.dtype, device=src.device)
                self.comm.all_gather(full, src.contiguous(), group=self.route.shard_group, tag="state")
                for p, view in zip(b.params, b.views(full)):
                    value_of[id(p)] = view
        return value_of

    def _memory_tensors(self):
        # params: the shards and whatever is gathered now; optimizer: fp32 master shards when mixed
        params = [s for u in self.units for s in u.shard.values()]
        params += [f for u in self.units for f in u.full.values()]
        params += [s for u in self.units for s in u.secondary.values()]     # hpZ
        grads = [u.grad_shard for u in self.units if u.grad_shard is not None]
        grads += [u.grad_full for u in self.units if u.grad_full is not None]
        masters = [u.master for u in self.units if u.master is not None] \
            if self.precision.policy.needs_master else []
        return params, grads, masters + optimizer_tensors(self.optimizer)

    # -------------------------------------------------------------- facts for the chapter
    def unit_sizes(self) -> dict:
        """{unit name: parameters in its flat buffers (padded)}."""
        return {u.name: u.numel for u in self.units}

    @property
    def num_params(self) -> int:
        return sum(b.numel for u in self.units for b in u.buckets.values())
