"""Mutual TLS between sites, in one process over loopback: members talk; every bad actor is refused
before a handler runs (another CA, an expired or revoked certificate, a certificate naming another
node than the frames claim, plain HTTP, a server that is not the site we meant); certificates
reload without a restart; the `certs` command line; the TLS configuration keys.
"""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from diloco_node.cli import main as cli_main
from diloco_node.config.settings import ConfigError, load_config
from diloco_node.ops import pki
from diloco_node.transport import Peer, PeerClient, PeerRefused, PeerServer, PeerUnreachable, kind_path
from diloco_node.transport.tls import SiteTls, TlsError, TlsFiles
from wire.auth import AuthContext, FrameVerifier, derive_frame_key
from wire.messages import Message, VoteReply, VoteRequest

from conftest import serve_peer_server, vote_request

RUN = "run-tls"
KEY = derive_frame_key(b"t" * 32)


@pytest.fixture(scope="module")
def run_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run CA with sites a, b, c; a second CA with its own site a; an expired a; a revoked a."""
    root = tmp_path_factory.mktemp("pki")
    pki.init_ca(root / "ca")
    for node in ("a", "b", "c"):
        pki.issue_site(root / "ca", node, root / node)
    pki.init_ca(root / "other-ca")
    pki.issue_site(root / "other-ca", "a", root / "stranger-a")
    long_ago = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=30)
    pki.issue_site(root / "ca", "a", root / "expired-a", valid_days=1, not_before=long_ago)
    pki.issue_site(root / "ca", "a", root / "revoked-a")
    pki.revoke(root / "ca", root / "revoked-a" / pki.SITE_CERT)
    return root


def _files(root: Path, site: str, *, crl: bool = False) -> TlsFiles:
    return TlsFiles(root / site / pki.SITE_CERT, root / site / pki.SITE_KEY, root / "ca" / pki.CA_CERT,
                    root / "ca" / pki.CA_CRL if crl else None)


class _Voter:
    def __init__(self) -> None:
        self.calls: list[Peer] = []

    async def __call__(self, message: Message, peer: Peer) -> Message:
        assert isinstance(message, VoteRequest)
        self.calls.append(peer)
        return VoteReply(epoch=message.epoch, voter="b", granted=True, reason="log is up to date")


@asynccontextmanager
async def _tls_server(tls: SiteTls, voter: _Voter) -> AsyncIterator[int]:
    server = PeerServer(AuthContext(RUN, "b", KEY), FrameVerifier(RUN, KEY, node_id="b"), certified_senders=True)
    server.on_message(VoteRequest.KIND, voter)
    runner, port = await serve_peer_server(server, tls.server_context)
    try:
        yield port
    finally:
        await runner.cleanup()


def _client(sender: str, tls: SiteTls | None) -> PeerClient:
    return PeerClient(AuthContext(RUN, sender, KEY), FrameVerifier(RUN, KEY, node_id=sender), tls=tls)


async def _send(port: int, sender: str, tls: SiteTls, *, peer: str | None = "b") -> list[Message]:
    async with _client(sender, tls) as client:
        return await client.send(f"https://127.0.0.1:{port}", vote_request(), peer=peer)


async def test_members_talk_over_mutual_tls_and_are_known_by_their_certificate(run_pki: Path) -> None:
    voter = _Voter()
    async with _tls_server(SiteTls(_files(run_pki, "b")), voter) as port:
        replies = await _send(port, "a", SiteTls(_files(run_pki, "a")))
    assert [type(r) for r in replies] == [VoteReply]
    assert [p.node_id for p in voter.calls] == ["a"]


async def test_a_chunk_served_from_read_only_arrays_crosses_tls_whole(run_pki: Path) -> None:
    """A snapshot chunk's payload given as views of read-only arrays (never copied by the server)
    goes through the TLS transport and arrives byte for byte, taken piece by piece."""
    import blake3
    import numpy as np

    from wire.messages import MessageKind, PayloadParts, SnapshotChunk, SnapshotRequest

    arrays = [np.random.default_rng(i).standard_normal(200_000).astype(np.float32) for i in range(2)]
    for array in arrays:
        array.flags.writeable = False  # as the state's arrays are
    state = b"".join(a.tobytes() for a in arrays)

    async def snapshot(message: Message, peer: Peer) -> Message:
        return SnapshotChunk(1, 3, 0, len(state), blake3.blake3(state).digest(), PayloadParts(arrays))

    server = PeerServer(AuthContext(RUN, "b", KEY), FrameVerifier(RUN, KEY, node_id="b"), certified_senders=True)
    server.on_message(MessageKind.SNAPSHOT_REQUEST, snapshot)
    runner, port = await serve_peer_server(server, SiteTls(_files(run_pki, "b")).server_context)
    try:
        async with _client("a", SiteTls(_files(run_pki, "a"))) as client:
            reply = await client.send_for_stream(f"https://127.0.0.1:{port}", SnapshotRequest(1, 0, len(state)),
                                                 reply_kind=MessageKind.SNAPSHOT_CHUNK, peer="b")
            pieces: list[bytes | memoryview] = []
            reply.feed(pieces.append)
    finally:
        await runner.cleanup()
    assert reply.sender == "b" and b"".join(pieces) == state


async def test_a_member_cannot_speak_for_another(run_pki: Path) -> None:
    """c's certificate, frames signed (with the shared run secret) as a: 403, nothing handled."""
    voter = _Voter()
    async with _tls_server(SiteTls(_files(run_pki, "b")), voter) as port:
        with pytest.raises(PeerRefused) as refused:
            await _send(port, "a", SiteTls(_files(run_pki, "c")))
    assert refused.value.status == 403
    assert "certificate names 'c' but the frame is from 'a'" in refused.value.reason
    assert voter.calls == []


def _cert_without_node_id(root: Path, out: Path) -> TlsFiles:
    """A certificate of the run CA that names a DNS host but no diloco-node:// identity."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_cert, ca_key = pki.load_ca(root / "ca")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "a")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("a")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "site.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "site.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    return TlsFiles(out / "site.crt", out / "site.key", root / "ca" / pki.CA_CERT)


async def test_a_certificate_naming_no_node_id_is_refused_before_reading(run_pki: Path, tmp_path: Path) -> None:
    voter = _Voter()
    async with _tls_server(SiteTls(_files(run_pki, "b")), voter) as port:
        with pytest.raises(PeerRefused) as refused:
            await _send(port, "a", SiteTls(_cert_without_node_id(run_pki, tmp_path / "anonymous")))
    assert refused.value.status == 403
    assert "exactly one diloco-node://<node_id> URI SAN, it names 0" in refused.value.reason
    assert voter.calls == []


@pytest.mark.parametrize("site, crl, why", [
    ("stranger-a", False, "a certificate from another CA"),
    ("expired-a", False, "an expired certificate"),
    ("revoked-a", True, "a certificate the run CA revoked"),
])
async def test_bad_certificates_are_refused_at_the_handshake(run_pki: Path, site: str, crl: bool, why: str) -> None:
    voter = _Voter()
    client_tls = SiteTls(TlsFiles(run_pki / site / pki.SITE_CERT, run_pki / site / pki.SITE_KEY,
                                  run_pki / "ca" / pki.CA_CERT))  # the client trusts the run CA
    async with _tls_server(SiteTls(_files(run_pki, "b", crl=crl)), voter) as port:
        with pytest.raises(PeerUnreachable):
            await _send(port, "a", client_tls)
        # The same server still serves a member in good standing.
        await _send(port, "a", SiteTls(_files(run_pki, "a")))
    assert [p.node_id for p in voter.calls] == ["a"], why


async def test_plain_http_is_refused_both_ways(run_pki: Path) -> None:
    voter = _Voter()
    async with _tls_server(SiteTls(_files(run_pki, "b")), voter) as port:
        # A plain-HTTP client at the TLS port: the connection is dropped, nothing is handled.
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientError):
                async with session.post(f"http://127.0.0.1:{port}{kind_path(VoteRequest.KIND)}", data=b"x") as r:
                    await r.read()
        # A TLS site never sends to a plain http:// URL.
        async with _client("a", SiteTls(_files(run_pki, "a"))) as client:
            with pytest.raises(PeerUnreachable, match="plain http is refused"):
                await client.send(f"http://127.0.0.1:{port}", vote_request(), peer="b")
    assert voter.calls == []


async def test_a_client_refuses_a_server_that_is_not_the_site_it_meant(run_pki: Path) -> None:
    """Sending to c at an address where b answers fails in the handshake, before any frame."""
    voter = _Voter()
    async with _tls_server(SiteTls(_files(run_pki, "b")), voter) as port:
        with pytest.raises(PeerUnreachable, match="(?i)hostname mismatch|not valid for 'c'"):
            await _send(port, "a", SiteTls(_files(run_pki, "a")), peer="c")
    assert voter.calls == []


async def _served_serial(port: int, client_tls: SiteTls) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_tls.client_context("b"),
                                                   server_hostname="b")
    try:
        return int(writer.get_extra_info("peercert")["serialNumber"], 16)
    finally:
        writer.close()
        await writer.wait_closed()


async def test_certificates_reload_without_a_restart(run_pki: Path, tmp_path: Path) -> None:
    site = tmp_path / "b"
    first = pki.issue_site(run_pki / "ca", "b", site)
    tls = SiteTls(TlsFiles(first.cert, first.key, first.ca))
    client_tls = SiteTls(_files(run_pki, "a"))
    voter = _Voter()
    async with _tls_server(tls, voter) as port:
        before = await _served_serial(port, client_tls)
        assert tls.reload_if_changed() is None  # nothing changed
        renewed = pki.issue_site(run_pki / "ca", "b", site, force=True)
        assert tls.reload_if_changed() is not None
        after = await _served_serial(port, client_tls)
        # A half-written key is refused and the previous certificates stay in use.
        renewed.key.write_text("-----BEGIN PRIVATE KEY-----\ntruncated")
        assert "keeping the previous certificates" in tls.reload()
        assert "cannot be loaded" in tls.last_reload_error
        kept = await _served_serial(port, client_tls)
        await _send(port, "a", client_tls)
    from cryptography import x509
    assert before != after == kept == x509.load_pem_x509_certificate(renewed.cert.read_bytes()).serial_number
    assert [p.node_id for p in voter.calls] == ["a"]


def test_unusable_tls_files_name_the_file(run_pki: Path, tmp_path: Path) -> None:
    with pytest.raises(TlsError, match="does not exist"):
        SiteTls(TlsFiles(tmp_path / "missing.crt", tmp_path / "missing.key", run_pki / "ca" / pki.CA_CERT))
    # a's certificate with b's key
    with pytest.raises(TlsError, match="cannot be loaded"):
        SiteTls(TlsFiles(run_pki / "a" / pki.SITE_CERT, run_pki / "b" / pki.SITE_KEY, run_pki / "ca" / pki.CA_CERT))


def test_certs_command_makes_a_ca_site_certificates_and_revocations(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["certs", "init", "--out", str(tmp_path / "ca")]) == 0
    assert (tmp_path / "ca" / pki.CA_KEY).stat().st_mode & 0o777 == 0o600
    assert cli_main(["certs", "issue", "--ca", str(tmp_path / "ca"), "--node-id", "site-a",
                     "--out", str(tmp_path / "site-a"), "--host", "10.0.0.5"]) == 0
    assert (tmp_path / "site-a" / pki.SITE_KEY).stat().st_mode & 0o777 == 0o600
    SiteTls(TlsFiles(tmp_path / "site-a" / pki.SITE_CERT, tmp_path / "site-a" / pki.SITE_KEY,
                     tmp_path / "site-a" / pki.CA_CERT, tmp_path / "ca" / pki.CA_CRL))  # loads as a site's files
    # Refusals are one line naming what to fix, exit 2.
    assert cli_main(["certs", "init", "--out", str(tmp_path / "ca")]) == 2
    assert cli_main(["certs", "issue", "--ca", str(tmp_path / "nowhere"), "--node-id", "x",
                     "--out", str(tmp_path / "x")]) == 2
    assert cli_main(["certs", "issue", "--ca", str(tmp_path / "ca"), "--node-id", "not a node id",
                     "--out", str(tmp_path / "y")]) == 2
    assert cli_main(["certs", "revoke", "--ca", str(tmp_path / "ca"),
                     "--cert", str(tmp_path / "site-a" / pki.SITE_CERT)]) == 0
    err = capsys.readouterr().err
    assert "exists; refusing to overwrite" in err and "certs init --out" in err and "node id" in err
    from cryptography import x509
    crl = x509.load_pem_x509_crl((tmp_path / "ca" / pki.CA_CRL).read_bytes())
    assert len(list(crl)) == 1


# ---- configuration ---------------------------------------------------------------------------


def _tls_keys(root: Path, site: str = "a") -> dict[str, str]:
    return {"tls_cert_file": str(root / site / pki.SITE_CERT), "tls_key_file": str(root / site / pki.SITE_KEY),
            "tls_ca_file": str(root / "ca" / pki.CA_CERT)}


def test_tls_is_off_by_default_and_everything_stays_on_one_port() -> None:
    node = load_config(None, {}, {"listen": "127.0.0.1:7100"}).node
    assert not node.tls_enabled and node.operator_listen is None and node.advertise == "http://127.0.0.1:7100"


def test_tls_keys_derive_https_and_a_loopback_status_listener(run_pki: Path) -> None:
    node = load_config(None, {}, {"listen": "127.0.0.1:7100", **_tls_keys(run_pki)}).node
    assert node.advertise == "https://127.0.0.1:7100" and str(node.operator_listen) == "127.0.0.1:7101"
    node = load_config(None, {}, {"listen": "127.0.0.1:7100", "status_listen": "127.0.0.1:9000",
                                  **_tls_keys(run_pki)}).node
    assert str(node.operator_listen) == "127.0.0.1:9000"


def test_tls_files_come_from_systemd_credentials(run_pki: Path, tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    for name, source in (("diloco-tls-cert", run_pki / "a" / pki.SITE_CERT),
                         ("diloco-tls-key", run_pki / "a" / pki.SITE_KEY),
                         ("diloco-tls-ca", run_pki / "ca" / pki.CA_CERT)):
        (creds / name).write_bytes(source.read_bytes())
    config = load_config(None, {"CREDENTIALS_DIRECTORY": str(creds)}, {"listen": "127.0.0.1:7100"})
    assert config.node.tls_enabled and config.node.advertise.startswith("https://")
    assert config.sources["tls_key_file"] == "systemd-credential:diloco-tls-key"


@pytest.mark.parametrize("extra, message", [
    ({"tls_cert_file": "x.crt"}, "tls_cert_file set but tls_key_file, tls_ca_file not"),
    ({"tls_crl_file": "x.crl"}, "tls_crl_file is set but TLS is not"),
    ({"advertise": "http://10.0.0.1:7100", "tls": True}, "advertise = 'http://10.0.0.1:7100': with TLS configured"),
    ({"status_listen": "127.0.0.1:7100", "tls": True}, "status_listen = '127.0.0.1:7100': must differ from listen"),
    ({"status_listen": "nonsense"}, "status_listen"),
])
def test_bad_tls_configuration_names_the_key(run_pki: Path, extra: dict[str, object], message: str) -> None:
    overrides = {"listen": "127.0.0.1:7100", **{k: v for k, v in extra.items() if k != "tls"}}
    if extra.get("tls"):
        overrides.update(_tls_keys(run_pki))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, {}, overrides)


def test_tls_contexts_are_tls13_with_client_certificates_required(run_pki: Path) -> None:
    tls = SiteTls(_files(run_pki, "a"))
    assert tls.server_context.verify_mode is ssl.CERT_REQUIRED
    assert tls.server_context.minimum_version is ssl.TLSVersion.TLSv1_3
    assert tls.client_context("b").check_hostname and not tls.client_context(None).check_hostname
    assert tls.client_context(None).verify_mode is ssl.CERT_REQUIRED
