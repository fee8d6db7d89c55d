"""ResidentOptimizerStore: reuse on a matching key, rebuild or load otherwise."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from art_megatron_ext.optim import (
    CheckpointConfig,
    CheckpointIO,
    ObjectiveMismatchError,
    Residency,
    ResidentKey,
    ResidentOptimizerStore,
    ShardedCheckpointer,
    TrainableStateError,
)


class TinyLoRA(nn.Module):
    """A frozen base linear with a trainable low-rank update (the shape of a LoRA site)."""

    def __init__(self, dim: int = 16, rank: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, dim, generator=g) * 0.1)
        self.lora_B = nn.Parameter(torch.zeros(dim, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_A.T @ self.lora_B.T


class CountingIO(CheckpointIO):
    def __init__(self) -> None:
        self.reads = 0

    def read_bytes(self, path):
        self.reads += 1
        return super().read_bytes(path)

    def open_read(self, path):
        self.reads += 1
        return super().open_read(path)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def reset_lora(model: TinyLoRA) -> None:
    with torch.no_grad():
        model.lora_B.zero_()


def train(state, steps: int, target: float, fail_after: int | None = None) -> None:
    x = torch.linspace(-1, 1, 32 * 16).reshape(32, 16)
    with state.saver() as saver:
        for i in range(steps):
            loss = (state.model(x) - target).pow(2).mean()
            loss.backward()
            state.optimizer.step()
            state.optimizer.zero_grad()
            if i == fail_after:
                raise RuntimeError("reward service went away")
            saver.step_done(saver.last_step + 1)


def snapshot(state) -> dict:
    return {
        "params": {n: t.clone() for n, t in state.trainable_state().items()},
        "moments": {
            i: {k: v.clone() for k, v in s.items()}
            for i, s in enumerate(state.optimizer.state.values())
        },
    }


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(same(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a)


def test_rl_reused_then_sft_rebuilt_then_rl_other_path_loaded(tmp_path):
    io = CountingIO()
    store = ResidentOptimizerStore(io=io)
    model = TinyLoRA()
    rl_a = ResidentKey("session-1", "rl", tmp_path / "rl-a")

    job1 = store.acquire(rl_a, model, adamw, reset_trainable=reset_lora)
    assert job1.residency is Residency.REBUILT
    train(job1, steps=3, target=1.0)  # clean stop saves step 3
    assert job1.step == 3

    io.reads = 0
    job2 = store.acquire(rl_a, model, adamw, reset_trainable=reset_lora)
    assert job2.residency is Residency.REUSED
    assert io.reads == 0, "a reused job must not read the disk"
    assert job2.optimizer is job1.optimizer and job2.step == 3
    train(job2, steps=2, target=1.0)  # step 5 is due: saved
    rl_end = snapshot(job2)
    assert ShardedCheckpointer(CheckpointConfig(rl_a.optimizer_path)).latest().step == 5

    sft = ResidentKey("session-1", "sft", tmp_path / "sft")
    job3 = store.acquire(sft, model, adamw, reset_trainable=reset_lora)
    assert job3.residency is Residency.REBUILT and "objective rl -> sft" in job3.reason
    assert job3.optimizer is not job2.optimizer
    assert len(job3.optimizer.state) == 0, "RL moments leaked into the SFT optimizer"
    assert torch.count_nonzero(model.lora_B) == 0  # reset_trainable ran
    # One SFT step gives exactly the moments of a fresh AdamW on the same gradients.
    reference = TinyLoRA()
    reference.load_state_dict(model.state_dict())
    ref_opt = adamw([reference.lora_A, reference.lora_B])
    x = torch.ones(4, 16)
    for m, opt in ((model, job3.optimizer), (reference, ref_opt)):
        (m(x) - 3.0).pow(2).mean().backward()
        opt.step()
    for p, q in zip(
        [model.lora_A, model.lora_B], [reference.lora_A, reference.lora_B], strict=True
    ):
        assert torch.equal(job3.optimizer.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"])
        assert torch.equal(job3.optimizer.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])

    rl_c = ResidentKey("session-1", "rl", tmp_path / "rl-c")
    shutil.copytree(rl_a.optimizer_path, rl_c.optimizer_path)
    io.reads = 0
    job4 = store.acquire(rl_c, model, adamw, reset_trainable=reset_lora)
    assert job4.residency is Residency.LOADED and job4.step == 5
    assert io.reads > 0
    assert same(snapshot(job4), rl_end), "loaded state differs from the saved RL state"


def test_same_key_with_another_model_object_is_not_reused(tmp_path):
    store = ResidentOptimizerStore()
    key = ResidentKey("s", "rl", tmp_path / "a")
    store.acquire(key, TinyLoRA(), adamw)
    again = store.acquire(key, TinyLoRA(), adamw)
    assert again.residency is Residency.REBUILT and again.reason == "another model object"


def test_changed_trainable_parameters_are_not_reused(tmp_path):
    store = ResidentOptimizerStore()
    model = TinyLoRA()
    key = ResidentKey("s", "rl", tmp_path / "a")
    store.acquire(key, model, adamw)
    model.lora_B = nn.Parameter(torch.zeros(16, 4))  # re-wrapped: the optimizer's is stale
    again = store.acquire(key, model, adamw)
    assert again.residency is Residency.REBUILT
    assert again.reason == "the model's trainable parameters changed"


def test_another_training_session_is_not_reused(tmp_path):
    store = ResidentOptimizerStore()
    model = TinyLoRA()
    first = store.acquire(ResidentKey("s1", "rl", tmp_path / "a"), model, adamw)
    first.save(1)
    second = store.acquire(ResidentKey("s2", "rl", tmp_path / "a"), model, adamw)
    assert second.residency is Residency.LOADED and "training_session s1 -> s2" in second.reason


def test_checkpoint_of_another_objective_is_refused_and_resident_state_stays(tmp_path):
    store = ResidentOptimizerStore()
    model = TinyLoRA()
    rl = store.acquire(ResidentKey("s", "rl", tmp_path / "rl"), model, adamw)
    train(rl, steps=2, target=1.0)
    shared_path = tmp_path / "rl"
    with pytest.raises(ObjectiveMismatchError, match="holds 'rl' optimizer state") as info:
        store.acquire(ResidentKey("s", "sft", shared_path), model, adamw)
    assert "Nothing was loaded" in str(info.value)
    assert store.resident is rl


def test_checkpoint_for_other_parameters_is_refused_and_model_is_untouched(tmp_path):
    writer = ResidentOptimizerStore()
    other = TinyLoRA(dim=16, rank=2)
    writer.acquire(ResidentKey("s", "rl", tmp_path / "p"), other, adamw).save(1)
    model = TinyLoRA()
    before = model.lora_A.detach().clone()
    with pytest.raises(TrainableStateError, match="other shape"):
        ResidentOptimizerStore().acquire(ResidentKey("s", "rl", tmp_path / "p"), model, adamw)
    assert torch.equal(model.lora_A, before)


def test_legacy_optimizer_only_shard_is_loaded(tmp_path):
    model = TinyLoRA()
    opt = adamw([model.lora_A, model.lora_B])
    (model(torch.ones(2, 16)) - 1).pow(2).mean().backward()
    opt.step()
    (tmp_path / "legacy").mkdir()
    torch.save(opt.state_dict(), tmp_path / "legacy" / "00-of-01.pt")
    state = ResidentOptimizerStore().acquire(
        ResidentKey("s", "rl", tmp_path / "legacy"), model, adamw
    )
    assert state.residency is Residency.LOADED
    assert torch.equal(
        state.optimizer.state[model.lora_A]["exp_avg"], opt.state[model.lora_A]["exp_avg"]
    )


def test_a_failed_job_is_not_reused_and_the_next_job_loads_the_last_commit(tmp_path):
    store = ResidentOptimizerStore()
    model = TinyLoRA()
    key = ResidentKey("s", "rl", tmp_path / "a")
    job = store.acquire(key, model, adamw)
    train(job, steps=5, target=1.0)  # saves step 5
    committed = snapshot(job)
    with pytest.raises(RuntimeError, match="reward service"):
        train(job, steps=3, target=2.0, fail_after=1)  # steps 6 done, 7 half-done, no save
    assert not same(snapshot(job), committed)
    again = store.acquire(key, model, adamw)
    assert again.residency is Residency.LOADED and again.step == 5
    assert "previous job failed after step 5" in again.reason
    assert same(snapshot(again), committed)


def test_key_fields_are_validated():
    with pytest.raises(ValueError, match="objective"):
        ResidentKey("s", "", "/tmp/x")
