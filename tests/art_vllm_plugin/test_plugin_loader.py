"""Loading the general plugin: idempotent, inert unless selected, version-gated.

Each case runs in a new process in which vLLM was imported and nothing else happened: the
plugin patches process-global vLLM objects, and the contract is about what happens in a new
vLLM process. The five are forks of one interpreter that imported vLLM once
(`support.vllm_forks`: one vLLM import, not five: 44 -> 14 CPU-s for the module).
"""

from __future__ import annotations

import json
import textwrap

import pytest
from support.vllm_forks import Case, run_forked

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


UNSUPPORTED = textwrap.dedent(
    """
    import vllm
    vllm.__version__ = "0.31.9"
    import art_vllm_plugin
    art_vllm_plugin.register_general()
    """
)

#: Every case: its code and its environment (None: `VLLM_PLUGINS` unset).
CASES = {
    "probe_selected": Case(PROBE, {"VLLM_PLUGINS": "art"}),
    "probe_unset": Case(PROBE, {"VLLM_PLUGINS": None}),
    "probe_other": Case(PROBE, {"VLLM_PLUGINS": "someone_else"}),
    "unsupported_selected": Case(UNSUPPORTED, {"VLLM_PLUGINS": "art"}),
    "unsupported_unset": Case(UNSUPPORTED, {"VLLM_PLUGINS": None}),
}


@pytest.fixture(scope="module")
def ran() -> dict:
    """Every case's completed process, by name (one fork each)."""
    return dict(
        zip(CASES, run_forked(list(CASES.values()), ("vllm.engine.arg_utils",)), strict=True)
    )


def _probe(ran, name):
    proc = ran[name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_load_changes_nothing_when_selected(ran):
    out = _probe(ran, "probe_selected")
    assert out["first"]["active"] is True
    assert out["first"] == out["second"]
    assert out["first"]["add_cli_args"] != out["before"]["add_cli_args"]
    assert out["first"]["wrapped_once"] is True


def test_unselected_plugin_only_adds_the_inert_cli_option(ran):
    out = _probe(ran, "probe_unset")
    assert out["first"]["active"] is False
    assert out["first"] == out["second"]
    assert out["first"]["env"] is None


def test_other_plugins_selected_leaves_art_inactive(ran):
    out = _probe(ran, "probe_other")
    assert out["first"]["active"] is False


def test_unsupported_vllm_is_refused_with_the_supported_range(ran):
    proc = ran["unsupported_selected"]
    assert proc.returncode != 0
    assert "UnsupportedVllmVersion" in proc.stderr
    assert "vLLM 0.31.9 is not supported" in proc.stderr
    assert "vllm >=0.32.0,<0.35" in proc.stderr


def test_unsupported_vllm_is_ignored_when_not_selected(ran):
    proc = ran["unsupported_unset"]
    assert proc.returncode == 0, proc.stderr[-2000:]
