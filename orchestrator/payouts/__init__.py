"""Withdrawals of claimable rewards and the payout records admins settle off-chain."""
