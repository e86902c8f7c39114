"""In-process multi-learner runner on a virtual clock: M learners, one syncer, real codecs.

This is the simulation harness behind `diloco-node demo/train` and `benchmarks/parity.py`. All M
learners live in one process: their parameters are stacked and stepped by one vmapped, jitted
AdamW call per clock tick (`inner.StackedLearners`), masked for learners that are mid-step or
down. Time is virtual: learner m's step takes `base_step_s / speed_m`; a transfer of n bytes takes
`latency_s + n / bandwidth`. Every exchange is really encoded with `wire.codecs`, so byte counts
are actual payload lengths. The fragment round is the daemon's own `sync.Syncer` (quorum, grace,
rate limit, merge, commit payload), the global state is a `sync.Replica` that applies the same
commit payloads a daemon's log carries, and learners take merges by the daemon's apply rule
(`sync.apply`): the runner adds only the virtual clock, the links and the learners' schedule.

Modes (see `MODES`):
- `data_parallel`: one model, gradients all-reduced every step (global batch = every live
  learner's batch). Bytes: each live learner sends its raw fp32 gradient and receives the raw fp32
  mean every step (what a ring/tree all-reduce moves per worker, up to a constant near 1).
- `diloco`: synchronous DiLoCo: whole model (P = 1) every H steps, learners block until the
  merge of all live learners (K = M) comes back; plain mean, uniform weights.
- `streaming`: Streaming DiLoCo: P fragments, staggered; a fragment sent at step n must be merged
  (K = M) and applied before step n + tau + 1 starts, otherwise the learner blocks; plain mean.
- `decoupled`: Decoupled DiLoCo: K from the manifest (default 1) plus the adaptive grace window,
  token weights, RDA; learners never block, merges are applied at the next step boundary.

Outages: a learner that is down does not compute (a step in progress is lost). On rejoin it
downloads every merge it missed (bytes counted), takes the newest global fragments and resets its
counters. The synchronous baselines are *elastic*: they carry on with the live learners (failure
detection is assumed instant, which favours them) and a rejoining learner joins at the next
round. Idle time = time a live learner spends blocked (on slower peers or on the network);
`idle_fraction` = idle / (idle + compute) over all learners.

The run stops when the learners together have processed the token budget (equal tokens across
modes); contributions already sent are still merged, steps in progress are dropped. Deterministic
for a seed: same config, same losses and byte counts.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Collection, Mapping

import numpy as np

from bootstrap.entries import EntryKind, LogEntry
from diloco_node.config.manifest import ERROR_FEEDBACK_CODECS, ConfigError, ModelSpec, RunManifest
from diloco_node.learn import data as data_lib
from diloco_node.learn import factory
from diloco_node.learn.error_feedback import ErrorFeedback, codec_quantizer
from diloco_node.learn import model as model_lib
from diloco_node.learn.inner import InnerLearner, StackedLearners
from diloco_node.sim.sparse_diagnostics import SparseDiagnostics
from diloco_node.sim.batches import StackedBatches
from diloco_node.sync.admission import LEARNER_ROLE, Member, Refused
from diloco_node.sync.apply import ApplyRule, FragmentCounters, SentFragment, apply_merge
from diloco_node.sync.fragments import FragmentPlan, plan_fragments
from diloco_node.sync.merge import Contribution
from diloco_node.sync.quorum import DEFAULT_MIN_ROUND_INTERVAL_FACTOR, QuorumPolicy, RoundDecision
from diloco_node.sync.replica import Replica
from diloco_node.sync.syncer import CommitPlan, RoundRules, Syncer
from wire.codecs import CODECS, decode_named, encode_named

MODES = ("data_parallel", "diloco", "streaming", "decoupled")
# Events closer than this on the virtual clock count as simultaneous (float noise of sums).
TIME_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class LinkModel:
    """A WAN link between any site and the syncer: fixed latency plus bandwidth."""

    bandwidth_bytes_per_s: float = 12.5e6  # 100 Mbit/s
    latency_s: float = 0.05

    def transfer_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True, slots=True)
class Outage:
    """Learner `learner` is down on the virtual interval [start_s, end_s)."""

    learner: int
    start_s: float
    end_s: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.start_s < self.end_s:
            raise ValueError(f"outage of learner {self.learner}: need 0 <= start_s < end_s, got {self.start_s}, {self.end_s}")


@dataclass(frozen=True)
class RunnerConfig:
    """One simulated run. `steps` is the nominal number of steps per learner: the token budget is
    num_learners * steps * batch_size * seq_len, and it is the horizon of the inner cosine."""

    manifest: RunManifest
    mode: str = "decoupled"
    num_learners: int = 4
    steps: int = 400
    speeds: tuple[float, ...] = ()  # relative speeds, 1.0 each when empty
    outages: tuple[Outage, ...] = ()
    base_step_s: float = 1.0
    link: LinkModel = LinkModel()
    eval_batches: int = 8
    eval_batch_size: int = 32
    log_every: int = 0  # ticks between progress callbacks (0: never)
    # When the budget is spent, every live learner sends each fragment it has trained since its
    # last send, so the evaluated global model contains every token (costs one more exchange).
    final_sync: bool = True
    # decoupled: rho of the per-fragment round rate limit (quorum.py); 0 disables it
    min_round_interval_factor: float = DEFAULT_MIN_ROUND_INTERVAL_FACTOR
    # (k, C) of a topk2 uplink, for measurements only: the top k of every C values. None: the codec's
    # defaults (64 of 4,096), which is what the daemon sends (the manifest has no key for them).
    topk2: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: must be one of {', '.join(MODES)}")
        if self.num_learners < 1:
            raise ValueError(f"num_learners = {self.num_learners}: must be >= 1")
        if self.steps < 1:
            raise ValueError(f"steps = {self.steps}: must be >= 1")
        if self.speeds and len(self.speeds) != self.num_learners:
            raise ValueError(f"speeds: {len(self.speeds)} given for {self.num_learners} learners")
        if any(not (s > 0 and math.isfinite(s)) for s in self.speeds):
            raise ValueError(f"speeds {self.speeds}: each must be a positive number")
        for outage in self.outages:
            if not 0 <= outage.learner < self.num_learners:
                raise ValueError(f"outage names learner {outage.learner}, but there are {self.num_learners}")
        if self.topk2 is not None:
            if self.manifest.sync.codec_up != "topk2":
                raise ValueError(f"topk2 = {self.topk2}: the uplink codec is {self.manifest.sync.codec_up}, not topk2")
            k, chunk = self.topk2
            problem = CODECS["topk2"].check_block_size(chunk)
            if problem is not None or not 1 <= k <= chunk:
                raise ValueError(f"topk2 = {self.topk2}: {problem or 'k must be in [1, C]'}")

    @property
    def uplink_codec_args(self) -> dict[str, int]:
        """encode_named's keyword arguments for the uplink: {} for the codec's defaults."""
        return {} if self.topk2 is None else {"top_k": self.topk2[0], "block_size": self.topk2[1]}

    def speed(self, m: int) -> float:
        return self.speeds[m] if self.speeds else 1.0

    @property
    def tokens_per_step(self) -> int:
        return self.manifest.inner.batch_size * self.manifest.model.seq_len

    @property
    def token_budget(self) -> int:
        return self.num_learners * self.steps * self.tokens_per_step


@dataclass(frozen=True)
class Progress:
    """A live progress line's content."""

    mode: str
    time_s: float
    step: int  # most steps any learner has done
    tokens: int
    train_loss: float
    merges: int
    bytes_cross_site: int


@dataclass
class RunResult:
    mode: str
    eval_loss_start: float
    eval_loss: float
    bytes_up: int
    bytes_down: int
    merges: int
    merges_during_outage: int
    idle_fraction: float
    tokens: int
    learner_steps: tuple[int, ...]
    virtual_s: float
    wall_s: float
    data_parallel_bytes_equivalent: int  # what data-parallel would have sent for these tokens
    missed_merges_applied: int = 0  # merges that learners back from an outage downloaded and applied
    merge_log: list[str] = field(default_factory=list)
    loss_curve: list[tuple[float, int, float]] = field(default_factory=list)  # (time, tokens, train loss)
    # Standard error of eval_loss over the eval set's batches (std of the batch means / sqrt(N)):
    # how much a different draw of held-out windows of the same size could move the figure.
    eval_loss_stderr: float = 0.0
    # The mean loss of each eval batch, in the eval set's order: two runs on the same eval set can
    # be compared batch by batch (a paired difference, whose noise is far below either's stderr).
    eval_batch_losses: tuple[float, ...] = ()
    # Per merged round of a sparse uplink (sim/sparse_diagnostics.py); empty for dense codecs.
    sparse_rounds: list[dict] = field(default_factory=list)
    # Fragment modes: parameter bytes the learners' stack brought to the host, and the fp32 bytes
    # of the fragments the algorithm read (contributions' deltas, local fragments an apply rule read).
    device_to_host_bytes: int = 0
    fragment_bytes_due: int = 0

    @property
    def bytes_cross_site(self) -> int:
        return self.bytes_up + self.bytes_down

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["bytes_cross_site"] = self.bytes_cross_site
        out.pop("merge_log")
        return out


# ------------------------------------------------------------------------------------------------
# shared setup


@dataclass
class _Setup:
    model: ModelSpec
    samplers: list[data_lib.BatchSampler]
    eval_inputs: np.ndarray
    eval_targets: np.ndarray
    initial: dict[str, np.ndarray]
    fp32_grad_bytes: int


def _setup(config: RunnerConfig, corpus: data_lib.Corpus) -> _Setup:
    manifest = config.manifest
    seq_len = manifest.model.seq_len
    model = factory.recipe(manifest.model)
    try:
        data_lib.check_tokens(corpus, model.vocab_size)
    except data_lib.DataError as error:
        raise ConfigError(str(error)) from None
    shards = data_lib.shard_bounds(len(corpus.train), config.num_learners)
    samplers = [data_lib.BatchSampler(corpus.train[a:b], manifest.inner.batch_size, seq_len, manifest.seed, m)
                for m, (a, b) in enumerate(shards)]
    eval_inputs, eval_targets = data_lib.eval_batches(corpus.eval, config.eval_batches, config.eval_batch_size, seq_len)
    _, params = factory.init_params(model, manifest.seed)
    initial = model_lib.flat_params(params)
    # Raw fp32 (no compression) is what a gradient all-reduce moves.
    fp32_grad_bytes = len(encode_named(initial, "fp32", zstd_level=None))
    return _Setup(model, samplers, eval_inputs, eval_targets, initial, fp32_grad_bytes)


def _inner_for(config: RunnerConfig):
    return dataclasses.replace(config.manifest.inner, total_steps=max(config.steps, config.manifest.inner.warmup_steps + 1))


def _outage_intervals(config: RunnerConfig, m: int) -> list[tuple[float, float]]:
    return sorted((o.start_s, o.end_s) for o in config.outages if o.learner == m)


def _is_down(config: RunnerConfig, m: int, t: float) -> bool:
    return any(a - TIME_EPS <= t < b - TIME_EPS for a, b in _outage_intervals(config, m))


def run(config: RunnerConfig, corpus: data_lib.Corpus,
        on_progress: Callable[[Progress], None] | None = None) -> RunResult:
    """Run one simulated training job and evaluate the resulting global model."""
    started = time.perf_counter()
    setup = _setup(config, corpus)
    if config.mode == "data_parallel":
        result = _DataParallel(config, setup, on_progress).run()
    else:
        result = _FragmentSync(config, setup, on_progress).run()
    result.wall_s = time.perf_counter() - started
    return result


def _evaluate(setup: _Setup, flat: dict[str, np.ndarray], evaluate, template) -> float:
    return _evaluate_params(setup, model_lib.load_flat_params(template, flat), evaluate)[0]


def _evaluate_params(setup: _Setup, params, evaluate) -> tuple[float, float, tuple[float, ...]]:
    """(mean loss over the eval set, its standard error over batches, each batch's mean). One
    jitted call per batch of the same shape (one compilation); the batches are equal-weight, so
    the mean of their means is the whole set's mean."""
    batch_means = np.array([float(evaluate(params, setup.eval_inputs[i:i + 1], setup.eval_targets[i:i + 1]))
                            for i in range(len(setup.eval_inputs))], dtype=np.float64)
    stderr = float(batch_means.std(ddof=1) / math.sqrt(len(batch_means))) if len(batch_means) > 1 else 0.0
    return float(batch_means.mean()), stderr, tuple(float(x) for x in batch_means)


# ------------------------------------------------------------------------------------------------
# data-parallel


class _DataParallel:
    """One model; every step waits for the slowest live learner, then all-reduces fp32 gradients."""

    def __init__(self, config: RunnerConfig, setup: _Setup, on_progress):
        self.config, self.setup, self.on_progress = config, setup, on_progress

    def run(self) -> RunResult:
        config, setup = self.config, self.setup
        learner = InnerLearner(setup.model, _inner_for(config), config.manifest.seed, setup.initial)
        evaluate = factory.eval_fn(setup.model)
        eval_start = _evaluate(setup, setup.initial, evaluate, learner.params)
        t = 0.0
        tokens = bytes_up = bytes_down = merges = merges_outage = 0
        compute_s = idle_s = 0.0
        was_down = [False] * config.num_learners
        steps = [0] * config.num_learners
        losses: list[tuple[float, int, object]] = []
        curve: list[tuple[float, int, float]] = []
        tick = 0
        while tokens < config.token_budget:
            live = [m for m in range(config.num_learners) if not _is_down(config, m, t)]
            if not live:  # everyone down: time passes until the next rejoin
                t = min(b for m in range(config.num_learners) for a, b in _outage_intervals(config, m) if b > t)
                continue
            for m in range(config.num_learners):
                down = m not in live
                if was_down[m] and not down:  # rejoin: fetch the current model (raw fp32)
                    bytes_down += setup.fp32_grad_bytes
                was_down[m] = down
            batches = [setup.samplers[m].next() for m in live]
            inputs = np.concatenate([b[0] for b in batches])
            targets = np.concatenate([b[1] for b in batches])
            loss = learner.step(inputs, targets)
            durations = [config.base_step_s / config.speed(m) for m in live]
            comm_s = 2 * config.link.transfer_s(setup.fp32_grad_bytes)
            step_s = max(durations) + comm_s
            compute_s += sum(durations)
            idle_s += sum(step_s - d for d in durations)
            bytes_up += len(live) * setup.fp32_grad_bytes
            bytes_down += len(live) * setup.fp32_grad_bytes
            if any(o.start_s <= t < o.end_s for o in config.outages):
                merges_outage += 1
            t += step_s
            merges += 1
            tokens += int(targets.size)
            for m in live:
                steps[m] += 1
            losses.append((t, tokens, loss))
            tick += 1
            if config.log_every and tick % config.log_every == 0:
                train_loss = float(np.mean([float(x) for _, _, x in losses[-config.log_every:]]))
                curve.append((t, tokens, train_loss))
                if self.on_progress:
                    self.on_progress(Progress(config.mode, t, max(steps), tokens, train_loss, merges, bytes_up + bytes_down))
        eval_end, eval_stderr, eval_batch_losses = _evaluate_params(setup, learner.params, evaluate)
        return RunResult(
            mode=config.mode, eval_loss_start=eval_start, eval_loss=eval_end, bytes_up=bytes_up,
            bytes_down=bytes_down, merges=merges, merges_during_outage=merges_outage,
            idle_fraction=idle_s / max(idle_s + compute_s, 1e-12), tokens=tokens, learner_steps=tuple(steps),
            virtual_s=t, wall_s=0.0, data_parallel_bytes_equivalent=bytes_up + bytes_down, loss_curve=curve,
            eval_loss_stderr=eval_stderr, eval_batch_losses=eval_batch_losses,
        )


# ------------------------------------------------------------------------------------------------
# fragment synchronisation: diloco, streaming, decoupled


@dataclass(frozen=True)
class _ModePolicy:
    fragments: int
    overlap: int
    blocking: bool  # learners wait for a sent fragment's merge by step n + overlap
    all_live: bool  # K = every live member of the round (synchronous)
    method: str
    weighting: str


def _mode_policy(config: RunnerConfig) -> _ModePolicy:
    sync = config.manifest.sync
    if config.mode == "diloco":
        return _ModePolicy(1, 0, True, True, "mean", "uniform")
    if config.mode == "streaming":
        return _ModePolicy(sync.fragments, sync.overlap, True, True, "mean", "uniform")
    return _ModePolicy(sync.fragments, sync.overlap, False, False, sync.merge, sync.weighting)


def round_rules(config: RunnerConfig, period: int) -> RoundRules:
    """The syncer's rules for a mode: the manifest's (decoupled, exactly what a daemon builds from
    it when rho is the default) or the synchronous baselines' (K = every live member, plain mean)."""
    policy = _mode_policy(config)
    if policy.all_live:  # K = M already aligns rounds: no rate limit
        quorum = QuorumPolicy(1, 0.0, 0.0, policy.overlap, period_steps=period, min_round_interval_factor=0.0)
    else:
        # Rounds of a fragment are rate-limited to its period (QuorumPolicy's rho), so a straggler's
        # out-of-phase contribution joins the next on-time round instead of merging alone.
        sync = config.manifest.sync
        quorum = QuorumPolicy(sync.min_quorum, sync.grace_gamma, sync.grace_cap_s, policy.overlap,
                              period_steps=period, min_round_interval_factor=config.min_round_interval_factor)
    return RoundRules(quorum, policy.method, policy.weighting, synchronous=policy.all_live)


@dataclass
class _MergeMsg:
    fragment: int
    round: int
    params: dict[str, np.ndarray]  # Theta_p after the merge (the learner's replica computes the same bits)
    nbytes: int  # encoded merged outer gradient: what crosses the link
    arrival: float
    contributors: frozenset[str] = frozenset()  # learners whose contribution this merge accepted


@dataclass
class _LearnerState:
    index: int
    name: str
    step_s: float
    down: bool = False
    stepping: bool = False  # a STEP_DONE event is scheduled
    joining: bool = False  # back from an outage, waiting for the next step boundary of the others
    active_since: float = 0.0  # when it (re)joined the schedule; rounds opened earlier do not wait for it
    blocked_since: float | None = None
    sync_step: int = 0  # steps since start (phase of the fragment schedule)
    c_steps: list[int] = field(default_factory=list)
    c_tokens: list[int] = field(default_factory=list)
    base_round: list[int] = field(default_factory=list)
    base_params: list[dict[str, np.ndarray]] = field(default_factory=list)
    awaiting: dict[int, int] = field(default_factory=dict)  # fragment -> last step allowed before its merge
    sent_step: dict[int, int] = field(default_factory=dict)  # fragment -> sync_step of its last send
    sent: dict[int, SentFragment] = field(default_factory=dict)  # fragment -> as sent (apply rule eager only)
    inbox: list[_MergeMsg] = field(default_factory=list)
    missed: list[_MergeMsg] = field(default_factory=list)
    compute_s: float = 0.0
    idle_s: float = 0.0


_STEP, _ARRIVE, _WAKE, _DELIVER, _DOWN, _UP = range(6)


class _FragmentSync:
    """diloco / streaming / decoupled: learners, one syncer, an event queue on a virtual clock."""

    def __init__(self, config: RunnerConfig, setup: _Setup, on_progress):
        self.config, self.setup, self.on_progress = config, setup, on_progress
        self.policy = _mode_policy(config)
        sync = config.manifest.sync
        period = max(sync.period, self.policy.fragments)
        shapes = {n: a.shape for n, a in setup.initial.items()}
        self.plan: FragmentPlan = plan_fragments(shapes, self.policy.fragments, period, self.policy.overlap)
        self.period = period
        # The global state is a replica: merges reach it as the commit payloads a daemon's log carries.
        self.replica = Replica(self.plan, setup.initial, config.manifest.resolved_outer())
        self.global_state = self.replica.state
        rules = round_rules(config, period)
        self.syncer = Syncer(config.manifest, self.plan, factory.embedding_names(setup.model, setup.initial), rules)
        self.rounds = VirtualRounds(self.syncer, self.replica)
        self.apply_rule = ApplyRule.from_sync_spec(sync, keeps_sent=True)
        M = config.num_learners
        self.learners = [_LearnerState(m, f"learner-{m}", config.base_step_s / config.speed(m)) for m in range(M)]
        P = self.plan.num_fragments
        for st in self.learners:
            st.c_steps, st.c_tokens = [0] * P, [0] * P
            st.base_round = [0] * P
            st.base_params = [self.global_state.fragment_params(p) for p in range(P)]
        self.stack = StackedLearners(setup.model, _inner_for(config), M, config.manifest.seed, setup.initial)
        # Each learner's error-feedback remainders (None: the uplink codec does not use them).
        self.error_feedback: list[ErrorFeedback] | None = None
        if sync.uses_error_feedback:
            quantize = codec_quantizer(sync.codec_up, **config.uplink_codec_args)
            self.error_feedback = [ErrorFeedback(sync.error_feedback_decay, quantize) for _ in range(M)]
        self.diagnostics = SparseDiagnostics() if sync.codec_up in ERROR_FEEDBACK_CODECS else None
        self.events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.bytes_up = self.bytes_down = 0
        self.merges = self.merges_outage = 0
        self.missed_merges_applied = 0
        self.tokens = 0
        self.now = 0.0
        self.stop_time: float | None = None
        self.merge_log: list[str] = []
        # Timing estimates for the grace window, primed from what a syncer knows before the first
        # round: the fastest step time (progress reports), the sync time (a link probe).
        probe = len(encode_named(self.global_state.fragment_params(0), sync.codec_up))
        self.syncer.prime(step_s=config.base_step_s / max(config.speed(m) for m in range(M)), quorum_s=0.0,
                          sync_s=2 * config.link.transfer_s(probe))
        self.batches = StackedBatches(setup.samplers, config.manifest.inner.batch_size, config.manifest.model.seq_len)
        # fp32 bytes of the fragments the algorithm read from the learners: each contribution's
        # delta, and the local fragment when the apply rule reads it (runner_overhead's "due").
        self.fragment_bytes_due = 0
        self._losses: list[tuple[np.ndarray, object]] = []
        self.curve: list[tuple[float, int, float]] = []
        self._ticks = 0

    # --- event queue ---

    def _push(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, kind if kind == _STEP else 1 + kind, self._seq, (kind, payload)))

    def _in_outage(self, t: float) -> bool:
        return any(o.start_s <= t < o.end_s for o in self.config.outages)

    # --- main loop ---

    def run(self) -> RunResult:
        config = self.config
        evaluate = factory.eval_fn(self.setup.model)
        template = self.stack.learner_params(0)
        eval_start = _evaluate(self.setup, self.setup.initial, evaluate, template)
        for o in config.outages:
            self._push(o.start_s, _DOWN, o.learner)
            self._push(o.end_s, _UP, o.learner)
        for st in self.learners:
            if not _is_down(config, st.index, 0.0):
                self._start_step(st, 0.0)
            else:
                st.down = True
        while self.events:
            t, _, _, (kind, payload) = heapq.heappop(self.events)
            self.now = t
            if kind == _STEP:
                group = [payload]
                while self.events and self.events[0][1] == _STEP and abs(self.events[0][0] - t) <= TIME_EPS:
                    group.append(heapq.heappop(self.events)[3][1])
                self._steps_done(sorted(group), t)
            elif kind == _ARRIVE:
                self._arrive(payload, t)
            elif kind == _WAKE:
                self._evaluate_round(payload, t)
            elif kind == _DELIVER:
                st = self.learners[payload]
                if st.blocked_since is not None and not st.down:
                    self._boundary(st, t, stepped=False)
            elif kind == _DOWN:
                self._go_down(self.learners[payload], t)
            elif kind == _UP:
                self._come_up(self.learners[payload], t)
        self._flush_losses()
        eval_end, eval_stderr, eval_batch_losses = _evaluate_params(
            self.setup, model_lib.load_flat_params(template, self.global_state.all_params()), evaluate)
        compute = sum(st.compute_s for st in self.learners)
        idle = sum(st.idle_s for st in self.learners)
        dp_equiv = 2 * self.setup.fp32_grad_bytes * (self.tokens // config.tokens_per_step)
        return RunResult(
            mode=config.mode, eval_loss_start=eval_start, eval_loss=eval_end, bytes_up=self.bytes_up,
            bytes_down=self.bytes_down, merges=self.merges, merges_during_outage=self.merges_outage,
            idle_fraction=idle / max(idle + compute, 1e-12), tokens=self.tokens,
            learner_steps=tuple(int(s) for s in self.stack.steps), virtual_s=self.stop_time or self.now,
            wall_s=0.0, data_parallel_bytes_equivalent=dp_equiv, merge_log=self.merge_log, loss_curve=self.curve,
            missed_merges_applied=self.missed_merges_applied, eval_loss_stderr=eval_stderr,
            eval_batch_losses=eval_batch_losses, device_to_host_bytes=self.stack.device_to_host_bytes,
            fragment_bytes_due=self.fragment_bytes_due,
            sparse_rounds=self.diagnostics.rows if self.diagnostics is not None else [],
        )

    # --- learners ---

    def _start_step(self, st: _LearnerState, t: float) -> None:
        st.stepping = True
        self._push(t + st.step_s, _STEP, st.index)

    def _steps_done(self, indices: list[int], t: float) -> None:
        config = self.config
        mask = np.zeros(config.num_learners, dtype=bool)
        for m in indices:
            mask[m] = True
        inputs, targets = self.batches.take(mask)
        loss_M = self.stack.step(inputs, targets, mask)
        self._losses.append((mask, loss_M))
        self._ticks += 1
        for m in indices:
            st = self.learners[m]
            st.stepping = False
            st.compute_s += st.step_s
            st.sync_step += 1
            self.tokens += config.tokens_per_step
            for p in range(self.plan.num_fragments):
                st.c_steps[p] += 1
                st.c_tokens[p] += config.tokens_per_step
        if self.tokens >= config.token_budget and self.stop_time is None:
            self.stop_time = t
            # Steps in progress are dropped: the budget is spent.
            self.events = [e for e in self.events if e[3][0] != _STEP]
            heapq.heapify(self.events)
            for st in self.learners:
                st.stepping = False
                if st.blocked_since is not None:  # blocked until the end: that wait is idle time
                    st.idle_s += t - st.blocked_since
                    st.blocked_since = None
        for m in indices:
            self._boundary(self.learners[m], t, stepped=True)
        if self.stop_time == t and config.final_sync and config.mode != "data_parallel":
            for st in self.learners:
                if st.down:
                    continue
                for p in range(self.plan.num_fragments):
                    if st.c_steps[p] > 0 and st.sent_step.get(p) != st.sync_step:
                        self._send(st, p, t)
        self._admit_joiners(indices, t)
        if config.log_every and self._ticks % config.log_every == 0:
            self._report(t)

    def _flush_losses(self) -> list[float]:
        values = [float(np.asarray(loss)[mask].mean()) for mask, loss in self._losses]
        self._losses = []
        return values

    def _report(self, t: float) -> None:
        values = self._flush_losses()
        train_loss = float(np.mean(values)) if values else float("nan")
        self.curve.append((t, self.tokens, train_loss))
        if self.on_progress:
            self.on_progress(Progress(self.config.mode, t, int(max(self.stack.steps)), self.tokens, train_loss,
                                      self.merges, self.bytes_up + self.bytes_down))

    def _boundary(self, st: _LearnerState, t: float, stepped: bool) -> None:
        """Between two steps: apply arrived merges, send due fragments, then step or block."""
        self._apply_inbox(st, t)
        if stepped and (self.stop_time is None or self.stop_time == t):
            for p in self.plan.due(st.sync_step):
                if st.c_steps[p] > 0:  # nothing new to contribute right after a merge was applied
                    self._send(st, p, t)
        if self.stop_time is not None:
            if st.blocked_since is not None:
                st.idle_s += t - st.blocked_since
                st.blocked_since = None
            return
        blocked = self.policy.blocking and any(st.sync_step >= last for last in st.awaiting.values())
        if blocked:
            if st.blocked_since is None:
                st.blocked_since = t
            return
        if st.blocked_since is not None:
            st.idle_s += t - st.blocked_since
            st.blocked_since = None
        self._start_step(st, t)

    def _apply_inbox(self, st: _LearnerState, t: float) -> None:
        ready = [msg for msg in st.inbox if msg.arrival <= t + TIME_EPS]
        if not ready:
            return
        st.inbox = [msg for msg in st.inbox if msg.arrival > t + TIME_EPS]
        for msg in sorted(ready, key=lambda m: (m.fragment, m.round)):
            self._apply_merge(st, msg)

    def _apply_merge(self, st: _LearnerState, msg: _MergeMsg, adopt: bool = False) -> None:
        """A merged fragment reaches learner `st`: the apply rule, or (`adopt`, back from an outage)
        the global fragment as it is, counters reset."""
        p = msg.fragment
        st.awaiting.pop(p, None)  # the round it waited for is closed (merged, or nothing acceptable)
        if msg.round <= st.base_round[p]:
            return
        if adopt:
            new, counters = msg.params, FragmentCounters()
        else:
            local = _LocalFragment(self, st.index, list(msg.params))  # read only if the rule reads it
            new, counters = apply_merge(local, st.base_params[p], msg.params, msg.contributors,
                                        FragmentCounters(st.c_steps[p], st.c_tokens[p]), learner=st.name,
                                        rule=self.apply_rule, sent=st.sent.pop(p, None))
        self.stack.set_flat(st.index, new)
        st.base_round[p] = msg.round
        st.base_params[p] = msg.params
        st.c_steps[p], st.c_tokens[p] = counters.c_steps, counters.c_tokens

    def _send(self, st: _LearnerState, p: int, t: float) -> None:
        sync = self.config.manifest.sync
        names = self.plan.fragments[p].names
        # base - local on the device (the same float32 bits as on the host): only the delta crosses.
        raw = delta = self.stack.fragment_delta(st.index, {n: st.base_params[p][n] for n in names})
        self.fragment_bytes_due += sum(v.nbytes for v in delta.values())
        if self.apply_rule.mode == "eager":  # the fragment as sent, base - (base - local): no device read
            st.sent[p] = SentFragment({n: st.base_params[p][n] - v for n, v in raw.items()},
                                      FragmentCounters(st.c_steps[p], st.c_tokens[p]))
        if self.error_feedback is not None:  # send Q(beta * e + delta), keep the rest
            delta = self.error_feedback[st.index].compensate(p, delta)
        payload = encode_named(delta, sync.codec_up, **self.config.uplink_codec_args)
        self.bytes_up += len(payload)
        contribution = Contribution(st.name, p, st.base_round[p], decode_named(payload), st.c_steps[p], st.c_tokens[p])
        if self.diagnostics is not None:
            remainder = self.error_feedback[st.index].remainder(p) if self.error_feedback is not None else {}
            self.diagnostics.sent(st.name, p, st.base_round[p], raw, contribution.delta, remainder)
        st.sent_step[p] = st.sync_step
        if self.policy.blocking:
            st.awaiting[p] = st.sync_step + self.policy.overlap
        self._push(t + self.config.link.transfer_s(len(payload)), _ARRIVE, (contribution, t))

    def _admit_joiners(self, stepped: list[int], t: float) -> None:
        """Learners back from an outage start at the next step boundary of the live learners, so
        they share the vmapped tick, and take the live learners' phase of the fragment schedule,
        so their contributions join the others' rounds instead of forming rounds of their own."""
        joiners = [st for st in self.learners if st.joining and not st.down]
        if not joiners or self.stop_time is not None:
            return
        phase = max(self.learners[m].sync_step for m in stepped)
        for st in joiners:
            st.joining = False
            st.active_since = t
            st.sync_step = phase
            self._start_step(st, t)

    # --- outages ---

    def _go_down(self, st: _LearnerState, t: float) -> None:
        st.down = True
        if st.stepping:  # the step in progress is lost
            self.events = [e for e in self.events if not (e[3][0] == _STEP and e[3][1] == st.index)]
            heapq.heapify(self.events)
            st.stepping = False
        if st.blocked_since is not None:
            st.idle_s += t - st.blocked_since
            st.blocked_since = None
        # Merges in flight to it are lost with it; it will fetch them on rejoin.
        st.missed.extend(st.inbox)
        st.inbox = []
        for p in list(self.syncer.rounds):
            self._evaluate_round(p, t)

    def _come_up(self, st: _LearnerState, t: float) -> None:
        st.down = False
        if self.error_feedback is not None:  # it adopts the global state: its remainders are stale
            self.error_feedback[st.index].reset()
        # Every missed merge is downloaded and applied in order; counters restart.
        for msg in sorted(st.missed, key=lambda m: (m.fragment, m.round)):
            self.bytes_down += msg.nbytes
            self._apply_merge(st, msg, adopt=True)
            self.missed_merges_applied += 1
        st.missed = []
        st.awaiting.clear()
        st.sent.clear()
        for p in range(self.plan.num_fragments):
            st.c_steps[p] = st.c_tokens[p] = 0
        if self.stop_time is not None:
            return
        if any(o.stepping for o in self.learners):
            st.joining = True  # starts at the others' next step boundary (_admit_joiners)
        else:
            st.active_since = t
            self._start_step(st, t)

    # --- syncer ---

    def _live(self) -> set[str]:
        return {st.name for st in self.learners if not st.down}

    def _arrive(self, payload: tuple[Contribution, float], t: float) -> None:
        contribution, sent_at = payload
        # A round's members (synchronous rules): learners live and on the schedule when its first
        # contribution was sent.
        members = [st.name for st in self.learners
                   if not st.down and not st.joining and st.active_since < sent_at + TIME_EPS]
        self._on_round(contribution.fragment, t, self.rounds.arrive(
            contribution, t, transfer_s=t - sent_at, members=members, live=self._live()))

    def _evaluate_round(self, p: int, t: float) -> None:
        self._on_round(p, t, self.rounds.evaluate(p, t, self._live()))

    def _on_round(self, p: int, t: float, outcome: RoundOutcome | None) -> None:
        if outcome is None:
            return
        if outcome.admission:  # a refusal or a capped claim: the daemon's rules bit here too
            self.merge_log.append(f"t={t:.2f} {outcome.admission}")
        if outcome.plan is not None:
            self._broadcast(p, t, outcome.plan)
        elif outcome.decision is not None and outcome.decision.wake_at is not None:
            self._push(outcome.decision.wake_at, _WAKE, p)

    def _broadcast(self, p: int, t: float, plan: CommitPlan) -> None:
        """A round was merged (or found nothing to merge): every learner hears of it."""
        merged = plan.merged
        rejected = merged.result.rejected if merged is not None else ()
        self.merge_log.append(f"t={t:.2f} {plan.reason}" + "".join(f"; {r}" for _, r in rejected))
        nbytes = 0  # nothing merged: waiting learners are released with the unchanged fragment
        if plan.proposes:
            assert merged is not None
            nbytes = len(merged.encoded)
            self.merges += 1
            if self.diagnostics is not None and merged.outer_gradient is not None:
                self.diagnostics.merged(p, merged.round, t, merged.contributors, merged.outer_gradient)
            if self._in_outage(t):
                self.merges_outage += 1
        down_s = self.config.link.transfer_s(nbytes)
        msg_round = self.global_state.round(p)
        contributors = frozenset(merged.contributors) if merged is not None else frozenset()
        params = self.global_state.fragment_params(p)
        for st in self.learners:
            msg = _MergeMsg(p, msg_round, params, nbytes, t + down_s, contributors)
            if st.down:
                st.missed.append(msg)
                continue
            self.bytes_down += nbytes  # broadcast to every live learner, also after the budget is spent
            if self.stop_time is not None:
                continue
            st.inbox.append(msg)
            self._push(msg.arrival, _DELIVER, st.index)


class _LocalFragment(Mapping):
    """A learner's local fragment for the apply rule, brought from the device on first access:
    the paper's overwrite rule never reads it, so a merge then moves nothing to the host."""

    def __init__(self, sync: _FragmentSync, learner: int, names: list[str]):
        self._sync, self._learner, self._names = sync, learner, names
        self._values: dict[str, np.ndarray] | None = None

    def _load(self) -> dict[str, np.ndarray]:
        if self._values is None:
            self._values = self._sync.stack.get_flat(self._learner, self._names)
            self._sync.fragment_bytes_due += sum(v.nbytes for v in self._values.values())
        return self._values

    def __getitem__(self, name: str) -> np.ndarray:
        return self._load()[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    """The syncer's decision on a round (None: the contribution was refused), what it merged when it
    merged (`plan`), and what admission said of the arriving contribution (a refusal or a capped
    claim; "" when it passed as sent)."""

    decision: RoundDecision | None
    plan: CommitPlan | None
    admission: str = ""


# The runner's learners are the run's learner members.
RUNNER_MEMBER = Member(LEARNER_ROLE)


class VirtualRounds:
    """The runner's side of every fragment round: the daemon's `Syncer` on the virtual clock, and a
    `Replica` that applies the commit payload a daemon's log would carry. It makes the calls
    `daemon/rounds.py`'s RoundDriver makes (admit, add, step_round, plan_commit, adopt) with the
    network and the replicated log taken out: the syncer holds the lease from `start` on."""

    def __init__(self, syncer: Syncer, replica: Replica, start: float = 0.0) -> None:
        self.syncer = syncer
        self.replica = replica
        self._next_index = 1
        syncer.lease_gained(replica.norm_refs, start)

    def arrive(self, contribution: Contribution, t: float, *, transfer_s: float, members: Collection[str],
               live: Collection[str]) -> RoundOutcome | None:
        ticket = self.syncer.admit(contribution.learner, contribution.fragment, member=RUNNER_MEMBER)
        if isinstance(ticket, Refused):
            return RoundOutcome(None, None, ticket.reason)
        capped = self.syncer.add(contribution, t, transfer_s=transfer_s, members=members, ticket=ticket)
        outcome = self.evaluate(contribution.fragment, t, live)
        if capped:
            return RoundOutcome(None if outcome is None else outcome.decision,
                                None if outcome is None else outcome.plan, capped)
        return outcome

    def evaluate(self, p: int, t: float, live: Collection[str]) -> RoundOutcome | None:
        step = self.syncer.step_round(p, t, live)
        if step is None:
            return None
        if step.taken is None:
            return RoundOutcome(step.decision, None)
        plan = self.syncer.plan_commit(step.taken, self.replica.state, None, wall_time=t)
        if plan.proposes:
            assert plan.merged is not None
            entry = LogEntry(1, self._next_index, EntryKind.OUTER_COMMIT, plan.payload, fragment=p,
                             round=plan.merged.round)
            self._next_index += 1
            outcome = self.replica.apply(entry)
            if not outcome.applied:
                raise RuntimeError(f"the runner's replica refused its own commit: {outcome.reason}")
        self.syncer.adopt(step.taken, plan, t)
        return RoundOutcome(step.decision, plan)


# ------------------------------------------------------------------------------------------------
# named scenarios (shared by the CLI and the parity benchmark)

SCENARIOS = ("uniform", "straggler", "outage")
STRAGGLER_SLOWDOWN = 2.5  # the straggler's step takes this many times longer


def scenario_settings(name: str, num_learners: int, steps: int, base_step_s: float = 1.0
                      ) -> tuple[tuple[float, ...], tuple[Outage, ...]]:
    """(speeds, outages) of a named scenario; the last learner is the odd one out.

    uniform: equal speeds. straggler: the last learner is 2.5x slower. outage: the last learner is
    down for the middle third of the nominal run (steps * base_step_s), on whole steps.
    """
    if name not in SCENARIOS:
        raise ValueError(f"scenario {name!r}: must be one of {', '.join(SCENARIOS)}")
    if name == "uniform" or num_learners < 2 and name == "straggler":
        return (), ()
    if name == "straggler":
        return tuple([1.0] * (num_learners - 1) + [1.0 / STRAGGLER_SLOWDOWN]), ()
    start = round(steps / 3) * base_step_s
    end = round(2 * steps / 3) * base_step_s
    return (), (Outage(num_learners - 1, start, end),)
