"""The live page at `/` in a real headless browser (Chromium, from the distribution's packages).

Chromium is driven with its own flags: `--dump-dom` prints the DOM after the page's scripts ran
(`--virtual-time-budget` lets its polling timers fire; virtual time waits for the network), and
`--screenshot` writes a PNG. Two tests:
- a real local cluster (three learners and a witness): the coordinator's page shows every member
  alive, the coordinator, the commit index, the quorum reason, and per-site training and eval
  loss drawn from every member's `/series`; a screenshot is taken (copied to `docs/img/` when
  `DILOCO_X_SCREENSHOT_DIR` names that folder);
- a node whose `/status` starts failing: the page says so, keeps its last figures and retries.

Not in the default suite (marker `browser`; also `integration`, since they start processes):
    apt-get install -y chromium
    .venv/bin/python -m pytest -m browser tests/integration/test_page_browser.py -v
`DILOCO_X_CHROMIUM` names the browser binary when it is not `chromium` on the PATH.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from aiohttp import web

from diloco_node.ops.page import page_html
from diloco_node.ops.status import MemberStatus, QuorumStatus, StatusBuilder
from diloco_node.testbed.launcher import DEFAULT_SETTINGS
from diloco_node.testbed.local_cluster import Cluster

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(900)]

STARTUP_S = 240.0  # four JAX processes compiling at once on two shared cores
# Evaluate often so the eval-loss chart has points within a minute or two.
SETTINGS = tuple(s for s in DEFAULT_SETTINGS if not s.startswith("eval_interval_commits=")) + (
    "eval_interval_commits=4",)
# Virtual time for the page's timers: about three polls (2 s apart) after the first.
VIRTUAL_TIME_MS = 7000
BROWSER_TIMEOUT_S = 120.0
WINDOW = "1280,1300"
# With DILOCO_X_SCREENSHOT_DIR set, the screenshot waits for this much history (x 2.5 s).
SCREENSHOT_SAMPLES = 72


def _chromium() -> str:
    found = os.environ.get("DILOCO_X_CHROMIUM") or next(
        (p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if not found:
        pytest.fail("no Chromium: `apt-get install -y chromium`, or set DILOCO_X_CHROMIUM to the binary")
    return found


def _browse(url: str, profile: Path, *extra: str) -> str:
    """Run headless Chromium on `url` with `extra` flags; its stdout. The whole process group
    (renderers, GPU and zygote helpers) is killed afterwards, whatever happened."""
    argv = [_chromium(), "--headless", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
            f"--user-data-dir={profile}", f"--window-size={WINDOW}", f"--virtual-time-budget={VIRTUAL_TIME_MS}",
            *extra, url]
    if os.geteuid() == 0:
        argv.insert(1, "--no-sandbox")  # Chromium refuses to run its sandbox as root (CI containers)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BROWSER_TIMEOUT_S)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0 or out, f"chromium exited {proc.returncode} with no output"
    return out.decode()


class Dom(HTMLParser):
    """The dumped DOM, reduced to what the tests ask: elements by id, rows, polylines, texts."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.by_id: dict[str, str] = {}  # id -> its text
        self.body: dict[str, str] = {}
        self.rows: dict[str, dict[str, str]] = {}  # member row: node -> attributes and cell texts
        self.lines: list[tuple[str, str, int]] = []  # (chart id, node, points)
        self.banner_class = ""
        self._open: list[tuple[str, dict[str, str]]] = []
        self._texts: dict[int, list[str]] = {}
        self._chart = ""
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        if a.get("id", "").startswith("chart-"):
            self._chart = a["id"]
        if tag == "polyline":
            self.lines.append((self._chart, a.get("data-node", ""), int(a.get("data-points", "0"))))
        if a.get("id") == "banner":
            self.banner_class = a.get("class", "")
        if tag in ("polyline", "line", "br", "meta", "input"):
            return  # void or self-closed in the dump
        self._open.append((tag, a))
        self._texts[len(self._open)] = []

    def handle_endtag(self, tag: str) -> None:
        if not self._open or self._open[-1][0] != tag:
            return
        depth = len(self._open)
        text = "".join(self._texts.pop(depth))
        _, a = self._open.pop()
        if self._open:
            self._texts[depth - 1].append(text)
        if "id" in a:
            self.by_id[a["id"]] = text
        if tag == "tr" and "data-node" in a:
            self.rows[a["data-node"]] = {**a, "text": text}

    def handle_data(self, data: str) -> None:
        if self._open:
            self._texts[len(self._open)].append(data)


# ---------------------------------------------------------------------------------------------
# A real cluster


def _series(url: str) -> list[dict]:
    with urllib.request.urlopen(url + "/series", timeout=5) as answer:
        return json.load(answer)["samples"]


def _samples(url: str) -> int:
    return len(_series(url))


def _series_ready(url: str) -> bool:
    """A learner's /series holds two training losses and an eval loss."""
    samples = _series(url)
    return (sum(s["loss"] is not None for s in samples) >= 2
            and any(s["eval_loss"] is not None for s in samples))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster.create(tmp_path_factory.mktemp("page")) as c:
        a = c.add("site-a", settings=SETTINGS)
        c.wait_for("site-a ready", lambda s: s.get("site-a", {}).get("ready", False), STARTUP_S)
        c.add("site-b", bootstrap=a, settings=SETTINGS)
        c.add("site-c", bootstrap=a, settings=SETTINGS)
        c.add("witness", bootstrap=a, settings=SETTINGS, role="witness")
        yield c


def test_the_page_shows_a_running_cluster(cluster: Cluster, tmp_path: Path) -> None:
    names = {"site-a", "site-b", "site-c", "witness"}
    learners = names - {"witness"}

    def settled(statuses: dict) -> bool:
        # Every site ready and seeing everyone alive, one coordinator, and every learner's series
        # holding training losses and an eval loss: then every chart has something to draw.
        return (names <= {n for n, d in statuses.items() if d.get("ready")}
                and all(sum(m["alive"] for m in statuses[n]["members"]) == len(names) for n in names)
                and cluster.coordinator(statuses) is not None
                and all(_series_ready(cluster.sites[n].url) for n in learners))

    statuses = cluster.wait_for("every site ready, all alive, every learner evaluated", settled, STARTUP_S)
    coordinator = cluster.coordinator(statuses)
    assert coordinator is not None
    url = cluster.sites[coordinator].url + "/"
    dom = Dom(_browse(url, tmp_path / "profile", "--dump-dom"))

    assert int(dom.body["data-polls"]) >= 2, "the page polled /status more than once"
    assert dom.banner_class == "", f"the page shows an error: {dom.by_id.get('banner')}"
    assert dom.by_id["title"] == coordinator
    assert dom.by_id["coordinator"] == coordinator
    assert int(dom.by_id["commit-index"]) >= statuses[coordinator]["commit_index"] > 0
    assert dom.by_id["quorum-reason"].strip() not in ("", "-")  # the coordinator's syncer says why
    assert set(dom.rows) == names
    assert all(row["data-alive"] == "true" and "unreadable" not in row["text"] for row in dom.rows.values())
    # Per-site training loss and eval loss: one line per learner, each read from its own /series.
    loss_lines = {node: points for chart, node, points in dom.lines if chart == "chart-loss"}
    assert set(loss_lines) == learners and min(loss_lines.values()) >= 2, loss_lines
    eval_lines = {node for chart, node, points in dom.lines if chart == "chart-eval" and points >= 1}
    assert eval_lines == learners
    assert {node for chart, node, _ in dom.lines if chart == "chart-commit"} == names
    assert {node for chart, node, _ in dom.lines if chart == "chart-bytes"} == {"sent", "received"}

    target = os.environ.get("DILOCO_X_SCREENSHOT_DIR")
    if target:  # the picture for the docs: let a few minutes of history build up first
        cluster.wait_for(f"{SCREENSHOT_SAMPLES} samples on {coordinator}'s page",
                         lambda s: _samples(cluster.sites[coordinator].url) >= SCREENSHOT_SAMPLES, 600, interval=5)
    shot = tmp_path / "page.png"
    _browse(url, tmp_path / "profile-shot", f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if target:
        shutil.copy(shot, Path(target) / "status-page.png")


# ---------------------------------------------------------------------------------------------
# A node whose /status fails


class _FlakyNode:
    """`/` and `/status` of a node in a background thread; /status answers once, then 500s."""

    def __init__(self) -> None:
        builder = StatusBuilder("site-a", "run-1", "learner", started_at=0.0)
        builder.set_ready(True, "serving")
        builder.set_coordination(epoch=1, coordinator="site-a", commit_index=42, state_digest="ab" * 32,
                                 members=[MemberStatus("site-a", "http://127.0.0.1:1", "learner", True)],
                                 quorum=QuorumStatus(1, 1, "quorum met"))
        self.document = builder.document(1.0).to_json()
        self.status_requests = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        app = web.Application()
        page = page_html()

        async def index(request: web.Request) -> web.Response:
            return web.Response(text=page, content_type="text/html")

        async def status(request: web.Request) -> web.Response:
            self.status_requests += 1
            if self.status_requests == 1:
                return web.Response(text=self.document, content_type="application/json")
            return web.Response(status=500, text="boom")

        app.router.add_get("/", index)
        app.router.add_get("/status", status)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}/"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_the_page_shows_a_failing_status_keeps_its_figures_and_retries(tmp_path: Path) -> None:
    node = _FlakyNode()
    try:
        dom = Dom(_browse(node.url, tmp_path / "profile", "--dump-dom"))
    finally:
        node.stop()
    assert dom.banner_class == "shown"
    assert dom.by_id["banner"].startswith("Cannot read /status: HTTP 500")
    assert "retrying every 2 s" in dom.by_id["banner"]
    assert "stale" in dom.body.get("class", "")
    # The figures of the one good answer stay on the page, dimmed.
    assert dom.by_id["title"] == "site-a" and dom.by_id["commit-index"] == "42"
    assert node.status_requests >= 3  # it kept polling after the first failure
