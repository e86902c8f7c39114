"""Hugging Face Llama <-> this project's "llama" factory: the one place for the name map, the shape
checks, the rotary permutation, config.json <-> `[run.model]` options, and reading and writing a
Hugging Face Llama directory (config.json plus one `model.safetensors` or shards listed in
`model.safetensors.index.json`).

numpy only, no JAX: `diloco-node export --format hf` uses it beside a running node, and the
founder's import runs before any model is built.

The rotary convention is the one thing that is not a rename or a transpose. Hugging Face's Llama
rotates *halves* (`rotate_half`: within a head of K channels, channel j pairs with j + K/2, both
turned by frequency j); ours rotates *interleaved* pairs (2j, 2j + 1), turned by frequency j
(learn/llama.py `rotary`). Permuting the output channels of the q and k projections within each
head, ours[2j] = theirs[j] and ours[2j + 1] = theirs[j + K/2], makes our pair j their pair j: the
rotated vectors are the same channels in another order, and since q and k are permuted alike,
every score q . k (a sum over channels) is unchanged. v and o are not rotated: no permutation.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diloco_node.config.manifest import ConfigError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"

# transformers' LlamaConfig defaults: `save_pretrained` may leave out a value equal to its class
# default (transformers 4.x writes the diff), so an absent key means this value, not "unknown".
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "head_dim": None, "rope_scaling": None, "rope_parameters": None,
}
# config.json key -> our `[run.model]` key (vocab_size is ModelSpec's own; the rest llama options).
SHAPE_KEYS: dict[str, str] = {
    "vocab_size": "vocab_size", "hidden_size": "d_model", "intermediate_size": "d_ff",
    "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
    "rope_theta": "rope_theta", "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings",
}
# A rope type other than these changes the frequencies (linear, dynamic, yarn, llama3 scaling):
# our rotary has none of them.
PLAIN_ROPE_TYPES = ("default",)

# Non-parameter buffers some checkpoints carry (transformers < 4.31 saved the rotary frequencies);
# they are recomputed from rope_theta, so they are skipped, not "unexpected".
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

# Safetensors dtypes we read, all converted to float32 (our parameters are float32).
_FLOAT_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"), "BF16": np.dtype("<u2")}
_HEADER_LENGTH_BYTES = 8  # safetensors: a little-endian u64 header length, then the JSON header
_MAX_HEADER_BYTES = 100 << 20  # the format's own limit (100 MB): a larger one is a corrupt file


class HFLlamaError(ConfigError):
    """A Hugging Face Llama directory we cannot read or represent; the message names the file, key or tensor."""


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """What the name map and config.json need of a llama model (learn/llama.py `LlamaConfig`'s
    fields of the same names; built from one with `of`)."""

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    d_ff: int
    tie_embeddings: bool
    rope_theta: float
    norm_eps: float

    @classmethod
    def of(cls, config: Any) -> LlamaShape:
        """From a `LlamaConfig` (or anything with these attributes)."""
        return cls(**{name: getattr(config, name) for name in cls.__slots__})

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


# ---------------------------------------------------------------------------------------------
# config.json <-> our options
# ---------------------------------------------------------------------------------------------


def read_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFLlamaError(f"init_from: {path} does not exist; a Hugging Face Llama directory holds "
                           f"{CONFIG_FILE} and {WEIGHTS_FILE} (or {INDEX_FILE} and its shards)") from None
    except (OSError, ValueError) as error:
        raise HFLlamaError(f"init_from: cannot read {path}: {error}") from None
    if not isinstance(config, dict):
        raise HFLlamaError(f"init_from: {path} is not a JSON object")
    return config


def options_from_config(config: Mapping[str, Any], where: str = CONFIG_FILE) -> dict[str, Any]:
    """Our `[run.model]` values (vocab_size and the llama options) for a Hugging Face Llama's
    config.json, or an HFLlamaError naming the key we cannot represent."""
    def get(key: str) -> Any:
        value = config.get(key)
        return HF_DEFAULTS.get(key) if value is None else value

    def refuse(key: str, why: str) -> HFLlamaError:
        return HFLlamaError(f"{where}: {key} = {json.dumps(config.get(key))}: {why}; the llama factory cannot "
                            "represent this model")

    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if model_type != MODEL_TYPE and not (model_type is None and ARCHITECTURE in architectures):
        raise refuse("model_type", f"must be {MODEL_TYPE!r} (a {ARCHITECTURE})")
    if get("hidden_act") != "silu":
        raise refuse("hidden_act", "must be \"silu\" (SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if get(key):
            raise refuse(key, "must be false (our projections have no bias)")
    out: dict[str, Any] = {}
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        value = get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise refuse(key, "must be an integer >= 1")
        out[SHAPE_KEYS[key]] = value
    kv_heads = get("num_key_value_heads")
    kv_heads = out["num_heads"] if kv_heads is None else kv_heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
        raise refuse("num_key_value_heads", "must be an integer >= 1")
    out["num_kv_heads"] = kv_heads
    if out["d_model"] % out["num_heads"]:
        raise refuse("num_attention_heads", f"must divide hidden_size = {out['d_model']}")
    head_dim = get("head_dim")
    if head_dim is not None and head_dim != out["d_model"] // out["num_heads"]:
        raise refuse("head_dim", f"must be hidden_size / num_attention_heads = {out['d_model'] // out['num_heads']}")
    out["rope_theta"] = _rope_theta(config, refuse)
    eps = get("rms_norm_eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise refuse("rms_norm_eps", "must be a positive number")
    out["norm_eps"] = float(eps)
    tied = get("tie_word_embeddings")
    if not isinstance(tied, bool):
        raise refuse("tie_word_embeddings", "must be true or false")
    out["tie_embeddings"] = tied
    return out


def _rope_theta(config: Mapping[str, Any], refuse: Any) -> float:
    """The base of the rotary frequencies, refusing any rope scaling. transformers 4.x writes
    `rope_theta` and `rope_scaling`; 5.x writes `rope_parameters` {rope_type, rope_theta}."""
    theta = config.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        table = config.get(key)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise refuse(key, "must be a table")
        kind = table.get("rope_type", table.get("type", "default"))
        if kind not in PLAIN_ROPE_TYPES:
            raise refuse(key, f"rope type {kind!r} scales the rotary frequencies; only "
                              f"{', '.join(PLAIN_ROPE_TYPES)} (none) is supported")
        if table.get("rope_theta") is not None:
            if theta is not None and table["rope_theta"] != theta:
                raise refuse(key, f"its rope_theta differs from rope_theta = {theta}")
            theta = table["rope_theta"]
    theta = HF_DEFAULTS["rope_theta"] if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (math.isfinite(theta) and theta > 0):
        raise refuse("rope_theta", "must be a positive number")
    return float(theta)


def config_from_shape(shape: LlamaShape, seq_len: int, *, bos_token_id: int | None = None,
                      eos_token_id: int | None = None) -> dict[str, Any]:
    """The config.json of a Hugging Face Llama with our model's shape (float32 weights).

    Both spellings of the rotary base are written (4.x `rope_theta`, 5.x `rope_parameters`) so
    either major version reads it. bos/eos are written even when unknown (null): an absent key
    would read as transformers' defaults 1 and 2, which are not our tokenizer's."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.d_model,
        "intermediate_size": shape.d_ff,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": seq_len,  # the context the run trained on
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": shape.tie_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }


# ---------------------------------------------------------------------------------------------
# The name map, shapes and the rotary permutation
# ---------------------------------------------------------------------------------------------

# How a Hugging Face tensor becomes ours: "copy" (same layout), "linear" (torch's [out, in] ->
# flax's [in, out]: a transpose), "query"/"key" (a linear whose output channels are also permuted
# per head for the rotary convention: `rotary_permutation`).
LAYER_NAMES: tuple[tuple[str, str, str], ...] = (
    ("model.layers.{i}.self_attn.q_proj.weight", "blocks/{i}/attn/q/kernel", "query"),
    ("model.layers.{i}.self_attn.k_proj.weight", "blocks/{i}/attn/k/kernel", "key"),
    ("model.layers.{i}.self_attn.v_proj.weight", "blocks/{i}/attn/v/kernel", "linear"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blocks/{i}/attn/o/kernel", "linear"),
    ("model.layers.{i}.mlp.gate_proj.weight", "blocks/{i}/mlp/gate/kernel", "linear"),
    ("model.layers.{i}.mlp.up_proj.weight", "blocks/{i}/mlp/up/kernel", "linear"),
    ("model.layers.{i}.mlp.down_proj.weight", "blocks/{i}/mlp/down/kernel", "linear"),
    ("model.layers.{i}.input_layernorm.weight", "blocks/{i}/attn_norm/scale", "copy"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blocks/{i}/mlp_norm/scale", "copy"),
)
TOP_NAMES: tuple[tuple[str, str, str], ...] = (
    ("model.embed_tokens.weight", "embed/embedding", "copy"),
    ("model.norm.weight", "norm/scale", "copy"),
)
HEAD_NAMES = ("lm_head.weight", "lm_head/kernel", "linear")  # untied models only


def name_map(shape: LlamaShape) -> list[tuple[str, str, str]]:
    """(Hugging Face name, our name, how) for every parameter of the model."""
    names = list(TOP_NAMES)
    for i in range(shape.num_layers):
        names.extend((hf.format(i=i), ours.format(i=i), how) for hf, ours, how in LAYER_NAMES)
    if not shape.tie_embeddings:
        names.append(HEAD_NAMES)
    return names


def our_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape as the llama factory builds it (flax kernels are [in, out])."""
    d, f, V = shape.d_model, shape.d_ff, shape.vocab_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_layer = {"attn/q/kernel": (d, q), "attn/k/kernel": (d, kv), "attn/v/kernel": (d, kv), "attn/o/kernel": (q, d),
                 "mlp/gate/kernel": (d, f), "mlp/up/kernel": (d, f), "mlp/down/kernel": (f, d),
                 "attn_norm/scale": (d,), "mlp_norm/scale": (d,)}
    out: dict[str, tuple[int, ...]] = {"embed/embedding": (V, d), "norm/scale": (d,)}
    for i in range(shape.num_layers):
        out.update((f"blocks/{i}/{name}", dims) for name, dims in per_layer.items())
    if not shape.tie_embeddings:
        out["lm_head/kernel"] = (d, V)
    return out


def hf_shape_of(ours: tuple[int, ...], how: str) -> tuple[int, ...]:
    return ours if how == "copy" else tuple(reversed(ours))


def rotary_permutation(num_heads: int, head_dim: int) -> np.ndarray:
    """Indices `perm` with ours = theirs[perm] over the output channels of a q or k projection:
    within each head of K channels, ours[2j] = theirs[j] and ours[2j + 1] = theirs[j + K/2]
    (module docstring: our interleaved rotary pairs are then theirs halves)."""
    half = head_dim // 2
    within = np.empty(head_dim, dtype=np.int64)
    within[0::2] = np.arange(half)
    within[1::2] = np.arange(half) + half
    return (np.arange(num_heads)[:, None] * head_dim + within[None, :]).reshape(-1)


def _heads(how: str, shape: LlamaShape) -> int:
    return shape.num_heads if how == "query" else shape.num_kv_heads


def to_ours(hf: Mapping[str, np.ndarray], shape: LlamaShape, where: str = "the weights") -> dict[str, np.ndarray]:
    """Our flat float32 parameters from a Hugging Face Llama's tensors, every name and shape
    checked first: the missing, unexpected and differently shaped tensors are all named."""
    entries = name_map(shape)
    expected = our_shapes(shape)
    present = {name for name in hf if not name.endswith(IGNORED_SUFFIXES)}
    wanted = {hf_name for hf_name, _, _ in entries}
    tied_head = shape.tie_embeddings and HEAD_NAMES[0] in present
    problems = [f"missing {name}" for name in sorted(wanted - present)]
    problems += [f"unexpected {name}" for name in sorted(present - wanted) if not (tied_head and name == HEAD_NAMES[0])]
    for hf_name, ours, how in entries:
        if hf_name in hf and tuple(hf[hf_name].shape) != hf_shape_of(expected[ours], how):
            problems.append(f"{hf_name} is {list(hf[hf_name].shape)}, expected {list(hf_shape_of(expected[ours], how))}")
    if tied_head and not np.array_equal(np.asarray(hf[HEAD_NAMES[0]], np.float32),
                                        np.asarray(hf[TOP_NAMES[0][0]], np.float32)):
        # A tied model may still save its head; it must then be the embedding, else it is not tied.
        problems.append(f"{HEAD_NAMES[0]} differs from {TOP_NAMES[0][0]} while tie_word_embeddings is true")
    if problems:
        raise HFLlamaError(f"{where}: the tensors do not match config.json ({len(problems)} problem(s)): "
                           + "; ".join(problems[:12]) + ("; ..." if len(problems) > 12 else ""))
    out: dict[str, np.ndarray] = {}
    for hf_name, ours, how in entries:
        weight = np.asarray(hf[hf_name], dtype=np.float32)
        if how in ("query", "key"):
            weight = weight[rotary_permutation(_heads(how, shape), shape.head_dim)]
        out[ours] = np.ascontiguousarray(weight if how == "copy" else weight.T)
    return dict(sorted(out.items()))


def to_hf(ours: Mapping[str, np.ndarray], shape: LlamaShape) -> dict[str, np.ndarray]:
    """The inverse of `to_ours`: Hugging Face names, [out, in] layout, halves rotary layout."""
    expected = our_shapes(shape)
    problems = [f"missing {name}" for name in sorted(set(expected) - set(ours))]
    problems += [f"unexpected {name}" for name in sorted(set(ours) - set(expected))]
    problems += [f"{name} is {list(np.shape(ours[name]))}, expected {list(dims)}"
                 for name, dims in expected.items() if name in ours and tuple(np.shape(ours[name])) != dims]
    if problems:
        raise HFLlamaError("the parameters are not the llama model's: " + "; ".join(problems[:12]))
    out: dict[str, np.ndarray] = {}
    for hf_name, name, how in name_map(shape):
        weight = np.asarray(ours[name], dtype=np.float32)
        if how != "copy":
            weight = weight.T
        if how in ("query", "key"):
            weight = weight[np.argsort(rotary_permutation(_heads(how, shape), shape.head_dim))]
        out[hf_name] = np.ascontiguousarray(weight)
    return out


def weights_sha256(flat: Mapping[str, np.ndarray]) -> str:
    """sha256 over our flat float32 parameters in name order: each tensor's name and shape (a
    JSON line) then its little-endian float32 bytes. What `[run.model] init_sha256` seals."""
    digest = hashlib.sha256()
    for name in sorted(flat):
        array = np.ascontiguousarray(flat[name], dtype="<f4")
        digest.update(json.dumps([name, list(array.shape)]).encode() + b"\n")
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Reading and writing a directory
# ---------------------------------------------------------------------------------------------


def read_safetensors(path: Path, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Tensors of one safetensors file as float32 (F32, F16, BF16 and F64 are read; bf16 is the
    top half of a float32, so it widens exactly). Parsed here rather than by the safetensors
    package, whose numpy reader has no bfloat16."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            raw_length = handle.read(_HEADER_LENGTH_BYTES)
            (length,) = struct.unpack("<Q", raw_length) if len(raw_length) == _HEADER_LENGTH_BYTES else (-1,)
            if not 0 < length <= _MAX_HEADER_BYTES:
                raise HFLlamaError(f"{path}: not a safetensors file (header length {length})")
            header = json.loads(handle.read(length))
        size = path.stat().st_size
    except FileNotFoundError:
        raise HFLlamaError(f"init_from: {path} does not exist") from None
    except (OSError, ValueError) as error:
        raise HFLlamaError(f"{path}: not a readable safetensors file: {error}") from None
    start = _HEADER_LENGTH_BYTES + length
    wanted = None if names is None else set(names)
    out: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        if name == "__metadata__" or (wanted is not None and name not in wanted):
            continue
        dtype = _FLOAT_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise HFLlamaError(f"{path}: tensor {name} has dtype {entry.get('dtype')}; only "
                               f"{', '.join(_FLOAT_DTYPES)} weights can be imported")
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
        if end - begin != math.prod(shape) * dtype.itemsize or start + end > size:
            raise HFLlamaError(f"{path}: tensor {name}'s offsets do not fit its shape or the file (truncated?)")
        array = np.fromfile(path, dtype=dtype, count=math.prod(shape), offset=start + begin).reshape(shape)
        if entry["dtype"] == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        out[name] = array.astype(np.float32, copy=False)
    if wanted is not None and wanted - set(out):
        raise HFLlamaError(f"{path}: does not hold {', '.join(sorted(wanted - set(out))[:5])}, which "
                           f"{INDEX_FILE} places in it")
    return out


def read_weights(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face directory: `model.safetensors`, or the shards that
    `model.safetensors.index.json`'s weight_map names."""
    directory = Path(directory)
    index_path = directory / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (OSError, ValueError, KeyError, AssertionError) as error:
            raise HFLlamaError(f"init_from: {index_path} has no readable weight_map: {error!r}") from None
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if os.path.basename(str(file)) != file:  # a shard outside the directory is not ours to read
                raise HFLlamaError(f"init_from: {index_path} places {name} in {file!r}, not a file of {directory}")
            by_file.setdefault(file, []).append(name)
        out: dict[str, np.ndarray] = {}
        for file, names in sorted(by_file.items()):
            out.update(read_safetensors(directory / file, names))
        return out
    if not (directory / WEIGHTS_FILE).exists():
        raise HFLlamaError(f"init_from: {directory} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    return read_safetensors(directory / WEIGHTS_FILE)


@dataclass(frozen=True, slots=True)
class ImportedLlama:
    """A Hugging Face Llama directory read and mapped: our options and float32 parameters."""

    options: dict[str, Any]  # vocab_size and the llama options, from config.json
    params: dict[str, np.ndarray]  # our flat names, sorted
    sha256: str  # `weights_sha256(params)`


def import_llama(directory: Path) -> ImportedLlama:
    """Read, check and map a Hugging Face Llama directory (config.json and safetensors)."""
    directory = Path(directory)
    options = options_from_config(read_config(directory), str(directory / CONFIG_FILE))
    shape = LlamaShape(**options)
    params = to_ours(read_weights(directory), shape, str(directory))
    return ImportedLlama(options, params, weights_sha256(params))


def write_llama(directory: Path, params: Mapping[str, np.ndarray], shape: LlamaShape, seq_len: int, *,
                metadata: Mapping[str, str] | None = None, tokenizer: Path | None = None,
                bos_token_id: int | None = None, eos_token_id: int | None = None) -> None:
    """Write config.json, model.safetensors and (given one) tokenizer.json into an existing,
    empty `directory`: what `transformers.LlamaForCausalLM.from_pretrained(directory)` loads."""
    from safetensors.numpy import save_file  # only writing needs it

    directory = Path(directory)
    hf = to_hf(params, shape)
    config = config_from_shape(shape, seq_len, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # transformers refuses a safetensors file whose metadata does not say format "pt" (torch layout).
    save_file(hf, str(directory / WEIGHTS_FILE), metadata={**(metadata or {}), "format": "pt"})
    if tokenizer is not None:
        (directory / TOKENIZER_FILE).write_bytes(Path(tokenizer).read_bytes())
