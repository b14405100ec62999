"""deploy/grafana/tierkv.json: a Grafana dashboard whose every expression names metrics a real
server exports.

The exported names come from a scrape of a running server's endpoint (its families and their
types), never from a list kept here. ``tests/service/test_prometheus.py`` evaluates every
expression against a real Prometheus as well (``dashboard_expressions``, ``as_promql``).
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import REPO
from tests.support.harness import ALICE_TOKEN, BackgroundServer, free_port
from tierkv import Client

DASHBOARD_PATH = REPO / "deploy" / "grafana" / "tierkv.json"
# What Grafana substitutes before it sends a query, and a value Prometheus accepts for each.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "1h",
    "$instance": ".*",
}
_METRIC_NAME = re.compile(r"\b(tierkv_[a-zA-Z0-9_:]*)")
# Sample names each family type exposes (prometheus_client's custom collectors add no
# _created samples).
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def load_dashboard() -> dict[str, Any]:
    """The dashboard's JSON model."""
    dashboard: dict[str, Any] = json.loads(DASHBOARD_PATH.read_text(encoding="utf-8"))
    return dashboard


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def dashboard_expressions() -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every panel target, as Grafana stores them."""
    return [(panel["title"], target["expr"])
            for panel in all_panels(load_dashboard()["panels"])
            for target in panel.get("targets", [])]


def variable_queries() -> list[str]:
    """The queries of the dashboard's query variables (Grafana's ``label_values(...)``)."""
    return [variable["definition"] for variable in load_dashboard()["templating"]["list"]
            if variable["type"] == "query"]


def as_promql(expr: str) -> str:
    """``expr`` with Grafana's variables replaced as Grafana would (``GRAFANA_VARIABLES``)."""
    for name, value in sorted(GRAFANA_VARIABLES.items(), key=lambda item: -len(item[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a Grafana variable no test substitutes: {expr}"
    return expr


def metric_names(expr: str) -> set[str]:
    """The ``tierkv_`` metric names ``expr`` reads."""
    return set(_METRIC_NAME.findall(expr))


def is_balanced(expr: str) -> bool:
    """Parentheses, brackets and braces nest, outside quoted strings, and quotes close."""
    closing = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    quote = ""
    escaped = False
    for char in expr:
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = ""
        elif char in "\"'`":
            quote = char
        elif char in "([{":
            stack.append(char)
        elif char in closing and (not stack or stack.pop() != closing[char]):
            return False
    return not stack and not quote


@pytest.fixture(scope="module")
def exported_names(tmp_path_factory: pytest.TempPathFactory) -> frozenset[str]:
    """The sample names a real server's endpoint exports (every family, by its type), after
    one call so that every family has been through a scrape with data."""
    server = BackgroundServer(tmp_path_factory.mktemp("dashboard"), metrics_port=free_port())
    try:
        with Client(server.tcp_target, token=ALICE_TOKEN, use_shm=False) as client:
            client.describe()
        port = server.served.server.metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode("utf-8")
    finally:
        server.close()
    names = set()
    for family in text_string_to_metric_families(text):
        assert family.type in _SUFFIXES, (family.name, family.type)
        names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    return frozenset(names)


def test_every_dashboard_expression_names_only_metrics_the_server_exports(
    exported_names: frozenset[str],
) -> None:
    queries = [*dashboard_expressions(), *(("variable", q) for q in variable_queries())]
    assert len(queries) >= 10
    for title, expr in queries:
        names = metric_names(expr)
        assert names, f"{title}: no tierkv metric in {expr}"
        assert names <= exported_names, f"{title}: not exported: {sorted(names - exported_names)}"


def test_every_expression_is_balanced_and_substitutes_to_plain_promql() -> None:
    for title, expr in dashboard_expressions():
        assert is_balanced(expr), f"{title}: unbalanced {expr}"
        assert is_balanced(as_promql(expr)), title
        # A histogram's buckets are only read through histogram_quantile.
        if "_bucket" in expr:
            assert expr.startswith("histogram_quantile("), title
    assert is_balanced('sum(rate(x{a="("}[1m]))')  # the checker itself: quotes hide brackets
    assert not is_balanced("sum(rate(x[1m])")


def test_the_dashboard_has_the_panels_operators_need() -> None:
    dashboard = load_dashboard()
    panels = list(all_panels(dashboard["panels"]))
    assert len({panel["id"] for panel in panels}) == len(panels)
    by_metric: dict[str, list[str]] = {}
    for panel in panels:
        assert panel["title"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            for name in metric_names(target["expr"]):
                by_metric.setdefault(name, []).append(target["expr"])
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    # Hit ratio per tier, bytes vs budget, tokens saved per second, latency percentiles,
    # evictions, errors.
    assert any("tierkv_tier_misses_total" in e for e in by_metric["tierkv_tier_hits_total"])
    assert by_metric["tierkv_tier_used_bytes"] and by_metric["tierkv_tier_capacity_bytes"]
    assert any(e.startswith("sum by (model) (rate(")
               for e in by_metric["tierkv_prefill_tokens_saved_total"])
    quantiles = {e.split(",")[0] for e in by_metric["tierkv_rpc_duration_seconds_bucket"]}
    assert quantiles == {"histogram_quantile(0.5", "histogram_quantile(0.99"}
    assert any("rate(" in e for e in by_metric["tierkv_tier_evictions_total"])
    assert any('code!="OK"' in e for e in by_metric["tierkv_rpc_requests_total"])
