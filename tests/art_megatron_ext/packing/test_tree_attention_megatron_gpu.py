"""Tree attention through FlexAttention inside a Megatron-core GPTModel, on CUDA (`gpu`).

A local-spec GPT with `TreeCoreAttention` (RoPE at trajectory positions, GQA, fp32, TF32 off)
runs packed prefix-tree rows with the "flex" backend (compiled FlexAttention with the plan's
`BlockMask`); the reference is the dense masked path: the same trajectories one by one through
Megatron's own `DotProductAttention` with a causal mask (what the tree mask means for each
trajectory, at its own positions). The policy-gradient surrogate loss and every parameter
gradient must agree.

Needs megatron-core (carried to the GPU machine, `bench/gpu_check_unpack.py`); no Transformer
Engine, no CPU shim. CPU twin: test_tree_attention_megatron.py (the same comparison with the
tiled kernel on CPU, at 2 x 4096 tokens) and test_flex_tree_attention.py (the FlexAttention
path alone, with its own CUDA test).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from .builders import VOCAB, make_multi_turn_group, make_single_turn_group

_HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and _HAVE_MEGATRON),
        reason="needs a CUDA GPU and megatron-core (on the GPU machine from the carry); CPU "
        "twin: test_tree_attention_megatron.py",
    ),
]

SEQ = 512
GRAD_TOLERANCE = 1e-3  # relative to the largest gradient entry (fp32, sums over ~1k tokens)
LOSS_TOLERANCE = 1e-4  # relative


@pytest.fixture(scope="module")
def cuda_world():
    from support.cuda_world import nccl_world_of_one

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with nccl_world_of_one("art_tree_flex_"):
        yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _groups():
    """About a thousand unique tokens: shared prompts with 3-5 rollouts each, and chats."""
    rng = np.random.default_rng(3)
    groups = [
        make_single_turn_group(
            rng,
            prompt_len=int(rng.integers(20, 80)),
            completion_lens=tuple(int(n) for n in rng.integers(10, 90, rng.integers(3, 6))),
        )
        for _ in range(4)
    ]
    return groups + [make_multi_turn_group(rng, turns=3) for _ in range(2)]


def _build(spec):
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    shape = GptShape(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=SEQ,
    )  # fmt: skip
    torch.manual_seed(0)
    return build_gpt(shape, layer_spec=spec, max_sequence_length=SEQ)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def tree_vs_dense(device: str, backend: str) -> dict:
    """Packed tree loss and grads (`backend`) vs the trajectories one by one, on `device`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from art_megatron_ext.packing import (
        PackingConfig,
        TreeAttentionConfig,
        TreePackedSeqParams,
        enable_tree_attention,
        pack_groups,
        predecessor_logprobs,
        tree_layer_spec,
    )

    local = get_gpt_layer_local_spec(normalization="RMSNorm")
    tree_model = enable_tree_attention(_build(tree_layer_spec(local))).to(device)
    plain_model = _build(local).to(device)
    plain_model.load_state_dict(tree_model.state_dict(), strict=True)

    groups = _groups()
    batch = pack_groups(groups, PackingConfig(seq_len=SEQ, vocab_size=VOCAB))
    on = lambda t: torch.as_tensor(t).to(device)  # noqa: E731
    params = TreePackedSeqParams.from_batch(
        batch, device=device, attention=TreeAttentionConfig(block=64, chunk_keys=256,
                                                            backend=backend),
    )  # fmt: skip
    logits = tree_model(on(batch.tokens), on(batch.input_pos), None, packed_seq_params=params)
    logp = predecessor_logprobs(
        logits, on(batch.tokens), on(batch.predecessor), on(batch.assistant_mask)
    )
    packed_loss = (logp * on(batch.weights * batch.advantages)).sum()
    packed_loss.backward()
    out = {"rows": batch.stats.rows, "block_mask": params.block_mask is not None}
    out["packed_loss"], packed = float(packed_loss), _grads(tree_model)

    expected = 0.0
    for group in groups:
        for t in group.trajectories:
            n = len(t.tokens)
            ids = on(t.tokens)[None]
            causal_blocked = ~torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]
            logits = plain_model(ids, torch.arange(n, device=device)[None], causal_blocked)[0]
            logp = logits[:-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            trained = on(t.assistant_mask[1:])
            w = on(np.broadcast_to(t.weight * t.advantage, (n,))[1:].copy()).float()
            part = (logp * trained * w).sum()
            part.backward()
            expected += float(part)
    alone = _grads(plain_model)
    assert packed.keys() == alone.keys()
    biggest = max(float(g.abs().max()) for g in alone.values())
    out["alone_loss"] = expected
    out["grad_error"] = max(float((packed[n] - alone[n]).abs().max()) for n in alone) / biggest
    return out


def test_megatron_tree_attention_on_flex_equals_the_dense_masked_reference(cuda_world):
    got = tree_vs_dense("cuda", "flex")
    assert got["block_mask"], "the flex backend was not used (no BlockMask was built)"
    assert got["rows"] >= 2
    scale = max(abs(got["alone_loss"]), 1.0)
    assert abs(got["packed_loss"] - got["alone_loss"]) <= LOSS_TOLERANCE * scale, got
    assert got["grad_error"] <= GRAD_TOLERANCE, got
