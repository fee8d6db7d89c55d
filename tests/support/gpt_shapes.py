"""The tiny GPT shapes the LoRA tests build (`GptShape(**shape)`), named once.

Not collected by pytest. TINY: the LoRA tests' default (wide enough for TP=2 and padding).
SMALL: narrower and four layers deep, so a pipeline of 2 or 4 stages has a layer per stage.
"""

from __future__ import annotations

TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=256,
)
SMALL = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=64,
)
