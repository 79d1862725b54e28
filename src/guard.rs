//! Keeps user code (handlers, transaction closures) from committing
//! anything by itself, or from changing what later batches run with.
//!
//! Invariant: while user code runs, no commit can happen on the write
//! connection. Two hooks enforce it:
//! * the authorizer (run when a statement is prepared) denies `BEGIN`,
//!   `COMMIT`, `ROLLBACK` and the engine's savepoints, so the common mistake
//!   gets a clear `not authorized` error and changes nothing;
//! * the commit hook vetoes every commit, which turns it into a rollback.
//!   This catches what the authorizer cannot: the engine's own cached
//!   `COMMIT` fetched through `prepare_cached`, and, after SQLite rolled the
//!   whole transaction back by itself (a full disk, an I/O error), the
//!   auto-committing statements user code would run next. Without it such a
//!   statement would commit half a handler's work on its own.
//!
//! Either way the engine then finds its transaction gone and fails the
//! batch: nothing of it was stored or acknowledged.
//!
//! Invariant: user code cannot turn a guarantee off for later batches. The
//! write connection is shared by every batch, so the authorizer also
//! denies, while user code runs:
//! * setting a pragma of [`ENGINE_PRAGMAS`]: connection state that decides
//!   how the engine's commits reach the disk, whether its statements may
//!   write, and whether postroom's constraints and triggers hold (a value
//!   set would stick until the engine is reopened);
//! * creating, dropping or altering any object named `postroom_*`, and
//!   creating an index or trigger (temporary ones included) on a postroom
//!   table: dropping `postroom_inbox_key_insert` would silently turn dedupe
//!   off, a trigger on the outbox could eat what handlers publish.
//!
//! A denied statement fails to prepare (`not authorized`); the handler's
//! attempt fails like on any other SQL error. Reading those pragmas, the
//! application's own pragmas (`user_version`, `application_id`, ...) and
//! the application's own schema changes stay allowed.
//!
//! The guard also notes which handler runs, and since when
//! ([`UserCodeGuard::run_handler`]): a handler runs inside the writer's
//! transaction, so one that hangs holds every write of the engine, and the
//! engine's watcher reports it (see `runtime::checkpoint`). Noting costs a
//! lock and two string copies into reused buffers per handler.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rusqlite::hooks::{AuthAction, AuthContext, Authorization};
use rusqlite::Connection;

/// Prefix of the engine's savepoints and schema objects.
const ENGINE_PREFIX: &str = "postroom_";

/// Pragmas user code may read but not set (`wal_checkpoint` not even run):
/// durability, the WAL and the WAL hook that `wal_autocheckpoint` would
/// silently replace; the lock and the busy timeout; whether the connection
/// may write; how schema, constraints, foreign keys and triggers behave;
/// and what the engine's queries return.
const ENGINE_PRAGMAS: [&str; 20] = [
    "synchronous",
    "journal_mode",
    "journal_size_limit",
    "locking_mode",
    "wal_autocheckpoint",
    "wal_checkpoint",
    "busy_timeout",
    "query_only",
    "foreign_keys",
    "writable_schema",
    "schema_version",
    "recursive_triggers",
    "ignore_check_constraints",
    "legacy_alter_table",
    "trusted_schema",
    "cell_size_check",
    "read_uncommitted",
    "reverse_unordered_selects",
    "case_sensitive_like",
    "fullfsync",
];

/// True for a name in postroom's namespace: its tables, indexes, triggers.
fn is_engine_object(name: &str) -> bool {
    name.get(..ENGINE_PREFIX.len())
        .is_some_and(|prefix| prefix.eq_ignore_ascii_case(ENGINE_PREFIX))
}

/// True when `action` creates, drops or alters one of postroom's objects,
/// or hangs an index or trigger on one of its tables.
fn changes_engine_schema(action: &AuthAction<'_>) -> bool {
    match *action {
        AuthAction::CreateTable { table_name }
        | AuthAction::CreateTempTable { table_name }
        | AuthAction::DropTable { table_name }
        | AuthAction::DropTempTable { table_name }
        | AuthAction::AlterTable { table_name, .. }
        | AuthAction::CreateVtable { table_name, .. }
        | AuthAction::DropVtable { table_name, .. } => is_engine_object(table_name),
        AuthAction::CreateIndex {
            index_name,
            table_name,
        }
        | AuthAction::CreateTempIndex {
            index_name,
            table_name,
        }
        | AuthAction::DropIndex {
            index_name,
            table_name,
        }
        | AuthAction::DropTempIndex {
            index_name,
            table_name,
        } => is_engine_object(index_name) || is_engine_object(table_name),
        AuthAction::CreateTrigger {
            trigger_name,
            table_name,
        }
        | AuthAction::CreateTempTrigger {
            trigger_name,
            table_name,
        }
        | AuthAction::DropTrigger {
            trigger_name,
            table_name,
        }
        | AuthAction::DropTempTrigger {
            trigger_name,
            table_name,
        } => is_engine_object(trigger_name) || is_engine_object(table_name),
        AuthAction::CreateView { view_name }
        | AuthAction::CreateTempView { view_name }
        | AuthAction::DropView { view_name }
        | AuthAction::DropTempView { view_name } => is_engine_object(view_name),
        _ => false,
    }
}

/// The authorizer's switch, and the handler running under it. Cloning
/// shares both.
#[derive(Debug, Clone, Default)]
pub(crate) struct UserCodeGuard(Arc<AtomicBool>, Arc<Mutex<RunningHandler>>);

/// The handler that runs on the write connection, if one does.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct RunningHandler {
    /// Counts handler runs: tells one run from the next of the same message.
    pub run: u64,
    pub consumer: String,
    pub message_id: String,
    /// When it started; `None` while no handler runs.
    pub since: Option<Instant>,
}

impl UserCodeGuard {
    /// Installs the authorizer and the commit hook on `conn`.
    pub fn install(conn: &mut Connection) -> rusqlite::Result<UserCodeGuard> {
        let guard = UserCodeGuard::default();
        let in_user_code = Arc::clone(&guard.0);
        conn.authorizer(Some(move |ctx: AuthContext<'_>| {
            if !in_user_code.load(Ordering::Relaxed) {
                return Authorization::Allow;
            }
            match ctx.action {
                AuthAction::Transaction { .. } => Authorization::Deny,
                AuthAction::Savepoint { savepoint_name, .. }
                    if is_engine_object(savepoint_name) =>
                {
                    Authorization::Deny
                }
                AuthAction::Pragma {
                    pragma_name,
                    pragma_value,
                } if ENGINE_PRAGMAS
                    .iter()
                    .any(|p| p.eq_ignore_ascii_case(pragma_name))
                    && (pragma_value.is_some()
                        || pragma_name.eq_ignore_ascii_case("wal_checkpoint")) =>
                {
                    Authorization::Deny
                }
                ref action if changes_engine_schema(action) => Authorization::Deny,
                _ => Authorization::Allow,
            }
        }))?;
        let in_user_code = Arc::clone(&guard.0);
        conn.commit_hook(Some(move || in_user_code.load(Ordering::Relaxed)))?;
        Ok(guard)
    }

    /// [`run`](Self::run) for a handler of `consumer` handling
    /// `message_id`, noted as running meanwhile (see the module docs).
    pub fn run_handler<T>(&self, consumer: &str, message_id: &str, f: impl FnOnce() -> T) -> T {
        struct Done<'a>(&'a Mutex<RunningHandler>);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.lock().unwrap_or_else(|p| p.into_inner()).since = None;
            }
        }
        {
            let mut running = self.1.lock().unwrap_or_else(|p| p.into_inner());
            running.run = running.run.wrapping_add(1);
            running.consumer.clear();
            running.consumer.push_str(consumer);
            running.message_id.clear();
            running.message_id.push_str(message_id);
            running.since = Some(Instant::now());
        }
        let _done = Done(&self.1);
        self.run(f)
    }

    /// The handler running now, if any: a copy, so the watcher holds the
    /// lock only as long as copying takes.
    pub fn running(&self) -> Option<RunningHandler> {
        let running = self.1.lock().unwrap_or_else(|p| p.into_inner());
        running.since.is_some().then(|| running.clone())
    }

    /// Runs `f` with transaction control denied and commits vetoed.
    pub fn run<T>(&self, f: impl FnOnce() -> T) -> T {
        struct Reset<'a>(&'a AtomicBool);
        impl Drop for Reset<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Relaxed);
            }
        }
        self.0.store(true, Ordering::Relaxed);
        let _reset = Reset(&self.0);
        f()
    }
}
