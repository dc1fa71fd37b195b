"""ZeRO++ and HSDP: the same ZeRO-3 units, their bytes sent over cheaper paths (chapter 12).

    zl.ZeRO(model, opt, stage=3, topology=2, quantize_weights=True)        # qwZ
    zl.ZeRO(model, opt, stage=3, topology=2, secondary_partition="node")   # hpZ
    zl.ZeRO(model, opt, stage=3, topology=2, quantize_gradients=True)      # qgZ
    zl.ZeRO(model, opt, stage=3, topology=2, shard_group="node")           # HSDP / MiCS

Plain ZeRO-3 sends 3 Psi per step over the whole world, and on a cluster most of it crosses the
slow links between nodes (zerolab.topology). Each option changes HOW one of a unit's three
collectives travels (units.Unit asks this Route), never what the unit ends up holding:

* qwZ (Wang et al., ZeRO++): the parameter all-gathers (forward, and backward unless hpZ) carry
  int8 codes with one fp32 scale per block (zerolab.quantize) instead of 16/32-bit values. Every
  rank dequantizes every rank's piece, its own included, so all ranks compute with the same
  weights; the fp32 master shards the optimizer updates stay exact.
* hpZ: when a unit's forward ends, each rank keeps a SECONDARY shard: its 1/g of the unit, g the
  ranks per node. Backward all-gathers the unit from the secondary shards of its own node, so no
  byte of backward's all-gather leaves the node. Cost: 1/g of every unit's parameters, held from
  its forward to its backward (Psi / g per rank at the peak instead of Psi / N).
* qgZ: the gradient reduce-scatter becomes two all-to-alls of int4 codes (with scales): inside the
  node first (each rank receives, from every node peer, the gradient of the shards its local
  index serves on every node, and sums them), then across nodes (each rank receives its own
  shard's partial sums from the same local rank of the other nodes). Only the node's partial sums,
  1/g of the gradient per rank, cross nodes. Why all-to-all and not reduce-scatter: a
  reduce-scatter adds on the wire, in the wire's format, and nobody can add int4 codes with
  different scales; an all-to-all only moves them, and the receiver dequantizes and adds in fp32.
  gloo runs all_to_all_single on CPU tensors, so this is the same collective NCCL would run.
  The reorder before the first exchange (shard n*g + j travels to local rank j) is the paper's
  "tensor slice reordering": without it a rank would receive other ranks' shards.
* HSDP (shard_group="node"; FSDP2 with a 2-D DeviceMesh, MiCS): a unit is sharded over the g
  ranks of a node only and REPLICATED on every node: both all-gathers stay in the node; the
  gradient is reduce-scattered in the node, then all-reduced across nodes on the 1/g shard.
  Memory: model states / g per rank instead of / N.

Bytes per step per node that cross nodes, Psi the parameters (padded), c bytes per element of
the compute dtype, N ranks on N_node nodes of G, q8 = 1 + 4/64 and q4 = 1/2 + 4/32 the bytes
per element of int8 / int4 codes with their scales (tests/test_zeropp.py derives each; the
letters are the book's notation.md):

    ZeRO-3            3 (N-1)/N Psi c
    qwZ               2 (N-1)/N Psi q8        +   (N-1)/N Psi c
    hpZ               2 (N-1)/N Psi c                                  (backward: 0)
    qgZ               2 (N-1)/N Psi c         +   (N_node-1)/N_node Psi q4
    qwZ + hpZ + qgZ     (N-1)/N Psi q8        +   (N_node-1)/N_node Psi q4
    HSDP              2 (N_node-1)/N_node Psi c                        (the all-reduce of the grads)
"""

from __future__ import annotations

import torch

from ... import quantize as qz
from ...topology import as_topology

WEIGHT_BITS, GRAD_BITS = 8, 4     # ZeRO++: int8 weights, int4 gradients
BLOCK = 64                        # elements per scale of the weights (a scale adds 4/64 byte each)
GRAD_BLOCK = 32                   # ... of the gradients: int4 has 15 levels, so smaller blocks
# Measured on the nano GPT, 300 steps, mean loss of the last 50 against one process: int4 gradients
# in blocks of 256 ended 2.7 % above; with 32, qgZ alone was within 0.5 %. With int8 weights in
# blocks of 256 as well, all three options together ended +0.8 % (AVX-512) and +1.2 % (ATen's default
# kernels); with 64, -0.6 % to +0.3 % on the default, AVX2 and AVX-512 kernels.


class _Done:
    """A handle whose work is finished (or that finishes it in wait())."""

    def __init__(self, handles=(), then=None):
        self.handles, self.then = list(handles), then

    def wait(self):
        for h in self.handles:
            h.wait()
        self.handles = []
        if self.then is not None:
            then, self.then = self.then, None
            then()


class Route:
    """How a unit's all-gathers and gradient reduction travel. Plain ZeRO-3: over the engine's
    group. The options above change single methods; Unit calls only these."""

    def __init__(self, comm, world_size, rank, zeropp):
        """zeropp: the engine's ZeroPP options (zerolab.engines.options), checked already."""
        self.comm = comm
        self.world_size = world_size               # the ranks a gradient is averaged over
        self.quantize_weights, self.quantize_gradients = zeropp.quantize_weights, zeropp.quantize_gradients
        self.secondary = zeropp.secondary_partition == "node"
        self.hsdp = zeropp.shard_group == "node"
        needs_topology = zeropp.topology is not None or self.secondary or self.quantize_gradients or self.hsdp
        self.topology = as_topology(zeropp.topology) if needs_topology else None
        if self.topology is not None:
            comm.topology = self.topology          # the ledger books bytes by link class
        t = self.topology
        # the group a unit is sharded over: the world, or (HSDP) the node
        self.shard_group = t.node_group if self.hsdp else None
        self.shard_size = t.ranks_per_node if self.hsdp else world_size
        self.shard_rank = t.local_rank if self.hsdp else rank
        self.replicas = t.nodes if self.hsdp else 1                 # copies of each shard
        self.replica_index = t.node if self.hsdp else 0

    @property
    def plain(self) -> bool:
        return not (self.quantize_weights or self.secondary or self.quantize_gradients or self.hsdp)

    # -------------------------------------------------------------- parameters
    def all_gather(self, unit, kind, full, phase):
        """Start filling `full` with every shard of the unit's `kind` buffer; returns a handle."""
        second = unit.secondary.get(kind)
        if phase == "backward" and second is not None:        # hpZ: the node's copy
            t = self.topology
            return self.comm.all_gather(full, second, group=t.node_group, async_op=True,
                                        tag=f"gather2:{unit.name}")
        if self.quantize_weights and phase in ("forward", "backward"):   # not to read weights
            return self._quantized_gather(unit, kind, full)
        return self.comm.all_gather(full, unit.shard[kind], group=self.shard_group, async_op=True,
                                    tag=f"gather:{unit.name}")

    def _quantized_gather(self, unit, kind, full):
        shard = unit.shard[kind]
        q = qz.quantize(shard, WEIGHT_BITS, BLOCK)
        n = self.shard_size
        codes = torch.empty(q.payload.numel() * n, dtype=q.payload.dtype, device=shard.device)
        scales = torch.empty(q.scales.numel() * n, dtype=torch.float32, device=shard.device)
        tag = f"qgather:{unit.name}"
        handles = [self.comm.all_gather(codes, q.payload, async_op=True, tag=tag),
                   self.comm.all_gather(scales, q.scales, async_op=True, tag=tag)]

        def dequantize_all():
            for piece, c, s in zip(full.chunk(n), codes.chunk(n), scales.chunk(n)):
                qz.dequantize(qz.from_parts(c, s, WEIGHT_BITS, BLOCK, shard.numel(), shard.dtype), out=piece)
        return _Done(handles, dequantize_all)

    def keep_secondary(self, unit, phase):
        """hpZ: before forward releases the unit, keep this rank's 1/g of it for backward."""
        if not self.secondary or phase != "forward":
            return
        t = self.topology
        for kind, full in unit.full.items():
            unit.secondary[kind] = full.chunk(t.ranks_per_node)[t.local_rank].clone()

    # -------------------------------------------------------------- gradients
    def reduce(self, unit, grad_full, out):
        """Start reducing grad_full into this rank's shard `out` (a sum: grad_full was divided
        by N); returns a handle."""
        if self.quantize_gradients:
            self._quantized_reduce(unit, grad_full, out)
            return _Done()
        h = self.comm.reduce_scatter(out, grad_full, group=self.shard_group, async_op=True,
                                     tag=f"reduce:{unit.name}")
        if not self.hsdp or self.replicas == 1:
            return h
        # HSDP: the node's sum, then the sum over the replicas of this shard on the other nodes
        return _Done([h], lambda: self.comm.all_reduce(out, group=self.topology.cross_group,
                                                       tag=f"allreduce:{unit.name}"))

    def _quantized_reduce(self, unit, grad_full, out):
        t = self.topology
        g, m, shard = t.ranks_per_node, t.nodes, out.numel()
        # reorder: local rank j's row holds the shards of ranks j, g + j, 2g + j, ... (one per node)
        rows = grad_full.view(m, g, shard).transpose(0, 1).reshape(g, m * shard)
        node_sum = self._exchange(rows, t.node_group, f"qreduce:{unit.name}")      # inside the node
        mine = self._exchange(node_sum.view(m, shard), t.cross_group, f"qreduce:{unit.name}")
        out.copy_(mine)

    def _exchange(self, rows, group, tag):
        """Row i goes to the group's i-th rank as int4 codes; returns the fp32 sum of the rows
        this rank received (its own included, in rank order: every rank adds alike)."""
        k, width = rows.shape
        if k == 1:                      # a group of one: nothing travels, nothing to quantize
            return rows[0].float()
        qs = [qz.quantize(r, GRAD_BITS, GRAD_BLOCK) for r in rows]
        codes, scales = torch.cat([q.payload for q in qs]), torch.cat([q.scales for q in qs])
        codes_in, scales_in = torch.empty_like(codes), torch.empty_like(scales)
        self.comm.all_to_all(codes_in, codes, group=group, tag=tag)
        self.comm.all_to_all(scales_in, scales, group=group, tag=tag)
        total = torch.zeros(width, dtype=torch.float32, device=rows.device)
        for c, s in zip(codes_in.chunk(k), scales_in.chunk(k)):
            total += qz.dequantize(qz.from_parts(c, s, GRAD_BITS, GRAD_BLOCK, width, torch.float32))
        return total
