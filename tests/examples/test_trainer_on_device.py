"""The example trainer's steps on the device it chose, on recorded rollouts (issue 34 item 4).

No server and no vLLM (the GPU machine has neither): the rollouts are written here, fixed and
deterministic (prompt and completion token ids, the behaviour logprobs a server would have
returned, rewards from the example's task and their GRPO advantages, two groups at two
sampling temperatures). On them run STEPS data-parallel-1 steps of the example's own code
(examples/pipeline_rl), in the order `trainer.main` calls it: `placement.choose` /
`init_ranks` / `megatron_runtime`, `policy.build_policy` (the tiny GPT with tree attention
and a LoRA slot, random weights: the GPU image has no checkpoint reader) and
`data_parallel` (Megatron DDP, distributed optimizer, overlapped reduce and gather),
`batches.pack_for_step`, `step.train_step` (logprobs at each group's temperature, GRPO with
TIS, `finalize_model_grads`, one optimizer step) and `stats.local_ratios`. The same batch
every step, as several epochs over one batch would be.

Checked: the loss (the GRPO objective over the batch's token weight) is finite and falls;
every parameter of the model, DDP's gradient buffers, the logprobs, the loss terms and the
token weight `finalize_model_grads` all-reduces are on the chosen device; the ratios the
trainer reports are finite (the logprobs came back to the host).

Cases: `cpu` runs everywhere without a GPU (gloo, the CPU stand-ins; about 10 s here);
`cuda` (`gpu`) runs on a GPU (NCCL, no stand-in, FlexAttention for the tree):
bench/gpu_check.sh's `example-trainer` stage, with the carried megatron-core.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.devices import cpu_and_cuda
from support.gpt_shapes import TINY

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "pipeline_rl"))

from batches import AcceptedGroup, Member, pack_for_step
from loop_config import LoopConfig
from placement import choose, init_ranks, megatron_runtime
from policy import build_policy, data_parallel
from stats import local_ratios
from step import train_step
from task import TargetTokenTask, group_advantages

STEPS = 5
#: below the loop's 5e-2: the same batch every step, so the loss falls at every step (seen on
#: CPU: -0.022, -0.107, -0.225, -0.316, -0.356; at 5e-2 it overshoots after the first step)
LR = 5e-3
VOCAB = 256
SHAPE = dict(TINY, vocab_size=VOCAB)  # the tiny GPT of the LoRA tests: hidden 128, GQA
GROUPS = ((1.0, 0), (0.7, 1))  # (sampling temperature, seed) per recorded group
GROUP_SIZE, PROMPT_LEN, COMPLETION_LEN = 4, 8, 12

DEVICES = cpu_and_cuda()


def recorded_groups(cfg: LoopConfig) -> list[AcceptedGroup]:
    """What the rollout workers would have accepted: fixed token ids, behaviour logprobs near
    the untrained model's (uniform over the vocabulary, +-0.1), the task's rewards (the share
    of target tokens: 0, 1/4, 1/2, 3/4 in each group) and their advantages."""
    task = TargetTokenTask(VOCAB, cfg.prompt_len, target_every=cfg.target_every)
    groups = []
    for temperature, seed in GROUPS:
        rng = np.random.default_rng([cfg.seed, seed])
        prompt = task.prompt(rng)
        targets, others = np.flatnonzero(task.targets), np.flatnonzero(~task.targets)
        completions, rewards = [], []
        for k in range(cfg.group_size):  # 0, 3, 6, 9 target tokens of 12
            tokens = rng.choice(others, cfg.completion_len)
            tokens[rng.permutation(cfg.completion_len)[: 3 * k]] = rng.choice(targets, 3 * k)
            completions.append(tokens.tolist())
            rewards.append(task.reward(tokens))
        advantages = group_advantages(rewards)
        members = []
        for tokens, reward, advantage in zip(completions, rewards, advantages, strict=True):
            n = len(tokens)
            behaviour = -math.log(VOCAB) + 0.1 * rng.uniform(-1, 1, n)
            members.append(
                Member(
                    completion=tokens,
                    logprobs=behaviour.tolist(),
                    ages=np.zeros(n, np.int64),
                    trained=np.ones(n, bool),
                    reward=float(reward),
                    advantage=float(advantage),
                    spans=[{"start": 0, "end": n, "slot": cfg.slot, "version": 0}],
                )
            )
        groups.append(AcceptedGroup(prompt, temperature, members, rollout_s=0.0, put_wait_s=0.0))
    return groups


def run_steps(cfg: LoopConfig, groups, tmp: Path) -> dict:
    """`trainer.main`'s set-up and step, minus the server: returns what the checks read."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    placement = choose(cfg.device)
    rank, world = init_ranks(placement, str(tmp))
    tracker_states = get_cuda_rng_tracker().get_states()
    parallel_state.initialize_model_parallel(1, 1)
    out = {"placement": placement, "world": world, "rank": rank, "losses": []}
    try:
        with megatron_runtime(placement, cfg.seed):
            model, shape = build_policy(cfg, placement.device, shape=_shape())
            ddp, make_optimizer = data_parallel(model, cfg)
            optimizer = make_optimizer([p for p in ddp.parameters() if p.requires_grad])
            for _ in range(STEPS):
                packed, temperature = pack_for_step(groups, cfg, shape.vocab_size, placement.device)
                lp, terms, weight = train_step(ddp, optimizer, packed, temperature, cfg)
                out["losses"].append(float(terms.loss_sum.detach()) / float(weight))
                ratios = local_ratios(lp, packed, groups)["ratios"]
                out.setdefault("first_ratios", ratios)
            out["devices"] = {
                "parameters": {p.device for p in ddp.module.parameters()},
                "grad buffers": {b.grad_data.device for b in ddp.buffers},
                "logprobs": {lp.device},
                "temperature": {temperature.device},
                "loss terms": {terms.loss_sum.device, terms.weight_sum.device},
                "token weight": {weight.device},
            }
            out["trained"] = sum(p.numel() for p in ddp.module.parameters() if p.requires_grad)
    finally:
        parallel_state.destroy_model_parallel()
        get_cuda_rng_tracker().set_states(tracker_states)
        torch.distributed.destroy_process_group()
    return out


def _shape():
    from art_megatron_ext.lora.tiny_gpt import GptShape

    return GptShape(**SHAPE)


@pytest.fixture
def single_rank(monkeypatch):
    """No torchrun variables (the trainer then starts a world of one) and no process group
    left by an earlier test."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.fail("a process group is already initialized in this process")


@pytest.mark.parametrize("device", DEVICES)
def test_the_example_trainer_learns_on_its_device(device, tmp_path, single_rank):
    cfg = LoopConfig(
        run_dir=str(tmp_path / "run"),
        hf_model="(random weights: build_policy(shape=))",
        init_adapter="(a fresh slot)",
        dp=1,
        device=device,
        groups_per_step=len(GROUPS),
        group_size=GROUP_SIZE,
        prompt_len=PROMPT_LEN,
        completion_len=COMPLETION_LEN,
        seq_len=64,
        lr=LR,
    )
    groups = recorded_groups(cfg)
    assert len({m.reward for g in groups for m in g.members}) > 1  # advantages to learn from
    out = run_steps(cfg, groups, tmp_path)

    placement = out["placement"]
    assert placement.device.type == device
    assert placement.backend == ("nccl" if device == "cuda" else "gloo")
    assert (out["rank"], out["world"]) == (0, 1)
    for what, devices in out["devices"].items():
        assert devices == {placement.device}, f"{what} on {devices}, not {placement.device}"
    assert out["trained"] > 0

    losses = out["losses"]
    assert all(math.isfinite(v) for v in losses), losses
    assert all(b < a for a, b in itertools.pairwise(losses)), f"loss did not fall: {losses}"
    assert losses[-1] < losses[0] - 0.01, losses
    ratios = out["first_ratios"]
    assert ratios.size == len(GROUPS) * GROUP_SIZE * COMPLETION_LEN
    assert np.isfinite(ratios).all()
    # the untrained model is near uniform, as the recorded behaviour logprobs are
    assert np.abs(np.log(ratios)).max() < 1.0, np.abs(np.log(ratios)).max()


def test_the_placement_follows_the_config_and_the_host():
    cpu = choose("cpu", cuda_devices=0)
    assert (cpu.device.type, cpu.backend) == ("cpu", "gloo")
    assert choose("auto", cuda_devices=0) == cpu
    gpu = choose("auto", local_rank=1, cuda_devices=2)
    assert (gpu.device, gpu.backend) == (torch.device("cuda", 1), "nccl")
    assert choose("cuda", cuda_devices=1).device == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        choose("cuda", cuda_devices=0)
    with pytest.raises(ValueError, match="LOCAL_RANK 2 has no GPU of its own: this process sees 2"):
        choose("auto", local_rank=2, cuda_devices=2)
    with pytest.raises(ValueError, match="stand-ins refuse to run beside CUDA"):
        choose("cpu", cuda_devices=1)
    with pytest.raises(ValueError, match="device must be one of"):
        choose("tpu")


def test_the_config_refuses_an_unknown_device_and_a_wildcard_trainer_host():
    base = dict(run_dir="/nonexistent", hf_model="m", init_adapter="a")
    with pytest.raises(ValueError, match=r"device must be one of \('auto', 'cuda', 'cpu'\)"):
        LoopConfig(**base, device="gpu")
    for host in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="no address the server's workers can connect to"):
            LoopConfig(**base, trainer_host=host)
    assert LoopConfig(**base).trainer_host == "127.0.0.1"
