from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.config import DEFAULT_POOLS_PATH, AlphaFromEvidence, Policies, Pool, load_pools
from schemas.errors import ConfigError, StepledgerError


def test_default_pools_file_loads():
    pools = load_pools(DEFAULT_POOLS_PATH)
    assert [p.name for p in pools.pools] == ["chat-8b", "reason-dsv3"]
    chat = pools.pool("chat-8b")
    assert chat.nano_per_gpu_hour == 3_600_000_000
    assert len(chat.replicas) == 4
    workloads = [p.workload for p in pools.pools if p.workload is not None]
    assert len(workloads) == len(pools.pools)
    tenants = {t.name for w in workloads for t in w.tenants}
    assert len(tenants) >= 4


def test_policy_version_is_stable_and_content_addressed():
    assert Policies().version() == Policies().version()
    assert Policies(alpha=0.8).version() != Policies(alpha=0.7).version()


def test_renaming_the_idle_policy_kept_the_policy_version():
    # Published before the rename as the default policies' version (idle `both`).
    assert Policies(idle="spread_then_headroom").version() == "pol-e3c47d9b1d"
    assert Policies(idle="spread").version() == "pol-be7ea0cf01"


def test_alpha_bounds_must_be_ordered():
    with pytest.raises(ValueError, match="min_alpha 0.9 exceeds max_alpha 0.5"):
        AlphaFromEvidence(min_alpha=0.9, max_alpha=0.5)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pools.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("line", "edited", "message"),
    [
        (
            "    usd_per_gpu_hour: 3.60",
            "    usd_per_gpu_hour: -1",
            "field pools.0.usd_per_gpu_hour: Input should be greater than 0",
        ),
        # The former spelling of an idle policy is refused, naming the new one.
        (
            "      idle: spread_then_headroom",
            "      idle: both",
            "field pools.0.policies.idle: Value error, idle policy 'both' is now called "
            "'spread_then_headroom' (same behaviour, see CHANGELOG.md): write that name instead",
        ),
    ],
)
def test_error_names_file_line_and_field(tmp_path, line, edited, message):
    text = DEFAULT_POOLS_PATH.read_text().replace(line.strip(), edited.strip())
    path = _write(tmp_path, text)
    number = 1 + text.splitlines().index(edited)
    with pytest.raises(ConfigError) as err:
        load_pools(path)
    assert str(err.value).startswith(f"{path}:{number}: {message}")


def test_gpu_uuid_count_must_match_replica_width(tmp_path):
    text = DEFAULT_POOLS_PATH.read_text().replace("gpus_per_replica: 1", "gpus_per_replica: 2")
    with pytest.raises(
        ConfigError, match="replica 'chat-8b-r0' lists 1 GPU UUIDs, expected gpus_per_replica=2"
    ):
        load_pools(_write(tmp_path, text))


def test_unknown_field_is_refused(tmp_path):
    text = DEFAULT_POOLS_PATH.read_text().replace(
        "    kv_block_size: 16\n", "    kv_blok_size: 16\n", 1
    )
    with pytest.raises(
        ConfigError, match=r"field pools\.0\.kv_blok_size: Extra inputs are not permitted"
    ):
        load_pools(_write(tmp_path, text))


def test_invalid_yaml_names_line(tmp_path):
    with pytest.raises(ConfigError, match=r"pools\.yaml:3: not valid YAML"):
        load_pools(_write(tmp_path, "pools:\n  - [unclosed\n"))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read pools file: No such file or directory"):
        load_pools(tmp_path / "absent.yaml")


def test_empty_file_says_what_is_missing(tmp_path):
    with pytest.raises(
        ConfigError, match=r"pools\.yaml: field \(top level\): Input should be a valid dictionary"
    ):
        load_pools(_write(tmp_path, "# only a comment\n"))


def test_non_utf8_file_names_the_byte(tmp_path):
    path = tmp_path / "pools.yaml"
    path.write_bytes(b"pools:\n  - name: caf\xe9\n")
    with pytest.raises(
        ConfigError, match=r"pools\.yaml: not UTF-8 text \(byte 20\): invalid continuation byte"
    ):
        load_pools(path)


@given(st.integers(1, 10**11))
def test_a_price_of_whole_nano_dollars_is_billed_exactly(nano):
    chat = load_pools(DEFAULT_POOLS_PATH).pool("chat-8b")
    price = float(f"{nano // 10**9}.{nano % 10**9:09d}")
    pool = Pool.model_validate({**chat.model_dump(), "usd_per_gpu_hour": price})
    assert pool.nano_per_gpu_hour == nano


def test_a_bad_pools_file_is_a_config_error_of_the_hierarchy(tmp_path: Path):
    pools = tmp_path / "pools.yaml"
    pools.write_text(
        DEFAULT_POOLS_PATH.read_text().replace("usd_per_gpu_hour", "usd_per_gpu_hr", 1)
    )
    with pytest.raises(
        StepledgerError, match=r"pools\.yaml:\d+: field pools\.0\.usd_per_gpu_hour: Field required"
    ) as raised:
        load_pools(pools)
    assert isinstance(raised.value, ConfigError)
    assert raised.value.exit_code == 4


def _with_attention_ranks(tmp_path: Path, ranks: int, extra_replica: str = "") -> Path:
    """The default pools file with reason-dsv3's replica split into `ranks` attention ranks."""
    text = DEFAULT_POOLS_PATH.read_text().replace(
        "    gpus_per_replica: 8\n", f"    gpus_per_replica: 8\n    data_parallel: {ranks}\n"
    )
    if extra_replica:
        text = text.replace(
            "      - {id: chat-8b-r0,",
            f"      - {{id: {extra_replica}, hostname: gpu-node-99, gpu_uuids: [GPU-99]}}\n"
            "      - {id: chat-8b-r0,",
        )
    return _write(tmp_path, text)


def test_each_attention_rank_is_a_stream_on_its_share_of_the_replicas_gpus(tmp_path):
    pool = load_pools(_with_attention_ranks(tmp_path, 4)).pool("reason-dsv3")
    (replica,) = pool.replicas
    assert pool.gpus_per_stream == 2
    assert [(s.id, s.hostname, s.gpu_uuids) for s in pool.streams] == [
        (f"reason-dsv3-r0.dp{rank}", "gpu-node-10", replica.gpu_uuids[2 * rank : 2 * rank + 2])
        for rank in range(4)
    ]
    # Priced as one rank of the replica's deployment: TP 2, four ranks feeding one MoE group.
    assert (pool.deployment().tp, pool.deployment().data_parallel) == (2, 4)


def test_a_replica_without_attention_ranks_is_its_own_stream():
    pool = load_pools().pool("chat-8b")
    assert (pool.streams, pool.gpus_per_stream) == (pool.replicas, 1)


def test_a_replica_id_naming_an_attention_ranks_stream_is_refused(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"replica ids \['reason-dsv3-r0\.dp1'\] are also the streams of attention "
        "data-parallel ranks",
    ):
        load_pools(_with_attention_ranks(tmp_path, 2, extra_replica="reason-dsv3-r0.dp1"))
