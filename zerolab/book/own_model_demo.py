"""Runs for chapter 11 (your own model): a Hugging Face GPT-2 under every engine.

The model is `transformers.GPT2LMHeadModel`, built from a small GPT2Config (nothing is
downloaded), called the way Hugging Face documents it (`engine(input_ids=ids, labels=ids)`),
and trained with what a real script does: nanoGPT's weight-decay parameter groups, gradient
accumulation over micro-batches, and gradient clipping. The workers below are what the chapter
launches with zl.launch; the parent prints what they return.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.data import VOCAB_SIZE, CharDataset

BLOCK = 32          # tokens per sequence (n_positions)
ROWS = 2            # sequences per rank per micro-batch
ACCUM = 2           # micro-batches per optimizer step
LR = 3e-3
MAX_NORM = 1.0      # gradient clipping
STEPS = 4
ENGINES = ("naive", "ddp", "zero1", "zero2", "zero3")
LABELS = {"single": "SingleProcess", "naive": "NaiveDDP", "ddp": "DDP",
          "zero1": "ZeRO stage 1", "zero2": "ZeRO stage 2", "zero3": "ZeRO stage 3"}


# ------------------------------------------------------------------ the model and the optimizer


def config(**overrides):
    """A tiny GPT-2: 2 blocks of width 64, 4 heads, the corpus's 96 characters as vocabulary."""
    from transformers import GPT2Config
    kw = dict(vocab_size=VOCAB_SIZE, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=4,
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
              bos_token_id=0, eos_token_id=0)
    kw.update(overrides)
    return GPT2Config(**kw)


def gpt2(seed: int = 0, **overrides):
    """GPT2LMHeadModel(config), with the same initial weights for the same seed."""
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging
    logging.set_verbosity_error()
    logging.disable_progress_bar()      # (from_pretrained would draw one)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPT2LMHeadModel(config(**overrides))


def nanogpt_adamw(params, lr=LR, weight_decay=0.1):
    """nanoGPT's configure_optimizers rule: decay every tensor of 2 or more dimensions (matrices,
    embeddings), none for the 1-D ones (biases, LayerNorm gains and shifts)."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, eps=1e-6)


def group_sizes(model) -> tuple:
    """(parameters with decay, parameters without), counted the way the rule splits them."""
    opt = nanogpt_adamw(model.parameters())
    return tuple(sum(p.numel() for p in g["params"]) for g in opt.param_groups)


def make(name, model=None, **options):
    """The engine `name` around a fresh GPT-2 (or `model`), with nanoGPT's parameter groups."""
    model = gpt2() if model is None else model
    if name == "single":
        return zl.SingleProcess(model, nanogpt_adamw, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zl.engines.make(name, model, nanogpt_adamw, **options)


# ------------------------------------------------------------------ the training loop


_DATA = {}


def tokens(step: int, micro: int, rank: int = 0, world: int = 1, rows: int = ROWS):
    """This rank's rows of micro-batch `micro` of step `step` (the same global batch at any world size)."""
    if BLOCK not in _DATA:
        _DATA[BLOCK] = CharDataset(BLOCK)
    return _DATA[BLOCK].batch(step * ACCUM + micro, rows, rank, world)[0]


def where():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def no_sync_unless_last(engine, last: bool):
    """engine.no_sync() for all but the last micro-batch (a single process has nothing to skip)."""
    if last or not hasattr(engine, "no_sync"):
        return contextlib.nullcontext()
    return engine.no_sync()


def train(engine, steps: int = STEPS, first: int = 0, global_rows: int = 2 * ROWS, clip: bool = True,
          accum: int = ACCUM):
    """`steps` optimizer steps of ACCUM micro-batches each, every micro-batch `global_rows`
    sequences split over the ranks. Returns this rank's losses (the mean over its micro-batches),
    the global gradient norms clip_grad_norm_ returned, and the last step's ledger and memory
    (measured between its backward and its step(): the moment every model state is held)."""
    rank, world = where()
    rows = global_rows // world
    losses, norms, memory = [], [], None
    for step in range(first, first + steps):
        last_step = step == first + steps - 1
        if last_step:
            engine.comm.reset()
        total = 0.0
        for micro in range(accum):
            ids = tokens(step, micro, rank, world, rows)
            with no_sync_unless_last(engine, micro == accum - 1):
                out = engine(input_ids=ids, labels=ids)       # as Hugging Face documents it
                engine.backward(out.loss / accum)              # the mean over the micro-batches
            total += out.loss.item() / accum
        if clip:
            norms.append(engine.clip_grad_norm_(MAX_NORM))     # the norm of the WHOLE gradient
        if last_step:
            memory = engine.memory_report()    # every gradient is held now, optimizer state too
        engine.step()
        engine.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "memory": memory}


def pytorch_train(engine, optimizer, steps: int = STEPS):
    """The same steps written as a PyTorch script writes them: loss.backward(), nanoGPT's
    require_backward_grad_sync for accumulation, optimizer.step(), optimizer.zero_grad().
    `optimizer` is the one the script built and gave the engine. Returns this rank's losses."""
    rank, world = where()
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(ACCUM):
            ids = tokens(step, micro, rank, world, ROWS * 2 // world)
            engine.require_backward_grad_sync = micro == ACCUM - 1      # no_sync, nanoGPT's way
            out = engine(input_ids=ids, labels=ids)
            (out.loss / ACCUM).backward()
            total += out.loss.item() / ACCUM
        engine.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def both_loops(names=("single",) + ENGINES, steps: int = STEPS) -> dict:
    """Each engine trained twice from the same weights, by zerolab's loop (train) and by PyTorch's
    (pytorch_train, with an optimizer built on model.parameters() and handed to the engine):
    {name: (same losses, same weights bit for bit)}. Then precision='fp16' with a bare
    loss.backward(): {"fp16": the error step() raises}."""
    out = {}
    for name in names:
        zl_engine = make(name, track_peak=False)
        zl_losses = train(zl_engine, steps)["losses"]
        model = gpt2()
        optimizer = nanogpt_adamw(model.parameters())
        pt_engine = make_with(name, model, optimizer)
        pt_losses = pytorch_train(pt_engine, optimizer, steps)
        a, b = zl_engine.full_state_dict(), pt_engine.full_state_dict()
        out[name] = (zl_losses == pt_losses, all(torch.equal(a[k], b[k]) for k in a))
    engine = make("ddp", precision="fp16", track_peak=False)
    engine(input_ids=tokens(0, 0), labels=tokens(0, 0)).loss.backward()
    try:
        engine.optimizer.step()
        out["fp16"] = "no error"
    except RuntimeError as e:
        out["fp16"] = str(e)
    return out


def make_with(name, model, optimizer, **options):
    """The engine `name` around `model`, given an optimizer the script built on its parameters."""
    if name == "single":
        return zl.SingleProcess(model, optimizer, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zl.engines.make(name, model, optimizer, **options)


# ------------------------------------------------------------------ section 2 and 3: every engine


# the ledger's tags of the small collectives that carry no model data: which parameters a rank
# reached, the clip norm, ZeRO-3's unit checks, fp16's overflow flag
BOOKKEEPING = ("used", "grad_norm", "check", "overflow")


def traffic(ledger) -> dict:
    """Bytes this rank sent, from the ledger's records: {op: bytes} for the collectives that move
    gradients or parameters, and the bookkeeping apart."""
    out = {"small_bytes": 0, "small_calls": 0}
    for r in ledger.records:
        if r.tag in BOOKKEEPING:
            out["small_bytes"] += r.bytes_sent
            out["small_calls"] += 1
        else:
            out[r.op] = out.get(r.op, 0) + r.bytes_sent
    return out


def step_counters(engine) -> int:
    """Bytes of AdamW's step counters: one small tensor per tensor the optimizer updates."""
    steps = [st["step"] for st in engine.optimizer.state.values() if torch.is_tensor(st.get("step"))]
    return sum(t.numel() * t.element_size() for t in steps)


def every_engine(names=ENGINES, steps: int = STEPS):
    """Train each engine in turn on this rank, from the same initial weights and batches."""
    out = {}
    for name in names:
        engine = make(name)
        run = train(engine, steps)
        run.update(bytes=traffic(engine.comm), state=engine.full_state_dict(), padded=_padded(engine),
                   counters=step_counters(engine))
        out[name] = run
    return out


def _padded(engine) -> int:
    """Elements of the flat buffers this engine lays the parameters into (with padding)."""
    if hasattr(engine, "units"):
        return sum(u.buckets["train"].padded_numel for u in engine.units)
    if hasattr(engine, "buckets"):
        return engine.buckets.padded_numel
    return sum(p.numel() for p in engine.params)


def reference(steps: int = STEPS):
    """One process on the global batch (2 x ROWS rows per micro-batch): the reference."""
    engine = make("single", track_peak=False)
    run = train(engine, steps)
    run.update(state=engine.full_state_dict(), psi=sum(p.numel() for p in engine.model.parameters()))
    return run


def memory_runs(configs=(("bf16", 1), ("bf16", 2)), names=("naive", "ddp", "zero1", "zero2", "zero3")):
    """Two steps per engine for each (precision, micro-batches per step); the second step's
    memory (between backward and step()) and bytes, with what the paper's formula does not
    count: AdamW's step counters (one 4-byte tensor per tensor it updates)."""
    out = {}
    for precision, accum in configs:
        for name in names:
            engine = make(name, precision=precision)
            run = train(engine, 2, accum=accum)
            out[precision, accum, name] = {"memory": run["memory"], "bytes": traffic(engine.comm),
                                           "padded": _padded(engine), "counters": step_counters(engine)}
    return out


# ------------------------------------------------------------------ section 4: save, resume, export


def probe():
    """A fixed batch to compare logits on (not one the runs train on)."""
    return CharDataset(BLOCK, seed=1).batch(0, 2)[0]


def first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0]


def save_and_continue(root: str, before: int = 2, after: int = 2):
    """ZeRO-3 on this rank: train `before` steps, save a sharded checkpoint, train `after` more
    (the uninterrupted run); then export the full weights for Hugging Face (rank 0 writes)."""
    import os
    from zerolab import checkpoint
    engine = make("zero3")
    first = train(engine, before)
    checkpoint.save(engine, os.path.join(root, "ckpt"), extra={"next_step": before})
    files = sorted(f for f in os.listdir(os.path.join(root, "ckpt")) if f.endswith(".pt"))
    rest = train(engine, after, first=before)
    model = engine.module
    out = {"losses": first["losses"] + rest["losses"], "shard_files": len(files)}

    # outside gathered_parameters a rank holds only its shard: reading a weight is refused
    try:
        model.lm_head.weight.sum()
        out["outside"] = "no error"
    except RuntimeError as e:
        out["outside"] = first_line(e)
    full = engine.full_state_dict()            # every rank calls it: the shards are gathered
    with engine.gathered_parameters():         # inside, every weight of the model is whole
        w = model.transformer.h[1].mlp.c_fc.weight
        out["inside"] = (tuple(w.shape), torch.equal(w.detach(), full["transformer.h.1.mlp.c_fc.weight"]),
                         model.lm_head.weight is model.transformer.wte.weight)
    engine.eval()
    with torch.no_grad():
        out["logits"] = engine(input_ids=probe()).logits
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(root, "gpt2.pt"))
        model.save_pretrained(os.path.join(root, "hf"), state_dict=dict(full))   # (it empties the dict)
    dist.barrier()
    out["keys"] = len(full)
    return out


def resume(root: str, names=("zero3", "zero1"), steps: int = 2):
    """Load the checkpoint into each engine on this rank and train `steps` more steps."""
    import os
    from zerolab import checkpoint
    out = {}
    for name in names:
        engine = make(name, gpt2(seed=1))     # other initial weights: the load must replace them
        extra = checkpoint.load(engine, os.path.join(root, "ckpt"))
        out[name] = train(engine, steps, first=extra["next_step"])["losses"]
    return out


def activation_bytes(rows=(2, 8), name: str = "zero3"):
    """Model states and the activations the last forward left alive (measured by an allocation
    tracker around the forward: track_activations=True), at `rows` sequences per rank."""
    rank, world = where()
    out = {}
    for r in rows:
        engine = make(name, track_activations=True)
        out[r] = train(engine, 2, global_rows=r * world, accum=1, clip=False)["memory"]
    return out


# ------------------------------------------------------------------ the chapter's figure


def traffic_figure(units: dict, expected: dict):
    """Bars of bytes per step (in units of one reduce-scatter of the model) per engine, one bar per
    number of micro-batches per step A; a tick marks what the engines' design predicts.
    units, expected: {A: {engine name: value}}."""
    import matplotlib.pyplot as plt
    names = [n for n in ("naive", "ddp", "zero1", "zero2", "zero3") if any(n in u for u in units.values())]
    fig, ax = plt.subplots(figsize=(7, 2.8))
    width = 0.8 / len(units)
    for i, (a, row) in enumerate(sorted(units.items())):
        xs = [k + (i - (len(units) - 1) / 2) * width for k, n in enumerate(names) if n in row]
        ax.bar(xs, [row[n] for n in names if n in row], width * 0.9, label=f"A = {a} (measured)")
        ax.plot(xs, [expected[a][n] for n in names if n in row], "k_", markersize=14)
    ax.set_xticks(range(len(names)), [LABELS[n] for n in names])
    ax.set_ylabel("bytes per step\n(reduce-scatters of the model)")
    ax.set_title("micro-batches per step A: what each engine sends (black: predicted)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
