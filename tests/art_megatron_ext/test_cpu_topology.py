"""cpu_topology: usable CPUs from affinity and cgroup quotas, read from fixture files."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from art_megatron_ext import cpu_topology

FIXTURES = Path(__file__).parent / "fixtures" / "cpu_topology"


@pytest.fixture
def scenario(monkeypatch):
    """Point every cgroup path constant at one fixture directory."""

    def use(name: str) -> Path:
        root = FIXTURES / name
        monkeypatch.setattr(cpu_topology, "PROC_SELF_CGROUP", str(root / "proc_self_cgroup"))
        monkeypatch.setattr(cpu_topology, "CGROUP_V2_ROOT", str(root / "cgroup"))
        monkeypatch.setattr(
            cpu_topology, "CGROUP_V1_CFS_QUOTA_US", str(root / "cpu" / "cpu.cfs_quota_us")
        )
        monkeypatch.setattr(
            cpu_topology, "CGROUP_V1_CFS_PERIOD_US", str(root / "cpu" / "cpu.cfs_period_us")
        )
        return root

    return use


def test_v2_quota_of_own_cgroup_rounds_up(scenario):
    scenario("v2_quota")  # job cgroup 150000/100000 = 1.5 CPUs, root unlimited
    budget = cpu_topology.cpu_budget(affinity=8)
    assert budget.cgroup_v2 == 1.5
    assert budget.cgroup_v1 is None
    assert budget.usable == 2


def test_v2_parent_quota_tighter_than_own_wins(scenario):
    scenario("v2_nested")  # parent slice 1 CPU, job 3 CPUs
    assert cpu_topology.cgroup_v2_cpu_limit() == 1.0
    assert cpu_topology.usable_cpus(affinity=8) == 1


def test_v2_unlimited_leaves_affinity(scenario):
    scenario("v2_unlimited")
    assert cpu_topology.cgroup_v2_cpu_limit() is None
    assert cpu_topology.usable_cpus(affinity=6) == 6


def test_v1_quota(scenario):
    scenario("v1_quota")  # 300000 / 100000
    assert cpu_topology.cgroup_v1_cpu_limit() == 3.0
    assert cpu_topology.usable_cpus(affinity=8) == 3


def test_v1_unlimited(scenario):
    scenario("v1_unlimited")  # quota -1
    assert cpu_topology.cgroup_v1_cpu_limit() is None
    assert cpu_topology.usable_cpus(affinity=5) == 5


def test_both_versions_take_the_minimum(scenario):
    scenario("both")  # v2 4 CPUs, v1 2.5 CPUs -> 3
    budget = cpu_topology.cpu_budget(affinity=16)
    assert (budget.cgroup_v2, budget.cgroup_v1, budget.usable) == (4.0, 2.5, 3)


def test_affinity_smaller_than_quota_wins(scenario):
    scenario("v1_quota")  # quota 3 CPUs
    assert cpu_topology.usable_cpus(affinity=2) == 2


def test_malformed_files_are_ignored_with_a_warning_naming_them(scenario, caplog):
    root = scenario("malformed")
    with caplog.at_level(logging.WARNING, logger=cpu_topology.__name__):
        assert cpu_topology.usable_cpus(affinity=4) == 4
    text = caplog.text
    assert str(root / "cgroup" / "cpu.max") in text
    assert str(root / "cpu" / "cpu.cfs_quota_us") in text
    assert "stay in effect" in text


def test_missing_files_mean_no_quota(scenario):
    scenario("missing")
    budget = cpu_topology.cpu_budget(affinity=3)
    assert (budget.cgroup_v2, budget.cgroup_v1, budget.usable) == (None, None, 3)


def test_zero_or_negative_quota_is_malformed_not_zero_cpus(scenario, tmp_path, monkeypatch):
    scenario("missing")
    (tmp_path / "cpu.max").write_text("0 100000\n")
    monkeypatch.setattr(cpu_topology, "CGROUP_V2_ROOT", str(tmp_path))
    assert cpu_topology.cgroup_v2_cpu_limit() is None
    assert cpu_topology.usable_cpus(affinity=2) == 2


def test_tiny_quota_still_gives_one_cpu(scenario, tmp_path, monkeypatch):
    scenario("missing")
    (tmp_path / "cpu.max").write_text("10000 100000\n")  # 0.1 CPU
    monkeypatch.setattr(cpu_topology, "CGROUP_V2_ROOT", str(tmp_path))
    assert cpu_topology.usable_cpus(affinity=4) == 1
    assert cpu_topology.pool_workers(reserve=2, affinity=4) == 1


def test_default_affinity_is_this_process_mask(scenario):
    scenario("missing")
    assert cpu_topology.usable_cpus() == len(os.sched_getaffinity(0))


def test_pool_workers_applies_reserve_and_cap(scenario):
    scenario("v1_quota")  # 3 usable with affinity 8
    assert cpu_topology.pool_workers(affinity=8) == 3
    assert cpu_topology.pool_workers(reserve=1, affinity=8) == 2
    assert cpu_topology.pool_workers(cap=2, affinity=8) == 2
    assert cpu_topology.pool_workers(cap=10, affinity=8) == 3
    assert cpu_topology.pool_workers(reserve=5, affinity=8) == 1


@pytest.mark.parametrize(("cap", "reserve"), [(0, 0), (None, -1)])
def test_pool_workers_rejects_bad_arguments_naming_them(scenario, cap, reserve):
    scenario("missing")
    with pytest.raises(ValueError, match="cap" if cap == 0 else "reserve"):
        cpu_topology.pool_workers(cap=cap, reserve=reserve)


@pytest.mark.parametrize("kind", ["not_utf8", "directory"])
def test_unreadable_cpu_max_is_ignored_with_a_warning_naming_it(
    scenario, tmp_path, monkeypatch, caplog, kind
):
    """A `cpu.max` that is not UTF-8 text or is a directory leaves the other limits in effect
    (it used to raise UnicodeDecodeError / IsADirectoryError out of usable_cpus)."""
    scenario("v1_quota")  # v1: 3 CPUs, still applied
    cpu_max = tmp_path / "cpu.max"
    if kind == "directory":
        cpu_max.mkdir()
    else:
        cpu_max.write_bytes(b"\xff\xfe 100000\n")
    monkeypatch.setattr(cpu_topology, "CGROUP_V2_ROOT", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=cpu_topology.__name__):
        budget = cpu_topology.cpu_budget(affinity=8)
    assert (budget.cgroup_v2, budget.cgroup_v1, budget.usable) == (None, 3.0, 3)
    assert str(cpu_max) in caplog.text and "stay in effect" in caplog.text


def test_unreadable_v1_quota_file_is_ignored(scenario, tmp_path, monkeypatch, caplog):
    scenario("missing")
    quota = tmp_path / "cpu.cfs_quota_us"
    quota.mkdir()
    period = tmp_path / "cpu.cfs_period_us"
    period.write_bytes(b"\x80\x81")
    monkeypatch.setattr(cpu_topology, "CGROUP_V1_CFS_QUOTA_US", str(quota))
    monkeypatch.setattr(cpu_topology, "CGROUP_V1_CFS_PERIOD_US", str(period))
    with caplog.at_level(logging.WARNING, logger=cpu_topology.__name__):
        assert cpu_topology.cgroup_v1_cpu_limit() is None
        assert cpu_topology.usable_cpus(affinity=2) == 2
    assert str(quota) in caplog.text
