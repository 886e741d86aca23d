"""`stepledger serve`: the read API, and `stepledger tokens`: its bearer tokens."""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.api.tokens import load_tokens, mint, revoke
from pipeline.cli.options import data_dir_option, file_option
from pipeline.datadir import DataDir


@click.command("serve")
@data_dir_option(help="data directory whose warehouse and tokens the API serves", existing=True)
@file_option("--budgets", "budgets_file", help="budgets file whose status /v1/budgets shows")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
def serve_command(data_dir: Path, budgets_file: Path | None, host: str, port: int) -> None:
    """Serve request costs (provisional or final, with parts), spend by tenant, feature and
    pool, budgets and the status of hours as JSON, described at /openapi.json. Every request
    needs a bearer token from `stepledger tokens mint`."""
    import uvicorn

    from pipeline.api.app import create_app

    uvicorn.run(create_app(data_dir, budgets_file), host=host, port=port, log_level="warning")


@click.group("tokens")
def tokens_group() -> None:
    """The read API's bearer tokens (stored hashed in DATA/api_tokens.json)."""


@tokens_group.command("mint")
@data_dir_option(help="data directory the token is for", existing=True)
@click.option("--name", required=True, help="a name to list and revoke the token by")
@click.option("--tenant", help="the one tenant the token reads")
@click.option("--finance", is_flag=True, help="the token reads every tenant")
def mint_command(data_dir: Path, name: str, tenant: str | None, finance: bool) -> None:
    """Mint a token and print it: it is stored hashed and cannot be shown again."""
    if finance == (tenant is not None):
        raise click.UsageError("give either --tenant TENANT or --finance")
    click.echo(mint(DataDir(data_dir).api_tokens, name, tenant))


@tokens_group.command("list")
@data_dir_option(help="data directory whose tokens to list", existing=True)
def list_command(data_dir: Path) -> None:
    """The tokens' names, scopes and creation times (never the tokens)."""
    for entry in load_tokens(DataDir(data_dir).api_tokens).tokens:
        scope = "finance" if entry.tenant is None else f"tenant {entry.tenant}"
        click.echo(f"{entry.name}  {scope}  {entry.created_at.isoformat()}")


@tokens_group.command("revoke")
@data_dir_option(help="data directory whose token to revoke", existing=True)
@click.option("--name", required=True, help="the token's name")
def revoke_command(data_dir: Path, name: str) -> None:
    """Revoke a token; a running server refuses it from its next request."""
    revoke(DataDir(data_dir).api_tokens, name)
