"""What on-call meets: a page says what failed, whether the hour is held back and what releases
it, what to do, and links the run, the hour in the Dagster UI and the report; it is delivered
apart from billing, by `demo` as by `run`; the table stays clean (WARN and ERROR findings in
full, pages after it on standard error); `stepledger status` says why an hour is held and
whether its page went out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from assets.cli import main
from assets.cli.run import PoolHourRun, run_pool_hours
from pipeline.reconcile.alerts import ENV_DAGSTER_URL, ENV_DEADLINE, ENV_REPORT_URL, ENV_URL
from pipeline.reconcile.findings import DROPPED, GPU_BUSIER
from pipeline.storage.warehouse import STATE_FILE, connect
from schemas.config import load_pools
from tests.helpers.fleets import simulate_small
from tests.helpers.hours import SIMULATED_HOUR
from tests.helpers.webhooks import RecordingSink

DAGSTER_UI = "http://dagster.example:3000"
REPORT = "https://reports.example/stepledger/report.html"
HOUR = "2026-11-30T00"
PARTITION = "2026-11-30-00%3A00%7Cchat-8b"


def clear_alert_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        ENV_URL,
        "STEPLEDGER_PAGERDUTY_ROUTING_KEY",
        "STEPLEDGER_ALERT_FORMAT",
        "STEPLEDGER_ALERT_FILE",
        ENV_DAGSTER_URL,
        ENV_REPORT_URL,
        "DAGSTER_HOME",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "1000")


def test_billing_goes_on_while_the_sink_holds_the_page_and_the_page_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clear_alert_environment(monkeypatch)
    pools = load_pools()
    one_replica_each = pools.model_copy(
        update={"pools": [p.model_copy(update={"replicas": p.replicas[:1]}) for p in pools.pools]}
    )
    # The recorder of chat-8b-r0 drops steps: the first pool-hour is held back and pages.
    data = simulate_small(tmp_path / "run", one_replica_each, faults={"drop-records": 0.01})
    billed_while_held: list[bool] = []
    with RecordingSink(held=True) as sink:
        monkeypatch.setenv(ENV_URL, sink.url)
        # Long enough that a sink waited on by billing would be abandoned, not answered.
        monkeypatch.setenv(ENV_DEADLINE, "30")
        monkeypatch.setenv(ENV_DAGSTER_URL, DAGSTER_UI + "/")
        monkeypatch.setenv(ENV_REPORT_URL, REPORT)

        def done(run: PoolHourRun) -> None:
            if run.pool == "reason-dsv3":
                # chat-8b's page reached the sink, which has not answered, and the next
                # pool-hour is billed all the same.
                billed_while_held.append(sink.got_request.wait(60))
                sink.release.set()

        runs = run_pool_hours(data, [SIMULATED_HOUR], on_done=done)
    assert billed_while_held == [True]
    assert [(r.pool, r.held_back, r.error) for r in runs] == [
        ("chat-8b", True, None),
        ("reason-dsv3", False, None),
    ]
    with connect(data / STATE_FILE) as con:
        outbox = con.execute(
            "SELECT attempts, delivered_at IS NOT NULL FROM alert_outbox"
        ).fetchall()
    # Delivered by its first attempt, once the sink answered: nobody gave up on it.
    assert outbox == [(1, True)]
    ((text,),) = [list(body.values()) for body in sink.bodies]
    summary, *rest = text.splitlines()
    assert summary.startswith(
        f"[ERROR] stepledger sequence failed for chat-8b/chat-8b-r0 hour {HOUR} (held back): "
        "recorder dropped "
    )
    assert rest == [
        f"The hour is held back from finance. Released by: {DROPPED.releases}.",
        f"What to do: {DROPPED.runbook}.",
        f"Dagster run: {DAGSTER_UI}/runs/{runs[0].run_id}",
        f"the hour in the Dagster UI: {DAGSTER_UI}/assets/ledger?view=partitions&partition={PARTITION}",
        f"report: {REPORT}",
    ]


def test_a_fault_demo_with_a_webhook_pages_and_status_says_why_the_hour_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clear_alert_environment(monkeypatch)
    out = tmp_path / "demo"
    with RecordingSink() as sink:
        monkeypatch.setenv(ENV_URL, sink.url)
        monkeypatch.setenv(ENV_DAGSTER_URL, DAGSTER_UI)
        result = CliRunner().invoke(
            main,
            ["demo", "--out", str(out), "--hours", "0.01", "--fault", "drop-records=0.01"],
        )
    assert result.exit_code == 0, result.output
    # One page, for the held-back hour, linking the report the demo writes.
    ((text,),) = [list(body.values()) for body in sink.bodies]
    assert text.startswith(f"[ERROR] stepledger sequence failed for chat-8b/chat-8b-r0 hour {HOUR}")
    assert f"\nreport: {(out / 'report.html').resolve().as_uri()}" in text
    assert f"\nthe hour in the Dagster UI: {DAGSTER_UI}/assets/ledger?" in text
    # The table: each pool-hour's standing, and every finding in full under its severity;
    # no JSON lines, no cut details. What was paged is said after it, on standard error.
    lines = result.stdout.splitlines()
    assert f"{HOUR} chat-8b: held back" in lines
    assert f"{HOUR} reason-dsv3: published with WARN" in lines
    (dropped,) = [line for line in lines if line.startswith("    ERROR sequence: ")]
    assert dropped.startswith("    ERROR sequence: chat-8b-r0: recorder dropped ")
    assert [line for line in lines if line.startswith("    WARN plausibility: ")]
    assert not [line for line in lines if line.lstrip().startswith(("{", "check failed"))]
    assert "…" not in result.stdout
    assert (
        "paged on-call: 1 alert(s) delivered to WebhookSink(slack -> http://127.0.0.1/…)"
        in result.stderr
    )

    status = CliRunner().invoke(main, ["status", "--data", str(out), "--json"])
    assert status.exit_code == 0, status.output
    chat, reason = json.loads(status.stdout)
    assert (chat["hour"], chat["pool"], chat["standing"], chat["reason"]) == (
        HOUR,
        "chat-8b",
        "held back",
        "failed blocking checks: sequence",
    )
    (error,) = [f for f in chat["failed"] if f["severity"] == "ERROR"]
    assert (error["check"], error["finding"], error["scope"]) == (
        "sequence",
        "dropped",
        "chat-8b-r0",
    )
    assert (error["means"], error["todo"], error["releases"]) == (
        DROPPED.description,
        DROPPED.runbook,
        DROPPED.releases,
    )
    assert error["page"].startswith("delivered ")
    assert {(f["severity"], f["finding"], f["page"]) for f in reason["failed"]} == {
        ("WARN", "gpu_busier", "WARN: pages nobody")
    }
    assert reason["standing"] == "published with WARN"
    assert reason["failed"][0]["todo"] == GPU_BUSIER.runbook
    # The text form, for on-call at a terminal; --from/--to select hours.
    text_status = CliRunner().invoke(
        main, ["status", "--data", str(out), "--from", HOUR, "--to", HOUR]
    )
    assert f"{HOUR} chat-8b: held back (failed blocking checks: sequence)" in text_status.stdout
    assert f"        released by: {DROPPED.releases}" in text_status.stdout
    later = CliRunner().invoke(main, ["status", "--data", str(out), "--from", "2026-11-30T01"])
    assert later.stdout == "no invoiced pool-hours in the range\n"
