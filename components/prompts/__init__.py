"""Prompts stage: build chat-templated prompt shards with gold answers and a train/eval split."""
