"""`--plugin NAME[,NAME]` and `--art-cpu-layout` on the stock `vllm serve` parser.

Each case parses in a process of its own (the options change the process's environment and
activate the plugin, which a later case must not see), but importing vLLM's CLI costs 10-20 s
per process on these hosts. So one process imports it once and forks a child per case
(`CASES_RUNNER`): the child starts from the import's state with its own environment, exactly
as a fresh `vllm serve` would after its imports, and reports its exit code, stdout and stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

#: Reads [{"argv": [...], "env": {...}}, ...] on stdin; forks a child per case that sets the
#: case's environment, builds the stock `vllm serve` parser, parses, and prints what the
#: options did; prints one JSON list of {"rc", "out", "err"} in case order.
CASES_RUNNER = textwrap.dedent(
    """
    import json, os, sys, tempfile
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from art_vllm_plugin import plugin_loader

    def parse(argv):
        root = FlexibleArgumentParser(prog="vllm")
        sub = root.add_subparsers(dest="subparser")
        ServeSubcommand().subparser_init(sub)
        args = root.parse_args(argv)
        layout = getattr(args, "art_cpu_layout", None)
        print(json.dumps({"plugins": getattr(args, "plugins", None),
                          "env": os.environ.get("VLLM_PLUGINS"),
                          "active": plugin_loader.is_active(),
                          "layout": layout.mode if layout else None,
                          "layout_env": os.environ.get("ART_VLLM_CPU_LAYOUT")}))

    results = []
    for case in json.load(sys.stdin):
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            sys.stdout.flush(); sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
                for name in ("VLLM_PLUGINS", "ART_VLLM_CPU_LAYOUT"):
                    os.environ.pop(name, None)
                os.environ.update(case["env"])
                code = 0
                try:
                    parse(case["argv"])
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
                except BaseException:
                    import traceback; traceback.print_exc(); code = 1
                sys.stdout.flush(); sys.stderr.flush()
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            out.seek(0); err.seek(0)
            results.append({"rc": os.waitstatus_to_exitcode(status),
                            "out": out.read().decode(), "err": err.read().decode()})
    print(json.dumps(results))
    """
)

CASES = {
    "selects": (["serve", "some/model", "--plugin", "art"], {}),
    "lists": (["serve", "m", "--plugin", "x,art", "--plugin", "art,y"], {}),
    "keeps_env": (["serve", "m", "--plugin", "art"], {"VLLM_PLUGINS": "art,other"}),
    "none": (["serve", "m"], {}),
    "empty_name": (["serve", "m", "--plugin", "art,"], {}),
    "layout_off": (["serve", "m", "--plugin", "art", "--art-cpu-layout", "off"], {}),
    "layout_default": (["serve", "m", "--plugin", "art"], {}),
    "layout_unknown": (["serve", "m", "--plugin", "art", "--art-cpu-layout", "sometimes"], {}),
}


@pytest.fixture(scope="module")
def parsed() -> dict[str, dict]:
    """Case name -> {"rc", "out", "err", "json" (the last stdout line, parsed, or None)}."""
    env = dict(os.environ)
    for name in ("VLLM_PLUGINS", "ART_VLLM_CPU_LAYOUT"):
        env.pop(name, None)
    cases = [{"argv": argv, "env": case_env} for argv, case_env in CASES.values()]
    proc = subprocess.run(
        [sys.executable, "-c", CASES_RUNNER],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    out = {}
    for name, result in zip(CASES, results, strict=True):
        lines = result["out"].strip().splitlines()
        result["json"] = json.loads(lines[-1]) if result["rc"] == 0 and lines else None
        out[name] = result
    return out


def _ok(parsed, name: str) -> dict:
    result = parsed[name]
    assert result["rc"] == 0, result["err"][-3000:]
    return result["json"]


def test_plugin_option_selects_and_activates_art(parsed):
    out = _ok(parsed, "selects")
    assert (out["plugins"], out["env"], out["active"]) == (["art"], "art", True)


def test_plugin_option_accepts_lists_and_repeats_without_duplicates(parsed):
    out = _ok(parsed, "lists")
    assert out["plugins"] == ["x", "art", "y"]
    assert out["env"] == "x,art,y"


def test_plugin_option_keeps_names_already_in_the_environment(parsed):
    assert _ok(parsed, "keeps_env")["env"] == "art,other"


def test_without_the_option_nothing_is_selected(parsed):
    out = _ok(parsed, "none")
    assert (out["plugins"], out["env"], out["active"]) == (None, None, False)


def test_empty_plugin_name_is_a_clear_error(parsed):
    result = parsed["empty_name"]
    assert result["rc"] != 0
    assert "--plugin expects NAME[,NAME]" in result["err"]


def test_cpu_layout_flag_is_typed_and_reaches_the_engine_processes(parsed):
    out = _ok(parsed, "layout_off")
    # EngineCore is started after parsing and inherits the variable.
    assert (out["layout"], out["layout_env"]) == ("off", "off")


def test_cpu_layout_default_leaves_the_environment_alone(parsed):
    out = _ok(parsed, "layout_default")
    assert (out["layout"], out["layout_env"]) == (None, None)


def test_cpu_layout_flag_refuses_unknown_modes(parsed):
    result = parsed["layout_unknown"]
    assert result["rc"] != 0
    err = result["err"]
    assert "--art-cpu-layout" in err and "invalid choice: 'sometimes'" in err


def _art_parser():
    import argparse

    from art_vllm_plugin import cli

    parser = argparse.ArgumentParser(prog="vllm serve")
    cli.add_art_options(parser)
    return parser


def test_weights_staging_budget_is_bytes_and_gpu_staging_is_refused_by_name(capsys):
    args = _art_parser().parse_args(["--art-weights-staging-bytes", "3MiB"])
    assert (args.art_weights_staging, args.art_weights_staging_bytes) == ("host", 3 * 1024**2)
    with pytest.raises(SystemExit):
        _art_parser().parse_args(["--art-weights-staging", "gpu"])
    err = capsys.readouterr().err
    assert "--art-weights-staging gpu" in err and "not built" in err
    with pytest.raises(SystemExit):
        _art_parser().parse_args(["--art-weights-staging-bytes", "lots"])
    assert "--art-weights-staging-bytes" in capsys.readouterr().err


def test_weights_stall_timeout_is_positive_seconds_with_a_default(capsys):
    from art_vllm_plugin.api_server.stage_deadline import DEFAULT_STALL_S

    assert _art_parser().parse_args([]).art_weights_stall_timeout == DEFAULT_STALL_S == 120.0
    args = _art_parser().parse_args(["--art-weights-stall-timeout", "2.5"])
    assert args.art_weights_stall_timeout == 2.5
    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(SystemExit):
            _art_parser().parse_args(["--art-weights-stall-timeout", bad])
        err = capsys.readouterr().err
        assert (
            f"--art-weights-stall-timeout: expected a positive number of seconds, got {bad!r}"
            in err
        )
