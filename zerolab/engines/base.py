"""What every engine does the same way, written once.

An engine wraps a model and an optimizer; what differs between SingleProcess, NaiveDDP, DDP,
ZeRO-1, ZeRO-2 and ZeRO-3 is where the gradients, masters and optimizer state live and when
they travel. What does not differ lives here:

* calling the engine casts floating inputs to the compute dtype, runs the forward, and hooks
  its output, so the engine sees every backward through it, whoever starts it;
* a backward is the same whether the script calls loss.backward() (PyTorch's loop) or
  engine.backward(loss) (which only adds fp16's loss scaling). An autograd pass through the
  engine's output opens a pass (`_open_pass`: a callback queued for its end); the backward
  begins when autograd is about to add a gradient to a trained parameter's .grad (a pre-hook on
  the parameter's gradient accumulator, or zl.DDP's reducer hook: `_begin_backward`, misuse
  refused, the reducer's state reset), and the pass's end ends it (`_end_backward`: the
  engine's `_finish_backward` waits for every reduction, so when backward returns every
  gradient is averaged). An autograd pass that adds to no parameter's .grad is not a backward:
  torch.autograd.grad(out.sum(), x) for a gradient penalty, and torch.autograd.grad(loss,
  model.parameters()), which returns this rank's own gradients unreduced, as under PyTorch DDP.
  Each reduction divides by N on its way (gloo has no average), never the loss;
* a step is optimizer.step(), whoever calls it (engine.step() does too): PyTorch's step hooks
  run the engine's parts around the optimizer's own update (optim.param_groups.hand_over).
  `_before_update` refuses gradients it should not apply (none, fp16 unscaled, never averaged),
  starts measuring the step's peak memory (with track_peak=True) and prepares the update: the
  fp32 gradients of what the optimizer updates (`_step_grads`), one finite check (`_grads_finite`),
  clipping, then each tensor the optimizer holds gets its gradient (`_hand_grads`; a parameter
  no rank reached keeps None, so the optimizer skips it, as one process does). The optimizer
  updates. Then `_after_update` publishes the updated masters to the compute copies (`_publish`:
  a cast, an all-gather, ...);
* after a reducing backward of a sharded engine, each p.grad is this rank's piece of the
  averaged gradient (engines.grad_guard.ShardedGradient: torch.nn.utils.clip_grad_norm_ on
  model.parameters() gets the global norm); zero_grad() drops the gradients (`_release_grads`)
  and takes the pieces back;
* where the engine is (forward, in backward, reduced, accumulated inside no_sync, stepped) and
  what each call may do is one object, engines.lifecycle.Lifecycle (`self.life`);
* engine.optimizer is the script's torch optimizer, each parameter of its groups moved onto what
  the engine updates for it (one master, or one view of a flat buffer: optim.param_views), and
  nothing of it replaced: the engine runs through PyTorch's step and state-dict hooks
  (optim.param_groups.hand_over) and sees its zero_grad() by the marks it leaves
  (optim.zero_grad_watch), so optimizer.step(), optimizer.zero_grad(), optimizer.state_dict()
  and torch.optim.lr_scheduler work as written;
* what PyTorch's wrappers offer: module, parameters(), named_parameters(), train(), eval(),
  require_backward_grad_sync and clip_grad_norm_(max) (the norm over every rank's shard, applied
  by the next step); state_dict() / load_state_dict() (consolidated, the model's own keys),
  full_state_dict(), memory_report(), gathered_parameters() and the pieces a checkpoint writes
  are engines.state.EngineState's.

Every engine is built by the same sequence, Engine.__init__: its options parsed and checked
(engines.options), `_read_options`, torch.compile's wrapper set aside, `_join` (who takes part:
one process, or the data-parallel group with its precision and the check that every rank wraps
the same model: engines.setup.join_data_parallel), the lifecycle (engines.lifecycle: the
training state and every misuse error), the script's optimizer checked (param_groups.build),
`_lay_out` (the engine's storage: masters, flat buckets, ZeRO-3's units), the optimizer's groups
moved onto what the engine updates and handed over (or awaited: FSDP2's order), `_ready`, and a
hook on each trainable parameter. The defaults suit one fp32 master per parameter; the flat
engines redefine _step_grads, _publish, _release_grads, _full_values and _memory_tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map

from ..memory import PeakMemory
from ..precision import cast_for_compute, global_norm, squared_norm
from ..optim import param_groups
from . import chunk_grad, grad_guard
from .bitwise_mode import BitwiseMode
from .partial_result import Reducer
from .lifecycle import Lifecycle
from .options import EngineOptions, check_max_grad_norm
from .setup import broadcast_from_rank0, compiled_parts, join_data_parallel, measured_forward
from .state import EngineState
from .step import Step


def tensors_in(output) -> list:
    """Every tensor in a module's output: nested tuples, lists and dicts, and the fields of a
    dataclass or a mapping (a Hugging Face ModelOutput with .logits and .loss)."""
    out = []
    for x in tree_flatten(output)[0]:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, Mapping):
            out += tensors_in(list(x.values()))
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            out += tensors_in([getattr(x, f.name) for f in dataclasses.fields(x)])
    return out

class Engine(Step, EngineState, BitwiseMode):
    """The shared part of every zerolab engine (see the module docstring; what it holds and
    reports: engines.state.EngineState)."""

    peak_meter = PeakMemory     # what step() measures its peak with (ZeRO-3 adds its own counts)
    sharded = False             # does each rank hold only a slice of the gradients and masters?
    takes_no_optimizer = False  # optimizer=None: the script steps p.grad itself (DDP, NaiveDDP)
    awaits_optimizer = False    # optimizer=None: adopt the script's, built afterwards (ZeRO)
    # May a reducing backward run again before zero_grad()? Yes where the reduction leaves each
    # gradient where the next backward adds to it (one process; DDP and NaiveDDP: p.grad; ZeRO-2
    # and 3: the shards); no for ZeRO-1, whose rank holds the averaged gradient of its own slice
    # only, beside the other slices' local ones (it refuses, naming zero_grad and no_sync).
    accumulates_after_reduce = True
    reduces_in_no_sync = False  # ZeRO-2 and 3 reduce every backward (no full gradient to keep)
    takes: tuple = ()           # the option names it takes (zerolab.engines.options)
    optimizer = None            # the script's torch optimizer, handed over (None: DDP without one)
    track_activations = False   # measure the activations each forward leaves (engines.setup)
    broadcast_buffers = False   # data-parallel engines: True by default (engines.setup)
    norm_group = None           # the group whose shards make up the whole gradient once (None: all)
    _last_batch = None          # fp16: the last training forward's inputs, to diagnose a give-up
    src_rank = 0                # the rank whose weights and buffers every rank starts from
    compiled = None             # torch.compile's wrapper of the model, which runs the forward
    mesh = None                 # ZeRO-R's Mesh (tensor-parallel models), if any

    def __init__(self, model: torch.nn.Module, optimizer=None, **keywords):
        """model: any nn.Module (compiled first or not); optimizer: a torch optimizer built on
        the model's parameters, a factory of one (functools.partial(torch.optim.AdamW, lr=3e-4)),
        or None where the engine takes none (DDP) or adopts the script's later (ZeRO: FSDP2's
        order); keywords: the options this engine takes (`takes`; engines.options says each)."""
        opts = EngineOptions.parse(type(self).__name__, self.takes, keywords, getattr(self, "stage", None))
        self.options = opts
        self.bitwise = opts.training.bitwise
        if self.bitwise and not self.takes_bitwise:
            raise ValueError(f"bitwise=True is not available on {type(self).__name__}: use zl.DDP, "
                             "zl.ZeRO (any stage) or zl.SingleProcess")
        self._read_options(opts, model)
        model, self.compiled = compiled_parts(model)
        self._join(model, optimizer, opts)
        if self.bitwise:
            self._check_bitwise_world()
        t = opts.training
        self.model, self.max_grad_norm, self.track_peak = model, t.max_grad_norm, t.track_peak
        self.steps, self.last_peak, self.last_grad_norm, self.last_activations = 0, 0, None, None
        self.last_backward = {}
        # bitwise: every backward is a chunk, added into the engine's trees (no_sync changes nothing)
        self.life = Lifecycle(type(self).__name__, self.world_size,
                              accumulates_after_reduce=self.accumulates_after_reduce or self.bitwise,
                              reduces_in_no_sync=self.reduces_in_no_sync or self.bitwise,
                              loss_scaling=self.precision.scaler is not None)
        # the optimizer sees the model's parameters, so its parameter groups can tell them apart
        state = None
        if optimizer is not None:
            self.optimizer, state = param_groups.build(optimizer, model)
        self._lay_out(model)
        if self.optimizer is not None:
            self._take_over(state)
        elif self.awaits_optimizer:     # FSDP2's order: the script builds it afterwards
            param_groups.await_optimizer(self)
        self._ready()
        self._watch_parameters()

    # What each engine fills in, in the order __init__ calls them.
    def _read_options(self, opts, model) -> None:
        """The engine's own settings from its checked options, before anything is built."""

    def _join(self, model, optimizer, opts) -> None:
        """Who takes part (the data-parallel group, precision, ZeRO-R's options), checked the same
        on every rank (engines.setup.join_data_parallel); then every rank starts from the same
        parameters and buffers. SingleProcess: one process."""
        self._keep(join_data_parallel(type(self), model, optimizer, opts))
        self.broadcast_buffers = opts.training.broadcast_buffers
        broadcast_from_rank0(list(model.parameters()) + list(model.buffers()), self.comm, self.src_rank)

    def _keep(self, group) -> None:
        """What join_data_parallel returned, as the engine's own attributes."""
        self.comm, self.world_size, self.rank, self.src_rank = group.comm, group.world_size, group.rank, group.src
        self.mesh, self.precision = group.mesh, group.precision
        self.activation_checkpointing, self.track_activations = group.activation_checkpointing, \
            group.track_activations

    def _lay_out(self, model) -> None:
        """The engine's storage: the parameters it trains, in its order, and their masters."""
        self.params = self._order(model)
        self._setup_storage()

    def _order(self, model) -> list:
        """The trainable parameters, each tied weight once, in the order the engine keeps them."""
        return [p for p in model.parameters() if p.requires_grad]

    def _setup_storage(self) -> None:
        """One master per trainable parameter: the parameter itself in fp32, an fp32 copy in
        bf16 / fp16 (the flat engines: buckets)."""
        if self.precision.policy.needs_master:
            # masters first, from the exact fp32 values; then the model becomes low precision
            self.masters = [p.detach().clone().float() for p in self.params]
            cast_for_compute(self.model, self.precision.compute_dtype)   # (BatchNorm stays fp32)
        else:
            self.masters = self.params

    def _ready(self) -> None:
        """The last touches once the optimizer is placed (ZeRO-3: its hooks)."""

    # -------------------------------------------------------------- forward
    def __call__(self, *args, **kwargs):
        """The forward, called as the model is (keywords and nested inputs too: a Hugging Face
        model's input_ids=..., labels=...). Floating tensors are cast to the compute dtype."""
        training = torch.is_grad_enabled()
        if training:
            self._zero_grad_seen(disarm=False)
        sync_buffers, synced = self.life.forward(training)
        self._pass_open = False         # (an autograd pass that raised never closed)
        if sync_buffers and self.broadcast_buffers:
            self._broadcast_buffers()
        dtype = self.precision.compute_dtype
        args, kwargs = tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                                else x, (args, kwargs))
        if self.precision.scaler is not None and training:
            self._last_batch = (args, kwargs)   # a reference, not a copy: the batch is alive anyway
        out = self._forward(*args, **kwargs)
        if training:
            self._watch_output(out, synced)
        return out

    def _forward(self, *args, **kwargs):
        # the model's forward; with track_activations, also the bytes it leaves alive
        return measured_forward(self, *args, **kwargs)

    def _broadcast_buffers(self):
        # rank 0's buffers (BatchNorm's running statistics), one broadcast per dtype: those the
        # model had when it was wrapped, as PyTorch DDP (walking the modules at every forward
        # costs a CPU rank more than a model without buffers should pay)
        buffers = self._buffers_list
        if buffers and self.world_size > 1:
            broadcast_from_rank0(buffers, self.comm, self.src_rank, tag="buffers")

    def _watch_output(self, out, synced: bool) -> None:
        """Hook the forward's output: its gradient is the first thing any autograd pass through it
        computes. `synced` is whether this forward ran outside no_sync() (as in PyTorch DDP, the
        forward decides)."""
        for t in tensors_in(out):
            if t.requires_grad:
                t.register_hook(lambda grad, synced=synced: self._output_grad(synced))

    def _output_grad(self, synced: bool) -> None:
        if not self.life.in_backward:
            self._open_pass(synced)

    # An autograd pass through the engine is a backward only if it adds a gradient to a trained
    # parameter's .grad: loss.backward() does; torch.autograd.grad(out.sum(), x) (a gradient
    # penalty's first half) and torch.autograd.grad(loss, model.parameters()) do not (autograd
    # hands their gradients back instead of accumulating them), and the engine stays out of them,
    # as PyTorch DDP's reducer does. The first gradient of the engine's output opens a pass and
    # queues a callback for its end (in the outermost pass: a reentrant checkpoint's inner pass
    # ends before the backward does); a pre-hook on each parameter's gradient accumulator, which
    # autograd runs only when it is about to add to p.grad, begins the backward (_param_grad);
    # the pass's end ends it. All public hooks: Node.register_prehook, queue_callback.
    _pass_open = False          # a pass through the engine's output is running
    _pass_synced = True         # whether the forward it began from ran outside no_sync()

    def _open_pass(self, synced: bool) -> bool:
        """An autograd pass reached the engine (its output's gradient): True if it opened now."""
        if self._pass_open:
            return False
        self._pass_open, self._pass_synced = True, synced
        torch.autograd.Variable._execution_engine.queue_callback(self._close_pass)
        self._pass_opened()
        return True

    def _close_pass(self) -> None:
        """The pass's end: if it added to a parameter's .grad, the backward ends now."""
        self._pass_open = False
        began = self.life.in_backward
        if began:
            self._end_backward()
        self._pass_closed(began)

    def _pass_opened(self) -> None:
        """A pass opened (ZeRO-3 keeps what it gathers until it knows whether it is a backward)."""

    def _pass_closed(self, was_backward: bool) -> None:
        """A pass ended (after _end_backward, if it was a backward)."""

    def _backward_synced(self) -> bool:
        """Does the backward beginning now reduce? The forward it began from decides (PyTorch
        DDP's rule): the pass's, or no_sync()'s state where no pass opened."""
        return self._pass_synced if self._pass_open else self.life.sync

    @property
    def require_backward_grad_sync(self) -> bool:
        """PyTorch DDP's flag (nanoGPT sets it per micro-batch): False is the same as no_sync()."""
        return self.life.sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.life.set_sync(value)

    # -------------------------------------------------------------- what a PyTorch wrapper offers
    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model (as DistributedDataParallel.module)."""
        return self.model

    def parameters(self, recurse: bool = True):
        return self.model.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.model.named_parameters(*args, **kwargs)

    def train(self, mode: bool = True):
        self.model.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # -------------------------------------------------------------- backward
    # A backward is the same whoever starts it: engine.backward(loss) or the script's own
    # loss.backward(). Its first hook (on the forward's output, or a parameter's if the output
    # was bypassed) calls _begin_backward, which queues _end_backward to run when autograd has
    # no work left; so when loss.backward() returns every gradient is reduced, as in PyTorch DDP.

    @property
    def _in_backward(self) -> bool:
        """Is an autograd pass through the engine running (a backward, or one that may be)?"""
        return self.life.in_backward or self._pass_open

    @property
    def _reducing_now(self) -> bool:
        """Does the backward in progress reduce (False inside no_sync, where gradients only add up)?"""
        return self.life.reducing

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), scaled in fp16: the one thing a bare loss.backward() cannot do. The
        engine's hooks reduce the gradients either way (each reduction divides by N)."""
        scaled = self.precision.scale_loss(loss, step=self.steps)
        life = self.life
        self._pass_open = False
        with life.engine_backward():
            scaled.backward()
        if not life.began:             # no hook fired: no parameter of this rank was reached,
            self._begin_backward(life.sync, queue=False)   # but the other ranks' collectives
            self._end_backward()                           # need this rank's (zeros) all the same

    def _begin_backward(self, synced: bool, queue: bool = True) -> None:
        """A backward begins: refuse a misuse before any gradient is touched, reset the reducer's
        per-backward state (engines' _reset_backward_state), queue the end-of-backward callback."""
        self._zero_grad_seen()
        self._take_back_placeholders()
        self._take_back_guards()
        self.life.backward_began(synced)
        self.last_backward = {"start": self.comm.now(), "compute_end": None, "end": None}
        self._reset_backward_state()
        if queue and not self._pass_open:   # (an open pass ends it: _close_pass)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        """Autograd has no work left: the engine finishes its reduction (_finish_backward); then
        step() may run, and each p.grad of a sharded engine is its piece (_hand_out_grads)."""
        if self.last_backward.get("compute_end") is None:
            self.last_backward["compute_end"] = self.comm.now()
        reducing = self.life.reducing
        if reducing:
            self._finish_backward()
        self.last_backward["end"] = self.comm.now()
        chunk = self.bitwise            # (bitwise: the backward's gradient went into the trees)
        if self.sharded and reducing and not chunk:   # what this rank updates with is a piece of each gradient
            self._hand_out_grads()
            self.life.pieces_handed()
        if reducing and not chunk and self.views is not None and not self.precision.policy.needs_master:
            self._expose_grads()
        self.life.backward_ended()
        # after a backward, marks only under bitwise=True, as placeholders: a GradScaler's
        # unscale_ would write into a plain mark (and bitwise=True refuses a GradScaler by name)
        self._watch_zero_grad(marks=self.bitwise, make=chunk_grad.placeholder if self.bitwise else None)

    # -------------------------------------------------------------- p.grad under a sharded engine
    _handed = 0                 # how many p.grad are this backward's pieces
    _zeroed: set = frozenset()  # ... and which of them p.grad.zero_() zeroed since (their keys)
    _generation = 0             # which hand-out the pieces in p.grad come from
    _grad_plan = None           # where each parameter's piece lies (grad_guard.plan), once
    grads_in_memory = True      # offload="disk": the gradient shards are in files after backward

    def _hand_out_grads(self) -> None:
        """Each trained p.grad becomes this rank's piece of its averaged gradient (a view of the
        engine's reduced shard: engines.grad_guard); one no rank reached keeps None."""
        if self._grad_plan is None:
            self._grad_plan = grad_guard.plan(*self._grad_layout())
        scale = self.precision.scale if self.precision.scaler is not None else 1.0
        self._generation += 1
        self._handed = grad_guard.hand_out(self._grad_plan, self._held_grad_shards(), self._grad_reducer(),
                                             scale, self, self._unused_params(), self.grads_in_memory,
                                             self._generation)
        self._zeroed = set()

    def _grad_reducer(self):
        """How reductions of p.grad combine: over the ranks whose shards make up the gradient."""
        if getattr(self, "_reducer", None) is None:
            rank, size = self._norm_rank_and_size()
            self._reducer = Reducer(self.comm, self.norm_group, rank, size, f"ZeRO-{getattr(self, 'stage', '?')}")
        return self._reducer

    def _norm_rank_and_size(self) -> tuple:
        return self.rank, self.world_size

    def _grad_layout(self) -> tuple:
        """(flat buckets, this rank's slice of each): where the gradient shards come from."""
        raise NotImplementedError

    def _held_grad_shards(self) -> list:
        """The reduced gradient shards, in _grad_layout's order (None: none since zero_grad)."""
        return self.owned_grads()

    def _grad_zeroed(self, key) -> None:
        """p.grad.zero_() on a piece this engine handed out (Module.zero_grad(set_to_none=False))."""
        if key[0] == self._generation and self.life.guarded:
            self._zeroed.add(key)

    def _take_back_guards(self) -> None:
        """Before a backward adds to p.grad: take the pieces back. If the script zeroed them all,
        by setting p.grad to None (model.zero_grad(), a torch optimizer's zero_grad(), p.grad =
        None) or by p.grad.zero_() on each (set_to_none=False), it zeroed the gradients: drop the
        ones the engine holds, as zero_grad() does. Otherwise the next backward adds to them."""
        if not self.life.guarded:
            return
        kept = grad_guard.count(self._trainable())
        if self._handed and kept == self._handed == len(self._zeroed):
            self.zero_grad()
            return
        if self.life.guards_left(kept, self._handed, getattr(self, "stage", "?")) == "zeroed":
            self.zero_grad()
            return
        grad_guard.take_back(self._trainable())
        self.life.pieces_taken_back()

    def _watch_parameters(self) -> None:
        """The end of every engine's construction: a pre-hook on each trainable parameter's
        gradient accumulator, which autograd runs just BEFORE it adds a gradient to p.grad (and
        never for torch.autograd.grad, which returns the gradient instead), begins the backward
        before p.grad is touched, and before any reducer hook runs."""
        self._trainable_params = [p for p in self.model.parameters() if p.requires_grad]
        self._buffers_list = list(self.model.buffers())
        self._accumulators = [self._accumulator_of(p) for p in self._trainable_params]
        for node in self._accumulators:
            node.register_prehook(self._param_grad)

    def _accumulator_of(self, p):
        # (holding it keeps it the one every graph of p uses: autograd keeps it weakly)
        return get_gradient_edge(p).node

    def _param_grad(self, grad_outputs):
        if not self.life.in_backward:
            self._begin_backward(self._backward_synced())
        return None

    def _trainable(self) -> list:
        return self._trainable_params

    _trainable_params: list = []
    _accumulators: list = []
    _buffers_list: list = []

    # What an engine's reducer does (the defaults: nothing to reduce, one process).
    def _reset_backward_state(self) -> None:
        """Any backward begins: forget what the last one delivered."""

    def _finish_backward(self) -> None:
        """The end of a reducing backward: every gradient reduced (waited for) when it returns."""

    # -------------------------------------------------------------- gradients
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient. zerolab always frees them (set_to_none=False is accepted and
        does the same): the next backward writes fresh ones. engine.optimizer.zero_grad() comes
        to this before the engine next touches its gradients or reports its memory
        (_zero_grad_seen), and so, under a sharded engine, does model.zero_grad()
        (_take_back_guards)."""
        if self._watch is not None:
            self._watch.disarm()
        self._clear_placeholders()
        self._release_grads()
        self._drop_step_grads()
        if self.sharded:                # (only a sharded engine's backward hands out pieces)
            grad_guard.take_back(self._trainable())
        self.life.zeroed()

    def _release_grads(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def clip_grad_norm_(self, max_norm) -> float:
        """torch.nn.utils.clip_grad_norm_ for an engine: call it between backward() and step().

        Returns the L2 norm of the whole gradient (every rank's shard, tied weights once,
        unscaled in fp16); the next step() scales the gradients so it is at most max_norm (as
        max_grad_norm= does at every step). torch.nn.utils.clip_grad_norm_(model.parameters(),
        max_norm) computes the same norm (under ZeRO each p.grad is a piece that knows it is sharded:
        engines.grad_guard) and scales the gradients at once instead."""
        check_max_grad_norm(max_norm)
        if max_norm is None or not self.life.backward_done:
            raise (ValueError("clip_grad_norm_: max_norm must be a number > 0") if max_norm is None else
                   RuntimeError("clip_grad_norm_() called before backward(): there is no gradient to clip"))
        if self.bitwise:            # the chunks' sum now (the step reuses it), its fixed-order norm
            self.life.clip_at_next_step(max_norm)
            return self._chunk_norm()
        sq = squared_norm([g for g in self.owned_grads() if g is not None])
        total = global_norm(sq, self.comm if self.sharded else None, self.norm_group)
        self.life.clip_at_next_step(max_norm)
        return total / self.precision.scale    # (1 unless fp16 scales the loss)

    def owned_grads(self) -> list:
        """The gradients this rank holds for the tensors it updates (here: one per parameter)."""
        return [p.grad for p in self.params]
