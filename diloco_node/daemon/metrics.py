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
        )
