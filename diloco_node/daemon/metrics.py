"""The daemon's own Prometheus series (beside those rendered from the status document, ops/status.py).

One prefix (`diloco_`), counters end in `_total`, cumulative seconds are `*_seconds_total`
counters, durations are histograms in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_node.ops.status import (
    ROUND_SECONDS_BUCKETS,
    STEP_SECONDS_BUCKETS,
    TRANSFER_SECONDS_BUCKETS,
    Counter,
    Gauge,
    Histogram,
    MetricsRegistry,
)


@dataclass(frozen=True, slots=True)
class DaemonSeries:
    commits_applied: Counter
    contributions_sent: Counter
    merges_proposed: Counter
    learner_compute_seconds: Counter
    learner_sync_seconds: Counter
    eval_loss: Gauge
    eval_commit_index: Gauge
    step_seconds: Histogram
    round_latency_seconds: Histogram
    transfer_seconds: Histogram

    @classmethod
    def register(cls, registry: MetricsRegistry) -> DaemonSeries:
        return cls(
            commits_applied=registry.counter("diloco_commits_applied_total", "Outer commits applied."),
            contributions_sent=registry.counter("diloco_contributions_sent_total", "Contributions sent."),
            merges_proposed=registry.counter("diloco_merges_proposed_total", "Merges proposed as lease holder."),
            learner_compute_seconds=registry.counter("diloco_learner_compute_seconds_total",
                                                     "Training thread: seconds in the jitted step."),
            learner_sync_seconds=registry.counter(
                "diloco_learner_sync_seconds_total",
                "Training thread: seconds applying committed fragments and computing due deltas."),
            # Labelled by set: "held_out" (the slice of the training data) or an eval set's name.
            eval_loss=registry.gauge("diloco_eval_loss",
                                     "The global model's loss on one of this site's held-out sets (last evaluation): "
                                     "set=\"held_out\" is the slice of its training data, else a [node.data.eval] set.",
                                     labels=("set",)),
            eval_commit_index=registry.gauge("diloco_eval_commit_index",
                                             "The commit index the last evaluation was taken at."),
            step_seconds=registry.histogram("diloco_learner_step_seconds", "Time of one inner step (the jitted step).",
                                            STEP_SECONDS_BUCKETS),
            round_latency_seconds=registry.histogram(
                "diloco_round_latency_seconds",
                "From sending a contribution to applying the commit of its fragment that includes it.",
                ROUND_SECONDS_BUCKETS),
            transfer_seconds=registry.histogram(
                "diloco_transfer_seconds",
                "Time of one transfer: a contribution sent to the lease holder, or the global state downloaded.",
                TRANSFER_SECONDS_BUCKETS, labels=("kind",)),
        )
