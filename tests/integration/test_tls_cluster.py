"""Three real `diloco-node run` sites speaking mutual TLS on 127.0.0.1: they commit and agree, every
bad actor is refused and changes nothing (a certificate from another CA, an expired one, one whose
name differs from the node id its frames claim, a plain-HTTP client, a removed member's revoked
certificate after a SIGHUP reload), and the run fails over after a SIGKILL of the coordinator.

Slow (a 3-site JAX run, about 2-3 minutes on two cores): run with
`pytest -m 'integration and slow' tests/integration/test_tls_cluster.py`. Every process is killed
at teardown.
"""

from __future__ import annotations

import asyncio
import datetime
import shutil
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from diloco_node.config.settings import run_id_for
from diloco_node.ops import pki
from diloco_node.testbed.local_cluster import Cluster
from diloco_node.transport import PeerClient, PeerRefused, PeerUnreachable
from diloco_node.transport.tls import SiteTls, TlsFiles
from wire.auth import AuthContext, FrameVerifier, derive_frame_key, load_run_secret
from wire.messages import VoteRequest

from conftest import voters

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

STARTUP_S = 150.0
FOUNDERS = {"a", "b", "c"}
LEASE_S = 3.0  # the daemon's default lease_timeout_s, which these sites keep


@pytest.fixture(scope="module")
def tls_run(tmp_path_factory: pytest.TempPathFactory):
    c = Cluster.create(tmp_path_factory.mktemp("tls-cluster"), tls=True)
    # Every site reads the run CA's CRL (empty at first) from one path, as if copied there.
    crl = c.root / "pki" / "run.crl"
    shutil.copy(c.ca_dir / pki.CA_CRL, crl)
    extra = ("--set", f"tls_crl_file={crl}")
    try:
        a = c.add("a", extra=extra)
        c.wait_for("a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
        c.add("b", bootstrap=a, extra=extra)
        c.add("c", bootstrap=a, extra=extra)
        c.wait_for("a, b, c ready, all voters, one coordinator", _healthy, STARTUP_S)
        yield c
    finally:
        c.close()


def _healthy(s: dict) -> bool:
    return (FOUNDERS <= {n for n, d in s.items() if d.get("ready")}
            and all(voters(s[n]) == FOUNDERS for n in FOUNDERS)
            and len({s[n].get("coordinator") for n in FOUNDERS} - {None}) == 1
            and all(s[n].get("coordinator") for n in FOUNDERS))


def _peer_port(cluster: Cluster, node_id: str) -> int:
    return cluster.sites[node_id].spec.port


def test_three_tls_sites_commit_and_agree(tls_run: Cluster) -> None:
    statuses = tls_run.poll()
    start = min(statuses[n]["commit_index"] for n in FOUNDERS)
    tls_run.wait_for("10 more commits everywhere", lambda s: FOUNDERS <= set(s) and
                     min(s[n]["commit_index"] for n in FOUNDERS) >= start + 10, 90)
    index = tls_run.common_commit_index(FOUNDERS, 60)
    assert len(tls_run.history[index]) == 1
    assert tls_run.conflicting_indices() == {}
    for site in tls_run.sites.values():
        assert "listening on 127.0.0.1" in site.log_text() and "advertised https://" in site.log_text()


def _rogue(cluster: Cluster, files: TlsFiles, sender: str, to: str) -> str:
    """Send one vote request to site `to` with `files` as our certificate and frames signed (with
    the real run secret) as `sender`; what happened, in words."""
    secret = load_run_secret(cluster.secret_file)
    run_id, key = run_id_for(secret), derive_frame_key(secret)

    async def send() -> str:
        client = PeerClient(AuthContext(run_id, sender, key), FrameVerifier(run_id, key, node_id=sender),
                            tls=SiteTls(files))
        async with client:
            try:
                await client.send(f"https://127.0.0.1:{_peer_port(cluster, to)}",
                                  VoteRequest(epoch=0, candidate=sender, last_log_epoch=0, last_log_index=0),
                                  peer=to, deadline_s=10)
            except PeerRefused as refused:
                return f"refused {refused.status}: {refused.reason}"
            except PeerUnreachable as error:
                return f"handshake failed: {error}"
            return "answered"

    return asyncio.run(send())


def test_bad_actors_are_refused_and_change_nothing(tls_run: Cluster, tmp_path: Path) -> None:
    cluster = tls_run
    before = cluster.poll()
    target = sorted(FOUNDERS - {before["a"]["coordinator"]})[0]  # a follower
    start_index = before[target]["commit_index"]
    ca = cluster.ca_dir
    run_ca = ca / pki.CA_CERT
    # Another CA's certificate for "a".
    pki.init_ca(tmp_path / "other-ca")
    pki.issue_site(tmp_path / "other-ca", "a", tmp_path / "stranger")
    stranger = TlsFiles(tmp_path / "stranger" / pki.SITE_CERT, tmp_path / "stranger" / pki.SITE_KEY, run_ca)
    # The run CA's certificate for "a", expired.
    long_ago = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=30)
    pki.issue_site(ca, "a", tmp_path / "expired", valid_days=1, not_before=long_ago)
    expired = TlsFiles(tmp_path / "expired" / pki.SITE_CERT, tmp_path / "expired" / pki.SITE_KEY, run_ca)
    # A member's own certificate ("c"), frames claiming to be "a".
    own = cluster.site_tls_dir("c")
    c_files = TlsFiles(own / pki.SITE_CERT, own / pki.SITE_KEY, run_ca)
    outcomes = {
        "another CA": _rogue(cluster, stranger, "a", target),
        "expired": _rogue(cluster, expired, "a", target),
        "name differs from the claimed node id": _rogue(cluster, c_files, "a", target if target != "c" else "b"),
    }
    # A plain-HTTP client at the peer port.
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{_peer_port(cluster, target)}/status", timeout=5)
        outcomes["plain HTTP"] = "answered"
    except (urllib.error.URLError, ConnectionError, OSError) as error:
        outcomes["plain HTTP"] = f"dropped: {error}"
    # A removed member "d": its certificate is good until the operator revokes it and the sites
    # reload their CRL (SIGHUP): then the handshake fails.
    d_dir = cluster.site_tls_dir("d")
    d_files = TlsFiles(d_dir / pki.SITE_CERT, d_dir / pki.SITE_KEY, run_ca)
    before_revocation = _rogue(cluster, d_files, "d", target)
    pki.revoke(ca, d_dir / pki.SITE_CERT)
    shutil.copy(ca / pki.CA_CRL, cluster.root / "pki" / "run.crl")
    for site in cluster.sites.values():
        site.signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while not all("SIGHUP: TLS certificates reloaded" in s.log_text() for s in cluster.sites.values()):
        assert time.monotonic() < deadline, "the sites did not log a TLS reload after SIGHUP"
        time.sleep(0.2)
    outcomes["revoked"] = _rogue(cluster, d_files, "d", target)

    assert outcomes["another CA"].startswith("handshake failed"), outcomes
    assert outcomes["expired"].startswith("handshake failed"), outcomes
    assert outcomes["name differs from the claimed node id"].startswith("refused 403"), outcomes
    assert "a member cannot speak for another" in outcomes["name differs from the claimed node id"]
    assert outcomes["plain HTTP"].startswith("dropped"), outcomes
    assert not before_revocation.startswith("handshake failed"), before_revocation  # TLS let it in
    assert outcomes["revoked"].startswith("handshake failed"), outcomes
    # Nothing changed: the same three voters, and the run goes on committing.
    after = cluster.wait_for("commits go on after the refusals", lambda s: target in s and
                             s[target]["commit_index"] > start_index + 2, 60)
    assert all(voters(after[n]) == FOUNDERS for n in FOUNDERS if n in after)
    assert cluster.conflicting_indices() == {}


def test_sigkill_coordinator_fails_over_over_tls(tls_run: Cluster, record_property) -> None:
    cluster = tls_run
    cluster.wait_for("a, b, c ready, all voters, one coordinator", _healthy, STARTUP_S)
    statuses = cluster.poll()
    leader = cluster.coordinator(statuses)
    assert leader is not None
    before = max(d["commit_index"] for d in statuses.values())
    victim = cluster.sites[leader]
    victim.kill()
    killed_at = time.monotonic()
    survivors = FOUNDERS - {leader}

    def new_holder(s: dict) -> bool:
        holders = {s[n].get("coordinator") for n in survivors if n in s}
        return len(holders) == 1 and None not in holders and leader not in holders

    cluster.wait_for("a new coordinator named by both survivors", new_holder, 60, interval=0.1)
    elected_s = time.monotonic() - killed_at
    cluster.wait_for("commits past the old index", lambda s: all(n in s for n in survivors) and
                     min(s[n]["commit_index"] for n in survivors) > before + 2, 60)
    committed_s = time.monotonic() - killed_at
    # Measured, not asserted against 3 x lease (timings on a shared machine): reported in the note.
    record_property("failover_elected_s", round(elected_s, 2))
    record_property("failover_committing_s", round(committed_s, 2))
    print(f"TLS failover: new coordinator after {elected_s:.2f} s, commits after {committed_s:.2f} s "
          f"(3 x lease = {3 * LEASE_S:g} s)")
    assert cluster.conflicting_indices() == {}
    victim.start()
    cluster.wait_for(f"{leader} back and ready", lambda s: leader in s and s[leader].get("ready"), STARTUP_S)
    index = cluster.common_commit_index(FOUNDERS, 60)
    assert len(cluster.history[index]) == 1
