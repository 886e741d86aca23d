"""The budgets file: monthly (and optional daily) budgets per tenant and per tenant+feature, the
thresholds that notify, and where each tenant is told.

    thresholds_pct: [50, 80, 100]
    channels:
      "#acme-gpu-spend": {webhook_url_env: ACME_SPEND_WEBHOOK_URL}
    budgets:
      - tenant: acme-support
        monthly_usd: 2500
        daily_usd: 120
        channel: "#acme-gpu-spend"
        page_on_call: true
      - {tenant: acme-support, feature: support-bot, monthly_usd: 1500, channel: "#acme-gpu-spend"}

Dollars are exact decimals with at most 9 places (whole nano-dollars). Each channel a budget
names is declared under `channels`: a webhook taking Slack-compatible JSON (`{"text": ...}`:
Slack, Mattermost, Rocket.Chat, ...) whose URL, a secret, is read from the environment variable
`webhook_url_env` names when a notice is delivered; the file holds only the variable's name.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.config import load_yaml_model
from schemas.units import NanoUSD, usd_to_nano

DEFAULT_THRESHOLDS_PCT = [50, 80, 100]


class Channel(BaseModel):
    """Where a tenant hears of its budgets: a Slack-compatible webhook."""

    model_config = ConfigDict(extra="forbid")

    # The name of the environment variable holding the webhook's URL, never the URL itself.
    webhook_url_env: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=128)


class Budget(BaseModel):
    """One budget: of a tenant, or of one of its features when `feature` is set."""

    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(min_length=1)
    feature: str | None = None
    monthly_usd: Decimal = Field(gt=0)
    daily_usd: Decimal | None = Field(default=None, gt=0)
    # Where the tenant hears of its budget: a channel of the file's `channels`.
    channel: str = Field(min_length=1)
    page_on_call: bool = False

    @field_validator("monthly_usd", "daily_usd")
    @classmethod
    def _whole_nano(cls, usd: Decimal | None) -> Decimal | None:
        if usd is not None:
            usd_to_nano(usd)
        return usd

    @property
    def monthly_nano(self) -> NanoUSD:
        return usd_to_nano(self.monthly_usd)

    @property
    def daily_nano(self) -> NanoUSD | None:
        return None if self.daily_usd is None else usd_to_nano(self.daily_usd)

    @property
    def label(self) -> str:
        return self.tenant if self.feature is None else f"{self.tenant}/{self.feature}"


class BudgetsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    thresholds_pct: list[int] = Field(default=DEFAULT_THRESHOLDS_PCT, min_length=1)
    channels: dict[str, Channel] = {}
    budgets: list[Budget] = []

    @field_validator("thresholds_pct")
    @classmethod
    def _rising(cls, thresholds: list[int]) -> list[int]:
        if thresholds != sorted(set(thresholds)) or thresholds[0] <= 0:
            raise ValueError(f"thresholds must be positive and rising, got {thresholds}")
        return thresholds

    @field_validator("budgets")
    @classmethod
    def _one_per_scope(cls, budgets: list[Budget]) -> list[Budget]:
        labels = [b.label for b in budgets]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ValueError(f"more than one budget for {repeated}")
        return budgets

    @model_validator(mode="after")
    def _channels_declared(self) -> BudgetsFile:
        undeclared = sorted(
            {f"{b.label}: {b.channel}" for b in self.budgets if b.channel not in self.channels}
        )
        if undeclared:
            raise ValueError(
                f"budgets name channels not declared under `channels` ({', '.join(undeclared)}); "
                "declare each with the environment variable holding its webhook URL "
                "(webhook_url_env)"
            )
        return self


def load_budgets(path: str | Path) -> BudgetsFile:
    """Read and validate a budgets file; errors name the file, line and field."""
    return load_yaml_model(path, BudgetsFile, "budgets file")
