//! The inline delivery state machine (docs/DESIGN.md, "How it works"), as a plain function over
//! a connection that is inside a write transaction. A batch's leader calls
//! it; tests and fuzz targets can call it directly with a manual clock.

use crate::escape::Esc;
use std::panic::{self, AssertUnwindSafe};
use std::time::Duration;

use rusqlite::{Connection, ErrorCode};

use crate::clock;
use crate::config::{Config, KeyOrder};
use crate::error::{Error, Result};
use crate::failpoint;
use crate::guard::UserCodeGuard;
use crate::handler::{Handler, Tx};
use crate::message::{Failure, Message, Outcome};
use crate::store::admission::{self, Admission};
use crate::store::inbox::{self, Record, Status, Target};
use crate::store::inflight::InflightLog;
use crate::store::outbox::Cause;
use crate::store::queue::{self, Claimed};
use crate::store::schema;
use crate::store::strict;

/// What one delivery runs against.
pub(crate) struct Env<'a> {
    pub conn: &'a Connection,
    pub config: &'a Config,
    pub now_ms: i64,
    pub log: &'a mut dyn InflightLog,
    pub guard: &'a UserCodeGuard,
}

/// What an attempt runs.
#[derive(Clone, Copy)]
pub(crate) enum Step<'h> {
    /// The handler.
    Run(&'h dyn Handler),
    /// Nothing: this attempt's handler already ran, in a transaction its
    /// SQL rolled back whole (see [`HANDLER_ROLLED_BACK`]); record that.
    RolledBack,
}

/// Delivers `msg` to `consumer`: dedupes, checks the payload digest, honours
/// backoff, and runs the handler when the message is due, recording the
/// result in the inbox. Must be called inside a transaction; on `Err` the
/// caller rolls back whatever this call wrote. An `Err(RolledBack)` with
/// the connection out of its transaction means the handler's SQL rolled it
/// back: the caller runs the delivery again in a fresh transaction with
/// [`Step::RolledBack`], which counts that attempt as failed.
pub(crate) fn deliver(
    env: &mut Env<'_>,
    consumer: &str,
    step: Step<'_>,
    msg: &Message,
    hash: &[u8; 32],
) -> Result<Outcome> {
    let conn = env.conn;
    let now = env.now_ms;
    let stored = match admission::admit(conn, consumer, msg, hash, now)
        .map_err(|e| Error::sqlite("admit delivery (key, digest, sequence)", e))?
    {
        Admission::New => None,
        Admission::Duplicate => return Ok(Outcome::Duplicate),
        Admission::DuplicateBySequence { sequence } => {
            return Ok(Outcome::DuplicateBySequence { sequence })
        }
        Admission::Conflict(conflict_id) => return Ok(Outcome::Conflict { conflict_id }),
        Admission::Stored { id, row } => Some((id, row)),
    };
    let row_id = stored.as_ref().map(|(id, _)| *id);
    // The row's incarnation: a new row gets `now` as its received_at.
    let received_at = stored.as_ref().map_or(now, |(_, r)| r.received_at);
    let prior_attempts = match stored {
        None => 0,
        Some((id, row)) => match row.status {
            Status::Completed | Status::Dead => {
                return Ok(final_outcome(row).expect("completed and dead are settled"))
            }
            Status::Processing => {
                return Ok(Outcome::InFlight {
                    retry_after: until(now, row.lease_until.unwrap_or(now)),
                })
            }
            Status::Pending | Status::Failed => {
                let error = row.last_error.unwrap_or_default();
                if row.attempts >= env.config.max_attempts {
                    let error = inbox::exhausted(row.attempts, env.config.max_attempts, &error);
                    inbox::mark_dead(conn, id, &error, now)
                        .map_err(|e| Error::sqlite("dead-letter inbox row", e))?;
                    return Ok(Outcome::Dead {
                        attempts: row.attempts,
                        error,
                    });
                }
                if let Some(next) = row.next_attempt_at.filter(|&next| next > now) {
                    return Ok(Outcome::Failed {
                        attempts: row.attempts,
                        error,
                        retry_after: until(now, next),
                    });
                }
                row.attempts
            }
        },
    };
    // Strict order: a message must not run past a dead or unfinished
    // earlier one of its key. Nothing is stored, so the broker keeps it
    // and redelivers it; the caller hears a retryable error.
    if let (KeyOrder::DeadHolds, Some(key)) =
        (env.config.key_order(consumer), msg.ordering_key.as_deref())
    {
        if strict::inline_held(conn, consumer, key, row_id)
            .map_err(|e| Error::sqlite("look up the ordering key's earlier rows", e))?
        {
            return Err(Error::KeyHeld {
                consumer: consumer.to_owned(),
                ordering_key: key.to_owned(),
            });
        }
    }
    let row = Target::of(conn, row_id)?;
    let at = Attempt {
        consumer,
        msg,
        hash,
        attempt: prior_attempts.saturating_add(1),
        received_at,
        row,
    };
    attempt(env, step, at)
}

/// The final answer for a row whose fate is decided (completed or dead, so
/// the same for every later delivery of the same payload), or `None`.
pub(crate) fn final_outcome(row: inbox::Row) -> Option<Outcome> {
    match row.status {
        Status::Completed => Some(Outcome::Duplicate),
        Status::Dead => Some(Outcome::Dead {
            attempts: row.attempts,
            error: row.last_error.unwrap_or_default(),
        }),
        _ => None,
    }
}

/// Runs the handler once (inline delivery), and records the result.
fn attempt(env: &mut Env<'_>, step: Step<'_>, at: Attempt<'_>) -> Result<Outcome> {
    let Attempt {
        consumer,
        msg,
        hash,
        ..
    } = at;
    let result = match step {
        Step::RolledBack => Some(Failure::retry(HANDLER_ROLLED_BACK)),
        Step::Run(handler) => {
            // The in-flight marker counts this attempt if the process dies
            // in it.
            env.log
                .begin(consumer, msg, hash, at.attempt - 1, env.now_ms)
                .map_err(|e| Error::io("write in-flight marker", e))?;
            let result = run_user_step(env, at, |tx| handler.handle(tx, msg));
            let cleared = env.log.end();
            let result = result?;
            cleared.map_err(|e| Error::io("clear in-flight marker", e))?;
            result
        }
    };
    failpoint::hit("deliver.after_handler")?;
    let outcome = finish(env, at, result)?;
    failpoint::hit("deliver.after_record")?;
    Ok(outcome)
}

/// One queued row's result, from [`process_due`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Processed {
    pub row_id: i64,
    pub consumer: String,
    pub message_id: String,
    pub outcome: Outcome,
}

impl Processed {
    fn of(row: Claimed, outcome: Outcome) -> Processed {
        Processed {
            row_id: row.row_id,
            consumer: row.consumer,
            message_id: row.msg.id,
            outcome,
        }
    }
}

/// Runs up to `limit` due queued rows of `consumers` (transactional
/// handlers, taken in the order given, each row in receive order) inside
/// the current transaction: each handler in its own savepoint, each
/// attempt counted by the result recorded with it, so the whole batch
/// costs one commit. Must be called inside a transaction; on `Err` the
/// caller rolls back whatever this call wrote.
///
/// No lease is taken: nothing else writes while the transaction runs. A
/// process that dies in a handler leaves nothing of the batch committed,
/// and the in-flight marker names the message whose handler was running,
/// so recovery counts that attempt, and only that one (as inline
/// delivery's). When a handler's SQL makes SQLite roll the whole
/// transaction back (a trigger's `RAISE(ROLLBACK)`, `INSERT OR ROLLBACK`),
/// which is the message's doing and not the storage's, its row is added to
/// `poisoned` and the error returned: the caller runs the batch again in a
/// fresh transaction with the same `poisoned`, and that run first counts
/// each of those rows' attempt as failed (see [`record_poisoned`]). Every
/// run that is rolled back adds a row, so the runs end.
///
/// Any other error fails the batch (the caller rolls it back), naming the
/// row it came from in `held` when the transaction is still open: a
/// handler that passed on a storage error (disk full, busy, read-only —
/// perhaps of an attached database of its own). The caller's next batch
/// first holds those rows back, uncounted, for the first retry delay (at
/// least `poll_interval` or 1 s, the shorter), so one such row cannot stop every other row,
/// while a storage failure that is real fails the next batch too.
pub(crate) fn process_due(
    env: &mut Env<'_>,
    consumers: &[(&str, &dyn Handler)],
    limit: usize,
    poisoned: &mut Vec<Claimed>,
    held: &mut Vec<Claimed>,
) -> Result<Vec<Processed>> {
    let mut done = Vec::new();
    // Handlers hold the writer (every caller waits): once they have held it
    // `slow_handler`, the batch takes no further row; those left stay due
    // for the next batch, between which callers get their turn.
    let started = std::time::Instant::now();
    let delay = clock::millis(env.config.storage_retry_delay());
    for row in held.iter() {
        queue::hold_back(
            env.conn,
            row.row_id,
            row.attempt - 1,
            env.now_ms.saturating_add(delay),
        )
        .map_err(|e| Error::sqlite("hold back a queued row", e))?;
    }
    for row in poisoned.iter() {
        if let Some(outcome) = record_poisoned(env, row)? {
            // Rare (a rolled-back run): the row stays listed for re-runs.
            done.push(Processed::of(row.clone(), outcome));
        }
    }
    for &(consumer, handler) in consumers {
        let want = limit.saturating_sub(done.len());
        if want == 0 || started.elapsed() >= env.config.slow_handler {
            break;
        }
        let due = queue::Due {
            consumer,
            order: env.config.key_order(consumer),
            limit: want,
            now_ms: env.now_ms,
            max_attempts: env.config.max_attempts,
        };
        let rows = queue::due(env.conn, due).map_err(|e| Error::sqlite("read due messages", e))?;
        for row in rows {
            if !done.is_empty() && started.elapsed() >= env.config.slow_handler {
                break;
            }
            let outcome = match attempt(env, Step::Run(handler), attempt_of(&row)) {
                Ok(outcome) => outcome,
                Err(e) => {
                    if !env.conn.is_autocommit() {
                        log::warn!(
                            "consumer {:?}: message {}/{}: {}; held back uncounted",
                            Esc(&row.consumer),
                            Esc(&row.msg.source),
                            Esc(&row.msg.id),
                            Esc(&e)
                        );
                        held.push(row);
                    } else if matches!(e, Error::RolledBack { .. }) {
                        poisoned.push(row);
                    }
                    return Err(e);
                }
            };
            done.push(Processed::of(row, outcome));
        }
    }
    Ok(done)
}

/// Counts the attempt of a queued row whose handler made SQLite roll its
/// whole transaction back (see [`process_due`]), as a failure of the
/// message: retried with backoff, dead after `max_attempts`. Nothing if
/// the row has moved on since (processed or counted by another path).
fn record_poisoned(env: &mut Env<'_>, row: &Claimed) -> Result<Option<Outcome>> {
    let unchanged = queue::still_due(env.conn, row.row_id, row.attempt - 1)
        .map_err(|e| Error::sqlite("look up inbox row", e))?;
    if !unchanged {
        return Ok(None);
    }
    let failure = Failure::retry(HANDLER_ROLLED_BACK);
    finish(env, attempt_of(row), Some(failure)).map(Some)
}

/// The error recorded for an attempt whose handler rolled its whole
/// transaction back.
pub(crate) const HANDLER_ROLLED_BACK: &str =
    "the handler's SQL rolled back the whole transaction (a RAISE(ROLLBACK) trigger or an \
     OR ROLLBACK statement)";

/// The attempt a claimed or due row is about to make.
pub(crate) fn attempt_of(row: &Claimed) -> Attempt<'_> {
    Attempt {
        consumer: &row.consumer,
        msg: &row.msg,
        hash: &row.hash,
        attempt: row.attempt,
        received_at: row.received_at,
        row: Target::Stored(row.row_id),
    }
}

/// One attempt at one message, as the state machine records it.
#[derive(Clone, Copy)]
pub(crate) struct Attempt<'a> {
    pub consumer: &'a str,
    pub msg: &'a Message,
    pub hash: &'a [u8; 32],
    /// This attempt's number, from 1.
    pub attempt: u32,
    /// The inbox row's `received_at` (see [`Cause`]).
    pub received_at: i64,
    /// The inbox row, stored or to be inserted by this attempt's result.
    pub row: Target,
}

/// Runs user code for `at` in its own savepoint, guarded and with panics
/// caught. `Ok(None)`: it succeeded and its writes stand. `Ok(Some(f))`: it
/// failed and its writes were rolled back. `Err`: SQLite rolled the whole
/// transaction back (not the message's fault).
pub(crate) fn run_user_step(
    env: &mut Env<'_>,
    at: Attempt<'_>,
    body: impl FnOnce(&mut Tx<'_>) -> Result<(), Failure>,
) -> Result<Option<Failure>> {
    let conn = env.conn;
    exec(conn, "SAVEPOINT postroom_handler")?;
    let result = {
        let cause = Cause {
            consumer: at.consumer,
            msg: at.msg,
            attempt: at.attempt,
            received_at: at.received_at,
            inbox_id: at.row.id(),
        };
        let mut tx = Tx::new(conn, env.config, env.guard, env.now_ms, Some(cause));
        let guard = env.guard;
        panic::catch_unwind(AssertUnwindSafe(|| {
            guard.run_handler(at.consumer, &at.msg.id, || body(&mut tx))
        }))
    };
    let succeeded = matches!(result, Ok(Ok(())));
    // Before anything is recorded: the state dedupe and the engine's writes
    // rest on, and what the group's COMMIT will check (see `guard`).
    let broken = match check_left_state(conn, env.guard, succeeded)? {
        // The guard keeps user code from ending the transaction, so SQLite
        // rolled it back by itself: a full disk, an I/O error, or the
        // handler's `OR ROLLBACK`. Nothing of this batch was stored.
        Left::Lost => return Err(rolled_back("handler", result.ok().and_then(Result::err))),
        Left::Broken(failure) => Some(failure),
        Left::Sound => None,
    };
    let failure = match result {
        // A refused statement is the first cause, whatever it left.
        Ok(Err(failure)) => Some(refusal(env.guard, &failure).or(broken).unwrap_or(failure)),
        _ if broken.is_some() => broken,
        Ok(Ok(())) => None,
        Err(panic) => Some(Failure::retry(format_args!(
            "handler panicked: {}",
            panic_message(panic.as_ref())
        ))),
    };
    if !end_savepoint(conn, failure.is_some())? {
        return Err(rolled_back("handler", None));
    }
    Ok(failure)
}

/// Ends user code's `postroom_handler` savepoint, rolling its writes back
/// first when `roll_back`. `Ok(false)`: the savepoint was gone, so the
/// transaction it was in is: SQLite rolled it back (`OR ROLLBACK`,
/// `RAISE(ROLLBACK)`) and user code's own `SAVEPOINT` began a new one,
/// which is rolled back here (it is user code's alone; nothing of it may
/// commit). User code cannot release or roll back the engine's savepoints
/// (the allowlist), and its own nest inside this one, so a missing
/// savepoint means exactly that.
pub(crate) fn end_savepoint(conn: &Connection, roll_back: bool) -> Result<bool> {
    let ended = if roll_back {
        exec(conn, "ROLLBACK TO postroom_handler")
            .and_then(|()| exec(conn, "RELEASE postroom_handler"))
    } else {
        exec(conn, "RELEASE postroom_handler")
    };
    match ended {
        Ok(()) => Ok(true),
        Err(e) if no_such_savepoint(&e) => {
            if !conn.is_autocommit() {
                exec(conn, "ROLLBACK")?;
            }
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// SQLite's answer to `RELEASE` or `ROLLBACK TO` a savepoint that does not
/// exist: a plain `SQLITE_ERROR` saying so.
fn no_such_savepoint(e: &Error) -> bool {
    matches!(e, Error::Sqlite { source, .. }
        if source.sqlite_error_code() == Some(ErrorCode::Unknown)
            && source.to_string().contains("no such savepoint"))
}

/// What [`check_left_state`] found.
pub(crate) enum Left {
    /// SQLite rolled the transaction user code ran in back: nothing of the
    /// batch stands. (One that user code began after that, with a
    /// `SAVEPOINT` of its own, is found by [`end_savepoint`].)
    Lost,
    /// User code broke a rule: this attempt fails so.
    Broken(Failure),
    Sound,
}

/// Checks, first thing after user code returned, the state the engine
/// relies on before it records or commits anything (see `guard`):
/// * statements it leaked are finalized; one still running rejects the
///   attempt (a bug of the handler's: it would keep every later savepoint
///   and commit busy). First, as finalizing one can end the transaction;
/// * the connection is still in a transaction ([`Left::Lost`] if not);
/// * the connection's settings are as configured ([`UserCodeGuard::verify`]
///   restores them): rejected, the code would do it again.
///
/// And when user code succeeded (a failure's writes are rolled back with
/// its savepoint, which undoes these):
/// * no deferred foreign-key violation is pending: retried with backoff
///   (an out-of-order child whose parent has not arrived yet), dead after
///   `max_attempts`. Left in, it would fail the whole group's `COMMIT`;
/// * after a schema change only: no object it made names a postroom table
///   ([`schema::reaching_among`]), and the TEMP schema is empty: rejected.
///
/// An engine statement still running is an `Err`: the batch fails (it is
/// postroom's bug, not the message's).
pub(crate) fn check_left_state(
    conn: &Connection,
    guard: &UserCodeGuard,
    succeeded: bool,
) -> Result<Left> {
    let left = guard.leftovers(conn);
    if left.engine_statement_busy {
        log::error!("postroom: an engine statement is still running after user code (a bug)");
        return Err(Error::Aborted {
            reason: "a statement of the engine's was still running after user code returned \
                     (a postroom bug: please report it)"
                .into(),
        });
    }
    if conn.is_autocommit() {
        return Ok(Left::Lost);
    }
    if let Some(changed) = guard
        .verify(conn)
        .map_err(|e| Error::sqlite("verify connection state", e))?
    {
        return Ok(Left::Broken(Failure::reject(changed)));
    }
    if left.leaked_running > 0 {
        return Ok(Left::Broken(Failure::reject(format_args!(
            "a handler must not leave a statement running: {} statement(s) it prepared were \
             still stepping when it returned (leaked, with mem::forget or a cycle?); postroom \
             finalized them and failed this attempt",
            left.leaked_running
        ))));
    }
    if !succeeded {
        return Ok(Left::Sound);
    }
    if left.deferred_fk_violation {
        return Ok(Left::Broken(Failure::retry(
            "the writes leave a deferred foreign-key constraint unmet (a row whose parent has \
             not arrived yet?): the transaction could not commit",
        )));
    }
    if left.schema_changed {
        let reaching = schema::reaching_among(conn, &left.made)
            .map_err(|e| Error::sqlite("check the schema after user code", e))?;
        if let Some(object) = reaching.first() {
            return Ok(Left::Broken(Failure::reject(format_args!(
                "a handler may not create {object}: its SQL names a postroom table, and an \
                 object of the application's must not reference, read, write or fire on \
                 postroom_* tables (whichever connection runs it later)"
            ))));
        }
        let temp = schema::temp_objects(conn)
            .map_err(|e| Error::sqlite("check the TEMP schema after user code", e))?;
        if let Some(object) = temp.first() {
            return Ok(Left::Broken(Failure::reject(format_args!(
                "a handler may not leave TEMP objects behind ({object}): they would outlive \
                 its message on the shared connection; drop them before returning"
            ))));
        }
    }
    Ok(Left::Sound)
}

/// The rejection a failure of user code's becomes when it is a statement
/// the allowlist refused in that run (`not authorized`): with the rule that
/// refused it. Retrying runs the same SQL, refused the same way; the
/// handler is to be fixed, and the message replayed from the dead letters.
/// `None` for any other failure.
pub(crate) fn refusal(guard: &UserCodeGuard, failure: &Failure) -> Option<Failure> {
    let Failure::Sqlite(e) = failure else {
        return None;
    };
    if e.sqlite_error_code() != Some(ErrorCode::AuthorizationForStatementDenied) {
        return None;
    }
    let rule = guard.refused()?;
    Some(Failure::reject(format_args!(
        "{rule} (sqlite: not authorized)"
    )))
}

/// Records the result of an attempt: completed, or failed with backoff, or
/// dead. A storage error from user code fails the job instead (no attempt
/// is counted; the caller rolls back).
pub(crate) fn finish(
    env: &mut Env<'_>,
    at: Attempt<'_>,
    failure: Option<Failure>,
) -> Result<Outcome> {
    let Attempt {
        consumer,
        msg,
        attempt,
        ..
    } = at;
    let config = env.config;
    let now = env.now_ms;
    let Some(failure) = failure else {
        record(env, at, Status::Completed, None, None)?;
        return Ok(Outcome::Processed { attempts: attempt });
    };
    let (reason, rejected, after) = match failure {
        Failure::Sqlite(e) if is_storage_error(&e) => return Err(Error::sqlite("handler", e)),
        Failure::Sqlite(e) => (format!("sqlite: {e}"), false, None),
        Failure::Retry { reason, after } => (reason, false, after),
        Failure::Reject { reason } => (reason, true, None),
    };
    if rejected || attempt >= config.max_attempts {
        record(env, at, Status::Dead, Some(&reason), None)?;
        log::warn!(
            consumer, message_id = msg.id.as_str();
            "consumer {:?}: message {}/{} dead after {attempt} attempt(s): {}",
            Esc(consumer),
            Esc(&msg.source),
            Esc(&msg.id),
            Esc(&reason)
        );
        return Ok(Outcome::Dead {
            attempts: attempt,
            error: reason,
        });
    }
    let delay = after.unwrap_or_else(|| {
        config
            .retry
            .delay(attempt, retry_jitter(consumer, msg, attempt))
    });
    let next = now.saturating_add(clock::millis(delay));
    record(env, at, Status::Failed, Some(&reason), Some(next))?;
    Ok(Outcome::Failed {
        attempts: attempt,
        error: reason,
        retry_after: delay,
    })
}

/// Records `at`'s result in its row.
fn record(
    env: &Env<'_>,
    at: Attempt<'_>,
    status: Status,
    last_error: Option<&str>,
    next_attempt_at: Option<i64>,
) -> Result<()> {
    let rec = Record {
        status,
        attempts: at.attempt,
        last_error,
        next_attempt_at,
        keep_payload: status != Status::Completed || env.config.keep_payloads,
    };
    inbox::record(
        env.conn,
        at.row,
        at.consumer,
        at.msg,
        at.hash,
        rec,
        env.now_ms,
    )
    .map_err(|e| Error::sqlite("record inbox row", e))
}

/// The error for a transaction SQLite rolled back while user code ran: the
/// storage error user code got, if it passed it on, else `RolledBack`:
/// user code's own doing (a `RAISE(ROLLBACK)` trigger, an `OR ROLLBACK`
/// statement), or an error it did not pass on.
pub(crate) fn rolled_back(op: &'static str, failure: Option<Failure>) -> Error {
    match failure {
        Some(Failure::Sqlite(e)) if is_storage_error(&e) => Error::sqlite(op, e),
        _ => Error::RolledBack { op },
    }
}

/// Errors that say the database or disk is in trouble, not the message.
/// `SQLITE_LOCKED` is not among them: on the engine's unshared connection
/// only the handler's own statements can cause it (a handler bug).
/// They fail the delivery with an [`Error`] and count no attempt.
pub(crate) fn is_storage_error(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(
            ErrorCode::DiskFull
                | ErrorCode::DatabaseBusy
                | ErrorCode::SystemIoFailure
                | ErrorCode::DatabaseCorrupt
                | ErrorCode::ReadOnly
                | ErrorCode::OutOfMemory
                | ErrorCode::FileLockingProtocolFailed
        )
    )
}

pub(crate) fn exec(conn: &Connection, sql: &'static str) -> Result<()> {
    conn.prepare_cached(sql)
        .and_then(|mut s| s.execute([]))
        .map(drop)
        .map_err(|e| Error::sqlite(sql, e))
}

fn until(now: i64, then: i64) -> Duration {
    Duration::from_millis(u64::try_from(then.saturating_sub(now)).unwrap_or(0))
}

fn retry_jitter(consumer: &str, msg: &Message, attempt: u32) -> u64 {
    let mut h = blake3::Hasher::new();
    for part in [consumer, &msg.source, &msg.id] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.update(&attempt.to_le_bytes());
    let bytes = h.finalize();
    u64::from_le_bytes(bytes.as_bytes()[..8].try_into().expect("8 bytes"))
}

pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

#[cfg(test)]
mod tests {
    //! The state machine driven directly: no threads, a manual clock.
    use super::*;
    use crate::handler::handler_fn;
    use crate::store::inflight::Inflight;
    use crate::store::inflight::NoInflightLog;

    struct Fixture {
        _dir: tempfile::TempDir,
        conn: Connection,
        config: Config,
        guard: UserCodeGuard,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            max_attempts: 3,
            ..Config::default()
        };
        let path = dir.path().join("t.db");
        crate::store::schema::create_private(&path).unwrap();
        let mut conn = crate::store::schema::open_writer(&path, &config).unwrap();
        crate::store::schema::migrate(&mut conn).unwrap();
        conn.execute_batch("CREATE TABLE effects (id TEXT)")
            .unwrap();
        let guard = UserCodeGuard::install(&mut conn).unwrap();
        Fixture {
            _dir: dir,
            conn,
            config,
            guard,
        }
    }

    impl Fixture {
        fn deliver(&self, now_ms: i64, handler: &dyn Handler, msg: &Message) -> Outcome {
            let hash = *blake3::hash(&msg.payload).as_bytes();
            let mut log = NoInflightLog;
            let mut env = Env {
                conn: &self.conn,
                config: &self.config,
                now_ms,
                log: &mut log,
                guard: &self.guard,
            };
            exec(&self.conn, "BEGIN IMMEDIATE").unwrap();
            let outcome = deliver(&mut env, "c", Step::Run(handler), msg, &hash).unwrap();
            exec(&self.conn, "COMMIT").unwrap();
            outcome
        }

        fn effects(&self) -> i64 {
            self.conn
                .query_row("SELECT count(*) FROM effects", [], |r| r.get(0))
                .unwrap()
        }
    }

    fn failing_until(ok_from_attempt: u32) -> impl Handler {
        handler_fn(move |tx, msg| {
            tx.execute("INSERT INTO effects VALUES (?1)", [msg.id()])?;
            if tx.attempt() < ok_from_attempt {
                return Err(Failure::retry("not yet"));
            }
            Ok(())
        })
    }

    #[test]
    fn retries_follow_backoff_on_the_injected_clock() {
        let f = fixture();
        let h = failing_until(3);
        let msg = Message::new("s", "m", "p");
        let Outcome::Failed { retry_after, .. } = f.deliver(0, &h, &msg) else {
            panic!()
        };
        let wait = i64::try_from(retry_after.as_millis()).unwrap();
        assert!((500..=1000).contains(&wait));
        // One millisecond early: not run.
        assert!(matches!(
            f.deliver(wait - 1, &h, &msg),
            Outcome::Failed { attempts: 1, retry_after, .. } if retry_after == Duration::from_millis(1)
        ));
        // Due: runs, fails again, backoff roughly doubles.
        let Outcome::Failed {
            attempts: 2,
            retry_after,
            ..
        } = f.deliver(wait, &h, &msg)
        else {
            panic!()
        };
        assert!((1000..=2000).contains(&retry_after.as_millis()));
        let later = wait + 2000;
        assert_eq!(
            f.deliver(later, &h, &msg),
            Outcome::Processed { attempts: 3 }
        );
        assert_eq!(f.deliver(later, &h, &msg), Outcome::Duplicate);
        assert_eq!(f.effects(), 1);
    }

    #[test]
    fn a_marker_is_as_old_as_retention_allows_whichever_deletes_first() {
        let mut config = Config::default();
        let week = clock::millis(config.retention);
        assert!(!crate::recovery::older_than_retention(&config, week, 0));
        assert!(crate::recovery::older_than_retention(&config, week + 1, 0));
        // A clock set back reads as a fresh marker: counted, never dropped.
        assert!(!crate::recovery::older_than_retention(&config, 0, week * 2));
        config.dead_retention = Some(Duration::from_secs(1));
        assert!(crate::recovery::older_than_retention(&config, 1_001, 0));
        config.dead_retention = Some(config.retention * 2);
        assert!(!crate::recovery::older_than_retention(&config, week, 0));
    }

    #[test]
    fn recovery_counts_only_attempts_that_did_not_commit() {
        let f = fixture();
        let msg = Message::new("s", "m", "p");
        let hash = *blake3::hash(&msg.payload).as_bytes();
        let inflight = |prior_attempts| Inflight {
            consumer: "c".into(),
            msg: msg.clone(),
            hash,
            prior_attempts,
            at_ms: 10,
        };
        let recover = |now, prior| {
            crate::recovery::recover_inflight(&f.conn, &f.config, now, &inflight(prior)).unwrap()
        };
        let exec = |sql| {
            f.conn.execute(sql, []).unwrap();
        };
        // Died on the first attempt: a failed row appears, due at once.
        let rec = recover(10, 0);
        assert!(matches!(rec, Some(Outcome::Failed { attempts: 1, .. })));
        // Running the same recovery again (a crash during recovery) is a no-op.
        assert_eq!(recover(10, 0), None);
        // The second attempt committed: the marker is stale, nothing counted.
        let ok = failing_until(1);
        assert_eq!(f.deliver(10, &ok, &msg), Outcome::Processed { attempts: 2 });
        assert_eq!(recover(20, 1), None);

        // Retention deleted the completed row; its key entry stays (noted
        // retired) until the drain deletes it, and answers for it: a marker
        // left stale by a power cut (markers are written without fsync) is
        // still seen as committed.
        exec("DELETE FROM postroom_inbox WHERE message_id = 'm'");
        assert_eq!(recover(30, 0), None);
        // Once the drain has deleted the entry too, only the marker's age
        // tells: retention deletes a row at the earliest `retention` after
        // its attempt, so a marker that much older is the stale one ...
        exec("DELETE FROM postroom_inbox_keys WHERE message_id = 'm'");
        let later = 10 + clock::millis(f.config.retention) + 1;
        assert_eq!(recover(later, 0), None);
        let rows: i64 = f
            .conn
            .query_row("SELECT count(*) FROM postroom_inbox", [], |r| r.get(0))
            .unwrap();
        assert_eq!(rows, 0);
        // ... and a younger one is an attempt that never committed.
        let rec = recover(later - 1, 0);
        assert!(
            matches!(rec, Some(Outcome::Failed { attempts: 1, .. })),
            "{rec:?}"
        );
        exec("DELETE FROM postroom_inbox WHERE message_id = 'm'");

        // Up to max_attempts (3) deaths, then dead with the payload.
        let other = Message::new("s", "x", "q");
        let hash = *blake3::hash(&other.payload).as_bytes();
        for prior in 0..3 {
            let rec = Inflight {
                consumer: "c".into(),
                msg: other.clone(),
                hash,
                prior_attempts: prior,
                at_ms: 30,
            };
            let outcome = crate::recovery::recover_inflight(&f.conn, &f.config, 30, &rec)
                .unwrap()
                .unwrap();
            assert_eq!(
                matches!(outcome, Outcome::Dead { .. }),
                prior == 2,
                "{outcome:?}"
            );
        }
        let payload: Vec<u8> = f
            .conn
            .query_row(
                "SELECT payload FROM postroom_inbox WHERE message_id = 'x'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(payload, b"q");
    }
}
