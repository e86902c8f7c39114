"""A run's own small PKI: make a run CA, issue site certificates, revoke them (a CRL).

For operators without a PKI of their own (`diloco-node certs init|issue|revoke`) and for the
testbed, which gives every local TLS site its own certificate. Built on the `cryptography`
library; nothing here touches the network.

A site certificate names its node id twice, each for one reader (docs/OPERATIONS.md, "Mutual TLS"):
- a URI SAN `diloco-node://<node_id>`: the identity the *server* reads from a client's verified
  certificate and compares with the sender of every frame (transport/tls.py);
- a DNS SAN `<node_id>`: the name the *client* asks for at the handshake (as the TLS server name),
  so a connection to a site that is not the one it meant to reach fails before a byte is sent.
Extra `hosts` (DNS names or IP addresses) may be added; they are never read as identities.

Keys are ECDSA P-256: small, fast handshakes, supported by every TLS 1.3 stack. Private keys
are written with mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NODE_ID_URI_PREFIX = "diloco-node://"
CA_CERT, CA_KEY, CA_CRL = "ca.crt", "ca.key", "ca.crl"
SITE_CERT, SITE_KEY = "site.crt", "site.key"
# A run CA outlives any run we know of; site certificates are renewed by re-issuing (the daemon
# reloads them without a restart), so a year keeps a stolen key's usefulness bounded.
CA_VALID_DAYS = 3650
SITE_VALID_DAYS = 365
# Clocks of sites differ by seconds, not minutes: a certificate valid from "now" would be refused
# by a peer whose clock is slightly behind.
BACKDATE = datetime.timedelta(minutes=5)
# A CRL is reissued by `certs revoke`; peers must reload it before this runs out.
CRL_VALID_DAYS = 365


class PkiError(Exception):
    """A CA directory, certificate or key is unusable; the message says which file and why."""


@dataclass(frozen=True, slots=True)
class Issued:
    """Where `issue_site` wrote a site's certificate and key."""

    cert: Path
    key: Path
    ca: Path


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _write(path: Path, data: bytes, *, private: bool, force: bool) -> None:
    if path.exists() and not force:
        raise PkiError(f"{path} exists; refusing to overwrite it (pass --force to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    if private:
        os.chmod(path, 0o600)  # an existing file kept its old mode through O_CREAT


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def init_ca(out: Path, *, name: str = "diloco-node run CA", force: bool = False,
            valid_days: int = CA_VALID_DAYS) -> Path:
    """A new run CA in `out` (ca.crt, ca.key 0600, and an empty ca.crl); returns ca.crt's path."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE).not_valid_after(now + datetime.timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write(out / CA_KEY, _key_pem(key), private=True, force=force)
    _write(out / CA_CERT, _cert_pem(cert), private=False, force=force)
    _write(out / CA_CRL, _crl_pem(cert, key, []), private=False, force=force)
    return out / CA_CERT


def load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA certificate and key of a directory made by `init_ca`."""
    try:
        cert = x509.load_pem_x509_certificate((ca_dir / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), password=None)
    except OSError as error:
        raise PkiError(f"CA directory {ca_dir}: cannot read {error.filename}: {error.strerror} "
                       "(make one with: diloco-node certs init --out DIR)") from None
    except ValueError as error:
        raise PkiError(f"CA directory {ca_dir}: not a PEM certificate and key: {error}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"CA directory {ca_dir}: {CA_KEY} is not an EC key made by `certs init`")
    return cert, key


def issue_site(ca_dir: Path, node_id: str, out: Path, *, hosts: tuple[str, ...] = (), force: bool = False,
               valid_days: int = SITE_VALID_DAYS, not_before: datetime.datetime | None = None) -> Issued:
    """A certificate for site `node_id`, signed by the CA in `ca_dir`: out/site.crt, out/site.key
    (0600) and a copy of the CA certificate (out/ca.crt), which is all a site needs."""
    ca_cert, ca_key = load_ca(ca_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(NODE_ID_URI_PREFIX + node_id),
                                     x509.DNSName(node_id)]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    start = (not_before or _now()) - BACKDATE
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            # Each site is both a TLS server (to its peers) and a client (of them).
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write(out / SITE_KEY, _key_pem(key), private=True, force=force)
    _write(out / SITE_CERT, _cert_pem(cert), private=False, force=force)
    if (out / CA_CERT).resolve() != (ca_dir / CA_CERT).resolve():
        _write(out / CA_CERT, _cert_pem(ca_cert), private=False, force=True)
    return Issued(out / SITE_CERT, out / SITE_KEY, out / CA_CERT)


def _crl_pem(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, serials: list[int]) -> bytes:
    now = _now()
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject)
               .last_update(now - BACKDATE).next_update(now + datetime.timedelta(days=CRL_VALID_DAYS)))
    for serial in serials:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now - BACKDATE).build())
    return _crl_to_pem(builder.sign(ca_key, hashes.SHA256()))


def _crl_to_pem(crl: x509.CertificateRevocationList) -> bytes:
    return crl.public_bytes(serialization.Encoding.PEM)


def revoke(ca_dir: Path, cert_file: Path) -> tuple[Path, int]:
    """Add `cert_file`'s serial to the CA's CRL (ca_dir/ca.crl, rewritten); returns (crl, serial).

    Copy the CRL to every site's `tls_crl_file`: a site reloads it (SIGHUP or on change) and refuses
    the revoked certificate at the next handshake."""
    ca_cert, ca_key = load_ca(ca_dir)
    try:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    except (OSError, ValueError) as error:
        raise PkiError(f"certificate {cert_file}: cannot read it: {error}") from None
    if cert.issuer != ca_cert.subject:
        raise PkiError(f"certificate {cert_file} was not issued by the CA in {ca_dir}")
    serials = []
    crl_path = ca_dir / CA_CRL
    if crl_path.exists():
        old = x509.load_pem_x509_crl(crl_path.read_bytes())
        serials = [entry.serial_number for entry in old]
    if cert.serial_number not in serials:
        serials.append(cert.serial_number)
    _write(crl_path, _crl_pem(ca_cert, ca_key, serials), private=False, force=True)
    return crl_path, cert.serial_number
