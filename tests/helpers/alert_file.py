"""Alerts paged to a JSON-lines file of the test's, whatever sink the environment named."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.reconcile.alerts import ENV_FILE, ENV_FORMAT, ENV_ROUTING_KEY, ENV_URL


def page_to_file(path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the alert sink at the JSON-lines file `path`, no webhook; returns `path`."""
    monkeypatch.setenv(ENV_FILE, str(path))
    for name in (ENV_URL, ENV_ROUTING_KEY, ENV_FORMAT):
        monkeypatch.delenv(name, raising=False)
    return path
