"""A node's effective configuration: TOML file < environment < command-line flags, every value with its source.

Two kinds of settings live in one file:

- `[node]`: what differs per site (identity, addresses, data directory, secret, role, timeouts,
  and in `[node.data]` the data it trains on), validated into a frozen `NodeConfig`;
- `[run]` with `[run.model]`, `[run.data]`, `[run.inner]`, `[run.outer]`, `[run.sync]`,
  `[run.stop]`: the run manifest (`manifest.RunManifest`), which the founding node defines and
  joiners receive from the run and must not contradict (`check_joiner_manifest`).

Environment names: `DILOCO_<KEY>` for node keys (`DILOCO_LISTEN`, `DILOCO_DATA_PATHS` for
`[node.data] paths`), `DILOCO_<SECTION>_<KEY>` for run keys (`DILOCO_SYNC_PERIOD`), `DILOCO_RUN_SEED` for the run seed, `DILOCO_CONFIG` for the file.
Unknown `DILOCO_*` variables are errors, like unknown file keys: a misspelt
`DILOCO_SYNC_PERIDO` silently ignored would run a different experiment from the one intended,
and the prefix is ours alone. Tooling that needs private variables uses `DILOCO_X_*`, which is
never read as configuration.

Secrets are never values: only a file path (`secret_file`) or a systemd credential
(`$CREDENTIALS_DIRECTORY/<secret_credential>`). An inline secret anywhere is refused, because
environment and argv leak through `ps`, `/proc/*/environ`, shell history and config backups.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import ipaddress
import math
import os
import re
import socket
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from diloco_node.config.manifest import MOVED_DATA_KEYS, ConfigError, RunManifest
from diloco_node.config.site_data import SiteData, parse_mix
from diloco_node.config.site_devices import ClusterSpec, MeshShape
from diloco_node.config.site_tracking import TrackingSpec
from wire.auth import MIN_RUN_SECRET_BYTES

__all__ = [
    "ConfigError",
    "EffectiveConfig",
    "HostPort",
    "NodeConfig",
    "Override",
    "Setting",
    "add_run_flags",
    "check_joiner_manifest",
    "load_config",
    "load_config_from_args",
    "overrides_from_args",
]

ROLES = ("learner", "witness")
LOG_LEVELS = ("debug", "info", "warning", "error")
# How a learner site produces its deltas: "jax" trains; "synthetic" draws random ones (benchmarks).
LEARNER_KINDS = ("jax", "synthetic")
# Largest relay fan-out a node accepts (bootstrap/relay_tree.py MAX_FANOUT: beyond it a tree is the
# holder sending to everyone again). Kept here so the config layer does not import the core.
MAX_RELAY_FANOUT = 16
ENV_PREFIX = "DILOCO_"
# Never read as configuration: room for test harnesses and experiments without tripping the
# unknown-variable check.
ENV_PRIVATE_PREFIX = "DILOCO_X_"
CONFIG_FILE_ENV = "DILOCO_CONFIG"
DEFAULT_SECRET_CREDENTIAL = "diloco-secret"
# The frame layer's floor (256 bits; a shorter HMAC key is guessable offline from one captured
# frame). One constant, so `config show` and `run` can never disagree about a valid secret.
MIN_SECRET_BYTES = MIN_RUN_SECRET_BYTES
# A secret file is a key, not a document; anything larger is almost certainly the wrong path.
MAX_SECRET_BYTES = 4096
# A site's own node id is also its certificate's DNS name, the TLS server name its peers ask for
# (ops/pki.py): no ':' or '@', at most 63 characters (a DNS label's length). Stricter than the node
# ids the wire carries (wire.messages.NODE_ID_PATTERN, MAX_NODE_ID_CHARS), so every id a site can be
# given is valid on the wire; the wire's set is a format invariant and stays as it is.
SITE_NODE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# Keys the operator might use to put a secret inline; each gets a pointed refusal rather than
# a generic "unknown key" (which would also be correct, but less helpful).
_INLINE_SECRET_WORDS = ("secret", "password", "token", "hmac_key", "key")
_SECRET_PATH_KEYS = ("secret_file", "secret_credential")


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True, slots=True)
class HostPort:
    """A TCP endpoint `host:port` (IPv6 written `[addr]:port`)."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"port {self.port}: must be in 1..65535")

    @classmethod
    def parse(cls, text: str, key: str) -> "HostPort":
        """Parse `host:port` or `[v6]:port`; the error names `key` and the bad text."""
        hint = f"{key} = {text!r}: expected HOST:PORT (IPv6 as [addr]:port)"
        text = text.strip()
        if text.startswith("["):
            host, sep, rest = text[1:].partition("]")
            if not sep or not rest.startswith(":"):
                raise ConfigError(hint)
            port_text = rest[1:]
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise ConfigError(f"{hint}; {host!r} is not an IPv6 address") from None
        else:
            host, sep, port_text = text.rpartition(":")
            if not sep or not host or ":" in host:
                raise ConfigError(hint)
        if not port_text.isdigit():
            raise ConfigError(f"{hint}; port {port_text!r} is not a number")
        port = int(port_text)
        if not 1 <= port <= 65535:
            raise ConfigError(f"{key} = {text!r}: port {port} must be in 1..65535")
        return cls(host, port)

    @property
    def is_wildcard(self) -> bool:
        return self.host in WILDCARD_HOSTS

    def url(self, scheme: str = "http") -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


# Log compaction keeps this many committed entries below the newest verified checkpoint, so a
# peer that lags briefly (a pause, a network blip, a restart: JAX start-up and compile take
# 15-40 s) catches up by replaying the log instead of a full state download. 256 entries are
# ~30 s of commits at the tiny test model's fastest pace (~8/s, ~33 KB each: ~9 MB) and many
# minutes for real models, whose rounds are rarer but whose entries are bigger (~0.8 MB at 6.5M
# parameters: ~200 MB); lower it where disk is tight, since a snapshot install is always safe.
DEFAULT_LOG_RETAIN_ENTRIES = 256


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """What one site decides for itself; validated on construction."""

    node_id: str
    listen: HostPort
    advertise: str
    # Outbound peer connections bind to this local IP (None: the kernel picks by route). For
    # multi-homed hosts that must send WAN traffic from one interface, and for per-site source
    # addresses on one machine (the chaos harness partitions sites by it).
    source_address: str | None = None
    bootstrap: tuple[HostPort, ...] = ()  # empty: this node founds the run
    data_dir: Path = Path("diloco-data")
    secret_file: Path | None = None
    secret_credential: str = DEFAULT_SECRET_CREDENTIAL
    role: str = "learner"
    log_level: str = "info"
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    heartbeat_interval_s: float = 0.5
    lease_timeout_s: float = 3.0
    checkpoint_interval_s: float = 60.0
    checkpoint_keep: int = 3
    log_retain_entries: int = DEFAULT_LOG_RETAIN_ENTRIES
    eval_interval_commits: int = 50
    eval_batches: int = 8
    # "synthetic": random deltas at `synthetic_steps_per_s` instead of training (learn/
    # synthetic_learner.py), for benchmarks and tests of the data plane; never for a real run.
    learner: str = "jax"
    synthetic_steps_per_s: float = 10.0
    # Relayed commits (docs/COORDINATION.md, "Relayed payloads"): as lease holder, send each commit
    # payload to this many sites and let them pass it on down a tree; 0 sends it to every follower.
    relay_fanout: int = 0
    data: SiteData = SiteData()  # [node.data]: what this site trains on
    # Mutual TLS between sites (docs/OPERATIONS.md, "Mutual TLS"): all three files, or none (off).
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_ca_file: Path | None = None
    tls_crl_file: Path | None = None  # the run CA's revocation list (`diloco-node certs revoke`)
    # Operator routes (/status, /metrics, /livez, /readyz, /) on a listener of their own; with TLS
    # on and this unset: 127.0.0.1 at the listen port + 1 (loopback: operators are local or tunnel).
    status_listen: HostPort | None = None
    # Where browsers reach this node's operator routes when they are not at `advertise` (TLS on);
    # members advertise it to each other so the live page can read every member's /series.
    # "": derived from status_listen when that is not a wildcard, else none.
    status_url: str = ""
    mesh: MeshShape = MeshShape()  # [node.mesh]: this site's devices laid out (learn/mesh.py)
    cluster: ClusterSpec = ClusterSpec()  # [node.cluster]: the hosts of a multi-host site
    tracking: TrackingSpec = TrackingSpec()  # [node.tracking]: TensorBoard / W&B (ops/tracking.py)

    def __post_init__(self) -> None:
        _require(bool(SITE_NODE_ID_PATTERN.fullmatch(self.node_id)),
                 f"node_id = {self.node_id!r}: must be 1-63 characters of letters, digits, '.', '_', '-', "
                 "starting with a letter or digit")
        _require(self.role in ROLES, f"role = {self.role!r}: must be one of {', '.join(ROLES)}")
        _require(self.log_level in LOG_LEVELS, f"log_level = {self.log_level!r}: must be one of {', '.join(LOG_LEVELS)}")
        _check_advertise(self.advertise)
        if self.status_url:
            _check_advertise(self.status_url, "status_url", "browsers")
        for peer in self.bootstrap:
            _require(HostPort.parse(_hostport_of_url(self.advertise), "advertise") != peer,
                     f"bootstrap = {str(peer)!r}: points at this node's own advertise address; "
                     "leave bootstrap empty on the founding node")
        _require(bool(self.secret_credential) and "/" not in self.secret_credential,
                 f"secret_credential = {self.secret_credential!r}: must be a plain credential name")
        for name in ("connect_timeout_s", "read_timeout_s", "heartbeat_interval_s", "lease_timeout_s",
                     "checkpoint_interval_s"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value > 0, f"{name} = {value}: must be a positive number of seconds")
        # A lease must survive two lost heartbeats, or one dropped packet ends it.
        _require(self.lease_timeout_s >= 3 * self.heartbeat_interval_s,
                 f"lease_timeout_s = {self.lease_timeout_s}: must be >= 3 x heartbeat_interval_s "
                 f"= {3 * self.heartbeat_interval_s}")
        # Keeping one older checkpoint is what lets a corrupt newest one fall back.
        _require(self.checkpoint_keep >= 2, f"checkpoint_keep = {self.checkpoint_keep}: must be >= 2")
        _require(self.log_retain_entries >= 0, f"log_retain_entries = {self.log_retain_entries}: must be >= 0")
        _require(self.eval_interval_commits >= 0,
                 f"eval_interval_commits = {self.eval_interval_commits}: must be >= 0 (0: never evaluate)")
        _require(1 <= self.eval_batches <= 1024, f"eval_batches = {self.eval_batches}: must be in [1, 1024]")
        _require(self.learner in LEARNER_KINDS,
                 f"learner = {self.learner!r}: must be one of {', '.join(LEARNER_KINDS)} "
                 "(synthetic is for benchmarks and tests: it does not train)")
        _require(math.isfinite(self.synthetic_steps_per_s) and self.synthetic_steps_per_s > 0,
                 f"synthetic_steps_per_s = {self.synthetic_steps_per_s}: must be a positive number of steps per second")
        _require(0 <= self.relay_fanout <= MAX_RELAY_FANOUT,
                 f"relay_fanout = {self.relay_fanout}: must be in [0, {MAX_RELAY_FANOUT}] "
                 "(0: no relays; 2 or 3 typical)")
        self._check_tls()

    def _check_tls(self) -> None:
        given = [name for name in TLS_FILE_KEYS if getattr(self, name) is not None]
        _require(not given or len(given) == len(TLS_FILE_KEYS),
                 f"{', '.join(given)} set but {', '.join(k for k in TLS_FILE_KEYS if k not in given)} not: "
                 "mutual TLS needs the site's certificate, its key and the run's CA (or none of them)")
        if self.tls_crl_file is not None:
            _require(bool(given), "tls_crl_file is set but TLS is not (set tls_cert_file, tls_key_file, tls_ca_file)")
        if given:
            _require(urlsplit(self.advertise).scheme == "https",
                     f"advertise = {self.advertise!r}: with TLS configured peers reach this node over "
                     "https://; plain http is refused")
            if self.status_listen is not None:
                _require(self.status_listen != self.listen,
                         f"status_listen = {str(self.status_listen)!r}: must differ from listen (that port speaks TLS only)")

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def peer_scheme(self) -> str:
        """How this site and its peers reach each other: https with TLS configured, else http."""
        return "https" if self.tls_enabled else "http"

    @property
    def operator_listen(self) -> HostPort | None:
        """Where the operator routes listen when not on `listen` (None: on `listen`, as without TLS)."""
        if self.status_listen is not None:
            return self.status_listen
        if self.tls_enabled:
            return HostPort("127.0.0.1", self.listen.port + 1 if self.listen.port < 65535 else self.listen.port - 1)
        return None

    @property
    def is_founder(self) -> bool:
        return not self.bootstrap


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# The [node] keys naming TLS files (tls_crl_file is optional beside them).
TLS_FILE_KEYS = ("tls_cert_file", "tls_key_file", "tls_ca_file")
# systemd credential names read for unset TLS keys (LoadCredential=diloco-tls-cert:/path ...).
TLS_CREDENTIALS = {"tls_cert_file": "diloco-tls-cert", "tls_key_file": "diloco-tls-key",
                   "tls_ca_file": "diloco-tls-ca", "tls_crl_file": "diloco-tls-crl"}


def _check_advertise(url: str, key: str = "advertise", who: str = "the other sites") -> None:
    parts = urlsplit(url)
    hint = f"{key} = {url!r}: expected http(s)://HOST:PORT reachable by {who}"
    _require(parts.scheme in ("http", "https"), hint)
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"{hint}; bad port") from None
    _require(bool(parts.hostname) and port is not None, hint)
    _require(parts.path in ("", "/") and not parts.query and not parts.fragment, f"{hint}; no path or query")
    _require(parts.hostname not in WILDCARD_HOSTS, f"{hint}; a wildcard address is not reachable")


def _hostport_of_url(url: str) -> str:
    return urlsplit(url).netloc


# ---------------------------------------------------------------------------------------------
# The key table: every setting, its type, default, environment variable and flag


@dataclass(frozen=True, slots=True)
class KeySpec:
    """One configurable key. `kind` drives parsing from TOML values and from strings."""

    key: str  # dotted name: "listen", "run.sync.period", "run.seed"
    kind: str  # str | int | float | bool | path | optpath | optip | hostport | opthostport | hostports | strlist
    default: Any
    help: str
    flag: str | None = None  # a dedicated command-line flag, if any

    @property
    def env(self) -> str:
        parts = self.key.split(".")
        if parts[0] == "run":
            parts = parts[1:] if len(parts) == 3 else parts  # run.sync.period -> SYNC_PERIOD; run.seed -> RUN_SEED
        return ENV_PREFIX + "_".join(parts).upper()

    @property
    def display(self) -> str:
        """Name as run_config's own messages spell it (without the `run.` prefix)."""
        return self.key[4:] if self.key.startswith("run.") and self.key.count(".") == 2 else self.key


_NODE_HELP = {
    "node_id": "this node's name in the run (default: the host name)",
    "listen": "HOST:PORT to bind the HTTP server to",
    "advertise": "URL other sites use to reach this node (default: http://<listen>)",
    "source_address": "local IP address outbound peer connections are made from (default: chosen by route)",
    "bootstrap": "HOST:PORT of peers already in the run (empty: found a new run)",
    "data_dir": "checkpoints and the replicated log (default: $STATE_DIRECTORY, else ./diloco-data)",
    "secret_file": "file holding the run's shared secret (default: the systemd credential)",
    "secret_credential": "name of the systemd credential holding the secret",
    "role": "learner (trains) or witness (replica and voter only)",
    "log_level": "debug, info, warning or error",
    "connect_timeout_s": "TCP connect timeout to peers",
    "read_timeout_s": "longest silence tolerated on an open peer stream",
    "heartbeat_interval_s": "coordinator lease renewal interval",
    "lease_timeout_s": "lease lifetime without a majority's acknowledgement",
    "checkpoint_interval_s": "seconds between local checkpoints",
    "checkpoint_keep": "checkpoints kept on disk (>= 2 so a corrupt newest falls back)",
    "log_retain_entries": "log entries kept below the newest checkpoint when compacting (lagging peers replay these)",
    "eval_interval_commits": "evaluate the global model on this site's eval split every N applied commits (0: never)",
    "eval_batches": "batches (of run.inner.batch_size windows) in each evaluation",
    "learner": "jax (trains the model) or synthetic (random deltas, no training: benchmarks and tests only)",
    "synthetic_steps_per_s": "steps per second of a synthetic learner (learner = synthetic only)",
    "relay_fanout": "as lease holder, send each commit payload to this many sites, which relay it on "
                    "(0: send it to every follower)",
    "data.source": "[node.data] what this site trains on: stdlib, text, tokens, or documents (jsonl, parquet, "
                   "arrow; documents: by extension)",
    "data.paths": "[node.data] files, directories (text) and globs, read in order as one stream",
    "data.tokenizer": "[node.data] a local tokenizer.json: text is tokenized with it; token files declare it",
    "data.token_dtype": "[node.data] id type of token files: uint16 or uint32 (uint8 for byte files)",
    "data.eval_fraction": "[node.data] share of the data held out for evaluation, in (0, 0.5)",
    "data.seed": "[node.data] which files are held out when a source is split by file",
    "data.text_field": "[node.data] the jsonl field or parquet/arrow column holding a document's text",
    "data.eos_token": "[node.data] the end-of-document token's text (default: the one the tokenizer declares)",
    "data.eos_id": "[node.data] the end-of-document token's id (-1: from eos_token or the tokenizer); "
                   "beside token files it counts their documents",
    "data.mix": "[node.data.mix.NAME] a mixture: tables of [node.data] keys plus weight (> 0)",
    "data.eval": "[node.data.eval.NAME] separate eval sets: tables of [node.data] keys (paths, source...), read "
                 "whole, never trained on",
    "tls_cert_file": "this site's TLS certificate (PEM; enables mutual TLS with tls_key_file and tls_ca_file)",
    "tls_key_file": "the private key of tls_cert_file (PEM, mode 0600)",
    "tls_ca_file": "the run CA's certificate: peers' certificates are verified against it alone",
    "tls_crl_file": "the run CA's revocation list (PEM; `diloco-node certs revoke` writes it)",
    "status_listen": "HOST:PORT of the operator routes' own listener (default with TLS: 127.0.0.1:<listen port + 1>)",
    "status_url": "URL browsers use to reach this node's operator routes, advertised to members for the live "
                  "page (default with TLS: http://<status_listen> unless a wildcard; without TLS: advertise)",
}
_NODE_KINDS = {
    "node_id": "str", "listen": "hostport", "advertise": "str", "source_address": "optip",
    "bootstrap": "hostports",
    "data_dir": "path", "secret_file": "optpath", "secret_credential": "str", "role": "str",
    "log_level": "str", "connect_timeout_s": "float", "read_timeout_s": "float",
    "heartbeat_interval_s": "float", "lease_timeout_s": "float", "checkpoint_interval_s": "float",
    "checkpoint_keep": "int", "log_retain_entries": "int", "eval_interval_commits": "int", "eval_batches": "int",
    "learner": "str", "synthetic_steps_per_s": "float", "relay_fanout": "int",
    "data.source": "str", "data.paths": "pathlist", "data.tokenizer": "pathstr", "data.token_dtype": "str",
    "data.eval_fraction": "float", "data.seed": "int", "data.text_field": "str", "data.eos_token": "str",
    "data.eos_id": "int", "data.mix": "datamix", "data.eval": "dataeval",
    "tls_cert_file": "optpath", "tls_key_file": "optpath", "tls_ca_file": "optpath", "tls_crl_file": "optpath",
    "status_listen": "opthostport", "status_url": "str",
}
# [node.data] is a table of its own: its keys are "data.<name>" (env DILOCO_DATA_<NAME>, --set data.<name>=).
NODE_DATA_PREFIX = "data."
_NODE_FLAGS = {
    "node_id": "--node-id", "listen": "--listen", "advertise": "--advertise",
    "source_address": "--source-address", "bootstrap": "--bootstrap",
    "data_dir": "--data-dir", "secret_file": "--secret-file", "role": "--role", "log_level": "--log-level",
}
DEFAULT_LISTEN = "127.0.0.1:7070"

# Nested node tables: `[node.<table>]` keys are "<table>.<name>" (env DILOCO_<TABLE>_<NAME>,
# `--set <table>.<name>=`), each table one frozen dataclass field of NodeConfig.
NODE_TABLES: dict[str, type] = {"data": SiteData, "mesh": MeshShape, "cluster": ClusterSpec, "tracking": TrackingSpec}
_NODE_TABLE_HELP = {
    "mesh.data": "[node.mesh] devices on the data axis (-1: every device fsdp leaves)",
    "mesh.fsdp": "[node.mesh] devices parameters and AdamW state are sharded over (-1: every device data leaves)",
    "mesh.microbatches": "[node.mesh] gradient accumulation: the global batch in this many microbatches",
    "mesh.attention": "[node.mesh] attention implementation: auto, xla, cudnn (NVIDIA fused flash), chunked "
                      "(online softmax, memory linear in the context) or reference; same model, other memory/speed",
    "mesh.remat": "[node.mesh] rematerialisation of the llama blocks: none, full, or dots (save matmul outputs)",
    "mesh.platform": "[node.mesh] the accelerator this site expects (auto, cpu, gpu, tpu): another one refuses to start",
    "mesh.peak_tflops": "[node.mesh] peak TFLOP/s of one device for MFU (0: from the table of known devices)",
    "cluster.coordinator": "[node.cluster] HOST:PORT of process 0's jax.distributed service, \"auto\" to detect, "
                           "empty for a one-host site",
    "cluster.num_processes": "[node.cluster] hosts (processes) of this site (scheduler: SLURM_NTASKS)",
    "cluster.process_id": "[node.cluster] this host's process id, 0 is the site's daemon (scheduler: SLURM_PROCID)",
    "cluster.heartbeat_timeout_s": "[node.cluster] seconds without a host's heartbeat before the whole site "
                                   "stops (a killed host is noticed sooner, by the collectives)",
    "tracking.tensorboard_dir": "[node.tracking] TensorBoard event files here (relative: under the data dir); \"\": off",
    "tracking.wandb_project": "[node.tracking] Weights & Biases project (needs the wandb extra); \"\": off",
    "tracking.wandb_mode": "[node.tracking] W&B mode: offline (no network; `wandb sync` later), online, disabled",
    "tracking.wandb_entity": "[node.tracking] W&B entity (team or user); \"\": the account's default",
    "tracking.run_name": "[node.tracking] the run's name in the trackers; \"\": the node id",
}
# A scheduler's variables fill cluster keys the node did not set itself.
_SCHEDULER_ENV = {"cluster.process_id": "SLURM_PROCID", "cluster.num_processes": "SLURM_NTASKS"}


def _table_specs(table: str) -> list[KeySpec]:
    cls = NODE_TABLES[table]
    specs = []
    for f in dataclasses.fields(cls):
        key, default = f"{table}.{f.name}", getattr(cls(), f.name)
        specs.append(KeySpec(key, _NODE_KINDS.get(key) or _kind_of(default), default,
                             _NODE_HELP.get(key) or _NODE_TABLE_HELP[key]))
    return specs


def _node_table_kwargs(values: Mapping[str, Any], sources: Mapping[str, str]) -> dict[str, Any]:
    """NodeConfig's nested tables built from their dotted keys (errors name the key's source)."""
    out = {}
    for table, cls in NODE_TABLES.items():
        fields = {f.name: values[f"{table}.{f.name}"] for f in dataclasses.fields(cls)}
        out[table] = _with_sources(lambda: cls(**fields), sources)
    return out


def _fill_scheduler(values: dict[str, Any], sources: dict[str, str], environ: Mapping[str, str]) -> None:
    for key, name in _SCHEDULER_ENV.items():
        if sources[key] == "default" and environ.get(name, "").strip().isdigit():
            values[key] = int(environ[name])
            sources[key] = f"env:{name}"


def _node_specs() -> list[KeySpec]:
    specs = []
    for f in dataclasses.fields(NodeConfig):
        default: Any = f.default
        if f.name in NODE_TABLES:
            specs.extend(_table_specs(f.name))
            continue
        if f.name == "listen":
            default = HostPort.parse(DEFAULT_LISTEN, "listen")
        elif f.name in ("node_id", "advertise"):
            default = None  # derived at load time
        specs.append(KeySpec(f.name, _NODE_KINDS[f.name], default, _NODE_HELP[f.name],
                             _NODE_FLAGS.get(f.name)))
    return specs


def _kind_of(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, tuple):
        return "strlist"
    return "str"


def _run_specs() -> list[KeySpec]:
    defaults = RunManifest()
    specs = []
    for section in dataclasses.fields(RunManifest):
        value = getattr(defaults, section.name)
        if section.name == "founded_at":
            continue  # set by the founding site, never configured
        if not dataclasses.is_dataclass(value):
            specs.append(KeySpec(f"run.{section.name}", _kind_of(value), value, "run-wide seed"))
            continue
        for f in dataclasses.fields(value):
            if section.name == "model" and f.name in ("options", "tensors"):
                continue  # options are free-form keys (below); tensors are sealed by the founder
            default = getattr(value, f.name)
            specs.append(KeySpec(f"run.{section.name}.{f.name}", _kind_of(default), default,
                                 f"run manifest {section.name}.{f.name}"))
    return specs


# Every other key of [run.model] is an option handed to the model factory (docs/MODELS.md).
MODEL_OPTION_PREFIX = "run.model."


def _is_model_option(key: str) -> bool:
    return (key.startswith(MODEL_OPTION_PREFIX) and key.count(".") == 2 and key not in ALL_SPECS
            and key != MODEL_OPTION_PREFIX + "tensors")  # sealed by the founding site, never configured


def _parse_model_option(key: str, raw: Any, where: str, from_text: bool) -> Any:
    """A factory option: TOML values as they are; text from flags read as a TOML value (1, 2.5,
    true, "x", [1, 2]) and otherwise taken as a plain string (`--set run.model.size=1m`)."""
    if from_text and isinstance(raw, str):
        try:
            return tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            return raw
    _require(isinstance(raw, (str, int, float, bool, list)), f"{key} = {raw!r} ({where}): must be a string, "
             "number, boolean or list")
    return raw


NODE_SPECS: tuple[KeySpec, ...] = tuple(_node_specs())
RUN_SPECS: tuple[KeySpec, ...] = tuple(_run_specs())
ALL_SPECS: dict[str, KeySpec] = {spec.key: spec for spec in NODE_SPECS + RUN_SPECS}
_ENV_TO_KEY: dict[str, str] = {spec.env: spec.key for spec in ALL_SPECS.values()}
assert len(_ENV_TO_KEY) == len(ALL_SPECS), "two keys map to one environment variable"


# ---------------------------------------------------------------------------------------------
# Parsing raw values (typed TOML values, or strings from the environment and flags)


def _parse(spec: KeySpec, raw: Any, where: str, base_dir: Path, from_text: bool) -> Any:
    """Typed value for `spec` from `raw`: text from env/flags is converted, TOML values must have the right type."""
    name = f"{spec.key} = {raw!r} ({where})"
    is_string = isinstance(raw, str)
    is_text = from_text and is_string  # to be converted to the key's type
    kind = spec.kind
    if kind == "str":
        _require(is_string, f"{name}: must be a string")
        return raw
    if kind == "int":
        if is_text:
            try:
                return int(raw.strip())
            except ValueError:
                raise ConfigError(f"{name}: must be an integer") from None
        _require(isinstance(raw, int) and not isinstance(raw, bool), f"{name}: must be an integer")
        return raw
    if kind == "float":
        if is_text:
            try:
                value = float(raw.strip())
            except ValueError:
                raise ConfigError(f"{name}: must be a number") from None
        else:
            _require(isinstance(raw, (int, float)) and not isinstance(raw, bool), f"{name}: must be a number")
            value = float(raw)
        _require(math.isfinite(value), f"{name}: must be finite")
        return value
    if kind == "bool":
        if is_text:
            lowered = raw.strip().lower()
            _require(lowered in ("true", "false", "1", "0", "yes", "no"), f"{name}: must be true or false")
            return lowered in ("true", "1", "yes")
        _require(isinstance(raw, bool), f"{name}: must be true or false")
        return raw
    if kind in ("path", "optpath"):
        _require(is_string, f"{name}: must be a path string")
        if kind == "optpath" and raw == "":
            return None
        _require(raw != "", f"{name}: must not be empty")
        path = Path(raw).expanduser()
        return path if path.is_absolute() else (base_dir / path)
    if kind == "pathstr":  # a path kept as text ("" = unset); relative to the file that set it
        _require(is_string, f"{name}: must be a path string")
        return _resolved(raw, base_dir) if raw else ""
    if kind == "pathlist":  # paths and globs, each relative to the file that set it
        if is_text:
            items = [item.strip() for item in raw.split(",") if item.strip()]
        else:
            _require(isinstance(raw, (list, tuple)) and all(isinstance(i, str) and i for i in raw),
                     f"{name}: must be a list of paths, e.g. [\"/srv/data/*.bin\"]")
            items = list(raw)
        return tuple(_resolved(item, base_dir) for item in items)
    if kind == "datamix":  # [node.data.mix.NAME] tables; paths inside are relative to the file that set them
        return parse_mix(raw, name, is_text, lambda path: _resolved(path, base_dir))
    if kind == "dataeval":  # [node.data.eval.NAME] tables, read as data.mix's are
        return parse_mix(raw, name, is_text, lambda path: _resolved(path, base_dir), table_name="eval")
    if kind == "optip":
        _require(is_string, f"{name}: must be an IP address string")
        if raw.strip() == "":
            return None
        try:
            address = ipaddress.ip_address(raw.strip())
        except ValueError:
            raise ConfigError(f"{name}: must be an IP address literal such as 10.0.0.5 (not a host name)") from None
        _require(not address.is_unspecified, f"{name}: a wildcard address picks nothing; leave it unset instead")
        return str(address)
    if kind == "opthostport" and is_string and raw.strip() == "":
        return None
    if kind in ("hostport", "opthostport"):
        _require(is_string, f"{name}: must be a string HOST:PORT")
        return HostPort.parse(raw, f"{spec.key} ({where})")
    if kind in ("hostports", "strlist"):
        if is_text or (is_string and kind == "hostports"):  # a file may give one peer as a plain string
            items = [item.strip() for item in raw.split(",") if item.strip()]
        else:
            _require(isinstance(raw, (list, tuple)) and all(isinstance(i, str) for i in raw),
                     f"{name}: must be a list of strings")
            items = list(raw)
        if kind == "strlist":
            return tuple(items)
        return tuple(HostPort.parse(item, f"{spec.key} ({where})") for item in items)
    raise AssertionError(f"unknown kind {kind}")


def _resolved(path: str, base_dir: Path) -> str:
    """`~` expanded; a relative path (or glob) taken from `base_dir`, as data_dir is."""
    expanded = os.path.expanduser(path)
    return expanded if os.path.isabs(expanded) else str(base_dir / expanded)


def _inline_secret_error(name: str, where: str) -> ConfigError:
    return ConfigError(
        f"{name} ({where}): inline secrets are refused (environment, argv and config files leak through "
        "ps, /proc/*/environ, shell history and backups); put the secret in a file readable only by the "
        f"node and set secret_file, or use systemd LoadCredential={DEFAULT_SECRET_CREDENTIAL}:/path/to/file"
    )


def _looks_like_inline_secret(key: str) -> bool:
    leaf = key.rsplit(".", 1)[-1].lower()
    if leaf in _SECRET_PATH_KEYS:
        return False
    return any(word == leaf or leaf.endswith("_" + word) or leaf.startswith(word + "_")
               for word in _INLINE_SECRET_WORDS)


# ---------------------------------------------------------------------------------------------
# Sources and the effective configuration


@dataclass(frozen=True, slots=True)
class Override:
    """One command-line value: dotted key, raw value (string or typed) and its flag as the source."""

    key: str
    value: Any
    source: str  # "flag:--listen", "flag:--set run.sync.period"


@dataclass(frozen=True, slots=True)
class Setting:
    key: str
    value: Any
    source: str
    env: str


@dataclass(frozen=True, slots=True)
class EffectiveConfig:
    """The validated node config and run manifest, plus where every value came from."""

    node: NodeConfig
    run: RunManifest
    sources: Mapping[str, str]  # dotted key -> "default" | "file:/p" | "env:NAME" | "flag:--x" | ...
    config_file: Path | None
    warnings: tuple[str, ...] = ()

    def settings(self) -> list[Setting]:
        """Every key (node keys first, then the run manifest) with its effective value and source."""
        run_dict = self.run.to_dict()
        out = []
        for spec in NODE_SPECS:
            out.append(Setting(spec.key, _node_value(self.node, spec.key), self.sources[spec.key], spec.env))
        for spec in RUN_SPECS:
            value: Any = run_dict
            for part in spec.key.split(".")[1:]:
                # A key a table leaves out when unset (model.init_from, init_sha256) is its default.
                value = value[part] if part in value else spec.default
            out.append(Setting(spec.key, value, self.sources[spec.key], spec.env))
        for name, value in self.run.model.options:
            key = MODEL_OPTION_PREFIX + name
            out.append(Setting(key, value, self.sources.get(key, "default"), ""))
        return out

    def explicit_run_keys(self) -> frozenset[str]:
        """Run keys this node set itself (not defaults), as run_config spells them (`sync.period`)."""
        return frozenset(k[len("run."):] for k, src in self.sources.items()
                         if k.startswith("run.") and src != "default")

    def read_secret(self) -> bytes:
        """The run secret, trailing newlines stripped; a clear error when none is configured or readable."""
        if self.node.secret_file is None:
            raise ConfigError(
                "no run secret: set secret_file (file, env DILOCO_SECRET_FILE or --secret-file) or run under "
                f"systemd with LoadCredential={self.node.secret_credential}:/path/to/secret")
        return _read_secret_file(self.node.secret_file, self.sources.get("secret_file", "?"))

    def manifest_for_join(self, theirs: RunManifest) -> RunManifest:
        """The run's manifest, after checking it does not contradict what this node's config says."""
        check_joiner_manifest(self.run, theirs, explicit=self.explicit_run_keys())
        return theirs


def _node_value(node: NodeConfig, key: str) -> Any:
    """A node key's value: "data.paths" is `node.data.paths` (a nested table), "listen" `node.listen`."""
    table, _, leaf = key.partition(".")
    return getattr(getattr(node, table), leaf) if leaf else getattr(node, key)


def _read_secret_file(path: Path, source: str) -> bytes:
    try:
        info = path.stat()
        _require(stat.S_ISREG(info.st_mode), f"secret_file = {str(path)!r} ({source}): not a regular file")
        _require(info.st_size <= MAX_SECRET_BYTES,
                 f"secret_file = {str(path)!r} ({source}): {info.st_size} bytes, larger than {MAX_SECRET_BYTES}; wrong file?")
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"secret_file = {str(path)!r} ({source}): cannot read: {exc.strerror or exc}") from None
    secret = data.rstrip(b"\r\n")
    _require(len(secret) >= MIN_SECRET_BYTES,
             f"secret_file = {str(path)!r} ({source}): secret is {len(secret)} bytes, need at least "
             f"{MIN_SECRET_BYTES} (e.g. head -c 32 /dev/urandom | base64 > FILE)")
    return secret


def check_joiner_manifest(ours: RunManifest, theirs: RunManifest, explicit: Iterable[str] | None = None) -> None:
    """Refuse to join a run whose manifest contradicts ours.

    With `explicit` (keys like `sync.period`), only those keys are compared: a joiner that left a
    key at its default accepts the run's value. Without it every key is compared.
    """
    diffs = ours.differences(theirs)
    if explicit is not None:
        wanted = set(explicit)
        diffs = [d for d in diffs if d.split(":", 1)[0] in wanted]
    if diffs:
        raise ConfigError(
            "this node's [run] settings contradict the run it is joining (ours != run's):\n  "
            + "\n  ".join(diffs)
            + "\nremove these keys from the node's config (joiners receive the run manifest) or fix them to match")


def load_config(
    toml_path: str | os.PathLike[str] | None,
    environ: Mapping[str, str],
    cli_overrides: Mapping[str, Any] | Sequence[Override] = (),
) -> EffectiveConfig:
    """Merge defaults < TOML file < `DILOCO_*` environment < flags into a validated `EffectiveConfig`.

    `cli_overrides` is either a list of `Override` (from `overrides_from_args`) or a plain mapping
    of dotted key to value (its source is then `flag:--<key>`). Raises `ConfigError` naming the
    key, the bad value and where it came from.
    """
    overrides = _normalise_overrides(cli_overrides)
    # key -> (raw value, source, base dir for relative paths, value is text to convert)
    raw: dict[str, tuple[Any, str, Path, bool]] = {}
    cwd = Path.cwd()

    config_file = None
    if toml_path is not None:
        config_file = Path(toml_path)
    elif environ.get(CONFIG_FILE_ENV):
        config_file = Path(environ[CONFIG_FILE_ENV])
    if config_file is not None:
        config_file = config_file.expanduser().absolute()
        for key, value in _read_toml(config_file).items():
            raw[key] = (value, f"file:{config_file}", config_file.parent, False)

    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name.startswith(ENV_PRIVATE_PREFIX) or name == CONFIG_FILE_ENV:
            continue
        if name not in _ENV_TO_KEY:
            if _looks_like_inline_secret(name[len(ENV_PREFIX):]):
                raise _inline_secret_error(name, "environment")
            raise ConfigError(f"unknown environment variable {name}: not a diloco-node setting "
                              f"(see `diloco-node config show` for every variable; use {ENV_PRIVATE_PREFIX}* "
                              "for private tooling variables)")
        raw[_ENV_TO_KEY[name]] = (value, f"env:{name}", cwd, True)

    for override in overrides:
        if _is_model_option(override.key):
            raw[override.key] = (override.value, override.source, cwd, True)
            continue
        if override.key not in ALL_SPECS:
            _refuse_moved_data_key(override.key, override.source)
            if _looks_like_inline_secret(override.key):
                raise _inline_secret_error(override.key, override.source)
            raise ConfigError(f"{override.key} ({override.source}): unknown setting; known node keys: "
                              f"{', '.join(s.key for s in NODE_SPECS)}; run keys look like run.sync.period")
        raw[override.key] = (override.value, override.source, cwd, True)

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, spec in ALL_SPECS.items():
        if key in raw:
            value, source, base, from_text = raw[key]
            values[key] = _parse(spec, value, source, base, from_text)
            sources[key] = source
        else:
            values[key] = spec.default
            sources[key] = "default"

    model_options: dict[str, Any] = {}
    for key, (value, source, _, from_text) in raw.items():
        if _is_model_option(key):
            model_options[key[len(MODEL_OPTION_PREFIX):]] = _parse_model_option(key, value, source, from_text)
            sources[key] = source

    warnings: list[str] = []
    _fill_tls(values, sources, environ)
    _fill_derived(values, sources, environ, cwd)
    _fill_secret(values, sources, environ, warnings)

    _fill_scheduler(values, sources, environ)
    node_kwargs = {spec.key: values[spec.key] for spec in NODE_SPECS if "." not in spec.key}
    node_kwargs.update(_node_table_kwargs(values, sources))
    node = _with_sources(lambda: NodeConfig(**node_kwargs), sources)
    run = _with_sources(lambda: RunManifest.from_dict(_nest_run(values, model_options)), sources)
    if node.secret_file is not None:
        _read_secret_file(node.secret_file, sources["secret_file"])  # fail now, not at the first frame
        mode = node.secret_file.stat().st_mode
        if mode & 0o077:
            warnings.append(f"secret_file {node.secret_file} is readable by group or others "
                            f"(mode {stat.filemode(mode)}); chmod 600 it")
    else:
        warnings.append("no run secret configured (secret_file or systemd credential); `run` will refuse to start")
    if node.data_dir.exists() and not node.data_dir.is_dir():
        raise ConfigError(f"data_dir = {str(node.data_dir)!r} ({sources['data_dir']}): exists and is not a directory")
    return EffectiveConfig(node, run, sources, config_file, tuple(warnings))


def _normalise_overrides(cli_overrides: Mapping[str, Any] | Sequence[Override]) -> list[Override]:
    if isinstance(cli_overrides, Mapping):
        out = []
        for key, value in cli_overrides.items():
            spec = ALL_SPECS.get(key)
            flag = spec.flag if spec and spec.flag else f"--set {key}"
            out.append(Override(key, value, f"flag:{flag}"))
        return out
    return list(cli_overrides)


def _read_toml(path: Path) -> dict[str, Any]:
    """Flatten the file into dotted keys; unknown tables/keys and inline secrets are errors."""
    try:
        with path.open("rb") as handle:
            document = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
    where = f"file:{path}"
    flat: dict[str, Any] = {}
    for name, value in document.items():
        if name == "node" and isinstance(value, dict):
            for key, item in value.items():
                if key in NODE_TABLES and isinstance(item, dict):
                    for sub, leaf in item.items():
                        _take_key(flat, f"{key}.{sub}", f"node.{key}.{sub}", leaf, where)
                else:
                    _take_key(flat, key, f"node.{key}", item, where)
        elif name == "run" and isinstance(value, dict):
            for section, item in value.items():
                if isinstance(item, dict) and f"run.{section}" not in ALL_SPECS:
                    for key, leaf in item.items():
                        _take_key(flat, f"run.{section}.{key}", f"run.{section}.{key}", leaf, where)
                else:
                    _take_key(flat, f"run.{section}", f"run.{section}", item, where)
        else:
            _take_key(flat, "", name, value, where)
    return flat


def _take_key(flat: dict[str, Any], key: str, dotted: str, value: Any, where: str) -> None:
    if key in ALL_SPECS or _is_model_option(key):
        flat[key] = value
        return
    _refuse_moved_data_key(dotted, where)  # before the secret check: run.data.token_file is no secret
    if _looks_like_inline_secret(dotted):
        raise _inline_secret_error(dotted, where)
    raise ConfigError(f"{dotted} ({where}): unknown key; {_known_keys_hint(dotted)}")


def _refuse_moved_data_key(dotted: str, where: str) -> None:
    if dotted.startswith("run.data.") and dotted.rsplit(".", 1)[1] in MOVED_DATA_KEYS:
        raise ConfigError(f"{dotted} ({where}): where a site reads its data is a site setting now: move it to "
                          "[node.data] (run.data.token_file becomes [node.data] paths = [...]; see docs/DATA.md)")


def _known_keys_hint(dotted: str) -> str:
    table = dotted.split(".")[1] if dotted.startswith("node.") and dotted.count(".") == 2 else ""
    if table in NODE_TABLES:
        return f"known in [node.{table}]: {', '.join(f.name for f in dataclasses.fields(NODE_TABLES[table]))}"
    if dotted.startswith("run."):
        parent = dotted.rsplit(".", 1)[0]
        known = [k.rsplit(".", 1)[1] for k in ALL_SPECS if k.startswith(parent + ".") and k.count(".") == dotted.count(".")]
        if known:
            return f"known in [{parent}]: {', '.join(known)}"
        return "run sections: model, data, inner, outer, sync, stop (and run.seed)"
    if dotted.startswith("node."):
        return f"known in [node]: {', '.join(s.key for s in NODE_SPECS)}"
    return "top-level tables are [node] and [run]"


def _fill_derived(values: dict[str, Any], sources: dict[str, str], environ: Mapping[str, str], cwd: Path) -> None:
    if values["node_id"] is None:
        values["node_id"] = _sanitised_hostname()
        sources["node_id"] = "default:hostname"
    if values["advertise"] is None:
        listen: HostPort = values["listen"]
        if listen.is_wildcard:
            raise ConfigError(f"advertise: not set, and listen = {str(listen)!r} ({sources['listen']}) is a wildcard "
                              "address other sites cannot reach; set advertise = \"http://HOST:PORT\"")
        # With TLS on, peers reach us over https (_fill_tls ran first, so credentials count).
        values["advertise"] = listen.url("https" if values["tls_cert_file"] is not None else "http")
        sources["advertise"] = "derived:listen"
    if values["status_listen"] is None and values["tls_cert_file"] is not None:
        # The peer port speaks TLS only; operators read a loopback port beside it (config show says which).
        listen = values["listen"]
        values["status_listen"] = HostPort("127.0.0.1", listen.port + 1 if listen.port < 65535 else listen.port - 1)
        sources["status_listen"] = "derived:listen"
    status_listen: HostPort | None = values["status_listen"]
    if not values["status_url"] and status_listen is not None and not status_listen.is_wildcard:
        values["status_url"] = status_listen.url("http")  # the operator listener speaks plain HTTP
        sources["status_url"] = "derived:status_listen"
    if sources["data_dir"] == "default" and environ.get("STATE_DIRECTORY"):
        # systemd's StateDirectory= sets this (colon-separated when several are configured).
        values["data_dir"] = Path(environ["STATE_DIRECTORY"].split(":")[0])
        sources["data_dir"] = "env:STATE_DIRECTORY"
    elif not Path(values["data_dir"]).is_absolute():
        values["data_dir"] = cwd / values["data_dir"]


def _fill_tls(values: dict[str, Any], sources: dict[str, str], environ: Mapping[str, str]) -> None:
    """Unset TLS keys from systemd credentials of the names in TLS_CREDENTIALS, when present."""
    credentials = environ.get("CREDENTIALS_DIRECTORY")
    if not credentials:
        return
    for key, credential in TLS_CREDENTIALS.items():
        candidate = Path(credentials) / credential
        if values[key] is None and candidate.exists():
            values[key] = candidate
            sources[key] = f"systemd-credential:{credential}"


def _fill_secret(values: dict[str, Any], sources: dict[str, str], environ: Mapping[str, str], warnings: list[str]) -> None:
    if values["secret_file"] is not None:
        return
    credentials = environ.get("CREDENTIALS_DIRECTORY")
    if credentials:
        candidate = Path(credentials) / values["secret_credential"]
        if candidate.exists():
            values["secret_file"] = candidate
            sources["secret_file"] = f"systemd-credential:{values['secret_credential']}"
        else:
            warnings.append(f"$CREDENTIALS_DIRECTORY is set but has no credential named {values['secret_credential']!r}")


def _sanitised_hostname() -> str:
    name = socket.gethostname().split(".")[0]
    name = re.sub(r"[^A-Za-z0-9._-]", "-", name).strip("-._")[:63]
    return name or "node"


def _nest_run(values: Mapping[str, Any], model_options: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for spec in RUN_SPECS:
        parts = spec.key.split(".")[1:]
        if len(parts) == 1:
            nested[parts[0]] = values[spec.key]
        else:
            nested.setdefault(parts[0], {})[parts[1]] = values[spec.key]
    nested["model"].update(model_options)
    return nested


def _with_sources(build: Any, sources: Mapping[str, str]) -> Any:
    """Run a validating constructor; on error, append where the keys it names were set."""
    try:
        return build()
    except ConfigError as exc:
        message = str(exc)
        named = [f"{spec.display} from {sources[spec.key]}" for spec in ALL_SPECS.values()
                 if sources.get(spec.key, "default") != "default"
                 and re.search(rf"(?<![\w.]){re.escape(spec.display)}(?![\w])", message)]
        if named:
            message += f" [{'; '.join(named)}]"
        raise ConfigError(message) from None


# ---------------------------------------------------------------------------------------------
# Command-line flags shared by `run` and `config show`


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags `run` accepts; `config show` takes the same so it shows exactly what `run` would use."""
    parser.add_argument("--config", metavar="FILE", help=f"TOML config file (or ${CONFIG_FILE_ENV})")
    parser.add_argument("--node-id", metavar="ID", help=_NODE_HELP["node_id"])
    parser.add_argument("--listen", metavar="HOST:PORT", help=f"{_NODE_HELP['listen']} (default {DEFAULT_LISTEN})")
    parser.add_argument("--advertise", metavar="URL", help=_NODE_HELP["advertise"])
    parser.add_argument("--source-address", metavar="IP", help=_NODE_HELP["source_address"])
    parser.add_argument("--bootstrap", metavar="HOST:PORT", action="append",
                        help="a peer already in the run; repeat or comma-separate for several")
    parser.add_argument("--data-dir", metavar="DIR", help=_NODE_HELP["data_dir"])
    parser.add_argument("--secret-file", metavar="FILE", help=_NODE_HELP["secret_file"])
    parser.add_argument("--role", choices=ROLES, help=_NODE_HELP["role"])
    parser.add_argument("--log-level", choices=LOG_LEVELS, help=_NODE_HELP["log_level"])
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="set_values",
                        help="any other key, e.g. --set run.sync.period=16 or --set checkpoint_keep=5")
    # Defined only to refuse it: without it argparse would take `--secret X` as an abbreviation
    # of --secret-file and then echo the secret back in a "file not found" error.
    parser.add_argument("--secret", dest="inline_secret", help=argparse.SUPPRESS)


def overrides_from_args(args: argparse.Namespace) -> list[Override]:
    """The flags the user actually gave, as `Override`s (flags left unset are not overrides)."""
    if getattr(args, "inline_secret", None) is not None:
        raise _inline_secret_error("--secret", "command line")
    out: list[Override] = []
    for spec in NODE_SPECS:
        if spec.flag is None:
            continue
        value = getattr(args, spec.flag[2:].replace("-", "_"), None)
        if value is None:
            continue
        if isinstance(value, list):
            value = ",".join(value)
        out.append(Override(spec.key, value, f"flag:{spec.flag}"))
    for item in getattr(args, "set_values", []) or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set run.sync.period=16")
        out.append(Override(key, value, f"flag:--set {key}"))
    return out


def load_config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> EffectiveConfig:
    """`load_config` for a namespace parsed with `add_run_flags` (what `run` and `config show` call)."""
    return load_config(args.config, os.environ if environ is None else environ, overrides_from_args(args))


def run_id_for(secret: bytes) -> str:
    """The run id stamped on every frame: derived from the run secret, so sites agree without config."""
    return "run-" + hashlib.sha256(b"diloco-node/run-id\0" + secret).hexdigest()[:16]
