"""`--art-routes`: which capture path serves routes, and the preconditions, checked at start.

vLLM 0.32 captures routed experts only in Model Runner V2 (`--enable-return-routed-experts`,
the "AuxOutput connector"): the scheduler side (`AuxOutputSchedulerConnector`, which tracks each
request's emit cursor and honours `routed_experts_prompt_start`) and the output side
(`EngineCoreOutput.routed_experts` -> `CompletionOutput.routed_experts`) are runner-agnostic,
but the worker side exists only in MRV2, which needs Triton. `--art-routes` turns the native
option on and, where the V1 runner serves (the CPU build), lets the plugin's worker hook
(`art_vllm_plugin.worker.route_capture`) fill the same output field. vLLM's own config check
refuses AuxOutput without MRV2; on the CPU platform with `--art-routes` we replace that one
check by the preconditions our worker path really has, each refused with its own message.
On Model Runner V2 (native capture) vLLM's own check runs, after ours for the model: a dense
model is refused on both runners.
"""

from __future__ import annotations

import os

ENV_VAR = "ART_VLLM_ROUTES"
MAX_BYTES_ENV = "ART_VLLM_ROUTES_MAX_BYTES"
DEFAULT_MAX_BODY_BYTES = 512 * 2**20


def selected() -> bool:
    """`--art-routes` was given (the flag exports ART_VLLM_ROUTES=1 to every vLLM process)."""
    return os.environ.get(ENV_VAR) == "1"


def max_body_bytes() -> int:
    """Largest `application/vnd.art.routes` body the server sends (413 beyond it)."""
    raw = os.environ.get(MAX_BYTES_ENV)
    if raw is None:
        return DEFAULT_MAX_BODY_BYTES
    try:
        value = int(raw)
    except ValueError as exc:
        raise ValueError(f"{MAX_BYTES_ENV} must be a positive integer, got {raw!r}") from exc
    if value <= 0:
        raise ValueError(f"{MAX_BYTES_ENV} must be a positive integer, got {raw!r}")
    return value


def model_problems(vllm_config) -> list[str]:
    """Why `--art-routes` cannot serve this model on any runner (empty: it can).

    vLLM's native capture (Model Runner V2) accepts a dense model and returns rows of
    nothing; a route request there would look served. Refused at start instead."""
    problems = []
    model = vllm_config.model_config
    if model.runner_type != "generate":
        problems.append(f"a generating model (runner is {model.runner_type!r})")
    if not model.is_moe:
        problems.append(
            f"a mixture-of-experts model ({model.model!r} has no routed experts: "
            f"architectures {getattr(model.hf_config, 'architectures', None)})"
        )
    return problems


def worker_path_problems(vllm_config) -> list[str]:
    """Why the plugin's worker capture cannot serve this configuration (empty: it can)."""
    problems = model_problems(vllm_config)
    if vllm_config.speculative_config is not None:
        problems.append("no speculative decoding (rejected draft rows are not handled)")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        problems.append("pipeline parallel size 1")
    if parallel.data_parallel_size > 1:
        problems.append("data parallel size 1")
    if vllm_config.scheduler_config.async_scheduling:
        problems.append("synchronous scheduling (--no-async-scheduling)")
    return problems


def worker_path_check(use_worker_path):
    """Wrapper maker for `VllmConfig._verify_aux_output_compatibility`.

    `use_worker_path(config)` says whether this config will be served by the V1 runner on the
    CPU platform with `--art-routes`; then our preconditions replace vLLM's MRV2 requirement.
    """

    def make(original):
        def verify(self) -> None:
            if not (self.aux_output_config.enabled and selected()):
                original(self)
                return
            if use_worker_path(self):
                problems = worker_path_problems(self)
                if problems:
                    raise ValueError(
                        "--art-routes (route capture in the CPU worker) needs "
                        + "; ".join(problems)
                    )
                return
            problems = model_problems(self)
            if problems:
                raise ValueError(
                    "--art-routes (vLLM's routed-experts capture, Model Runner V2) needs "
                    + "; ".join(problems)
                )
            original(self)

        return verify

    return make
