"""Per-step numbers of the loop: policy ages, importance ratios by age, the score (numpy only).

The score is the seed's (issue 16, item 4), computed from the step's real spans and counts:

    score = accepted_train_tok_per_s * freshness_discount * batch_factor

- accepted_train_tok_per_s: completion tokens the step trained on (trajectories that passed
  the age and zero-variance filters), divided by the step's wall time (end of the previous
  step to end of this one, waiting for rollouts included).
- freshness_discount = 1 / E_token[exp(age / 8)] over those tokens (`policy_age.freshness`,
  tau = 8 steps); a token's age is the trainer's version minus the version in its span.
- batch_factor = (G_ref + 300 / n_ref) / (G + 300 / n) (`policy_age.batch_factor`, critical
  rollout scale C = 300) with G groups of n rollouts this step and the reference (G_ref, n_ref)
  the run's starting settings: 1.0 unless the autotuner changed the groups per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from art_protocol.policy_age import batch_factor, freshness

FRESHNESS_TAU = 8.0
CRITICAL_ROLLOUT_SCALE = 300.0


def token_ages(spans: Sequence[dict], num_tokens: int, current: int) -> np.ndarray:
    """Age of every completion token: the current version minus the version that computed it,
    where a span's version counts its slot's updates and its base weights' (`base_version`,
    full-weight updates): the loop publishes one kind, so one of the two stays 0."""
    ages = np.full(num_tokens, -1, dtype=np.int64)
    for span in spans:
        ages[span["start"] : span["end"]] = current - span["version"] - span.get("base_version", 0)
    if (ages < 0).any():
        raise ValueError(
            f"spans {list(spans)} do not cover {num_tokens} tokens at or before version {current}"
        )
    return ages


def local_ratios(lp, packed, mine) -> dict:
    """This rank's trained tokens: trainer/behaviour ratio (the trainer's weights before the
    step), age, and whether the whole completion was fresh. `lp`: the step's [rows, seq]
    logprobs (a torch tensor on the trainer's device), `packed` the rows, `mine` this rank's
    groups (`batches.AcceptedGroup`) in packing order."""
    lp_np = lp.detach().cpu().numpy()  # the one host copy of the step's logprobs
    ratios, ages, whole = [], [], []
    k = 0
    for group in mine:
        p = len(group.prompt)
        for m in group.members:
            row, pos = packed.trajectory_positions[k]
            k += 1
            t = m.trained
            ratios.append(np.exp(lp_np[row, pos[p:]][t] - np.asarray(m.logprobs)[t]))
            ages.append(m.ages[t])
            whole.append(np.full(int(t.sum()), bool((m.ages == 0).all())))
    return {
        "ratios": np.concatenate(ratios),
        "ages": np.concatenate(ages),
        "whole": np.concatenate(whole),
        "rows": packed.stats.rows,
        "physical": packed.stats.physical_tokens,
        "logical": packed.stats.logical_tokens,
    }


def ratio_stats(
    ratios: np.ndarray, ages: np.ndarray, whole_fresh: np.ndarray, clip_eps: float
) -> dict:
    """Importance ratio (trainer / behaviour) per age bucket.

    - fresh: tokens of completions computed wholly by the trainer's current version (one span,
      age 0). Same weights, same dtype, same context: the ratio is 1 up to kernel rounding.
      This is the train/inference parity check.
    - age0_mixed: age-0 tokens of completions that began under an older version. The new
      weights computed them, but on top of KV-cache entries the old version wrote for the
      earlier tokens (an in-flight update does not recompute the cache), while the trainer
      recomputes the whole context with the new weights: ratios drift from 1.
    - stale: tokens of age >= 1 (ratio = new policy / old policy, what clipping is for).
    """
    out = {}
    buckets = (
        ("fresh", whole_fresh),
        ("age0_mixed", (ages == 0) & ~whole_fresh),
        ("stale", ages >= 1),
        ("all", ages >= 0),
    )
    for name, sel in buckets:
        r = ratios[sel]
        out[name] = {
            "tokens": int(r.size),
            "mean": float(r.mean()) if r.size else None,
            "max": float(r.max()) if r.size else None,
            "max_abs_dev": float(np.abs(r - 1).max()) if r.size else None,
            "clipped_fraction": float((np.abs(r - 1) > clip_eps).mean()) if r.size else None,
        }
    return out


def score(
    accepted_tokens: int,
    wall_s: float,
    spans_with_current: Sequence[tuple[Sequence[dict], int]],
    groups: int,
    group_size: int,
    ref_groups: int,
    ref_group_size: int,
    full: bool = False,
) -> dict:
    """The seed's score and its three factors (see the module docstring). `full`: the
    versions are the base weights' (`--update full`)."""
    spans = [dict(s) for spans, _ in spans_with_current for s in spans]
    current = max((c for _, c in spans_with_current), default=0)
    slot_current, base_current = (0, current) if full else (current, 0)
    fresh = (
        freshness(spans, slot_current, tau=FRESHNESS_TAU, current_base=base_current)
        if spans
        else 1.0
    )
    tok_s = accepted_tokens / wall_s if wall_s > 0 else 0.0
    factor = batch_factor(groups, group_size, ref_groups, ref_group_size, CRITICAL_ROLLOUT_SCALE)
    return {
        "accepted_tok_per_s": tok_s,
        "freshness": fresh,
        "batch_factor": factor,
        "score": tok_s * fresh * factor,
    }


def step_line(rec: dict) -> str:
    """One line per step for the console."""
    r = rec["ratio"]
    fresh = r["fresh"]
    stale = r["stale"]

    def fmt(x, spec=".3f"):
        return "  -  " if x is None else format(x, spec)

    line = (
        f"step {rec['step']:3d} | reward {rec['reward']:.3f} | acc {rec['accepted_tok_per_s']:6.1f}"
        f" tok/s | age mean {rec['age_mean']:.2f} p90 {rec['age_p90']:.0f} | fresh "
        f"{rec['freshness']:.3f} | batch {rec['batch_factor']:.2f} | score {rec['score']:6.1f} | "
        f"update {rec['update_ms']:5.0f} ms | ratio fresh {fmt(fresh['mean'])}/"
        f"{fmt(fresh['max'])} age1+ {fmt(stale['mean'])}/{fmt(stale['max'])} clip "
        f"{fmt(r['all']['clipped_fraction'], '.2f')} | drop stale {rec['dropped_stale']} "
        f"zero-var {rec['dropped_zero_var']}"
    )
    if rec.get("autotune"):
        line += f" | tune: {rec['autotune']}"
    return line
