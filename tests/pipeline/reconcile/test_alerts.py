from __future__ import annotations

import io
import json
import logging
import traceback
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from pipeline.reconcile import check_plausibility
from pipeline.reconcile.alerts import (
    AlertConfigError,
    AlertDeliveryError,
    JsonLinesSink,
    SentKeysFile,
    WebhookSink,
    deadman,
    dedup_key,
    page,
    sink_from_env,
)
from pipeline.reconcile.findings import HOST_STALL
from schemas.config import Settings
from tests.helpers.hours import HOUR
from tests.helpers.reconcile_builders import clean_steps, make_dcgm, make_pool
from tests.helpers.webhooks import LocalEndpoint, TricklingSink

POOL = make_pool()
RAISED = datetime(2026, 11, 30, 6, 20, tzinfo=UTC)
ROUTING_KEY = "R0UTING-KEY-s3cr3t-5a1e"
SECRET_PATH = "/hooks/T000-s3cr3t-path"


def host_stall_results():
    dcgm = make_dcgm(POOL, {"GPU-0000-0000": [0.6], "GPU-0001-0000": [0.25]})
    return check_plausibility(HOUR, POOL, clean_steps(POOL), dcgm, Settings())


class Receiver(LocalEndpoint):
    """A local HTTP endpoint that records every POST and answers with a chosen status."""

    def __init__(self, status: int = 202) -> None:
        self.requests: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        self.status = status
        super().__init__(SECRET_PATH, self._record)

    def _record(self, handler: BaseHTTPRequestHandler) -> None:
        body = handler.rfile.read(int(handler.headers["Content-Length"]))
        self.requests.append((handler.path, dict(handler.headers), json.loads(body)))
        handler.send_response(self.status)
        handler.end_headers()
        handler.wfile.write(
            b'{"status": "echo ' + ROUTING_KEY.encode() + b" " + handler.path.encode() + b'"}'
        )


def test_failed_check_reaches_pagerduty_webhook_once(tmp_path: Path, caplog):
    caplog.set_level(logging.DEBUG)
    results = host_stall_results()
    failed = results[1]
    with Receiver() as receiver:
        sink = sink_from_env(
            {
                "STEPLEDGER_ALERT_WEBHOOK_URL": receiver.url,
                "STEPLEDGER_PAGERDUTY_ROUTING_KEY": ROUTING_KEY,
            }
        )
        sent_keys = SentKeysFile(tmp_path / "sent-keys")
        first = page(results, sink, sent_keys, raised_at=RAISED)
        # A re-run of the hour, with a fresh view of the same state file: nothing new is sent.
        second = page(results, sink, SentKeysFile(tmp_path / "sent-keys"), raised_at=RAISED)
    assert len(first) == 1
    assert second == []
    assert len(receiver.requests) == 1
    path, headers, body = receiver.requests[0]
    assert path == SECRET_PATH
    assert headers["Content-Type"] == "application/json"
    key = dedup_key("plausibility", HOUR, "chat", "chat-r1", "host_stall")
    summary = f"[ERROR] stepledger plausibility failed for chat/chat-r1 hour 2026-11-30T05: {failed.detail}"
    assert body == {
        "routing_key": ROUTING_KEY,
        "event_action": "trigger",
        "dedup_key": key,
        "payload": {
            "summary": summary,
            "source": "stepledger",
            "severity": "error",
            "timestamp": "2026-11-30T06:20:00+00:00",
            "component": "chat",
            "group": "chat-r1",
            "class": "plausibility",
            "custom_details": {
                "raised_at": "2026-11-30T06:20:00+00:00",
                "severity": "ERROR",
                "kind": "plausibility",
                "hour": "2026-11-30T05",
                "pool": "chat",
                "replica": "chat-r1",
                "finding": "host_stall",
                "detail": failed.detail,
                "dedup_key": key,
                # Paged through `page`, as dead-man pages are: not about one hour's publication.
                "held_back": None,
                "todo": HOST_STALL.runbook,
                "releases": "",
                "links": [],
            },
        },
    }
    assert (tmp_path / "sent-keys").read_text() == key + "\n"
    assert "sent plausibility alert for chat 2026-11-30T05" in caplog.text
    assert ROUTING_KEY not in caplog.text
    assert SECRET_PATH not in caplog.text


def test_slack_payload_is_the_summary_text():
    with Receiver(status=200) as receiver:
        sink = sink_from_env({"STEPLEDGER_ALERT_WEBHOOK_URL": receiver.url})
        page(host_stall_results(), sink, set(), raised_at=RAISED)
    ((_, _, body),) = receiver.requests
    assert list(body) == ["text"]
    assert body["text"].startswith(
        "[ERROR] stepledger plausibility failed for chat/chat-r1 hour 2026-11-30T05: "
    )


def test_delivery_failure_hides_url_and_key_and_is_retried_next_run(caplog):
    caplog.set_level(logging.DEBUG)
    sent_keys: set[str] = set()
    with Receiver(status=500) as receiver:
        sink = WebhookSink(receiver.url, format="pagerduty", routing_key=ROUTING_KEY)
        with pytest.raises(AlertDeliveryError) as raised:
            page(host_stall_results(), sink, sent_keys, raised_at=RAISED)
    assert sent_keys == set()
    assert len(receiver.requests) == 1
    port = receiver.server.server_port
    assert str(raised.value) == (
        "delivering plausibility alert for chat 2026-11-30T05 to WebhookSink(pagerduty -> http://127.0.0.1/…) "
        'failed: HTTP 500 Internal Server Error: {"status": "echo [redacted] [redacted]"}'
    )
    assert raised.value.__context__ is None
    assert raised.value.__cause__ is None
    shown = "".join(traceback.format_exception(raised.value)) + repr(sink) + caplog.text
    for secret in (ROUTING_KEY, SECRET_PATH, f":{port}"):
        assert secret not in shown


def test_unreachable_webhook_error_hides_the_url():
    with Receiver() as receiver:
        url = receiver.url
    sink = WebhookSink(url, format="slack", timeout_s=2)
    with pytest.raises(AlertDeliveryError) as raised:
        page(host_stall_results(), sink, set(), raised_at=RAISED)
    assert "refused" in str(raised.value).lower()
    assert SECRET_PATH not in "".join(traceback.format_exception(raised.value))


def test_default_sink_writes_json_lines_to_a_file_or_stdout(tmp_path: Path, capsys):
    target = tmp_path / "alerts" / "alerts.jsonl"
    sink = sink_from_env({"STEPLEDGER_ALERT_FILE": str(target)})
    assert isinstance(sink, JsonLinesSink)
    page(host_stall_results(), sink, set(), raised_at=RAISED)
    (line,) = target.read_text().splitlines()
    assert json.loads(line)["finding"] == "host_stall"
    page(host_stall_results(), sink_from_env({}), set(), raised_at=RAISED)
    assert json.loads(capsys.readouterr().out)["replica"] == "chat-r1"
    stream = io.StringIO()
    page(host_stall_results(), JsonLinesSink(stream), set(), raised_at=RAISED)
    assert json.loads(stream.getvalue())["kind"] == "plausibility"


def test_sink_configuration_errors_name_the_variable_not_the_value():
    with pytest.raises(
        AlertConfigError, match="STEPLEDGER_ALERT_FORMAT=slack needs STEPLEDGER_ALERT_WEBHOOK_URL"
    ):
        sink_from_env({"STEPLEDGER_ALERT_FORMAT": "slack"})
    with pytest.raises(
        AlertConfigError, match=r"needs a routing key \(STEPLEDGER_PAGERDUTY_ROUTING_KEY\)"
    ):
        sink_from_env({"STEPLEDGER_ALERT_FORMAT": "pagerduty"})
    with pytest.raises(AlertConfigError, match="is not one of pagerduty, slack"):
        sink_from_env({"STEPLEDGER_ALERT_FORMAT": "email"})
    with pytest.raises(AlertConfigError) as raised:
        sink_from_env({"STEPLEDGER_ALERT_WEBHOOK_URL": f"ftp://example.com{SECRET_PATH}"})
    assert SECRET_PATH not in str(raised.value)
    pagerduty = sink_from_env({"STEPLEDGER_PAGERDUTY_ROUTING_KEY": ROUTING_KEY})
    assert repr(pagerduty) == "WebhookSink(pagerduty -> https://events.pagerduty.com/…)"


def test_dedup_key_separates_findings_and_hours():
    key = dedup_key("plausibility", HOUR, "chat", "chat-r1", "host_stall")
    assert key == dedup_key("plausibility", HOUR, "chat", "chat-r1", "host_stall")
    assert (
        len(
            {
                key,
                dedup_key("plausibility", HOUR, "chat", "chat-r1", "dcgm_missing"),
                dedup_key("plausibility", HOUR, "chat", None, "host_stall"),
                dedup_key("plausibility", HOUR.replace(hour=6), "chat", "chat-r1", "host_stall"),
            }
        )
        == 4
    )


def test_deadman_fires_only_after_the_deadline_and_once_per_oldest_hour():
    settings = Settings(deadman_minutes=120)
    last = {
        "chat": datetime(2026, 11, 30, 5, tzinfo=UTC),
        "big": datetime(2026, 11, 30, 2, tzinfo=UTC),
    }
    # Hour 06 ended at 07:00; its deadline is 09:00.
    assert [r.pool for r in deadman(last, datetime(2026, 11, 30, 8, 59, tzinfo=UTC), settings)] == [
        "big"
    ]
    (big, chat) = deadman(last, datetime(2026, 11, 30, 9, 0, tzinfo=UTC), settings)
    assert (chat.pool, chat.hour, chat.passed, chat.check_name) == (
        "chat",
        HOUR.replace(hour=6),
        False,
        "deadman",
    )
    assert chat.detail == (
        "pool chat: 1 hour(s) not reconciled within 120 min of their end (2026-11-30T06): "
        "the scheduler, its daemon or the hourly run is not running"
    )
    assert big.detail.startswith(
        "pool big: 4 hour(s) not reconciled within 120 min of their end "
        "(2026-11-30T03 to 2026-11-30T06)"
    )
    later = deadman(last, datetime(2026, 11, 30, 11, 30, tzinfo=UTC), settings)
    sent: set[str] = set()
    stream = io.StringIO()
    assert (
        len(
            page(
                deadman(last, datetime(2026, 11, 30, 9, 0, tzinfo=UTC), settings),
                JsonLinesSink(stream),
                sent,
                raised_at=RAISED,
            )
        )
        == 2
    )
    assert page(later, JsonLinesSink(stream), sent, raised_at=RAISED) == []


def test_deadman_refuses_naive_times():
    with pytest.raises(ValueError, match="deadman: chat time 2026-11-30 05:00:00 has no time zone"):
        deadman({"chat": datetime(2026, 11, 30, 5)}, RAISED, Settings())


def test_a_sink_that_trickles_is_abandoned_at_the_deadline():
    # Each byte comes well within the deadline, so only a deadline on the whole delivery ends it.
    with TricklingSink(SECRET_PATH, interval_s=0.01) as trickling:
        sink = WebhookSink(trickling.url, format="slack", timeout_s=0.5)
        with pytest.raises(AlertDeliveryError) as raised:
            page(host_stall_results(), sink, set(), raised_at=RAISED)
        assert trickling.got_request.is_set()
        # The abandoned request's socket is shut: the sink sees its client gone.
        assert trickling.client_gone.wait(timeout=30)
    assert str(raised.value) == (
        "delivering plausibility alert for chat 2026-11-30T05 to "
        "WebhookSink(slack -> http://127.0.0.1/…) failed: no answer within 0.5 s; abandoned"
    )
    assert raised.value.__context__ is None
    assert raised.value.__cause__ is None
