"""Several torch optimizers stepped as one: zl.CombinedOptimizer (Muon on the matrices, AdamW on the rest).

Muon is written for the matrices of a network's hidden layers; its users step the embeddings,
the output head, the biases and the norms' gains with AdamW (Keller Jordan's modded-nanogpt,
nanochat, Moonlight). PyTorch's documentation builds two optimizers and steps both. A zerolab
engine takes one optimizer, whose step is the engine's step (the gradients are handed out
before it, the new weights published after it: optim.param_groups), so the two are combined
into one:

    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    rest = [p for p in model.parameters() if all(p is not q for q in matrices)]
    opt = zl.CombinedOptimizer(torch.optim.Muon(matrices, lr=0.02),
                               torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.0))
    engine = zl.ZeRO(model, opt, stage=2)            # or zl.ZeRO(model) and build opt afterwards
    loss.backward(); opt.step(); opt.zero_grad()     # PyTorch's loop, one optimizer

It IS a torch.optim.Optimizer: its param_groups are the members' own groups (the same dicts,
so a learning-rate scheduler on the combined optimizer drives every member, and an engine that
moves the groups onto its own tensors moves the members' too), its state is one dict that
every member steps in, and its state_dict() is a plain optimizer's over all those groups, in
the members' order. step() steps each member in turn. An engine reads which parameters need
whole matrices from the member whose group holds them (optim.whole_matrix.whole_ids).
"""

from __future__ import annotations

from collections import defaultdict

import torch


class CombinedOptimizer(torch.optim.Optimizer):
    """The optimizers given, stepped as one (see the module docstring)."""

    def __init__(self, *optimizers):
        if len(optimizers) == 1 and isinstance(optimizers[0], (list, tuple)):
            optimizers = tuple(optimizers[0])
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError("CombinedOptimizer takes torch optimizers, e.g. CombinedOptimizer("
                            "torch.optim.Muon(matrices), torch.optim.AdamW(rest))")
        if any(isinstance(o, CombinedOptimizer) for o in optimizers):
            raise TypeError("CombinedOptimizer: pass the optimizers themselves, not a CombinedOptimizer")
        state = defaultdict(dict)
        for o in optimizers:
            state.update(o.state)        # (an optimizer may make state when built: Adagrad)
        # (add_param_group keeps each group dict itself: the members step these very groups;
        # a parameter in two members is refused there, as in two groups of one optimizer)
        super().__init__([g for o in optimizers for g in o.param_groups], {})
        self.optimizers = list(optimizers)
        self._share(state)

    def _share(self, state) -> None:
        """Every member steps in `state` and in its own slice of self.param_groups."""
        self.state = state
        at = 0
        for o in self.optimizers:
            k = len(o.param_groups)
            o.param_groups = self.param_groups[at:at + k]
            o.state = state
            at += k

    def __getstate__(self) -> dict:
        # the members too, so that a copy steps (copy.copy: optim.param_groups.without_hooks)
        return {**super().__getstate__(), "optimizers": self.optimizers}

    def __setstate__(self, state) -> None:
        # load_state_dict() makes new group dicts and a new state: the members take them too
        super().__setstate__(state)
        if "optimizers" in self.__dict__:
            self._share(self.state)

    @torch.no_grad()
    def step(self, closure=None):
        """Each member's step, in order (a closure is evaluated once, before them)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss

    def add_param_group(self, param_group: dict) -> None:
        if "optimizers" in self.__dict__:
            raise RuntimeError("CombinedOptimizer.add_param_group: add the group to the member "
                               "optimizer that should step it, before combining them")
        super().add_param_group(param_group)

    def __repr__(self) -> str:
        return f"CombinedOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"
