"""Train stage: one policy-gradient update of the LoRA adapter on a rollout batch (objective.py)."""
