"""Sampling temperature inside the chunked predecessor logprobs (issue 34 item 4).

vLLM's logprobs of a sampled token (`--logprobs-mode processed_logprobs`) are
`log_softmax(logits.float() / T)`: the logits upcast to fp32 first, then divided. The trainer
must compute the same thing or its importance ratios are off on fresh tokens. So
`predecessor_logprobs(..., temperature=)` divides each chunk of scored logits in fp32:

- bf16 logits with per-group temperatures give the fp32 reference within FP32_ATOL (fp32
  rounding), where the old way (divide the bf16 logits by the temperature, then upcast) is
  off by more than OLD_WAY_MIN (bf16 rounding of logits around 10, and of T itself);
- its gradient is the reference's (autograd through the fp32 division), and passes
  `gradcheck` in fp64 with repeated predecessors;
- chunking changes nothing, no `[tokens, vocab]` tensor over a chunk is made, a float
  temperature equals a constant grid and 1.0 is no division at all;
- TP=2 (two spawned gloo ranks, the vocabulary split in halves, no Megatron) gives the TP=1
  values and, concatenated over the ranks, its gradient;
- a temperature that is not finite and > 0, or a grid of the wrong shape, is named.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.train_ranks import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from art_megatron_ext.packing import PackingConfig, pack_groups, predecessor_logprobs
from art_megatron_ext.packing.logprobs import tempered_logprobs

from .builders import VOCAB, make_multi_turn_group, make_single_turn_group

LOGITS_VOCAB = 64
CHUNK = 48
TEMPERATURES = (0.7, 1.3, 0.55, 1.0)  # per group, cycled; 0.7 is 0.69921875 in bf16
LOGIT_SCALE = 6.0  # logits of size 5 to 25, as a trained LM's
FP32_ATOL = 2e-5  # logprobs down to ~-50 in fp32 (ulp 4e-6); seen: 0.0 on CPU
OLD_WAY_MIN = 1e-2  # the bf16 division is off by more (seen: 0.20 at most, 0.037 on average)
GRAD_ATOL = 2e-2  # bf16 gradient entries of size <= ~2 (a fork's children add up)


def _batch():
    """2+ rows with forks (repeated predecessors) and multi-turn chats, and each trajectory's
    group temperature on its positions (1 on padding), as the example's `temperature_grid`."""
    rng = np.random.default_rng(3)
    groups = [make_single_turn_group(rng, 12, (20, 9, 31, 7)) for _ in range(4)]
    groups += [make_multi_turn_group(rng, turns=3) for _ in range(2)]
    batch = pack_groups(groups, PackingConfig(seq_len=200, vocab_size=VOCAB))
    grid = torch.ones(batch.tokens.shape)
    k = 0
    for g, group in enumerate(groups):
        for _ in group.trajectories:
            row, pos = batch.trajectory_positions[k]
            grid[row, torch.as_tensor(pos)] = TEMPERATURES[g % len(TEMPERATURES)]
            k += 1
    return batch, grid


def _logits(batch, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(4)
    logits = LOGIT_SCALE * torch.randn(*batch.tokens.shape, LOGITS_VOCAB, generator=g)
    return (logits + 10.0).to(dtype)


def _weights(batch):
    return torch.randn(batch.tokens.shape, generator=torch.Generator().manual_seed(5))


def _run(logits, batch, weights, **kwargs):
    """Values and the gradient of sum(weights * logprobs) with respect to the logits."""
    logits = logits.detach().clone().requires_grad_()
    lp = predecessor_logprobs(
        logits, batch.tokens, batch.predecessor, batch.assistant_mask, **kwargs
    )
    (lp * weights).sum().backward()
    return lp.detach(), logits.grad


def _reference(logits, batch, grid, weights):
    """What vLLM samples from: the logits upcast, then divided, then log-softmax; and its
    gradient through that fp32 computation."""
    logits = logits.detach().clone().requires_grad_()
    logp = (logits.float() / grid[..., None]).log_softmax(-1)
    mask = batch.assistant_mask
    row, col = mask.nonzero(as_tuple=True)
    pred = batch.predecessor[row, col].long()
    values = logp[row, pred, batch.tokens[row, col].long()]
    (values * weights[row, col]).sum().backward()
    out = torch.zeros(mask.shape).index_put((row, col), values.detach())
    return out, logits.grad


@pytest.fixture(scope="module")
def setup():
    batch, grid = _batch()
    return batch, grid, _logits(batch), _weights(batch)


def test_the_batch_has_forks_several_temperatures_and_large_logits(setup):
    batch, grid, logits, _ = setup
    mask = batch.assistant_mask
    row, col = mask.nonzero(as_tuple=True)
    read = grid[row, batch.predecessor[row, col].long()]
    assert sorted(read.unique().tolist()) == pytest.approx(sorted(TEMPERATURES))
    assert int(mask.sum()) > 3 * CHUNK
    sources = batch.predecessor[mask].long() + batch.predecessor.shape[1] * row
    assert sources.unique().numel() < sources.numel(), "no fork: repeats untested"
    assert float(logits.float().abs().max()) > 20


def test_bf16_logits_with_temperature_give_the_fp32_reference(setup):
    batch, grid, logits, weights = setup
    want, want_grad = _reference(logits, batch, grid, weights)
    got, grad = _run(logits, batch, weights, temperature=grid, chunk_tokens=CHUNK)
    assert got.dtype == torch.float32 and grad.dtype == torch.bfloat16
    err = float((got - want).abs().max())
    assert err <= FP32_ATOL, err
    assert torch.count_nonzero(got[~batch.assistant_mask]) == 0
    assert float((grad.float() - want_grad.float()).abs().max()) <= GRAD_ATOL
    assert float(want_grad.float().abs().max()) > 0.5  # a gradient to compare, not zeros


def test_the_old_way_dividing_bf16_logits_first_is_off(setup):
    """Dividing the bf16 logits by the temperature (in bf16), then normalising in fp32: the
    quotient is rounded to bf16 (8 bits of mantissa) and so is T."""
    batch, grid, logits, weights = setup
    want, _ = _reference(logits, batch, grid, weights)
    old = logits / grid[..., None].to(logits.dtype)
    got, _ = _run(old, batch, weights, chunk_tokens=CHUNK)
    err = float((got - want).abs().max())
    assert err > OLD_WAY_MIN, err
    assert err > 100 * FP32_ATOL, err


def test_fp32_logits_match_dividing_first(setup):
    """In fp32 the division outside gives the same numbers: nothing changes for an fp32
    trainer (the example's, whose fresh-token ratios are held within 1e-3 of 1)."""
    batch, grid, logits, weights = setup
    wide = logits.float()
    got, _ = _run(wide, batch, weights, temperature=grid, chunk_tokens=CHUNK)
    before, _ = _run(wide / grid[..., None], batch, weights, chunk_tokens=CHUNK)
    assert float((got - before).abs().max()) <= 1e-6


def test_chunking_does_not_change_values_or_gradients(setup):
    batch, grid, logits, weights = setup
    base, base_grad = _run(logits, batch, weights, temperature=grid, chunk_tokens=CHUNK)
    for chunk in (1, 7, 10_000):
        got, grad = _run(logits, batch, weights, temperature=grid, chunk_tokens=chunk)
        assert torch.equal(got, base), chunk
        # bf16 accumulation of repeated predecessors in another order
        assert float((grad.float() - base_grad.float()).abs().max()) <= 1e-2, chunk


def test_a_float_temperature_equals_a_constant_grid_and_one_is_no_division(setup):
    batch, _, logits, weights = setup
    got, grad = _run(logits, batch, weights, temperature=0.7)
    want, want_grad = _run(logits, batch, weights, temperature=torch.full(batch.tokens.shape, 0.7))
    assert torch.equal(got, want) and torch.equal(grad, want_grad)
    one, one_grad = _run(logits, batch, weights, temperature=1.0)
    plain, plain_grad = _run(logits, batch, weights)
    assert torch.equal(one, plain) and torch.equal(one_grad, plain_grad)


class _WidestChunk(TorchDispatchMode):
    """The most token rows of any `[..., vocab]` op output other than the logits' shape."""

    def __init__(self, logits_shape):
        super().__init__()
        self.logits_shape, self.rows = tuple(logits_shape), 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if (
                isinstance(t, torch.Tensor)
                and t.dim() >= 2
                and t.shape[-1] == LOGITS_VOCAB
                and tuple(t.shape) != self.logits_shape
            ):
                self.rows = max(self.rows, t.numel() // LOGITS_VOCAB)
        return out


def test_no_token_by_vocab_tensor_over_a_chunk_forward_or_backward(setup):
    batch, grid, logits, weights = setup
    logits = logits.clone().requires_grad_()
    with _WidestChunk(logits.shape) as probe:
        lp = predecessor_logprobs(
            logits,
            batch.tokens,
            batch.predecessor,
            batch.assistant_mask,
            temperature=grid,
            chunk_tokens=CHUNK,
        )
        (lp * weights).sum().backward()
    assert 0 < probe.rows <= CHUNK


def test_gradcheck_in_float64_with_repeated_indices_and_temperatures():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, generator=g, requires_grad=True)
    rows = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    cols = torch.tensor([1, 1, 3, 0, 4, 4, 2])  # (0, 1) and (1, 4) are read twice
    target = torch.tensor([3, 7, 0, 10, 2, 2, 5])
    temperature = torch.tensor([0.7, 0.7, 1.3, 0.5, 2.0, 2.0, 1.0], dtype=torch.float64)

    def fn(x):
        return tempered_logprobs(x, (rows, cols), target, temperature, chunk_tokens=3)

    assert torch.autograd.gradcheck(fn, (logits,))


def _tp2_worker(rank: int, world_size: int) -> dict:
    """This rank's half of the vocabulary; the group given explicitly (no Megatron)."""
    batch, grid = _batch()
    full, weights = _logits(batch), _weights(batch)
    width = LOGITS_VOCAB // world_size
    mine = full[..., rank * width : (rank + 1) * width]
    values, grad = _run(
        mine,
        batch,
        weights,
        temperature=grid,
        tp_group=torch.distributed.group.WORLD,
        chunk_tokens=CHUNK,
    )
    return {"values": values.numpy(), "grad": grad.float().numpy()}


def test_tp2_equals_tp1_values_and_gradients(setup):
    batch, grid, logits, weights = setup
    tp1, tp1_grad = _run(logits, batch, weights, temperature=grid, chunk_tokens=CHUNK)
    ranks = run_ranks(_tp2_worker, world_size=2, timeout_s=120)
    for rank in ranks:
        assert float(np.abs(rank["values"] - tp1.numpy()).max()) <= FP32_ATOL
    grad = np.concatenate([r["grad"] for r in ranks], axis=-1)
    assert grad.shape == tuple(tp1_grad.shape)
    assert float(np.abs(grad - tp1_grad.float().numpy()).max()) <= GRAD_ATOL


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_float_temperature_that_is_not_finite_and_positive_is_refused(setup, bad):
    batch, _, logits, _ = setup
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        predecessor_logprobs(
            logits, batch.tokens, batch.predecessor, batch.assistant_mask, temperature=bad
        )


def test_a_grid_with_a_bad_temperature_names_the_position(setup):
    batch, grid, logits, _ = setup
    mask = batch.assistant_mask
    row, col = (int(v[0]) for v in mask.nonzero(as_tuple=True))
    src = int(batch.predecessor[row, col])
    bad = grid.clone()
    bad[row, src] = 0.0
    with pytest.raises(ValueError, match=rf"\({row}, {col}\) reads its logits at \({row}, {src}\)"):
        predecessor_logprobs(logits, batch.tokens, batch.predecessor, mask, temperature=bad)
    with pytest.raises(ValueError, match=r"floating \[rows, seq\]"):
        predecessor_logprobs(logits, batch.tokens, batch.predecessor, mask, temperature=grid[0])
