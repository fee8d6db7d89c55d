"""Megatron-core extensions for Pipeline RL trainers."""
