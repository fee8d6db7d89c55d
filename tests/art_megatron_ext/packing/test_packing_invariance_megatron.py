"""Packing invariance on Megatron-core's GPTModel (local spec, fp32, CPU): per-token logprobs
from the packed rows, with the derived attention mask (`attention_mask` True = blocked),
`position_ids = input_pos` and logits read at `predecessor`, equal each trajectory run alone.

One spawned single-rank gloo process runs every case (Megatron needs its parallel state).
"""

import contextlib
import types

import numpy as np
import pytest
import torch
from support.train_ranks import run_ranks

from art_megatron_ext.packing import PackingConfig, pack_groups, tree_attention_mask

from .builders import VOCAB, make_multi_turn_group, make_single_turn_group


def _gpt_worker(rank: int, world_size: int, cases: dict) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from support.megatron_cpu import cpu_shim, megatron_parallel

    # Attention dropout forks the CUDA RNG tracker even at p=0; there is no CUDA RNG here.
    no_tracker = types.SimpleNamespace(fork=lambda *a, **k: contextlib.nullcontext())
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: no_tracker
    results = {}
    with cpu_shim(), megatron_parallel():
        config = TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        torch.manual_seed(0)
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=VOCAB,
            max_sequence_length=128,
            position_embedding_type="learned_absolute",
        ).eval()

        def logprobs(tokens, positions, blocked):
            return torch.log_softmax(model(tokens, positions, blocked[:, None]), dim=-1)

        with torch.no_grad():
            for name, (groups, seq_len) in cases.items():
                packed = pack_groups(groups, PackingConfig(seq_len=seq_len, vocab_size=VOCAB))
                tree = tree_attention_mask(packed.subtree_end)
                causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril().expand_as(tree)
                for mask_name, allowed in (("tree", tree), ("plain_causal", causal)):
                    logp = logprobs(packed.tokens, packed.input_pos, ~allowed)
                    worst = 0.0
                    flat = [t for g in groups for t in g.trajectories]
                    for k, trajectory in enumerate(flat):
                        row, positions = packed.trajectory_positions[k]
                        later = torch.as_tensor(positions[1:])
                        got = logp[
                            row, packed.predecessor[row, later].long(), packed.tokens[row, later]
                        ]
                        n = len(trajectory.tokens)
                        ids = torch.as_tensor(trajectory.tokens)[None]
                        alone_blocked = ~torch.ones(n, n, dtype=torch.bool).tril()[None]
                        alone = logprobs(ids, torch.arange(n)[None], alone_blocked)[0]
                        expected = alone[torch.arange(n - 1), ids[0, 1:]]
                        worst = max(worst, float((got - expected).abs().max()))
                    results[(name, mask_name)] = worst
    return results


@pytest.fixture(scope="module")
def worst_errors():
    """Needs one spawned gloo rank with Megatron-core (about 10-20 s on the 2-core box)."""
    rng = np.random.default_rng(11)
    single = [
        make_single_turn_group(rng, prompt_len=8, completion_lens=(5, 9, 3)) for _ in range(2)
    ]
    multi = [make_multi_turn_group(rng, turns=3) for _ in range(2)]
    cases = {
        "single_turn": (single, 48),
        "multi_turn": (multi, 48),
        "mixed_split_rows": (single + multi, 30),
    }
    return run_ranks(_gpt_worker, world_size=1, args=(cases,), timeout_s=300)[0]


@pytest.mark.parametrize("case", ["single_turn", "multi_turn", "mixed_split_rows"])
def test_megatron_gpt_logprobs_match_each_trajectory_alone(worst_errors, case):
    assert worst_errors[(case, "tree")] <= 1e-5, worst_errors


def test_megatron_oracle_detects_a_wrong_mask(worst_errors):
    assert worst_errors[("single_turn", "plain_causal")] > 1e-3
