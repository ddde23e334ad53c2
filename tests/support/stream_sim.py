"""The simulated slots of the stream tests: bench/fleet_sim.py's (the fleet benchmark runs the same ones)."""

from __future__ import annotations

from bench.fleet_sim import SimulatedSlot, canonical_state, run_writers, slot_owner

__all__ = ["SimulatedSlot", "canonical_state", "run_writers", "slot_owner"]
