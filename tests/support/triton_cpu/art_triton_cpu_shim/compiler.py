"""The compiler half of the `cpu` backend: kernels run in Triton's interpreter, so a
compile reaching this class is a set-up error (TRITON_INTERPRET=1 missing), said loudly."""

from triton.backends.compiler import BaseBackend, GPUTarget

_NOT_COMPILED = (
    "the test-only Triton `cpu` backend compiles nothing: set TRITON_INTERPRET=1 "
    "(tests/support/model_runner.py does)"
)


class InterpreterOnlyBackend(BaseBackend):
    @staticmethod
    def supports_target(target: GPUTarget):
        return target.backend == "cpu"

    def hash(self) -> str:
        return "art-triton-cpu-shim-interpreter-only"

    def parse_options(self, options: dict) -> object:
        raise RuntimeError(_NOT_COMPILED)

    def add_stages(self, stages: dict, options: object, language) -> None:
        raise RuntimeError(_NOT_COMPILED)

    def load_dialects(self, context):
        raise RuntimeError(_NOT_COMPILED)

    def get_module_map(self):
        return {}
