"""`diloco-node accept-loss`: lift a node's vote barrier by accepting, explicitly, that its log
lost the entries after an index (the lone-voter case: docs/OPERATIONS.md, "A voter that lost log
entries").

Asks the node's operator listener (`POST /accept-loss`, loopback only). The node refuses unless
`--lost-after` is the index it reports on /status (`storage.vote_barrier_help.lost_after`), and
records who accepted what, and why, in `coordination/loss-accepted.json` before it votes again.
Uses urllib (blocking, stdlib), like `diloco-node status`: it must start fast and never import JAX.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from diloco_node.cli.status import DEFAULT_TIMEOUT_S, post_operator

EXIT_ACCEPTED = 0
EXIT_NOT_DONE = 1  # refused (no barrier, another index, a bad request), or the node is unreachable


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--peer", metavar="URL", required=True,
                        help="the node's operator listener: status_listen with TLS, the node's own port without")
    parser.add_argument("--lost-after", type=int, required=True, metavar="INDEX",
                        help="the index after which the node lost its entries, as its /status says")
    parser.add_argument("--by", required=True, metavar="NAME", help="who accepts the loss (recorded)")
    parser.add_argument("--reason", required=True, help="why (recorded)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help=f"seconds to wait for the answer (default {DEFAULT_TIMEOUT_S:g})")


def run(args: argparse.Namespace) -> int:
    return accept_loss_command(args.peer, args.lost_after, args.by, args.reason, args.timeout, sys.stdout, sys.stderr)


def accept_loss_command(peer: str, lost_after: int, by: str, reason: str, timeout: float,
                        out: TextIO, err: TextIO) -> int:
    status, answer = post_operator(peer, "/accept-loss", {"lost_after": lost_after, "by": by, "reason": reason},
                                   timeout if timeout > 0 else DEFAULT_TIMEOUT_S)
    if status == 200:
        print(answer.get("message", "accepted"), file=out)
        return EXIT_ACCEPTED
    print(f"diloco-node accept-loss: {answer.get('error', f'HTTP {status}')}", file=err)
    return EXIT_NOT_DONE
