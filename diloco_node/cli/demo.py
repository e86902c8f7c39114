"""`diloco-node demo`: the main job on its built-in default (diloco_node/testbed/demo.py).

Four local sites as real processes behind emulated WAN links, the coordinator killed and
restarted midway, a summary at the end; exit 0 when the global model improved.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser, name: str = "demo") -> None:
    parser.add_argument("--train-s", type=float, default=90.0, help="training time before and after the kill")
    parser.add_argument("--bandwidth-mbit", type=float, default=50.0, help="each site's emulated link, Mbit/s")
    parser.add_argument("--latency-ms", type=float, default=40.0, help="one-way latency of each link")


def run(args: argparse.Namespace) -> int:
    from diloco_node.testbed.demo import run_demo  # imports JAX only when the demo runs

    return run_demo(args)
