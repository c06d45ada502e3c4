"""A worker skips the plans an ended scheduler session left queued before a new one's reset."""

from collections import deque

from services.worker.step_link import skip_ended_sessions
from shared.messages import StepPlan


def plans(*steps: tuple[int, bool]) -> deque[StepPlan]:
    return deque(StepPlan(step_id=step_id, reset=reset) for step_id, reset in steps)


def test_plans_before_the_last_reset_are_skipped():
    queued = plans((7, False), (8, False), (0, True), (1, False))
    assert skip_ended_sessions(queued) == 2
    assert [(p.step_id, p.reset) for p in queued] == [(0, True), (1, False)]


def test_two_resets_keep_only_the_last_session():
    queued = plans((0, True), (1, False), (0, True), (1, False))
    assert skip_ended_sessions(queued) == 2
    assert [(p.step_id, p.reset) for p in queued] == [(0, True), (1, False)]


def test_a_session_without_a_reset_behind_it_runs_all():
    for queued in (plans(), plans((0, True), (1, False)), plans((4, False), (5, False))):
        before = list(queued)
        assert skip_ended_sessions(queued) == 0
        assert list(queued) == before
