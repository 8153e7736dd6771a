"""The double-entry, append-only ledger: the one home of money (stake and rewards)."""
