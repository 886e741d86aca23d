"""The report as one self-contained HTML page: inline CSS and SVG, no scripts, no links out."""

from __future__ import annotations

import base64
import csv
import io
from datetime import datetime, timedelta
from html import escape

import numpy as np
import polars as pl

from pipeline.attribution.ledger import LINE_KINDS
from pipeline.report import charts
from pipeline.report.data import ReportData
from pipeline.report.money import usd, usd_per
from pricing import RESOURCES
from schemas.units import NANO_PER_USD, nano_to_usd

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


def _exact_usd(nano: int) -> str:
    return f"{nano_to_usd(nano):f}"


def _download(filename: str, frame: pl.DataFrame) -> str:
    """A link that saves `frame` as a CSV file (the data is in the link: the page stays
    self-contained). Columns ending in _nano get an exact dollar column beside them."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    columns = []
    for column in frame.columns:
        columns.append(column)
        if column.endswith("_nano"):
            columns.append(column.removesuffix("_nano") + "_usd")
    writer.writerow(columns)
    for row in frame.iter_rows(named=True):
        cells: list[object] = []
        for column, value in row.items():
            cells.append(_hour_text(value) if isinstance(value, datetime) else value)
            if column.endswith("_nano"):
                cells.append(_exact_usd(value))
        writer.writerow(cells)
    encoded = base64.b64encode(out.getvalue().encode()).decode()
    return (
        f'<p class="download"><a download="{escape(filename)}" '
        f'href="data:text/csv;base64,{encoded}">Download {escape(filename)}</a></p>'
    )


def tenant_colours(names: list[str]) -> dict[str, str]:
    """A colour per tenant that tells tenants apart and stays the same across the charts:
    tenants in sorted order take the palette, labels in parentheses (idle and the like) greys."""
    labels = sorted(n for n in names if n.startswith("("))
    tenants = sorted(n for n in names if not n.startswith("("))
    colours = {n: charts.GREYS[i % len(charts.GREYS)] for i, n in enumerate(labels)}
    return colours | {n: charts.PALETTE[i % len(charts.PALETTE)] for i, n in enumerate(tenants)}


def _trend(data: ReportData) -> str:
    """Cost per tenant over the report's range: per hour within one day, else per day."""
    published = data.published_lines
    heading = "<h2>Trend per tenant</h2>"
    if published.is_empty():
        return heading + "<p>No published hours in this period.</p>"
    hours = published["hour"]
    first, last = hours.min(), hours.max()
    assert isinstance(first, datetime)
    assert isinstance(last, datetime)
    by_day = (last - first) >= timedelta(days=1) or first.date() != last.date()
    period = pl.col("hour").dt.truncate("1d") if by_day else pl.col("hour")
    trend = (
        published.with_columns(period.alias("period"))
        .group_by("period", "tenant")
        .agg(pl.col("amount_nano").sum())
        .sort("period", "amount_nano", "tenant", descending=[False, True, False])
    )
    periods = sorted(set(trend["period"].to_list()))
    index = {p: i for i, p in enumerate(periods)}
    totals = trend.group_by("tenant").agg(pl.col("amount_nano").sum())
    tenants = totals.sort("amount_nano", "tenant", descending=[True, False])["tenant"].to_list()
    series = {}
    for tenant in tenants:
        values = np.zeros(len(periods))
        for when, amount in (
            trend.filter(pl.col("tenant") == tenant).select("period", "amount_nano").iter_rows()
        ):
            values[index[when]] = amount / NANO_PER_USD
        series[tenant] = values
    label = (lambda p: p.strftime("%Y-%m-%d")) if by_day else _hour_label
    chart = charts.stacked_bars(
        [label(p) for p in periods],
        series,
        ylabel=f"USD per {'day' if by_day else 'hour'} (published)",
        colours=tenant_colours(tenants),
    )
    rows = [
        f"<tr><td>{label(r['period'])}</td><td>{escape(r['tenant'])}</td>{_money_cell(r['amount_nano'])}</tr>"
        for r in trend.iter_rows(named=True)
    ]
    csv_frame = trend.with_columns(
        pl.col("period").dt.strftime("%Y-%m-%d" if by_day else "%Y-%m-%dT%H")
    ).rename({"period": "day" if by_day else "hour"})
    return (
        heading
        + f'<p class="intro">What each tenant\'s published hours cost per UTC {"day" if by_day else "hour"}, '
        f"{label(periods[0])} to {label(periods[-1])}. Negative amounts (a prefix-cache credit) are drawn below "
        "zero.</p>"
        + chart
        + _table(["period", "tenant", "amount"], rows, numeric_from=2)
        + _download("trend_per_tenant.csv", csv_frame)
    )


def _month_to_date(data: ReportData) -> str:
    month = data.month
    heading = "<h2>Month to date and projection</h2>"
    if month is None:
        return heading + "<p>No published hour in this period.</p>"
    frame = month.tenants
    rows = [
        f"<tr><td>{escape(r['tenant'])}</td>{_money_cell(r['amount_nano'])}{_money_cell(r['projected_nano'])}</tr>"
        for r in frame.iter_rows(named=True)
    ]
    total = frame.select(pl.col("amount_nano").sum(), pl.col("projected_nano").sum()).row(0)
    rows.append(
        f'<tr class="total"><td>total</td>{_money_cell(total[0])}{_money_cell(total[1])}</tr>'
    )
    return (
        heading + f'<p class="intro">{month.month:%B %Y} (UTC) to the end of hour '
        f"{_hour_text(month.through - timedelta(hours=1))}: "
        f"{month.published_hours} published hour(s) so far, {month.hours_left} hour(s) left. The projection "
        "adds the hours left at each tenant's average cost per published hour.</p>"
        + _table(["tenant", "month to date", "projected month"], rows)
        + _download(f"month_to_date_{month.month:%Y-%m}.csv", frame)
    )


def _utilisation(data: ReportData) -> str:
    """Per pool: how much of the GPU time it paid for was used, against its target, and the
    GPU-hours the work would need at the target."""
    published = data.invoices.filter(pl.col("published"))
    heading = "<h2>Utilisation and idle per pool</h2>"
    if published.is_empty():
        return heading + "<p>No published hours in this period.</p>"
    lines = data.published_lines
    idle = (
        lines.filter(pl.col("line_kind").is_in(["idle", "headroom"]))
        .group_by("pool")
        .agg(pl.col("amount_nano").sum().alias("idle_nano"))
    )
    pools = (
        published.group_by("pool")
        .agg(
            pl.col("amount_nano").sum().alias("invoice_nano"),
            pl.col("gpus").sum().alias("gpu_hours"),
        )
        .join(idle, on="pool", how="left")
        .with_columns(pl.col("idle_nano").fill_null(0))
        .with_columns(
            (1 - pl.col("idle_nano") / pl.col("invoice_nano")).alias("utilisation"),
            pl.col("pool").replace_strict(data.targets, default=None).alias("target"),
        )
        .with_columns((pl.col("gpu_hours") * pl.col("utilisation")).alias("busy_gpu_hours"))
        .with_columns((pl.col("busy_gpu_hours") / pl.col("target")).alias("gpu_hours_at_target"))
        .sort("pool")
    )
    rows = []
    for r in pools.iter_rows(named=True):
        below = r["target"] is not None and r["utilisation"] < r["target"]
        target = "-" if r["target"] is None else f"{r['target']:.0%}"
        at_target = "-" if r["gpu_hours_at_target"] is None else f"{r['gpu_hours_at_target']:,.2f}"
        rows.append(
            f"<tr><td>{escape(r['pool'])}</td>{_num(r['gpu_hours'])}{_money_cell(r['invoice_nano'])}"
            f"{_money_cell(r['idle_nano'])}"
            f'<td class="num {"warn" if below else "pass"}">{r["utilisation"]:.1%}</td>'
            f'<td class="num">{target}</td><td class="num">{r["busy_gpu_hours"]:,.2f}</td>'
            f'<td class="num">{at_target}</td></tr>'
        )
    return (
        heading
        + '<p class="intro">Of the GPU-hours each pool paid for in its published hours, the share its requests '
        "used (1 &minus; idle and headroom over the invoice), against the pool's target utilization; the last "
        "column is the GPU-hours the same work needs at the target.</p>"
        + _table(
            [
                "pool",
                "GPU-hours",
                "invoice",
                "idle + headroom",
                "utilisation",
                "target",
                "busy GPU-hours",
                "GPU-hours at target",
            ],
            rows,
        )
        + _download("utilisation_per_pool.csv", pools)
    )


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
            values[index[hour]] = amount / NANO_PER_USD
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
        + _download("cost_per_tenant.csv", by_tenant)
        + "<h3>By tenant and feature (published hours)</h3>"
        + _table(
            ["tenant", "feature", *headers_tail],
            _unit_cost_rows(by_feature, ["tenant", "feature"]),
            numeric_from=2,
        )
        + _download("cost_per_feature.csv", by_feature)
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
        + _download("line_kinds_per_hour.csv", wide.sort("hour", "pool", "line_kind"))
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
        + _download("top_requests.csv", data.requests)
    )


def _resources(data: ReportData) -> str:
    frame = data.resources
    heading = (
        "<h3>What each tenant used: SM, HBM, NVLink, NIC, host</h3>"
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
        + _download("resources_per_tenant.csv", frame)
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
        + _download("reconciliation.csv", data.checks)
        + failed_html
        + alerts_html
    )


def _bottlenecks(data: ReportData) -> str:
    parts = [
        "<h3>Bottleneck by batch size</h3>"
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
            f"<h4>{escape(sweep.title)}</h4>"
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
        + _trend(data)
        + _month_to_date(data)
        + _costs(data)
        + _line_kinds(data)
        + _utilisation(data)
        + _top_requests(data)
        + _reconciliation(data)
        + '<h2 id="engineering">Engineering: the pricing kernel</h2>'
        '<p class="intro">For the people who tune the kernel and the pools: how each tenant\'s compute '
        "charge divides over the GPU's resources, and what bounds each pool's steps.</p>"
        + _resources(data)
        + _bottlenecks(data)
        + notes_html
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>{body}</body></html>\n"
    )
