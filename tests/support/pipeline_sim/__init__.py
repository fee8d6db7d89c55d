"""A discrete-event Pipeline RL simulator for the autotuner (`bench/autotune.py`, tests).

A test harness for the tuner's logic, not a claim about GPU throughput: every number it
produces comes from the parameters in `workloads.py`.
"""

from .server import Server, ServerParams
from .sim import SimResult, Simulation, run_fixed, run_tuned
from .workloads import BAD_SETTINGS, FIXED_DEFAULTS, REF_GROUPS, WORKLOADS, Workload, tuner_config

__all__ = [
    "BAD_SETTINGS",
    "FIXED_DEFAULTS",
    "REF_GROUPS",
    "WORKLOADS",
    "Server",
    "ServerParams",
    "SimResult",
    "Simulation",
    "Workload",
    "run_fixed",
    "run_tuned",
    "tuner_config",
]
