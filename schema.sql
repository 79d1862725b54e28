-- postroom schema, version 1.
--
-- Applied in one transaction when a database is opened for the first time.
-- Every table is prefixed `postroom_` so it can live beside the application's
-- own tables in the same file: domain writes share the transaction.
--
-- Times are unix milliseconds (INTEGER). Payload digests are blake3 (32 bytes).
-- The schema version lives in postroom_meta, not in PRAGMA user_version, which
-- is left to the application (migration tools such as rusqlite_migration use it).

CREATE TABLE postroom_meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;

-- One row per (consumer, source, message_id) ever accepted, until retention
-- deletes completed rows. `id` gives receive order for queued processing.
--
-- Invariants:
--   * status = 'completed' => processed_at IS NOT NULL
--   * status IN ('failed', 'dead') => payload IS NOT NULL and last_error IS NOT NULL
--   * status = 'processing' => lease_until IS NOT NULL and lease_token IS NOT NULL
--   * payload_hash is the digest of the first payload accepted under this key;
--     a later delivery with another digest is quarantined, never merged.
CREATE TABLE postroom_inbox (
    id              INTEGER PRIMARY KEY,
    consumer        TEXT    NOT NULL,
    source          TEXT    NOT NULL,
    message_id      TEXT    NOT NULL,
    status          TEXT    NOT NULL
        CHECK (status IN ('pending', 'processing', 'completed', 'failed', 'dead')),
    payload         BLOB,
    payload_hash    BLOB    NOT NULL CHECK (length(payload_hash) = 32),
    headers         TEXT,
    ordering_key    TEXT,
    attempts        INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error      TEXT,
    received_at     INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    next_attempt_at INTEGER,
    lease_until     INTEGER,
    lease_token     INTEGER,
    processed_at    INTEGER,
    -- 1 when the engine's workers own this message's retries: it was
    -- received (queued) or redriven. 0 when it was delivered inline: the
    -- broker redelivers it, and workers leave it alone.
    queued          INTEGER NOT NULL DEFAULT 0 CHECK (queued IN (0, 1)),
    UNIQUE (consumer, source, message_id)
);

-- What workers may claim, in receive order: queued rows pending, or failed
-- (next_attempt_at is checked while scanning; rows waiting out a backoff are
-- few compared with the backlog).
CREATE INDEX postroom_inbox_due
    ON postroom_inbox (consumer, id)
    WHERE queued = 1 AND status IN ('pending', 'failed');

-- Unfinished rows per ordering key: a row may be claimed only when no
-- earlier row of its key is still pending, processing or failed.
CREATE INDEX postroom_inbox_ordering
    ON postroom_inbox (consumer, ordering_key, id)
    WHERE ordering_key IS NOT NULL AND status IN ('pending', 'processing', 'failed');

-- What is leased: the reaper looks here for expired leases.
CREATE INDEX postroom_inbox_leased
    ON postroom_inbox (lease_until)
    WHERE status = 'processing';

-- What retention deletes.
CREATE INDEX postroom_inbox_done
    ON postroom_inbox (processed_at)
    WHERE status = 'completed';

-- Outgoing messages, committed in the same transaction as the handler that
-- published them. `seq` is commit order; `message_id` is stable across re-sends
-- so a downstream inbox can deduplicate.
CREATE TABLE postroom_outbox (
    seq              INTEGER PRIMARY KEY,
    message_id       TEXT    NOT NULL UNIQUE,
    topic            TEXT    NOT NULL,
    key              TEXT,
    payload          BLOB    NOT NULL,
    headers          TEXT,
    status           TEXT    NOT NULL CHECK (status IN ('pending', 'sent', 'dead')),
    attempts         INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error       TEXT,
    created_at       INTEGER NOT NULL,
    next_attempt_at  INTEGER NOT NULL,
    sent_at          INTEGER,
    cause_consumer   TEXT,
    cause_source     TEXT,
    cause_message_id TEXT
);

-- What the relay reads: pending rows in commit order.
CREATE INDEX postroom_outbox_pending
    ON postroom_outbox (seq)
    WHERE status = 'pending';

-- Pending rows per key: a row is held back while an earlier row of its key
-- waits out a backoff.
CREATE INDEX postroom_outbox_key
    ON postroom_outbox (key, seq)
    WHERE key IS NOT NULL AND status = 'pending';

CREATE INDEX postroom_outbox_sent
    ON postroom_outbox (sent_at)
    WHERE status = 'sent';

-- Deliveries whose id matched a stored message but whose payload digest did
-- not. The stored message is never touched; the newcomer is kept here whole.
-- A redelivery of the same conflicting payload bumps `deliveries` instead of
-- adding a row, so a broker that keeps redelivering cannot grow this table.
CREATE TABLE postroom_conflicts (
    id            INTEGER PRIMARY KEY,
    consumer      TEXT    NOT NULL,
    source        TEXT    NOT NULL,
    message_id    TEXT    NOT NULL,
    stored_hash   BLOB    NOT NULL,
    payload_hash  BLOB    NOT NULL,
    payload       BLOB    NOT NULL,
    headers       TEXT,
    first_seen_at INTEGER NOT NULL,
    last_seen_at  INTEGER NOT NULL,
    deliveries    INTEGER NOT NULL DEFAULT 1,
    UNIQUE (consumer, source, message_id, payload_hash)
);
