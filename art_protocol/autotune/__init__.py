"""Online autotuner for Pipeline RL: rollout workers, batch bounds, target groups per step and
queue capacity, from `/art/metrics` samples and trainer step records.

Imports numpy at most (no vLLM, no torch, no HTTP client): trainers import it. See `rules.py`
for the rules, `config.py` for the bounds, `window.py` for the metrics contract,
`controller.py` for the API a training loop calls once per step, `profile.py` for profiles.
"""

from art_protocol.autotune.config import Settings, SettingsError, TunerConfig
from art_protocol.autotune.controller import Autotuner
from art_protocol.autotune.packing_estimate import GroupShape, groups_fitting, packed_rows
from art_protocol.autotune.profile import ProfileError, load_profile, save_profile
from art_protocol.autotune.rules import Decision, decide
from art_protocol.autotune.window import (
    REQUIRED_METRICS,
    MetricsContractError,
    StepRecord,
    Window,
    summarize,
)

__all__ = [
    "REQUIRED_METRICS",
    "Autotuner",
    "Decision",
    "GroupShape",
    "MetricsContractError",
    "ProfileError",
    "Settings",
    "SettingsError",
    "StepRecord",
    "TunerConfig",
    "Window",
    "decide",
    "groups_fitting",
    "load_profile",
    "packed_rows",
    "save_profile",
    "summarize",
]
