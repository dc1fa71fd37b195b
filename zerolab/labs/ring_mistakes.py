"""Lab 1's planted mistakes: zerolab.theory.collectives' ring with one thing wrong, as students write it.
Each must fail the grader with the failure named in `expect`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..theory.collectives import (all_gather_chunks, exchange, reduce_scatter_chunks, ring_all_reduce,
                                  ring_position)
from .lab import Mistake


def receives_from_the_right(ledger, send, recv, r, n):
    h_send = ledger.isend(send.contiguous(), (r + 1) % n, tag="ring")
    h_recv = ledger.irecv(recv, (r + 1) % n, tag="ring")   # (the right neighbour sends to ITS right)
    h_send.wait()
    h_recv.wait()


def runs_backwards(ledger, send, recv, r, n):
    h_send = ledger.isend(send.contiguous(), (r - 1) % n, tag="ring")   # (left, and from the right)
    h_recv = ledger.irecv(recv, (r + 1) % n, tag="ring")
    h_send.wait()
    h_recv.wait()


def receives_into_a_new_tensor(ledger, send, recv, r, n):
    incoming = torch.empty_like(recv)      # (the message lands here, and `recv` is never written)
    h_send = ledger.isend(send.contiguous(), (r + 1) % n, tag="ring")
    h_recv = ledger.irecv(incoming, (r - 1) % n, tag="ring")
    h_send.wait()
    h_recv.wait()


def _exchange(ledger, send, recv, r, n):
    exchange(ledger, send, recv, r, n, "ring")


def copies_instead_of_adding(chunks, ledger, r, n):
    scratch = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send_i, recv_i = (r - step - 1) % n, (r - step - 2) % n
        _exchange(ledger, chunks[send_i], scratch, r, n)
        chunks[recv_i].copy_(scratch)       # (replaces the chunk instead of adding to it)


def sends_the_wrong_chunk(chunks, ledger, r, n):
    scratch = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send_i, recv_i = (r - step) % n, (r - step - 1) % n     # (the all-gather's indices)
        _exchange(ledger, chunks[send_i], scratch, r, n)
        chunks[recv_i].add_(scratch)


def one_step_short(chunks, ledger, r, n):
    scratch = torch.empty_like(chunks[0])
    for step in range(n - 2):               # (N - 2 steps)
        send_i, recv_i = (r - step - 1) % n, (r - step - 2) % n
        _exchange(ledger, chunks[send_i], scratch, r, n)
        chunks[recv_i].add_(scratch)


def gathers_into_the_wrong_chunk(chunks, ledger, r, n):
    for step in range(n - 1):
        send_i, recv_i = (r - step) % n, (r - step + 1) % n     # (receives into the next chunk)
        _exchange(ledger, chunks[send_i], chunks[recv_i], r, n)


def gathers_by_adding(chunks, ledger, r, n):
    scratch = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        _exchange(ledger, chunks[send_i], scratch, r, n)
        chunks[recv_i].add_(scratch)        # (the reduce-scatter's addition, in the all-gather)


def all_gather_one_step_short(chunks, ledger, r, n):
    for step in range(n - 2):               # (N - 2 steps)
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        _exchange(ledger, chunks[send_i], chunks[recv_i], r, n)


def splits_by_numel_over_n(tensor, ledger):
    ledger, r, n = ring_position(ledger)
    chunks = list(tensor.view(-1).split(tensor.numel() // n))   # (N + 1 chunks when N does not divide it)
    reduce_scatter_chunks(chunks, ledger, r, n, "ring")
    all_gather_chunks(chunks, ledger, r, n, "ring")


def averages(tensor, ledger):
    ring_all_reduce(tensor, ledger)
    tensor.div_(dist.get_world_size())      # (the mean, where the sum was asked for)


def forgets_the_all_gather(tensor, ledger):
    ledger, r, n = ring_position(ledger)
    reduce_scatter_chunks(list(torch.tensor_split(tensor.view(-1), n)), ledger, r, n, "ring")


def sends_everything_to_everyone(tensor, ledger):
    r, n = dist.get_rank(), dist.get_world_size()
    incoming = [torch.empty_like(tensor) for _ in range(n)]
    handles = [ledger.isend(tensor.clone(), q, tag="ring") for q in range(n) if q != r]
    handles += [ledger.irecv(incoming[q], q, tag="ring") for q in range(n) if q != r]
    for h in handles:
        h.wait()
    for q in range(n):
        if q != r:
            tensor.add_(incoming[q])


MISTAKES = (
    Mistake("copies_instead_of_adding", "copied each received chunk over its own",
            {"reduce_scatter_chunks": copies_instead_of_adding}, "copied_not_added"),
    Mistake("sends_the_wrong_chunk", "used the all-gather's chunk indices in the reduce-scatter",
            {"reduce_scatter_chunks": sends_the_wrong_chunk}, "wrong_chunk"),
    Mistake("one_step_short", "ran the reduce-scatter for N - 2 steps", {"reduce_scatter_chunks": one_step_short},
            "step_count"),
    Mistake("gathers_into_the_wrong_chunk", "received each all-gather step into the wrong chunk",
            {"all_gather_chunks": gathers_into_the_wrong_chunk}, "wrong_place"),
    Mistake("forgets_the_all_gather", "built the all-reduce from the reduce-scatter alone",
            {"ring_all_reduce": forgets_the_all_gather}, "no_all_gather"),
    Mistake("sends_everything_to_everyone", "all-reduced by sending the whole tensor to every rank",
            {"ring_all_reduce": sends_everything_to_everyone}, "bytes"),
    Mistake("runs_backwards", "sent to the left and received from the right",
            {"exchange": runs_backwards}, "reversed"),
    Mistake("receives_into_a_new_tensor", "received into a tensor of its own instead of `recv`",
            {"exchange": receives_into_a_new_tensor}, "recv_untouched"),
    Mistake("gathers_by_adding", "added each received chunk in the all-gather, as in the reduce-scatter",
            {"all_gather_chunks": gathers_by_adding}, "gathered_by_adding"),
    Mistake("all_gather_one_step_short", "ran the all-gather for N - 2 steps",
            {"all_gather_chunks": all_gather_one_step_short}, "never_arrived"),
    Mistake("splits_by_numel_over_n", "cut the all-reduce's tensor into chunks of numel // N elements",
            {"ring_all_reduce": splits_by_numel_over_n}, "uneven"),
    Mistake("averages", "divided the all-reduce's sum by N", {"ring_all_reduce": averages}, "divided"),
    Mistake("receives_from_the_right", "received from the right neighbour, which sends to its own right",
            {"exchange": receives_from_the_right}, "hang", hangs=True),
)
