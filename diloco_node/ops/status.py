"""The operator surface's documents: the /status schema and builder, /metrics, / and the probes.

- `StatusDocument`: a frozen tree with a schema string, `to_json()` and a validating `from_dict()`
  (the `status`/`watch` commands parse what a node serves with it).
- `StatusBuilder`: the daemon's thread-safe collector (learner progress, bytes, coordination
  state, recent errors) that produces a `StatusDocument` for a given `now`.
- `MetricsRegistry`: one prometheus_client `CollectorRegistry` per node (several nodes share a
  process in tests), with counters, gauges and histograms, the families derived from the status
  document and the process_* collector, rendered in the text format (0.0.4) by `render_metrics`.
  One prefix (`diloco_`), counters end in `_total`, cumulative seconds are `*_seconds_total`.
- `operator_routes`: aiohttp routes for `/status`, `/metrics`, `/livez`, `/readyz` and the live
  page's `/` and `/series` (ops/page.py), for the daemon to mount.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Sequence

from diloco_node.ops.liveness import ALIVE, Liveness
from diloco_node.ops.page import StatusSeries, page_routes

if TYPE_CHECKING:
    from aiohttp import web

STATUS_SCHEMA = "diloco-node/status/1"
_SCHEMA_PREFIX = "diloco-node/status/"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Tokens/s is averaged over this window: long enough to smooth step-to-step jitter, short enough
# that a stalled learner shows 0 within a minute.
TOKENS_RATE_WINDOW_S = 30.0
# Recent errors shown on /status; older ones are in the log.
MAX_RECENT_ERRORS = 10
MAX_ERROR_CHARS = 500


class StatusFormatError(ValueError):
    """A status document does not match the schema; the message names the field."""


# ---------------------------------------------------------------------------------------------
# The document


@dataclass(frozen=True, slots=True)
class MemberStatus:
    node_id: str
    url: str
    role: str
    alive: bool
    voter: bool = True
    last_seen_s: float | None = None  # seconds since we last heard from it (None: never, or self)
    # Where a browser reaches the member's operator routes (/series) when not at `url` (TLS on);
    # "" when the member advertised none (then they are at `url`, or not reachable from a browser).
    status_url: str = ""


@dataclass(frozen=True, slots=True)
class LearnerStatus:
    """The learner's progress. `tokens_per_s` is averaged over the last `TOKENS_RATE_WINDOW_S`;
    `step_time_s` (wall seconds per step), `mfu` (model FLOPs utilisation, learn/flops.py; None
    where the device's peak is unknown, e.g. a CPU), `grad_norm` (the batch gradient's global norm
    before clipping) and `lr` (the inner learning rate) are those of the last closed step window
    (learn/figures.py); None before the first window. A learner without progress within the
    tokens window shows mfu 0."""

    step: int = 0
    loss: float | None = None
    tokens: int = 0
    tokens_per_s: float = 0.0
    step_time_s: float | None = None
    mfu: float | None = None
    grad_norm: float | None = None
    lr: float | None = None


@dataclass(frozen=True, slots=True)
class EvalSetStatus:
    """One separate eval set's figure: its mean next-token loss (None: not finite) over `tokens`
    predicted tokens."""

    loss: float | None = None
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class EvalStatus:
    """The global model's loss on this site's held-out data, as of a commit index (None: not yet).
    `loss` is the held-out slice's (set "held_out"; None too when the site has eval sets instead),
    `sets` each `[node.data.eval.NAME]` set's, by name; `seconds` the whole evaluation's."""

    loss: float | None = None
    commit_index: int = 0
    seconds: float = 0.0
    sets: Mapping[str, EvalSetStatus] = field(default_factory=dict)

    def figures(self) -> list[tuple[str, float | None]]:
        """(set name, loss) of everything evaluated: "held_out" first when the slice was."""
        held = [("held_out", self.loss)] if self.loss is not None or not self.sets else []
        return held + [(name, figure.loss) for name, figure in self.sets.items()]

    @classmethod
    def from_dict(cls, raw: Any, where: str = "evaluation") -> "EvalStatus":
        sets = raw.get("sets", {}) if isinstance(raw, Mapping) else {}
        if not isinstance(sets, Mapping):
            raise StatusFormatError(f"{where}.sets: expected an object, got {type(sets).__name__}")
        plain = _build(_EvalFigures, raw, where)
        return cls(plain.loss, plain.commit_index, plain.seconds,
                   {str(name): _build(EvalSetStatus, figure, f"{where}.sets.{name}") for name, figure in sets.items()})


@dataclass(frozen=True, slots=True)
class _EvalFigures:
    """EvalStatus's plain fields, validated by `_build` (which reads flat fields only)."""

    loss: float | None = None
    commit_index: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class EvictedStatus:
    """A site evicted from this run (`diloco-node evict`): refused by every member from `index` on."""

    node_id: str
    index: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class TlsStatus:
    """The site's own TLS certificate, as loaded (`enabled` false: TLS is off, the rest empty)."""

    enabled: bool = False
    node_id: str = ""  # the certificate's diloco-node://<node_id> URI SAN
    fingerprint: str = ""  # SHA-256 of the certificate (DER), hex
    not_after: str = ""  # expiry, ISO 8601 UTC
    expires_in_s: float = 0.0  # seconds until then, as of this document (negative once expired)
    days_left: float = 0.0  # the same in days (2 decimals)
    ca_subject: str = ""  # the run CA's subject
    crl_loaded: bool = False  # a tls_crl_file is in use
    loaded_at: str = ""  # when the certificates in use were loaded (start or reload), ISO 8601 UTC
    reloads: int = 0  # successful reloads since start
    reload_error: str = ""  # the last failed reload's error; "" after a good load


@dataclass(frozen=True, slots=True)
class TrackerStatus:
    """One experiment tracker (ops/tracking.py): where it writes (`target`: a directory, a W&B
    project), entries written and dropped (queue full, or a failed write), the last failure ("" once
    writing works again). `enabled` false: the tracker is off, the rest empty."""

    enabled: bool = False
    target: str = ""
    written: int = 0
    dropped: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class TrackingStatus:
    tensorboard: TrackerStatus = field(default_factory=TrackerStatus)
    wandb: TrackerStatus = field(default_factory=TrackerStatus)

    @classmethod
    def from_dict(cls, raw: Any, where: str = "tracking") -> "TrackingStatus":
        if not isinstance(raw, Mapping):
            raise StatusFormatError(f"{where}: expected an object, got {type(raw).__name__}")
        return cls(_build(TrackerStatus, raw.get("tensorboard", {}), where + ".tensorboard"),
                   _build(TrackerStatus, raw.get("wandb", {}), where + ".wandb"))


@dataclass(frozen=True, slots=True)
class ByteCounters:
    sent: int = 0
    received: int = 0


@dataclass(frozen=True, slots=True)
class OuterGradientStatus:
    """What the outer gradients cost this node: the run's codecs both ways, whether learners keep
    an error-feedback remainder, the encoded bytes of the contribution chunks this node produced
    (up) and of the commit payloads it applied (down), with the parameters those bytes carried,
    and so the bits per parameter each way (None before any)."""

    codec_up: str = ""
    codec_down: str = ""
    error_feedback: bool = False
    sent_bytes: int = 0
    sent_parameters: int = 0
    applied_bytes: int = 0
    applied_parameters: int = 0
    bits_per_parameter_up: float | None = None
    bits_per_parameter_down: float | None = None

    @classmethod
    def of(cls, *, codec_up: str, codec_down: str, error_feedback: bool, sent_bytes: int, sent_parameters: int,
           applied_bytes: int, applied_parameters: int) -> "OuterGradientStatus":
        """The section with its bits per parameter worked out from the counters."""
        return cls(codec_up, codec_down, error_feedback, sent_bytes, sent_parameters, applied_bytes,
                   applied_parameters, bits_per_parameter(sent_bytes, sent_parameters),
                   bits_per_parameter(applied_bytes, applied_parameters))


def bits_per_parameter(encoded_bytes: int, parameters: int) -> float | None:
    """8 x bytes / parameters, to 4 decimals; None when no parameter was carried."""
    return round(8.0 * encoded_bytes / parameters, 4) if parameters > 0 else None


@dataclass(frozen=True, slots=True)
class RelayStatus:
    """Relayed commit payloads at this node (daemon/relays.py): copies it pushed as lease holder,
    forwarded as a relay, served to fetchers; fetches it sent; fetches it promised (bytes it was
    receiving itself, sent on arrival); streams it refused (wrong digest,
    short, over the run's bound); payload bytes pushed and forwarded (fetch answers included);
    what it keeps now until the log holds it (spool files on disk); and the relay plane's latest
    decisions with their reasons, newest first (bootstrap/relay_plane.py, `RelayFollower`)."""

    pushed: int = 0
    forwarded: int = 0
    served: int = 0
    fetched: int = 0
    refused: int = 0
    promised: int = 0
    pushed_bytes: int = 0
    forwarded_bytes: int = 0
    held: int = 0
    spooled: int = 0
    held_bytes: int = 0
    decisions: tuple[str, ...] = ()  # e.g. "1.2s ago: fetch 3fa2b1c0 from b: no bytes after 1 relay timeout: ..."


@dataclass(frozen=True, slots=True)
class QuorumStatus:
    have: int = 0
    need: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class AdmissionStatus:
    """Contributions this node's syncer refused, by kind, and claims it capped, since the node
    started (sync/admission.py), with the last reason of either."""

    not_member: int = 0
    not_learner: int = 0
    left: int = 0
    not_lease_holder: int = 0
    in_flight: int = 0
    unknown_fragment: int = 0
    malformed: int = 0
    capped: int = 0
    last_reason: str = ""

    @property
    def refused(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("capped", "last_reason")}


@dataclass(frozen=True, slots=True)
class FragmentStatus:
    fragment: int
    round: int


@dataclass(frozen=True, slots=True)
class MeshAxes:
    data: int = 0
    fsdp: int = 0


@dataclass(frozen=True, slots=True)
class DeviceStatus:
    """The accelerators this site trains on: platform ("gpu", "tpu", "cpu"), device count over
    all its processes (hosts), and the mesh's axis sizes. Count 0: no learner (a witness)."""

    platform: str = ""
    count: int = 0
    processes: int = 0
    mesh: MeshAxes = field(default_factory=MeshAxes)

    @classmethod
    def from_dict(cls, raw: Any, where: str = "devices") -> "DeviceStatus":
        if not isinstance(raw, Mapping):
            raise StatusFormatError(f"{where}: expected an object, got {type(raw).__name__}")
        flat = {k: v for k, v in raw.items() if k != "mesh"}
        plain = _build(_DeviceFields, flat, where)
        return cls(plain.platform, plain.count, plain.processes, _build(MeshAxes, raw.get("mesh", {}), where + ".mesh"))


@dataclass(frozen=True, slots=True)
class _DeviceFields:
    platform: str = ""
    count: int = 0
    processes: int = 0


@dataclass(frozen=True, slots=True)
class RecentError:
    age_s: float
    message: str


@dataclass(frozen=True, slots=True)
class StatusDocument:
    """What `/status` serves. Field names are the JSON keys."""

    node_id: str
    run_id: str
    role: str
    ready: bool
    epoch: int
    coordinator: str | None  # node_id of the lease holder, None while no one holds it
    commit_index: int
    state_digest: str
    members: tuple[MemberStatus, ...] = ()
    learner: LearnerStatus = field(default_factory=LearnerStatus)
    evaluation: EvalStatus = field(default_factory=EvalStatus)
    bytes: ByteCounters = field(default_factory=ByteCounters)
    # The outer gradients' codecs and what they cost, both ways (daemon/rounds.py OuterGradientBytes)
    outer_gradients: OuterGradientStatus = field(default_factory=OuterGradientStatus)
    quorum: QuorumStatus = field(default_factory=QuorumStatus)
    admission: AdmissionStatus = field(default_factory=AdmissionStatus)  # contributions refused / capped
    fragments: tuple[FragmentStatus, ...] = ()
    uptime_s: float = 0.0
    version: str = ""
    last_errors: tuple[RecentError, ...] = ()
    ready_reason: str = ""  # why not ready yet ("catching up: applied 12 of 40"), or what ready means
    log_first_index: int = 1  # the oldest log entry this node still holds (> 1 once compacted)
    log_bytes: int = 0  # size of the replicated log on disk
    loop_lag_s: float = 0.0  # worst event-loop lag of the last 10-20 s (daemon/loop_monitor.py)
    loop_stalls: int = 0  # event-loop stalls of >= 1 s since the process started
    devices: DeviceStatus = field(default_factory=DeviceStatus)  # what the learner trains on
    tls: TlsStatus = field(default_factory=TlsStatus)  # this site's certificate (TLS on)
    evicted: tuple[EvictedStatus, ...] = ()  # sites evicted from this run, by node id
    relays: RelayStatus = field(default_factory=RelayStatus)  # relayed commit payloads (daemon/relays.py)
    tracking: TrackingStatus = field(default_factory=TrackingStatus)  # experiment trackers (ops/tracking.py)
    # The disk as the durable steps see it (ops/storage_health.py): `failing` points with their
    # error, `failures_total` by point, `quarantined` files; `vote_barrier` when the node does not vote
    # freely; `log_repair` after log.bin was found damaged while running (lost_after, refilled)
    storage: dict[str, Any] = field(default_factory=dict)
    # Seconds since this node last saw its commit index grow (since it started, before any commit):
    # the "no commit" alert's figure (examples/monitoring/alerts.yml)
    commit_age_s: float = 0.0
    schema: str = STATUS_SCHEMA

    @property
    def is_coordinator(self) -> bool:
        return self.coordinator is not None and self.coordinator == self.node_id

    def to_dict(self) -> dict[str, Any]:
        """JSON-shaped: nested dicts and lists (no tuples)."""
        return _jsonable(dataclasses.asdict(self))

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, raw: Any) -> "StatusDocument":
        """Validate a parsed document; unknown keys are ignored (newer nodes may add fields)."""
        if not isinstance(raw, Mapping):
            raise StatusFormatError(f"status: expected a JSON object, got {type(raw).__name__}")
        schema = _get(raw, "schema", str)
        if not schema.startswith(_SCHEMA_PREFIX) or schema.split("/")[-1] != STATUS_SCHEMA.split("/")[-1]:
            raise StatusFormatError(f"schema = {schema!r}: this build reads {STATUS_SCHEMA!r}")
        return cls(
            schema=schema,
            node_id=_get(raw, "node_id", str),
            run_id=_get(raw, "run_id", str),
            role=_get(raw, "role", str),
            ready=_get(raw, "ready", bool),
            epoch=_get(raw, "epoch", int),
            coordinator=_get(raw, "coordinator", (str, type(None))),
            commit_index=_get(raw, "commit_index", int),
            state_digest=_get(raw, "state_digest", str),
            members=tuple(_build(MemberStatus, m, f"members[{i}]")
                          for i, m in enumerate(_get(raw, "members", list))),
            learner=_build(LearnerStatus, _get(raw, "learner", dict), "learner"),
            # Older nodes have no evaluation: an absent object is "not evaluated yet".
            evaluation=EvalStatus.from_dict(raw.get("evaluation", {}), "evaluation"),
            bytes=_build(ByteCounters, _get(raw, "bytes", dict), "bytes"),
            # Older nodes have no outer-gradient section: an absent object reads as unknown codecs, 0 bytes.
            outer_gradients=_build(OuterGradientStatus, raw.get("outer_gradients", {}), "outer_gradients"),
            quorum=_build(QuorumStatus, _get(raw, "quorum", dict), "quorum"),
            # Older nodes have no admission counters: an absent object reads as all zero.
            admission=_build(AdmissionStatus, raw.get("admission", {}), "admission"),
            fragments=tuple(_build(FragmentStatus, f, f"fragments[{i}]")
                            for i, f in enumerate(raw.get("fragments", []) or [])),
            uptime_s=float(raw.get("uptime_s", 0.0) or 0.0),
            version=str(raw.get("version", "")),
            last_errors=tuple(_build(RecentError, e, f"last_errors[{i}]")
                              for i, e in enumerate(raw.get("last_errors", []) or [])),
            ready_reason=str(raw.get("ready_reason", "")),
            log_first_index=int(_get(raw, "log_first_index", int)) if "log_first_index" in raw else 1,
            log_bytes=int(_get(raw, "log_bytes", int)) if "log_bytes" in raw else 0,
            loop_lag_s=float(_get(raw, "loop_lag_s", (int, float))) if "loop_lag_s" in raw else 0.0,
            loop_stalls=int(_get(raw, "loop_stalls", int)) if "loop_stalls" in raw else 0,
            # Older nodes have no devices: an absent object reads as "not reported".
            devices=DeviceStatus.from_dict(raw.get("devices", {})),
            # Older nodes, and TLS off: an absent object reads as "TLS off".
            tls=_build(TlsStatus, raw.get("tls", {}), "tls"),
            evicted=tuple(_build(EvictedStatus, e, f"evicted[{i}]")
                          for i, e in enumerate(raw.get("evicted", []) or [])),
            # Older nodes have no relay counters: an absent object reads as all zero.
            relays=_build(RelayStatus, raw.get("relays", {}), "relays"),
            # Older nodes have no trackers: an absent object reads as both off.
            tracking=TrackingStatus.from_dict(raw.get("tracking", {})),
            # Older nodes have no storage section: an absent object reads as nothing failing.
            storage=dict(_get(raw, "storage", dict)) if "storage" in raw else {},
            commit_age_s=float(_get(raw, "commit_age_s", (int, float))) if "commit_age_s" in raw else 0.0,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> "StatusDocument":
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise StatusFormatError(f"status: not JSON: {exc}") from None
        return cls.from_dict(raw)


def _iso_utc(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _type_ok(value: Any, types: type | tuple[type, ...]) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types:
        return False  # JSON true is not a number here
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        return True
    return isinstance(value, types)


def _get(raw: Mapping[str, Any], key: str, types: type | tuple[type, ...], where: str = "") -> Any:
    if key not in raw:
        raise StatusFormatError(f"{where}{key}: missing")
    value = raw[key]
    if not _type_ok(value, types):
        names = "/".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise StatusFormatError(f"{where}{key} = {value!r}: expected {names}")
    return value


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,), "bool": (bool,), "int": (int,), "float": (float,),
    "float | None": (float, type(None)), "str | None": (str, type(None)), "tuple[str, ...]": (list,),
}


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, Mapping):
        raise StatusFormatError(f"{where}: expected an object, got {type(raw).__name__}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw and (f.default is not dataclasses.MISSING):
            continue
        value = _get(raw, f.name, _FIELD_TYPES[str(f.type)], where + ".")
        if str(f.type) == "tuple[str, ...]":
            if not all(isinstance(item, str) for item in value):
                raise StatusFormatError(f"{where}.{f.name} = {value!r}: expected a list of strings")
            value = tuple(value)
        kwargs[f.name] = float(value) if str(f.type).startswith("float") and value is not None else value
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------
# The builder the daemon feeds


class StatusBuilder:
    """Collects a node's live figures from the event loop and the training thread (hence the lock)."""

    def __init__(self, node_id: str, run_id: str, role: str, started_at: float, version: str = "",
                 tokens_rate_window_s: float = TOKENS_RATE_WINDOW_S, max_recent_errors: int = MAX_RECENT_ERRORS,
                 tracking: Callable[[], TrackingStatus] | None = None) -> None:
        self._lock = threading.Lock()
        self._base = StatusDocument(node_id=node_id, run_id=run_id, role=role, ready=False, epoch=0,
                                    coordinator=None, commit_index=0, state_digest="", version=version)
        self._started_at = started_at
        self._window_s = tokens_rate_window_s
        self._samples: deque[tuple[float, int]] = deque()
        self._learner = LearnerStatus()
        # The last step window's figures (set_learner_figures), kept across record_learner calls.
        self._figures: dict[str, float | None] = {}
        self._sent = 0
        self._received = 0
        self._errors: deque[tuple[float, str]] = deque(maxlen=max_recent_errors)
        self._tls: TlsStatus | None = None
        self._tls_not_after_unix = 0.0
        self.wall: Callable[[], float] = time.time  # the certificate's time to expiry, the commit age
        self._commit_seen_at: float | None = None  # wall time the commit index last grew (None: not since start)
        # The trackers' counters (ops/tracking.py Tracking.status), read when a document is built.
        self.tracking = tracking

    def set_run_id(self, run_id: str) -> None:
        """A joiner learns the run id only after joining."""
        with self._lock:
            self._base = dataclasses.replace(self._base, run_id=run_id)

    def set_ready(self, ready: bool, reason: str) -> None:
        with self._lock:
            self._base = dataclasses.replace(self._base, ready=ready, ready_reason=reason)

    def set_coordination(self, *, epoch: int, coordinator: str | None, commit_index: int, state_digest: str,
                         members: Sequence[MemberStatus], quorum: QuorumStatus,
                         fragments: Sequence[FragmentStatus] = ()) -> None:
        with self._lock:
            if commit_index > self._base.commit_index:
                self._commit_seen_at = self.wall()
            self._base = dataclasses.replace(
                self._base, epoch=epoch, coordinator=coordinator, commit_index=commit_index,
                state_digest=state_digest, members=tuple(members), quorum=quorum, fragments=tuple(fragments))

    def set_admission(self, admission: AdmissionStatus) -> None:
        """The syncer's admission counters (sync/admission.py `AdmissionCounts`)."""
        with self._lock:
            self._base = dataclasses.replace(self._base, admission=admission)

    def set_evicted(self, evicted: Sequence[EvictedStatus]) -> None:
        with self._lock:
            self._base = dataclasses.replace(self._base, evicted=tuple(evicted))

    def set_log(self, *, first_index: int, size_bytes: int) -> None:
        """The replicated log's first held index and its size on disk (compaction at work)."""
        with self._lock:
            self._base = dataclasses.replace(self._base, log_first_index=first_index, log_bytes=size_bytes)

    def set_storage(self, storage: Mapping[str, Any]) -> None:
        with self._lock:
            self._base = dataclasses.replace(self._base, storage=dict(storage))

    def set_relays(self, relays: RelayStatus) -> None:
        """The relayed-payload counters (daemon/relays.py, `RelayIO.counts`) and what is held now."""
        with self._lock:
            self._base = dataclasses.replace(self._base, relays=relays)

    def set_outer_gradients(self, outer_gradients: OuterGradientStatus) -> None:
        """The outer gradients' codecs and byte counters (daemon/rounds.py `OuterGradientBytes`)."""
        with self._lock:
            self._base = dataclasses.replace(self._base, outer_gradients=outer_gradients)

    def set_loop_lag(self, *, worst_s: float, stalls: int) -> None:
        """The event loop's recent worst lag and its stall count (daemon/loop_monitor.py)."""
        with self._lock:
            self._base = dataclasses.replace(self._base, loop_lag_s=worst_s, loop_stalls=stalls)

    def set_devices(self, devices: Mapping[str, Any]) -> None:
        """The learner's devices as `SiteMesh.describe()` gives them."""
        mesh = devices.get("mesh", {})
        with self._lock:
            self._base = dataclasses.replace(self._base, devices=DeviceStatus(
                str(devices["platform"]), int(devices["count"]), int(devices["processes"]),
                MeshAxes(int(mesh.get("data", 0)), int(mesh.get("fsdp", 0)))))

    def record_learner(self, *, step: int, loss: float | None, tokens: int, now: float) -> None:
        """`tokens` is the learner's cumulative count; the rate comes from the recent window."""
        with self._lock:
            self._samples.append((now, tokens))
            while len(self._samples) > 2 and now - self._samples[1][0] >= self._window_s:
                self._samples.popleft()
            finite = loss is None or math.isfinite(loss)
            if not finite and (self._learner.loss is not None or self._learner.step == 0):
                # JSON has no NaN: show null, and say why once rather than on every step.
                self._errors.append((now, f"learner loss is {loss} at step {step}"))
            self._learner = LearnerStatus(step=step, loss=loss if finite else None, tokens=tokens)

    def set_learner_figures(self, *, step_time_s: float | None, mfu: float | None, grad_norm: float | None,
                            lr: float | None) -> None:
        """The figures of the learner's last closed step window (non-finite values read as None)."""
        figures = {"step_time_s": step_time_s, "mfu": mfu, "grad_norm": grad_norm, "lr": lr}
        with self._lock:
            self._figures = {k: (float(v) if v is not None and math.isfinite(v) else None) for k, v in figures.items()}

    def set_tls(self, *, node_id: str, fingerprint: str, not_after_unix: float, ca_subject: str, crl_loaded: bool,
                loaded_at_unix: float, reloads: int, reload_error: str) -> None:
        """The site's certificate as loaded (at start, and after every reload attempt)."""
        tls = TlsStatus(enabled=True, node_id=node_id, fingerprint=fingerprint, not_after=_iso_utc(not_after_unix),
                        ca_subject=ca_subject, crl_loaded=crl_loaded, loaded_at=_iso_utc(loaded_at_unix),
                        reloads=reloads, reload_error=reload_error[:MAX_ERROR_CHARS])
        with self._lock:
            self._tls, self._tls_not_after_unix = tls, not_after_unix

    def set_evaluation(self, evaluation: EvalStatus) -> None:
        with self._lock:
            self._base = dataclasses.replace(self._base, evaluation=evaluation)

    def add_bytes(self, *, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self._sent += sent
            self._received += received

    def byte_counts(self) -> ByteCounters:
        with self._lock:
            return ByteCounters(self._sent, self._received)

    def record_error(self, message: str, now: float) -> None:
        with self._lock:
            self._errors.append((now, message[:MAX_ERROR_CHARS]))

    def document(self, now: float) -> StatusDocument:
        with self._lock:
            rate = self._rate(now)
            figures = dict(self._figures)
            if rate == 0.0 and figures.get("mfu") is not None:
                figures["mfu"] = 0.0  # stalled: no utilisation now, whatever the last window had
            return dataclasses.replace(
                self._base,
                learner=dataclasses.replace(self._learner, tokens_per_s=rate, **figures),
                bytes=ByteCounters(self._sent, self._received),
                uptime_s=max(0.0, now - self._started_at),
                last_errors=tuple(RecentError(round(now - t, 3), m) for t, m in reversed(self._errors)),
                tls=self._tls_now() if self._tls is not None else TlsStatus(),
                tracking=self.tracking() if self.tracking is not None else TrackingStatus(),
                commit_age_s=round(max(0.0, self.wall() - self._commit_seen_at), 1)
                if self._commit_seen_at is not None else max(0.0, now - self._started_at),
            )

    def _tls_now(self) -> TlsStatus:
        assert self._tls is not None
        left = self._tls_not_after_unix - self.wall()
        return dataclasses.replace(self._tls, expires_in_s=round(left, 1), days_left=round(left / 86400, 2))

    def _rate(self, now: float) -> float:
        if len(self._samples) < 2 or now - self._samples[-1][0] > self._window_s:
            return 0.0  # no progress within the window: stalled, not "last known speed"
        (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


# ---------------------------------------------------------------------------------------------
# Prometheus exposition (prometheus_client)

_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# Every series this project exports starts with this (process_* from the ProcessCollector aside).
METRIC_PREFIX = "diloco_"
# Bucket bounds, in seconds, from a tiny CPU step (ms) to a big model's step on a slow device.
STEP_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A contribution's way to a commit spans the syncer's grace and one or more outer periods: up to hours.
ROUND_SECONDS_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
# One fragment or a whole state over a WAN link: sub-second on a LAN, many minutes across oceans.
TRANSFER_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


@dataclass(frozen=True, slots=True)
class MetricFamily:
    """One family derived from the status document (a gauge or a counter)."""

    name: str
    kind: str  # "counter" | "gauge"
    help: str
    samples: tuple[tuple[Mapping[str, str], float], ...]


class _Metric:
    """A prometheus_client metric with the labels passed as keywords (`inc(reason="bad mac")`)."""

    def __init__(self, registry: "MetricsRegistry", metric: Any, name: str, labels: Sequence[str]) -> None:
        self._registry = registry
        self._metric = metric
        self.name, self.labels = name, tuple(labels)

    def _child(self, labels: Mapping[str, str]) -> Any:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name}: labels {sorted(labels)} given, declared {list(self.labels)}")
        return self._metric.labels(**{k: str(v) for k, v in labels.items()}) if self.labels else self._metric

    def value(self, **labels: str) -> float:
        self._child(labels)  # validates the label names
        sample = self.name if isinstance(self, (Counter, Gauge)) else f"{self.name}_count"
        found = self._registry.registry.get_sample_value(sample, {k: str(v) for k, v in labels.items()})
        return 0.0 if found is None else found


class Counter(_Metric):
    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up (inc by {amount})")
        self._child(labels).inc(amount)


class Gauge(_Metric):
    def set(self, value: float, **labels: str) -> None:
        self._child(labels).set(float(value))

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).inc(amount)

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).dec(amount)


class Histogram(_Metric):
    """`value()` is the number of observations."""

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(float(value))


class _StatusCollector:
    """The status document's families, taken from the document `render_metrics` is given."""

    def __init__(self) -> None:
        self.doc: StatusDocument | None = None

    def describe(self) -> list[Any]:  # the names, so the registry refuses a clashing metric
        return [_to_client_family(f) for f in status_families(_EMPTY_DOCUMENT)]

    def collect(self) -> list[Any]:
        return [] if self.doc is None else [_to_client_family(f) for f in status_families(self.doc)]


def _to_client_family(family: MetricFamily) -> Any:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = list(family.samples[0][0]) if family.samples else []
    kind = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
    out = kind(family.name, family.help, labels=labels)
    for sample_labels, value in family.samples:
        out.add_metric([str(sample_labels[k]) for k in labels], value)
    return out


class MetricsRegistry:
    """One node's metrics: a prometheus_client `CollectorRegistry` of its own (several nodes share a
    process in tests, and the client's global registry would mix their figures), holding the
    status document's families, what components register, and the process_* collector."""

    def __init__(self, *, process_metrics: bool = True) -> None:
        from prometheus_client import CollectorRegistry, ProcessCollector, disable_created_metrics

        # `*_created` series double every counter and histogram for a start time /status already
        # has (uptime); the switch is process-wide, and every registry of ours wants it.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self._status = _StatusCollector()
        self.registry.register(self._status)
        self._render_lock = threading.Lock()
        self._names: set[str] = set()
        if process_metrics:  # process_cpu_seconds_total, process_resident_memory_bytes, ... (Linux)
            ProcessCollector(registry=self.registry)

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name!r}: Prometheus counters are named *_total")
        from prometheus_client import Counter as ClientCounter

        return Counter(self, self._create(ClientCounter, name, help, labels), name, labels)

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        from prometheus_client import Gauge as ClientGauge

        return Gauge(self, self._create(ClientGauge, name, help, labels), name, labels)

    def histogram(self, name: str, help: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Histogram:
        if not name.endswith("_seconds"):
            raise ValueError(f"histogram {name!r}: name it for its unit (*_seconds)")
        from prometheus_client import Histogram as ClientHistogram

        return Histogram(self, self._create(ClientHistogram, name, help, labels, buckets=tuple(buckets)),
                         name, labels)

    def _create(self, kind: Any, name: str, help: str, labels: Sequence[str], **extra: Any) -> Any:
        if not _METRIC_NAME.match(name):
            raise ValueError(f"metric name {name!r} is not a valid Prometheus name")
        if not name.startswith(METRIC_PREFIX):
            raise ValueError(f"metric name {name!r}: every series of ours starts with {METRIC_PREFIX!r}")
        for label in labels:
            if not _LABEL_NAME.match(label) or label.startswith("__"):
                raise ValueError(f"{name}: label name {label!r} is not valid")
        if name in self._names or name in STATUS_METRIC_NAMES:
            raise ValueError(f"metric {name!r} is already registered")
        self._names.add(name)
        return kind(name, help, labelnames=tuple(labels), registry=self.registry, **extra)

    def names(self) -> set[str]:
        """The names registered by components (the status families aside)."""
        return set(self._names)

    def render(self, doc: StatusDocument) -> bytes:
        from prometheus_client import generate_latest

        with self._render_lock:  # the status families come from `doc` for this render only
            self._status.doc = doc
            try:
                return generate_latest(self.registry)
            finally:
                self._status.doc = None


def status_families(doc: StatusDocument) -> list[MetricFamily]:
    """Metric families derived from a status document."""

    def one(name: str, kind: str, help: str, value: float, labels: Mapping[str, str] | None = None) -> MetricFamily:
        return MetricFamily(name, kind, help, ((labels or {}, value),))

    def maybe(name: str, help: str, value: float | None) -> MetricFamily:
        """A gauge with no sample while the value is unknown (absent, not a made-up number)."""
        return MetricFamily(name, "gauge", help, () if value is None else (({}, value),))

    learner = doc.learner
    outer = doc.outer_gradients
    families = [
        one("diloco_info", "gauge", "Constant 1, labelled with the node's identity.", 1.0,
            {"node_id": doc.node_id, "run_id": doc.run_id, "role": doc.role, "version": doc.version}),
        one("diloco_ready", "gauge", "1 when the node is ready (caught up, serving).", float(doc.ready)),
        one("diloco_uptime_seconds", "gauge", "Seconds since the node started.", doc.uptime_s),
        one("diloco_epoch", "gauge", "Current election epoch.", doc.epoch),
        one("diloco_is_coordinator", "gauge", "1 when this node holds the coordinator lease.", float(doc.is_coordinator)),
        one("diloco_commit_index", "gauge", "Highest committed log index known.", doc.commit_index),
        one("diloco_commit_age_seconds", "gauge",
            "Seconds since this node last saw its commit index grow (since it started, before any).",
            doc.commit_age_s),
        MetricFamily("diloco_members", "gauge", "Members by liveness as seen from this node.", (
            ({"state": "alive"}, float(sum(m.alive for m in doc.members))),
            ({"state": "dead"}, float(sum(not m.alive for m in doc.members))),
        )),
        one("diloco_learners_alive", "gauge", "Learner members alive as seen from this node (itself included).",
            float(sum(m.alive and m.role == "learner" for m in doc.members))),
        one("diloco_quorum_have", "gauge", "Contributions in hand for the round being merged.", doc.quorum.have),
        one("diloco_quorum_need", "gauge", "Contributions required (K).", doc.quorum.need),
        MetricFamily("diloco_contributions_refused_total", "counter",
                     "Contributions refused by this node's syncer, by kind (sync/admission.py).",
                     tuple(({"reason": kind}, float(n)) for kind, n in doc.admission.refused.items())),
        one("diloco_contribution_claims_capped_total", "counter",
            "Contributions whose steps claim this node's syncer cut to what the time allows.", doc.admission.capped),
        one("diloco_learner_step", "gauge", "Learner inner steps taken.", learner.step),
        one("diloco_learner_loss", "gauge", "Latest training loss (NaN before the first step).",
            math.nan if learner.loss is None else learner.loss),
        one("diloco_learner_tokens_total", "counter", "Tokens trained on by this learner.", learner.tokens),
        one("diloco_learner_tokens_per_second", "gauge", "Training throughput over the recent window.",
            learner.tokens_per_s),
        maybe("diloco_learner_step_time_seconds", "Wall seconds per inner step over the last step window.",
              learner.step_time_s),
        maybe("diloco_learner_mfu", "Model FLOPs utilisation (0..1) over the last step window; absent where the "
              "device's peak is unknown.", learner.mfu),
        maybe("diloco_learner_grad_norm", "Global norm of the batch gradient before clipping (last step window).",
              learner.grad_norm),
        maybe("diloco_learner_lr", "Inner learning rate at the last step window's last step.", learner.lr),
        one("diloco_bytes_sent_total", "counter", "Bytes sent to peers.", doc.bytes.sent),
        one("diloco_bytes_received_total", "counter", "Bytes received from peers.", doc.bytes.received),
        MetricFamily("diloco_outer_gradient_bytes_total", "counter",
                     "Encoded outer-gradient bytes: contribution chunks this node produced (up), commit payloads "
                     "it applied (down), by the run's codec.", (
                         ({"direction": "up", "codec": outer.codec_up}, float(outer.sent_bytes)),
                         ({"direction": "down", "codec": outer.codec_down}, float(outer.applied_bytes)))),
        MetricFamily("diloco_outer_gradient_parameters_total", "counter",
                     "Parameters the outer-gradient bytes carried (8 x bytes / parameters: bits per parameter).", (
                         ({"direction": "up", "codec": outer.codec_up}, float(outer.sent_parameters)),
                         ({"direction": "down", "codec": outer.codec_down}, float(outer.applied_parameters)))),
        one("diloco_log_first_index", "gauge", "Oldest log index held (older ones are compacted).",
            doc.log_first_index),
        one("diloco_log_bytes", "gauge", "Size of the replicated log on disk.", doc.log_bytes),
        one("diloco_event_loop_lag_seconds", "gauge", "Worst event-loop lag over the last 10-20 s.", doc.loop_lag_s),
        one("diloco_event_loop_stalls_total", "counter", "Event-loop stalls of 1 s or more.", doc.loop_stalls),
        MetricFamily("diloco_storage_failing", "gauge",
                     "1 for each durable step (failpoint name) whose last attempt failed.",
                     tuple(({"point": point}, 1.0) for point in sorted(doc.storage.get("failing", {})))),
        one("diloco_storage_vote_barrier", "gauge",
            "1 while the node, its log found damaged, votes only for a candidate whose log reaches its "
            "vote floor, or for no one when the floor is unknown (storage.vote_barrier).",
            float(doc.storage.get("vote_barrier") is not None)),
        one("diloco_evicted_members", "gauge", "Sites evicted from this run (diloco-node evict).",
            float(len(doc.evicted))),
        one("diloco_storage_quarantined_files", "gauge", "Files found corrupt and renamed aside (listed on /status).",
            float(len(doc.storage.get("quarantined", ())))),
        one("diloco_relay_pushed_total", "counter", "Relayed payload copies pushed as lease holder.",
            doc.relays.pushed),
        one("diloco_relay_forwarded_total", "counter", "Relayed payload copies passed on down the tree.",
            doc.relays.forwarded),
        one("diloco_relay_served_total", "counter", "Relayed payloads sent to members that fetched them.",
            doc.relays.served),
        one("diloco_relay_fetched_total", "counter", "Relayed payload fetches sent.", doc.relays.fetched),
        one("diloco_relay_promised_total", "counter",
            "Relayed payload fetches answered with a promise: the bytes were still on their way here.",
            doc.relays.promised),
        one("diloco_relay_refused_total", "counter",
            "Relayed payload streams refused (wrong digest, short, over the run's bound).", doc.relays.refused),
        one("diloco_relay_pushed_bytes_total", "counter", "Relayed payload bytes pushed as lease holder.",
            doc.relays.pushed_bytes),
        one("diloco_relay_forwarded_bytes_total", "counter",
            "Relayed payload bytes passed on down the tree or to fetchers.", doc.relays.forwarded_bytes),
        one("diloco_relay_held_bytes", "gauge", "Relayed payload bytes kept until the log holds them.",
            doc.relays.held_bytes),
        MetricFamily("diloco_fragment_round", "gauge", "Committed round per fragment.",
                     tuple(({"fragment": str(f.fragment)}, float(f.round)) for f in doc.fragments)),
        *([one("diloco_tls_cert_expiry_seconds", "gauge",
                "Seconds until this site's TLS certificate expires (negative once expired).",
                doc.tls.expires_in_s)] if doc.tls.enabled else []),
        one("diloco_learner_devices", "gauge", "Devices the learner trains on, over all hosts of the site.",
            doc.devices.count, {"platform": doc.devices.platform, "processes": str(doc.devices.processes),
                                "data": str(doc.devices.mesh.data), "fsdp": str(doc.devices.mesh.fsdp)}),
    ]
    return families


_EMPTY_DOCUMENT = StatusDocument(node_id="x", run_id="", role="learner", ready=False, epoch=0, coordinator=None,
                                 commit_index=0, state_digest="", tls=TlsStatus(enabled=True))  # every family
STATUS_METRIC_NAMES = frozenset(f.name for f in status_families(_EMPTY_DOCUMENT))


def render_metrics(doc: StatusDocument, registry: MetricsRegistry | None = None) -> str:
    """The Prometheus text exposition (0.0.4) for one node: status-derived families plus the registry's."""
    if registry is None:
        registry = MetricsRegistry(process_metrics=False)
    return registry.render(doc).decode()


# ---------------------------------------------------------------------------------------------
# HTTP routes


# `POST /evict` body: {"node_id": ..., "reason": ...}; a few hundred bytes at most.
MAX_EVICT_BODY_BYTES = 4096
# (node id, reason) -> (HTTP status, JSON body): the daemon's eviction (daemon/coordination.py).
Evict = Callable[[str, str], Awaitable[tuple[int, dict[str, Any]]]]
# JSON body -> (HTTP status, JSON body): an operator accepts the loss of log entries (daemon/lost_entries.py).
AcceptLoss = Callable[[dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]
# seconds -> (HTTP status, JSON body): a profiler capture (ops/profiling.py ProfileCapture.capture).
Profile = Callable[[Any], Awaitable[tuple[int, dict[str, Any]]]]


def is_loopback(remote: str | None) -> bool:
    """Whether a request's peer address is this host's loopback (an operator on the host itself)."""
    try:
        return remote is not None and ipaddress.ip_address(remote.split("%")[0]).is_loopback
    except ValueError:
        return False


def operator_routes(snapshot: Callable[[], StatusDocument], registry: MetricsRegistry | None = None,
                    live: Callable[[], Liveness] = lambda: ALIVE, series: StatusSeries | None = None,
                    evict: Evict | None = None, profile: Profile | None = None,
                    accept_loss: AcceptLoss | None = None) -> "web.RouteTableDef":
    """aiohttp routes for the operator API; `snapshot()` builds the current document.

    `/` and `/series` (the live page and its time series) come from ops/page.py; `series` is the
    node's ring buffer of samples (None: `/series` answers no samples).

    `/readyz` is 200 only when the document says ready (a load balancer or the local-cluster
    script waits on it); `/livez` is 200 while `live()` says alive (the event loop answering is
    most of the proof; `live` adds "the training thread has neither crashed nor stalled"), else
    503 with the reason.

    `POST /evict` (when `evict` is given) removes a site from the run for good: it is answered only
    to a client on this host's loopback (403 otherwise, whatever the listener's address), since
    without TLS the operator routes share the public peer port.

    `POST /profile` (when `profile` is given), body {"seconds": N}: a JAX profiler trace of the
    running daemon (`diloco-node profile`), loopback only for the same reason; answered when the
    capture is done, with its directory.

    `POST /accept-loss` (when `accept_loss` is given), body {"by", "reason", "lost_after"}: an
    operator accepts that this node lost the log entries after `lost_after` (`diloco-node
    accept-loss`), loopback only.
    """
    from aiohttp import web

    routes = web.RouteTableDef()

    @routes.get("/status")
    async def status(request: web.Request) -> web.Response:
        return web.Response(text=snapshot().to_json(), content_type="application/json")

    @routes.get("/metrics")
    async def metrics(request: web.Request) -> web.Response:
        body = (registry or MetricsRegistry(process_metrics=False)).render(snapshot())
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    @routes.get("/livez")
    async def livez(request: web.Request) -> web.Response:
        verdict = live()
        return web.Response(text="ok\n") if verdict.alive else web.Response(status=503, text=verdict.reason + "\n")

    @routes.get("/readyz")
    async def readyz(request: web.Request) -> web.Response:
        doc = snapshot()
        if doc.ready:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"not ready: {doc.ready_reason or 'starting'}\n")

    if evict is not None:
        @routes.post("/evict")
        async def evict_route(request: web.Request) -> web.Response:
            if not is_loopback(request.remote):
                return web.json_response({"error": f"/evict is answered only on this host's loopback, "
                                                   f"not to {request.remote}"}, status=403)
            if request.content_length is None or request.content_length > MAX_EVICT_BODY_BYTES:
                return web.json_response({"error": f"the body must be a JSON object of at most "
                                                   f"{MAX_EVICT_BODY_BYTES} bytes with a Content-Length"}, status=400)
            try:
                body = json.loads(await request.read())
            except (ValueError, UnicodeDecodeError) as error:
                return web.json_response({"error": f"the body is not JSON: {error}"}, status=400)
            node_id, reason = (body.get("node_id"), body.get("reason", "")) if isinstance(body, dict) else (None, "")
            if not isinstance(node_id, str) or not node_id or not isinstance(reason, str):
                return web.json_response({"error": 'the body must be {"node_id": "<id>", "reason": "<text>"}'},
                                         status=400)
            status, answer = await evict(node_id, reason)
            return web.json_response(answer, status=status)

    async def json_body(request: web.Request) -> tuple[Any, web.Response | None]:
        if not is_loopback(request.remote):
            return None, web.json_response({"error": f"{request.path} is answered only on this host's loopback, "
                                                     f"not to {request.remote}"}, status=403)
        if request.content_length is None or request.content_length > MAX_EVICT_BODY_BYTES:
            return None, web.json_response({"error": f"the body must be a JSON object of at most "
                                                     f"{MAX_EVICT_BODY_BYTES} bytes with a Content-Length"}, status=400)
        try:
            return json.loads(await request.read()), None
        except (ValueError, UnicodeDecodeError) as error:
            return None, web.json_response({"error": f"the body is not JSON: {error}"}, status=400)

    if profile is not None:
        @routes.post("/profile")
        async def profile_route(request: web.Request) -> web.Response:
            body, refused = await json_body(request)
            if refused is not None:
                return refused
            if not isinstance(body, dict) or "seconds" not in body:
                return web.json_response({"error": 'the body must be {"seconds": <number>}'}, status=400)
            status, answer = await profile(body["seconds"])
            return web.json_response(answer, status=status)

    if accept_loss is not None:
        @routes.post("/accept-loss")
        async def accept_loss_route(request: web.Request) -> web.Response:
            body, refused = await json_body(request)
            if refused is not None:
                return refused
            if not isinstance(body, dict):
                return web.json_response({"error": 'the body must be {"by": ..., "reason": ..., "lost_after": N}'},
                                         status=400)
            status, answer = await accept_loss(body)
            return web.json_response(answer, status=status)

    page_routes(routes, lambda: snapshot().node_id, series)
    return routes
