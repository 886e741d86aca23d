from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from schemas.budgets import load_budgets
from schemas.errors import ConfigError


def test_a_budgets_file_is_read_with_exact_dollars(tmp_path: Path):
    path = tmp_path / "budgets.yaml"
    path.write_text(
        "thresholds_pct: [80, 100]\n"
        "channels:\n"
        "  '#acme': {webhook_url_env: ACME_SPEND_WEBHOOK_URL}\n"
        "budgets:\n"
        "  - {tenant: acme, monthly_usd: 2500.000000001, daily_usd: 120, channel: '#acme'}\n"
        "  - {tenant: acme, feature: bot, monthly_usd: 1500, channel: '#acme', page_on_call: true}\n"
    )
    budgets = load_budgets(path)
    assert budgets.thresholds_pct == [80, 100]
    assert [b.label for b in budgets.budgets] == ["acme", "acme/bot"]
    assert budgets.budgets[0].monthly_nano == 2_500_000_000_001
    assert budgets.budgets[0].daily_nano == 120_000_000_000
    assert budgets.budgets[1].daily_nano is None
    assert budgets.budgets[1].monthly_usd == Decimal(1500)
    assert budgets.channels["#acme"].webhook_url_env == "ACME_SPEND_WEBHOOK_URL"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "budgets:\n  - {tenant: a, monthly_usd: 0.0000000001, channel: c}\n",
            ":2: field budgets.0.monthly_usd",
        ),
        ("thresholds_pct: [80, 50]\n", ":1: field thresholds_pct"),
        (
            "budgets:\n  - {tenant: a, monthly_usd: 1, channel: c}\n"
            "  - {tenant: a, monthly_usd: 2, channel: d}\n",
            "more than one budget for ['a']",
        ),
        ("budgets:\n  - {tenant: a, monthly_usd: 1, channel: c, colour: red}\n", "colour"),
        ("budgets:\n  - {tenant: a, monthly_usd: -1, channel: c}\n", "monthly_usd"),
        (
            "channels: {c: {webhook_url_env: C_URL}}\n"
            "budgets:\n  - {tenant: a, monthly_usd: 1, channel: c}\n"
            "  - {tenant: b, monthly_usd: 1, channel: '#b'}\n",
            "budgets name channels not declared under `channels` (b: #b)",
        ),
        # The file names the variable holding the URL, never the URL (a secret) itself.
        (
            "channels: {c: {webhook_url_env: 'https://hooks.example/T0/B0/secret'}}\n",
            ":1: field channels.c.webhook_url_env",
        ),
    ],
)
def test_a_bad_budgets_file_is_refused_naming_file_and_field(
    tmp_path: Path, text: str, message: str
):
    path = tmp_path / "budgets.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=str(path)) as raised:
        load_budgets(path)
    assert message in str(raised.value)


def test_a_url_in_place_of_its_variable_is_refused_without_repeating_it(tmp_path: Path):
    path = tmp_path / "budgets.yaml"
    path.write_text("channels: {c: {webhook_url_env: 'https://hooks.example/T0/B0/secret'}}\n")
    with pytest.raises(ConfigError) as raised:
        load_budgets(path)
    assert "secret" not in str(raised.value)
