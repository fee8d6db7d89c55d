"""Code that runs in vLLM worker processes: in-place writes into LoRA slots."""
