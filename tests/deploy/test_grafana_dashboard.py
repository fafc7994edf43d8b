"""The Grafana dashboard in deploy/grafana/ queries only metrics that exist.

A panel whose query names a metric nobody exports shows "No data" and looks like a quiet server.
So every series each query reads must be declared: the handler's (handler/metrics.py, which a unit
test holds to model-config/metrics.yaml's model_metrics) or TorchServe's own, as the same file's
ts_metrics declares them. A histogram is read through its `_bucket`, `_sum` and `_count` series,
and `histogram_quantile` only over a histogram's buckets or the handler's bucket counters.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from handler import metrics as handler_metrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "spec-serve-dashboard.json"
METRICS_YAML = REPO / "model-config" / "metrics.yaml"

# PromQL words that are not series: aggregation modifiers, set and vector-matching operators.
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def declared() -> dict[str, str]:
    """{metric name: type} of everything exported: the handler's metrics and TorchServe's own."""
    names: dict[str, str] = {}
    config = yaml.safe_load(METRICS_YAML.read_text())
    for section in ("ts_metrics", "model_metrics"):
        for metric_type, metrics in config[section].items():
            names.update({metric["name"]: metric_type for metric in metrics})
    for metric_type, metrics in (
        ("counter", handler_metrics.COUNTERS),
        ("gauge", handler_metrics.GAUGES),
        ("histogram", handler_metrics.HISTOGRAMS),
    ):
        for name in metrics:
            # metrics.yaml and handler/metrics.py agree (tests/unit/test_config.py); a name in one only is not exported.
            assert names.get(name) == metric_type, f"{name}: a {metric_type} in handler/metrics.py, not in metrics.yaml"
    return names


def series_in(expr: str) -> list[str]:
    """The series names a PromQL expression reads (no functions, labels, durations or keywords)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals: label values
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range durations, $__rate_interval included
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    names = []
    for match in re.finditer(r"(?<![\w$.])([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name in PROMQL_KEYWORDS or re.fullmatch(r"\d+e\d+", name):
            continue
        names.append(name)
    return names


def undeclared(expr: str, names: dict[str, str]) -> list[str]:
    """The series of `expr` that no declared metric exports."""
    missing = []
    for series in series_in(expr):
        if series in names and names[series] != "histogram":
            continue
        base = next((series[: -len(s)] for s in HISTOGRAM_SERIES if series.endswith(s)), None)
        if base is None or names.get(base) != "histogram":
            missing.append(series)
    return missing


def panels() -> list[dict]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def queries() -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in panels() for target in panel["targets"]]


def test_the_dashboard_is_grafana_json_with_a_query_in_every_panel():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels():
        assert panel["targets"] and all(target["expr"].strip() for target in panel["targets"]), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", f"{panel['title']}: the dashboard's data source"
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    used = set(re.findall(r"\$(\w+)", json.dumps(dashboard))) - {"__rate_interval"}
    assert used <= variables, f"undefined variables: {used - variables}"


@pytest.mark.parametrize(("title", "expr"), queries(), ids=[f"{t}: {e[:40]}" for t, e in queries()])
def test_each_query_names_declared_metrics_only(title, expr):
    names = declared()
    assert series_in(expr), f"{title}: no metric in {expr!r}"
    assert not undeclared(expr, names), f"{title}: {undeclared(expr, names)} not declared, in {expr!r}"


def test_quantiles_read_buckets():
    bucket_counters = set(handler_metrics.BUCKET_COUNTERS.values())
    names = declared()
    for title, expr in queries():
        for argument in re.findall(r"histogram_quantile\(\s*[\d.]+\s*,(.*)", expr):
            [series] = series_in(argument)
            histogram = series.removesuffix("_bucket")
            assert series in bucket_counters or (series.endswith("_bucket") and names[histogram] == "histogram"), (
                f"{title}: histogram_quantile over {series}, which has no le label"
            )


def test_the_check_catches_a_misnamed_metric():
    """Without this, a parser that found no names would pass every query."""
    names = declared()
    assert series_in('sum(rate(SpecRequests{ModelName=~"$model"}[5m])) by (Hostname)') == ["SpecRequests"]
    assert undeclared("sum(rate(SpecRequest[5m]))", names) == ["SpecRequest"]
    assert undeclared("rate(SpecDraftTokens_bucket[5m])", names) == ["SpecDraftTokens_bucket"]  # a counter
    assert undeclared("rate(SpecRequestLatencySeconds[5m])", names) == ["SpecRequestLatencySeconds"]  # needs a suffix
    assert not undeclared("rate(SpecRequestLatencySeconds_sum[5m]) / rate(SpecRequestLatencySeconds_count[5m])", names)
    assert not undeclared("sum(rate(ts_queue_latency_microseconds[5m])) / 1e6", names)
