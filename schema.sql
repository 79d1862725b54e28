-- postroom schema, version 12.
--
-- Applied in one transaction when a database is opened for the first time.
-- Every statement is `IF NOT EXISTS`: the migration from version 1 renames
-- the old inbox away and runs this file again to create what is missing.
-- Every table is prefixed `postroom_` so it can live beside the application's
-- own tables in the same file: domain writes share the transaction.
--
-- Times are unix milliseconds (INTEGER). Payload digests are blake3 (32 bytes).
-- The schema version lives in postroom_meta, not in PRAGMA user_version, which
-- is left to the application (migration tools such as rusqlite_migration use it).

CREATE TABLE IF NOT EXISTS postroom_meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;

-- One row per (consumer, source, message_id) ever accepted, until retention
-- deletes completed rows. `id` gives receive order for queued processing.
-- The key is unique through postroom_inbox_keys (below), which triggers keep
-- in step with this table: a second row with a known key fails its insert.
--
-- Invariants:
--   * status = 'completed' => processed_at IS NOT NULL
--   * status IN ('failed', 'dead') => payload IS NOT NULL and last_error IS NOT NULL
--   * status = 'processing' => lease_until IS NOT NULL and lease_token IS NOT NULL
--   * payload_hash is the digest of the first payload accepted under this key;
--     a later delivery with another digest is quarantined, never merged.
--
-- next_attempt_at holds a time only while a row waits: a retry's backoff,
-- or a claim handed back after a storage error. A row due at once
-- (received, redriven, an attempt cut short) has NULL there, not "now": a
-- clock set back later (an RTC kept in local time, corrected by NTP after
-- boot) must not hold it, and its ordering key, until the clock reads that
-- time again. (Files written before version 5 hold "now" there.)
-- `seq` and `seq_stream` (schema version 6): the message's sequence number
-- in its sequence stream (`Message::with_sequence`), both NULL for a
-- message without one; see postroom_watermarks. They are laid out as
-- `ALTER TABLE … ADD COLUMN` writes them into a migrated file's schema, so
-- that a migrated file's schema reads the same as a new one's.
CREATE TABLE IF NOT EXISTS postroom_inbox (
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
    queued          INTEGER NOT NULL DEFAULT 0 CHECK (queued IN (0, 1))
, seq INTEGER CHECK (seq IS NULL OR seq >= 1), seq_stream TEXT);

-- The inbox's key, with what a redelivery of a completed message needs to
-- be answered from this one B-tree: which row, the first 16 bytes of its
-- payload digest, and whether it completed. A UNIQUE index on the inbox
-- would hold the key too, but answering from it means a second descent
-- into the inbox table for the digest and status, a page read of its own
-- at millions of rows (schema version 1 did that).
--
-- A 16-byte digest prefix tells a duplicate from a conflict: two payloads
-- sharing it by chance take 2^64 tries even for a sender choosing both,
-- and the worst case is a conflict answered as a duplicate (dropped, never
-- applied twice). Every other decision reads the row and its whole digest.
--
-- Invariant (kept by the triggers below, checked by `postroom check`):
-- exactly one row here per inbox row, with the same key, inbox_id = its id,
-- digest = substr(payload_hash, 1, 16), completed = (status = 'completed');
-- and besides those, only entries of deleted completed rows whose key is in
-- postroom_retired_keys (below), until retention deletes them.
--
-- Statements on postroom_inbox must not use INSERT OR IGNORE / OR REPLACE:
-- the outer conflict policy would override the triggers' own. The engine
-- refuses to open a file missing one of these triggers.
CREATE TABLE IF NOT EXISTS postroom_inbox_keys (
    consumer   TEXT    NOT NULL,
    source     TEXT    NOT NULL,
    message_id TEXT    NOT NULL,
    inbox_id   INTEGER NOT NULL,
    digest     BLOB    NOT NULL CHECK (length(digest) = 16),
    completed  INTEGER NOT NULL CHECK (completed IN (0, 1)),
    PRIMARY KEY (consumer, source, message_id)
) WITHOUT ROWID;

-- Keys of completed rows that retention deleted, whose key entries are
-- still in postroom_inbox_keys. Retention deletes the rows in the order
-- they completed, and their keys are random: deleting each key entry with
-- its row rewrote one random leaf of the key table per row, 93% of what
-- retention wrote to the WAL (277 pages per 256 rows at a million rows).
-- Appending here is sequential; retention then deletes up to 131,072 of
-- these key entries at a time in key order, when their neighbours share
-- leaves, and clears the rows it read (`retired.rs`). At a million rows
-- that writes 68 pages per 256 rows in all: 22.7 for the rows, 41.7 for
-- their entries, 4.0 for the notes (277 with the entries deleted at once).
--
-- An entry waiting here is still a completed key: a redelivery with its
-- payload is answered as a duplicate, one with another payload finds no
-- row and is taken as a new message (the entry is dropped first). Both
-- answers are allowed once retention has passed. A retention pass (reaper
-- or `postroom cleanup`) that runs to its end leaves none waiting; one cut
-- short (shutdown, crash, error) leaves them to the next.
--
-- AUTOINCREMENT: `seq` is never reused, so clearing `seq <= n` after
-- reading up to n cannot clear a key appended since.
CREATE TABLE IF NOT EXISTS postroom_retired_keys (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer   TEXT NOT NULL,
    source     TEXT NOT NULL,
    message_id TEXT NOT NULL
);

CREATE TRIGGER IF NOT EXISTS postroom_inbox_key_insert
AFTER INSERT ON postroom_inbox
BEGIN
    INSERT INTO postroom_inbox_keys (consumer, source, message_id, inbox_id, digest, completed)
    VALUES (NEW.consumer, NEW.source, NEW.message_id, NEW.id,
            substr(NEW.payload_hash, 1, 16), NEW.status = 'completed');
END;

-- Only a change into or out of 'completed' touches the key row: a message
-- completed by the insert that stored it (inline, first attempt) pays no
-- second write; one completed later (queued, or after a failed attempt)
-- pays one.
CREATE TRIGGER IF NOT EXISTS postroom_inbox_key_status
AFTER UPDATE OF status ON postroom_inbox
WHEN (OLD.status = 'completed') <> (NEW.status = 'completed')
BEGIN
    UPDATE postroom_inbox_keys SET completed = (NEW.status = 'completed')
    WHERE consumer = NEW.consumer AND source = NEW.source AND message_id = NEW.message_id;
END;

-- A deleted row that never completed (a dead letter past dead_retention)
-- frees its key at once.
CREATE TRIGGER IF NOT EXISTS postroom_inbox_key_delete
AFTER DELETE ON postroom_inbox
WHEN OLD.status <> 'completed'
BEGIN
    DELETE FROM postroom_inbox_keys
    WHERE consumer = OLD.consumer AND source = OLD.source AND message_id = OLD.message_id;
END;

-- A deleted completed row (retention) leaves its key entry behind and
-- notes the key in postroom_retired_keys instead; see there why.
CREATE TRIGGER IF NOT EXISTS postroom_inbox_key_retire
AFTER DELETE ON postroom_inbox
WHEN OLD.status = 'completed'
BEGIN
    INSERT INTO postroom_retired_keys (consumer, source, message_id)
    VALUES (OLD.consumer, OLD.source, OLD.message_id);
END;

-- A row's identity and first digest are fixed for its life.
CREATE TRIGGER IF NOT EXISTS postroom_inbox_key_fixed
BEFORE UPDATE OF id, consumer, source, message_id, payload_hash ON postroom_inbox
WHEN NEW.id IS NOT OLD.id OR NEW.consumer IS NOT OLD.consumer OR NEW.source IS NOT OLD.source
  OR NEW.message_id IS NOT OLD.message_id OR NEW.payload_hash IS NOT OLD.payload_hash
BEGIN
    SELECT RAISE(ABORT, 'postroom_inbox: a row''s id, key and payload digest never change');
END;

-- What workers may claim of the rows without an ordering key, in receive
-- order: queued rows pending, or failed (next_attempt_at is checked while
-- scanning; rows waiting out a backoff are few compared with the backlog).
-- Rows with a key are found through postroom_inbox_heads instead (schema
-- version 7; before, this index held them too, and the due query walked a
-- held key's whole backlog on every batch).
CREATE INDEX IF NOT EXISTS postroom_inbox_due
    ON postroom_inbox (consumer, id)
    WHERE queued = 1 AND status IN ('pending', 'failed') AND ordering_key IS NULL;

-- The head of each ordering key (schema version 7): the lowest id of its
-- unfinished rows (pending, processing or failed), the only row of the key
-- that may run. The due query reads heads, never the rows behind them, so
-- a key held back by a failing head costs it one row however long its
-- backlog. Kept by the triggers below, in the transaction that changes
-- the inbox, whatever changes it (checked by `postroom check`).
CREATE TABLE IF NOT EXISTS postroom_inbox_heads (
    consumer     TEXT    NOT NULL,
    ordering_key TEXT    NOT NULL,
    head_id      INTEGER NOT NULL,
    PRIMARY KEY (consumer, ordering_key)
) WITHOUT ROWID;

-- Heads in receive order, for the due query.
CREATE INDEX IF NOT EXISTS postroom_inbox_heads_id
    ON postroom_inbox_heads (consumer, head_id);

-- A new unfinished row of a key: the head unless the key has an earlier one.
CREATE TRIGGER IF NOT EXISTS postroom_inbox_head_insert
AFTER INSERT ON postroom_inbox
WHEN NEW.ordering_key IS NOT NULL AND NEW.status IN ('pending', 'processing', 'failed')
BEGIN
    INSERT INTO postroom_inbox_heads (consumer, ordering_key, head_id)
    VALUES (NEW.consumer, NEW.ordering_key, NEW.id)
    ON CONFLICT (consumer, ordering_key) DO UPDATE SET head_id = excluded.head_id
    WHERE excluded.head_id < head_id;
END;

-- A row finishes (completed, dead) or comes back (redriven): its key's
-- head is looked up again, one step down postroom_inbox_ordering (ORDER BY
-- … LIMIT 1: min() in a subquery loses SQLite's min optimisation and reads
-- every unfinished row of the key, which made draining a key quadratic).
CREATE TRIGGER IF NOT EXISTS postroom_inbox_head_status
AFTER UPDATE OF status ON postroom_inbox
WHEN NEW.ordering_key IS NOT NULL AND OLD.ordering_key IS NEW.ordering_key
  AND (OLD.status IN ('pending', 'processing', 'failed'))
      <> (NEW.status IN ('pending', 'processing', 'failed'))
BEGIN
    DELETE FROM postroom_inbox_heads
    WHERE consumer = NEW.consumer AND ordering_key = NEW.ordering_key;
    INSERT INTO postroom_inbox_heads (consumer, ordering_key, head_id)
    SELECT consumer, ordering_key, id FROM postroom_inbox
    WHERE consumer = NEW.consumer AND ordering_key = NEW.ordering_key
      AND status IN ('pending', 'processing', 'failed')
    ORDER BY id LIMIT 1;
END;

-- A row's key changed (only by hand: postroom never does): both keys'
-- heads are looked up again.
CREATE TRIGGER IF NOT EXISTS postroom_inbox_head_rekey
AFTER UPDATE OF ordering_key ON postroom_inbox
WHEN OLD.ordering_key IS NOT NEW.ordering_key
BEGIN
    DELETE FROM postroom_inbox_heads
    WHERE consumer = OLD.consumer AND ordering_key IN (OLD.ordering_key, NEW.ordering_key);
    INSERT INTO postroom_inbox_heads (consumer, ordering_key, head_id)
    SELECT consumer, ordering_key, id FROM postroom_inbox
    WHERE consumer = OLD.consumer AND ordering_key = OLD.ordering_key
      AND status IN ('pending', 'processing', 'failed')
    ORDER BY id LIMIT 1;
    INSERT INTO postroom_inbox_heads (consumer, ordering_key, head_id)
    SELECT consumer, ordering_key, id FROM postroom_inbox
    WHERE consumer = NEW.consumer AND ordering_key = NEW.ordering_key
      AND status IN ('pending', 'processing', 'failed')
    ORDER BY id LIMIT 1;
END;

-- An unfinished row deleted (by hand, or an operator's tool): its key's
-- head is looked up again.
CREATE TRIGGER IF NOT EXISTS postroom_inbox_head_delete
AFTER DELETE ON postroom_inbox
WHEN OLD.ordering_key IS NOT NULL AND OLD.status IN ('pending', 'processing', 'failed')
BEGIN
    DELETE FROM postroom_inbox_heads
    WHERE consumer = OLD.consumer AND ordering_key = OLD.ordering_key;
    INSERT INTO postroom_inbox_heads (consumer, ordering_key, head_id)
    SELECT consumer, ordering_key, id FROM postroom_inbox
    WHERE consumer = OLD.consumer AND ordering_key = OLD.ordering_key
      AND status IN ('pending', 'processing', 'failed')
    ORDER BY id LIMIT 1;
END;

-- Rows of a key in progress (schema version 7): a redriven head must not
-- run beside a later row of its key that is running. Claimed rows only
-- (effectful consumers), so few.
CREATE INDEX IF NOT EXISTS postroom_inbox_busy
    ON postroom_inbox (consumer, ordering_key)
    WHERE status = 'processing' AND ordering_key IS NOT NULL;

-- Unfinished rows per ordering key: a row may be claimed only when no
-- earlier row of its key is still pending, processing or failed.
CREATE INDEX IF NOT EXISTS postroom_inbox_ordering
    ON postroom_inbox (consumer, ordering_key, id)
    WHERE ordering_key IS NOT NULL AND status IN ('pending', 'processing', 'failed');

-- What is leased: the reaper looks here for expired leases.
CREATE INDEX IF NOT EXISTS postroom_inbox_leased
    ON postroom_inbox (lease_until)
    WHERE status = 'processing';

-- Completed rows have no index of their own (schema version 11; before,
-- postroom_inbox_done, by completion time, cost every message an entry):
-- retention walks the inbox in id order from where its last pass stopped,
-- kept in postroom_meta (`retention_frontier`, `retention_swept_at`,
-- `retention_stopped_at`; see src/store/sweep.rs).

-- What dead_retention deletes (schema version 5): without it each batch
-- scanned the whole inbox for dead rows, inside the writer. Dead letters
-- are few, so it costs nothing on the delivery path.
CREATE INDEX IF NOT EXISTS postroom_inbox_dead
    ON postroom_inbox (updated_at)
    WHERE status = 'dead';

-- Dead rows with an ordering key, per key in receive order (schema
-- version 9): under strict order (`Builder::strict_order`) a dead row
-- holds the rows of its key behind it, and the due query probes here for
-- each head it considers (one step; dead rows are few, so it costs the
-- normal path nothing but an entry per keyed dead letter).
CREATE INDEX IF NOT EXISTS postroom_inbox_dead_keys
    ON postroom_inbox (consumer, ordering_key, id)
    WHERE status = 'dead' AND ordering_key IS NOT NULL;

-- Rows waiting for a redelivery (schema version 9): failed inline, so no
-- worker retries them (`queued = 0`); only their sender's redelivery
-- revives them. Listed so that the live gauges count them without a pass
-- over the inbox; an inline failure is rare, so the index is small and
-- the delivery path pays an entry only for those.
CREATE INDEX IF NOT EXISTS postroom_inbox_redelivery
    ON postroom_inbox (consumer, updated_at)
    WHERE status = 'failed' AND queued = 0;

-- Sequenced rows by stream and sequence (schema version 6): a new message
-- whose sequence a retained row of another id holds is a conflict (a
-- counter that went back). Partial: rows without a sequence pay nothing.
CREATE INDEX IF NOT EXISTS postroom_inbox_seq
    ON postroom_inbox (consumer, seq_stream, seq)
    WHERE seq IS NOT NULL;

-- Per (consumer, sequence stream): every sequence below `settled_below`
-- has settled (completed or dead) — the watermark is settled_below - 1;
-- sequences start at 1, so a new stream's watermark is 0 —
-- and postroom_watermark_settled holds the settled sequences above it
-- while there are gaps. A message whose row retention deleted is answered
-- from here: a sequence below settled_below, or one listed above it with
-- the same key and payload digest, is a duplicate. `highest` is the
-- highest sequence stored; `unrecorded` counts settled sequences that
-- were neither listed (more than 4096 above the watermark) nor kept in a
-- run (it already had 4096 runs, postroom_watermark_runs): the watermark
-- cannot pass such a sequence, and a redelivery of it after retention is
-- taken as new (as without a sequence) — never dropped.
--
-- Kept by the triggers below, in the transaction that settles the row,
-- whatever settles it (a handler, a dead-letter, the reaper, recovery).
-- The engine writes it directly only for `reset_sequence`.
CREATE TABLE IF NOT EXISTS postroom_watermarks (
    consumer      TEXT    NOT NULL,
    stream        TEXT    NOT NULL,
    settled_below INTEGER NOT NULL DEFAULT 1,
    highest       INTEGER,
    unrecorded    INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer, stream)
) WITHOUT ROWID;

-- Settled sequences above a stream's watermark and at most 4096 above
-- it, with the key and digest of the message that settled each (a
-- redelivery at that sequence with another key or payload is a
-- conflict): at most 4096 per stream.
CREATE TABLE IF NOT EXISTS postroom_watermark_settled (
    consumer     TEXT    NOT NULL,
    stream       TEXT    NOT NULL,
    seq          INTEGER NOT NULL,
    source       TEXT    NOT NULL,
    message_id   TEXT    NOT NULL,
    payload_hash BLOB    NOT NULL,
    PRIMARY KEY (consumer, stream, seq)
) WITHOUT ROWID;

-- Settled sequences more than 4096 above a stream's watermark (past the
-- listing's bound; schema version 13), as runs: `lo..=hi` all settled. Runs of one stream
-- never overlap or touch (a sequence that joins two merges them), so one
-- sequence stuck below many settled ones costs one run, not one entry per
-- sequence. At most 4096 runs per stream; past that, `unrecorded`. A
-- redelivery in a run after retention is a duplicate (no key or digest
-- kept: as below the watermark).
CREATE TABLE IF NOT EXISTS postroom_watermark_runs (
    consumer TEXT    NOT NULL,
    stream   TEXT    NOT NULL,
    lo       INTEGER NOT NULL,
    hi       INTEGER NOT NULL CHECK (hi >= lo),
    PRIMARY KEY (consumer, stream, lo)
) WITHOUT ROWID;

-- A sequenced row is stored: its stream gets a watermark row, `highest`
-- follows.
CREATE TRIGGER IF NOT EXISTS postroom_inbox_seq_seen
AFTER INSERT ON postroom_inbox
WHEN NEW.seq IS NOT NULL
BEGIN
    INSERT OR IGNORE INTO postroom_watermarks (consumer, stream)
    VALUES (NEW.consumer, NEW.seq_stream);
    UPDATE postroom_watermarks SET highest = NEW.seq
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
      AND (highest IS NULL OR highest < NEW.seq);
END;

-- A sequenced row settles, stored settled (inline, first attempt) or
-- updated to it: the watermark advances (postroom_watermarks). The two
-- triggers share one body; SQLite has no trigger for both events.
CREATE TRIGGER IF NOT EXISTS postroom_inbox_seq_settled_insert
AFTER INSERT ON postroom_inbox
WHEN NEW.seq IS NOT NULL AND NEW.status IN ('completed', 'dead')
BEGIN
    INSERT OR IGNORE INTO postroom_watermarks (consumer, stream)
    VALUES (NEW.consumer, NEW.seq_stream);
    -- In order, nothing settled right above: the watermark moves up by one.
    UPDATE postroom_watermarks SET settled_below = NEW.seq + 1
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream AND settled_below = NEW.seq
      AND NOT EXISTS (SELECT 1 FROM postroom_watermark_settled
                      WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                        AND seq = NEW.seq + 1)
      AND NOT EXISTS (SELECT 1 FROM postroom_watermark_runs
                      WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                        AND lo = NEW.seq + 1);
    -- Otherwise listed when within 4096 of the watermark (the listing's
    -- bound, by distance: no count to read), the one closing the gap always.
    INSERT INTO postroom_watermark_settled
        (consumer, stream, seq, source, message_id, payload_hash)
    SELECT NEW.consumer, NEW.seq_stream, NEW.seq, NEW.source, NEW.message_id, NEW.payload_hash
    FROM postroom_watermarks w
    WHERE w.consumer = NEW.consumer AND w.stream = NEW.seq_stream
      AND NEW.seq >= w.settled_below
      AND NOT EXISTS (SELECT 1 FROM postroom_watermark_settled
                      WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                        AND seq = NEW.seq)
      AND NOT EXISTS (SELECT 1 FROM (SELECT hi FROM postroom_watermark_runs
                                     WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                                       AND lo <= NEW.seq ORDER BY lo DESC LIMIT 1)
                      WHERE hi >= NEW.seq)
      AND NEW.seq - w.settled_below < 4096;
    -- Past the listing's bound: in a run of settled sequences, joined to
    -- the runs next to it (runs never touch: one run per stretch).
    -- Above the watermark, not listed, in no run yet: extend the run
    -- ending right below, else the one starting right above.
    UPDATE postroom_watermark_runs SET hi = NEW.seq
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
      AND lo = (SELECT max(lo) FROM postroom_watermark_runs
                WHERE consumer = NEW.consumer AND stream = NEW.seq_stream AND lo < NEW.seq)
      AND hi = NEW.seq - 1
      AND NEW.seq > (SELECT settled_below FROM postroom_watermarks
                     WHERE consumer = NEW.consumer AND stream = NEW.seq_stream)
      AND NOT EXISTS (SELECT 1 FROM postroom_watermark_settled
                      WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                        AND seq = NEW.seq);
    -- It joined two runs: the upper one is merged into the lower.
    UPDATE postroom_watermark_runs SET hi = (
        SELECT r.hi FROM postroom_watermark_runs r
        WHERE r.consumer = NEW.consumer AND r.stream = NEW.seq_stream AND r.lo = NEW.seq + 1)
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
      AND lo = (SELECT max(lo) FROM postroom_watermark_runs
                WHERE consumer = NEW.consumer AND stream = NEW.seq_stream AND lo <= NEW.seq)
      AND hi = NEW.seq
      AND EXISTS (SELECT 1 FROM postroom_watermark_runs
                  WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                    AND lo = NEW.seq + 1);
    DELETE FROM postroom_watermark_runs
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream AND lo = NEW.seq + 1
      AND EXISTS (SELECT 1 FROM postroom_watermark_runs r
                  WHERE r.consumer = NEW.consumer AND r.stream = NEW.seq_stream
                    AND r.lo <= NEW.seq AND r.hi > NEW.seq);
    UPDATE postroom_watermark_runs SET lo = NEW.seq
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream AND lo = NEW.seq + 1
      AND NEW.seq > (SELECT settled_below FROM postroom_watermarks
                     WHERE consumer = NEW.consumer AND stream = NEW.seq_stream)
      AND NOT EXISTS (SELECT 1 FROM postroom_watermark_settled
                      WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                        AND seq = NEW.seq)
      AND NOT EXISTS (SELECT 1 FROM (SELECT hi FROM postroom_watermark_runs
                                     WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                                       AND lo <= NEW.seq ORDER BY lo DESC LIMIT 1)
                      WHERE hi >= NEW.seq);
    -- No run next to it: a run of its own, within the bound.
    INSERT INTO postroom_watermark_runs (consumer, stream, lo, hi)
    SELECT NEW.consumer, NEW.seq_stream, NEW.seq, NEW.seq
    WHERE NEW.seq > (SELECT settled_below FROM postroom_watermarks
                     WHERE consumer = NEW.consumer AND stream = NEW.seq_stream)
      AND NOT EXISTS (SELECT 1 FROM postroom_watermark_settled
                      WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                        AND seq = NEW.seq)
      AND NOT EXISTS (SELECT 1 FROM (SELECT hi FROM postroom_watermark_runs
                                     WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                                       AND lo <= NEW.seq ORDER BY lo DESC LIMIT 1)
                      WHERE hi >= NEW.seq)
      AND (SELECT count(*) FROM postroom_watermark_runs
           WHERE consumer = NEW.consumer AND stream = NEW.seq_stream) < 4096;
    -- The gap closed: past every listed sequence and run that follows it,
    -- in one walk (at most the bound's listed sequences and runs).
    UPDATE postroom_watermarks SET settled_below = (
        WITH RECURSIVE up(n) AS (
            SELECT NEW.seq
            UNION ALL
            SELECT coalesce(
                (SELECT up.n + 1 FROM postroom_watermark_settled s
                 WHERE s.consumer = NEW.consumer AND s.stream = NEW.seq_stream
                   AND s.seq = up.n),
                (SELECT r.hi + 1 FROM postroom_watermark_runs r
                 WHERE r.consumer = NEW.consumer AND r.stream = NEW.seq_stream
                   AND r.lo = up.n))
            FROM up WHERE up.n IS NOT NULL)
        SELECT max(n) FROM up)
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream AND settled_below = NEW.seq
      AND EXISTS (SELECT 1 FROM postroom_watermark_settled
                  WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                    AND seq = NEW.seq);
    DELETE FROM postroom_watermark_settled
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
      AND seq < (SELECT settled_below FROM postroom_watermarks
                 WHERE consumer = NEW.consumer AND stream = NEW.seq_stream);
    DELETE FROM postroom_watermark_runs
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
      AND lo < (SELECT settled_below FROM postroom_watermarks
                WHERE consumer = NEW.consumer AND stream = NEW.seq_stream);
    -- Past both bounds: counted, not kept.
    UPDATE postroom_watermarks SET unrecorded = unrecorded + 1
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
      AND NEW.seq >= settled_below
      AND NOT EXISTS (SELECT 1 FROM postroom_watermark_settled
                      WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                        AND seq = NEW.seq)
      AND NOT EXISTS (SELECT 1 FROM (SELECT hi FROM postroom_watermark_runs
                                     WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                                       AND lo <= NEW.seq ORDER BY lo DESC LIMIT 1)
                      WHERE hi >= NEW.seq);
END;

CREATE TRIGGER IF NOT EXISTS postroom_inbox_seq_settled_update
AFTER UPDATE OF status ON postroom_inbox
WHEN NEW.seq IS NOT NULL AND NEW.status IN ('completed', 'dead')
  AND OLD.status NOT IN ('completed', 'dead')
BEGIN
    INSERT OR IGNORE INTO postroom_watermarks (consumer, stream)
    VALUES (NEW.consumer, NEW.seq_stream);
    -- In order, nothing settled right above: the watermark moves up by one.
    UPDATE postroom_watermarks SET settled_below = NEW.seq + 1
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream AND settled_below = NEW.seq
      AND NOT EXISTS (SELECT 1 FROM postroom_watermark_settled
                      WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                        AND seq = NEW.seq + 1)
      AND NOT EXISTS (SELECT 1 FROM postroom_watermark_runs
                      WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                        AND lo = NEW.seq + 1);
    -- Otherwise listed when within 4096 of the watermark (the listing's
    -- bound, by distance: no count to read), the one closing the gap always.
    INSERT INTO postroom_watermark_settled
        (consumer, stream, seq, source, message_id, payload_hash)
    SELECT NEW.consumer, NEW.seq_stream, NEW.seq, NEW.source, NEW.message_id, NEW.payload_hash
    FROM postroom_watermarks w
    WHERE w.consumer = NEW.consumer AND w.stream = NEW.seq_stream
      AND NEW.seq >= w.settled_below
      AND NOT EXISTS (SELECT 1 FROM postroom_watermark_settled
                      WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                        AND seq = NEW.seq)
      AND NOT EXISTS (SELECT 1 FROM (SELECT hi FROM postroom_watermark_runs
                                     WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                                       AND lo <= NEW.seq ORDER BY lo DESC LIMIT 1)
                      WHERE hi >= NEW.seq)
      AND NEW.seq - w.settled_below < 4096;
    -- Past the listing's bound: in a run of settled sequences, joined to
    -- the runs next to it (runs never touch: one run per stretch).
    -- Above the watermark, not listed, in no run yet: extend the run
    -- ending right below, else the one starting right above.
    UPDATE postroom_watermark_runs SET hi = NEW.seq
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
      AND lo = (SELECT max(lo) FROM postroom_watermark_runs
                WHERE consumer = NEW.consumer AND stream = NEW.seq_stream AND lo < NEW.seq)
      AND hi = NEW.seq - 1
      AND NEW.seq > (SELECT settled_below FROM postroom_watermarks
                     WHERE consumer = NEW.consumer AND stream = NEW.seq_stream)
      AND NOT EXISTS (SELECT 1 FROM postroom_watermark_settled
                      WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                        AND seq = NEW.seq);
    -- It joined two runs: the upper one is merged into the lower.
    UPDATE postroom_watermark_runs SET hi = (
        SELECT r.hi FROM postroom_watermark_runs r
        WHERE r.consumer = NEW.consumer AND r.stream = NEW.seq_stream AND r.lo = NEW.seq + 1)
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
      AND lo = (SELECT max(lo) FROM postroom_watermark_runs
                WHERE consumer = NEW.consumer AND stream = NEW.seq_stream AND lo <= NEW.seq)
      AND hi = NEW.seq
      AND EXISTS (SELECT 1 FROM postroom_watermark_runs
                  WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                    AND lo = NEW.seq + 1);
    DELETE FROM postroom_watermark_runs
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream AND lo = NEW.seq + 1
      AND EXISTS (SELECT 1 FROM postroom_watermark_runs r
                  WHERE r.consumer = NEW.consumer AND r.stream = NEW.seq_stream
                    AND r.lo <= NEW.seq AND r.hi > NEW.seq);
    UPDATE postroom_watermark_runs SET lo = NEW.seq
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream AND lo = NEW.seq + 1
      AND NEW.seq > (SELECT settled_below FROM postroom_watermarks
                     WHERE consumer = NEW.consumer AND stream = NEW.seq_stream)
      AND NOT EXISTS (SELECT 1 FROM postroom_watermark_settled
                      WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                        AND seq = NEW.seq)
      AND NOT EXISTS (SELECT 1 FROM (SELECT hi FROM postroom_watermark_runs
                                     WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                                       AND lo <= NEW.seq ORDER BY lo DESC LIMIT 1)
                      WHERE hi >= NEW.seq);
    -- No run next to it: a run of its own, within the bound.
    INSERT INTO postroom_watermark_runs (consumer, stream, lo, hi)
    SELECT NEW.consumer, NEW.seq_stream, NEW.seq, NEW.seq
    WHERE NEW.seq > (SELECT settled_below FROM postroom_watermarks
                     WHERE consumer = NEW.consumer AND stream = NEW.seq_stream)
      AND NOT EXISTS (SELECT 1 FROM postroom_watermark_settled
                      WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                        AND seq = NEW.seq)
      AND NOT EXISTS (SELECT 1 FROM (SELECT hi FROM postroom_watermark_runs
                                     WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                                       AND lo <= NEW.seq ORDER BY lo DESC LIMIT 1)
                      WHERE hi >= NEW.seq)
      AND (SELECT count(*) FROM postroom_watermark_runs
           WHERE consumer = NEW.consumer AND stream = NEW.seq_stream) < 4096;
    -- The gap closed: past every listed sequence and run that follows it,
    -- in one walk (at most the bound's listed sequences and runs).
    UPDATE postroom_watermarks SET settled_below = (
        WITH RECURSIVE up(n) AS (
            SELECT NEW.seq
            UNION ALL
            SELECT coalesce(
                (SELECT up.n + 1 FROM postroom_watermark_settled s
                 WHERE s.consumer = NEW.consumer AND s.stream = NEW.seq_stream
                   AND s.seq = up.n),
                (SELECT r.hi + 1 FROM postroom_watermark_runs r
                 WHERE r.consumer = NEW.consumer AND r.stream = NEW.seq_stream
                   AND r.lo = up.n))
            FROM up WHERE up.n IS NOT NULL)
        SELECT max(n) FROM up)
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream AND settled_below = NEW.seq
      AND EXISTS (SELECT 1 FROM postroom_watermark_settled
                  WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                    AND seq = NEW.seq);
    DELETE FROM postroom_watermark_settled
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
      AND seq < (SELECT settled_below FROM postroom_watermarks
                 WHERE consumer = NEW.consumer AND stream = NEW.seq_stream);
    DELETE FROM postroom_watermark_runs
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
      AND lo < (SELECT settled_below FROM postroom_watermarks
                WHERE consumer = NEW.consumer AND stream = NEW.seq_stream);
    -- Past both bounds: counted, not kept.
    UPDATE postroom_watermarks SET unrecorded = unrecorded + 1
    WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
      AND NEW.seq >= settled_below
      AND NOT EXISTS (SELECT 1 FROM postroom_watermark_settled
                      WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                        AND seq = NEW.seq)
      AND NOT EXISTS (SELECT 1 FROM (SELECT hi FROM postroom_watermark_runs
                                     WHERE consumer = NEW.consumer AND stream = NEW.seq_stream
                                       AND lo <= NEW.seq ORDER BY lo DESC LIMIT 1)
                      WHERE hi >= NEW.seq);
END;

-- Outgoing messages, committed in the same transaction as the handler that
-- published them. `seq` is commit order; `message_id` is stable across re-sends
-- so a downstream inbox can deduplicate.
--
-- next_attempt_at is 0 for a row due at once (new, or redriven), for the
-- inbox's reason above; a retry's backoff sets a time.
--
-- `head` (schema version 8): 1 on a pending row the relay may send now in
-- key order: a row without a key, or the lowest pending row of its key.
-- The relay reads heads in commit order (postroom_outbox_ready) and a
-- key's later rows from its head (postroom_outbox_key), so a key held
-- back by a failing head costs it one row, however many wait behind it.
-- Set by the engine's insert, kept by the triggers below whatever changes
-- the rows (checked by `postroom check`); meaningless on a row that is not
-- pending. Schema version 7 kept the heads in a table of their own with
-- an index (two more B-trees, two more pages per message written), and
-- every pending row in a third index.
--
-- `alone` (schema version 10): 1 on a head stored while its key had no
-- other pending row, until a row of its key is stored behind it (or comes
-- back behind it): the relay takes such a head as it is, without reading
-- its key's rows behind it (three index probes per head, each a random
-- page after any other connection's commit). A hint that only ever errs
-- towards 0: 0 means "read the key's rows" and is always safe; set by the
-- engine's insert, cleared by the triggers below, checked by `postroom
-- check`. Meaningless on a row that is not pending.
--
-- `named` (schema version 12): 1 when the application named the message's
-- id (`Outgoing::with_id`, or a row stored by hand; and every row a file
-- held when it was migrated to version 12), 0 when the engine
-- derived it (a handler's publish: from the inbox row that caused it) or
-- generated it (outside a handler). Only named ids are checked for
-- uniqueness, by postroom_outbox_named. Derived ids are unique by
-- construction: each hashes its inbox row's id, which is never given out
-- twice, and the publish's place in the handler (src/store/outbox.rs).
-- Before version 12 every id had a UNIQUE index entry, on a random leaf
-- (ids are hashes): a page written per message at one per commit.
CREATE TABLE IF NOT EXISTS postroom_outbox (
    seq              INTEGER PRIMARY KEY,
    message_id       TEXT    NOT NULL,
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
    cause_message_id TEXT,
    head             INTEGER NOT NULL DEFAULT 0 CHECK (head IN (0, 1)),
    alone            INTEGER NOT NULL DEFAULT 0 CHECK (alone IN (0, 1)),
    named            INTEGER NOT NULL DEFAULT 1 CHECK (named IN (0, 1))
);

-- Ids the application named are unique among themselves (schema version
-- 12): a second publish of one fails. No entry for a derived or generated
-- id; a migrated file's rows until retention deletes them.
CREATE UNIQUE INDEX IF NOT EXISTS postroom_outbox_named
    ON postroom_outbox (message_id)
    WHERE named = 1;

-- What the relay reads (schema version 8): the heads, in commit order.
-- The lowest pending seq is always a head, so this also gives it.
CREATE INDEX IF NOT EXISTS postroom_outbox_ready
    ON postroom_outbox (seq)
    WHERE status = 'pending' AND head = 1;

-- Pending rows per key: a key's next head, and its rows behind the head.
CREATE INDEX IF NOT EXISTS postroom_outbox_key
    ON postroom_outbox (key, seq)
    WHERE key IS NOT NULL AND status = 'pending';

-- Pending keyed rows that failed once (a backoff set next_attempt_at; new
-- and redriven rows hold 0), schema version 7: the relay stops a key's
-- rows at the first one still waiting, found here among few rows instead
-- of among the key's whole backlog.
CREATE INDEX IF NOT EXISTS postroom_outbox_waiting
    ON postroom_outbox (key, seq)
    WHERE status = 'pending' AND key IS NOT NULL AND next_attempt_at > 0;

-- A row stored pending without its head mark, or a keyed one without its
-- `alone` mark (by hand: the engine's insert sets both itself, so a new
-- head fires nothing): made a head if it is one, and a later head of its
-- key (a row stored by hand with a lower seq) stepped down. The engine's
-- rows take the highest seq, so no later row of their key is ever
-- pending. Either way the key's head has a row besides it now: it is not
-- `alone`.
CREATE TRIGGER IF NOT EXISTS postroom_outbox_head_insert
AFTER INSERT ON postroom_outbox
WHEN NEW.status = 'pending' AND (NEW.head = 0 OR (NEW.key IS NOT NULL AND NEW.alone = 0))
BEGIN
    UPDATE postroom_outbox SET head = 1, alone = 0
    WHERE seq = NEW.seq AND head = 0
      AND (NEW.key IS NULL
           OR NOT EXISTS (SELECT 1 FROM postroom_outbox
                          WHERE key = NEW.key AND status = 'pending' AND seq < NEW.seq));
    UPDATE postroom_outbox SET head = 0, alone = 0
    WHERE NEW.key IS NOT NULL AND head = 1
      AND seq = (SELECT seq FROM postroom_outbox
                 WHERE key = NEW.key AND status = 'pending' AND seq > NEW.seq
                 ORDER BY seq LIMIT 1);
    UPDATE postroom_outbox SET alone = 0
    WHERE NEW.key IS NOT NULL AND alone = 1
      AND seq = (SELECT seq FROM postroom_outbox
                 WHERE key = NEW.key AND status = 'pending' ORDER BY seq LIMIT 1);
END;

-- A row leaves pending (sent, dead) or comes back (redriven): its key's
-- lowest pending row is its head, and only that one. One step down
-- postroom_outbox_key each way (ORDER BY … LIMIT 1: a key's backlog is
-- never walked).
CREATE TRIGGER IF NOT EXISTS postroom_outbox_head_status
AFTER UPDATE OF status ON postroom_outbox
WHEN (OLD.status = 'pending') <> (NEW.status = 'pending')
BEGIN
    -- Back to pending: the row is a head unless its key has an earlier
    -- pending row, and when it is, the head after it steps down. Neither
    -- is `alone`, nor is an earlier head it now stands behind.
    UPDATE postroom_outbox SET alone = 0, head = (NEW.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM postroom_outbox
            WHERE key = NEW.key AND status = 'pending' AND seq < NEW.seq))
    WHERE NEW.status = 'pending' AND seq = NEW.seq;
    UPDATE postroom_outbox SET head = 0, alone = 0
    WHERE NEW.status = 'pending' AND NEW.key IS NOT NULL AND head = 1
      AND seq = (SELECT seq FROM postroom_outbox
                 WHERE key = NEW.key AND status = 'pending' AND seq > NEW.seq
                 ORDER BY seq LIMIT 1);
    UPDATE postroom_outbox SET alone = 0
    WHERE NEW.status = 'pending' AND NEW.key IS NOT NULL AND alone = 1
      AND seq = (SELECT seq FROM postroom_outbox
                 WHERE key = NEW.key AND status = 'pending' ORDER BY seq LIMIT 1);
    -- Out of pending (sent, dead): the key's lowest pending row is its
    -- head (already, unless this row was), and not `alone` (a mark a hand
    -- edit left on a row behind a head never comes into force).
    UPDATE postroom_outbox SET head = 1, alone = 0
    WHERE NEW.status <> 'pending' AND NEW.key IS NOT NULL AND head = 0
      AND seq = (SELECT seq FROM postroom_outbox
                 WHERE key = NEW.key AND status = 'pending' ORDER BY seq LIMIT 1);
END;

-- A row's key changed (only by hand: postroom never does): both keys'
-- lowest pending rows are heads, and the row is one if it leads its new
-- key (or has none). No head of the new key is `alone` after it.
CREATE TRIGGER IF NOT EXISTS postroom_outbox_head_rekey
AFTER UPDATE OF key ON postroom_outbox
WHEN OLD.key IS NOT NEW.key AND NEW.status = 'pending'
BEGIN
    UPDATE postroom_outbox SET alone = 0, head = (NEW.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM postroom_outbox
            WHERE key = NEW.key AND status = 'pending' AND seq < NEW.seq))
    WHERE seq = NEW.seq;
    UPDATE postroom_outbox SET head = 1, alone = 0
    WHERE head = 0 AND seq = (SELECT seq FROM postroom_outbox
                              WHERE key = OLD.key AND status = 'pending'
                              ORDER BY seq LIMIT 1);
    UPDATE postroom_outbox SET head = 0, alone = 0
    WHERE NEW.key IS NOT NULL AND head = 1
      AND seq = (SELECT seq FROM postroom_outbox
                 WHERE key = NEW.key AND status = 'pending' AND seq > NEW.seq
                 ORDER BY seq LIMIT 1);
    UPDATE postroom_outbox SET alone = 0
    WHERE NEW.key IS NOT NULL AND alone = 1
      AND seq = (SELECT seq FROM postroom_outbox
                 WHERE key = NEW.key AND status = 'pending' ORDER BY seq LIMIT 1);
END;

-- A pending head deleted (by hand, or an operator's tool): its key's next
-- pending row is the head (not `alone`).
CREATE TRIGGER IF NOT EXISTS postroom_outbox_head_delete
AFTER DELETE ON postroom_outbox
WHEN OLD.key IS NOT NULL AND OLD.status = 'pending'
BEGIN
    UPDATE postroom_outbox SET head = 1, alone = 0
    WHERE head = 0 AND seq = (SELECT seq FROM postroom_outbox
                              WHERE key = OLD.key AND status = 'pending'
                              ORDER BY seq LIMIT 1);
END;

CREATE INDEX IF NOT EXISTS postroom_outbox_sent
    ON postroom_outbox (sent_at)
    WHERE status = 'sent';

-- Dead outbox rows, for their listing (schema version 5): without it a
-- listing read every sent row. Few rows, none on the relay's path.
CREATE INDEX IF NOT EXISTS postroom_outbox_dead
    ON postroom_outbox (seq)
    WHERE status = 'dead';

-- Deliveries whose id matched a stored message but whose payload digest did
-- not. The stored message is never touched; the newcomer is kept here whole.
-- A redelivery of the same conflicting payload bumps `deliveries` instead of
-- adding a row, so a broker that keeps redelivering cannot grow this table.
-- Rows leave only by `conflict_retention` (last seen before it), an
-- operator's `conflicts discard`, or `postroom cleanup
-- --conflict-retention-secs`.
--
-- AUTOINCREMENT: the id is told to the caller (`Outcome::Conflict`) and may
-- be logged; a deleted conflict's id must not name a later one. Conflicts
-- are rare, so the sqlite_sequence update this costs each insert does not
-- matter (the inbox and outbox keep their numbers another way: retention
-- never deletes their newest row).
CREATE TABLE IF NOT EXISTS postroom_conflicts (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
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

-- What conflict_retention deletes.
CREATE INDEX IF NOT EXISTS postroom_conflicts_seen
    ON postroom_conflicts (last_seen_at);
