"""The shared server configurations of the serve suite (`tests/support/server_pool.py`).

Each kind says which modules share it and why its flags are what they are. A module uses a
kind through the fixture `<name>_server`; the order here is the order the kinds run in.
Start adapters are copied under the kind's directory (`<root>/start/<slot>`), inside an
allowed adapter root, so the hand-over can re-publish them.

Every kind either has an API key (`keyed`) or runs with `--art-allow-unauthenticated`
(`OPEN`): a server without a key refuses state-changing `/art` requests by default (the
hand-over itself publishes), and these servers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from support.server_pool import Kind, KindPaths

#: The API key of the `keyed` server.
KEYED_API_KEY = "shared-s3cret-key"
#: The flag of every kind without a key (see the module docstring); the same as
#: `serve_process.ALLOW_UNAUTHENTICATED`, spelled out because this module imports no plugin
#: code at import time (it loads in both environments).
OPEN = ("--art-allow-unauthenticated",)
#: Ceiling for a shared server's start (two cores shared with the train suite and other jobs).
STARTUP_CEILING_S = 900.0


def _two_cpus() -> str:
    """One OpenMP core per worker (vLLM cannot pick two NUMA nodes on this host)."""
    cpus = sorted(os.sched_getaffinity(0))
    return f"{cpus[0]}|{cpus[1 % len(cpus)]}"


def _starts(start: Path, adapters: Path, slots: dict[str, str]) -> dict[str, Path]:
    """Copy tiny adapter `slots[slot]` to `start/<slot>` once; slot -> directory."""
    out = {}
    for slot, name in slots.items():
        dst = start / slot
        if not dst.exists():
            shutil.copytree(adapters / name, dst)
        out[slot] = dst
    return out


def _modules(starts: dict[str, Path]) -> tuple[str, ...]:
    return ("--lora-modules", *(f"{slot}={path}" for slot, path in starts.items()))


#: vLLM 0.34's Model Runner V2 warms up with a dummy batch of `--max-num-batched-tokens` tokens
#: and a sampler run of `--max-num-seqs` requests, each through Triton's interpreter here: on
#: the tiny LoRA server that took 92 s of a 133 s start on a quiet host, and 14 s of 56 s with
#: these two (2026-12-08). No shared server's test runs more than 16 requests at once.
SMALL_WARMUP_34 = {"--max-num-seqs": 16, "--max-num-batched-tokens": 512}


def _vllm_034() -> bool:
    """Whether the installed vLLM is 0.34 or later (its metadata, no vLLM import)."""
    from importlib.metadata import version

    return tuple(int(x) for x in version("vllm").split(".")[:2]) >= (0, 34)


def _small_warmup(args: tuple[str, ...]) -> tuple[str, ...]:
    """`args` plus SMALL_WARMUP_34 on vLLM 0.34 (unless `args` set them); the batched tokens
    cover `--max-model-len`."""
    if not _vllm_034():
        return args
    extra: list[str] = []
    for flag, value in SMALL_WARMUP_34.items():
        if flag in args:
            continue
        if flag == "--max-num-batched-tokens" and "--max-model-len" in args:
            value = max(value, int(args[args.index("--max-model-len") + 1]))
        extra += [flag, str(value)]
    return (*args, *extra)


def _config(model: Path, args, env, **kw):
    from art_vllm_plugin import serve_process

    return serve_process.ServeConfig(
        model=str(model),
        args=_small_warmup(tuple(str(a) for a in args)),
        env=env,
        startup_timeout_s=STARTUP_CEILING_S,
        **kw,
    )


# -- lora: the plain plugin server --------------------------------------------------------
LORA_SLOTS = {"policy": "a", "other": "a", "ref_a": "a", "ref_b": "b"}


def _lora_slots(p: KindPaths) -> dict[str, Path]:
    return _starts(p.start, p.tiny_adapters, LORA_SLOTS)


def _lora(p: KindPaths):
    from art_vllm_plugin.serve_process import tiny_lora_args

    return _config(
        p.tiny_model,
        (
            # three device slots: `policy` and the references `ref_a`, `ref_b` stay resident
            *tiny_lora_args(max_loras=3),
            *_modules(_lora_slots(p)),
            *("--art-adapter-root", p.tiny_adapters, "--art-adapter-root", p.root),
            *OPEN,
        ),
        # Selected through the environment, not `--plugin art` (test_capabilities checks that
        # this works); vLLM's dev-mode /pause, /resume and /reset_prefix_cache; the test hooks;
        # vLLM's runtime /v1/load_lora_adapter and /v1/unload_lora_adapter
        # (test_stock_lora_routes).
        {
            "VLLM_PLUGINS": "art",
            "VLLM_SERVER_DEV_MODE": "1",
            "ART_TEST_HOOKS": "1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        },
        plugin=False,
        unset_env=(),
    )


# -- keyed: an API key, an adapter root and a trainer path map -----------------------------
def _keyed_slots(p: KindPaths) -> dict[str, Path]:
    return _starts(p.root / "allowed" / "start", p.tiny_adapters, {"policy": "a", "ref_b": "b"})


def _keyed(p: KindPaths):
    from art_vllm_plugin.serve_process import tiny_lora_args

    allowed = p.root / "allowed"
    (p.root / "outside").mkdir(parents=True, exist_ok=True)
    return _config(
        p.tiny_model,
        (
            # max_cpu_loras 3: the two slots and one exact lease (test_leases fills it)
            *tiny_lora_args(max_loras=2),
            *("--max-cpu-loras", "3"),
            *_modules(_keyed_slots(p)),
            *("--api-key", KEYED_API_KEY),
            *("--art-adapter-root", allowed, "--art-path-map", f"/trainer/ckpts={allowed}"),
        ),
        # vLLM's dev-mode /is_paused and /resume, the step hold (tests/support/step_hold.py)
        {"VLLM_SERVER_DEV_MODE": "1", "ART_TEST_HOOKS": "1"},
    )


# -- one_seq: one request at a time, one LoRA slot, small prefix-cache blocks -----------------
ONE_SEQ_SLOTS = {"policy": "a", "other": "c", "ref_a": "a", "ref_b": "b", "ref_c": "c"}


def _one_seq_slots(p: KindPaths) -> dict[str, Path]:
    return _starts(p.start, p.tiny_adapters, ONE_SEQ_SLOTS)


def _one_seq(p: KindPaths):
    from art_vllm_plugin.serve_process import tiny_lora_args

    return _config(
        p.tiny_model,
        (
            # every switch of slot evicts the previous adapter from the GPU and CPU caches
            *tiny_lora_args(max_loras=1),
            *("--max-cpu-loras", "1"),
            # one request runs, the others wait (batch of one: exactly reproducible tokens)
            *("--max-num-seqs", "1"),
            # prefix caching observable on short prompts, cached tokens reported
            *("--block-size", "32", "--enable-prompt-tokens-details"),
            *_modules(_one_seq_slots(p)),
            *("--art-adapter-root", p.tiny_adapters, "--art-adapter-root", p.root),
            *OPEN,
        ),
        {"VLLM_SERVER_DEV_MODE": "1"},
    )


# -- two_slots: two device slots for four resident LoRA modules, and a hub-id module ---------
# test_lease_capacity: `--max-loras 2` for four LoRA modules, all resident in the CPU cache
# (`--max-cpu-loras 6`), is the shape under test (the other kinds keep their references on the
# device or have room for one lease only). test_hub_lora_modules: a `--lora-modules` entry
# that is a hub id, resolved at start from a local hub cache (HUB_ID at HUB_COMMIT, adapter
# b's files; `HF_HUB_OFFLINE=1` as everywhere), and `--art-cpu-layout off`. One server for
# both (they had one each): neither flag changes what the other module checks.
TWO_SLOTS = {"policy": "a", "shadow": "b", "ref_a": "a", "ref_c": "c"}
#: The hub id of the `two_slots` kind's hub module (`hub`) and its snapshot's commit.
HUB_ID = "fakeorg/tiny-lora-b"
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _two_slots_slots(p: KindPaths) -> dict[str, Path]:
    return _starts(p.start, p.tiny_adapters, TWO_SLOTS)


def _hub_cache(p: KindPaths) -> Path:
    """A local Hugging Face hub cache holding HUB_ID at HUB_COMMIT (adapter b's files)."""
    cache = p.root / "hf" / "hub"
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    if not (repo / "refs" / "main").exists():
        shutil.copytree(p.tiny_adapters / "b", repo / "snapshots" / HUB_COMMIT)
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(HUB_COMMIT)
    return cache


def _two_slots(p: KindPaths):
    from art_vllm_plugin.serve_process import tiny_lora_args

    return _config(
        p.tiny_model,
        (
            *tiny_lora_args(max_loras=2),
            # every adapter stays resident; only the device slots (2) are scarce
            *("--max-cpu-loras", "6"),
            *_modules(_two_slots_slots(p)),
            f"hub={HUB_ID}",  # one more `--lora-modules` entry
            *("--art-cpu-layout", "off"),
            *("--art-adapter-root", p.tiny_adapters, "--art-adapter-root", p.root),
            *OPEN,
        ),
        # vLLM's dev-mode /pause and /resume (test_lease_capacity)
        {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_CACHE": str(_hub_cache(p)), "HF_HUB_OFFLINE": "1"},
    )


# -- tp2: two tensor-parallel workers --------------------------------------------------------
def _tp2_slots(p: KindPaths) -> dict[str, Path]:
    return _starts(p.start, p.tiny_adapters, {"policy": "a", "ref_b": "b"})


def staging_budget(model: Path) -> int:
    """`--art-weights-staging-bytes` of the tp kinds: 3/4 of the model in float32, so a worker of
    `-tp 2` fits one streamed version's shard (about half the model) and refuses a second one
    beside the held undo (507; test_shard_staging checks both)."""
    import math

    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        numel = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    return numel * 4 * 3 // 4


def tp_config(p: KindPaths, tp: int, log_path: Path | None = None):
    """`-tp N` on the tiny model, float32: bf16 sums split over two ranks round differently
    and greedy tokens drift apart after a few dozen tokens; float32 keeps the sharded sums
    equal to the whole (test_tensor_parallel compares -tp 2 with -tp 1). The art_nixl
    weight-transfer engine and a staging budget for test_shard_staging (the last module on
    it: it streams full weights to the two workers over NIXL, each of which stages only its
    shard; art_gloo keeps its own tests: test_gloo_wire, test_two_hosts, the example loop)."""
    from art_vllm_plugin.serve_process import tiny_lora_args

    env = {"VLLM_SERVER_DEV_MODE": "1", "ART_TEST_HOOKS": "1"}
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = _two_cpus()
    return _config(
        p.tiny_model,
        (
            *tiny_lora_args(max_loras=2),
            *("--tensor-parallel-size", str(tp), "--dtype", "float32"),
            *("--weight-transfer-config", '{"backend": "art_nixl"}'),
            *("--art-weights-staging-bytes", str(staging_budget(p.tiny_model))),
            *_modules(_tp2_slots(p)),
            *("--art-adapter-root", p.tiny_adapters, "--art-adapter-root", p.root),
            *OPEN,
        ),
        env,
        log_path=log_path,
    )


# -- dp2: two data-parallel engines, two API servers -------------------------------------------
# float32, prompt token details and dev mode for test_full_weight_update (the last module on
# it: it changes the base weights), whose greedy tokens are compared with Hugging Face's;
# the art_nixl weight-transfer engine for test_streamed_weight_update (also last: the DP=2
# full-weight contract over NIXL).
def _dp2_slots(p: KindPaths) -> dict[str, Path]:
    return _starts(p.start, p.tiny_adapters, {"policy": "a", "ref_b": "b"})


def _dp2(p: KindPaths):
    from art_vllm_plugin.serve_process import tiny_lora_args

    return _config(
        p.tiny_model,
        (
            *tiny_lora_args(max_loras=2),
            *("--data-parallel-size", "2", "--dtype", "float32"),
            "--enable-prompt-tokens-details",
            *("--weight-transfer-config", '{"backend": "art_nixl"}'),
            *("--max-cpu-loras", "3"),  # slots policy and ref_b, and one lease copy
            *_modules(_dp2_slots(p)),
            *("--art-adapter-root", p.tiny_adapters, "--art-adapter-root", p.root),
            *OPEN,
        ),
        {"ART_TEST_HOOKS": "1", "VLLM_SERVER_DEV_MODE": "1", **_dp_binding()},
    )


def _dp_binding() -> dict[str, str]:
    """How the two DP engines' workers bind to this host's cores. vLLM 0.32 takes an explicit
    list (one core each). vLLM 0.34 binds each DP engine to a NUMA node of its own
    (`parallel_config.assigned_physical_gpu_ids`): on this one-node host engine 1 dies at
    start (`IndexError` in cpu_worker.py); its NUMA simulation (`VLLM_CPU_SIM_MULTI_NUMA`)
    places both on node 0, and needs vLLM's automatic binding (it asserts it)."""
    if _vllm_034():
        return {"VLLM_CPU_SIM_MULTI_NUMA": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
    return {"VLLM_CPU_OMP_THREADS_BIND": _two_cpus()}


def _dp_binding_leaving_a_core() -> dict[str, str]:
    """`_dp_binding`, except on a host of two cores under vLLM 0.32: there both DP engines'
    workers go on the last core, and the first stays for the API server and the test.

    Why: with one worker bound to each core, an MoE model's engines step in lock step (the idle
    one runs dummy batches) and keep both cores busy; on this host the processes bound to
    neither (API server, test client) then got no CPU until the generation ended (a probe
    process's run-queue wait, /proc/self/schedstat: 15.4 s of a 15.5 s generation), so an
    update sent mid-generation was admitted after it. Both workers on one core: no probe
    waited over 0.16 s, and the generation took 18 s instead of 16."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 2 or _vllm_034():
        return _dp_binding()
    return {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[-1]}|{cpus[-1]}"}


# -- pp2: two pipeline stages ------------------------------------------------------------------
# Its own kind, not folded into tp2 or dp2: pipeline stages are the subject (every stage must
# agree on a commit, and EngineCore must settle from every stage's answer, issue 36 item 4),
# and tp2's tests compare receipts and tokens with a one-worker engine, dp2's pin requests to
# engines. float32 so Hugging Face's greedy tokens are the reference of the full-weight
# checks; one module uses it (test_pipeline_parallel), and it changes the base weights.
def _pp2_slots(p: KindPaths) -> dict[str, Path]:
    return _starts(p.start, p.tiny_adapters, {"policy": "a", "ref_b": "b"})


def _pp2(p: KindPaths):
    from art_vllm_plugin.serve_process import tiny_lora_args

    return _config(
        p.tiny_model,
        (
            *tiny_lora_args(max_loras=2),
            *("--pipeline-parallel-size", "2", "--dtype", "float32"),
            *_modules(_pp2_slots(p)),
            *("--art-adapter-root", p.tiny_adapters, "--art-adapter-root", p.root),
            *OPEN,
        ),
        {
            "VLLM_SERVER_DEV_MODE": "1",
            "ART_TEST_HOOKS": "1",
            "VLLM_CPU_OMP_THREADS_BIND": _two_cpus(),
        },
    )


# -- ray_tp2: vLLM's Ray executor, two tensor-parallel workers on two Ray nodes ----------------
# Its own kind, not folded into tp2: the executor is the subject (issue 36, item 6: labels
# exact under Ray, whose queue reaches a worker on another node over TCP), and the server
# needs a Ray cluster beside it. One server covers both Ray layouts the issue names: TP=2
# under Ray, and an engine whose workers sit on two Ray nodes (each node has one worker place,
# so the executor must spread them; tests/support/ray_cluster.py). float32 so Hugging Face's
# greedy tokens are the reference of the full-weight check; one module uses it
# (test_ray_executor), and it changes the base weights.
_RAY_CLUSTERS: dict[Path, object] = {}


def _ray_tp2_slots(p: KindPaths) -> dict[str, Path]:
    return _starts(p.start, p.tiny_adapters, {"policy": "a", "ref_b": "b"})


def _ray_tp2(p: KindPaths):
    from art_vllm_plugin.serve_process import tiny_lora_args
    from support import ray_cluster

    _ray_tp2_stop(p)  # a restart after the server died starts a fresh cluster
    env = ray_cluster.server_env(
        {
            "VLLM_SERVER_DEV_MODE": "1",
            "ART_TEST_HOOKS": "1",
            "VLLM_CPU_OMP_THREADS_BIND": _two_cpus(),
        }
    )
    cluster = _RAY_CLUSTERS[p.root] = ray_cluster.start(env, nodes=2)
    return _config(
        p.tiny_model,
        (
            *tiny_lora_args(max_loras=2),
            *("--distributed-executor-backend", "ray", "--tensor-parallel-size", "2"),
            *("--dtype", "float32"),
            *_modules(_ray_tp2_slots(p)),
            *("--art-adapter-root", p.tiny_adapters, "--art-adapter-root", p.root),
            *OPEN,
        ),
        {**env, "RAY_ADDRESS": cluster.address},
        plugin=False,  # VLLM_PLUGINS names art and the test platform (ray_cluster.server_env)
        unset_env=(),
    )


def ray_cluster_of(shared):
    """The local Ray cluster under a running `ray_tp2` server (a `support.ray_cluster.LocalRay`)."""
    return _RAY_CLUSTERS[shared.paths.root]


def _ray_tp2_stop(p: KindPaths) -> None:
    cluster = _RAY_CLUSTERS.pop(p.root, None)
    if cluster is not None:
        cluster.stop()


# -- moe_routes: the tiny Qwen3-MoE with --art-routes, no LoRA ----------------------------------
#: The route response size limit the MoE server runs with (test_route_serving checks the 413).
ROUTES_MAX_BYTES = 16384
#: Prefix-cache block size of the MoE server (a 70-token prompt spans full blocks).
MOE_BLOCK = 32


def _moe_routes(p: KindPaths):
    if not (p.moe_model / "config.json").exists():
        raise FileNotFoundError(f"the tiny MoE model is missing at {p.moe_model}: run `make tiny`")
    return _config(
        p.moe_model,
        (
            # float32 and eager: routes and logprobs are compared with HF and Megatron in fp32
            *("--dtype", "float32", "--enforce-eager", "--max-model-len", "512"),
            *("--gpu-memory-utilization", "0.2"),
            *("--block-size", MOE_BLOCK, "--enable-prompt-tokens-details", "--art-routes"),
            *OPEN,
        ),
        {"ART_VLLM_ROUTES_MAX_BYTES": str(ROUTES_MAX_BYTES), "VLLM_SERVER_DEV_MODE": "1"},
    )


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(
            "lora",
            "tiny model, LoRA slots policy/other/ref_a/ref_b, fault hook, dev mode",
            _lora,
            _lora_slots,
        ),
        Kind(
            "keyed",
            "API key, adapter root and trainer path map, slots policy/ref_b",
            _keyed,
            _keyed_slots,
            api_key=KEYED_API_KEY,
            modules_dir=lambda p: p.root / "allowed" / "modules",
        ),
        Kind(
            "one_seq",
            "--max-num-seqs 1, one LoRA slot on device and in CPU, block size 32",
            _one_seq,
            _one_seq_slots,
        ),
        Kind(
            "two_slots",
            "--max-loras 2 for four resident LoRA modules, a hub-id module, CPU layout off",
            _two_slots,
            _two_slots_slots,
        ),
        Kind(
            "tp2",
            "--tensor-parallel-size 2, float32, fault hook",
            lambda p: tp_config(p, 2),
            _tp2_slots,
        ),
        Kind("dp2", "--data-parallel-size 2, float32, fault hook, dev mode", _dp2, _dp2_slots),
        Kind("pp2", "--pipeline-parallel-size 2, float32, fault hook, dev mode", _pp2, _pp2_slots),
        Kind(
            "ray_tp2",
            "Ray executor, --tensor-parallel-size 2 on two local Ray nodes, float32, fault hook",
            _ray_tp2,
            _ray_tp2_slots,
            after_stop=_ray_tp2_stop,
        ),
        Kind("moe_routes", "tiny Qwen3-MoE, --art-routes, no LoRA", _moe_routes, lambda p: {}),
    )
}
