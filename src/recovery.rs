//! What opening does about a process that died: the attempt of the
//! handler it died in (the in-flight marker, `store::inflight`), rows it
//! left `processing`, and the marker file cleared for good. All of it in
//! one transaction committed at `FULL`, before the engine takes any work.

use crate::escape::Esc;
use std::time::Duration;

use rusqlite::Connection;

use crate::clock::{self, Clock};
use crate::config::{Config, Durability};
use crate::delivery::exec;
use crate::error::{Error, Result};
use crate::message::Outcome;
use crate::store::inbox::{self, Found, Key, Record, Status};
use crate::store::inflight::{EngineFile, Inflight, StartedClaim};
use crate::store::queue;

/// Recovers what the previous process left behind (see
/// [`recover_after_crash`]), then clears the in-flight marker.
pub(crate) fn recover(
    conn: &rusqlite::Connection,
    config: &Config,
    clock: &dyn Clock,
    engine_file: &mut EngineFile,
) -> Result<()> {
    let inflight = engine_file
        .read()
        .map_err(|e| Error::io("read in-flight marker", e))?;
    let started = engine_file
        .started_claims()
        .map_err(|e| Error::io("read claim marks", e))?;
    // The clear below is durable, so what it stands for must be too: at
    // `Normal` a power cut could otherwise keep the cleared file and lose
    // the recovery, and with it the attempt the marker counted.
    let set_sync = |mode| {
        conn.pragma_update(None, "synchronous", mode)
            .map_err(|e| Error::sqlite("set synchronous", e))
    };
    set_sync(Durability::Full.pragma())?;
    recover_after_crash(conn, config, clock.now_ms(), inflight.as_ref(), &started)?;
    set_sync(config.durability.pragma())?;
    engine_file
        .clear()
        .map_err(|e| Error::io("clear in-flight marker", e))
}

/// Recovers what a process that died left behind, in one transaction: the
/// attempt of an inline handler it died in (see [`crate::store::inflight`]), and
/// rows it left `processing` (nothing else can hold them: the caller holds
/// the engine lock). Of those, claims whose user code was running
/// (`started`, under the same lease token) become due again with their
/// attempt counted; the others only waited, and are handed back uncounted.
pub(crate) fn recover_after_crash(
    conn: &rusqlite::Connection,
    config: &Config,
    now: i64,
    inflight: Option<&Inflight>,
    started: &[StartedClaim],
) -> Result<()> {
    exec(conn, "BEGIN IMMEDIATE")?;
    let recovered = (|| {
        if let Some(inflight) = inflight {
            recover_inflight(conn, config, now, inflight)?;
        }
        let abandoned = queue::leased(conn).map_err(|e| Error::sqlite("read leases", e))?;
        for row in &abandoned {
            // Tokens restart at 1 in every process, so a slot and a lease
            // may only be compared if both come from the same process: the
            // previous one. They do: the recovery before it committed at
            // FULL and then fsynced the cleared slots (`recover`), so neither
            // an older slot nor an older lease survives a power cut.
            let ran =
                |claim: &StartedClaim| claim.row_id == row.row_id && Some(claim.token) == row.token;
            if started.iter().any(ran) {
                queue::expire(
                    conn,
                    row.row_id,
                    row.token,
                    "process died while the handler was running",
                    config.max_attempts,
                    now,
                )
                .map(drop)
            } else if let Some(token) = row.token {
                queue::release(conn, row.row_id, token).map(drop)
            } else {
                queue::expire(
                    conn,
                    row.row_id,
                    None,
                    "lease abandoned",
                    config.max_attempts,
                    now,
                )
                .map(drop)
            }
            .map_err(|e| Error::sqlite("recover abandoned lease", e))?;
        }
        if !abandoned.is_empty() {
            log::warn!(
                "postroom: {} message(s) were being processed when the previous process \
                 died; they will be retried",
                abandoned.len()
            );
        }
        exec(conn, "COMMIT")
    })();
    if recovered.is_err() && !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    recovered
}

/// Counts the attempt of a handler that was running when its process died,
/// unless that attempt committed after all. Returns the outcome recorded.
/// The row is due at once: the restart was its backoff.
pub(crate) fn recover_inflight(
    conn: &Connection,
    config: &Config,
    now_ms: i64,
    inflight: &Inflight,
) -> Result<Option<Outcome>> {
    let msg = &inflight.msg;
    let key = Key {
        consumer: &inflight.consumer,
        source: &msg.source,
        message_id: &msg.id,
    };
    let row_id = match inbox::find_live(conn, key, &inflight.hash)
        .map_err(|e| Error::sqlite("look up inbox row", e))?
    {
        // No row: the attempt never committed, or it did and retention has
        // deleted its row since, leaving a stale marker (power loss). Only
        // a marker older than retention can be the second.
        None if older_than_retention(config, now_ms, inflight.at_ms) => {
            log::info!(
                "consumer {:?}: message {}/{}: in-flight marker from {} ms ago ignored: \
                 older than retention, with no row left to tell whether it committed",
                Esc(&inflight.consumer),
                Esc(&msg.source),
                Esc(&msg.id),
                now_ms.saturating_sub(inflight.at_ms)
            );
            return Ok(None);
        }
        None => None,
        Some(Found::Row { id, row })
            if row.payload_hash == inflight.hash
                && row.attempts <= inflight.prior_attempts
                && !matches!(row.status, Status::Completed | Status::Dead) =>
        {
            Some(id)
        }
        // The attempt committed after all (or the row moved on).
        Some(_) => return Ok(None),
    };
    let attempt = inflight.prior_attempts.saturating_add(1);
    let error = format!("process died while the handler was running (attempt {attempt})");
    let status = if attempt >= config.max_attempts {
        Status::Dead
    } else {
        Status::Failed
    };
    let rec = Record {
        status,
        attempts: attempt,
        last_error: Some(&error),
        next_attempt_at: None,
        keep_payload: true,
    };
    let row = inbox::Target::of(conn, row_id)?;
    inbox::record(
        conn,
        row,
        &inflight.consumer,
        msg,
        &inflight.hash,
        rec,
        now_ms,
    )
    .map_err(|e| Error::sqlite("record crashed attempt", e))?;
    log::warn!(
        "consumer {:?}: message {}/{}: {error}; now {status}",
        Esc(&inflight.consumer),
        Esc(&msg.source),
        Esc(&msg.id)
    );
    Ok(Some(if status == Status::Dead {
        Outcome::Dead {
            attempts: attempt,
            error,
        }
    } else {
        Outcome::Failed {
            attempts: attempt,
            error,
            retry_after: Duration::ZERO,
        }
    }))
}

/// True when a row stored or updated at `at_ms` may have been deleted by
/// retention (of completed rows, or of dead ones) by `now_ms`.
pub(crate) fn older_than_retention(config: &Config, now_ms: i64, at_ms: i64) -> bool {
    let horizon = config
        .dead_retention
        .map_or(config.retention, |dead| dead.min(config.retention));
    now_ms.saturating_sub(at_ms) > clock::millis(horizon)
}
