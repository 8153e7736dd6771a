"""The append-only audit log of operator and admin actions."""
