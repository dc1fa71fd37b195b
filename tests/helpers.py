"""What several test files share: the parity tests' optimizer and models, and the workers and
models that more than one file launches. Test modules import from here, never from each other.

The launched ranks import these by name too: conftest.py puts tests/ on sys.path.
"""

import dataclasses
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

import zerolab as zl
from zerolab.data import CharDataset, SyntheticRegression
from zerolab.zero_r.mesh import Mesh
from zerolab.models import GPT, AwkwardModel, gpt_config, gpt_loss, regression_loss
from zerolab.zero_r.tensor_parallel import TensorParallelGPT

# the parity tests' AdamW: lr and eps as tests/tolerances.py derives its bounds for
PARITY_ADAMW = partial(torch.optim.AdamW, lr=1e-3, eps=1e-6, weight_decay=0.1)


def build(kind, seed):
    """(model, data, loss_fn, rows per rank) of the parity tests, from `seed`."""
    torch.manual_seed(seed)
    if kind in ("gpt", "gpt_tied"):
        # bias=False: the gradient of the attention KEY bias is exactly zero in real arithmetic
        # (softmax ignores a shift), so with biases Adam turns that bias's rounding noise into
        # full-size updates and no two summation orders (PyTorch DDP included) agree to 1e-6.
        cfg = gpt_config("nano", bias=False, **({"tie_weights": True} if kind == "gpt_tied" else {}))
        return GPT(cfg), CharDataset(32), gpt_loss, 2
    if kind == "awkward":
        return AwkwardModel(), SyntheticRegression(d_in=13, d_out=5), regression_loss, 3
    raise ValueError(f"unknown model kind {kind!r}")


def backward_in_micro_batches(engine, loss_of, micro, no_sync=True):
    """engine.backward on `micro` micro-batches, all but the last inside no_sync() (unless
    no_sync=False); loss_of(m) is micro-batch m's loss, already divided by `micro`."""
    for m in range(micro):
        if no_sync and m < micro - 1:
            with engine.no_sync():
                engine.backward(loss_of(m))
        else:
            engine.backward(loss_of(m))


# ------------------------------------------------------------------ a PyTorch user's habits
# (test_habits.py, test_habits_table.py)


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class KwNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self.head = nn.Linear(3, 3)      # in ZeRO-3's root unit: needed again in backward

    def forward(self, features, target=None, scale=1.0):
        logits = self.head(self.body(features["x"]) * scale)
        loss = None if target is None else (logits - target).pow(2).mean()
        return Output(logits, loss)


def batch(step, rows):
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


def hf_gpt2():
    import warnings
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging
    logging.set_verbosity_error()
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPT2LMHeadModel(cfg)


def tokens(step, rows):
    return torch.randint(0, 64, (rows, 16), generator=torch.Generator().manual_seed(step))


def one_step_fewer():
    t = torch.ones(1)
    for _ in range(3 - dist.get_rank()):    # rank 1 stops one collective early
        dist.all_reduce(t)
    return dist.get_rank()



# ------------------------------------------------------------------ buffers (test_buffers.py, test_habits_table.py)


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        # two blocks (ZeRO-3's units), the first with a BatchNorm
        self.blocks = nn.Sequential(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh()),
                                    nn.Sequential(nn.Linear(8, 3)))

    def forward(self, x):
        return self.blocks(x)


def my_rows(step):
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4 * n, 6, generator=g), torch.randn(4 * n, 3, generator=g)
    x = x + torch.arange(4 * n).unsqueeze(1) / 4.0     # each rank's rows have their own mean
    return x[4 * r:4 * r + 4], y[4 * r:4 * r + 4]



# ------------------------------------------------------------------ parameter groups
# (test_param_groups.py, test_habits_table.py)


def model_under_test():
    torch.manual_seed(0)
    # two blocks (ZeRO-3 units) with weights, biases and a LayerNorm; a head in the root unit
    return nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16)),
                         nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4))


def nanogpt_groups(params):
    """nanoGPT's configure_optimizers rule: weight decay on tensors of 2 or more dimensions."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=1e-3)


def lr_groups(params):
    """Per-group learning rates, groups that cut across buckets and units."""
    params = list(params)
    return torch.optim.AdamW([{"params": params[::2], "lr": 1e-2, "weight_decay": 0.1},
                              {"params": params[1::2], "lr": 1e-3, "weight_decay": 0.0}], lr=5e-3)


FACTORIES = {"nanogpt": nanogpt_groups, "lr": lr_groups}


def group_batch(step, rows):
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


def train_groups(engine, steps, first=0):
    n = dist.get_world_size() if dist.is_initialized() else 1
    r = dist.get_rank() if dist.is_initialized() else 0
    for step in range(first, first + steps):
        x, y = group_batch(step, 4)
        rows = slice(r * 4 // n, (r + 1) * 4 // n)
        loss = (engine(x[rows]) - y[rows]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    return engine


def make_grouped(name, factory):
    # tiny buckets, so that groups are cut across several buckets and shards
    options = {} if name in ("single", "naive", "zero3") else {"bucket_mb": 0.0005}
    return zl.engines.make(name, model_under_test(), FACTORIES[factory], **options)



# ------------------------------------------------------------------ tensor parallel (test_activation_checkpointing.py, test_zero_r.py)

B = 4        # sequences per data-parallel rank


def tp_train(mode, steps=3, mp=2):
    mesh = Mesh(mp=mp)
    cfg = gpt_config("nano", n_head=4)
    torch.manual_seed(0)
    model = TensorParallelGPT.from_dense(GPT(cfg), mesh)
    if mode != "none":
        zl.activation_checkpointing.enable(model, mesh, partition_activations=mode in ("pa", "pa_cpu"),
                             offload_activations=mode == "pa_cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = CharDataset(cfg.block_size)
    losses = []
    for step in range(steps):
        _, loss = gpt_loss(model, data.batch(step, B, mesh.dp_rank, mesh.dp))
        loss.backward()
        for p in model.parameters():   # average over the dp group
            mesh.ledger.all_reduce(p.grad, group=mesh.dp_group, tag="dp")
            p.grad /= mesh.dp
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    by_tag = {}
    for r in mesh.ledger.records:
        by_tag[r.tag] = by_tag.get(r.tag, 0) + r.bytes_sent
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "bytes": by_tag}


