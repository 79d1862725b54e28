//! Operator functions over a plain [`rusqlite::Connection`]: what the
//! `postroom` command-line tool does, for your own tooling too.
//!
//! These work on a database **while an application has it open**: they
//! never open a [`Postroom`](crate::Postroom) engine and never touch the
//! engine's lock file (`<db>-postroom`). [`open_read`] and [`read`] give a
//! read-only connection that leaves every file as it was; [`open`] with
//! `writable = true` one for mutations, after the checks the engine's own
//! open makes. Each mutation runs in its own short `BEGIN IMMEDIATE`
//! transaction, so it waits for — and is serialized with — the running
//! engine's writer.
//!
//! ```
//! # fn main() -> postroom::Result<()> {
//! # let dir = tempfile::tempdir().unwrap();
//! # let path = dir.path().join("app.db");
//! # postroom::Postroom::builder().open(&path)?.shutdown(std::time::Duration::from_secs(5))?;
//! use postroom::admin;
//!
//! let conn = admin::open(&path, false)?;          // read-only
//! let status = admin::status(&conn, &path)?;
//! assert_eq!(status.conflicts, 0);
//! print!("{}", admin::prometheus(&status));
//!
//! let report = admin::check(&conn, false)?;
//! assert!(report.is_ok());
//! # Ok(()) }
//! ```
//!
//! Times are unix milliseconds, as stored. Names and ids are always bound
//! as SQL parameters.

use crate::escape::Esc;
use std::fmt::{self, Write as _};
use std::io;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use rusqlite::{Connection, ErrorCode, OpenFlags, Transaction, TransactionBehavior};
use serde::Serialize;

use crate::clock::{self, Clock as _};
use crate::error::{Error, Result};
use crate::store::check as rows;
use crate::store::conflicts;
use crate::store::inbox::{self, Status};
use crate::store::outbox::{self, OutboxMessage};
use crate::store::payload::hex;
use crate::store::queue::{self, DeadLetter};
use crate::store::retention as store_retention;
use crate::store::retired;
use crate::store::schema;
use crate::store::stats::{self, OutboxCounts, StatusCounts};
use crate::store::watermark::StreamWatermark;

pub use crate::store::conflicts::{ConflictDetail, ConflictEntry};
pub use crate::store::inbox::{InboxDetail, InboxEntry, InboxFilter};
pub use crate::store::outbox::{OutboxDetail, OutboxEntry, OutboxFilter, OutboxState};
pub use crate::store::page::Page;
pub use crate::store::payload::{Decoded, Payload};

/// How long [`open`] waits for another connection's lock (the engine's
/// writer) before a statement fails with [`Error::Busy`].
pub const DEFAULT_BUSY_TIMEOUT: Duration = crate::config::DEFAULT_BUSY_TIMEOUT;

/// Rows deleted per transaction by [`cleanup`] (as the engine's retention).
pub const CLEANUP_BATCH: usize = store_retention::BATCH;

/// The engine's default retention, 7 days: the dedupe horizon.
pub const DEFAULT_RETENTION: Duration = crate::config::DEFAULT_RETENTION;

/// At most this many findings of each kind (violations, warnings) are kept
/// in a [`CheckReport`]; the totals count all of them.
pub const MAX_FINDINGS: usize = 100;

/// The wall clock in unix milliseconds: the engine's [`SystemClock`](crate::SystemClock).
pub fn now_ms() -> i64 {
    clock::SystemClock.now_ms()
}

/// Opens an existing postroom database for operator work, with
/// [`DEFAULT_BUSY_TIMEOUT`]. See [`open_with_timeout`].
pub fn open(path: impl AsRef<Path>, writable: bool) -> Result<Connection> {
    open_with_timeout(path, writable, DEFAULT_BUSY_TIMEOUT)
}

/// Opens an existing postroom database for operator work: never creates a
/// file, never changes the journal mode, never takes the engine's lock.
///
/// With `writable = false` it is [`open_read`]'s read-only connection (see
/// there for what it leaves untouched). With `writable = true` the file and
/// its directory must be writable ([`Error::ReadOnly`] otherwise), and the
/// same `PRAGMA quick_check` the engine runs at open must pass
/// ([`Error::Corrupt`] otherwise): nothing writes to a damaged file.
///
/// Refuses, changing nothing:
/// * a `busy_timeout` over 2,147,483,647 ms: [`Error::InvalidInput`] with
///   field `"busy_timeout"`;
/// * a missing path, a symbolic link loop or an unreadable directory:
///   [`Error::Io`] with operation `"open database"`;
/// * a path that is not a regular file, has several hard links, or is a
///   SQLite database without postroom's tables: [`Error::InvalidInput`]
///   with field `"database"`;
/// * a file that is not SQLite: [`Error::NotADatabase`];
/// * a schema newer than this library's: [`Error::SchemaTooNew`];
/// * an older or unknown schema version (the engine migrates on open; this
///   does not): [`Error::InvalidInput`] with field `"database"`.
pub fn open_with_timeout(
    path: impl AsRef<Path>,
    writable: bool,
    busy_timeout: Duration,
) -> Result<Connection> {
    if !writable {
        return open_read(path, busy_timeout).map(|(conn, _)| conn);
    }
    // Everything is checked on a read-only connection first: a read-write
    // one that turned out to be the last to close would checkpoint the WAL
    // into the file and delete it, refusal or not.
    let (reader, view) = open_read(path.as_ref(), busy_timeout)?;
    let path = view.path.clone();
    for target in [path.as_path(), schema::parent_dir(&path)] {
        // `access` says yes to root for anything but a read-only mount;
        // the mode's write bits say what the owner meant.
        let protected = std::fs::metadata(target).map_or(true, |m| m.permissions().readonly());
        if protected || rustix::fs::access(target, rustix::fs::Access::WRITE_OK).is_err() {
            return Err(Error::ReadOnly {
                path: target.to_path_buf(),
            });
        }
    }
    // With nobody else connected, this connection's close would copy the
    // WAL into the file and delete it: a killed engine's WAL, which only
    // the engine (with its own recovery) should take over.
    if view.wal_bytes > 0 && view.shm_in_use != Some(true) {
        return Err(Error::invalid(
            "database",
            format!(
                "{}: its -wal file holds {} bytes and nothing has the database open{}; only \
                 the engine should recover them: open it with the engine first",
                path.display(),
                view.wal_bytes,
                if view.shm_in_use.is_none() {
                    " (as far as can be told)"
                } else {
                    ""
                }
            ),
        ));
    }
    schema::quick_check(&reader)?;
    drop(reader);
    // READ_WRITE without CREATE: an existing file only.
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(&path, flags)
        .map_err(|e| schema::open_error(&path, "open database", e))?;
    conn.busy_timeout(busy_timeout)
        .map_err(|e| schema::open_error(&path, "set busy_timeout", e))?;
    validate(&conn, &path)?;
    Ok(conn)
}

/// How a connection from [`open_read`] sees the database, and what an
/// operator should be told about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ReadView {
    /// The database's canonical path (symbolic links resolved).
    pub path: std::path::PathBuf,
    /// Opened with SQLite's `immutable` flag: no lock taken and no `-shm`
    /// or `-wal` created. Used when there is no `-wal` beside the file (the
    /// file alone is the whole database), or when its `-wal` cannot be read
    /// without creating or writing a `-shm` file.
    pub immutable: bool,
    /// Size of the `-wal` file, 0 when there is none.
    pub wal_bytes: u64,
    /// The `-wal` file holds transactions this connection does not see
    /// (see [`ReadView::immutable`]): only the engine, at its next open,
    /// should recover them.
    pub wal_unread: bool,
    /// Whether an engine has the database open, from the kernel's table of
    /// file locks (`/proc/locks`); `None` when that cannot be told.
    pub engine_running: Option<bool>,
    /// Frames of the WAL's current generation past a checksum failure:
    /// damage that SQLite silently stops reading before (see
    /// [`wal_damaged_frames`]).
    pub wal_damaged_frames: u64,
    /// Whether any process (an engine, or any other SQLite connection)
    /// holds a lock on the `-shm` file, that is, has the database open in
    /// WAL mode; `None` when that cannot be told.
    pub shm_in_use: Option<bool>,
}

impl ReadView {
    /// What an operator should know before trusting what was read: a WAL
    /// that was not read, or one that no running engine owns.
    pub fn notices(&self) -> Vec<String> {
        let mut notes = Vec::new();
        if self.wal_damaged_frames > 0 {
            notes.push(format!(
                "the -wal file is damaged: {} frame(s) of committed transactions past a \
                 checksum failure are not read (by this command, nor by the engine's recovery, \
                 which drops them); keep a copy of the files before opening the engine",
                self.wal_damaged_frames
            ));
        }
        if self.wal_unread {
            notes.push(format!(
                "the -wal file holds {} bytes that were not read (reading them would create \
                 or write the -shm file); what is shown may be older than the last commits, \
                 and the engine recovers them at its next open",
                self.wal_bytes
            ));
        } else if self.wal_bytes > 0 && self.shm_in_use == Some(false) {
            notes.push(format!(
                "no engine has the database open, yet its -wal file holds {} bytes (left by an \
                 engine that did not shut down cleanly?): they were read without changing any \
                 file; the engine checkpoints them at its next open",
                self.wal_bytes
            ));
        }
        notes
    }
}

/// Opens an existing postroom database read-only, leaving every file as it
/// was, byte for byte: nothing is checkpointed, no `-wal` or `-shm` file is
/// created or deleted, and the database and its `-wal` are never written
/// (so it works on files this user cannot write). Checks as
/// [`open_with_timeout`] does.
///
/// * With a `-wal` and a `-shm` beside the file (an engine has it open, or
///   one was killed): a `SQLITE_OPEN_READONLY` connection that reads the
///   WAL as the engine would. Beside a running engine it shares the
///   engine's `-shm` index as any reader does; with no engine running it
///   reads the `-shm` without writing it (`readonly_shm`).
/// * Without a `-wal`, or with one but no usable `-shm`: an `immutable`
///   connection on the file alone ([`ReadView::immutable`]). It does not
///   see an engine that starts after it opened; [`read`] reruns its work
///   when that happened.
pub fn open_read(path: impl AsRef<Path>, busy_timeout: Duration) -> Result<(Connection, ReadView)> {
    let path = existing(path.as_ref(), busy_timeout)?;
    let wal = crate::store::beside(&path, "-wal");
    let wal_bytes = std::fs::metadata(&wal).map_or(0, |m| m.len());
    let has_wal = wal.exists();
    let has_shm = crate::store::beside(&path, "-shm").exists();
    // SQLite deletes the -wal of an empty database file at open, even on a
    // read-only connection: the file alone is read instead.
    let empty = std::fs::metadata(&path).map_or(true, |m| m.len() == 0);
    let mut view = ReadView {
        // The engine file's lock, or the database file's own (which holds
        // when the engine file was deleted; SQLite's locks there are POSIX).
        engine_running: match (
            locked(&crate::store::beside(&path, "-postroom"), |kind| {
                kind == "FLOCK"
            }),
            locked(&path, |kind| kind == "FLOCK"),
        ) {
            (Some(true), _) | (_, Some(true)) => Some(true),
            (Some(false), Some(false)) => Some(false),
            _ => None,
        },
        shm_in_use: locked(&crate::store::beside(&path, "-shm"), |_| true),
        path,
        immutable: !(has_wal && has_shm) || empty,
        wal_bytes,
        wal_unread: false,
        wal_damaged_frames: wal_damaged_frames(&wal).unwrap_or(0),
    };
    if !view.immutable {
        // Unless some connection is known to have the database open (it
        // keeps the `-shm` index, which the read then shares as any reader
        // does), nothing may rebuild the index a kill left stale, and this
        // read must not either: `readonly_shm` reads the WAL through
        // private memory.
        let query = if view.shm_in_use == Some(true) {
            "mode=ro"
        } else {
            "mode=ro&readonly_shm=1"
        };
        match connect(&view.path, query, busy_timeout) {
            Ok(conn) => return Ok((conn, view)),
            // A `-shm` this user cannot use: read the file alone instead.
            Err(Error::Sqlite { source, .. })
                if matches!(
                    source.sqlite_error_code(),
                    Some(ErrorCode::ReadOnly | ErrorCode::CannotOpen)
                ) =>
            {
                view.immutable = true
            }
            Err(e) => return Err(e),
        }
    }
    view.wal_unread = has_wal && wal_bytes > 0;
    let conn = connect(&view.path, "immutable=1", busy_timeout).map_err(|e| match e {
        // Say why a file may look incomplete: its newest commits are in a
        // WAL that was not read.
        Error::InvalidInput { field, reason } if view.wal_unread => Error::InvalidInput {
            field,
            reason: format!(
                "{reason} (only the database file was read: its -wal file, {} bytes, could \
                 not be read without writing a -shm file)",
                view.wal_bytes
            ),
        },
        e => e,
    })?;
    Ok((conn, view))
}

/// A read-only connection by URI (`query` its parameters), checked to be
/// a postroom database.
fn connect(path: &Path, query: &str, busy_timeout: Duration) -> Result<Connection> {
    let conn = Connection::open_with_flags(
        uri(path, query),
        OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_URI
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| schema::open_error(path, "open database", e))?;
    conn.busy_timeout(busy_timeout)
        .map_err(|e| schema::open_error(path, "set busy_timeout", e))?;
    validate(&conn, path)?;
    Ok(conn)
}

/// Frames of committed transactions that SQLite will never read because an
/// earlier frame of the WAL fails its checksum: damage, which a reader and
/// the engine's recovery silently stop before. After the failing frame the
/// walk picks the checksum chain up again from that frame's own stored
/// checksum: frames that chain on from there were written as one sequence
/// with it, and are counted when they include a commit. A torn last
/// transaction, a rolled-back transaction's spilled frames and older
/// generations (other salts) are what a WAL normally holds and are not
/// counted. `Ok(0)` when there is no WAL. The format:
/// <https://sqlite.org/fileformat2.html#walformat>.
pub fn wal_damaged_frames(wal: &Path) -> io::Result<u64> {
    use std::io::Read;
    let mut file = match std::fs::File::open(wal) {
        Ok(f) => io::BufReader::new(f),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut header = [0u8; 32];
    if file.read_exact(&mut header).is_err() {
        return Ok(0); // empty, or shorter than a header: nothing to read
    }
    let word = |b: &[u8], i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let big_endian = match word(&header, 0) {
        0x377f_0682 => false,
        0x377f_0683 => true,
        _ => return Ok(0), // not a WAL SQLite would read
    };
    let page_size = word(&header, 8) as usize;
    if !(512..=65536).contains(&page_size) || !page_size.is_power_of_two() {
        return Ok(0);
    }
    let salts = (word(&header, 16), word(&header, 20));
    let mut sum = (0u32, 0u32);
    let add = |sum: &mut (u32, u32), data: &[u8]| {
        for pair in data.chunks_exact(8) {
            let w = |i: usize| {
                let b = [pair[i], pair[i + 1], pair[i + 2], pair[i + 3]];
                if big_endian {
                    u32::from_be_bytes(b)
                } else {
                    u32::from_le_bytes(b)
                }
            };
            sum.0 = sum.0.wrapping_add(w(0)).wrapping_add(sum.1);
            sum.1 = sum.1.wrapping_add(w(4)).wrapping_add(sum.0);
        }
    };
    add(&mut sum, &header[..24]);
    if sum != (word(&header, 24), word(&header, 28)) {
        return Ok(0); // a header SQLite ignores: the WAL is empty to it
    }
    let mut frame = vec![0u8; 24 + page_size];
    // After a failure: frames chained on past it, and whether they hold a commit.
    let (mut broken, mut chained, mut commit) = (false, 0u64, false);
    while file.read_exact(&mut frame).is_ok() {
        if (word(&frame, 8), word(&frame, 12)) != salts {
            break; // an older generation's leftovers
        }
        let stored = (word(&frame, 16), word(&frame, 20));
        let mut next = sum;
        add(&mut next, &frame[..8]);
        add(&mut next, &frame[24..]);
        match (next == stored, broken) {
            (true, false) => sum = next,
            (false, false) => {
                // Pick the chain up from what this frame says it was.
                broken = true;
                chained = 1;
                commit = word(&frame, 4) != 0;
                sum = stored;
            }
            (true, true) => {
                chained += 1;
                commit |= word(&frame, 4) != 0;
                sum = next;
            }
            (false, true) => break,
        }
    }
    Ok(if broken && chained > 1 && commit {
        chained
    } else {
        0
    })
}

/// Runs `f` on an [`open_read`] connection. An `immutable` read cannot see
/// an engine that opened the database meanwhile (its commits go to a new
/// `-wal`, its checkpoints rewrite pages under the read); when the files
/// changed while `f` ran, `f` runs once more on a fresh connection, which
/// then reads the engine's WAL. `f`'s error is kept only when the files
/// did not change: a read torn by a checkpoint can look like damage.
pub fn read<T>(
    path: impl AsRef<Path>,
    busy_timeout: Duration,
    mut f: impl FnMut(&mut Connection, &ReadView) -> Result<T>,
) -> Result<(T, ReadView)> {
    let path = path.as_ref();
    let (mut conn, view) = open_read(path, busy_timeout)?;
    if !view.immutable {
        return f(&mut conn, &view).map(|t| (t, view));
    }
    let before = files_state(&view.path);
    let out = f(&mut conn, &view);
    drop(conn);
    if files_state(&view.path) == before {
        return out.map(|t| (t, view));
    }
    log::debug!(
        "{} changed during an immutable read: reading again",
        Esc(path.display())
    );
    let (mut conn, view) = open_read(path, busy_timeout)?;
    f(&mut conn, &view).map(|t| (t, view))
}

/// What tells that a database changed: its size and mtime, and whether
/// (and how large) its `-wal` is.
fn files_state(path: &Path) -> (Option<(u64, Option<SystemTime>)>, Option<u64>) {
    let db = std::fs::metadata(path)
        .ok()
        .map(|m| (m.len(), m.modified().ok()));
    let wal = std::fs::metadata(crate::store::beside(path, "-wal"))
        .ok()
        .map(|m| m.len());
    (db, wal)
}

/// `file:` URI with `query` for an absolute path. Every byte outside a
/// plain set is percent-encoded, so `?`, `#`, `%` and bytes that are not
/// UTF-8 stay part of the path.
fn uri(path: &Path, query: &str) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut uri = String::from("file:");
    for &b in path.as_os_str().as_bytes() {
        if b.is_ascii_alphanumeric() || b"/._-~+,=@".contains(&b) {
            uri.push(char::from(b));
        } else {
            let _ = write!(uri, "%{b:02X}");
        }
    }
    uri.push('?');
    uri.push_str(query);
    uri
}

/// Whether a lock is held on `file`, whose `/proc/locks` kind (`FLOCK`,
/// `POSIX`, `OFDLCK`) passes `kind`: read from the kernel's table, never by
/// taking a lock (taking even a shared one for a moment could make an
/// engine that opens just then fail). `Some(false)` when the file does not
/// exist; `None` when it cannot be told.
fn locked(file: &Path, kind: impl Fn(&str) -> bool) -> Option<bool> {
    use std::os::unix::fs::MetadataExt;
    let meta = match std::fs::metadata(file) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Some(false),
        Err(_) => return None,
    };
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    let dev = meta.dev();
    let id = format!(
        "{:02x}:{:02x}:{}",
        rustix::fs::major(dev),
        rustix::fs::minor(dev),
        meta.ino()
    );
    // `1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF`; blocked waiters
    // (`->`) hold nothing.
    Some(locks.lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.get(1).is_some_and(|k| kind(k)) && fields.contains(&id.as_str())
    }))
}

/// Checks the linked SQLite (as the engine's open does), the busy timeout
/// and the path: an existing regular file with one name; returns its
/// canonical path.
fn existing(path: &Path, busy_timeout: Duration) -> Result<std::path::PathBuf> {
    schema::check_sqlite_version(rusqlite::version_number())?;
    // SQLite counts it in milliseconds, in a C int.
    if busy_timeout > Duration::from_millis(i32::MAX as u64) {
        return Err(Error::invalid(
            "busy_timeout",
            format!("{busy_timeout:?} is too large: must be at most 2147483647 ms"),
        ));
    }
    match std::fs::metadata(path) {
        Ok(meta) if !meta.is_file() => Err(Error::invalid(
            "database",
            format!("{} is not a regular file", path.display()),
        )),
        Ok(_) => schema::resolve(path),
        Err(e) => Err(Error::Io {
            op: "open database",
            source: io::Error::new(
                e.kind(),
                if e.kind() == io::ErrorKind::NotFound {
                    format!("{} does not exist", path.display())
                } else {
                    format!("{}: {e}", path.display())
                },
            ),
        }),
    }
}

/// The schema version is one this library reads, and every table is there.
fn validate(conn: &Connection, path: &Path) -> Result<()> {
    let version =
        schema::stored_version(conn).map_err(|e| schema::open_error(path, "read schema", e))?;
    match version {
        None => {
            return Err(Error::invalid(
                "database",
                format!(
                    "{} is not a postroom database (it has no postroom_meta table)",
                    path.display()
                ),
            ))
        }
        Some(found) => schema::check_version(found)?,
    }
    let missing =
        schema::missing_tables(conn).map_err(|e| schema::open_error(path, "read schema", e))?;
    if !missing.is_empty() {
        return Err(Error::invalid(
            "database",
            format!(
                "{} is not a complete postroom database: missing {}",
                path.display(),
                missing.join(", ")
            ),
        ));
    }
    Ok(())
}

/// Runs `f` in one read transaction (one snapshot) unless the caller
/// already has a transaction open.
fn snapshot<T>(conn: &Connection, f: impl FnOnce() -> Result<T>) -> Result<T> {
    if !conn.is_autocommit() {
        return f();
    }
    let tx = Transaction::new_unchecked(conn, TransactionBehavior::Deferred)
        .map_err(|e| Error::sqlite("begin read transaction", e))?;
    let out = f()?;
    // Ending a read transaction cannot lose anything; a failure to end it
    // is still reported.
    tx.commit()
        .map_err(|e| Error::sqlite("end read transaction", e))?;
    Ok(out)
}

/// How often a mutation tries again for the write lock while another
/// writer holds it. SQLite's own busy handler backs off to 100 ms between
/// tries, and an engine that commits back to back leaves the lock free only
/// for moments in between, which those tries can miss for seconds
/// (docs/DESIGN.md, "Writes are short").
const WRITE_LOCK_RETRY: Duration = Duration::from_millis(1);

/// Runs `f` in its own `BEGIN IMMEDIATE` transaction: it waits (up to the
/// busy timeout, trying every [`WRITE_LOCK_RETRY`]) for the engine's
/// writer, then holds the write lock only for `f`. Rolled back when `f`
/// fails.
fn write<T>(
    conn: &Connection,
    op: &'static str,
    f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
) -> Result<T> {
    let tx = begin_immediate(conn).map_err(|e| Error::sqlite(op, e))?;
    let out = f(&tx).map_err(|e| Error::sqlite(op, e))?;
    tx.commit().map_err(|e| Error::sqlite(op, e))?;
    Ok(out)
}

/// `BEGIN IMMEDIATE`, tried every [`WRITE_LOCK_RETRY`] until the
/// connection's busy timeout has passed; the timeout is set back after. A
/// connection without one (none set, or a busy handler of the caller's
/// own, which reads as 0) is left as it is: one try, through its handler.
fn begin_immediate(conn: &Connection) -> rusqlite::Result<Transaction<'_>> {
    let timeout_ms: i64 = conn.pragma_query_value(None, "busy_timeout", |r| r.get(0))?;
    let timeout = Duration::from_millis(u64::try_from(timeout_ms).unwrap_or(0));
    if timeout.is_zero() {
        return Transaction::new_unchecked(conn, TransactionBehavior::Immediate);
    }
    let deadline = Instant::now() + timeout;
    conn.busy_timeout(Duration::ZERO)?;
    let begun = loop {
        match Transaction::new_unchecked(conn, TransactionBehavior::Immediate) {
            Err(e)
                if e.sqlite_error_code() == Some(ErrorCode::DatabaseBusy)
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(WRITE_LOCK_RETRY)
            }
            begun => break begun,
        }
    };
    conn.busy_timeout(timeout)?;
    begun
}

fn sql(op: &'static str) -> impl Fn(rusqlite::Error) -> Error {
    move |e| Error::sqlite(op, e)
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

// ---------------------------------------------------------------- status

/// Rows of one attempts count, in a consumer's attempts histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct AttemptsBucket {
    /// Attempts made.
    pub attempts: u32,
    /// Inbox rows (of any status) with that many attempts.
    pub rows: u64,
}

/// The inbox of one consumer, as [`status`] sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ConsumerStatus {
    /// The consumer's name.
    pub consumer: String,
    /// Rows by status: the engine's own [`StatusCounts`] (JSON: its fields
    /// inline, `"pending"`, `"processing"`, …).
    #[serde(flatten)]
    pub counts: StatusCounts,
    /// All rows.
    pub total: u64,
    /// `received_at` of the oldest message not yet done (pending,
    /// processing or failed): how far behind the consumer is.
    pub oldest_pending_ms: Option<i64>,
    /// Its age at the time of the report, in milliseconds.
    pub oldest_pending_age_ms: Option<i64>,
    /// Age of the oldest row waiting for a redelivery (`counts`'
    /// `waiting_for_redelivery`), since its last attempt, in milliseconds.
    pub oldest_waiting_for_redelivery_age_ms: Option<i64>,
    /// `processing` rows whose lease has passed: the engine's reaper (or its
    /// next open) turns them into retries.
    pub expired_leases: u64,
    /// Rows by attempts made, fewest first.
    pub attempts: Vec<AttemptsBucket>,
}

/// The outbox, as [`status`] sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct OutboxStatus {
    /// Rows by status: the engine's own [`OutboxCounts`] (JSON: its fields
    /// inline, `"pending"`, `"sent"`, `"dead"`).
    #[serde(flatten)]
    pub counts: OutboxCounts,
    /// `created_at` of the oldest pending row.
    pub oldest_pending_ms: Option<i64>,
    /// Its age at the time of the report, in milliseconds.
    pub oldest_pending_age_ms: Option<i64>,
}

/// Per consumer and sequence stream: the watermark, the highest sequence
/// stored, what is listed settled above the watermark and the missing
/// ranges ([`Message::with_sequence`](crate::Message::with_sequence)), in
/// consumer and stream order. Empty for a file without sequenced messages
/// (or not yet at schema version 6). Reads at most 4096 listed sequences
/// per stream.
pub fn sequences(conn: &Connection) -> Result<Vec<StreamWatermark>> {
    crate::store::watermark::read_all(conn).map_err(sql("read sequence watermarks"))
}

/// [`sequences`] in the Prometheus text format, to append to
/// [`prometheus`]'s: `postroom_sequence_watermark`,
/// `postroom_sequence_highest`, `postroom_sequence_listed`,
/// `postroom_sequence_unrecorded` and `postroom_sequence_missing` (the
/// count of sequences in the missing ranges shown), gauges labelled
/// `consumer` and `stream`; nothing when there are no streams.
pub fn sequences_prometheus(streams: &[StreamWatermark]) -> String {
    let mut out = String::new();
    if streams.is_empty() {
        // No family at all: the output of a file without sequences is as
        // before.
        return out;
    }
    let labels = |w: &StreamWatermark| {
        format!(
            "consumer=\"{}\",stream=\"{}\"",
            label(&w.consumer),
            label(&w.stream)
        )
    };
    type Field = fn(&StreamWatermark) -> u64;
    let families: [(&str, &str, Field); 5] = [
        (
            "postroom_sequence_watermark",
            "Every sequence up to this one has settled (completed or dead).",
            |w| w.watermark,
        ),
        (
            "postroom_sequence_highest",
            "The highest sequence stored; 0 when none since a reset.",
            |w| w.highest.unwrap_or(0),
        ),
        (
            "postroom_sequence_listed",
            "Settled sequences listed above the watermark (at most 4096).",
            |w| w.listed,
        ),
        (
            "postroom_sequence_unrecorded",
            "Settled sequences past the listing bound; non-zero: reset the stream.",
            |w| w.unrecorded,
        ),
        (
            "postroom_sequence_missing",
            "Sequences up to the highest that have not settled, in the ranges shown.",
            |w| w.missing.iter().map(|&(lo, hi)| hi - lo + 1).sum(),
        ),
    ];
    for (name, help, field) in families {
        family(
            &mut out,
            name,
            "gauge",
            help,
            streams.iter().map(|w| (labels(w), field(w).to_string())),
        );
    }
    out
}

/// What is in a postroom database, from [`status`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct StatusReport {
    /// The database file.
    pub path: String,
    /// When the report was made (unix ms); ages are measured from here.
    pub now_ms: i64,
    /// The schema version stored in the file.
    pub schema_version: i64,
    /// Per consumer, in name order. Only consumers with rows appear.
    pub consumers: Vec<ConsumerStatus>,
    /// The outbox.
    pub outbox: OutboxStatus,
    /// Rows in `postroom_conflicts`: quarantined deliveries.
    pub conflicts: u64,
    /// Size of the database file, in bytes.
    pub db_bytes: u64,
    /// Size of the `-wal` file, in bytes (0 when absent).
    pub wal_bytes: u64,
    /// Per consumer and sequence stream: the watermark, the highest
    /// sequence seen and what is missing (see [`sequences`]).
    pub sequences: Vec<StreamWatermark>,
}

/// Counts by status per consumer, oldest unfinished message and attempts
/// histogram per consumer, outbox backlog and its oldest row, conflicts,
/// and file sizes. One read transaction making four passes over the inbox
/// (seconds at millions of rows), during which the checkpointer cannot
/// restart the WAL past the read.
/// `path` is the database file (for the sizes).
pub fn status(conn: &Connection, path: &Path) -> Result<StatusReport> {
    let now = now_ms();
    snapshot(conn, || {
        let version = schema::stored_version(conn)
            .map_err(sql("read schema version"))?
            .unwrap_or(0);
        let st = stats::read(conn, path)?;
        let mut consumers: Vec<ConsumerStatus> = st
            .inbox
            .iter()
            .map(|(name, c)| ConsumerStatus {
                consumer: name.clone(),
                counts: *c,
                total: c.total(),
                oldest_pending_ms: None,
                oldest_pending_age_ms: None,
                oldest_waiting_for_redelivery_age_ms: c
                    .oldest_waiting_for_redelivery_ms
                    .map(|at| now.saturating_sub(at).max(0)),
                expired_leases: 0,
                attempts: Vec::new(),
            })
            .collect();
        let find = |consumers: &[ConsumerStatus], name: &str| {
            consumers.iter().position(|c| c.consumer == name)
        };

        let oldest = stats::oldest_unfinished(conn).map_err(sql("read oldest pending"))?;
        for (name, oldest) in oldest {
            if let Some(i) = find(&consumers, &name) {
                consumers[i].oldest_pending_ms = Some(oldest);
                consumers[i].oldest_pending_age_ms = Some(now.saturating_sub(oldest).max(0));
            }
        }
        let expired = stats::expired_leases(conn, now).map_err(sql("read leases"))?;
        for (name, n) in expired {
            if let Some(i) = find(&consumers, &name) {
                consumers[i].expired_leases = count(n);
            }
        }
        let buckets = stats::attempts(conn).map_err(sql("read attempts"))?;
        for (name, attempts, n) in buckets {
            if let Some(i) = find(&consumers, &name) {
                consumers[i].attempts.push(AttemptsBucket {
                    attempts,
                    rows: count(n),
                });
            }
        }

        Ok(StatusReport {
            path: path.display().to_string(),
            now_ms: now,
            schema_version: version,
            consumers,
            outbox: OutboxStatus {
                counts: st.outbox,
                oldest_pending_ms: st.oldest_pending_outbox_ms,
                oldest_pending_age_ms: st
                    .oldest_pending_outbox_ms
                    .map(|t| now.saturating_sub(t).max(0)),
            },
            conflicts: st.conflicts,
            sequences: st.sequences,
            db_bytes: st.db_bytes,
            wal_bytes: st.wal_bytes,
        })
    })
}

// ---------------------------------------------------------------- metrics

fn label(value: &str) -> String {
    let mut s = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

fn seconds(ms: Option<i64>) -> String {
    let ms = ms.unwrap_or(0).max(0);
    format!("{}.{:03}", ms / 1000, ms % 1000)
}

/// The numbers of a [`StatusReport`] in the Prometheus text exposition
/// format (version 0.0.4), each family with `# HELP` and `# TYPE` lines:
///
/// | metric | labels | type |
/// |---|---|---|
/// | `postroom_inbox_messages` | `consumer`, `status` | gauge |
/// | `postroom_oldest_pending_seconds` | `consumer` | gauge (0 when nothing waits) |
/// | `postroom_expired_leases` | `consumer` | gauge |
/// | `postroom_inbox_attempts` | `consumer`, `attempts` | gauge (rows per attempts count) |
/// | `postroom_outbox_messages` | `status` | gauge |
/// | `postroom_outbox_oldest_pending_seconds` | | gauge |
/// | `postroom_conflicts` | | gauge (rows; `conflict_retention`, `conflicts discard` and `cleanup` delete them) |
/// | `postroom_db_bytes`, `postroom_wal_bytes` | | gauge |
/// | `postroom_schema_version` | | gauge |
pub fn prometheus(report: &StatusReport) -> String {
    let mut out = String::new();
    let consumer = |c: &ConsumerStatus| format!("consumer=\"{}\"", label(&c.consumer));
    family(
        &mut out,
        "postroom_inbox_messages",
        "gauge",
        "Inbox rows by consumer and status.",
        report.consumers.iter().flat_map(|c| {
            Status::ALL.into_iter().map(move |s| {
                (
                    format!("{},status=\"{s}\"", consumer(c)),
                    c.counts.get(s).to_string(),
                )
            })
        }),
    );
    family(
        &mut out,
        "postroom_oldest_pending_seconds",
        "gauge",
        "Age of the oldest inbox message not yet done (pending, processing or failed); 0 when none.",
        report
            .consumers
            .iter()
            .map(|c| (consumer(c), seconds(c.oldest_pending_age_ms))),
    );
    family(
        &mut out,
        "postroom_waiting_for_redelivery",
        "gauge",
        "Failed inbox rows no worker retries (delivered inline, or counted by crash recovery \
         before their receipt committed): only their sender's redelivery revives them.",
        report
            .consumers
            .iter()
            .map(|c| (consumer(c), c.counts.waiting_for_redelivery.to_string())),
    );
    family(
        &mut out,
        "postroom_oldest_waiting_for_redelivery_seconds",
        "gauge",
        "Age of the oldest row waiting for a redelivery, since its last attempt; 0 when none.",
        report
            .consumers
            .iter()
            .map(|c| (consumer(c), seconds(c.oldest_waiting_for_redelivery_age_ms))),
    );
    family(
        &mut out,
        "postroom_expired_leases",
        "gauge",
        "Processing inbox rows whose lease has passed (recovered by the reaper or at next open).",
        report
            .consumers
            .iter()
            .map(|c| (consumer(c), c.expired_leases.to_string())),
    );
    family(
        &mut out,
        "postroom_inbox_attempts",
        "gauge",
        "Inbox rows by consumer and number of attempts made.",
        report.consumers.iter().flat_map(|c| {
            c.attempts.iter().map(move |b| {
                (
                    format!("{},attempts=\"{}\"", consumer(c), b.attempts),
                    b.rows.to_string(),
                )
            })
        }),
    );
    family(
        &mut out,
        "postroom_outbox_messages",
        "gauge",
        "Outbox rows by status.",
        [
            ("pending", report.outbox.counts.pending),
            ("sent", report.outbox.counts.sent),
            ("dead", report.outbox.counts.dead),
        ]
        .into_iter()
        .map(|(s, n)| (format!("status=\"{s}\""), n.to_string())),
    );
    let scalars: [(&str, &str, &str, String); 5] = [
        (
            "postroom_outbox_oldest_pending_seconds",
            "gauge",
            "Age of the oldest pending outbox row; 0 when none.",
            seconds(report.outbox.oldest_pending_age_ms),
        ),
        (
            "postroom_conflicts",
            "gauge",
            "Quarantined deliveries (same id, different payload) in postroom_conflicts.",
            report.conflicts.to_string(),
        ),
        (
            "postroom_db_bytes",
            "gauge",
            "Size of the database file in bytes.",
            report.db_bytes.to_string(),
        ),
        (
            "postroom_wal_bytes",
            "gauge",
            "Size of the write-ahead log file in bytes.",
            report.wal_bytes.to_string(),
        ),
        (
            "postroom_schema_version",
            "gauge",
            "Schema version stored in the database.",
            report.schema_version.to_string(),
        ),
    ];
    for (name, kind, help, value) in scalars {
        family(&mut out, name, kind, help, [(String::new(), value)]);
    }
    out
}

/// One metric family: HELP, TYPE, then a sample per `(labels, value)`,
/// `labels` without braces (empty for none).
fn family(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    samples: impl IntoIterator<Item = (String, String)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, value) in samples {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {value}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
}

// ---------------------------------------------------------------- payloads

impl Payload {
    /// For people: pretty-printed JSON, or the text, or a hex dump (offset,
    /// 16 bytes in hex, and their printable ASCII). JSON is re-indented
    /// without being reparsed: large numbers and duplicate keys show as
    /// stored.
    ///
    /// Bounded, whatever the payload: about [`PRETTY_MAX_BYTES`] of output
    /// at most, JSON nested deeper than [`PRETTY_MAX_DEPTH`] levels shown
    /// as `[…]` / `{…}`, each cut said on a last line starting
    /// `… truncated`. Linear in what it shows, without recursion, so a
    /// hostile payload (100,000 nested arrays) costs the operator's machine
    /// nothing. The exact bytes are in the serialization (`--json`).
    pub fn pretty(&self) -> String {
        let limit = PRETTY_MAX_BYTES;
        let total = self.0.len();
        let (mut s, cut) = match self.encoding() {
            "json" => reindent(&String::from_utf8_lossy(&self.0), PRETTY_MAX_DEPTH, limit),
            "text" => {
                let text = String::from_utf8_lossy(&self.0);
                let mut end = text.len().min(limit);
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                let cut = Cut {
                    size: end < text.len(),
                    deep: false,
                };
                (text[..end].to_owned(), cut)
            }
            _ => {
                let mut s = String::new();
                let mut size = false;
                for (n, chunk) in self.0.chunks(16).enumerate() {
                    if s.len() >= limit {
                        size = true;
                        break;
                    }
                    let _ = write!(s, "{:08x}  ", n * 16);
                    for i in 0..16 {
                        match chunk.get(i) {
                            Some(b) => {
                                let _ = write!(s, "{b:02x} ");
                            }
                            None => s.push_str("   "),
                        }
                    }
                    s.push(' ');
                    for &b in chunk {
                        s.push(if b.is_ascii_graphic() || b == b' ' {
                            char::from(b)
                        } else {
                            '.'
                        });
                    }
                    s.push('\n');
                }
                (s, Cut { size, deep: false })
            }
        };
        if (cut.deep || cut.size) && !s.ends_with('\n') {
            s.push('\n');
        }
        if cut.deep {
            let _ = writeln!(
                s,
                "… truncated: nesting deeper than {PRETTY_MAX_DEPTH} levels is shown as […] or \
                 {{…}}; --json gives the payload exactly"
            );
        }
        if cut.size {
            let _ = writeln!(
                s,
                "… truncated after {} bytes of output (the payload has {total} bytes); --json \
                 gives the payload exactly",
                limit
            );
        }
        s
    }
}

/// About how many bytes [`Payload::pretty`] shows (a line may run past).
pub const PRETTY_MAX_BYTES: usize = 64 * 1024;

/// How deep [`Payload::pretty`] shows nested JSON.
pub const PRETTY_MAX_DEPTH: usize = 32;

/// What [`Payload::pretty`] left out.
#[derive(Debug, Clone, Copy, Default)]
struct Cut {
    /// Stopped at the size limit.
    size: bool,
    /// Elided values nested past the depth limit.
    deep: bool,
}

/// Valid JSON text re-indented by two spaces per level, every token kept
/// as stored: numbers past what a double holds, duplicate keys, key order
/// and string escapes come out as they went in (a reparse would change
/// them). One pass, no recursion: an array or object that would open level
/// `max_depth + 1` is shown as `[…]` / `{…}` and skipped, so indentation
/// costs at most `2 * max_depth` bytes a line; output stops once it holds
/// `max_bytes`.
fn reindent(text: &str, max_depth: usize, max_bytes: usize) -> (String, Cut) {
    let mut out = String::with_capacity(text.len().min(max_bytes) * 2);
    let mut cut = Cut::default();
    let mut depth = 0usize;
    let (mut in_string, mut escaped) = (false, false);
    let newline = |out: &mut String, depth: usize| {
        out.push('\n');
        out.push_str(&"  ".repeat(depth));
    };
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if out.len() >= max_bytes {
            cut.size = true;
            break;
        }
        if in_string {
            out.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            '{' | '[' => {
                out.push(c);
                while chars.peek().is_some_and(|c| c.is_ascii_whitespace()) {
                    chars.next();
                }
                if matches!(chars.peek(), Some('}' | ']')) {
                    out.extend(chars.next());
                } else if depth >= max_depth {
                    // Too deep to show: the value's inside is skipped
                    // whole (strings included), in one pass.
                    cut.deep = true;
                    out.push('…');
                    skip_value_rest(&mut chars);
                    out.push(if c == '{' { '}' } else { ']' });
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(c);
            }
            ',' => {
                out.push(c);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            c if c.is_ascii_whitespace() => {}
            c => out.push(c),
        }
    }
    (out, cut)
}

/// Consumes the rest of an array or object whose opening bracket was just
/// read, up to and including its closing bracket. Iterative: a count of
/// open brackets, not a recursion.
fn skip_value_rest(chars: &mut impl Iterator<Item = char>) {
    let mut open = 1usize;
    let (mut in_string, mut escaped) = (false, false);
    for c in chars {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' | '[' => open += 1,
            '}' | ']' => {
                open -= 1;
                if open == 0 {
                    return;
                }
            }
            _ => {}
        }
    }
}

// ---------------------------------------------------------------- inbox

/// Inbox rows matching `filter`, one [`Page`] of them (newest first by
/// default).
pub fn inbox_list(conn: &Connection, filter: &InboxFilter) -> Result<Vec<InboxEntry>> {
    inbox::list(conn, filter).map_err(sql("list inbox"))
}

/// The inbox row with this id, in full; `None` when there is none.
pub fn inbox_show(conn: &Connection, id: i64) -> Result<Option<InboxDetail>> {
    snapshot(conn, || {
        inbox::show(conn, id).map_err(sql("show inbox row"))
    })
}

// ---------------------------------------------------------------- dead letters

/// Dead inbox messages, oldest first, of one consumer or all, at most
/// `limit`, with payloads (as [`Postroom::dead_letters`](crate::Postroom::dead_letters)).
pub fn dead_letters(
    conn: &Connection,
    consumer: Option<&str>,
    limit: usize,
) -> Result<Vec<DeadLetter>> {
    queue::dead_letters(conn, consumer, limit).map_err(sql("list dead letters"))
}

/// Dead outbox messages, oldest first, at most `limit` (as
/// [`Postroom::outbox_dead_letters`](crate::Postroom::outbox_dead_letters)).
pub fn outbox_dead_letters(conn: &Connection, limit: usize) -> Result<Vec<OutboxMessage>> {
    outbox::dead_letters(conn, limit).map_err(sql("list outbox dead letters"))
}

/// Sends the dead letter with row id `id` back to `pending`, attempts
/// reset, due at once whatever the engine's clock reads (`now_ms` stamps
/// `updated_at`): a running engine's workers pick it up at their next
/// poll. Returns false (changing nothing) when `id` is not a dead
/// letter. One `BEGIN IMMEDIATE` transaction.
pub fn redrive(conn: &Connection, id: i64, now_ms: i64) -> Result<bool> {
    write(conn, "redrive", |c| queue::redrive(c, id, now_ms))
}

/// Gives up on the dead letter with row id `id` for good: it becomes
/// `completed` without its effects (payload dropped, reason kept), so a
/// redelivery is a duplicate. Returns false (changing nothing) when `id` is
/// not a dead letter. One `BEGIN IMMEDIATE` transaction.
pub fn discard(conn: &Connection, id: i64, now_ms: i64) -> Result<bool> {
    write(conn, "discard", |c| queue::discard(c, id, now_ms))
}

/// Sends the dead outbox row `seq` back to the relay, attempts reset, due
/// at once whatever the engine's clock reads. Returns false (changing
/// nothing) when it is not a dead outbox row.
pub fn redrive_outbox(conn: &Connection, seq: i64) -> Result<bool> {
    write(conn, "redrive outbox row", |c| outbox::redrive(c, seq))
}

/// Gives up on the dead outbox row `seq`: it will not be sent. As
/// [`Postroom::discard_outbox`](crate::Postroom::discard_outbox): marked
/// `sent` without being handed over (payload dropped, reason kept), deleted
/// later by retention. Returns false (changing nothing) when it is not a
/// dead outbox row.
pub fn discard_outbox(conn: &Connection, seq: i64, now_ms: i64) -> Result<bool> {
    write(conn, "discard outbox row", |c| {
        outbox::discard(c, seq, now_ms)
    })
}

/// Which dead letters [`dead_select`] finds. Every filter is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadFilter {
    /// Dead outbox rows instead of inbox messages.
    pub outbox: bool,
    /// Only this consumer's (inbox only).
    pub consumer: Option<String>,
    /// Only those whose last error contains this text.
    pub error_contains: Option<String>,
    /// Only those that died at or after this time (unix ms); for outbox
    /// rows, that were committed at or after it.
    pub since_ms: Option<i64>,
    /// Only those that died (outbox: were committed) before this time.
    pub until_ms: Option<i64>,
}

/// Row ids (inbox) or `seq`s (outbox) of the dead letters matching
/// `filter`, one [`Page`] of them (a bulk action takes them all, oldest
/// first: [`Page::all`]).
pub fn dead_select(conn: &Connection, filter: &DeadFilter, page: Page) -> Result<Vec<i64>> {
    let found = if filter.outbox {
        if filter.consumer.is_some() {
            // Consumers are an inbox notion: no outbox row is any one's.
            return Ok(Vec::new());
        }
        outbox::dead_seqs(
            conn,
            filter.error_contains.as_deref(),
            (filter.since_ms, filter.until_ms),
            page,
        )
    } else {
        inbox::dead_ids(
            conn,
            filter.consumer.as_deref(),
            filter.error_contains.as_deref(),
            (filter.since_ms, filter.until_ms),
            page,
        )
    };
    found.map_err(sql("select dead letters"))
}

/// What [`act_on_dead_letters`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct BulkSummary {
    /// Dead letters redriven or discarded.
    pub done: u64,
    /// Ids that were no longer dead letters when their turn came (the
    /// engine or another operator got there first): left as they were.
    pub skipped: u64,
    /// Write transactions used.
    pub transactions: u64,
}

/// Rows per transaction of [`act_on_dead_letters`], as [`cleanup`]'s batches.
const BULK_BATCH: usize = CLEANUP_BATCH;

/// What [`act_on_dead_letters`] does to each dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetterAction {
    /// As [`redrive`] / [`redrive_outbox`]: back to pending, attempts reset.
    Redrive,
    /// As [`discard`] / [`discard_outbox`]: given up for good.
    Discard,
}

impl DeadLetterAction {
    /// `"redrive"` or `"discard"`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterAction::Redrive => "redrive",
            DeadLetterAction::Discard => "discard",
        }
    }
}

/// Redrives or discards each dead letter of `ids` (inbox row ids, or
/// outbox `seq`s with `outbox`), [`CLEANUP_BATCH`] per `BEGIN IMMEDIATE`
/// transaction, pausing between full batches like [`cleanup`]. An id that
/// is not (or no longer) a dead letter is left as it is and counted as
/// skipped. `progress` hears the count handled so far after each batch.
pub fn act_on_dead_letters(
    conn: &Connection,
    action: DeadLetterAction,
    outbox: bool,
    ids: &[i64],
    now_ms: i64,
    progress: &mut dyn FnMut(u64),
) -> Result<BulkSummary> {
    let mut summary = BulkSummary::default();
    for batch in ids.chunks(BULK_BATCH) {
        let started = Instant::now();
        let done = write(conn, "act on dead letters", |c| {
            let mut done = 0;
            for &id in batch {
                let acted = match (action, outbox) {
                    (DeadLetterAction::Redrive, false) => queue::redrive(c, id, now_ms)?,
                    (DeadLetterAction::Redrive, true) => outbox::redrive(c, id)?,
                    (DeadLetterAction::Discard, false) => queue::discard(c, id, now_ms)?,
                    (DeadLetterAction::Discard, true) => outbox::discard(c, id, now_ms)?,
                };
                done += u64::from(acted);
            }
            Ok(done)
        })?;
        summary.transactions += 1;
        summary.done += done;
        summary.skipped += batch.len() as u64 - done;
        progress(summary.done + summary.skipped);
        if batch.len() == BULK_BATCH {
            pause_after(started);
        }
    }
    Ok(summary)
}

// ---------------------------------------------------------------- outbox

/// Outbox rows matching `filter`, one [`Page`] of them (newest first by
/// default).
pub fn outbox_list(conn: &Connection, filter: &OutboxFilter) -> Result<Vec<OutboxEntry>> {
    outbox::list(conn, filter, now_ms()).map_err(sql("list outbox"))
}

/// The outbox row `seq` in full, with what holds it back; `None` when
/// there is none.
pub fn outbox_show(conn: &Connection, seq: i64) -> Result<Option<OutboxDetail>> {
    let now = now_ms();
    snapshot(conn, || {
        outbox::show(conn, seq, now).map_err(sql("show outbox row"))
    })
}

// ---------------------------------------------------------------- conflicts

/// Quarantined deliveries, one [`Page`] of them (newest first by default).
pub fn conflicts_list(conn: &Connection, page: Page) -> Result<Vec<ConflictEntry>> {
    conflicts::list(conn, page).map_err(sql("list conflicts"))
}

/// The conflict with this id, in full; `None` when there is none.
pub fn conflicts_show(conn: &Connection, id: i64) -> Result<Option<ConflictDetail>> {
    snapshot(conn, || {
        conflicts::show(conn, id).map_err(sql("show conflict"))
    })
}

/// Deletes the conflict `id`, its payload with it: an operator looked at it
/// and is done. Returns false (changing nothing) when there is none. Its id
/// is never given to a later conflict; a redelivery of the same payload is
/// quarantined anew. One `BEGIN IMMEDIATE` transaction.
pub fn conflicts_discard(conn: &Connection, id: i64) -> Result<bool> {
    write(conn, "discard conflict", |c| inbox::discard_conflict(c, id))
}

// ---------------------------------------------------------------- cleanup

/// How long [`cleanup`] keeps finished rows: the engine's `retention`,
/// `dead_retention` and `conflict_retention` settings, for running
/// retention from outside the engine (the CLI's `cleanup`). A bare
/// [`Duration`] converts into one that keeps dead letters and conflicts,
/// as the engine's defaults do.
///
/// ```
/// use std::time::Duration;
/// use postroom::admin::Retention;
///
/// let day = Duration::from_secs(24 * 3600);
/// let policy = Retention::new(7 * day).dead(Some(30 * day)).conflicts(Some(30 * day));
/// assert_eq!(policy.dead, Some(30 * day));
/// assert_eq!(Retention::from(7 * day).conflicts, None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Retention {
    /// Completed inbox rows processed, and sent outbox rows sent, longer
    /// ago than this are deleted: the dedupe horizon.
    pub completed: Duration,
    /// Dead letters (inbox) that died longer ago than this are deleted;
    /// `None` (the default) keeps them.
    pub dead: Option<Duration>,
    /// Quarantined deliveries last seen longer ago than this are deleted;
    /// `None` (the default) keeps them.
    pub conflicts: Option<Duration>,
}

impl Retention {
    /// Deletes completed and sent rows older than `completed`; keeps dead
    /// letters and conflicts.
    pub fn new(completed: Duration) -> Self {
        Retention {
            completed,
            dead: None,
            conflicts: None,
        }
    }

    /// Also delete dead letters older than this (`None`: keep them).
    pub fn dead(mut self, dead: Option<Duration>) -> Self {
        self.dead = dead;
        self
    }

    /// Also delete conflicts last seen longer ago than this (`None`: keep
    /// them).
    pub fn conflicts(mut self, conflicts: Option<Duration>) -> Self {
        self.conflicts = conflicts;
        self
    }
}

impl From<Duration> for Retention {
    fn from(completed: Duration) -> Self {
        Retention::new(completed)
    }
}

/// What [`cleanup`] deleted, or would delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CleanupSummary {
    /// Completed and sent rows finished before this time (unix ms) are past
    /// retention.
    pub cutoff_ms: i64,
    /// Dead letters that died before this time are past
    /// [`Retention::dead`]; `None` when it is `None`.
    pub dead_cutoff_ms: Option<i64>,
    /// Conflicts last seen before this time are past
    /// [`Retention::conflicts`]; `None` when it is `None`.
    pub conflicts_cutoff_ms: Option<i64>,
    /// True when nothing was deleted, only counted.
    pub dry_run: bool,
    /// Completed inbox rows deleted (or that would be).
    pub inbox_deleted: u64,
    /// Their key entries deleted, after the rows, in key order (0 for a
    /// dry run): as many, plus any an interrupted pass left; fewer if the
    /// engine's reaper deleted some first.
    pub keys_deleted: u64,
    /// Sent outbox rows deleted (or that would be).
    pub outbox_deleted: u64,
    /// Inbox dead letters deleted (or that would be); `None` when
    /// [`Retention::dead`] is `None`.
    pub dead_deleted: Option<u64>,
    /// Conflicts deleted (or that would be); `None` when
    /// [`Retention::conflicts`] is `None`.
    pub conflicts_deleted: Option<u64>,
    /// Write transactions used (0 for a dry run).
    pub transactions: u64,
}

/// Applies retention as the engine's reaper does: completed inbox rows
/// processed, and sent outbox rows sent, before `now_ms - completed`; with
/// [`Retention::dead`] / [`Retention::conflicts`], dead letters and
/// conflicts too. Pending, failed and processing rows are never touched,
/// nor the newest row of the inbox or the outbox (so no row id or `seq` is
/// given out twice). `retention` is a [`Retention`] or a bare [`Duration`]
/// (completed and sent rows only).
///
/// With `dry_run`, only counts, with the statements a run deletes with
/// (read-only). Otherwise deletes [`CLEANUP_BATCH`] rows per
/// `BEGIN IMMEDIATE` transaction, pausing between batches as long as the
/// batch took, so a running engine's writer gets the lock at least half of
/// the time.
pub fn cleanup(
    conn: &Connection,
    now_ms: i64,
    retention: impl Into<Retention>,
    dry_run: bool,
) -> Result<CleanupSummary> {
    let retention = retention.into();
    let keep = store_retention::Keep {
        completed: retention.completed,
        dead: retention.dead,
        conflicts: retention.conflicts,
    };
    let cutoffs = keep.cutoffs(now_ms);
    let mut summary = CleanupSummary {
        cutoff_ms: cutoffs.completed,
        dead_cutoff_ms: cutoffs.dead,
        conflicts_cutoff_ms: cutoffs.conflicts,
        dry_run,
        inbox_deleted: 0,
        keys_deleted: 0,
        outbox_deleted: 0,
        dead_deleted: None,
        conflicts_deleted: None,
        transactions: 0,
    };
    if dry_run {
        return snapshot(conn, || {
            let expired = |statement, cutoff| {
                queue::count_expired(conn, statement, cutoff).map_err(sql("count expired rows"))
            };
            summary.inbox_deleted = expired(queue::DELETE_COMPLETED, cutoffs.completed)?;
            summary.outbox_deleted = expired(outbox::DELETE_SENT, cutoffs.completed)?;
            if let Some(c) = cutoffs.dead {
                summary.dead_deleted = Some(expired(queue::DELETE_DEAD, c)?);
            }
            if let Some(c) = cutoffs.conflicts {
                summary.conflicts_deleted = Some(expired(inbox::DELETE_CONFLICTS, c)?);
            }
            Ok(summary)
        });
    }
    let mut cleaner = Cleaner {
        conn,
        transactions: 0,
        started: Instant::now(),
    };
    let deleted = store_retention::run(cutoffs, &mut cleaner)?;
    summary.inbox_deleted = deleted.inbox;
    summary.keys_deleted = deleted.keys;
    summary.outbox_deleted = deleted.outbox;
    summary.dead_deleted = deleted.dead;
    summary.conflicts_deleted = deleted.conflicts;
    summary.transactions = cleaner.transactions;
    Ok(summary)
}

/// Retention on an operator's connection: each batch its own
/// `BEGIN IMMEDIATE`, with a pause after it as long as it took, so a
/// running engine's writer gets the lock at least half of the time.
struct Cleaner<'c> {
    conn: &'c Connection,
    transactions: u64,
    /// When the last batch began.
    started: Instant,
}

impl store_retention::Driver for Cleaner<'_> {
    type Error = Error;

    fn delete(&mut self, statement: &'static str, cutoff: i64) -> Result<usize> {
        self.started = Instant::now();
        self.transactions += 1;
        write(self.conn, "delete expired rows", |c| {
            queue::delete_expired(c, statement, cutoff, CLEANUP_BATCH)
        })
    }

    fn read_retired(&mut self) -> Result<Option<retired::Retired>> {
        retired::read(self.conn).map_err(sql("read retired keys"))
    }

    fn apply_retired(&mut self, batch: retired::Batch) -> Result<usize> {
        let started = Instant::now();
        self.transactions += 1;
        let n = write(self.conn, "delete retired keys", |c| {
            retired::apply(c, &batch)
        })?;
        pause_after(started);
        Ok(n)
    }

    fn between_batches(&mut self) -> bool {
        pause_after(self.started);
        true
    }
}

/// Lets a running engine's writer have the lock at least half of the time.
fn pause_after(started: Instant) {
    std::thread::sleep(started.elapsed().max(Duration::from_millis(1)));
}

// ---------------------------------------------------------------- check

/// What a [`Finding`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FindingKind {
    /// A stored inbox payload does not match its stored blake3 digest.
    PayloadDigest,
    /// A quarantined payload does not match its stored digest.
    ConflictDigest,
    /// An inbox or outbox row's columns contradict its status (e.g. a
    /// completed row without `processed_at`, a dead row without payload or
    /// error, a processing row without a lease).
    StatusFields,
    /// An outbox row names a cause whose inbox row exists but is not
    /// completed: its effects committed without the message being done.
    CauseNotCompleted,
    /// The inbox's key table (`postroom_inbox_keys`) disagrees with the
    /// inbox: an entry missing, wrong or without its row. Dedupe answers
    /// come from that table, so this breaks exactly-once.
    KeyTable,
    /// An ordering key's head (`postroom_inbox_heads`, the outbox's
    /// `head` column) is not its lowest unfinished row: the due
    /// queries read only heads, so the key would be held back for good or
    /// run out of order. Kept by triggers: the file was changed outside
    /// postroom.
    HeadTable,
    /// A `processing` row whose lease has passed. Not a violation: the
    /// reaper, or the engine's next open, retries it.
    ExpiredLease,
    /// Committed transactions in the WAL past a checksum failure, which
    /// SQLite does not read ([`wal_damaged_frames`]). A warning: the file
    /// as read is consistent, but unless an engine has already gone on past
    /// the damage, its next open drops them; keep a copy of the files.
    WalDamage,
    /// One of postroom's triggers is missing or not as the schema ships it
    /// (its SQL differs): what it keeps (the key table, the watermarks) is
    /// no longer kept. A trigger of someone else's on a postroom table is
    /// a warning of this kind: it runs inside the engine's statements.
    Trigger,
    /// A sequence watermark contradicts itself: `settled_below` under 1, a
    /// listed sequence at or below it or above the stream's `highest`, a
    /// listing without its stream, or more listed than the bound. A
    /// retained row below the watermark that has not settled is a warning
    /// of this kind (a dead letter redriven after its number settled; else
    /// the watermark passed a message that never settled).
    Watermark,
    /// The file is not the one its instance id was given to (a copy, a
    /// restore into a new file, or made by an older build): a warning.
    /// The next engine open gives it a new instance id, and a downstream
    /// postroom numbers its outbox as a new stream.
    Identity,
}

impl fmt::Display for FindingKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FindingKind::PayloadDigest => "payload_digest",
            FindingKind::ConflictDigest => "conflict_digest",
            FindingKind::StatusFields => "status_fields",
            FindingKind::CauseNotCompleted => "cause_not_completed",
            FindingKind::KeyTable => "key_table",
            FindingKind::HeadTable => "head_table",
            FindingKind::ExpiredLease => "expired_lease",
            FindingKind::WalDamage => "wal_damage",
            FindingKind::Trigger => "trigger",
            FindingKind::Watermark => "watermark",
            FindingKind::Identity => "identity",
        })
    }
}

/// One problem found by [`check`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Finding {
    /// What kind of problem.
    pub kind: FindingKind,
    /// The table of the row.
    pub table: &'static str,
    /// The row's id (`seq` for the outbox).
    pub id: i64,
    /// What is wrong, for people.
    pub detail: String,
}

/// The result of [`check`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CheckReport {
    /// `"quick_check"` or `"integrity_check"`.
    pub integrity_check: &'static str,
    /// True when SQLite's check answered `ok`.
    pub integrity_ok: bool,
    /// What SQLite's check reported otherwise (at most 100 lines).
    pub integrity_errors: Vec<String>,
    /// Frames of committed transactions in the WAL past a checksum
    /// failure ([`wal_damaged_frames`]): SQLite's check cannot see them (it
    /// reads what the WAL holds before the failure); reported as a
    /// [`FindingKind::WalDamage`] warning.
    pub wal_damaged_frames: u64,
    /// False when the file failed SQLite's check: postroom's invariants
    /// were then not checked (the rows cannot be trusted).
    pub invariants_checked: bool,
    /// Inbox rows looked at.
    pub inbox_rows: u64,
    /// Stored payloads (inbox and conflicts) whose digest was recomputed.
    pub payloads_hashed: u64,
    /// Outbox rows looked at.
    pub outbox_rows: u64,
    /// Broken invariants (at most [`MAX_FINDINGS`]).
    pub violations: Vec<Finding>,
    /// All broken invariants found.
    pub violations_total: u64,
    /// Worth knowing, not broken (at most [`MAX_FINDINGS`]).
    pub warnings: Vec<Finding>,
    /// All warnings found.
    pub warnings_total: u64,
}

impl CheckReport {
    /// True when SQLite's check passed and no invariant is broken
    /// (warnings allowed).
    pub fn is_ok(&self) -> bool {
        self.integrity_ok && self.violations_total == 0
    }

    fn violation(&mut self, f: Finding) {
        self.violations_total += 1;
        if self.violations.len() < MAX_FINDINGS {
            self.violations.push(f);
        }
    }

    fn warning(&mut self, f: Finding) {
        self.warnings_total += 1;
        if self.warnings.len() < MAX_FINDINGS {
            self.warnings.push(f);
        }
    }
}

/// Checks the database: SQLite's `PRAGMA quick_check` (or the slower, more
/// thorough `integrity_check` when `full`), then, if that passed,
/// postroom's own invariants, in one read transaction:
///
/// * every stored inbox and conflict payload matches its blake3 digest;
/// * each row's columns fit its status (schema.sql's invariants);
/// * an outbox row caused by an inbox message whose row still exists (and
///   was received before the outbox row was written) points to a
///   completed row — rows deleted by retention are fine;
/// * every inbox row has its entry in the key table, only they do, and the
///   triggers that keep it so exist (a missing one is reported with id 0);
/// * `processing` rows whose lease has passed are reported as warnings:
///   the reaper or the engine's next open recovers them.
///
/// Reads every stored payload; on a live database the read transaction
/// keeps the WAL from being checkpointed past it while it runs.
pub fn check(conn: &Connection, full: bool) -> Result<CheckReport> {
    let now = now_ms();
    let pragma = if full {
        "integrity_check"
    } else {
        "quick_check"
    };
    let mut report = CheckReport {
        integrity_check: pragma,
        integrity_ok: false,
        integrity_errors: Vec::new(),
        wal_damaged_frames: 0,
        invariants_checked: false,
        inbox_rows: 0,
        payloads_hashed: 0,
        outbox_rows: 0,
        violations: Vec::new(),
        violations_total: 0,
        warnings: Vec::new(),
        warnings_total: 0,
    };
    let lines = rows::integrity(conn, full).map_err(sql("integrity check"))?;
    report.integrity_ok = lines.len() == 1 && lines[0] == "ok";
    if !report.integrity_ok {
        report.integrity_errors = lines;
    }
    if let Some(db) = conn.path().filter(|p| !p.is_empty()) {
        report.wal_damaged_frames =
            wal_damaged_frames(&crate::store::beside(Path::new(db), "-wal"))
                .map_err(|e| Error::io("read the WAL", e))?;
    }
    if report.wal_damaged_frames > 0 {
        report.warning(Finding {
            kind: FindingKind::WalDamage,
            table: "-wal",
            id: 0,
            detail: format!(
                "{} frame(s) of committed transactions past a checksum failure, which SQLite \
                 does not read",
                report.wal_damaged_frames
            ),
        });
    }
    if !report.integrity_ok {
        return Ok(report);
    }
    snapshot(conn, || check_invariants(conn, now, &mut report))?;
    report.invariants_checked = true;
    Ok(report)
}

/// postroom's triggers against the schema's (missing key triggers are
/// reported as `key_table` findings, as before).
fn check_triggers(conn: &Connection, report: &mut CheckReport) -> Result<()> {
    use schema::TriggerFinding;
    for found in schema::audit_triggers(conn).map_err(sql("check triggers"))? {
        let finding = |detail: String| Finding {
            kind: FindingKind::Trigger,
            table: "sqlite_master",
            id: 0,
            detail,
        };
        match found {
            TriggerFinding::Missing(name) if schema::KEY_TRIGGERS.contains(&name) => {}
            TriggerFinding::Missing(name) => report.violation(finding(format!(
                "trigger {name} is missing: what it keeps is not kept"
            ))),
            TriggerFinding::Altered(name) => report.violation(finding(format!(
                "trigger {name} is not the one the schema ships (its SQL differs): what \
                     it keeps is not kept as the engine relies on; restore it from schema.sql"
            ))),
            TriggerFinding::Foreign { name, table } => report.warning(finding(format!(
                "trigger {name} on {table} is not postroom's: it runs inside the engine's \
                     statements, so make sure it neither changes nor ignores them"
            ))),
        }
    }
    Ok(())
}

/// The sequence watermarks' invariants (docs/DESIGN.md "Sequence
/// watermarks"), each a query over the two tables and the inbox.
fn check_watermarks(conn: &Connection, report: &mut CheckReport) -> Result<()> {
    rows::watermark_breaks(conn, |b| {
        let finding = Finding {
            kind: FindingKind::Watermark,
            table: b.table,
            id: 0,
            detail: format!(
                "consumer {:?}, stream {:?}: {}",
                b.consumer, b.stream, b.what
            ),
        };
        if b.violation {
            report.violation(finding);
        } else {
            report.warning(finding);
        }
    })
    .map_err(sql("check watermarks"))
}

/// The identity recorded beside the instance id against this file's.
fn check_identity(conn: &Connection, db: &Path, report: &mut CheckReport) -> Result<()> {
    let Ok(identity) = schema::file_identity(db) else {
        return Ok(());
    };
    let recorded = rows::recorded_identity(conn).map_err(sql("check identity"))?;
    if recorded.as_deref() != Some(identity.as_str()) {
        report.warning(Finding {
            kind: FindingKind::Identity,
            table: "postroom_meta",
            id: 0,
            detail: format!(
                "this file is not the one its instance id was given to ({}): the next engine \
                 open gives it a new instance id, and a downstream postroom numbers its outbox \
                 as a new stream (nothing is lost)",
                if recorded.is_some() {
                    "a copy, or a restore into a new file"
                } else {
                    "no file identity recorded: made by an older build"
                }
            ),
        });
    }
    Ok(())
}

/// Every invariant over the rows, each its own function, in one snapshot
/// (the caller's).
fn check_invariants(conn: &Connection, now: i64, report: &mut CheckReport) -> Result<()> {
    check_key_triggers(conn, report)?;
    check_triggers(conn, report)?;
    check_watermarks(conn, report)?;
    check_key_table(conn, report)?;
    check_key_heads(conn, report)?;
    check_inbox_rows(conn, now, report)?;
    check_conflict_digests(conn, report)?;
    check_outbox_rows(conn, report)?;
    if let Some(db) = conn.path().filter(|p| !p.is_empty()) {
        check_identity(conn, Path::new(db), report)?;
    }
    Ok(())
}

/// The triggers that keep the key table exist.
fn check_key_triggers(conn: &Connection, report: &mut CheckReport) -> Result<()> {
    for name in schema::missing_triggers(conn).map_err(sql("check inbox keys"))? {
        report.violation(Finding {
            kind: FindingKind::KeyTable,
            table: "postroom_inbox",
            id: 0,
            detail: format!("trigger {name} is missing"),
        });
    }
    Ok(())
}

/// Every inbox row has its entry in the key table, and only they do.
fn check_key_table(conn: &Connection, report: &mut CheckReport) -> Result<()> {
    inbox::key_mismatches(conn, |table, id, what| {
        report.violation(Finding {
            kind: FindingKind::KeyTable,
            table,
            id,
            detail: what.to_string(),
        })
    })
    .map_err(sql("check inbox keys"))
}

/// Each ordering key's head names its lowest unfinished row.
fn check_key_heads(conn: &Connection, report: &mut CheckReport) -> Result<()> {
    schema::head_mismatches(conn, |table, key, stored, expected| {
        let show = |id: Option<i64>| id.map_or_else(|| "none".to_owned(), |id| id.to_string());
        report.violation(Finding {
            kind: FindingKind::HeadTable,
            table,
            id: stored.or(expected).unwrap_or_default(),
            detail: format!(
                "key {key:?}: head {}, but its lowest unfinished row is {}",
                show(stored),
                show(expected)
            ),
        })
    })
    .map_err(sql("check key heads"))
}

/// Each inbox row: its payload matches its digest, its status has the
/// fields it needs, and a lease that passed is a warning.
fn check_inbox_rows(conn: &Connection, now: i64, report: &mut CheckReport) -> Result<()> {
    rows::inbox_rows(conn, |row| {
        report.inbox_rows += 1;
        if let Some(p) = &row.payload {
            report.payloads_hashed += 1;
            let actual = blake3::hash(p);
            if actual.as_bytes().as_slice() != row.payload_hash.as_slice() {
                report.violation(Finding {
                    kind: FindingKind::PayloadDigest,
                    table: "postroom_inbox",
                    id: row.id,
                    detail: format!(
                        "stored payload ({} bytes) hashes to {}, stored digest is {}",
                        p.len(),
                        actual.to_hex(),
                        hex(&row.payload_hash)
                    ),
                });
            }
        }
        let wrong = missing_inbox_fields(&row);
        if !wrong.is_empty() {
            report.violation(Finding {
                kind: FindingKind::StatusFields,
                table: "postroom_inbox",
                id: row.id,
                detail: format!("{} row with {}", row.status, wrong.join(" and ")),
            });
        }
        if row.status == Status::Processing {
            if let Some(until) = row.lease_until.filter(|&u| u < now) {
                report.warning(Finding {
                    kind: FindingKind::ExpiredLease,
                    table: "postroom_inbox",
                    id: row.id,
                    detail: format!(
                        "lease expired {} ms ago; retried after the reaper's next pass or \
                         the engine's next open",
                        now - until
                    ),
                });
            }
        }
    })
    .map_err(sql("check inbox"))
}

/// What an inbox row in its status should have and lacks.
fn missing_inbox_fields(row: &rows::InboxRow) -> Vec<&'static str> {
    let mut wrong = Vec::new();
    match row.status {
        Status::Completed if row.processed_at.is_none() => wrong.push("no processed_at"),
        Status::Failed | Status::Dead => {
            if row.payload.is_none() {
                wrong.push("no payload");
            }
            if row.last_error.is_none() {
                wrong.push("no last_error");
            }
        }
        Status::Processing if row.lease_until.is_none() || row.lease_token.is_none() => {
            wrong.push("no lease")
        }
        _ => {}
    }
    wrong
}

/// Each quarantined payload matches its digest.
fn check_conflict_digests(conn: &Connection, report: &mut CheckReport) -> Result<()> {
    rows::conflict_rows(conn, |id, payload, hash| {
        report.payloads_hashed += 1;
        let actual = blake3::hash(&payload);
        if actual.as_bytes().as_slice() != hash.as_slice() {
            report.violation(Finding {
                kind: FindingKind::ConflictDigest,
                table: "postroom_conflicts",
                id,
                detail: format!(
                    "quarantined payload ({} bytes) hashes to {}, stored digest is {}",
                    payload.len(),
                    actual.to_hex(),
                    hex(&hash)
                ),
            });
        }
    })
    .map_err(sql("check conflicts"))
}

/// Each outbox row has the fields its status needs, and the inbox row
/// whose handler published it (while stored) is completed.
fn check_outbox_rows(conn: &Connection, report: &mut CheckReport) -> Result<()> {
    rows::outbox_rows(conn, |row| {
        report.outbox_rows += 1;
        let wrong = match row.status.as_str() {
            "sent" if row.sent_at.is_none() => Some("no sent_at"),
            "dead" if row.last_error.is_none() => Some("no last_error"),
            _ => None,
        };
        if let Some(wrong) = wrong {
            report.violation(Finding {
                kind: FindingKind::StatusFields,
                table: "postroom_outbox",
                id: row.seq,
                detail: format!("{} row with {wrong}", row.status),
            });
        }
        if let Some((inbox_id, inbox_status)) = row.cause {
            if inbox_status != Status::Completed {
                report.violation(Finding {
                    kind: FindingKind::CauseNotCompleted,
                    table: "postroom_outbox",
                    id: row.seq,
                    detail: format!(
                        "published while handling inbox row {inbox_id}, which is {inbox_status}, \
                         not completed"
                    ),
                });
            }
        }
    })
    .map_err(sql("check outbox"))
}

/// True for a character that reorders or hides the text around it
/// (Unicode's format characters, the line and paragraph separators): what
/// the CLI escapes besides control characters, the same list as the
/// engine's own log text.
pub fn invisible(c: char) -> bool {
    crate::escape::invisible(c)
}

/// A handler that has held a running engine's writer longer than its
/// `slow_handler` threshold: every write of that engine waits for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct SlowHandler {
    /// Its consumer.
    pub consumer: String,
    /// The message it handles (a very long id is cut).
    pub message_id: String,
    /// When it started (unix ms).
    pub since_ms: i64,
}

/// The slow handler that the engine running on the database at `path`
/// records in its engine file, if any. `None` also when no engine runs
/// (a record left by a process that died is stale; its next open clears
/// it) or the record cannot be read.
pub fn slow_handler(path: &Path) -> Option<SlowHandler> {
    let path = schema::resolve(path).ok()?;
    let running = locked(&crate::store::beside(&path, "-postroom"), |kind| {
        kind == "FLOCK"
    });
    if running == Some(false) {
        return None;
    }
    let slow = crate::store::inflight::read_slow_handler(&path).ok()??;
    Some(SlowHandler {
        consumer: slow.consumer,
        message_id: slow.message_id,
        since_ms: slow.since_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pretty_json_is_cut_at_depth_and_size_and_strings_are_never_misread() {
        // Small JSON comes out whole and re-indented, as stored.
        let small = Payload(br#"{"a":[1,2],"b":"x]"}"#.to_vec());
        assert_eq!(
            small.pretty(),
            "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": \"x]\"\n}"
        );
        // Past the depth limit a value is elided whole: brackets inside its
        // strings do not end it early, and what follows it is shown.
        let (shown, cut) = reindent(r#"[[["a]]]\"", [1]], "after"], 2]"#, 2, 1 << 20);
        assert!(cut.deep && !cut.size, "{shown}");
        assert!(shown.contains("[…]"), "{shown}");
        assert!(shown.contains("\"after\""), "{shown}");
        assert!(!shown.contains("a]]]"), "{shown}");
        // The size limit stops the pass; the marker says so.
        let wide = Payload(format!("[{}1]", "1,".repeat(100_000)).into_bytes());
        let shown = wide.pretty();
        assert!(shown.len() < PRETTY_MAX_BYTES + 1024, "{}", shown.len());
        assert!(
            shown.ends_with("--json gives the payload exactly\n"),
            "{shown}"
        );
        // Deep nesting: linear, no recursion, both markers where both apply.
        let deep = Payload(format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes());
        let shown = deep.pretty();
        assert!(shown.len() < 4096, "{}", shown.len());
        assert!(
            shown.contains("… truncated: nesting deeper than 32 levels"),
            "{shown}"
        );
    }
}
