"""A stopped service leaves at once (shared.telemetry.exit_flushed, skipping the interpreter's
teardown) with its spans exported and its logs written."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support.otlp_receiver import OtlpReceiver

PROGRAM = textwrap.dedent(
    """
    import logging, sys
    from opentelemetry import trace
    from shared.telemetry import exit_flushed, setup_tracing

    logging.basicConfig(filename=sys.argv[2], level=logging.INFO)
    setup_tracing("exit-test", sys.argv[1])
    with trace.get_tracer("t").start_as_current_span("last.span"):
        pass
    logging.getLogger("t").info("the last line")
    exit_flushed(3)
    """
)


def test_exit_flushed_exports_spans_writes_logs_and_keeps_the_code(tmp_path):
    log = tmp_path / "service.log"
    with OtlpReceiver() as receiver:
        done = subprocess.run(
            [sys.executable, "-c", PROGRAM, receiver.url, str(log)], timeout=60, check=False
        )
        spans = [(s.service, s.name) for s in receiver.spans]
    assert done.returncode == 3
    assert "the last line" in log.read_text()
    assert spans == [("textgen-exit-test", "last.span")]  # batched: sent only by the flush
