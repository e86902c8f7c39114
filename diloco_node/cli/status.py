"""`diloco-node status` (one-shot) and `diloco-node watch` (live view): read nodes' /status over HTTP.

Uses urllib (blocking, stdlib): one request per peer per poll needs no event loop, and these
commands must start fast and never import JAX.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Callable, TextIO

from diloco_node.ops.status import StatusDocument, StatusFormatError

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_INTERVAL_S = 2.0
# A status document is a few KiB; refuse to buffer a misbehaving server's endless body.
MAX_STATUS_BYTES = 4 << 20
_CLEAR = "\x1b[H\x1b[2J"


class PeerError(Exception):
    """A peer could not be read; the message names the URL and the reason."""


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--peer", metavar="URL", action="append", required=True,
                        help="node to ask, e.g. http://127.0.0.1:7070 (repeat for several nodes)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help=f"per-request timeout in seconds (default {DEFAULT_TIMEOUT_S})")
    if name == "status":
        parser.add_argument("--json", action="store_true", help="print the raw status document(s) as JSON")
    else:
        parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, metavar="S",
                            help=f"seconds between polls (default {DEFAULT_INTERVAL_S})")
        parser.add_argument("--count", type=int, default=0, metavar="N", help="stop after N polls (0: until Ctrl-C)")
        parser.add_argument("--json", action="store_true",
                            help="one JSON line per peer per poll even on a terminal (the default when piped)")


def run(args: argparse.Namespace) -> int:
    if args.command == "status":
        return status_command(args.peer, args.json, args.timeout, sys.stdout, sys.stderr)
    if args.interval <= 0:
        print(f"diloco-node watch: --interval {args.interval}: must be > 0", file=sys.stderr)
        return 2
    json_lines = args.json or not sys.stdout.isatty()
    try:
        return watch_command(args.peer, args.interval, args.count, json_lines, args.timeout, sys.stdout)
    except KeyboardInterrupt:
        return 0


def normalise_url(peer: str) -> str:
    """`host:port` or `http://host:port[/]` -> base URL without trailing slash."""
    peer = peer.strip().rstrip("/")
    if "://" not in peer:
        peer = "http://" + peer
    return peer


# An operator route's JSON answer is a few lines (a message, a directory); more is not ours.
MAX_ANSWER_BYTES = 64 * 1024


def post_operator(peer: str, route: str, body: dict[str, Any], timeout: float) -> tuple[int, dict[str, Any]]:
    """POST a JSON body to an operator route (`/evict`, `/profile`) of the node at `peer`:
    (HTTP status, the JSON object it answered). Unreachable, no answer in `timeout` seconds, or
    an answer that is not a JSON object: status 0 (or the HTTP status) and {"error": why}."""
    url = normalise_url(peer) + route
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read(MAX_ANSWER_BYTES)
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read(MAX_ANSWER_BYTES)
    except urllib.error.URLError as error:
        return 0, {"error": f"{url}: unreachable: {error.reason}"}
    except (TimeoutError, socket.timeout):
        return 0, {"error": f"{url}: no answer within {timeout:g}s"}
    try:
        answer = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        answer = None
    if not isinstance(answer, dict):
        return status, {"error": f"{url}: HTTP {status}, not a diloco-node answer: {raw[:200]!r}"}
    return status, answer


def fetch_status(peer: str, timeout: float) -> StatusDocument:
    """GET <peer>/status and validate it; raises `PeerError` naming the URL and what went wrong."""
    url = normalise_url(peer) + "/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = response.read(MAX_STATUS_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise PeerError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise PeerError(f"{url}: unreachable: {_reason(exc.reason)}") from None
    except (TimeoutError, socket.timeout):
        raise PeerError(f"{url}: no answer within {timeout:g}s") from None
    except (OSError, ValueError) as exc:
        raise PeerError(f"{url}: {exc}") from None
    if len(body) > MAX_STATUS_BYTES:
        raise PeerError(f"{url}: response larger than {MAX_STATUS_BYTES} bytes; not a diloco-node status")
    try:
        return StatusDocument.from_json(body)
    except StatusFormatError as exc:
        raise PeerError(f"{url}: not a diloco-node status document: {exc}") from None


def _reason(reason: object) -> str:
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return "timed out"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason)


def status_command(peers: list[str], as_json: bool, timeout: float, out: TextIO, err: TextIO) -> int:
    failed = False
    documents = []
    for peer in peers:
        try:
            documents.append(fetch_status(peer, timeout))
        except PeerError as exc:
            print(f"diloco-node status: {exc}", file=err)
            failed = True
    if as_json:
        payload = [d.to_dict() for d in documents]
        print(json.dumps(payload[0] if len(peers) == 1 and payload else payload, indent=2), file=out)
    else:
        print("\n\n".join(render_table(d) for d in documents), file=out)
    return 1 if failed else 0


def watch_command(peers: list[str], interval: float, count: int, json_lines: bool, timeout: float, out: TextIO,
                  sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.time) -> int:
    """Poll until `count` polls (0: forever). Returns 1 if the last poll of any peer failed."""
    polls = 0
    last_failed = False
    while True:
        polls += 1
        last_failed = False
        frames = []
        for peer in peers:
            try:
                doc = fetch_status(peer, timeout)
                if json_lines:
                    frames.append(json.dumps({"time": round(clock(), 3), "peer": normalise_url(peer),
                                              "status": doc.to_dict()}))
                else:
                    frames.append(render_table(doc))
            except PeerError as exc:
                last_failed = True
                if json_lines:
                    frames.append(json.dumps({"time": round(clock(), 3), "peer": normalise_url(peer), "error": str(exc)}))
                else:
                    frames.append(f"!! {exc}")
        if json_lines:
            out.write("".join(line + "\n" for line in frames))
        else:
            stamp = time.strftime("%H:%M:%S", time.localtime(clock()))
            out.write(f"{_CLEAR}diloco-node watch  {stamp}  every {interval:g}s  (Ctrl-C to quit)\n\n")
            out.write("\n\n".join(frames) + "\n")
        out.flush()
        if count and polls >= count:
            return 1 if last_failed else 0
        sleep(interval)


def _human(n: float, unit: str = "") -> str:
    for suffix in ("", "k", "M", "G", "T"):
        if abs(n) < 1000 or suffix == "T":
            return f"{n:.0f}{suffix}{unit}" if suffix == "" else f"{n:.1f}{suffix}{unit}"
        n /= 1000
    return str(n)


def _bytes(n: int) -> str:
    value = float(n)
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or suffix == "TiB":
            return f"{value:.0f} {suffix}" if suffix == "B" else f"{value:.1f} {suffix}"
        value /= 1024
    return str(n)


def _figure(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _evaluation_line(doc: StatusDocument) -> str:
    """Every eval set's loss of the global model, and the commit it was taken at."""
    evaluation = doc.evaluation
    if evaluation.commit_index == 0 and evaluation.loss is None and not evaluation.sets:
        return "eval -  (not evaluated yet)"
    tokens = {name: figure.tokens for name, figure in evaluation.sets.items()}
    sets = "  ".join(f"{name} {_figure(loss, '.4f')}" + (f" ({_human(tokens[name])} tokens)" if name in tokens else "")
                     for name, loss in evaluation.figures())
    return f"eval at commit {evaluation.commit_index} ({evaluation.seconds:.1f}s)  {sets}"


def _outer_gradients_line(doc: StatusDocument) -> str:
    outer = doc.outer_gradients
    return (f"outer gradients up {outer.codec_up or '-'} {_bytes(outer.sent_bytes)} "
            f"{_figure(outer.bits_per_parameter_up, '.2f')} bits/param  "
            f"down {outer.codec_down or '-'} {_bytes(outer.applied_bytes)} "
            f"{_figure(outer.bits_per_parameter_down, '.2f')} bits/param  "
            f"error feedback {'on' if outer.error_feedback else 'off'}")


def _storage_line(doc: StatusDocument) -> str:
    """The failing durable steps, quarantined files, a log repair under way and the vote barrier, or "ok"."""
    storage = doc.storage
    failing = storage.get("failing") or {}
    quarantined = storage.get("quarantined") or []
    parts = [f"FAILING {point}: {info.get('error', '?') if isinstance(info, dict) else info}"
             for point, info in sorted(failing.items())]
    if quarantined:
        parts.append(f"{len(quarantined)} file(s) quarantined: "
                     + ", ".join(str(q.get("file", "?")) if isinstance(q, dict) else str(q) for q in quarantined))
    repair = storage.get("log_repair")
    if isinstance(repair, dict) and not repair.get("refilled"):
        parts.append(f"LOG REPAIR: entries after {repair.get('lost_after', '?')} being fetched again")
    if storage.get("vote_barrier"):
        parts.append(f"VOTE BARRIER: {storage['vote_barrier']}")
    return "storage " + ("  ".join(parts) if parts else "ok")


def _admission_line(doc: StatusDocument) -> str:
    admission = doc.admission
    refused = "  ".join(f"{kind} {n}" for kind, n in admission.refused.items() if n)
    line = f"admission refused {refused or 'none'}  capped {admission.capped}"
    return line + (f"  last: {admission.last_reason}" if admission.last_reason else "")


def _relays_line(doc: StatusDocument) -> str:
    r = doc.relays
    line = (f"relays pushed {r.pushed} ({_bytes(r.pushed_bytes)})  forwarded {r.forwarded} ({_bytes(r.forwarded_bytes)})  "
            f"served {r.served}  fetched {r.fetched}  promised {r.promised}  refused {r.refused}  "
            f"held {r.held} ({_bytes(r.held_bytes)})")
    return line + (f"  last: {r.decisions[0]}" if r.decisions else "")


def render_table(doc: StatusDocument) -> str:
    """A readable multi-line summary of one node's status."""
    learner = doc.learner
    coordinator = doc.coordinator or "(none)"
    if doc.is_coordinator:
        coordinator += " (this node)"
    loss = "-" if learner.loss is None else f"{learner.loss:.4f}"
    lines = [
        f"node {doc.node_id}  role {doc.role}  {'READY' if doc.ready else 'NOT READY'}"
        + (f" ({doc.ready_reason})" if doc.ready_reason else ""),
        f"run {doc.run_id or '-'}  epoch {doc.epoch}  coordinator {coordinator}",
        f"commit index {doc.commit_index}  state digest {doc.state_digest[:16] or '-'}",
        f"quorum {doc.quorum.have}/{doc.quorum.need}" + (f"  {doc.quorum.reason}" if doc.quorum.reason else ""),
        f"learner step {learner.step}  loss {loss}  tokens {_human(learner.tokens)}  "
        f"tokens/s {_human(learner.tokens_per_s)}",
        f"learner step time {_figure(learner.step_time_s, '.3f', 's')}  mfu {_figure(learner.mfu, '.1%')}  "
        f"grad norm {_figure(learner.grad_norm, '.4g')}  lr {_figure(learner.lr, '.3g')}",
        _evaluation_line(doc),
        f"bytes sent {_bytes(doc.bytes.sent)}  received {_bytes(doc.bytes.received)}  uptime {doc.uptime_s:.0f}s  "
        f"last commit {doc.commit_age_s:.0f}s ago",
        _outer_gradients_line(doc),
        _storage_line(doc),
        f"log first index {doc.log_first_index}  {_bytes(doc.log_bytes)}  event loop lag {doc.loop_lag_s:.3f}s  "
        f"stalls {doc.loop_stalls}",
        _admission_line(doc),
        _relays_line(doc),
    ]
    if doc.devices.count:
        devices = doc.devices
        lines.append(f"devices {devices.count} {devices.platform} over {devices.processes} process(es)  "
                     f"mesh data {devices.mesh.data} fsdp {devices.mesh.fsdp}")
    for name, tracker in (("tensorboard", doc.tracking.tensorboard), ("wandb", doc.tracking.wandb)):
        if tracker.enabled:
            lines.append(f"tracking {name} {tracker.target}  written {tracker.written}  dropped {tracker.dropped}"
                         + (f"  error: {tracker.error}" if tracker.error else ""))
    if doc.evicted:
        lines.append("evicted " + "  ".join(f"{e.node_id} (index {e.index}" + (f": {e.reason})" if e.reason else ")")
                                           for e in doc.evicted))
    if doc.tls.enabled:
        tls = doc.tls
        lines.append(f"tls certificate {tls.node_id or '(names no node id)'}  expires {tls.not_after} "
                     f"({tls.days_left:.1f} days)  CA {tls.ca_subject}  CRL {'yes' if tls.crl_loaded else 'no'}  "
                     f"sha256 {tls.fingerprint[:16]}")
        if tls.reload_error:
            lines.append(f"tls reload FAILED (still serving the certificates loaded {tls.loaded_at}): "
                         f"{tls.reload_error}")
    if doc.fragments:
        lines.append("fragment rounds " + " ".join(f"{f.fragment}:{f.round}" for f in doc.fragments))
    if doc.members:
        rows = [("MEMBER", "ROLE", "ALIVE", "LAST SEEN", "URL")]
        for m in doc.members:
            seen = "-" if m.last_seen_s is None else f"{m.last_seen_s:.1f}s"
            role = m.role + ("" if m.voter else " (non-voting)")
            rows.append((m.node_id, role, "yes" if m.alive else "NO", seen, m.url))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines.append("")
        lines.extend("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
    if doc.last_errors:
        lines.append("")
        lines.append("recent errors:")
        lines.extend(f"  {e.age_s:.0f}s ago  {e.message}" for e in doc.last_errors)
    return "\n".join(lines)
