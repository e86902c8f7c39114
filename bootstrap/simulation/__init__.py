"""Deterministic simulation of coordination nodes (virtual clock, faulty network) and its invariant checker."""

from bootstrap.simulation.checker import InvariantChecker
from bootstrap.simulation.harness import FAULT_WEIGHTS, SimConfig, SimResult, Simulation, run_seed

__all__ = ["FAULT_WEIGHTS", "InvariantChecker", "SimConfig", "SimResult", "Simulation", "run_seed"]
