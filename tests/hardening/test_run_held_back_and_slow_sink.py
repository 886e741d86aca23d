"""`stepledger run` with an hour held back by a failed blocking check and a webhook that
never finishes answering: every pool-hour is billed, the page stays owed in the outbox with
the reason, and the run exits with status 8 (held back), not 0."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from assets.cli import main
from pipeline.ingestion.ingest import segment_files
from pipeline.storage.warehouse import STATE_FILE, connect
from tests.helpers.webhooks import TricklingSink

DEADLINE_S = 0.5


def test_a_held_back_hour_exits_3_and_a_trickling_sink_delays_nothing(
    simulated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "run"
    shutil.copytree(simulated, data)
    # Frames overwritten a third of the way into a replica's log: the steps in them are lost,
    # and the sequence check holds the hour back.
    (segment, *_) = segment_files(data / "outbox", ["chat-8b-r1"])
    with segment.open("r+b") as log:
        log.seek(segment.stat().st_size // 3)
        log.write(b"\xff" * 32)
    for name in ("STEPLEDGER_PAGERDUTY_ROUTING_KEY", "STEPLEDGER_ALERT_FILE"):
        monkeypatch.delenv(name, raising=False)
    with TricklingSink("/hooks/slow", interval_s=0.01) as trickling:
        monkeypatch.setenv("STEPLEDGER_ALERT_WEBHOOK_URL", trickling.url)
        monkeypatch.setenv("STEPLEDGER_ALERT_FORMAT", "slack")
        monkeypatch.setenv("STEPLEDGER_ALERT_DEADLINE_S", str(DEADLINE_S))
        result = CliRunner().invoke(main, ["run", "--data", str(data), "--json"])
        assert trickling.got_request.is_set()
    assert result.exit_code == 8, result.output
    (run,) = json.loads(result.stdout)
    assert (run["pool"], run["held_back"], run["error"]) == ("chat-8b", True, None)
    assert "1 pool-hour(s) held back from finance by a failed blocking check" in result.stderr
    with connect(data / STATE_FILE) as con:
        owed = con.execute(
            "SELECT json_extract_string(alert, '$.kind'), attempts, last_error FROM alert_outbox "
            "WHERE delivered_at IS NULL"
        ).fetchall()
    assert [(kind, attempts) for kind, attempts, _ in owed] == [("sequence", 1)]
    assert owed[0][2].endswith(f"no answer within {DEADLINE_S:g} s; abandoned")
    # `stepledger status` says why the hour is held and that its page is still owed.
    status = CliRunner().invoke(main, ["status", "--data", str(data), "--json"])
    (hour,) = json.loads(status.stdout)
    assert (hour["standing"], hour["reason"]) == ("held back", "failed blocking checks: sequence")
    (error,) = [f for f in hour["failed"] if f["severity"] == "ERROR"]
    assert error["page"] == f"owed after 1 attempt(s): {owed[0][2]}"
