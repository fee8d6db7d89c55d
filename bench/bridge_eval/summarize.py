"""One line per model from `run_bridge.py` records: build, padded vocabulary, logits error,
export comparison.

Why: the records carry provider fields and tracebacks; the table in docs/model-mapping.md
needs only these columns. Run with any Python 3.11+:

    python3 bench/bridge_eval/summarize.py /tmp/bridge-tp1.jsonl /tmp/bridge-tp2-fix.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ERROR_CHARS = 160
ALL_FIXES = 5  # run_bridge.FIXES, not imported: that module needs torch


def _short(text: str) -> str:
    """`text` on one line, cut to ERROR_CHARS."""
    return " ".join(text.split())[:ERROR_CHARS]


def line(rec: dict) -> str:
    """`name tpN fixes build=... pad=... logits=... export_exact=...` for one record."""
    fixes = rec.get("fixes", [])
    label = "all" if len(fixes) == ALL_FIXES else ",".join(fixes) or "shipped"
    out = f"{rec['name']:18s} tp{rec['tp']} fix={label} build={_short(rec['build'])}"
    if rec["build"] != "ok":
        return out
    out += f" pad={rec.get('padded_vocab')}"
    if isinstance(rec.get("logits_maxabs"), float):
        out += f" logits={rec['logits_maxabs']:.3g}"
    else:
        out += f" logits=n/a {_short(rec.get('forward', ''))}"
    if "export" in rec:
        return out + f" export={_short(rec['export'])}"
    return out + (
        f" export_exact={rec['export_bitwise']}"
        f" missing={rec['export_missing']}"
        f" extra={rec['export_extra']}"
        f" shape={rec['export_shape_diff']}"
        f" values={len(rec['export_value_diff'])}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, nargs="+", help="JSON lines from run_bridge.py")
    args = parser.parse_args()
    for path in args.records:
        print("==", path)
        for text in path.read_text().splitlines():
            if text.strip():
                print(line(json.loads(text)))


if __name__ == "__main__":
    main()
