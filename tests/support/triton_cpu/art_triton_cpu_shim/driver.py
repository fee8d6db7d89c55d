"""The driver half of the `cpu` backend: active, CPU tensors, nothing to launch."""

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class InterpreterOnlyDriver(DriverBase):
    @staticmethod
    def is_active():
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise RuntimeError("the test-only Triton `cpu` backend launches nothing (interpreter)")

    def get_current_target(self):
        return GPUTarget("cpu", 0, 0)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_benchmarker(self):
        raise RuntimeError("the test-only Triton `cpu` backend has no benchmarker")
