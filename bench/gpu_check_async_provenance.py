"""GPU check: provenance under vLLM's default async scheduling, and the device-staged commit.

Needs vLLM + a CUDA GPU (the serving env on a lent device). On a GPU vLLM 0.32 schedules with a
batch queue of 2 by default; this builds the real EngineCore in-process (async scheduling as
the platform chose it, not forced), drives its step loop as `EngineCoreProc.run_busy_loop`
does, and publishes an adapter between two steps while a batch is in flight:

- every token's label is the version of the weights that computed it: the in-flight batch
  keeps the old version, its tokens equal the old adapter's greedy tokens, and the new weights
  change the following tokens;
- the worker staged the adapter on the device (side stream), so the commit call's time, the
  engine stall, is printed next to the mean step time.

Usage: python bench/gpu_check_async_provenance.py [--tiny .cache/tiny]
Exit code 0 when every check passes, 1 when one fails, 2 when there is no GPU / vLLM.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11, 12]
TOKENS = 32
LORA_ID = 1


def _needs() -> str | None:
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError as exc:
        return f"needs vLLM + GPU: {exc}"
    if not torch.cuda.is_available():
        return "needs vLLM + GPU: torch.cuda.is_available() is False"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", type=Path, default=Path(".cache/tiny"))
    args = parser.parse_args()
    if (why := _needs()) is not None:
        print(f"[gpu_check_async_provenance] SKIP: {why}")
        return 2
    os.environ["VLLM_PLUGINS"] = "art"
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.executor import Executor

    from art_protocol.provenance import slot_version
    from art_vllm_plugin import compat, plugin_loader, staging
    from art_vllm_plugin.adapters import read_adapter_files

    if not (args.tiny / "model" / "config.json").exists():
        from art_vllm_plugin.tiny_model import generate

        generate(args.tiny)
    model, adapters = args.tiny / "model", args.tiny / "adapters"
    plugin_loader.activate()
    config = EngineArgs(
        model=str(model),
        enable_lora=True,
        max_lora_rank=8,
        max_loras=1,
        dtype="bfloat16",
        max_model_len=512,
        gpu_memory_utilization=0.3,
    ).create_engine_config()
    print(
        f"async_scheduling={config.scheduler_config.async_scheduling} "
        f"max_concurrent_batches={config.max_concurrent_batches}"
    )
    core = compat.engine_core_class()(config, Executor.get_class(config), log_stats=False)
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            failures.append(what)

    def add(request_id: str) -> None:
        req = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(PROMPT_IDS),
            mm_features=None,
            sampling_params=SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True),
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=compat.lora_request(
                lora_name="policy", lora_int_id=LORA_ID, lora_path=str(adapters / "a")
            ),
            cache_salt=None,
            data_parallel_rank=None,
        )
        core.add_request(*core.preprocess_add_request(req))

    def collect(outputs, out: list) -> None:
        for eco in (outputs or {}).values():
            for o in eco.outputs:
                out += [(t, slot_version(eco.weight_version, LORA_ID)) for t in o.new_token_ids]

    def run_to_end(out: list) -> None:
        for _ in range(10 * TOKENS):
            outputs, _ = core.step_fn()
            collect(outputs, out)
            if not core.scheduler.has_requests() and not core.batch_queue:
                return
        failures.append("request did not finish")

    try:
        check(core.batch_queue is not None, "EngineCore runs a batch queue (async scheduling)")
        reference: list = []
        add("reference")
        run_to_end(reference)
        tokens: list = []
        add("updated")
        for _ in range(8):
            outputs, _ = core.step_fn()
            collect(outputs, tokens)
        returned, inflight = len(tokens), len(core.batch_queue or ())
        check(inflight >= 1, f"a batch is in flight at the update ({inflight})")
        with tempfile.TemporaryDirectory() as tmp:
            token = uuid.uuid4().hex
            stage_dir = staging.new_stage_dir(staging.StagingConfig(Path(tmp)), "policy", 1)
            staging.write_files(stage_dir, read_adapter_files(adapters / "b").as_files())
            res = core.art_stage_lora_update(token, LORA_ID, "policy", str(stage_dir), 1)
            while len(staging.poll(stage_dir, res["ranks"])[0]) < len(res["ranks"]):
                failed = staging.poll(stage_dir, res["ranks"])[1]
                if failed:
                    raise RuntimeError(f"staging failed: {failed}")
                time.sleep(0.005)
            result = core.art_commit_lora_update(token)
        check(result["ok"], f"commit ok ({result.get('error', '')})")
        run_to_end(tokens)
        versions = [v for _, v in tokens]
        k = versions.index(1) if 1 in versions else len(versions)
        check(
            k == returned + inflight,
            f"in-flight batch labelled old: k={k}, returned={returned}, inflight={inflight}",
        )
        ids, ref = [t for t, _ in tokens], [t for t, _ in reference]
        check(ids[:k] == ref[:k], "tokens labelled old equal the old adapter's greedy tokens")
        check(ids[k : k + 8] != ref[k : k + 8], "the new weights change the next tokens")
        state = core.art_slot_state()
        print(
            f"engine stall of the update: {result['stall_ms']:.3f} ms "
            f"(commit {result['engine_ms']:.3f} ms); mean step {state['mean_step_ms']} ms"
        )
    finally:
        core.shutdown()
    print("PASS" if not failures else f"FAIL: {failures}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
