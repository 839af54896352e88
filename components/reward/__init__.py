"""Reward stage: score rollout shards with built-in or user-supplied rewards."""
