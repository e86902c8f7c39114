"""Evaluating any checkpoint on a site's eval data: `diloco-node eval`'s work.

`load_model(path, site_seq_len)` reads a model from any of: a node's data directory (the global
model of its newest verified checkpoint, as `diloco-node export` finds it), an export file
(`diloco-node export`'s safetensors or npz), or a Hugging Face Llama directory (learn/hf_llama.py).
`eval_streams(node)` opens the site's eval data: its `[node.data.eval.NAME]` sets, else its
held-out slice as set "held_out". `evaluate(model, streams, max_tokens)` scores it.

The windows are fixed, so a figure is reproducible and comparable across models and sites:
window i holds tokens [i·L, (i+1)·L] of a set's stream (L + 1 tokens: L inputs and their L next
tokens), i = 0, 1, ... while they fit in `max_tokens` (default: the whole set). The loss is the
mean next-token cross-entropy over every predicted token; windows are batched for speed and each
batch's mean is weighted by its tokens, so the figure does not depend on the batching.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diloco_node.config.manifest import ConfigError, ModelSpec, RunManifest
from diloco_node.config.site_data import HELD_OUT_SET
from diloco_node.learn import data as data_lib
from diloco_node.learn import hf_llama
from diloco_node.ops import export as export_lib

# Windows scored in one call: enough to keep an accelerator busy on small models, small enough
# that a batch of 8 long windows of a large vocabulary (8 × 4096 × 128k logits) fits in memory.
WINDOWS_PER_BATCH = 8


class EvalError(Exception):
    """The evaluation cannot be done; the one-line message says why and names the path or set."""


@dataclass(frozen=True)
class LoadedModel:
    spec: ModelSpec  # what builds the model (factory, options, vocab_size, seq_len)
    params: Mapping[str, np.ndarray]  # flat float32 parameters, our names
    source: str  # what was read, for messages: "data directory ...", "export ...", "Hugging Face Llama ..."


@dataclass(frozen=True)
class SetResult:
    loss: float
    tokens: int  # predicted tokens scored (windows × L)


def load_model(path: Path, site_seq_len: int) -> LoadedModel:
    """The model at `path` (module docstring). A Hugging Face directory has no run seq_len: its
    `max_position_embeddings`, capped by the site's `[run.model] seq_len`, is the window."""
    path = Path(path)
    if path.is_dir() and (path / export_lib.COORDINATION_DIR / export_lib.IDENTITY_FILE).exists():
        try:
            model = export_lib.read_global_model(path)
            manifest = export_lib.read_run_manifest(path)
        except export_lib.ExportError as error:
            raise EvalError(str(error)) from None
        return LoadedModel(manifest.model, model.params, f"data directory {path} ({model.checkpoint.name})")
    if path.is_dir() and (path / hf_llama.CONFIG_FILE).exists():
        try:
            config = hf_llama.read_config(path)
            imported = hf_llama.import_llama(path)
        except ConfigError as error:
            raise EvalError(str(error)) from None
        context = config.get("max_position_embeddings")
        seq_len = min(int(context), site_seq_len) if isinstance(context, int) and context > 0 else site_seq_len
        options = dict(imported.options)
        vocab = options.pop("vocab_size")
        return LoadedModel(ModelSpec.of("llama", vocab_size=vocab, seq_len=seq_len, **options), imported.params,
                           f"Hugging Face Llama {path}")
    if path.is_file():
        try:
            params, metadata = export_lib.load_export(path)
            manifest = RunManifest.from_dict(json.loads(metadata["manifest"]))
        except export_lib.ExportError as error:
            raise EvalError(f"--model {path}: not an export of `diloco-node export` ({error})") from None
        except (KeyError, ValueError, TypeError, ConfigError) as error:
            raise EvalError(f"--model {path}: its export metadata holds no readable run manifest ({error})") from None
        return LoadedModel(manifest.model, params, f"export {path}")
    raise EvalError(f"--model {path}: not a node's data directory (no {export_lib.COORDINATION_DIR}/"
                    f"{export_lib.IDENTITY_FILE}), a Hugging Face Llama directory (no {hf_llama.CONFIG_FILE}) or "
                    "an export file; pass one of these")


def eval_streams(data: Any, cache_dir: Path | None) -> dict[str, Any]:
    """The site's eval data by set name: its `[node.data.eval.NAME]` sets read whole, else the
    held-out slice of its training data (the one the site evaluates) as "held_out"."""
    try:
        if data.eval:
            return dict(data_lib.open_eval_sets(data, cache_dir))
        return {HELD_OUT_SET: data_lib.open_site_data(data, cache_dir).eval}
    except data_lib.DataError as error:
        raise EvalError(str(error)) from None


def window_count(stream: Any, seq_len: int, max_tokens: int | None = None) -> int:
    """How many fixed windows fit: window i is tokens [i·L, (i+1)·L], within the first
    `max_tokens` tokens of the stream (None: the whole stream)."""
    usable = len(stream) if max_tokens is None else min(len(stream), max_tokens)
    return max(0, (usable - 1) // seq_len)


def windows(stream: Any, seq_len: int, first: int, count: int) -> np.ndarray:
    """Windows first .. first + count - 1 as a (count, L + 1) int32 array (read from the stream
    alone: a set larger than memory is scored a batch at a time)."""
    flat = np.asarray(stream[first * seq_len:(first + count) * seq_len + 1]).astype(np.int64)
    return flat[np.arange(count)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]].astype(np.int32)


def evaluate(model: LoadedModel, streams: Mapping[str, Any], max_tokens: int | None = None) -> dict[str, SetResult]:
    """Each set's mean next-token loss over its fixed windows (module docstring)."""
    import jax  # only here: loading a model and reading data need no JAX

    from diloco_node.learn import factory
    from diloco_node.learn import model as model_lib

    seq_len, vocab = model.spec.seq_len, model.spec.vocab_size
    counts = {}
    for name, stream in streams.items():
        counts[name] = window_count(stream, seq_len, max_tokens)
        if not counts[name]:
            held = f"--max-tokens {max_tokens}" if max_tokens is not None and max_tokens < len(stream) else \
                f"its {len(stream)} tokens"
            raise EvalError(f"eval set {name!r}: {held} hold no window of seq_len {seq_len} + 1 tokens")
    try:
        graphdef, template = factory.abstract_model(model.spec)
        params = model_lib.load_flat_params(template, model.params)
    except (KeyError, ValueError, ConfigError) as error:
        raise EvalError(f"{model.source}: its parameters do not fit the model it describes ({error})") from None
    batch_loss = jax.jit(lambda p, inputs, targets: model_lib.loss_fn(graphdef, p, inputs, targets))
    results = {}
    for name, stream in streams.items():
        total = 0.0  # float64 on the host: the sum of every predicted token's loss
        for first in range(0, counts[name], WINDOWS_PER_BATCH):
            rows = windows(stream, seq_len, first, min(WINDOWS_PER_BATCH, counts[name] - first))
            top = int(rows.max())
            if top >= vocab:  # an embedding lookup would silently clamp it: refuse instead
                raise EvalError(f"eval set {name!r}: id {top} is not below the model's vocabulary ({vocab} ids, "
                                f"{model.source}): the model was not made for this data's tokenizer")
            mean = float(batch_loss(params, rows[:, :-1], rows[:, 1:]))
            total += mean * rows.shape[0] * seq_len  # each batch weighted by its tokens
        tokens = counts[name] * seq_len
        results[name] = SetResult(total / tokens, tokens)
    return results
