"""Capture one training step (forward and backward) as an FX graph, with PyTorch's own tracer.

`make_fx` runs the step once on fake tensors and records every aten operation that autograd
performs, forward and backward alike, in order. The result is a flat program over the model's
parameters and one batch: it returns the loss and one gradient per parameter.

    step = capture(model, loss_fn, batch)
    step.graph             # the torch.fx.Graph: placeholders, aten operations, one output
    step.names             # the parameters' names, in the placeholders' order
    loss, *grads = step.module(*params, *batch)

Each node carries `meta["val"]`, a fake tensor with the shape, dtype and strides of its result:
the passes (zerolab.compiled.passes) read sizes from it without running anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx


@dataclass
class Step:
    """A captured training step: the graph module and what its placeholders mean."""

    module: fx.GraphModule
    names: list            # parameter names, one placeholder each, first
    shapes: list           # each parameter's full shape
    n_batch: int           # the batch's tensors, placeholders after the parameters

    @property
    def graph(self) -> fx.Graph:
        return self.module.graph

    def params(self) -> list:
        """The parameter placeholders, in order."""
        return [n for n in self.graph.nodes if n.op == "placeholder"][:len(self.names)]

    def loss_node(self) -> fx.Node:
        """The node that computes the loss: the forward ends there, the backward starts after it."""
        return self.graph.output_node().args[0][0]

    def recompile(self) -> "Step":
        self.graph.lint()
        self.module.recompile()
        return self


def capture(model: torch.nn.Module, loss_fn, batch: tuple) -> Step:
    """The forward and backward of `loss_fn(model, *batch)` as one FX graph of aten operations."""
    names = [name for name, _ in model.named_parameters()]
    k = len(names)

    def step(*flat):
        params, inputs = flat[:k], flat[k:]
        loss = loss_fn(lambda *a: torch.func.functional_call(model, dict(zip(names, params)), a), *inputs)
        return (loss, *torch.autograd.grad(loss, params))

    params = [p.detach().requires_grad_() for p in model.parameters()]
    module = make_fx(step, tracing_mode="fake")(*params, *batch)
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names + [f"batch_{i}" for i in range(len(batch))]):
        node._rename(name.replace(".", "_"))
    return Step(module, names, [tuple(p.shape) for p in params], len(batch)).recompile()


def gpt_loss(forward, tokens, targets):
    """Cross-entropy of a language model's next-token predictions (the book's GPT loss)."""
    logits = forward(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
