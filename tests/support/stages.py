"""Stage directories left by other processes, for the staging sweep's tests.

`stage_left_by(root, "kill")` runs a process that makes a stage in `root` exactly as an API
server does (`art_vllm_plugin.staging.new_stage_dir`, then a file in it) and SIGKILLs itself:
what a crashed server leaves. With "live" the process keeps running (and its stage must stay)
until the caller closes its stdin.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_MAKE_STAGE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from art_vllm_plugin import staging
    stage = staging.new_stage_dir(staging.StagingConfig(Path(sys.argv[1])), "policy", 7)
    (stage / "adapter_model.safetensors").write_bytes(b"x" * 100)
    print(stage, flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()
    """
)


def stage_left_by(root: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    """(the process, the stage it made in `root`); mode "kill" or "live"."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _MAKE_STAGE, str(root), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    stage = Path(proc.stdout.readline().strip())
    if stage.parent != root:
        proc.kill()
        raise RuntimeError(f"the staging process printed {stage}, not a stage in {root}")
    if mode == "kill" and proc.wait(timeout=60) != -signal.SIGKILL:
        raise RuntimeError(f"the staging process ended with {proc.returncode}, not SIGKILL")
    return proc, stage


def end(proc: subprocess.Popen) -> None:
    """End a "live" staging process."""
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    proc.wait(timeout=60)
