"""HybridEP: dispatch/combine buffers for MoE expert parallelism (see docs/hybridep)."""
