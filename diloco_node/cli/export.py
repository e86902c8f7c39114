"""`diloco-node export`: write the global model from a site's newest verified checkpoint to a file.

Thin: the work is `diloco_node.ops.export`. Safe to run beside the site's running node (it only
reads the data directory). Exit 0 on success; 2 with a one-line message when the export cannot be
done (no data directory, no checkpoint, every checkpoint corrupt, output exists or is not
writable, unknown format). No JAX is imported.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from diloco_node.ops.export import FORMATS, ExportError, export_global_model


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--data-dir", required=True, type=Path, metavar="DIR",
                        help="the site's data directory (its node's data_dir)")
    parser.add_argument("--out", required=True, type=Path, metavar="FILE",
                        help="the file to write, e.g. model.safetensors or model.npz")
    # No argparse `choices`: an unknown format gets the same one-line error as every other problem.
    parser.add_argument("--format", default=None, metavar="FORMAT",
                        help=f"{' or '.join(FORMATS)} (default: from the suffix of --out)")
    parser.add_argument("--force", action="store_true", help="replace FILE if it exists")


def run(args: argparse.Namespace) -> int:
    return export_command(args.data_dir, args.out, args.format, args.force, sys.stdout, sys.stderr)


def export_command(data_dir: Path, out: Path, fmt: str | None, force: bool, stdout: TextIO, stderr: TextIO) -> int:
    try:
        result = export_global_model(data_dir, out, fmt, force=force)
    except ExportError as error:
        print(f"diloco-node export: {error}", file=stderr)
        return 2
    for reason in result.model.skipped:
        print(f"diloco-node export: skipped a newer checkpoint: {reason}", file=stderr)
    meta = result.model.metadata
    print(f"exported {len(result.model.params)} tensors ({result.num_parameters} parameters) from "
          f"{result.model.checkpoint} (commit index {meta['commit_index']}, state digest "
          f"{meta['state_digest'][:16]}) to {result.out} ({result.format})", file=stdout)
    return 0
