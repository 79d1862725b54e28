//! Opening the database: pragmas, integrity check, schema and migrations,
//! and the file's own identity.
//!
//! Invariant: the instance id in `postroom_meta` (the stream an outbox's
//! `seq` numbers downstream) belongs to this file: the file identity
//! recorded beside it is this file's, or the engine's next open mints a
//! new id ([`claim_identity`]) before anything is relayed.

use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};

use rusqlite::{Connection, ErrorCode, OpenFlags, TransactionBehavior};

use crate::config::{Config, Durability};
use crate::error::{Error, Result};
use crate::failpoint;

pub(crate) use crate::store::identity::{claim_identity, file_identity, FILE_IDENTITY_KEY};

/// The newest schema version this library knows.
pub const SCHEMA_VERSION: i64 = 13;

/// The schema, applied in one transaction to a database without one.
pub const SCHEMA_SQL: &str = include_str!("../../schema.sql");

/// The oldest SQLite the engine works with. Its own statements need 3.35.0
/// (`RETURNING`; `INSERT … ON CONFLICT … DO UPDATE` needs 3.24.0), but the
/// rusqlite it is built on (0.43) is compiled against SQLite 3.45.3's
/// interface and needs that (it calls `sqlite3_set_clientdata`, new in
/// 3.44). With the default `bundled` feature the compiled-in SQLite is
/// newer; with a system library, [`Builder::open`](crate::Builder::open)
/// refuses an older one with [`Error::SqliteTooOld`](crate::Error::SqliteTooOld)
/// (one too old to have `sqlite3_set_clientdata` fails to link at all).
pub const MIN_SQLITE_VERSION: &str = "3.45.3";
/// [`MIN_SQLITE_VERSION`] as SQLite numbers versions (`sqlite3_libversion_number`).
const MIN_SQLITE_VERSION_NUMBER: i32 = 3_045_003;

/// Refuses a linked SQLite older than [`MIN_SQLITE_VERSION`]; `number` is
/// `sqlite3_libversion_number()` (`X*1000000 + Y*1000 + Z`).
pub(crate) fn check_sqlite_version(number: i32) -> Result<()> {
    if number >= MIN_SQLITE_VERSION_NUMBER {
        return Ok(());
    }
    Err(Error::SqliteTooOld {
        found: format!(
            "{}.{}.{}",
            number / 1_000_000,
            number / 1000 % 1000,
            number % 1000
        ),
        required: MIN_SQLITE_VERSION,
    })
}

/// Creates the database file with mode 0600 if it does not exist. SQLite
/// gives its `-wal` and `-shm` files the database file's mode.
#[cfg(any(test, feature = "_sim"))]
pub(crate) fn create_private(path: &Path) -> Result<()> {
    create_if_missing(path).map(drop)
}

/// [`create_private`], telling whether this call created the file; a
/// refusal names the file or its directory.
pub(crate) fn create_if_missing(path: &Path) -> Result<bool> {
    match crate::platform::private(OpenOptions::new().write(true).create_new(true)).open(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(cannot_create(path, "create database file", e)),
    }
}

/// The error for a file beside the database that could not be created: a
/// read-only mount or directory names what cannot be written, a missing
/// directory is named.
pub(crate) fn cannot_create(file: &Path, op: &'static str, e: io::Error) -> Error {
    let dir = parent_dir(file);
    if e.raw_os_error() == Some(EROFS) {
        return Error::ReadOnly {
            path: dir.to_path_buf(),
        };
    }
    match e.kind() {
        io::ErrorKind::PermissionDenied => Error::ReadOnly {
            path: dir.to_path_buf(),
        },
        io::ErrorKind::NotFound => Error::Io {
            op,
            source: io::Error::new(
                io::ErrorKind::NotFound,
                format!("directory {} does not exist", dir.display()),
            ),
        },
        _ => Error::Io {
            op,
            source: io::Error::new(e.kind(), format!("{}: {e}", file.display())),
        },
    }
}

/// `EROFS`: the file system is mounted read-only.
const EROFS: i32 = 30;

/// The directory a file is in (`.` for a bare file name).
pub(crate) fn parent_dir(file: &Path) -> &Path {
    match file.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

/// Where `path` leads, checked before anything is created: the database's
/// canonical path (every symlink resolved, so every route to one file
/// names one engine file and one lock), for an existing regular file with
/// one name or a new file in an existing directory. Refused, naming the
/// path: a directory, a FIFO, socket or device, a symlink whose target is
/// missing, a missing directory, and a file with several hard links
/// (SQLite names the `-wal` and `-shm` files after the path, so two names
/// of one file are two logs of one database, each able to undo the other's
/// commits: <https://sqlite.org/howtocorrupt.html#_multiple_links_to_the_same_file>).
pub(crate) fn resolve(path: &Path) -> Result<PathBuf> {
    let shown = path.display();
    let refuse = |reason: String| Error::invalid("database", reason);
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let dir = parent_dir(path);
            let name = path
                .file_name()
                .ok_or_else(|| refuse(format!("{shown} does not name a file")))?;
            let dir =
                std::fs::canonicalize(dir).map_err(|e| cannot_create(path, "open database", e))?;
            if !dir.is_dir() {
                return Err(refuse(format!("{} is not a directory", dir.display())));
            }
            Ok(dir.join(name))
        }
        Err(e) => Err(Error::Io {
            op: "open database",
            source: io::Error::new(e.kind(), format!("{shown}: {e}")),
        }),
        Ok(link) => {
            let meta = match std::fs::metadata(path) {
                Ok(meta) => meta,
                Err(e) if link.is_symlink() && e.kind() == io::ErrorKind::NotFound => {
                    let target = std::fs::read_link(path).unwrap_or_default();
                    return Err(refuse(format!(
                        "{shown} is a symbolic link to {}, which does not exist; create the \
                         database there or remove the link",
                        target.display()
                    )));
                }
                Err(e) => {
                    return Err(Error::Io {
                        op: "open database",
                        source: io::Error::new(e.kind(), format!("{shown}: {e}")),
                    })
                }
            };
            if meta.is_dir() {
                return Err(refuse(format!(
                    "{shown} is a directory; give the path of a database file"
                )));
            }
            if !meta.is_file() {
                return Err(refuse(format!(
                    "{shown} is not a regular file (a FIFO, socket or device); give the path \
                     of a database file"
                )));
            }
            let links = crate::platform::link_count(path).map_err(|e| Error::Io {
                op: "open database",
                source: io::Error::new(e.kind(), format!("{shown}: {e}")),
            })?;
            if links > 1 {
                return Err(refuse(format!(
                    "{shown} has {} hard links: SQLite names its -wal and -shm files after the \
                     path, so each name would get a log of its own and one could undo the \
                     other's commits; remove the other links and open it by one name",
                    links
                )));
            }
            std::fs::canonicalize(path).map_err(|e| Error::Io {
                op: "open database",
                source: io::Error::new(e.kind(), format!("{shown}: {e}")),
            })
        }
    }
}

/// Opens the write connection: busy timeout first (every later statement
/// may wait on a lock), then `quick_check` when configured (before anything
/// is written), WAL, synchronous per durability, foreign keys.
pub(crate) fn open_writer(path: &Path, config: &Config) -> Result<Connection> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    wait_until_shared(path, config.busy_timeout)?;
    let conn = Connection::open_with_flags(path, flags)
        .map_err(|e| open_error(path, "open database", e))?;
    conn.busy_timeout(config.busy_timeout)
        .map_err(|e| open_error(path, "set busy_timeout", e))?;
    // SQLite quietly opens a file it cannot write read-only; every write
    // would then fail. Refuse up front instead.
    if conn
        .is_readonly(rusqlite::MAIN_DB)
        .map_err(|e| open_error(path, "open database", e))?
    {
        return Err(Error::ReadOnly {
            path: path.to_path_buf(),
        });
    }
    // Before anything is written: switching a rollback-journal file to WAL
    // writes its header.
    if config.quick_check_on_open {
        quick_check(&conn).map_err(|e| match e {
            Error::Sqlite { source, .. } => beside_error(path, "quick_check", source),
            e => e,
        })?;
    }
    let mode: String = conn
        .pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))
        .map_err(|e| beside_error(path, "set journal_mode", e))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(Error::invalid(
            "database",
            format!(
                "journal_mode is {mode:?}; postroom needs WAL (is the file on a network share?)"
            ),
        ));
    }
    set_durability(&conn, config.durability).map_err(|e| open_error(path, "set synchronous", e))?;
    conn.pragma_update(None, "foreign_keys", true)
        .map_err(|e| open_error(path, "set foreign_keys", e))?;
    // The engine's statements, the guard's 7 pragma reads after every
    // handler, and the handlers' own (keyed apart: see `guard`).
    conn.set_prepared_statement_cache_capacity(80);
    Ok(conn)
}

/// Waits, up to `busy_timeout`, while another process holds the database
/// file open unshared (a scan by an antivirus takes a moment): then
/// [`Error::FileInUse`], typed and retryable, where SQLite would answer a
/// plain "unable to open database file".
pub(crate) fn wait_until_shared(path: &Path, busy_timeout: std::time::Duration) -> Result<()> {
    let deadline = std::time::Instant::now() + busy_timeout;
    while crate::platform::held_unshared(path) {
        if std::time::Instant::now() >= deadline {
            return Err(Error::FileInUse {
                path: path.to_path_buf(),
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    Ok(())
}

/// Sets `synchronous` for `durability`, and `fullfsync` and
/// `checkpoint_fullfsync` on. Those two matter on Apple systems only
/// (elsewhere SQLite ignores them): there `fsync` leaves the data in the
/// drive's cache, and only `F_FULLFSYNC` makes a commit survive power loss.
/// At `Full` every commit pays it (docs/DESIGN.md, "Platforms"); at
/// `Normal` commits do not sync at all, and checkpoints still flush the
/// drive, so a power cut loses the last commits but never orders the
/// database file's pages against the WAL's.
pub(crate) fn set_durability(conn: &Connection, durability: Durability) -> rusqlite::Result<()> {
    conn.pragma_update(None, "synchronous", durability.pragma())?;
    conn.pragma_update(None, "fullfsync", true)?;
    conn.pragma_update(None, "checkpoint_fullfsync", true)
}

/// [`open_error`], and: the database opened writable, but its `-wal` or
/// `-shm` could not be made (`CANTOPEN`, `READONLY_CANTINIT`), nearly
/// always a directory the process may not create files in: `ReadOnly`
/// naming it.
fn beside_error(path: &Path, op: &'static str, e: rusqlite::Error) -> Error {
    match e.sqlite_error_code() {
        Some(ErrorCode::CannotOpen | ErrorCode::ReadOnly) => Error::ReadOnly {
            path: parent_dir(path).to_path_buf(),
        },
        _ => open_error(path, op, e),
    }
}

/// Maps "not a database" to its own variant; everything else as usual.
pub(crate) fn open_error(path: &Path, op: &'static str, e: rusqlite::Error) -> Error {
    if e.sqlite_error_code() == Some(ErrorCode::NotADatabase) {
        Error::NotADatabase {
            path: path.to_path_buf(),
        }
    } else {
        Error::sqlite(op, e)
    }
}

/// `PRAGMA quick_check`: refuses a damaged database before anything is
/// written to it.
pub(crate) fn quick_check(conn: &Connection) -> Result<()> {
    let mut stmt = conn
        .prepare("PRAGMA quick_check(10)")
        .map_err(|e| Error::sqlite("quick_check", e))?;
    let lines = stmt
        .query_map([], |r| r.get::<_, String>(0))
        .and_then(|rows| rows.collect::<rusqlite::Result<Vec<_>>>())
        .map_err(|e| Error::sqlite("quick_check", e))?;
    if lines.len() == 1 && lines[0] == "ok" {
        Ok(())
    } else {
        Err(Error::Corrupt {
            detail: lines.join("; "),
        })
    }
}

/// The schema version stored in the file, if postroom's tables exist.
pub fn stored_version(conn: &Connection) -> rusqlite::Result<Option<i64>> {
    let has_meta: bool = conn.query_row(
        "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = 'postroom_meta'",
        [],
        |r| r.get(0),
    )?;
    if !has_meta {
        return Ok(None);
    }
    let text: Option<String> = conn
        .query_row(
            "SELECT value FROM postroom_meta WHERE key = 'schema_version'",
            [],
            |r| r.get(0),
        )
        .map(Some)
        .or_else(|e| match e {
            rusqlite::Error::QueryReturnedNoRows => Ok(None),
            e => Err(e),
        })?;
    Ok(Some(text.and_then(|t| t.parse().ok()).unwrap_or(0)))
}

/// Applies the schema to a new database, or checks and migrates an existing
/// one, in one `BEGIN IMMEDIATE` transaction: a crash mid-way leaves the
/// file as it was.
pub(crate) fn migrate(conn: &mut Connection) -> Result<()> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(|e| Error::sqlite("begin schema transaction", e))?;
    match stored_version(&tx).map_err(|e| Error::sqlite("read schema version", e))? {
        None => {
            tx.execute_batch(SCHEMA_SQL)
                .map_err(|e| Error::sqlite("create schema", e))?;
            tx.execute(
                "INSERT INTO postroom_meta (key, value) VALUES ('schema_version', ?1)",
                [SCHEMA_VERSION.to_string()],
            )
            .map_err(|e| Error::sqlite("record schema version", e))?;
            add_instance_id(&tx).map_err(|e| Error::sqlite("record instance id", e))?;
        }
        // A file at version `found` takes every step from there on.
        Some(found @ 1..SCHEMA_VERSION) => {
            refuse_reaching_objects(&tx)?;
            for step in &MIGRATIONS[usize::try_from(found - 1).unwrap_or(0)..] {
                step(&tx)?;
            }
        }
        Some(found) => {
            check_version(found)?;
            refuse_reaching_objects(&tx)?;
        }
    }
    forget_statistics(&tx).map_err(|e| Error::sqlite("forget statistics", e))?;
    refuse_missing_triggers(&tx, &[])?;
    refuse_incomplete_schema(&tx)?;
    refuse_altered_triggers(&tx)?;
    failpoint::hit("schema.migrate")?;
    tx.commit().map_err(|e| Error::sqlite("commit schema", e))
}

/// Deletes the planner's statistics on postroom's tables and indexes
/// (`sqlite_stat1`, and `sqlite_stat4` where SQLite keeps it), leaving
/// the application's, and reloads what is left into this connection.
///
/// postroom's statements are written for its partial indexes, and every
/// plan test runs them without statistics. Statistics are a snapshot:
/// `PRAGMA optimize` (run at shutdown) taken while every outbox row was
/// pending says the relay's index holds the whole table, and SQLite then
/// reads the heads by scanning the table from its first row, through every
/// row sent since, on every batch. So the engine keeps none on its own
/// tables: at open, and after `PRAGMA optimize` at shutdown. The hottest
/// statements name their index as well (`INDEXED BY`), against an
/// `ANALYZE` run by hand while the engine is open.
pub(crate) fn forget_statistics(conn: &Connection) -> rusqlite::Result<()> {
    // The tables the schema creates, by name: an application table that
    // happens to share the prefix keeps its statistics.
    let ours: Vec<String> = schema_objects()
        .filter(|(kind, _)| kind == "table")
        .map(|(_, name)| format!("'{name}'"))
        .collect();
    let ours = ours.join(", ");
    let mut forgot = 0;
    for table in ["sqlite_stat1", "sqlite_stat4"] {
        let exists: bool = conn.query_row(
            "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = ?1",
            [table],
            |r| r.get(0),
        )?;
        if exists {
            forgot += conn.execute(&format!("DELETE FROM {table} WHERE tbl IN ({ours})"), [])?;
        }
    }
    if forgot > 0 {
        // Statistics are read with the schema: without this, this
        // connection would go on planning with what was just deleted.
        // (It is a write: it expires this connection's prepared
        // statements, which prepare again, and in a STAT4 build may create
        // `sqlite_stat4`. Both places that call this hold the write lock.)
        conn.execute_batch("ANALYZE sqlite_schema")?;
    }
    Ok(())
}

/// The migration steps: `MIGRATIONS[n - 1]` takes a file from version `n`
/// to `n + 1`, so a file at version `found` runs `MIGRATIONS[found - 1..]`.
type Step = fn(&Connection) -> Result<()>;
const MIGRATIONS: [Step; 12] = [
    migrate_v1,
    migrate_v2,
    migrate_v3,
    migrate_v4,
    migrate_v5,
    migrate_v6,
    migrate_v7,
    migrate_v8,
    migrate_v9,
    migrate_v10,
    migrate_v11,
    migrate_v12,
];
const _: () = assert!(MIGRATIONS.len() as i64 == SCHEMA_VERSION - 1);

/// The triggers that keep `postroom_inbox_keys` in step with the inbox.
pub(crate) const KEY_TRIGGERS: [&str; 5] = [
    "postroom_inbox_key_insert",
    "postroom_inbox_key_status",
    "postroom_inbox_key_delete",
    "postroom_inbox_key_retire",
    "postroom_inbox_key_fixed",
];

/// Those of [`KEY_TRIGGERS`] the file lacks. Without them, dedupe answers
/// would come from a table nothing keeps up to date.
pub(crate) fn missing_triggers(conn: &Connection) -> rusqlite::Result<Vec<&'static str>> {
    let present = conn
        .prepare(
            "SELECT name FROM sqlite_master
             WHERE type = 'trigger' AND tbl_name = 'postroom_inbox'",
        )?
        .query_map([], |r| r.get::<_, String>(0))?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(KEY_TRIGGERS
        .into_iter()
        .filter(|name| !present.iter().any(|p| p == name))
        .collect())
}

/// Refuses a file missing one of [`KEY_TRIGGERS`], other than those in
/// `not_yet` (added by the migration under way).
fn refuse_missing_triggers(conn: &Connection, not_yet: &[&str]) -> Result<()> {
    let missing = missing_triggers(conn).map_err(|e| Error::sqlite("read schema", e))?;
    match missing.iter().find(|name| !not_yet.contains(name)) {
        None => Ok(()),
        Some(name) => Err(Error::invalid(
            "database",
            format!(
                "trigger {name} is missing: postroom's dedupe depends on it, and the key table \
                 may no longer match the inbox; the file was changed outside postroom \
                 (run `postroom check`)"
            ),
        )),
    }
}

/// Refuses a file where one of postroom's triggers is not the schema's
/// ([`audit_triggers`]): what it keeps (the key table, the watermarks)
/// would not be kept as every answer relies on. Someone else's trigger on
/// a postroom table is left to `postroom check` to warn of.
fn refuse_altered_triggers(conn: &Connection) -> Result<()> {
    let found = audit_triggers(conn).map_err(|e| Error::sqlite("read schema", e))?;
    match found.iter().find_map(|f| match f {
        TriggerFinding::Altered(name) => Some(name),
        _ => None,
    }) {
        None => Ok(()),
        Some(name) => Err(Error::invalid(
            "database",
            format!(
                "trigger {name} is not the one postroom's schema ships (its SQL was changed \
                 outside postroom): postroom's answers depend on it; recreate it from \
                 schema.sql (DROP TRIGGER {name}, then run the schema), and run `postroom check`"
            ),
        )),
    }
}

/// What [`audit_triggers`] finds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TriggerFinding {
    /// One of the schema's triggers is not in the file.
    Missing(&'static str),
    /// One of the schema's triggers is there with other SQL (edited by
    /// hand, or replaced): what it keeps is no longer kept as the engine
    /// relies on.
    Altered(&'static str),
    /// A trigger on a postroom table that the schema does not have: it
    /// runs inside the engine's statements.
    Foreign { name: String, table: String },
}

/// Compares the file's triggers with the schema's, by their SQL (blanks
/// collapsed): an allowlist, the schema's own, rather than a list of
/// known ways to break them.
pub(crate) fn audit_triggers(conn: &Connection) -> rusqlite::Result<Vec<TriggerFinding>> {
    let shipped = Connection::open_in_memory()?;
    shipped.execute_batch(SCHEMA_SQL)?;
    let triggers = |conn: &Connection| -> rusqlite::Result<Vec<(String, String, String)>> {
        conn.prepare(
            "SELECT name, tbl_name, coalesce(sql, '') FROM sqlite_master WHERE type = 'trigger'",
        )?
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
        .collect()
    };
    let squeeze = |sql: &str| sql.split_whitespace().collect::<Vec<_>>().join(" ");
    let ours = triggers(&shipped)?;
    let theirs = triggers(conn)?;
    let mut found = Vec::new();
    for name in schema_objects().filter_map(|(kind, name)| (kind == "trigger").then_some(name)) {
        let want = ours
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, _, sql)| squeeze(sql));
        match theirs.iter().find(|(n, _, _)| n == name) {
            None => found.push(TriggerFinding::Missing(name)),
            Some((_, _, sql)) if Some(squeeze(sql)) != want => {
                found.push(TriggerFinding::Altered(name))
            }
            Some(_) => {}
        }
    }
    for (name, table, _) in theirs {
        let postroom_table = table.starts_with("postroom_");
        if postroom_table && !ours.iter().any(|(n, _, _)| *n == name) {
            found.push(TriggerFinding::Foreign { name, table });
        }
    }
    Ok(found)
}

/// An object of the application's (not one [`SCHEMA_SQL`] creates) that
/// reaches postroom's tables: found by [`reaching_engine_tables`] (made by
/// any connection) or [`reaching_among`] (made by user code).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reaching {
    /// `table`, `index`, `trigger` or `view`.
    pub kind: String,
    pub name: String,
}

impl std::fmt::Display for Reaching {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.kind, self.name)
    }
}

fn reaching_rows(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
) -> rusqlite::Result<Vec<Reaching>> {
    let found = conn
        .prepare_cached(sql)?
        .query_map(params, |r| {
            Ok(Reaching {
                kind: r.get(0)?,
                name: r.get(1)?,
            })
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let ours: Vec<(String, &str)> = schema_objects().collect();
    Ok(found
        .into_iter()
        .filter(|o| {
            !ours
                .iter()
                .any(|(kind, name)| *kind == o.kind && *name == o.name)
        })
        .collect())
}

/// The application's objects, made by any connection (a migration, the
/// `sqlite3` shell), that act on postroom's rows from outside the engine,
/// whichever connection later runs them:
/// * a table with a foreign key to a postroom table: every delete of a
///   referenced row (retention) fails;
/// * a trigger on one of the application's tables whose SQL names a
///   postroom table: an update by any connection writes the engine's rows
///   (a `DELETE FROM postroom_inbox_keys` reopens every key).
///
/// Not among them: views and indexes (they read), and triggers on a
/// postroom table (they run inside the engine's own statements;
/// [`audit_triggers`] reports them, and `postroom check` warns).
pub(crate) fn reaching_engine_tables(conn: &Connection) -> rusqlite::Result<Vec<Reaching>> {
    let mut found = reaching_rows(
        conn,
        "SELECT DISTINCT 'table', m.name FROM main.sqlite_schema AS m,
                pragma_foreign_key_list(m.name) AS f
         WHERE m.type = 'table' AND f.\"table\" LIKE 'postroom\\_%' ESCAPE '\\'
         ORDER BY m.name",
        [],
    )?;
    found.extend(reaching_rows(
        conn,
        "SELECT type, name FROM main.sqlite_schema
         WHERE type = 'trigger' AND tbl_name NOT LIKE 'postroom\\_%' ESCAPE '\\'
           AND sql LIKE '%postroom\\_%' ESCAPE '\\'
         ORDER BY name",
        [],
    )?);
    Ok(found)
}

/// Those of the objects named `names` (made or altered by user code in
/// one run) whose SQL names a postroom table, in `main`. Stricter than
/// [`reaching_engine_tables`], and textual on the safe side: user code may
/// not make any object that mentions the `postroom_` prefix (an
/// identifier, quoted or not, in any case; a comment too), as SQL has no
/// other way to spell an identifier.
pub(crate) fn reaching_among(
    conn: &Connection,
    names: &[String],
) -> rusqlite::Result<Vec<Reaching>> {
    let mut found = Vec::new();
    for name in names {
        found.extend(reaching_rows(
            conn,
            "SELECT type, name FROM main.sqlite_schema
             WHERE name = ?1 COLLATE NOCASE AND sql LIKE '%postroom\\_%' ESCAPE '\\'",
            [name],
        )?);
    }
    Ok(found)
}

/// The objects in this connection's TEMP schema (`CREATE TEMP ...`); the
/// engine makes none.
pub(crate) fn temp_objects(conn: &Connection) -> rusqlite::Result<Vec<Reaching>> {
    conn.prepare_cached("SELECT type, name FROM temp.sqlite_schema ORDER BY type, name")?
        .query_map([], |r| {
            Ok(Reaching {
                kind: r.get(0)?,
                name: r.get(1)?,
            })
        })?
        .collect()
}

/// Refuses a file holding an object of [`reaching_engine_tables`]: what it
/// does to postroom's rows no answer of postroom's accounts for. Checked
/// before any migration step runs, so a refused file is not migrated first.
fn refuse_reaching_objects(conn: &Connection) -> Result<()> {
    let found = reaching_engine_tables(conn).map_err(|e| Error::sqlite("read schema", e))?;
    match found.first() {
        None => Ok(()),
        Some(object) => Err(Error::invalid(
            "database",
            format!(
                "the application's {object} reaches postroom's tables ({} such object(s)): \
                 a foreign key to a postroom table, or a trigger on an application table \
                 that names one, acts on the engine's rows from outside it, whichever \
                 connection runs it; drop it (DROP {} {}) and run `postroom check`",
                found.len(),
                object.kind.to_uppercase(),
                object.name
            ),
        )),
    }
}

/// Every table, index and trigger [`SCHEMA_SQL`] creates, as
/// `(type, name)` with the type as `sqlite_master` spells it.
pub(crate) fn schema_objects() -> impl Iterator<Item = (String, &'static str)> {
    SCHEMA_SQL.lines().filter_map(|line| {
        let line = line.trim().strip_prefix("CREATE ")?;
        let (kind, rest) = line
            .strip_prefix("UNIQUE ")
            .unwrap_or(line)
            .split_once(' ')?;
        let name = rest
            .strip_prefix("IF NOT EXISTS ")?
            .split_whitespace()
            .next()?;
        Some((kind.to_ascii_lowercase(), name))
    })
}

/// Refuses a file, at the current version, missing an object of the
/// schema: the engine's statements and guarantees need each one (without
/// `postroom_conflicts` every conflict fails for good; without an index a
/// statement scans). Nothing is recreated: an object missing means the
/// file was changed outside postroom, and what it held is gone.
fn refuse_incomplete_schema(conn: &Connection) -> Result<()> {
    let mut present = conn
        .prepare_cached("SELECT count(*) > 0 FROM sqlite_master WHERE type = ?1 AND name = ?2")
        .map_err(|e| Error::sqlite("read schema", e))?;
    for (kind, name) in schema_objects() {
        let found: bool = present
            .query_row([&kind, name], |r| r.get(0))
            .map_err(|e| Error::sqlite("read schema", e))?;
        if !found {
            return Err(Error::invalid(
                "database",
                format!(
                    "{kind} {name} is missing: the file was changed outside postroom (a dropped \
                     {kind}, a partial restore); restore it from a backup, or run `postroom \
                     check` to see what else differs"
                ),
            ));
        }
    }
    Ok(())
}

/// Version 1 to 2: the inbox's key moves from a UNIQUE constraint on the
/// table to `postroom_inbox_keys`. SQLite cannot drop a table constraint, so
/// the inbox is rebuilt ([`rebuild`]; the insert trigger fills the key
/// table). Takes time in proportion to the inbox, once (docs/DESIGN.md has
/// a measurement). The old table's pages stay in the file
/// as free pages, reused by later writes (`VACUUM` returns them).
fn migrate_v1(tx: &Connection) -> Result<()> {
    let rows: i64 = tx
        .query_row("SELECT count(*) FROM postroom_inbox", [], |r| r.get(0))
        .map_err(|e| Error::sqlite("migrate schema 1 to 2", e))?;
    log::info!("postroom: migrating schema 1 to 2 ({rows} inbox rows)");
    rebuild(
        tx,
        "postroom_inbox",
        // Schema 11 dropped it; the rest of version 1's are the schema's.
        &["postroom_inbox_done"],
        "id, consumer, source, message_id, status, payload, payload_hash, headers, ordering_key,
         attempts, last_error, received_at, updated_at, next_attempt_at, lease_until,
         lease_token, processed_at, queued",
        2,
    )
    .map_err(|e| Error::sqlite("migrate schema 1 to 2", e))
}

/// Rebuilds `table` as the schema has it now, for a change SQLite cannot
/// make in place: its indexes and triggers of postroom's (the schema's, and
/// `retired`: names of earlier versions') dropped, so that the schema can
/// make them again under their names; renamed away; created anew by the
/// schema (every statement `IF NOT EXISTS`), refilled with `columns` in row
/// id order, the old table dropped; the file is then at `version`. The
/// rename is the legacy one: the application's views, and triggers and
/// foreign keys on other tables, that name `table` keep naming it (the new
/// table), instead of being rewritten to the old table about to be
/// dropped. The application's own indexes and triggers on `table` would go
/// with the old table: they are made again, from their SQL, on the new one
/// once it is filled (an error there, e.g. an index on a column the table
/// no longer has, fails the migration, which changes nothing).
fn rebuild(
    tx: &Connection,
    table: &str,
    retired: &[&str],
    columns: &str,
    version: i64,
) -> rusqlite::Result<()> {
    let ours: Vec<&str> = schema_objects().map(|(_, name)| name).collect();
    let objects: Vec<(String, String, String)> = tx
        .prepare(
            "SELECT type, name, sql FROM sqlite_master
             WHERE tbl_name = ?1 AND type IN ('index', 'trigger') AND sql IS NOT NULL",
        )?
        .query_map([table], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let mut theirs = Vec::new();
    for (kind, name, sql) in objects {
        if ours.contains(&name.as_str()) || retired.contains(&name.as_str()) {
            tx.execute_batch(&format!("DROP {kind} {name};"))?;
        } else {
            theirs.push(sql);
        }
    }
    let old = format!("{table}_v{}", version - 1);
    tx.execute_batch(&format!(
        "PRAGMA legacy_alter_table = ON;
         ALTER TABLE {table} RENAME TO {old};
         PRAGMA legacy_alter_table = OFF;"
    ))?;
    add_missing(tx, version)?;
    tx.execute_batch(&format!(
        "INSERT INTO {table} ({columns}) SELECT {columns} FROM {old} ORDER BY rowid;
         DROP TABLE {old};"
    ))?;
    for sql in theirs {
        tx.execute_batch(&sql)?;
    }
    Ok(())
}

/// Version 2 to 3: deleting a completed row no longer deletes its key entry
/// at once but notes the key in `postroom_retired_keys` (schema.sql says
/// why). Replaces one trigger and adds a table: no row is touched.
fn migrate_v2(tx: &Connection) -> Result<()> {
    log::info!("postroom: migrating schema 2 to 3");
    refuse_missing_triggers(tx, &["postroom_inbox_key_retire"])?;
    tx.execute_batch("DROP TRIGGER postroom_inbox_key_delete;")
        .and_then(|()| add_missing(tx, 3))
        .map_err(|e| Error::sqlite("migrate schema 2 to 3", e))
}

/// Version 3 to 4: `postroom_conflicts` can be pruned (`conflict_retention`,
/// `conflicts discard`), so its ids become `AUTOINCREMENT` (never given out
/// again) and it gets an index on `last_seen_at`. SQLite cannot add
/// `AUTOINCREMENT` to a table, so the conflicts table (rarely more than a
/// handful of rows) is rebuilt ([`rebuild`]); copying its rows with their
/// ids starts the sequence past the largest. (From version 1 or 2 the
/// earlier steps' run of the schema already put the new index on the old
/// table: `rebuild` drops it first, as every index of the schema's.)
fn migrate_v3(tx: &Connection) -> Result<()> {
    log::info!("postroom: migrating schema 3 to 4");
    rebuild(
        tx,
        "postroom_conflicts",
        &[],
        "id, consumer, source, message_id, stored_hash, payload_hash, payload, headers,
         first_seen_at, last_seen_at, deliveries",
        4,
    )
    .map_err(|e| Error::sqlite("migrate schema 3 to 4", e))
}

/// Version 4 to 5: indexes of dead rows — inbox by `updated_at`, so
/// `dead_retention` and the dead-letter listing find them without scanning
/// the inbox, outbox by `seq` for its listing (schema.sql). Reads both
/// tables once to build them; dead rows are few, so they are small.
fn migrate_v4(tx: &Connection) -> Result<()> {
    log::info!("postroom: migrating schema 4 to 5");
    add_missing(tx, 5).map_err(|e| Error::sqlite("migrate schema 4 to 5", e))
}

/// Version 5 to 6: sequence watermarks (schema.sql,
/// `postroom_watermarks`): two nullable columns on the inbox (no row is
/// rewritten), two tables, a partial index and three triggers, all empty
/// or covering no row until a sequenced message arrives.
fn migrate_v5(tx: &Connection) -> Result<()> {
    log::info!("postroom: migrating schema 5 to 6");
    add_missing(tx, 6)
        .and_then(|()| add_instance_id(tx))
        .map_err(|e| Error::sqlite("migrate schema 5 to 6", e))
}

/// Version 6 to 7: ordering-key heads (schema.sql, `postroom_inbox_heads`,
/// `postroom_outbox_heads`), so that a key held back by a failing head
/// costs the due queries one row, not its backlog. `postroom_inbox_due`
/// now holds only rows without a key: dropped and made again. The heads
/// are filled from the unfinished rows (one pass over the ordering
/// indexes); the triggers keep them from then on.
fn migrate_v6(tx: &Connection) -> Result<()> {
    log::info!("postroom: migrating schema 6 to 7");
    tx.execute_batch("DROP INDEX IF EXISTS postroom_inbox_due;")
        .and_then(|()| add_missing(tx, 7))
        .and_then(|()| fill_heads(tx))
        .map_err(|e| Error::sqlite("migrate schema 6 to 7", e))
}

/// Sets the heads from the rows: each key's lowest unfinished inbox id
/// (per consumer) in the inbox's heads table, and the outbox's `head` on
/// its pending rows (the lowest of each key, and every one without a key),
/// none of them `alone` (the hint's safe value).
pub(crate) fn fill_heads(tx: &Connection) -> rusqlite::Result<()> {
    tx.execute_batch(
        "UPDATE postroom_outbox SET alone = 0 WHERE alone = 1;
         DELETE FROM postroom_inbox_heads;
         INSERT INTO postroom_inbox_heads (consumer, ordering_key, head_id)
         SELECT consumer, ordering_key, min(id) FROM postroom_inbox
         WHERE ordering_key IS NOT NULL AND status IN ('pending', 'processing', 'failed')
         GROUP BY consumer, ordering_key;
         UPDATE postroom_outbox SET head = 0
         WHERE status = 'pending' AND head = 1 AND key IS NOT NULL
           AND seq NOT IN (SELECT min(seq) FROM postroom_outbox
                           WHERE key IS NOT NULL AND status = 'pending' GROUP BY key);
         UPDATE postroom_outbox SET head = 1
         WHERE status = 'pending' AND head = 0
           AND (key IS NULL
                OR seq IN (SELECT min(seq) FROM postroom_outbox
                           WHERE key IS NOT NULL AND status = 'pending' GROUP BY key));",
    )
}

/// Version 7 to 8: an outbox row says itself whether it is its key's
/// head (schema.sql, `postroom_outbox.head`), instead of a heads table with
/// an index of its own and a third index of every pending row: two B-tree
/// entries fewer per published message, and one page fewer written per
/// B-tree per commit (issue 33). The column and the relay's index are
/// added (no row rewritten but the pending ones, to set their heads), the
/// old objects dropped.
fn migrate_v7(tx: &Connection) -> Result<()> {
    log::info!("postroom: migrating schema 7 to 8");
    add_missing(tx, 8)
        .and_then(|()| fill_heads(tx))
        .map_err(|e| Error::sqlite("migrate schema 7 to 8", e))
}

/// Version 8 to 9: strict order (`Builder::strict_order`) finds a key's
/// dead rows through a partial index of dead keyed rows
/// (`postroom_inbox_dead_keys`); added, built from the dead rows. No row
/// changes.
fn migrate_v8(tx: &Connection) -> Result<()> {
    log::info!("postroom: migrating schema 8 to 9");
    add_missing(tx, 9).map_err(|e| Error::sqlite("migrate schema 8 to 9", e))
}

/// Version 9 to 10: a keyed outbox head says whether it is its key's only
/// pending row (schema.sql, `postroom_outbox.alone`), so that the relay
/// takes it without reading its key's rows. The column is added as 0 on
/// every row ("read the key's rows", what every earlier version did), and
/// the outbox's head triggers are made again to keep it: no row changes
/// (SQLite reads the table once, to check the new column's `CHECK`).
fn migrate_v9(tx: &Connection) -> Result<()> {
    log::info!("postroom: migrating schema 9 to 10");
    add_missing(tx, 10).map_err(|e| Error::sqlite("migrate schema 9 to 10", e))
}

/// Version 10 to 11: retention walks the inbox in id order
/// (`store::sweep`) instead of reading completed rows by completion time
/// from `postroom_inbox_done`, which is dropped: one index entry fewer per
/// message. No row changes; the first pass walks from the first row
/// (nothing in `postroom_meta` says where to start).
fn migrate_v10(tx: &Connection) -> Result<()> {
    log::info!("postroom: migrating schema 10 to 11");
    add_missing(tx, 11).map_err(|e| Error::sqlite("migrate schema 10 to 11", e))
}

/// Version 11 to 12: an outbox id has no UNIQUE index entry unless the
/// application named it (schema.sql, `postroom_outbox.named`): derived
/// ids are unique by construction. SQLite cannot drop a column's UNIQUE
/// constraint, so the outbox is rebuilt ([`rebuild`]), its triggers and
/// indexes made anew by the schema. Every row it holds is kept `named`
/// (the column's default, given by [`add_named_column`]): their ids were
/// checked when stored, and a later named id is checked against them.
/// Takes time in proportion to the outbox, once.
fn migrate_v11(tx: &Connection) -> Result<()> {
    let rows: i64 = tx
        .query_row("SELECT count(*) FROM postroom_outbox", [], |r| r.get(0))
        .map_err(|e| Error::sqlite("migrate schema 11 to 12", e))?;
    log::info!("postroom: migrating schema 11 to 12 ({rows} outbox rows)");
    add_named_column(tx)
        .and_then(|()| {
            rebuild(
                tx,
                "postroom_outbox",
                &[],
                "seq, message_id, topic, key, payload, headers, status, attempts, last_error,
                 created_at, next_attempt_at, sent_at, cause_consumer, cause_source,
                 cause_message_id, head, alone, named",
                12,
            )
        })
        .map_err(|e| Error::sqlite("migrate schema 11 to 12", e))
}

/// Version 12 to 13: settled sequences past the listing's bound are kept
/// as runs (schema.sql, `postroom_watermark_runs`) instead of only
/// counted as `unrecorded`: the table is added and the two triggers that
/// settle a sequence are made again. No row changes: what an earlier
/// version counted as unrecorded stays so.
fn migrate_v12(tx: &Connection) -> Result<()> {
    log::info!("postroom: migrating schema 12 to 13");
    tx.execute_batch(
        "DROP TRIGGER IF EXISTS postroom_inbox_seq_settled_insert;
         DROP TRIGGER IF EXISTS postroom_inbox_seq_settled_update;",
    )
    .and_then(|()| add_missing(tx, 13))
    .map_err(|e| Error::sqlite("migrate schema 12 to 13", e))
}

/// Gives an outbox of an earlier version the `named` column (schema
/// version 12), 1 on every row, so that the schema's index of named ids
/// can be made on it before [`migrate_v11`] rebuilds it. Nothing for a
/// file without an outbox (the schema creates it) or with the column.
fn add_named_column(tx: &Connection) -> rusqlite::Result<()> {
    if !lacks_column(tx, "postroom_outbox", "named")? {
        return Ok(());
    }
    tx.execute_batch(
        "ALTER TABLE postroom_outbox ADD COLUMN named INTEGER NOT NULL DEFAULT 1 CHECK (named IN (0, 1));",
    )
}

/// Gives an outbox of an earlier version the `alone` column (schema
/// version 10) and drops the outbox's head triggers, which the schema then
/// creates again (every statement `IF NOT EXISTS`) as they keep the column
/// now. Nothing for a file without an outbox (the schema creates it) or
/// with the column. Runs after [`add_head_column`]: the two `ALTER`s give
/// the table the text a new file's `CREATE TABLE` has.
fn add_alone_column(tx: &Connection) -> rusqlite::Result<()> {
    if !lacks_column(tx, "postroom_outbox", "alone")? {
        return Ok(());
    }
    tx.execute_batch(
        "ALTER TABLE postroom_outbox ADD COLUMN alone INTEGER NOT NULL DEFAULT 0 CHECK (alone IN (0, 1));
         DROP TRIGGER IF EXISTS postroom_outbox_head_insert;
         DROP TRIGGER IF EXISTS postroom_outbox_head_status;
         DROP TRIGGER IF EXISTS postroom_outbox_head_rekey;
         DROP TRIGGER IF EXISTS postroom_outbox_head_delete;",
    )
}

/// Gives an outbox of an earlier version the `head` column (schema version
/// 8) and drops what version 7 kept the heads with, so that the schema
/// (every statement `IF NOT EXISTS`) creates the new triggers under the
/// old triggers' names and the relay's index on the column. The heads are
/// set by [`fill_heads`] once the schema ran. Nothing for a file without
/// an outbox (the schema creates it) or with the column.
fn add_head_column(tx: &Connection) -> rusqlite::Result<()> {
    if !lacks_column(tx, "postroom_outbox", "head")? {
        return Ok(());
    }
    tx.execute_batch(
        // One line: SQLite writes the column's text into the table's
        // schema as given, and a migrated file's must read as a new one's.
        "ALTER TABLE postroom_outbox ADD COLUMN head INTEGER NOT NULL DEFAULT 0 CHECK (head IN (0, 1));
         DROP TRIGGER IF EXISTS postroom_outbox_head_insert;
         DROP TRIGGER IF EXISTS postroom_outbox_head_status;
         DROP TRIGGER IF EXISTS postroom_outbox_head_rekey;
         DROP TRIGGER IF EXISTS postroom_outbox_head_delete;
         DROP INDEX IF EXISTS postroom_outbox_pending;
         DROP INDEX IF EXISTS postroom_outbox_unkeyed;
         DROP INDEX IF EXISTS postroom_outbox_heads_seq;
         DROP TABLE IF EXISTS postroom_outbox_heads;",
    )
}

/// Where the head tables disagree with the rows (`postroom check`): for
/// each key whose stored head is not its lowest unfinished inbox row (or
/// lowest pending outbox row), `found(table, key, stored, expected)`. The
/// due queries read only heads, so a wrong one holds a key back for good
/// or runs a row out of key order. A file without them (the inbox's
/// heads table before version 7, the outbox's `head` column before 8) has
/// nothing to compare.
pub(crate) fn head_mismatches(
    conn: &Connection,
    mut found: impl FnMut(&'static str, String, Option<i64>, Option<i64>),
) -> rusqlite::Result<()> {
    let has = |sql: &str| -> rusqlite::Result<bool> { conn.query_row(sql, [], |r| r.get(0)) };
    let inbox_heads = has("SELECT count(*) > 0 FROM sqlite_master
         WHERE type = 'table' AND name = 'postroom_inbox_heads'")?;
    let outbox_heads = columns(conn, "postroom_outbox")?
        .iter()
        .any(|c| c == "head");
    let mut checks = Vec::new();
    if inbox_heads {
        checks.push((
            "postroom_inbox_heads",
            "WITH e(consumer, ordering_key, head) AS (
                 SELECT consumer, ordering_key, min(id) FROM postroom_inbox
                 WHERE ordering_key IS NOT NULL
                   AND status IN ('pending', 'processing', 'failed')
                 GROUP BY consumer, ordering_key)
             SELECT coalesce(e.consumer, h.consumer) || '/' || coalesce(e.ordering_key,
                    h.ordering_key), h.head_id, e.head
             FROM e FULL JOIN postroom_inbox_heads h
               ON h.consumer = e.consumer AND h.ordering_key = e.ordering_key
             WHERE h.head_id IS NOT e.head",
        ));
    }
    if outbox_heads {
        // Per key, each pending row marked head against the lowest pending
        // row (a key with two heads shows the wrong one); a pending row
        // without a key is always its own head.
        checks.push((
            "postroom_outbox",
            "WITH e(key, head) AS (
                 SELECT key, min(seq) FROM postroom_outbox
                 WHERE key IS NOT NULL AND status = 'pending' GROUP BY key),
             h(key, head) AS (
                 SELECT key, seq FROM postroom_outbox
                 WHERE key IS NOT NULL AND status = 'pending' AND head = 1)
             SELECT coalesce(e.key, h.key), h.head, e.head
             FROM e FULL JOIN h ON h.key = e.key
             WHERE h.head IS NOT e.head
             UNION ALL
             SELECT '(no key)', NULL, seq FROM postroom_outbox
             WHERE key IS NULL AND status = 'pending' AND head = 0",
        ));
    }
    for (table, sql) in checks {
        let mut stmt = conn.prepare(sql)?;
        let mut rows = stmt.query([])?;
        while let Some(r) = rows.next()? {
            let key = crate::store::text::lossy_text(r, 0)?.unwrap_or_default();
            found(table, key, r.get(1)?, r.get(2)?);
        }
    }
    Ok(())
}

/// Outbox heads marked `alone` that are not (`postroom check`): a pending
/// keyed row with the mark that is not its key's head, or has another
/// pending row of its key; `found(key, seq)` for each. The relay would
/// hand such a key's rows over one batch at a time (never out of order:
/// the mark only spares it reading the rows behind a head). Nothing to
/// compare on a file without the column (before version 10).
pub(crate) fn alone_mismatches(
    conn: &Connection,
    mut found: impl FnMut(String, i64),
) -> rusqlite::Result<()> {
    if !columns(conn, "postroom_outbox")?
        .iter()
        .any(|c| c == "alone")
    {
        return Ok(());
    }
    let mut stmt = conn.prepare(
        "SELECT r.key, r.seq FROM postroom_outbox r
         WHERE r.alone = 1 AND r.status = 'pending' AND r.key IS NOT NULL
           AND (r.head = 0 OR EXISTS (SELECT 1 FROM postroom_outbox o
                                      WHERE o.key = r.key AND o.status = 'pending'
                                        AND o.seq <> r.seq))
         ORDER BY r.seq",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        let key = crate::store::text::lossy_text(r, 0)?.unwrap_or_default();
        found(key, r.get(1)?);
    }
    Ok(())
}

/// Gives the file its instance id (schema version 6): 128 random bits,
/// naming the stream its outbox `seq` numbers (see
/// [`OutboxMessage::origin`](crate::OutboxMessage::origin)).
fn add_instance_id(tx: &Connection) -> rusqlite::Result<()> {
    tx.execute(
        "INSERT OR IGNORE INTO postroom_meta (key, value)
         VALUES ('instance_id', lower(hex(randomblob(16))))",
        [],
    )
    .map(drop)
}

/// Where this engine's lease tokens start: 62 random bits (at least 1).
/// Not "the highest stored token + 1": a released row's token is cleared,
/// and two engines that both read the same maximum would hand out the same
/// tokens; random bases make two engines' tokens meet with a chance of
/// about (claims made) / 2^62, should two ever run on one file (an older
/// build that looks only at the engine file, a network filesystem).
pub(crate) fn lease_token_base(conn: &Connection) -> Result<i64> {
    conn.query_row("SELECT (random() & 4611686018427387903) | 1", [], |r| {
        r.get(0)
    })
    .map_err(|e| Error::sqlite("pick the lease tokens' base", e))
}

/// Adds the inbox's sequence columns (schema version 6) to an inbox that
/// lacks them, so that [`SCHEMA_SQL`]'s index and triggers on them can be
/// created by any step; an inbox the schema is about to create (a rebuild
/// renamed the old one away) gets them from its `CREATE TABLE`.
fn add_seq_columns(tx: &Connection) -> rusqlite::Result<()> {
    if !lacks_column(tx, "postroom_inbox", "seq")? {
        return Ok(());
    }
    tx.execute_batch(
        "ALTER TABLE postroom_inbox ADD COLUMN seq INTEGER CHECK (seq IS NULL OR seq >= 1);
         ALTER TABLE postroom_inbox ADD COLUMN seq_stream TEXT;",
    )
}

/// The columns of `table`, none when it does not exist.
fn columns(conn: &Connection, table: &str) -> rusqlite::Result<Vec<String>> {
    conn.prepare("SELECT name FROM pragma_table_info(?1)")?
        .query_map([table], |r| r.get(0))?
        .collect()
}

/// Whether `table` exists without `column`: an earlier version's table,
/// which a migration step gives the column. False for a table the schema
/// is about to create (none yet, or a rebuild renamed the old one away).
fn lacks_column(conn: &Connection, table: &str, column: &str) -> rusqlite::Result<bool> {
    let columns = columns(conn, table)?;
    Ok(!columns.is_empty() && !columns.iter().any(|c| c == column))
}

/// A step that only adds objects: runs the schema (every statement is
/// `IF NOT EXISTS`) and records `version`.
fn add_missing(tx: &Connection, version: i64) -> rusqlite::Result<()> {
    add_seq_columns(tx)?;
    add_head_column(tx)?;
    add_alone_column(tx)?;
    add_named_column(tx)?;
    // Indexes a later version no longer has (`migrate_v10`).
    tx.execute_batch("DROP INDEX IF EXISTS postroom_inbox_done")?;
    tx.execute_batch(SCHEMA_SQL)?;
    tx.execute(
        "UPDATE postroom_meta SET value = ?1 WHERE key = 'schema_version'",
        [version.to_string()],
    )
    .map(drop)
}

/// `Ok` for the schema version this build writes; an error for a newer one
/// or one it does not know.
pub(crate) fn check_version(found: i64) -> Result<()> {
    match found {
        SCHEMA_VERSION => Ok(()),
        found if found > SCHEMA_VERSION => Err(Error::SchemaTooNew {
            found,
            supported: SCHEMA_VERSION,
        }),
        found @ 1.. => Err(Error::invalid(
            "database",
            format!(
                "postroom schema version {found} is older than this build's {SCHEMA_VERSION}; \
                 opening it once with the engine migrates it"
            ),
        )),
        found => Err(Error::invalid(
            "database",
            format!("unknown postroom schema version {found} (this build knows {SCHEMA_VERSION})"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The open-time check knows every object the schema creates.
    #[test]
    fn lease_tokens_start_at_a_random_positive_base() {
        let conn = Connection::open_in_memory().unwrap();
        let bases: std::collections::HashSet<i64> =
            (0..16).map(|_| lease_token_base(&conn).unwrap()).collect();
        assert_eq!(bases.len(), 16);
        assert!(bases.iter().all(|&b| (1..1 << 62).contains(&b)));
    }

    /// A copy of a file, at another path, has another identity; the same
    /// file renamed keeps its own.
    #[test]
    fn a_copy_has_another_file_identity() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.db");
        std::fs::write(&a, b"x").unwrap();
        let first = file_identity(&a).unwrap();
        let b = dir.path().join("b.db");
        std::fs::copy(&a, &b).unwrap();
        assert_ne!(file_identity(&b).unwrap(), first);
        let moved = dir.path().join("moved.db");
        std::fs::rename(&a, &moved).unwrap();
        assert_eq!(file_identity(&moved).unwrap(), first);
    }

    #[test]
    fn every_object_of_the_schema_is_listed() {
        let objects: Vec<_> = schema_objects().collect();
        let creates = SCHEMA_SQL.matches("CREATE ").count();
        assert_eq!(objects.len(), creates, "{objects:?}");
        assert!(objects.contains(&("table".into(), "postroom_conflicts")));
        assert!(objects.contains(&("index".into(), "postroom_outbox_dead")));
        assert!(objects.contains(&("index".into(), "postroom_outbox_named")));
        assert!(objects.contains(&("trigger".into(), "postroom_inbox_key_fixed")));
    }

    /// A system SQLite older than rusqlite's floor is refused with the
    /// typed error, naming both versions; the floor itself is accepted, and
    /// so is the SQLite this build links.
    #[test]
    fn a_sqlite_older_than_3_45_3_is_refused_by_name() {
        match check_sqlite_version(3_045_002) {
            Err(Error::SqliteTooOld { found, required }) => {
                assert_eq!(found, "3.45.2");
                assert_eq!(required, "3.45.3");
            }
            other => panic!("3.45.2 was not refused: {other:?}"),
        }
        check_sqlite_version(3_045_003).unwrap();
        check_sqlite_version(rusqlite::version_number()).unwrap();
        let text = check_sqlite_version(3_024_000).unwrap_err().to_string();
        assert!(
            text.contains("3.24.0") && text.contains("bundled"),
            "{text}"
        );
    }

    /// `forget_statistics` deletes what `ANALYZE` learnt of postroom's
    /// tables and keeps the application's (one sharing the prefix
    /// included), and the connection that ran it
    /// plans without them at once: the heads are read through their
    /// index, not by a scan of the table that stale statistics pick.
    #[test]
    fn statistics_on_postroom_tables_are_forgotten_and_the_apps_kept() {
        let dir = tempfile::tempdir().unwrap();
        let conn = Connection::open(dir.path().join("stats.db")).unwrap();
        conn.execute_batch(SCHEMA_SQL).unwrap();
        conn.execute_batch(
            "CREATE TABLE app_orders (id INTEGER PRIMARY KEY, customer TEXT);
             CREATE INDEX app_orders_customer ON app_orders (customer);
             INSERT INTO app_orders (customer) VALUES ('a'), ('b'), ('a');
             CREATE TABLE postroom_app_notes (id INTEGER PRIMARY KEY, note TEXT);
             CREATE INDEX postroom_app_notes_note ON postroom_app_notes (note);
             INSERT INTO postroom_app_notes (note) VALUES ('x'), ('y');
             WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000)
             INSERT INTO postroom_outbox (message_id, topic, key, payload, status, created_at,
                 next_attempt_at)
             SELECT 'm' || i, 't', 'k' || i, x'', 'pending', 1, 0 FROM n;
             ANALYZE;",
        )
        .unwrap();
        let heads = "SELECT seq, key, alone FROM postroom_outbox
                     WHERE status = 'pending' AND head = 1 AND next_attempt_at <= 5
                     ORDER BY seq LIMIT 100";
        let plan = |conn: &Connection| -> String {
            conn.prepare(&format!("EXPLAIN QUERY PLAN {heads}"))
                .unwrap()
                .query_map([], |r| r.get::<_, String>(3))
                .unwrap()
                .map(Result::unwrap)
                .collect::<Vec<_>>()
                .join("; ")
        };
        assert!(
            !plan(&conn).contains("postroom_outbox_ready"),
            "{}",
            plan(&conn)
        );
        forget_statistics(&conn).unwrap();
        assert!(
            plan(&conn).contains("postroom_outbox_ready"),
            "{}",
            plan(&conn)
        );
        let kept: Vec<String> = conn
            .prepare("SELECT DISTINCT tbl FROM sqlite_stat1 ORDER BY 1")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(kept, ["app_orders", "postroom_app_notes"]);
        forget_statistics(&conn).unwrap(); // nothing left to forget
    }

    /// Every mismatch `head_mismatches` reports, as text.
    fn mismatches(conn: &Connection) -> Vec<String> {
        let mut found = Vec::new();
        head_mismatches(conn, |table, key, stored, expected| {
            found.push(format!("{table} {key}: {stored:?} != {expected:?}"))
        })
        .unwrap();
        found
    }

    /// The head triggers keep each key's head the lowest unfinished row
    /// through everything that changes rows: inserts (settled ones fire
    /// nothing), a head finishing, a later row finishing, a dead earlier
    /// row redriven (it becomes the head again), a hand edit of a key, a
    /// delete; and `postroom check` sees a head changed by hand.
    #[test]
    fn the_head_triggers_keep_each_keys_lowest_unfinished_row() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(SCHEMA_SQL).unwrap();
        let inbox_heads = |conn: &Connection| -> Vec<(String, i64)> {
            conn.prepare(
                "SELECT consumer || '/' || ordering_key, head_id FROM postroom_inbox_heads
                 ORDER BY 1",
            )
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
        };
        let outbox_heads = |conn: &Connection| -> Vec<(String, i64)> {
            conn.prepare(
                "SELECT key, seq FROM postroom_outbox
                 WHERE status = 'pending' AND head = 1 AND key IS NOT NULL ORDER BY 1",
            )
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
        };
        let insert = |id: i64, consumer: &str, key: Option<&str>, status: &str| {
            conn.execute(
                "INSERT INTO postroom_inbox (id, consumer, source, message_id, status, payload,
                     payload_hash, ordering_key, last_error, received_at, updated_at,
                     processed_at, lease_until, lease_token, queued)
                 VALUES (?1, ?2, 's', 'm' || ?1, ?3, x'', zeroblob(32), ?4, 'e', 1, 1, 1, 1, 1, 1)",
                rusqlite::params![id, consumer, status, key],
            )
            .unwrap();
        };
        let set = |id: i64, status: &str| {
            conn.execute(
                "UPDATE postroom_inbox SET status = ?2 WHERE id = ?1",
                rusqlite::params![id, status],
            )
            .unwrap();
        };
        insert(1, "c", Some("a"), "completed"); // settled at once: no head
        insert(2, "c", Some("a"), "failed");
        insert(3, "c", Some("a"), "pending");
        insert(4, "c", Some("a"), "pending");
        insert(5, "d", Some("a"), "pending"); // another consumer, same key
        insert(6, "c", None, "pending"); // no key: no head
        insert(7, "c", Some("b"), "processing");
        assert_eq!(
            inbox_heads(&conn),
            [("c/a".into(), 2), ("c/b".into(), 7), ("d/a".into(), 5)]
        );
        set(3, "completed"); // a later row finishing: the head stays
        assert_eq!(inbox_heads(&conn)[0], ("c/a".into(), 2));
        set(2, "dead"); // the head dying: the next unfinished row
        assert_eq!(inbox_heads(&conn)[0], ("c/a".into(), 4));
        set(2, "pending"); // redriven: the head again
        assert_eq!(inbox_heads(&conn)[0], ("c/a".into(), 2));
        set(2, "processing"); // claimed: still unfinished, still the head
        assert_eq!(inbox_heads(&conn)[0], ("c/a".into(), 2));
        set(7, "completed"); // the last row of a key: no head
        assert!(!inbox_heads(&conn).iter().any(|(k, _)| k == "c/b"));
        conn.execute(
            "UPDATE postroom_inbox SET ordering_key = 'b' WHERE id = 2",
            [],
        )
        .unwrap(); // a hand edit: both keys looked up again
        assert_eq!(
            inbox_heads(&conn),
            [("c/a".into(), 4), ("c/b".into(), 2), ("d/a".into(), 5)]
        );
        conn.execute("DELETE FROM postroom_inbox WHERE id = 4", [])
            .unwrap();
        assert_eq!(inbox_heads(&conn), [("c/b".into(), 2), ("d/a".into(), 5)]);
        assert_eq!(mismatches(&conn), Vec::<String>::new());

        let out = |seq: i64, key: Option<&str>, status: &str| {
            conn.execute(
                "INSERT INTO postroom_outbox (seq, message_id, topic, key, payload, status,
                     last_error, created_at, next_attempt_at, sent_at)
                 VALUES (?1, 'o' || ?1, 't', ?2, x'', ?3, 'e', 1, 0, 1)",
                rusqlite::params![seq, key, status],
            )
            .unwrap();
        };
        out(1, Some("k"), "sent");
        out(2, Some("k"), "pending");
        out(3, Some("k"), "pending");
        out(4, None, "pending");
        assert_eq!(outbox_heads(&conn), [("k".into(), 2)]);
        conn.execute(
            "UPDATE postroom_outbox SET status = 'dead' WHERE seq = 2",
            [],
        )
        .unwrap();
        assert_eq!(outbox_heads(&conn), [("k".into(), 3)]);
        conn.execute(
            "UPDATE postroom_outbox SET status = 'pending' WHERE seq = 2",
            [],
        )
        .unwrap();
        assert_eq!(outbox_heads(&conn), [("k".into(), 2)]);
        conn.execute(
            "UPDATE postroom_outbox SET status = 'sent' WHERE seq IN (2, 3)",
            [],
        )
        .unwrap();
        assert_eq!(outbox_heads(&conn), Vec::<(String, i64)>::new());
        out(5, Some("k"), "pending");
        out(6, Some("j"), "pending");
        conn.execute("UPDATE postroom_outbox SET key = 'j' WHERE seq = 5", [])
            .unwrap();
        assert_eq!(outbox_heads(&conn), [("j".into(), 5)]);
        conn.execute("DELETE FROM postroom_outbox WHERE seq = 5", [])
            .unwrap();
        assert_eq!(outbox_heads(&conn), [("j".into(), 6)]);
        assert_eq!(mismatches(&conn), Vec::<String>::new());

        // Changed by hand: `postroom check` names both.
        conn.execute_batch(
            "UPDATE postroom_inbox_heads SET head_id = 99 WHERE consumer = 'd';
             UPDATE postroom_outbox SET head = 0 WHERE seq = 6;",
        )
        .unwrap();
        assert_eq!(
            mismatches(&conn),
            [
                "postroom_inbox_heads d/a: Some(99) != Some(5)",
                "postroom_outbox j: None != Some(6)"
            ]
        );
        // fill_heads (the migration) sets them right.
        fill_heads(&conn).unwrap();
        assert_eq!(mismatches(&conn), Vec::<String>::new());
    }

    /// A head finishing costs the same whatever waits behind it: the
    /// trigger finds the successor with one index step (a first version
    /// used min() in a subquery, which SQLite answered by reading every
    /// unfinished row of the key: draining a key was quadratic).
    #[test]
    fn a_head_finishing_costs_the_same_whatever_waits_behind_it() {
        let finish_head = |behind: i64| {
            let mut conn = Connection::open_in_memory().unwrap();
            conn.execute_batch(SCHEMA_SQL).unwrap();
            conn.execute(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i <= ?1)
                 INSERT INTO postroom_inbox (consumer, source, message_id, status, payload,
                     payload_hash, ordering_key, received_at, updated_at, queued)
                 SELECT 'c', 's', 'm' || i, 'pending', x'', zeroblob(32), 'k', 1, 1, 1 FROM n;
                 ",
                [behind],
            )
            .unwrap();
            conn.execute(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i <= ?1)
                 INSERT INTO postroom_outbox (message_id, topic, key, payload, status,
                     created_at, next_attempt_at)
                 SELECT 'o' || i, 't', 'k', x'', 'pending', 1, 0 FROM n",
                [behind],
            )
            .unwrap();
            let ((), ops) = crate::store::queue::tests::vm_ops(&mut conn, |c| {
                c.execute_batch(
                    "UPDATE postroom_inbox SET status = 'completed', processed_at = 1
                     WHERE id = 1;
                     UPDATE postroom_outbox SET status = 'sent', sent_at = 1 WHERE seq = 1;",
                )
                .unwrap()
            });
            assert_eq!(mismatches(&conn), Vec::<String>::new());
            ops
        };
        let (few, many) = (finish_head(1), finish_head(100_000));
        assert!(
            many <= 2 * few + 1_000,
            "{few} VM steps with 1 row behind the heads, {many} with 100,000"
        );
    }
}
