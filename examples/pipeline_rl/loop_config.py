"""The loop's settings, one typed object shared by the driver (`run.py`) and the trainer.

The driver writes it as JSON into the run directory; the trainer (another virtual environment,
another Python) reads it back. Everything a run depends on is here, seeds included.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

#: `device` values: "auto" is CUDA when the trainer process sees a GPU, else CPU
DEVICES = ("auto", "cuda", "cpu")
LOOPBACK = "127.0.0.1"
#: How full-weight versions may travel (`--transport`).
TRANSPORTS = ("files", "gloo", "nixl")
#: `stream_keep` values (`art_megatron_ext.weights.kept_version.KEEP_WHERE`; this module stays
#: importable without torch)
STREAM_KEEP = ("device", "pinned_host", "files")
#: addresses a server's workers cannot connect to (a listener's "any address")
_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def default_trainer_host() -> str:
    """run.py's default for `trainer_host`: VLLM_HOST_IP when set, else loopback.

    Why: with `--transport gloo` the server's workers connect to the trainer (rank 0 hosts
    the weight-transfer group), so the address must be one they can reach. VLLM_HOST_IP is
    the address vLLM's own multi-node set-ups give a host for its workers' connections; where
    it is set on the trainer's host, that host is reachable from the workers at it. Loopback
    only reaches workers on the trainer's own host: right for the demo and the tests, wrong
    for a server on another machine (then pass --trainer-host)."""
    return os.environ.get("VLLM_HOST_IP") or LOOPBACK


@dataclass(frozen=True)
class LoopConfig:
    run_dir: str  # everything the run writes: adapters, optimizer checkpoints, metrics, plot
    hf_model: str  # the tiny model (HF directory): the server serves it, the trainer loads it
    init_adapter: str  # PEFT adapter both sides start from (served as version 0 of the slot)
    steps: int = 40
    slot: str = "policy"  # the slot rollouts sample from
    publish_slot: str = "policy"  # where updates go; anything else breaks the loop (a test)
    group_size: int = 8  # completions per prompt (one GRPO group)
    groups_per_step: int = 4  # accepted groups per optimizer step
    target_every: int = 32  # the task's target set: every `target_every`-th token id
    prompt_len: int = 8
    completion_len: int = 16
    max_policy_age: int = 4  # tokens older than this are not trained (per token, batches.py)
    rollout_workers: int = 2
    queue_capacity: int = 8  # groups; workers block when it is full
    seq_len: int = 256  # packed row length
    attention: str = "tree"  # "tree": tree core attention (no S x S mask); "dense": mask
    lr: float = 5e-2
    clip_eps: float = 0.2  # PPO clip around the proximal policy (grpo.py)
    tis_cap: float = 2.0  # truncation of the proximal/behaviour importance weight (TIS)
    temperature: float = 1.0  # sampling temperature; the trainer divides its logits by it
    dp: int = 2  # data-parallel trainer ranks (Megatron DDP + DistributedOptimizer)
    #: where each trainer rank runs: "auto" (its LOCAL_RANK's GPU when it sees one, else the
    #: CPU), "cuda" or "cpu"; NCCL between GPUs, gloo between CPU ranks (placement.py)
    device: str = "auto"
    overlap: bool = True  # overlap_grad_reduce and overlap_param_gather
    bucket_size: int = 2048  # DDP bucket elements: LoRA spans several buckets, as at scale
    lease_eval_step: int = 3  # pin version N after step N, evaluate it exactly (0: off)
    save_interval: int = 5  # optimizer checkpoint every N steps (and on the final step)
    seed: int = 0
    server_dtype: str = "float32"  # the trainer computes in float32; bfloat16 breaks parity
    autotune: bool = False
    push: bool = False  # send each version's files with the update instead of its path
    max_rollout_workers: int = 4  # the autotuner's absolute worker cap
    autotune_on_bad_metrics: str = "hold"  # or "raise" (strict); see autotune_hook.py
    fresh_ratio_tolerance: float = 1e-3  # |ratio - 1| allowed on age-0 tokens (parity check)
    #: "lora": train and publish the LoRA slot; "full": train every weight and publish them as
    #: full-weight updates (`/art/v1/weights/update`), rollouts on the base model
    update: str = "lora"
    full_lr: float = 2e-3  # Adam's learning rate when every weight trains (`update="full"`)
    #: How versions travel: "files" (RUN_DIR/adapters or RUN_DIR/weights/v<N>, read by the
    #: server; with `push` the adapter's files go in the request), "gloo" (streamed to the
    #: server's workers over the art_gloo weight-transfer group) or "nixl" (the art_nixl
    #: engine: the workers READ the trainer's registered buckets over NIXL; `pip install
    #: 'art-pipeline[nixl]'` on both sides); streamed, the server reads nothing of RUN_DIR.
    #: Full weights and LoRA adapters alike (an adapter's stream: `send_adapter`)
    transport: str = "files"
    #: streamed (`transport` "gloo" or "nixl"): the address the server's workers reach the
    #: trainer's rank 0 at (it hosts the group there: `GlooWeightSender.connect(host=)`,
    #: `NixlWeightSender.connect(host=)`); run.py's default is `default_trainer_host()`
    trainer_host: str = LOOPBACK
    #: streamed: where rank 0 keeps the version while it streams in the background
    #: (`art_megatron_ext.weights.keep_version`): "device" (beside the parameters: GPU spare
    #: memory on a GPU, no host copy), "pinned_host" (page-locked host memory) or "files"
    #: (RUN_DIR/weights/v<N>, read back a shard at a time: nothing kept in memory)
    stream_keep: str = "device"

    def __post_init__(self) -> None:
        if self.update not in ("lora", "full"):
            raise ValueError(f"update must be 'lora' or 'full', got {self.update!r}")
        if self.update == "full" and self.push:
            raise ValueError(
                "--push sends a LoRA adapter's files; full-weight updates go by path "
                "(RUN_DIR/weights/v<N>, under the server's --art-adapter-root)"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.transport != "files" and self.push:
            raise ValueError(
                f"--push sends each version's files in the request; --transport "
                f"{self.transport} streams its tensors instead: give one of them"
            )
        if self.stream_keep not in STREAM_KEEP:
            raise ValueError(f"stream_keep must be one of {STREAM_KEEP}, got {self.stream_keep!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.trainer_host.strip() in _WILDCARDS:
            raise ValueError(
                f"trainer_host {self.trainer_host!r} is no address the server's workers can "
                "connect to: give this host's address on their network"
            )
        if self.attention not in ("tree", "dense"):
            raise ValueError(f"attention must be 'tree' or 'dense', got {self.attention!r}")
        if self.steps < 1 or self.group_size < 2 or self.dp < 1:
            raise ValueError(f"need steps >= 1, group_size >= 2, dp >= 1: {self}")
        if self.groups_per_step < self.dp:
            raise ValueError(
                f"groups_per_step {self.groups_per_step} < dp {self.dp}: every data-parallel "
                "rank trains on at least one group"
            )
        if self.temperature <= 0 or self.tis_cap < 1:
            raise ValueError(
                f"need temperature > 0 (got {self.temperature}) and tis_cap >= 1 (got "
                f"{self.tis_cap})"
            )
        if self.prompt_len + self.group_size * self.completion_len > self.seq_len:
            raise ValueError(
                f"one group ({self.prompt_len} + {self.group_size} x {self.completion_len} "
                f"tokens) must fit a packed row of seq_len {self.seq_len}"
            )

    @property
    def path(self) -> Path:
        return Path(self.run_dir)

    @property
    def full(self) -> bool:
        return self.update == "full"

    @property
    def streamed(self) -> bool:
        return self.transport != "files"

    @property
    def transfer_backend(self) -> str:
        """The server's `--weight-transfer-config` backend of a streamed transport."""
        from art_protocol.weight_transfer import GLOO_BACKEND, NIXL_BACKEND

        return {"gloo": GLOO_BACKEND, "nixl": NIXL_BACKEND}[self.transport]

    @property
    def model_name(self) -> str:
        """What rollouts ask the server for: the slot, or the base model itself (full)."""
        return self.hf_model if self.full else self.slot

    @property
    def learning_rate(self) -> float:
        return self.full_lr if self.full else self.lr

    def save(self) -> Path:
        out = self.path / "loop_config.json"
        out.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return out

    @classmethod
    def load(cls, path: str | Path) -> LoopConfig:
        return cls(**json.loads(Path(path).read_text()))
