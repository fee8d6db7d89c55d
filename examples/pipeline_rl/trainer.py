"""The trainer of the Pipeline RL loop: one process per data-parallel rank (`.venv-train`).

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... \\
        .venv-train/bin/python examples/pipeline_rl/trainer.py RUN_DIR/loop_config.json

`run.py` starts `cfg.dp` of them with those variables (the same ones `torchrun` sets: a team
launches this file with `torchrun --nproc-per-node N` on its GPUs); without them it runs as a
single rank. Where each rank runs is one choice, `cfg.device` (`placement.py`): on a GPU host
(default "auto") rank r trains on GPU LOCAL_RANK and the ranks talk over NCCL; on a host
without one (or with `--device cpu`) they talk over gloo and Megatron's CUDA-only calls are
stood in for (`art_megatron_ext.cpu_stand_in`), which never happens on a GPU.

What it does, in order:
1. Builds the Megatron GPT + LoRA policy on every rank (`policy.build_policy`) and wraps it in
   Megatron DDP with the distributed optimizer, `overlap_grad_reduce` and
   `overlap_param_gather` (`policy.data_parallel`); the optimizer comes from the resident
   store (atomic checkpoints in RUN_DIR/optimizer every `save_interval` steps and on the
   final step, collective over the ranks).
2. Rank 0 waits for the server (the driver writes RUN_DIR/server.json once `/health`
   answers) and starts the rollout workers (threads, `rollouts.py`) which never stop until
   the end.
3. Per step: rank 0 takes groups off the queue until the target is accepted (`batches.py`:
   per-token age filter, zero-variance groups dropped) and shares them out; each rank packs
   its groups as prefix trees on its device (`batches.pack_for_step`), computes its logprobs
   at each group's sampling temperature (divided in fp32 inside the chunked logprobs) and the
   GRPO objective with TIS and proximal clipping (`grpo.py`); DDP reduces the gradients,
   `finalize_model_grads` divides them by the global batch's token weight, one optimizer
   step (`step.py`). Then every rank takes part in the export (`publisher.py`), rank 0
   publishes it in flight (`ArtClient.update`) while the optimizer checkpoint is written,
   prints one line and appends one JSON record to RUN_DIR/metrics.jsonl.
4. Rank 0 writes RUN_DIR/summary.json; every rank stops its threads (also on error).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from batches import pack_for_step, share, take_batch
from lease_eval import LeaseEvaluation
from loop_config import LoopConfig
from placement import choose, init_ranks, local_rank, megatron_runtime
from policy import build_policy, data_parallel
from publisher import Publisher
from rollouts import GroupQueue, RolloutWorkers
from stats import local_ratios, ratio_stats, score, step_line
from step import train_step
from task import TargetTokenTask


def wait_for_server(run_dir: Path, timeout_s: float = 600) -> str:
    path = run_dir / "server.json"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f}s")
        time.sleep(0.2)
    return json.loads(path.read_text())["url"]


def gather_to_rank0(local: dict, rank: int, world: int) -> list[dict] | None:
    if world == 1:
        return [local]
    out = [None] * world if rank == 0 else None
    torch.distributed.gather_object(local, out, dst=0)
    return out


def step_record(step, version, groups, drops, parts, terms_global, publisher, t, cfg) -> dict:
    """The step's JSON record (rank 0), from every rank's part."""
    now, t_server, t_prev, wait_s = t
    ratios = np.concatenate([p["ratios"] for p in parts])
    ages = np.concatenate([p["ages"] for p in parts])
    whole = np.concatenate([p["whole"] for p in parts])
    members = [m for g in groups for m in g.members]
    loss, weight, tis_truncated = terms_global
    return {
        "step": step,
        "t": now - t_server,
        "wall_s": now - t_prev,
        "wait_s": wait_s,
        "loss": loss,
        "reward": float(np.mean([m.reward for m in members])),
        "groups": len(groups),
        "accepted_tokens": int(ages.size),  # trained: young enough, in accepted trajectories
        "completion_tokens": sum(len(m.completion) for m in members),
        "span_tokens": sum(s["end"] - s["start"] for m in members for s in m.spans),
        "untrained_stale_tokens": sum(int((~m.trained).sum()) for m in members),
        "loss_weight": weight,
        "tis_truncated_tokens": tis_truncated,
        "age_mean": float(ages.mean()),
        "age_p90": float(np.percentile(ages, 90)),
        "age_max": int(ages.max()),
        "age_hist": np.bincount(ages).tolist(),
        "update_ms": publisher.last_ms,
        "ratio": ratio_stats(ratios, ages, whole, cfg.clip_eps),
        "dropped_stale": drops["stale"],
        "dropped_stale_tokens": drops["stale_tokens"],
        "dropped_stale_groups": drops["stale_groups"],
        "dropped_zero_var": drops["zero_var"],
        "packed_rows": sum(p["rows"] for p in parts),
        "packed_tokens": sum(p["physical"] for p in parts),
        "logical_tokens": sum(p["logical"] for p in parts),
        "dp": len(parts),
        **score(
            ages.size,
            now - t_prev,
            [(m.spans, version) for m in members],
            len(groups),
            cfg.group_size,
            cfg.groups_per_step,
            cfg.group_size,
            full=cfg.full,
        ),
    }


def main(config_path: str) -> int:
    from megatron.core import parallel_state

    from art_megatron_ext.optim.resident import ResidentKey, ResidentOptimizerStore
    from art_megatron_ext.optim.schedule import SaveSchedule

    cfg = LoopConfig.load(config_path)
    run_dir = cfg.path
    t_start = time.monotonic()
    placement = choose(cfg.device, local_rank=local_rank())
    if not placement.on_cuda:
        torch.set_num_threads(1)  # the other core drives the server
    with tempfile.TemporaryDirectory(prefix="art_loop_") as tmp:
        rank, world = init_ranks(placement, tmp)
        if world != cfg.dp:
            raise SystemExit(f"started as {world} ranks, the config says dp={cfg.dp}")
        lead = rank == 0
        parallel_state.initialize_model_parallel(1, 1)  # TP 1, PP 1: data parallel `world`
        workers = tuner = publisher = lease = None
        try:
            with megatron_runtime(placement, cfg.seed):
                model, shape = build_policy(cfg, placement.device)
                ddp, make_optimizer = data_parallel(model, cfg)
                store = ResidentOptimizerStore()
                key = ResidentKey(run_dir.name, "rl", run_dir / "optimizer")
                state = store.acquire(key, ddp, make_optimizer)
                optimizer = state.optimizer
                t_ready, ready_at = time.monotonic(), time.time()
                if lead:
                    print(
                        f"[trainer] {world} rank(s) on {placement.device.type} "
                        f"({placement.backend}) ready in {t_ready - t_start:.1f}s "
                        f"(optimizer {state.residency.value}); waiting for the server",
                        flush=True,
                    )
                url = wait_for_server(run_dir) if lead else None
                t_server = time.monotonic()
                publisher = Publisher(url, cfg, shape)
                settings = {"workers": cfg.rollout_workers, "groups": cfg.groups_per_step}
                if lead:
                    task = TargetTokenTask(
                        shape.vocab_size, cfg.prompt_len, target_every=cfg.target_every
                    )
                    queue = GroupQueue(cfg.queue_capacity)
                    if cfg.autotune:
                        from autotune_hook import make_tuner

                        tuner = make_tuner(cfg, url)
                    workers = RolloutWorkers(
                        url=url,
                        slot=cfg.model_name,
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
                        temperature=cfg.temperature,
                        seed=cfg.seed,
                        full=cfg.full,
                    )
                    eval_rng = np.random.default_rng([cfg.seed, 999])
                    eval_prompts = [task.prompt(eval_rng) for _ in range(4)]
                    workers.start()
                    metrics = (run_dir / "metrics.jsonl").open("w")
                version, t_prev, saved = 0, time.monotonic(), []
                with state.saver(SaveSchedule(cfg.save_interval)) as saver:
                    for step in range(1, cfg.steps + 1):
                        t0, before = time.monotonic(), version  # the weights the step starts at
                        accepted = drops = None
                        if lead:  # at least one group per rank
                            target = max(settings["groups"], world)
                            accepted, drops = take_batch(queue, workers, cfg, version, target)
                        groups, mine = share(accepted, rank, world)
                        wait_s = time.monotonic() - t0
                        packed, temperature = pack_for_step(
                            mine, cfg, shape.vocab_size, placement.device
                        )
                        lp, terms, weight = train_step(ddp, optimizer, packed, temperature, cfg)
                        t_trained = time.monotonic()
                        sums = torch.stack(
                            [terms.loss_sum.detach().double(), terms.tis_truncated.double()]
                        )
                        if world > 1:
                            torch.distributed.all_reduce(sums)
                        parts = gather_to_rank0(local_ratios(lp, packed, mine), rank, world)
                        # Export on every rank, publish from rank 0; checkpoint meanwhile.
                        publisher.start(ddp, step, t_trained)
                        if saver.step_done(step, final=step == cfg.steps):
                            saved.append(step)
                        publisher.join()
                        version = step
                        if not lead:
                            continue
                        if step == cfg.lease_eval_step and not cfg.full:  # leases pin slots
                            lease = LeaseEvaluation(
                                url, cfg.publish_slot, eval_prompts, cfg.completion_len
                            )
                            lease.start(step)
                        now = time.monotonic()
                        w = float(weight)
                        rec = step_record(
                            step,
                            before,
                            groups,
                            drops,
                            parts,
                            (float(sums[0]) / w, w, int(sums[1])),
                            publisher,
                            (now, t_server, t_prev, wait_s),
                            cfg,
                        )
                        if tuner is not None:
                            rec["autotune"] = tuner.step(rec, groups, packed, settings, queue)
                        t_prev = now
                        print(step_line(rec), flush=True)
                        metrics.write(json.dumps(rec) + "\n")
                        metrics.flush()
                if lead:
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
                        "dp": world,
                        "device": placement.device.type,
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
