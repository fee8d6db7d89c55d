"""LoRA for Megatron-core modules: slots, one site iterator, padding cleanup, PEFT export.

Public API (see docs/lora.md):
- `attach_lora(model, LoraConfig(...))` adds LoRA to QKV, attention output, FC1, FC2 and
  grouped expert linears, tensor-parallel aware.
- `activate_slot(model, name)` chooses the slot for forward passes (survives recompute);
  `add_slot`, `load_slot`, `drop_slot` manage slots model-wide.
- `iter_lora_sites(model)`, `zero_lora_padding_(model, optimizer=None)`.
- `export_peft(model, slot, out_dir, base_model_name_or_path)` and `import_peft(...)`;
  `peft_adapter(...)`: the same tensors and config in memory, for a streamed update.
- `finish_lora_param_sync(model)` before reading trained LoRA weights under Megatron DDP's
  `overlap_param_gather` (export and dist-checkpoint saves call it themselves);
  `apply_slot_training(model, SlotTraining(trained=..., frozen=...))` before DDP wraps it.
"""

from .attach import BypassedLinear, UnsupportedLinear, attach_lora
from .config import DEFAULT_SLOT, KNOWN_TARGETS, LoraConfig, LoraPadding
from .export import export_peft, peft_adapter
from .hf_layout import HfNaming
from .site import LoraSite, NoActiveSlot, SlotHasLiveGradients
from .sites import (
    LoraPrecisionError,
    LoraSiteSlot,
    check_lora_optimizer_precision,
    finish_lora_param_sync,
    iter_lora_sites,
    zero_lora_padding_,
)
from .slot_ops import add_slot, drop_slot, import_peft
from .slot_training import SlotTraining, SlotTrainingAfterWrap, apply_slot_training, trained_slots
from .slots import activate_slot

__all__ = [
    "DEFAULT_SLOT",
    "KNOWN_TARGETS",
    "BypassedLinear",
    "HfNaming",
    "LoraConfig",
    "LoraPadding",
    "LoraPrecisionError",
    "LoraSite",
    "LoraSiteSlot",
    "NoActiveSlot",
    "SlotHasLiveGradients",
    "SlotTraining",
    "SlotTrainingAfterWrap",
    "UnsupportedLinear",
    "activate_slot",
    "add_slot",
    "apply_slot_training",
    "attach_lora",
    "check_lora_optimizer_precision",
    "drop_slot",
    "export_peft",
    "finish_lora_param_sync",
    "import_peft",
    "iter_lora_sites",
    "peft_adapter",
    "trained_slots",
    "zero_lora_padding_",
]
