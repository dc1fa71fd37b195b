"""When DDP's buckets hide behind backward on a GPU cluster: the cost model, bucket by bucket.

`zerolab.theory.cost_model.step_estimate` sends a step's gradients as one message. DDP sends them
in buckets: each bucket pays a collective's latency, and its all-reduce can start only once the
backward has produced its last gradient. `bucket_pipeline` plays that out on the cost model:

    the backward produces the gradients at a steady rate (the bytes of bucket i are ready when
    that share of the backward has run); the buckets' all-reduces run one after another, each as
    soon as its bucket is ready and the previous one has finished; each takes
    cost_model.collective_seconds for its size. What runs past the end of the backward is exposed.

Tiny buckets pay the latency many times over; one huge bucket cannot start before the backward
ends. Chapter 5 draws the exposed time against the bucket size.
"""

from __future__ import annotations

import math

from ..theory import cost_model as cm


def bucket_sizes(grad_bytes: float, bucket_bytes: float) -> list:
    """Bytes of each bucket: full buckets, then what is left (the last may be smaller)."""
    if grad_bytes <= 0 or bucket_bytes <= 0:
        raise ValueError(f"bucket_sizes: sizes must be positive, got {grad_bytes} and {bucket_bytes}")
    k = max(1, math.ceil(grad_bytes / bucket_bytes))
    return [bucket_bytes] * (k - 1) + [grad_bytes - bucket_bytes * (k - 1)]


def bucket_pipeline(psi: float, n: int, tokens_per_rank: float, bucket_bytes: float,
                    cluster: cm.Cluster = cm.H100_CLUSTER, bytes_per_element: float = 2) -> dict:
    """One DDP backward of a psi-parameter model on n GPUs with buckets of bucket_bytes.

    Returns the backward's seconds, the buckets' count, their all-reduces' seconds in all (and of
    that, latency), and the exposed seconds: how long after the backward the last all-reduce ends.
    """
    grad_bytes = psi * bytes_per_element
    backward_s = cm.BACKWARD_SHARE * cm.compute_seconds(psi, tokens_per_rank, cluster)
    sizes = bucket_sizes(grad_bytes, bucket_bytes)
    costs = {size: cm.collective_cost("all_reduce", size, n, cluster) for size in set(sizes)}
    end = filled = comm = latency = 0.0
    for size in sizes:
        filled += size
        ready = backward_s * filled / grad_bytes
        cost = costs[size]
        end = max(ready, end) + cost.seconds
        comm += cost.seconds
        latency += cost.latency_s
    return {"buckets": len(sizes), "backward_s": backward_s, "comm_s": comm, "latency_s": latency,
            "exposed_s": max(0.0, end - backward_s)}


def exposed_by_bucket_size(psi: float, n: int, tokens_per_rank: float, bucket_bytes_list,
                           cluster: cm.Cluster = cm.H100_CLUSTER, bytes_per_element: float = 2) -> list:
    """bucket_pipeline for each bucket size: [{"bucket_bytes", "buckets", "exposed_s", ...}]."""
    return [{"bucket_bytes": b, **bucket_pipeline(psi, n, tokens_per_rank, b, cluster, bytes_per_element)}
            for b in bucket_bytes_list]
