"""The FOCUS 1.2 export: the `focus_costs` view, `stepledger export focus` and `stepledger
close`, checked against the spec's columns and values, and by the FinOps FOCUS validator."""

from __future__ import annotations

import csv
import subprocess
import xml.etree.ElementTree as ET
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline import finance
from pipeline.cli import main
from pipeline.storage.warehouse import STATE_FILE, connect
from tests.helpers.hours import HOUR
from tests.pipeline.storage.test_warehouse import publish

# FOCUS 1.2 (https://focus.finops.org/focus-specification/v1-2/): the mandatory columns and
# the allowed values of the columns stepledger fills.
FOCUS_MANDATORY = {
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "ContractedCost",
    "EffectiveCost",
    "InvoiceIssuerName",
    "ListCost",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "ServiceCategory",
    "ServiceName",
}
# The columns unit pricing adds: the pool's price per GPU-hour published as a SKU.
FOCUS_UNIT_PRICING = {
    "ContractedUnitPrice",
    "ListUnitPrice",
    "PricingCurrency",
    "PricingCurrencyContractedUnitPrice",
    "PricingCurrencyEffectiveCost",
    "PricingCurrencyListUnitPrice",
    "SkuId",
    "SkuMeter",
    "SkuPriceDetails",
    "SkuPriceId",
}
FOCUS_COSTS = ("BilledCost", "ContractedCost", "EffectiveCost", "ListCost")
FOCUS_TIMES = ("BillingPeriodEnd", "BillingPeriodStart", "ChargePeriodEnd", "ChargePeriodStart")
FOCUS_ALLOWED: dict[str, set[str | None]] = {
    "ChargeCategory": {"Usage", "Purchase", "Tax", "Credit", "Adjustment"},
    "ChargeClass": {None, "Correction"},
    "ChargeFrequency": {"One-Time", "Recurring", "Usage-Based"},
    "PricingCategory": {None, "Standard", "Dynamic", "Committed", "Other"},
    "BillingCurrency": {"USD"},
}
NEXT = datetime(2026, 11, 30, 6, tzinfo=UTC)
DECEMBER = datetime(2026, 12, 1, 5, tzinfo=UTC)
# The price the test ledger's pool is invoiced at (tests.pipeline.storage.test_warehouse).
PRICE = Decimal("3.6")


@pytest.fixture
def focus_data(tmp_path: Path) -> Path:
    """Two hours of pool chat: spread idle on a tenant feature, idle charged to the capacity
    owner, and a cache credit."""
    with connect(tmp_path / STATE_FILE) as con:
        publish(
            con,
            "chat",
            [
                ("acme", "bot", "usage", 700, 3, 30),
                ("acme", "bot", "idle", 300, 0, 0),
                ("platform", "(prefix-cache)", "cache_credit", -5, 0, 0),
                ("globex", "q", "usage", 5, 1, 7),
            ],
            1000,
        )
        publish(
            con,
            "chat",
            [("acme", "bot", "usage", 600, 2, 20), ("platform", "(idle)", "idle", 400, 0, 0)],
            1000,
            hour=NEXT,
        )
    return tmp_path


def export(data: Path, out: Path, *options: str) -> None:
    result = CliRunner().invoke(
        main, ["export", "focus", "--data", str(data), "--out", str(out), *options]
    )
    assert result.exit_code == 0, result.output


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def close_november(data: Path) -> list[str]:
    closed = CliRunner().invoke(main, ["close", "--data", str(data), "--month", "2026-11"])
    assert closed.exit_code == 0, closed.output
    return closed.output.splitlines()


def test_focus_costs_has_the_mandatory_columns(tmp_path: Path) -> None:
    with connect(tmp_path / "w.duckdb") as con:
        publish(
            con,
            "chat",
            [
                ("acme", "bot", "usage", 2_500_000_001, 1, 1),
                ("acme", "bot", "cache_credit", -1, 0, 0),
            ],
            2_500_000_000,
        )
        frame = con.sql("SELECT * FROM focus_costs ORDER BY x_AmountNano").pl()
    assert set(frame.columns) >= FOCUS_MANDATORY | FOCUS_UNIT_PRICING
    assert frame["ChargeCategory"].to_list() == ["Credit", "Usage"]
    assert frame["BilledCost"].to_list() == [Decimal("-0.000000001"), Decimal("2.500000001")]
    assert frame["ChargePeriodStart"].to_list() == [HOUR] * 2
    assert frame["BillingPeriodStart"][0] == datetime(2026, 11, 1, tzinfo=UTC)


def test_focus_export_follows_the_1_2_spec(focus_data: Path, tmp_path: Path) -> None:
    for fmt in ("parquet", "csv"):
        export(focus_data, tmp_path / f"focus.{fmt}", "--format", fmt)
    table = pq.read_table(tmp_path / "focus.parquet")
    assert set(table.column_names) >= FOCUS_MANDATORY | FOCUS_UNIT_PRICING
    decimals = (*FOCUS_COSTS, "ContractedUnitPrice", "ListUnitPrice", "PricingQuantity")
    for column in (*decimals, "ConsumedQuantity"):
        assert pa.types.is_decimal(table.schema.field(column).type), column
    for column in FOCUS_TIMES:
        assert table.schema.field(column).type == pa.timestamp("us", tz="UTC"), column
    rows = table.to_pylist()
    for column, allowed in FOCUS_ALLOWED.items():
        assert {r[column] for r in rows} <= allowed, column
    for r in rows:
        assert r["ChargePeriodEnd"] - r["ChargePeriodStart"] == timedelta(hours=1)
        assert r["BillingPeriodStart"] <= r["ChargePeriodStart"] < r["BillingPeriodEnd"]
        assert all(r[c] == Decimal(r["x_AmountNano"]).scaleb(-9) for c in FOCUS_COSTS)
        # The month is open: every line is on its tenant's provisional invoice.
        assert r["InvoiceId"] == f"SL-202611-provisional-{r['BillingAccountId']}"
    priced = [r for r in rows if r["ChargeCategory"] == "Usage"]
    for r in priced:
        # The list price is the pool's price per GPU-hour; the pricing quantity the GPU-hours
        # the line's cost buys at it, to 18 places.
        assert r["ListUnitPrice"] == r["ContractedUnitPrice"] == PRICE
        assert abs(r["ListUnitPrice"] * r["PricingQuantity"] - r["ListCost"]) < Decimal("1e-17")
        assert (r["PricingUnit"], r["SkuId"], r["SkuMeter"]) == (
            "GPU-Hours",
            "chat/gpu-hour",
            "GPU Hours",
        )
        assert r["SkuPriceId"] == "chat/gpu-hour@3.6"
    assert [(r["x_AmountNano"], r["ChargeCategory"], r["ConsumedQuantity"]) for r in rows] == [
        (300, "Usage", Decimal(0)),
        (700, "Usage", Decimal(30)),
        (5, "Usage", Decimal(7)),
        (-5, "Credit", None),
        (600, "Usage", Decimal(20)),
        (400, "Usage", Decimal(0)),
    ]
    credit = next(r for r in rows if r["ChargeCategory"] == "Credit")
    unpriced = ("ListUnitPrice", "PricingQuantity", "PricingUnit", "SkuId", "SkuPriceId")
    assert [credit[c] for c in unpriced] == [None] * len(unpriced)
    idle = {r["ChargeDescription"] for r in rows if r["x_LineKind"] == "idle"}
    assert idle == {
        "Idle GPU time on pool chat, spread by usage",
        "Idle GPU time on pool chat, charged to its capacity owner",
    }
    csv_rows = read_csv(tmp_path / "focus.csv")
    assert [r["ChargePeriodStart"] for r in csv_rows[:1]] == ["2026-11-30T05:00:00Z"]
    # Decimals as plain numbers: no exponent, no trailing zeros, one decimal place.
    assert [(r["ConsumedQuantity"], r["BilledCost"]) for r in csv_rows] == [
        ("0.0", "0.0000003"),
        ("30.0", "0.0000007"),
        ("7.0", "0.000000005"),
        ("", "-0.000000005"),
        ("20.0", "0.0000006"),
        ("0.0", "0.0000004"),
    ]
    assert csv_rows[0]["PricingQuantity"] == "0.000000083333333333"
    assert [r["ListUnitPrice"] for r in csv_rows] == ["3.6", "3.6", "3.6", "", "3.6", "3.6"]


def test_a_pool_hour_s_lines_buy_its_gpu_hours(tmp_path: Path) -> None:
    # 4 GPUs for an hour at $3.60: $14.40, split into lines that each buy part of the 4
    # GPU-hours; truncating each to 18 places loses less than 1e-18 a line.
    with connect(tmp_path / STATE_FILE) as con:
        publish(
            con,
            "chat",
            [
                ("acme", "bot", "usage", 10_000_000_000, 3, 30),
                ("globex", "q", "usage", 3_333_333_333, 1, 7),
                ("platform", "(idle)", "idle", 1_066_666_667, 0, 0),
            ],
            14_400_000_000,
        )
        quantities = [
            r[0] for r in con.execute("SELECT PricingQuantity FROM focus_costs").fetchall()
        ]
    assert Decimal(4) - sum(quantities) < Decimal("3e-18")


def test_closing_a_month_numbers_invoices_and_freezes_its_export(
    focus_data: Path, tmp_path: Path
) -> None:
    assert close_november(focus_data) == [
        "SL-202611-0001  acme  0.000001600 USD",
        "SL-202611-0002  globex  0.000000005 USD",
        "SL-202611-0003  platform  0.000000395 USD",
    ]
    again = CliRunner().invoke(main, ["close", "--data", str(focus_data), "--month", "2026-11"])
    assert again.exit_code == 6  # StateError: the warehouse refuses to close it twice
    assert "2026-11 is closed already" in again.output
    # An hour of the closed month is re-billed: the invoices stand as issued, and each
    # tenant's change (globex -5, platform +5; acme's 1000 is unchanged) is an adjustment on
    # its December invoice.
    with connect(focus_data / STATE_FILE) as con:
        publish(con, "chat", [("acme", "bot", "usage", 1000, 3, 30)], 1000)
    out = tmp_path / "closed.parquet"
    export(focus_data, out, "--from", "2026-11-30", "--to", "2026-12-01")
    rows = pq.read_table(out).to_pylist()
    assert [(r["InvoiceId"], r["x_AmountNano"]) for r in rows] == [
        ("SL-202611-0001", 300),
        ("SL-202611-0001", 700),
        ("SL-202612-provisional-globex", -5),
        ("SL-202611-0002", 5),
        ("SL-202612-provisional-platform", 5),
        ("SL-202611-0003", -5),
        ("SL-202611-0001", 600),
        ("SL-202611-0003", 400),
    ]
    (credit, debit) = (r for r in rows if r["x_LineKind"] == "adjustment")
    assert (credit["ChargeCategory"], credit["ChargeClass"], credit["BilledCost"]) == (
        "Adjustment",
        "Correction",
        Decimal("-0.000000005"),
    )
    assert credit["ChargePeriodStart"] == datetime(2026, 11, 30, 5, tzinfo=UTC)
    assert credit["BillingPeriodStart"] == datetime(2026, 12, 1, tzinfo=UTC)
    assert credit["ChargeDescription"].startswith("Correction of invoice SL-202611-0002: ")
    assert debit["SkuId"] is None
    assert debit["PricingQuantity"] is None
    # A correction is exported with the month whose invoice carries it, once.
    for bounds, corrections in (
        (("--from", "2026-11", "--to", "2026-11"), []),
        (("--from", "2026-12-01", "--to", "2026-12-01"), [-5, 5]),
        (("--from", "2026-12-02", "--to", "2026-12"), []),
    ):
        export(focus_data, out, *bounds)
        kinds = pq.read_table(out, columns=["x_LineKind", "x_AmountNano"]).to_pylist()
        assert [r["x_AmountNano"] for r in kinds if r["x_LineKind"] == "adjustment"] == corrections
    with finance.connect(focus_data) as now:
        assert now.execute("SELECT sum(x_AmountNano) FROM focus_costs").fetchall() == [(2000,)]
        warned = now.execute("SELECT severity, kind, pool FROM alerts").fetchall()
    assert warned == [("WARN", "closed_month", "chat")]
    # December's invoices carry the adjustments.
    with connect(focus_data / STATE_FILE) as con:
        publish(con, "chat", [("acme", "bot", "usage", 1000, 1, 10)], 1000, hour=DECEMBER)
    closed = CliRunner().invoke(main, ["close", "--data", str(focus_data), "--month", "2026-12"])
    assert closed.exit_code == 0, closed.output
    assert closed.output.splitlines() == [
        "SL-202612-0001  acme  0.000001000 USD",
        "SL-202612-0002  globex  -0.000000005 USD",
        "SL-202612-0003  platform  0.000000005 USD",
    ]
    with finance.connect(focus_data) as now:
        invoices = now.execute(
            "SELECT month, tenant, invoice_id, status, charges_nano, adjustments_nano, "
            "amount_nano FROM tenant_invoices ORDER BY month, tenant"
        ).fetchall()
    nov, dec = date(2026, 11, 1), date(2026, 12, 1)
    assert invoices == [
        (nov, "acme", "SL-202611-0001", "issued", 1600, 0, 1600),
        (nov, "globex", "SL-202611-0002", "issued", 5, 0, 5),
        (nov, "platform", "SL-202611-0003", "issued", 395, 0, 395),
        (dec, "acme", "SL-202612-0001", "issued", 1000, 0, 1000),
        (dec, "globex", "SL-202612-0002", "issued", 0, -5, -5),
        (dec, "platform", "SL-202612-0003", "issued", 0, 5, 5),
    ]


# The FinOps FOCUS validator, installed by `make focus-validator` (Makefile) in a venv of its
# own, and the applicability criteria stepledger claims (docs/warehouse.md says why).
VALIDATOR_VENV = Path(__file__).resolve().parents[3] / ".venv" / "focus-validator"
CLAIMED_CRITERIA = (
    "ACCOUNT_NAMING_SUPPORTED",
    "BILLING_BASED_ON_PROVISIONED_RESOURCES_SUPPORTED",
    "PUBLIC_PRICE_LIST_SUPPORTED",
    "RESOURCE_TYPE_ASSIGNMENT_SUPPORTED",
    "SUB_ACCOUNT_SUPPORTED",
    "TAGGING_SUPPORTED",
    "UNIT_PRICING_SUPPORTED",
    "USAGE_MEASUREMENT_SUPPORTED",
)


def validator_packages() -> Path:
    """The validator's site-packages: it reads its rules and currency codes from paths
    relative to the working directory, so it runs there."""
    found = sorted(VALIDATOR_VENV.glob("lib/python3.*/site-packages/focus_validator"))
    if not found:
        pytest.skip(
            f"the FOCUS validator (focus_validator 2.2.1) is not in {VALIDATOR_VENV}: it needs "
            "Python 3.12; `make focus-validator` installs it where the machine has one"
        )
    return found[-1].parent


def validate(packages: Path, data_file: Path, report: Path) -> dict[str, str]:
    """Run the validator on `data_file` for FOCUS 1.2 with the claimed criteria; the outcome
    of each rule it tested: 'passed', 'failed' or 'skipped'."""
    run = subprocess.run(
        [
            str(VALIDATOR_VENV / "bin" / "focus-validator"),
            "--data-file",
            str(data_file),
            "--validate-version",
            "1.2",
            "--block-download",
            "--applicability-criteria",
            ",".join(CLAIMED_CRITERIA),
            "--output-type",
            "unittest",
            "--output-destination",
            str(report),
        ],
        cwd=packages,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        rule_id = case.attrib["name"].split(" :: ")[0]
        failed = case.find("failure") is not None or case.find("error") is not None
        outcomes[rule_id] = (
            "failed" if failed else "skipped" if case.find("skipped") is not None else "passed"
        )
    return outcomes


@pytest.mark.parametrize(
    ("months", "fmt"),
    [("open", "csv"), ("closed, then open", "parquet"), ("closed, re-billed", "csv")],
)
def test_the_focus_validator_passes_every_rule(
    focus_data: Path, tmp_path: Path, months: str, fmt: str
) -> None:
    packages = validator_packages()
    out = tmp_path / f"focus.{fmt}"
    if months == "open":
        export(focus_data, out, "--format", fmt)
        assert {r["InvoiceId"] for r in read_csv(out)} == {
            "SL-202611-provisional-acme",
            "SL-202611-provisional-globex",
            "SL-202611-provisional-platform",
        }
    else:
        # November closed, December open: issued and provisional invoices in one file.
        close_november(focus_data)
        with connect(focus_data / STATE_FILE) as con:
            publish(con, "chat", [("acme", "bot", "usage", 900, 3, 30)], 900, hour=DECEMBER)
        if months == "closed, re-billed":
            # Its correction (globex -5, platform +5) is on their December invoices.
            with connect(focus_data / STATE_FILE) as con:
                publish(con, "chat", [("acme", "bot", "usage", 1000, 3, 30)], 1000)
        export(focus_data, out, "--format", fmt)
        rows = pq.read_table(out) if fmt == "parquet" else None
        invoices = (
            set(rows.column("InvoiceId").to_pylist())
            if rows is not None
            else {r["InvoiceId"] for r in read_csv(out)}
        )
        corrections = (
            {"SL-202612-provisional-globex", "SL-202612-provisional-platform"}
            if months == "closed, re-billed"
            else set()
        )
        assert invoices == {
            "SL-202611-0001",
            "SL-202611-0002",
            "SL-202611-0003",
            "SL-202612-provisional-acme",
            *corrections,
        }
    outcomes = validate(packages, out, tmp_path / "report.xml")
    failed = {rule for rule, outcome in outcomes.items() if outcome == "failed"}
    # InvoiceId-C-003-C holds when one of its two alternatives does, and the validator reports
    # the other as a failure of its own: every line is on an invoice (issued or provisional),
    # so the alternative for charges on no invoice, InvoiceId-C-004-C, is the one left out.
    assert failed == {"InvoiceId-C-004-C"}
    assert outcomes["InvoiceId-C-003-C"] == outcomes["InvoiceId-C-005-C"] == "passed"
    # Unit pricing is tested, not skipped.
    for rule in (
        "ConsumedQuantity-C-000-C",
        "ListCost-C-009-C",
        "ListUnitPrice-C-000-C",
        "PricingQuantity-C-000-M",
        "SkuId-C-000-C",
        "SkuMeter-C-000-C",
    ):
        assert outcomes[rule] == "passed", rule
