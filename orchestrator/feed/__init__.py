"""The trainer feed: accepted rollouts in acceptance order, and their JSONL export."""
