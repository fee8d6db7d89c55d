"""The commit of a staged shard (`shard_stage.ShardStage`): a copy where the served form is the
loaded form, vLLM's per-layer rebuild where it is not.

Per module the stream wrote (`compat.shard_forms.plain_copy_applies` decides, once per
module, from the module itself: no checkpoint is read):
- `copy`: the staged tensors are copied into the served ones (`Tensor.copy_`: host-to-device
  from pinned memory on GPUs, a memcpy on CPU), keeping every tensor's storage, so CUDA
  graphs captured on them stay valid. Applies where nothing processes the weights after
  loading: unquantized layers on CUDA, and on every platform the layers without a quant
  method (norms);
- `rebuild`: the layer is rebuilt from the staged shard by vLLM's own per-layer steps and
  processed again (`compat.shard_forms.rebuild_layer`): quantized layers, attention layers,
  and on CPU every linear layer and embedding (the CPU build packs their GEMM weights for
  oneDNN: `dispatch_cpu_unquantized_gemm` sets `cpu_linear` and, for linear layers, empties
  `weight`).

Either way the write runs in vLLM's config context with the runner's config, as vLLM's own
reloads do. A failure part-way leaves the failing layer with its served tensors and a clean
reload state; the caller then writes a whole version back (`base_weights._write_back`).
`describe` is what `GET /art/v1/weights` reports per worker.
"""

from __future__ import annotations

from collections import Counter

from art_vllm_plugin import compat
from art_vllm_plugin.compat import shard_forms

COPY = "copy"
REBUILD = "rebuild"


class InjectedCommitFailure(RuntimeError):
    """The `commit` test fault, raised after the first module of a shard commit was written."""


def paths(stage) -> dict[int, tuple[str, str]]:
    """(path, why) for every module the stage wrote, by module identity."""
    out = {}
    for module, staged in stage.by_module():
        ok, why = shard_forms.plain_copy_applies(module, staged)
        out[id(module)] = (COPY if ok else REBUILD, why)
    return out


def commit(worker, stage, fail_after_first: bool = False) -> dict:
    """Write the staged shard into the served tensors; returns how many modules and bytes
    took each path. `fail_after_first`: the `commit` test fault."""
    runner = compat.worker_model_runner(worker)
    chosen = paths(stage)
    counts: Counter = Counter()
    nbytes: Counter = Counter()
    with shard_forms.vllm_config_context(runner.vllm_config):
        for i, (module, staged) in enumerate(stage.by_module()):
            path = chosen[id(module)][0]
            if path == COPY:
                for name, tensor in staged.items():
                    module._parameters[name].data.copy_(tensor, non_blocking=True)
            else:
                shard_forms.rebuild_layer(module, staged)
            counts[path] += 1
            nbytes[path] += sum(t.numel() * t.element_size() for t in staged.values())
            if fail_after_first and i == 0:
                raise InjectedCommitFailure(
                    f"injected commit failure on rank {compat.worker_rank(worker)} after the "
                    "first module of a shard commit (test hook)"
                )
    return {p: {"modules": counts[p], "bytes": nbytes[p]} for p in (COPY, REBUILD)}


def describe(stage_or_entries_paths: dict) -> dict:
    """{"copy": n, "rebuild": m, "why": {reason: modules}} from `paths`' answer."""
    counts = Counter(p for p, _ in stage_or_entries_paths.values())
    why = Counter(f"{p}: {w}" for p, w in stage_or_entries_paths.values())
    return {COPY: counts[COPY], REBUILD: counts[REBUILD], "why": dict(sorted(why.items()))}
