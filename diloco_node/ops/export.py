"""Export a site's global model: the newest verified checkpoint in its data directory -> one file.

`export_global_model(data_dir, out)` reads the global model's current parameters out of the
newest checkpoint that verifies and writes them as flat float32 tensors named like the model's
parameters ("blocks/0/attn/qkv/kernel", ...) with the run manifest and the checkpoint's identity
as metadata, in safetensors or npz. `load_export(path)` reads either format back.

Where things are (a node's data directory, as the daemon lays it out):

    <data_dir>/checkpoints/ckpt-<sequence>.bin   the node's checkpoints (ops/checkpoint.py); the
                                                  global state's arrays and meta are named by
                                                  sync/state_codec.py
    <data_dir>/coordination/identity.json        node id, role and the run manifest
                                                  (daemon/coordination_store.py, daemon/identity.py)

A checkpoint's meta does not hold the manifest, the node's identity file does: a data directory
belongs to one node of one run, so that manifest is the one every checkpoint there was trained
under.

Safe beside a running node: files are only read, never locked, renamed or removed. The node
writes checkpoints and identity.json atomically (temporary file, rename), so a file read here is
either complete or absent; a checkpoint the node rotates away between listing and reading is
looked for again rather than reported as corrupt. A checkpoint that fails verification is
skipped (and named in `ExportResult.skipped`) but left where it is: quarantining it is the
node's business (`CheckpointStore.load_latest`). So is one the node wrote at stop while its global
state was not current (a stale fragment, a download under way: `state_codec.checkpoint_not_current`):
the export is then of the newest checkpoint written while it was.

The output is written to a temporary file in the target directory, fsynced and renamed into
place (then the directory fsynced; `storage/durable.py`, failpoint `export.write`), so a reader never
sees a partial export, and a full disk is an `ExportError` that leaves no file behind; an existing
file is replaced only with `force`.

Metadata (every value a string, as safetensors requires): "format" ("diloco-node-export/1"),
"manifest" (the canonical manifest JSON: `RunManifest.from_dict(json.loads(...))`),
"manifest_digest", "commit_index" (the replicated log index the global state includes: the
checkpoint's applied index), "state_digest", "rounds" (JSON list, per fragment), "node_id" and
"checkpoint" (the file name). In npz the same dict is a JSON string in the `__metadata__` entry.

Loading an export elsewhere (needs only numpy, plus safetensors for that format):

    from safetensors.numpy import load_file
    params = load_file("model.safetensors")          # {"blocks/0/attn/qkv/kernel": float32, ...}
    from safetensors import safe_open
    with safe_open("model.safetensors", framework="numpy") as f:
        metadata = f.metadata()                       # {"format": ..., "manifest": ..., ...}

    import json, numpy as np
    with np.load("model.npz") as f:                   # no pickle needed
        metadata = json.loads(str(f["__metadata__"]))
        params = {k: f[k] for k in f.files if k != "__metadata__"}

Into this project's model: `model.load_flat_params(params_state, params)`.

`--format hf` (runs of the "llama" factory) writes a Hugging Face Llama directory instead
(learn/hf_llama.py: config.json, model.safetensors with Hugging Face names and layout, and the
site's tokenizer.json when given; ops/hf_export_files.py: generation_config.json, and with the
tokenizer its tokenizer_config.json and special_tokens_map.json, bos/eos ids from the tokenizer
when not given): what `AutoTokenizer` and `AutoModelForCausalLM.from_pretrained` load.
It is built in a temporary directory beside the target and renamed into place.

No JAX here (numpy and safetensors only): the command must start fast and run beside a node. The
one exception is the hf format, which resolves the run's llama options (presets included) with
learn/llama.py's `LlamaConfig`, and so imports JAX (no device is touched).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diloco_node.config.manifest import ConfigError, RunManifest, tensor_differences
from diloco_node.learn import hf_llama
from diloco_node.ops import hf_export_files
from diloco_node.ops.checkpoint import Checkpoint, CheckpointError, read_checkpoint_file
from diloco_node.storage import durable, failpoints
from diloco_node.sync.state_codec import checkpoint_not_current, params_from_checkpoint

EXPORT_FORMAT = "diloco-node-export/1"
FORMATS = ("safetensors", "npz", "hf")
HF_FORMAT = "hf"  # a Hugging Face Llama directory; never guessed from a suffix (--out is a directory)
# What an hf export directory holds: with --force only such a directory is replaced (removed).
HF_EXPORT_FILES = frozenset({hf_llama.CONFIG_FILE, hf_llama.WEIGHTS_FILE, hf_llama.TOKENIZER_FILE}
                            | hf_export_files.FILES)
FORMAT_BY_SUFFIX = {".safetensors": "safetensors", ".npz": "npz"}
NPZ_METADATA_KEY = "__metadata__"
# The data directory's layout as the daemon creates it (daemon/services.py: the checkpoint store's
# and the coordination store's directories; daemon/coordination_store.py: the identity file).
CHECKPOINTS_DIR = "checkpoints"
COORDINATION_DIR = "coordination"
IDENTITY_FILE = "identity.json"
# A checkpoint's file name as CheckpointStore.path_for writes it; temporary and quarantined
# (`*.corrupt`) files do not match and are never candidates.
CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{12})\.bin$")
# A running node can rotate away the file we were about to read (it keeps only the newest few);
# the directory is then listed again, a few times at most.
MAX_LISTINGS = 5
_ZIP_MAGIC = b"PK\x03\x04"


class ExportError(Exception):
    """The export cannot be done; the one-line message says why (and names files)."""


@dataclass(frozen=True, slots=True)
class GlobalModel:
    """The global model of one checkpoint: flat float32 parameters and the export's metadata."""

    params: Mapping[str, np.ndarray]
    metadata: Mapping[str, str]
    checkpoint: Path
    skipped: tuple[str, ...] = ()  # newer checkpoints that did not verify, one reason each


@dataclass(frozen=True, slots=True)
class ExportResult:
    out: Path
    format: str
    model: GlobalModel

    @property
    def num_parameters(self) -> int:
        return int(sum(a.size for a in self.model.params.values()))


# ---------------------------------------------------------------------------------------------
# Reading the data directory
# ---------------------------------------------------------------------------------------------


def read_global_model(data_dir: Path) -> GlobalModel:
    """The global model from the newest verified checkpoint in a node's data directory."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise ExportError(f"no such data directory: {data_dir}")
    checkpoint, skipped = _newest_verified_checkpoint(data_dir / CHECKPOINTS_DIR)
    manifest = read_run_manifest(data_dir)
    params = {name: np.ascontiguousarray(array, dtype=np.float32)
              for name, array in sorted(params_from_checkpoint(checkpoint.arrays).items())}
    if manifest.model.tensors:
        # The run's sealed parameter signature: what the factory builds, so what loads back into it.
        exported = tuple((name, tuple(array.shape), "float32") for name, array in params.items())
        differences = tensor_differences(exported, manifest.model.tensors)
        if differences:
            raise ExportError(f"{checkpoint.path.name}: its parameters differ from the run's model: "
                              + "; ".join(differences))
    return GlobalModel(params, _metadata(checkpoint, manifest), checkpoint.path, skipped)


def read_run_manifest(data_dir: Path) -> RunManifest:
    """The run manifest the node keeps in its identity file (checksummed record, or the older
    unframed file)."""
    # The daemon's record framing, read (not written) here: light, no JAX, no daemon state.
    from diloco_node.storage.records import RecordError, unframe

    path = Path(data_dir) / COORDINATION_DIR / IDENTITY_FILE
    try:
        identity = unframe(path.read_bytes(), "node_id")
        return RunManifest.from_dict(identity["manifest"])
    except FileNotFoundError:
        raise ExportError(f"no run manifest: {path} does not exist (is {data_dir} a node's data directory?)") from None
    except OSError as error:
        raise ExportError(f"no run manifest: cannot read {path}: {error.strerror or error}") from None
    except RecordError as error:
        raise ExportError(f"no run manifest: {path} is damaged ({error})") from None
    except (ValueError, KeyError, TypeError, ConfigError) as error:
        # ConfigError is a ValueError; named for the reader: a manifest this build refuses.
        raise ExportError(f"no run manifest: {path} holds none this build reads: {error!r}") from None


def _checkpoint_files(directory: Path) -> list[tuple[int, Path]]:
    """(sequence, path) of the checkpoint files present, newest first."""
    try:
        names = [entry.name for entry in directory.iterdir()]
    except FileNotFoundError:
        return []
    except OSError as error:
        raise ExportError(f"cannot list {directory}: {error.strerror or error}") from None
    found = [(int(m.group(1)), directory / name) for name in names if (m := CHECKPOINT_NAME.match(name))]
    return sorted(found, reverse=True)


def _newest_verified_checkpoint(directory: Path) -> tuple[Checkpoint, tuple[str, ...]]:
    skipped: list[str] = []
    tried: set[int] = set()
    for _ in range(MAX_LISTINGS):
        rotated_away = False
        for sequence, path in _checkpoint_files(directory):
            if sequence in tried:
                continue
            tried.add(sequence)
            try:
                checkpoint = read_checkpoint_file(path)
            except CheckpointError as error:
                if not path.exists():
                    rotated_away = True  # newer ones were written meanwhile: list again
                    break
                skipped.append(str(error))
                continue
            problem = _not_a_global_model(checkpoint, sequence)
            if problem:
                skipped.append(f"{path}: {problem}")
                continue
            return checkpoint, tuple(skipped)
        if not rotated_away:
            break
    if skipped:
        raise ExportError(f"no verified checkpoint in {directory}; skipped: " + "; ".join(skipped))
    raise ExportError(f"no checkpoint in {directory}: the node has not written one yet "
                      "(or this is not a node's data directory)")


def _not_a_global_model(checkpoint: Checkpoint, sequence: int) -> str | None:
    """Why a checkpoint that verified still cannot be exported; None when it can."""
    if checkpoint.sequence != sequence:
        return f"holds sequence {checkpoint.sequence}, its name says {sequence}"
    if not params_from_checkpoint(checkpoint.arrays):
        return "holds no global model parameters"
    if "applied_index" not in checkpoint.meta or "state_digest" not in checkpoint.meta:
        return "has no applied_index / state_digest in its metadata: not a node's checkpoint"
    not_current = checkpoint_not_current(checkpoint.meta)
    if not_current:  # written at stop while a fragment was stale or a download ran: not the run's model
        return f"was written while the global state was not current ({not_current})"
    return None


def _metadata(checkpoint: Checkpoint, manifest: RunManifest) -> dict[str, str]:
    meta = checkpoint.meta
    return {
        "format": EXPORT_FORMAT,
        "manifest": manifest.canonical_bytes().decode(),
        "manifest_digest": manifest.digest(),
        "commit_index": str(int(meta["applied_index"])),
        "state_digest": str(meta["state_digest"]),
        "rounds": json.dumps([int(r) for r in meta.get("rounds", [])]),
        "node_id": str(meta.get("node_id", "")),
        "checkpoint": checkpoint.path.name,
    }


# ---------------------------------------------------------------------------------------------
# Writing the export
# ---------------------------------------------------------------------------------------------


def resolve_format(out: Path, requested: str | None) -> str:
    """The format asked for, else the one the output's suffix names."""
    if requested is not None:
        if requested not in FORMATS:
            raise ExportError(f"unknown format {requested!r}: use one of {', '.join(FORMATS)}")
        return requested
    by_suffix = FORMAT_BY_SUFFIX.get(Path(out).suffix.lower())
    if by_suffix is None:
        raise ExportError(f"cannot tell the format from {Path(out).name!r}: name it *.safetensors or *.npz, "
                          f"or pass --format ({' or '.join(FORMATS)})")
    return by_suffix


def export_global_model(data_dir: Path, out: Path, fmt: str | None = None, *, force: bool = False,
                        tokenizer: Path | None = None, bos_token_id: int | None = None,
                        eos_token_id: int | None = None) -> ExportResult:
    """Write the global model of the newest verified checkpoint in `data_dir` to `out` (with the
    hf format: a directory; `tokenizer`, bos and eos ids go into it)."""
    out = Path(out)
    fmt = resolve_format(out, fmt)
    if fmt == HF_FORMAT:
        _check_hf_target(out, force)
        model = read_global_model(data_dir)
        write_hf_export(model, out, force=force, tokenizer=tokenizer, bos_token_id=bos_token_id,
                        eos_token_id=eos_token_id)
        return ExportResult(out, fmt, model)
    if tokenizer is not None or bos_token_id is not None or eos_token_id is not None:
        raise ExportError(f"a tokenizer and bos/eos ids go into the {HF_FORMAT} format only (--format {HF_FORMAT})")
    _check_target(out, force)  # before reading megabytes of checkpoint
    model = read_global_model(data_dir)
    write_export(model.params, model.metadata, out, fmt, force=force)
    return ExportResult(out, fmt, model)


def _check_target(out: Path, force: bool) -> None:
    parent = out.parent
    if not parent.is_dir():
        raise ExportError(f"cannot write {out}: {parent} is not a directory")
    if out.is_dir():
        raise ExportError(f"cannot write {out}: it is a directory")
    if out.exists() and not force:
        raise ExportError(f"{out} exists; pass --force to replace it")


def write_export(params: Mapping[str, np.ndarray], metadata: Mapping[str, str], out: Path, fmt: str,
                 *, force: bool = False) -> None:
    """Atomically create (or with `force` replace) `out` holding `params` and `metadata`."""
    out = Path(out)
    _check_target(out, force)
    if NPZ_METADATA_KEY in params:
        raise ExportError(f"a parameter is named {NPZ_METADATA_KEY!r}, the metadata entry's name")
    writer = {"safetensors": _write_safetensors, "npz": _write_npz}.get(fmt)
    if writer is None:
        raise ExportError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    try:
        fd, temp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    except OSError as error:
        raise ExportError(f"cannot write in {out.parent}: {error.strerror or error}") from None
    temp = Path(temp_name)
    try:
        os.close(fd)  # the writers open the path themselves
        failpoints.hit("export.write")
        writer(temp, params, metadata)
        _fsync_file(temp)
        _move_into_place(temp, out, force)
        durable.sync_dir(out.parent)
    except OSError as error:
        raise ExportError(f"cannot write {out}: {error.strerror or error}") from None
    finally:
        temp.unlink(missing_ok=True)


def _check_hf_target(out: Path, force: bool) -> None:
    if not out.parent.is_dir():
        raise ExportError(f"cannot write {out}: {out.parent} is not a directory")
    if out.exists() or out.is_symlink():
        if not force:
            raise ExportError(f"{out} exists; pass --force to replace it")
        if not out.is_dir() or out.is_symlink():
            raise ExportError(f"cannot write {out}: it exists and is not a directory")
        others = sorted(entry.name for entry in out.iterdir() if entry.name not in HF_EXPORT_FILES)
        if others:  # --force removes what it replaces: never a directory that is not an export
            raise ExportError(f"{out} holds {', '.join(others[:5])}: not a Hugging Face export this command "
                              "wrote; --force replaces only those; choose another --out")


def llama_shape(manifest: RunManifest) -> hf_llama.LlamaShape:
    """The run's llama shape from its manifest: the factory's options resolved (presets included)."""
    if manifest.model.factory != "llama":
        raise ExportError(f"the {HF_FORMAT} format writes a Hugging Face Llama; this run's model factory is "
                          f"{manifest.model.factory!r} (use --format safetensors or npz)")
    from diloco_node.learn.llama import LlamaConfig  # the presets live there (imports JAX, touches no device)

    try:
        config = LlamaConfig.from_dict(manifest.model.factory_config())
    except ValueError as error:
        raise ExportError(f"the run's llama options cannot be resolved: {error}") from None
    return hf_llama.LlamaShape.of(config)


def write_hf_export(model: GlobalModel, out: Path, *, force: bool = False, tokenizer: Path | None = None,
                    bos_token_id: int | None = None, eos_token_id: int | None = None) -> None:
    """`model` as a Hugging Face Llama directory at `out`, built beside it and renamed into place.
    A tokenizer whose sha256 is not the run's sealed `[run.data] tokenizer_sha256` is refused."""
    out = Path(out)
    _check_hf_target(out, force)
    manifest = RunManifest.from_dict(json.loads(model.metadata["manifest"]))
    shape = llama_shape(manifest)
    bos_token = eos_token = None
    if tokenizer is not None:
        _check_tokenizer(Path(tokenizer), manifest.data.tokenizer_sha256)
        try:  # ids not given: the site's tokenizer's own (ops/hf_export_files.py)
            if bos_token_id is None or eos_token_id is None:
                found_bos, found_eos = hf_export_files.special_ids(Path(tokenizer))
                bos_token_id = found_bos if bos_token_id is None else bos_token_id
                eos_token_id = found_eos if eos_token_id is None else eos_token_id
            bos_token = hf_export_files.token_text(Path(tokenizer), bos_token_id)
            eos_token = hf_export_files.token_text(Path(tokenizer), eos_token_id)
        except hf_export_files.TokenizerFilesError as error:
            raise ExportError(str(error)) from None
    # The safetensors metadata "format" must be "pt" for transformers; ours is kept beside it.
    metadata = {**{k: v for k, v in model.metadata.items() if k != "format"}, "diloco_format": EXPORT_FORMAT}
    try:
        temp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    except OSError as error:
        raise ExportError(f"cannot write in {out.parent}: {error.strerror or error}") from None
    old: Path | None = None
    try:
        failpoints.hit("export.write")
        try:
            hf_llama.write_llama(temp, model.params, shape, manifest.model.seq_len, metadata=metadata,
                                 tokenizer=tokenizer, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
        except hf_llama.HFLlamaError as error:
            raise ExportError(f"{model.checkpoint.name}: {error}") from None
        hf_export_files.write_files(temp, seq_len=manifest.model.seq_len, bos_token_id=bos_token_id,
                                    eos_token_id=eos_token_id, bos_token=bos_token, eos_token=eos_token,
                                    with_tokenizer=tokenizer is not None)
        for entry in temp.iterdir():
            _fsync_file(entry)
        os.chmod(temp, 0o755)  # mkdtemp makes it private; an export is meant to be read
        if out.exists():  # force (checked above): the old export aside, the new one in, the old one removed
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        os.replace(temp, out)
        durable.sync_dir(out.parent)
    except OSError as error:
        raise ExportError(f"cannot write {out}: {error.strerror or error}") from None
    finally:
        shutil.rmtree(temp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _check_tokenizer(path: Path, run_sha256: str) -> None:
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as error:
        raise ExportError(f"cannot read the tokenizer {path}: {error.strerror or error}") from None
    if run_sha256 and digest != run_sha256:
        raise ExportError(f"the tokenizer {path} (sha256 {digest}) is not the run's ([run.data] tokenizer_sha256 = "
                          f"{run_sha256}): its ids would not be the model's")


def _write_safetensors(path: Path, params: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    from safetensors.numpy import save_file  # only this format needs it

    save_file(dict(params), str(path), metadata=dict(metadata))


def _write_npz(path: Path, params: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    # A 0-d unicode array loads without allow_pickle, unlike an object array of a dict.
    entries = {**params, NPZ_METADATA_KEY: np.array(json.dumps(dict(metadata), sort_keys=True))}
    with path.open("wb") as handle:  # a file object: np.savez would append ".npz" to a bare name
        np.savez(handle, **entries)


def _move_into_place(temp: Path, out: Path, force: bool) -> None:
    if force:
        os.replace(temp, out)
        return
    # A hard link fails if `out` appeared since the check: no overwrite even in that race.
    try:
        os.link(temp, out)
    except FileExistsError:
        raise ExportError(f"{out} exists; pass --force to replace it") from None
    except OSError:
        # A filesystem without hard links: the check in _check_target is all we have.
        if out.exists():
            raise ExportError(f"{out} exists; pass --force to replace it") from None
        os.replace(temp, out)


def _fsync_file(path: Path) -> None:
    """fsync a written file behind failpoint `export.write` (its crashes fire here: the output's
    final name appears only after this, by a rename, so a crash leaves no partial export)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        durable.sync_file("export.write", fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Reading an export back
# ---------------------------------------------------------------------------------------------


def load_export(path: Path | str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(flat float32 parameters, metadata) of an export in either format (told apart by content)."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            head = handle.read(len(_ZIP_MAGIC))
    except OSError as error:
        raise ExportError(f"cannot read {path}: {error.strerror or error}") from None
    return _load_npz(path) if head == _ZIP_MAGIC else _load_safetensors(path)


def _load_npz(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            if NPZ_METADATA_KEY not in archive.files:
                raise ExportError(f"{path}: npz without a {NPZ_METADATA_KEY} entry: not a diloco-node export")
            metadata = json.loads(str(archive[NPZ_METADATA_KEY]))
            params = {name: archive[name] for name in archive.files if name != NPZ_METADATA_KEY}
    except (OSError, ValueError, zipfile.BadZipFile) as error:  # ValueError: a pickled entry, bad JSON
        raise ExportError(f"{path}: not a readable npz export: {error}") from None
    return params, _checked_metadata(path, metadata)


def _load_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = handle.metadata() or {}
            # safe_open is not a mapping (not even iterable): its names come from keys().
            params = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except (OSError, SafetensorError) as error:
        raise ExportError(f"{path}: not a readable safetensors export: {error}") from None
    return params, _checked_metadata(path, metadata)


def _checked_metadata(path: Path, metadata: Any) -> dict[str, str]:
    if not isinstance(metadata, dict) or metadata.get("format") != EXPORT_FORMAT:
        found = metadata.get("format") if isinstance(metadata, dict) else None
        raise ExportError(f"{path}: metadata format {found!r}, expected {EXPORT_FORMAT!r}")
    return {str(k): str(v) for k, v in metadata.items()}
