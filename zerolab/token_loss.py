"""Token-weighted loss: every token of the global batch counts once, however it was split.

A language model's loss is the mean over the tokens that count (labels != ignore_index). With
gradient accumulation and data parallelism the global batch is cut into micro-batches on
ranks, and the habit of taking each micro-batch's own mean, dividing by the number of
micro-batches, and letting the gradient reduction average over ranks computes

    (1 / (M N)) * sum over micro-batches of (sum of its token losses / its tokens)

which is the global mean only when every micro-batch holds the same number of tokens. With
padding or packed sequences of different lengths they do not: a token of a short micro-batch
weighs more than one of a long one, and the run differs from the same global batch in one
process (torchtune pull request 1875, torchtitan pull request 2206). The fix divides every
micro-batch's SUM by the number of tokens in the whole global batch, counted once per step:

    tokens = zl.count_tokens([labels for each micro-batch of this step], engine.comm)
    for logits, labels in micro_batches:
        engine.backward(zl.token_weighted_loss(logits, labels, tokens))

count_tokens adds the counts over ranks (one all-reduce of one integer per step); the loss is
multiplied by the number of ranks because the gradient reduction of zl.DDP, zl.ZeRO and
PyTorch's DistributedDataParallel averages over ranks (it divides by N): the product is the
gradient of the global token mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100          # torch.nn.functional.cross_entropy's and Hugging Face's default


def count_tokens(labels, comm=None, ignore_index: int = IGNORE_INDEX, group=None) -> int:
    """The tokens that count in this step's loss, over every micro-batch and every rank.

    labels: this rank's labels for the step, a tensor or a list of micro-batches' tensors.
    comm: a zerolab Ledger (engine.comm) for the all-reduce; None makes one. Without a process
    group (one process) this rank's count is the count."""
    if isinstance(labels, torch.Tensor):
        labels = [labels]
    local = sum(int((t != ignore_index).sum()) for t in labels)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return local
    if comm is None:
        from .runtime.comm import Ledger
        comm = Ledger()
    total = torch.tensor([local], dtype=torch.int64)
    comm.all_reduce(total, op="sum", group=group, tag="tokens")
    return int(total.item())


def token_weighted_loss(logits: torch.Tensor, labels: torch.Tensor, tokens: int,
                        ignore_index: int = IGNORE_INDEX, ranks: int | None = None) -> torch.Tensor:
    """This micro-batch's share of the global batch's mean token loss (cross-entropy).

    logits: (..., vocabulary), labels: (...) aligned with them (shift them first for next-token
    prediction); tokens: count_tokens(...) of the step. ranks: what the gradient reduction
    divides by (the data-parallel world size, the default; 1 for a reduction that sums)."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"token_weighted_loss: tokens must be the step's count of tokens that count "
                         f"(zl.count_tokens over every micro-batch and rank), an int >= 1; got {tokens!r}")
    if ranks is None:
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                            ignore_index=ignore_index, reduction="sum")
    return total * (ranks / tokens)
