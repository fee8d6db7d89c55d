"""Test-only Triton backend named `cpu` that compiles nothing (see ../README.md)."""

from art_triton_cpu_shim import interpreter_speed as _interpreter_speed

# Triton imports this package while it discovers backends, before vLLM runs any kernel.
_interpreter_speed.install()
