"""`load_and_digest`: one pass that loads a shard into private memory and digests the file."""

from __future__ import annotations

import pytest
import torch
import xxhash

from art_megatron_ext.optim.fileio import load_and_digest


def _states() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(4096, generator=g)
    return {
        "many_small": {f"t{i}": torch.randn(i + 1, generator=g) for i in range(300)},
        "large": {"big": torch.randn(3 << 20, generator=g), "tail": torch.arange(5)},
        "views_shared_empty": {
            "view": torch.randn(1 << 19, generator=g)[1000:300000],
            "a": shared[:100],
            "b": shared[50:],
            "empty": torch.empty(0),
            "bf16": torch.randn(77, generator=g).to(torch.bfloat16),
            "nested": [{"x": torch.ones(3)}, (torch.zeros(2, 2),)],
            "n": 3,
        },
    }


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("case", sorted(_states()))
def test_state_equals_torch_load_and_digest_equals_the_files(tmp_path, case):
    path = tmp_path / "s.pt"
    torch.save(_states()[case], path)
    raw = path.read_bytes()
    state, digest = load_and_digest(str(path), len(raw), weights_only=True)
    assert _equal(state, torch.load(path, weights_only=True))
    assert digest == xxhash.xxh3_128(raw).hexdigest()
    if case == "views_shared_empty":  # tensors that shared a storage still share one
        state["a"][60] = 123.0
        assert state["b"][10] == 123.0


def test_the_state_is_a_private_copy_not_a_mapping_of_the_file(tmp_path):
    path = tmp_path / "s.pt"
    torch.save(_states()["large"], path)
    state, _ = load_and_digest(str(path), path.stat().st_size, weights_only=True)
    expected = torch.load(path, weights_only=True)
    with open(path, "r+b") as f:  # rewrite the file in place, same size
        f.write(b"\xff" * path.stat().st_size)
    path.unlink()
    assert _equal(state, expected)


@pytest.mark.parametrize("where", [0.0005, 0.5, 0.9999])
def test_a_flipped_byte_changes_the_digest(tmp_path, where):
    path = tmp_path / "s.pt"
    torch.save(_states()["large"], path)
    raw = bytearray(path.read_bytes())
    raw[int(len(raw) * where)] ^= 0x10
    path.write_bytes(bytes(raw))
    try:
        _, digest = load_and_digest(str(path), len(raw), weights_only=True)
    except Exception:  # the zip structure itself was hit: the caller digests the file alone
        return
    assert digest == xxhash.xxh3_128(bytes(raw)).hexdigest()
