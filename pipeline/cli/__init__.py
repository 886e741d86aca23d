"""The `stepledger` command line.

Each command lives in its own module and is imported only when it runs, so `stepledger
--help` stays fast and one command's heavy imports (Dagster, the kernel) do not slow another.
"""

from __future__ import annotations

import importlib

import click

# command name -> "module:attribute" of its click command, in the order --help lists them.
COMMANDS: dict[str, str] = {
    "demo": "pipeline.cli.demo:demo_command",
    "simulate": "pipeline.cli.simulate:simulate_command",
    "run": "pipeline.cli.run:run_command",
    "costs": "pipeline.cli.costs:costs_command",
    "report": "pipeline.cli.report:report_command",
    "inspect": "pipeline.cli.inspect:inspect_command",
    "price": "pipeline.cli.price:price_command",
    "calibrate": "pipeline.cli.calibrate:calibrate_command",
    "explain-step": "pipeline.cli.explain_step:explain_step_command",
    "dev": "pipeline.cli.dev:dev_command",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attribute = target.split(":")
        return getattr(importlib.import_module(module_name), attribute)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="stepledger")
def main() -> None:
    """stepledger: what each tenant, feature and request cost on shared inference GPUs.

    An engine hook writes binary step records; stepledger decodes them, prices each slot's
    work with a per-layer GPU kernel model, splits every measured step among its requests in
    integer nano-dollars, labels idle and headroom, and reconciles every hour.
    """

