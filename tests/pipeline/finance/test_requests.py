"""cost_per_request's payer, `stepledger explain` and `stepledger whatif` on a small simulated
fleet billed through `stepledger run`; the chat pool charges prefix-cache reads (cache_read),
so its hour has platform retries and a cache credit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from assets.cli import main
from pipeline import finance
from pipeline.finance.explain_request import explain_requests
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
    assert got["payers"] == [("platform", 2, 352_322), ("tenant", 1258, 357_451_327)]
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
    assert (request_id, amount) == ("req-chat-8b-0001097", 3_231_390)
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
        ("platform-inference", "(idle)", 0, 6_843_539_209, 6_843_539_209),
        ("platform-inference", "(prefix-cache)", -1_342_858, -671_320, 671_538),
        ("platform-inference", "(platform-retry)", 352_322, 291_704, -60_618),
        ("acme-support", "ticket-summary", 169_408_260, 26_205_190, -143_203_070),
        ("initech-docs", "long-context-qa", 265_862_417, 56_481_360, -209_381_057),
        ("globex-search", "query-rewrite", 262_050_082, 23_461_661, -238_588_421),
        ("acme-support", "support-bot", 753_735_341, 89_662_447, -664_072_894),
        ("umbrella-labs", "batch-extract", 1_066_395_227, 161_029_749, -905_365_478),
        ("support-bot", "(headroom)", 4_683_539_209, 0, -4_683_539_209),
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
