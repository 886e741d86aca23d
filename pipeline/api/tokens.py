"""The read API's bearer tokens: minted once, shown once, stored only as their SHA-256.

Each token is scoped to one tenant (its own requests, spend and budgets) or to finance (all).
The file (`DataDir.api_tokens`) is JSON validated on every load, written atomically and
readable by its owner only; the server reloads it when it changes, so a token minted or
revoked while it runs counts at once.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from schemas.errors import ConfigError, InputError

TOKEN_PREFIX = "slk_"


class TokenEntry(BaseModel):
    """One token: its name, scope and hash (never the token)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    scope: Literal["tenant", "finance"]
    tenant: str | None = None
    sha256: str
    created_at: datetime

    @model_validator(mode="after")
    def _tenant_matches_scope(self) -> TokenEntry:
        if (self.scope == "tenant") != (self.tenant is not None):
            raise ValueError("a tenant token names its tenant; a finance token names none")
        return self


class TokensFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: list[TokenEntry] = []


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def load_tokens(path: Path) -> TokensFile:
    """The tokens file (empty when there is none yet)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return TokensFile()
    try:
        return TokensFile.model_validate_json(text)
    except ValidationError as err:
        raise ConfigError(f"{path}: not a tokens file: {err}") from err


def _save(path: Path, tokens: TokensFile) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as stream:
        stream.write(tokens.model_dump_json(indent=2))
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(partial, path)


def mint(path: Path, name: str, tenant: str | None) -> str:
    """A new token named `name` for `tenant` (None: finance); returns the token, which is not
    stored and cannot be shown again."""
    tokens = load_tokens(path)
    if any(entry.name == name for entry in tokens.tokens):
        raise InputError(f"--name: a token named {name!r} exists already in {path}")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    tokens.tokens.append(
        TokenEntry(
            name=name,
            scope="finance" if tenant is None else "tenant",
            tenant=tenant,
            sha256=token_hash(token),
            created_at=datetime.now(UTC),
        )
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    _save(path, tokens)
    return token


def revoke(path: Path, name: str) -> None:
    """Remove the token named `name`."""
    tokens = load_tokens(path)
    kept = [entry for entry in tokens.tokens if entry.name != name]
    if len(kept) == len(tokens.tokens):
        raise InputError(f"--name: no token named {name!r} in {path}")
    _save(path, TokensFile(tokens=kept))


class TokenStore:
    """Looks bearer tokens up in the tokens file, reloading it when it changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._version: tuple[int, int] | None = None
        self._by_hash: dict[str, TokenEntry] = {}

    def _reload(self) -> None:
        try:
            stat = self.path.stat()
            version: tuple[int, int] | None = (stat.st_mtime_ns, stat.st_size)
        except FileNotFoundError:
            version = None
        if version != self._version:
            self._by_hash = {e.sha256: e for e in load_tokens(self.path).tokens}
            self._version = version

    def lookup(self, token: str) -> TokenEntry | None:
        """The entry of `token`, or None for an unknown one."""
        self._reload()
        digest = token_hash(token)
        entry = self._by_hash.get(digest)
        if entry is None or not hmac.compare_digest(entry.sha256, digest):
            return None
        return entry
