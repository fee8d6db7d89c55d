"""What a worker keeps of a streamed full-weight version: its own shard, in the parameters'
loaded form (`compat/shard_forms.py`), not a host copy of the whole checkpoint.

How a worker knows its slice: it does not compute it. vLLM's own weight loaders already know
it (a parameter's `output_dim`/`input_dim` and tensor-parallel rank, q/k/v and gate/up
fusion, expert ownership under EP, vocabulary padding), so the worker runs the model's own
`load_weights` on a *shadow* of the model: every module a shallow copy of the live one (same
attributes: ranks, sizes, quant method), whose parameters are staging tensors shaped like
the loaded form vLLM recorded at load, each with the live parameter's attributes and its
weight loader bound to the shadow module. Each checkpoint tensor the stream delivers goes
through the model's loading code into the staging tensors and is then dropped, so a worker
holds its shard plus the one tensor in flight. Nothing of the live model is written: the
shadow shares only read-only attributes and buffers with it, so a worker of a one-worker
engine stages on its own thread while the forward runs. Why not slice by hand from
`output_dim` and the rank: fused and replicated parameters (q/k/v with KV heads replicated
over ranks, gate/up, experts, a padded vocabulary) would each need their own rule, which the
loaders already are.

Where: pinned host memory when the platform has CUDA (the commit's host-to-device copies then
run at link speed), plain host memory otherwise. A parameter shared by two modules (tied
embeddings) is staged once. `nbytes` is what this version holds here; `layout_bytes` what any
version would, known before a byte moves (the API server's staging budget reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

from art_vllm_plugin.compat import shard_forms


@dataclass
class Entry:
    """One parameter of one live module, and its staging tensor (None until allocated)."""

    path: str
    module: object
    name: str
    spec: object  # the loaded form (a meta tensor with the parameter's attributes)
    key: int  # the live parameter's identity: a tied parameter is staged once


def layout(model) -> list[Entry]:
    """Every parameter of `model` in its loaded form, module by module."""
    entries = []
    for path, module in model.named_modules():
        form = shard_forms.loaded_form(module)
        live = {n: p for n, p in module._parameters.items() if p is not None}
        for name in [*form, *(n for n in live if n not in form)]:
            spec = form.get(name, live.get(name))
            key = id(live.get(name, spec))
            entries.append(Entry(path, module, name, spec, key))
    return entries


def layout_bytes(entries: list[Entry]) -> int:
    """Bytes a version staged in this layout holds (tied parameters once)."""
    seen: dict[int, int] = {}
    for e in entries:
        seen.setdefault(e.key, e.spec.numel() * e.spec.element_size())
    return sum(seen.values())


def _staging_tensor(spec, live_module, shadow_module, pin: bool):
    import torch

    tensor = torch.zeros(tuple(spec.shape), dtype=spec.dtype, pin_memory=pin)
    tensor.__class__ = spec.__class__
    tensor.__dict__ = dict(spec.__dict__)
    return shard_forms.bind_loaders(tensor, live_module, shadow_module)


class _Written:
    """Records which staging tensors a loader wrote into (`copy_`/`fill_` into their storage),
    and how many writes there were: a module's parameters the checkpoint does not hold stay
    out of the commit, and a tensor no loader wrote anything of is named."""

    def __init__(self, by_storage: dict[int, int]):
        from torch.utils._python_dispatch import TorchDispatchMode

        written: set[int] = set()
        counts = [0]

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.__name__.startswith(("copy_", "fill_")):
                    target = args[0]
                    meta = target.device.type == "meta"
                    ptr = 0 if meta else target.untyped_storage().data_ptr()
                    if ptr in by_storage:
                        written.add(by_storage[ptr])
                        counts[0] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode
        self.keys = written
        self.counts = counts


class ShardStage:
    """One version's shard on this worker; `load_weights` takes checkpoint tensors, as a
    weight-transfer engine's target does."""

    def __init__(self, model, entries: list[Entry], pin: bool):
        shadows: dict[int, object] = {}
        for module in model.modules():
            shadow = object.__new__(type(module))
            shadow.__dict__ = dict(module.__dict__)
            shadow._parameters = dict.fromkeys(module._parameters)
            shadow._buffers = dict(module._buffers)
            shadows[id(module)] = shadow
        for module in model.modules():
            shadow = shadows[id(module)]
            shadow._modules = {
                n: None if c is None else shadows[id(c)] for n, c in module._modules.items()
            }
        self.entries = entries
        self.tensors: dict[int, object] = {}  # live parameter identity -> staging tensor
        for e in entries:
            shadow = shadows[id(e.module)]
            if e.key not in self.tensors:
                self.tensors[e.key] = _staging_tensor(e.spec, e.module, shadow, pin)
            shadow._parameters[e.name] = self.tensors[e.key]
        self.shadow = shadows[id(model)]
        by_storage = {t.untyped_storage().data_ptr(): k for k, t in self.tensors.items()}
        self._written = _Written(by_storage)
        self.names: set[str] = set()
        #: Tensors the model's loaders took nothing of (a checkpoint may hold some vLLM skips,
        #: such as `rotary_emb.inv_freq`: reported, and refused only when it is every tensor).
        self.ignored: list[str] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def load_weights(self, weights) -> set[str]:
        """Run the model's own loading code on the shadow: each tensor's slice lands in the
        staging tensors."""
        for name, tensor in weights:
            before = self._written.counts[0]
            with self._written.mode():
                self.shadow.load_weights(iter([(name, tensor)]))
            if self._written.counts[0] == before:
                self.ignored.append(name)
            self.names.add(name)
        return self.names

    def seal(self) -> None:
        """The stream ended: keep the staged values only. The shadow goes, and so do the
        staging tensors' attributes (weight loaders bound to shadow modules, whose attributes
        are the live modules' of the time: a held shard would keep the served forms of then,
        such as the CPU build's packed GEMM weights, alive with it)."""
        self.tensors = {k: t.data for k, t in self.tensors.items()}
        self.shadow = None

    def by_module(self) -> list[tuple[object, dict]]:
        """(live module, {parameter name: staged tensor}) for every module the stream wrote,
        in model order; a tied parameter goes to each module that holds it."""
        out: dict[int, tuple[object, dict]] = {}
        for e in self.entries:
            if e.key in self._written.keys:
                out.setdefault(id(e.module), (e.module, {}))[1][e.name] = self.tensors[e.key]
        return list(out.values())

    def unwritten(self) -> list[str]:
        """Parameters of written modules that no loader wrote (their module cannot be
        rebuilt from the shard)."""
        touched = {id(m) for m, _ in self.by_module()}
        return [
            f"{e.path}.{e.name}" if e.path else e.name
            for e in self.entries
            if id(e.module) in touched and e.key not in self._written.keys
        ]
