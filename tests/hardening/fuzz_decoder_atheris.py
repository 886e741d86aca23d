"""Coverage-guided fuzzing of the segment decoder with atheris (libFuzzer).

    python -m tests.hardening.fuzz_decoder_atheris -runs=100000 -timeout=10 -rss_limit_mb=2048

Needs the `fuzz` extra (`pip install -e '.[fuzz]'`). The seed corpus is the recorded segments
of segment_bytes.py, written to `atheris-decoder/corpus` in the working directory unless
corpus directories are given (libFuzzer adds the inputs it finds interesting there).
Any exception escaping read_segments, an input taking longer than -timeout seconds, or the
process exceeding -rss_limit_mb is a finding: libFuzzer stops and writes the input to
`crash-*`/`timeout-*`/`oom-*` in the working directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["pipeline.ingestion", "pipeline.hook", "schemas"]):
    from pipeline.ingestion.decoder import read_segments

from tests.helpers.segment_bytes import recorded_segments

# In the working directory, next to libFuzzer's own findings: libFuzzer ends the process
# without running Python's exit handlers, so a temporary directory would be left behind.
_WORK = Path.cwd() / "atheris-decoder"
_INPUT = _WORK / "input.seg"


def decode_one(data: bytes) -> None:
    _INPUT.write_bytes(data)
    read_segments([_INPUT])


def main() -> None:
    args = list(sys.argv)
    _WORK.mkdir(exist_ok=True)
    if not any(not arg.startswith("-") for arg in args[1:]):
        corpus = _WORK / "corpus"
        corpus.mkdir(exist_ok=True)
        for index, content in enumerate(recorded_segments()):
            (corpus / f"segment-{index}.seg").write_bytes(content)
        args.append(str(corpus))
    atheris.Setup(args, decode_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
