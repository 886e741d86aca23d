"""Cost while it happens, end to end: a simulated busy pool's segments arrive through its hour,
the live path prices them (in this process, and once as a restarted `stepledger live` process),
a real HTTP server answers a real HTTP client with provisional costs during the hour and final
ones after the hourly ledger; budgets notify each threshold once, across a restart too.

With a fixed alpha every step's split depends on that step alone, so the provisional usage of
each tenant-hour must equal the hourly ledger's to the nano-dollar: the ledger is the oracle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import pipeline.finance
from pipeline.budgets import budget_status, notify
from pipeline.datadir import DataDir
from pipeline.live.price import PROVISIONAL_NOTE
from pipeline.live.replay import OutboxReplay
from pipeline.live.service import LivePricer
from pipeline.reconcile.alerts import JsonLinesSink, deliver_due
from pipeline.simulator import simulate
from pipeline.storage import warehouse
from schemas.budgets import Budget, BudgetsFile, Channel
from schemas.config import PoolsFile, load_pools
from schemas.units import HOUR_NS, NS_PER_SECOND, hour_key, hour_start_ns
from tests.helpers.api_server import Api, serving
from tests.helpers.fleets import SIMULATED_HOURS, small_pools
from tests.helpers.hours import SIMULATED_HOUR

ROOT = Path(__file__).resolve().parents[3]
TENANT, OTHER = "acme-support", "globex-search"
HOUR = hour_key(SIMULATED_HOUR)
# Budgets are seen half-way through the hour.
NOW = SIMULATED_HOUR + timedelta(minutes=30)
ROUND_NS = 30 * NS_PER_SECOND
# The round a separate `stepledger live --once` process prices: a restart of the live path.
RESTART_ROUND = 3


@dataclass
class LiveRun:
    data: Path
    api: Api
    budgets: BudgetsFile
    notices: Path
    # Per round: a request priced in it and the API's answer then.
    answers: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    # Each notice's finding and the round it was delivered in.
    notice_rounds: list[tuple[str, int]] = field(default_factory=list)


def _fixed_alpha_pools() -> PoolsFile:
    pools = small_pools()
    chat = pools.pool("chat-8b")
    chat = chat.model_copy(update={"policies": chat.policies.model_copy(update={"alpha": 0.8})})
    return pools.model_copy(update={"pools": [chat]})


def _tenant_total(data: Path, tenant: str) -> int:
    with pipeline.finance.connect(data) as con:
        return int(
            con.execute(
                "SELECT coalesce(sum(amount_nano), 0) FROM provisional_lines WHERE tenant = ?",
                [tenant],
            ).fetchall()[0][0]
        )


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The simulated pool, a segment per 15 s as the recorder ships them, and what the live
    path prices of TENANT's usage over the whole span in one go."""
    out = tmp_path_factory.mktemp("live") / "simulated"
    simulate(out, _fixed_alpha_pools(), hours=SIMULATED_HOURS, seed=7, rotate_seconds=15)
    one_go = LivePricer(out, load_pools(DataDir(out).own_pools_file))
    con = one_go.open_warehouse()
    try:
        assert one_go.cycle(con) is not None
    finally:
        con.close()
    return out, _tenant_total(out, TENANT)


def _budgets_round(run: LiveRun, round_index: int) -> None:
    """See the budgets as the live service does after a cycle, and deliver what is owed."""
    with pipeline.finance.connect(run.data) as reader:
        statuses = budget_status(reader, run.budgets, NOW)
    with warehouse.connect(DataDir(run.data).state_file) as state:
        notify(state, statuses, run.budgets, NOW)
        delivered = deliver_due(state, JsonLinesSink(run.notices), NOW)
    run.notice_rounds += [(alert.finding, round_index) for alert in delivered]


def _stepledger(*args: str) -> None:
    """Run the installed command line in a process of its own, as an operator would."""
    done = subprocess.run(
        [sys.executable, "-c", "from assets.cli import main; main()", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _price_round(pricer: LivePricer, data: Path, round_index: int) -> None:
    if round_index == RESTART_ROUND:
        _stepledger("live", "--data", str(data), "--once")
        return
    con = pricer.open_warehouse()
    try:
        pricer.cycle(con)
    finally:
        con.close()


def _latest_priced(data: Path) -> str | None:
    with pipeline.finance.connect(data) as con:
        rows = con.execute(
            "SELECT request_id FROM provisional_cost_per_request WHERE tenant = ? "
            "ORDER BY last_step_end_utc_ns DESC, request_id LIMIT 1",
            [TENANT],
        ).fetchall()
    return rows[0][0] if rows else None


@pytest.fixture(scope="module")
def live(source: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    """The hour replayed: segments arrive every ROUND_NS, are priced, read through the API and
    seen by the budgets; then the hourly ledger is billed."""
    simulated, tenant_total = source
    data = tmp_path_factory.mktemp("live") / "data"
    replay = OutboxReplay(simulated, data, 15 * NS_PER_SECOND)
    pools = load_pools(DataDir(data).own_pools_file)
    # The limit is the tenant's whole usage over the span, so 100% is crossed only once its
    # last segments are priced, in the last round, after the span ends, whatever a round's
    # amounts are; 80% is crossed while segments arrive, as only the span's last 15 to 30 s
    # are still to come in the round before.
    limit = Decimal(tenant_total).scaleb(-9)
    # On-call's copy of each notice is what the test follows (the channel's URL is not set here:
    # its copies stay owed, tests/pipeline/budgets delivers them).
    budgets = BudgetsFile(
        channels={"#acme": Channel(webhook_url_env="ACME_SPEND_WEBHOOK_URL")},
        budgets=[Budget(tenant=TENANT, monthly_usd=limit, channel="#acme", page_on_call=True)],
    )
    LivePricer(data, pools).open_warehouse().close()
    with serving(data, TENANT, clock=lambda: NOW) as api:
        run = LiveRun(data, api, budgets, data.parent / "notices.jsonl")
        start = hour_start_ns(SIMULATED_HOUR)
        end = start + round(SIMULATED_HOURS * HOUR_NS) + ROUND_NS
        for round_index, now_ns in enumerate(range(start + ROUND_NS, end + ROUND_NS, ROUND_NS)):
            # Each round a new pricer: the live path keeps nothing in memory it relies on.
            replay.deliver_until(now_ns)
            _price_round(LivePricer(data, pools), data, round_index)
            api.committed()
            request_id = _latest_priced(data)
            if request_id is not None:
                status, body = api.get(f"/v1/requests/{request_id}/cost", api.tenant)
                assert status == 200, body
                run.answers.append((request_id, body))
            _budgets_round(run, round_index)
        assert replay.pending == []
        # Billed by another process, as the Dagster daemon bills beside the API server.
        _stepledger("run", "--data", str(data), "--hour", HOUR)
        api.committed()
        yield run


def test_provisional_costs_are_read_through_the_api_during_the_hour(live: LiveRun):
    assert len(live.answers) >= 5
    for request_id, body in live.answers:
        assert body["request_id"] == request_id
        assert body["basis"] == "provisional"
        assert body["note"] == PROVISIONAL_NOTE
        assert body["tenant"] == TENANT
        assert body["amount_nano"] == body["compute_nano"] + body["kv_nano"] > 0
        for part in ("amount", "compute", "kv"):
            assert body[f"{part}_usd"] == f"{Decimal(body[f'{part}_nano']).scaleb(-9):f}"


def test_the_hourly_ledger_supersedes_provisional_figures_to_the_nano_dollar(live: LiveRun):
    with pipeline.finance.connect(live.data) as con:
        compared = con.execute(
            "SELECT tenant, provisional_nano, final_nano, delta_nano, published "
            "FROM provisional_vs_final ORDER BY tenant"
        ).fetchall()
        provisional_requests = dict(
            con.execute(
                "SELECT request_id, amount_nano FROM provisional_cost_per_request"
            ).fetchall()
        )
        final_requests = dict(
            con.execute("SELECT request_id, amount_nano FROM request_costs").fetchall()
        )
    assert {row[0] for row in compared} >= {TENANT, OTHER}
    for tenant, provisional, final, delta, published in compared:
        assert (provisional, delta, published) == (final, 0, True), tenant
    assert provisional_requests == final_requests
    request_id = live.answers[-1][0]
    status, body = live.api.get(f"/v1/requests/{request_id}/cost", live.api.tenant)
    assert (status, body["basis"], body["note"]) == (200, "final", None)
    assert body["amount_nano"] == final_requests[request_id]


def test_a_tenant_token_reads_its_own_tenant_only(live: LiveRun):
    with pipeline.finance.connect(live.data) as con:
        other_request = con.execute(
            "SELECT min(request_id) FROM request_costs WHERE tenant = ?", [OTHER]
        ).fetchall()[0][0]
    api = live.api
    assert api.get(f"/v1/requests/{other_request}/cost", api.tenant)[0] == 404
    status, body = api.get(f"/v1/requests/{other_request}/cost", api.finance)
    assert (status, body["tenant"]) == (200, OTHER)
    status, body = api.get(f"/v1/spend?from={HOUR}&to={HOUR}&tenant={OTHER}", api.tenant)
    assert (status, body["parameter"] if "parameter" in body else body["detail"][:7]) == (
        403,
        "tenant:",
    )
    status, rows = api.get(f"/v1/spend?from={HOUR}&to={HOUR}&group_by=tenant", api.tenant)
    assert status == 200
    assert [row["tenant"] for row in rows] == [TENANT]
    assert api.get("/v1/spend?from=2026-11&to=2026-11", "slk_not-a-token")[0] == 401


def test_bad_parameters_are_refused_by_name(live: LiveRun):
    api = live.api
    for query, parameter in (
        ("from=yesterday&to=2026-11", "from"),
        ("from=2026-11&to=2026-10", "to"),
        ("from=2026-11&to=2026-11&group_by=tenant,colour", "group_by"),
        ("to=2026-11", "from"),
    ):
        status, body = api.get(f"/v1/spend?{query}", api.finance)
        assert (status, body["parameter"]) == (400, parameter), query


def test_each_budget_threshold_is_notified_once_also_after_a_restart(live: LiveRun):
    rounds = dict(live.notice_rounds)
    assert sorted(rounds) == ["month-100pct", "month-50pct", "month-80pct"]
    assert len(live.notice_rounds) == 3
    # 80% was told while the hour ran, before 100%.
    assert rounds["month-50pct"] <= rounds["month-80pct"] < rounds["month-100pct"]
    _budgets_round(live, 99)  # a restarted service sees the budgets again
    lines = [json.loads(line) for line in live.notices.read_text().splitlines()]
    assert sorted(line["finding"] for line in lines) == sorted(rounds)
    assert {line["pool"] for line in lines} == {TENANT}
