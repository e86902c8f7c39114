"""Eviction with real daemons (issue 12): three `diloco-node run` sites over mutual TLS; the
operator runs `diloco-node evict` against the lease holder's operator listener; every member then
refuses the evicted site (403 with the reason, its certificate included), it cannot join again, and
the other two keep committing with equal digests. On the way, it checks that every member knows
every other member's advertised operator URL (`status_url`), which the live page reads under TLS.

Slow (a 3-site JAX run, about 2-3 minutes on two cores): run with
`pytest -m 'integration and slow' tests/integration/test_eviction_cluster.py`. Every process is
killed at teardown.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request

import pytest

from diloco_node.ops import pki
from diloco_node.testbed.local_cluster import Cluster
from diloco_node.transport.tls import TlsFiles
from test_tls_cluster import FOUNDERS, STARTUP_S, _healthy, _rogue

from conftest import voters

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


def _evict(url: str, node_id: str, reason: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "diloco_node", "evict", "--peer", url, "--node-id", node_id,
                           "--reason", reason], capture_output=True, text=True, timeout=60)


def test_an_evicted_site_is_refused_everywhere_and_cannot_rejoin(tmp_path_factory: pytest.TempPathFactory) -> None:
    cluster = Cluster.create(tmp_path_factory.mktemp("evict-cluster"), tls=True)
    with cluster:
        a = cluster.add("a")
        cluster.wait_for("a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
        cluster.add("b", bootstrap=a)
        cluster.add("c", bootstrap=a)
        statuses = cluster.wait_for("a, b, c ready, all voters, one coordinator", _healthy, STARTUP_S)
        holder = cluster.coordinator(statuses)
        assert holder is not None
        # /status shows each site's own certificate (issue 12, TLS details).
        for n in FOUNDERS:
            tls = statuses[n]["tls"]
            assert tls["enabled"] and tls["node_id"] == n and len(tls["fingerprint"]) == 64, tls
            assert 300 < tls["days_left"] <= 366 and not tls["crl_loaded"] and tls["reload_error"] == "", tls
        metrics = urllib.request.urlopen(cluster.sites[holder].url + "/metrics", timeout=10).read().decode()
        assert "diloco_tls_cert_expiry_seconds " in metrics
        # Every member advertises its operator URL (status_url, from status_listen) for the live page.
        cluster.wait_for("every member's status_url known everywhere", lambda s: all(
            n in s and {m["node_id"]: m["status_url"] for m in s[n]["members"]}
            == {m: cluster.sites[m].url for m in FOUNDERS} for n in FOUNDERS), 30)
        victim = sorted({"b", "c"} - {holder})[0]  # a joiner (bootstrap a), not the lease holder
        survivors = FOUNDERS - {victim}
        other = sorted(survivors - {holder})[0]

        # Asked of a member that does not hold the lease: refused, it names the holder, nothing changes.
        wrong = _evict(cluster.sites[other].url, victim, "test")
        assert wrong.returncode == 1 and "does not hold the lease" in wrong.stderr and holder in wrong.stderr, wrong

        evicted = _evict(cluster.sites[holder].url, victim, "key leaked in a test")
        assert evicted.returncode == 0, evicted
        assert f"node {victim} was evicted from this run at index " in evicted.stdout
        assert evicted.stdout.strip().endswith(": key leaked in a test")

        after = cluster.wait_for(f"{victim} out of the voters on both survivors", lambda s: all(
            n in s and voters(s[n]) == survivors for n in survivors), 60)
        start = min(after[n]["commit_index"] for n in survivors)
        assert all([(e["node_id"], e["reason"]) for e in after[n]["evicted"]] == [(victim, "key leaked in a test")]
                   for n in survivors), {n: after[n]["evicted"] for n in survivors}

        # Its own certificate and node id, with the run's secret: 403 with the reason, at every member.
        tls_dir = cluster.site_tls_dir(victim)
        files = TlsFiles(tls_dir / pki.SITE_CERT, tls_dir / pki.SITE_KEY, cluster.ca_dir / pki.CA_CERT)
        for member in sorted(survivors):
            outcome = _rogue(cluster, files, victim, member)
            assert outcome.startswith(f"refused 403: node {victim} was evicted from this run at index "), outcome

        # It cannot come back: restarted with its data, then as a fresh joiner (data wiped), it is
        # refused for good each time and exits 3 (systemd's RestartPreventExitStatus).
        site = cluster.sites[victim]
        for how in ("restart with its data", "fresh join"):
            site.kill()
            if how == "fresh join":
                shutil.rmtree(site.data_dir)
            site.start()
            assert site.wait(120) == 3, (how, site.log_text()[-3000:])
            assert f"node {victim} was evicted from this run at index " in site.log_text(), how

        # The two others go on committing, with one digest per index.
        cluster.wait_for("10 more commits on both survivors", lambda s: all(n in s for n in survivors) and
                         min(s[n]["commit_index"] for n in survivors) >= start + 10, 120)
        index = cluster.common_commit_index(survivors, 60)
        assert len(cluster.history[index]) == 1
        assert cluster.conflicting_indices() == {}
        assert all(voters(d) == survivors for n, d in cluster.poll().items() if n in survivors)
