"""megatron-bridge 0.6.2 on the model zoo: build, load, logits vs HF, export vs checkpoint.

Why: docs/model-mapping.md decides between the bridge and our own mapping by measurement.
For each zoo model, on TP gloo ranks inside the project's `cpu_shim()` + `cpu_megatron()`:
build the bridge's provider with the local (non-TE) spec in fp32 on CPU, load the HF
weights with `load_hf_weights`, forward the saved prompts and compare the all-gathered
logits with the saved HF fp32 logits, then `export_hf_weights` and compare with the
checkpoint's safetensors (names, shapes, values). One JSON record per model goes to `--out`
(default: stdout); `summarize.py` turns records into table lines.

As shipped, nothing is changed beyond what a CPU run needs (local spec, fusions off, fp32,
alltoall dispatcher). `--fix` applies the adjustments named in docs/model-mapping.md:
  rope           llama3 rope `inv_freq` from the checkpoint's values (the bridge passes only
                 `factor`; Megatron fixes low 1, high 4, original 8192)
  dense-layers   Qwen3-MoE `mlp_only_layers` as `moe_layer_freq` (the bridge makes every
                 layer MoE)
  mla-attention  `SdpaCoreAttention` as MLA's core attention (the local one lacks
                 `k_channels` / `v_channels`)
  no-mtp         `mtp_num_layers=None` (HF-written checkpoints carry no MTP weights)
  group-score    HF's expert-group score in megatron-core (`hf_group_score.py`)
`--fix all` applies every one. `--divisible-by 128` pads the vocabulary as Megatron trainers
do (`should_pad_vocab=True`); the default leaves it unpadded, as the bridge does.

Run with the project's train venv, the bridge's packages first on the path, after
`write_zoo.py` (see README.md for the install):

    .venv-train/bin/python bench/bridge_eval/run_bridge.py --zoo /tmp/zoo \\
        --bridge-pkgs /tmp/bridge-pkgs --tp 2 --fix all --out /tmp/bridge-tp2-fix.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import HF_LOGITS, MODELS, use_repo

FIXES = ("rope", "dense-layers", "mla-attention", "no-mtp", "group-score")
FUSIONS = (
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
    "moe_grouped_gemm",
    "moe_permute_fusion",
    "moe_router_fusion",
    "cross_entropy_loss_fusion",
)
PROVIDER_FIELDS = (  # recorded per model, to see what the bridge made of the HF config
    "rope_scaling",
    "rope_scaling_factor",
    "rotary_base",
    "make_vocab_size_divisible_by",
    "share_embeddings_and_output_weights",
    "qk_layernorm",
    "add_qkv_bias",
    "kv_channels",
    "multi_latent_attention",
    "moe_router_score_function",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
    "moe_router_enable_expert_bias",
    "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
    "rotary_scaling_factor",
    "mtp_num_layers",
    "original_max_position_embeddings",
)
TRACEBACK_CHARS = 3000


@dataclass(frozen=True)
class Options:
    """What one run measures; passed to every rank."""

    zoo: Path
    tp: int
    names: tuple[str, ...]
    fixes: frozenset[str] = field(default_factory=frozenset)
    divisible_by: int | None = None


def _spec_name(spec) -> str:
    """A layer spec's name without memory addresses (a partial shows its function and args)."""
    if isinstance(spec, functools.partial):
        args = ", ".join(f"{k}={v!r}" for k, v in spec.keywords.items())
        return f"partial({_spec_name(spec.func)}, {args})"
    return getattr(spec, "__name__", repr(spec))


def _mla_spec(inner):
    """`inner`'s block spec with `SdpaCoreAttention` as every layer's core attention."""
    from art_megatron_ext.lora.mla_core_attention import SdpaCoreAttention

    def spec(config, vp_stage=None):
        block = inner(config, vp_stage=vp_stage)
        for layer_spec in block.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
        return block

    return spec


def _apply_fixes(provider, hf_config: dict, fixes: frozenset[str], notes: list[str]) -> None:
    """The provider-side fixes (`rope` needs the built model: see `_fix_rope`)."""
    dense = hf_config.get("mlp_only_layers")
    if "dense-layers" in fixes and dense:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        layers = hf_config["num_hidden_layers"]
        provider.moe_layer_freq = [0 if i in dense else 1 for i in range(layers)]
        provider.transformer_layer_spec = functools.partial(
            get_gpt_decoder_block_spec, use_transformer_engine=False
        )
        notes.append("decoder_block_spec(moe_layer_freq)")
    if "mla-attention" in fixes and getattr(provider, "multi_latent_attention", False):
        provider.transformer_layer_spec = _mla_spec(provider.transformer_layer_spec)
        notes.append("MLA core attention = SdpaCoreAttention")
    if "group-score" in fixes and getattr(provider, "moe_router_num_groups", None):
        import hf_group_score

        hf_group_score.install()
        notes.append("group score = HF top-2")
    if "no-mtp" in fixes and getattr(provider, "mtp_num_layers", None):
        provider.mtp_num_layers = None
        notes.append("mtp_num_layers=None")


def _fix_rope(model, provider, hf_config: dict, notes: list[str]) -> None:
    """Set llama3 rope `inv_freq` from the checkpoint's values, not Megatron's fixed ones."""
    rope = hf_config.get("rope_parameters") or {}
    if rope.get("rope_type") != "llama3":
        return
    dim = provider.kv_channels
    base = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rotary = model.rotary_pos_emb
    rotary.inv_freq = rotary._apply_scaling(
        base,
        factor=rope["factor"],
        low_freq_factor=rope["low_freq_factor"],
        high_freq_factor=rope["high_freq_factor"],
        original_max_position_embeddings=rope["original_max_position_embeddings"],
    )
    notes.append("rope inv_freq from checkpoint")


def build(opts: Options, name: str, notes: list[str]):
    """(bridge, provider, model) for zoo model `name`, HF weights loaded through the bridge."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import default_layer_spec, local_layer_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnBackend

    path = opts.zoo / name
    hf_config = json.loads((path / "config.json").read_text())
    bridge = AutoBridge.from_hf_pretrained(str(path), dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=False)
    shipped = _spec_name(provider.transformer_layer_spec)
    if provider.transformer_layer_spec is default_layer_spec:  # the TE spec
        provider.transformer_layer_spec = local_layer_spec
    notes.append(f"{shipped} -> {_spec_name(provider.transformer_layer_spec)}")
    if opts.divisible_by:
        provider.make_vocab_size_divisible_by = opts.divisible_by
        provider.should_pad_vocab = True
    provider.tensor_model_parallel_size = opts.tp
    provider.sequence_parallel = False
    provider.use_cpu_initialization = True
    provider.params_dtype = torch.float32
    provider.pipeline_dtype = torch.float32
    provider.bf16 = False
    provider.fp16 = False
    provider.attention_backend = AttnBackend.local
    for flag in FUSIONS:
        if hasattr(provider, flag):
            setattr(provider, flag, False)
    if getattr(provider, "num_moe_experts", None):
        provider.moe_token_dispatcher_type = "alltoall"
        provider.moe_router_dtype = "fp32"
    _apply_fixes(provider, hf_config, opts.fixes, notes)
    provider.finalize()
    # provide() needs the process groups outside provide_distributed_model
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(0)
    model = provider.provide()
    model.eval()
    if "rope" in opts.fixes:
        _fix_rope(model, provider, hf_config, notes)
    bridge.load_hf_weights([model])
    return bridge, provider, model


def _logits(model, tokens: torch.Tensor, tp: int) -> torch.Tensor:
    """Full-vocabulary logits, all-gathered over the TP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    s = tokens.shape[1]
    positions = torch.arange(s)[None].expand_as(tokens)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        local = model(tokens, positions, mask)
    parts = [torch.empty_like(local) for _ in range(tp)]
    group = parallel_state.get_tensor_model_parallel_group()
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, -1)


def _compare_export(bridge, model, checkpoint: Path) -> dict:
    """The exported tensors against the checkpoint's: missing, extra, shape and value diffs."""
    from safetensors.torch import load_file

    exported = {
        n: t.detach().cpu()
        for n, t in bridge.export_hf_weights([model], cpu=True, show_progress=False)
    }
    want = load_file(checkpoint / "model.safetensors")
    common = [k for k in want if k in exported]
    rec = {
        "export_missing": sorted(set(want) - set(exported)),
        "export_extra": sorted(set(exported) - set(want)),
        "export_shape_diff": {
            k: [list(exported[k].shape), list(want[k].shape)]
            for k in common
            if exported[k].shape != want[k].shape
        },
        "export_value_diff": sorted(
            k
            for k in common
            if exported[k].shape == want[k].shape
            and not torch.equal(exported[k].float(), want[k].float())
        ),
        "export_dtypes": sorted({str(t.dtype) for t in exported.values()}),
    }
    rec["export_bitwise"] = not any(rec[k] for k in list(rec)[:4])
    return rec


def measure(opts: Options, name: str) -> dict:
    """One JSON-able record for zoo model `name` (failures recorded, not raised)."""
    rec: dict = {"name": name, "tp": opts.tp, "fixes": sorted(opts.fixes)}
    notes: list[str] = []
    try:
        bridge, provider, model = build(opts, name, notes)
    except Exception as e:
        rec["build"] = f"FAIL {type(e).__name__}: {e}"
        rec["spec"] = " ; ".join(notes)
        rec["tb"] = traceback.format_exc()[-TRACEBACK_CHARS:]
        return rec
    rec["build"] = "ok"
    rec["spec"] = " ; ".join(notes)
    rec["provider"] = {k: repr(getattr(provider, k, None)) for k in PROVIDER_FIELDS}
    params = dict(model.named_parameters())
    rec["padded_vocab"] = params["embedding.word_embeddings.weight"].shape[0] * opts.tp
    data = torch.load(opts.zoo / HF_LOGITS)
    ref = data[name]
    try:
        logits = _logits(model, data["prompts"], opts.tp)
        rec["logits_cols"] = logits.shape[-1]
        rec["logits_maxabs"] = (logits[..., : ref.shape[-1]] - ref).abs().max().item()
        padded = logits[..., ref.shape[-1] :]
        rec["pad_cols_maxabs"] = padded.abs().max().item() if padded.numel() else 0.0
    except Exception as e:
        rec["forward"] = f"FAIL {type(e).__name__}: {e}"
        rec["tb"] = traceback.format_exc()[-TRACEBACK_CHARS:]
    try:
        rec.update(_compare_export(bridge, model, opts.zoo / name))
    except Exception as e:
        rec["export"] = f"FAIL {type(e).__name__}: {e}"
        rec["tb_export"] = traceback.format_exc()[-TRACEBACK_CHARS:]
    return rec


def worker(rank: int, world: int, opts: Options) -> list[dict]:
    """One rank: every model in turn, each in its own Megatron parallel state."""
    import te_stub

    te_stub.install()  # before anything imports megatron.bridge
    import megatron.bridge
    import transformers
    from support.megatron_cpu import megatron_parallel

    from art_megatron_ext.cpu_stand_in import cpu_shim
    from art_megatron_ext.lora.cpu_runtime import cpu_megatron

    versions = {
        "megatron.bridge": megatron.bridge.__file__,
        "transformers": transformers.__version__,
    }
    out = []
    with cpu_shim(), cpu_megatron():
        for name in opts.names:
            with megatron_parallel(tp=world):
                out.append({**measure(opts, name), **versions})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=Path, required=True, help="folder written by write_zoo.py")
    parser.add_argument(
        "--bridge-pkgs",
        type=Path,
        help="pip --target folder holding megatron-bridge (put first on sys.path; "
        "or set PYTHONPATH to it instead)",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (gloo ranks)")
    parser.add_argument("--fix", nargs="+", default=[], choices=[*FIXES, "all"])
    parser.add_argument("--divisible-by", type=int, help="pad the vocabulary to a multiple")
    parser.add_argument("--out", type=Path, help="JSON lines file (default: stdout)")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("names", nargs="*", default=list(MODELS), help="zoo models")
    args = parser.parse_args()

    if args.bridge_pkgs:  # spawned ranks inherit sys.path
        sys.path.insert(0, str(args.bridge_pkgs.resolve()))
    use_repo()
    from support.dist import run_ranks

    fixes = frozenset(FIXES if "all" in args.fix else args.fix)
    opts = Options(args.zoo.resolve(), args.tp, tuple(args.names), fixes, args.divisible_by)
    records = run_ranks(worker, world_size=args.tp, args=(opts,), timeout_s=args.timeout_s)[0]
    lines = "".join(json.dumps(rec) + "\n" for rec in records)
    if args.out:
        args.out.write_text(lines)
    else:
        sys.stdout.write(lines)


if __name__ == "__main__":
    main()
