"""The `stepledger` command line: the commands that need no Dagster. The installed
`stepledger` (`assets.cli.main`) adds those that run the Dagster definitions.

Each command lives in its own module and is imported only when it runs, so `stepledger
--help` stays fast and one command's heavy imports (Dagster, the kernel) do not slow another.

A `schemas.errors.StepledgerError` ends the command with its kind's exit code and its message
in one line on stderr; any other exception is a bug, reported with its traceback and exit code
70 (`EXIT_BUG`). `--debug` shows the traceback of every error. The codes are documented in
docs/getting-started.md ("Exit codes").
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Mapping
from typing import Any

import click

from schemas.errors import StepledgerError

# command name -> "module:attribute" of its click command, in the order --help lists them.
COMMANDS: dict[str, str] = {
    "simulate": "pipeline.cli.simulate:simulate_command",
    "costs": "pipeline.cli.costs:costs_command",
    "sql": "pipeline.cli.sql:sql_command",
    "export": "pipeline.cli.export:export_group",
    "close": "pipeline.cli.close:close_command",
    "migrate": "pipeline.cli.migrate:migrate_command",
    "report": "pipeline.cli.report:report_command",
    "status": "pipeline.cli.status:status_command",
    "inspect": "pipeline.cli.inspect:inspect_command",
    "hook-config": "pipeline.cli.hook_config:hook_config_command",
    "price": "pipeline.cli.price:price_command",
    "calibrate": "pipeline.cli.calibrate:calibrate_command",
    "explain": "pipeline.cli.explain_request:explain_command",
    "whatif": "pipeline.cli.whatif:whatif_command",
    "explain-step": "pipeline.cli.explain_step:explain_step_command",
    "stack": "pipeline.cli.stack:stack_group",
    "live": "pipeline.cli.live:live_command",
    "serve": "pipeline.cli.serve:serve_command",
    "tokens": "pipeline.cli.serve:tokens_group",
    "budgets": "pipeline.cli.budgets:budgets_command",
    "ship": "pipeline.cli.ship:ship_command",
    "verify": "pipeline.cli.verify:verify_command",
}


EPILOG = """\b
Environment:
  STEPLEDGER_DATA                 data directory of the Dagster code location (default demo-run)
  STEPLEDGER_WAREHOUSE            the pipeline's DuckDB state file (default DATA/pipeline.duckdb);
                                  the DuckLake warehouse is the directory warehouse/ next to it
  STEPLEDGER_POSTGRES             PostgreSQL (libpq connection string) holding the pipeline's
                                  state and the warehouse's catalog instead
  STEPLEDGER_STORE                s3://bucket/prefix the engines' segments are shipped to and
                                  ingested from (AWS_* variables: endpoint, region, credentials)
  STEPLEDGER_FIRST_HOUR           first hourly partition, YYYY-MM-DDTHH
  STEPLEDGER_KEY_SALT             key of the HMAC that turns API keys into api_key_id
  STEPLEDGER_ALERT_WEBHOOK_URL    page through a webhook (never logged)
  STEPLEDGER_ALERT_FORMAT         pagerduty or slack
  STEPLEDGER_PAGERDUTY_ROUTING_KEY  PagerDuty Events v2 routing key (never logged)
  STEPLEDGER_ALERT_FILE           JSON-lines file for alerts when no webhook is set (default stdout;
                                  `run` and `demo` print them to stderr)
  STEPLEDGER_ALERT_DEADLINE_S     how long one delivery to the webhook may take in all (default 10)
  STEPLEDGER_DAGSTER_URL          the Dagster UI's base URL: pages link the run and the hour there
  STEPLEDGER_REPORT_URL           where the HTML report is served: pages link it
  STEPLEDGER_OUTBOX, STEPLEDGER_HOOK_CONFIG, STEPLEDGER_DRIVER_VERSION
                                  the vLLM hook's outbox, replica descriptor (written by
                                  `stepledger hook-config`) and driver version

Documentation: docs/README.md. Every command takes --help."""


# BSD sysexits' EX_SOFTWARE: an internal software error.
EXIT_BUG = 70


class _LazyGroup(click.Group):
    def __init__(self, *args: Any, lazy_commands: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(lazy_commands)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.lazy_commands)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = self.lazy_commands.get(name)
        if target is None:
            return None
        module_name, attribute = target.split(":")
        command: click.Command = getattr(importlib.import_module(module_name), attribute)
        return command

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except StepledgerError as err:
            if ctx.params.get("debug"):
                raise
            # As click reports its own errors: "Error: <message>" on stderr.
            click.echo(f"Error: {err}", err=True)
            ctx.exit(err.exit_code)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as err:
            if ctx.params.get("debug"):
                raise
            # Imported here: --help must not pay for the file system's imports.
            from pipeline.storage.read_only_files import refusal_in

            refused = refusal_in(err)
            if refused is not None:
                click.echo(f"Error: {refused}", err=True)
                ctx.exit(refused.exit_code)
            traceback.print_exc()
            click.echo(
                "Error: this is a bug in stepledger (the traceback above); please report it",
                err=True,
            )
            ctx.exit(EXIT_BUG)


def command_line(commands: Mapping[str, str]) -> click.Group:
    """The `stepledger` group over `commands` (name -> "module:attribute" of each command)."""

    @click.group(
        cls=_LazyGroup,
        lazy_commands=commands,
        context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
        epilog=EPILOG,
    )
    @click.version_option(package_name="stepledger")
    @click.option(
        "--debug", is_flag=True, help="show the Python traceback of an error, not just its message"
    )
    def main(debug: bool) -> None:
        """stepledger: what each tenant, feature and request cost on shared inference GPUs.

        An engine hook writes binary step records; stepledger decodes them, prices each slot's
        work with a per-layer GPU kernel model, splits every measured step among its requests in
        integer nano-dollars, labels idle and headroom, and reconciles every hour.

        \b
        Try it:
          stepledger demo                        simulate the default pools and bill one hour
          stepledger costs --by feature          what each tenant and feature cost (published hours)
          stepledger sql                         SQL on the warehouse (read-only, never blocks billing)
          stepledger report                      an HTML report that opens offline
        \b
        On your own data:
          stepledger inspect OUTBOX              what the step segments hold, gaps and damage
          stepledger run --data DIR              ingest, attribute, publish and reconcile every hour
          stepledger calibrate --data DIR        fit the work model for an engine version
          stepledger dev --data DIR              the Dagster UI, schedules and sensors
          stepledger live --data DIR             provisional costs as segments close
          stepledger serve --data DIR            the read API (tokens: stepledger tokens mint)
          stepledger budgets --config FILE       spend against budgets, projected month-end
          stepledger verify --data DIR           published hours against their recorded hashes
        \b
        Understand a number:
          stepledger price --model M --gpu G --tp N --decode B --context L
          stepledger explain REQUEST_ID          why a billed request cost what it cost, step by step
          stepledger whatif --hour H --set idle=capacity_owner   past hours under other policies
          stepledger explain-step STEP.json      how one step was split, and why
        """

    return main


main = command_line(COMMANDS)
