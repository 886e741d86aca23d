-- The stepledger warehouse: a DuckLake (Parquet data files under warehouse/data/, catalog in
-- warehouse/catalog.sqlite). Every statement is idempotent: pipeline.storage.warehouse applies this
-- file, in one transaction, to a warehouse whose schema_version does not record this file's
-- sha256 (a new one, or one of an earlier layout). Each table's Arrow schema is in schemas/tables.py.
-- Money is BIGINT nano-dollars (1 USD = 1_000_000_000); hours are UTC TIMESTAMP at :00.
-- DuckLake has no primary keys or CHECK constraints: pipeline.storage.warehouse refuses rows that
-- would break them (an hour outside the one replaced, an unknown line kind or severity).

-- The layout's version; pipeline.storage.warehouse refuses a warehouse of another version.
-- schema_sha256: the sha256 of the schema.sql last applied (null before it was recorded); a
-- writing connection that finds its own file's applies nothing.
CREATE TABLE IF NOT EXISTS schema_version (
    version       INTEGER   NOT NULL,
    applied_at    TIMESTAMP NOT NULL,
    schema_sha256 VARCHAR
);
ALTER TABLE schema_version ADD COLUMN IF NOT EXISTS schema_sha256 VARCHAR;

-- The GPU-hours each pool paid for in one hour: the total the ledger must add up to.
-- One row per (hour, pool).
CREATE TABLE IF NOT EXISTS invoices (
    hour              TIMESTAMP NOT NULL,
    pool              VARCHAR   NOT NULL,
    gpus              INTEGER   NOT NULL,
    usd_per_gpu_hour  DOUBLE    NOT NULL,
    amount_nano       BIGINT    NOT NULL
);

-- The hour's invoice split into lines per tenant and feature; per (hour, pool) the lines sum
-- to invoices.amount_nano exactly. line_kind is one of usage, idle, headroom, unattributed,
-- platform_retry, cache_credit.
CREATE TABLE IF NOT EXISTS ledger_lines (
    hour            TIMESTAMP NOT NULL,
    pool            VARCHAR   NOT NULL,
    tenant          VARCHAR   NOT NULL,
    feature         VARCHAR   NOT NULL,
    line_kind       VARCHAR   NOT NULL,
    amount_nano     BIGINT    NOT NULL,
    requests        BIGINT    NOT NULL,
    new_tokens      BIGINT    NOT NULL,
    cached_tokens   BIGINT    NOT NULL,
    weights_version VARCHAR   NOT NULL,
    policy_version  VARCHAR   NOT NULL
);

-- What each request cost in the hour (a request running across an hour boundary has a row in
-- each hour it ran in).
CREATE TABLE IF NOT EXISTS request_costs (
    hour          TIMESTAMP NOT NULL,
    pool          VARCHAR   NOT NULL,
    request_id    VARCHAR   NOT NULL,
    tenant        VARCHAR,
    feature       VARCHAR,
    api_key_id    VARCHAR,
    compute_nano  BIGINT    NOT NULL,
    kv_nano       BIGINT    NOT NULL,
    amount_nano   BIGINT    NOT NULL,
    steps         BIGINT    NOT NULL,
    new_tokens    BIGINT    NOT NULL,
    cached_tokens BIGINT    NOT NULL,
    prompt_tokens BIGINT    NOT NULL,
    output_tokens BIGINT    NOT NULL,
    -- The ledger line the request's charge is on: usage, unattributed or platform_retry
    -- (the capacity owner pays a platform-caused retry). Null in hours billed before the
    -- column existed; re-running such an hour fills it.
    line_kind     VARCHAR
);
ALTER TABLE request_costs ADD COLUMN IF NOT EXISTS line_kind VARCHAR;

-- One row per reconciliation check of an hour (per replica where the check is per replica).
-- A failed blocking check holds the hour back from the finance views. severity is ERROR or
-- WARN. Re-billing an hour deletes its checks: the new charges are unchecked until its
-- reconciliation runs again.
CREATE TABLE IF NOT EXISTS reconciliation (
    hour        TIMESTAMP NOT NULL,
    pool        VARCHAR   NOT NULL,
    replica     VARCHAR,
    check_name  VARCHAR   NOT NULL,
    passed      BOOLEAN   NOT NULL,
    expected    VARCHAR   NOT NULL,
    observed    VARCHAR   NOT NULL,
    detail      VARCHAR   NOT NULL,
    severity    VARCHAR   NOT NULL DEFAULT 'ERROR',
    blocking    BOOLEAN   NOT NULL DEFAULT TRUE,
    -- A short stable code of what failed ('' when passed); it identifies the alert.
    finding     VARCHAR   NOT NULL DEFAULT '',
    checked_at  TIMESTAMP NOT NULL DEFAULT current_timestamp
);

CREATE TABLE IF NOT EXISTS alerts (
    raised_at  TIMESTAMP NOT NULL,
    severity   VARCHAR   NOT NULL,
    kind       VARCHAR   NOT NULL,
    hour       TIMESTAMP,
    pool       VARCHAR,
    replica    VARCHAR,
    detail     VARCHAR   NOT NULL,
    -- pipeline.reconcile.alerts.dedup_key(kind, hour, pool, replica, finding): one row per finding and hour.
    dedup_key VARCHAR
);

-- Every re-billing of an hour that had been billed before: per tenant, what the hour cost
-- before and after, and why it changed. previous_snapshot is the warehouse snapshot that
-- still holds the replaced charges (`AT (VERSION => previous_snapshot)`).
CREATE TABLE IF NOT EXISTS reruns (
    rerun_at          TIMESTAMPTZ NOT NULL,
    hour              TIMESTAMP   NOT NULL,
    pool              VARCHAR     NOT NULL,
    tenant            VARCHAR     NOT NULL,
    previous_nano     BIGINT      NOT NULL,
    amount_nano       BIGINT      NOT NULL,
    delta_nano        BIGINT      NOT NULL,
    reason            VARCHAR     NOT NULL,
    previous_snapshot BIGINT      NOT NULL
);

-- Months finance has closed: the snapshot frozen for their invoices, and when.
CREATE TABLE IF NOT EXISTS closed_months (
    month      DATE        NOT NULL,
    snapshot   BIGINT      NOT NULL,
    closed_at  TIMESTAMPTZ NOT NULL
);

-- The invoice numbers of closed months: one per (month, tenant), numbered in closing order.
CREATE TABLE IF NOT EXISTS invoice_numbers (
    month       DATE    NOT NULL,
    tenant      VARCHAR NOT NULL,
    invoice_id  VARCHAR NOT NULL,
    amount_nano BIGINT  NOT NULL
);

-- Provisional figures (pipeline.live): each request's usage priced from the segments closed
-- so far, by the hourly path's kernel, weights and allocator, one row per request and pricing
-- batch (a request running through several batches has a row in each; the views sum them).
-- Usage only: idle and headroom are known when the hour closes. The hourly ledger supersedes
-- them; they stay, so `provisional_vs_final` can show what the hour changed.
CREATE TABLE IF NOT EXISTS provisional_request_costs (
    hour          TIMESTAMP NOT NULL,
    pool          VARCHAR   NOT NULL,
    request_id    VARCHAR   NOT NULL,
    tenant        VARCHAR,
    feature       VARCHAR,
    api_key_id    VARCHAR,
    compute_nano  BIGINT    NOT NULL,
    kv_nano       BIGINT    NOT NULL,
    amount_nano   BIGINT    NOT NULL,
    steps         BIGINT    NOT NULL,
    new_tokens    BIGINT    NOT NULL,
    cached_tokens BIGINT    NOT NULL,
    prompt_tokens BIGINT    NOT NULL,
    output_tokens BIGINT    NOT NULL,
    line_kind     VARCHAR   NOT NULL,
    -- The UTC end of the request's last step in the batch (ns): how fresh the figure is.
    last_step_end_utc_ns BIGINT NOT NULL,
    batch_id      VARCHAR   NOT NULL,
    priced_at     TIMESTAMP NOT NULL
);

-- The provisional usage lines of each pricing batch (ledger_lines' usage, unattributed and
-- platform_retry kinds, as the hourly ledger labels them).
CREATE TABLE IF NOT EXISTS provisional_lines (
    hour            TIMESTAMP NOT NULL,
    pool            VARCHAR   NOT NULL,
    tenant          VARCHAR   NOT NULL,
    feature         VARCHAR   NOT NULL,
    line_kind       VARCHAR   NOT NULL,
    amount_nano     BIGINT    NOT NULL,
    new_tokens      BIGINT    NOT NULL,
    cached_tokens   BIGINT    NOT NULL,
    weights_version VARCHAR   NOT NULL,
    policy_version  VARCHAR   NOT NULL,
    batch_id        VARCHAR   NOT NULL,
    priced_at       TIMESTAMP NOT NULL
);

-- Segments the live path has priced, committed in the same snapshot as the figures priced
-- from them: a restarted live path never prices a segment twice, nor skips one.
CREATE TABLE IF NOT EXISTS live_segments (
    path       VARCHAR   NOT NULL,
    segment_id VARCHAR   NOT NULL,
    pool       VARCHAR   NOT NULL,
    replica    VARCHAR   NOT NULL,
    steps      BIGINT    NOT NULL,
    batch_id   VARCHAR   NOT NULL,
    priced_at  TIMESTAMP NOT NULL
);

-- Corrections of closed months: an hour of a closed month billed again changes what its
-- tenants owe, but the issued invoice (invoice_numbers) is never changed. Each tenant's change
-- (amount_nano = new - previous: positive a debit, negative a credit) is carried on its
-- invoice of invoice_month, the first month after charge_month not closed when the hour was
-- billed again. corrects_invoice_id is the issued invoice of charge_month (null if the tenant
-- had none); previous_snapshot holds the charges replaced.
CREATE TABLE IF NOT EXISTS invoice_adjustments (
    recorded_at         TIMESTAMPTZ NOT NULL,
    hour                TIMESTAMP   NOT NULL,
    pool                VARCHAR     NOT NULL,
    tenant              VARCHAR     NOT NULL,
    charge_month        DATE        NOT NULL,
    invoice_month       DATE        NOT NULL,
    corrects_invoice_id VARCHAR,
    amount_nano         BIGINT      NOT NULL,
    reason              VARCHAR     NOT NULL,
    previous_snapshot   BIGINT      NOT NULL
);

-- What each published pool-hour held when it was published (pipeline.storage.integrity): a
-- digest of its invoices, ledger lines and request costs (rows in one canonical order and
-- encoding), written in the transaction that publishes the hour. A re-run verifies it before
-- replacing the hour.
CREATE TABLE IF NOT EXISTS published_digests (
    hour        TIMESTAMP NOT NULL,
    pool        VARCHAR   NOT NULL,
    rows_sha256 VARCHAR   NOT NULL
);

-- The sha256 of each data file holding a published pool-hour's rows (path relative to the
-- warehouse's data directory): finance connections verify every such file they read.
CREATE TABLE IF NOT EXISTS published_files (
    hour       TIMESTAMP NOT NULL,
    pool       VARCHAR   NOT NULL,
    table_name VARCHAR   NOT NULL,
    path       VARCHAR   NOT NULL,
    sha256     VARCHAR   NOT NULL
);
