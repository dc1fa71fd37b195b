"""The museum's models, data and references: one process on the global batch, and closed forms.

Everything the ranks of zerolab.book.museum compute is judged here, in one process and without
zerolab's engines: the same model from the same seed, every rank's data at once, PyTorch's own
optimizer step. Two "what went wrong" computations live here too, in plain PyTorch, because
they are what a flat-partitioned optimizer or a naive checkpoint converter does:
`lamb_on_flat_partitions` and `concatenate_slices`.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

WORLD = 2


def mlp() -> nn.Module:
    """195 parameters: the first weight (128 elements) is cut by the edge of a 2-rank shard."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 63))


def _generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))   # the same in every process


def inputs(step: int, micro: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s micro-batch `micro` of step `step`: 4 rows of 8 features."""
    return torch.randn(4, 8, generator=_generator("x", step, micro, rank))


def wide_inputs(rank: int) -> torch.Tensor:
    return torch.randn(4, 64, generator=_generator("wide", rank))


def global_batch(step: int, micro: int = 0) -> torch.Tensor:
    return torch.cat([inputs(step, micro, r) for r in range(WORLD)])


# ------------------------------------------------------------------ LAMB (You et al., 2020)


class Lamb(torch.optim.Optimizer):
    """LAMB: Adam's direction, scaled per TENSOR by the trust ratio ||p|| / ||update||.
    (Yang You et al., *Large Batch Optimization for Deep Learning: Training BERT in 76 minutes*,
    2020.) The ratio reads the whole tensor: the update of one element depends on all of them."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.trust = []                 # the last step's trust ratio of each tensor, in order

    @torch.no_grad()
    def step(self, closure=None):
        self.trust = []
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None or p.numel() == 0:
                    continue
                state = self.state[p]
                if not state:
                    state["step"], state["m"], state["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = state["m"] / (1 - b1 ** state["step"])
                v_hat = state["v"] / (1 - b2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w, u = p.norm(), update.norm()
                trust = (w / u) if w > 0 and u > 0 else torch.tensor(1.0)
                self.trust.append(float(trust))
                p.add_(update, alpha=-group["lr"] * float(trust))


def one_process(model: nn.Module, optimizer, batches, steps: int, loss=None, clip=None) -> dict:
    """Train `model` in one process: batches(step) is the global batch; returns the weights."""
    for step in range(steps):
        out = model(batches(step))
        (out.pow(2).mean() if loss is None else loss(out, step)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def tree_sum(tensors: list) -> torch.Tensor:
    """The tensors added in one fixed binary tree, neighbours first: ((t0 + t1) + (t2 + t3)). Their
    number is a power of two."""
    while len(tensors) > 1:
        tensors = [tensors[i] + tensors[i + 1] for i in range(0, len(tensors), 2)]
    return tensors[0]


def chunked_step(model: nn.Module, chunk_losses: list, divide_by: int = 1) -> None:
    """One SGD step (lr 0.1) in one process as the bitwise mode computes it: each chunk's loss
    backward on its own, the gradients added in the fixed tree over chunks (tree_sum), divided by
    `divide_by`, then PyTorch's own single-tensor SGD. chunk_losses: loss(model) per chunk, in order."""
    params = list(model.parameters())
    grads = [torch.autograd.grad(loss(model), params) for loss in chunk_losses]
    for i, p in enumerate(params):
        p.grad = tree_sum([g[i] for g in grads]) / divide_by
    torch.optim.SGD(params, lr=0.1, foreach=False).step()


def mlp_chunked(steps: int) -> dict:
    """mlp_one_process with the global batch cut into its WORLD chunks (rank r's rows are chunk r),
    added in the fixed tree: what zl.ZeRO(stage=2, bitwise=True) must equal bit for bit."""
    model = mlp()
    for step in range(steps):
        chunk_losses = [lambda m, r=r: m(inputs(step, 0, r)).pow(2).mean() for r in range(WORLD)]
        chunked_step(model, chunk_losses, divide_by=WORLD)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def lamb_one_process(steps: int = 2) -> dict:
    model = mlp()
    return one_process(model, Lamb(model.parameters(), lr=0.05), global_batch, steps)


def lamb_on_flat_partitions(steps: int = 2, world: int = WORLD) -> dict:
    """LAMB as an optimizer over flat partitions runs it: the model's parameters laid end to end,
    padded to a multiple of `world`, cut into `world` equal slices, each slice ONE tensor to the
    optimizer (DeepSpeed's stage 1 and 2 layout). The gradient is the global batch's."""
    model = mlp()
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    padded = -(-total // world) * world
    flat = torch.zeros(padded)
    flat[:total] = torch.cat([p.detach().reshape(-1) for p in params])
    slices = [nn.Parameter(s.clone()) for s in flat.chunk(world)]
    opt = Lamb(slices, lr=0.05)
    for step in range(steps):
        model.zero_grad()
        model(global_batch(step)).pow(2).mean().backward()
        g = torch.zeros(padded)
        g[:total] = torch.cat([p.grad.reshape(-1) for p in params])
        for s, gs in zip(slices, g.chunk(world)):
            s.grad = gs.clone()
        opt.step()
        new = torch.cat([s.detach() for s in slices])[:total]
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(new, params)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trust_ratios(world: int = WORLD) -> dict:
    """The trust ratio LAMB's first step gives every element of the model's parameters laid end to
    end: per TENSOR in one process, per SLICE over `world` flat partitions (the gradient is the
    global batch's in both). Returns the per-element ratios of each, the tensors' names, offsets and
    sizes in the flat order, and where the slices' edges fall."""
    model = mlp()
    model(global_batch(0)).pow(2).mean().backward()
    named = list(model.named_parameters())
    sizes = [p.numel() for _, p in named]
    total = sum(sizes)
    padded = -(-total // world) * world
    flat_w, flat_g = torch.zeros(padded), torch.zeros(padded)
    flat_w[:total] = torch.cat([p.detach().reshape(-1) for _, p in named])
    flat_g[:total] = torch.cat([p.grad.reshape(-1) for _, p in named])
    slices = [nn.Parameter(s.clone()) for s in flat_w.chunk(world)]
    for s, g in zip(slices, flat_g.chunk(world)):
        s.grad = g.clone()
    on_slices = Lamb(slices, lr=0.05)
    on_slices.step()
    whole = Lamb([p for _, p in named], lr=0.05)
    whole.step()
    shard = padded // world
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return {"names": [n for n, _ in named], "offsets": offsets, "sizes": sizes, "total": total,
            "edges": [shard * r for r in range(1, world)],
            "one process": [r for r, k in zip(whole.trust, sizes) for _ in range(k)],
            "flat partitions": [on_slices.trust[i // shard] for i in range(total)]}


def token_weights(world: int = WORLD, micro: int = 2) -> dict:
    """The weight each token that counts gets in the step's gradient, micro-batch by micro-batch:
    under the habit (each micro-batch's own mean, divided by the micro-batches, averaged over the
    ranks) 1 / (micro x world x its tokens); under the token mean 1 / (all tokens of the step)."""
    counts = [int((token_batch(r, m)[1] != -100).sum()) for r in range(world) for m in range(micro)]
    total = sum(counts)
    return {"labels": [f"rank {r}, micro-batch {m}" for r in range(world) for m in range(micro)], "tokens": counts,
            "habit": [1 / (micro * world * n) for n in counts], "token mean": [1 / total] * len(counts)}


def clip_one_process(max_norm: float) -> tuple:
    """(the global batch's gradient norm, the weights after one clipped SGD step)."""
    model = mlp()
    model(global_batch(0)).pow(2).mean().backward()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return norm, {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ tokens


VOCAB, LENGTH = 11, 6
PADDED = (0, 9, 3, 11)       # padding positions (label -100) of micro-batch 2 r + m, out of 12


def tiny_lm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))


def token_batch(rank: int, micro: int) -> tuple:
    """(ids, labels) of 2 sequences of 6 tokens; some labels are padding (-100)."""
    g = _generator("tok", rank, micro)
    ids = torch.randint(0, VOCAB, (2, LENGTH), generator=g)
    labels = torch.randint(0, VOCAB, (2, LENGTH), generator=g).reshape(-1)
    labels[labels.numel() - PADDED[2 * rank + micro]:] = -100
    return ids, labels.reshape(2, LENGTH)


def tokens_one_process() -> tuple:
    """(tokens that count, weights after one SGD step on the mean over every token of the global batch)."""
    model = tiny_lm()
    batches = [token_batch(r, m) for r in range(WORLD) for m in range(2)]
    ids = torch.cat([i for i, _ in batches])
    labels = torch.cat([lab for _, lab in batches])
    logits = model(ids)
    F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).backward()   # mean over tokens that count
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return int((labels != -100).sum()), {k: v.detach().clone() for k, v in model.state_dict().items()}


def tokens_chunked() -> dict:
    """tokens_one_process with each micro-batch a chunk (chunk 2 r + m: rank r's micro-batch m),
    each weighted by its tokens that count over the step's, added in the fixed tree."""
    model = tiny_lm()
    batches = [token_batch(r, m) for r in range(WORLD) for m in range(2)]
    total = sum(int((labels != -100).sum()) for _, labels in batches)

    def loss(ids, labels):
        # (times 1 / total, as the token-weighted loss scales: dividing by total rounds otherwise)
        return lambda m: F.cross_entropy(m(ids).reshape(-1, VOCAB), labels.reshape(-1), reduction="sum") * (1 / total)
    chunked_step(model, [loss(ids, labels) for ids, labels in batches])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ a layer used twice, checkpointed


class Shared(nn.Module):
    """One layer applied twice, each time inside a reentrant activation checkpoint (a weight
    shared by two blocks, as in a Siamese model or a looped transformer layer)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.shared, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def _block(self, x):
        return torch.tanh(self.shared(x))

    def forward(self, x):
        x = self.inp(x)
        for _ in range(2):
            x = checkpoint(self._block, x, use_reentrant=True)
        return self.out(x)


def shared_one_process() -> dict:
    model = Shared()
    return one_process(model, torch.optim.SGD(model.parameters(), lr=0.1), global_batch, 1)


def mlp_one_process(steps: int) -> dict:
    model = mlp()
    return one_process(model, torch.optim.SGD(model.parameters(), lr=0.1), global_batch, steps)


# ------------------------------------------------------------------ a naive checkpoint converter


def concatenate_slices(slices_per_rank: list, layout: list) -> dict:
    """What a converter that ignores padding does: per bucket, join the ranks' slices; then join
    the buckets and cut the result parameter after parameter by their sizes, in bucket order."""
    flat = torch.cat([torch.cat([rank[b] for rank in slices_per_rank]) for b in range(len(layout))])
    out, at = {}, 0
    for bucket in layout:
        for name, shape in bucket:
            n = int(torch.Size(shape).numel())
            out[name] = flat[at:at + n].reshape(shape).clone()
            at += n
    return out


def owned(sizes: list, padded: int, rank: int, world: int = WORLD) -> tuple:
    """(real elements, parameters with a piece) in rank `rank`'s slice of a flat bucket of
    parameters of `sizes` laid end to end, padded to `padded`: what its optimizer steps."""
    lo, hi = rank * padded // world, (rank + 1) * padded // world
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    real = max(0, min(hi, sum(sizes)) - lo)
    pieces = sum(1 for o, n in zip(starts, sizes) if o < hi and o + n > lo)
    return real, pieces


def worst(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts of the same keys."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
