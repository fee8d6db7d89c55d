"""Fixtures for the packing tests: the group builders of builders.py."""

import pytest

from .builders import make_multi_turn_group, make_single_turn_group


@pytest.fixture
def single_turn_group():
    return make_single_turn_group


@pytest.fixture
def multi_turn_group():
    return make_multi_turn_group
