"""HybridEP: dispatch/combine buffers for MoE expert parallelism (see docs/hybridep.md).

`Buffer` is the public entry point (Megatron-core's `HybridEPBuffer` contract); `backend=`
chooses the reference over `torch.distributed` ("torch") or our CUDA kernels ("cuda").
"""

from hybridep.backends import BackendUnavailable, HybridEPBackend, select_backend
from hybridep.buffer import Buffer
from hybridep.config import HybridEPConfig
from hybridep.handle import DispatchHandle

__all__ = [
    "BackendUnavailable",
    "Buffer",
    "DispatchHandle",
    "HybridEPBackend",
    "HybridEPConfig",
    "select_backend",
]
