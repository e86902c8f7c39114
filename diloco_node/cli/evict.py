"""`diloco-node evict`: remove a site from this run for good, through the local node's operator listener.

The node it asks must hold the lease: it appends the replicated eviction (docs/OPERATIONS.md,
"Evicting a site"). Any other node answers which member holds the lease, and the command says to
run it again on that member's host (the operator listener answers /evict on loopback only).
Uses urllib (blocking, stdlib), like `diloco-node status`: it must start fast and never import JAX.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from diloco_node.cli.status import DEFAULT_TIMEOUT_S, post_operator

# The node waits up to two lease times for the eviction to commit; the request needs more.
DEFAULT_EVICT_TIMEOUT_S = 30.0
# An answer is a small JSON object.

EXIT_EVICTED = 0
EXIT_NOT_DONE = 1  # refused, not the lease holder, unreachable, or appended but not committed yet


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--peer", metavar="URL", required=True,
                        help="the local node's operator listener: status_listen with TLS (by default "
                             "http://127.0.0.1:<port+1>), the node's own port without")
    parser.add_argument("--node-id", required=True, help="the node id of the site to evict")
    parser.add_argument("--reason", default="", help="why (shown to the evicted site in every refusal)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_EVICT_TIMEOUT_S, metavar="S",
                        help=f"seconds to wait for the answer (default {DEFAULT_EVICT_TIMEOUT_S:g})")


def run(args: argparse.Namespace) -> int:
    return evict_command(args.peer, args.node_id, args.reason, args.timeout, sys.stdout, sys.stderr)


def request_eviction(peer: str, node_id: str, reason: str, timeout: float) -> tuple[int, dict[str, Any]]:
    """POST <peer>/evict; (HTTP status, JSON answer). OSError-like failures become status 0."""
    return post_operator(peer, "/evict", {"node_id": node_id, "reason": reason}, timeout)


def evict_command(peer: str, node_id: str, reason: str, timeout: float, out: TextIO, err: TextIO) -> int:
    status, answer = request_eviction(peer, node_id, reason, timeout if timeout > 0 else DEFAULT_TIMEOUT_S)
    if status == 200:
        print(answer.get("message", f"{node_id} evicted"), file=out)
        return EXIT_EVICTED
    if status == 202:
        print(f"diloco-node evict: {answer.get('message')}; check `diloco-node status` for the commit", file=err)
        return EXIT_NOT_DONE
    message = answer.get("error", f"HTTP {status}")
    holder_url = answer.get("lease_holder_url")
    if holder_url:
        message += f"; its peer URL is {holder_url}"
    print(f"diloco-node evict: {message}", file=err)
    return EXIT_NOT_DONE
