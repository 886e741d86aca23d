"""Paging on-call: failed reconciliation findings to a sink, each finding once per hour.

Sinks: a local JSON-lines file or stdout (the default), or a webhook that posts PagerDuty
Events v2 or Slack-compatible JSON. Configuration comes from the environment:

- `STEPLEDGER_ALERT_WEBHOOK_URL`: the webhook; for PagerDuty it defaults to the public
  Events v2 endpoint. Slack-style URLs carry their secret in the path, so the URL is never
  logged or put in an error message, only its scheme and host.
- `STEPLEDGER_PAGERDUTY_ROUTING_KEY`: the PagerDuty integration key, never logged.
- `STEPLEDGER_ALERT_FORMAT`: `pagerduty` or `slack`; by default `pagerduty` when a routing
  key is set, `slack` when only a URL is.
- `STEPLEDGER_ALERT_FILE`: with no webhook, alerts are appended here as JSON lines; with
  neither, they are printed to stdout.
- `STEPLEDGER_ALERT_DEADLINE_S`: how long one delivery to the webhook may take in all (10 s
  by default); a sink that has not answered by then is abandoned, and the alert stays owed.
- `STEPLEDGER_DAGSTER_URL`: the Dagster UI's base URL; pages then link the run and the hour's
  partition there.
- `STEPLEDGER_REPORT_URL`: where the HTML report is served; pages then link it.

An alert may instead be for a channel of its own (a budget notice for a tenant's channel:
`Alert.destination`): it goes to a Slack-compatible webhook whose URL is in the environment
variable the alert names (`destination_env`), read by the process delivering it.

A page says what failed, whether the hour is held back from finance and what releases it,
and what on-call does next: the texts of the findings registry (`findings.py`).

Deduplication: a finding's key hashes (kind, hour, pool, replica, finding code). Keys already
in the `SentKeys` store are not sent again; a key is stored only after its alert was
delivered, so a failed delivery is retried by the next run. PagerDuty also receives the key as
`dedup_key`, so two racing runs still open one incident.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import logging
import os
import re
import socket
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO

import duckdb

from pipeline.reconcile.findings import NOT_RECONCILED, UNDELIVERED, kinds_found
from pipeline.reconcile.result import CheckResult, failed
from pipeline.storage.warehouse import connect, transaction
from schemas.config import Settings
from schemas.errors import ConfigError, ExternalError
from schemas.units import (
    hour_key,
    instant_to_warehouse,
    parse_hour_key,
    to_warehouse,
    warehouse_now,
)

log = logging.getLogger(__name__)

PAGERDUTY_EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"
# PagerDuty rejects summaries longer than this.
PAGERDUTY_SUMMARY_LIMIT = 1024
ENV_URL = "STEPLEDGER_ALERT_WEBHOOK_URL"
ENV_ROUTING_KEY = "STEPLEDGER_PAGERDUTY_ROUTING_KEY"
ENV_FORMAT = "STEPLEDGER_ALERT_FORMAT"
ENV_FILE = "STEPLEDGER_ALERT_FILE"
ENV_DEADLINE = "STEPLEDGER_ALERT_DEADLINE_S"
ENV_DAGSTER_URL = "STEPLEDGER_DAGSTER_URL"
ENV_REPORT_URL = "STEPLEDGER_REPORT_URL"
# How long one delivery to a webhook may take, all of it, before it is abandoned and retried.
DEFAULT_DEADLINE_S = 10.0

WebhookFormat = Literal["pagerduty", "slack"]


class AlertConfigError(ConfigError):
    """The alert sink's environment configuration is incomplete or invalid."""


class AlertDeliveryError(ExternalError):
    """An alert could not be delivered; the message never contains the webhook URL or key."""


# What on-call does when a pool-hour run failed before its checks could say what is wrong.
RUN_FAILED_TODO = (
    "the error names the file, record or field that failed: fix it and re-run the hour "
    "(`stepledger run --hour`, or re-materialize the partition); until then the hour stays as "
    "its last finished run left it"
)


@dataclass(frozen=True)
class Link:
    """A link a page carries: the Dagster run, the hour in the UI, the report."""

    text: str
    href: str


@dataclass(frozen=True)
class Alert:
    """What on-call is told of one finding: a failed result, when it was raised and its dedup key,
    whether the hour is held back from finance (None when the alert is not about one hour's
    publication: a dead-man page, a run that failed before its checks), what to do, what
    releases a held hour, and links."""

    raised_at: datetime
    severity: str
    kind: str
    hour: datetime
    pool: str
    replica: str | None
    finding: str
    detail: str
    dedup_key: str
    held_back: bool | None = None
    todo: str = ""
    releases: str = ""
    links: tuple[Link, ...] = ()
    # Where the alert goes: on-call (None), through the sink the environment configures, or a
    # channel of its own, a Slack-compatible webhook whose URL is in the environment variable
    # `destination_env` of the delivering process (the outbox never holds the URL).
    destination: str | None = None
    destination_env: str | None = None

    @property
    def summary(self) -> str:
        """One line: severity, check, where, hour, whether it is published, and the detail."""
        where = self.pool if self.replica is None else f"{self.pool}/{self.replica}"
        standing = {None: "", True: " (held back)", False: " (published)"}[self.held_back]
        return (
            f"[{self.severity}] stepledger {self.kind} failed for {where} hour "
            f"{hour_key(self.hour)}{standing}: {self.detail}"
        )

    def message(self) -> str:
        """The whole page as lines of text: the summary, the hour's standing and what releases
        it, what to do, the links."""
        lines = [self.summary]
        if self.held_back:
            lines.append(f"The hour is held back from finance. Released by: {self.releases}.")
        elif self.held_back is False:
            lines.append("The hour is published: finance sees it.")
        if self.todo:
            lines.append(f"What to do: {self.todo}.")
        lines.extend(f"{link.text}: {link.href}" for link in self.links)
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        """The alert as JSON values (times as ISO strings, the hour as its key)."""
        return {
            "raised_at": self.raised_at.astimezone(UTC).isoformat(),
            "severity": self.severity,
            "kind": self.kind,
            "hour": hour_key(self.hour),
            "pool": self.pool,
            "replica": self.replica,
            "finding": self.finding,
            "detail": self.detail,
            "dedup_key": self.dedup_key,
            "held_back": self.held_back,
            "todo": self.todo,
            "releases": self.releases,
            "links": [asdict(link) for link in self.links],
            # Only an alert for a channel says where it goes: on-call's alerts stay as they were.
            **(
                {"destination": self.destination, "destination_env": self.destination_env}
                if self.destination is not None
                else {}
            ),
        }


def links_for(
    run_id: str | None,
    partition: str,
    environ: Mapping[str, str] | None = None,
    *,
    report: str | None = None,
) -> tuple[Link, ...]:
    """The links a page of the run `run_id` for the partition `partition` carries: the run and
    the partition in the Dagster UI when `STEPLEDGER_DAGSTER_URL` is set, the report at
    `STEPLEDGER_REPORT_URL` (or `report`, where the caller writes it)."""
    env = os.environ if environ is None else environ
    links = []
    if dagster := env.get(ENV_DAGSTER_URL, "").rstrip("/"):
        if run_id:
            links.append(Link("Dagster run", f"{dagster}/runs/{urllib.parse.quote(run_id)}"))
        links.append(
            Link(
                "the hour in the Dagster UI",
                f"{dagster}/assets/ledger?view=partitions&partition="
                + urllib.parse.quote(partition, safe=""),
            )
        )
    if report := env.get(ENV_REPORT_URL) or report:
        links.append(Link("report", report))
    return tuple(links)


def _runbook(result: CheckResult) -> tuple[str, str]:
    """What to do about a failed result, and what releases the hour it holds back (the
    registry's texts of the kinds it found, each once)."""
    kinds = kinds_found(result.check_name, result.finding, result.severity)
    todo = "; ".join(dict.fromkeys(kind.runbook for kind in kinds))
    releases = "; ".join(dict.fromkeys(kind.releases for kind in kinds if kind.releases))
    return todo, releases


def dedup_key(kind: str, hour: datetime, pool: str, replica: str | None, finding: str) -> str:
    """Stable key of one finding for one hour: equal findings page once."""
    identity = json.dumps([kind, hour_key(hour), pool, replica, finding])
    return "stepledger-" + hashlib.sha256(identity.encode()).hexdigest()[:32]


# What an alert repeats of its failed result under the same name (`kind` is its check_name).
_FROM_RESULT = ("severity", "hour", "pool", "replica", "finding", "detail")


def alert_for(
    result: CheckResult,
    raised_at: datetime,
    *,
    held_back: bool | None = None,
    links: tuple[Link, ...] = (),
) -> Alert:
    """The alert of a failed result, raised at `raised_at`, with the registry's texts;
    `held_back`: whether the result's hour is held back (None: not about its publication).
    A passed result is refused."""
    if result.passed:
        raise ValueError(
            f"{result.check_name} for {result.pool} passed; only failed results are alerts"
        )
    key = dedup_key(result.check_name, result.hour, result.pool, result.replica, result.finding)
    todo, releases = _runbook(result)
    return Alert(
        raised_at=raised_at,
        kind=result.check_name,
        dedup_key=key,
        held_back=held_back,
        todo=todo,
        releases=releases if held_back else "",
        links=links,
        **{name: getattr(result, name) for name in _FROM_RESULT},
    )


def record_alerts(con: duckdb.DuckDBPyConnection, results: Iterable[CheckResult]) -> None:
    """Add an `alerts` row for each failed result not recorded before (keyed by `dedup_key`),
    so a re-run of a failing hour adds no second row."""
    with transaction(con):
        add_alerts(con, results)


def add_alerts(con: duckdb.DuckDBPyConnection, results: Iterable[CheckResult]) -> None:
    """`record_alerts` inside the caller's transaction (the one recording the checks)."""
    raised_at = warehouse_now()
    rows: dict[str, list[Any]] = {}
    for r in results:
        if r.passed:
            continue
        key = dedup_key(r.check_name, r.hour, r.pool, r.replica, r.finding)
        rows.setdefault(
            key,
            [
                raised_at,
                r.severity,
                r.check_name,
                to_warehouse(r.hour),
                r.pool,
                r.replica,
                r.detail,
                key,
            ],
        )
    if not rows:
        return
    # One statement for the hour's alerts: each statement on the warehouse costs a round of
    # catalog look-ups (10 ms), which a failing hour's many results added up.
    values = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?)"] * len(rows))
    con.execute(
        "INSERT INTO alerts (raised_at, severity, kind, hour, pool, replica, detail, dedup_key) "
        "SELECT CAST(raised_at AS TIMESTAMP), severity, kind, "
        "CAST(hour AS TIMESTAMP), pool, replica, detail, dedup_key "
        f"FROM (VALUES {values}) AS new(raised_at, severity, kind, hour, pool, replica, detail, "
        "dedup_key) WHERE NOT EXISTS (SELECT 1 FROM alerts WHERE alerts.dedup_key = new.dedup_key)",
        [value for row in rows.values() for value in row],
    )


# --- where sent keys live -----------------------------------------------------------------


class SentKeys(Protocol):
    """Dedup keys of alerts already delivered. A plain `set` is one (for a single process)."""

    def __contains__(self, key: object) -> bool: ...

    def add(self, key: str) -> None:
        """Remember `key` as sent."""


class SentKeysFile:
    """Sent keys in a small text file, one per line, appended and fsynced as each alert is sent."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._keys = set(self.path.read_text(encoding="utf-8").split())
        except FileNotFoundError:
            self._keys = set()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def add(self, key: str) -> None:
        """Record `key` as sent, on disk before in memory."""
        if key in self._keys:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as stream:
            stream.write(key + "\n")
            stream.flush()
            os.fsync(stream.fileno())
        self._keys.add(key)


# --- sinks --------------------------------------------------------------------------------


class AlertSink(Protocol):
    """Where alerts go; `send` raises AlertDeliveryError when one is not accepted."""

    def send(self, alert: Alert) -> None:
        """Deliver one alert."""


class JsonLinesSink:
    """Appends each alert as one JSON object per line to a file, or writes it to a stream."""

    def __init__(self, target: str | os.PathLike[str] | TextIO | None = None) -> None:
        self.target = Path(target) if isinstance(target, (str, os.PathLike)) else target

    def send(self, alert: Alert) -> None:
        """Write the alert as one JSON line."""
        line = json.dumps(alert.as_json(), sort_keys=True) + "\n"
        if isinstance(self.target, Path):
            self.target.parent.mkdir(parents=True, exist_ok=True)
            with self.target.open("a", encoding="utf-8") as stream:
                stream.write(line)
        else:
            out = self.target or sys.stdout
            out.write(line)
            out.flush()

    def __repr__(self) -> str:
        return f"JsonLinesSink({str(self.target) if isinstance(self.target, Path) else 'stream'})"


class _Abandonable:
    """The sockets one request opens, so that a deadline can shut them under it: a sink that
    answers one byte at a time never lets a per-read timeout expire, and would hold the
    request, and whoever waits on it, for good."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._abandoned = False

    def opener(self) -> urllib.request.OpenerDirector:
        """An opener whose HTTP(S) connections report their sockets here."""
        track = self._track

        class Http(urllib.request.HTTPHandler):
            def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
                return self.do_open(track(http.client.HTTPConnection), req)

        class Https(urllib.request.HTTPSHandler):
            def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
                return self.do_open(
                    track(http.client.HTTPSConnection),
                    req,
                    context=self._context,  # type: ignore[attr-defined]
                )

        return urllib.request.build_opener(Http, Https)

    def _track(self, connection_class: type[http.client.HTTPConnection]) -> Any:
        opened = self._opened

        class Tracked(connection_class):  # type: ignore[valid-type,misc]
            def connect(self) -> None:
                super().connect()
                opened(self.sock)

        return Tracked

    def _opened(self, sock: socket.socket) -> None:
        with self._lock:
            if self._abandoned:
                _shut(sock)
            self._sockets.append(sock)

    def abandon(self) -> None:
        """Shut every socket opened and any opened from now on: the request fails at once."""
        with self._lock:
            self._abandoned = True
            for sock in self._sockets:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # closed already
        sock.shutdown(socket.SHUT_RDWR)


class WebhookSink:
    """POSTs PagerDuty Events v2 or Slack-compatible JSON; URL and routing key stay secret.

    `timeout_s` is the deadline of one delivery, all of it (name lookup, connecting, sending,
    the answer): a sink that has not answered by then is abandoned and the delivery failed."""

    def __init__(
        self,
        url: str,
        *,
        format: WebhookFormat,
        routing_key: str | None = None,
        source: str = "stepledger",
        timeout_s: float = DEFAULT_DEADLINE_S,
        url_env: str = ENV_URL,
    ) -> None:
        if format not in ("pagerduty", "slack"):
            raise AlertConfigError(f"webhook format {format!r} is not one of pagerduty, slack")
        if format == "pagerduty" and not routing_key:
            raise AlertConfigError(f"the pagerduty format needs a routing key ({ENV_ROUTING_KEY})")
        # Never the URL in the message, nor a chained error that quotes it: its path is a secret.
        try:
            parts = urllib.parse.urlsplit(url)
            # A port that is not a number would otherwise fail only at the first page.
            parts.port  # noqa: B018
        except ValueError:
            raise AlertConfigError(f"the webhook URL ({url_env}) does not parse as a URL") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise AlertConfigError(f"the webhook URL ({url_env}) is not an http(s) URL")
        if re.search(r"[\x00-\x20\x7f]", url):
            raise AlertConfigError(
                f"the webhook URL ({url_env}) contains whitespace or control characters"
            )
        self._url = url
        self._routing_key = routing_key
        self.format: WebhookFormat = format
        self.source = source
        self.timeout_s = timeout_s
        # What may be shown of the destination: scheme and host, never path, query or key.
        self.destination = f"{parts.scheme}://{parts.hostname}"

    def __repr__(self) -> str:
        return f"WebhookSink({self.format} -> {self.destination}/…)"

    def payload(self, alert: Alert) -> dict[str, Any]:
        """The JSON body posted for the alert in this sink's format."""
        if self.format == "slack":
            return {"text": alert.message()}
        links = {"links": [asdict(link) for link in alert.links]} if alert.links else {}
        return {
            "routing_key": self._routing_key,
            "event_action": "trigger",
            "dedup_key": alert.dedup_key,
            "payload": {
                "summary": alert.summary[:PAGERDUTY_SUMMARY_LIMIT],
                "source": self.source,
                "severity": "error" if alert.severity == "ERROR" else "warning",
                "timestamp": alert.raised_at.astimezone(UTC).isoformat(),
                "component": alert.pool,
                "group": alert.replica or alert.pool,
                "class": alert.kind,
                "custom_details": alert.as_json(),
            },
            **links,
        }

    def _redact(self, text: str) -> str:
        parts = urllib.parse.urlsplit(self._url)
        path_and_query = parts.path + (f"?{parts.query}" if parts.query else "")
        for secret in (
            self._url,
            path_and_query if len(path_and_query) > 1 else None,
            self._routing_key,
        ):
            if secret:
                text = text.replace(secret, "[redacted]")
        return text

    def send(self, alert: Alert) -> None:
        """POST the alert; AlertDeliveryError (with the URL and key redacted) unless accepted."""
        request = urllib.request.Request(
            self._url,
            data=json.dumps(self.payload(alert)).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        what = f"{alert.kind} alert for {alert.pool} {hour_key(alert.hour)} to {self!r}"
        sockets = _Abandonable()
        outcome: list[int | BaseException] = []

        def post() -> None:
            try:
                with sockets.opener().open(request, timeout=self.timeout_s) as response:
                    outcome.append(response.status)
            except BaseException as err:  # handed to the waiting thread, which classifies it
                outcome.append(err)

        # The request runs in a thread of its own so that the deadline holds whatever it is
        # blocked in; at the deadline its sockets are shut, which ends it.
        attempt = threading.Thread(target=post, name="alert-delivery", daemon=True)
        attempt.start()
        attempt.join(self.timeout_s)
        if not outcome:
            sockets.abandon()
            raise AlertDeliveryError(
                f"delivering {what} failed: no answer within {self.timeout_s:g} s; abandoned"
            )
        (result,) = outcome
        if isinstance(result, urllib.error.HTTPError):
            body = self._redact(result.read(300).decode("utf-8", "replace"))
            message = (
                f"delivering {what} failed: HTTP {result.code} "
                f"{self._redact(str(result.reason))}: {body}"
            )
        elif isinstance(result, (urllib.error.URLError, OSError)):
            reason = getattr(result, "reason", result)
            message = f"delivering {what} failed: {self._redact(str(reason))}"
        elif isinstance(result, BaseException):
            raise result
        else:
            log.info("sent %s (HTTP %s)", what, result)
            return
        # Raised apart from the request's exception: it carries the full URL and must not be
        # chained to this one.
        raise AlertDeliveryError(message)


def sink_from_env(environ: Mapping[str, str] | None = None) -> AlertSink:
    """The sink the environment configures (see the module docstring)."""
    env = os.environ if environ is None else environ
    url = env.get(ENV_URL) or None
    routing_key = env.get(ENV_ROUTING_KEY) or None
    format = env.get(ENV_FORMAT) or ("pagerduty" if routing_key else "slack" if url else None)
    if format is None:
        return JsonLinesSink(env.get(ENV_FILE) or None)
    if format not in ("pagerduty", "slack"):
        raise AlertConfigError(f"{ENV_FORMAT}={format!r} is not one of pagerduty, slack")
    if format == "slack" and url is None:
        raise AlertConfigError(f"{ENV_FORMAT}=slack needs {ENV_URL}")
    return WebhookSink(
        url or PAGERDUTY_EVENTS_URL,
        format="slack" if format == "slack" else "pagerduty",
        routing_key=routing_key,
        timeout_s=_deadline_s(env),
    )


def _deadline_s(env: Mapping[str, str]) -> float:
    deadline = env.get(ENV_DEADLINE) or str(DEFAULT_DEADLINE_S)
    try:
        timeout_s = float(deadline)
    except ValueError:
        timeout_s = 0.0
    if not 0 < timeout_s < float("inf"):
        raise AlertConfigError(f"{ENV_DEADLINE}={deadline!r} is not a number of seconds above 0")
    return timeout_s


def channel_sink(alert: Alert, environ: Mapping[str, str] | None = None) -> AlertSink:
    """The sink of an alert for a channel: the Slack-compatible webhook whose URL is in the
    environment variable the alert names. AlertDeliveryError when it is not set here (the
    alert stays owed and is retried)."""
    env = os.environ if environ is None else environ
    name = alert.destination_env or ""
    url = env.get(name)
    if not url:
        raise AlertDeliveryError(
            f"channel {alert.destination}: {name} (its webhook URL) is not set in the "
            "environment of the process delivering alerts"
        )
    return WebhookSink(url, format="slack", timeout_s=_deadline_s(env), url_env=name)


# --- paging -------------------------------------------------------------------------------


def page(
    results: Iterable[CheckResult], sink: AlertSink, sent_keys: SentKeys, *, raised_at: datetime
) -> list[Alert]:
    """Send each failed result's finding unless sent before; returns the alerts sent now."""
    return send_new((alert_for(r, raised_at) for r in results if not r.passed), sink, sent_keys)


def send_new(alerts: Iterable[Alert], sink: AlertSink, sent_keys: SentKeys) -> list[Alert]:
    """Send the alerts whose dedup key is not in `sent_keys`, recording each once delivered.

    A delivery error propagates after the alerts before it were sent and recorded, so the run
    fails (and the failure is itself visible) while nothing is paged twice on the retry.
    """
    sent = []
    for alert in alerts:
        if alert.dedup_key in sent_keys:
            log.debug("already sent %s for %s %s", alert.kind, alert.pool, hour_key(alert.hour))
            continue
        sink.send(alert)
        sent_keys.add(alert.dedup_key)
        sent.append(alert)
    return sent


# --- the outbox: at-least-once delivery --------------------------------------------------

# After a failed delivery the next try waits FIRST_RETRY, doubling per attempt up to LAST_RETRY:
# a sink down for a minute is retried within one, one down for a day is tried hourly.
FIRST_RETRY = timedelta(minutes=1)
LAST_RETRY = timedelta(hours=1)


def _alert_from_json(text: str) -> Alert:
    fields = json.loads(text)
    return Alert(
        **{
            **fields,
            "raised_at": datetime.fromisoformat(fields["raised_at"]),
            "hour": parse_hour_key(fields["hour"]),
            # Alerts owed since before pages carried links have none.
            "links": tuple(Link(**link) for link in fields.get("links", ())),
        }
    )


def enqueue(con: duckdb.DuckDBPyConnection, alerts: Iterable[Alert]) -> int:
    """Record alerts owed to on-call in the pipeline state's `alert_outbox`; an alert whose
    dedup key is there already (owed or delivered) is not added again. Returns how many were."""
    added = 0
    with transaction(con):
        for alert in alerts:
            # Not ON CONFLICT ... RETURNING: DuckDB runs no RETURNING against PostgreSQL, where
            # the outbox lives in production.
            added += con.execute(
                "INSERT INTO alert_outbox SELECT ?, ?, ?, 0, ?, NULL, NULL "
                "WHERE NOT EXISTS (SELECT 1 FROM alert_outbox WHERE dedup_key = ?)",
                [
                    alert.dedup_key,
                    json.dumps(alert.as_json(), sort_keys=True),
                    instant_to_warehouse(alert.raised_at),
                    instant_to_warehouse(alert.raised_at),
                    alert.dedup_key,
                ],
            ).fetchall()[0][0]
    return added


def deliver_due(
    con: duckdb.DuckDBPyConnection,
    sink: AlertSink,
    now: datetime,
    environ: Mapping[str, str] | None = None,
) -> list[Alert]:
    """Try every owed alert whose next attempt is due, oldest first; returns those delivered.
    On-call's alerts go to `sink`, a channel's to its webhook (`channel_sink`, its URL from
    `environ`, by default the process's environment).

    Each outcome is committed as it happens: delivered, or the attempt counted with its error
    and the next attempt put off (FIRST_RETRY doubling up to LAST_RETRY). A destination that
    fails gets no more alerts this round, so a sink that is down is not hammered with every
    owed alert, and a tenant's channel that is down does not hold up on-call's pages."""
    due = con.execute(
        "SELECT dedup_key, alert, attempts FROM alert_outbox "
        "WHERE delivered_at IS NULL AND next_attempt_at <= ? ORDER BY enqueued_at, dedup_key",
        [instant_to_warehouse(now)],
    ).fetchall()
    delivered = []
    refused: set[str | None] = set()
    for key, text, attempts in due:
        alert = _alert_from_json(text)
        if alert.destination in refused:
            continue
        try:
            target = sink if alert.destination is None else channel_sink(alert, environ)
            target.send(alert)
        except (AlertDeliveryError, AlertConfigError, OSError) as err:
            wait = min(FIRST_RETRY * 2**attempts, LAST_RETRY)
            con.execute(
                "UPDATE alert_outbox SET attempts = attempts + 1, last_error = ?, "
                "next_attempt_at = ? WHERE dedup_key = ?",
                [str(err), instant_to_warehouse(now + wait), key],
            )
            log.warning("alert %s owed (attempt %d): %s", key, attempts + 1, err)
            refused.add(alert.destination)
            continue
        con.execute(
            "UPDATE alert_outbox SET attempts = attempts + 1, delivered_at = ?, last_error = NULL "
            "WHERE dedup_key = ?",
            [instant_to_warehouse(now), key],
        )
        delivered.append(alert)
    return delivered


class Courier:
    """Delivers alerts on a thread of its own, so that billing never waits on a sink: the
    billing thread records what is owed in the outbox of `state_file` and calls `wake`, or,
    when the outbox cannot be written, hands the alerts to `send`, which needs no disk. Each
    delivery is bounded by the sink's deadline; `close` waits for the last round.

    `report` lists, for the caller to show after its own output, what became of each round:
    alerts delivered, alerts still owed and why, alerts that could not be paged at all."""

    def __init__(self, state_file: Path, sink: AlertSink) -> None:
        self.state_file = state_file
        self.sink = sink
        self.delivered: list[Alert] = []
        self.report: list[str] = []
        self._direct: list[Alert] = []
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._closing = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._deliver_rounds, name="alert-courier")

    def __enter__(self) -> Courier:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wake(self) -> None:
        """Deliver what the outbox owes, on the courier's thread."""
        self._wanted.set()

    def send(self, alerts: Iterable[Alert]) -> None:
        """Deliver `alerts` straight to the sink, not through the outbox (which cannot be
        written): a failure is reported, and the alert is lost to the next run."""
        with self._lock:
            self._direct.extend(alerts)
        self._wanted.set()

    def close(self) -> None:
        """Finish the round under way and one more for anything owed since; raise what the
        courier's thread raised, if anything."""
        self._closing = True
        self._wanted.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._failure is not None:
            raise self._failure

    def _deliver_rounds(self) -> None:
        try:
            while True:
                self._wanted.wait()
                self._wanted.clear()
                closing = self._closing
                self._round(datetime.now(UTC))
                if closing:
                    return
        except BaseException as err:  # raised again by close(), on the caller's thread
            self._failure = err

    def _tell(self, line: str) -> None:
        if line not in self.report:
            self.report.append(line)

    def _round(self, now: datetime) -> None:
        with self._lock:
            direct, self._direct = self._direct, []
        for alert in direct:
            try:
                self.sink.send(alert)
                self.delivered.append(alert)
            except (AlertDeliveryError, OSError) as err:
                self._tell(
                    f"on-call could not be paged for {hour_key(alert.hour)} {alert.pool}: {err}"
                )
        try:
            with connect(self.state_file) as con:
                self.delivered.extend(deliver_due(con, self.sink, now))
                owed = con.execute(
                    "SELECT count(*), max(last_error) FROM alert_outbox WHERE delivered_at IS NULL"
                ).fetchall()
        except (duckdb.Error, OSError) as err:
            self._tell(f"{self.state_file}: the alert outbox cannot be read ({err})")
            return
        ((count, last_error),) = owed
        if count and self._closing:
            self._tell(
                f"{count} alert(s) still owed in the outbox ({last_error}): the `deliver_alerts` "
                "sensor or the next run delivers them"
            )


def hour_alerts(
    findings: Iterable[CheckResult],
    pool: str,
    hour: datetime,
    run_id: str,
    error: str | None,
    now: datetime,
    links: tuple[Link, ...] = (),
) -> list[Alert]:
    """What a failed pool-hour run owes on-call: its ERROR findings, each once per hour and
    saying whether the hour is held back; when it has none, the run's failure itself
    (`run_failed`, once per run)."""
    failures = [r for r in findings if not r.passed]
    held_back = any(r.blocking for r in failures)
    errors = [
        alert_for(r, now, held_back=held_back, links=links)
        for r in failures
        if r.severity == "ERROR"
    ]
    if errors:
        return errors
    return [
        Alert(
            raised_at=now,
            severity="ERROR",
            kind="run_failed",
            hour=hour,
            pool=pool,
            replica=None,
            finding=run_id,
            detail=error or "the pool-hour run failed",
            dedup_key=dedup_key("run_failed", hour, pool, None, run_id),
            todo=RUN_FAILED_TODO,
            links=links,
        )
    ]


def undelivered(
    con: duckdb.DuckDBPyConnection, now: datetime, settings: Settings
) -> list[CheckResult]:
    """A failed `alert_delivery` result per alert owed for longer than
    `settings.deadman_minutes`: the sink has refused on-call's pages that long."""
    grace = timedelta(minutes=settings.deadman_minutes)
    rows = con.execute(
        "SELECT alert, attempts, last_error, enqueued_at FROM alert_outbox "
        "WHERE delivered_at IS NULL AND enqueued_at <= ? ORDER BY enqueued_at",
        [instant_to_warehouse(now - grace)],
    ).fetchall()
    results = []
    for text, attempts, last_error, enqueued_at in rows:
        alert = _alert_from_json(text)
        results.append(
            failed(
                (alert.hour, alert.pool, alert.replica),
                f"every alert delivered within {settings.deadman_minutes} min",
                f"{attempts} failed attempt(s) since {enqueued_at.isoformat()} UTC",
                [
                    UNDELIVERED.found(
                        f"the {alert.kind} alert for {alert.pool} hour {hour_key(alert.hour)} "
                        f"({alert.dedup_key}) is still undelivered: {last_error}"
                    )
                ],
            )
        )
    return results


def deadman(
    last_reconciled: Mapping[str, datetime], now: datetime, settings: Settings
) -> list[CheckResult]:
    """Pools whose hours went unreconciled for `settings.deadman_minutes` after they ended.

    `last_reconciled`: pool -> the latest hour up to which every hour is reconciled (for a new
    pool, the hour before it went live). One failed result per late pool, placed at its oldest overdue hour, so the page
    repeats only when a newer hour becomes the oldest overdue one. Runs outside the scheduler:
    when no run happens, nothing inside the scheduler can notice.
    """
    for name, moment in [("now", now), *last_reconciled.items()]:
        if moment.tzinfo is None:
            raise ValueError(
                f"deadman: {name} time {moment} has no time zone; pass aware UTC datetimes"
            )
    grace = timedelta(minutes=settings.deadman_minutes)
    hour = timedelta(hours=1)
    # The newest hour whose deadline has passed: it ended at least `grace` ago.
    newest_due = (now.astimezone(UTC) - grace - hour).replace(minute=0, second=0, microsecond=0)
    results = []
    for pool, last in sorted(last_reconciled.items()):
        last_utc = last.astimezone(UTC)
        if last_utc >= newest_due:
            continue
        oldest = last_utc + hour
        overdue = (newest_due - oldest) // hour + 1
        span = hour_key(oldest) if overdue == 1 else f"{hour_key(oldest)} to {hour_key(newest_due)}"
        results.append(
            failed(
                (oldest, pool, None),
                f"every hour reconciled within {settings.deadman_minutes} min of its end",
                f"last reconciled hour {hour_key(last_utc)}",
                [
                    NOT_RECONCILED.found(
                        f"pool {pool}: {overdue} hour(s) not reconciled within {settings.deadman_minutes} min "
                        f"of their end ({span}): the scheduler, its daemon or the hourly run is not running"
                    )
                ],
            )
        )
    return results
