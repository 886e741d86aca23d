-- The pipeline's own bookkeeping (DuckDB file pipeline.duckdb): what it ingested and the
-- gateway context it loaded. Finance never reads it (the ledger is in the DuckLake warehouse,
-- sql/schema.sql), so a finance session never holds this file. Idempotent; applied by
-- pipeline.storage.warehouse to a state whose state_schema does not record this file's sha256
-- (a new one, or one an earlier release made). Arrow schemas in schemas/tables.py.

-- The sha256 of the pipeline_state.sql last applied: a writing connection that finds its own
-- file's applies nothing (on PostgreSQL, replacing the view below locks out every other
-- process's reads of it).
CREATE TABLE IF NOT EXISTS state_schema (
    sha256     VARCHAR   NOT NULL,
    applied_at TIMESTAMP NOT NULL
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

-- Segments whose wall-clock anchor stepped away from the monotonic clock of the replica's
-- previous segment (same boot: earlier sequence numbers, earlier monotonic anchor). Their steps
-- are placed by the previous segment's clock shift (placed_shift_ns, UTC = monotonic + shift);
-- jump_ns is how far the header's wall clock was off. first_start_utc_ns: the placed UTC start
-- of the segment's first step (the hour the finding belongs to).
CREATE TABLE IF NOT EXISTS clock_jumps (
    segment_id          VARCHAR NOT NULL PRIMARY KEY,
    path                VARCHAR NOT NULL,
    pool                VARCHAR NOT NULL,
    replica             VARCHAR NOT NULL,
    first_seq           BIGINT  NOT NULL,
    previous_segment_id VARCHAR NOT NULL,
    placed_shift_ns     BIGINT  NOT NULL,
    jump_ns             BIGINT  NOT NULL,
    first_start_utc_ns  BIGINT  NOT NULL,
    batch_id            VARCHAR NOT NULL
);

-- Every lake file ingest wrote (path relative to the lake) and its content hash: attribution
-- refuses a file whose bytes differ from what was written.
CREATE TABLE IF NOT EXISTS lake_files (
    path     VARCHAR NOT NULL PRIMARY KEY,
    sha256   VARCHAR NOT NULL,
    batch_id VARCHAR NOT NULL
);

-- Pages owed to on-call (pipeline.reconcile.alerts): recorded before any delivery is tried, retried with
-- backoff until the sink accepts each one, once per dedup_key. delivered_at NULL: still owed.
CREATE TABLE IF NOT EXISTS alert_outbox (
    dedup_key       VARCHAR   NOT NULL PRIMARY KEY,
    alert           VARCHAR   NOT NULL,
    enqueued_at     TIMESTAMP NOT NULL,
    attempts        BIGINT    NOT NULL,
    next_attempt_at TIMESTAMP NOT NULL,
    last_error      VARCHAR,
    delivered_at    TIMESTAMP
);

-- Sequence ranges missing between consecutive ingested segments of a replica.
CREATE OR REPLACE VIEW sequence_gaps AS
SELECT pool, replica, first_missing_seq, last_missing_seq,
       last_missing_seq - first_missing_seq + 1 AS missing_steps
FROM (
    SELECT pool, replica,
           max(last_seq) OVER (PARTITION BY pool, replica ORDER BY first_seq
                               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) + 1 AS first_missing_seq,
           first_seq - 1 AS last_missing_seq
    FROM segments
) AS spans
WHERE first_missing_seq IS NOT NULL AND last_missing_seq >= first_missing_seq;
