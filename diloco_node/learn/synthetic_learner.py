"""A synthetic learner for benchmarks and tests of the data plane: NOT for training.

`SyntheticLearner` stands in for `LearnerThread` (learn/learner_thread.py) in the daemon, with
the same hand-offs (`offer_fragment`, `request_state`, `stop`, the `on_contribution` and
`on_progress` callbacks) and the same fragment schedule (`FragmentPlan.due`), but it computes no
model and holds no weights or optimizer state: at a set step rate it "steps", and when fragment
p is due it hands over a fresh random fp32 delta of the fragment's shapes with the counters a
real learner would send (steps since its base, batch tokens per step). Everything after the
hand-off is real: codecs, transport, merge, the log, the replicas. So what it measures is the
cost of moving and merging fragments, without the CPU of training.

The deltas are small (standard deviation `DELTA_SCALE`) so every merge and outer step stays
finite, and every learner's norms are alike, so the merge's outlier check accepts them all.
Selected by `[node] learner = "synthetic"` (docs/OPERATIONS.md).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import numpy as np

from diloco_node.config.manifest import RunManifest
from diloco_node.learn.handoffs import LearnerHandoffs
from diloco_node.learn.learner_thread import DueFragment, LearnerSnapshot
from diloco_node.sync.apply import ApplyRule
from diloco_node.sync.fragments import FragmentPlan

log = logging.getLogger(__name__)

# Standard deviation of every delta element: the size of a few AdamW steps at a typical
# learning rate, so the global model stays near its initial values for as long as a benchmark runs.
DELTA_SCALE = 1e-4
# The loss a synthetic learner reports (it computes none): a constant, so status and history
# have a finite number and no one mistakes it for training.
SYNTHETIC_LOSS = 0.0


@dataclass(frozen=True, slots=True)
class _Offer:
    round: int
    contributors: frozenset[str]


class SyntheticLearner(LearnerHandoffs[LearnerSnapshot]):
    """Steps at `steps_per_s` and hands over random deltas on the fragment schedule."""

    def __init__(self, *, node_id: str, manifest: RunManifest, plan: FragmentPlan,
                 shapes: Mapping[str, tuple[int, ...]], global_rounds: list[int],
                 on_contribution: Callable[[DueFragment], None], on_progress: Callable[[int, float, int], None],
                 steps_per_s: float) -> None:
        if not steps_per_s > 0:
            raise ValueError(f"synthetic_steps_per_s = {steps_per_s}: must be > 0")
        missing = sorted(set(plan.names) - set(shapes))
        if missing:
            raise ValueError(f"the fragment plan names tensors without a shape: {missing[:5]}")
        super().__init__(f"synthetic-learner-{node_id}")
        self.node_id = node_id
        self.plan = plan
        self.manifest = manifest
        self._shapes = {n: tuple(int(d) for d in shapes[n]) for n in plan.names}
        self._interval_s = 1.0 / steps_per_s
        self._tokens_per_step = manifest.inner.batch_size * manifest.model.seq_len
        # Seeded by the site's name: different sites send different deltas, a restart repeats none
        # of what matters (the merge only needs them finite and alike in scale).
        seed = int.from_bytes(hashlib.sha256(node_id.encode()).digest()[:8], "little")
        self._rng = np.random.default_rng(seed)
        self._apply_rule = ApplyRule.from_sync_spec(manifest.sync)
        P = plan.num_fragments
        self.base_rounds = list(global_rounds)
        self.c_steps = [0] * P
        self.c_tokens = [0] * P
        self._steps = 0
        self._tokens = 0
        self._on_contribution = on_contribution
        self._on_progress = on_progress
        self._offers: dict[int, _Offer] = {}
        self.stopped_at_step: int | None = None
        self.error: BaseException | None = None
        self.last_step_at = time.monotonic()
        self.step_seconds = 0.0
        self.compute_seconds_total = 0.0  # drawing random deltas: the synthetic learner's only work
        self.sync_seconds_total = 0.0
        self.contributions = 0  # deltas handed over (tests and benchmarks read it)

    # ---- set-up (the same calls the daemon makes on LearnerThread) ----------------------------

    def compile(self) -> float:
        return 0.0  # nothing to compile

    def restore(self, snap: LearnerSnapshot) -> None:
        """Resume step and token counts and the per-fragment counters from a checkpoint."""
        self._steps, self._tokens = snap.step, snap.tokens
        self.c_steps, self.c_tokens = list(snap.c_steps), list(snap.c_tokens)

    def adopt_global(self, global_params: Mapping[str, np.ndarray], global_rounds: list[int]) -> None:
        """A fresh learner takes the global rounds as its base (it keeps no weights)."""
        self.base_rounds = list(global_rounds)
        self.c_steps = [0] * self.plan.num_fragments
        self.c_tokens = [0] * self.plan.num_fragments

    # ---- thread-safe hand-offs ----------------------------------------------------------------

    def offer_fragment(self, p: int, round_: int, params: Mapping[str, np.ndarray],
                       contributors: Collection[str] = ()) -> None:
        """A committed version of fragment p: only its round and contributors are kept (no weights)."""
        with self._lock:
            current = self._offers.get(p)
            if current is None or current.round < round_:
                earlier = current.contributors if current is not None else frozenset()
                self._offers[p] = _Offer(round_, earlier | frozenset(contributors))

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def tokens(self) -> int:
        return self._tokens

    # ---- the loop -----------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._go.wait()
            next_at = time.monotonic()
            while not self._stop_requested.is_set():
                started = time.perf_counter()
                self.take_offers()
                self._answer_state_requests()
                self.step_once()
                self.step_seconds = time.perf_counter() - started
                self.last_step_at = time.monotonic()
                # A fixed rate, not a fixed pause: drawing a big delta does not slow the schedule
                # unless it takes longer than a whole step.
                next_at = max(next_at + self._interval_s, time.monotonic())
                self._stop_requested.wait(max(0.0, next_at - time.monotonic()))
            self.take_offers()
        except BaseException as error:  # reported on /status and /livez by the node
            self.error = error
            log.exception("synthetic learner failed")
        finally:
            self.stopped_at_step = self._steps
            self._answer_state_requests()

    def step_once(self) -> None:
        """One synthetic step: counters advance, progress is reported, due fragments are sent."""
        self._steps += 1
        self._tokens += self._tokens_per_step
        for p in range(self.plan.num_fragments):
            self.c_steps[p] += 1
            self.c_tokens[p] += self._tokens_per_step
        self._on_progress(self._steps, SYNTHETIC_LOSS, self._tokens)
        for p in self.plan.due(self._steps):
            if self.c_steps[p] > 0:
                drawn = time.perf_counter()
                delta = self.random_delta(p)
                self.compute_seconds_total += time.perf_counter() - drawn
                self.contributions += 1
                self._on_contribution(DueFragment(p, self.base_rounds[p], self.c_steps[p], self.c_tokens[p],
                                                  delta, self._steps))

    def random_delta(self, p: int) -> dict[str, np.ndarray]:
        """A fresh fp32 delta of fragment p's shapes, normal with standard deviation DELTA_SCALE."""
        out = {}
        for name in self.plan.fragments[p].names:
            values = self._rng.standard_normal(self._shapes[name], dtype=np.float32)
            values *= np.float32(DELTA_SCALE)
            out[name] = values
        return out

    def take_offers(self) -> None:
        """Take the fragments committed since the last step: the newest round becomes the base.
        The counters restart, as the real apply rule's do, unless the run keeps unmerged work
        and this learner's work was in none of the merges since its base."""
        with self._lock:
            offers, self._offers = self._offers, {}
        for p, offer in offers.items():
            if offer.round <= self.base_rounds[p]:
                continue
            keeps_local = (self._apply_rule.keep_unmerged and self.node_id not in offer.contributors
                           and self.c_steps[p] > 0)
            self.base_rounds[p] = offer.round
            if not keeps_local:
                self.c_steps[p], self.c_tokens[p] = 0, 0

    def _answer_state_requests(self) -> None:
        requests = self._take_state_requests()
        if not requests:
            return
        # No weights and no optimizer state: a checkpoint keeps the counters only.
        snap = LearnerSnapshot(step=self._steps, tokens=self._tokens, params={}, opt_leaves=[],
                               base_rounds=list(self.base_rounds), c_steps=list(self.c_steps),
                               c_tokens=list(self.c_tokens), sampler="")
        self._resolve(requests, snap)
