"""Full weights of a Megatron model for the serving side (full-weight updates, issue 26)."""

from art_megatron_ext.weights.gloo_sender import GlooWeightSender
from art_megatron_ext.weights.hf_checkpoint import write_hf_checkpoint
from art_megatron_ext.weights.hf_stream import StreamReceipt, stream_hf_weights
from art_megatron_ext.weights.kept_version import KeptVersion, keep_version
from art_megatron_ext.weights.nixl_sender import NixlWeightSender

__all__ = [
    "GlooWeightSender",
    "KeptVersion",
    "NixlWeightSender",
    "StreamReceipt",
    "keep_version",
    "stream_hf_weights",
    "write_hf_checkpoint",
]
