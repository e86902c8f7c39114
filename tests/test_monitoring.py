"""examples/monitoring: the alert rules, their unit tests, the scrape config and the Grafana dashboard.

Here, without Prometheus' tools: the dashboard's shape (importable, a datasource variable), every
metric family the daemon exports drawn by some panel, every series an alert reads exported, every
alert with a firing and a silent case and a runbook line. promtool's checks (`check config`, `check
rules`, `test rules`, every dashboard expression parsed) are tests/integration/test_monitoring_promtool.py;
a real Prometheus scraping a two-site run is tests/integration/test_monitoring_prometheus.py (slow).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from diloco_node.daemon.metrics import DaemonSeries
from diloco_node.ops.status import MetricsRegistry, StatusDocument, TlsStatus

MONITORING = Path(__file__).resolve().parent.parent / "examples" / "monitoring"
# Words of PromQL that are not metric names (functions, keywords, aggregation modifiers).
_PROMQL_WORDS = {"rate", "increase", "delta", "changes", "histogram_quantile", "sum", "by", "without", "on",
                 "ignoring", "group_left", "group_right", "and", "or", "unless", "max", "min", "avg", "time",
                 "clamp", "clamp_min", "clamp_max", "avg_over_time", "min_over_time", "max_over_time", "le",
                 "offset", "job", "instance", "scalar", "vector"}
_SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def exported_families() -> dict[str, str]:
    """Every family a daemon's /metrics can carry (name -> type): the status document's (with TLS
    on and a failing storage point, so none is empty), the daemon's own series, process_*."""
    from prometheus_client.parser import text_string_to_metric_families

    registry = MetricsRegistry()
    DaemonSeries.register(registry)
    doc = StatusDocument(node_id="a", run_id="r", role="learner", ready=True, epoch=1, coordinator="a",
                         commit_index=1, state_digest="", tls=TlsStatus(enabled=True),
                         storage={"failing": {"checkpoint.write": {}}})
    return {f.name: f.type for f in text_string_to_metric_families(registry.render(doc).decode())}


def dashboard() -> dict:
    return json.loads((MONITORING / "grafana-dashboard.json").read_text())


def dashboard_expressions() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] if p["type"] != "row" for t in p["targets"]]


def metric_names(expression: str) -> set[str]:
    """The metric names an expression reads (identifiers outside braces and strings, not PromQL words)."""
    bare = re.sub(r'\{[^}]*\}|"[^"]*"|\[[^\]]*\]|\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)',
                  " ", expression)
    return {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare) if w not in _PROMQL_WORDS}


def family_of(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"]
            for rule in group["rules"]]


def test_dashboard_is_importable_with_a_datasource_variable() -> None:
    board = dashboard()
    for key in ("title", "uid", "schemaVersion", "panels", "templating", "time"):
        assert key in board, key
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in board["panels"]:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        if panel["type"] == "row":
            continue
        # Every panel queries through the variable, so the import asks which Prometheus to use.
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}" and target["expr"].strip(), panel["title"]


def test_dashboard_draws_every_exported_family() -> None:
    drawn = {family_of(name) for expr in dashboard_expressions() for name in metric_names(expr)}
    families = exported_families()
    assert len(families) > 50  # the registry really was read (status, daemon and process families)
    missing = sorted(set(families) - drawn)
    assert not missing, f"families no dashboard panel draws: {missing}"
    unknown = sorted(drawn - set(families) - {"up"})
    assert not unknown, f"the dashboard reads series the daemon does not export: {unknown}"


def test_every_series_an_alert_reads_is_exported() -> None:
    families = exported_families()
    for rule in alert_rules():
        for name in metric_names(rule["expr"]):
            assert name == "up" or family_of(name) in families, f"{rule['alert']} reads {name}"


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    alerts = {rule["alert"] for rule in alert_rules()}
    cases = yaml.safe_load((MONITORING / "alerts_test.yml").read_text())["tests"]
    firing, silent = set(), set()
    for case in cases:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    assert len(alerts) >= 11
    assert alerts - firing == set(), "alerts with no firing case"
    assert alerts - silent == set(), "alerts with no silent case"
    assert (firing | silent) <= alerts, "cases for alerts that do not exist"


def test_every_alert_has_a_runbook_line() -> None:
    operations = (MONITORING.parent.parent / "docs" / "OPERATIONS.md").read_text()
    for rule in alert_rules():
        assert rule["annotations"]["runbook"] == f"docs/OPERATIONS.md#alerts: {rule['alert']}"
        assert f"| `{rule['alert']}` |" in operations, f"{rule['alert']}: no runbook line in docs/OPERATIONS.md"


def grafana_to_promql(expression: str, job: str = "diloco") -> str:
    """A dashboard expression as Prometheus runs it with the variables set (every site)."""
    return expression.replace("$job", job).replace("$instance", ".*")
