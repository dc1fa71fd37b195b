"""zerolab.bitwise.cost: the bytes each engine sends per step are its closed form exactly
(2 (N-1)/N of what it reduces); the times come back as min <= median <= max (no assertion on
their size: the machine is shared)."""

import pytest

from zerolab.bitwise.cost import measure_cost

pytestmark = pytest.mark.slow     # launches ranks


def test_bytes_are_the_closed_form_and_times_a_spread():
    rows = measure_cost(world_sizes=(2, 4), size="nano", steps=2, warmup=1)
    for n, row in rows.items():
        for name in ("ring", "bitwise", "bitwise_interleaved"):
            assert row[name]["bytes_per_step"] == row[name]["bytes_closed_form"], (n, name, row[name])
            t = row[name]["step_s"]
            assert 0 < t["min"] <= t["median"] <= t["max"]
        # both reduce the whole gradient, padded a little: to N * 256 elements (bitwise), to the
        # buckets' alignment (DDP)
        assert row["params"] <= row["ring_numel"] and row["params"] <= row["bitwise_numel"] < row["params"] + n * 256
