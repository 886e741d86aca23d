-- The stepledger warehouse (DuckDB). Every statement is idempotent: pipeline.warehouse applies
-- this file on every read/write connection, so a new warehouse file needs no migration step.
-- Money is BIGINT nano-dollars (1 USD = 1_000_000_000); hours are UTC TIMESTAMP at :00.

-- The GPU-hours each pool paid for in one hour: the total the ledger must add up to.
CREATE TABLE IF NOT EXISTS invoices (
    hour              TIMESTAMP NOT NULL,
    pool              VARCHAR   NOT NULL,
    gpus              INTEGER   NOT NULL,
    usd_per_gpu_hour  DOUBLE    NOT NULL,
    amount_nano       BIGINT    NOT NULL,
    PRIMARY KEY (hour, pool)
);

-- The hour's invoice split into lines per tenant and feature; per (hour, pool) the lines sum
-- to invoices.amount_nano exactly.
CREATE TABLE IF NOT EXISTS ledger_lines (
    hour            TIMESTAMP NOT NULL,
    pool            VARCHAR   NOT NULL,
    tenant          VARCHAR   NOT NULL,
    feature         VARCHAR   NOT NULL,
    line_kind       VARCHAR   NOT NULL CHECK (line_kind IN
                        ('usage', 'idle', 'headroom', 'unattributed', 'platform_retry', 'cache_credit')),
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
    output_tokens BIGINT    NOT NULL
);

-- One row per reconciliation check of an hour (per replica where the check is per replica).
-- A failed blocking check holds the hour back from the finance views.
CREATE TABLE IF NOT EXISTS reconciliation (
    hour        TIMESTAMP NOT NULL,
    pool        VARCHAR   NOT NULL,
    replica     VARCHAR,
    check_name  VARCHAR   NOT NULL,
    passed      BOOLEAN   NOT NULL,
    expected    VARCHAR   NOT NULL,
    observed    VARCHAR   NOT NULL,
    detail      VARCHAR   NOT NULL,
    severity    VARCHAR   NOT NULL DEFAULT 'ERROR' CHECK (severity IN ('ERROR', 'WARN')),
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
    -- pipeline.alerts.dedup_key(kind, hour, pool, replica, finding): one row per finding and hour.
    dedupe_key VARCHAR
);

-- Gateway context of each request. API keys are never stored: api_key_id is their keyed hash.
CREATE TABLE IF NOT EXISTS request_context (
    request_id  VARCHAR   NOT NULL PRIMARY KEY,
    tenant      VARCHAR   NOT NULL,
    feature     VARCHAR   NOT NULL,
    api_key_id  VARCHAR   NOT NULL,
    retry_of    VARCHAR,
    retry_cause VARCHAR   CHECK (retry_cause IN ('client_timeout', 'platform_timeout')),
    received_at TIMESTAMP NOT NULL,
    source_file VARCHAR   NOT NULL
);

-- Gateway files loaded, with a content hash: an unchanged file is not loaded again.
CREATE TABLE IF NOT EXISTS context_files (
    path      VARCHAR   NOT NULL PRIMARY KEY,
    sha256    VARCHAR   NOT NULL,
    requests  BIGINT    NOT NULL,
    loaded_at TIMESTAMP NOT NULL
);

-- Every segment file seen in an outbox, by its path relative to the data directory and its
-- content. status 'ingested' or 'duplicate' (the same bytes, or only steps of a segment id
-- already ingested, from another delivery).
CREATE TABLE IF NOT EXISTS segment_files (
    path        VARCHAR   NOT NULL,
    sha256      VARCHAR   NOT NULL,
    bytes       BIGINT    NOT NULL,
    status      VARCHAR   NOT NULL CHECK (status IN ('ingested', 'duplicate')),
    batch_id    VARCHAR   NOT NULL,
    ingested_at TIMESTAMP NOT NULL,
    PRIMARY KEY (path, sha256)
);

-- One row per distinct segment ingested (schemas.tables.SEGMENTS plus its content hash).
CREATE TABLE IF NOT EXISTS segments (
    path             VARCHAR NOT NULL,
    segment_id       VARCHAR NOT NULL PRIMARY KEY,
    sha256           VARCHAR NOT NULL,
    format_version   INTEGER NOT NULL,
    pool             VARCHAR NOT NULL,
    replica          VARCHAR NOT NULL,
    engine_name      VARCHAR NOT NULL,
    engine_version   VARCHAR NOT NULL,
    driver_version   VARCHAR NOT NULL,
    model            VARCHAR NOT NULL,
    gpu_type         VARCHAR NOT NULL,
    gpus_per_replica INTEGER NOT NULL,
    kv_block_size    INTEGER NOT NULL,
    mono_anchor_ns   BIGINT  NOT NULL,
    wall_anchor_ns   BIGINT  NOT NULL,
    first_seq        BIGINT  NOT NULL,
    last_seq         BIGINT  NOT NULL,
    steps            BIGINT  NOT NULL,
    dropped_steps    BIGINT  NOT NULL,
    bytes            BIGINT  NOT NULL,
    batch_id         VARCHAR NOT NULL
);

-- Damage the decoder found (schemas.tables.DAMAGE), and the ingest batch that found it.
CREATE TABLE IF NOT EXISTS damage (
    path        VARCHAR NOT NULL,
    kind        VARCHAR NOT NULL,
    byte_offset BIGINT,
    byte_length BIGINT,
    first_seq   BIGINT,
    last_seq    BIGINT,
    detail      VARCHAR NOT NULL,
    batch_id    VARCHAR NOT NULL
);

-- Steps the recorder dropped on purpose (schemas.tables.DROPS).
CREATE TABLE IF NOT EXISTS drops (
    pool      VARCHAR NOT NULL,
    replica   VARCHAR NOT NULL,
    first_seq BIGINT  NOT NULL,
    last_seq  BIGINT  NOT NULL,
    steps     BIGINT  NOT NULL,
    batch_id  VARCHAR NOT NULL
);
