"""The one place that names Megatron-core's private (non-public-API) objects.

Why: Megatron-core moves internals between minor releases (e.g. `moe_utils.permute` returned
3 values in 0.16 and 5 in 0.19). Every module of ours that touches such a name imports it
from here, so a version bump is one file to audit, and an untested version fails at import
with a message instead of deep inside a training step.

Sections below are grouped by the feature that needs them; add a name to the section of its
feature (or a new section) rather than importing Megatron internals elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

SUPPORTED_MEGATRON = ((0, 19), (0, 20))  # [min, max): megatron-core 0.19.x
SUPPORTED_RANGE_TEXT = "megatron-core >=0.19,<0.20"


class UnsupportedMegatronVersion(RuntimeError):
    """Raised when the installed megatron-core is outside the tested range."""


def _parse(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError) as exc:
        raise UnsupportedMegatronVersion(
            f"cannot parse megatron-core version {version!r}; art_megatron_ext supports "
            f"{SUPPORTED_RANGE_TEXT}"
        ) from exc


def check_megatron_version(version: str) -> None:
    """Refuse a megatron-core version outside the tested range, naming the range."""
    lo, hi = SUPPORTED_MEGATRON
    if not (lo <= _parse(version) < hi):
        raise UnsupportedMegatronVersion(
            f"megatron-core {version} is not supported by art_megatron_ext; "
            f"tested range is {SUPPORTED_RANGE_TEXT}. Install a supported version "
            "(`pip install 'megatron-core>=0.19,<0.20'`)."
        )


def megatron_version() -> str:
    import megatron.core

    return megatron.core.__version__


def require_megatron() -> str:
    """Import megatron.core and check its version; returns the version string."""
    version = megatron_version()
    check_megatron_version(version)
    return version


# --- LoRA (art_megatron_ext/lora): state that activation recomputation restores -------------
# Why: a LoRA slot chosen by a context manager at forward time must still be the active slot
# when Megatron recomputes a checkpointed region during backward (outside that context).
# Megatron's checkpoint functions (`CheckpointFunction`, `CheckpointWithoutOutput`) save
# `_get_all_rng_states()` at forward and restore it with `_set_all_rng_states(*states)` right
# before recomputing; every caller treats the tuple as opaque. We append one extra element
# holding our captured state, so it rides along with the RNG states and nothing else changes.


class _RecomputeExtra(tuple):
    """The extra element appended to Megatron's RNG-state tuple: captured states by name."""


_RECOMPUTE_STATE: dict[str, tuple] = {}  # name -> (capture() -> object, restore(object))


def register_recompute_state(name: str, capture, restore) -> None:
    """Make `capture()` run when Megatron saves RNG states for recompute, `restore(v)` before.

    Idempotent per name (a later registration replaces an earlier one). Installs the wrapper
    around `megatron.core.tensor_parallel.random._get_all_rng_states/_set_all_rng_states`
    once per process.
    """
    require_megatron()
    from megatron.core.tensor_parallel import random as mrandom

    _RECOMPUTE_STATE[name] = (capture, restore)
    if getattr(mrandom._get_all_rng_states, "_art_recompute_state", False):
        return
    get_orig, set_orig = mrandom._get_all_rng_states, mrandom._set_all_rng_states

    def _get_all_rng_states():
        extra = _RecomputeExtra((n, cap()) for n, (cap, _) in _RECOMPUTE_STATE.items())
        return (*get_orig(), extra)

    def _set_all_rng_states(*states):
        if states and isinstance(states[-1], _RecomputeExtra):
            for n, value in states[-1]:
                if n in _RECOMPUTE_STATE:
                    _RECOMPUTE_STATE[n][1](value)
            states = states[:-1]
        return set_orig(*states)

    _get_all_rng_states._art_recompute_state = True
    mrandom._get_all_rng_states = _get_all_rng_states
    mrandom._set_all_rng_states = _set_all_rng_states


def megatron_rng_module():
    """`megatron.core.tensor_parallel.random` (private helpers `_get/_set_cuda_rng_state`)."""
    from megatron.core.tensor_parallel import random as mrandom

    return mrandom


# --- HybridEP hook-up (art_megatron_ext/moe/hybridep_hookup.py) ------------------------------
# Megatron-core imports `from deep_ep import HybridEPBuffer` in `fused_a2a.py`; without DeepEP
# it leaves `HybridEPBuffer` undefined and `hybrid_ep_dispatch/combine` None there and in
# `token_dispatcher.py` (which imported them by name). We point those module attributes at
# ours at run time instead of installing a package named `deep_ep` (that would shadow a real
# DeepEP). Megatron's own autograd Functions `HybridEPDispatch/HybridEPCombine` are reused.
# `reset_hybrid_ep_buffer` only sets the `_hybrid_ep_buffer` global to None; ours also closes
# the dropped buffer (collective: frees its registered memory and IPC mappings).
HYBRIDEP_FUSED_A2A_ATTRS = (
    "HybridEPBuffer",
    "HAVE_HYBRIDEP",
    "hybrid_ep_dispatch",
    "hybrid_ep_combine",
    "reset_hybrid_ep_buffer",
)
HYBRIDEP_TOKEN_DISPATCHER_ATTRS = ("hybrid_ep_dispatch", "hybrid_ep_combine")
HYBRIDEP_BUFFER_GLOBAL = "_hybrid_ep_buffer"
"""`fused_a2a`'s module global holding the buffer Megatron built (None before the first use)."""


def megatron_fused_a2a_module():
    """`megatron.core.transformer.moe.fused_a2a` (private: HybridEP globals and Functions)."""
    require_megatron()
    from megatron.core.transformer.moe import fused_a2a

    return fused_a2a


def megatron_token_dispatcher_module():
    """`megatron.core.transformer.moe.token_dispatcher` (holds imported hybrid_ep_* names)."""
    require_megatron()
    from megatron.core.transformer.moe import token_dispatcher

    return token_dispatcher


# --- Router replay (art_megatron_ext/routing/replay.py) --------------------------------------
# `RouterReplay` keeps one instance per MoE router in a class-level list, in construction
# order, and its static methods set targets and actions on all of them; `RouterReplayAction`
# selects RECORD / REPLAY_FORWARD / REPLAY_BACKWARD. Megatron's own docstrings call replay
# "for debugging and development", so we treat the module as private.
def megatron_router_replay():
    """`(RouterReplay, RouterReplayAction)` from `megatron.core.transformer.moe.router_replay`."""
    require_megatron()
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    return RouterReplay, RouterReplayAction


# megatron-core 0.19.2 bug: `TopKRouter._apply_expert_bias` masks padding with
# `routing_map & ~padding_mask`, a [tokens, experts] map against a [tokens] mask, which fails to
# broadcast (or, when tokens == experts, masks the wrong axis). So any forward with both
# `moe_router_enable_expert_bias` and a `padding_mask` fails in training. Within
# `expert_bias_padding_mask_fixed(modules)` the routers found in `modules` (and only those) use a
# method that masks rows; the class and every other router keep Megatron's, and the routers get
# Megatron's back on exit.
def _row_masked_apply_expert_bias(self, routing_map, padding_mask=None):
    import torch

    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


@contextlib.contextmanager
def expert_bias_padding_mask_fixed(modules):
    """Within the block, the `TopKRouter`s in `modules` (a module or a list of them) count
    expert-bias load on non-padding rows only. Scoped per router instance: nothing global is
    patched, and re-entering for the same router is a no-op for the inner block."""
    require_megatron()
    from megatron.core.transformer.moe.router import TopKRouter

    roots = modules if isinstance(modules, list | tuple) else [modules]
    routers = [
        m
        for root in roots
        for m in root.modules()
        if isinstance(m, TopKRouter) and "_apply_expert_bias" not in m.__dict__
    ]
    for router in routers:
        router._apply_expert_bias = types.MethodType(_row_masked_apply_expert_bias, router)
    try:
        yield
    finally:
        for router in routers:
            del router._apply_expert_bias


# --- Distributed optimizer state (art_megatron_ext/optim/optimizer_state.py, lora/padding.py) -
# `DistributedOptimizer.state_dict()` leaves out the parameter state (fp32 main params and
# Adam moments: they are sharded over DP and saved by Megatron through separate calls). We
# read and write one model parameter's shard of it with the optimizer's own per-parameter
# helpers, and locate that shard with its range map. `ChainedOptimizer` keeps its parts in
# `chained_optimizers`. Names as of megatron-core 0.19.2 (optimizer/distrib_optimizer.py).
def is_distributed_optimizer(optimizer) -> bool:
    """True for a megatron-core `DistributedOptimizer` (not a chain of them)."""
    require_megatron()
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(optimizer, DistributedOptimizer)


def chained_parts(optimizer) -> list:
    """The parts of a `ChainedOptimizer`, or `[optimizer]` for anything else."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def distopt_model_params(optimizer) -> list:
    """The model parameters a `DistributedOptimizer` owns a shard of (on this DP rank)."""
    return list(optimizer.model_param_group_index_map)


def distopt_owns(optimizer, model_param) -> bool:
    """True when this DP rank holds a shard of `model_param` (identity, not tensor equality)."""
    return model_param in optimizer.model_param_group_index_map


def distopt_param_shard(optimizer, model_param) -> tuple[int, int]:
    """(start, end) of this DP rank's shard within the flattened `model_param`."""
    rng = optimizer._get_model_param_range_map(model_param)["param"]
    return int(rng.start), int(rng.end)


def distopt_get_param_state(optimizer, model_param) -> dict:
    """{"param": fp32 main shard, "exp_avg": ..., ...} for `model_param` (live tensors)."""
    return optimizer._get_main_param_and_optimizer_states(model_param)


def distopt_set_param_state(optimizer, model_param, tensors: dict) -> None:
    """Copy `tensors` (as returned by `distopt_get_param_state`) into the live shard state."""
    optimizer._set_main_param_and_optimizer_states(model_param, tensors)


# --- Transformer Engine linears (art_megatron_ext/lora/attach.py, site.py) -------------------
# LoRA attaches to the TE linears Megatron's TE specs build. We never import
# `transformer_engine` (absent on CPU machines, and importing a half-installed TE breaks
# `import megatron.core`): a module is recognized by the name of a class in its MRO, the one
# `megatron/core/extensions/transformer_engine.py` (0.19) defines, and read through the
# attributes those wrappers and TE set. Names and attributes below are what 0.19 uses.
TE_COLUMN = "TEColumnParallelLinear"
TE_ROW = "TERowParallelLinear"
TE_LAYERNORM_COLUMN = "TELayerNormColumnParallelLinear"
TE_DUPLICATED = "TELinear"  # parallel_mode "duplicated" (MLA down projections): not a target
TE_COLUMN_GROUPED = "TEColumnParallelGroupedLinear"
TE_ROW_GROUPED = "TERowParallelGroupedLinear"
_TE_LINEAR_CLASSES = (TE_LAYERNORM_COLUMN, TE_COLUMN, TE_ROW, TE_DUPLICATED)


def te_linear_class(module) -> str | None:
    """The Megatron TE wrapper class `module` is (or derives from), by name; None otherwise.

    Checks the most specific name first (`TELMHeadColumnParallelLinear` is a
    `TEColumnParallelLinear`, both are `TELinear`s)."""
    names = {cls.__name__ for cls in type(module).__mro__}
    return next((name for name in _TE_LINEAR_CLASSES if name in names), None)


def te_tp_group(module):
    """Megatron's tensor-parallel group of a TE wrapper (`_tp_group`; expert-TP for experts)."""
    return getattr(module, "_tp_group", None)


def te_layernorm_output(output) -> tuple:
    """Split a `TELayerNormColumnParallelLinear` output taken with `return_layernorm_output`.

    TE's `LayerNormLinear` then returns `(out, ln_out)` or, with `return_bias`,
    `(out, bias, ln_out)`; Megatron's wrapper returns that tuple as is when `te_return_bias`,
    else `(TE's output, None)`. Returns `(out, bias, ln_out)`."""
    first, *rest = output
    if isinstance(first, (tuple, list)):  # ((out, ln_out), None)
        (out, ln_out), bias = first, rest[0]
        return out, bias, ln_out
    out, bias, ln_out = output
    return out, bias, ln_out


# --- TE op fuser in grouped experts (art_megatron_ext/lora/attach.py) -----------------------
# With `TransformerConfig.use_transformer_engine_op_fuser` on, 0.19's `TEGroupedMLP.__init__`
# asserts TE (>= 2.14) can fuse the layer and stores the decision in `_with_fused_impl`; its
# `forward` then runs `_fused_forward`, TE fused ops built from the weights of `linear_fc1` /
# `linear_fc2`, and never calls either module, so hooks on them (LoRA) never fire.
TE_OP_FUSER_FLAG = "use_transformer_engine_op_fuser"
_TE_GROUPED_MLP_FUSED_ATTR = "_with_fused_impl"


def te_grouped_mlp_bypasses_linears(experts) -> bool:
    """True when `experts` is Megatron's `TEGroupedMLP` (or a subclass) set to run the TE
    op-fuser path, which never calls its `linear_fc1` / `linear_fc2`.

    Reads the constructor's decision (`_with_fused_impl`); a version without that attribute
    falls back to the config flag, erring on the side of refusing."""
    require_megatron()
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    if not isinstance(experts, TEGroupedMLP):
        return False
    flag = bool(getattr(experts.config, TE_OP_FUSER_FLAG, False))
    return bool(getattr(experts, _TE_GROUPED_MLP_FUSED_ATTR, flag))


# --- dist_checkpointing writes (art_megatron_ext/optim/dist_checkpoint.py) -------------------
# Megatron's torch_dist save strategy opens every data file (`__R_I.distcp`) with the name
# `open` looked up in `dist_checkpointing/strategies/filesystem_async.py` (0.19.2,
# `write_preloaded_data`: `open_file = open`). Binding a hashing `open` there for the length
# of one save lets us digest each data file while it is written. We also read and write the
# distributed optimizer's per-parameter state with `_set_main_param_and_optimizer_states`,
# which in 0.19.2 requires a value for every live state key while
# `load_parameter_state_from_fully_reshardable` leaves out torch Adam's "step" (KeyError);
# `distopt_load_state_dict` supplies the live step (set from param_groups just before).
def dist_ckpt_writer_module():
    """`megatron.core.dist_checkpointing.strategies.filesystem_async` (private writer)."""
    require_megatron()
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return filesystem_async


# Async dist_checkpointing saves (art_megatron_ext/optim/dist_checkpoint.py). In 0.19.2
# `dist_checkpointing.save(..., async_sharded_save=True, async_strategy="mcore")` plans on the
# default group and returns an `AsyncRequest` whose `async_fn(rank, write_buckets,
# results_queue)` only writes this rank's files, and whose `finalize_fns` are
# [strategies/torch.py `finalize_fn` (closes over `save_state_dict_ret = (writer,
# global_metadata, dist_wrapper)`; its gather and broadcast use `dist_wrapper.group`),
# serialization.py `metadata_finalize_fn` (rank 0 `save_config`, then a barrier on the
# default group)]. A background save runs the first with `dist_wrapper.group` rebound to a
# checkpoint-only group and replaces the second by `save_config` plus its own barrier, so no
# collective of the default group ever runs off the main thread.
@dataclasses.dataclass
class DistAsyncParts:
    write_fn: object  # write_fn(rank, write_buckets, results_queue)
    rank: int
    write_buckets: list  # [(path, file_name, (bytes_data, [(item, tensor), ...])), ...]
    results_queue: object
    finalize: object  # the strategy's finalize (metadata gather, `.metadata` on the coordinator)
    dist_wrapper: object  # torch DCP `_DistWrapper` of the plan; `.group` is rebindable


def dist_ckpt_async_parts(request) -> DistAsyncParts:
    """Take a 0.19 `AsyncRequest` from `dist_checkpointing.save(async_sharded_save=True)`
    apart (see above); raises naming what differs when Megatron's structure changed."""
    import inspect

    names = [getattr(fn, "__name__", repr(fn)) for fn in request.finalize_fns]
    if names != ["finalize_fn", "metadata_finalize_fn"]:
        raise RuntimeError(
            f"megatron-core {megatron_version()}: unexpected async save finalize functions "
            f"{names} (0.19.2 has ['finalize_fn', 'metadata_finalize_fn'])"
        )
    captured = inspect.getclosurevars(request.finalize_fns[0]).nonlocals
    ret = captured.get("save_state_dict_ret")
    if not (isinstance(ret, (tuple, list)) and len(ret) == 3 and hasattr(ret[2], "group")):
        raise RuntimeError(
            f"megatron-core {megatron_version()}: async save finalize does not close over "
            "(writer, global_metadata, dist_wrapper)"
        )
    if request.async_fn is None:  # nothing to write on this rank
        return DistAsyncParts(None, 0, [], None, request.finalize_fns[0], ret[2])
    rank, buckets, queue = request.async_fn_args
    return DistAsyncParts(
        request.async_fn, rank, list(buckets), queue, request.finalize_fns[0], ret[2]
    )


def dist_ckpt_save_config(directory) -> None:
    """Write `metadata.json` (backend torch_dist, version 1) as `metadata_finalize_fn` does."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    save_config(CheckpointingConfig("torch_dist", 1), str(directory))


def distopt_load_state_dict(optimizer, state_dict) -> None:
    """`optimizer.load_state_dict(state_dict)` for a (chain of) DistributedOptimizer whose
    inner torch Adam keeps `step` per parameter (no TE/Apex)."""
    parts = chained_parts(optimizer)
    for part in parts:
        original = part._set_main_param_and_optimizer_states

        def set_with_step(model_param, tensors, part=part, original=original):
            if "step" not in tensors:
                live = part._get_main_param_and_optimizer_states(model_param)
                if "step" in live:
                    tensors = {**tensors, "step": live["step"]}
            return original(model_param, tensors)

        part._set_main_param_and_optimizer_states = set_with_step
    try:
        optimizer.load_state_dict(state_dict)
    finally:
        for part in parts:
            del part._set_main_param_and_optimizer_states


def distopt_init_state(optimizer) -> None:
    """Allocate a fresh DistributedOptimizer's state (one zero-gradient step), as Megatron's
    own loaders do before reading a checkpoint into it."""
    for part in chained_parts(optimizer):
        if len(part.optimizer.state) == 0:
            part._init_optimizer_states_with_dummy_values()


# --- Tree attention (art_megatron_ext/packing/spec.py) ---------------------------------------
# The packed prefix tree reaches every layer's core attention as `packed_seq_params` (a
# `PackedSeqParams` subclass with qkv_format "tree", which Megatron's "thd" branches skip).
# RoPE: in 0.19.2 `GPTModel._preprocess` calls
# `self.rotary_pos_emb.get_rotary_seq_len(..., packed_seq_params)` and then
# `self.rotary_pos_emb(rotary_seq_len, packed_seq=..., cp_group=...)`, once per forward; we
# wrap the module held at that attribute to return frequencies at per-token positions.
GPT_ROTARY_ATTR = "rotary_pos_emb"


def gpt_rotary_module_attr() -> str:
    """The GPTModel attribute holding its `RotaryEmbedding` (called once per forward)."""
    return GPT_ROTARY_ATTR


def mla_rotary_modules(model) -> list:
    """Every multi-latent attention layer's own `RotaryEmbedding` (0.19.2: MLA keeps one per
    layer in `self_attention.rotary_pos_emb`; the GPTModel has none for MLA)."""
    out = []
    for layer in model.decoder.layers:
        rotary = getattr(layer.self_attention, "rotary_pos_emb", None)
        if rotary is None:
            raise ValueError(f"layer {layer.layer_number}: no MLA rotary embedding")
        out.append(rotary)
    return out


def megatron_packed_seq_params_class():
    """`megatron.core.packed_seq_params.PackedSeqParams`."""
    require_megatron()
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams


def megatron_module_base():
    """`megatron.core.transformer.module.MegatronModule` (base of core-attention modules)."""
    require_megatron()
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


# --- LoRA padding in the distributed optimizer's live storage (art_megatron_ext/lora/padding.py)
# `_get_main_param_and_optimizer_states` (0.19.2 distrib_optimizer.py, around line 1098) returns
# live tensors except when `config.use_precision_aware_optimizer_no_fp8_or_ds_fp8` is set (and
# the inner optimizer is not a `HybridDeviceOptimizer`): then each moment comes from
# `get_unscaled_state`, a copy, and the fp32 master from the state key "master_param", so
# zeroing what it returns changes nothing. The live tensors are the inner optimizer's state
# of the sharded model parameter, found as Megatron finds it: `(group, order) =
# model_param_group_index_map[model_param]`, `optimizer.optimizer.param_groups[group]
# ["params"][order]`. Zero stays zero under any scale, so masking the scaled storage is exact.
def distopt_precision_aware(optimizer) -> bool:
    """True when this `DistributedOptimizer` hands back unscaled copies of its state."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    aware = getattr(optimizer.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
    return bool(aware) and not isinstance(optimizer.optimizer, HybridDeviceOptimizer)


def distopt_live_param_state(optimizer, model_param) -> dict:
    """{name: live tensor} the optimizer keeps for this rank's shard of `model_param` (main
    copy and moments, in their stored precision and scale); writes to them take effect."""
    if not distopt_precision_aware(optimizer):
        return distopt_get_param_state(optimizer, model_param)
    import torch

    group_index, group_order = optimizer.model_param_group_index_map[model_param]
    shard = optimizer.optimizer.param_groups[group_index]["params"][group_order]
    state = optimizer.optimizer.state[shard]
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def unwrap_model(model):
    """The model inside Megatron's wrappers (`DistributedDataParallel`, `Float16Module`, any
    nesting), so parameter names are the model's own (`decoder.layers.0...`, not
    `module.module.decoder...`). Anything else is returned as it is."""
    require_megatron()
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    wrappers = (DistributedDataParallel, Float16Module)
    while isinstance(model, wrappers):
        model = model.module
    return model


def set_rotary_inv_freq(rotary, inv_freq) -> None:
    """Replace a `RotaryEmbedding`'s inverse frequencies (0.19.2: the plain attribute
    `inv_freq`, read by `get_freqs_non_repeated`; `forward` is an `lru_cache` per sequence
    length, cleared here so no embedding of the old frequencies is served)."""
    current = rotary.inv_freq
    if current.shape != inv_freq.shape:
        raise ValueError(
            f"rope inverse frequencies are {tuple(current.shape)} in the model, "
            f"{tuple(inv_freq.shape)} from the checkpoint's head_dim"
        )
    rotary.inv_freq = inv_freq.to(device=current.device, dtype=current.dtype)
    type(rotary).forward.cache_clear()
