"""Typed tunables of a `hybridep.Buffer` (SMs, blocks, chunking, barrier timeout).

Why a dataclass and not environment variables: the values change kernel launch shapes and
(for the CUDA backend) the JIT cache key, so they must be visible, validated once, and passed
explicitly. The reference `torch` backend ignores the launch tunables; they are still
validated so a configuration that runs on CPU CI also runs on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

TOKEN_CHUNK = 64
"""Tokens per dispatch chunk; Megatron's `HYBRIDEP_TOKEN_ALIGNMENT` matches it."""


@dataclass(frozen=True)
class HybridEPConfig:
    """Launch tunables of the CUDA backend; see docs/hybridep.md for the table.

    Attributes:
        num_sms_dispatch: SMs the dispatch kernel spreads over (its grid is this many SMs
            times the blocks one SM holds); the other SMs stay free for overlapping compute.
        num_sms_combine: SMs of the combine kernel, likewise.
        num_sms_preprocessing: SMs of the preprocessing's elementwise launches (the per-slot
            rank bits and the final positions); its column scan is W + L blocks regardless.
        num_blocks_permute: blocks of the permute kernel (0 = one per row, up to 65535).
        num_blocks_unpermute: blocks of the unpermute kernel (0 = one per row, up to 65535).
        token_chunk: tokens per chunk; the maximum tokens per rank is rounded up to it.
        barrier_timeout_s: how long a cross-rank barrier of the CUDA backend waits for a late
            peer (e.g. one still writing a checkpoint) before the call fails naming the
            missing rank. The buffer is unusable after that (rebuild it); the CUDA context
            and the process survive.
    """

    num_sms_dispatch: int = 16
    num_sms_combine: int = 16
    num_sms_preprocessing: int = 32
    num_blocks_permute: int = 0
    num_blocks_unpermute: int = 0
    token_chunk: int = TOKEN_CHUNK
    barrier_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        timeout = self.barrier_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(
                f"HybridEPConfig.barrier_timeout_s must be a number > 0, got {timeout!r}"
            )
        for f in fields(self):
            if f.name == "barrier_timeout_s":
                continue
            value = getattr(self, f.name)
            minimum = 0 if f.name.startswith("num_blocks_") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(
                    f"HybridEPConfig.{f.name} must be an int >= {minimum}, got {value!r}"
                )

    @classmethod
    def from_megatron_kwargs(
        cls,
        num_sms_dispatch_api: int | None = None,
        num_sms_combine_api: int | None = None,
        num_sms_preprocessing_api: int | None = None,
        num_blocks_permute: int | None = None,
        num_blocks_unpermute: int | None = None,
        base: HybridEPConfig | None = None,
    ) -> HybridEPConfig:
        """Overlay the keyword names Megatron-core's `fused_a2a.py` passes on `base`."""
        values = {f.name: getattr(base or cls(), f.name) for f in fields(cls)}
        given = {
            "num_sms_dispatch": num_sms_dispatch_api,
            "num_sms_combine": num_sms_combine_api,
            "num_sms_preprocessing": num_sms_preprocessing_api,
            "num_blocks_permute": num_blocks_permute,
            "num_blocks_unpermute": num_blocks_unpermute,
        }
        values.update({k: v for k, v in given.items() if v is not None})
        return cls(**values)
