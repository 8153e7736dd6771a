"""Providers and their nodes: registration, identity and the node registry."""
