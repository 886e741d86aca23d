"""The step log: the engine hook that writes binary step records and the decoder that reads them."""

from __future__ import annotations

from pipeline.steplog.decoder import DecodedLog, read_segments, segment_paths
from pipeline.steplog.format import InvalidStep
from pipeline.steplog.recorder import RecorderError, StepRecorder, recover_partial_segments
from schemas.records import SegmentHeader

__all__ = [
    "DecodedLog",
    "InvalidStep",
    "RecorderError",
    "SegmentHeader",
    "StepRecorder",
    "read_segments",
    "recover_partial_segments",
    "segment_paths",
]
