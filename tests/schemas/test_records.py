"""The segment header as JSON: the exact bytes written, what is read back, and every bad field
named."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.records import LAYOUT, FieldError, HeaderFrame, SegmentHeader

HEADER: dict[str, Any] = {
    "pool": "chat-8b",
    "replica": "chat-8b-r0",
    "engine_name": "vllm",
    "engine_version": "0.33.0",
    "driver_version": "550.54.15",
    "model": "llama-3.1-8b-instruct",
    "gpu_type": "h100",
    "gpus_per_replica": 1,
    "kv_block_size": 16,
}


def test_the_header_is_compact_json_in_field_order_with_text_as_utf8():
    header = SegmentHeader(**{**HEADER, "engine_model": '/models/Llama "3" é\n', "pool": "p"})
    assert (
        header.to_json()
        == (
            '{"pool":"p","replica":"chat-8b-r0","engine_name":"vllm","engine_version":"0.33.0",'
            '"driver_version":"550.54.15","model":"llama-3.1-8b-instruct","gpu_type":"h100",'
            '"gpus_per_replica":1,"kv_block_size":16,"engine_model":"/models/Llama \\"3\\" \xe9\\n",'
            '"engine_device":null}'
        ).encode()
    )


def test_a_header_written_before_the_engines_own_names_reads_with_none():
    frame = HeaderFrame.from_json(
        json.dumps(
            {
                **HEADER,
                "format_version": 1,
                "segment_id": "167644ebec9347fc84f2c433002f618f",
                "first_seq": 0,
                "mono_anchor_ns": 2179528165099,
                "wall_anchor_ns": 1796316776665105694,
                "layout": LAYOUT,
            }
        )
    )
    assert (frame.engine_model, frame.engine_device, frame.wall_anchor_ns) == (
        None,
        None,
        1796316776665105694,
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"gpus_per_replica": True}, "field gpus_per_replica: expected an integer in [1, "),
        ({"kv_block_size": 2**31}, "field kv_block_size: expected an integer in [1, 2147483647]"),
        ({"replica": ""}, "field replica: expected a non-empty string, got ''"),
        ({"engine_model": 3}, "field engine_model: expected a string or null, got 3"),
        ({"driver_version": "\ud800"}, "field driver_version: expected a string, got '\\ud800'"),
        ({"model": None}, "field model: expected a string, got None"),
    ],
)
def test_a_bad_field_is_named(changes, message):
    with pytest.raises(FieldError) as refused:
        SegmentHeader(**{**HEADER, **changes})
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({**HEADER, "gpus": 1}, "field gpus: not a field of SegmentHeader"),
        ({k: v for k, v in HEADER.items() if k != "model"}, "field model: required"),
    ],
)
def test_a_header_document_with_a_field_too_many_or_too_few_is_refused(document, message):
    with pytest.raises(FieldError) as refused:
        SegmentHeader.from_mapping(document)
    assert str(refused.value) == message


def test_a_layout_of_other_than_name_code_pairs_is_refused():
    document = {
        **HEADER,
        "format_version": 1,
        "segment_id": "s",
        "first_seq": 0,
        "mono_anchor_ns": 0,
        "wall_anchor_ns": 0,
        "layout": {"step": [["seq", 8]]},
    }
    with pytest.raises(FieldError) as refused:
        HeaderFrame.from_mapping(document)
    assert str(refused.value).startswith(
        "field layout: expected an object of lists of [name, code] pairs, got {'step': "
    )


text = st.text(st.characters(exclude_categories=["Cs"]), max_size=16)


@given(
    names=st.tuples(text.filter(bool), text.filter(bool), text, text, text, text, text),
    counts=st.tuples(st.integers(1, 2**31 - 1), st.integers(1, 2**31 - 1)),
    engine=st.tuples(st.none() | text, st.none() | text),
)
def test_any_header_reads_back_as_written_and_as_json_says(names, counts, engine):
    fields = ("pool", "replica", "engine_name", "engine_version", "driver_version", "model")
    header = SegmentHeader(
        **dict(zip(fields, names, strict=False)),
        gpu_type=names[6],
        gpus_per_replica=counts[0],
        kv_block_size=counts[1],
        engine_model=engine[0],
        engine_device=engine[1],
    )
    written = header.to_json()
    assert SegmentHeader.from_json(written) == header
    assert json.loads(written) == {
        **dict(zip(fields, names, strict=False)),
        "gpu_type": names[6],
        "gpus_per_replica": counts[0],
        "kv_block_size": counts[1],
        "engine_model": engine[0],
        "engine_device": engine[1],
    }


def test_an_attention_ranks_header_says_its_rank_and_the_replicas_parallel_sizes():
    header = SegmentHeader(
        **{**HEADER, "replica": "dsv3-r0.dp3", "gpus_per_replica": 2},
        tp_size=8,
        ep_size=8,
        attn_dp_rank=3,
        attn_dp_size=4,
    )
    assert header.to_json().endswith(
        b'"engine_device":null,"tp_size":8,"ep_size":8,"attn_dp_rank":3,"attn_dp_size":4}'
    )
    assert SegmentHeader.from_json(header.to_json()) == header
    with pytest.raises(FieldError, match=r"field attn_dp_rank: expected an integer in \[0, "):
        SegmentHeader(**HEADER, attn_dp_rank=-1)
