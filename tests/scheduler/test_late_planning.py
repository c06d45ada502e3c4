"""Late planning (services/scheduler/steps.py): while the worker runs its only step, the next
plan waits for arrivals until PLAN_AHEAD_FRACTION of a decode step's running estimate has
passed; the estimate follows decode-only steps' durations as the worker reports them. Short
decode steps (a GPU's) are planned at once."""

from __future__ import annotations

import time

import pytest
import redis
import redis.asyncio as aioredis

from services.scheduler import intake as intake_module
from services.scheduler.aborts import AbortListener
from services.scheduler.intake import RequestIntake
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.steps import (
    DECODE_STEP_SMOOTHING,
    LATE_PLANNING_MIN_STEP_S,
    PLAN_AHEAD_FRACTION,
    StepChannel,
)
from shared.bus import stream_fields
from shared.channels import Channels
from shared.messages import (
    NewRequest,
    RequestOutput,
    RunningRequest,
    SamplingParams,
    StepPlan,
    StepResult,
    StoppingParams,
)
from tests.support.redis_server import redis_server


def plan(step_id: int, *tokens: int) -> StepPlan:
    """A plan whose requests are scheduled `tokens` each (the first one new)."""
    first = NewRequest(
        request_id="r0",
        input_ids=[1] * tokens[0],
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=4),
        reply_to="reply",
        block_ids=[0],
        num_computed_tokens=0,
        num_scheduled_tokens=tokens[0],
    )
    running = [
        RunningRequest(request_id=f"r{i}", new_block_ids=[], num_scheduled_tokens=n)
        for i, n in enumerate(tokens[1:], start=1)
    ]
    return StepPlan(step_id=step_id, new_requests=[first], running=running)


async def answered(channel: StepChannel, result: StepResult) -> StepResult:
    async def healthy() -> None:
        return None

    channel._keep_results([(b"1-0", result)])
    return await channel.await_oldest(healthy, lambda: False)


@pytest.fixture
async def redis_client(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


async def test_the_next_plan_waits_a_share_of_a_decode_step(redis_client, namespace):
    channel = StepChannel(redis_client, Channels(namespace), "g", SchedulerMetrics())
    assert channel.plan_wait_s() == 0.0  # idle worker
    await channel.send(plan(0, 40))  # a prompt: its duration says nothing of decodes
    assert channel.plan_wait_s() == 0.0  # no decode step timed yet
    await answered(channel, StepResult(step_id=0, step_s=0.5))
    assert channel.decode_step_s == 0.0
    await channel.send(plan(1, 1, 1))
    await answered(channel, StepResult(step_id=1, step_s=0.400))
    assert channel.decode_step_s == pytest.approx(0.400)
    await channel.send(plan(2, 1, 1))
    await answered(channel, StepResult(step_id=2, step_s=0.600))
    expected = 0.400 + DECODE_STEP_SMOOTHING * (0.600 - 0.400)
    assert channel.decode_step_s == pytest.approx(expected)

    sent = time.perf_counter()
    await channel.send(plan(3, 1, 1))  # the worker was idle: it runs this one from now
    wait = channel.plan_wait_s()
    assert 0 < wait <= PLAN_AHEAD_FRACTION * expected
    assert wait >= PLAN_AHEAD_FRACTION * expected - (time.perf_counter() - sent) - 1e-3
    await channel.send(plan(4, 1, 1))  # a plan queued behind it: nothing to wait for
    assert channel.plan_wait_s() == 0.0
    await answered(channel, StepResult(step_id=3, step_s=0.5))  # plan 4 runs from now
    assert 0 < channel.plan_wait_s() <= PLAN_AHEAD_FRACTION * channel.decode_step_s


async def test_a_result_of_an_ended_session_is_not_taken_for_this_ones(redis_client, namespace):
    """A new session (Redis failed over) numbers its plans from 0 again while the worker may
    still answer the last session's plans: a Redis Cluster test once hung with requests the
    scheduler held but never planned after such a session change."""
    channels = Channels(namespace)
    metrics = SchedulerMetrics()
    channel = StepChannel(redis_client, channels, "g", metrics)
    await channel.reset()
    await channel.send(plan(0, 4))
    ended = channel.session
    await channel.reset()
    await channel.send(plan(0, 4))
    assert channel.session != ended
    for session, token in ((ended, 7), (channel.session, 9)):  # as the worker answers them
        output = RequestOutput(request_id="r0", token_ids=[token])
        result = StepResult(step_id=0, session=session, outputs=[output])
        await redis_client.xadd(channels.results("g"), stream_fields(result))

    async def healthy() -> None:
        return None

    result = await channel.await_oldest(healthy, lambda: False)
    assert result.outputs[0].token_ids == [9]
    assert metrics.registry.get_sample_value("textgen_scheduler_stale_step_results_total") == 1


async def test_short_decode_steps_are_planned_at_once(redis_client, namespace):
    """A wait on Redis's millisecond clock does not fit in a GPU's decode step: the plan would
    come after the step it should follow."""
    channel = StepChannel(redis_client, Channels(namespace), "g", SchedulerMetrics())
    short = 0.8 * LATE_PLANNING_MIN_STEP_S
    await channel.send(plan(0, 1, 1))
    await answered(channel, StepResult(step_id=0, step_s=short))
    assert channel.decode_step_s == pytest.approx(short)
    await channel.send(plan(1, 1, 1))  # the worker's only step
    assert channel.plan_wait_s() == 0.0
    await answered(channel, StepResult(step_id=1, step_s=50 * LATE_PLANNING_MIN_STEP_S))
    await channel.send(plan(2, 1, 1))  # the estimate is long enough again
    assert channel.decode_step_s > LATE_PLANNING_MIN_STEP_S
    assert channel.plan_wait_s() > 0.0


async def test_a_late_planning_wait_ends_on_time_when_nothing_else_reaches_redis(namespace):
    """Redis ends a blocked read's timeout when its event loop wakes: on any command, else at
    its next cron tick. At hz 1, five 5 ms waits for arrivals with nothing else going on took
    ~4-5 s before the intake woke Redis at each wait's end (token gaps of up to 100 ms at one
    stream with the default hz 10)."""
    with redis_server() as url:
        client = aioredis.Redis.from_url(url)
        try:
            await client.config_set("hz", 1)
            channels = Channels(namespace)
            metrics = SchedulerMetrics()
            aborts = AbortListener(client, channels, memory_s=60)
            intake = RequestIntake(client, channels, "c", aborts, metrics, claim_timeout=30)
            await intake.open()
            started = time.perf_counter()
            for _ in range(5):
                assert await intake.pull(room=4, block=False, wait_s=0.005) == []
            assert time.perf_counter() - started < 1.0
            wakes = metrics.registry.get_sample_value("textgen_scheduler_plan_wait_wakes_total")
            # each wait was ended by a wake, but for at most one that Redis's own once-a-second
            # tick ended first (the five took under a second: a busy host stretches each wait)
            assert wakes >= 4
        finally:
            await client.aclose()


@pytest.mark.parametrize("block", [True, False])
async def test_a_blocked_read_without_a_reply_is_a_lost_connection(namespace, monkeypatch, block):
    """A lanes' read that Redis never answers (CLIENT PAUSE here; a Redis Cluster kill -9
    failover once left one so for minutes, every stream stuck) ends READ_GRACE_S past its
    block time as redis's TimeoutError, which the scheduler's loop takes for a lost
    connection: it reconnects and starts its session again."""
    monkeypatch.setattr(intake_module, "READ_GRACE_S", 0.3)
    with redis_server() as url:
        client = aioredis.Redis.from_url(url)
        pauser = aioredis.Redis.from_url(url)
        try:
            channels = Channels(namespace)
            metrics = SchedulerMetrics()
            aborts = AbortListener(client, channels, memory_s=60)
            intake = RequestIntake(client, channels, "c", aborts, metrics, claim_timeout=30)
            await intake.open()

            async def nothing_waiting(room: int) -> list:
                return []

            monkeypatch.setattr(intake.lanes, "read", nothing_waiting)
            await pauser.execute_command("CLIENT", "PAUSE", 5000, "ALL")
            started = time.perf_counter()
            with pytest.raises(redis.TimeoutError, match="no reply"):
                await intake.pull(room=4, block=block, wait_s=0.005)
            assert time.perf_counter() - started < 2.0  # the block (<= 0.25 s) and the grace
            await pauser.execute_command("CLIENT", "UNPAUSE")
            assert await intake.pull(room=4, block=False) == []  # a new connection serves
        finally:
            await pauser.execute_command("CLIENT", "UNPAUSE")
            await client.aclose()
            await pauser.aclose()
