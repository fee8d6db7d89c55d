"""Let `import megatron.bridge` (0.6.2) succeed on a machine without Transformer Engine.

Why: `megatron/bridge/peft/lora_layers.py` has the bridge's one unguarded
`import transformer_engine.pytorch as te`; every other TE import is guarded. Making
`transformer_engine` importable would flip megatron-core's `HAVE_TE` probes, so the stub is
scoped to that one importer instead.

`install()` wraps `builtins.__import__`: only when the importing module is
`megatron.bridge.peft.lora_layers` and the name starts with `transformer_engine` is a stub
package returned. `sys.modules` is never touched, so megatron-core keeps `HAVE_TE = False`.
The stub's attributes (`te.Linear`, `te.LayerNormLinear`, `te.ops.*`, ...) are inert
placeholder classes: lora_layers uses them only in `isinstance` checks and in the TE-fused
LoRA path, which the local spec never reaches. Imported by `run_bridge.py`, which calls
`install()` before importing `megatron.bridge`; not run on its own.
"""

from __future__ import annotations

import builtins
import types

IMPORTER = "megatron.bridge.peft.lora_layers"


class _Placeholder:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("transformer_engine stub: Transformer Engine is not installed")


def _stub_module(name: str) -> types.ModuleType:
    """A module whose every public attribute is a distinct placeholder class."""
    module = types.ModuleType(name)
    classes: dict[str, type] = {}

    def __getattr__(attr: str) -> type:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr not in classes:
            classes[attr] = type(attr, (_Placeholder,), {})
        return classes[attr]

    module.__getattr__ = __getattr__
    return module


def install() -> None:
    """Answer the bridge's unguarded TE import with the stub; idempotent."""
    if getattr(builtins.__import__, "_te_stub", False):
        return
    te = _stub_module("transformer_engine")
    te.pytorch = _stub_module("transformer_engine.pytorch")
    te.pytorch.ops = _stub_module("transformer_engine.pytorch.ops")
    real_import = builtins.__import__

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        if (
            level == 0
            and name.split(".")[0] == "transformer_engine"
            and globals is not None
            and globals.get("__name__") == IMPORTER
        ):
            return te
        return real_import(name, globals, locals, fromlist, level)

    _import._te_stub = True
    builtins.__import__ = _import
