"""Rollout tasks: policy versions, task batches, replicas with seeds, leases and results."""
