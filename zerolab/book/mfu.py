"""Model FLOPs utilisation as the book counts it: one convention for every GPU table and the roofline.

    from zerolab.book import mfu
    mfu.flops_per_token(cfg, psi)      # 6 x (parameters outside the embedding lookups) + attention
    mfu.mfu(tokens_per_s, cfg, psi)    # that, times tokens per second, over the H100's 989 TFLOP/s

A training step multiplies every weight matrix by each token's activations three times (forward, and
two products in the backward): 6 FLOPs per parameter per token. The token and position embeddings
are looked up, not multiplied, so they do no FLOPs (Kaplan et al., "Scaling Laws for Neural Language
Models", count N without them; PaLM's appendix B adds attention, 12 L T d per token). An output layer
tied to the token embedding multiplies, so a tied table counts once. Biases and LayerNorm parameters
stay in the count, as in both papers: they are about 0.1% of a GPT's parameters.
"""

from __future__ import annotations

from ..theory.cost_model import H100_PEAK_FLOPS


def _get(cfg, key, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def embedding_params(cfg) -> int:
    """Parameters only looked up: the position table, and the token table unless the output layer is it."""
    d = _get(cfg, "n_embd")
    tokens = 0 if _get(cfg, "tie_weights", False) else _get(cfg, "vocab_size") * d
    return tokens + _get(cfg, "block_size") * d


def flops_per_token(cfg, psi: int) -> int:
    """Training FLOPs per token: 6 x (psi less the embedding lookups) + 12 x layers x sequence x width."""
    return 6 * (psi - embedding_params(cfg)) + 12 * _get(cfg, "n_layer") * _get(cfg, "block_size") * _get(cfg, "n_embd")


def mfu(tokens_per_s: float, cfg, psi: int, peak_flops: float = H100_PEAK_FLOPS) -> float:
    """The model's FLOPs per second over the datasheet's dense bf16 peak (989 TFLOP/s for the H100 SXM
    and the H200 alike)."""
    return tokens_per_s * flops_per_token(cfg, psi) / peak_flops
