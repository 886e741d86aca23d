"""Write the sample output the docs show from a real run of the commands that print it.

    python docs/sample_output.py            run each sample's command, rewrite its block
    python docs/sample_output.py --check    exit 1 if a block differs from what the command prints

A sample is a ```sh block holding one `stepledger` command (with its SQL as a here-document,
if any), followed by `<!-- output of the command above: ... -->`, its ```text output, and
`<!-- end of output -->`. The samples run in the order of PAGES, the demo first: the others
read the `demo-run` it writes. tests/assets/test_cli.py runs the same commands on the demo
it runs anyway and compares what they print with the pages, so a change to what a command
prints fails there until this script has been run again.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from click.testing import Result

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "docs" / "getting-started.md", ROOT / "docs" / "warehouse.md")
# The directory the demo sample writes and the others read, as the pages name it.
OUT = "demo-run"
BEGIN = "<!-- output of the command above: written by docs/sample_output.py -->"
END = "<!-- end of output -->"
_SAMPLE = re.compile(
    r"```sh\n(?P<command>[^`]*?)```\n\n" + re.escape(BEGIN) + r"\n(?P<output>.*?)" + re.escape(END),
    re.S,
)
# Wide enough that the console wraps nothing, so that the output does not depend on the length
# of the directory's path; the page folds long lines itself (`shown`).
COLUMNS = "1000"
WIDTH = 100
_BOX_DRAWING = re.compile("[\u2500-\u257f]")
# Unset as on a reader's first run: no instance of their own, no alert sink.
UNSET = (
    "DAGSTER_HOME",
    "STEPLEDGER_ALERT_WEBHOOK_URL",
    "STEPLEDGER_PAGERDUTY_ROUTING_KEY",
    "STEPLEDGER_ALERT_FORMAT",
    "STEPLEDGER_ALERT_FILE",
)


@dataclass(frozen=True)
class Sample:
    page: Path
    command: str  # the ```sh block: the command line, then its here-document if any
    output: str  # the ```text block, as `shown` gives it

    def argv(self, out: Path) -> list[str]:
        """The command's arguments after `stepledger`, reading or writing `out` for demo-run."""
        line = self.command.splitlines()[0].partition("<<")[0]
        return [str(out) if arg == OUT else arg for arg in shlex.split(line)[1:]]

    def stdin(self) -> str:
        """The here-document's text, if the command has one."""
        lines = self.command.splitlines()
        return "\n".join(lines[1:-1]) + "\n" if "<<" in lines[0] else ""


def samples() -> list[Sample]:
    """Every sample of the pages, in the order they run."""
    found = []
    for page in PAGES:
        for match in _SAMPLE.finditer(page.read_text()):
            block = match["output"].strip().removeprefix("```text\n").removesuffix("```")
            found.append(Sample(page, match["command"], block))
    return found


def shown(output: str, out: Path) -> str:
    """What a page shows of a command's standard output: the demo's directory as demo-run,
    lines of text longer than the page folded and indented under their first line (a table's
    are left whole), and no blank lines at the end."""
    lines = []
    for line in output.replace(str(out), OUT).splitlines():
        text = line.lstrip()
        if not text or _BOX_DRAWING.match(text):
            lines.append(line)
            continue
        indent = line[: len(line) - len(text)]
        lines += textwrap.wrap(
            line,
            WIDTH,
            subsequent_indent=indent + "  ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    return "\n".join(line.rstrip() for line in lines).rstrip("\n") + "\n"


def run(sample: Sample, out: Path) -> Result:
    """Run a sample's command, with `out` for demo-run."""
    from click.testing import CliRunner

    from assets.cli import main

    return CliRunner().invoke(main, sample.argv(out), input=sample.stdin())


def rewritten(text: str, outputs: dict[str, str]) -> str:
    """`text` with each sample's block holding the output of its command in `outputs`."""

    def block(match: re.Match[str]) -> str:
        output = outputs[match["command"]]
        return f"```sh\n{match['command']}```\n\n{BEGIN}\n```text\n{output}```\n{END}"

    return _SAMPLE.sub(block, text)


def main(args: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    for name in UNSET:
        os.environ.pop(name, None)
    os.environ["COLUMNS"] = COLUMNS
    outputs: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / OUT
        for sample in samples():
            result = run(sample, out)
            if result.exit_code != 0:
                raise SystemExit(
                    f"{sample.command}exited with {result.exit_code}:\n{result.output}"
                )
            outputs[sample.command] = shown(result.stdout, out)
    differs = []
    for page in PAGES:
        current = page.read_text()
        wanted = rewritten(current, outputs)
        if wanted != current:
            differs.append(str(page.relative_to(ROOT)))
            if args[1:] != ["--check"]:
                page.write_text(wanted)
    if args[1:] == ["--check"] and differs:
        print("differs from what the commands print:", *differs, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
