"""The trainer of the Pipeline RL loop: one process per data-parallel rank (`.venv-train`).

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... \\
        .venv-train/bin/python examples/pipeline_rl/trainer.py RUN_DIR/loop_config.json

`run.py` starts `cfg.dp` of them with those variables (the same ones `torchrun` sets: a team
launches this file with `torchrun --nproc-per-node N` on its GPUs); without them it runs as a
single rank. Here, on CPU, the ranks talk over gloo and Megatron's CUDA-only calls are stood in
for (`art_megatron_ext.cpu_stand_in`); on GPUs a trainer uses NCCL, sets its device and enters
neither stand-in.

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
   its groups as prefix trees, computes its logprobs at each group's sampling temperature and
   the GRPO objective with TIS and proximal clipping (`grpo.py`); DDP reduces the gradients,
   `finalize_model_grads` divides them by the global batch's token weight, one optimizer
   step. Then every rank takes part in the export (`publisher.py`), rank 0 publishes it in
   flight (`ArtClient.update`) while the optimizer checkpoint is written, prints one line and
   appends one JSON record to RUN_DIR/metrics.jsonl.
4. Rank 0 writes RUN_DIR/summary.json; every rank stops its threads (also on error).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from batches import share, take_batch, to_packing_groups
from grpo import loss_terms, packed_logprobs, temperature_grid
from lease_eval import LeaseEvaluation
from loop_config import LoopConfig
from policy import build_policy, data_parallel
from publisher import Publisher
from rollouts import GroupQueue, RolloutWorkers
from stats import ratio_stats, score, step_line
from task import TargetTokenTask


def wait_for_server(run_dir: Path, timeout_s: float = 600) -> str:
    path = run_dir / "server.json"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f}s")
        time.sleep(0.2)
    return json.loads(path.read_text())["url"]


def init_ranks(tmp: str) -> tuple[int, int]:
    """(rank, world): from torchrun's variables when they are set, else a single rank."""
    if "WORLD_SIZE" in os.environ:
        torch.distributed.init_process_group("gloo")
    else:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1
        )
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def cpu_stand_ins() -> contextlib.ExitStack:
    """Megatron's CUDA-only calls stood in for (this example runs on CPU; never on a GPU)."""
    from art_megatron_ext.cpu_stand_in import cpu_shim, cuda_tensor_type_names
    from art_megatron_ext.lora.cpu_runtime import cpu_megatron

    stack = contextlib.ExitStack()
    for ctx in (cpu_shim(), cuda_tensor_type_names(), cpu_megatron()):
        stack.enter_context(ctx)
    return stack


def train_step(ddp, optimizer, packed, temperature, cfg: LoopConfig):
    """One optimizer step on this rank's rows; returns (logprobs, loss terms, global weight).
    Collective: DDP's gradient reduce-scatter, the weight's all-reduce, the optimizer's
    all-gather."""
    from megatron.core.distributed import finalize_model_grads

    from art_megatron_ext.lora import zero_lora_padding_
    from art_megatron_ext.lora.slots import activate_slot

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    # `--update full`: no LoRA slot, every weight trains
    with contextlib.nullcontext() if cfg.full else activate_slot(ddp.module, cfg.slot):
        lp = packed_logprobs(ddp, packed, cfg.attention, temperature)
        terms = loss_terms(lp, packed, cfg.clip_eps, cfg.tis_cap)
    terms.loss_sum.backward()
    weight = terms.weight_sum.clone()
    finalize_model_grads([ddp], num_tokens=weight)  # all-reduces `weight`, grads /= it
    zero_lora_padding_(ddp.module, optimizer)
    ok, _, _ = optimizer.step()
    if not ok:
        raise RuntimeError("the optimizer skipped its step (non-finite gradients)")
    zero_lora_padding_(ddp.module, optimizer)
    return lp, terms, weight


def local_ratios(lp: torch.Tensor, packed, mine) -> dict:
    """This rank's trained tokens: trainer/behaviour ratio (the trainer's weights before the
    step), age, and whether the whole completion was fresh."""
    lp_np = lp.detach().numpy()
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
    from art_megatron_ext.packing import PackingConfig, pack_groups

    cfg = LoopConfig.load(config_path)
    run_dir = cfg.path
    t_start = time.monotonic()
    torch.set_num_threads(1)  # the other core drives the server
    with tempfile.TemporaryDirectory(prefix="art_loop_") as tmp:
        rank, world = init_ranks(tmp)
        if world != cfg.dp:
            raise SystemExit(f"started as {world} ranks, the config says dp={cfg.dp}")
        lead = rank == 0
        parallel_state.initialize_model_parallel(1, 1)  # TP 1, PP 1: data parallel `world`
        workers = tuner = publisher = lease = None
        try:
            with cpu_stand_ins():
                model, shape = build_policy(cfg)
                ddp, make_optimizer = data_parallel(model, cfg)
                store = ResidentOptimizerStore()
                key = ResidentKey(run_dir.name, "rl", run_dir / "optimizer")
                state = store.acquire(key, ddp, make_optimizer)
                optimizer = state.optimizer
                t_ready, ready_at = time.monotonic(), time.time()
                if lead:
                    print(
                        f"[trainer] {world} rank(s) ready in {t_ready - t_start:.1f}s "
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
                        packing_groups, temps = to_packing_groups(mine)
                        packed = pack_groups(
                            packing_groups,
                            PackingConfig(seq_len=cfg.seq_len, vocab_size=shape.vocab_size),
                        )
                        temperature = temperature_grid(packed, temps)
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
