"""Whatever the recorder is given comes back from the decoder identically."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
from hypothesis import given, settings

from pipeline.hook.recorder import StepRecorder
from pipeline.ingestion.decoder import read_segments
from schemas.records import HOLDER_STATES, SLOT_COLUMNS

INT32 = 2**31 - 1
counts = st.integers(0, INT32)
blocks = st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False)
ids = st.text(max_size=12)


@st.composite
def slots(draw):
    new_tokens = draw(counts)
    drafted = draw(st.integers(0, new_tokens))
    return {
        "request_id": draw(ids),
        "new_tokens": new_tokens,
        "context_tokens": draw(counts),
        "kv_blocks": draw(blocks),
        "prompt_tokens": draw(counts),
        "prefix_hit_tokens": draw(counts),
        "spec_drafted": drafted,
        "spec_accepted": draw(st.integers(0, drafted)),
    }


@st.composite
def steps(draw):
    start = draw(st.integers(0, 2**53))
    return {
        "start_ns": start,
        "end_ns": start + draw(st.integers(0, 2**40)),
        "slots": draw(st.lists(slots(), max_size=5)),
        "holders": draw(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "request_id": ids,
                        "kv_blocks": blocks,
                        "state": st.sampled_from(HOLDER_STATES),
                    }
                ),
                max_size=3,
            )
        ),
        "admission_blocked": draw(st.booleans()),
        "free_blocks": draw(counts),
        "total_blocks": draw(counts),
        # Steps that are dropped on purpose instead of recorded.
        "drop": draw(st.booleans()) and draw(st.booleans()),
    }


@settings(max_examples=60, deadline=None)
@given(
    log=st.lists(steps(), max_size=8),
    first_seq=st.integers(0, 2**40),
    rotate_bytes=st.sampled_from([1 << 20, 900]),
    columns_as_lists=st.booleans(),
)
def test_round_trip(header, clocks, log, first_seq, rotate_bytes, columns_as_lists):
    with tempfile.TemporaryDirectory() as outbox:
        with StepRecorder(
            Path(outbox),
            header,
            overflow="block",
            first_seq=first_seq,
            rotate_bytes=rotate_bytes,
            **clocks,
        ) as recorder:
            for step in log:
                if step["drop"]:
                    recorder.drop_step()
                    continue
                columns: list[Sequence[Any]] = [
                    [slot[name] for slot in step["slots"]] for name in ("request_id", *SLOT_COLUMNS)
                ]
                if not columns_as_lists:
                    columns = [tuple(column) for column in columns]
                assert recorder.record_step(
                    step["start_ns"],
                    step["end_ns"],
                    *columns,
                    holder_ids=[h["request_id"] for h in step["holders"]],
                    holder_blocks=[h["kv_blocks"] for h in step["holders"]],
                    holder_states=[h["state"] for h in step["holders"]],
                    admission_blocked=step["admission_blocked"],
                    free_blocks=step["free_blocks"],
                    total_blocks=step["total_blocks"],
                )
        decoded = read_segments(Path(outbox).glob("*.seg"))
    shift = clocks["wall_clock"]() - clocks["mono_clock"]()
    kept = [(first_seq + index, step) for index, step in enumerate(log) if not step["drop"]]
    assert decoded.damage.num_rows == 0
    assert decoded.steps.drop(["segment_id"]).to_pylist() == [
        {
            "pool": header.pool,
            "replica": header.replica,
            "seq": seq,
            "start_ns": step["start_ns"],
            "end_ns": step["end_ns"],
            "start_utc_ns": step["start_ns"] + shift,
            "end_utc_ns": step["end_ns"] + shift,
            "admission_blocked": step["admission_blocked"],
            "free_blocks": step["free_blocks"],
            "total_blocks": step["total_blocks"],
            "num_slots": len(step["slots"]),
            "num_holders": len(step["holders"]),
        }
        for seq, step in kept
    ]
    assert decoded.slots.to_pylist() == [
        {"pool": header.pool, "replica": header.replica, "seq": seq, "slot_index": index, **slot}
        for seq, step in kept
        for index, slot in enumerate(step["slots"])
    ]
    assert decoded.holders.to_pylist() == [
        {
            "pool": header.pool,
            "replica": header.replica,
            "seq": seq,
            "holder_index": index,
            **holder,
        }
        for seq, step in kept
        for index, holder in enumerate(step["holders"])
    ]
    dropped = [first_seq + index for index, step in enumerate(log) if step["drop"]]
    assert sum(row["steps"] for row in decoded.drops.to_pylist()) == len(dropped)
    assert (
        sorted(
            seq
            for row in decoded.drops.to_pylist()
            for seq in range(row["first_seq"], row["last_seq"] + 1)
        )
        == dropped
    )
    assert sum(decoded.segments.column("steps").to_pylist()) == len(kept)
