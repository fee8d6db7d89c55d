"""Code that runs in the vLLM EngineCore process: the slot-update coordinator and step hooks."""
