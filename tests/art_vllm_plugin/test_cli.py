"""`--plugin NAME[,NAME]` on the stock `vllm serve` parser selects plugins for every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

PARSE = textwrap.dedent(
    """
    import json, os, sys
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from art_vllm_plugin import plugin_loader

    root = FlexibleArgumentParser(prog="vllm")
    sub = root.add_subparsers(dest="subparser")
    ServeSubcommand().subparser_init(sub)
    args = root.parse_args(sys.argv[1:])
    print(json.dumps({"plugins": getattr(args, "plugins", None),
                      "env": os.environ.get("VLLM_PLUGINS"),
                      "active": plugin_loader.is_active()}))
    """
)


def _parse(*argv: str, env_plugins: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if env_plugins is not None:
        env["VLLM_PLUGINS"] = env_plugins
    return subprocess.run(
        [sys.executable, "-c", PARSE, *argv], capture_output=True, text=True, env=env, timeout=300
    )


def _ok(*argv, **kw):
    proc = _parse(*argv, **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_plugin_option_selects_and_activates_art():
    out = _ok("serve", "some/model", "--plugin", "art")
    assert out == {"plugins": ["art"], "env": "art", "active": True}


def test_plugin_option_accepts_lists_and_repeats_without_duplicates():
    out = _ok("serve", "m", "--plugin", "x,art", "--plugin", "art,y")
    assert out["plugins"] == ["x", "art", "y"]
    assert out["env"] == "x,art,y"


def test_plugin_option_keeps_names_already_in_the_environment():
    out = _ok("serve", "m", "--plugin", "art", env_plugins="art,other")
    assert out["env"] == "art,other"


def test_without_the_option_nothing_is_selected():
    out = _ok("serve", "m")
    assert out == {"plugins": None, "env": None, "active": False}


def test_empty_plugin_name_is_a_clear_error():
    proc = _parse("serve", "m", "--plugin", "art,")
    assert proc.returncode != 0
    assert "--plugin expects NAME[,NAME]" in proc.stderr


LAYOUT = textwrap.dedent(
    """
    import json, os, sys
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = FlexibleArgumentParser(prog="vllm")
    sub = root.add_subparsers(dest="subparser")
    ServeSubcommand().subparser_init(sub)
    args = root.parse_args(sys.argv[1:])
    layout = getattr(args, "art_cpu_layout", None)
    print(json.dumps({"mode": layout.mode if layout else None,
                      "env": os.environ.get("ART_VLLM_CPU_LAYOUT")}))
    """
)


def _layout(*argv):
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    env.pop("ART_VLLM_CPU_LAYOUT", None)
    return subprocess.run(
        [sys.executable, "-c", LAYOUT, *argv], capture_output=True, text=True, env=env, timeout=300
    )


def test_cpu_layout_flag_is_typed_and_reaches_the_engine_processes():
    proc = _layout("serve", "m", "--plugin", "art", "--art-cpu-layout", "off")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # EngineCore is started after parsing and inherits the variable.
    assert out == {"mode": "off", "env": "off"}


def test_cpu_layout_default_leaves_the_environment_alone():
    proc = _layout("serve", "m", "--plugin", "art")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"mode": None, "env": None}


def test_cpu_layout_flag_refuses_unknown_modes():
    proc = _layout("serve", "m", "--plugin", "art", "--art-cpu-layout", "sometimes")
    assert proc.returncode != 0
    assert "--art-cpu-layout" in proc.stderr and "invalid choice: 'sometimes'" in proc.stderr
