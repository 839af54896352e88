"""Quantize stage: bf16 HF checkpoint → NVFP4A16 compressed-tensors checkpoint."""
