"""The live operator page at `/` and the bounded time series behind it (`/series`).

- `StatusSeries`: a ring buffer of recent samples of this node's status document (commit index,
  training loss, the global model's eval loss, tokens, bytes, the learner's tokens/s, step time,
  MFU, gradient norm and learning rate), taken at most every `interval_s`,
  so a page opened now still shows the last half hour. Thread-safe; bounded by `capacity`.
- `page_routes`: aiohttp routes for `/` (one static HTML file with inline CSS and JS, shipped in
  the package: sites may have no internet, so nothing is loaded from elsewhere) and `/series`.

The page polls `/status` and `/series` of the node that served it, and `/series` of every member
at the member's advertised URL, which is how it shows each site's own loss: no node knows the
others' losses. A member the browser cannot reach is shown as such; the rest of the page works.

Samples carry `age_s` (seconds before the answer), not clock readings: the browser places every
node's samples on its own clock, so no two nodes' clocks are ever compared.
"""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from aiohttp import web

SERIES_SCHEMA = "diloco-node/series/1"
# 2.5 s x 720 = the last 30 minutes: long enough to see a trend after a coffee break; at ~300
# bytes a sample the whole buffer is ~220 KB of JSON, and pages fetch only what is new (`after`).
SERIES_INTERVAL_S = 2.5
SERIES_CAPACITY = 720
PAGE_CONTENT_TYPE = "text/html"
PAGE_FILE = "page.html"


@dataclass(frozen=True, slots=True)
class Sample:
    seq: int  # 1, 2, ... within one process: a page asks for samples after the last it has
    t: float  # this node's monotonic clock; served as an age, never as a time
    commit_index: int
    step: int
    loss: float | None  # training loss of this site's learner (None: witness, or not finite yet)
    eval_loss: float | None  # the global model's loss on this site's held-out slice
    eval_commit_index: int
    tokens: int
    bytes_sent: int
    bytes_received: int
    # The learner's figures (ops/status.py LearnerStatus); None while unknown (MFU on a CPU).
    tokens_per_s: float = 0.0
    step_time_s: float | None = None
    mfu: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    # Each [node.data.eval.NAME] set's loss of the global model, by name (None: not finite); the
    # page draws one eval line per site and set.
    eval_sets: dict[str, float | None] = field(default_factory=dict)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class StatusSeries:
    """Recent samples of one node's status document; the oldest fall out past `capacity`."""

    def __init__(self, clock: Callable[[], float], interval_s: float = SERIES_INTERVAL_S,
                 capacity: int = SERIES_CAPACITY) -> None:
        if interval_s <= 0 or capacity < 1:
            raise ValueError(f"series: interval_s {interval_s} must be > 0 and capacity {capacity} >= 1")
        self.clock = clock  # the daemon's monotonic clock (a fake one in tests)
        self.interval_s = interval_s
        self.capacity = capacity
        # Tells a page that the node restarted (sequence numbers start again), without clocks.
        self.instance = os.urandom(6).hex()
        self._lock = threading.Lock()
        self._samples: deque[Sample] = deque(maxlen=capacity)
        self._seq = 0

    def observe(self, document: Callable[[], Any]) -> bool:
        """Take a sample of `document()` (a StatusDocument) if one is due; whether one was taken.
        The document is only built when due: the daemon calls this every status refresh."""
        now = self.clock()
        with self._lock:
            if self._samples and now - self._samples[-1].t < self.interval_s:
                return False
        doc = document()
        with self._lock:
            self._seq += 1
            self._samples.append(Sample(
                seq=self._seq, t=now, commit_index=doc.commit_index, step=doc.learner.step,
                loss=_finite(doc.learner.loss), eval_loss=_finite(doc.evaluation.loss),
                eval_commit_index=doc.evaluation.commit_index, tokens=doc.learner.tokens,
                bytes_sent=doc.bytes.sent, bytes_received=doc.bytes.received,
                tokens_per_s=_finite(doc.learner.tokens_per_s) or 0.0, step_time_s=_finite(doc.learner.step_time_s),
                mfu=_finite(doc.learner.mfu), grad_norm=_finite(doc.learner.grad_norm), lr=_finite(doc.learner.lr),
                eval_sets={name: _finite(figure.loss) for name, figure in doc.evaluation.sets.items()}))
        return True

    def to_dict(self, node_id: str, after: int = 0) -> dict[str, Any]:
        """The samples with `seq > after`, oldest first, each with `age_s` instead of `t`."""
        now = self.clock()
        with self._lock:
            samples = [s for s in self._samples if s.seq > after]
        rows = []
        for s in samples:
            row = asdict(s)
            row["age_s"] = round(max(0.0, now - row.pop("t")), 3)
            rows.append(row)
        return {"schema": SERIES_SCHEMA, "node_id": node_id, "instance": self.instance,
                "interval_s": self.interval_s, "capacity": self.capacity, "samples": rows}


def page_html() -> str:
    """The page, read from the package (hatch ships every file under `diloco_node/`)."""
    return resources.files("diloco_node.ops").joinpath(PAGE_FILE).read_text(encoding="utf-8")


def _after(request: "web.Request") -> int:
    try:
        return max(0, int(request.query.get("after", "0")))
    except ValueError:
        return 0  # a malformed cursor gets the whole (bounded) buffer, not an error page


def page_routes(routes: "web.RouteTableDef", node_id: Callable[[], str], series: StatusSeries | None) -> None:
    """Add `/` and `/series` to `routes` (the operator routes, wherever they are mounted)."""
    from aiohttp import web

    text = page_html()  # read once: the file does not change under a running node

    @routes.get("/")
    async def index(request: web.Request) -> web.Response:
        # The page is static and small; no-cache so an upgraded node serves its new page at once.
        return web.Response(text=text, content_type=PAGE_CONTENT_TYPE, headers={"Cache-Control": "no-cache"})

    @routes.get("/series")
    async def series_route(request: web.Request) -> web.Response:
        body = (series.to_dict(node_id(), _after(request)) if series is not None
                else {"schema": SERIES_SCHEMA, "node_id": node_id(), "instance": "", "interval_s": 0.0,
                      "capacity": 0, "samples": []})
        # Any origin may read it: the page served by one member reads every member's series, and
        # it holds only numbers that anyone who can reach this port may read anyway (no URLs,
        # errors or run id). /status stays same-origin.
        return web.json_response(body, headers={"Access-Control-Allow-Origin": "*", "Cache-Control": "no-store"})
