from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.ingestion.dcgm import DCGM_SCHEMA, DcgmParseError, parse_dcgm, read_dcgm_hour
from schemas.units import hour_bounds_ns
from tests.helpers.hours import HOUR

HOUR_MS = hour_bounds_ns(HOUR)[0] // 1_000_000

NEW_EXPORTER = f"""\
# HELP DCGM_FI_PROF_GR_ENGINE_ACTIVE Ratio of time the graphics engine is active.
# TYPE DCGM_FI_PROF_GR_ENGINE_ACTIVE gauge
DCGM_FI_PROF_GR_ENGINE_ACTIVE{{gpu="0",UUID="GPU-aaa",pci_bus_id="00000000:1B:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",hostname="gpu-node-01"}} 0.734 {HOUR_MS}
DCGM_FI_PROF_GR_ENGINE_ACTIVE{{gpu="1",UUID="GPU-bbb",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",hostname="gpu-node-01"}} 0 {HOUR_MS}
# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{{gpu="0",UUID="GPU-aaa",hostname="gpu-node-01"}} 73 {HOUR_MS}
"""

OLD_EXPORTER = f"""\
DCGM_FI_PROF_GR_ENGINE_ACTIVE{{gpu="0",uuid="GPU-aaa",Hostname="gpu-node-01",modelName="NVIDIA H100 80GB HBM3"}} 0.5 {HOUR_MS + 15000}
DCGM_FI_PROF_GR_ENGINE_ACTIVE{{gpu="0",UUID="GPU-aaa",Hostname="gpu-node-01",modelName="NVIDIA H100 80GB HBM3"}} 0.25 {HOUR_MS + 30000}
"""


def test_new_and_old_label_spellings_parse_to_the_same_columns():
    samples = parse_dcgm(NEW_EXPORTER + OLD_EXPORTER)
    assert samples.schema == DCGM_SCHEMA
    start_ns = hour_bounds_ns(HOUR)[0]
    assert samples.rows() == [
        ("GPU-aaa", "gpu-node-01", 0, "NVIDIA H100 80GB HBM3", start_ns, 0.734),
        ("GPU-aaa", "gpu-node-01", 0, "NVIDIA H100 80GB HBM3", start_ns + 15_000_000_000, 0.5),
        ("GPU-aaa", "gpu-node-01", 0, "NVIDIA H100 80GB HBM3", start_ns + 30_000_000_000, 0.25),
        ("GPU-bbb", "gpu-node-01", 1, "NVIDIA H100 80GB HBM3", start_ns, 0.0),
    ]


def test_a_scrape_appended_twice_counts_once():
    assert parse_dcgm(NEW_EXPORTER + NEW_EXPORTER).height == 2


def test_samples_without_timestamps_take_the_default():
    text = 'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-aaa",hostname="h"} 0.5\n'
    assert parse_dcgm(text, default_timestamp_ns=42)["timestamp_ns"].to_list() == [42]
    with pytest.raises(
        DcgmParseError, match=r"^<text>:1: sample has no timestamp and no default scrape time"
    ):
        parse_dcgm(text)


def test_escaped_label_values_are_unescaped():
    text = (
        r'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-aaa",hostname="h",modelName="A \"big\" GPU\\x} {y}\n"}'
        f" 0.5 {HOUR_MS}\n"
    )
    assert parse_dcgm(text)["model_name"].to_list() == ['A "big" GPU\\x} {y}\n']


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (
            'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-aaa",hostname="h"}',
            "not a Prometheus sample line",
        ),
        (
            'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-aaa",hostname="h"} busy 1',
            "sample value 'busy' is not a number",
        ),
        (
            'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-aaa",hostname="h"} 0.5 12.5',
            "timestamp '12.5' is not integer",
        ),
        (
            'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-aaa",hostname="h"} 1.5 1',
            "value 1.5 is outside the ratio 0..1",
        ),
        (
            'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-aaa",hostname="h"} NaN 1',
            "value NaN is outside the ratio",
        ),
        ('DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",hostname="h"} 0.5 1', "sample has no uuid label"),
        (
            'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-aaa"} 0.5 1',
            "sample has no hostname label",
        ),
        (
            'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="x",UUID="GPU-aaa",hostname="h"} 0.5 1',
            "gpu label 'x' is not a GPU index",
        ),
        (
            'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-aaa",uuid="GPU-bbb",hostname="h"} 0.5 1',
            "uuid labels disagree",
        ),
        (
            'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",gpu="1",UUID="GPU-aaa",hostname="h"} 0.5 1',
            "label 'gpu' appears twice",
        ),
        (
            'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-a\\qa",hostname="h"} 0.5 1',
            "unknown escape",
        ),
        ('DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0" UUID="GPU-aaa"} 0.5 1', "cannot parse labels"),
        ('DCGM_FI_DEV_GPU_UTIL{gpu="0"} lots 1', "sample value 'lots' is not a number"),
        (
            'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-aaa",hostname="h"} 0.5 9223372036855',
            "out of the nanosecond range",
        ),
    ],
)
def test_malformed_lines_name_file_line_and_problem(tmp_path: Path, line: str, problem: str):
    path = tmp_path / "gpu-node-01" / "2026-11-30T05.prom"
    path.parent.mkdir()
    path.write_text(NEW_EXPORTER + line + "\n")
    with pytest.raises(DcgmParseError) as raised:
        parse_dcgm(path)
    assert str(raised.value).startswith(f"{path}:8: ")
    assert problem in str(raised.value)


def test_conflicting_values_for_one_gpu_and_time_are_an_error():
    text = NEW_EXPORTER + NEW_EXPORTER.replace(" 0.734 ", " 0.9 ")
    with pytest.raises(
        DcgmParseError, match="GPU GPU-aaa has 2 conflicting values at the same timestamps"
    ):
        parse_dcgm(text, source_name="scrapes.prom")


def test_read_hour_takes_every_host_file_and_only_samples_of_the_hour(tmp_path: Path):
    for host, uuid in (("gpu-node-01", "GPU-aaa"), ("gpu-node-02", "GPU-ccc")):
        (tmp_path / host).mkdir()
        (tmp_path / host / "2026-11-30T05.prom").write_text(
            f'DCGM_FI_PROF_GR_ENGINE_ACTIVE{{gpu="0",UUID="{uuid}",Hostname="{host}"}} 0.5 {HOUR_MS + 15000}\n'
            f'DCGM_FI_PROF_GR_ENGINE_ACTIVE{{gpu="0",UUID="{uuid}",Hostname="{host}"}} 0.7 {HOUR_MS + 3_600_000}\n'
            f'DCGM_FI_PROF_GR_ENGINE_ACTIVE{{gpu="0",UUID="{uuid}",Hostname="{host}"}} 0.3\n'
        )
    (tmp_path / "gpu-node-01" / "2026-11-30T06.prom").write_text("")
    samples = read_dcgm_hour(tmp_path, HOUR)
    start_ns = hour_bounds_ns(HOUR)[0]
    assert samples.select("uuid", "timestamp_ns", "value").rows() == [
        ("GPU-aaa", start_ns, 0.3),
        ("GPU-aaa", start_ns + 15_000_000_000, 0.5),
        ("GPU-ccc", start_ns, 0.3),
        ("GPU-ccc", start_ns + 15_000_000_000, 0.5),
    ]
    assert read_dcgm_hour(tmp_path / "nothing-here", HOUR).schema == DCGM_SCHEMA


label_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            label_text,
            label_text,
            st.integers(0, 7),
            st.integers(-(10**12), 9 * 10**12),
            st.floats(0.0, 1.0),
        ),
        max_size=8,
        unique_by=lambda sample: (sample[0], sample[3]),
    ),
    st.booleans(),
)
def test_rendered_samples_parse_back_exactly(samples, old_spelling):
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    uuid_label, host_label = ("uuid", "Hostname") if old_spelling else ("UUID", "hostname")
    text = "".join(
        f'DCGM_FI_PROF_GR_ENGINE_ACTIVE{{gpu="{gpu}",{uuid_label}="{escape(uuid)}",{host_label}="{escape(host)}"}} '
        f"{value!r} {ms}\n"
        for uuid, host, gpu, ms, value in samples
    )
    parsed = parse_dcgm(text)
    expected = pl.DataFrame(
        [(uuid, host, gpu, None, ms * 1_000_000, value) for uuid, host, gpu, ms, value in samples],
        schema=DCGM_SCHEMA,
        orient="row",
    ).sort("uuid", "timestamp_ns")
    assert parsed.rows() == expected.rows()


def test_a_path_given_as_text_gets_a_hint(tmp_path: Path):
    path = tmp_path / "2026-11-30T05.prom"
    path.write_text(NEW_EXPORTER)
    with pytest.raises(DcgmParseError, match="to read a file, pass a pathlib.Path"):
        parse_dcgm(str(path))
    assert parse_dcgm(path).height == 2
