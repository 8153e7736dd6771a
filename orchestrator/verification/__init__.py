"""Verification: nothing a worker claims is paid until the coordinator has checked it."""
