"""The installed `stepledger` command: pipeline/'s commands, plus those that run the Dagster
definitions (`demo`, `run`, `dev`), which pipeline/ cannot name without depending on assets/."""

from __future__ import annotations

from pipeline.cli import COMMANDS, command_line

DAGSTER_COMMANDS = {
    "demo": "assets.cli.demo:demo_command",
    "run": "assets.cli.run:run_command",
    "dev": "assets.cli.dev:dev_command",
}

main = command_line(
    {
        "demo": DAGSTER_COMMANDS["demo"],
        "simulate": COMMANDS["simulate"],
        "run": DAGSTER_COMMANDS["run"],
        **{name: target for name, target in COMMANDS.items() if name != "simulate"},
        "dev": DAGSTER_COMMANDS["dev"],
    }
)
