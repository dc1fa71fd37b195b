"""Runs that chapter 3 ("Where did all the memory go?") launches and measures.

Kept in the library, not in notebook cells, because launched ranks import them by name.
"""

from __future__ import annotations

import torch

from ..theory import calculator
from .. import data, memory, models
from ..runtime.comm import Ledger
from ..launch import rank, world_size


def one_step(size: str = "small", batch_size: int = 8, seed: int = 0) -> dict:
    """One fp32 AdamW step of the book's GPT in this process, measured piece by piece."""
    torch.manual_seed(seed)
    cfg = models.gpt_config(size)
    model = models.GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = data.CharDataset(cfg.block_size, seed=seed).batch(0, batch_size)
    result = memory.measure_training_step(model, optimizer, batch, models.gpt_loss)
    result["param_tensors"] = len(list(model.parameters()))
    return result


def activation_bytes(size: str, batch_sizes, seed: int = 0) -> list:
    """Bytes autograd saves for backward, for each batch size (one forward each)."""
    torch.manual_seed(seed)
    cfg = models.gpt_config(size)
    model = models.GPT(cfg)
    params = list(model.parameters())
    dataset = data.CharDataset(cfg.block_size, seed=seed)
    out = []
    for b in batch_sizes:
        _, nbytes = memory.saved_activation_bytes(models.gpt_loss, model, dataset.batch(0, b), exclude=params)
        out.append(nbytes)
    return out


def activation_bytes_by_length(size: str, lengths, batch_size: int = 8, kernel: str = "flash",
                               seed: int = 0) -> list:
    """Bytes autograd saves for backward at each sequence length, with one attention kernel.

    kernel="flash": PyTorch's fused scaled_dot_product_attention, which keeps one log-sum-exp per
    row and recomputes the scores in backward; kernel="math": attention written out (scores,
    softmax, product), which saves the batch x heads x seq x seq softmax output of every layer.
    The sequences are the first `length` characters of the same batch.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[kernel]
    torch.manual_seed(seed)
    cfg = models.gpt_config(size)
    model = models.GPT(cfg)
    params = list(model.parameters())
    x, y = data.CharDataset(cfg.block_size, seed=seed).batch(0, batch_size)
    out = []
    for n in lengths:
        with sdpa_kernel(backend):
            _, nbytes = memory.saved_activation_bytes(models.gpt_loss, model, (x[:, :n], y[:, :n]),
                                                      exclude=params)
        out.append(nbytes)
    return out


def replicated_step(size: str = "small", batch_size: int = 8, seed: int = 0) -> dict:
    """Plain data parallelism done by hand: every rank keeps every model state.

    Each rank trains on its share of the batch, all-reduces every gradient (through the
    ledger, so the bytes are counted), and steps its own full AdamW. Returns this rank's
    measured model states in bytes ("params", "grads", "optimizer", "total"), what it sent, and
    its parameters' values after the step ("param_values", one flat tensor).
    """
    torch.manual_seed(seed)  # same seed on every rank: identical starting models
    cfg = models.gpt_config(size)
    model = models.GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = data.CharDataset(cfg.block_size, seed=seed).batch(0, batch_size, rank(), world_size())
    ledger = Ledger()
    _, loss = models.gpt_loss(model, batch)
    loss.backward()
    for p in model.parameters():
        ledger.all_reduce(p.grad)
        p.grad /= world_size()
    optimizer.step()
    states = memory.model_state_bytes_measured(model, optimizer)
    values = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"rank": rank(), **states, "numel": models.num_params(model), "bytes_sent": ledger.bytes(),
            "param_values": values}


def table1(psis=(7.5e9, 128e9, 1e12), n_ds=(1, 4, 16, 64, 256, 1024)) -> list:
    """The paper's Table 1 (zerolab.theory.calculator.table1) as rows: (N_d, [GB per stage 1, 2, 3 for each model])."""
    t = calculator.table1(psis, n_ds)
    return [(n, [gb for psi in psis for gb in t[psi][n]]) for n in n_ds]
