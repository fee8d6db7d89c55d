"""`vllm serve MODEL --plugin NAME[,NAME]`: selecting plugins from the stock vLLM CLI.

Why this shape: stock `vllm serve` has no `--plugin` flag and parses its arguments before any
plugin is selected. But while it builds the `serve` parser, `AsyncEngineArgs.add_cli_args`
calls `load_general_plugins()` and then `EngineArgs.add_cli_args(parser)`. Our general plugin
wraps the latter (`add_serve_options`, applied once by `art_vllm_plugin.install.install_cli`)
so that the `serve` parser gains `--plugin`. The option's argparse action runs during parsing,
in the API-server process, before any engine or worker process exists: it adds the names to
`VLLM_PLUGINS` (inherited by every process vLLM starts) and activates the art plugin in the
API server itself, whose general plugins already loaded (`on_select`, given by the loader).

Limitation (docs/plugin.md): the hook exists only if the general plugin loaded,
i.e. when `VLLM_PLUGINS` is unset or already names `art`. With `VLLM_PLUGINS=other`, argparse
rejects `--plugin`; use `VLLM_PLUGINS=other,art` instead.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from art_vllm_plugin.selection import PLUGIN_NAME, select

OPTION = "--plugin"


class PluginAction(argparse.Action):
    """Parses `NAME[,NAME]`, may repeat; selects the named plugins for all vLLM processes.

    `on_select()` runs when `art` is among them (the loader's `activate`)."""

    def __init__(self, *args, on_select: Callable[[], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_select = on_select

    def __call__(self, parser, namespace, values, option_string=None):
        names = [n.strip() for n in str(values).split(",")]
        if not all(names):
            parser.error(f"{OPTION} expects NAME[,NAME], got {values!r}")
        current = list(getattr(namespace, self.dest, None) or [])
        setattr(namespace, self.dest, current + [n for n in names if n not in current])
        select(names)
        if PLUGIN_NAME in names and self.on_select is not None:
            self.on_select()


def _is_serve_parser(parser: argparse.ArgumentParser) -> bool:
    return parser.prog.split()[-1:] == ["serve"] and not parser.prog.startswith("vllm bench")


def add_plugin_option(
    parser: argparse.ArgumentParser, on_select: Callable[[], None] | None = None
) -> None:
    """Add `--plugin` to `parser` unless it already has it."""
    if OPTION in parser._option_string_actions:
        return
    parser.add_argument(
        OPTION,
        action=PluginAction,
        on_select=on_select,
        dest="plugins",
        metavar="NAME[,NAME]",
        help="Select vLLM plugins by entry-point name (sets VLLM_PLUGINS for every vLLM "
        "process), e.g. `--plugin art`. Added by the art-pipeline plugin.",
    )


def _path_map_arg(value: str) -> str:
    from art_vllm_plugin.api_server.paths import parse_path_map

    try:
        parse_path_map(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return value


def _staging_dir_arg(value: str) -> str:
    from art_vllm_plugin.staging import StagingDirError, check_dir

    try:
        return str(check_dir(value, "--art-staging-dir"))
    except StagingDirError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _adapter_bytes_arg(value: str) -> int:
    from art_vllm_plugin.staging import parse_bytes

    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--art-max-adapter-bytes: {exc}") from exc


def _weights_staging_arg(value: str) -> str:
    """`--art-weights-staging`: only `host` is built. `gpu` (the shard staged in GPU memory
    reserved at start) is refused by name rather than taken as host: no test here could show
    it works (no GPU runs vLLM in this project's checks)."""
    if value == "host":
        return value
    if value == "gpu":
        raise argparse.ArgumentTypeError(
            "--art-weights-staging gpu: staging full-weight shards in GPU memory reserved at "
            "start is not built yet; use host (pinned host memory on GPUs)"
        )
    raise argparse.ArgumentTypeError(f"--art-weights-staging: expected host or gpu, got {value!r}")


def _staging_bytes_arg(value: str) -> int:
    from art_vllm_plugin.staging import parse_bytes

    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--art-weights-staging-bytes: {exc}") from exc


def _stall_timeout_arg(value: str) -> float:
    """`--art-weights-stall-timeout SECONDS`: a positive number of seconds."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(
            f"--art-weights-stall-timeout: expected a positive number of seconds, got {value!r}"
        )
    return seconds


class CpuLayoutAction(argparse.Action):
    """`--art-cpu-layout {auto,off}`: exported to the EngineCore process it concerns.

    EngineCore is started by this (API-server) process after parsing and inherits its
    environment, so the choice travels as `ART_VLLM_CPU_LAYOUT` (also a documented override).
    """

    def __call__(self, parser, namespace, values, option_string=None):
        from art_vllm_plugin.engine_core.core_pinning import ENV_VAR, CpuLayoutConfig

        setattr(namespace, self.dest, CpuLayoutConfig(mode=values))
        os.environ[ENV_VAR] = values


class RoutesAction(argparse.Action):
    """`--art-routes`: capture MoE routes (native `--enable-return-routed-experts` where the
    runner has it, the plugin's worker hook on the CPU build). Exported as ART_VLLM_ROUTES=1
    so the worker processes install their hook; see `art_vllm_plugin.routes.config`."""

    def __call__(self, parser, namespace, values, option_string=None):
        from art_vllm_plugin.routes.config import ENV_VAR

        setattr(namespace, self.dest, True)
        namespace.enable_return_routed_experts = True
        os.environ[ENV_VAR] = "1"


def add_art_options(parser: argparse.ArgumentParser) -> None:
    """The art plugin's own serve options (inert unless the plugin is selected)."""
    if "--art-adapter-root" in parser._option_string_actions:
        return
    group = parser.add_argument_group("art plugin")
    group.add_argument(
        "--art-adapter-root",
        action="append",
        dest="art_adapter_roots",
        metavar="DIR",
        help="Directory from which /art/v1/lora/update may read adapters (repeatable). "
        "Default: the directories holding the --lora-modules adapters.",
    )
    group.add_argument(
        "--art-path-map",
        action="append",
        dest="art_path_maps",
        metavar="TRAINER_PREFIX=SERVER_PREFIX",
        help="Translate adapter paths published by a trainer to paths on this server "
        "(repeatable; the longest matching prefix wins).",
    )
    group.add_argument(
        "--art-cpu-layout",
        choices=("auto", "off"),
        action=CpuLayoutAction,
        dest="art_cpu_layout",
        help="CPU hosts with few cores: `auto` (default) lets EngineCore share the worker's "
        "core so the API server keeps a core of its own (answers /health and updates during "
        "generation); `off` leaves vLLM's layout. Env override: ART_VLLM_CPU_LAYOUT.",
    )
    group.add_argument(
        "--art-routes",
        nargs=0,
        action=RoutesAction,
        dest="art_routes",
        default=False,
        help="Capture the MoE experts every token was routed to (MoE models only; vLLM's "
        "native capture where available, the plugin's worker hook on the CPU build) and serve "
        "them on /art/v1/completions and /art/v1/chat/completions with return_routes.",
    )
    from art_vllm_plugin.api_server import body_limits

    group.add_argument(
        "--art-allow-unauthenticated",
        action="store_true",
        dest="art_allow_unauthenticated",
        help="Without --api-key (or VLLM_API_KEY), accept requests that change the server's "
        "state (POST /art/v1/lora/update, leases, test hooks) from anyone who can reach the "
        "port. Default: they are refused (403); reads and generation stay open. For a trusted "
        "network only (a loopback demo, tests).",
    )
    group.add_argument(
        "--art-max-body-bytes",
        type=body_limits.parse_max_body_bytes,
        dest="art_max_body_bytes",
        default=body_limits.DEFAULT_MAX_BODY_BYTES,
        metavar="N",
        help="Largest request body an /art route reads (default 16 MiB); a larger one is "
        "refused with 413 before it is parsed. Multipart adapter pushes to "
        "/art/v1/lora/update have their own limit.",
    )
    group.add_argument(
        "--art-staging-dir",
        type=_staging_dir_arg,
        dest="art_staging_dir",
        metavar="DIR",
        help="Existing directory where updates stage adapters for the workers (memory-backed "
        "is best). Default: ART_STAGING_DIR if set, else /dev/shm (64 MiB by default in "
        "Docker and Kubernetes). An update the directory has no room for is refused with 507.",
    )
    group.add_argument(
        "--art-max-adapter-bytes",
        type=_adapter_bytes_arg,
        dest="art_max_adapter_bytes",
        metavar="N",
        help="Largest adapter (both files together) an update may stage, by path or pushed; "
        "a larger one is refused with 413 before it is staged. Bytes, or with KiB/MiB/GiB "
        "(default 4GiB).",
    )
    group.add_argument(
        "--art-weights-staging",
        type=_weights_staging_arg,
        dest="art_weights_staging",
        default="host",
        metavar="{host,gpu}",
        help="Where each worker stages its shard of a streamed full-weight version: host "
        "(default; pinned host memory on GPUs). gpu is not built yet and is refused.",
    )
    group.add_argument(
        "--art-weights-staging-bytes",
        type=_staging_bytes_arg,
        dest="art_weights_staging_bytes",
        metavar="N",
        help="Host memory each worker may hold for streamed full-weight versions: the shard "
        "of the version arriving plus the current version's shard kept as the undo. A stream "
        "beyond it is refused with 507 before a byte moves. Bytes, or with KiB/MiB/GiB "
        "(default: not limited).",
    )
    from art_vllm_plugin.api_server.stage_deadline import DEFAULT_STALL_S

    group.add_argument(
        "--art-weights-stall-timeout",
        type=_stall_timeout_arg,
        dest="art_weights_stall_timeout",
        default=DEFAULT_STALL_S,
        metavar="SECONDS",
        help="A full-weight update is ended (500, the old weights keep serving) once no "
        "worker of some engine still staging it received anything for this long; one that "
        "keeps moving bytes runs to its end, whatever its size. The error names the engine, "
        f"the workers and the bytes received of the update's total (default {DEFAULT_STALL_S:g}).",
    )


def add_serve_options(on_select: Callable[[], None]):
    """Wrapper maker for `EngineArgs.add_cli_args`: the `serve` parser gains `--plugin` and
    the art options."""

    def make(original):
        def add_cli_args(parser, *args, **kwargs):
            parser = original(parser, *args, **kwargs)
            if _is_serve_parser(parser):
                add_plugin_option(parser, on_select)
                add_art_options(parser)
            return parser

        return add_cli_args

    return make
