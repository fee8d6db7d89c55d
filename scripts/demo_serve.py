"""`make demo-serve`: serve the tiny model with `--plugin art` and show what the plugin does.

Starts a real `vllm serve` (stock CLI, `--plugin art`) on a free loopback port, asks the art
routes what this server can do, runs a long generation on the LoRA slot `policy` (adapter a)
and publishes adapter b to that slot while it runs: the running request decodes its next
tokens with b, and its `policy_spans` say which tokens came from which version. Then it stops
the server cleanly (also on Ctrl-C or error).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx

from art_vllm_plugin import serve_process

TOKENS = 460


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def show(title: str, payload) -> None:
    print(f"\n== {title}")
    print(json.dumps(payload, indent=2)[:4000])


async def generate_with_inflight_update(url: str, adapter: Path, version: int):
    """A long greedy generation; once the engine ran 60 steps, publish `adapter`."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        steps0 = (await client.get("/art/v1/engine")).json()["steps"]
        gen = asyncio.create_task(
            client.post(
                "/v1/completions",
                json={
                    "model": "policy",
                    "prompt": "the policy",
                    "max_tokens": TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
        )
        while (await client.get("/art/v1/engine")).json()["steps"] < steps0 + 60:
            await asyncio.sleep(0.01)
        update = await client.post(
            "/art/v1/lora/update", json={"slot": "policy", "path": str(adapter), "version": version}
        )
        update.raise_for_status()
        resp = await gen
        resp.raise_for_status()
        return resp.json(), update.json(), steps0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", type=Path, default=Path(".cache/tiny"))
    args = parser.parse_args()
    model, adapters = args.tiny / "model", args.tiny / "adapters"
    config = serve_process.ServeConfig(
        model=str(model),
        args=(
            *serve_process.tiny_lora_args(),
            # loopback and no key: the demo's update needs the unguarded routes
            *serve_process.ALLOW_UNAUTHENTICATED,
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
            show("GET /art/v1/slots", client.get("/art/v1/slots").json())
        say(f"generating {TOKENS} tokens on slot 'policy' and publishing adapter b mid-way")
        for version in (1, 2, 3):
            out, update, steps0 = asyncio.run(
                generate_with_inflight_update(server.url, adapters / "b", version)
            )
            if update["step"] < steps0 + TOKENS - 1:
                break
            say("the update reached the engine after the generation ended (busy machine); again")
        show("POST /art/v1/lora/update (sent while the generation ran)", update)
        choice = out["choices"][0]
        show(
            "the generation's policy_spans (tokens before the update: old version, after: new)",
            choice["policy_spans"],
        )
        with httpx.Client(base_url=server.url, timeout=120) as client:
            show("GET /art/v1/slots after the update", client.get("/art/v1/slots").json())
        say("stopping the server")
    say("server stopped cleanly; done")


if __name__ == "__main__":
    main()
