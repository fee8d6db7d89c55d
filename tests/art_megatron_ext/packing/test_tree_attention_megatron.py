"""Tree attention in a Megatron-core GPTModel (local spec with `TreeCoreAttention`, RoPE, GQA,
fp32, CPU): on packed rows of 2 x 4096 tokens, the policy-gradient surrogate loss and every
parameter gradient equal those of the same trajectories run one by one through Megatron's own
`DotProductAttention`; no tensor anywhere near S x S is created, and the heap grows far less
than the dense tree mask alone would take.

The loss is `sum(weight * advantage * logprob)` over trained tokens: packed, a shared token
carries the summed weight of its trainers (`pack.py`), so the sums agree exactly in math and
to fp32 rounding here. One spawned single-rank gloo process runs every case.
"""

import contextlib
import ctypes
import types

import numpy as np
import pytest
import torch
from support.train_ranks import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from art_megatron_ext.packing import PackingConfig, pack_groups

from .builders import VOCAB, make_multi_turn_group, make_single_turn_group

SEQ = 4096
GRAD_TOLERANCE = 2e-4  # relative to the largest gradient entry; fp32 sums over ~7k tokens
LOSS_ABS = 1e-3  # the loss is a sum of ~6k fp32 logprobs of size ~4


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


class PeakProbe(TorchDispatchMode):
    """Records the largest tensor any op returns and the peak of glibc's allocated bytes
    (`mallinfo2`: arena plus mmapped chunks) sampled after every op, above the entry value.
    Backward ops run inside the mode too (autograd carries the mode to its CPU thread)."""

    def __init__(self):
        super().__init__()
        self._mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
        self._mallinfo2.restype = _Mallinfo2
        self.largest, self.largest_op = 0, ""
        self.base = self.peak = self._heap()

    def _heap(self) -> int:
        info = self._mallinfo2()
        return info.uordblks + info.hblkhd

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.largest_op = t.numel(), f"{func} {tuple(t.shape)}"
        self.peak = max(self.peak, self._heap())
        return out

    @property
    def growth(self) -> int:
        return self.peak - self.base


def _groups(seed: int):
    """About 7k unique tokens: 2 rows of 4096, prompts shared by 4-6 rollouts, chats."""
    rng = np.random.default_rng(seed)
    groups = [
        make_single_turn_group(
            rng,
            prompt_len=int(rng.integers(40, 160)),
            completion_lens=tuple(int(n) for n in rng.integers(20, 200, rng.integers(4, 7))),
        )
        for _ in range(12)
    ]
    return groups + [make_multi_turn_group(rng, turns=4) for _ in range(6)]


def _build(spec, recompute=False):
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    shape = GptShape(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    torch.manual_seed(0)
    return build_gpt(shape, layer_spec=spec, max_sequence_length=SEQ, recompute=recompute)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank: int, world_size: int, seed: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from support.megatron_cpu import cpu_shim, megatron_parallel

    from art_megatron_ext.lora.cpu_runtime import cpu_megatron
    from art_megatron_ext.packing import (
        TreeAttentionConfig,
        TreePackedSeqParams,
        enable_tree_attention,
        predecessor_logprobs,
        tree_attention_mask,
        tree_layer_spec,
    )

    # DotProductAttention forks the CUDA RNG tracker for dropout even at p=0.
    no_tracker = types.SimpleNamespace(fork=lambda *a, **k: contextlib.nullcontext())
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: no_tracker
    out = {}
    with cpu_shim(), megatron_parallel():
        local = get_gpt_layer_local_spec(normalization="RMSNorm")
        tree_model = enable_tree_attention(_build(tree_layer_spec(local)))
        plain_model = _build(local)
        plain_model.load_state_dict(tree_model.state_dict(), strict=True)

        groups = _groups(seed)
        batch = pack_groups(groups, PackingConfig(seq_len=SEQ, vocab_size=VOCAB))
        out["rows"], out["physical"] = batch.stats.rows, batch.stats.physical_tokens
        scale = batch.weights * batch.advantages

        def packed_loss(params):
            logits = tree_model(batch.tokens, batch.input_pos, None, packed_seq_params=params)
            logp = predecessor_logprobs(
                logits, batch.tokens, batch.predecessor, batch.assistant_mask
            )
            return (logp * scale).sum()

        attention = TreeAttentionConfig(block=128, chunk_keys=512)
        params = TreePackedSeqParams.from_batch(batch, attention=attention)
        out["visible_tiles"] = params.plan.visible_tiles
        out["causal_tiles"] = params.plan.total_tiles
        with PeakProbe() as probe:
            loss = packed_loss(params)
            loss.backward()
        out["largest"], out["largest_op"] = probe.largest, probe.largest_op
        out["heap_growth"] = probe.growth
        out["packed_loss"], packed = float(loss), _grads(tree_model)

        # The same trajectories one by one, Megatron's DotProductAttention, plain causal.
        expected = 0.0
        for group in groups:
            for t in group.trajectories:
                n = len(t.tokens)
                ids = torch.as_tensor(t.tokens)[None]
                causal_blocked = ~torch.ones(n, n, dtype=torch.bool).tril()[None, None]
                logits = plain_model(ids, torch.arange(n)[None], causal_blocked)[0]
                logp = logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
                trained = torch.as_tensor(t.assistant_mask[1:])
                w = torch.as_tensor(np.broadcast_to(t.weight * t.advantage, (n,))[1:].copy())
                part = (logp * trained * w.float()).sum()
                part.backward()
                expected += float(part)
        out["alone_loss"], alone = expected, _grads(plain_model)

        # Full activation recompute (Megatron re-runs each layer in backward, params and all).
        # cpu_megatron: the checkpoint saves and restores the CUDA RNG state, absent here.
        with cpu_megatron():
            recomputed = enable_tree_attention(_build(tree_layer_spec(local), recompute=True))
            recomputed.load_state_dict(tree_model.state_dict(), strict=True)
            logits = recomputed(batch.tokens, batch.input_pos, None, packed_seq_params=params)
            logp = predecessor_logprobs(
                logits, batch.tokens, batch.predecessor, batch.assistant_mask
            )
            (logp * scale).sum().backward()
        again = _grads(recomputed)
        out["recompute_error"] = max(float((again[n] - packed[n]).abs().max()) for n in packed)
        assert packed.keys() == alone.keys()
        biggest = max(float(g.abs().max()) for g in alone.values())
        out["grad_error"] = max(float((packed[n] - alone[n]).abs().max()) for n in alone) / biggest

        # The dense-mask path: Megatron's DotProductAttention over the same packed rows with
        # the [rows, 1, S, S] tree mask (True = blocked), measured by the same probe. Only its
        # memory is compared (its RoPE uses row positions, so its loss is not the oracle).
        plain_model.zero_grad()
        with PeakProbe() as probe:
            blocked = ~tree_attention_mask(batch.subtree_end)[:, None]
            logits = plain_model(batch.tokens, batch.input_pos, blocked)
            del blocked
            logp = predecessor_logprobs(
                logits, batch.tokens, batch.predecessor, batch.assistant_mask
            )
            (logp * scale).sum().backward()
        out["dense_largest"], out["dense_heap_growth"] = probe.largest, probe.growth

        # Misuse fails loudly: no tree params, a model without the tree spec, a dense mask.
        short = batch.tokens[:, :8], batch.input_pos[:, :8]
        some_mask = torch.zeros(1, dtype=torch.bool)
        for name, call in {
            "no_params": lambda: tree_model(*short, None),
            "plain_model_with_tree": lambda: plain_model(
                batch.tokens, batch.input_pos, None, packed_seq_params=params
            ),
            "mask_and_params": lambda: tree_model(
                batch.tokens, batch.input_pos, some_mask, packed_seq_params=params
            ),
            "enable_on_plain": lambda: enable_tree_attention(plain_model),
        }.items():
            try:
                call()
                out[name] = "no error"
            except Exception as error:
                out[name] = f"{type(error).__name__}: {error}"

        # Oracle check: a plain causal "tree" (every subtree to the row end) must differ.
        tree_model.zero_grad()
        causal_end = torch.full_like(batch.subtree_end, SEQ)
        wrong = TreePackedSeqParams(
            subtree_end=causal_end, positions=batch.input_pos, attention=attention
        )
        with torch.no_grad():
            out["causal_loss"] = float(packed_loss(wrong))
    return out


@pytest.fixture(scope="module")
def result():
    """One spawned gloo rank with Megatron-core: about 20 s of CPU (the packed step 2 s, the
    dense control 17 s and 3.3 GB of heap, the 70 trajectories alone 1 s)."""
    return run_ranks(_worker, world_size=1, args=(3,), timeout_s=600)[0]


def test_the_batch_fills_two_rows_of_4096(result):
    assert result["rows"] == 2 and result["physical"] > SEQ


def test_packed_loss_equals_trajectories_run_alone(result):
    assert abs(result["packed_loss"] - result["alone_loss"]) <= LOSS_ABS, result


def test_packed_gradients_equal_trajectories_run_alone(result):
    assert result["grad_error"] <= GRAD_TOLERANCE, result


def test_full_activation_recompute_gives_the_same_gradients(result):
    assert result["recompute_error"] <= 1e-6, result


def test_the_oracle_sees_a_causal_mask_across_branches(result):
    """A plain causal mask over the same rows (branches see their siblings) moves the loss
    by far more than the packed/alone disagreement the tests above allow."""
    assert abs(result["causal_loss"] - result["alone_loss"]) > 100 * LOSS_ABS, result


def test_no_tensor_near_s_by_s_is_created(result):
    """The largest op output in forward and backward (activations, tiles) stays below S*S/4,
    while the dense path (the probe's control) makes tensors of rows*heads*S*S."""
    assert result["largest"] < SEQ * SEQ // 4, result["largest_op"]
    assert result["dense_largest"] >= result["rows"] * SEQ * SEQ


def test_heap_peak_far_below_the_dense_path(result):
    """Peak heap growth of the whole packed forward+backward (all activations included) is
    under an eighth of the dense-mask path's on the same rows, and under twice the bool
    mask alone."""
    assert result["heap_growth"] * 8 < result["dense_heap_growth"], result
    assert result["heap_growth"] < 2 * result["rows"] * SEQ * SEQ, result


def test_fully_masked_tiles_are_skipped(result):
    assert result["visible_tiles"] < result["causal_tiles"] * 0.75, result


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no_params", "TypeError: TreeCoreAttention needs packed_seq_params=TreePackedSeqParams"),
        ("plain_model_with_tree", "Packed sequence is not supported by DotProductAttention"),
        ("mask_and_params", "ValueError: TreeCoreAttention reads the tree from packed_seq_params"),
        ("enable_on_plain", "ValueError: the model has no TreeCoreAttention"),
    ],
)
def test_misuse_fails_naming_the_fix(result, case, message):
    assert message in result[case]
