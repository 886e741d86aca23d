from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.attribution.calibration import CalibrationStore
from pipeline.attribution.synthetic import synthetic_log, synthetic_pool
from pipeline.cli import main

SEED_STEPS = (
    Path(__file__).resolve().parents[3] / "pipeline" / "attribution" / "examples" / "seed_step.json"
)


def _run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_seed_example_file_reproduces_both_published_splits():
    result = _run("explain-step", str(SEED_STEPS), "--json")
    assert result.exit_code == 0, result.output
    alpha_one, alpha_point_eight = json.loads(result.output)
    assert (alpha_one["total"], alpha_one["shares"]) == (50, {"A": 39, "B": 4, "C": 4, "D": 3})
    assert (alpha_point_eight["total"], alpha_point_eight["shares"]) == (
        50,
        {"A": 32, "B": 10, "C": 5, "D": 3},
    )
    b = alpha_point_eight["slots"][1]
    assert b["kv_share"] == pytest.approx(0.70)
    assert b["exact"] == pytest.approx(9.9084, abs=1e-4)
    assert "rounded up" in b["reason"]


def test_one_step_object_gives_one_object_and_a_table(tmp_path):
    step = json.loads(SEED_STEPS.read_text())[1] | {"unit": "nano"}
    path = tmp_path / "step.json"
    path.write_text(json.dumps(step))
    result = _run("explain-step", str(path), "--json")
    answer = json.loads(result.output)
    assert answer["total"] == 50_000
    assert sum(answer["shares"].values()) == 50_000
    assert answer["shares"] == {"A": 32_508, "B": 9_908, "C": 4_636, "D": 2_948}
    table = _run("explain-step", str(path))
    assert table.exit_code == 0
    assert "50000 nano-dollars" in table.output
    assert "A: prefill chunk of 512" in table.output


def test_thousands_of_steps_in_one_call(tmp_path):
    step = json.loads(SEED_STEPS.read_text())[1]
    path = tmp_path / "many.json"
    path.write_text(json.dumps([step] * 3000))
    answers = json.loads(_run("explain-step", str(path), "--json").output)
    assert len(answers) == 3000
    assert all(a["shares"] == {"A": 32, "B": 10, "C": 5, "D": 3} for a in answers)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("[", "not valid JSON"),
        (
            json.dumps(
                [
                    {
                        "step_ms": 50,
                        "usd_per_gpu_hour": 3.6,
                        "coefficients": {"c0_ms": 1, "a_ms": 1, "b_ms": 1},
                        "slots": [
                            {"request_id": "A", "new_tokens": -1, "context": 0, "kv_blocks": 1}
                        ],
                    }
                ]
            ),
            "step[0]: field slots.0.new_tokens",
        ),
        (
            json.dumps(
                {
                    "step_ms": 50,
                    "usd_per_gpu_hour": 3.6,
                    "slots": [{"request_id": "A", "new_tokens": 1, "context": 0, "kv_blocks": 1}],
                }
            ),
            'give "coefficients"',
        ),
        (
            json.dumps(
                {
                    "step_ms": 50,
                    "usd_per_gpu_hour": 3.6,
                    "coefficients": {"c0_ms": 1, "a_ms": 1, "b_ms": 1},
                    "slots": [{"request_id": "A", "new_tokens": 1, "context": 0, "kv_blocks": 1}]
                    * 2,
                }
            ),
            "request ids repeat",
        ),
    ],
)
def test_bad_step_files_are_named(tmp_path, document, message):
    path = tmp_path / "bad.json"
    path.write_text(document)
    result = CliRunner().invoke(main, ["explain-step", str(path)])
    assert result.exit_code != 0
    assert message in result.output
    assert "bad.json" in result.output


def test_kernel_weights_form(tmp_path):
    pytest.importorskip("pricing")
    step = {
        "step_ms": 30,
        "usd_per_gpu_hour": 3.6,
        "unit": "nano",
        "alpha": 1.0,
        "weights": "kernel",
        "deployment": {"model": "llama-3.1-8b-instruct", "chip": "h100"},
        "slots": [
            {"request_id": "P", "new_tokens": 512, "context": 0, "kv_blocks": 32},
            {
                "request_id": "D",
                "new_tokens": 1,
                "context": 2000,
                "kv_blocks": 126,
                "prompt_tokens": 1500,
            },
        ],
    }
    path = tmp_path / "kernel.json"
    path.write_text(json.dumps(step))
    result = _run("explain-step", str(path), "--json")
    answer = json.loads(result.output)
    assert answer["total"] == 30_000
    assert answer["weights"] == "kernel"
    assert answer["shares"]["P"] > answer["shares"]["D"] > 0


def _record_calibration_run(outbox: Path, engine_version: str, coefficients, seed: int) -> None:
    from pipeline.hook.recorder import StepRecorder
    from schemas.records import SegmentHeader

    pool = synthetic_pool(replicas=1)
    log = synthetic_log(
        pool, steps_per_replica=120, seed=seed, coefficients=coefficients, noise=0.01
    )
    header = SegmentHeader(
        pool=pool.name,
        replica="r0",
        engine_name="vllm",
        engine_version=engine_version,
        driver_version="550.54",
        model=pool.model,
        gpu_type=pool.gpu_type,
        gpus_per_replica=1,
        kv_block_size=16,
    )
    start = int(log.steps["start_ns"][0])
    # Sequence numbers continue across the engine upgrade: (replica, seq) names a step.
    with StepRecorder(
        outbox / engine_version,
        header,
        overflow="block",
        mono_clock=lambda: start,
        wall_clock=lambda: start,
        first_seq=seed * 1000,
    ) as recorder:
        for step in log.steps.iter_rows(named=True):
            slots = log.slots.filter(log.slots["seq"] == step["seq"])
            recorder.record_step(
                step["start_ns"],
                step["end_ns"],
                slots["request_id"].to_list(),
                slots["new_tokens"].to_list(),
                slots["context_tokens"].to_list(),
                slots["kv_blocks"].to_list(),
                slots["prompt_tokens"].to_list(),
                slots["prefix_hit_tokens"].to_list(),
                slots["spec_drafted"].to_list(),
                slots["spec_accepted"].to_list(),
            )


def test_calibrate_fits_real_segments_per_engine_version_and_stores_them(tmp_path):
    pytest.importorskip("pipeline.ingestion.decoder")
    _record_calibration_run(tmp_path / "run", "0.11.0", (12.0, 0.05, 0.00005), seed=1)
    _record_calibration_run(tmp_path / "run", "0.12.0", (10.0, 0.04, 0.00006), seed=2)
    store = tmp_path / "calibration.yaml"
    result = _run("calibrate", "--data", str(tmp_path / "run"), "--store", str(store), "--json")
    assert result.exit_code == 0, result.output
    fits = {f["engine_version"]: f for f in json.loads(result.output)}
    assert fits["0.11.0"]["c0_ms"] == pytest.approx(12.0, rel=0.05)
    assert fits["0.11.0"]["n_steps"] == 120
    assert fits["0.12.0"]["c0_ms"] == pytest.approx(10.0, rel=0.05)
    assert fits["0.12.0"]["stored"]
    assert fits["0.12.0"]["a_ms"] == pytest.approx(0.04, rel=0.1)
    loaded = CalibrationStore.load(store)
    coefficients = loaded.lookup("llama-3.1-8b-instruct", "h100", "0.12.0", "550.54")
    assert coefficients is not None
    assert coefficients.version == fits["0.12.0"]["version"]
    text = _run("calibrate", "--data", str(tmp_path / "run"), "--store", str(store), "--dry-run")
    assert "R^2=0.9" in text.output
    assert "not stored (dry run)" in text.output


def test_calibrate_rejects_a_poor_fit_and_an_empty_directory(tmp_path):
    pytest.importorskip("pipeline.ingestion.decoder")
    empty = CliRunner().invoke(main, ["calibrate", "--data", str(tmp_path)])
    assert empty.exit_code != 0
    assert "no *.seg step-log segments" in empty.output
    _record_calibration_run(tmp_path / "run", "0.11.0", (12.0, 0.05, 0.00005), seed=1)
    strict = CliRunner().invoke(
        main,
        [
            "calibrate",
            "--data",
            str(tmp_path / "run"),
            "--store",
            str(tmp_path / "c.json"),
            "--min-r2",
            "1.0",
        ],
    )
    assert strict.exit_code == 1
    assert "REJECTED: R^2 below 1.0" in strict.output
    assert not (tmp_path / "c.json").exists()
