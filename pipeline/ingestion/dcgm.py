"""DCGM exporter samples: GPU engine activity read from Prometheus text exposition.

The reconciliation's plausibility check compares the engine's busy fraction with the GPU's own
`DCGM_FI_PROF_GR_ENGINE_ACTIVE` counter. dcgm-exporter serves Prometheus text; collectors
append successive scrapes to one file per host and hour (`<dir>/<hostname>/<YYYY-MM-DDTHH>.prom`).
Exporters before mid-2026 spell the host label `Hostname` and, in compat mode, the UUID label
`uuid`; both spellings are accepted. Samples are matched to replicas by GPU UUID, never by the
`gpu` index, which restarts at 0 on every host.
"""

from __future__ import annotations

import math
import os
import re
from datetime import datetime
from os import PathLike
from pathlib import Path
from typing import Any, NamedTuple

import polars as pl

from schemas.errors import DataError
from schemas.units import NS_PER_MS, hour_bounds_ns, hour_key

GR_ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"

DCGM_SCHEMA = pl.Schema(
    {
        "uuid": pl.String,
        "hostname": pl.String,
        "gpu": pl.Int32,
        "model_name": pl.String,
        "timestamp_ns": pl.Int64,
        "value": pl.Float64,
    }
)

# label name -> column, for every spelling an exporter version has used.
_LABEL_SPELLINGS = {"UUID": "uuid", "uuid": "uuid", "Hostname": "hostname", "hostname": "hostname"}

_METRIC_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(
    rf"(?P<name>{_METRIC_NAME})"
    r"(?:\{(?P<labels>.*)\})?"  # greedy: a quoted label value may itself contain "}"
    r"[ \t]+(?P<value>\S+)"
    r"(?:[ \t]+(?P<timestamp>\S+))?[ \t]*"
)
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|$)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_ESCAPE = re.compile(r"\\.")

_INT64_LIMIT = 1 << 63


class DcgmParseError(DataError):
    """A DCGM exposition file is malformed; the message names the file, line and problem."""


def _unescape(raw: str, where: str) -> str:
    def replace(match: re.Match[str]) -> str:
        escape = match.group(0)
        if escape not in _ESCAPES:
            raise DcgmParseError(f"{where}: unknown escape {escape!r} in a label value")
        return _ESCAPES[escape]

    return _ESCAPE.sub(replace, raw)


def _parse_labels(text: str, where: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    position = 0
    text = text.rstrip(" \t,")
    while position < len(text):
        match = _LABEL.match(text, position)
        if match is None:
            raise DcgmParseError(
                f"{where}: cannot parse labels at {text[position : position + 40]!r}"
            )
        name, value = match.group(1), _unescape(match.group(2), where)
        if name in labels:
            raise DcgmParseError(f"{where}: label {name!r} appears twice")
        labels[name] = value
        position = match.end()
    return labels


def _column_values(labels: dict[str, str], where: str) -> dict[str, str]:
    """Map old and new label spellings onto columns; both spellings must agree if both appear."""
    columns: dict[str, str] = {}
    for label, column in _LABEL_SPELLINGS.items():
        if label in labels:
            if column in columns and columns[column] != labels[label]:
                raise DcgmParseError(
                    f"{where}: {column} labels disagree: {columns[column]!r} vs {labels[label]!r}"
                )
            columns[column] = labels[label]
    return columns


class _Sample(NamedTuple):
    """One sample line: its metric, labels, value (as written and as a number) and timestamp
    (None when the line has none)."""

    name: str
    labels: dict[str, str]
    raw_value: str
    value: float
    timestamp_ns: int | None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DcgmParseError(f"{path}: cannot read DCGM samples: {err}") from err


def _timestamp_ns(raw_timestamp: str, where: str) -> int:
    try:
        timestamp_ns = int(raw_timestamp) * NS_PER_MS
    except ValueError:
        raise DcgmParseError(
            f"{where}: timestamp {raw_timestamp!r} is not integer milliseconds"
        ) from None
    if not -_INT64_LIMIT <= timestamp_ns < _INT64_LIMIT:
        raise DcgmParseError(
            f"{where}: timestamp {raw_timestamp} ms is out of the nanosecond range"
        )
    return timestamp_ns


def _parse_sample(line: str, where: str, text: str) -> _Sample:
    """A sample line of any metric, syntax-checked; `text`: the whole input, for the hint that
    a path was passed as text."""
    match = _SAMPLE.fullmatch(line)
    if match is None:
        # os.path.exists, unlike Path.exists, returns False for names too long to be paths.
        hint = (
            "; to read a file, pass a pathlib.Path"
            if "\n" not in text and os.path.exists(text)
            else ""
        )
        raise DcgmParseError(f"{where}: not a Prometheus sample line: {line[:80]!r}{hint}")
    labels = _parse_labels(match.group("labels") or "", where)
    raw_value, raw_timestamp = match.group("value"), match.group("timestamp")
    try:
        value = float(raw_value)
    except ValueError:
        raise DcgmParseError(f"{where}: sample value {raw_value!r} is not a number") from None
    timestamp_ns = None if raw_timestamp is None else _timestamp_ns(raw_timestamp, where)
    return _Sample(match.group("name"), labels, raw_value, value, timestamp_ns)


def _append_engine_active(
    rows: dict[str, list[Any]], sample: _Sample, default_timestamp_ns: int | None, where: str
) -> None:
    """Check a GR_ENGINE_ACTIVE sample and append it to `rows` (DCGM_SCHEMA's columns)."""
    if not (math.isfinite(sample.value) and 0.0 <= sample.value <= 1.0):
        raise DcgmParseError(
            f"{where}: {GR_ENGINE_ACTIVE} value {sample.raw_value} is outside the ratio 0..1"
        )
    timestamp_ns = sample.timestamp_ns
    if timestamp_ns is None:
        if default_timestamp_ns is None:
            raise DcgmParseError(
                f"{where}: sample has no timestamp and no default scrape time was given"
            )
        timestamp_ns = default_timestamp_ns
    labels = sample.labels
    columns = _column_values(labels, where)
    for required in ("uuid", "hostname"):
        if required not in columns:
            raise DcgmParseError(
                f"{where}: sample has no {required} label (labels: {sorted(labels)})"
            )
    gpu = labels.get("gpu")
    if gpu is None or not gpu.isdigit():
        raise DcgmParseError(f"{where}: gpu label {gpu!r} is not a GPU index")
    rows["uuid"].append(columns["uuid"])
    rows["hostname"].append(columns["hostname"])
    rows["gpu"].append(int(gpu))
    rows["model_name"].append(labels.get("modelName"))
    rows["timestamp_ns"].append(timestamp_ns)
    rows["value"].append(sample.value)


def parse_dcgm(
    source: str | PathLike[str],
    *,
    default_timestamp_ns: int | None = None,
    source_name: str = "<text>",
) -> pl.DataFrame:
    """Parse `DCGM_FI_PROF_GR_ENGINE_ACTIVE` samples from Prometheus text exposition.

    `source` is a path (`pathlib.Path` or other `os.PathLike`) or the text itself (`str`).
    Several concatenated scrapes are fine. Samples without an explicit millisecond timestamp
    take `default_timestamp_ns` (the scrape time, or the hour a file is named for); without one
    they are an error. Other metrics are syntax-checked and skipped. Exact repeats of a sample
    (a scrape appended twice) are kept once; two different values for the same GPU and
    timestamp are an error. Returns DCGM_SCHEMA columns sorted by uuid and timestamp.
    """
    if isinstance(source, PathLike):
        path = Path(source)
        source_name = str(path)
        text = _read_text(path)
    else:
        text = source

    rows: dict[str, list[Any]] = {name: [] for name in DCGM_SCHEMA}
    # Lines end at "\n" only: a quoted label value may hold any other control character.
    for line_number, line in enumerate(text.split("\n"), start=1):
        stripped = line.strip(" \t\r")
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{source_name}:{line_number}"
        sample = _parse_sample(stripped, where, text)
        if sample.name == GR_ENGINE_ACTIVE:
            _append_engine_active(rows, sample, default_timestamp_ns, where)

    samples = pl.DataFrame(rows, schema=DCGM_SCHEMA).unique(maintain_order=True)
    conflicts = samples.filter(pl.len().over("uuid", "timestamp_ns") > 1)
    if conflicts.height:
        first = conflicts.row(0, named=True)
        raise DcgmParseError(
            f"{source_name}: GPU {first['uuid']} has {conflicts.height} conflicting values at the same "
            f"timestamps (first at {first['timestamp_ns']} ns)"
        )
    return samples.sort("uuid", "timestamp_ns")


def read_dcgm_hour(dcgm_dir: str | PathLike[str], hour: datetime) -> pl.DataFrame:
    """All hosts' samples for one UTC hour from `<dcgm_dir>/<hostname>/<YYYY-MM-DDTHH>.prom`.

    A sample without a timestamp belongs to the hour its file is named for. Samples outside
    the hour (a collector that wrote late) are left out. No files gives an empty frame: the
    plausibility check reports each GPU without samples.
    """
    start_ns, end_ns = hour_bounds_ns(hour)
    files = sorted(Path(dcgm_dir).glob(f"*/{hour_key(hour)}.prom"))
    frames = [parse_dcgm(path, default_timestamp_ns=start_ns) for path in files]
    samples = pl.concat(frames) if frames else pl.DataFrame(schema=DCGM_SCHEMA)
    return samples.filter(pl.col("timestamp_ns").is_between(start_ns, end_ns, closed="left")).sort(
        "uuid", "timestamp_ns"
    )
