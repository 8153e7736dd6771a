"""Heartbeats and the liveness sweeper: healthy -> unhealthy -> dead."""
