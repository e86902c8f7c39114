"""A real Prometheus (Debian's `prometheus` package) with examples/monitoring's alert rules, scraping a
real two-site run: every expression of the Grafana dashboard answers with series (but those the
run cannot have, named below with the reason), every rule evaluates without error, no alert fires
on the healthy run, and `diloco-node status` prints the learner, eval, outer-gradient, storage,
admission and relay lines; then one site is SIGKILLed and `DilocoSiteDown` goes pending within its `for`.

Slow (two JAX sites and Prometheus, a few minutes on two cores); skipped with the install line
when the prometheus binary is absent.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco_node.testbed.launcher import DEFAULT_SETTINGS, free_port
from diloco_node.testbed.local_cluster import Cluster

from test_monitoring import MONITORING, dashboard_expressions, grafana_to_promql

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STARTUP_S = 300.0
# Evaluate every 2 commits, so both sites report eval losses soon.
SETTINGS = tuple(s for s in DEFAULT_SETTINGS if not s.startswith("eval_interval_commits=")) + (
    "eval_interval_commits=2",)
SCRAPE_S = 1  # Prometheus scrapes and evaluates every second here (15 s in the example)
# Dashboard expressions this run cannot answer, with the reason: TLS is off (no certificate),
# no storage point fails, and a CPU has no known peak FLOP/s (no MFU).
EMPTY_HERE = {"diloco_tls_cert_expiry_seconds": "TLS off", "diloco_storage_failing": "nothing failing",
              "diloco_learner_mfu": "no MFU on a CPU"}
SITE_DOWN_FOR_S = 60.0  # DilocoSiteDown's `for` in alerts.yml


def _get(base: str, path: str, **params: str) -> Any:
    url = f"{base}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        answer = json.loads(response.read())
    assert answer["status"] == "success", answer
    return answer["data"]


def _wait(what: str, check, timeout: float, every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = check()
        except OSError:
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def test_prometheus_scrapes_a_two_site_run_with_the_dashboard_and_the_alerts(tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed: apt-get install -y prometheus")
    with Cluster.create(tmp_path / "run") as cluster:
        a = cluster.add("a", settings=SETTINGS)
        cluster.wait_for("a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
        b = cluster.add("b", bootstrap=a, settings=SETTINGS)
        cluster.wait_for("a and b ready, evaluated", lambda s: all(
            s.get(n, {}).get("ready") and s[n]["evaluation"]["commit_index"] > 0 for n in ("a", "b")), STARTUP_S)

        targets = {site.url.removeprefix("http://"): name for name, site in cluster.sites.items()}
        config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
                  "rule_files": [str(MONITORING / "alerts.yml")],
                  "scrape_configs": [{"job_name": "diloco", "static_configs": [{"targets": sorted(targets)}]}]}
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = (tmp_path / "prometheus.log").open("w")
        prometheus = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                       f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)
        try:
            # Both sites scraped a few times, so rate() over [5m] has its two samples.
            _wait("both targets up", lambda: len([t for t in _get(base, "/api/v1/targets")["activeTargets"]
                                                  if t["health"] == "up"]) == 2, 60)
            time.sleep(10 * SCRAPE_S)
            empty = []
            for expression in dashboard_expressions():
                result = _get(base, "/api/v1/query", query=grafana_to_promql(expression))["result"]
                if not result and not any(name in expression for name in EMPTY_HERE):
                    empty.append(expression)
            assert empty == [], f"dashboard expressions without series on a healthy run: {empty}"
            print(f"\n{len(dashboard_expressions())} dashboard expressions queried; "
                  f"allowed empty: {sorted(EMPTY_HERE.items())}")

            groups = _get(base, "/api/v1/rules")["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            assert len(rules) >= 13 and all(rule["health"] == "ok" for rule in rules), \
                [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
            alerts = _get(base, "/api/v1/alerts")["alerts"]
            assert [a for a in alerts if a["state"] == "firing"] == [], alerts
            print(f"healthy run: {len(rules)} rules ok, none firing; pending: "
                  f"{[(a['labels']['alertname'], a['labels'].get('instance')) for a in alerts]}")

            # `diloco-node status` on a running site prints every section an operator acts on.
            shown = subprocess.run([sys.executable, "-m", "diloco_node", "status", "--peer", a.url],
                                   capture_output=True, text=True, timeout=60)
            assert shown.returncode == 0, shown.stderr
            for section in ("learner step time", "eval at commit", "outer gradients up", "bits/param",
                            "storage ok", "admission refused", "relays pushed"):
                assert section in shown.stdout, (section, shown.stdout)
            print(shown.stdout)

            b_target = next(t for t, name in targets.items() if name == "b")
            b.kill()
            killed = time.monotonic()

            def site_down() -> list[dict]:
                return [alert for alert in _get(base, "/api/v1/alerts")["alerts"]
                        if alert["labels"]["alertname"] == "DilocoSiteDown"
                        and alert["labels"]["instance"] == b_target]

            down = _wait("DilocoSiteDown pending for b", site_down, SITE_DOWN_FOR_S, every=0.5)
            pending_after = time.monotonic() - killed
            assert down[0]["state"] == "pending" and pending_after < SITE_DOWN_FOR_S, (down, pending_after)
            print(f"DilocoSiteDown pending {pending_after:.1f} s after b's SIGKILL (its for: {SITE_DOWN_FOR_S:.0f} s)")
        finally:
            prometheus.terminate()
            try:
                prometheus.wait(30)
            except subprocess.TimeoutExpired:
                prometheus.kill()
                prometheus.wait(10)
            log.close()
