"""The roofline's counts against closed forms: a linear layer's FLOPs and bytes by hand, fused attention's
FLOPs and the scores it never stores, a GPT step's FLOPs against 6 Psi + attention, the least an AdamW step
must move, and each operation's time at its own roof."""

from functools import partial

import pytest
import torch

from zerolab.book.mfu import flops_per_token
from zerolab.models import GPT, GPTConfig, gpt_loss
from zerolab.theory import roofline as rl

BF16 = 2


def _sum_loss(model, x):
    return model(x).float().sum()


def test_a_linear_layer_step_by_hand():
    # y = x W^T + b on (n, i) -> (n, o) in bf16, x an activation that needs its gradient: forward addmm
    # 2 n i o FLOPs; backward two mm (dx and dW), 2 n i o each
    n, i, o = 64, 32, 16
    with torch.device("meta"):
        layer = torch.nn.Linear(i, o).to(torch.bfloat16)
        x = torch.empty(n, i, dtype=torch.bfloat16, requires_grad=True)
    c = rl.count_step(layer, _sum_loss, x)
    assert c.total("matmul") == 6 * n * i * o
    fwd = next(op for op in c.ops if op[1] == "addmm")
    assert fwd[3] == BF16 * (o + n * i + i * o + n * o)            # reads bias, x, W; writes y
    assert c.total("attention") == 0 and c.total("optimizer", "bytes") == 0
    assert not {"t", "view", "expand", "transpose", "detach"} & {op[1] for op in c.ops}      # views move nothing


def test_fused_attention_counts_its_flops_and_never_the_scores():
    b, h, t, d = 2, 4, 1024, 32

    def attn(_, q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).float().sum()
    with torch.device("meta"):
        q = torch.empty(b, h, t, d, dtype=torch.bfloat16, requires_grad=True)
    c = rl.count_step(torch.nn.Identity(), attn, q)
    assert c.total("attention") == 12 * b * h * t * t * d          # 4 b h t^2 d forward, twice that backward
    assert c.total("attention", "bytes") < b * h * t * t * BF16     # the t x t scores never cross the memory
    assert c.total("matmul") == 0


def test_a_gpt_step_does_six_psi_plus_attention_flops():
    # the counted matrix products and attention are 6 Psi + 12 L T d per token (PaLM's count), less 6 FLOPs per
    # parameter that is in no matrix product: the embeddings (lookups), biases and LayerNorm parameters
    cfg = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64)
    rows = 3
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
        x = torch.randint(0, 96, (rows, 32))
    c = rl.count_step(model, lambda m, b: gpt_loss(m, b)[1], (x, x), partial(torch.optim.AdamW, foreach=True))
    psi = sum(p.numel() for p in model.parameters())
    outside = sum(p.numel() for p in model.parameters() if p.dim() == 1)   # (the lookups: flops_per_token leaves them out)
    tokens = rows * 32
    assert c.total("matmul") + c.total("attention") == (flops_per_token(cfg, psi) - 6 * outside) * tokens
    # an AdamW step reads the fp32 master, gradient and two moments and writes three of them back: 28 bytes
    # per parameter at the least (more: PyTorch's foreach AdamW makes one pass per operation)
    assert c.total("optimizer", "bytes") >= 28 * psi
    assert c.total("memory", "bytes") > 0


def test_each_operation_is_timed_at_its_own_roof():
    roof = rl.Roof("toy", peak_flops=1e12, hbm_Bps=1e10, matmul_efficiency=0.5)
    assert roof.critical_intensity == 100
    c = rl.Counts()
    c.add("matmul", "compute-bound", 1e12, 1e9)        # 2 s of math at 0.5e12, 0.1 s of memory
    c.add("matmul", "memory-bound", 1e9, 1e9)          # 2 ms of math, 0.1 s of memory
    c.add("optimizer", "update", 0, 1e10)              # 1 s of memory
    t = rl.step_time(c, roof, optimizer_share=0.25)
    assert t["matmul"] == pytest.approx(2 + 0.1) and t["optimizer"] == pytest.approx(0.25)
    assert t["total"] == pytest.approx(2.35) and t["memory_bound"] == pytest.approx(0.1 + 0.25)
    assert rl.mfu_bound(1e12, c, roof, 0.25) == pytest.approx(1 / 2.35)
    assert rl.mfu_bound(1e12, c, roof, 0.25, exposed_comm_s=0.65) == pytest.approx(1 / 3.0)


def test_the_h100_critical_intensity():
    assert rl.H100_SXM.critical_intensity == pytest.approx(989e12 / 3.35e12)     # about 295 FLOPs per byte
