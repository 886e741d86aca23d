from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.api.tokens import TokenStore, load_tokens, mint, revoke, token_hash
from schemas.errors import ConfigError, InputError


def test_a_token_is_stored_only_as_its_hash_readable_by_its_owner(tmp_path: Path):
    path = tmp_path / "api_tokens.json"
    token = mint(path, "gateway", "acme")
    text = path.read_text()
    assert token not in text
    assert json.loads(text)["tokens"][0]["sha256"] == token_hash(token)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    store = TokenStore(path)
    entry = store.lookup(token)
    assert entry is not None
    assert (entry.name, entry.scope, entry.tenant) == ("gateway", "tenant", "acme")
    assert store.lookup(token + "x") is None


def test_a_running_store_sees_tokens_minted_and_revoked(tmp_path: Path):
    path = tmp_path / "api_tokens.json"
    store = TokenStore(path)
    finance = mint(path, "finance", None)
    found = store.lookup(finance)
    assert found is not None
    assert (found.scope, found.tenant) == ("finance", None)
    revoke(path, "finance")
    assert store.lookup(finance) is None
    with pytest.raises(InputError, match="no token named 'finance'"):
        revoke(path, "finance")


def test_names_are_unique_and_a_damaged_file_is_named(tmp_path: Path):
    path = tmp_path / "api_tokens.json"
    mint(path, "a", "acme")
    with pytest.raises(InputError, match="--name: a token named 'a' exists"):
        mint(path, "a", None)
    path.write_text('{"tokens": [{"name": "x", "scope": "tenant", "sha256": "00"}]}')
    with pytest.raises(ConfigError, match=str(path)):
        load_tokens(path)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(["acme", "globex", None]), min_size=1, max_size=6))
def test_every_token_finds_its_own_entry_only(scopes: list[str | None]):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "api_tokens.json"
        tokens = [mint(path, f"t{i}", tenant) for i, tenant in enumerate(scopes)]
        store = TokenStore(path)
        for i, (token, tenant) in enumerate(zip(tokens, scopes, strict=True)):
            entry = store.lookup(token)
            assert entry is not None
            assert (entry.name, entry.tenant) == (f"t{i}", tenant)
