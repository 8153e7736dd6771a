"""Coordination service for permissionless compute pools."""

__version__ = "0.1.0"
