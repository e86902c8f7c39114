"""`diloco-node certs`: a run CA and site certificates for operators without a PKI of their own.

Thin: the work is `diloco_node.ops.pki`. Three actions:
- `certs init --out DIR`: a new run CA (DIR/ca.crt, DIR/ca.key mode 0600, DIR/ca.crl empty);
- `certs issue --ca DIR --node-id ID --out DIR [--host NAME_OR_IP ...]`: a site's certificate and
  key, plus a copy of ca.crt: the three files `[node] tls_cert_file`, `tls_key_file`, `tls_ca_file`;
- `certs revoke --ca DIR --cert FILE`: add a certificate to the CA's CRL (copy it to every site's
  `tls_crl_file`; sites reload it on SIGHUP or when the file changes).
Exit 0 on success; 2 with a one-line message naming the file or value to fix. No JAX is imported.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from diloco_node.config.settings import SITE_NODE_ID_PATTERN
from diloco_node.ops import pki


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    init = actions.add_parser("init", help="make a run CA in DIR")
    init.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory for ca.crt, ca.key, ca.crl")
    init.add_argument("--force", action="store_true", help="replace an existing CA in DIR")
    issue = actions.add_parser("issue", help="issue a site certificate signed by the run CA")
    issue.add_argument("--ca", required=True, type=Path, metavar="DIR", help="the CA directory made by `certs init`")
    issue.add_argument("--node-id", required=True, metavar="ID", help="the site's node_id (its certificate names it)")
    issue.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory for site.crt, site.key, ca.crt")
    issue.add_argument("--host", action="append", default=[], metavar="NAME_OR_IP",
                       help="an extra DNS name or IP address in the certificate (repeatable; never an identity)")
    issue.add_argument("--days", type=int, default=pki.SITE_VALID_DAYS, help="validity in days")
    issue.add_argument("--force", action="store_true", help="replace an existing site.crt/site.key (renewal)")
    revoke = actions.add_parser("revoke", help="add a site certificate to the run CA's revocation list")
    revoke.add_argument("--ca", required=True, type=Path, metavar="DIR", help="the CA directory made by `certs init`")
    revoke.add_argument("--cert", required=True, type=Path, metavar="FILE", help="the certificate to revoke")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "init":
            cert = pki.init_ca(args.out, force=args.force)
            print(f"run CA written: {cert} (keep {args.out / pki.CA_KEY} offline; give every site {cert.name})")
        elif args.action == "issue":
            if not SITE_NODE_ID_PATTERN.fullmatch(args.node_id):
                raise pki.PkiError(f"--node-id {args.node_id!r}: not a node id (1-63 of A-Z a-z 0-9 . _ -)")
            if args.days <= 0:
                raise pki.PkiError(f"--days {args.days}: must be positive")
            issued = pki.issue_site(args.ca, args.node_id, args.out, hosts=tuple(args.host), force=args.force,
                                    valid_days=args.days)
            print(f"certificate for {args.node_id} written; in its [node] table:\n"
                  f'tls_cert_file = "{issued.cert.resolve()}"\ntls_key_file = "{issued.key.resolve()}"\n'
                  f'tls_ca_file = "{issued.ca.resolve()}"')
        else:
            crl, serial = pki.revoke(args.ca, args.cert)
            print(f"revoked serial {serial:x}; copy {crl} to every site's tls_crl_file")
    except pki.PkiError as error:
        print(f"diloco-node certs {args.action}: {error}", file=sys.stderr)
        return 2
    return 0
