"""Tree attention inside a Megatron-core GPTModel: the core-attention module, the tree metadata
that rides Megatron's forward, and RoPE at each token's position in its trajectory.

How a trainer uses it (see `tree_layer_spec` and `enable_tree_attention`)::

    spec = tree_layer_spec(get_gpt_layer_local_spec(normalization="RMSNorm"))
    model = GPTModel(config, spec, vocab_size, max_len, position_embedding_type="rope")
    enable_tree_attention(model)
    params = TreePackedSeqParams.from_batch(batch)          # batch = pack_groups(...)
    logits = model(batch.tokens, batch.input_pos, None, packed_seq_params=params)

Why `packed_seq_params`: it is the one argument GPTModel hands unchanged to every layer's
core attention (and to the RoPE module's `get_rotary_seq_len`), and activation recompute
keeps it too. `TreePackedSeqParams` subclasses Megatron's `PackedSeqParams` with
`qkv_format="tree"`, so Megatron's own `thd` branches (squeezing, cu_seqlens RoPE) skip it;
Megatron's `DotProductAttention` refuses any packed params, so a model built without the tree
spec fails loudly instead of attending causally across branches.

Why RoPE needs help: GPTModel builds rotary frequencies for physical positions `0..S-1`, but a
branch stored after its siblings is not at its logical distance from its prefix. RoPE must
rotate by `input_pos` (the position within the trajectory). `enable_tree_attention` wraps the
model's rotary module so that, when tree params are passed, it returns `[S, rows, 1, dim]`
frequencies gathered at `input_pos` (Megatron's unfused RoPE broadcasts over rows). Learned
absolute embeddings need nothing: they already read `position_ids = input_pos`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from art_megatron_ext.compat import (
    gpt_rotary_module_attr,
    megatron_module_base,
    megatron_packed_seq_params_class,
)
from art_megatron_ext.packing.flex_tree_attention import (
    flex_tree_attention,
    tree_attention_backend,
    tree_block_mask,
)
from art_megatron_ext.packing.tree_attention import (
    TreeAttentionConfig,
    TreePlan,
    plan_tree_attention,
    tree_attention,
)

_PackedSeqParams = megatron_packed_seq_params_class()
_MegatronModule = megatron_module_base()
TREE_QKV_FORMAT = "tree"


@dataclass
class TreePackedSeqParams(_PackedSeqParams):
    """Megatron `PackedSeqParams` carrying a packed prefix-tree batch.

    Attributes:
        subtree_end: `[rows, seq]` int, from `PackedBatch.subtree_end`.
        positions: `[rows, seq]` int64 position of each token in its trajectory
            (`PackedBatch.input_pos`); RoPE rotates by it.
        attention: tile sizes and backend of the kernel.
        plan: the block plan, built once here and shared by every layer.
        block_mask: FlexAttention's masks of the plan (a `FlexTreeMask`, the "flex"
            backend), built by the first layer that needs it and shared by the others.
    """

    subtree_end: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    attention: TreeAttentionConfig = dataclasses.field(default_factory=TreeAttentionConfig)
    plan: TreePlan | None = None
    block_mask: object = None

    def __post_init__(self) -> None:
        if self.subtree_end is None or self.positions is None:
            raise ValueError("TreePackedSeqParams needs subtree_end and positions")
        if self.positions.shape != self.subtree_end.shape:
            raise ValueError(
                f"positions {tuple(self.positions.shape)} and subtree_end "
                f"{tuple(self.subtree_end.shape)} must both be [rows, seq]"
            )
        seq = self.subtree_end.shape[1]
        self.qkv_format = TREE_QKV_FORMAT
        self.max_seqlen_q = self.max_seqlen_kv = seq
        if self.plan is None:
            self.plan = plan_tree_attention(self.subtree_end, self.attention.block)
        super().__post_init__()

    @classmethod
    def from_batch(
        cls,
        batch,
        *,
        device: torch.device | str | None = None,
        attention: TreeAttentionConfig | None = None,
    ) -> TreePackedSeqParams:
        """From a `PackedBatch` (its `subtree_end` and `input_pos`), moved to `device`."""
        return cls(
            subtree_end=batch.subtree_end.to(device),
            positions=batch.input_pos.to(device),
            attention=attention or TreeAttentionConfig(),
        )


class TreeCoreAttention(_MegatronModule):
    """Drop-in for Megatron's `DotProductAttention` (the `core_attention` submodule of
    `SelfAttention`) that attends along the packed prefix tree given in
    `packed_seq_params` (a `TreePackedSeqParams`), without an S x S mask or scores.

    Same constructor as `DotProductAttention`. Refused (at build): context parallelism,
    attention dropout, a non-vanilla softmax. `apply_query_key_layer_scaling` needs nothing:
    Megatron divides the scale by the layer number and multiplies it back in the softmax.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                f"TreeCoreAttention: context_parallel_size={config.context_parallel_size}; "
                "tree rows are not split over context-parallel ranks"
            )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"TreeCoreAttention: attention_dropout={dropout} is not supported")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"TreeCoreAttention: softmax_type={config.softmax_type!r}")
        if pg_collection is not None:
            tp = pg_collection.tp.size()
        else:
            from megatron.core import parallel_state

            tp = parallel_state.get_tensor_model_parallel_world_size()
        self.layer_number = max(1, layer_number)
        self.heads = config.num_attention_heads // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.head_dim**-0.5
        self.tree_ready = False  # set by enable_tree_attention (positions are handled)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query `[s, b, heads, dim]`, key/value `[s, b, kv_heads, dim]` -> `[s, b, heads*dim]`."""
        if not isinstance(packed_seq_params, TreePackedSeqParams):
            raise TypeError(
                "TreeCoreAttention needs packed_seq_params=TreePackedSeqParams(...) (the packed "
                f"tree), got {type(packed_seq_params).__name__}"
            )
        if attention_mask is not None or attention_bias is not None:
            raise ValueError(
                "TreeCoreAttention reads the tree from packed_seq_params; pass "
                "attention_mask=None (and no attention_bias)"
            )
        if not self.tree_ready:
            raise RuntimeError(
                "call enable_tree_attention(model) before the first forward: RoPE must rotate "
                "each token by its position in its trajectory, not its place in the row"
            )
        seq, rows = query.shape[0], query.shape[1]
        if packed_seq_params.subtree_end.shape != (rows, seq):
            raise ValueError(
                f"packed_seq_params.subtree_end is {tuple(packed_seq_params.subtree_end.shape)}, "
                f"but the attention input is {rows} rows x {seq} tokens"
            )
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        params = packed_seq_params
        if tree_attention_backend(params.attention.backend, query.device) == "flex":
            if params.block_mask is None:
                params.block_mask = tree_block_mask(
                    params.subtree_end,
                    params.plan,
                    q.device,
                    rows_per_call=params.attention.flex_rows,
                )
            out = flex_tree_attention(q, k, v, params.block_mask, scale=self.softmax_scale)
        else:
            out = tree_attention(
                q,
                k,
                v,
                params.subtree_end,
                scale=self.softmax_scale,
                plan=params.plan,
                config=params.attention,
            )
        return out.permute(2, 0, 1, 3).reshape(seq, rows, -1)


class TreeRotaryEmbedding(torch.nn.Module):
    """Wraps a GPTModel's `RotaryEmbedding`: with tree params, frequencies at `positions`.

    GPTModel calls `get_rotary_seq_len(..., packed_seq_params)` and then this module, once per
    forward; the first call notes the positions, the second consumes them. Without tree params
    both calls go to the wrapped module unchanged. Holds no state dict entries.
    """

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self._positions: torch.Tensor | None = None

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        params = kwargs.get("packed_seq_params", args[4] if len(args) > 4 else None)
        if isinstance(params, TreePackedSeqParams):
            self._positions = params.positions
            return params.positions.shape[1]
        self._positions = None
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        positions, self._positions = self._positions, None
        if positions is None:
            return self.inner(max_seq_len, offset, packed_seq, cp_group)
        inv_freq = self.inner.inv_freq.to(positions.device)
        seq = positions.t().to(inv_freq.dtype) + offset  # [S, rows]
        if self.inner.seq_len_interpolation_factor is not None:
            seq = seq / self.inner.seq_len_interpolation_factor
        freqs = seq[..., None] * inv_freq  # [S, rows, dim/2]
        if self.inner.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, :, None, :]


def tree_layer_spec(spec):
    """A copy of a GPT layer spec (a `ModuleSpec` of a TransformerLayer, or a
    `TransformerBlockSubmodules` holding `layer_specs`) whose self-attention core is
    `TreeCoreAttention`. Works for the local and the Transformer Engine specs."""
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[tree_layer_spec(s) for s in spec.layer_specs])
    attention = spec.submodules.self_attention
    if not hasattr(attention.submodules, "core_attention"):
        raise ValueError(f"{attention.module} has no core_attention submodule to replace")
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(attention.submodules, core_attention=TreeCoreAttention),
    )
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention)
    )


def enable_tree_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Make a GPTModel built with `tree_layer_spec` ready for `TreePackedSeqParams`: RoPE at
    trajectory positions (learned absolute embeddings already read `position_ids`). Refuses
    a model without TreeCoreAttention layers or with a position embedding it cannot place.
    Idempotent; returns the model."""
    cores = [m for m in model.modules() if isinstance(m, TreeCoreAttention)]
    if not cores:
        raise ValueError("the model has no TreeCoreAttention: build it with tree_layer_spec(...)")
    kind = getattr(model, "position_embedding_type", None)
    attr = gpt_rotary_module_attr()
    if kind == "rope":
        rotary = getattr(model, attr, None)
        if rotary is not None and not isinstance(rotary, TreeRotaryEmbedding):
            if getattr(model.config, "apply_rope_fusion", False):
                raise ValueError(
                    "apply_rope_fusion=True: the fused RoPE kernel takes one frequency row per "
                    "position, not per (position, row); set apply_rope_fusion=False"
                )
            setattr(model, attr, TreeRotaryEmbedding(rotary))
    elif kind not in ("learned_absolute", "none"):
        raise ValueError(f"position_embedding_type={kind!r} is not supported with tree rows")
    for core in cores:
        core.tree_ready = True
    return model
