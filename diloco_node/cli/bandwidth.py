"""`diloco-node bandwidth`: print the cross-site bandwidth arithmetic, optionally as JSON.

Parsing and printing only; the calculator is diloco_node.sim.bandwidth. Imports no JAX.
"""

from __future__ import annotations

import argparse
import json
import sys

from diloco_node.sim import bandwidth
from diloco_node.sim.bandwidth import BandwidthInputs

_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """'12e9', '12B', '1.5T' -> a float; argparse turns the ValueError into exit code 2."""
    cleaned = text.strip().lower()
    scale = 1.0
    if cleaned and cleaned[-1] in _SUFFIXES:
        scale = _SUFFIXES[cleaned[-1]]
        cleaned = cleaned[:-1]
    try:
        return float(cleaned) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (use e.g. 12e9 or 12B)") from None


def add_arguments(parser: argparse.ArgumentParser, name: str = "bandwidth") -> None:
    d = BandwidthInputs(params=1, step_time_s=1)
    parser.add_argument("--params", type=parse_count,
                        help="model parameters, e.g. 12B or 12e9 (required unless --paper)")
    parser.add_argument("--step-time", type=float, help="seconds per step (required unless --paper)")
    parser.add_argument("--sites", type=int, default=d.sites, help="sites / learners (default: %(default)s)")
    parser.add_argument("--fragments", "-P", type=int, default=d.fragments, help="P (default: %(default)s)")
    parser.add_argument("--period", "-H", type=int, default=d.period, help="H (default: %(default)s)")
    parser.add_argument("--tau", type=int, default=d.tau, help="overlap steps tau (default: %(default)s)")
    parser.add_argument("--dp-bits", type=float, default=d.dp_bits,
                        help="bits per gradient value for data-parallel (default: %(default)s, bf16)")
    parser.add_argument("--bits", type=float, default=d.decoupled_bits,
                        help="bits per value learner -> syncer (default: %(default)s, int4)")
    parser.add_argument("--down-bits", type=float, default=d.down_bits,
                        help="bits per value syncer -> learner (default: %(default)s)")
    parser.add_argument("--target-utilisation", type=float, default=d.target_utilisation,
                        help="compute utilisation to keep, in (0, 1] (default: %(default)s)")
    parser.add_argument("--dp-overlap", type=float, default=d.dp_overlap,
                        help="share of a step the data-parallel all-reduce hides behind "
                             "(default: %(default)s; ~0.67 if only the backward pass)")
    parser.add_argument("--paper", action="store_true",
                        help="use the assumed paper setting and compare with 198 / 0.84 Gbps")
    parser.add_argument("--json", help="also write the report as JSON to this path ('-' = stdout)")


def run(args: argparse.Namespace) -> int:
    params, step = args.params, args.step_time
    if args.paper:
        paper = bandwidth.paper_setting()
        params = paper.params if params is None else params
        step = paper.step_time_s if step is None else step
    if params is None or step is None:
        print("diloco-node bandwidth: error: --params and --step-time are required "
              "(or pass --paper)", file=sys.stderr)
        return 2
    try:
        inputs = BandwidthInputs(
            params=params,
            step_time_s=step,
            sites=args.sites,
            fragments=args.fragments,
            period=args.period,
            tau=args.tau,
            dp_bits=args.dp_bits,
            decoupled_bits=args.bits,
            down_bits=args.down_bits,
            target_utilisation=args.target_utilisation,
            dp_overlap=args.dp_overlap,
        )
    except ValueError as exc:
        print(f"diloco-node bandwidth: error: {exc}", file=sys.stderr)
        return 2
    report = bandwidth.compute(inputs)
    text_out = sys.stderr if args.json == "-" else sys.stdout
    print("\n".join(report.lines), file=text_out)
    payload = report.to_dict()
    if args.paper:
        comparison = paper_comparison(report)
        payload["paper_comparison"] = comparison
        print("", file=text_out)
        print("against the paper (8 datacenters)", file=text_out)
        for key in ("data_parallel", "decoupled"):
            c = comparison[key]
            print(f"  {key}: ours {c['ours_gbps']:.4g} vs paper {c['paper_gbps']:g} Gbit/s "
                  f"-> {c['factor']:.3g}x", file=text_out)
        print(f"  ratio: ours {report.paper_ratio:.4g}x vs paper "
              f"{comparison['paper_ratio']:.4g}x", file=text_out)
    if args.json == "-":
        json.dump(payload, sys.stdout, indent=1)
        print()
    elif args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(payload, fh, indent=1)
                fh.write("\n")
        except OSError as exc:
            print(f"diloco-node bandwidth: error: cannot write {args.json}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.json}", file=text_out)
    return 0


def paper_comparison(report: bandwidth.BandwidthReport) -> dict[str, object]:
    """Ours (paper accounting) over the paper's figure; > 1 means we need more bandwidth."""
    ours_dp, ours_dec = report.dp_paper_gbps, report.decoupled_paper_gbps
    return {
        "data_parallel": {"ours_gbps": ours_dp, "paper_gbps": bandwidth.PAPER_DP_GBPS,
                          "factor": ours_dp / bandwidth.PAPER_DP_GBPS},
        "decoupled": {"ours_gbps": ours_dec, "paper_gbps": bandwidth.PAPER_DECOUPLED_GBPS,
                      "factor": ours_dec / bandwidth.PAPER_DECOUPLED_GBPS},
        "paper_ratio": bandwidth.PAPER_DP_GBPS / bandwidth.PAPER_DECOUPLED_GBPS,
    }
