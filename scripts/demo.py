"""`make demo`: serve the tiny model with `--plugin art` and show what the plugin does.

Starts a real `vllm serve` (stock CLI, `--plugin art`) on a free loopback port, asks the art
routes what this server can do, runs a completion on the LoRA slot, and stops the server
cleanly (also on Ctrl-C or error).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

from art_vllm_plugin import serve_process


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def show(title: str, payload) -> None:
    print(f"\n== {title}")
    print(json.dumps(payload, indent=2)[:4000])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", type=Path, default=Path(".cache/tiny"))
    args = parser.parse_args()
    model, adapters = args.tiny / "model", args.tiny / "adapters"
    config = serve_process.ServeConfig(
        model=str(model),
        args=(
            *serve_process.tiny_lora_args(),
            "--lora-modules",
            f"policy={adapters / 'a'}",
        ),
        log_path=Path(".cache/logs/demo-server.log"),
    )
    say(
        "command: "
        + " ".join(serve_process.build_command(config, 0)).replace("--port 0", "--port <free>")
    )
    say(f"starting vllm serve (about 30 s on CPU; log: {config.log_path})")
    t0 = time.monotonic()
    with serve_process.serving(config) as server:
        say(f"ready at {server.url} after {time.monotonic() - t0:.0f}s")
        with httpx.Client(base_url=server.url, timeout=120) as client:
            show("GET /art/v1/capabilities", client.get("/art/v1/capabilities").json())
            resp = client.post(
                "/v1/completions",
                json={
                    "model": "policy",
                    "prompt": "the policy",
                    "max_tokens": 24,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            resp.raise_for_status()
            choice = resp.json()["choices"][0]
            show(
                "POST /v1/completions on slot 'policy' (adapter a)",
                {
                    "text": choice["text"],
                    "policy_spans": choice.get("policy_spans", "(not yet: in-flight update issue)"),
                },
            )
        say("stopping the server")
    say("server stopped cleanly; done")


if __name__ == "__main__":
    main()
