"""The learner: local AdamW training in ONE dedicated thread that never waits on the network.

The event loop talks to it only through thread-safe hand-offs:
- `offer_fragment(p, round, params, contributors)`: a newly committed global fragment; taken at the
  next step boundary (the newest round wins) by the run's apply rule (`sync/apply.py`), which
  needs to know whether any merge since the learner's base included its contribution;
- `request_state()`: a future filled at the next step boundary with a consistent copy of the
  learner's state (for checkpoints);
- `stop()`: finish the current step and exit.
The thread reports back through callbacks the node passes in (`on_contribution` when fragment
p is due, `on_progress` after each step); the node marshals them onto the loop. A progress report
that fails with `OSError` (a full disk under the history or the status files) is logged once per
streak and training goes on: only the learner's own failures stop the thread. The figures of
the latest closed step window (tokens/s, step time, gradient norm, learning rate: learn/figures.py)
are in `figures`, set before the `on_progress` of the step that closed the window.

On a device mesh (learn/mesh.py) merged fragments are placed with each parameter's own sharding
when they are offered, and installed at the boundary by one compiled update that donates the
fragment's old buffers. With the int4 uplink (learn/device_quantize.py) a due fragment never
crosses to the host as float32: one compiled program per fragment takes its delta against the base
(kept on the device, or placed from the host with `base_on_device=False`) and encodes it; the
thread starts the transfer of the codes and scales, hands them over and dispatches the next step
without waiting for them (whoever encodes the contribution reads them). Other codecs copy the
fragment on the devices and read it one step later, overlapped with the next step. On a multi-host site (`following`, learn/cluster.py) this same thread runs on every host:
process 0 decides at each boundary and every process does the same.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diloco_node.learn import data as data_lib
from diloco_node.learn.device_quantize import DEVICE_CODECS, EncodedTensor, delta_program
from diloco_node.learn.figures import FigureWindow, StepFigures
from diloco_node.learn.error_feedback import ErrorFeedback, codec_quantizer
from diloco_node.learn.handoffs import LearnerHandoffs
from diloco_node.sync.apply import ApplyRule, FragmentCounters, apply_merge
from diloco_node.sync.fragments import FragmentPlan
from diloco_node.learn.inner import InnerLearner
from diloco_node.learn.cluster import (APPLY_AFTER_READ, APPLY_NONE, APPLY_WRITE, BoundaryDecision,
                                        BoundaryFollowing, meet)
from diloco_node.learn.mesh import host_copies, host_view, place
from diloco_node.config.manifest import RunManifest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DueFragment:
    """What the learner hands over when fragment p's slot comes: δ = Θ_p(base) − θ_p and counters.
    With the int4 uplink each tensor of `delta` is an `EncodedTensor` (encoded on the device; it has
    a shape and reads as its decoded float32 values; the contribution stream frames its bytes
    as they are), otherwise a float32 array."""

    fragment: int
    base_round: int
    c_steps: int
    c_tokens: int
    delta: Mapping[str, Any]
    step: int


@dataclass(frozen=True, slots=True)
class LearnerSnapshot:
    step: int
    tokens: int
    params: dict[str, np.ndarray]
    opt_leaves: list[np.ndarray]
    base_rounds: list[int]
    c_steps: list[int]
    c_tokens: list[int]
    sampler: str = ""  # the batch sampler's position (data.BatchSampler.state); "" in older checkpoints
    # Error-feedback remainders by flat parameter name (learn/error_feedback.py); empty when the
    # run's uplink codec keeps none, and in older checkpoints.
    error_feedback: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Offer:
    """The newest committed version of a fragment, not yet taken by the training thread."""

    round: int
    params: dict[str, np.ndarray]
    on_device: dict[str, jax.Array]
    # (round, contributors) of every offer since the last boundary: whether this learner's work is
    # in the merge depends on every round after its base, not only the newest.
    contributors_by_round: tuple[tuple[int, frozenset[str]], ...]

    def contributors_after(self, base_round: int) -> frozenset[str]:
        return frozenset().union(*(c for r, c in self.contributors_by_round if r > base_round))


@dataclass(frozen=True, slots=True)
class _PendingRead:
    """A due fragment whose device copies are on their way to the host (taken one step later)."""

    fragment: int
    base_round: int
    c_steps: int
    c_tokens: int
    step: int
    base: dict[str, np.ndarray]
    copies: dict[str, jax.Array]


# One dispatch copies a whole fragment on the device (the next step donates the parameters, so
# the transfer to the host must read copies); compiled once per fragment, in `compile`.
_copy_fragment = jax.jit(lambda arrays: {name: jnp.copy(array) for name, array in arrays.items()})

# Host times per step kept for `host_ms_per_step` (about a minute of small steps).
HOST_TIMES_KEPT = 4096


def learner_index(node_id: str) -> int:
    """A stable per-site stream index for the batch sampler (different sites, different batches)."""
    return int.from_bytes(hashlib.sha256(node_id.encode()).digest()[:4], "little")


class LearnerThread(LearnerHandoffs[LearnerSnapshot]):
    def __init__(
        self,
        *,
        node_id: str,
        manifest: RunManifest,
        plan: FragmentPlan,
        corpus: data_lib.Corpus,
        global_params: Mapping[str, np.ndarray],
        global_rounds: list[int],
        on_contribution: Callable[[DueFragment], None],
        on_progress: Callable[[int, float, int], None],
        min_step_interval_s: float = 0.0,
        inner: InnerLearner | None = None,
        following: BoundaryFollowing | None = None,
        base_on_device: bool = True,
    ) -> None:
        super().__init__(f"learner-{node_id}")
        self.node_id = node_id  # the learner's name in commits' contributor lists
        self.plan = plan
        self.manifest = manifest
        if inner is None:
            inner = InnerLearner(manifest.model, manifest.learner_inner(), manifest.seed, global_params)
        else:  # built earlier by the node (its initial weights seeded the replica): take the state
            inner.set_flat(global_params)
        self._inner = inner
        # A multi-host site (learn/cluster.py): every process runs this thread on the same global
        # mesh; process 0's decides at each boundary and the others follow. None: one host.
        self._following = following
        # What process 0 hands the other processes when training starts (the state it was given).
        self._host_params = dict(global_params)
        self._host_opt: list[np.ndarray] | None = None
        self._last_snapshot: LearnerSnapshot | None = None
        self._leaf_index = _leaf_index(self._inner.params)
        if set(self._leaf_index) != set(global_params):
            raise RuntimeError("parameter leaf names do not match the model's flat names")
        # Every parameter's layout on the site's devices: a merged fragment is written back with
        # exactly its leaf's sharding, so the compiled step sees the same inputs (no recompile).
        shardings = self._inner.param_shardings
        self._shardings = {name: shardings[i] for name, i in self._leaf_index.items()}
        self._pending_reads: list[_PendingRead] = []
        self._sampler = data_lib.BatchSampler(corpus.train, manifest.inner.batch_size, manifest.model.seq_len,
                                              manifest.seed, learner_index(node_id))
        P = plan.num_fragments
        self.base_rounds = list(global_rounds)
        self._base_params = [{n: np.array(global_params[n], np.float32) for n in f.names} for f in plan.fragments]
        self.c_steps = [0] * P
        self.c_tokens = [0] * P
        self._on_contribution = on_contribution
        self._on_progress = on_progress
        self._min_step_interval_s = min_step_interval_s
        self._apply_rule = ApplyRule.from_sync_spec(manifest.sync)
        # What the uplink codec dropped from each fragment's sends, sent again with the next one
        # (None: the run's codec_up keeps no remainder).
        self._error_feedback: ErrorFeedback | None = None
        if manifest.sync.uses_error_feedback:
            self._error_feedback = ErrorFeedback(manifest.sync.error_feedback_decay,
                                                 codec_quantizer(manifest.sync.codec_up))
        # The due-fragment path: int4 encoded on the device (one program per fragment), or float32
        # read to the host (other codecs, error feedback, a multi-host site's gather).
        self._encode_on_device = (manifest.sync.codec_up in DEVICE_CODECS and following is None
                                  and self._error_feedback is None)
        self._delta_programs = [delta_program(f.names) for f in plan.fragments] if self._encode_on_device else []
        # The base each delta is taken against, on the devices: 4 bytes per parameter of device
        # memory (one float32 copy of the model). `base_on_device=False` (tight devices) places
        # the host base at each due fragment instead (one host-to-device copy of the fragment).
        self._base_on_device = base_on_device and self._encode_on_device
        self._device_base: list[dict[str, jax.Array]] = []
        self._place_device_base(global_params)
        # Bytes handed from the device to the host for due fragments, and their float32 size.
        self.due_transfer_bytes = 0
        self.due_fp32_bytes = 0
        self._offers: dict[int, _Offer] = {}
        self.stopped_at_step: int | None = None
        self.error: BaseException | None = None
        self._progress_failing = False  # the last progress report failed with an OSError
        self.last_step_at = time.monotonic()
        self.step_seconds = 0.0
        # Where the training thread's time goes (cumulative, written only by this thread): the
        # jitted step itself vs the sync work it does at boundaries (applying committed fragments,
        # computing due deltas, checkpoint copies). Pacing sleeps are in neither.
        self.compute_seconds_total = 0.0
        self.sync_seconds_total = 0.0
        # The thread's own host time of each step (everything but waiting on the device and
        # pacing), the critical path on an accelerator; the latest HOST_TIMES_KEPT, in seconds.
        self.host_seconds: collections.deque[float] = collections.deque(maxlen=HOST_TIMES_KEPT)
        # The same steps' CPU time of this thread (`time.thread_time`): on a loaded machine the
        # wall time above also counts the time the thread was runnable but not running.
        self.host_cpu_seconds: collections.deque[float] = collections.deque(maxlen=HOST_TIMES_KEPT)
        # The latest closed window's figures (None until the first window closes); replaced whole.
        self.figures: StepFigures | None = None
        self._window = FigureWindow()

    # ---- set-up -----------------------------------------------------------------------------

    def compile(self) -> float:
        """Compile the jitted step (the node reports ready only after this); returns seconds."""
        started = time.perf_counter()
        # A throw-away batch of the right shape: drawing from the sampler would move it past a
        # batch the learner never trains on (and off a restored position).
        zeros = np.zeros((self._sampler.batch_size, self._sampler.seq_len), np.int32)
        # A multi-host site's processes compile at their own speeds, then run the step's first
        # collectives together (learn/cluster.py `meet`).
        self._inner.compile_step(zeros, zeros, None if self._following is None else lambda: meet("compiled"))
        for p, fragment in enumerate(self.plan.fragments if self._following is None else ()):
            # the due fragments' programs (device encoding, or device copies), compiled now too
            leaves = self._fragment_leaves(fragment.names)
            if self._encode_on_device:
                jax.block_until_ready(self._delta_programs[p](self._delta_base(p), leaves))
            else:
                jax.block_until_ready(_copy_fragment(leaves))
            # the merged fragment's write: the current values written back (copies, as the write
            # donates what it overwrites)
            self._write_params(_copy_fragment(self._fragment_leaves(fragment.names)))
        return time.perf_counter() - started

    def _place_device_base(self, values: Mapping[str, np.ndarray]) -> None:
        if self._base_on_device:
            self._device_base = [{n: place(np.asarray(values[n], np.float32), self._shardings[n]) for n in f.names}
                                 for f in self.plan.fragments]

    def _delta_base(self, p: int) -> Mapping[str, Any]:
        return self._device_base[p] if self._base_on_device else self._base_params[p]

    def restore(self, snap: LearnerSnapshot) -> None:
        """Resume a checkpointed learner (before `start`): weights, AdamW state, step and tokens."""
        inner = self._inner
        inner.set_flat(snap.params)
        inner.put_opt_leaves(snap.opt_leaves)
        self._host_params, self._host_opt = dict(snap.params), list(snap.opt_leaves)
        inner.steps = snap.step
        inner.tokens = snap.tokens
        # The base stays the current global state: the next delta also carries what the run
        # moved since this learner's checkpoint (a rebase), and the counters keep its work.
        self.c_steps = list(snap.c_steps)
        self.c_tokens = list(snap.c_tokens)
        if self._error_feedback is not None:
            self._error_feedback.load(snap.error_feedback, dict(enumerate(f.names for f in self.plan.fragments)))
        if snap.sampler:
            try:
                self._sampler.restore(snap.sampler)
            except data_lib.DataError as error:  # the site's data changed: train on, from the seed
                log.warning("%s: not resuming the batch sampler: %s; sampling from the start", self.node_id, error)

    def adopt_global(self, global_params: Mapping[str, np.ndarray], global_rounds: list[int]) -> None:
        """A fresh learner (before `start`) takes the current global state as its weights and base."""
        self._inner.set_flat(global_params)
        self._host_params = dict(global_params)
        self.base_rounds = list(global_rounds)
        self._base_params = [{n: np.array(global_params[n], np.float32) for n in f.names}
                             for f in self.plan.fragments]
        self._place_device_base(global_params)
        self.c_steps = [0] * self.plan.num_fragments
        self.c_tokens = [0] * self.plan.num_fragments
        if self._error_feedback is not None:  # a state installed, not followed from our sends
            self._error_feedback.reset()

    # ---- thread-safe hand-offs ----------------------------------------------------------------

    def offer_fragment(self, p: int, round_: int, params: dict[str, np.ndarray],
                       contributors: Collection[str] = ()) -> None:
        """A committed version of fragment p; `contributors`: whose contributions its merge accepted
        (empty for a state that was downloaded or repaired rather than merged)."""
        # Device copies are made here, on the caller's thread, not at the training thread's
        # boundary, each with its parameter's own sharding (so writing them never recompiles).
        # On a multi-host site every process places its own shards at the boundary instead.
        on_device = {} if self._following is not None else {
            n: place(np.asarray(v, dtype=np.float32), self._shardings[n]) for n, v in params.items()}
        with self._lock:
            current = self._offers.get(p)
            if current is None or current.round < round_:
                earlier = current.contributors_by_round if current is not None else ()
                self._offers[p] = _Offer(round_, params, on_device, earlier + ((round_, frozenset(contributors)),))

    @property
    def steps(self) -> int:
        return self._inner.steps

    @property
    def tokens(self) -> int:
        return self._inner.tokens

    # ---- the loop -----------------------------------------------------------------------------

    def run(self) -> None:
        previous_loss = None
        try:
            self._go.wait()
            if self._following is not None:
                self._cluster_start()
            self._window.begin(time.perf_counter())
            while True:
                started, cpu_started = time.perf_counter(), time.thread_time()
                if self._following is not None:
                    if self._cluster_boundary():
                        break
                elif self._stop_requested.is_set():
                    break
                else:
                    self._boundary()
                computing = time.perf_counter()
                x, y = self._sampler.next()
                # The previous step's gradient norm: done once its loss is fetched below, so
                # reading it at a window's end never waits on the step being dispatched now.
                done_grad_norm, done_step = self._inner.last_grad_norm, self._inner.steps
                # The step is dispatched, not awaited: the loss fetched is the previous step's
                # (long done), so the host samples the next batch while the device computes this
                # one. Progress reports run one step behind in their loss, never in their counts.
                loss_now = self._inner.step(x, y)
                # Due fragments read at the previous boundary: their copies reached the host
                # while this step was being dispatched and computed.
                self._finish_reads()
                # The one wait of the loop, on the older of two steps in flight (the device holds
                # the one it computes and the next, already dispatched): the host's work of a
                # boundary (sampling, reports, hand-offs) overlaps the newer step.
                waiting = time.perf_counter()
                loss = _scalar(previous_loss if previous_loss is not None else loss_now)
                waited = time.perf_counter() - waiting
                previous_loss = loss_now
                tokens = int(np.size(y))
                for p in range(self.plan.num_fragments):
                    self.c_steps[p] += 1
                    self.c_tokens[p] += tokens
                computed = time.perf_counter()
                self.step_seconds = computed - computing
                self.compute_seconds_total += computed - computing
                self.last_step_at = time.monotonic()
                figures = self._window.step(
                    self._inner.steps, tokens, time.perf_counter(),
                    lambda: (None, 0) if done_grad_norm is None else (_scalar(done_grad_norm), done_step),
                    self._inner.learning_rate)
                if figures is not None:
                    self.figures = figures
                self._report_progress(loss)
                for p in self.plan.due(self._inner.steps):
                    if self._following is not None:
                        self._gather_due(p)
                    else:
                        self._start_read(p)
                finished = time.perf_counter()
                self.sync_seconds_total += (computing - started) + (finished - computed)
                self.host_seconds.append(finished - started - waited)
                self.host_cpu_seconds.append(time.thread_time() - cpu_started)
                if self._min_step_interval_s > 0:
                    rest = self._min_step_interval_s - (time.perf_counter() - started)
                    if rest > 0:
                        self._stop_requested.wait(rest)
            if self._following is None:
                self._finish_reads()
                self._boundary()
        except BaseException as error:  # reported on /status and /livez by the node
            self.error = error
            log.exception("learner thread failed")
        finally:
            self.stopped_at_step = self._inner.steps
            self._answer_state_requests()

    def _report_progress(self, loss: float) -> None:
        """`on_progress`, where a disk that refuses a report's write is no reason to stop training."""
        try:
            self._on_progress(self._inner.steps, loss, self._inner.tokens)
        except OSError as error:
            if not self._progress_failing:
                log.warning("learner %s: a progress report failed (%s); training goes on without it",
                            self.node_id, error)
            self._progress_failing = True
        else:
            if self._progress_failing:
                log.warning("learner %s: progress reports work again", self.node_id)
            self._progress_failing = False

    def _boundary(self) -> None:
        self.take_offers()
        self._answer_state_requests()

    def take_offers(self) -> None:
        """Apply the fragments offered since the last step boundary, by the run's apply rule. The
        training thread calls this at every boundary; call it directly only while it is not running."""
        with self._lock:
            offers, self._offers = self._offers, {}
        taken = {p: offer for p, offer in offers.items() if offer.round > self.base_rounds[p]}
        if taken:
            rule = self._apply_rule
            # Fast path (overwrite, the common case): one compiled write of the device copies made
            # when the fragments were offered into the parameters (it copies them: the device base
            # keeps the offered arrays). Anything else (mix, or a merge without our unsent work)
            # goes through the apply rule on host copies.
            incoming: dict[str, Any] = {}
            for p, offer in taken.items():
                counters = FragmentCounters(self.c_steps[p], self.c_tokens[p])
                contributors = offer.contributors_after(self.base_rounds[p])
                keeps_local = rule.keep_unmerged and self.node_id not in contributors and counters.c_steps > 0
                if rule.mode == "overwrite" and not keeps_local:
                    incoming.update(offer.on_device)
                    counters = FragmentCounters()
                else:
                    local = self._read_params(offer.params)
                    new, counters = apply_merge(local, self._base_params[p], offer.params, contributors, counters,
                                                learner=self.node_id, rule=rule)
                    incoming.update(new)
                self.base_rounds[p] = offer.round
                self._base_params[p] = offer.params
                if self._base_on_device:  # the offer's placed arrays, never donated (writes copy them)
                    self._device_base[p] = offer.on_device
                self.c_steps[p], self.c_tokens[p] = counters.c_steps, counters.c_tokens
                self._reset_if_installed(p, offer)
            self._write_params(incoming)

    def _reset_if_installed(self, p: int, offer: _Offer) -> None:
        """A fragment downloaded or repaired (an offer with no contributors) replaces the weights
        our sends followed: the remainder of fragment p no longer belongs to them."""
        if self._error_feedback is not None and any(not c for _, c in offer.contributors_by_round):
            self._error_feedback.reset(p)

    def _contribution(self, p: int, base_round: int, c_steps: int, c_tokens: int, delta: dict[str, np.ndarray],
                      step: int) -> DueFragment:
        """The hand-off of a due fragment: its delta, compensated by error feedback when the codec uses it."""
        if self._error_feedback is not None:
            delta = self._error_feedback.compensate(p, delta)
        return DueFragment(p, base_round, c_steps, c_tokens, delta, step)

    def _fragment_leaves(self, names: Iterable[str]) -> dict[str, jax.Array]:
        """The named parameters as device arrays (`InnerLearner.read_params`: the next step donates
        a leaf that is not packed, so read them before it or copy them)."""
        names = list(names)
        return dict(zip(names, self._inner.read_params([self._leaf_index[n] for n in names])))

    def _read_params(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """Host copies of the named local tensors (only those: a due fragment needs its own)."""
        return host_copies(self._fragment_leaves(names))

    def _write_params(self, flat: Mapping[str, Any]) -> None:
        """Write tensors into the parameters, each with its leaf's own sharding (a host value is
        placed, a device value already placed by `offer_fragment` is taken as it is), by one
        compiled write that copies them in (the values stay the caller's)."""
        values = {}
        for name, value in flat.items():
            i = self._leaf_index[name]
            sharding = self._shardings[name]
            if not (isinstance(value, jax.Array) and value.sharding == sharding):
                value = place(np.asarray(value, dtype=np.float32), sharding)
            values[i] = value
        self._inner.write_params(values)

    def _start_read(self, p: int) -> None:
        """Fragment p is due: copy its tensors on the device (one dispatch, queued behind the step
        just dispatched) and start their transfer to the host. The delta is computed at the next
        boundary, after the next step is dispatched, so the device never waits for the host."""
        if self.c_steps[p] == 0:
            return
        if self._encode_on_device:
            self._encode_due(p)
            return
        copies = _copy_fragment(self._fragment_leaves(self.plan.fragments[p].names))
        for array in copies.values():
            array.copy_to_host_async()
        # Base and counters as of this step: an offer taken before the read finishes replaces
        # `_base_params[p]` (a new dict), it never edits the one held here.
        self._pending_reads.append(_PendingRead(p, self.base_rounds[p], self.c_steps[p], self.c_tokens[p],
                                                self._inner.steps, self._base_params[p], copies))

    def _encode_due(self, p: int) -> None:
        """Fragment p is due and the uplink is int4: its delta and encoding are one program queued
        behind the step just dispatched; the codes and scales start for the host and are handed
        over at once (`EncodedTensor`: read by the codec pool, never waited for here)."""
        leaves = self._fragment_leaves(self.plan.fragments[p].names)
        encoded = self._delta_programs[p](self._delta_base(p), leaves)
        delta = {}
        for name, parts in encoded.items():
            for array in parts:
                array.copy_to_host_async()
            delta[name] = tensor = EncodedTensor(name, leaves[name].shape, *parts)
            self.due_transfer_bytes += tensor.transfer_bytes
            self.due_fp32_bytes += 4 * tensor.size
        self._on_contribution(DueFragment(p, self.base_rounds[p], self.c_steps[p], self.c_tokens[p], delta,
                                          self._inner.steps))

    def _finish_reads(self) -> None:
        reads, self._pending_reads = self._pending_reads, []
        for read in reads:
            # One pass over the fragment: the device copies' host values are read where the
            # transfer left them (no second copy), and the float32 difference is the only new
            # array. On an accelerator this thread's host work must fit in one step's device time,
            # or the device idles; the three passes this replaced (copy, subtract, cast) were the
            # largest part of it (on the CPU, 112-160 ms against 70 ms for a 150 MB fragment).
            delta = {n: np.subtract(read.base[n], host_view(array), dtype=np.float32)
                     for n, array in read.copies.items()}
            self._on_contribution(self._contribution(read.fragment, read.base_round, read.c_steps, read.c_tokens,
                                                     delta, read.step))

    def _answer_state_requests(self, snap: LearnerSnapshot | None = None) -> None:
        requests = self._take_state_requests()
        if not requests:
            return
        if snap is None and self._following is not None:
            # A multi-host site's state is read by all its processes together, at a boundary:
            # after the thread ends, the copy its last boundary gathered is the state.
            snap = self._last_snapshot
            if snap is None:
                for future in requests:
                    if not future.done():
                        future.set_exception(RuntimeError("the learner of a multi-host site has no state to "
                                                          "copy before it has started"))
                return
        if snap is None:
            snap = LearnerSnapshot(
                step=self._inner.steps, tokens=self._inner.tokens, params=self._inner.get_flat(),
                opt_leaves=[np.asarray(leaf) for leaf in self._inner.opt_leaves],
                base_rounds=list(self.base_rounds), c_steps=list(self.c_steps), c_tokens=list(self.c_tokens),
                sampler=self._sampler.state(), error_feedback=self._error_feedback_state())
        self._resolve(requests, snap)

    def _error_feedback_state(self) -> dict[str, np.ndarray]:
        if self._error_feedback is None:
            return {}
        return {name: a.copy() for name, a in self._error_feedback.state().items()}

    # ---- a multi-host site: every process at every boundary (learn/cluster.py) --------------

    def _cluster_start(self) -> None:
        """Every process takes process 0's starting state: weights, AdamW state when it was
        restored, step and token counts, and the sampler's position (so all sample one batch)."""
        following = self._following
        assert following is not None
        leaves = self._inner.param_leaves
        leader = following.leader
        meet("training")  # the followers begin at once, process 0 when the node is ready
        header = following.share(
            {"h": np.array([self._host_opt is not None, self._inner.steps, self._inner.tokens], np.int64)}
            if leader else None, {"h": ((3,), np.int64)})["h"]
        params = following.share(self._host_params if leader else None,
                                 {n: (tuple(leaves[i].shape), np.float32) for n, i in self._leaf_index.items()})
        self._inner.set_flat(params)
        if header[0]:
            template = [(tuple(leaf.shape), leaf.dtype) for leaf in self._inner.opt_leaves]
            self._inner.put_opt_leaves(following.share_list(self._host_opt if leader else None, template))
        self._inner.steps, self._inner.tokens = int(header[1]), int(header[2])
        sampler = following.share_text(self._sampler.state() if leader else None)
        if not leader:
            self._sampler.restore(sampler)

    def _cluster_boundary(self) -> bool:
        """Process 0 decides what this boundary does, every process does it; returns stop."""
        following = self._following
        assert following is not None
        decision, taken = None, {}
        if following.leader:
            with self._lock:
                offers, self._offers = self._offers, {}
                snapshot = bool(self._state_requests)
            taken = {p: offer for p, offer in offers.items() if offer.round > self.base_rounds[p]}
            apply = [APPLY_NONE] * self.plan.num_fragments
            rule = self._apply_rule
            for p, offer in taken.items():
                keeps_local = (rule.keep_unmerged and self.node_id not in offer.contributors_after(self.base_rounds[p])
                               and self.c_steps[p] > 0)
                apply[p] = APPLY_WRITE if rule.mode == "overwrite" and not keeps_local else APPLY_AFTER_READ
            stop = self._stop_requested.is_set()
            # The last boundary also copies the state: the checkpoint at shutdown reads it.
            decision = BoundaryDecision(stop=stop, snapshot=snapshot or stop, apply=tuple(apply))
        decision = following.decide(decision)
        for p, action in enumerate(decision.apply):
            if action == APPLY_NONE:
                continue
            names = self.plan.fragments[p].names
            local = following.gather(self._fragment_leaves(names)) if action == APPLY_AFTER_READ else None
            values = None
            if following.leader:
                offer = taken[p]
                if action == APPLY_WRITE:
                    values, counters = offer.params, FragmentCounters()
                else:
                    counters = FragmentCounters(self.c_steps[p], self.c_tokens[p])
                    values, counters = apply_merge(local, self._base_params[p], offer.params,
                                                   offer.contributors_after(self.base_rounds[p]), counters,
                                                   learner=self.node_id, rule=self._apply_rule)
                self.base_rounds[p] = offer.round
                self._base_params[p] = offer.params
                self.c_steps[p], self.c_tokens[p] = counters.c_steps, counters.c_tokens
                self._reset_if_installed(p, offer)
            leaves = self._fragment_leaves(names)
            self._write_params(following.share(values, {n: (tuple(leaves[n].shape), np.float32) for n in names}))
        if decision.snapshot:
            snap = self._gathered_snapshot()
            self._last_snapshot = snap
            if following.leader:
                self._answer_state_requests(snap)
        return decision.stop

    def _gathered_snapshot(self) -> LearnerSnapshot:
        following = self._following
        assert following is not None
        params = following.gather(self._fragment_leaves(self._leaf_index))
        opt = following.gather({f"{i:05d}": leaf for i, leaf in enumerate(self._inner.opt_leaves)})
        return LearnerSnapshot(step=self._inner.steps, tokens=self._inner.tokens, params=params,
                               opt_leaves=[opt[k] for k in sorted(opt)], base_rounds=list(self.base_rounds),
                               c_steps=list(self.c_steps), c_tokens=list(self.c_tokens), sampler=self._sampler.state(),
                               error_feedback=self._error_feedback_state())

    def _gather_due(self, p: int) -> None:
        """Fragment p is due on a multi-host site: every process gathers it (a collective, so not
        overlapped with the next step), process 0 sends its delta."""
        following = self._following
        assert following is not None
        local = following.gather(self._fragment_leaves(self.plan.fragments[p].names))
        if following.leader and self.c_steps[p] > 0:
            delta = {n: (self._base_params[p][n] - local[n]).astype(np.float32) for n in local}
            self._on_contribution(self._contribution(p, self.base_rounds[p], self.c_steps[p], self.c_tokens[p], delta,
                                                     self._inner.steps))


def _scalar(value: Any) -> float:
    """A replicated device scalar as a float (on a multi-host site, from this process's copy)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return float(np.asarray(value.addressable_data(0)))
    return float(value)


def _leaf_index(params: Any) -> dict[str, int]:
    """Parameter name ("blocks/0/attn/out/kernel", as `model.flat_params` names them) -> leaf position."""
    named, _ = jax.tree_util.tree_flatten_with_path(params)
    index = {}
    for i, (path, _) in enumerate(named):
        keys = [k for k in path if not isinstance(k, jax.tree_util.GetAttrKey)]  # the Variable's `.value`
        index["/".join(str(k.key if hasattr(k, "key") else k.idx) for k in keys)] = i
    return index


def snapshot_meta_and_arrays(snap: LearnerSnapshot) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta = {"step": snap.step, "tokens": snap.tokens, "base_rounds": snap.base_rounds,
            "c_steps": snap.c_steps, "c_tokens": snap.c_tokens, "opt_leaves": len(snap.opt_leaves),
            "sampler": snap.sampler}
    arrays = {f"learner/params/{n}": a for n, a in snap.params.items()}
    arrays.update({f"learner/opt/{i:05d}": np.asarray(a) for i, a in enumerate(snap.opt_leaves)})
    arrays.update({f"learner/error_feedback/{n}": a for n, a in snap.error_feedback.items()})
    return meta, arrays


def snapshot_from_checkpoint(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> LearnerSnapshot:
    prefix = "learner/params/"
    params = {k[len(prefix):]: np.array(v) for k, v in arrays.items() if k.startswith(prefix)}
    leaves = [np.array(arrays[f"learner/opt/{i:05d}"]) for i in range(int(meta["opt_leaves"]))]
    ef_prefix = "learner/error_feedback/"
    remainders = {k[len(ef_prefix):]: np.array(v, np.float32) for k, v in arrays.items() if k.startswith(ef_prefix)}
    return LearnerSnapshot(int(meta["step"]), int(meta["tokens"]), params, leaves, list(meta["base_rounds"]),
                           list(meta["c_steps"]), list(meta["c_tokens"]), str(meta.get("sampler", "")), remainders)
