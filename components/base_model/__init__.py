"""Base model stage: publish the bf16 HF checkpoint that the run starts from."""
