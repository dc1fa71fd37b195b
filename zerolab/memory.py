"""Memory: the paper's model of it, and measurement that never uses that model.

The model (ZeRO paper, section 3.1 and 5): mixed-precision Adam keeps, per parameter,
2 bytes of fp16 parameters, 2 bytes of fp16 gradients and K = 12 bytes of optimizer
state (fp32 master copy, momentum, variance), so 16 bytes in all. ZeRO stage 1 shards
the K bytes over N_d ranks, stage 2 also the gradients, stage 3 also the parameters:

    stage 0 (plain DP):  (2 + 2 + K) Psi
    stage 1 (P_os):      (2 + 2) Psi + K Psi / N_d
    stage 2 (P_os+g):     2 Psi + (2 + K) Psi / N_d
    stage 3 (P_os+g+p):  (2 + 2 + K) Psi / N_d

Measurement counts real storages: `live_bytes` adds up distinct storages (a view or a
tied weight is counted once), `model_state_bytes_measured` sorts them into params,
grads and optimizer state, `AllocationTracker` follows every tensor an operation
allocates and frees to find the peak of a region, and `saved_activation_bytes` counts
what autograd keeps for the backward pass.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ------------------------------------------------------------------ the paper's model


def _check_model_args(psi, n_d, stage, k):
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (plain data parallelism), 1, 2 or 3; got {stage!r}")
    if not isinstance(psi, (int, float)) or isinstance(psi, bool) or not psi > 0:
        raise ValueError(f"psi (the number of parameters) must be > 0; got {psi!r}")
    if isinstance(n_d, bool) or not isinstance(n_d, int) or n_d < 1:
        raise ValueError(f"n_d (the data-parallel degree) must be an int >= 1; got {n_d!r}")
    if not isinstance(k, (int, float)) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k (optimizer bytes per parameter) must be >= 0; got {k!r}")


def bytes_per_param(n_d: int, stage: int, k: float = 12, *, param_bytes: float = 2,
                    grad_bytes: float = 2) -> float:
    """Model-state bytes per parameter on one rank (defaults: the paper's fp16 + Adam)."""
    _check_model_args(1, n_d, stage, k)
    p, g, o = param_bytes, grad_bytes, k
    if stage >= 1:
        o = o / n_d
    if stage >= 2:
        g = g / n_d
    if stage >= 3:
        p = p / n_d
    return p + g + o


def model_state_bytes(psi: float, n_d: int, stage: int, k: float = 12, *, param_bytes: float = 2,
                      grad_bytes: float = 2) -> float:
    """Per-device model-state bytes for a psi-parameter model, as in the paper's Table 1.

    fp32 training with Adam is param_bytes=4, grad_bytes=4, k=8 (two fp32 moments).
    """
    _check_model_args(psi, n_d, stage, k)
    return psi * bytes_per_param(n_d, stage, k, param_bytes=param_bytes, grad_bytes=grad_bytes)


def max_params(device_bytes: float, n_d: int, stage: int, k: float = 12, n_m: int = 1, *,
               param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """The largest model whose model states fit in `device_bytes` per device (Table 2, left).

    Model parallelism of degree n_m splits every model state n_m ways on top of ZeRO.
    """
    if not isinstance(device_bytes, (int, float)) or not device_bytes > 0:
        raise ValueError(f"device_bytes must be > 0; got {device_bytes!r}")
    if isinstance(n_m, bool) or not isinstance(n_m, int) or n_m < 1:
        raise ValueError(f"n_m (the model-parallel degree) must be an int >= 1; got {n_m!r}")
    return n_m * device_bytes / bytes_per_param(n_d, stage, k, param_bytes=param_bytes,
                                                grad_bytes=grad_bytes)


# ------------------------------------------------------------------ measurement: live storages


def _storage_key(t: torch.Tensor):
    st = t.untyped_storage()
    return (st.device.type, st.device.index, st.data_ptr()), st.nbytes()


def live_bytes(tensors, exclude=()) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights count once).

    Storages also behind a tensor of `exclude` are left out (e.g. parameters saved for backward).
    """
    skip = {_storage_key(t)[0] for t in exclude if isinstance(t, torch.Tensor)}
    seen: dict = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        key, nbytes = _storage_key(t)
        if key[2] == 0 or key in skip:  # empty or excluded storage
            continue
        seen[key] = nbytes
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list:
    """Every tensor the optimizer keeps in its state (moments, step counters...)."""
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def model_state_bytes_measured(model: torch.nn.Module, optimizer=None, extra_params=()) -> dict:
    """Measured bytes of params / grads / optimizer state held by a model and its optimizer.

    Counts storages, so it sees exactly what is allocated: a padded flat buffer counts with its
    padding, a freed gradient counts nothing. `extra_params` adds tensors that are parameters
    in all but name (e.g. fp32 master copies an engine keeps).
    """
    params = list(model.parameters()) + list(extra_params)
    grads = [p.grad for p in params if p.grad is not None]
    opt = optimizer_tensors(optimizer) if optimizer is not None else []
    out = {"params": live_bytes(params), "grads": live_bytes(grads, exclude=params),
           "optimizer": live_bytes(opt, exclude=params + grads)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


# ------------------------------------------------------------------ measurement: activations


def saved_activation_bytes(fn, *args, exclude=(), **kwargs):
    """Run fn(*args) and measure the bytes autograd saved for backward.

    Returns (fn's output, bytes). Storages of `exclude` (pass the parameters) are not counted:
    a weight saved for backward is a parameter, not an activation.
    """
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return out, live_bytes(saved, exclude=list(exclude))


def held_after(fn, *args, **kwargs):
    """Run fn(*args) and return (its output, bytes allocated inside fn still alive after it).

    Right after a forward pass this is what the forward left behind for backward (plus the
    output itself), however it was kept: saved tensors, checkpoints, offloaded slices.
    """
    with AllocationTracker() as tracker:
        out = fn(*args, **kwargs)
    return out, settled(tracker)


def settled(tracker: "AllocationTracker", max_wait: float = 0.2) -> int:
    """tracker.current once it stops changing.

    A collective's backend thread (gloo's worker) may still hold a tensor for a moment after
    the collective returned; give it a few milliseconds to let go before reading the count.
    """
    last, steady = tracker.current, 0
    for _ in range(int(max_wait / 0.002)):
        time.sleep(0.002)
        steady = steady + 1 if tracker.current == last else 0
        last = tracker.current
        if steady >= 3:
            break
    return tracker.current


# ------------------------------------------------------------------ measurement: peak of a region


class TraceEvent(NamedTuple):
    """One allocation (delta > 0) or free (delta < 0) of the storage numbered `block`."""

    index: int
    delta: int
    op: str
    block: int


@dataclass
class AllocationTracker(TorchDispatchMode):
    """Follows every storage an operation allocates inside a `with` block, and its release.

    Works on any device, CPU included, by watching the outputs of every aten operation
    (forward, backward and optimizer) and attaching a finalizer to each new storage. It sees
    the tensors that operations return, not scratch space inside a single kernel.

        with AllocationTracker() as tr:
            loss = model(x).sum(); loss.backward(); opt.step()
        tr.peak      # the most bytes allocated inside the block at any moment
        tr.current   # bytes allocated inside the block and still alive
        tr.trace     # [TraceEvent(index, +bytes or -bytes, op name, block id)]: allocations and frees
    """

    record_trace: bool = False
    current: int = 0
    peak: int = 0
    allocations: int = 0
    trace: list = field(default_factory=list)

    def __post_init__(self):
        super().__init__()
        self._live: dict = {}

    def _freed(self, key, block):
        nbytes = self._live.pop(key, 0)
        self.current -= nbytes
        if self.record_trace and nbytes:
            self.trace.append(TraceEvent(len(self.trace), -nbytes, "free", block))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not _may_allocate(func):
            return out          # in place, out=, a view, or nothing returned: no new storage
        inputs = None           # the inputs' storages, read only if an output might be new
        for t in _tensors(out):
            if t.device.type == "meta":
                continue
            key, nbytes = _storage_key(t)
            if key[2] == 0 or key in self._live:
                continue  # empty, or already counted
            if inputs is None:
                inputs = {_storage_key(x)[0] for x in _tensors((args, kwargs))}
            if key in inputs:
                continue  # a view of an input, or an in-place result
            self._live[key] = nbytes
            self.current += nbytes
            self.allocations += 1
            self.peak = max(self.peak, self.current)
            if self.record_trace:
                self.trace.append(TraceEvent(len(self.trace), nbytes, str(func), self.allocations))
            weakref.finalize(t.untyped_storage(), self._freed, key, self.allocations)
        return out


_ALLOCATES: dict = {}    # aten operation -> may it return a tensor that is not one of its inputs?


def _may_allocate(func) -> bool:
    """False when the operation's schema says every result aliases an input (mul_, div.out, view,
    a foreach update that returns nothing): most of an optimizer step, skipped without looking
    at its tensors. Asked once per operation."""
    allocates = _ALLOCATES.get(func)
    if allocates is None:
        allocates = _ALLOCATES[func] = not all(r.alias_info is not None for r in func._schema.returns)
    return allocates


def _tensors(tree):
    """The tensors in an operation's arguments or results (nested tuples, lists and dicts): a
    plain walk, as tree_leaves but without its per-node bookkeeping, since it runs for every
    operation a tracked region performs (a foreach update passes lists of every parameter)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


class PeakMemory:
    """Peak bytes allocated during a region, above what was allocated when it began.

    On CUDA it reads the caching allocator's statistics; on CPU it uses AllocationTracker.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak = 0
        self._tracker = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._tracker = AllocationTracker().__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            self._tracker.__exit__(*exc)
            self.peak = self._tracker.peak
        return False


def malloc_in_use() -> int | None:
    """Bytes this whole process has in use from malloc (glibc's mallinfo2), or None elsewhere.

    Every CPU tensor's memory comes from malloc, whichever code or thread allocated it."""
    global _mallinfo2
    if _mallinfo2 is None:
        import ctypes

        class _Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                      "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
        try:
            fn = ctypes.CDLL("libc.so.6").mallinfo2
            fn.restype = _Info
            _mallinfo2 = fn
        except (OSError, AttributeError):   # not glibc >= 2.33 (macOS, musl, old Linux)
            _mallinfo2 = False
    if not _mallinfo2:
        return None
    info = _mallinfo2()
    return info.uordblks + info.hblkhd      # in use in the heap + in mmapped blocks


_mallinfo2 = None


class MallocTrace(TorchDispatchMode):
    """The bytes the process has in use from malloc, sampled after every PyTorch op.

        with MallocTrace() as trace:
            engine = build()            # model, optimizer state, buffers: all counted
            warm_up(engine)
            trace.mark("step")
            engine.step(...)
            trace.mark("end")
        trace.held("step"), trace.peak("step", "end")    # bytes above the block's start

    The trackers above see the tensors Python code creates. This one sees malloc itself, so
    it also counts what C++ code allocates (PyTorch DDP's reducer buckets), storages resized
    in place (FSDP2's gathered parameters) and tensors freed by other threads (gloo's): the
    fair measure when comparing engines we did not write. Its samples come after each op, so
    a temporary born and freed inside one op is missed. Linux (glibc) only.
    """

    def __enter__(self):
        self._base = malloc_in_use()
        if self._base is None:
            raise RuntimeError("MallocTrace needs glibc's mallinfo2 (Linux); use PeakMemory elsewhere")
        self._samples, self._marks = [0], {}
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._samples.append(malloc_in_use() - self._base)
        return out

    def mark(self, name: str) -> None:
        self._samples.append(malloc_in_use() - self._base)
        self._marks[name] = len(self._samples) - 1

    def held(self, mark: str) -> int:
        """Bytes in use at `mark`, above the start of the block."""
        return self._samples[self._marks[mark]]

    def peak(self, start: str, end: str) -> int:
        """The most bytes in use at any sample between two marks."""
        return max(self._samples[self._marks[start]:self._marks[end] + 1])


# ------------------------------------------------------------------ one measured training step


def measure_training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch,
                          loss_fn) -> dict:
    """One plain training step (forward, backward, optimizer step), measured piece by piece.

    Returns bytes for params, grads, optimizer state (after the step, when Adam's moments
    exist), activations saved for backward (at the end of forward), and the peak allocated
    during the step on top of the model states held when it began.
    """
    params = list(model.parameters())
    device = params[0].device
    with PeakMemory(device) as peak:
        (logits, loss), activations = saved_activation_bytes(loss_fn, model, batch, exclude=params)
        loss.backward()
        optimizer.step()
    states = model_state_bytes_measured(model, optimizer)
    return {**states, "activations": activations, "peak_step": peak.peak, "loss": loss.item(),
            "numel": sum(p.numel() for p in params)}
