"""Mutual TLS between sites: the site's SSL contexts, their reload, and a peer's certified node id.

`SiteTls` builds, from the site's certificate, key, the run's CA (and optionally the CA's CRL):
- one *server* context: TLS 1.3 only, a client certificate required and verified against the run CA;
- two *client* contexts: both present our certificate and verify the peer's against the run CA;
  `client_context(peer)` with a peer's node id also checks, during the handshake, that the
  server's certificate names that node id (its DNS SAN, asked for as the TLS server name), so a
  delta never starts towards the wrong site; without one (a joiner asking a bootstrap address)
  only the CA is checked.
`reload()` (SIGHUP) and `reload_if_changed()` (the files' mtimes) build new contexts from the
files and swap them in only once all of them loaded: a half-written key never takes the site
down. New connections use the new contexts; open ones finish on the old (the server's one
context object switches per connection to the newest in its `sni_callback`).

`certified_node_id(ssl_object)` is the identity the server compares with the sender of every frame
on that connection: the single URI SAN `diloco-node://<node_id>` of the verified client
certificate (diloco_node/ops/pki.py writes it; docs/OPERATIONS.md documents it).
`SiteTls.facts` describes the site's own certificate as loaded (node id, fingerprint, expiry, CA,
CRL) for /status and the expiry gauge. `certificate_sha256(ssl_object)` is a peer certificate's fingerprint, which an eviction records
(diloco_node/sync/evictions.py) so the evicted site's certificate is refused for the rest of the run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import ssl
import time
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

log = logging.getLogger(__name__)

NODE_ID_URI_PREFIX = "diloco-node://"  # the same as diloco_node.ops.pki's (transport must not import ops)


class TlsError(Exception):
    """The site's TLS files cannot be loaded; the message names the file and the reason."""


@dataclasses.dataclass(frozen=True, slots=True)
class TlsFiles:
    """The files a TLS site needs: its certificate chain and key, the run CA, and optionally a CRL."""

    cert: Path
    key: Path
    ca: Path
    crl: Path | None = None

    def paths(self) -> tuple[Path, ...]:
        return tuple(p for p in (self.cert, self.key, self.ca, self.crl) if p is not None)


@dataclasses.dataclass(frozen=True, slots=True)
class _Contexts:
    server: ssl.SSLContext
    client_named: ssl.SSLContext  # checks the server's certificate names the peer we meant
    client_any: ssl.SSLContext  # CA only: the receiver's node id is not known


def _verifying(context: ssl.SSLContext, files: TlsFiles) -> ssl.SSLContext:
    # Both ends are this program: TLS 1.3 only (no renegotiation, fewer round trips, no weak suites).
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    _load(files.cert, lambda: context.load_cert_chain(files.cert, files.key), what="certificate and key",
          also=files.key)
    # Only the run CA: the system's trust store would let in every certificate any public CA issued.
    _load(files.ca, lambda: context.load_verify_locations(cafile=files.ca), what="CA certificate")
    if files.crl is not None:
        crl = files.crl
        _load(crl, lambda: context.load_verify_locations(cafile=crl), what="CRL")
        context.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return context


def _load(path: Path, load, *, what: str, also: Path | None = None) -> None:
    try:
        load()
    except FileNotFoundError as error:
        raise TlsError(f"TLS {what}: {error.filename or path} does not exist") from None
    except (ssl.SSLError, OSError, ValueError) as error:
        where = f"{path} / {also}" if also is not None else str(path)
        raise TlsError(f"TLS {what} {where}: cannot be loaded: {error}") from None


def build_contexts(files: TlsFiles) -> _Contexts:
    server = _verifying(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), files)
    named = _verifying(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), files)  # check_hostname is on by default
    anyone = _verifying(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), files)
    anyone.check_hostname = False  # still verified against the run CA (verify_mode stays CERT_REQUIRED)
    return _Contexts(server, named, anyone)


def certified_node_id(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> tuple[str | None, str]:
    """The node id a verified peer certificate names, and why (a refusal's reason when None)."""
    if ssl_object is None:
        return None, "plain connection: this node accepts peers over mutual TLS only"
    cert = ssl_object.getpeercert()
    if not cert:
        return None, "the peer presented no verified certificate"
    ids = [value[len(NODE_ID_URI_PREFIX):] for kind, value in cert.get("subjectAltName", ())
           if kind == "URI" and value.startswith(NODE_ID_URI_PREFIX)]
    if len(ids) != 1:
        return None, (f"the peer's certificate must name exactly one {NODE_ID_URI_PREFIX}<node_id> URI SAN, "
                      f"it names {len(ids)}")
    return ids[0], f"certificate names {ids[0]!r}"


@dataclasses.dataclass(frozen=True, slots=True)
class CertificateFacts:
    """The site's own certificate as loaded: what an operator checks before it expires."""

    node_id: str  # its diloco-node://<node_id> URI SAN ("" when it names none)
    fingerprint: str  # SHA-256 of the certificate (DER), 64 lowercase hex digits
    not_after_unix: float
    ca_subject: str  # the run CA's subject (RFC 4514), the first certificate of tls_ca_file
    crl_loaded: bool


def read_facts(files: TlsFiles) -> CertificateFacts:
    """Facts of the (already loaded) files; TlsError naming the file if one cannot be parsed."""
    try:
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
        ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    except (OSError, ValueError) as error:
        raise TlsError(f"TLS certificate {files.cert} / CA {files.ca}: cannot be read: {error}") from None
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    ids = [u[len(NODE_ID_URI_PREFIX):] for u in uris if u.startswith(NODE_ID_URI_PREFIX)]
    return CertificateFacts(node_id=ids[0] if len(ids) == 1 else "",
                            fingerprint=hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest(),
                            not_after_unix=cert.not_valid_after_utc.timestamp(),
                            ca_subject=ca.subject.rfc4514_string(), crl_loaded=files.crl is not None)


def certificate_sha256(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> str | None:
    """The SHA-256 of the peer's verified certificate (DER), as 64 lowercase hex digits; None without one."""
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    return hashlib.sha256(der).hexdigest() if der else None


class SiteTls:
    """The site's current TLS contexts, rebuilt from its files on demand."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._stamps = self._file_stamps()
        self._current = build_contexts(files)  # TlsError at start-up: the daemon refuses to start
        self.facts = read_facts(files)
        self.loaded_at_unix = time.time()  # when the certificates in use were loaded (start or reload)
        self.reloads = 0
        self.last_reload_error = ""
        # The server context handed to aiohttp stays the same object; every connection is moved
        # to the newest context as its handshake starts (called with or without an SNI name).
        self._listener = build_contexts(files).server
        self._listener.sni_callback = self._pick_server_context

    def _pick_server_context(self, ssl_object: ssl.SSLObject, server_name: str | None,
                             context: ssl.SSLContext) -> None:
        current = self._current.server
        if ssl_object.context is not current:
            ssl_object.context = current

    @property
    def server_context(self) -> ssl.SSLContext:
        return self._listener

    def client_context(self, peer: str | None) -> ssl.SSLContext:
        """For a request to `peer` (its node id; None when not known)."""
        return self._current.client_named if peer else self._current.client_any

    def _file_stamps(self) -> tuple[tuple[int, int], ...]:
        stamps = []
        for path in self.files.paths():
            try:
                info = os.stat(path)
                stamps.append((info.st_mtime_ns, info.st_size))
            except OSError:
                stamps.append((-1, -1))
        return tuple(stamps)

    def reload(self) -> str:
        """Rebuild the contexts from the files; keep the old ones if that fails. Returns what happened."""
        stamps = self._file_stamps()
        try:
            contexts = build_contexts(self.files)
            facts = read_facts(self.files)
        except TlsError as error:
            self._stamps = stamps  # retried when a file changes again, not on every check
            self.last_reload_error = str(error)
            return f"TLS reload failed, keeping the previous certificates: {error}"
        self._current = contexts
        self.facts = facts
        self.loaded_at_unix = time.time()
        self._stamps = stamps
        self.reloads += 1
        self.last_reload_error = ""
        return f"TLS certificates reloaded from {self.files.cert} (reload {self.reloads})"

    def reload_if_changed(self) -> str | None:
        """`reload()` when a file's mtime or size changed since the last load; None when none did."""
        if self._file_stamps() == self._stamps:
            return None
        return self.reload()
