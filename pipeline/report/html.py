"""The report as one self-contained HTML page: inline CSS and SVG, no scripts, no links out."""

from __future__ import annotations

from datetime import datetime
from html import escape

import numpy as np
import polars as pl

from pipeline.ledger import LINE_KINDS, RESOURCES
from pipeline.report import charts
from pipeline.report.data import ReportData
from pipeline.report.money import usd, usd_per

KIND_COLOURS = {
    "usage": "#0072B2",
    "idle": "#BAB0AC",
    "headroom": "#E69F00",
    "unattributed": "#D55E00",
    "platform_retry": "#CC79A7",
    "cache_credit": "#009E73",
}
KIND_MEANING = {
    "usage": "measured engine steps charged to the tenant's requests",
    "idle": "GPU time between steps, spread over tenants by usage or charged to the capacity owner",
    "headroom": "idle beyond the pool's target utilization, charged to its SLO owner",
    "unattributed": "requests without gateway context",
    "platform_retry": "retries caused by a platform timeout, paid by the capacity owner",
    "cache_credit": "prefix-cache read discount booked as pool savings (negative)",
}
# Beyond this many tenant/feature series the smallest are drawn together as "other".
MAX_SERIES = 14

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color: #1d1d1f; margin: 0 auto; max-width: 1280px; padding: 24px 32px 64px; line-height: 1.45; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 20px; margin: 40px 0 8px; padding-top: 12px; border-top: 1px solid #ddd; }
h3 { font-size: 15px; margin: 20px 0 6px; }
p.intro, p.note { color: #555; margin: 4px 0 12px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 16px 0; }
.card { border: 1px solid #ddd; border-radius: 8px; padding: 10px 16px; min-width: 170px; }
.card .label { color: #666; font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.card .value { font-size: 20px; font-variant-numeric: tabular-nums; }
.banner { background: #fff4e5; border: 1px solid #f0b35b; border-radius: 8px; padding: 10px 16px; margin: 12px 0; }
.banner.ok { background: #eef8f0; border-color: #7cc48c; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 13px; }
th, td { padding: 4px 8px; border-bottom: 1px solid #e6e6e6; text-align: left; vertical-align: top; white-space: nowrap; }
td.detail { white-space: normal; min-width: 240px; }
.scroll { overflow-x: auto; }
th { background: #f5f5f7; font-weight: 600; white-space: nowrap; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.total td { font-weight: 600; border-top: 2px solid #bbb; }
.pass { color: #1a7f37; font-weight: 600; }
.fail { color: #b00020; font-weight: 600; }
.warn { color: #9a6700; font-weight: 600; }
.detail { color: #444; max-width: 640px; }
svg.chart { width: 100%; height: auto; display: block; margin: 8px 0; }
code { background: #f5f5f7; padding: 1px 4px; border-radius: 4px; }
"""


def _money_cell(nano: int) -> str:
    return f'<td class="num" title="{int(nano)} nano-USD">{usd(nano)}</td>'


def _num(value: int) -> str:
    return f'<td class="num">{int(value):,}</td>'


def _table(headers: list[str], rows: list[str], numeric_from: int = 1) -> str:
    head = "".join(
        f'<th class="num">{escape(h)}</th>' if i >= numeric_from else f"<th>{escape(h)}</th>"
        for i, h in enumerate(headers)
    )
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>'


def _hour_label(hour: datetime) -> str:
    return hour.strftime("%m-%d %Hh")


def _hour_text(hour: datetime) -> str:
    return hour.strftime("%Y-%m-%dT%H")


def _summary(data: ReportData) -> str:
    invoices = data.invoices
    held = invoices.filter(~pl.col("published"))
    invoiced = int(invoices["amount_nano"].sum())
    held_nano = int(held["amount_nano"].sum())
    cards = [
        ("invoiced", usd(invoiced), invoiced),
        ("published to finance", usd(invoiced - held_nano), invoiced - held_nano),
        ("held back", usd(held_nano), held_nano),
    ]
    body = "".join(
        f'<div class="card"><div class="label">{label}</div><div class="value" title="{nano} nano-USD">{value}</div></div>'
        for label, value, nano in cards
    )
    body += (
        f'<div class="card"><div class="label">pool-hours</div><div class="value">'
        f"{invoices.height - held.height} of {invoices.height} published</div></div>"
    )
    if held.height:
        items = "".join(
            f"<li><b>{_hour_text(r['hour'])} {escape(r['pool'])}</b> ({usd(r['amount_nano'])}): "
            f"{escape(r['reason'] or '')}</li>"
            for r in held.iter_rows(named=True)
        )
        banner = (
            f'<div class="banner"><b>{held.height} pool-hour(s) held back from finance.</b> They are named '
            f"above their bars in the charts below (hatched when every pool of the hour is held back) and left "
            f"out of the cost tables, which show published hours only."
            f"<ul>{items}</ul></div>"
        )
    else:
        banner = '<div class="banner ok">Every pool-hour in this report passed its blocking checks and is published.</div>'
    return f'<div class="cards">{body}</div>{banner}'


def _hourly_chart(
    data: ReportData, lines: pl.DataFrame, names: list[str], colours: dict[str, str]
) -> str:
    """Stacked bars of `lines` (hour, series, amount_nano) per invoiced hour, one series per
    name in `names` (in that order); held-back hours are marked."""
    hours = sorted(set(data.invoices["hour"].to_list()))
    index = {h: i for i, h in enumerate(hours)}
    totals = lines.group_by("hour", "series").agg(pl.col("amount_nano").sum())
    series = {}
    for name in names:
        part = totals.filter(pl.col("series") == name)
        if part.is_empty():
            continue
        values = np.zeros(len(hours))
        for hour, amount in part.select("hour", "amount_nano").iter_rows():
            values[index[hour]] = amount / 1e9
        series[name] = values
    # An hour is hatched when all its pools are held back, else the held-back pools are named.
    held = data.invoices.group_by("hour").agg(
        pl.col("pool").filter(~pl.col("published")), pl.col("published").any()
    )
    notes = {
        index[hour]: "held back" if not any_published else "held back: " + ", ".join(sorted(pools))
        for hour, pools, any_published in held.iter_rows()
        if pools
    }
    hatched = [index[hour] for hour, pools, any_published in held.iter_rows() if not any_published]
    return charts.stacked_bars(
        [_hour_label(h) for h in hours],
        series,
        ylabel="USD per hour (all pools)",
        colours=colours,
        notes=notes,
        hatched=hatched,
    )


def _tenant_feature_chart(data: ReportData) -> str:
    lines = data.lines.with_columns((pl.col("tenant") + " / " + pl.col("feature")).alias("series"))
    totals = (
        lines.group_by("series")
        .agg(pl.col("amount_nano").sum())
        .sort("amount_nano", "series", descending=[True, False])
    )
    keep = totals["series"].head(MAX_SERIES).to_list()
    lines = lines.with_columns(
        pl.when(pl.col("series").is_in(keep))
        .then(pl.col("series"))
        .otherwise(pl.lit("other"))
        .alias("series")
    )
    names = [*keep, "other"] if totals.height > len(keep) else keep
    # Lines of no tenant feature, "(idle)" and the like, in greys; tenants' features in colour.
    labelled = [name for name in names if " / (" in name or name == "other"]
    colours = {name: charts.GREYS[i % len(charts.GREYS)] for i, name in enumerate(labelled)}
    colours |= {
        name: charts.PALETTE[i % len(charts.PALETTE)]
        for i, name in enumerate(n for n in names if n not in colours)
    }
    return _hourly_chart(data, lines, names, colours)


def _unit_cost_rows(frame: pl.DataFrame, keys: list[str]) -> list[str]:
    rows = []
    for r in frame.iter_rows(named=True):
        names = "".join(f"<td>{escape(str(r[k]))}</td>" for k in keys)
        rows.append(
            f"<tr>{names}{_money_cell(r['amount_nano'])}{_num(r['requests'])}{_num(r['new_tokens'])}"
            f'{_num(r["cached_tokens"])}<td class="num">{usd_per(r["amount_nano"], r["requests"])}</td>'
            f'<td class="num">{usd_per(r["amount_nano"] * 1000, r["new_tokens"])}</td></tr>'
        )
    return rows


def _costs(data: ReportData) -> str:
    published = data.published_lines
    sums = [
        pl.col("amount_nano").sum(),
        pl.col("requests").sum(),
        pl.col("new_tokens").sum(),
        pl.col("cached_tokens").sum(),
    ]
    headers_tail = ["amount", "requests", "tokens", "cached tokens", "per request", "per 1k tokens"]
    by_tenant = (
        published.group_by("tenant")
        .agg(*sums)
        .sort("amount_nano", "tenant", descending=[True, False])
    )
    by_feature = (
        published.group_by("tenant", "feature")
        .agg(*sums)
        .sort("amount_nano", "tenant", "feature", descending=[True, False, False])
    )
    total = published.select(*sums).with_columns(pl.lit("total").alias("tenant"))
    tenant_rows = _unit_cost_rows(by_tenant, ["tenant"])
    tenant_rows += [
        row.replace("<tr>", '<tr class="total">', 1) for row in _unit_cost_rows(total, ["tenant"])
    ]
    return (
        "<h2>Cost per tenant and feature</h2>"
        '<p class="intro">Every ledger line by tenant and feature, stacked per UTC hour (all pools). '
        "Lines that belong to no tenant feature carry a label in parentheses: <code>(idle)</code>, "
        "<code>(headroom)</code>, <code>(platform-retry)</code>, <code>(prefix-cache)</code>, "
        "<code>(unattributed)</code>.</p>"
        + _tenant_feature_chart(data)
        + "<h3>By tenant (published hours)</h3>"
        '<p class="note">Tokens are the tokens the GPUs computed (prefill and decode, speculative drafts '
        "included); prefix-cache hits are counted apart. Unit costs divide the totals, so idle spread to a tenant "
        "raises its cost per request. A request running across an hour boundary counts once in each hour.</p>"
        + _table(["tenant", *headers_tail], tenant_rows)
        + "<h3>By tenant and feature (published hours)</h3>"
        + _table(
            ["tenant", "feature", *headers_tail],
            _unit_cost_rows(by_feature, ["tenant", "feature"]),
            numeric_from=2,
        )
    )


def _line_kinds(data: ReportData) -> str:
    chart = _hourly_chart(
        data, data.lines.rename({"line_kind": "series"}), list(LINE_KINDS), KIND_COLOURS
    )
    wide = data.lines.group_by("hour", "pool", "line_kind").agg(pl.col("amount_nano").sum())
    rows = []
    for inv in data.invoices.iter_rows(named=True):
        amounts = dict(
            wide.filter((pl.col("hour") == inv["hour"]) & (pl.col("pool") == inv["pool"]))
            .select("line_kind", "amount_nano")
            .iter_rows()
        )
        lines_sum = sum(amounts.values())
        balance = (
            '<td class="pass">= invoice</td>'
            if lines_sum == inv["amount_nano"]
            else f'<td class="fail" title="{lines_sum - inv["amount_nano"]} nano-USD">off by '
            f"{usd(lines_sum - inv['amount_nano'], 9)}</td>"
        )
        rows.append(
            f"<tr><td>{_hour_text(inv['hour'])}</td><td>{escape(inv['pool'])}</td>{_money_cell(inv['amount_nano'])}"
            + "".join(_money_cell(amounts.get(k, 0)) for k in LINE_KINDS)
            + f"{balance}</tr>"
        )
    legend = "".join(f"<li><b>{k}</b>: {escape(v)}</li>" for k, v in KIND_MEANING.items())
    return (
        "<h2>Where each hour's invoice went</h2>"
        '<p class="intro">The invoice of every pool-hour (GPUs &times; price) split into ledger line kinds; '
        "the lines add up to the invoice to the nano-dollar.</p>"
        + chart
        + f"<ul>{legend}</ul>"
        + _table(["hour", "pool", "invoice", *LINE_KINDS, "lines"], rows, numeric_from=2)
    )


def _top_requests(data: ReportData) -> str:
    if data.requests.is_empty():
        return "<h2>Top requests</h2><p>No published request costs in this period.</p>"
    rows = [
        f"<tr><td>{_hour_label(r['hour'])}</td><td>{escape(r['pool'])}</td><td>{escape(r['request_id'])}</td>"
        f"<td>{escape(r['tenant'])}</td><td>{escape(r['feature'])}</td>{_money_cell(r['amount_nano'])}"
        f"{_money_cell(r['compute_nano'])}{_money_cell(r['kv_nano'])}{_num(r['steps'])}{_num(r['prompt_tokens'])}"
        f"{_num(r['output_tokens'])}{_num(r['cached_tokens'])}"
        f'<td class="num">{usd_per(r["amount_nano"] * 1000, r["new_tokens"])}</td></tr>'
        for r in data.requests.iter_rows(named=True)
    ]
    return (
        f"<h2>Top {data.requests.height} requests</h2>"
        '<p class="intro">The most expensive request-hours of the published hours: compute (its share of the '
        "steps' work) plus KV memory-time.</p>"
        + _table(
            [
                "hour",
                "pool",
                "request",
                "tenant",
                "feature",
                "amount",
                "compute",
                "KV memory",
                "steps",
                "prompt tokens",
                "output tokens",
                "cached tokens",
                "per 1k tokens",
            ],
            rows,
            numeric_from=5,
        )
    )


def _resources(data: ReportData) -> str:
    frame = data.resources
    heading = (
        "<h2>What each tenant used: SM, HBM, NVLink, NIC, host</h2>"
        '<p class="intro">Each request\'s compute charge split over the five resources in proportion to the '
        "pricing kernel's work for its slots (its own part plus its share of each step's fixed part, under "
        "the pool's fixed-cost policy), recomputed from the hour's slots in the Parquet lake. KV memory-time "
        "is charged apart. All hours in the report, held back ones included.</p>"
    )
    if frame.is_empty():
        return heading + "<p>No slots found in the lake for these hours.</p>"
    work = frame.select(f"{r}_us" for r in RESOURCES).to_numpy()
    shares = work / work.sum(axis=1, keepdims=True)
    chart = charts.share_bars(
        frame["tenant"].to_list(), shares, RESOURCES, xlabel="share of kernel work time (%)"
    )
    rows = []
    for r in frame.iter_rows(named=True):
        cells = "".join(_money_cell(r[f"{name}_nano"]) for name in RESOURCES)
        seconds = "".join(
            f'<td class="num">{r[f"{name}_us"] / 1e6:,.1f}</td>' for name in RESOURCES
        )
        rows.append(
            f"<tr><td>{escape(r['tenant'])}</td>{_num(r['requests'])}{cells}{_money_cell(r['compute_nano'])}"
            f"{_money_cell(r['kv_nano'])}{seconds}</tr>"
        )
    labels = [charts.RESOURCE_LABELS[r] for r in RESOURCES]
    return (
        heading
        + chart
        + _table(
            [
                "tenant",
                "request-hours",
                *labels,
                "compute",
                "KV memory",
                *(f"{label} s" for label in labels),
            ],
            rows,
        )
        + (
            '<p class="note">The last five columns are the kernel\'s estimated busy seconds of each resource for the '
            "tenant's slots (NoOverlap: resources summed, not overlapped).</p>"
        )
    )


def _reconciliation(data: ReportData) -> str:
    if data.checks.is_empty():
        return "<h2>Reconciliation</h2><p>No hour in this report has been reconciled yet.</p>"
    check_names = sorted(set(data.checks["check_name"].to_list()))
    header = ["hour", "pool", "status", *check_names]
    rows = []
    for inv in data.invoices.iter_rows(named=True):
        mine = data.checks.filter((pl.col("hour") == inv["hour"]) & (pl.col("pool") == inv["pool"]))
        status = (
            '<td class="pass">published</td>'
            if inv["published"]
            else '<td class="fail">held back</td>'
        )
        cells = []
        for name in check_names:
            results = mine.filter(pl.col("check_name") == name)
            if results.is_empty():
                cells.append("<td>-</td>")
            elif results["passed"].all():
                cells.append(
                    f'<td class="pass">pass ({results.height})</td>'
                    if results.height > 1
                    else '<td class="pass">pass</td>'
                )
            else:
                failed = results.filter(~pl.col("passed"))
                css = "fail" if failed["blocking"].any() else "warn"
                cells.append(f'<td class="{css}">fail ({failed.height}/{results.height})</td>')
        rows.append(
            f"<tr><td>{_hour_text(inv['hour'])}</td><td>{escape(inv['pool'])}</td>{status}{''.join(cells)}</tr>"
        )
    failures = data.checks.filter(~pl.col("passed"))
    failure_rows = [
        f"<tr><td>{_hour_text(r['hour'])}</td><td>{escape(r['pool'])}</td><td>{escape(r['replica'] or '-')}</td>"
        f'<td>{escape(r["check_name"])}</td><td class="{"fail" if r["blocking"] else "warn"}">'
        f'{escape(r["severity"])}{" (blocking)" if r["blocking"] else ""}</td><td class="detail">{escape(r["expected"])}</td>'
        f'<td class="detail">{escape(r["observed"])}</td><td class="detail">{escape(r["detail"])}</td></tr>'
        for r in failures.iter_rows(named=True)
    ]
    failed_html = (
        "<h3>What failed</h3>"
        + _table(
            ["hour", "pool", "replica", "check", "severity", "expected", "observed", "detail"],
            failure_rows,
            numeric_from=99,
        )
        if failure_rows
        else "<p>Every check passed.</p>"
    )
    alert_rows = [
        f"<tr><td>{r['raised_at']:%Y-%m-%d %H:%M:%S}</td><td>{escape(r['severity'])}</td><td>{escape(r['kind'])}</td>"
        f"<td>{_hour_text(r['hour']) if r['hour'] else '-'}</td><td>{escape(r['pool'] or '-')}</td>"
        f'<td>{escape(r["replica"] or "-")}</td><td class="detail">{escape(r["detail"])}</td></tr>'
        for r in data.alerts.iter_rows(named=True)
    ]
    alerts_html = (
        (
            "<h3>Alerts raised</h3>"
            + _table(
                ["raised at (UTC)", "severity", "kind", "hour", "pool", "replica", "detail"],
                alert_rows,
                numeric_from=99,
            )
        )
        if alert_rows
        else ""
    )
    return (
        "<h2>Reconciliation</h2>"
        '<p class="intro">Checks of every pool-hour. Sequence, time and money are blocking: an hour that fails one '
        "is held back from the finance views. Plausibility (engine busy time against DCGM) and the unattributed "
        "share warn and page without holding the hour back.</p>"
        + _table(header, rows, numeric_from=99)
        + failed_html
        + alerts_html
    )


def _bottlenecks(data: ReportData) -> str:
    parts = [
        "<h2>Pricing kernel: bottleneck by batch size</h2>"
        '<p class="intro">Each pool\'s deployment priced by the kernel for decode batches of 1 to 256 requests '
        "at a typical context: time on each resource per step (left) and the two step estimates (right): "
        "NoOverlap sums the resources, Overlap takes the slowest. Attribution splits each measured step in "
        "proportion to the NoOverlap work of its slots.</p>"
    ]
    for sweep in data.sweeps:
        ranges = ", ".join(
            f"{charts.RESOURCE_LABELS[r]} for batches {a}-{b}"
            if a != b
            else f"{charts.RESOURCE_LABELS[r]} at batch {a}"
            for r, a, b in sweep.bottleneck_ranges
        )
        parts.append(
            f"<h3>{escape(sweep.title)}</h3>"
            f'<p class="note">Decode at {sweep.context_tokens:,} context tokens ({escape(sweep.context_source)}). '
            f"Bottleneck: {escape(ranges)}.</p>"
            + charts.bottleneck_chart(
                sweep.batches,
                sweep.resource_ms,
                sweep.overlap_ms,
                sweep.nooverlap_ms,
                title=f"{sweep.title}; decode at {sweep.context_tokens:,} context tokens",
            )
        )
    return "".join(parts)


def render_html(data: ReportData) -> str:
    """The whole report page."""
    notes = "".join(f"<li>{escape(n)}</li>" for n in data.notes)
    notes_html = f"<h2>Notes</h2><ul>{notes}</ul>" if notes else ""
    title = f"stepledger report: {data.scope.label}"
    body = (
        f"<h1>{escape(title)}</h1>"
        f'<p class="intro">Warehouse <code>{escape(str(data.warehouse))}</code>; generated '
        f"{data.generated_at:%Y-%m-%d %H:%M} UTC. Amounts are exact sums of integer nano-dollars, shown to the "
        "micro-dollar (hover a number for its nano-dollars).</p>"
        + _summary(data)
        + _costs(data)
        + _line_kinds(data)
        + _top_requests(data)
        + _resources(data)
        + _reconciliation(data)
        + _bottlenecks(data)
        + notes_html
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>{body}</body></html>\n"
    )
