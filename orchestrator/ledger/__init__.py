"""The double-entry, append-only ledger: the one home of money (stake and rewards)."""

#: An ``Idempotency-Key`` (withdrawals, deposits, payout runs): 8 to 100 of these characters.
IDEMPOTENCY_KEY_PATTERN = r"^[A-Za-z0-9._:-]+$"
IDEMPOTENCY_KEY_CHARS = "letters, digits, '.', '_', ':' and '-'"
