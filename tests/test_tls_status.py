"""TLS details on /status and /metrics (issue 12): the site's own certificate as loaded (node id,
fingerprint, expiry, CA, CRL, last load and reload error), and the `diloco_tls_cert_expiry_seconds`
gauge an operator alerts on before a certificate runs out."""

from __future__ import annotations

import hashlib
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from diloco_node.ops import pki
from diloco_node.ops.status import MetricsRegistry, StatusBuilder, StatusDocument
from diloco_node.transport.tls import SiteTls, TlsFiles

DAY = 86400.0


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_the_sites_certificate_facts_follow_a_reload_and_survive_a_failed_one(tmp_path: Path) -> None:
    pki.init_ca(tmp_path / "ca")
    first = pki.issue_site(tmp_path / "ca", "site-a", tmp_path / "a", valid_days=30)
    tls = SiteTls(TlsFiles(first.cert, first.key, first.ca, tmp_path / "ca" / pki.CA_CRL))
    cert = _cert(first.cert)
    facts = tls.facts
    assert facts.node_id == "site-a" and facts.crl_loaded
    assert facts.fingerprint == hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()
    assert facts.not_after_unix == cert.not_valid_after_utc.timestamp()
    assert facts.ca_subject == _cert(first.ca).subject.rfc4514_string() and facts.ca_subject.startswith("CN=")
    loaded = tls.loaded_at_unix
    renewed = pki.issue_site(tmp_path / "ca", "site-a", tmp_path / "a", valid_days=90, force=True)
    assert tls.reload_if_changed() is not None and tls.reloads == 1 and tls.loaded_at_unix >= loaded
    assert tls.facts.fingerprint != facts.fingerprint
    assert tls.facts.not_after_unix == _cert(renewed.cert).not_valid_after_utc.timestamp()
    shown = tls.facts
    renewed.cert.write_text("-----BEGIN CERTIFICATE-----\ntruncated")  # a half-copied file
    assert "keeping the previous certificates" in tls.reload()
    assert "cannot be loaded" in tls.last_reload_error
    assert tls.facts == shown and tls.reloads == 1  # the certificate still in use is what is shown


def test_status_shows_the_certificate_and_metrics_its_time_to_expiry() -> None:
    builder = StatusBuilder("site-a", "run", "learner", started_at=0.0)
    builder.wall = lambda: 1_000_000.0
    off = builder.document(1.0)
    assert not off.tls.enabled
    assert "diloco_tls_cert_expiry_seconds" not in MetricsRegistry(process_metrics=False).render(off).decode()
    builder.set_tls(node_id="site-a", fingerprint="ab" * 32, not_after_unix=1_000_000.0 + 10.5 * DAY,
                    ca_subject="CN=run CA", crl_loaded=True, loaded_at_unix=999_000.0, reloads=2,
                    reload_error="TLS certificate and key /x: cannot be loaded")
    doc = builder.document(2.0)
    tls = doc.to_dict()["tls"]
    assert tls == {"enabled": True, "node_id": "site-a", "fingerprint": "ab" * 32, "not_after": "1970-01-23T01:46:40Z",
                   "expires_in_s": 907200.0, "days_left": 10.5, "ca_subject": "CN=run CA", "crl_loaded": True,
                   "loaded_at": "1970-01-12T13:30:00Z", "reloads": 2,
                   "reload_error": "TLS certificate and key /x: cannot be loaded"}
    assert StatusDocument.from_json(doc.to_json()) == doc
    metrics = MetricsRegistry(process_metrics=False).render(doc).decode()
    assert "# TYPE diloco_tls_cert_expiry_seconds gauge" in metrics
    assert "diloco_tls_cert_expiry_seconds 907200.0" in metrics
    builder.wall = lambda: 1_000_000.0 + 11 * DAY  # a day after expiry: negative, so an alert fires
    assert builder.document(3.0).tls.days_left == -0.5


def test_the_status_command_shows_the_certificate_and_a_failed_reload() -> None:
    from diloco_node.cli.status import render_table

    builder = StatusBuilder("site-a", "run", "learner", started_at=0.0)
    builder.wall = lambda: 0.0
    assert "tls" not in render_table(builder.document(1.0))
    builder.set_tls(node_id="site-a", fingerprint="0123456789abcdef" * 4, not_after_unix=3 * DAY,
                    ca_subject="CN=run CA", crl_loaded=False, loaded_at_unix=0.0, reloads=0, reload_error="")
    table = render_table(builder.document(1.0))
    assert ("tls certificate site-a  expires 1970-01-04T00:00:00Z (3.0 days)  CA CN=run CA  CRL no  "
            "sha256 0123456789abcdef") in table and "reload FAILED" not in table
    builder.set_tls(node_id="site-a", fingerprint="0" * 64, not_after_unix=3 * DAY, ca_subject="CN=run CA",
                    crl_loaded=False, loaded_at_unix=0.0, reloads=0, reload_error="CRL /x: cannot be loaded")
    assert ("tls reload FAILED (still serving the certificates loaded 1970-01-01T00:00:00Z): CRL /x: cannot be "
            "loaded") in render_table(builder.document(1.0))
