"""art_protocol: what the serving side and the training side both read, and nothing heavier.

Both `art_vllm_plugin` (vLLM) and `art_megatron_ext` (Megatron) depend on this package and
never on each other. It imports numpy and httpx at most: no torch, vLLM or Megatron, so a
trainer, a rollout worker or a dashboard can install `art-pipeline` without extras and use it.

- `digest`: the content digest of a PEFT adapter (trainer manifest, server check).
- `updates`: the typed request and response of `POST /art/v1/lora/update`.
- `provenance`: the per-step version label and per-token policy spans; `spans`: their check.
- `policy_age`: policy age, freshness and the throughput score.
- `route_bundle`, `routed_completion`: the binary formats of `docs/formats.md`.
- `client`: the HTTP client and the multi-replica fleet; `autotune`: the trainer-side tuner
  fed by `/art/metrics`; `packing`: the numpy half of prefix-tree packing that both the
  trainer's packer and the tuner's estimate use.

Submodules are imported on demand; `import art_protocol` itself loads nothing.
"""
