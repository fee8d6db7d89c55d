"""The trainer process of the Pipeline RL loop (runs in `.venv-train`; started by `run.py`).

    .venv-train/bin/python examples/pipeline_rl/trainer.py RUN_DIR/loop_config.json

What it does, in order:
1. Builds a Megatron GPT shaped like the tiny model, loads its HF weights, attaches LoRA and
   imports the adapter the server serves as version 0 of the slot (both sides start equal).
2. Acquires the optimizer from the resident store (Adam; atomic checkpoints in RUN_DIR/optimizer
   every `save_interval` steps and on the final step).
3. Waits for the server (the driver writes RUN_DIR/server.json once `/health` answers) and
   starts the rollout workers (threads, `rollouts.py`) which never stop until the end.
4. Per step: takes groups off the queue until `groups_per_step` were accepted (trajectories
   older than `max_policy_age` and groups with zero reward variance are dropped and counted),
   packs them as prefix trees (the prompt is stored once per group), computes the trainer's
   logprobs with Megatron on the packed rows, the GRPO clipped loss, one Adam step; then
   exports the slot as PEFT and publishes it in flight (`ArtClient.update`) while the optimizer
   checkpoint is written; prints one line, appends one JSON record to RUN_DIR/metrics.jsonl.
5. Writes RUN_DIR/summary.json and stops its threads (also on error).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from lease_eval import LeaseEvaluation
from loop_config import LoopConfig
from rollouts import GroupQueue, RolloutWorkers
from stats import ratio_stats, score, step_line, token_ages
from task import TargetTokenTask, group_advantages


class LogicalRope(torch.nn.Module):
    """Megatron's GPTModel rotates token i of a row by RoPE position i. In a packed prefix tree
    a branch does not sit at its logical position (the second completion of a group starts
    right after the first, not after the prompt), so the rotary embedding must be looked up at
    each token's `input_pos`, as vLLM does. Set `.positions` ([rows, seq]) before a forward."""

    def __init__(self, rope: torch.nn.Module):
        super().__init__()
        self.rope = rope
        self.positions: torch.Tensor | None = None

    def get_rotary_seq_len(self, *args, **kwargs):
        return self.rope.get_rotary_seq_len(*args, **kwargs)

    def forward(self, seq_len: int, **kwargs) -> torch.Tensor:
        if self.positions is None:
            raise RuntimeError("LogicalRope.positions must be set before the forward")
        table = self.rope(int(self.positions.max()) + 1, **kwargs)  # [max_pos + 1, 1, 1, dim]
        return table[:, 0, 0, :][self.positions.T].unsqueeze(2)  # [seq, rows, 1, dim]


def wait_for_server(run_dir: Path, timeout_s: float = 600) -> str:
    path = run_dir / "server.json"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f}s")
        time.sleep(0.2)
    return json.loads(path.read_text())["url"]


def build_policy(cfg: LoopConfig):
    """Megatron GPT + HF base weights + LoRA slot `cfg.slot` loaded from `cfg.init_adapter`.

    `cfg.attention == "tree"`: core attention reads the packed prefix tree directly
    (`art_megatron_ext.packing.tree_layer_spec`, no [S, S] mask; RoPE at each token's
    logical position via `enable_tree_attention`). `"dense"`: Megatron's local attention with
    the packer's dense tree mask and `LogicalRope` (fine at small S, O(S^2) memory)."""
    from art_megatron_ext.lora import attach_lora, import_peft
    from art_megatron_ext.lora.config import LoraConfig
    from art_megatron_ext.lora.hf_weights import load_hf_weights
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    shape = GptShape.from_hf_config(cfg.hf_model)
    torch.manual_seed(cfg.seed)
    spec = None
    if cfg.attention == "tree":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from art_megatron_ext.packing import tree_layer_spec

        spec = tree_layer_spec(get_gpt_layer_local_spec(normalization="RMSNorm"))
    model = build_gpt(shape, max_sequence_length=cfg.seq_len, layer_spec=spec)
    load_hf_weights(model, cfg.hf_model, shape)
    for p in model.parameters():
        p.requires_grad_(False)
    attach_lora(model, LoraConfig(rank=8, alpha=8.0, init_seed=cfg.seed, slot=cfg.slot))
    import_peft(model, cfg.slot, cfg.init_adapter)
    if cfg.attention == "tree":
        from art_megatron_ext.packing import enable_tree_attention

        model = enable_tree_attention(model)
    else:
        model.rotary_pos_emb = LogicalRope(model.rotary_pos_emb)
    return model, shape


def packed_logprobs(model, packed, attention: str) -> torch.Tensor:
    """[rows, seq] logprob of every token under the model, read at its predecessor's logits
    (0 where a token is not trained: prompt tokens, padding)."""
    if attention == "tree":
        from art_megatron_ext.packing import TreePackedSeqParams, predecessor_logprobs

        params = TreePackedSeqParams.from_batch(packed)
        logits = model(packed.tokens, packed.input_pos, None, packed_seq_params=params)
        return predecessor_logprobs(
            logits, packed.tokens, packed.predecessor, packed.assistant_mask
        )
    from art_megatron_ext.packing import tree_attention_mask

    blocked = ~tree_attention_mask(packed.subtree_end.long())[:, None]  # True = masked
    model.rotary_pos_emb.positions = packed.input_pos
    logits = model(packed.tokens, packed.input_pos, blocked)  # [rows, seq, vocab]
    logp = torch.log_softmax(logits.float(), dim=-1)
    pred = packed.predecessor.long().clamp(min=0)
    rows = torch.arange(logp.shape[0])[:, None]
    out = logp[rows, pred, packed.tokens]
    return torch.where(packed.assistant_mask, out, torch.zeros_like(out))


def grpo_loss(lp: torch.Tensor, packed, clip_eps: float) -> torch.Tensor:
    """PPO-clipped GRPO objective over the packed tokens (shared tokens carry summed weights)."""
    mask = packed.assistant_mask
    behaviour = torch.nan_to_num(packed.logprobs, nan=0.0)
    ratio = torch.exp(lp - behaviour)
    adv = packed.advantages
    objective = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    w = packed.weights * mask
    return -(objective * w).sum() / w.sum()


class Publisher:
    """Export each version atomically (`export_ready`: temp dir, fsync, rename, manifest with
    the content digest) and publish it in flight on a background thread
    (`BackgroundPublisher` + `post_update`, digest included), so the optimizer checkpoint is
    written while the server loads the version. With `--push` the version's files travel in
    the request (`ArtClient.update_from_dir`, digest included) instead of its path. `latest` is
    the newest version published or in flight: what the rollout workers validate span
    versions against."""

    def __init__(self, url: str, cfg: LoopConfig):
        from art_megatron_ext.lora.publish_ready import BackgroundPublisher, post_update

        self.cfg = cfg
        self._post = self._pusher(url) if cfg.push else post_update(url)
        self._background = BackgroundPublisher(self._publish)
        self._pending = None
        self._t_trained = 0.0
        self.latest = 0
        self.published = 0
        self.last_ms = 0.0

    @staticmethod
    def _pusher(url: str):
        from art_protocol.client import ArtClient

        def push(ready) -> dict:
            with ArtClient(url, timeout=300) as art:
                return art.update_from_dir(
                    ready.slot, ready.path, ready.version, digest=ready.digest
                )

        return push

    def _publish(self, ready) -> dict:
        if self.cfg.publish_slot != ready.slot:  # the broken-loop test's wrong slot
            ready = dataclasses.replace(ready, slot=self.cfg.publish_slot)
        receipt = self._post(ready)
        self.published = ready.version
        self.last_ms = (time.monotonic() - self._t_trained) * 1000
        return receipt

    def start(self, model, version: int, t_trained: float) -> None:
        from art_megatron_ext.lora.publish_ready import export_ready

        ready = export_ready(
            model,
            self.cfg.slot,
            self.cfg.path / "adapters",
            version=version,
            step=version,
            base_model_name_or_path=self.cfg.hf_model,
        )
        self.latest = version
        self._t_trained = t_trained
        self._pending = self._background.submit(ready)

    def join(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # raises the publish's error

    def close(self) -> None:
        self._background.close()


def take_batch(queue, workers, cfg: LoopConfig, current: int, target: int, task):
    """Groups off the queue until `target` are accepted; returns them and the counts."""
    accepted, stale, zero_var, stale_groups, offered = [], 0, 0, 0, 0
    starving = 0  # groups in a row with fewer than 2 trajectories within the age limit
    while len(accepted) < target:
        if starving >= 8 * target:
            raise RuntimeError(
                f"{starving} groups in a row had fewer than 2 trajectories within the policy-age "
                f"limit {cfg.max_policy_age} at version {current}: the rollouts do not get the "
                f"updates (updates go to slot {cfg.publish_slot!r}, rollouts sample "
                f"{cfg.slot!r})"
            )
        try:
            group = queue.get(timeout_s=120)
        except TimeoutError:
            if workers.error is not None:
                raise RuntimeError("a rollout worker failed") from workers.error
            raise
        offered += 1
        keep = []
        for r in group.rollouts:
            ages = token_ages(r.spans, len(r.completion), current)
            if ages.mean() > cfg.max_policy_age:
                stale += 1
            else:
                keep.append((r, ages))
        if len(keep) < 2:
            stale_groups += 1
            starving += 1
            continue
        starving = 0
        rewards = [r.reward for r, _ in keep]
        if np.std(rewards) == 0:
            zero_var += 1
            continue
        accepted.append((group, keep, group_advantages(rewards)))
    return accepted, {
        "stale": stale,
        "stale_groups": stale_groups,
        "zero_var": zero_var,
        "offered": offered,
    }


def to_packing_groups(accepted, cfg: LoopConfig):
    from art_megatron_ext.packing import Trajectory, TrajectoryGroup

    groups = []
    for group, keep, adv in accepted:
        p = len(group.prompt)
        members = []
        for (r, _), a in zip(keep, adv, strict=True):
            n = len(r.completion)
            members.append(
                Trajectory(
                    tokens=np.asarray(group.prompt + r.completion, dtype=np.int64),
                    assistant_mask=np.r_[np.zeros(p, bool), np.ones(n, bool)],
                    logprobs=np.r_[np.full(p, np.nan), r.logprobs].astype(np.float32),
                    advantage=float(a),
                )
            )
        groups.append(TrajectoryGroup(members))
    return groups


def main(config_path: str) -> int:
    from megatron.core import parallel_state

    from art_megatron_ext.lora import zero_lora_padding_
    from art_megatron_ext.lora.cpu_runtime import cpu_megatron
    from art_megatron_ext.lora.slots import activate_slot
    from art_megatron_ext.optim.resident import ResidentKey, ResidentOptimizerStore
    from art_megatron_ext.optim.schedule import SaveSchedule
    from art_megatron_ext.packing import PackingConfig, pack_groups

    cfg = LoopConfig.load(config_path)
    run_dir = cfg.path
    t_start = time.monotonic()
    torch.set_num_threads(1)  # the other core drives the server
    with tempfile.TemporaryDirectory(prefix="art_loop_") as tmp:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1
        )
        parallel_state.initialize_model_parallel(1, 1)
        workers = tuner = publisher = lease = None
        try:
            with cpu_megatron():
                model, shape = build_policy(cfg)
                store = ResidentOptimizerStore()
                key = ResidentKey(run_dir.name, "rl", run_dir / "optimizer")
                state = store.acquire(
                    key, model, lambda params: torch.optim.Adam(params, lr=cfg.lr)
                )
                t_ready, ready_at = time.monotonic(), time.time()
                print(
                    f"[trainer] model ready in {t_ready - t_start:.1f}s "
                    f"(optimizer {state.residency.value}); waiting for the server",
                    flush=True,
                )
                url = wait_for_server(run_dir)
                t_server = time.monotonic()
                publisher = Publisher(url, cfg)
                task = TargetTokenTask(
                    shape.vocab_size, cfg.prompt_len, target_every=cfg.target_every
                )
                settings = {"workers": cfg.rollout_workers, "groups": cfg.groups_per_step}
                queue = GroupQueue(cfg.queue_capacity)
                if cfg.autotune:
                    from autotune_hook import make_tuner

                    tuner = make_tuner(cfg, url)
                workers = RolloutWorkers(
                    url=url,
                    slot=cfg.slot,
                    queue=queue,
                    make_prompt=task.prompt,
                    reward=task.reward,
                    latest_version=lambda: publisher.latest,
                    group_size=cfg.group_size,
                    completion_len=cfg.completion_len,
                    workers=max(
                        cfg.rollout_workers, cfg.max_rollout_workers if cfg.autotune else 0
                    ),
                    active=lambda: settings["workers"],
                    seed=cfg.seed,
                )
                eval_rng = np.random.default_rng([cfg.seed, 999])
                eval_prompts = [task.prompt(eval_rng) for _ in range(4)]
                workers.start()
                metrics = (run_dir / "metrics.jsonl").open("w")
                version, t_prev, saved = 0, time.monotonic(), []
                with state.saver(SaveSchedule(cfg.save_interval)) as saver:
                    for step in range(1, cfg.steps + 1):
                        t0 = time.monotonic()
                        accepted, drops = take_batch(
                            queue, workers, cfg, version, settings["groups"], task
                        )
                        wait_s = time.monotonic() - t0
                        packed = pack_groups(
                            to_packing_groups(accepted, cfg),
                            PackingConfig(seq_len=cfg.seq_len, vocab_size=shape.vocab_size),
                        )
                        with activate_slot(model, cfg.slot):
                            lp = packed_logprobs(model, packed, cfg.attention)
                            loss = grpo_loss(lp, packed, cfg.clip_eps)
                        loss.backward()
                        zero_lora_padding_(model, state.optimizer)
                        state.optimizer.step()
                        state.optimizer.zero_grad(set_to_none=True)
                        zero_lora_padding_(model, state.optimizer)
                        t_trained = time.monotonic()
                        # Ratios: the trainer's logprobs (version `version`, before this step)
                        # against the server's, per token, with the token's age from its span.
                        lp_np = lp.detach().numpy()
                        ratios, ages, whole, rewards, spans_cur = [], [], [], [], []
                        k = 0
                        for group, keep, _ in accepted:
                            p = len(group.prompt)
                            for r, age in keep:
                                row, pos = packed.trajectory_positions[k]
                                k += 1
                                ratios.append(np.exp(lp_np[row, pos[p:]] - np.asarray(r.logprobs)))
                                ages.append(age)
                                whole.append(np.full(age.size, bool((age == 0).all())))
                                spans_cur.append((r.spans, version))
                            rewards.extend(r.reward for r, _ in keep)
                        ratios, ages = np.concatenate(ratios), np.concatenate(ages)
                        whole = np.concatenate(whole)
                        # Publish the new weights in flight; the checkpoint is written meanwhile.
                        publisher.start(model, step, t_trained)
                        if saver.step_done(step, final=step == cfg.steps):
                            saved.append(step)
                        publisher.join()
                        version = step
                        if step == cfg.lease_eval_step:
                            lease = LeaseEvaluation(
                                url, cfg.publish_slot, eval_prompts, cfg.completion_len
                            )
                            lease.start(step)
                        now = time.monotonic()
                        groups = len(accepted)
                        trained = [r for _, keep, _ in accepted for r, _ in keep]
                        rec = {
                            "step": step,
                            "t": now - t_server,
                            "wall_s": now - t_prev,
                            "wait_s": wait_s,
                            "loss": loss.item(),
                            "reward": float(np.mean(rewards)),
                            "groups": groups,
                            "accepted_tokens": int(ages.size),
                            "completion_tokens": sum(len(r.completion) for r in trained),
                            "span_tokens": sum(
                                s["end"] - s["start"] for r in trained for s in r.spans
                            ),
                            "age_mean": float(ages.mean()),
                            "age_p90": float(np.percentile(ages, 90)),
                            "age_max": int(ages.max()),
                            "age_hist": np.bincount(ages).tolist(),
                            "update_ms": publisher.last_ms,
                            "ratio": ratio_stats(ratios, ages, whole, cfg.clip_eps),
                            "dropped_stale": drops["stale"],
                            "dropped_stale_groups": drops["stale_groups"],
                            "dropped_zero_var": drops["zero_var"],
                            "packed_rows": packed.stats.rows,
                            "packed_tokens": packed.stats.physical_tokens,
                            "logical_tokens": packed.stats.logical_tokens,
                            "queue": len(queue),
                            "checkpoint": step in saved,
                            **score(
                                ages.size,
                                now - t_prev,
                                spans_cur,
                                groups,
                                cfg.group_size,
                                cfg.groups_per_step,
                                cfg.group_size,
                            ),
                        }
                        if tuner is not None:
                            rec["autotune"] = tuner.step(rec, accepted, packed, settings, queue)
                        t_prev = now
                        print(step_line(rec), flush=True)
                        metrics.write(json.dumps(rec) + "\n")
                        metrics.flush()
                metrics.close()
                workers_requests = workers.requests
                workers.stop()
                workers = None
                lease_result = None
                if lease is not None:  # the slot moved on; version N must not have
                    lease_result = lease.finish(publisher.published)
                manifest = state.checkpointer.latest()
                summary = {
                    "steps": cfg.steps,
                    "updates_published": publisher.published,
                    "pushed": cfg.push,  # the versions' files travelled in the requests
                    "optimizer_saves": saved,
                    "optimizer_generation": None if manifest is None else manifest.generation,
                    "optimizer_step": None if manifest is None else manifest.step,
                    "model_ready_s": t_ready - t_start,
                    "model_ready_at": ready_at,
                    "loop_s": time.monotonic() - t_server,
                    "rollout_requests": workers_requests,
                    "lease_eval": lease_result,
                }
                if tuner is not None:
                    summary["autotune_decisions"] = tuner.decisions()
                    summary["autotune_poll_failures"] = tuner.poll_failures
                (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        finally:
            if workers is not None:
                workers.stop()
            if tuner is not None:
                tuner.close()
            if publisher is not None:
                publisher.close()
            if lease is not None:
                lease.close()
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
