"""Reading Prometheus text exposition in tests (engine and gateway /metrics alike)."""

from __future__ import annotations


def parse_metrics(text: str) -> dict[str, float]:
    """'name{labels}' -> value for every sample line."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            out[key] = float(val)
    return out


def metric(samples: dict[str, float], name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, v in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total
