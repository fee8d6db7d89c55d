"""The adapter digest is XXH3-128 over both files as documented; malformed digests are refused."""

import pytest
import xxhash

from art_protocol.digest import (
    DigestFormatError,
    check_format,
    digest_bytes,
    digest_dir,
)


def test_digest_is_xxh3_128_over_both_files_in_the_documented_order(tmp_path):
    (tmp_path / "adapter_config.json").write_bytes(b'{"r": 8}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x01\x02weights")
    expected = xxhash.xxh3_128(
        b'adapter_config.json\0{"r": 8}\0adapter_model.safetensors\0\x01\x02weights'
    ).hexdigest()
    assert digest_dir(tmp_path) == f"xxh3-128:{expected}"


def test_moving_bytes_between_the_files_changes_the_digest():
    assert digest_bytes(b"ab", b"c") != digest_bytes(b"a", b"bc")


@pytest.mark.parametrize(
    "bad", ["", "xxh3-128:", "xxh3-128:" + "g" * 32, "blake2b:" + "0" * 32, "xxh3-128:" + "A" * 32]
)
def test_malformed_digest_is_refused_with_the_expected_form(bad):
    with pytest.raises(DigestFormatError, match="xxh3-128"):
        check_format(bad)
    assert check_format("xxh3-128:" + "0" * 32)
