"""`textgen queue`: the request stream and the worker groups, for operators and scripts.

    textgen queue [--json] [--watch SECONDS]     stream, consumers and groups (read-only)
    textgen queue request REQUEST_ID             where one request is (read-only)
    textgen queue drain GROUP                    the group's scheduler stops pulling new requests
    textgen queue undrain GROUP                  ... and pulls again

Redis URL and namespace come from --redis-url/--namespace, else REDIS_URL/NAMESPACE (Settings).
Draining is a key ({textgen:group:<g>}:drain) that the scheduler reads every half second;
requests it already holds still finish, the others go to the other groups.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

import redis

from services.launcher.queue_view import GroupView, QueueSnapshot, QueueView, RequestState
from shared.bus import as_text
from shared.redis_connect import redact_url, sync_client
from shared.settings import Settings, describe_invalid

CONFIRM_TIMEOUT_S = 5.0  # drain/undrain wait this long for the scheduler to report the change


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
    # absent unless given, so that flags after a sub-action do not reset the ones before it
    parser.add_argument("--redis-url", default=argparse.SUPPRESS, help="default: env REDIS_URL")
    parser.add_argument(
        "--redis-cluster",
        action="store_const",
        const=True,
        default=argparse.SUPPRESS,
        help="--redis-url names a Redis Cluster node (default: env REDIS_CLUSTER)",
    )
    parser.add_argument("--namespace", default=argparse.SUPPRESS, help="default: env NAMESPACE")
    parser.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON for scripts"
    )


def add_queue_flags(parser: argparse.ArgumentParser) -> None:
    _add_connection_flags(parser)
    parser.add_argument(
        "--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C"
    )
    actions = parser.add_subparsers(dest="action", metavar="{request,drain,undrain}")
    request = actions.add_parser("request", help="one request's state by id")
    request.add_argument("request_id")
    _add_connection_flags(request)
    for name, text in (("drain", "stop admitting to GROUP"), ("undrain", "admit to GROUP again")):
        sub = actions.add_parser(name, help=text, description=text)
        sub.add_argument("group")
        sub.add_argument(
            "--no-wait", action="store_true", help="do not wait for the scheduler to confirm"
        )
        _add_connection_flags(sub)


def run(args: argparse.Namespace) -> int:
    names = ("redis_url", "redis_cluster", "namespace")
    explicit = {k: getattr(args, k) for k in names if hasattr(args, k)}
    try:
        settings = Settings(**explicit)
    except ValueError as exc:
        print(f"textgen queue: invalid settings: {describe_invalid(exc)}", file=sys.stderr)
        return 2
    if not settings.has_redis:
        print("textgen queue: no Redis: pass --redis-url or set REDIS_URL", file=sys.stderr)
        return 2
    client = sync_client(settings, socket_connect_timeout=5)
    view = QueueView(client, settings.namespace)
    as_json = getattr(args, "json", False)
    try:
        if args.action == "request":
            show_request(view.request_state(args.request_id), as_json)
        elif args.action in ("drain", "undrain"):
            return set_drain(view, args.group, args.action == "drain", not args.no_wait)
        elif args.watch:
            watch(view, args.watch, as_json)
        else:
            show_snapshot(view.snapshot(), as_json)
    except redis.ConnectionError as exc:
        print(
            f"textgen queue: Redis unreachable at {redact_url(settings.redis_url or '')}: {exc}",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        pass
    finally:
        client.close()
    return 0


def to_dict(value: Any) -> dict[str, Any]:
    """A snapshot (or request state) as plain JSON-able data, derived fields included."""
    out = dataclasses.asdict(value)
    if isinstance(value, QueueSnapshot):
        for group, data in zip(value.groups, out["groups"]):
            data["is_alive"], data["state"] = group.is_alive, group.state
    return out


def watch(view: QueueView, interval: float, as_json: bool) -> None:
    is_tty = sys.stdout.isatty()
    while True:
        snapshot = view.snapshot()
        if as_json:
            print(json.dumps(to_dict(snapshot)), flush=True)  # one JSON document per line
        else:
            if is_tty:
                print("\x1b[H\x1b[2J", end="")
            show_snapshot(snapshot, as_json=False)
            print(flush=True)
        time.sleep(interval)


def set_drain(view: QueueView, group: str, draining: bool, wait: bool) -> int:
    """Write (or delete) the drain key, then wait for the scheduler's stats to agree."""
    key = view.channels.drain(group)
    written_at = time.time()
    known = {as_text(g) for g in view.client.smembers(view.channels.groups)}
    if draining:
        view.client.set(key, b"1")
    else:
        view.client.delete(key)
    word = "draining" if draining else "undrained"
    if group not in known:
        print(f"warning: group {group!r} is not known (groups: {sorted(known)})", file=sys.stderr)
    if not wait:
        print(f"{group}: {word} (requested)")
        return 0
    deadline = time.monotonic() + CONFIRM_TIMEOUT_S
    while time.monotonic() < deadline:
        current = next((g for g in view.snapshot().groups if g.group == group), None)
        # stats published after the write, so a dead scheduler's old stats do not count
        is_fresh = current is not None and (current.stats_at or 0.0) >= written_at
        if current is not None and is_fresh and current.draining == draining:
            held = current.num_running or 0
            held += current.num_waiting or 0
            print(f"{group}: {word} (confirmed by its scheduler; {held} requests held)")
            return 0
        time.sleep(0.1)
    print(
        f"{group}: {word} requested; its scheduler has not confirmed in {CONFIRM_TIMEOUT_S:.0f} s "
        "(it applies the change when it runs)",
        file=sys.stderr,
    )
    return 1


def show_request(state: RequestState, as_json: bool) -> None:
    if as_json:
        print(json.dumps(to_dict(state)))
        return
    print(f"{state.request_id}: {state.state}")
    if state.entry_id is None:
        return
    details = [f"entry {state.entry_id}", f"age {_seconds(state.age_s)}"]
    if state.queue_position is not None:
        details.append(f"{state.queue_position} queued ahead")
    if state.consumer is not None:
        details.append(f"group {state.group}, idle {_seconds(state.idle_s)}")
        details.append(f"delivered {state.num_deliveries}x")
    details.append(f"{state.num_input_tokens} prompt tokens, max_new_tokens {state.max_new_tokens}")
    if state.num_generated_ids:
        details.append(f"{state.num_generated_ids} tokens carried over")
    print("  " + "; ".join(details))


def show_snapshot(snapshot: QueueSnapshot, as_json: bool) -> None:
    if as_json:
        print(json.dumps(to_dict(snapshot)))
        return
    s = snapshot.stream
    stamp = time.strftime("%H:%M:%S", time.localtime(snapshot.at))
    print(f"namespace {snapshot.namespace}  at {stamp}")
    lag = "?" if s.lag is None else s.lag
    cursor = s.last_delivered_id if s.has_consumer_group else "(no consumer group yet)"
    print(
        f"stream {s.key}: {s.length} entries, {s.num_queued} queued, {s.num_pending} pending, "
        f"oldest {_seconds(s.oldest_age_s)}, lag {lag}, delivered up to {cursor}"
    )
    lanes = ", ".join(f"{key.rsplit(':', 1)[-1]} {n}" for key, n in snapshot.lane_lengths.items())
    print(f"lanes (entries): {lanes}")
    print()
    header = ("GROUP", "STATE", "BLOCKS", "KV USE", "RUN", "WAIT", "PENDING", "HEARTBEAT")
    rows: list[tuple[str, ...]] = [header + ("STEPS", "FINISHED", "PREEMPTED", "DEVICE", "MODEL")]
    rows += [_group_row(g) for g in snapshot.groups]
    _table(rows)
    if snapshot.consumers:
        print()
        rows = [("CONSUMER", "GROUP", "PENDING", "IDLE")]  # a table of its own
        rows += [
            (c.name, c.group, str(c.num_pending), _seconds(c.idle_s)) for c in snapshot.consumers
        ]
        _table(rows)


def _group_row(g: GroupView) -> tuple[str, ...]:
    kv = "-" if g.kv_use_pct is None else f"{g.kv_use_pct:.1f}%"
    return (
        g.group,
        g.state,
        _opt(g.num_blocks),
        kv,
        _opt(g.num_running),
        _opt(g.num_waiting),
        str(g.num_pending),
        _seconds(g.heartbeat_age_s),
        _opt(g.num_steps),
        _opt(g.num_finished),
        _opt(g.num_preempted),
        g.device or "-",
        g.model_id or "-",
    )


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"
