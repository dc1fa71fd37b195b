"""Collectives from first principles: the ring algorithms, built from send and recv.

torch.distributed gives you all_reduce in one call. Here we write it by hand, the way
NCCL and gloo do for large tensors, so you can see why it costs 2 (N-1)/N of the data:

    ring reduce-scatter   N-1 steps; each step every rank sends one chunk to its right
                          neighbour and adds the chunk it receives from its left one.
                          Afterwards rank r holds chunk r, summed over all ranks.
    ring all-gather       N-1 steps; each step every rank passes on the chunk it got last.
                          Afterwards every rank holds every chunk.
    ring all-reduce       reduce-scatter, then all-gather, on the same chunks.

Every message goes through a zerolab.runtime.comm.Ledger (isend/irecv), so the bytes each rank
sends are counted and can be compared with the formulas. These are for teaching: the
engines use the library collectives (Ledger.all_reduce ...), which do the same thing in C++.

Pass `record=[]` to get a snapshot of this rank's buffer after every step, which is how
chapter 4 draws the ring step by step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.comm import Ledger


def ring_position(ledger: Ledger | None):
    """(the ledger, this rank's place r in the ring, the ring's size n): the ledger's group, or
    the default group through a new Ledger when none is given."""
    ledger = Ledger() if ledger is None else ledger
    n = dist.get_world_size(ledger.group) if dist.is_initialized() else 1
    r = dist.get_rank(ledger.group) if dist.is_initialized() else 0
    return ledger, r, n


def _global(ledger: Ledger, group_rank: int) -> int:
    """send/recv take ranks of the default group."""
    if ledger.group is None:
        return group_rank
    return dist.get_global_rank(ledger.group, group_rank)


def exchange(ledger: Ledger, send: torch.Tensor, recv: torch.Tensor, r: int, n: int, tag: str):
    """Send `send` to the right neighbour while receiving `recv` from the left one."""
    right, left = _global(ledger, (r + 1) % n), _global(ledger, (r - 1) % n)
    # Post both before waiting on either: if every rank did a blocking send first, a ring of
    # blocking sends could wait on each other forever.
    h_send = ledger.isend(send.contiguous(), right, tag=tag)
    h_recv = ledger.irecv(recv, left, tag=tag)
    h_send.wait()
    h_recv.wait()


def _check_flat(name: str, *tensors):
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected tensors, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: tensors must be contiguous")


def reduce_scatter_chunks(chunks, ledger, r, n, tag, record=None, flat=None):
    """In place: afterwards chunks[r] is the sum over ranks of chunks[r]."""
    scratch = torch.empty_like(chunks[0]) if chunks else None
    for step in range(n - 1):
        # Step s: send chunk r-s-1, receive chunk r-s-2 and add it in. Chunk c starts at
        # rank c+1 and gathers one contribution per hop, reaching rank c after N-1 hops.
        send_i, recv_i = (r - step - 1) % n, (r - step - 2) % n
        incoming = scratch[: chunks[recv_i].numel()]
        exchange(ledger, chunks[send_i], incoming, r, n, tag)
        chunks[recv_i].add_(incoming)
        _note(record, flat, "reduce-scatter", step, send_i, recv_i)


def all_gather_chunks(chunks, ledger, r, n, tag, record=None, flat=None):
    """In place: rank r starts with the true chunks[r]; afterwards every chunk is true."""
    for step in range(n - 1):
        # Step s: pass on chunk r-s (our own at first, then the one we just received).
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        exchange(ledger, chunks[send_i], chunks[recv_i], r, n, tag)
        _note(record, flat, "all-gather", step, send_i, recv_i)


def _note(record, flat, phase, step, sent, received):
    """Keep a copy of this rank's buffer after one ring step (for pictures)."""
    if record is not None:
        record.append({"phase": phase, "step": step, "sent": sent, "received": received,
                       "buffer": flat.detach().clone()})


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, ledger: Ledger | None = None,
                        record: list | None = None) -> torch.Tensor:
    """output <- rank r's chunk of the sum over ranks of `input` (input = N chunks of output's size).

    `input` is left untouched; the work happens in a copy.
    """
    _check_flat("ring_reduce_scatter", output, input)
    ledger, r, n = ring_position(ledger)
    if input.numel() != output.numel() * n:
        raise ValueError(f"ring_reduce_scatter: input has {input.numel()} elements; it must be "
                         f"output ({output.numel()}) times the world size ({n})")
    work = input.detach().reshape(-1).clone()
    chunks = list(torch.tensor_split(work, n))
    reduce_scatter_chunks(chunks, ledger, r, n, "ring_reduce_scatter", record, work)
    output.copy_(chunks[r].view_as(output))
    return output


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, ledger: Ledger | None = None,
                    record: list | None = None) -> torch.Tensor:
    """output <- the concatenation of every rank's `input`, in rank order."""
    _check_flat("ring_all_gather", output, input)
    ledger, r, n = ring_position(ledger)
    if output.numel() != input.numel() * n:
        raise ValueError(f"ring_all_gather: output has {output.numel()} elements; it must be "
                         f"input ({input.numel()}) times the world size ({n})")
    flat = output.view(-1)
    chunks = list(torch.tensor_split(flat, n))
    chunks[r].copy_(input.reshape(-1))
    all_gather_chunks(chunks, ledger, r, n, "ring_all_gather", record, flat)
    return output


def ring_all_reduce(tensor: torch.Tensor, ledger: Ledger | None = None,
                    record: list | None = None) -> torch.Tensor:
    """tensor <- the sum over ranks of tensor, in place: a ring reduce-scatter then a ring all-gather.

    Any size works: the tensor is cut into N nearly equal chunks (torch.tensor_split), so each
    rank sends N-1 chunks in each phase, about 2 (N-1)/N of the tensor in all.
    """
    _check_flat("ring_all_reduce", tensor)
    ledger, r, n = ring_position(ledger)
    if n == 1:
        return tensor
    flat = tensor.view(-1)
    chunks = list(torch.tensor_split(flat, n))
    reduce_scatter_chunks(chunks, ledger, r, n, "ring_all_reduce", record, flat)
    # Now rank r holds the finished chunk r: exactly the starting point of an all-gather.
    all_gather_chunks(chunks, ledger, r, n, "ring_all_reduce", record, flat)
    return tensor


def naive_reduce(tensor: torch.Tensor, dst: int = 0, ledger: Ledger | None = None) -> torch.Tensor:
    """tensor on rank dst <- the sum over ranks: everyone sends its whole tensor to dst.

    The simplest reduce, and the slowest: dst receives (N-1) full tensors through one link.
    Other ranks' tensors are left as they were.
    """
    _check_flat("naive_reduce", tensor)
    ledger, r, n = ring_position(ledger)
    if r == dst:
        incoming = torch.empty_like(tensor)
        for src in range(n):
            if src != dst:
                # irecv + wait: Ledger.recv (sync) trips over dist.recv returning an int
                ledger.irecv(incoming, _global(ledger, src), tag="naive_reduce").wait()
                tensor.add_(incoming)
    else:
        ledger.isend(tensor, _global(ledger, dst), tag="naive_reduce").wait()
    return tensor


def ring_bytes(op: str, numel: int, n: int, element_size: int = 4) -> float:
    """Bytes each rank sends in a ring collective on a tensor of `numel` elements (the formula)."""
    if op == "all_reduce":
        factor = 2 * (n - 1) / n
    elif op in ("reduce_scatter", "all_gather"):
        factor = (n - 1) / n
    else:
        raise ValueError(f"ring_bytes: op must be all_reduce, reduce_scatter or all_gather, got {op!r}")
    return factor * numel * element_size
