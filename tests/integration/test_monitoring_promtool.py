"""examples/monitoring checked by Prometheus' own promtool (Debian's `prometheus` package): the scrape
config and the rules are valid, the alerts' unit tests (alerts_test.yml) pass, and every Grafana
dashboard expression parses (as a recording rule). Skipped with the install line without promtool;
tests/test_monitoring.py checks the rest without it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from test_monitoring import MONITORING, alert_rules, dashboard_expressions, grafana_to_promql

PROMTOOL_INSTALL = "apt-get install -y prometheus  (Debian's package brings promtool)"


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip(f"promtool not installed: {PROMTOOL_INSTALL}")
    return found


def _run(*args: str, cwd: Path) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_promtool_checks_the_config_and_the_rules() -> None:
    promtool = _promtool()
    out = _run(promtool, "check", "config", "prometheus.yml", cwd=MONITORING)
    assert "SUCCESS" in out
    assert f"SUCCESS: {len(alert_rules())} rules found" in _run(promtool, "check", "rules", "alerts.yml", cwd=MONITORING)


def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    promtool = _promtool()
    assert "SUCCESS" in _run(promtool, "test", "rules", "alerts_test.yml", cwd=MONITORING)


def test_promtool_parses_every_dashboard_expression(tmp_path: Path) -> None:
    promtool = _promtool()
    rules = [{"record": f"dashboard:expr_{i}", "expr": grafana_to_promql(expr)}
             for i, expr in enumerate(dashboard_expressions())]
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert f"SUCCESS: {len(rules)} rules found" in _run(promtool, "check", "rules", "dashboard.yml", cwd=tmp_path)
