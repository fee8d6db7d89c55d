"""Cases that each need a new vLLM process, run as forks of one interpreter that imported vLLM.

Why: a fresh interpreter that imports vLLM costs 8-14 CPU-s on these hosts, and a case about
what a new vLLM process does (loading the plugin patches process-global vLLM objects) needs a
process in which vLLM was imported and nothing else happened yet: not an import of its own.
One interpreter (`python -c`, the environment of this process less every variable a case
sets) imports the vLLM modules the cases name, checks that nothing of `art_vllm_plugin` was
imported, that vLLM loaded no plugin and that it runs one thread (a fork copies only the
calling thread), then forks one child per case. Each child sets its environment, runs the
case's code as `python -c` runs it (`__main__`, its own stdout and stderr, an uncaught
exception printed by `sys.excepthook` and exit code 1, `SystemExit` as Python exits, the
exit handlers run) and never returns into the parent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass

_RUNNER = textwrap.dedent(
    r"""
    import atexit, json, os, sys

    spec = json.loads(sys.stdin.read())
    for name in spec["preload"]:
        __import__(name)
    import vllm.plugins

    state = {
        "leaked": sorted(m for m in sys.modules if m.split(".")[0] == "art_vllm_plugin"),
        "plugins_loaded": vllm.plugins.plugins_loaded,
        "threads": len(os.listdir("/proc/self/task")),
        "cases": [],
    }
    if state["leaked"] or state["plugins_loaded"] or state["threads"] != 1:
        print(json.dumps(state))
        sys.exit(0)

    for i, case in enumerate(spec["cases"]):
        out = os.path.join(spec["dir"], f"case{i}")
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for fd, suffix in ((1, ".out"), (2, ".err")):
                    os.dup2(os.open(out + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                for key, value in case["env"].items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
                try:
                    exec(compile(case["code"], "<string>", "exec"), {"__name__": "__main__"})
                    code = 0
                except SystemExit as exc:
                    if exc.code is None or isinstance(exc.code, int):
                        code = exc.code or 0
                    else:
                        print(exc.code, file=sys.stderr)
                except BaseException:
                    sys.excepthook(*sys.exc_info())
                atexit._run_exitfuncs()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        with open(out + ".out") as o, open(out + ".err") as e:
            state["cases"].append(
                {"returncode": os.waitstatus_to_exitcode(status), "stdout": o.read(),
                 "stderr": e.read()}
            )
    print(json.dumps(state))
    """
)


@dataclass(frozen=True)
class Case:
    """`code` run as `python -c code` would, with `env` applied (None: the variable unset)."""

    code: str
    env: dict[str, str | None]


def run_forked(
    cases: list[Case], preload: tuple[str, ...], timeout_s: float = 600
) -> list[subprocess.CompletedProcess]:
    """Run every case in a fork of one interpreter that imported `preload`; one
    `CompletedProcess` per case, in order (`args` is the case's code)."""
    env = dict(os.environ)
    for case in cases:
        for key in case.env:
            env.pop(key, None)
    with tempfile.TemporaryDirectory(prefix="vllm-forks-") as tmp:
        spec = {"preload": list(preload), "dir": tmp, "cases": [vars(c) for c in cases]}
        proc = subprocess.run(
            [sys.executable, "-c", _RUNNER],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads(proc.stdout.strip().splitlines()[-1])
    assert state["leaked"] == [], f"importing {preload} imported {state['leaked']}"
    assert state["plugins_loaded"] is False, f"importing {preload} loaded vLLM's plugins"
    assert state["threads"] == 1, f"{state['threads']} threads before forking: fork is unsafe"
    return [
        subprocess.CompletedProcess(c.code, r["returncode"], r["stdout"], r["stderr"])
        for c, r in zip(cases, state["cases"], strict=True)
    ]
