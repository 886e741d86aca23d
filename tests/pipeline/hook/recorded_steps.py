"""What the engine hooks' conformance tests share: a tiny model shape the engines load without
weights, and the check of each recorded step against what the scheduler's own state said."""

from __future__ import annotations

from typing import Any

from pipeline.ingestion.decoder import DecodedLog

# A Llama shape small enough that the engines' architecture inspection is all it costs.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def assert_steps_match(log: DecodedLog, expected: list[dict[str, Any]]) -> None:
    """Every recorded step, in order, holds the slots, holders and block counts `expected`
    took from the scheduler when it ran the step (KV blocks to 9 decimals)."""
    steps = log.steps.to_pylist()
    assert [s["seq"] for s in steps] == list(range(len(expected)))
    slots, holders = log.slots.to_pylist(), log.holders.to_pylist()
    for seq, (step, want) in enumerate(zip(steps, expected, strict=True)):
        recorded_slots = [
            {key: slot[key] for key in (want["slots"] or [{}])[0]}
            | {"kv_blocks": round(slot["kv_blocks"], 9)}
            for slot in slots
            if slot["seq"] == seq
        ]
        assert recorded_slots == want["slots"], f"step {seq}"
        recorded_holders = sorted(
            (h["request_id"], round(h["kv_blocks"], 9), h["state"])
            for h in holders
            if h["seq"] == seq
        )
        assert recorded_holders == want["holders"], f"step {seq}"
        assert (step["free_blocks"], step["total_blocks"]) == (
            want["free_blocks"],
            want["total_blocks"],
        ), f"step {seq}"
        assert step["admission_blocked"] == want["admission_blocked"], f"step {seq}"
