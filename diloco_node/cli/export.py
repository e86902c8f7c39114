"""`diloco-node export`: write the global model from a site's newest verified checkpoint to a file.

Thin: the work is `diloco_node.ops.export`. Safe to run beside the site's running node (it only
reads the data directory). Exit 0 on success; 2 with a one-line message when the export cannot be
done (no data directory, no checkpoint, every checkpoint corrupt, output exists or is not
writable, unknown format). No JAX is imported, except by `--format hf` (a Hugging Face Llama
directory: the run's llama options are resolved by the factory's configuration).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TextIO

from diloco_node.config.settings import ConfigError, load_config
from diloco_node.ops.export import FORMATS, HF_FORMAT, ExportError, export_global_model


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--data-dir", type=Path, metavar="DIR",
                        help="the site's data directory (its node's data_dir; default: --config's)")
    parser.add_argument("--out", required=True, type=Path, metavar="PATH",
                        help="the file to write, e.g. model.safetensors or model.npz; with --format hf a directory")
    # No argparse `choices`: an unknown format gets the same one-line error as every other problem.
    parser.add_argument("--format", default=None, metavar="FORMAT",
                        help=f"{' or '.join(FORMATS)} (default: from the suffix of --out; {HF_FORMAT}: a Hugging "
                             "Face Llama directory for transformers, llama runs only)")
    parser.add_argument("--force", action="store_true", help="replace PATH if it exists")
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="the site's config file: its data_dir and (hf) its [node.data] tokenizer")
    parser.add_argument("--tokenizer", type=Path, metavar="FILE",
                        help="hf: the tokenizer.json to put beside the model (default: --config's [node.data] tokenizer)")
    parser.add_argument("--bos-token-id", type=int, default=None, metavar="ID", help="hf: config.json bos_token_id")
    parser.add_argument("--eos-token-id", type=int, default=None, metavar="ID", help="hf: config.json eos_token_id")


def run(args: argparse.Namespace) -> int:
    data_dir, tokenizer = args.data_dir, args.tokenizer
    if args.config is not None:
        try:
            node = load_config(args.config, os.environ).node
        except ConfigError as error:
            print(f"diloco-node export: --config {args.config}: {error}", file=sys.stderr)
            return 2
        data_dir = data_dir or node.data_dir
        if tokenizer is None and args.format == HF_FORMAT and node.data.tokenizer:
            tokenizer = Path(node.data.tokenizer)
    if data_dir is None:
        print("diloco-node export: pass --data-dir DIR (or --config FILE, whose data_dir is used)", file=sys.stderr)
        return 2
    return export_command(data_dir, args.out, args.format, args.force, sys.stdout, sys.stderr, tokenizer=tokenizer,
                          bos_token_id=args.bos_token_id, eos_token_id=args.eos_token_id)


def export_command(data_dir: Path, out: Path, fmt: str | None, force: bool, stdout: TextIO, stderr: TextIO, *,
                   tokenizer: Path | None = None, bos_token_id: int | None = None,
                   eos_token_id: int | None = None) -> int:
    try:
        result = export_global_model(data_dir, out, fmt, force=force, tokenizer=tokenizer,
                                     bos_token_id=bos_token_id, eos_token_id=eos_token_id)
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
