"""`shoal-engine bench serve`'s statistics: percentiles, arrival processes and length sampling."""

from __future__ import annotations

import random

import pytest

from shoal.engine.tools import bench_serve


def test_bench_statistics():
    p = bench_serve.percentiles([float(i) for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01) and p["mean"] == 50.5
    assert bench_serve.percentiles([])["p50"] is None
    d1 = bench_serve.arrival_delays(random.Random(1), 1000, 10.0, "poisson")
    assert d1 == bench_serve.arrival_delays(random.Random(1), 1000, 10.0, "poisson")
    assert 0.08 < sum(d1) / len(d1) < 0.12
    assert bench_serve.arrival_delays(random.Random(1), 3, 4.0, "fixed") == [0.25] * 3
    assert bench_serve.arrival_delays(random.Random(1), 3, float("inf"), "poisson") == [0.0] * 3
    lens = bench_serve.sample_lengths(random.Random(0), 100, 0.5, 200)
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 10
