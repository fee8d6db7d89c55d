"""Two costs of Triton's interpreter that compiled kernels never pay, removed for the tests.

Measured with py-spy on a Model Runner V2 worker serving the tiny model (4 requests decoding):
92% of the worker's time was in the interpreter; of it, re-patching `triton.language` before
every kernel and device-function call (`_patch_lang`, with `inspect.getmembers` over the
language modules) took 27%, and integer-overflow sanitising of every add/sub/mul
(`binary_op_sanitize_overflow_impl`, on by default in `InterpreterOptions` only) 22%.

- Overflow checks: compiled kernels check overflow only when built with debug on; the
  interpreter's default checks every integer op. Off here, the interpreter computes what the
  compiled kernel computes.
- Language patching: in a process where every kernel is interpreted (a test server's worker),
  `triton.language` may stay patched; it is patched once per set of language modules and the
  per-launch restore becomes a no-op.

Kernels themselves (vLLM's) run unchanged. Triton imports its interpreter lazily (at the
first `@triton.jit` under TRITON_INTERPRET=1) and imports this package while it is itself half
imported, so `install()` waits for `triton.runtime.interpreter` to finish loading and tunes it
then (`apply()`, idempotent).
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import sys

_MODULE = "triton.runtime.interpreter"

_applied = False


class _KeepPatched:
    """A patch scope whose restore does nothing: the language stays patched."""

    def restore(self) -> None:
        return None


def apply() -> None:
    global _applied
    if _applied:
        return
    _applied = True
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)

    original = interpreter._patch_lang
    patched: set[frozenset[int]] = set()

    def patch_lang_once(fn):
        langs = frozenset(
            id(v)
            for v in fn.__globals__.values()
            if v is interpreter.tl or v is interpreter.tl.core
        )
        if langs not in patched:
            original(fn)  # its scope is dropped: the patches stay
            patched.add(langs)
        return _KeepPatched()

    interpreter._patch_lang = patch_lang_once


class _TuneAfterLoad(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds nothing itself: wraps the real loader of Triton's interpreter module."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        apply()


def install() -> None:
    """Tune the interpreter now if it is loaded, else as soon as Triton loads it."""
    if _MODULE in sys.modules:
        apply()
    elif not any(isinstance(f, _TuneAfterLoad) for f in sys.meta_path):
        sys.meta_path.insert(0, _TuneAfterLoad())
