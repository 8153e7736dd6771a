"""Pools: what operators run and nodes join (requirements, admission, caps, economics)."""
