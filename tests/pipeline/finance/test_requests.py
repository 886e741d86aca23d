"""cost_per_request's payer, `stepledger explain` and `stepledger whatif` on a small simulated
fleet billed through `stepledger run`; the chat pool charges prefix-cache reads (cache_read),
so its hour has platform retries and a cache credit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from assets.cli import main
from pipeline import finance
from pipeline.datadir import DataDir
from pipeline.finance.explain_request import explain_requests
from pipeline.finance.whatif import with_policies
from schemas.config import load_pools
from tests.helpers.fleets import simulate_small, small_pools

HOUR = "2026-11-30T00"


@pytest.fixture(scope="module")
def billed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pools = small_pools()
    chat = pools.pool("chat-8b")
    chat = chat.model_copy(
        update={"policies": chat.policies.model_copy(update={"prefix_cache": "cache_read"})}
    )
    data = simulate_small(
        tmp_path_factory.mktemp("requests") / "run", pools.model_copy(update={"pools": [chat]})
    )
    ran = CliRunner().invoke(main, ["run", "--data", str(data), "--hour", HOUR])
    assert ran.exit_code == 0, ran.output
    return data


# What the payer test reads from the finance views, by name.
WHO_PAYS = {
    "hours": "SELECT count(*) FROM published_hours",
    "mismatched": """
        WITH per_request AS (
            SELECT hour, pool, billed_tenant AS tenant, billed_feature AS feature, line_kind,
                   sum(amount_nano) AS amount, count(*) AS requests
            FROM cost_per_request GROUP BY ALL),
        per_line AS (
            SELECT hour, pool, tenant, feature, line_kind, sum(amount_nano) AS amount,
                   sum(requests) AS requests
            FROM published_ledger_lines
            WHERE line_kind IN ('usage', 'unattributed', 'platform_retry') GROUP BY ALL)
        SELECT * FROM per_request FULL JOIN per_line USING (hour, pool, tenant, feature, line_kind)
        WHERE per_request.amount IS DISTINCT FROM per_line.amount
           OR per_request.requests IS DISTINCT FROM per_line.requests
        """,
    "payers": "SELECT paid_by, count(*), sum(amount_nano) FROM cost_per_request GROUP BY ALL ORDER BY ALL",
    "platform": "SELECT DISTINCT billed_tenant, billed_feature, tenant IS NOT NULL "
    "FROM cost_per_request WHERE paid_by = 'platform'",
    "credit": "SELECT requests FROM ledger_lines WHERE line_kind = 'cache_credit'",
    "owner": "SELECT requests FROM tenant_costs WHERE tenant = 'platform-inference'",
    "retries": "SELECT sum(requests) FROM ledger_lines WHERE line_kind = 'platform_retry'",
}


def test_requests_sum_to_the_ledger_lines_of_who_pays(billed: Path) -> None:
    with finance.connect(billed) as con:
        got = {name: con.execute(sql).fetchall() for name, sql in WHO_PAYS.items()}
    assert got["hours"] == [(1,)]
    assert got["mismatched"] == []
    assert got["payers"] == [("platform", 2, 305_226), ("tenant", 1258, 354_495_998)]
    # A platform retry keeps the tenant that sent it, and is billed to the capacity owner.
    assert got["platform"] == [("platform-inference", "(platform-retry)", True)]
    assert got["credit"] == [(1111,)]
    # The capacity owner's requests are its retries: the cache credit's readers are not counted.
    assert got["owner"] == got["retries"] == [(2,)]


def test_explain_reproduces_a_request_charge(billed: Path) -> None:
    with finance.connect(billed) as con:
        (request_id, amount), *_ = con.execute(
            "SELECT request_id, amount_nano FROM cost_per_request "
            "WHERE cached_tokens > 0 AND steps > 3 ORDER BY amount_nano DESC, request_id LIMIT 1"
        ).fetchall()
    result = CliRunner().invoke(main, ["explain", request_id, "--data", str(billed), "--json"])
    assert result.exit_code == 0, result.output
    explained = json.loads(result.stdout)
    assert (request_id, amount) == ("req-chat-8b-0000363", 3_345_058)
    assert explained["amount_nano"] == amount
    assert explained["reproduced"] is True
    (hour,) = explained["hours"]
    assert hour["hour"] == HOUR
    assert hour["pool"] == "chat-8b"
    assert hour["paid_by"] == "tenant"
    assert sum(s["share_nano"] for s in hour["steps"]) + hour["cache_read_nano"] == amount
    assert hour["cache_read_nano"] > 0
    assert (
        sum(s["compute_nano"] for s in hour["steps"]) + hour["cache_read_nano"]
        == hour["compute_nano"]
    )
    assert sum(hour["resources"].values()) == hour["compute_nano"]
    assert hour["policies"]["prefix_cache"] == "cache_read"
    table = CliRunner().invoke(main, ["explain", request_id, "--data", str(billed)])
    assert table.exit_code == 0
    assert "reproduced" in table.output
    missing = CliRunner().invoke(main, ["explain", "no-such-request", "--data", str(billed)])
    assert missing.exit_code == 3
    assert "'no-such-request': not charged" in missing.output


def test_explain_reproduces_every_request_of_the_hour(billed: Path) -> None:
    with finance.connect(billed) as con:
        charged = con.execute(
            "SELECT request_id, amount_nano, compute_nano, kv_nano FROM request_costs "
            "ORDER BY request_id"
        ).fetchall()
    explanations = explain_requests(billed, [request_id for request_id, *_ in charged])
    cache_reads = 0
    for (request_id, amount, compute, kv), explanation in zip(charged, explanations, strict=True):
        assert explanation.request_id == request_id
        (hour,) = explanation.hours
        steps = hour.steps
        assert int(steps["share_nano"].sum()) + hour.cache_read_nano == amount, request_id
        assert int(steps["compute_nano"].sum()) + hour.cache_read_nano == compute, request_id
        assert int(steps["kv_nano"].sum()) == kv, request_id
        assert explanation.reproduced, request_id
        cache_reads += hour.cache_read_nano > 0
    # The hour charges prefix-cache reads, so some charges are not only steps' shares.
    assert cache_reads > 0


def test_whatif_changes_costs_without_publishing(billed: Path) -> None:
    with finance.connect(billed) as con:
        before = con.execute("SELECT * FROM ledger_lines ORDER BY ALL").fetchall()
    result = CliRunner().invoke(
        main,
        [
            "whatif",
            "--data",
            str(billed),
            "--hour",
            HOUR,
            "--set",
            "idle=capacity_owner",
            "--set",
            "alpha=0.5",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    scenario = json.loads(result.stdout)
    assert scenario["balanced"] is True
    (hour,) = scenario["hours"]
    assert hour["before_nano"] == hour["after_nano"] == hour["invoice_nano"] == 7_200_000_000
    changes = [
        (r["tenant"], r["feature"], r["before_nano"], r["after_nano"], r["change_nano"])
        for r in scenario["changes"]
    ]
    # All idle goes to the capacity owner instead of being spread and held as headroom; with
    # alpha 0.5 instead of 1 (the hour never waited on KV blocks) KV memory weighs half.
    assert changes == [
        ("platform-inference", "(idle)", 0, 6_846_513_936, 6_846_513_936),
        ("platform-inference", "(prefix-cache)", -1_315_160, -657_689, 657_471),
        ("platform-inference", "(platform-retry)", 305_226, 251_844, -53_382),
        ("acme-support", "ticket-summary", 168_751_916, 25_488_241, -143_263_675),
        ("initech-docs", "long-context-qa", 267_253_951, 52_126_203, -215_127_748),
        ("globex-search", "query-rewrite", 256_836_954, 23_494_637, -233_342_317),
        ("acme-support", "support-bot", 754_203_380, 92_931_374, -661_272_006),
        ("umbrella-labs", "batch-extract", 1_067_449_797, 159_851_454, -907_598_343),
        ("support-bot", "(headroom)", 4_686_513_936, 0, -4_686_513_936),
    ]
    assert scenario["changes"][-1]["change_pct"] == -100.0
    assert scenario["changes"][0]["change_pct"] is None  # nothing before: no percentage
    with finance.connect(billed) as con:
        assert con.execute("SELECT * FROM ledger_lines ORDER BY ALL").fetchall() == before
    bad = CliRunner().invoke(
        main, ["whatif", "--data", str(billed), "--hour", HOUR, "--set", "idle=x"]
    )
    assert bad.exit_code == 3
    assert "--set on pool 'chat-8b': idle" in bad.output
    fitted = CliRunner().invoke(
        main, ["whatif", "--data", str(billed), "--hour", HOUR, "--set", "weights=fitted"]
    )
    assert fitted.exit_code == 3
    assert (
        "2026-11-30T00 chat-8b: no calibration for model 'llama-3.1-8b-instruct'" in fitted.output
    )


# The hour's tenants summed from the per-feature changes above (billed, what-if).
TENANT_TOTALS = {
    "platform-inference": (-1_315_160 + 305_226, 6_846_513_936 - 657_689 + 251_844),
    "acme-support": (168_751_916 + 754_203_380, 25_488_241 + 92_931_374),
    "initech-docs": (267_253_951, 52_126_203),
    "globex-search": (256_836_954, 23_494_637),
    "umbrella-labs": (1_067_449_797, 159_851_454),
    "support-bot": (4_686_513_936, 0),
}


def test_whatif_totals_each_tenant_in_dollars_over_a_named_range(billed: Path) -> None:
    # On 2026-12-01 the billed hour is yesterday's.
    runner = CliRunner(env={"STEPLEDGER_NOW": "2026-12-01T03:00:00Z"})
    scenario = ["--set", "idle=capacity_owner", "--set", "alpha=0.5"]
    ranged = runner.invoke(
        main,
        [
            "whatif",
            "--data",
            str(billed),
            "--from",
            "yesterday",
            "--to",
            "yesterday",
            *scenario,
            "--json",
        ],
    )
    assert ranged.exit_code == 0, ranged.output
    tenants = {
        r["tenant"]: (r["before_nano"], r["after_nano"], r["change_nano"])
        for r in json.loads(ranged.stdout)["tenants"]
    }
    assert tenants == {t: (b, a, a - b) for t, (b, a) in TENANT_TOTALS.items()}
    assert (
        sum(b for b, _, _ in tenants.values())
        == sum(a for _, a, _ in tenants.values())
        == 7_200_000_000
    )
    table = runner.invoke(
        main,
        ["whatif", "--data", str(billed), "--from", "2026-11-30", "--to", "2026-11-30", *scenario],
    )
    assert table.exit_code == 0, table.output
    lines = [" ".join(line.replace("│", " ").split()) for line in table.output.splitlines()]
    assert "support-bot 4.686513936 0.000000000 -4.686513936 -100.00%" in lines
    assert "platform-inference -0.001009934 6.846108091 +6.847118025 +677976.78%" in lines
    assert (
        "1 pool-hour(s), invoices 7.200000000 USD (7,200,000,000 nano-dollars): both ledgers balance"
        in " ".join(lines)
    )
    empty = runner.invoke(main, ["whatif", "--data", str(billed), "--from", "today", *scenario])
    assert empty.exit_code == 3
    assert "no billed hours from 2026-12-01T00" in empty.output


def test_explain_leads_with_parts_that_add_up_to_the_charge(billed: Path) -> None:
    request_id = "req-chat-8b-0001097"
    with finance.connect(billed) as con:
        ((amount, compute, kv),) = con.execute(
            "SELECT amount_nano, compute_nano, kv_nano FROM request_costs WHERE request_id = ?",
            [request_id],
        ).fetchall()
    result = CliRunner().invoke(main, ["explain", request_id, "--data", str(billed), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["summary"]
    parts = summary["parts"]
    # The warehouse's own split of the charge is the oracle: compute (steps and cache read)
    # and KV memory-time (none: the hour never waited on KV blocks, alpha is 1).
    assert parts == {"compute": 3_216_392, "kv_memory_time": 0, "cache_read": 1_110}
    assert parts["compute"] + parts["cache_read"] == compute
    assert parts["kv_memory_time"] == kv
    assert sum(parts.values()) == summary["amount_nano"] == amount == 3_217_502
    assert summary["resources"] == {
        "sm": 28_639,
        "hbm": 2_829_549,
        "nvlink": 0,
        "nic": 0,
        "host": 359_314,
    }
    assert sum(summary["resources"].values()) == compute
    assert summary["steps"] == 1_667
    assert [(s["seq"], s["share_nano"]) for s in summary["largest_steps"]] == [
        (18_387, 12_106),
        (19_558, 7_518),
        (19_563, 7_491),
        (19_561, 7_449),
        (19_559, 7_427),
    ]
    table = CliRunner().invoke(main, ["explain", request_id, "--data", str(billed)])
    assert table.exit_code == 0, table.output
    lines = [" ".join(line.replace("│", " ").split()) for line in table.output.splitlines()]
    assert lines[0].startswith("request req-chat-8b-0001097: 0.003217502 USD (3,217,502")
    for row in (
        "compute on its steps 3,216,392 0.003216392",
        "KV memory-time 0 0.000000000",
        "prefix-cache read 1,110 0.000001110",
        "total 3,217,502 0.003217502",
    ):
        assert row in lines
    assert len(lines) < 60
    every = CliRunner().invoke(main, ["explain", request_id, "--data", str(billed), "--steps"])
    assert every.exit_code == 0, every.output
    step_rows = [line for line in every.output.splitlines() if "│ chat-8b-r" in line]
    assert len(step_rows) == 5 + 1_667


def test_rebilling_a_closed_month_warns_and_adjusts_the_next_invoice(
    billed: Path, tmp_path: Path
) -> None:
    data = tmp_path / "run"
    shutil.copytree(billed, data)
    runner = CliRunner()
    # What the pool's hour costs with idle charged to its capacity owner: the oracle.
    scenario = runner.invoke(
        main,
        ["whatif", "--data", str(data), "--hour", HOUR, "--set", "idle=capacity_owner", "--json"],
    )
    assert scenario.exit_code == 0, scenario.output
    changes = {r["tenant"]: r["change_nano"] for r in json.loads(scenario.stdout)["tenants"]}
    closed = runner.invoke(main, ["close", "--data", str(data), "--month", "2026-11"])
    assert closed.exit_code == 0, closed.output
    with finance.connect(data) as con:
        issued = con.execute(
            "SELECT tenant, amount_nano FROM invoice_numbers ORDER BY 1"
        ).fetchall()
    # The pools file changes the policy, and the hour is billed again.
    layout = DataDir(data)
    pools = load_pools(layout.pools_file)
    chat = with_policies(pools.pools[0], {"idle": "capacity_owner"})
    layout.own_pools_file.write_text(
        yaml.safe_dump(pools.model_copy(update={"pools": [chat]}).model_dump(mode="json"))
    )
    # A process of its own: the warning is what a user's terminal shows.
    rerun = subprocess.run(
        [
            sys.executable,
            "-c",
            "from assets.cli import main; main()",
            "run",
            "--data",
            str(data),
            "--hour",
            HOUR,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stderr
    warning = "2026-11-30T00 chat-8b is in 2026-11, a closed month, and was billed again"
    assert warning in rerun.stderr
    with finance.connect(data) as con:
        adjustments = dict(
            con.execute(
                "SELECT tenant, amount_nano FROM invoice_adjustments "
                "WHERE invoice_month = DATE '2026-12-01' ORDER BY 1"
            ).fetchall()
        )
        assert (
            con.execute("SELECT tenant, amount_nano FROM invoice_numbers ORDER BY 1").fetchall()
            == issued
        )
        owed = con.execute(
            "SELECT tenant, adjustments_nano, amount_nano FROM tenant_invoices "
            "WHERE month = DATE '2026-12-01' ORDER BY 1"
        ).fetchall()
        warned = con.execute(
            "SELECT severity, kind FROM alerts WHERE kind = 'closed_month'"
        ).fetchall()
    assert adjustments == {t: c for t, c in changes.items() if c != 0}
    assert sum(adjustments.values()) == 0
    assert owed == [(t, c, c) for t, c in sorted(adjustments.items())]
    assert warned == [("WARN", "closed_month")]
