"""`stepledger report`: one self-contained HTML page for an hour, a day or everything."""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.cli.options import TimeRange, directory_option, file_option, range_options


@click.command("report")
@directory_option(
    "--data",
    "data_dir",
    help="data directory holding lake/ and pools.yaml [default: the warehouse's directory, else demo-run]",
)
@file_option(
    "--warehouse",
    help="the pipeline's state file; the warehouse beside it is read [default: DATA/pipeline.duckdb]",
)
@click.option("--hour", "hour", metavar="YYYY-MM-DDTHH", default=None, help="report one UTC hour")
@click.option("--day", "day", metavar="YYYY-MM-DD", default=None, help="report one UTC day")
@range_options("reported")
@file_option("--out", help="HTML file to write [default: DATA/report-<period>.html]")
def report_command(
    data_dir: Path | None,
    warehouse: Path | None,
    hour: str | None,
    day: str | None,
    period: TimeRange,
    out: Path | None,
) -> None:
    """Write an HTML report that opens offline, of one hour, one day, a range or every hour: costs per tenant and feature by hour, idle and
    the other ledger lines, cost per request and per thousand tokens, the top requests, each
    tenant's SM/HBM/NVLink/NIC/host usage, reconciliation status, and each pool's bottleneck
    chart. Finance tables show published hours; held-back hours are marked. Prints the path.

    \b
    Examples:
      stepledger report                              # everything billed in demo-run/
      stepledger report --day 2026-11-30 --out nov30.html
      stepledger report --from 2026-11-01 --to 2026-11-30   # all of November
      stepledger report --from last-month --to last-month
      stepledger report --data /srv/ledger --hour 2026-11-30T05
    """
    from pipeline.datadir import DataDir, check_output
    from pipeline.report import Scope, write_report
    from schemas.config import load_pools

    ranged = period.start is not None or period.end is not None
    if sum((hour is not None, day is not None, ranged)) > 1:
        raise click.UsageError("give one of --hour, --day or --from/--to")
    try:
        scope = Scope.hour(hour) if hour else Scope.day(day) if day else None
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--hour" if hour else "--day") from err
    if scope is None:
        scope = Scope(*period.closed(), period.label()) if ranged else Scope.everything()
    if data_dir is None:
        data_dir = warehouse.parent if warehouse else Path("demo-run")
    layout = DataDir(data_dir)
    warehouse = warehouse or layout.state_file
    name = hour or day or (period.slug() if ranged else "all")
    out = out or data_dir / f"report-{name}.html"
    check_output(out, data_dir, [warehouse, layout.pools_file])
    pools = load_pools(layout.pools_file)
    write_report(warehouse, pools, layout.lake, scope, out)
    click.echo(out.resolve())
