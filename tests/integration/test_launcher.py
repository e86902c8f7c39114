"""The node launcher: a real site behind an emulated link, reached through it, and nothing left
running after `close()`, whatever the node was doing."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from diloco_node.testbed.launcher import LinkShape, SiteSpec, launch_site, write_secret

from conftest import process_gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STARTUP_S = 150.0


def test_a_site_behind_a_link_answers_through_it_and_close_leaves_nothing(tmp_path: Path) -> None:
    spec = SiteSpec("a", tmp_path / "a", tmp_path / "a.log", write_secret(tmp_path / "secret"),
                    link=LinkShape(bandwidth_mbit=50, latency_ms=5))
    argv = spec.argv()
    assert argv[argv.index("--advertise") + 1] == f"http://127.0.0.1:{spec.link.port}"
    with launch_site(spec) as site:
        deadline = time.monotonic() + STARTUP_S
        while not (site.status() or {}).get("ready"):
            assert site.running, site.log_text()[-2000:]
            assert time.monotonic() < deadline, site.log_text()[-2000:]
            time.sleep(0.3)
        # Peers reach the node through the link: the same node answers there.
        with urllib.request.urlopen(f"http://{site.address}/status", timeout=5) as response:
            assert json.loads(response.read())["node_id"] == "a"
        site.signal(signal.SIGSTOP)  # a frozen node must not survive close() either
        pids = [site.pid, site.link.pid if site.link else None]
    assert None not in pids
    assert all(process_gone(pid) for pid in pids if pid is not None)
    assert not site.running
