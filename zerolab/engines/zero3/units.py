"""ZeRO-3's units: the groups of parameters that are gathered, used and released together.

A Unit holds one flat buffer per kind ("train": trainable parameters, with gradients and optimizer
state; "frozen": the rest) and this rank's shard of each, and carries out its own lifecycle:

    partitioned --gather()--> in flight --wait()--> gathered --release()--> partitioned
    gradient:   full (backward) --reduce_scatter()--> in flight --finish_reduce()--> this rank's shard

find_units picks the units (by default the children of the model's largest nn.ModuleList /
nn.Sequential); zerolab.engines.zero3.engine decides WHEN each unit does what (hooks, prefetch order).
_InputsGradDone tells it when a unit's backward is over. A released buffer keeps its shape but
its storage is resized to 0 (storage_free / storage_alloc): autograd may hold views of it, so
the tensor itself must stay. Resizing a storage is not an operation the CPU allocation tracker
sees, so measure_peak counts it.

Reading a parameter whose storage is 0 bytes would read freed memory (print(p) can kill the
process). So while its unit is released a parameter's class is ReleasedParameter: what FSDP2's
sharded parameters answer between forwards can be looked at (p.shape, p.dtype, p.numel(),
p.data.shape, p.grad, requires_grad, hooks; torch.autograd.grad(loss, params) may name it), and
anything that reads its values raises an error that says where the values are; p.data is a
ReleasedValues, which refuses the same reads while the storage is freed. Gathering turns the
parameter back into a plain nn.Parameter, at no cost to forward.
"""

from __future__ import annotations

from collections import namedtuple

import torch
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge

from ...buckets import Bucket
from ...memory import PeakMemory
from .unit_state import GRAD_MOVES, PARAM_MOVES, GradState, ParamState, moved

Event = namedtuple("Event", "time rank unit state phase")
"""One step of a unit's lifecycle: state is gathering | gathered | in_use | reduce_scatter | released."""


# ------------------------------------------------------------------ finding the units


def find_units(model: nn.Module, units=None):
    """[(name, module)] of the non-root units, and a note when none could be found.

    Default: the children of the model's largest ModuleList / Sequential (by parameters).
    `units` may name modules ("blocks.0") or pass the modules themselves.
    """
    named = dict(model.named_modules())
    if units is not None:
        out = []
        by_id = {id(m): n for n, m in named.items()}
        for u in units:
            if isinstance(u, str):
                if u not in named or u == "":
                    raise ValueError(f"units: no submodule named {u!r} in the model")
                out.append((u, named[u]))
            elif isinstance(u, nn.Module) and id(u) in by_id and u is not model:
                out.append((by_id[id(u)], u))
            else:
                raise ValueError(f"units: {u!r} is not a submodule of the model (nor its name)")
        return out, None
    best, best_size = None, 0
    for name, m in named.items():      # (the model itself too: a model that is an nn.Sequential)
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            size = sum(p.numel() for p in m.parameters())
            if size > best_size:
                best, best_size = name, size
    if best is None:
        return [], (f"ZeRO3: {type(model).__name__} neither is nor holds an nn.ModuleList or nn.Sequential to "
                    "cut into units; the whole model is ONE root unit (gathered whole for forward and "
                    "backward). Pass units=[...] to name submodules as units.")
    return [(f"{best}.{n}" if best else n, m) for n, m in named[best].named_children()
            if any(True for _ in m.parameters())], None


def group_params(model: nn.Module, found):
    """Which unit each parameter belongs to: ([(name, module)] with the root first, [params per
    unit], refs). A parameter inside one unit's subtree is that unit's; one shared by two units
    (a tied weight) or outside all of them is the root's. refs: id(param) -> every (module name,
    module, attribute) that holds it, so a meta parameter can be replaced everywhere."""
    owners: dict = {}               # id(param) -> unit positions whose subtree holds it
    for i, (_, m) in enumerate(found):
        for p in m.parameters():
            owners.setdefault(id(p), set()).add(i + 1)
    groups = [[] for _ in range(len(found) + 1)]
    for p in model.parameters():    # each tied weight once
        where = owners.get(id(p), set())
        groups[next(iter(where)) if len(where) == 1 else 0].append(p)
    refs: dict = {}
    for mname, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            refs.setdefault(id(p), []).append((mname, m, pname))
    # the root's forward is the model's forward; unit 0 is always the root
    return [("root", model)] + list(found), groups, refs


class Unit:
    """A group of parameters gathered and freed together: one flat buffer per kind.

    `train` holds the trainable parameters (gradients, optimizer state), `frozen` the rest
    (gathered like the others, never reduced, no optimizer state). `comm` is the engine's
    ledger, `record(unit, state, phase)` its event log, `route` decides how its collectives
    travel (zerolab.engines.zero3.zeropp: over the world, quantized, node-local, HSDP).
    """

    def __init__(self, index, name, module, params, comm, record, route):
        self.index, self.name, self.module = index, name, module
        self.params = params            # original parameters, in model.parameters() order
        self.comm, self.record = comm, record
        self.route = route              # how its collectives travel (zeropp.Route: plain, ZeRO++, HSDP)
        self.secondary = {}             # kind -> hpZ's node-local shard, from forward to backward
        self.buckets = {}               # "train" / "frozen" -> Bucket
        self.full = {}                  # kind -> the full flat buffer (storage resized to 0 when free)
        self.shard = {}                 # kind -> this rank's shard, compute dtype
        self.master = None              # fp32 master of the train shard (an nn.Parameter)
        self.handles = {}               # kind -> Handle of an all-gather in flight
        self.params_state = ParamState.PARTITIONED
        self.grad_full = None           # full gradient while backward produces it
        self.grad_shard = None          # this rank's reduced gradient, until zero_grad
        self.unused_positions = None    # train positions no backward reached since zero_grad
        self.accumulators = {}          # id(trainable parameter) -> its autograd gradient accumulator
        self._rs = None                 # (handle, output) of a reduce-scatter in flight
        self.reset_backward()

    def reset_backward(self):
        """A new pass: no backward has reached the unit yet."""
        self.n_acc = 0                  # trainable params whose gradient was accumulated
        self.grad_state = GradState.WAITING
        self.input_hooks_out = 0        # input-gradient hooks set up in forward ...
        self.input_hooks_in = 0         # ... and fired in backward
        self.used = set()               # positions (in the train bucket) that got a gradient

    # -------------------------------------------------------------- the two states, moved
    def move_params(self, to: ParamState) -> None:
        self.params_state = moved(self, "parameters", self.params_state, to, PARAM_MOVES)

    def move_grads(self, to: GradState) -> None:
        self.grad_state = moved(self, "gradient", self.grad_state, to, GRAD_MOVES)

    @property
    def gathered(self) -> bool:
        return self.params_state is ParamState.GATHERED

    @gathered.setter
    def gathered(self, value: bool) -> None:
        # (lab 6's Unit, written by the student, says it with a boolean: the move is checked)
        self.move_params(ParamState.GATHERED if value else ParamState.PARTITIONED)

    @property
    def in_backward(self) -> bool:
        """Its backward began in this pass (and the pass is not over)."""
        return self.grad_state in (GradState.IN_BACKWARD, GradState.REDUCING)

    @property
    def reduced(self) -> bool:
        """Its backward is over in this pass: its gradient was (or is being) reduce-scattered."""
        return self.grad_state in (GradState.REDUCING, GradState.REDUCED)

    @property
    def numel(self):
        return sum(b.padded_numel for b in self.buckets.values())

    @property
    def n_train(self):
        return len(self.buckets["train"].params) if "train" in self.buckets else 0

    def materialize(self, model, refs, init_fn, world_size, rank, src, dtype, mixed, replaced):
        """Give this unit its flat buffers and this rank's shards, holding at most this ONE unit
        in full: meta parameters are created and initialised here (init_fn(name, module)); real
        ones become views into the flat buffer. Every rank starts from rank `src`'s values.
        replaced: filled with id(meta parameter) -> the parameter made in its place (the
        optimizer, built on the meta ones, then steps the new ones: optim.param_views)."""
        trainable = [p for p in self.params if p.requires_grad]
        for kind, params in (("train", trainable),
                             ("frozen", [p for p in self.params if not p.requires_grad])):
            if not params:
                continue
            if params[0].device.type == "meta":
                flat = torch.zeros(-(-sum(p.numel() for p in params) // world_size) * world_size)
                new = []
                offset = 0
                for p in params:
                    # q.data = a view, as Bucket.bind_params does, not Parameter(view): a
                    # parameter made FROM a view shares the flat buffer's version counter, so
                    # every all-gather into the buffer would look to autograd like an in-place
                    # edit of the weights its forward saved for backward
                    q = nn.Parameter(torch.empty(0), requires_grad=p.requires_grad)
                    q.data = flat[offset:offset + p.numel()].view(p.shape)
                    offset += p.numel()
                    replaced[id(p)] = q
                    for _, m, pname in refs[id(p)]:
                        m._parameters[pname] = q      # every module that uses p (tied) gets q
                    new.append(q)
                # initialise in model order, so tied weights end as a plain build leaves them
                done = {id(q) for q in new}
                with torch.no_grad():
                    for mname, m in model.named_modules():
                        if any(id(q) in done for q in m.parameters(recurse=False)):
                            init_fn(mname, m)
                b = Bucket(0, new, world_size)
                b.data = flat
            else:
                b = Bucket(0, params, world_size)
                with torch.no_grad():
                    b.bind_params()           # parameters become views into b.data
            self.comm.broadcast(b.data, src=src, tag="setup")   # ranks start identical (in place)
            if mixed:
                if kind == "train":           # the fp32 master shard, from the exact fp32 values
                    master = b.data[b.shard(rank)].clone()
                b.data = b.data.to(dtype)     # then the unit becomes low precision
                for view, p in zip(b.views(b.data), b.params):
                    p.data = view
            self.buckets[kind] = b
            self.full[kind] = b.data
            self.shard[kind] = b.data[b.shard(rank)].clone()
            if kind == "train":               # each one's gradient accumulator, taken while its
                self.accumulators = {id(p): get_gradient_edge(p).node for p in b.params}   # values exist
            storage_free(b.data)             # from now on this rank holds only its shard
        self.params = [p for b in self.buckets.values() for p in b.params]
        mark_released(self.params, True)
        if "train" in self.buckets:
            self.master = nn.Parameter(master if mixed else self.shard["train"])
            if not mixed:
                self.shard["train"] = self.master.data
        for pos, p in enumerate(self.buckets["train"].params if "train" in self.buckets else []):
            p._zero3_pos = pos

    # -------------------------------------------------------------- parameters
    def gather(self, phase):
        """Issue the all-gather(s) of the full buffers (nothing if gathered or in flight)."""
        if self.gathered or self.handles:
            return
        self.record(self, "gathering", phase)
        self.move_params(ParamState.IN_FLIGHT)
        for kind, full in self.full.items():
            storage_alloc(full)
            if self.route.plain:
                self.handles[kind] = self.comm.all_gather(full, self.shard[kind], async_op=True,
                                                          tag=f"gather:{self.name}")
            else:                       # ZeRO++ / HSDP (chapter 12): quantized, node-local...
                self.handles[kind] = self.route.all_gather(self, kind, full, phase)

    def wait(self, phase) -> float:
        """Block until gathered (gathering first if nobody did); return the seconds waited."""
        if self.gathered:
            return 0.0
        self.gather(phase)
        t0 = self.comm.now()
        for h in self.handles.values():
            h.wait()
        self.handles = {}
        self.move_params(ParamState.GATHERED)
        mark_released(self.params, False)
        self.record(self, "gathered", phase)
        return self.comm.now() - t0

    def release(self, phase):
        """Free the full buffers (a prefetch nobody used is finished first). hpZ keeps a
        secondary shard from a training forward until the unit's backward is done."""
        if self.handles:
            self.wait(phase)
        if phase in ("backward", "step"):
            self.secondary = {}
        if not self.gathered:
            return
        if phase == "forward" and torch.is_grad_enabled():
            self.route.keep_secondary(self, phase)
        mark_released(self.params, True)
        for full in self.full.values():
            storage_free(full)
        self.move_params(ParamState.PARTITIONED)
        self.record(self, "released", phase)

    # -------------------------------------------------------------- gradients
    def accumulate(self, p, pos):
        """Add parameter p's gradient (position pos of the train bucket) to the full gradient."""
        b = self.buckets["train"]
        if self.grad_full is None:
            self.grad_full = torch.zeros(b.padded_numel, dtype=p.dtype, device=p.device)
        self.grad_full[b.offsets[pos]:b.offsets[pos] + b.sizes[pos]].view(p.shape).add_(p.grad)
        if pos not in self.used:
            self.used.add(pos)
            self.n_acc += 1

    def reduce_scatter(self):
        """Start reducing the full gradient to this rank's shard: divided by N first, so the
        sum is the mean. Zeros if no gradient reached the unit on this rank."""
        b = self.buckets["train"]
        if self.grad_full is None:
            self.grad_full = torch.zeros(b.padded_numel, dtype=b.data.dtype, device=b.data.device)
        elif self.route.world_size > 1:
            self.grad_full.div_(self.route.world_size)
        out = torch.empty(b.padded_numel // b.world_size, dtype=self.grad_full.dtype, device=b.data.device)
        self.record(self, "reduce_scatter", "backward")
        if self.route.plain:
            handle = self.comm.reduce_scatter(out, self.grad_full, async_op=True, tag=f"reduce:{self.name}")
        else:                           # ZeRO++ / HSDP (chapter 12): int4 all-to-alls, + all-reduce
            handle = self.route.reduce(self, self.grad_full, out)
        self._rs = (handle, out)

    def finish_reduce(self):
        """Wait for the reduce-scatter; keep (or add to) the gradient shard, free the full gradient."""
        handle, out = self._rs
        handle.wait()
        self._rs, self.grad_full = None, None
        if self.grad_shard is None:
            self.grad_shard = out
        else:                           # a later micro-batch: accumulate the shard in fp32
            if self.grad_shard.dtype != torch.float32:
                self.grad_shard = self.grad_shard.float()
            self.grad_shard.add_(out)


class ReleasedParameter(nn.Parameter):
    """A ZeRO-3 parameter while its unit is released: 1/N of it is on this rank (in the unit's
    shard), its own storage is 0 bytes. Looking at it is allowed (shape, dtype, device, grad,
    requires_grad, hooks); any operation that reads its values raises instead of reading freed
    memory. Only Unit changes a parameter's class to this one and back (mark_released)."""

    # the methods that look at a tensor without reading its elements (and autograd's entry
    # points, which only name the parameters: the units' hooks gather what the pass needs)
    LOOKS = frozenset({"size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset",
                       "is_contiguous", "is_floating_point", "is_complex", "get_device", "data_ptr",
                       "untyped_storage", "requires_grad_", "register_hook", "_is_view",
                       "register_post_accumulate_grad_hook", "__len__", "__setstate__", "grad", "backward"})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        # properties come as __get__ / __set__ of a descriptor: all are metadata except .data,
        # whose values are guarded in turn (p.data.shape is the parameter's, as under FSDP2)
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        if not (name in cls.LOOKS or name in ("__get__", "__set__")):
            raise RuntimeError(_released_message(prop or name))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if prop == "data" and name == "__get__":
            out = out.as_subclass(ReleasedValues)
        return out


class ReleasedValues(torch.Tensor):
    """p.data of a ZeRO-3 parameter while its unit is released: its shape, dtype and device can be
    looked at; reading its values is refused while its storage is freed (after a gather they are
    there, and it reads them as any tensor)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        with torch._C.DisableTorchFunctionSubclass():
            held = all(_allocated(t) for t in args if isinstance(t, ReleasedValues))
            if name in ReleasedParameter.LOOKS or name in ("__get__", "__set__") or held:
                return func(*args, **(kwargs or {}))
        raise RuntimeError(_released_message(prop or name))


def _allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


def _released_message(what: str) -> str:
    return (f"this parameter is sharded by ZeRO-3 and not gathered now ({what} would read its values, "
            "but this rank holds only its 1/N shard). Read full weights inside "
            "`with engine.gathered_parameters():`, take engine.full_state_dict() (every rank calls "
            "it), save with zl.checkpoint.save(engine, path), write weights with "
            "engine.load_state_dict(sd), and step with the engine's optimizer (the one passed to "
            "zl.ZeRO; one built on model.parameters() outside the engine would update a released "
            "parameter). Its shape, dtype and p.grad can be read: torch.nn.utils.clip_grad_norm_("
            "model.parameters(), max_norm) works.")


def mark_released(params, released: bool) -> None:
    """Swap the class of plain nn.Parameters (a subclass of Parameter is left as it is)."""
    old, new = (nn.Parameter, ReleasedParameter) if released else (ReleasedParameter, nn.Parameter)
    for p in params:
        if type(p) is old:
            p.__class__ = new


class _InputsGradDone(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward is finished."""

    @staticmethod
    def forward(ctx, engine, unit, *tensors):
        ctx.engine, ctx.unit = engine, unit
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._on_inputs_grad(ctx.unit)
        return (None, None) + grads


# Resizing a storage is not an aten operation, so the CPU AllocationTracker behind
# PeakMemory cannot see it: the gathered buffers report their own allocations and frees to
# every region opened with measure_peak() (CUDA's allocator sees them without help).
_ACTIVE: list = []


def _note(delta: int, key=None) -> None:
    for tr in _ACTIVE:
        if key is not None and key in tr._live:   # allocated by an op inside the region
            delta = -tr._live.pop(key)
        tr.current += delta
        tr.peak = max(tr.peak, tr.current)


class measure_peak(PeakMemory):
    """PeakMemory that also counts ZeRO-3's gathered buffers (allocated by resizing storage)."""

    def __enter__(self):
        super().__enter__()
        if self._tracker is not None:
            _ACTIVE.append(self._tracker)
        return self

    def __exit__(self, *exc):
        if self._tracker in _ACTIVE:
            _ACTIVE.remove(self._tracker)
        return super().__exit__(*exc)


def storage_free(t: torch.Tensor):
    st = t.untyped_storage()
    if st.nbytes():
        key = (st.device.type, st.device.index, st.data_ptr())
        nbytes = st.nbytes()
        st.resize_(0)
        _note(-nbytes, key)


def storage_alloc(t: torch.Tensor):
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)
        _note(nbytes)
