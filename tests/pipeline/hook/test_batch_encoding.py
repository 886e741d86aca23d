"""step_frames encodes a batch of steps to exactly the bytes step_frame gives each one."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.hook.format import InvalidStep, _batch_frames, step_frame, step_frames
from schemas.records import HOLDER_STATES

# A step is valid unless one of these spoils it; step_frame names the field either way.
FLAWS = (
    None,
    "negative_tokens",
    "drafts_exceed_new",
    "unknown_state",
    "end_before_start",
    "float_free_blocks",
    "id_is_none",
    "short_column",
    "nan_blocks",
)


@st.composite
def steps(draw: st.DrawFn) -> tuple[Any, ...]:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    slots = draw(st.integers(0, 6))
    holders = draw(st.integers(0, 3))
    flaw = draw(st.sampled_from(FLAWS)) if draw(st.integers(0, 3)) == 0 else None
    as_list = draw(st.booleans())
    dtype = draw(st.sampled_from([np.int64, np.int32, np.uint32, np.int16]))
    new_tokens = rng.integers(1, 30, slots).astype(dtype)
    drafted = np.minimum(new_tokens, rng.integers(0, 4, slots).astype(dtype))
    accepted = drafted // 2
    kv_blocks = rng.random(slots) * 40.0 if draw(st.booleans()) else rng.integers(0, 40, slots)
    request_ids: list[str | None] = [f"r{seed % 997}-{i}-{'ü' * (i % 3)}" for i in range(slots)]
    states = [HOLDER_STATES[i % len(HOLDER_STATES)] for i in range(holders)]
    start = int(rng.integers(0, 2**40))
    end = start + int(rng.integers(0, 10**6))
    free_blocks: object = int(rng.integers(0, 2**31 - 1))
    context = rng.integers(0, 2**31 - 1, slots)
    if slots and flaw == "negative_tokens":
        context[0] = -1
    if slots and flaw == "drafts_exceed_new":
        drafted[0] = new_tokens[0] + 1
    if holders and flaw == "unknown_state":
        states[0] = "evicted"
    if flaw == "end_before_start":
        end = start - 1
    if flaw == "float_free_blocks":
        free_blocks = 3.0
    if slots and flaw == "id_is_none":
        request_ids[0] = None
    if slots and flaw == "short_column":
        context = context[1:]
    if slots and flaw == "nan_blocks":
        kv_blocks = kv_blocks.astype(np.float64)
        kv_blocks[0] = np.nan

    def column(values: np.ndarray) -> object:
        return values.tolist() if as_list else values

    return (
        int(rng.integers(0, 2**40)),
        start,
        end,
        request_ids,
        column(new_tokens),
        column(context),
        column(kv_blocks),
        column(rng.integers(0, 9000, slots)),
        column(rng.integers(0, 500, slots)),
        column(drafted),
        column(accepted),
        [f"h{i}" for i in range(holders)],
        rng.random(holders) * 8.0,
        states,
        draw(st.booleans()),
        free_blocks,
        np.int32(rng.integers(0, 2**31 - 1)),
    )


def one_by_one(batch: list[tuple[Any, ...]]) -> list[bytes | str]:
    encoded: list[bytes | str] = []
    for step in batch:
        try:
            encoded.append(step_frame(*step))
        except (InvalidStep, TypeError, ValueError) as err:
            encoded.append(f"{type(err).__name__}: {err}")
    return encoded


def described(frames: list[bytes | Exception]) -> list[bytes | str]:
    return [f"{type(f).__name__}: {f}" if isinstance(f, Exception) else f for f in frames]


@settings(max_examples=150, deadline=None)
@given(st.lists(steps(), min_size=0, max_size=12))
def test_batch_bytes_equal_step_by_step_bytes(batch):
    assert described(step_frames(batch)) == one_by_one(batch)


def test_a_bad_step_fails_alone_and_its_neighbours_keep_their_bytes():
    good = (
        7,
        100,
        150,
        ["a", "b"],
        [3, 1],
        [10, 20],
        [0.5, 2.0],
        [5, 5],
        [0, 0],
        [1, 0],
        [0, 0],
        ["w"],
        [1.5],
        ["waiting"],
        True,
        10,
        20,
    )
    bad = (*good[:9], [4, 0], *good[10:])
    frames = step_frames([good, bad, good])
    assert frames[0] == frames[2] == step_frame(*good)
    assert isinstance(frames[1], InvalidStep)
    assert (
        str(frames[1])
        == "spec_drafted exceeds new_tokens (drafts are part of the step's new tokens)"
    )


def test_a_clean_batch_is_packed_whole_to_the_same_bytes():
    step: tuple[Any, ...] = (
        1,
        2,
        3,
        ["x"],
        np.array([2]),
        np.array([9]),
        np.array([1.0]),
        np.array([4]),
        np.array([0]),
        np.array([1]),
        np.array([1]),
        [],
        [],
        [],
        False,
        0,
        5,
    )
    empty: tuple[Any, ...] = (
        2,
        3,
        3,
        [],
        [],
        [],
        [],
        [],
        [],
        [],
        [],
        ["h"],
        [2.0],
        ["waiting"],
        False,
        1,
        5,
    )
    expected = [step_frame(*step), step_frame(*empty)]
    assert _batch_frames([step, empty]) == expected
    assert step_frames([step, empty]) == expected
