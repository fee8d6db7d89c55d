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

`run_forked` runs a list of cases one after the other and ends the interpreter; a `Forker`
keeps it for a module and runs each batch of cases on request, one after the other or all at
once (the ranks of one tensor-parallel group).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

_RUNNER = textwrap.dedent(
    r"""
    import atexit, json, os, sys

    first = json.loads(sys.stdin.readline())
    for name in first["preload"]:
        __import__(name)
    import vllm.plugins

    state = {
        "leaked": sorted(m for m in sys.modules if m.split(".")[0] == "art_vllm_plugin"),
        "plugins_loaded": vllm.plugins.plugins_loaded,
        "threads": len(os.listdir("/proc/self/task")),
    }
    print(json.dumps(state), flush=True)
    if state["leaked"] or state["plugins_loaded"] or state["threads"] != 1:
        sys.exit(0)


    def child(case, out):
        code = 1
        try:
            for fd, path in ((1, case["log"] or out + ".out"), (2, case["log"] or out + ".err")):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
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


    def read(path):
        try:
            with open(path) as f:
                return f.read()
        except FileNotFoundError:
            return ""


    n = 0
    for line in sys.stdin:
        batch = json.loads(line)
        forked, codes = [], {}
        for case in batch["cases"]:
            out = os.path.join(batch["dir"], f"case{n}")
            n += 1
            for suffix in (".out", ".err"):
                open(out + suffix, "w").close()
            pid = os.fork()
            if pid == 0:
                child(case, out)
            forked.append((pid, out))
            if not batch["together"]:
                codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        for pid, _ in forked:
            if pid not in codes:
                codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        done = [
            {"returncode": codes[pid], "stdout": read(out + ".out"), "stderr": read(out + ".err")}
            for pid, out in forked
        ]
        print(json.dumps(done), flush=True)
    """
)


@dataclass(frozen=True)
class Case:
    """`code` run as `python -c code` would, with `env` applied (None: the variable unset);
    its stdout and stderr both go to `log` where given."""

    code: str
    env: dict[str, str | None]
    log: str | None = None


class Forker:
    """One interpreter that imported `preload` (the environment `env`, default this process's,
    less every variable in `unset`) and forks a child per case on request."""

    def __init__(self, preload: tuple[str, ...], env=None, unset=(), timeout_s: float = 600):
        env = dict(os.environ if env is None else env)
        for key in unset:
            env.pop(key, None)
        self.timeout_s = timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="vllm-forks-")
        self._err = Path(self._tmp.name) / "runner.err"
        with self._err.open("w") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _RUNNER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                start_new_session=True,  # its forks share its group: a timeout kills them all
            )
        state = self._answer({"preload": list(preload)})
        assert state["leaked"] == [], f"importing {preload} imported {state['leaked']}"
        assert state["plugins_loaded"] is False, f"importing {preload} loaded vLLM's plugins"
        assert state["threads"] == 1, f"{state['threads']} threads before forking: fork is unsafe"

    def _answer(self, message: dict):
        self._proc.stdin.write(json.dumps(message) + "\n")
        self._proc.stdin.flush()
        ready, _, _ = select.select([self._proc.stdout], [], [], self.timeout_s)
        if not ready:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            raise AssertionError(f"the fork runner did not answer within {self.timeout_s} s")
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait(timeout=60)
            err = self._err.read_text(errors="replace")[-3000:]
            raise AssertionError(f"the fork runner exited {self._proc.returncode}:\n{err}")
        return json.loads(line)

    def run(self, cases: list[Case], together: bool = False) -> list[subprocess.CompletedProcess]:
        """Fork every case (`together`: all at once, then wait for all; else one after the
        other); one `CompletedProcess` per case, in order (`args` is the case's code)."""
        batch = {"dir": self._tmp.name, "together": together, "cases": [vars(c) for c in cases]}
        done = self._answer(batch)
        return [
            subprocess.CompletedProcess(c.code, r["returncode"], r["stdout"], r["stderr"])
            for c, r in zip(cases, done, strict=True)
        ]

    def close(self) -> None:
        self._proc.stdout.close()
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._tmp.cleanup()

    def __enter__(self) -> Forker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_forked(
    cases: list[Case], preload: tuple[str, ...], timeout_s: float = 600
) -> list[subprocess.CompletedProcess]:
    """Run every case, one after the other, in a fork of one interpreter that imported
    `preload` (this process's environment less every variable a case sets)."""
    unset = {key for case in cases for key in case.env}
    with Forker(preload, unset=unset, timeout_s=timeout_s) as forker:
        return forker.run(cases)
