"""The /status document, its builder, /metrics rendering, the operator routes and status/watch."""

import asyncio
import io
import json
import math
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from diloco_node import cli
from diloco_node.ops.status import (
    STATUS_SCHEMA,
    FragmentStatus,
    MemberStatus,
    MetricsRegistry,
    QuorumStatus,
    StatusBuilder,
    StatusDocument,
    StatusFormatError,
    operator_routes,
    render_metrics,
)
from diloco_node.cli.status import fetch_status, PeerError, render_table, watch_command

from conftest import free_port


def _document(node_id: str = "site-a", ready: bool = True) -> StatusDocument:
    builder = StatusBuilder(node_id, "run-7f3a", "learner", started_at=100.0, version="0.1.0")
    builder.set_coordination(
        epoch=4, coordinator="site-b", commit_index=123, state_digest="ab" * 32,
        members=[MemberStatus("site-a", "http://127.0.0.1:7101", "learner", True),
                 MemberStatus("site-b", "http://127.0.0.1:7102", "learner", True, last_seen_s=0.4),
                 MemberStatus("witness", "http://127.0.0.1:7104", "witness", False, last_seen_s=31.0)],
        quorum=QuorumStatus(2, 2, "quorum met: 2 of K=2; grace 0.8s"),
        fragments=[FragmentStatus(0, 10), FragmentStatus(1, 9)],
    )
    builder.set_ready(ready, "serving" if ready else "catching up: applied 12 of 40")
    builder.record_learner(step=400, loss=2.75, tokens=800_000, now=110.0)
    builder.record_learner(step=450, loss=2.5, tokens=900_000, now=120.0)
    builder.add_bytes(sent=5 << 20, received=1 << 20)
    return builder.document(now=121.0)


# --- the document ------------------------------------------------------------------------------


def test_document_has_the_required_fields_and_round_trips():
    doc = _document()
    raw = json.loads(doc.to_json())
    for key in ("schema", "node_id", "run_id", "role", "ready", "epoch", "coordinator", "commit_index",
                "state_digest", "members", "learner", "bytes", "quorum"):
        assert key in raw
    assert raw["schema"] == STATUS_SCHEMA
    assert set(raw["members"][0]) >= {"node_id", "url", "role", "alive"}
    assert set(raw["learner"]) == {"step", "loss", "tokens", "tokens_per_s", "step_time_s", "mfu", "grad_norm", "lr"}
    assert raw["bytes"] == {"sent": 5 << 20, "received": 1 << 20}
    assert raw["quorum"] == {"have": 2, "need": 2, "reason": "quorum met: 2 of K=2; grace 0.8s"}
    assert raw["learner"]["tokens_per_s"] == 10_000.0
    assert raw["uptime_s"] == 21.0
    assert StatusDocument.from_json(doc.to_json()) == doc


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema="diloco-node/status/2"), "schema = 'diloco-node/status/2'"),
        (lambda d: d.pop("commit_index"), "commit_index: missing"),
        (lambda d: d.update(epoch="4"), "epoch = '4': expected int"),
        (lambda d: d.update(ready=1), "ready = 1: expected bool"),
        (lambda d: d["members"][1].pop("url"), r"members\[1\].url: missing"),
        (lambda d: d["learner"].update(loss="low"), "learner.loss = 'low'"),
    ],
)
def test_malformed_documents_name_the_field(mutate, message):
    raw = _document().to_dict()
    mutate(raw)
    with pytest.raises(StatusFormatError, match=message):
        StatusDocument.from_dict(raw)


def test_unknown_fields_from_newer_nodes_are_ignored():
    raw = _document().to_dict()
    raw["future_field"] = {"x": 1}
    assert StatusDocument.from_dict(raw).node_id == "site-a"


def test_builder_rate_goes_to_zero_when_the_learner_stalls_and_nan_loss_is_reported_once():
    builder = StatusBuilder("n", "r", "learner", started_at=0.0, tokens_rate_window_s=10.0)
    for second in range(20):
        builder.record_learner(step=second, loss=1.0, tokens=1000 * second, now=float(second))
    assert builder.document(19.0).learner.tokens_per_s == pytest.approx(1000.0)
    assert builder.document(40.0).learner.tokens_per_s == 0.0
    builder.record_learner(step=20, loss=math.nan, tokens=20_000, now=41.0)
    builder.record_learner(step=21, loss=math.inf, tokens=21_000, now=42.0)
    doc = builder.document(43.0)
    assert doc.learner.loss is None
    assert [e.message for e in doc.last_errors] == ["learner loss is nan at step 20"]
    json.loads(doc.to_json())  # still valid JSON (no NaN)


def test_recent_errors_are_capped_newest_first():
    builder = StatusBuilder("n", "r", "witness", started_at=0.0, max_recent_errors=3)
    for i in range(5):
        builder.record_error(f"error {i}", now=float(i))
    assert [e.message for e in builder.document(10.0).last_errors] == ["error 4", "error 3", "error 2"]


# --- metrics ---------------------------------------------------------------------------------


def _sample(lines: list[str], series: str) -> float:
    (value,) = [float(line.rsplit(" ", 1)[1]) for line in lines if line.rsplit(" ", 1)[0] == series]
    return value


def test_metrics_text_format_includes_status_and_registry_families():
    registry = MetricsRegistry()
    rejected = registry.counter("diloco_frames_rejected_total", "Frames refused.", labels=("reason",))
    rejected.inc(reason="bad mac")
    rejected.inc(2, reason='quote " and \\ and\nnewline')
    text = render_metrics(_document(), registry)
    lines = text.splitlines()
    assert "# TYPE diloco_commit_index gauge" in lines
    assert "diloco_commit_index 123.0" in lines
    assert "# TYPE diloco_bytes_sent_total counter" in lines
    assert _sample(lines, "diloco_bytes_sent_total") == 5 << 20
    assert 'diloco_members{state="dead"} 1.0' in lines
    assert 'diloco_fragment_round{fragment="1"} 9.0' in lines
    assert "diloco_learner_loss 2.5" in lines
    assert 'diloco_frames_rejected_total{reason="bad mac"} 1.0' in lines
    assert 'diloco_frames_rejected_total{reason="quote \\" and \\\\ and\\nnewline"} 2.0' in lines
    assert text.endswith("\n")
    # Every sample line belongs to a family declared with HELP and TYPE (histograms: _bucket, _sum, _count).
    declared = {line.split()[2] for line in lines if line.startswith("# TYPE")}
    for line in lines:
        if not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            assert any(name == d or name in (f"{d}_bucket", f"{d}_sum", f"{d}_count", f"{d}_total") for d in declared), name


def test_one_prefix_counters_total_cumulative_seconds_as_counters_and_histograms():
    """The node's whole /metrics: diloco_* (and process_*), counters *_total, no cumulative
    seconds exported as a gauge, histograms for step time, round latency and transfers."""
    from diloco_node.daemon.metrics import DaemonSeries

    registry = MetricsRegistry()
    series = DaemonSeries.register(registry)
    series.step_seconds.observe(0.02)
    series.round_latency_seconds.observe(42.0)
    series.transfer_seconds.observe(1.5, kind="contribution")
    series.learner_compute_seconds.inc(3.5)
    text = render_metrics(_document(), registry)
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    assert all(name.startswith(("diloco_", "process_")) for name in types), sorted(types)
    assert any(name.startswith("process_") for name in types)  # the ProcessCollector, on this registry
    for name, kind in types.items():
        assert (kind == "counter") == name.endswith("_total"), name
        if "seconds" in name and kind == "gauge":  # instants and windows, never cumulative time
            assert name in ("diloco_uptime_seconds", "diloco_event_loop_lag_seconds", "diloco_learner_step_time_seconds",
                            "diloco_commit_age_seconds", "process_start_time_seconds"), name
    assert types["diloco_learner_compute_seconds_total"] == types["diloco_learner_sync_seconds_total"] == "counter"
    assert "diloco_learner_compute_seconds_total 3.5" in text
    for name in ("diloco_learner_step_seconds", "diloco_round_latency_seconds", "diloco_transfer_seconds"):
        assert types[name] == "histogram", name
    assert 'diloco_transfer_seconds_bucket{kind="contribution",le="2.5"} 1.0' in text
    assert "diloco_round_latency_seconds_count 1.0" in text and "_created" not in text
    assert series.step_seconds.value() == 1.0 and series.learner_compute_seconds.value() == 3.5


def test_registries_are_per_node_and_validate_names():
    a, b = MetricsRegistry(), MetricsRegistry()
    a.counter("diloco_rounds_total", "Rounds.").inc()
    assert b.names() == set()  # nothing leaks between nodes sharing a process
    assert "diloco_rounds_total" not in render_metrics(_document(), b)
    b.counter("diloco_rounds_total", "Rounds.")  # the same name in another registry is fine
    with pytest.raises(ValueError, match="already registered"):
        a.counter("diloco_rounds_total", "Again.")
    with pytest.raises(ValueError, match="already registered"):
        a.gauge("diloco_commit_index", "Clashes with a status family.")
    with pytest.raises(ValueError, match=r"\*_total"):
        a.counter("diloco_rounds", "No suffix.")
    with pytest.raises(ValueError, match="not a valid Prometheus name"):
        a.gauge("diloco-bad", "Dash.")
    with pytest.raises(ValueError, match="starts with 'diloco_'"):
        a.gauge("daemon_things", "Another prefix.")
    with pytest.raises(ValueError, match="only goes up"):
        a.counter("diloco_x_total", "X.").inc(-1)
    gauge = a.gauge("diloco_inflight", "In flight.", labels=("peer",))
    gauge.inc(peer="b")
    gauge.inc(peer="b")
    gauge.dec(peer="b")
    assert gauge.value(peer="b") == 1.0
    with pytest.raises(ValueError, match="labels"):
        gauge.set(1.0)


# --- HTTP: operator routes and the status/watch commands --------------------------------------


class _Server:
    """An aiohttp app on 127.0.0.1 in a background thread, so blocking CLI code can call it."""

    def __init__(self, app: web.Application) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(app)
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def node_server() -> Iterator[tuple[str, dict]]:
    state = {"doc": _document()}
    app = web.Application()
    app.add_routes(operator_routes(lambda: state["doc"], MetricsRegistry()))
    server = _Server(app)
    yield server.url, state
    server.stop()


@pytest.fixture
def broken_server() -> Iterator[str]:
    app = web.Application()

    async def not_status(request: web.Request) -> web.Response:
        return web.json_response({"hello": "world"})

    async def fails(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    app.router.add_get("/status", not_status)
    app.router.add_get("/broken/status", fails)
    server = _Server(app)
    yield server.url
    server.stop()


def test_operator_routes_serve_status_metrics_and_probes(node_server):
    import urllib.error
    import urllib.request

    url, state = node_server
    assert fetch_status(url, 5.0) == state["doc"]
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert b"diloco_commit_index 123" in response.read()
    with urllib.request.urlopen(url + "/livez", timeout=5) as response:
        assert response.status == 200
    with urllib.request.urlopen(url + "/readyz", timeout=5) as response:
        assert response.status == 200
    with urllib.request.urlopen(url + "/", timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/html") and b'id="members"' in response.read()
    state["doc"] = _document(ready=False)
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(url + "/readyz", timeout=5)
    assert exc.value.code == 503 and b"catching up: applied 12 of 40" in exc.value.read()


def test_status_command_prints_a_table_and_json(node_server, capsys):
    url, _ = node_server
    assert cli.main(["status", "--peer", url]) == 0
    table = capsys.readouterr().out
    assert "node site-a  role learner  READY" in table
    assert "coordinator site-b" in table
    assert "commit index 123" in table
    assert "tokens/s 10.0k" in table
    assert "bytes sent 5.0 MiB  received 1.0 MiB" in table
    assert "witness" in table and " NO " in table
    assert cli.main(["status", "--peer", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["commit_index"] == 123


def test_status_command_unreachable_peer_exits_1_naming_url_and_reason(capsys):
    port = free_port()  # nothing listens on it
    assert cli.main(["status", "--peer", f"127.0.0.1:{port}", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert f"http://127.0.0.1:{port}/status: unreachable: Connection refused" in err


def test_status_command_rejects_non_status_and_http_errors(broken_server, capsys):
    assert cli.main(["status", "--peer", broken_server]) == 1
    assert "not a diloco-node status document: schema: missing" in capsys.readouterr().err
    with pytest.raises(PeerError, match="HTTP 500"):
        fetch_status(broken_server + "/broken", 5.0)


def test_watch_prints_one_json_line_per_peer_per_poll_when_piped(node_server, broken_server):
    url, _ = node_server
    out = io.StringIO()
    sleeps = []
    code = watch_command([url, broken_server], interval=0.5, count=3, json_lines=True, timeout=5.0, out=out,
                         sleep=sleeps.append)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 6 and sleeps == [0.5, 0.5]
    assert [("status" in line, "error" in line) for line in lines[:2]] == [(True, False), (False, True)]
    assert lines[0]["status"]["commit_index"] == 123 and lines[0]["peer"] == url
    assert code == 1  # the last poll of one peer failed


def test_watch_terminal_view_redraws_and_keeps_going_through_errors(node_server):
    url, state = node_server
    out = io.StringIO()
    polls = []

    def next_poll(_interval: float) -> None:
        polls.append(1)
        state["doc"] = _document(node_id="site-a-restarted")

    code = watch_command([url], interval=1.0, count=2, json_lines=False, timeout=5.0, out=out, sleep=next_poll)
    screens = out.getvalue().split("\x1b[H\x1b[2J")[1:]
    assert code == 0 and len(screens) == 2 and polls == [1]
    assert "node site-a " in screens[0] and "site-a-restarted" in screens[1]
    assert "MEMBER" in screens[1] and "quorum 2/2" in screens[1]


def test_render_table_without_members_or_learner_progress():
    doc = StatusDocument(node_id="w", run_id="", role="witness", ready=False, epoch=0, coordinator=None,
                         commit_index=0, state_digest="")
    text = render_table(doc)
    assert "NOT READY" in text and "coordinator (none)" in text and "loss -" in text


def test_relay_counters_and_decisions_reach_status_and_metrics_and_older_documents_read_as_zero():
    from diloco_node.daemon.status_feed import relay_status

    builder = StatusBuilder("site-a", "run-7f3a", "learner", started_at=100.0)
    decisions = ["0.3s ago: promise 3fa2b1c0 to c: awaiting them as a fresh commit of a: sent on arrival",
                 "1.1s ago: fetch 3fa2b1c0 from a: no bytes after 1 relay timeout: ask a (parent in a's tree)"]
    # What RelayIO.status() gives (its fanout and bound are for logs, not the document).
    builder.set_relays(relay_status({"pushed": 12, "forwarded": 3, "served": 2, "fetched": 1, "refused": 4,
                                     "promised": 6, "pushed_bytes": 12 << 20, "forwarded_bytes": 5 << 20, "held": 1,
                                     "spooled": 1, "held_bytes": 1 << 20, "fanout": 2, "max_payload_bytes": 9,
                                     "decisions": decisions}))
    doc = builder.document(now=101.0)
    raw = json.loads(doc.to_json())
    assert raw["relays"] == {"pushed": 12, "forwarded": 3, "served": 2, "fetched": 1, "refused": 4,
                             "promised": 6, "pushed_bytes": 12 << 20, "forwarded_bytes": 5 << 20, "held": 1, "spooled": 1,
                             "held_bytes": 1 << 20, "decisions": decisions}
    assert StatusDocument.from_dict(raw) == doc
    with pytest.raises(StatusFormatError, match=r"relays.decisions = \[3\]: expected a list of strings"):
        StatusDocument.from_dict({**raw, "relays": {**raw["relays"], "decisions": [3]}})
    lines = render_metrics(doc).splitlines()
    assert "# TYPE diloco_relay_pushed_total counter" in lines
    assert _sample(lines, "diloco_relay_pushed_total") == 12 and _sample(lines, "diloco_relay_refused_total") == 4
    assert _sample(lines, "diloco_relay_forwarded_bytes_total") == 5 << 20
    assert _sample(lines, "diloco_relay_promised_total") == 6
    assert _sample(lines, "diloco_relay_held_bytes") == 1 << 20
    del raw["relays"]  # a node from before relay counters
    assert StatusDocument.from_dict(raw).relays.pushed == 0


def test_admission_refusals_and_caps_reach_status_and_metrics_by_kind():
    from diloco_node.daemon.status_feed import admission_status
    from diloco_node.sync.admission import Admission, Member

    admission = Admission(num_fragments=2, period=8)
    admission.admit("stranger", 0, member=None)
    admission.admit("w", 0, member=Member("witness"))
    ticket = admission.admit("a", 0, member=Member("learner"))
    admission.admit("a", 1, member=Member("learner"))  # its first is still arriving
    admission.release(ticket)
    admission.admit("a", 5, member=Member("learner"))
    admission.lease_gained(0.0)
    admission.cap_claim("a", 0, 1000, 1000 * 32, 4.0, 1.0, 32)  # 8 + 2 x 4 s / 1 s = 16 steps possible
    builder = StatusBuilder("site-a", "run-7f3a", "learner", started_at=100.0)
    builder.set_admission(admission_status(admission.counts))
    doc = builder.document(now=101.0)
    raw = json.loads(doc.to_json())
    assert raw["admission"] == {"not_member": 1, "not_learner": 1, "left": 0, "not_lease_holder": 0, "in_flight": 1,
                                "unknown_fragment": 1, "malformed": 0, "capped": 1,
                                "last_reason": "a claims 1000 steps for fragment 0; 16 are possible since its "
                                               "previous contribution: capped"}
    assert StatusDocument.from_dict(raw) == doc
    lines = render_metrics(doc).splitlines()
    assert "# TYPE diloco_contributions_refused_total counter" in lines
    assert 'diloco_contributions_refused_total{reason="in_flight"} 1.0' in lines
    assert 'diloco_contributions_refused_total{reason="left"} 0.0' in lines
    assert _sample(lines, "diloco_contribution_claims_capped_total") == 1
    del raw["admission"]  # a node from before admission counters
    assert StatusDocument.from_dict(raw).admission.capped == 0


def test_the_series_the_alerts_read_commit_age_learners_alive_vote_barrier_evicted():
    """examples/monitoring/alerts.yml's own series: the commit age counts from the start until the
    commit index grows, then from the wall time it grew; learners alive count learner members only."""
    from diloco_node.ops.status import EvictedStatus

    wall = [5000.0]
    builder = StatusBuilder("a", "run", "learner", started_at=100.0)
    builder.wall = lambda: wall[0]
    members = [MemberStatus("a", "http://a", "learner", True), MemberStatus("b", "http://b", "learner", False),
               MemberStatus("w", "http://w", "witness", True)]
    builder.set_coordination(epoch=1, coordinator="a", commit_index=0, state_digest="", members=members,
                             quorum=QuorumStatus(0, 2))
    assert builder.document(now=160.0).commit_age_s == 60.0  # no commit yet: since the start
    builder.set_coordination(epoch=1, coordinator="a", commit_index=3, state_digest="", members=members,
                             quorum=QuorumStatus(0, 2))
    wall[0] += 42.0
    builder.set_coordination(epoch=1, coordinator="a", commit_index=3, state_digest="", members=members,
                             quorum=QuorumStatus(0, 2))  # no growth: the age keeps counting
    doc = builder.document(now=999.0)
    assert doc.commit_age_s == 42.0 and StatusDocument.from_json(doc.to_json()).commit_age_s == 42.0
    text = render_metrics(doc)
    assert "diloco_commit_age_seconds 42.0" in text and "diloco_learners_alive 1.0" in text
    assert "diloco_storage_vote_barrier 0.0" in text and "diloco_evicted_members 0.0" in text
    builder.set_storage({"vote_barrier": "log damaged at index 7"})
    builder.set_evicted([EvictedStatus("c", 9, "gone")])
    text = render_metrics(builder.document(now=999.0))
    assert "diloco_storage_vote_barrier 1.0" in text and "diloco_evicted_members 1.0" in text


def test_status_and_watch_show_learner_figures_eval_sets_outer_gradients_storage_relays_admission():
    """What `diloco-node status` and `watch` print (both render_table): every section an operator acts on."""
    from diloco_node.ops.status import (
        AdmissionStatus,
        EvalSetStatus,
        EvalStatus,
        EvictedStatus,
        OuterGradientStatus,
        RelayStatus,
    )

    builder = StatusBuilder("a", "run", "learner", started_at=0.0)
    builder.record_learner(step=10, loss=2.5, tokens=1000, now=1.0)
    builder.record_learner(step=20, loss=2.4, tokens=2000, now=2.0)
    builder.set_learner_figures(step_time_s=0.1, mfu=0.42, grad_norm=1.25, lr=3e-4)
    builder.set_evaluation(EvalStatus(None, 7, 1.5, {"wiki": EvalSetStatus(3.125, 4096),
                                                     "code": EvalSetStatus(None, 2048)}))
    builder.set_outer_gradients(OuterGradientStatus.of(codec_up="int4", codec_down="int4", error_feedback=True,
                                                       sent_bytes=1000, sent_parameters=2000,
                                                       applied_bytes=3000, applied_parameters=6000))
    builder.set_storage({"failing": {"log.append": {"error": "No space left on device", "consecutive": 3}},
                         "quarantined": [{"file": "checkpoints/ckpt-000040.bin"}],
                         "vote_barrier": "log damaged at index 9",
                         "log_repair": {"lost_after": 8, "dropped": 3, "held": [2, 11], "refilled": False}})
    builder.set_admission(AdmissionStatus(in_flight=2, malformed=1, capped=4, last_reason="a second contribution"))
    builder.set_relays(RelayStatus(pushed=3, refused=1, decisions=("0.4s ago: fetch x from b",)))
    builder.set_evicted([EvictedStatus("c", 12, "disk lost")])
    table = render_table(builder.document(now=2.5))
    for expected in ("step time 0.100s", "mfu 42.0%", "grad norm 1.25", "lr 0.0003",
                     "eval at commit 7 (1.5s)", "wiki 3.1250 (4.1k tokens)", "code - (2.0k tokens)",
                     "outer gradients up int4 1000 B 4.00 bits/param  down int4 2.9 KiB 4.00 bits/param",
                     "error feedback on", "FAILING log.append: No space left on device",
                     "1 file(s) quarantined: checkpoints/ckpt-000040.bin", "VOTE BARRIER: log damaged at index 9",
                     "LOG REPAIR: entries after 8 being fetched again",
                     "admission refused in_flight 2  malformed 1  capped 4  last: a second contribution",
                     "relays pushed 3", "refused 1", "last: 0.4s ago: fetch x from b", "evicted c (index 12: disk lost)"):
        assert expected in table, (expected, table)
    quiet = render_table(StatusDocument(node_id="w", run_id="", role="witness", ready=False, epoch=0,
                                        coordinator=None, commit_index=0, state_digest=""))
    assert "storage ok" in quiet and "admission refused none" in quiet and "eval -  (not evaluated yet)" in quiet
    assert "step time -  mfu -  grad norm -  lr -" in quiet
