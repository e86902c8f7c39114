"""Chaos engineering for diloco-node: seeded nemesis schedules, a process supervisor, an invariant
checker and run metrics over node histories, and the harness that composes them (docs/CHAOS.md)."""
