"""An adapter with expert weights can be updated in flight: the worker writes what vLLM's own
load writes, bit for bit, on every tensor-parallel rank, and copies only the rank's shard.

Why no server: vLLM's CPU build cannot run expert LoRA at all (measured on Model Runner V2
under the Triton interpreter: the first forward dies on `_moe_C.moe_align_block_size`, absent
from the CPU build; the CPU punica wrapper has no `add_lora_w13`), so `worker/moe_lora_cpu.py`
refuses it at start. Each rank here is vLLM's own `CPUModelRunner` with LoRA on the tiny
Qwen3-MoE (`.cache/tiny/moe`: 3 layers, layer 0 dense, 8 experts, top-2): real
`FusedMoEWithLoRA` layers and vLLM's LoRA manager, built and never run
(`expert_update_worker.py`, one process per rank). Index 0 gets adapter `b` through the
plugin's stage and commit (over `a`), index 1 gets `b` from vLLM's own activation; every
stacked tensor of every LoRA layer must then be equal at the two indices.

- `export`: adapters laid out as `art_megatron_ext.lora.export` writes them (one module per
  expert, `mlp.experts.<e>.{gate,up,down}_proj`, its `adapter_config`), tensor parallel 2:
  both ranks commit, every tensor equal, and the bytes staged for the device on each rank are
  the rank's shard of the adapter, not the whole (column-parallel B and row-parallel A are
  halved: q/k/v/gate/up B, o/down A, experts included).
- `fused-3d`: vLLM's fused 3-D expert layout (`mlp.experts.base_layer` = gate_up,
  `mlp.experts` = down) on an engine with `--enable-mixed-moe-lora-format`, loaded with
  `is_3d_lora_weight`: the update must stage with the slot's flag (vLLM refuses fused 3-D
  weights without it).

Runner-independent: the LoRA manager and layers are the same under both model runners (the
runner objects share `LoRAModelRunnerMixin`), so the ranks run without Triton on either.

Each rank is a fork of one interpreter that imported the vLLM modules the ranks build on
(`support.vllm_forks`, module scope): three ranks, one vLLM import.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.vllm_forks import Case, Forker

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("expert_update_worker.py")
ADAPTERS = Path(__file__).with_name("moe_adapters.py")
MOE = REPO / ".cache" / "tiny" / "moe"
#: Runner selection of the serve suite: the ranks build the CPU runner object themselves.
RUNNER_ENV = ("VLLM_USE_V2_MODEL_RUNNER", "TRITON_INTERPRET", "ART_TEST_TRITON_PATHS")
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # B split over ranks
ROW = ("o_proj", "down_proj")  # A split over ranks


def _adapters(tmp: Path, *flags: str) -> tuple[Path, Path]:
    """Adapters `a` and `b` of the tiny MoE (`moe_adapters.py`, in a process of its own)."""
    if not (MOE / "config.json").exists():
        from art_vllm_plugin.tiny_model import generate

        generate(MOE.parent)
    cmd = [sys.executable, str(ADAPTERS), "--model", str(MOE), "--out", str(tmp), *flags]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return tmp / "a", tmp / "b"


def _numels(adapter: Path) -> dict[str, int]:
    from safetensors import safe_open

    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        names = f.keys()
        return {k: math.prod(f.get_slice(k).get_shape()) for k in names}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What the ranks import before they fork (`expert_update_worker._build_runner`'s imports).
PRELOAD = (
    "torch",
    "vllm.config",
    "vllm.distributed",
    "vllm.engine.arg_utils",
    "vllm.v1.worker.cpu_model_runner",
)


@pytest.fixture(scope="module")
def ranks():
    """The interpreter the ranks fork from: this process's environment without the serve
    suite's runner selection, and the variables every vLLM run gets."""
    env = {k: v for k, v in os.environ.items() if k not in RUNNER_ENV}
    env.update(VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1")
    env.update(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    with Forker(PRELOAD, env=env, unset=("VLLM_DIST_IDENT",), timeout_s=300) as forker:
        yield forker


def _run_ranks(ranks: Forker, tmp: Path, a: Path, b: Path, tp: int, *extra: str) -> list[dict]:
    """Run `expert_update_worker.py` for every rank at once; each rank's JSON answer."""
    port, cases, outs = _free_port(), [], []
    env = {"VLLM_DIST_IDENT": f"art-expert-update-{port}"}  # the CPU worker sets it (SHM group)
    for rank in range(tp):
        out, log = tmp / f"rank{rank}.json", tmp / f"rank{rank}.log"
        argv = [str(WORKER), "--model", str(MOE), "--a", str(a), "--b", str(b)]
        argv += ["--tp", str(tp), "--rank", str(rank), "--port", str(port), "--out", str(out)]
        # as `python expert_update_worker.py ARGS` runs it: argv, and its folder first on the path
        code = f"import runpy, sys\nsys.argv = {[*argv, *extra]!r}\n"
        code += f"sys.path[0] = {str(WORKER.parent)!r}\n"
        code += f"runpy.run_path({str(WORKER)!r}, run_name='__main__')\n"
        cases.append(Case(code, env, log=str(log)))
        outs.append((out, log))
    codes = [done.returncode for done in ranks.run(cases, together=True)]
    results = []
    for (out, log), code in zip(outs, codes, strict=True):
        tail = log.read_text(errors="replace")[-3000:]
        assert out.exists(), f"rank {len(results)} wrote no answer (exit {code}):\n{tail}"
        results.append(json.loads(out.read_text()))
        assert code == 0, f"rank {len(results) - 1} exited {code}: {results[-1]}\n{tail}"
    return results


def _check_same_as_vllm(result: dict, rank: int) -> None:
    assert result["stage_error"] is None, f"rank {rank}: {result['stage_error']}"
    assert result["commit"] == {"ok": True, "rank": rank, "index": 0}, result["commit"]
    experts = [k for k in result["compared"] if ".experts." in k]
    assert len(experts) == 2 * 7, experts  # 2 MoE layers: w13 A/B x2 (gate, up), w2 A/B, flag
    assert result["differ"] == [], f"rank {rank}: index 0 differs from vLLM's load of b"
    assert len(result["changed"]) == 2 * 6, result["changed"]  # a and b differ on each one


@pytest.mark.timeout(600)
def test_expert_adapter_export_layout_tp2_writes_vllms_tensors_and_copies_the_shard(
    ranks, tmp_path
):
    a, b = _adapters(tmp_path)
    results = _run_ranks(ranks, tmp_path, a, b, 2)
    numels = _numels(b)
    whole, shard = sum(numels.values()), 0
    for key, numel in numels.items():
        proj, factor = key.split(".lora_")[0].rsplit(".", 1)[-1], key.split(".lora_")[1][0]
        split = (factor == "B" and proj in COLUMN) or (factor == "A" and proj in ROW)
        shard += numel // 2 if split else numel
    for rank, result in enumerate(results):
        _check_same_as_vllm(result, rank)
        # the staged device copy is this rank's shard: its share of the whole, in bytes
        assert result["device_bytes"] * whole == shard * result["whole_bytes"], (
            f"rank {rank}: {result['device_bytes']} bytes staged for the device, the shard is "
            f"{shard * result['whole_bytes'] // whole} of {result['whole_bytes']}"
        )
        assert result["device_bytes"] < result["whole_bytes"]


@pytest.mark.timeout(600)
def test_fused_3d_expert_adapter_stages_with_the_slots_is_3d_flag(ranks, tmp_path):
    a, b = _adapters(tmp_path, "--fused-3d")
    (result,) = _run_ranks(ranks, tmp_path, a, b, 1, "--mixed-3d")
    _check_same_as_vllm(result, 0)
    assert result["device_bytes"] == result["whole_bytes"]  # one rank: its shard is the whole
