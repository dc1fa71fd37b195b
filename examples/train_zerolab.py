"""After: the same script on zerolab, on as many ranks as you start.

    python examples/train_zerolab.py [RANKS]                           # 2 ranks on this machine (zl.launch)
    torchrun --nproc-per-node 2 examples/train_zerolab.py              # the same, started by torchrun
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 examples/train_zerolab.py   # 2 GPU nodes

Every rank builds the model and the optimizer exactly as train_plain.py does and hands both to the
engine; from then on it is PyTorch's loop (loss.backward(), optimizer.step(), optimizer.zero_grad(),
the scheduler). Each rank computes on its own rows of the step's global batch, and the engine averages
the gradients, so the run trains the same model as train_plain.py on the whole batch. On a GPU box
every rank gets its own GPU and NCCL (one GPU per rank), and trains in bf16.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zerolab as zl

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, "
        "it was the age of foolishness, it was the epoch of belief, it was the epoch of incredulity. ") * 8
VOCAB = sorted(set(TEXT))
STEPS, ROWS, BLOCK, LR = 30, 8, 32, 3e-3


class TinyLM(nn.Module):
    """Token and position embeddings, two causal transformer layers, a linear head."""

    def __init__(self, vocab=len(VOCAB), width=64, heads=4, layers=2, block=BLOCK):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(block, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def batch(step, rows=ROWS):
    """The step's rows of BLOCK + 1 characters: inputs and the characters that follow them."""
    data = torch.tensor([VOCAB.index(c) for c in TEXT])
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - BLOCK - 1, (rows,), generator=g)
    chunk = torch.stack([data[s:s + BLOCK + 1] for s in starts.tolist()])
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def sample(model, prompt="It was the ", n=40):
    idx = torch.tensor([[VOCAB.index(c) for c in prompt]])
    for _ in range(n):
        logits = model(idx[:, -BLOCK:])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)     # greedy: the same every run
    return "".join(VOCAB[i] for i in idx[0].tolist())


def train(stage=3):
    """One rank's run: the plain script's loop, on this rank's rows, with the model in a zerolab engine."""
    rank, world, device = zl.rank(), zl.world_size(), zl.device()     # device: this rank's GPU, or the CPU
    torch.manual_seed(0)                              # every rank builds the same model (the engine checks it)
    model = TinyLM().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    engine = zl.ZeRO(model, optimizer, stage=stage, precision="bf16" if device.type == "cuda" else "fp32")
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS)
    rows = ROWS // world
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[rank * rows:(rank + 1) * rows].to(device), y[rank * rows:(rank + 1) * rows].to(device)
        loss = F.cross_entropy(engine(x).flatten(0, 1).float(), y.flatten())
        loss.backward()                               # the engine averages the gradients over the ranks
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    logged = loss.detach().clone()                    # the global batch's loss: the mean of the ranks' losses
    dist.all_reduce(logged)
    with engine.gathered_parameters():                # ZeRO-3: whole weights inside, on EVERY rank (a collective)
        text = sample(model.eval())
    return logged.item() / world, text


def init_under_torchrun():
    """torchrun started this process as one rank: say which device is its own, and join the others."""
    gpus = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])    # one GPU per rank, or none
    if gpus:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if gpus else "gloo")


if __name__ == "__main__":
    if "RANK" in os.environ:                          # under torchrun: this process is one of the ranks
        init_under_torchrun()
        loss, text = train()
        if dist.get_rank() == 0:
            print(f"final loss {loss:.6f}")
            print("sample:", repr(text))
        dist.destroy_process_group()
    else:                                             # plain python: start the ranks here
        loss, text = zl.launch(train, world_size=int(sys.argv[1]) if len(sys.argv) > 1 else 2)[0]
        print(f"final loss {loss:.6f}")
        print("sample:", repr(text))
