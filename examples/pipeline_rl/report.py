"""The end of a run: the reward/score plot and the summary (reads RUN_DIR/metrics.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from loop_config import LoopConfig


def load_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(run_dir: Path) -> Path | None:
    """RUN_DIR/loop.png: reward and score per step (None when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[driver] matplotlib not installed (dev extra): no plot")
        return None
    records = load_records(run_dir)
    if not records:
        return None
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward"] for r in records], color="tab:blue", label="reward")
    ax.set_xlabel("step")
    ax.set_ylabel("reward (share of target tokens)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["score"] for r in records], color="tab:orange", label="score")
    ax2.set_ylabel("score (accepted tok/s x freshness x batch factor)", color="tab:orange")
    ax.set_title("Pipeline RL on the tiny model")
    fig.tight_layout()
    out = run_dir / "loop.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def summarize(cfg: LoopConfig, timings: dict, png: Path | None, t0_wall: float) -> dict:
    """Print and return the summary (also written to RUN_DIR/result.json)."""
    records = load_records(cfg.path)
    trainer = json.loads((cfg.path / "summary.json").read_text())
    hist = np.zeros(1 + max(len(r["age_hist"]) for r in records), dtype=np.int64)
    for r in records:
        hist[: len(r["age_hist"])] += r["age_hist"]
    first = float(np.mean([r["reward"] for r in records[:3]]))
    last = float(np.mean([r["reward"] for r in records[-3:]]))
    fresh = [r["ratio"]["fresh"]["max_abs_dev"] for r in records]
    fresh = [x for x in fresh if x is not None]
    out = {
        "reward_first3": first,
        "reward_last3": last,
        "score_last10": float(np.mean([r["score"] for r in records[-10:]])),
        "age_hist": hist[: int(np.flatnonzero(hist).max()) + 1].tolist(),
        "dropped_stale": sum(r["dropped_stale"] for r in records),
        "dropped_zero_var": sum(r["dropped_zero_var"] for r in records),
        "fresh_tokens": sum(r["ratio"]["fresh"]["tokens"] for r in records),
        "fresh_ratio_max_abs_dev": max(fresh) if fresh else None,
        "updates_published": trainer["updates_published"],
        "optimizer_saves": trainer["optimizer_saves"],
        "plot": None if png is None else str(png),
        # trainer: process start (imports included) to model + optimizer ready
        "timings": {**timings, "trainer_ready_s": trainer["model_ready_at"] - t0_wall},
    }
    (cfg.path / "result.json").write_text(json.dumps(out, indent=2) + "\n")
    share = hist / hist.sum()
    ages = ", ".join(f"{a}: {s:.0%}" for a, s in enumerate(share[: len(out["age_hist"])]))
    t = out["timings"]
    lease = trainer.get("lease_eval")
    lease_line = "off"
    if lease:
        lease_line = (
            f"{lease['model']} evaluated at step {lease['version']} and after the slot reached "
            f"version {lease['slot_version_at_end']}: "
            f"{'same tokens' if lease['exact'] else 'TOKENS DIFFER'}, span versions "
            f"{lease['span_versions']}, released {lease['released']}"
        )
    out["lease_eval"] = lease
    dev_value = out["fresh_ratio_max_abs_dev"]
    dev = "-" if dev_value is None else f"{dev_value:.2e}"
    verdict = (
        "no fresh tokens"
        if dev_value is None
        else "ok"
        if dev_value <= cfg.fresh_ratio_tolerance
        else "EXCEEDED"
    )
    print(
        "\n== Pipeline RL summary\n"
        f"reward (mean of first 3 steps -> last 3): {first:.3f} -> {last:.3f}\n"
        f"score (mean of last 10 steps): {out['score_last10']:.1f} "
        "(accepted tok/s x freshness x batch factor)\n"
        f"policy age of trained tokens: {ages}\n"
        f"dropped: {out['dropped_stale']} stale trajectories, {out['dropped_zero_var']} "
        "zero-variance groups\n"
        f"fresh-token ratio (train/inference parity): max |ratio - 1| = {dev} over "
        f"{out['fresh_tokens']} tokens, tolerance {cfg.fresh_ratio_tolerance}: {verdict}\n"
        f"lease evaluation: {lease_line}\n"
        f"updates published: {out['updates_published']}; optimizer checkpoints at steps "
        f"{out['optimizer_saves']}\n"
        f"plot: {out['plot']}\n"
        f"time: server start {t['server_start_s']:.1f}s, trainer start (imports, model, "
        f"optimizer) {t['trainer_ready_s']:.1f}s in parallel, "
        f"loop {t['trainer_after_server_s']:.1f}s, "
        f"plot {t['plot_s']:.1f}s, total {t['total_s']:.1f}s",
        flush=True,
    )
    return out
