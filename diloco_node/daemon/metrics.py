"""The daemon's own Prometheus series (beside those rendered from the status document, ops/status.py)."""

from __future__ import annotations

from dataclasses import dataclass

from diloco_node.ops.status import Counter, Gauge, MetricsRegistry


@dataclass(frozen=True, slots=True)
class DaemonSeries:
    commits_applied: Counter
    contributions_sent: Counter
    merges_proposed: Counter
    learner_compute_seconds: Gauge
    learner_sync_seconds: Gauge
    eval_loss: Gauge
    eval_commit_index: Gauge

    @classmethod
    def register(cls, registry: MetricsRegistry) -> DaemonSeries:
        return cls(
            commits_applied=registry.counter("diloco_daemon_commits_applied_total", "outer commits applied"),
            contributions_sent=registry.counter("diloco_daemon_contributions_sent_total", "contributions sent"),
            merges_proposed=registry.counter("diloco_daemon_merges_proposed_total",
                                             "merges proposed as lease holder"),
            learner_compute_seconds=registry.gauge("diloco_daemon_learner_compute_seconds",
                                                   "training thread: seconds in the jitted step (cumulative)"),
            learner_sync_seconds=registry.gauge(
                "diloco_daemon_learner_sync_seconds",
                "training thread: seconds applying committed fragments and computing due deltas (cumulative)"),
            eval_loss=registry.gauge("diloco_daemon_eval_loss",
                                     "the global model's loss on this site's eval split (last evaluation)"),
            eval_commit_index=registry.gauge("diloco_daemon_eval_commit_index",
                                             "the commit index the last evaluation was taken at"),
        )
