"""The live page at `/` and its `/series` ring buffer, without a browser (tests/integration/test_page_browser.py
drives the page in Chromium, tests/integration/test_page_processes.py runs its JavaScript in node):
the buffer is bounded and well-formed, samples are taken only when due, `/` is HTML that loads
nothing from elsewhere, `/series` answers what is new."""

from __future__ import annotations

import json
import math
import re

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from diloco_node.ops.page import SERIES_CAPACITY, SERIES_INTERVAL_S, SERIES_SCHEMA, StatusSeries, page_html
from diloco_node.ops.status import MetricsRegistry, StatusBuilder, operator_routes


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _builder() -> StatusBuilder:
    builder = StatusBuilder("site-a", "run-1", "learner", started_at=0.0)
    builder.set_ready(True, "serving")
    return builder


def _series(clock: FakeClock, builder: StatusBuilder, samples: int, capacity: int = 3) -> StatusSeries:
    series = StatusSeries(clock, interval_s=2.0, capacity=capacity)
    for step in range(1, samples + 1):
        builder.record_learner(step=step, loss=4.0 / step, tokens=100 * step, now=clock.t)
        builder.add_bytes(sent=10, received=20)
        assert series.observe(lambda: builder.document(clock.t))
        clock.t += 2.0
    return series


def test_the_default_buffer_holds_half_an_hour():
    assert SERIES_INTERVAL_S * SERIES_CAPACITY == 1800


def test_series_is_bounded_oldest_first_with_ages_not_times():
    clock, builder = FakeClock(), _builder()
    series = _series(clock, builder, samples=10, capacity=3)
    body = series.to_dict("site-a")
    json.dumps(body, allow_nan=False)  # valid JSON as served
    assert (body["schema"], body["node_id"], body["capacity"], body["interval_s"]) == (SERIES_SCHEMA, "site-a", 3, 2.0)
    assert [s["seq"] for s in body["samples"]] == [8, 9, 10]
    # The clock is now 2 s past the last sample: ages 6, 4, 2; no clock reading is served.
    assert [s["age_s"] for s in body["samples"]] == [6.0, 4.0, 2.0]
    assert "t" not in body["samples"][0]
    last = body["samples"][-1]
    assert (last["step"], last["loss"], last["tokens"], last["bytes_sent"], last["bytes_received"]) == (10, 0.4, 1000, 100, 200)
    assert set(last) == {"seq", "age_s", "commit_index", "step", "loss", "eval_loss", "eval_commit_index", "tokens",
                         "bytes_sent", "bytes_received", "tokens_per_s", "step_time_s", "mfu", "grad_norm", "lr", "eval_sets"}


def test_series_answers_only_samples_after_a_cursor():
    clock, builder = FakeClock(), _builder()
    series = _series(clock, builder, samples=5, capacity=10)
    assert [s["seq"] for s in series.to_dict("site-a", after=3)["samples"]] == [4, 5]
    assert series.to_dict("site-a", after=5)["samples"] == []


def test_a_sample_is_taken_only_when_due_and_the_document_only_built_then():
    clock, builder = FakeClock(), _builder()
    series = StatusSeries(clock, interval_s=2.0, capacity=10)
    built = []

    def document():
        built.append(clock.t)
        return builder.document(clock.t)

    assert series.observe(document)
    clock.t += 1.9
    assert not series.observe(document)
    clock.t += 0.1
    assert series.observe(document)
    assert built == [1000.0, 1002.0]


def test_non_finite_losses_are_served_as_null():
    clock, builder = FakeClock(), _builder()
    series = StatusSeries(clock, interval_s=1.0, capacity=4)
    builder.record_learner(step=1, loss=math.nan, tokens=1, now=clock.t)
    series.observe(lambda: builder.document(clock.t))
    sample = series.to_dict("site-a")["samples"][0]
    assert sample["loss"] is None and sample["eval_loss"] is None
    json.dumps(sample, allow_nan=False)


def test_series_refuses_a_meaningless_shape():
    with pytest.raises(ValueError, match="capacity"):
        StatusSeries(FakeClock(), capacity=0)
    with pytest.raises(ValueError, match="interval_s"):
        StatusSeries(FakeClock(), interval_s=0)


def test_the_page_loads_nothing_from_elsewhere_and_never_parses_peer_text_as_html():
    page = page_html()
    assert page.startswith("<!doctype html>")
    # Sites may have no internet: no absolute or protocol-relative URL in src/href/CSS.
    assert re.findall(r"""(?:src|href)\s*=\s*["'](?:[a-z]+:)?//""", page, re.I) == []
    assert re.findall(r"@import|url\(", page) == []
    # Member names, errors and reasons come from peers: they are set as text only.
    assert re.findall(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", page) == []


@pytest.fixture
async def client():
    clock, builder = FakeClock(), _builder()
    series = _series(clock, builder, samples=5, capacity=4)
    app = web.Application()
    app.add_routes(operator_routes(lambda: builder.document(clock.t), MetricsRegistry(), series=series))
    async with TestClient(TestServer(app)) as c:
        yield c


async def test_the_page_is_served_as_html_and_the_series_as_bounded_json(client):
    page = await client.get("/")
    assert page.status == 200 and page.headers["Content-Type"] == "text/html; charset=utf-8"
    assert 'id="members"' in await page.text()
    answer = await client.get("/series")
    assert answer.status == 200 and answer.headers["Content-Type"].startswith("application/json")
    # Every member's page reads it across origins; /status is not opened that way.
    assert answer.headers["Access-Control-Allow-Origin"] == "*"
    body = await answer.json()
    assert body["schema"] == SERIES_SCHEMA and body["node_id"] == "site-a"
    assert [s["seq"] for s in body["samples"]] == [2, 3, 4, 5]  # capacity 4 of 5 taken
    assert [s["seq"] for s in (await (await client.get("/series?after=4")).json())["samples"]] == [5]
    # A malformed cursor gets the whole (bounded) buffer rather than an error.
    assert len((await (await client.get("/series?after=soon")).json())["samples"]) == 4
    assert "Access-Control-Allow-Origin" not in (await client.get("/status")).headers


async def test_without_a_series_the_endpoint_answers_no_samples():
    builder = _builder()
    app = web.Application()
    app.add_routes(operator_routes(lambda: builder.document(0.0)))
    async with TestClient(TestServer(app)) as c:
        body = await (await c.get("/series")).json()
    assert body["schema"] == SERIES_SCHEMA and body["samples"] == [] and body["capacity"] == 0


# ------------------------------------------------------------------ status_url: every member's /series under TLS

def _tls_overrides(root, site: str = "a") -> dict[str, str]:
    from diloco_node.ops import pki
    if not (root / "ca" / pki.CA_CERT).exists():
        pki.init_ca(root / "ca")
        pki.issue_site(root / "ca", site, root / site)
    return {"tls_cert_file": str(root / site / pki.SITE_CERT), "tls_key_file": str(root / site / pki.SITE_KEY),
            "tls_ca_file": str(root / "ca" / pki.CA_CERT)}


def test_a_node_advertises_its_operator_url_when_tls_moves_it(tmp_path):
    from diloco_node.config.settings import ConfigError, load_config

    def node(**overrides):
        return load_config(None, {}, {"listen": "127.0.0.1:7100", **overrides}).node

    assert node().status_url == ""  # without TLS the operator routes are at advertise
    tls = _tls_overrides(tmp_path)
    assert node(**tls).status_url == "http://127.0.0.1:7101"  # derived from the loopback status_listen
    assert node(status_listen="192.0.2.7:9000", **tls).status_url == "http://192.0.2.7:9000"
    assert node(status_listen="0.0.0.0:9000", **tls).status_url == ""  # a wildcard is no address to give
    explicit = node(status_listen="0.0.0.0:9000", status_url="https://status.site-a.example:443", **tls)
    assert explicit.status_url == "https://status.site-a.example:443"
    with pytest.raises(ConfigError, match=r"status_url = 'status.example': expected http\(s\)://HOST:PORT "
                                          r"reachable by browsers"):
        node(status_url="status.example", **tls)


def test_status_url_crosses_the_wire_and_older_members_simply_omit_it():
    from wire.messages import JoinRequest, Member, Membership, Role

    request = JoinRequest("b", "https://b:7070", Role.LEARNER, b"\x01" * 32, status_url="http://b:7071")
    fields, payload = request.to_wire()
    assert JoinRequest.from_wire(fields, payload) == request
    del fields["status_url"]  # what a member built before the field existed sends
    assert JoinRequest.from_wire(fields, payload).status_url == ""
    members = (Member("a", "https://a:7070", Role.LEARNER, True, status_url="http://a:7071"),
               Member("c", "https://c:7070", Role.WITNESS, False))
    fields, payload = Membership(3, 7, members, b"{}").to_wire()
    assert [sorted(m) for m in fields["members"]] == [["advertise_url", "node_id", "role", "status_url", "voter"],
                                                      ["advertise_url", "node_id", "role", "voter"]]
    assert Membership.from_wire(fields, payload).members == members
    with pytest.raises(Exception, match="status_url"):
        Member("a", "https://a:7070", Role.LEARNER, True, status_url="not a url")


async def test_a_members_status_url_is_learned_from_its_join_and_passed_on():
    import random

    from bootstrap.coordinator_node import CoordinatorNode, PersistentState
    from diloco_node.clock import FakeClock as Clock
    from diloco_node.config.manifest import RunManifest
    from diloco_node.daemon.coordination import CoordinationIO
    from diloco_node.daemon.peers import AddressBook
    from diloco_node.daemon.tasks import TaskSet
    from diloco_node.ops.status import MemberStatus, StatusDocument
    from wire.messages import JoinRequest, Role

    class NoDisk:
        damaged_after = None

        def sync(self, persistent, prepared=None):
            pass

        def observe(self, core):
            pass

    class Signed:
        node_id = "b"

    manifest = RunManifest()
    core = CoordinatorNode("a", PersistentState.founding(["a"]), now=0.0, rng=random.Random(0))
    core.tick(10.0)
    book = AddressBook({"a": "https://a:7070"})
    book.learn_status_url("a", "http://a:7071")
    tasks = TaskSet()
    io = CoordinationIO(core=core, persistent=core.persistent, store=NoDisk(), history=NoDisk(), client=None,
                        addresses=book, clock=Clock(10.0), tasks=tasks, on_apply=lambda e: None,
                        on_restore_snapshot=lambda s: None, after_step=lambda: None,
                        remember_member=lambda node, url, role: book.learn(node, url, role),
                        report_error=lambda m: None)
    try:
        answer = await io.on_join_request(JoinRequest("b", "https://b:7070", Role.LEARNER, manifest.digest_bytes(),
                                                      status_url="http://b:7071"), Signed(), manifest)
    finally:
        await tasks.close()
    assert {m.node_id: m.status_url for m in answer.members} == {"a": "http://a:7071", "b": "http://b:7071"}
    # /status lists it per member; a document from an older node (no status_url) reads as "".
    doc = StatusDocument("a", "r", "learner", True, 1, "a", 1, "",
                         members=(MemberStatus("b", "https://b:7070", "learner", True, status_url=book.status_url("b")),))
    raw = doc.to_dict()
    assert raw["members"][0]["status_url"] == "http://b:7071"
    del raw["members"][0]["status_url"]
    assert StatusDocument.from_dict(raw).members[0].status_url == ""


def test_series_samples_carry_every_eval_sets_loss():
    """The page draws one eval line per site and set: each sample holds every set's loss by name."""
    from diloco_node.ops.status import EvalSetStatus, EvalStatus

    clock, builder = FakeClock(), _builder()
    builder.set_evaluation(EvalStatus(None, 4, 1.0, {"wiki": EvalSetStatus(3.25, 512), "code": EvalSetStatus(None, 0)}))
    series = StatusSeries(clock, interval_s=2.0, capacity=4)
    assert series.observe(lambda: builder.document(clock.t))
    sample = series.to_dict("site-a")["samples"][-1]
    assert sample["eval_sets"] == {"wiki": 3.25, "code": None} and sample["eval_loss"] is None
    json.dumps(sample, allow_nan=False)
