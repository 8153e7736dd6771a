"""Heartbeats, the liveness sweeper (healthy -> unhealthy -> dead) and its reconciler."""
