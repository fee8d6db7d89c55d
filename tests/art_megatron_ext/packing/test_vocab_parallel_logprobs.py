"""Predecessor logprobs from tensor-parallel (vocab-sharded) logits, chunk by chunk.

- TP=2 (two spawned gloo ranks, Megatron's parallel state, each rank holding half of the
  vocabulary, the group found by default) gives the TP=1 logprobs and, concatenated over
  the ranks, the TP=1 gradient of a weighted sum of them, within fp32 rounding; TP=1 gives
  a float64 `log_softmax` of the whole vocabulary.
- bf16 logits are normalised in fp32: the result is fp32 and equals the fp32 computation
  on the same (bf16-rounded) logits.
- Memory: no `[tokens, vocab]` intermediate over `chunk_tokens` tokens is made, in forward
  or backward, at TP=2 or TP=1, while the gathered computation (today's code, kept here as
  the probe's control) makes `[scored tokens, vocab]` ones. On CPU torch has no peak-memory
  counter, so a `TorchDispatchMode` records every op's output shape.
- The gradient is `torch.autograd.gradcheck`-exact (fp64), with repeated predecessors (a
  fork's children all read their parent's logits).
- Misuse fails with a message naming the input: a token outside the vocabulary, a bad
  chunk size, a group for gathered logits, ranks passing unequal shards.
"""

import numpy as np
import pytest
import torch
from support.train_ranks import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from art_megatron_ext.packing import PackingConfig, pack_groups, predecessor_logprobs
from art_megatron_ext.packing.vocab_parallel import vocab_parallel_logprobs

from .builders import VOCAB, make_multi_turn_group, make_single_turn_group

LOGITS_VOCAB = 64  # padded as Megatron pads: tokens < VOCAB = 50 fall in both TP=2 shards
CHUNK = 64
FP32_ATOL = 2e-6  # logprobs of size ~5 in fp32; a per-shard normalisation is off by ~0.7
# Gradient entries up to ~3 (summed over a fork's children) times softmaxes whose fp32
# log-sum-exp differs by an ulp of ~5 between TP=1 and TP=2 (seen: 1.8e-6); a wrong
# normalisation or a missing repeat is off by 0.01 to 1.
GRAD_ATOL = 1e-5


def _batch():
    """2 rows of 300 with shared prompts (forks: repeated predecessors) and chats."""
    rng = np.random.default_rng(0)
    groups = [make_single_turn_group(rng, 20, (30, 9, 50, 7)) for _ in range(4)]
    groups += [make_multi_turn_group(rng, turns=4) for _ in range(3)]
    return pack_groups(groups, PackingConfig(seq_len=300, vocab_size=VOCAB))


def _logits_and_weights(batch):
    g = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(*batch.tokens.shape, LOGITS_VOCAB, generator=g)
    return logits, torch.randn(batch.tokens.shape, generator=g)


class ShapeProbe(TorchDispatchMode):
    """Records the largest number of token rows of any `[..., vocab]` op output (forward and
    backward ops alike; autograd carries the mode into backward) other than tensors of the
    logits' own shape (the gradient of the logits is logits-sized whatever one does)."""

    def __init__(self, logits_shape, widths):
        super().__init__()
        self.logits_shape, self.widths = tuple(logits_shape), set(widths)
        self.rows, self.op = 0, ""

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[-1] not in self.widths:
                continue
            if tuple(t.shape) != self.logits_shape and t.numel() // t.shape[-1] > self.rows:
                self.rows, self.op = t.numel() // t.shape[-1], f"{func} {tuple(t.shape)}"
        return out


def _run(logits, batch, weights, **kwargs):
    """Logprobs and the gradient of `sum(weights * logprobs)`, under a ShapeProbe."""
    logits = logits.detach().clone().requires_grad_()
    widths = (logits.shape[-1], LOGITS_VOCAB)
    with ShapeProbe(logits.shape, widths) as probe:
        lp = predecessor_logprobs(
            logits, batch.tokens, batch.predecessor, batch.assistant_mask, **kwargs
        )
        (lp * weights).sum().backward()
    return {"values": lp.detach(), "grad": logits.grad, "rows": probe.rows, "op": probe.op}


def _gathered_logprobs(logits, tokens, predecessor, mask):
    """The gathered computation (the code before vocab-parallel logprobs): the control."""
    row, col = mask.nonzero(as_tuple=True)
    picked = logits[row, predecessor[row, col].long()].float().log_softmax(-1)
    values = picked.gather(-1, tokens[row, col].long()[:, None]).squeeze(-1)
    return torch.zeros(mask.shape).index_put((row, col), values)


def _worker(rank: int, world_size: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from support.megatron_cpu import cpu_shim, megatron_parallel

    batch = _batch()
    full, weights = _logits_and_weights(batch)
    width = LOGITS_VOCAB // world_size
    mine = full[..., rank * width : (rank + 1) * width]
    out = {}
    with cpu_shim(), megatron_parallel(tp=world_size):
        out["fp32"] = _run(mine, batch, weights, chunk_tokens=CHUNK)
        out["default_chunk"] = _run(mine, batch, weights)["values"]
        out["bf16"] = _run(mine.bfloat16(), batch, weights, chunk_tokens=CHUNK)
        out["gathered_flag"] = _run(full, batch, weights, vocab_parallel=False)["values"]
        narrower = mine[..., : width - rank]  # rank 1 passes one column fewer
        try:
            predecessor_logprobs(narrower, batch.tokens, batch.predecessor, batch.assistant_mask)
            out["unequal_shards"] = "no error"
        except ValueError as error:
            out["unequal_shards"] = str(error)
    return _to_numpy(out)


def _to_numpy(tree):
    """Tensors leave a spawned rank as numpy arrays (bf16 as fp32, its dtype kept aside):
    torch tensors are passed through shared memory that vanishes with the rank."""
    if isinstance(tree, dict):
        return {k: _to_numpy(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return (tree.float().numpy(), str(tree.dtype))
    return tree


def _to_torch(tree):
    if isinstance(tree, dict):
        return {k: _to_torch(v) for k, v in tree.items()}
    if isinstance(tree, tuple):
        array, dtype = tree
        return torch.from_numpy(array).to(getattr(torch, dtype.removeprefix("torch.")))
    return tree


@pytest.fixture(scope="module")
def setup():
    batch = _batch()
    logits, weights = _logits_and_weights(batch)
    return batch, logits, weights


@pytest.fixture(scope="module")
def tp1(setup):
    batch, logits, weights = setup
    return _run(logits, batch, weights, chunk_tokens=CHUNK)


@pytest.fixture(scope="module")
def tp2():
    """Two spawned gloo ranks with Megatron's parallel state at TP=2: about 25 s of CPU,
    mostly importing Megatron."""
    return [_to_torch(r) for r in run_ranks(_worker, world_size=2, timeout_s=300)]


def test_the_batch_scores_many_chunks_and_repeats_predecessors(setup):
    batch, _, _ = setup
    mask = batch.assistant_mask
    sources = batch.predecessor[mask].long() + batch.predecessor.shape[1] * mask.nonzero()[:, 0]
    assert int(mask.sum()) > 4 * CHUNK and int(mask.sum()) % CHUNK != 0
    assert sources.unique().numel() < sources.numel(), "no fork: repeats untested"


def test_tp1_equals_log_softmax_of_the_whole_vocabulary_in_float64(setup, tp1):
    batch, logits, weights = setup
    wide = logits.double().requires_grad_()
    full = wide.log_softmax(-1)
    mask = batch.assistant_mask
    row, col = mask.nonzero(as_tuple=True)
    want = full[row, batch.predecessor[row, col].long(), batch.tokens[row, col].long()]
    (want * weights[row, col].double()).sum().backward()
    assert tp1["values"].dtype == torch.float32
    assert torch.allclose(tp1["values"][row, col].double(), want, atol=FP32_ATOL, rtol=0)
    assert torch.count_nonzero(tp1["values"][~mask]) == 0
    assert torch.allclose(tp1["grad"].double(), wide.grad, atol=GRAD_ATOL, rtol=0)


def test_chunk_size_does_not_change_tp1_values(setup, tp1):
    batch, logits, weights = setup
    for chunk in (1, 7, 10_000):
        got = _run(logits, batch, weights, chunk_tokens=chunk)
        assert torch.equal(got["values"], tp1["values"]), chunk
        assert torch.allclose(got["grad"], tp1["grad"], atol=1e-7, rtol=0), chunk


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_logprobs_equal_tp1(tp1, tp2, rank):
    diff = (tp2[rank]["fp32"]["values"] - tp1["values"]).abs().max()
    assert diff <= FP32_ATOL, float(diff)
    assert torch.allclose(tp2[rank]["default_chunk"], tp1["values"], atol=FP32_ATOL, rtol=0)


def test_tp2_gradients_concatenated_over_ranks_equal_tp1(tp1, tp2):
    grad = torch.cat([tp2[0]["fp32"]["grad"], tp2[1]["fp32"]["grad"]], dim=-1)
    assert grad.shape == tp1["grad"].shape
    assert (grad - tp1["grad"]).abs().max() <= GRAD_ATOL
    assert tp1["grad"].abs().max() > 0.1  # a gradient to compare, not zeros


def test_tp2_bf16_logits_are_normalised_in_fp32(setup, tp2):
    batch, logits, weights = setup
    want = _run(logits.bfloat16().float(), batch, weights, chunk_tokens=CHUNK)
    for rank in (0, 1):
        got = tp2[rank]["bf16"]
        assert got["values"].dtype == torch.float32 and got["grad"].dtype == torch.bfloat16
        assert (got["values"] - want["values"]).abs().max() <= FP32_ATOL
    grad = torch.cat([tp2[0]["bf16"]["grad"], tp2[1]["bf16"]["grad"]], dim=-1)
    assert torch.allclose(grad.float(), want["grad"], atol=1e-2, rtol=1e-2)  # bf16 gradient


def test_gathered_logits_with_vocab_parallel_false_need_no_group(tp1, tp2):
    for rank in (0, 1):
        assert torch.allclose(tp2[rank]["gathered_flag"], tp1["values"], atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_makes_no_token_by_vocab_tensor_over_a_chunk(tp2, rank):
    assert 0 < tp2[rank]["fp32"]["rows"] <= CHUNK, tp2[rank]["fp32"]["op"]


def test_tp1_makes_no_token_by_vocab_tensor_over_a_chunk_unlike_the_gathered_path(setup, tp1):
    batch, logits, _ = setup
    assert 0 < tp1["rows"] <= CHUNK, tp1["op"]
    logits = logits.clone().requires_grad_()
    with ShapeProbe(logits.shape, (LOGITS_VOCAB,)) as probe:  # the control
        _gathered_logprobs(
            logits, batch.tokens, batch.predecessor, batch.assistant_mask
        ).sum().backward()
    assert probe.rows >= int(batch.assistant_mask.sum()), probe.op


def test_gradient_passes_gradcheck_with_repeated_indices():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, generator=g, requires_grad=True)
    rows = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    cols = torch.tensor([1, 1, 3, 0, 4, 4, 2])  # (0, 1) and (1, 4) are read twice
    target = torch.tensor([3, 7, 0, 10, 2, 2, 5])

    def fn(x):
        return vocab_parallel_logprobs(x, (rows, cols), target, chunk_tokens=3)

    assert torch.autograd.gradcheck(fn, (logits,))


def test_a_token_outside_the_vocabulary_is_named(setup):
    batch, logits, _ = setup
    narrow = logits[..., :40]  # tokens go up to 49
    with pytest.raises(ValueError, match=r"position \(\d+, \d+\) holds token 4\d, outside"):
        predecessor_logprobs(narrow, batch.tokens, batch.predecessor, batch.assistant_mask)


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True])
def test_a_bad_chunk_size_is_refused(setup, chunk):
    batch, logits, _ = setup
    with pytest.raises(ValueError, match=r"chunk_tokens must be an int >= 1, got"):
        predecessor_logprobs(
            logits, batch.tokens, batch.predecessor, batch.assistant_mask, chunk_tokens=chunk
        )


def test_a_group_for_gathered_logits_is_refused(setup):
    batch, logits, _ = setup
    with pytest.raises(ValueError, match="tp_group was given with vocab_parallel=False"):
        predecessor_logprobs(
            logits,
            batch.tokens,
            batch.predecessor,
            batch.assistant_mask,
            vocab_parallel=False,
            tp_group=object(),
        )


def test_ranks_passing_unequal_shards_fail_instead_of_hanging(tp2):
    for rank in (0, 1):
        assert "vocabulary shard widths over [31, 32]" in tp2[rank]["unequal_shards"]
