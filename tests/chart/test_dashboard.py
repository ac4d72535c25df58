"""The Grafana dashboard is built on the engine's metric contract: shoal:* names with vLLM's meanings, labelled
model_name (ARCHITECTURE.md)."""

from __future__ import annotations

import importlib
import json
import re

import pytest

from chartkit import CHART_DIR

DASHBOARD = json.loads((CHART_DIR / "dashboards" / "shoal-engine.json").read_text())

GAUGES = {"shoal:num_requests_running", "shoal:num_requests_waiting", "shoal:kv_cache_usage_perc"}
COUNTERS = {"shoal:num_preemptions_total", "shoal:prefix_cache_queries_total", "shoal:prefix_cache_hits_total",
            "shoal:prompt_tokens_total", "shoal:generation_tokens_total", "shoal:request_success_total"}
HISTOGRAMS = {"shoal:time_to_first_token_seconds", "shoal:inter_token_latency_seconds",
              "shoal:e2e_request_latency_seconds", "shoal:request_queue_time_seconds"}
METRIC = re.compile(r"shoal:[a-z0-9_]+")


def _panels():
    return [p for p in DASHBOARD["panels"] if p["type"] != "row"]


def _exprs():
    return [t["expr"] for p in _panels() for t in p["targets"]]


def test_dashboard_shape():
    assert DASHBOARD["uid"] == "shoal-engine" and DASHBOARD["title"]
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    assert variables == {"datasource", "namespace", "model_name"}
    for panel in _panels():
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24


def test_only_contract_metrics_are_used_and_all_of_them_are():
    used = set()
    for expr in _exprs():
        for name in METRIC.findall(expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if base in HISTOGRAMS:
                assert name != base, f"histogram {base} used without _bucket/_sum/_count in {expr}"
            else:
                assert name in GAUGES | COUNTERS, f"{name} is not an engine metric ({expr})"
            used.add(base)
    assert used == GAUGES | COUNTERS | HISTOGRAMS


def test_queries_are_well_formed():
    for expr in _exprs():
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        for name in COUNTERS:
            if name in expr:  # counters are only ever read as rates
                assert re.search(rf"rate\({re.escape(name)}\{{", expr), expr
        for selector in re.findall(r"shoal:[a-z0-9_]+\{([^}]*)\}", expr):
            assert 'model_name=~"$model_name"' in selector and 'namespace=~"$namespace"' in selector, expr
        assert "histogram_quantile" not in expr or "sum by (le" in expr, expr


def test_metric_names_match_what_the_engine_exposes():
    """Scrape a real ServerMetrics registry (over a stand-in engine) and check every series the dashboard reads,
    with its model_name label, is exposed."""
    metrics = importlib.import_module("shoal.engine.server.metrics")
    from types import SimpleNamespace

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    server = metrics.ServerMetrics("demo")
    server.attach(SimpleNamespace(snapshot=SimpleNamespace(stats=None), num_waiting=lambda: 0,
                                  is_alive=lambda: True))
    exposed = {}
    for family in text_string_to_metric_families(generate_latest(server.registry).decode()):
        for sample in family.samples:
            exposed.setdefault(sample.name, set()).update(sample.labels)
    used = {name for expr in _exprs() for name in METRIC.findall(expr)}
    missing = sorted(used - set(exposed))
    assert not missing, f"the dashboard reads series the engine does not expose: {missing}"
    for name in used:
        assert "model_name" in exposed[name], name
    assert "finished_reason" in exposed["shoal:request_success_total"]
