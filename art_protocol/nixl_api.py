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
    `backends` (UCX: DRAM and, where UCX has CUDA support, VRAM, within and across hosts)."""
    nixl_agent, nixl_agent_config = _api()
    agent = nixl_agent(name, nixl_agent_config(backends=list(backends)))
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise RuntimeError(
            f"NIXL has no {', '.join(missing)} backend here (plugins found: "
            f"{sorted(agent.plugin_list)}); {INSTALL_HINT}"
        )
    return agent
