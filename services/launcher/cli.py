"""The one `textgen` command: `launch`, `gateway`, `scheduler`, `worker`; tools `bench`, `queue`.

Flags are generated from shared.settings.Settings (TGI's names); environment variables with
the same upper-case names apply when a flag is absent."""

from __future__ import annotations

import argparse
import sys

from shared.adapters import AdapterError
from shared.model_files import ModelNotFound
from shared.settings import add_settings_flags, describe_invalid, settings_from_args
from shared.telemetry import exit_flushed, setup_logging

COMMANDS = {
    "launch": "an embedded Redis and every service, in one command",
    "gateway": "the HTTP gateway (TGI and OpenAI routes)",
    "scheduler": "the scheduler of one worker group",
    "worker": "a worker group: the model, its KV cache and sampling",
}
TOOLS = {
    "bench": "latency and throughput of a server (sweeps, Poisson arrivals) vs baselines",
    "queue": "the request stream and the worker groups; drain/undrain a group",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI. A tool's flags (and module) are loaded only when that tool runs (or
    when no command is named): a command loads nothing it does not run."""
    parser = argparse.ArgumentParser(prog="textgen", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        add_settings_flags(commands.add_parser(name, help=help_text, description=help_text))
    bench = commands.add_parser("bench", help=TOOLS["bench"], description=TOOLS["bench"])
    queue = commands.add_parser("queue", help=TOOLS["queue"], description=TOOLS["queue"])
    if command in (None, "bench"):
        from services.bench.flags import add_bench_flags

        add_bench_flags(bench)
    if command in (None, "queue"):
        from services.launcher.queue_cli import add_queue_flags

        add_queue_flags(queue)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in (*COMMANDS, *TOOLS) else None
    args = build_parser(command).parse_args(argv)
    if args.command == "bench":
        from services.bench.main import run as run_bench

        setup_logging("bench", "WARNING")
        return run_bench(args)
    if args.command == "queue":
        from services.launcher.queue_cli import run as run_queue

        return run_queue(args)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"textgen {args.command}: invalid settings: {describe_invalid(exc)}", file=sys.stderr)
        return 2
    setup_logging(args.command, settings.log_level, settings.json_output)
    try:
        return run_command(args.command, settings, argv[1:])
    except (ModelNotFound, AdapterError) as exc:  # a user's mistake: one line, no traceback
        print(f"textgen {args.command}: {exc}", file=sys.stderr, flush=True)
        return 2


def run_command(command: str, settings, args: list[str]) -> int:
    if command == "launch":
        from services.launcher.launcher import Launcher

        return Launcher(settings, without_secret_flags(args)).run()
    if command == "gateway":
        from services.gateway.main import run
    elif command == "scheduler":
        from services.scheduler.main import run
    else:
        from services.worker.main import run
    try:
        run(settings)
    except KeyboardInterrupt:
        pass
    exit_flushed(0)


SECRET_FLAGS = ("--redis-url", "--api-key")  # passed to children in the environment instead


def without_secret_flags(args: list[str]) -> list[str]:
    """The flags to forward to child processes, less those `ps` must not show."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in SECRET_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in SECRET_FLAGS)):
            out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())
