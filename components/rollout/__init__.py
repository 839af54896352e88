"""Rollout stage: vLLM generates from the NVFP4 base with this iteration's LoRA and AQN."""
