"""vLLM's weight-transfer engines, as the full-weight stream uses them (`worker/gloo_transfer.py`,
`worker/base_weights.py`, `engine_core/base_updates.py`)."""

from __future__ import annotations

from art_vllm_plugin.compat import names
from art_vllm_plugin.compat.engine_core import engine_executor
from art_vllm_plugin.compat.patching import load


def weight_transfer_engine_base() -> type:
    """The class a weight-transfer engine subclasses (`WeightTransferEngine`)."""
    return load(names.WEIGHT_TRANSFER_ENGINE)


def register_weight_transfer_engine(backend: str, module: str, class_name: str) -> None:
    """Register an engine with vLLM's factory, lazily imported; once per process (the general
    plugin may run more than once, and the factory refuses a name registered twice)."""
    factory = load(names.WEIGHT_TRANSFER_FACTORY)
    if backend not in factory._registry:
        factory.register_engine(backend, module, class_name)


def worker_weight_transfer_engine(worker):
    """The engine vLLM built at model load from `--weight-transfer-config`; None without one."""
    return getattr(worker, "weight_transfer_engine", None)


def engine_init_weight_transfer(core, init_info: dict) -> None:
    """Every worker of this engine joins the trainer's group (vLLM's worker method)."""
    engine_executor(core).collective_rpc(
        "init_weight_transfer_engine", kwargs={"init_info": init_info}
    )


def initialize_layerwise_reload(model) -> None:
    """Begin a reload straight into the model (`start_reload` on 0.34)."""
    from art_vllm_plugin.compat.inplace_write import start_reload

    start_reload(model)


def finalize_layerwise_reload(model, model_config, device=None) -> None:
    """End it (`finish_reload` on 0.34, which also takes the model's device)."""
    from art_vllm_plugin.compat.inplace_write import finish_reload

    finish_reload(model, model_config, device)
