"""ZeRO-Offload: the fp32 master shards and the optimizer state live in HOST memory.

    engine = zl.ZeRO(model, partial(torch.optim.AdamW, lr=3e-4), stage=2, offload="optimizer")

The three ZeRO stages keep, on each rank, a 1/N shard of the fp32 masters and of the optimizer
state: 12 of the 16 bytes per parameter of mixed-precision Adam. ZeRO-Offload (Ren et al.,
2021) moves exactly those to the CPU's memory, which is larger and cheaper than the
accelerator's, and runs the optimizer there. Each step then moves, per rank:

    down  (device -> host)  the reduced gradient shard, in the dtype it was reduced in
    up    (host -> device)  the updated parameter shard, in the compute dtype

    d2h = (Psi_pad / N) * bytes(gradient)      h2d = (Psi_pad / N) * bytes(compute dtype)

Psi_pad is the parameter count after each flat buffer is padded to a multiple of N. Nothing
else crosses the bus: forward and backward run on the device as without offload, and every
collective (reduce-scatter, all-gather) moves the same bytes as before.

How it fits the engines: OptimizerOffload is a mixin placed before ZeRO1, ZeRO2 or ZeRO3. After
the engine is built it gives every master shard a host twin (pinned when CUDA is present: a
copy from pinned memory runs by DMA at the bus's full speed; zerolab still waits for each one,
so its seconds are the copy's) and points the optimizer at the twins; the device keeps only the
compute copy. Beside each twin it keeps, for every step, an fp32 gradient buffer and (bf16,
fp16) a staging buffer in the compute dtype (_make_host_buffers). Then these steps of the
engine's step template change and nothing else:

    _step_grads   copy each gradient shard down (counted), cast it to fp32 ON THE HOST
    _grad_sums    the finite check's sums, on the device's shards (the same values)
    _upload       cast each updated master shard to the compute dtype, copy it up (counted)

Host bytes per element of the shard, k = Psi_pad / N of them, c the compute dtype's bytes:

    host = (4 + 8 + 4 + c) k  (+ 4 bytes of step count per tensor the optimizer updates)
           master, Adam's two moments, the fp32 gradient, the staging buffer (none in fp32)

18 bytes in bf16 and fp16, 16 in fp32: what DeepSpeed's ZeRO-Offload keeps on the host too.

Clipping and the optimizer (the user's torch optimizer, on one view per parameter of the host
shards) run on the host copies: the same arithmetic on the same values, so the result is bit
for bit the engine without offload. That is also why zerolab runs the optimizer as the script
built it: torch's AdamW(fused=True) updates in one pass over the memory (what DeepSpeed's
DeepSpeedCPUAdam does) where its foreach path makes a dozen, but it rounds differently in the
last bit, so it is the script's choice (partial(torch.optim.AdamW, fused=True)), never made
behind its back; zerolab only asks for foreach where the script left the choice to torch.

`engine.transfers` is the ledger of device <-> host copies (direction, bytes, seconds), kept
apart from `engine.comm`, the ledger of the network. memory_report() adds "device" and "host".

On a machine without an accelerator, "device" and "host" are the same RAM. The copies are
still made (separate tensors) and counted: the data flow is the one a GPU would run, and the
bytes are the bytes a PCIe bus would carry; only the seconds are not a bus's seconds. (The
tests run on CPU with gloo; the CUDA paths here, pinning and synchronising, ran on an H100 with
offload="optimizer" at stages 1-3, gpu/offload_cuda.py; offload="disk" has not yet completed a
step on GPU tensors there.)

delay_update=True is ZeRO-Offload's one-step delayed parameter update (DPU): step() runs the
engine's step (gradients down, the finite check, clipping) and only its update changes: the
optimizer runs on a background thread (`_land_update`) and step() returns; the
forward and backward of the next step run meanwhile, on the parameters from BEFORE that
update. The next step() waits for it and publishes it. So the gradient of step t+1 is computed
on the weights of step t-1: every update lags one step (the paper turns it on after a few
warm-up steps; here it is on from the start, so the first step's forward and the second's see
the same weights). finish_update() lands the last one (state_dict, full_state_dict and
checkpoints land it themselves; zero_grad leaves it running).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn as nn

from ...memory import live_bytes, optimizer_tensors
from ...optim.param_groups import without_hooks



def host_empty(shape, dtype, for_gpu: bool) -> torch.Tensor:
    """A host tensor; pinned (page-locked) when it will be copied to or from a GPU, so the copy
    runs through DMA at the bus's rate. Only then: an engine training on CPU tensors on a
    machine that has a GPU must not pin, since pinning creates a CUDA context (hundreds of MB
    of the process's memory) for nothing."""
    return torch.empty(shape, dtype=dtype, pin_memory=for_gpu)


@dataclass
class Transfer:
    """One copy between device and host memory."""

    direction: str      # "d2h" (gradients down) | "h2d" (parameters up)
    bytes: int
    seconds: float
    tag: str = ""


class Transfers:
    """The ledger of device <-> host copies (engine.transfers); the network's is engine.comm."""

    def __init__(self):
        self.records: list[Transfer] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str, tag: str = "") -> torch.Tensor:
        """dst.copy_(src), counted. The bytes are what crosses the bus: the SOURCE dtype going
        down (the gradient as reduced), the DESTINATION dtype going up (the compute dtype)."""
        t0 = time.perf_counter()
        dst.copy_(src)
        if dst.is_cuda or src.is_cuda:
            torch.cuda.synchronize()
        moved = src if direction == "d2h" else dst
        self.records.append(Transfer(direction, moved.numel() * moved.element_size(),
                                     time.perf_counter() - t0, tag))
        return dst

    def bytes(self, direction: str | None = None) -> int:
        return sum(r.bytes for r in self.records if direction in (None, r.direction))

    def seconds(self, direction: str | None = None) -> float:
        return sum(r.seconds for r in self.records if direction in (None, r.direction))

    def reset(self) -> None:
        self.records = []


class DetachedUpdate:
    """The optimizer's update as of now, for another thread: nothing the script does meanwhile
    reaches it, and it touches nothing the script sees until it lands.

    It runs on a copy of the optimizer made by the optimizer's own copy protocol (no hooks), whose
    groups are copies (lr, betas, weight decay as they are now, whatever a learning-rate
    scheduler writes into the real groups meanwhile) holding aliases of the tensors (t.detach():
    the same storage, other tensor objects, each with the gradient handed to it now). So the
    script's optimizer.zero_grad() and the engine's marks on the real tensors
    (optim.zero_grad_watch) never reach the update in flight. The state is the optimizer's own: the
    same per-parameter dicts, updated in place; a parameter's first state is handed back when the
    update lands (land)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.copy = without_hooks(optimizer)
        self.real = {}                  # alias -> the optimizer's tensor
        groups = []
        for group in optimizer.param_groups:
            aliases = []
            for t in group["params"]:
                alias = t.detach()
                alias.grad = t.grad
                self.real[alias] = t
                aliases.append(alias)
            groups.append({**group, "params": aliases})
        self.copy.param_groups = groups
        self.copy.state = defaultdict(dict, {a: optimizer.state[t] for a, t in self.real.items()
                                             if t in optimizer.state})

    def run(self) -> None:
        self.copy.step()

    def land(self) -> None:
        """After the thread: the state the update made for a parameter stepped the first time."""
        for alias, state in self.copy.state.items():
            if self.real[alias] not in self.optimizer.state:
                self.optimizer.state[self.real[alias]] = state


class OptimizerOffload:
    """Mixin for ZeRO1 / ZeRO2 / ZeRO3: masters and optimizer state in host memory (module doc)."""

    offload = "optimizer"

    def __init__(self, model, optimizer=None, **keywords):
        self.transfers = Transfers()
        self._in_flight = None            # (thread, error box) of a delayed update in flight
        super().__init__(model, optimizer, **keywords)   # (its options include engines.options.Offload)
        self.delay_update = self.options.offload.delay_update
        self._move_masters_to_host()
        self._make_host_buffers()

    # -------------------------------------------------------------- construction
    @torch.no_grad()
    def _move_masters_to_host(self):
        self._dev = self._compute_shards()       # (the engine's: ZeRO1 or ZeRO3)
        old = list(self.masters)
        host = []
        for m in old:
            h = host_empty(m.shape, torch.float32, m.is_cuda)
            h.copy_(m)                  # setup, not a step: not counted
            host.append(nn.Parameter(h) if isinstance(m, nn.Parameter) else h)
        self._set_masters(host)          # every name the engine has for them means the host twins
        if self.views is not None:       # the optimizer's views are cut again, from the twins
            self.views.move(host, self.optimizer)

    @torch.no_grad()
    def _make_host_buffers(self):
        """The step's host buffers, made once here and reused by every step (a fresh fp32 copy of
        each gradient and a fresh staging buffer every step cost a GPU box's host more than the
        update itself: new pages to fault in, or to pin):

            grad32[i]             the fp32 gradient the optimizer reads: 4 bytes per element
            staging[i, dtype]     bf16 / fp16 only: where the reduced gradient lands from the device,
                                  and where the updated master is cast before it goes up: c bytes
                                  per element. One buffer serves both directions, one after the
                                  other: every copy has finished when Transfers.copy returns.

        DeepSpeed's ZeRO-Offload keeps the same two (its fp32 gradient partition and its 16-bit
        buffer for the way up, deepspeed/runtime/zero/stage_1_and_2.py)."""
        self._grad32 = [host_empty(m.shape, torch.float32, d.is_cuda) for m, d in zip(self.masters, self._dev)]
        self._shard_of = {id(m): i for i, m in enumerate(self.masters)}
        self._staging = {}              # (shard, dtype) -> its staging buffer
        for i, d in enumerate(self._dev):
            if d.dtype != torch.float32:
                self._staging_buffer(i, d.dtype, d.is_cuda)

    def _staging_buffer(self, i, dtype, for_gpu) -> torch.Tensor:
        """Shard i's staging buffer of `dtype`: the compute dtype's was made with the engine (a
        gradient is reduced in that dtype or in fp32, which needs none); another is made once."""
        if (i, dtype) not in self._staging:
            self._staging[i, dtype] = host_empty(self.masters[i].shape, dtype, for_gpu)
        return self._staging[i, dtype]

    # -------------------------------------------------------------- the steps that move bytes
    def _step_grads(self) -> list:
        """Each reduced gradient shard goes down to the host, then becomes fp32 there, in the
        shard's persistent buffers (_make_host_buffers): a low-precision gradient lands in the
        staging buffer and is cast from it into grad32 on all the host's cores; an fp32 one lands
        in grad32 itself. ZeRO-3's unit that no backward reached sends nothing: zeros."""
        for i, (m, g) in enumerate(zip(self.masters, self.owned_grads())):
            grad32 = self._grad32[i]
            if g is None:
                grad32.zero_()          # (the buffer still holds the last step's gradient)
            elif g.dtype == torch.float32:
                self.transfers.copy(grad32, g, "d2h", tag=f"grad{i}")
            else:
                staged = self.transfers.copy(self._staging_buffer(i, g.dtype, g.is_cuda), g, "d2h", tag=f"grad{i}")
                grad32.copy_(staged)    # the cast to fp32 is the host's work
            m.grad = grad32
        return [m.grad for m in self.masters]

    def _grad_sums(self, grads) -> list:
        """The finite check (bf16, fp32: one sum per shard, or the sums the engine took during
        backward) reads the DEVICE's gradient shards, the same values as the host's copies: a GPU
        sums its own memory in microseconds, and the host's cores are left to the update."""
        return super()._grad_sums([g for g in self.owned_grads() if g is not None])

    def _upload(self, dev, master):
        """The updated fp32 master shard goes up, cast to the compute dtype. The cast is the
        host's work, on all its cores, into the shard's staging buffer (pinned on a GPU box), which
        one DMA copy then sends up: a copy that changes dtype and device at once would convert
        on one core first (on an H100 host, 250 ms for 163 M parameters where the bus needs 6 ms).
        (offload="disk" steps a unit at a time and keeps no buffer between steps: its cast goes
        to a buffer made for it.)"""
        if master.dtype != dev.dtype:
            i = self._shard_of.get(id(master))
            staged = (host_empty(master.shape, dev.dtype, dev.is_cuda) if i is None
                      else self._staging_buffer(i, dev.dtype, dev.is_cuda))
            master = staged.copy_(master)
        self.transfers.copy(dev, master, "h2d", tag="param")

    def _drop_step_grads(self):
        if self._in_flight is not None:
            return                      # zero_grad() during a delayed update: its thread reads them
        super()._drop_step_grads()
        for m in self.masters:          # (grad32 keeps its storage for the next step)
            m.grad = None

    def _expose_grads(self):
        """(The views are host tensors: the device's gradients reach them only in the step.)"""

    # -------------------------------------------------------------- the delayed update
    def _start_step(self) -> None:
        self.finish_update()            # delay_update: the last step's update lands first,
        super()._start_step()           # then ZeRO-3 releases its gathered units (stale)

    def _hand_grads(self) -> None:
        """delay_update: nothing is handed to the optimizer's own update (it finds no gradient and
        does nothing); _land_update runs the update on a thread instead."""
        if not self.delay_update:
            super()._hand_grads()

    def _land_update(self) -> None:
        """delay_update: the views get this step's gradients and the optimizer runs on a thread,
        and step() returns; finish_update, at the next step, waits for it and publishes (a
        collective: on the main thread)."""
        if not self.delay_update:
            return super()._land_update()
        super()._hand_grads()
        box: list = []
        # the hyperparameters are read once, now: a scheduler's change after this step() (on
        # the main thread, while the update runs) takes effect at the next step, as without delay
        as_of_now = DetachedUpdate(self.optimizer)

        def update():                   # host arithmetic only: no collective on this thread
            try:
                as_of_now.run()
            except BaseException as e:  # re-raised by finish_update, on the main thread
                box.append(e)

        thread = threading.Thread(target=update, name="zerolab-offload-step", daemon=True)
        thread.start()
        self._in_flight = (thread, box, as_of_now)

    # no_grad: state_dict, checkpoints and users call it outside step(); with grad enabled the
    # copies into the compute shards would be recorded by autograd, and ZeRO-3's next all-gather
    # into them fails ("A view was created in no_grad mode and is being modified inplace")
    @torch.no_grad()
    def finish_update(self) -> None:
        """delay_update: wait for the update in flight and publish it (up, then all-gather for
        stages 1-2). Every rank must call it (publishing is a collective); nothing if none."""
        if self._in_flight is None:
            return
        thread, box, update = self._in_flight
        self._in_flight = None
        thread.join()
        if box:
            raise box[0]
        update.land()
        self._publish()
        if self._watch is not None:     # (the engine's own drop, not the script's zero_grad())
            with self._watch.engine_drops():
                self._drop_step_grads()
        else:
            self._drop_step_grads()

    def full_state_dict(self) -> dict:
        self.finish_update()
        return super().full_state_dict()

    def checkpoint_segments(self, names):
        self.finish_update()            # (zerolab.checkpoint and load_state_dict come here)
        return super().checkpoint_segments(names)

    # -------------------------------------------------------------- where the bytes live
    def host_tensors(self) -> list:
        """What lives in host memory: the fp32 masters, the optimizer state, and the step's
        buffers (fp32 gradients, staging), held between steps too."""
        grads = [m.grad for m in self.masters if m.grad is not None]
        return (list(self.masters) + grads + list(self._grad32) + list(self._staging.values())
                + optimizer_tensors(self.optimizer))

    def _memory_tensors(self):
        # the host masters are separate tensors now (in fp32 too): count them as optimizer bytes
        params, grads, optimizer = super()._memory_tensors()
        return params, grads, self.host_tensors() + optimizer

    def memory_report(self) -> dict:
        """Engine's report, plus where the bytes live: "host" (masters, optimizer state, their
        gradients while a step runs) and "device" (the rest of the model states)."""
        out = super().memory_report()
        out["host"] = live_bytes(self.host_tensors())
        out["device"] = out["total"] - out["host"]
        return out
