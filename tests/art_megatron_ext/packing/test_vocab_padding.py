"""Logprobs of a padded vocabulary equal the served model's: padded ids take no probability.

Megatron pads the output layer to `make_vocab_size_divisible_by * tp` rows (zeros, so their
logits are 0, not -inf); vLLM serves the checkpoint's `vocab_size` columns. Normalising over
the padded columns too gives every token a smaller logprob than the served one (by
log(1 + padded mass)), so the fresh-token ratio drifts from 1. With `vocab_size`, the result
and its gradient equal `log_softmax` over the true columns, at TP=1 and at TP=2 where the
second shard is almost all padding, and the padded columns get zero gradient.
"""

import pytest
import torch
from support.train_ranks import run_ranks

from art_megatron_ext.packing.vocab_parallel import vocab_parallel_logprobs

VOCAB, PADDED = 37, 64  # TP=2: rank 1 holds ids 32..63, of which 32..36 are tokens
ATOL = 2e-6


def _inputs():
    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(20, PADDED, generator=g)
    logits[:, VOCAB:] = 0.0  # what zero padded rows of the output layer give
    target = torch.randint(0, VOCAB, (20,), generator=g)
    weights = torch.randn(20, generator=g)
    return logits, target, weights


def _reference():
    logits, target, weights = _inputs()
    logits.requires_grad_()
    lp = logits[:, :VOCAB].double().log_softmax(-1).gather(-1, target[:, None]).squeeze(-1)
    (lp * weights.double()).sum().backward()
    return lp.float(), logits.grad


def _ours(logits, target, weights, **kwargs):
    logits = logits.detach().clone().requires_grad_()
    rows = torch.arange(target.shape[0])
    lp = vocab_parallel_logprobs(logits, (rows,), target, chunk_tokens=8, **kwargs)
    (lp * weights).sum().backward()
    return lp.detach(), logits.grad


def _worker(rank: int, world: int) -> dict:
    from support.megatron_cpu import cpu_shim, megatron_parallel

    from art_megatron_ext.packing.vocab_parallel import megatron_tp_group

    logits, target, weights = _inputs()
    width = PADDED // world
    mine = logits[:, rank * width : (rank + 1) * width]
    with cpu_shim(), megatron_parallel(tp=world):
        lp, grad = _ours(mine, target, weights, tp_group=megatron_tp_group(), vocab_size=VOCAB)
    return {"lp": lp.numpy(), "grad": grad.numpy()}


def test_padded_ids_take_no_probability_at_tp1():
    want_lp, want_grad = _reference()
    lp, grad = _ours(*_inputs(), vocab_size=VOCAB)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=ATOL)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=ATOL)
    assert (grad[:, VOCAB:] == 0).all()
    unmasked, _ = _ours(*_inputs())  # the old normalisation: off by the padded mass
    assert (want_lp - unmasked).min() > 1e-3


def test_padded_ids_take_no_probability_at_tp2():
    want_lp, want_grad = _reference()
    ranks = run_ranks(_worker, world_size=2)
    lp = torch.from_numpy(ranks[0]["lp"])
    grad = torch.cat([torch.from_numpy(r["grad"]) for r in ranks], dim=-1)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=ATOL)
    torch.testing.assert_close(torch.from_numpy(ranks[1]["lp"]), lp, rtol=0, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=ATOL)
    assert (grad[:, VOCAB:] == 0).all()


def test_a_padded_id_as_target_or_a_bad_vocab_size_is_refused():
    logits, target, weights = _inputs()
    target[4] = VOCAB
    with pytest.raises(ValueError, match=r"target\[4\] = 37 is outside the vocabulary \[0, 37\)"):
        _ours(logits, target, weights, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="vocab_size must be an int in"):
        _ours(*_inputs(), vocab_size=PADDED + 1)


def test_tempered_logprobs_of_a_padded_vocabulary():
    """The example's path (`predecessor_logprobs` with a temperature) takes `vocab_size` too."""
    from art_megatron_ext.packing import predecessor_logprobs

    logits, target, _ = _inputs()
    temperature = 0.7
    want = (logits[:, :VOCAB].double() / temperature).log_softmax(-1)
    want = want.gather(-1, target[:, None]).squeeze(-1).float()
    # one row of 21 positions: position i + 1 holds target i, predicted by position i
    tokens = torch.cat([torch.zeros(1, dtype=torch.long), target])[None]
    predecessor = torch.arange(-1, 20)[None]
    mask = predecessor >= 0
    padded = torch.cat([logits, torch.zeros(1, PADDED)])[None]
    for t in (temperature, torch.full((1, 21), temperature)):
        got = predecessor_logprobs(
            padded, tokens, predecessor, mask, temperature=t, vocab_size=VOCAB, chunk_tokens=8
        )
        torch.testing.assert_close(got[0, 1:], want, rtol=0, atol=ATOL)
