"""The content digest of a PEFT adapter: one definition shared by the trainer and the server.

The trainer writes it into the export manifest (`AdapterReady.digest`); the server computes it
once from the bytes it already read for validation, checks an optional `digest` sent with an
update (a mismatch means a torn or partial export) and reports it in receipts, `/art/v1/slots`
and `/art/metrics`. Both sides must agree byte for byte, so it lives here, importable without
vLLM or torch.

Definition (`xxh3-128:<32 hex digits>`): XXH3-128 over, in this order,
`b"adapter_config.json\\0"`, the config file's bytes, `b"\\0adapter_model.safetensors\\0"`, the
weights file's bytes. The files are hashed as stored (no canonicalisation): the digest names
exactly the bytes the server loads. XXH3 runs at memory speed (tens of GB/s), so hashing costs
far less than reading; it detects accidental change (torn writes, a stale directory), not an
adversary: the routes that accept adapters are guarded by the API key.
"""

from __future__ import annotations

from pathlib import Path

ALGORITHM = "xxh3-128"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class DigestFormatError(ValueError):
    """A digest string that is not `xxh3-128:<32 lowercase hex digits>`."""


def digest_bytes(config: bytes, weights: bytes) -> str:
    """The digest of an adapter given its two files' bytes."""
    import xxhash

    h = xxhash.xxh3_128()
    h.update(CONFIG_FILE.encode() + b"\0")
    h.update(config)
    h.update(b"\0" + WEIGHTS_FILE.encode() + b"\0")
    h.update(weights)
    return f"{ALGORITHM}:{h.hexdigest()}"


def digest_dir(path: str | Path) -> str:
    """The digest of the adapter directory `path` (reads both files once)."""
    path = Path(path)
    return digest_bytes((path / CONFIG_FILE).read_bytes(), (path / WEIGHTS_FILE).read_bytes())


def check_format(digest: str) -> str:
    """`digest` if well formed, else `DigestFormatError` naming the expected form."""
    prefix = ALGORITHM + ":"
    hexpart = digest[len(prefix) :] if isinstance(digest, str) else ""
    if (
        not isinstance(digest, str)
        or not digest.startswith(prefix)
        or len(hexpart) != 32
        or any(c not in "0123456789abcdef" for c in hexpart)
    ):
        raise DigestFormatError(
            f"digest {digest!r} is not of the form '{ALGORITHM}:' + 32 lowercase hex digits"
        )
    return digest
