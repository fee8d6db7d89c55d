"""Loading the general plugin: idempotent, inert unless selected, version-gated.

Each case runs in a fresh interpreter: the plugin patches process-global vLLM objects, and the
contract is about what happens in a new vLLM process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import json, os, sys
    from vllm.engine.arg_utils import EngineArgs
    import art_vllm_plugin
    from art_vllm_plugin import plugin_loader

    def state():
        return {
            "add_cli_args": id(EngineArgs.add_cli_args),
            "wrapped_once": getattr(EngineArgs.add_cli_args, "__wrapped__", None) is not None
                and getattr(EngineArgs.add_cli_args.__wrapped__, "__wrapped__", None) is None,
            "active": plugin_loader.is_active(),
            "env": os.environ.get("VLLM_PLUGINS"),
        }

    before = {"add_cli_args": id(EngineArgs.add_cli_args)}
    art_vllm_plugin.register_general()
    first = state()
    art_vllm_plugin.register_general()
    second = state()
    print(json.dumps({"before": before, "first": first, "second": second}))
    """
)


def _run(code: str, env_extra: dict[str, str | None]) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    for key, value in env_extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )


def _probe(env_extra):
    proc = _run(PROBE, env_extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_load_changes_nothing_when_selected():
    out = _probe({"VLLM_PLUGINS": "art"})
    assert out["first"]["active"] is True
    assert out["first"] == out["second"]
    assert out["first"]["add_cli_args"] != out["before"]["add_cli_args"]
    assert out["first"]["wrapped_once"] is True


def test_unselected_plugin_only_adds_the_inert_cli_option():
    out = _probe({"VLLM_PLUGINS": None})
    assert out["first"]["active"] is False
    assert out["first"] == out["second"]
    assert out["first"]["env"] is None


def test_other_plugins_selected_leaves_art_inactive():
    out = _probe({"VLLM_PLUGINS": "someone_else"})
    assert out["first"]["active"] is False


UNSUPPORTED = textwrap.dedent(
    """
    import vllm
    vllm.__version__ = "0.31.9"
    import art_vllm_plugin
    art_vllm_plugin.register_general()
    """
)


def test_unsupported_vllm_is_refused_with_the_supported_range():
    proc = _run(UNSUPPORTED, {"VLLM_PLUGINS": "art"})
    assert proc.returncode != 0
    assert "UnsupportedVllmVersion" in proc.stderr
    assert "vLLM 0.31.9 is not supported" in proc.stderr
    assert "vllm >=0.32.0,<0.35" in proc.stderr


def test_unsupported_vllm_is_ignored_when_not_selected():
    proc = _run(UNSUPPORTED, {"VLLM_PLUGINS": None})
    assert proc.returncode == 0, proc.stderr[-2000:]
