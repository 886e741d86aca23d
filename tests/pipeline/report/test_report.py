from __future__ import annotations

import base64
import re
import subprocess
from datetime import UTC
from decimal import Decimal
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.cli import main
from pipeline.report import Scope, load_report, render_html, usd, usd_per
from schemas.config import load_pools
from tests.helpers.report_fleet import build_fleet

CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fleet(tmp_path_factory.mktemp("fleet"))


@pytest.fixture(scope="module")
def report(fleet: Path) -> tuple[Path, str]:
    out = fleet / "report.html"
    result = CliRunner().invoke(main, ["report", "--data", str(fleet), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(out.resolve())
    return out, out.read_text()


def _row(page: str, first_cell: str) -> str:
    """The first table row whose first cell is `first_cell`, as text."""
    match = re.search(rf"<tr(?: class=\"total\")?><td>{re.escape(first_cell)}</td>(.*?)</tr>", page)
    assert match, f"no row {first_cell!r}"
    return match.group(1)


def test_tenant_costs_are_the_exact_dollars_of_the_published_hour(report: tuple[Path, str]) -> None:
    _, whole = report
    page = whole[whole.index("<h3>By tenant (published hours)</h3>") :]
    # Hour 05 only: each request paid half of 1 800 one-second steps at $0.001 each.
    assert re.findall(r">(\$[\d.,]+)<", _row(page, "acme-support")) == [
        "$0.900000",
        "$0.90000000",
        "$0.50000000",
    ]
    assert re.findall(r">(\$[\d.,]+)<", _row(page, "globex-search")) == [
        "$0.900000",
        "$0.90000000",
        "$0.50000000",
    ]
    assert 'title="900000000 nano-USD">$0.900000<' in _row(page, "acme-support")
    # The idle half of the hour goes to the capacity owner (policy capacity_owner).
    assert "$1.800000" in _row(page, "platform-inference")
    assert re.findall(r">(\$[\d.,]+)<", _row(page, "total"))[0] == "$3.600000"


def test_held_back_hour_is_named_with_its_failed_check(report: tuple[Path, str]) -> None:
    _, page = report
    assert "1 pool-hour(s) held back from finance" in page
    assert "<b>2026-11-30T06 chat-test</b> ($3.600000): failed blocking checks: sequence" in page
    assert "recorder dropped 1 steps (seq 2700)" in page
    assert '<td class="fail">held back</td>' in page
    # Invoiced both hours, published one.
    assert '<div class="value" title="7200000000 nano-USD">$7.200000</div>' in page
    assert '<div class="value" title="3600000000 nano-USD">$3.600000</div>' in page


def test_every_hour_balances_and_shows_its_line_kinds(report: tuple[Path, str]) -> None:
    _, page = report
    for hour in ("2026-11-30T05", "2026-11-30T06"):
        cells = re.findall(r">(\$[\d.,]+|= invoice)<", _row(page, hour))
        assert cells[:4] == ["$3.600000", "$1.800000", "$1.800000", "$0.000000"]
        assert cells[-1] == "= invoice"


def test_resource_breakdown_splits_each_tenants_compute_exactly(fleet: Path) -> None:
    pools = load_pools(fleet / "pools.yaml")
    data = load_report(fleet / "warehouse.duckdb", pools, fleet / "lake", Scope.everything())
    by_tenant = {r["tenant"]: r for r in data.resources.iter_rows(named=True)}
    assert set(by_tenant) == {"acme-support", "globex-search"}
    # Alpha 0.8, equal blocks: 80 % of each request's charge is compute.
    assert by_tenant["globex-search"]["compute_nano"] == 720_000_000
    assert by_tenant["acme-support"]["compute_nano"] == 720_000_000 + 1_440_000_000
    for row in by_tenant.values():
        parts = [row[f"{r}_nano"] for r in ("sm", "hbm", "nvlink", "nic", "host")]
        assert sum(parts) == row["compute_nano"]
        assert parts[2] == parts[3] == 0  # one TP1 replica moves nothing over NVLink or the NIC
        # Every step decodes two tokens: each GEMM costs its weight read, which outweighs its
        # arithmetic (laws revision 9), and attention and the elementwise ops are reads too, so
        # no part of the step binds on the SMs; the launches are the host's.
        assert parts[0] == 0
        assert parts[1] > parts[4] > 0
    assert [s.pool for s in data.sweeps] == ["chat-test"]
    sweep = data.sweeps[0]
    assert sweep.context_tokens == 1399  # the median decode context the fleet logged (500..2299)
    assert sweep.batches[0] == 1
    assert sweep.batches[-1] == 256
    assert sweep.bottleneck_ranges[0][1] == 1
    assert sweep.bottleneck_ranges[-1][2] == 256


def test_hour_scope_reports_one_hour(fleet: Path, tmp_path: Path) -> None:
    out = tmp_path / "h.html"
    result = CliRunner().invoke(
        main,
        [
            "report",
            "--warehouse",
            str(fleet / "warehouse.duckdb"),
            "--hour",
            "2026-11-30T06",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert "stepledger report: hour 2026-11-30T06 UTC" in page
    assert "2026-11-30T05" not in page
    assert "No published request costs in this period." in page


def test_page_is_self_contained(report: tuple[Path, str]) -> None:
    _, page = report
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*https?://""", page, re.I)
    assert "<script" not in page.lower()
    assert "@import" not in page
    assert not re.search(r"url\((?!#)", page)  # only references to the page's own clip paths
    # The tenant trend, two stacked bars, the resource shares, one bottleneck chart.
    assert page.count("<svg") == 5


def _chromium(page: Path, *args: str) -> str:
    """Run headless Chromium on the page with `args`; its standard output."""
    return subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            *args,
            page.resolve().as_uri(),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless Chromium is not installed")
def test_renders_in_headless_chromium(report: tuple[Path, str], tmp_path: Path) -> None:
    out, _ = report
    png = tmp_path / "report.png"
    _chromium(out, f"--screenshot={png}", "--window-size=1400,3000")
    from PIL import Image

    with Image.open(png) as image:
        assert image.size == (1400, 3000)
        # A blank or failed page is one colour; the report has text and charts.
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is not None
        assert len(colors) > 50
    # The page as Chromium built it: the sections in their order, a CSV under every table.
    dom = _chromium(out, "--dump-dom")
    headings = re.findall(r"<h2[^>]*>(.*?)</h2>", dom)
    assert headings == [
        "Trend per tenant",
        "Month to date and projection",
        "Cost per tenant and feature",
        "Where each hour's invoice went",
        "Utilisation and idle per pool",
        "Top 2 requests",
        "Reconciliation",
        "Engineering: the pricing kernel",
    ]
    assert dom.count('download="') == 9  # a CSV download under every table


@pytest.mark.parametrize(
    ("args", "exit_code", "message"),
    [
        (["--hour", "2026-11-30T05", "--day", "2026-11-30"], 2, "give one of --hour, --day or"),
        (["--day", "2026-11-30", "--from", "2026-11"], 2, "give one of --hour, --day or"),
        (["--hour", "yesterday"], 2, "is not of the form YYYY-MM-DDTHH"),
        (["--day", "2026-13-01"], 2, "is not of the form YYYY-MM-DD"),
        (["--hour", "2026-12-01T00"], 6, "no invoiced hours in hour 2026-12-01T00 UTC"),
    ],
)
def test_bad_input_says_what_to_do(
    fleet: Path, args: list[str], exit_code: int, message: str
) -> None:
    result = CliRunner().invoke(main, ["report", "--data", str(fleet), *args])
    assert result.exit_code == exit_code
    assert message in result.output


def test_missing_warehouse_is_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["report", "--data", str(tmp_path)])
    assert result.exit_code == 6
    assert (
        f"{tmp_path / 'warehouse' / 'catalog.sqlite'}: no warehouse (run `stepledger demo` or `stepledger run` first)"
        in result.output
    )


def test_rendering_the_same_data_twice_gives_the_same_page(fleet: Path) -> None:
    from datetime import datetime

    pools = load_pools(fleet / "pools.yaml")
    now = datetime(2026, 12, 1, tzinfo=UTC)
    pages = [
        render_html(
            load_report(
                fleet / "warehouse.duckdb", pools, fleet / "lake", Scope.everything(), now=now
            )
        )
        for _ in range(2)
    ]
    assert pages[0] == pages[1]


def test_dollar_strings() -> None:
    assert usd(1_234_567_890_123) == "$1,234.567890"
    assert usd(-337_116_000) == "-$0.337116"
    assert usd(500) == "$0.000000"
    assert usd(1_500) == "$0.000002"
    assert usd_per(900_000_000, 1) == "$0.90000000"
    assert usd_per(900_000_000_000, 1800) == "$0.50000000"
    assert usd_per(5, 0) == "-"


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_nine_places_give_back_the_exact_nano_dollars(nano: int) -> None:
    text = usd(nano, 9)
    value = Decimal(text.replace("$", "").replace(",", ""))
    assert int(value * 1_000_000_000) == nano


def test_day_report_is_written_next_to_the_data_by_default(fleet: Path) -> None:
    result = CliRunner().invoke(main, ["report", "--data", str(fleet), "--day", "2026-11-30"])
    assert result.exit_code == 0, result.output
    out = fleet / "report-2026-11-30.html"
    assert result.output.strip() == str(out.resolve())
    assert "stepledger report: day 2026-11-30 UTC" in out.read_text()


def test_a_missing_lake_is_named_and_the_rest_still_renders(fleet: Path, tmp_path: Path) -> None:
    pools = load_pools(fleet / "pools.yaml")
    data = load_report(fleet / "warehouse.duckdb", pools, tmp_path / "no-lake", Scope.everything())
    assert data.resources.is_empty()
    assert data.notes == [
        f"2026-11-30T05 chat-test: no ledger in {tmp_path / 'no-lake'}, so its requests are missing from the resource breakdown",
        f"2026-11-30T06 chat-test: no ledger in {tmp_path / 'no-lake'}, so its requests are missing from the resource breakdown",
    ]
    page = render_html(data)
    assert "No slots found in the lake for these hours." in page
    assert "default" in data.sweeps[0].context_source
    assert data.sweeps[0].context_tokens == 2048
    assert re.findall(r">(\$[\d.,]+)<", _row(page, "acme-support"))[0] == "$0.900000"


def test_names_from_the_gateway_are_escaped(fleet: Path) -> None:
    from dataclasses import replace

    import polars as pl

    pools = load_pools(fleet / "pools.yaml")
    data = load_report(fleet / "warehouse.duckdb", pools, fleet / "lake", Scope.everything())
    hostile = replace(
        data,
        lines=data.lines.with_columns(
            pl.when(pl.col("tenant") == "acme-support")
            .then(pl.lit("<script>x</script>"))
            .otherwise(pl.col("tenant"))
            .alias("tenant")
        ),
    )
    page = render_html(hostile)
    assert "<script>" not in page
    assert "<td>&lt;script&gt;x&lt;/script&gt;</td>" in page


def test_the_attribution_examples_in_the_docs_still_hold(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import runpy

    runpy.run_path(
        str(Path(__file__).resolve().parents[3] / "docs" / "examples" / "policies.py"),
        run_name="__main__",
    )
    printed = capsys.readouterr().out
    # Numbers quoted in docs/attribution.md.
    for line in (
        "A        acme            39458        0        39458",  # the seed's step, alpha 1
        "B        acme             2908     7000         9908",  # alpha 0.8
        "H        globex              0     4098         4098",  # alpha from evidence: 0.75
        "A        acme            35928        0        35928",  # kernel weights
        "cache_credit   platform / (prefix-cache)             -7476",
        "headroom       support / (headroom)             2519910000",
    ):
        assert line in printed
    assert printed.count("invoice                                         3600000000") == 11


def test_trend_month_to_date_and_utilisation(report: tuple[Path, str]) -> None:
    _, page = report
    # One published hour (05): the trend is per hour, each tenant its exact dollars.
    assert (
        "<tr><td>11-30 05h</td><td>platform-inference</td>"
        '<td class="num" title="1800000000 nano-USD">$1.800000</td></tr>'
    ) in page
    # November 2026 to the end of hour 05 of the 30th: one published hour, 18 left, so each
    # tenant's hour is projected 19 times.
    assert "1 published hour(s) so far, 18 hour(s) left" in page
    page = page[page.index("<h2>Month to date and projection</h2>") :]
    assert re.findall(r">(\$[\d.,]+)<", _row(page, "platform-inference")) == [
        "$1.800000",
        "$34.200000",
    ]
    month = re.search(
        r'download="month_to_date_2026-11.csv" href="data:text/csv;base64,([^"]+)"', page
    )
    assert month
    assert base64.b64decode(month.group(1)).decode().splitlines() == [
        "tenant,amount_nano,amount_usd,projected_nano,projected_usd",
        "platform-inference,1800000000,1.800000000,34200000000,34.200000000",
        "acme-support,900000000,0.900000000,17100000000,17.100000000",
        "globex-search,900000000,0.900000000,17100000000,17.100000000",
    ]
    # Half of the published GPU-hour was idle against a 70 % target: 0.5 busy GPU-hours need
    # 0.5 / 0.7 GPU-hours at the target.
    assert (
        '<td class="num warn">50.0%</td><td class="num">70%</td><td class="num">0.50</td>'
        '<td class="num">0.71</td>'
    ) in _row(page, "chat-test")


def test_a_range_report_reads_from_to_as_costs_does(fleet: Path, tmp_path: Path) -> None:
    # The fleet's published hour is 2026-11-30T05; on 2026-12-01, that is yesterday.
    runner = CliRunner(env={"STEPLEDGER_NOW": "2026-12-01T08:00:00Z"})
    for bounds, title in (
        (["--from", "2026-11-01", "--to", "2026-11-30"], "2026-11-01 to 2026-11-30 UTC"),
        (["--from", "yesterday", "--to", "yesterday"], "2026-11-30 UTC"),
        (["--from", "2026-11-30T05", "--to", "2026-11-30T05"], "2026-11-30T05 UTC"),
    ):
        out = tmp_path / "range.html"
        result = runner.invoke(main, ["report", "--data", str(fleet), "--out", str(out), *bounds])
        assert result.exit_code == 0, result.output
        page = out.read_text()
        assert f"stepledger report: {title}" in page
        assert "$0.900000" in _row(page[page.index("By tenant") :], "acme-support")
    later = runner.invoke(main, ["report", "--data", str(fleet), "--from", "today"])
    assert later.exit_code == 6
    assert "no invoiced hours in 2026-12-01 to the last hour UTC" in later.output
    named = runner.invoke(
        main, ["report", "--data", str(fleet), "--from", "last-month", "--to", "last-month"]
    )
    assert named.exit_code == 0, named.output
    assert (fleet / "report-2026-11-01T00_2026-11-30T23.html").is_file()
