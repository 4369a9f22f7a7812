"""Simulation: many fellows on simulated networks, in virtual time."""
