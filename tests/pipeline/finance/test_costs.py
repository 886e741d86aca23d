"""`stepledger costs`: filters, breakdowns and formats on a hand-built warehouse of known lines."""

from __future__ import annotations

import calendar
import csv
import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from pipeline import finance
from pipeline.cli import main
from pipeline.cli.costs import costs_command
from pipeline.cli.options import NOW_VARIABLE, period_bounds
from pipeline.storage.warehouse import connect
from schemas.units import parse_range_bound
from tests.pipeline.storage.test_warehouse import publish

DAY_ONE = datetime(2026, 11, 30, 22, tzinfo=UTC)
DAY_TWO = DAY_ONE + timedelta(hours=3)  # 2026-12-01T01


# (pool, hour, lines (tenant, feature, kind, amount, requests, tokens), invoice, checks passed)
PUBLISHED = [
    (
        "chat",
        DAY_ONE,
        [
            ("acme", "bot", "usage", 600, 3, 30),
            ("acme", "search", "usage", 150, 1, 10),
            ("globex", "qa", "usage", 200, 2, 20),
            ("platform", "(platform-retry)", "platform_retry", 40, 1, 4),
            ("platform", "(prefix-cache)", "cache_credit", -30, 2, 0),
            ("platform", "(idle)", "idle", 40, 0, 0),
        ],
        1000,
        True,
    ),
    (
        "batch",
        DAY_TWO,
        [
            ("globex", "qa", "usage", 300, 5, 50),
            ("(unattributed)", "(unattributed)", "unattributed", 20, 1, 2),
            ("sre", "(headroom)", "headroom", 180, 0, 0),
        ],
        500,
        True,
    ),
    ("chat", DAY_TWO, [("acme", "bot", "usage", 999, 9, 99)], 999, False),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two hours on two days: pool chat with usage, a platform retry, a cache credit that
    counts requests its usage lines count already, and idle; pool batch with headroom and
    unattributed usage. One more hour is held back (a failed blocking check)."""
    directory = tmp_path_factory.mktemp("costs")
    with connect(directory / "pipeline.duckdb") as con:
        for pool, hour, lines, invoice, passed in PUBLISHED:
            publish(con, pool, lines, invoice, hour=hour, passed=passed)
    return directory


def costs(data: Path, *args: str) -> dict[str, Any]:
    result = CliRunner().invoke(costs_command, ["--data", str(data), "--format", "json", *args])
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = json.loads(result.output)
    return report


def rows(report: dict[str, Any], *columns: str) -> list[tuple[Any, ...]]:
    return [tuple(row[c] for c in columns) for row in report["costs"]]


def test_by_tenant_counts_each_request_once(data: Path) -> None:
    report = costs(data)
    # platform: retry 40 + credit -30 + idle 40; its cache-credit requests are not counted.
    assert rows(report, "tenant", "amount_nano", "requests", "tokens") == [
        ("acme", 750, 4, 40),
        ("globex", 500, 7, 70),
        ("sre", 180, 0, 0),
        ("platform", 50, 1, 4),
        ("(unattributed)", 20, 1, 2),
    ]
    assert report["costs"][0]["amount_usd"] == "0.000000750"
    assert report["costs"][0]["usd_per_request"] == 1.875e-07
    assert [(r["hour"], r["pool"]) for r in report["held_back"]] == [
        ("2026-12-01T01:00:00", "chat")
    ]


def test_line_kinds_are_rows_of_their_own(data: Path) -> None:
    report = costs(data, "--by", "line-kind")
    assert rows(report, "line_kind", "amount_nano", "requests") == [
        ("usage", 1250, 11),
        ("headroom", 180, 0),
        ("idle", 40, 0),
        ("platform_retry", 40, 1),
        ("unattributed", 20, 1),
        ("cache_credit", -30, 0),
    ]
    assert sum(r["amount_nano"] for r in report["costs"]) == 1500


def test_range_of_a_day_or_an_hour_and_several_breakdowns(data: Path) -> None:
    day_one = costs(
        data, "--from", "2026-11-30", "--to", "2026-11-30", "--by", "day", "--by", "pool"
    )
    assert rows(day_one, "day", "pool", "amount_nano") == [("2026-11-30", "chat", 1000)]
    # The Dagster partition key names the same hour.
    hour = costs(data, "--from", "2026-12-01-01:00", "--to", "2026-12-01T01", "--by", "hour")
    assert rows(hour, "hour", "amount_nano") == [("2026-12-01T01:00:00", 500)]
    assert [r["pool"] for r in hour["held_back"]] == ["chat"]
    month = costs(
        data, "--from", "2026-12", "--to", "2026-12", "--by", "tenant", "--by", "line-kind"
    )
    assert rows(month, "tenant", "line_kind", "amount_nano") == [
        ("globex", "usage", 300),
        ("sre", "headroom", 180),
        ("(unattributed)", "unattributed", 20),
    ]


def test_tenant_pool_and_feature_filters(data: Path) -> None:
    acme = costs(data, "--tenant", "acme", "--by", "feature")
    assert rows(acme, "tenant", "feature", "amount_nano", "requests") == [
        ("acme", "bot", 600, 3),
        ("acme", "search", 150, 1),
    ]
    qa_batch = costs(data, "--feature", "qa", "--pool", "batch", "--by", "pool")
    assert rows(qa_batch, "pool", "amount_nano") == [("batch", 300)]
    # The held-back hour is of pool chat: filtering on batch leaves it out.
    assert qa_batch["held_back"] == []


def test_csv_and_parquet_files(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "costs.csv"
    runner = CliRunner()
    result = runner.invoke(
        costs_command,
        ["--data", str(data), "--by", "pool", "--format", "csv", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    table = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [(r["pool"], r["amount_nano"], r["amount_usd"]) for r in table] == [
        ("chat", "1000", "0.000001000"),
        ("batch", "500", "0.000000500"),
    ]
    parquet = tmp_path / "costs.parquet"
    result = runner.invoke(
        costs_command,
        ["--data", str(data), "--by", "day", "--format", "parquet", "--out", str(parquet)],
    )
    assert result.exit_code == 0, result.output
    frame = pl.read_parquet(parquet)
    assert frame.select("day", "amount_nano").rows() == [
        (datetime(2026, 11, 30).date(), 1000),
        (datetime(2026, 12, 1).date(), 500),
    ]
    assert frame.schema["amount_nano"] == pl.Int64


def test_bad_options_name_themselves(data: Path) -> None:
    runner = CliRunner()
    bad_day = runner.invoke(costs_command, ["--data", str(data), "--from", "2026-13-01"])
    assert bad_day.exit_code == 2
    assert "--from" in bad_day.output
    assert "no month (YYYY-MM), day (YYYY-MM-DD) or hour" in bad_day.output
    backwards = runner.invoke(
        costs_command, ["--data", str(data), "--from", "2026-12-01", "--to", "2026-11-30"]
    )
    assert backwards.exit_code == 2
    assert "is before --from" in backwards.output
    no_file = runner.invoke(costs_command, ["--data", str(data), "--format", "parquet"])
    assert no_file.exit_code == 2
    assert "give --out FILE" in no_file.output


@given(st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2099, 12, 31, 23)))
def test_a_period_read_as_both_bounds_covers_exactly_its_hours(moment: datetime) -> None:
    hour = moment.replace(minute=0, second=0, microsecond=0, tzinfo=UTC)
    for text, hours in (
        (f"{hour:%Y-%m-%dT%H}", 1),
        (f"{hour:%Y-%m-%d-%H:00}", 1),
        (f"{hour:%Y-%m-%d}", 24),
        (f"{hour:%Y-%m}", calendar.monthrange(hour.year, hour.month)[1] * 24),
    ):
        start, end = parse_range_bound(text, end=False), parse_range_bound(text, end=True)
        assert start <= hour < end
        assert end - start == timedelta(hours=hours)


# Published: chat on day one (4 + 2 usage, 1 platform retry; the 2 cache-credit requests are
# counted on their usage lines) and batch on day two (5 usage, 1 unattributed).
PUBLISHED_REQUESTS = 13
PUBLISHED_NANO = 1500


@pytest.mark.parametrize(
    "view",
    [
        "tenant_costs",
        "feature_costs",
        "tenant_costs_daily",
        "feature_costs_daily",
        "tenant_costs_hourly",
    ],
)
def test_every_view_counts_the_published_requests_and_money_once(data: Path, view: str) -> None:
    with finance.connect(data) as con:
        totals = con.sql(f"SELECT sum(requests), sum(amount_nano) FROM {view}").fetchone()
        assert totals is not None
        requests, amount_nano = totals
    assert requests == PUBLISHED_REQUESTS
    assert amount_nano == PUBLISHED_NANO


@pytest.mark.parametrize("by", ["tenant", "feature", "pool", "line-kind", "day", "hour"])
def test_every_breakdown_of_costs_counts_the_same_requests(data: Path, by: str) -> None:
    report = costs(data, "--by", by)
    assert sum(row["requests"] for row in report["costs"]) == PUBLISHED_REQUESTS
    assert sum(row["amount_nano"] for row in report["costs"]) == PUBLISHED_NANO


# A clock fixed on the morning of the second day: yesterday is day one, today day two.
MORNING_OF_DAY_TWO = {NOW_VARIABLE: "2026-12-01T09:41:00+00:00"}


@pytest.mark.parametrize(
    ("bounds", "amount_nano"),
    [
        # Both bounds name whole periods, inclusive: all of November is its first to last day.
        (("--from", "2026-11-01", "--to", "2026-11-30"), 1000),
        (("--from", "2026-11", "--to", "2026-11"), 1000),
        (("--from", "2026-11-30T22", "--to", "2026-12-01T01"), 1500),
        (("--from", "2026-11-30T23", "--to", "2026-12-01T00"), None),
        (("--to", "2026-11-30"), 1000),
        (("--from", "yesterday", "--to", "yesterday"), 1000),
        (("--from", "today"), 500),
        (("--from", "last-month", "--to", "last-month"), 1000),
        (("--from", "this-month", "--to", "this-month"), 500),
        (("--from", "mtd"), 500),
        (("--from", "last-month", "--to", "mtd"), 1500),
    ],
)
def test_costs_ranges_name_whole_periods(
    data: Path, bounds: tuple[str, ...], amount_nano: int | None
) -> None:
    result = CliRunner(env=MORNING_OF_DAY_TWO).invoke(
        costs_command, ["--data", str(data), "--format", "json", "--by", "pool", *bounds]
    )
    assert result.exit_code == 0, result.output
    total = sum(row["amount_nano"] for row in json.loads(result.output)["costs"])
    assert total == (amount_nano or 0)


def test_focus_export_reads_the_same_range_as_costs(data: Path, tmp_path: Path) -> None:
    runner = CliRunner(env=MORNING_OF_DAY_TWO)
    for bounds, amounts in (
        (("--from", "2026-11-01", "--to", "2026-11-30"), [1000]),
        (("--from", "last-month", "--to", "last-month"), [1000]),
        (("--from", "2026-12-01", "--to", "2026-12-01"), [500]),
        (("--from", "yesterday"), [1000, 500]),
    ):
        out = tmp_path / "focus.parquet"
        result = runner.invoke(
            main, ["export", "focus", "--data", str(data), "--out", str(out), *bounds]
        )
        assert result.exit_code == 0, result.output
        rows = pq.read_table(out).to_pylist()
        by_hour: dict[datetime, int] = {}
        for row in rows:
            start = row["ChargePeriodStart"]
            by_hour[start] = by_hour.get(start, 0) + row["x_AmountNano"]
        assert list(by_hour.values()) == amounts, bounds


def test_an_unknown_name_says_which_names_there_are(data: Path) -> None:
    runner = CliRunner()
    for args, message in (
        (["--tenant", "acm"], "no tenant `acm` (did you mean `acme`?)"),
        (["--tenant", "acme", "--tenant", "globx"], "no tenant `globx` (did you mean `globex`?)"),
        (["--pool", "cha"], "no pool `cha` (did you mean `chat` or `batch`?)"),
        (
            ["--feature", "zzz"],
            "no feature `zzz` (known: `(headroom)`, `(idle)`, `(platform-retry)`, "
            "`(prefix-cache)`, `(unattributed)`, `bot`, `qa`, `search`)",
        ),
    ):
        result = runner.invoke(main, ["costs", "--data", str(data), *args])
        assert result.exit_code == 3, result.output
        assert message in result.output, result.output
    # A held-back hour's tenant is known: its hours match nothing published, and say so.
    held = runner.invoke(
        costs_command, ["--data", str(data), "--pool", "chat", "--from", "2026-12"]
    )
    assert held.exit_code == 0, held.output
    assert "no published hours match" in held.output


@given(
    st.datetimes(
        min_value=datetime(2000, 1, 1), max_value=datetime(2099, 12, 31), timezones=st.just(UTC)
    )
)
def test_relative_periods_tile_the_calendar_around_now(now: datetime) -> None:
    yesterday, today, this_month, last_month, mtd = (
        period_bounds(name, now)
        for name in ("yesterday", "today", "this-month", "last-month", "mtd")
    )
    assert yesterday[1] == today[0] <= now < today[1]
    assert today[1] - today[0] == yesterday[1] - yesterday[0] == timedelta(days=1)
    assert last_month[1] == this_month[0] == mtd[0] <= today[0] < today[1] <= this_month[1]
    assert mtd[1] - timedelta(hours=1) <= now < mtd[1] <= this_month[1]
    assert (this_month[0].day, last_month[0].day, this_month[1].day) == (1, 1, 1)
    assert this_month[0].hour == last_month[0].hour == 0
    assert (this_month[0] - timedelta(days=1)).month == last_month[0].month
