"""Request ids and tenant names an attacker chooses (quotes, SQL, control characters,
non-ASCII) travel recorder -> decoder -> lake -> warehouse -> finance views verbatim, and
change nothing but themselves."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from pipeline import finance
from tests.helpers.fleets import bill, rerecord, simulate_small, small_pools

pytestmark = pytest.mark.timeout(300)

HOSTILE = [
    "'",
    '"',
    "'); DROP TABLE ledger_lines; --",
    "\n",
    "\r\n",
    "\0",
    "\x1b[2J",
    "\t",
    "\\",
    "%_",
    "日本語",
    "é",
    "🙂",
    "\u2028",
    "\ufeff",
    " ",
]
TENANTS = [
    "acme-'\"",
    "'); DROP TABLE ledger_lines; --",
    "tab\there\nnl\0nul\x1b[31m",
    "日本語-é-🙂 ",
]
FEATURES = ["f'1", "f;2--", "f\r\n3", "ƒ4"]


def hostile_id(request_id: str) -> str:
    number = int(request_id.rsplit("-", 1)[1])
    return f"{HOSTILE[number % len(HOSTILE)]}{request_id}{HOSTILE[(number * 7) % len(HOSTILE)]}"


@pytest.fixture(scope="module")
def billed(tmp_path_factory) -> tuple[Path, Path]:
    """The same simulated traffic billed twice: with plain and with hostile request ids."""
    pools = small_pools(TENANTS, FEATURES)
    root = tmp_path_factory.mktemp("hostile")
    plain = simulate_small(root / "plain", pools)
    hostile = root / "hostile"
    shutil.copytree(plain, hostile)
    rerecord(hostile, hostile_id)
    with dg.DagsterInstance.ephemeral() as instance:
        for data in (plain, hostile):
            assert [r.success for r in bill(data, pools, instance)] == [True]
    return plain, hostile


def rows(data: Path, sql: str) -> list[tuple[Any, ...]]:
    with finance.connect(data) as con:
        return con.execute(sql).fetchall()


def test_hostile_request_ids_are_stored_verbatim_and_cost_the_same(billed):
    plain, hostile = billed
    columns = "request_id, tenant, feature, api_key_id, compute_nano, kv_nano, amount_nano, steps, new_tokens"
    expected = sorted(
        (hostile_id(r[0]), *r[1:]) for r in rows(plain, f"SELECT {columns} FROM request_costs")
    )
    stored = sorted(rows(hostile, f"SELECT {columns} FROM request_costs"))
    assert len(stored) > 100
    assert stored == expected
    in_view = sorted(rows(hostile, f"SELECT {columns} FROM cost_per_request"))
    assert in_view == expected
    lake_ids = rows(
        hostile,
        "SELECT DISTINCT request_id FROM lake('slots')",
    )
    assert {r[0] for r in lake_ids} >= {r[0] for r in expected}


def test_hostile_tenant_names_reach_every_finance_view_verbatim(billed):
    plain, hostile = billed
    ledger = (
        "SELECT tenant, feature, line_kind, amount_nano, requests FROM ledger_lines ORDER BY ALL"
    )
    assert rows(hostile, ledger) == rows(plain, ledger)
    tenants = {
        r[0]
        for r in rows(hostile, "SELECT DISTINCT tenant FROM ledger_lines WHERE line_kind = 'usage'")
    }
    assert tenants == set(TENANTS)
    assert {r[0] for r in rows(hostile, "SELECT DISTINCT tenant FROM tenant_costs_hourly")} >= set(
        TENANTS
    )
    assert {r[0] for r in rows(hostile, "SELECT DISTINCT tenant FROM tenant_costs_daily")} >= set(
        TENANTS
    )
    assert {
        r[0] for r in rows(hostile, "SELECT DISTINCT BillingAccountName FROM focus_costs")
    } >= set(TENANTS)
    features = {
        r[0]
        for r in rows(
            hostile, "SELECT DISTINCT feature FROM ledger_lines WHERE line_kind = 'usage'"
        )
    }
    assert features == set(FEATURES)
    invoice = rows(hostile, "SELECT sum(amount_nano) FROM invoices")[0][0]
    assert rows(hostile, "SELECT sum(amount_nano) FROM ledger_lines")[0][0] == invoice
    checks = "SELECT check_name, replica, passed, detail FROM reconciliation ORDER BY ALL"
    assert rows(hostile, checks) == rows(plain, checks)
    assert rows(hostile, "SELECT count(*) FROM reconciliation WHERE blocking AND NOT passed") == [
        (0,)
    ]


# Names a terminal formatter (rich) would read as markup, or as an emoji code.
MARKUP_TENANTS = ["[bold]acme[/]", "[/]", "[red", ":warning: globex [link=http://x]y[/link]"]
MARKUP_FEATURES = ["[/]f", "[i]", "f:smile:", "\\[x]"]


def test_names_that_look_like_markup_print_as_text(tmp_path_factory):
    from click.testing import CliRunner

    from pipeline.cli import main

    pools = small_pools(MARKUP_TENANTS, MARKUP_FEATURES)
    data = simulate_small(tmp_path_factory.mktemp("markup") / "run", pools)
    with dg.DagsterInstance.ephemeral() as instance:
        assert [r.success for r in bill(data, pools, instance)] == [True]
    runner = CliRunner()
    by_tenant = runner.invoke(main, ["costs", "--data", str(data)], catch_exceptions=False)
    assert by_tenant.exit_code == 0, by_tenant.output
    printed = {line.split("│")[1].strip() for line in by_tenant.output.splitlines() if "│" in line}
    assert printed >= set(MARKUP_TENANTS)
    by_feature = runner.invoke(
        main, ["costs", "--data", str(data), "--by", "feature"], catch_exceptions=False
    )
    assert by_feature.exit_code == 0, by_feature.output
    printed = {line.split("│")[2].strip() for line in by_feature.output.splitlines() if "│" in line}
    assert printed >= set(MARKUP_FEATURES)
