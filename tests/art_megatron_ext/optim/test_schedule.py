"""PeriodicSaver: every save_interval steps, on the final step, and on a clean stop."""

from __future__ import annotations

import pytest

from art_megatron_ext.optim import PeriodicSaver, SaveSchedule


def run(steps, *, interval=5, final_at=None, raise_at=None):
    saved: list[int] = []
    try:
        with PeriodicSaver(saved.append, SaveSchedule(interval)) as saver:
            for step in steps:
                if step == raise_at:
                    raise RuntimeError("training failed")
                saver.step_done(step, final=step == final_at)
    except RuntimeError:
        pass
    return saved


def test_default_interval_is_five():
    assert SaveSchedule().save_interval == 5


def test_saves_every_interval_and_on_a_clean_stop_at_an_unannounced_last_step():
    assert run(range(1, 13)) == [5, 10, 12]


def test_saves_on_the_final_step_once():
    assert run(range(1, 8), final_at=7) == [5, 7]


def test_a_last_step_on_the_interval_is_not_saved_twice():
    assert run(range(1, 11)) == [5, 10]


def test_leaving_with_an_exception_saves_nothing_more():
    assert run(range(1, 13), raise_at=8) == [5]


def test_stop_without_any_step_saves_nothing():
    assert run([]) == []


def test_resumed_saver_does_not_resave_the_loaded_step():
    saved: list[int] = []
    saver = PeriodicSaver(saved.append, SaveSchedule(5), last_saved_step=10)
    assert saver.stop() is False
    saver.step_done(11)
    assert saver.stop() is True and saved == [11]


def test_steps_must_increase():
    saver = PeriodicSaver(lambda step: None)
    saver.step_done(3)
    with pytest.raises(ValueError, match="step 3 is not after the last completed step 3"):
        saver.step_done(3)


@pytest.mark.parametrize("bad", [0, -5])
def test_interval_must_be_positive(bad):
    with pytest.raises(ValueError, match="save_interval"):
        SaveSchedule(bad)


def test_interval_must_be_an_int():
    with pytest.raises(TypeError, match="save_interval"):
        SaveSchedule(2.5)  # type: ignore[arg-type]


def test_leaving_with_an_exception_reports_it_to_on_abort():
    aborted: list[BaseException] = []
    with (
        pytest.raises(KeyError),
        PeriodicSaver(lambda step: None, on_abort=aborted.append) as saver,
    ):
        saver.step_done(1)
        raise KeyError("batch")
    assert len(aborted) == 1 and isinstance(aborted[0], KeyError)
