"""Charts as inline SVG (matplotlib, text kept as text), so the report needs nothing online.

Chart values are floats for drawing only; every number the report states comes from the
integer nano-dollar amounts.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

# Colour-blind-safe categories (Okabe-Ito, then Tableau's muted set) for tenants and features.
PALETTE = (
    "#0072B2",
    "#E69F00",
    "#009E73",
    "#CC79A7",
    "#56B4E9",
    "#D55E00",
    "#F0E442",
    "#000000",
    "#4E79A7",
    "#F28E2B",
    "#59A14F",
    "#B07AA1",
    "#9C755F",
    "#BAB0AC",
    "#76B7B2",
    "#EDC948",
)
GREYS = ("#BAB0AC", "#79706E", "#D7D2CB", "#595959", "#A0A0A0")
RESOURCE_COLOURS = {
    "sm": "#0072B2",
    "hbm": "#E69F00",
    "nvlink": "#009E73",
    "nic": "#CC79A7",
    "host": "#D55E00",
}
RESOURCE_LABELS = {"sm": "SM", "hbm": "HBM", "nvlink": "NVLink", "nic": "NIC", "host": "host"}

# The XML prolog, DOCTYPE and RDF metadata matplotlib writes name remote schemas; an inline
# <svg> needs none of them.
_PREAMBLE = re.compile(r"^.*?(?=<svg)", re.S)
_METADATA = re.compile(r"<metadata>.*?</metadata>\s*", re.S)


STYLE: dict[RcKeyType, Any] = {
    "svg.fonttype": "none",  # real <text>, styled by the page's font stack
    "svg.hashsalt": "stepledger",  # stable element ids: the same data gives the same file
    "font.family": "sans-serif",
    "font.size": 11,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
}


@contextmanager
def _pyplot() -> Iterator[Any]:
    """pyplot with the report's style, for drawing and saving one chart; the process's own
    matplotlib settings are left as they were."""
    # Imported when a chart is drawn: matplotlib takes over a second to import (1.1 s measured
    # for matplotlib.patches), and the Dagster code location imports pipeline.report.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.rc_context(STYLE):
        yield plt


def _to_svg(plt: Any, figure: Any) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(figure)
    text = _METADATA.sub("", _PREAMBLE.sub("", buffer.getvalue(), count=1))
    # Shrink with the page but never grow past the drawn size (text would grow with it).
    return re.sub(
        r'<svg([^>]*?) width="([^"]*)" height="[^"]*"',
        r'<svg\1 class="chart" style="max-width: \2"',
        text,
        count=1,
    )


def stacked_bars(
    categories: Sequence[str],
    series: dict[str, np.ndarray],
    *,
    ylabel: str,
    colours: dict[str, str] | None = None,
    notes: dict[int, str] | None = None,
    hatched: Sequence[int] = (),
) -> str:
    """Bars per category, stacked by series; negative values stack below zero. `notes` label
    categories above their bar; categories in `hatched` are drawn hatched and faded."""
    from matplotlib.patches import Patch  # when drawn, as in _pyplot

    with _pyplot() as plt:
        width = min(12.0, max(6.0, 0.45 * len(categories) + 4.5))
        figure, axis = plt.subplots(figsize=(width, 4.2))
        x = np.arange(len(categories))
        above = np.zeros(len(categories))
        below = np.zeros(len(categories))
        handles = []
        for index, (name, values) in enumerate(series.items()):
            values = np.asarray(values, dtype=np.float64)
            colour = (colours or {}).get(name, PALETTE[index % len(PALETTE)])
            base = np.where(values >= 0, above, below)
            bars = axis.bar(
                x, values, 0.7, bottom=base, color=colour, edgecolor="white", linewidth=0.4
            )
            for position in hatched:
                bars[position].set_hatch("///")
                bars[position].set_alpha(0.55)
            handles.append(Patch(facecolor=colour, label=name))
            above = np.where(values >= 0, above + values, above)
            below = np.where(values < 0, below + values, below)
        for position, note in (notes or {}).items():
            axis.annotate(
                note,
                (x[position], above[position]),
                textcoords="offset points",
                xytext=(0, 3),
                ha="center",
                fontsize=8,
                color="#B00020",
            )
        if below.min() < 0:
            axis.axhline(0, color="#333", linewidth=0.8)
        axis.set_xticks(
            x,
            categories,
            rotation=45 if len(categories) > 6 else 0,
            ha="right" if len(categories) > 6 else "center",
        )
        axis.set_ylabel(ylabel)
        axis.grid(axis="x", visible=False)
        axis.margins(x=0.02, y=0.12)
        axis.legend(
            handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9
        )
        return _to_svg(plt, figure)


def share_bars(
    labels: Sequence[str], shares: np.ndarray, names: Sequence[str], *, xlabel: str
) -> str:
    """One horizontal 100 % bar per label, split into `names` by the rows of `shares`."""
    with _pyplot() as plt:
        figure, axis = plt.subplots(figsize=(10, 0.45 * len(labels) + 1.4))
        y = np.arange(len(labels))[::-1]
        left = np.zeros(len(labels))
        for column, name in enumerate(names):
            values = shares[:, column] * 100.0
            axis.barh(
                y,
                values,
                0.65,
                left=left,
                label=RESOURCE_LABELS.get(name, name),
                color=RESOURCE_COLOURS.get(name, PALETTE[column % len(PALETTE)]),
                edgecolor="white",
                linewidth=0.4,
            )
            for row in np.flatnonzero(values >= 7.0):
                axis.text(
                    left[row] + values[row] / 2,
                    y[row],
                    f"{values[row]:.0f}%",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                )
            left += values
        axis.set_yticks(y, labels)
        axis.set_xlim(0, 100)
        axis.set_xlabel(xlabel)
        axis.grid(axis="y", visible=False)
        axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
        return _to_svg(plt, figure)


def bottleneck_chart(
    batches: np.ndarray,
    resource_ms: dict[str, np.ndarray],
    overlap_ms: np.ndarray,
    nooverlap_ms: np.ndarray,
    *,
    title: str,
) -> str:
    """Left: each resource's time per step; right: the NoOverlap and Overlap step estimates;
    both against the batch size on a log2 axis."""
    with _pyplot() as plt:
        figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
        for name, values in resource_ms.items():
            if np.any(values):  # a fabric no collective uses is not drawn
                left.plot(
                    batches,
                    values,
                    label=RESOURCE_LABELS[name],
                    color=RESOURCE_COLOURS[name],
                    linewidth=1.8,
                )
        right.plot(batches, nooverlap_ms, label="NoOverlap (sum)", color="#000000", linewidth=1.8)
        right.plot(
            batches,
            overlap_ms,
            label="Overlap (max)",
            color="#777777",
            linestyle="--",
            linewidth=1.8,
        )
        for axis, heading in ((left, "time per resource"), (right, "step estimates")):
            axis.set_xscale("log", base=2)
            axis.set_xticks([1, 4, 16, 64, 256], ["1", "4", "16", "64", "256"])
            axis.set_xlabel("decode requests in the batch")
            axis.set_title(heading, fontsize=10)
            axis.legend(frameon=False, fontsize=9)
        left.set_ylabel("ms per step")
        left.set_ylim(bottom=0)
        figure.suptitle(title, fontsize=10)
        return _to_svg(plt, figure)
