"""The one place either side imports NIXL (`art_nixl`, the link-speed weight transfer).

Why one loader: NIXL is optional (the `nixl` extra) and its meta package picks a backend
wheel by the CUDA major version of the torch it finds (`nixl-cu12`, `nixl-cu13`); a missing or
mismatched wheel fails with NIXL's own terse message deep inside an import. Here it fails
once, naming what to install. Nothing is imported until an agent is made.
"""

from __future__ import annotations

#: How to install NIXL without the dependencies its meta package declares (both CUDA wheels and
#: an unpinned torch, which could replace the environment's torch).
INSTALL_HINT = (
    "install NIXL beside this environment's torch: `pip install --no-deps nixl==1.5.1 "
    "nixl-cu12==1.5.1` (nixl-cu13 instead for a CUDA 13 torch; scripts/setup_serve_env.sh and "
    "scripts/setup_train_env.sh pick the right one)"
)


def _api():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise ImportError(
            f"the art_nixl weight transfer needs NIXL ({exc}): {INSTALL_HINT}"
        ) from exc
    return nixl_agent, nixl_agent_config


def new_agent(name: str, backends: tuple[str, ...] = ("UCX",)):
    """A NIXL agent named `name` (unique among the agents that talk to each other) with
    `backends` (UCX: DRAM and, where UCX has CUDA support, VRAM, within and across hosts).

    Without NIXL's progress thread: it spins with no pause (NIXL 1.5.1's Python agent sets
    its delay to 0), which measured 0.68 of a core per idle agent on this 2-core machine, in
    every vLLM worker for as long as it serves. Transfers progress when their owner polls
    them (`check_xfer_state`), and a trainer progresses its agent while it waits for the
    workers' reads (`progress`)."""
    nixl_agent, nixl_agent_config = _api()
    config = nixl_agent_config(enable_prog_thread=False, backends=list(backends))
    agent = nixl_agent(name, config)
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise RuntimeError(
            f"NIXL has no {', '.join(missing)} backend here (plugins found: "
            f"{sorted(agent.plugin_list)}); {INSTALL_HINT}"
        )
    return agent


def progress(agent) -> None:
    """Let `agent`'s backends make progress once (for the target of one-sided reads over
    transports that need the target's help, such as UCX over TCP): polling its notifications
    runs a progress pass of each backend."""
    agent.get_new_notifs()
