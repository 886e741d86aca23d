"""`stepledger stack up` starts PostgreSQL, the Dagster daemon and the webserver on loopback;
`stack down` leaves nothing running."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline import finance, stack
from pipeline.storage.warehouse import POSTGRES_ENV
from schemas.errors import ExternalError
from tests.helpers.dagster_processes import free_port, listening_addresses, wait_for_daemons

pytestmark = pytest.mark.timeout(1800)
# Bounds for a webserver and daemon that hang, not wait: a loaded two-core machine has taken
# minutes to start them.
STARTUP_SECONDS = 600
REPOSITORY = Path(__file__).resolve().parents[2]


def test_the_stack_serves_on_loopback_and_down_stops_all_it_started(tmp_path: Path) -> None:
    try:
        stack.server_binaries()
    except ExternalError as err:
        pytest.skip(f"no PostgreSQL server here: {err}")
    directory, data = tmp_path / "stack", tmp_path / "data"
    data.mkdir()
    port = free_port()
    record = stack.up(directory, data, webserver_port=port)
    processes = dict(record["processes"])  # type: ignore[call-overload]
    try:
        assert set(processes) == {"daemon", "webserver"}
        wait_for_daemons(port, time.monotonic() + STARTUP_SECONDS)
        # Loopback only: 0100007F is 127.0.0.1 as /proc/net/tcp writes it.
        assert listening_addresses(port) == {"0100007F"}
        env = stack.environment_of(directory)
        assert env[POSTGRES_ENV].startswith("host=127.0.0.1 ")
        # Finance reads the stack's store through its read-only role: an empty ledger.
        con = finance.connect(data)
        try:
            assert con.execute("SELECT count(*) FROM invoices").fetchall() == [(0,)]
        finally:
            con.close()
        with pytest.raises(stack.StackError, match="a stack runs there"):
            stack.up(directory, data)
    finally:
        stopped = stack.down(directory)
    assert stopped == ["webserver", "daemon", "postgres"]
    assert [name for name, pgid in processes.items() if stack.group_running(pgid)] == []
    assert not (Path(str(record["cluster"])) / "postmaster.pid").exists()
    assert not (directory / stack.STACK_FILE).exists()
