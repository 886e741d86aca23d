"""Secrets and access: a billed run leaves no raw API key, webhook URL or routing key in any
file it writes (lake, warehouse, logs, alerts, reports, Dagster storage), and finance reads
the warehouse only through read-only connections."""

from __future__ import annotations

import gc
import hashlib
import http.server
import json
import logging
import shutil
import socket
import threading
import traceback
from pathlib import Path
from typing import Any, ClassVar

import dagster as dg
import duckdb
import polars as pl
import pytest
from click.testing import CliRunner

from assets.definitions import build_definitions
from pipeline.cli import main
from pipeline.reconcile.alerts import AlertConfigError
from pipeline.storage.warehouse import STATE_FILE, connect, connect_read_only
from tests.helpers.fleets import bill, page_on_call, simulate_small, small_pools

pytestmark = pytest.mark.timeout(300)

WEBHOOK_PATH = "/v2/enqueue/hook-path-secret-7f3a9c"
ROUTING_KEY = "R0UTING-KEY-secret-5be21d"
# The inputs production delivers with raw keys in them: the gateway log and the pools file.
INPUTS = ("gateway", "pools.yaml")
DEBUG_RUN = {"loggers": {"console": {"config": {"log_level": "DEBUG"}}}}


class _Webhook(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append((self.path, json.loads(body)))
        self.send_response(202)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def billed_run(tmp_path_factory):
    """A run with missing request context (an ERROR check fails and pages go out, yet the hour
    is published), billed with a persistent Dagster instance, a webhook sink and debug logging
    to a file, then reported on with `stepledger costs` and `stepledger report`."""
    pools = small_pools()
    root = tmp_path_factory.mktemp("secrets")
    data = simulate_small(root / "run", pools, faults={"missing-context": 0.2})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Webhook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}{WEBHOOK_PATH}"
    environment = {
        "STEPLEDGER_ALERT_WEBHOOK_URL": url,
        "STEPLEDGER_PAGERDUTY_ROUTING_KEY": ROUTING_KEY,
        "STEPLEDGER_ALERT_FORMAT": "pagerduty",
        "STEPLEDGER_KEY_SALT": "hardening-salt",
    }
    log_file = data / "logs" / "pipeline.log"
    log_file.parent.mkdir()
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root_logger = logging.getLogger()
    previous_level = root_logger.level
    root_logger.addHandler(handler)
    root_logger.setLevel(logging.DEBUG)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment.items():
            patch.setenv(name, value)
        try:
            (root / "dagster_home").mkdir()
            instance = dg.DagsterInstance.local_temp(tempdir=str(root / "dagster_home"))
            with instance:
                (result,) = bill(data, pools, instance, run_config=DEBUG_RUN)
                assert not result.success
                page_on_call(build_definitions(pools, data), instance, result)
            runner = CliRunner()
            costs = runner.invoke(
                main, ["costs", "--data", str(data), "--json"], catch_exceptions=False
            )
            (data / "logs" / "costs.json").write_text(costs.output)
            report = runner.invoke(main, ["report", "--data", str(data)], catch_exceptions=False)
            assert report.exit_code == 0, report.output
        finally:
            root_logger.removeHandler(handler)
            root_logger.setLevel(previous_level)
            handler.close()
            server.shutdown()
    return pools, root, data, url


def every_file(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def secrets_in(path: Path, secrets: list[str]) -> set[str]:
    """The secrets in a file's bytes, and (for Parquet and DuckDB, whose pages may be
    compressed) in every value of every column."""
    raw = path.read_bytes()
    found = {s for s in secrets if s.encode() in raw}
    if path.suffix == ".parquet":
        frame = pl.read_parquet(path)
        text = frame.select(pl.all().cast(pl.String)).write_csv()
        found |= {s for s in secrets if s in text}
    elif path.suffix == ".duckdb":
        with duckdb.connect(str(path), read_only=True) as con:
            tables = [
                r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()
            ]
            for table in tables:
                for row in con.execute(
                    f'SELECT CAST(COLUMNS(*) AS VARCHAR) FROM "{table}"'
                ).fetchall():
                    text = "\x1f".join(str(v) for v in row)
                    found |= {s for s in secrets if s in text}
    return found


def test_no_raw_api_key_or_webhook_secret_in_any_output_file(billed_run):
    pools, root, data, url = billed_run
    api_keys = sorted(
        {key for pool in pools.pools for tenant in pool.workload.tenants for key in tenant.api_keys}
    )
    secrets = [*api_keys, WEBHOOK_PATH, ROUTING_KEY, url]
    outputs = [
        p
        for p in every_file(root)
        if not (p.is_relative_to(data) and p.relative_to(data).parts[0] in INPUTS)
    ]
    suffixes = {p.suffix for p in outputs}
    # The search covered every kind of output, so an empty result means something.
    assert {".seg", ".parquet", ".duckdb", ".log", ".json", ".html", ".db"} <= suffixes, suffixes
    leaks = {
        str(p.relative_to(root)): sorted(found)
        for p in outputs
        if (found := secrets_in(p, secrets))
    }
    assert leaks == {}
    # The same search does find the keys where they belong: the gateway log it was given.
    gateway_hits = set().union(*(secrets_in(p, secrets) for p in every_file(data / "gateway")))
    assert gateway_hits == set(api_keys)


def test_pages_went_out_with_the_secrets_only_in_the_request(billed_run):
    _pools, _root, data, _url = billed_run
    assert _Webhook.received, "no page reached the webhook"
    assert {path for path, _ in _Webhook.received} == {WEBHOOK_PATH}
    assert {body["routing_key"] for _, body in _Webhook.received} == {ROUTING_KEY}
    assert "unattributed" in {body["payload"]["class"] for _, body in _Webhook.received}
    # The hour was published too, so the finance outputs searched above are not empty.
    assert "acme-support" in (data / "logs" / "costs.json").read_text()


def test_the_dagster_event_log_holds_no_secret(billed_run):
    _pools, root, _data, _url = billed_run
    storage = every_file(root / "dagster_home")
    assert any(p.suffix == ".db" for p in storage)
    text = "".join(p.read_bytes().decode("utf-8", "replace") for p in storage)
    assert "pool_hour_job" in text  # the run is in there, so the search looked at the right files
    for secret in (WEBHOOK_PATH, ROUTING_KEY):
        assert secret not in text


def test_a_failed_delivery_names_neither_url_nor_key(billed_run, tmp_path, monkeypatch, caplog):
    pools, _root, data, _url = billed_run
    copy = tmp_path / "run"
    shutil.copytree(data, copy)
    # The copy owes its pages again, as if the first delivery had never happened.
    with connect(copy / STATE_FILE) as con:
        owed = con.execute("UPDATE alert_outbox SET delivered_at = NULL").fetchone()
    assert owed
    assert owed[0] > 0
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        closed_port = unused.getsockname()[1]
    unreachable = f"http://127.0.0.1:{closed_port}{WEBHOOK_PATH}"
    monkeypatch.setenv("STEPLEDGER_ALERT_WEBHOOK_URL", unreachable)
    monkeypatch.setenv("STEPLEDGER_PAGERDUTY_ROUTING_KEY", ROUTING_KEY)
    with dg.DagsterInstance.ephemeral() as instance, caplog.at_level(logging.WARNING):
        (result,) = bill(copy, pools, instance)
        gc.collect()
        page_on_call(build_definitions(pools, copy), instance, result)
    with connect(copy / STATE_FILE) as con:
        errors = [
            error
            for (error,) in con.execute(
                "SELECT last_error FROM alert_outbox WHERE delivered_at IS NULL"
            ).fetchall()
        ]
    # The refused page is owed with its error recorded, and neither it nor the log names a secret.
    assert errors
    assert errors[0].startswith("delivering ")
    told = "\n".join(e for e in errors if e) + caplog.text
    for secret in (WEBHOOK_PATH, ROUTING_KEY, unreachable):
        assert secret not in told


def test_finance_entry_points_open_the_warehouse_read_only(billed_run, monkeypatch, tmp_path):
    _pools, _root, data, _url = billed_run
    state = data / STATE_FILE
    catalog = data / "warehouse" / "catalog.sqlite"
    before = [hashlib.sha256(f.read_bytes()).hexdigest() for f in (state, catalog)]
    opened: list[tuple[str, bool]] = []
    real_connect = duckdb.connect

    def recording_connect(database=":memory:", read_only=False, *args, **kwargs):
        opened.append((str(database), bool(read_only)))
        return real_connect(database, read_only, *args, **kwargs)

    monkeypatch.setattr(duckdb, "connect", recording_connect)
    runner = CliRunner()
    for by in ("tenant", "feature", "day"):
        assert runner.invoke(main, ["costs", "--data", str(data), "--by", by]).exit_code == 0
    report = runner.invoke(main, ["report", "--data", str(data), "--out", str(tmp_path / "r.html")])
    assert report.exit_code == 0, report.output
    # Finance never opens the pipeline's state file, and changes nothing in the warehouse.
    assert opened
    assert str(state) not in {path for path, _ in opened}, opened
    assert [hashlib.sha256(f.read_bytes()).hexdigest() for f in (state, catalog)] == before


@pytest.mark.parametrize(
    "statement",
    [
        "INSERT INTO ledger_lines SELECT * FROM ledger_lines LIMIT 1",
        "UPDATE invoices SET amount_nano = 0",
        "DELETE FROM request_costs",
        "DROP TABLE ledger_lines",
        "CREATE TABLE stolen AS SELECT * FROM request_costs",
        "CREATE VIEW mine AS SELECT 1 AS one",
        "ALTER TABLE invoices ADD COLUMN note VARCHAR",
        "TRUNCATE invoices",
    ],
)
def test_a_write_through_the_finance_connection_fails(billed_run, statement):
    _pools, _root, data, _url = billed_run
    warehouse = data / "warehouse.duckdb"
    with connect_read_only(warehouse) as con:
        before = con.execute("SELECT count(*), sum(amount_nano) FROM ledger_lines").fetchone()
        with pytest.raises(duckdb.Error, match="read-only"):
            con.execute(statement)
    with connect_read_only(warehouse) as con:
        assert (
            con.execute("SELECT count(*), sum(amount_nano) FROM ledger_lines").fetchone() == before
        )


# Webhook URLs that do not parse, each carrying the secret path.
UNPARSABLE_URLS = [
    f"https://hooks.example.com:{WEBHOOK_PATH[1:]}",  # a port that is no number
    f"http://[::1{WEBHOOK_PATH}",  # an IPv6 host never closed
    f"https://hooks.example.com{WEBHOOK_PATH}\n",  # a line end from an env file
    f"https://hooks.example.com{WEBHOOK_PATH} ",
    f"hooks.example.com{WEBHOOK_PATH}",  # no scheme
]


def test_a_webhook_url_that_does_not_parse_appears_in_no_message(billed_run, tmp_path):
    pools, _root, data, _url = billed_run
    copy = tmp_path / "run"
    shutil.copytree(data, copy)
    with connect(copy / STATE_FILE) as con:
        con.execute("UPDATE alert_outbox SET delivered_at = NULL")
    with dg.DagsterInstance.ephemeral() as instance:
        (result,) = bill(copy, pools, instance)
        gc.collect()
        for url in UNPARSABLE_URLS:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("STEPLEDGER_ALERT_WEBHOOK_URL", url)
                patch.setenv("STEPLEDGER_ALERT_FORMAT", "slack")
                with pytest.raises(AlertConfigError, match="^the webhook URL ") as raised:
                    page_on_call(build_definitions(pools, copy), instance, result)
            told = "".join(traceback.format_exception(raised.value))
            assert WEBHOOK_PATH not in told, url
            assert WEBHOOK_PATH[1:] not in told, url


def test_a_gateway_line_that_fails_validation_echoes_no_api_key(billed_run, tmp_path):
    """The error names file, line and field; neither it nor its chained cause quotes the line,
    which holds a raw API key, into Dagster's event log."""
    pools, _root, data, _url = billed_run
    copy = tmp_path / "run"
    shutil.copytree(data, copy)
    gateway = sorted((copy / "gateway").glob("*.jsonl"))[0]
    lines = gateway.read_text().splitlines()
    broken = json.loads(lines[2])
    del broken["tenant"]
    lines[2] = json.dumps(broken)
    gateway.write_text("\n".join(lines) + "\n")
    (tmp_path / "dagster_home").mkdir()
    with dg.DagsterInstance.local_temp(tempdir=str(tmp_path / "dagster_home")) as instance:
        (result,) = bill(copy, pools, instance, run_config=DEBUG_RUN)
        assert not result.success
        (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
        error = failure.step_failure_data.error
        assert error is not None
        told = error.to_string()
        assert f"{gateway}:3: field tenant: Field required" in told
    storage = "".join(
        p.read_bytes().decode("utf-8", "replace") for p in every_file(tmp_path / "dagster_home")
    )
    assert "field tenant: Field required" in storage  # the search looked where the error is
    for text in (told, storage):
        assert broken["api_key"] not in text


def test_a_pools_file_that_fails_validation_echoes_no_api_key(tmp_path):
    from schemas.config import ConfigError, load_pools

    pools = small_pools().model_dump(mode="json")
    tenant = pools["pools"][0]["workload"]["tenants"][0]
    del tenant["features"]
    path = tmp_path / "pools.yaml"
    path.write_text(json.dumps(pools))
    with pytest.raises(ConfigError, match="field pools.0.workload.tenants.0.features") as raised:
        load_pools(path)
    told = "".join(traceback.format_exception(raised.value))
    assert not [key for key in tenant["api_keys"] if key in told]
