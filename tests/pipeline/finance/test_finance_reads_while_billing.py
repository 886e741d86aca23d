"""Finance keeps a session open while billing re-bills an hour: neither blocks the other.

The reader is this test process, through the documented read path (`pipeline.finance.connect`);
the writer is `stepledger run` in its own process, as the hourly schedule runs it."""

from __future__ import annotations

import json
import subprocess
import time
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from assets.cli import main
from pipeline import finance
from pipeline.simulator import simulate
from schemas.config import PoolsFile, load_pools
from tests.helpers.children import child
from tests.helpers.dagster_processes import STEPLEDGER

TENANT_TOTALS = "SELECT tenant, amount_nano FROM tenant_costs ORDER BY tenant"
PUBLISHED_AND_HELD = (
    "SELECT (SELECT sum(amount_nano) FROM tenant_costs), "
    "(SELECT sum(amount_nano) FROM held_back_hours)"
)


def small_chat_pool() -> PoolsFile:
    pools = load_pools()
    chat = pools.pool("chat-8b")
    return pools.model_copy(
        update={"pools": [chat.model_copy(update={"replicas": chat.replicas[:2]})]}
    )


def run(data: Path) -> AbstractContextManager[subprocess.Popen[str]]:
    return child(
        [STEPLEDGER, "run", "--data", str(data), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def billed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("finance") / "run"
    simulate(data, small_chat_pool(), hours=0.05, seed=7)
    with run(data) as first:
        out, err = first.communicate()
    assert first.returncode == 0, err
    assert all(r["success"] for r in json.loads(out))
    return data


def test_a_finance_session_and_a_rebilling_run_never_block_each_other(billed: Path) -> None:
    with finance.connect(billed) as reader:
        before = reader.execute(TENANT_TOTALS).fetchall()
        assert before
        assert sum(amount for _, amount in before) > 0
        billed_at = datetime.now(UTC)
        # Finance policy changes: idle goes to the capacity owner instead of being spread.
        pools_file = billed / "pools.yaml"
        pools = yaml.safe_load(pools_file.read_text())
        pools["pools"][0]["policies"]["idle"] = "capacity_owner"
        pools_file.write_text(yaml.safe_dump(pools))

        with run(billed) as rebill:
            queries = 0
            invoiced = sum(a for _, a in before)
            while rebill.poll() is None:
                # Any error here fails the test: the reader must never see a lock or a torn hour.
                # Between the re-billing and its reconciliation the hour is held back, whole. One
                # statement reads one snapshot; two could straddle the run's commit.
                ((published, held),) = reader.execute(PUBLISHED_AND_HELD).fetchall()
                assert (published or 0, held or 0) in {(invoiced, 0), (0, invoiced)}
                queries += 1
                time.sleep(1)
            out, err = rebill.communicate()
            assert rebill.returncode == 0, err
            assert all(r["success"] for r in json.loads(out))
        assert queries >= 3, "the run ended before the reader could query during it"

        after = reader.execute(TENANT_TOTALS).fetchall()
    # The same invoice, split differently: the capacity owner now carries the idle time.
    assert after != before
    assert sum(a for _, a in after) == sum(a for _, a in before)
    owner = pools["pools"][0]["capacity_owner"]
    assert dict(after)[owner] > dict(before).get(owner, 0)

    as_of = CliRunner().invoke(
        main, ["costs", "--data", str(billed), "--as-of", billed_at.isoformat(), "--json"]
    )
    assert as_of.exit_code == 0, as_of.output
    assert [(r["tenant"], r["amount_nano"]) for r in json.loads(as_of.output)["costs"]] == sorted(
        before, key=lambda r: (-r[1], r[0])
    )
    with finance.connect(billed, as_of=billed_at) as then:
        assert then.execute(TENANT_TOTALS).fetchall() == before

    with finance.connect(billed) as now:
        reruns = now.execute(
            "SELECT tenant, previous_nano, amount_nano, delta_nano, reason, previous_snapshot "
            "FROM reruns ORDER BY tenant"
        ).fetchall()
        assert {(t, p) for t, p, *_ in reruns} >= {(t, a) for t, a in before if a}
        assert all(new - old == delta for _, old, new, delta, *_ in reruns)
        assert sum(delta for *_, delta, _, _ in reruns) == 0
        assert all(reason.startswith("policy ") for *_, reason, _ in reruns)
        # The snapshot each re-run names still holds the charges it replaced.
        (snapshot,) = {row[-1] for row in reruns}
        replaced = now.execute(
            f"SELECT tenant, sum(amount_nano)::BIGINT FROM ledger_lines AT (VERSION => {snapshot}) "
            "GROUP BY ALL ORDER BY tenant"
        ).fetchall()
        assert replaced == before
