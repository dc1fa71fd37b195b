"""Before: a plain PyTorch training script, one process.

    python examples/train_plain.py

A small character-level language model learns a few lines of text, then writes some. Nothing here
knows about zerolab; examples/train_zerolab.py is the same script on zerolab's engines (chapter 11 of
the book puts the two side by side).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

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


def main():
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS)
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    print(f"final loss {loss.item():.6f}")
    print("sample:", repr(sample(model.eval())))


if __name__ == "__main__":
    main()
