"""Simulators on a virtual clock: the in-process multi-learner runner, the fleet goodput model and
the bandwidth calculator."""
