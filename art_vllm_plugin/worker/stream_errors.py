"""The refusal every full-weight stream engine raises (`art_gloo`, `art_nixl`).

One type, so the staging code treats a stream that broke its plan alike whatever carried it:
`worker/base_weights._stage_stream` answers a `ValueError` as a refusal (422, the old weights
keep serving) and any other exception as a transport failure. Imports nothing of vLLM.
"""

from __future__ import annotations


class StreamRefused(ValueError):
    """The stream does not match its plan or its digest: nothing of it may be used."""
