//! Keeps user code (handlers, transaction closures) from committing
//! anything by itself, or from changing what later batches run with.
//!
//! User code never holds the connection: [`Tx`](crate::Tx) hands out SQL
//! (statements, queries, batches, savepoints of its own), nothing that sets
//! connection state (`set_db_config`, `busy_timeout`, hooks, functions,
//! `ATTACH` through the API...). So everything user code does reaches
//! SQLite as SQL, and all SQL passes the authorizer when it is prepared.
//!
//! Invariant: while user code runs, no commit can happen on the write
//! connection. Two hooks enforce it:
//! * the authorizer denies `BEGIN`, `COMMIT`, `ROLLBACK` and the engine's
//!   savepoints, so the common mistake gets a clear `not authorized` error
//!   and changes nothing;
//! * the commit hook vetoes every commit, which turns it into a rollback.
//!   This catches what the authorizer cannot: after SQLite rolled the whole
//!   transaction back by itself (a full disk, an I/O error), the
//!   auto-committing statements user code would run next. Without it such a
//!   statement would commit half a handler's work on its own.
//!
//! Either way the engine then finds its transaction gone and fails the
//! batch: nothing of it was stored or acknowledged.
//!
//! Invariant: user code cannot turn a guarantee off for later batches. The
//! authorizer is an ALLOWLIST ([`user_code_may`]): reads, selects,
//! functions, recursive CTEs; writes to the application's tables; the
//! application's own schema changes (never on a `postroom_*` object, nor an
//! index or trigger on a postroom table); savepoints of its own; and only
//! the pragmas of [`REPORTING_PRAGMAS`] (no argument), [`ASKING_PRAGMAS`]
//! (an argument naming what to report on) and [`APP_PRAGMAS`] (the file
//! header fields that belong to the application). Everything else, and
//! anything a newer SQLite may add, is denied: transaction control,
//! `ATTACH`/`DETACH`, `ANALYZE`, writes to postroom's tables and to most of
//! SQLite's own (`sqlite_stat1`), and every pragma that sets
//! connection state or acts (`count_changes`, `max_page_count`,
//! `optimize`, `wal_checkpoint`, `incremental_vacuum`, ...).
//!
//! Statements user code prepares through the connection's statement cache
//! are keyed apart from the engine's ([`user_sql`]): a cache hit skips the
//! authorizer, so user code must never be handed a statement the engine
//! prepared unguarded (its `RELEASE postroom_handler`, its inbox writes).
//!
//! Invariant, checked rather than assumed: after each piece of user code,
//! before the engine records or commits anything, [`UserCodeGuard::verify`]
//! compares the connection state the guarantees rest on ([`FLAGS`],
//! [`PRAGMAS`]) with what it was when the guard was installed; a
//! difference is restored, logged, and fails that attempt. Nothing user
//! code can reach should change it: this is the net under the allowlist.
//!
//! A denied statement fails to prepare (`not authorized`); the handler's
//! attempt fails like on any other SQL error.
//!
//! The guard also notes which handler runs, and since when
//! ([`UserCodeGuard::run_handler`]): a handler runs inside the writer's
//! transaction, so one that hangs holds every write of the engine, and the
//! engine's watcher reports it (see `runtime::checkpoint`). Noting costs a
//! lock and two string copies into reused buffers per handler.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use rusqlite::config::DbConfig;
use rusqlite::hooks::{AuthAction, AuthContext, Authorization, TransactionOperation};
use rusqlite::Connection;

/// Prefix of the engine's savepoints and schema objects.
const ENGINE_PREFIX: &str = "postroom_";

/// Prefixed to every statement user code prepares, so that its cached
/// statements never share a cache entry with the engine's (the engine's
/// SQL never starts with it). See the module doc.
const USER_SQL_TAG: &str = "/* postroom: user code */ ";

/// Pragmas user code may run without an argument: they only report a
/// value, change nothing and act on nothing. (`optimize`, `wal_checkpoint`,
/// `shrink_memory`, `incremental_vacuum` act even without one: not here.)
pub(crate) const REPORTING_PRAGMAS: &[&str] = &[
    "analysis_limit",
    "application_id",
    "auto_vacuum",
    "automatic_index",
    "busy_timeout",
    "cache_size",
    "cache_spill",
    "cell_size_check",
    "checkpoint_fullfsync",
    "collation_list",
    "compile_options",
    "count_changes",
    "data_version",
    "database_list",
    "defer_foreign_keys",
    "encoding",
    "foreign_key_check",
    "foreign_keys",
    "freelist_count",
    "fullfsync",
    "function_list",
    "hard_heap_limit",
    "ignore_check_constraints",
    "integrity_check",
    "journal_mode",
    "journal_size_limit",
    "legacy_alter_table",
    "locking_mode",
    "max_page_count",
    "mmap_size",
    "module_list",
    "page_count",
    "page_size",
    "pragma_list",
    "query_only",
    "quick_check",
    "read_uncommitted",
    "recursive_triggers",
    "reverse_unordered_selects",
    "schema_version",
    "secure_delete",
    "soft_heap_limit",
    "synchronous",
    "table_list",
    "temp_store",
    "threads",
    "trusted_schema",
    "user_version",
    "wal_autocheckpoint",
    "writable_schema",
];

/// Pragmas whose argument names what to report on (a table, an index, a
/// row limit), never a value to set.
pub(crate) const ASKING_PRAGMAS: &[&str] = &[
    "foreign_key_check",
    "foreign_key_list",
    "index_info",
    "index_list",
    "index_xinfo",
    "integrity_check",
    "quick_check",
    "table_info",
    "table_list",
    "table_xinfo",
];

/// Pragmas user code may set: file header fields that belong to the
/// application (its schema version, its file type), which postroom never
/// reads.
pub(crate) const APP_PRAGMAS: &[&str] = &["user_version", "application_id"];

/// `sqlite3_db_config` flags the engine relies on: triggers (dedupe, the
/// watermarks), foreign keys, views, the schema's protection and how it is
/// read, query planning. Each read is one C call with no SQL.
pub(crate) const FLAGS: [DbConfig; 15] = [
    DbConfig::SQLITE_DBCONFIG_ENABLE_TRIGGER,
    DbConfig::SQLITE_DBCONFIG_ENABLE_FKEY,
    DbConfig::SQLITE_DBCONFIG_ENABLE_VIEW,
    DbConfig::SQLITE_DBCONFIG_DEFENSIVE,
    DbConfig::SQLITE_DBCONFIG_WRITABLE_SCHEMA,
    DbConfig::SQLITE_DBCONFIG_TRUSTED_SCHEMA,
    DbConfig::SQLITE_DBCONFIG_LEGACY_ALTER_TABLE,
    DbConfig::SQLITE_DBCONFIG_DQS_DML,
    DbConfig::SQLITE_DBCONFIG_DQS_DDL,
    DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG,
    DbConfig::SQLITE_DBCONFIG_TRIGGER_EQP,
    DbConfig::SQLITE_DBCONFIG_RESET_DATABASE,
    DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
    DbConfig::SQLITE_DBCONFIG_LEGACY_FILE_FORMAT,
    DbConfig::SQLITE_DBCONFIG_REVERSE_SCANORDER,
];

/// Connection state only a pragma reports, each a whole number: the ones
/// whose change wedged or weakened the engine (finding 3 and 6 of issue
/// 31: `busy_timeout`, `count_changes`, `max_page_count`), durability, and
/// the flags that decide whether the engine's writes and constraints act.
/// Each read is one cached statement (see `verify`'s cost in
/// docs/DESIGN.md).
pub(crate) const PRAGMAS: [&str; 7] = [
    "busy_timeout",
    "max_page_count",
    "count_changes",
    "query_only",
    "synchronous",
    "recursive_triggers",
    "ignore_check_constraints",
];

/// True for a name in postroom's namespace: its tables, indexes, triggers.
fn is_engine_object(name: &str) -> bool {
    name.get(..ENGINE_PREFIX.len())
        .is_some_and(|prefix| prefix.eq_ignore_ascii_case(ENGINE_PREFIX))
}

fn listed(list: &[&str], name: &str) -> bool {
    list.iter().any(|p| p.eq_ignore_ascii_case(name))
}

/// SQLite's own tables that user code may write: those SQLite writes
/// itself for an allowed schema change, which the authorizer sees as
/// writes: the schema tables (writing one directly needs `writable_schema`,
/// which user code cannot set). Not `sqlite_sequence`: postroom's
/// `AUTOINCREMENT` tables (`postroom_conflicts`, `postroom_retired_keys`)
/// keep their counters there, and a counter set to `i64::MAX` would fail
/// every later quarantine and retention pass, one deleted would give an id
/// out twice. The price: user code cannot rename a table (SQLite updates
/// `sqlite_sequence` on every rename once the file has one, and postroom's
/// does) nor drop an `AUTOINCREMENT` one; do that outside handlers. Not `sqlite_stat1`: it steers the engine's plans.
const SQLITE_TABLES_WRITTEN: [&str; 4] = [
    "sqlite_master",
    "sqlite_temp_master",
    "sqlite_schema",
    "sqlite_temp_schema",
];

/// True when user code may write rows of `table`: the application's
/// tables, not postroom's (deleting an inbox row would re-open its key),
/// nor SQLite's own but [`SQLITE_TABLES_WRITTEN`].
fn may_write(table: &str) -> bool {
    if is_engine_object(table) {
        return false;
    }
    let internal = table
        .get(..7)
        .is_some_and(|p| p.eq_ignore_ascii_case("sqlite_"));
    !internal || listed(&SQLITE_TABLES_WRITTEN, table)
}

/// True when user code may run the schema change `action`: one on the
/// application's objects, which neither is a postroom object nor hangs an
/// index or trigger on one. `None`: `action` is not a schema change.
fn schema_change_allowed(action: &AuthAction<'_>) -> Option<bool> {
    let engine = match *action {
        // The authorizer is not told the new name of `ALTER TABLE .. RENAME`,
        // so a temporary table renamed `postroom_outbox` would shadow the
        // real one on this connection (the engine's SQL names its tables
        // unqualified) and take every later publish with it. The temp schema
        // is this connection's alone: nothing of the application's needs an
        // ALTER there.
        AuthAction::AlterTable {
            database_name,
            table_name,
        } => is_engine_object(table_name) || database_name.eq_ignore_ascii_case("temp"),
        AuthAction::CreateTable { table_name }
        | AuthAction::CreateTempTable { table_name }
        | AuthAction::DropTable { table_name }
        | AuthAction::DropTempTable { table_name }
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
        }
        | AuthAction::CreateTrigger {
            trigger_name: index_name,
            table_name,
        }
        | AuthAction::CreateTempTrigger {
            trigger_name: index_name,
            table_name,
        }
        | AuthAction::DropTrigger {
            trigger_name: index_name,
            table_name,
        }
        | AuthAction::DropTempTrigger {
            trigger_name: index_name,
            table_name,
        } => is_engine_object(index_name) || is_engine_object(table_name),
        AuthAction::CreateView { view_name }
        | AuthAction::CreateTempView { view_name }
        | AuthAction::DropView { view_name }
        | AuthAction::DropTempView { view_name } => is_engine_object(view_name),
        AuthAction::Reindex { index_name } => is_engine_object(index_name),
        _ => return None,
    };
    Some(!engine)
}

/// The allowlist: what user code may prepare. Anything not named here is
/// denied, including actions a later SQLite adds.
pub(crate) fn user_code_may(action: &AuthAction<'_>) -> bool {
    match *action {
        AuthAction::Select
        | AuthAction::Recursive
        | AuthAction::Read { .. }
        | AuthAction::Function { .. } => true,
        AuthAction::Insert { table_name }
        | AuthAction::Delete { table_name }
        | AuthAction::Update { table_name, .. } => may_write(table_name),
        AuthAction::Savepoint {
            operation,
            savepoint_name,
        } => {
            matches!(
                operation,
                TransactionOperation::Begin
                    | TransactionOperation::Release
                    | TransactionOperation::Rollback
            ) && !is_engine_object(savepoint_name)
        }
        AuthAction::Pragma {
            pragma_name,
            pragma_value: None,
        } => listed(REPORTING_PRAGMAS, pragma_name),
        AuthAction::Pragma {
            pragma_name,
            pragma_value: Some(_),
        } => listed(ASKING_PRAGMAS, pragma_name) || listed(APP_PRAGMAS, pragma_name),
        ref other => schema_change_allowed(other).unwrap_or(false),
    }
}

/// `sql` as user code prepares it: tagged so its cache entry is its own.
pub(crate) fn user_sql(sql: &str) -> String {
    let mut tagged = String::with_capacity(USER_SQL_TAG.len() + sql.len());
    tagged.push_str(USER_SQL_TAG);
    tagged.push_str(sql);
    tagged
}

/// Runs `f` with `flag` set to `value`, then sets it back (on a panic too).
fn set_during<T>(flag: &AtomicBool, value: bool, f: impl FnOnce() -> T) -> T {
    struct Reset<'a>(&'a AtomicBool, bool);
    impl Drop for Reset<'_> {
        fn drop(&mut self) {
            self.0.store(self.1, Ordering::Relaxed);
        }
    }
    let before = flag.swap(value, Ordering::Relaxed);
    let _reset = Reset(flag, before);
    f()
}

/// The rule an action the allowlist refuses breaks, for the error user
/// code's failure is answered with.
fn refusal(action: &AuthAction<'_>) -> String {
    match *action {
        AuthAction::Pragma {
            pragma_name,
            pragma_value: Some(value),
        } => format!(
            "a handler may not change the connection: PRAGMA {pragma_name} = {value} \
             (the write connection is shared by every later message)"
        ),
        AuthAction::Pragma { pragma_name, .. } => format!(
            "a handler may not run PRAGMA {pragma_name}: it acts on or changes the shared \
             connection (only reporting pragmas, user_version and application_id are allowed)"
        ),
        AuthAction::Transaction { operation } => format!(
            "a handler may not end or control the transaction ({operation:?}): the engine \
             commits when it returns Ok; return Err to roll its writes back, or use \
             Tx::savepoint"
        ),
        AuthAction::Savepoint { savepoint_name, .. } => format!(
            "a handler may not use the savepoint {savepoint_name:?}: names starting \
             postroom_ are the engine's"
        ),
        AuthAction::Insert { table_name }
        | AuthAction::Delete { table_name }
        | AuthAction::Update { table_name, .. } => format!(
            "a handler may not write the table {table_name}: postroom's tables (and \
             SQLite's own) are written only by the engine; use Tx::publish for the outbox"
        ),
        AuthAction::Attach { .. } | AuthAction::Detach { .. } => {
            "a handler may not ATTACH or DETACH a database: the attachment would outlive \
             the message on the shared connection"
                .to_owned()
        }
        ref other if schema_change_allowed(other).is_some() => format!(
            "a handler may not change postroom's schema ({other:?}): objects named \
             postroom_*, and indexes, triggers and renames on them or in the TEMP schema, \
             are the engine's"
        ),
        ref other => format!(
            "a handler may not run this statement ({other:?}): it is not on postroom's SQL \
             allowlist"
        ),
    }
}

/// The `main` object a schema change creates or alters, if it is one.
/// (TEMP objects are checked whole; drops leave nothing.)
fn made_in_main<'a>(action: &AuthAction<'a>) -> Option<&'a str> {
    match *action {
        AuthAction::CreateTable { table_name } => Some(table_name),
        AuthAction::AlterTable {
            database_name,
            table_name,
        } if !database_name.eq_ignore_ascii_case("temp") => Some(table_name),
        AuthAction::CreateIndex { index_name, .. } => Some(index_name),
        AuthAction::CreateTrigger { trigger_name, .. } => Some(trigger_name),
        AuthAction::CreateView { view_name } => Some(view_name),
        AuthAction::CreateVtable { table_name, .. } => Some(table_name),
        _ => None,
    }
}

/// What [`UserCodeGuard::leftovers`] found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Leftovers {
    /// User code's leaked statements that were still running (all its
    /// leaked ones were finalized).
    pub leaked_running: usize,
    /// A statement not of user code's still runs: the connection cannot
    /// take a savepoint or commit (an engine bug, not the handler's).
    pub engine_statement_busy: bool,
    /// A deferred foreign-key violation is pending in the transaction.
    pub deferred_fk_violation: bool,
    /// User code prepared a schema change: the schema is to be checked.
    pub schema_changed: bool,
    /// The `main` objects it prepared to create or alter.
    pub made: Vec<String>,
}

/// The two facts of the connection that only SQLite's C API gives: the
/// deferred foreign-key violations pending (`sqlite3_db_status`), and the
/// statements alive (`sqlite3_next_stmt`, `sqlite3_stmt_busy`), with the
/// finalizing of those user code leaked. rusqlite offers neither; no SQL
/// reads them.
///
/// Why `unsafe` here, and why it is sound (the crate denies `unsafe`
/// everywhere else):
/// * the handle is the live connection `conn` borrows, used on the thread
///   that holds `conn`, for calls SQLite documents on an open connection;
/// * a statement is finalized only when its SQL carries user code's tag
///   (every statement `Tx` prepares does; the engine's never do), once user
///   code has returned and the statement cache was flushed. User code's
///   statements borrow its `Tx`, and nothing user code returns may borrow
///   it (`transaction` results are `'static`), so then no Rust value owns
///   one: a statement still there was leaked (`mem::forget`, `Box::leak`, a
///   cycle), and its owner will never step, reset or finalize it. The
///   caller guarantees "once user code returned" (`leftovers`, and the
///   writer's close).
#[allow(unsafe_code)]
mod raw {
    use std::ffi::CStr;
    use std::ptr;

    use rusqlite::{ffi, Connection};

    /// `SQLITE_DBSTATUS_DEFERRED_FKS`: non-zero while the transaction has
    /// a deferred foreign-key violation that `COMMIT` would fail on.
    pub(super) fn deferred_fk_violations(conn: &Connection) -> i32 {
        let (mut current, mut highwater) = (0, 0);
        // SAFETY: see the module doc; the out-pointers are live locals.
        let rc = unsafe {
            ffi::sqlite3_db_status(
                conn.handle(),
                ffi::SQLITE_DBSTATUS_DEFERRED_FKS,
                &mut current,
                &mut highwater,
                0,
            )
        };
        if rc == ffi::SQLITE_OK {
            current
        } else {
            0
        }
    }

    /// Finalizes every statement whose SQL starts with `tag`; returns how
    /// many of them were running. The caller has flushed the statement
    /// cache and guarantees no Rust value owns such a statement.
    pub(super) fn finalize_user_statements(conn: &Connection, tag: &str) -> usize {
        let mut running = 0;
        // SAFETY: see the module doc. The list is walked on the thread that
        // holds the connection; the next statement is taken before one is
        // finalized (finalizing unlinks it).
        unsafe {
            let db = conn.handle();
            let mut stmt = ffi::sqlite3_next_stmt(db, ptr::null_mut());
            while !stmt.is_null() {
                let next = ffi::sqlite3_next_stmt(db, stmt);
                let sql = ffi::sqlite3_sql(stmt);
                if !sql.is_null() && CStr::from_ptr(sql).to_bytes().starts_with(tag.as_bytes()) {
                    if ffi::sqlite3_stmt_busy(stmt) != 0 {
                        running += 1;
                    }
                    // Its error is the statement's last one, already met by
                    // whoever stepped it.
                    ffi::sqlite3_finalize(stmt);
                }
                stmt = next;
            }
        }
        running
    }
}

/// The connection state [`UserCodeGuard::verify`] holds user code to.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Expected {
    flags: [bool; FLAGS.len()],
    pragmas: [i64; PRAGMAS.len()],
}

fn read_pragma(conn: &Connection, name: &str) -> rusqlite::Result<i64> {
    conn.prepare_cached(&format!("PRAGMA {name}"))?
        .query_row([], |r| r.get(0))
}

impl Expected {
    fn read(conn: &Connection) -> rusqlite::Result<Expected> {
        let mut state = Expected {
            flags: [false; FLAGS.len()],
            pragmas: [0; PRAGMAS.len()],
        };
        state.read_flags(conn)?;
        state.read_pragmas(conn)?;
        Ok(state)
    }

    fn read_flags(&mut self, conn: &Connection) -> rusqlite::Result<()> {
        for (value, flag) in self.flags.iter_mut().zip(FLAGS) {
            *value = conn.db_config(flag)?;
        }
        Ok(())
    }

    fn read_pragmas(&mut self, conn: &Connection) -> rusqlite::Result<()> {
        for (value, name) in self.pragmas.iter_mut().zip(PRAGMAS) {
            *value = read_pragma(conn, name)?;
        }
        Ok(())
    }

    /// Sets `conn` back to `self`, returning what differed.
    fn restore(&self, conn: &Connection, found: &Expected) -> Vec<String> {
        let mut changed = Vec::new();
        for ((flag, want), got) in FLAGS.iter().zip(self.flags).zip(found.flags) {
            if want != got {
                changed.push(format!("{flag:?} {got} (was {want})"));
                if let Err(e) = conn.set_db_config(*flag, want) {
                    log::error!("postroom: could not restore {flag:?}: {e}");
                }
            }
        }
        for ((name, want), got) in PRAGMAS.iter().zip(self.pragmas).zip(found.pragmas) {
            if want != got {
                changed.push(format!("{name} {got} (was {want})"));
                if let Err(e) = conn.pragma_update(None, name, want) {
                    log::error!("postroom: could not restore pragma {name}: {e}");
                }
            }
        }
        changed
    }
}

/// The authorizer's switch, and the connection state user code is held
/// to. Cloning shares both.
#[derive(Debug, Clone)]
pub(crate) struct UserCodeGuard {
    /// User code is running: commits are vetoed, the allowlist applies.
    in_user_code: Arc<AtomicBool>,
    /// Engine code runs from inside user code (`publish`): the allowlist
    /// is lifted, the commit veto is not (after SQLite rolled the
    /// transaction back by itself, `publish`'s insert would otherwise
    /// commit on its own).
    engine_inside: Arc<AtomicBool>,
    /// User code prepared a `PRAGMA` (or a pragma table function) since
    /// the last `verify`: only then can pragma-only state have changed.
    pragma_seen: Arc<AtomicBool>,
    /// User code prepared a schema change since the last
    /// [`leftovers`](UserCodeGuard::leftovers): only then can the schema
    /// hold something new to check.
    schema_touched: Arc<AtomicBool>,
    /// The `main` objects user code prepared to create or alter since the
    /// last `leftovers`: those it may have made.
    made: Arc<Mutex<Vec<String>>>,
    /// The first statement the allowlist refused since user code began, as
    /// the rule that refused it.
    refused: Arc<Mutex<Option<String>>>,
    expected: Arc<Mutex<Expected>>,
    /// The handler running on the write connection, if one does.
    running: Arc<Mutex<RunningHandler>>,
    /// Test support: full-disk errors `Tx`'s statements returned to user
    /// code (the testkit tells a handler that swallowed one from one that
    /// met none).
    #[cfg(feature = "testkit")]
    full_disk_errors: Arc<std::sync::atomic::AtomicU64>,
}

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
    /// Installs the authorizer and the commit hook on `conn`, and takes the
    /// connection's present state as the state user code must leave (so
    /// install it once the connection is configured).
    pub fn install(conn: &mut Connection) -> rusqlite::Result<UserCodeGuard> {
        let guard = UserCodeGuard {
            in_user_code: Arc::default(),
            engine_inside: Arc::default(),
            pragma_seen: Arc::default(),
            schema_touched: Arc::default(),
            made: Arc::default(),
            refused: Arc::default(),
            expected: Arc::new(Mutex::new(Expected::read(conn)?)),
            running: Arc::default(),
            #[cfg(feature = "testkit")]
            full_disk_errors: Arc::default(),
        };
        let in_user_code = Arc::clone(&guard.in_user_code);
        let engine_inside = Arc::clone(&guard.engine_inside);
        let pragma_seen = Arc::clone(&guard.pragma_seen);
        let schema_touched = Arc::clone(&guard.schema_touched);
        let made = Arc::clone(&guard.made);
        let refused = Arc::clone(&guard.refused);
        conn.authorizer(Some(move |ctx: AuthContext<'_>| {
            if !in_user_code.load(Ordering::Relaxed) || engine_inside.load(Ordering::Relaxed) {
                return Authorization::Allow;
            }
            if matches!(ctx.action, AuthAction::Pragma { .. }) {
                pragma_seen.store(true, Ordering::Relaxed);
            }
            if schema_change_allowed(&ctx.action).is_some() {
                schema_touched.store(true, Ordering::Relaxed);
                if let Some(name) = made_in_main(&ctx.action) {
                    made.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(name.to_owned());
                }
            }
            if user_code_may(&ctx.action) {
                Authorization::Allow
            } else {
                // The statement fails `not authorized`; this says why.
                let rule = refusal(&ctx.action);
                log::debug!("postroom: {rule}");
                refused
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get_or_insert(rule);
                Authorization::Deny
            }
        }))?;
        let in_user_code = Arc::clone(&guard.in_user_code);
        conn.commit_hook(Some(move || in_user_code.load(Ordering::Relaxed)))?;
        // No rollback hook: rusqlite 0.43 frees its closure before SQLite's
        // close rolls an open transaction back and calls it (a
        // use-after-free, seen as a SIGSEGV). A transaction lost under user
        // code is found by its savepoint instead (`delivery::end_savepoint`).
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
            let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
            running.run = running.run.wrapping_add(1);
            running.consumer.clear();
            running.consumer.push_str(consumer);
            running.message_id.clear();
            running.message_id.push_str(message_id);
            running.since = Some(Instant::now());
        }
        let _done = Done(&self.running);
        self.run(f)
    }

    /// The handler running now, if any: a copy, so the watcher holds the
    /// lock only as long as copying takes.
    pub fn running(&self) -> Option<RunningHandler> {
        let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        running.since.is_some().then(|| running.clone())
    }

    /// Runs `f` with the allowlist applied and commits vetoed. What `f`
    /// leaves is for [`refused`](Self::refused), [`verify`](Self::verify)
    /// and [`leftovers`](Self::leftovers) to find.
    pub fn run<T>(&self, f: impl FnOnce() -> T) -> T {
        self.refused
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        set_during(&self.in_user_code, true, f)
    }

    /// The rule that refused the first statement user code prepared in its
    /// last run, if one was refused.
    pub fn refused(&self) -> Option<String> {
        self.refused
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// What user code's last run left on `conn` that the engine must not
    /// build on, read first thing after it returned:
    /// * statements it prepared and leaked (`mem::forget`, `Box::leak`, a
    ///   cycle): all are finalized here. One still running would keep every
    ///   later `SAVEPOINT` and `COMMIT` busy; [`Leftovers::leaked_running`]
    ///   counts those;
    /// * whether a deferred foreign-key violation is pending, which would
    ///   fail the batch's `COMMIT` for every job in it;
    /// * whether it prepared a schema change, and the `main` objects it
    ///   prepared to create or alter, for the caller to check.
    ///
    /// Costs two C calls (no SQL) and an atomic unless user code leaked a
    /// statement or prepared a schema change. When it did either, the
    /// statement cache is flushed: no schema change prepared in this run can
    /// then run later from the cache without meeting the authorizer again,
    /// and every statement of user code's still alive after it is leaked.
    pub fn leftovers(&self, conn: &Connection) -> Leftovers {
        let mut left = Leftovers::default();
        if self.schema_touched.swap(false, Ordering::Relaxed) {
            conn.flush_prepared_statement_cache();
            left.schema_changed = true;
            left.made =
                std::mem::take(&mut *self.made.lock().unwrap_or_else(PoisonError::into_inner));
        }
        if conn.is_busy() {
            left.leaked_running = self.release_leaked(conn);
            left.engine_statement_busy = conn.is_busy();
        }
        left.deferred_fk_violation = raw::deferred_fk_violations(conn) > 0;
        left
    }

    /// Finalizes every statement of user code's that no Rust value owns:
    /// after the statement cache is flushed, while no user code runs (after
    /// it returned; at close), every statement left with user code's tag
    /// was leaked. Returns how many of them were still running.
    pub fn release_leaked(&self, conn: &Connection) -> usize {
        conn.flush_prepared_statement_cache();
        raw::finalize_user_statements(conn, USER_SQL_TAG)
    }

    /// Runs engine code `f` from inside user code (a `Tx` method that
    /// writes postroom's tables, as `publish` does) with the allowlist
    /// lifted; commits stay vetoed. `f` must not run user code.
    pub fn engine<T>(&self, f: impl FnOnce() -> T) -> T {
        set_during(&self.engine_inside, true, f)
    }

    /// Checks, after user code ran on `conn`, that the connection state the
    /// engine relies on is as it was. On a difference, restores it, logs,
    /// and returns what differed, for the caller to fail the attempt with.
    /// A read that fails is an `Err` (the caller fails the batch).
    ///
    /// The flags are read every time (one C call each, no SQL). The
    /// pragma-only state is read when user code prepared a pragma since the
    /// last check: SQL is the only way user code has to the connection, and
    /// a `PRAGMA` statement (or pragma function) the only SQL that changes
    /// it; each one user code prepares meets the authorizer, which notes it.
    /// (A cached one skips the authorizer, but the only pragmas user code
    /// may prepare set nothing this checks.) Reading them all costs several
    /// µs, about a fiftieth of a delivery on a loaded 2-core machine
    /// (docs/DESIGN.md), too much to pay per message for a net.
    pub fn verify(&self, conn: &Connection) -> rusqlite::Result<Option<String>> {
        let expected = self.expected.lock().unwrap_or_else(PoisonError::into_inner);
        let mut found = expected.clone();
        found.read_flags(conn)?;
        if self.pragma_seen.swap(false, Ordering::Relaxed) {
            found.read_pragmas(conn)?;
        }
        if found == *expected {
            return Ok(None);
        }
        let changed = expected.restore(conn, &found).join(", ");
        log::error!(
            "postroom: user code changed the write connection ({changed}); restored. \
             A handler or transaction closure must not change connection settings"
        );
        Ok(Some(format!(
            "user code changed the connection's settings ({changed}); postroom restored them \
             and failed this attempt"
        )))
    }

    /// Test support (feature `testkit`): notes a full-disk error a `Tx`
    /// statement returned to user code.
    #[cfg(feature = "testkit")]
    pub fn note_error(&self, e: &rusqlite::Error) {
        if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull) {
            self.full_disk_errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Test support (feature `testkit`): how many full-disk errors `Tx`
    /// statements returned to user code so far.
    #[cfg(feature = "testkit")]
    pub fn full_disk_errors(&self) -> u64 {
        self.full_disk_errors.load(Ordering::Relaxed)
    }

    /// Test support: sets `conn`'s page quota (from the writer, or from
    /// inside user code's turn) as the engine's own change, and holds user
    /// code to the new value; nothing else of the expected state moves (so
    /// nothing user code changed is taken for the engine's). Returns the
    /// quota set (SQLite keeps it at least the file's size).
    pub fn set_max_page_count(&self, conn: &Connection, pages: u32) -> rusqlite::Result<i64> {
        let set: i64 = self.engine(|| {
            conn.query_row(&format!("PRAGMA max_page_count = {pages}"), [], |r| {
                r.get(0)
            })
        })?;
        let at = PRAGMAS.iter().position(|p| *p == "max_page_count");
        if let Some(at) = at {
            self.expected
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pragmas[at] = set;
        }
        Ok(set)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guarded() -> (Connection, UserCodeGuard) {
        let mut conn = Connection::open_in_memory().unwrap();
        let guard = UserCodeGuard::install(&mut conn).unwrap();
        (conn, guard)
    }

    #[test]
    fn verify_finds_and_restores_what_changed() {
        let (conn, guard) = guarded();
        assert_eq!(guard.verify(&conn).unwrap(), None);
        conn.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_TRIGGER, false)
            .unwrap();
        conn.busy_timeout(std::time::Duration::ZERO).unwrap();
        conn.pragma_update(None, "count_changes", 1).unwrap();
        // Only the flags are read unless user code prepared a pragma.
        let changed = guard.verify(&conn).unwrap().unwrap();
        assert!(changed.contains("ENABLE_TRIGGER"), "{changed}");
        assert!(!changed.contains("busy_timeout"), "{changed}");
        conn.busy_timeout(std::time::Duration::ZERO).unwrap();
        conn.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_TRIGGER, false)
            .unwrap();
        guard.run(|| {
            conn.prepare("PRAGMA user_version")
                .unwrap()
                .finalize()
                .unwrap()
        });
        let changed = guard.verify(&conn).unwrap().unwrap();
        for what in ["ENABLE_TRIGGER", "busy_timeout", "count_changes"] {
            assert!(changed.contains(what), "{changed}");
        }
        assert_eq!(guard.verify(&conn).unwrap(), None);
        assert!(conn
            .db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_TRIGGER)
            .unwrap());
    }

    #[test]
    fn user_statements_never_share_the_engines_cache_entries() {
        let (conn, guard) = guarded();
        conn.execute_batch("BEGIN").unwrap();
        // The engine's statement, cached while unguarded.
        conn.prepare_cached("SAVEPOINT postroom_x").unwrap();
        let denied = guard.run(|| conn.prepare_cached(&user_sql("SAVEPOINT postroom_x")).err());
        assert!(denied.is_some_and(|e| e.to_string().contains("not authorized")));
    }

    /// What one `verify` costs, printed (`--nocapture`); bounded loosely so
    /// a busy machine passes.
    #[test]
    fn verify_is_cheap() {
        let (conn, guard) = guarded();
        let n = 2_000;
        let start = std::time::Instant::now();
        for _ in 0..n {
            assert_eq!(guard.verify(&conn).unwrap(), None);
        }
        let each = start.elapsed() / n;
        println!("verify: {each:?} per call");
        assert!(each < std::time::Duration::from_millis(1), "{each:?}");
    }
}

/// What `verify` costs beside a delivery: `cargo test --release --lib
/// guard::cost -- --ignored --nocapture` (numbers in docs/DESIGN.md).
#[cfg(test)]
mod cost {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    #[ignore = "a measurement; run it in release"]
    fn verify_beside_a_delivery() {
        let conn = Connection::open_in_memory().unwrap();
        let n = 20_000;
        let t = Instant::now();
        for _ in 0..n {
            for f in FLAGS {
                conn.db_config(f).unwrap();
            }
        }
        println!("{} flags: {:?}", FLAGS.len(), t.elapsed() / n);
        for p in PRAGMAS {
            let t = Instant::now();
            for _ in 0..n {
                read_pragma(&conn, p).unwrap();
            }
            println!("{p}: {:?}", t.elapsed() / n);
        }
        let mut conn = conn;
        let guard = UserCodeGuard::install(&mut conn).unwrap();
        let t = Instant::now();
        for _ in 0..n {
            assert_eq!(guard.verify(&conn).unwrap(), None);
        }
        println!("verify: {:?}", t.elapsed() / n);
        conn.execute_batch("BEGIN").unwrap();
        let t = Instant::now();
        for _ in 0..n {
            assert_eq!(guard.leftovers(&conn), Leftovers::default());
        }
        println!("leftovers: {:?}", t.elapsed() / n);
        conn.execute_batch("ROLLBACK").unwrap();

        // A delivery with a one-row handler, delivered from 4 threads so
        // batches form, as on a busy engine.
        let dir = tempfile::tempdir().unwrap();
        let room = crate::Postroom::builder()
            .workers(0)
            .consumer(
                "c",
                crate::handler_fn(|tx, msg| {
                    tx.execute("INSERT INTO t VALUES (?1)", [msg.id()])?;
                    Ok(())
                }),
            )
            .open(dir.path().join("app.db"))
            .unwrap();
        room.transaction(|tx| Ok(tx.execute_batch("CREATE TABLE t (id TEXT)")?))
            .unwrap();
        let per_thread = 5_000;
        let t = Instant::now();
        std::thread::scope(|s| {
            for th in 0..4 {
                let room = &room;
                s.spawn(move || {
                    for i in 0..per_thread {
                        let msg = crate::Message::new("s", format!("{th}-{i}"), "x");
                        room.deliver("c", msg).unwrap();
                    }
                });
            }
        });
        println!("delivery: {:?} per message", t.elapsed() / (4 * per_thread));
        room.shutdown(Duration::from_secs(10)).unwrap();
    }
}
