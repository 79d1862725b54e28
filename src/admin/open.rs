//! Opening a database for operator work: read-only connections that leave
//! every file as it was ([`open_read`], [`read`]), writable ones after the
//! checks the engine's own open makes ([`open`]), and what the files on
//! disk say (the WAL's damaged frames, who holds a lock).
//!
//! Invariants: a read never creates, truncates or checkpoints a file; a
//! file that is not a complete postroom database of a version this library
//! reads is refused before any statement on its tables.

use std::io;
use std::path::Path;
use std::time::{Duration, SystemTime};

use rusqlite::{Connection, ErrorCode, OpenFlags};
use serde::Serialize;

use crate::clock::{self, Clock as _};
use crate::error::{Error, Result};
use crate::escape::Esc;
use crate::store::schema;

use super::DEFAULT_BUSY_TIMEOUT;

/// The wall clock in unix milliseconds: the engine's [`SystemClock`](crate::SystemClock).
pub fn now_ms() -> i64 {
    clock::SystemClock.now_ms()
}

/// What an operator's connection ([`open`]) may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read only: [`open_read`]'s connection, which leaves every file as
    /// it was.
    ReadOnly,
    /// Mutations too (redrive, discard, cleanup), after the checks the
    /// engine's own open makes.
    ReadWrite,
}

/// Opens an existing postroom database for operator work, with
/// [`DEFAULT_BUSY_TIMEOUT`]. See [`open_with_timeout`].
pub fn open(path: impl AsRef<Path>, access: Access) -> Result<Connection> {
    open_with_timeout(path, access, DEFAULT_BUSY_TIMEOUT)
}

/// Opens an existing postroom database for operator work: never creates a
/// file, never changes the journal mode, never takes the engine's lock.
///
/// With [`Access::ReadOnly`] it is [`open_read`]'s read-only connection (see
/// there for what it leaves untouched). With [`Access::ReadWrite`] the file and
/// its directory must be writable ([`Error::ReadOnly`] otherwise), and the
/// same `PRAGMA quick_check` the engine runs at open must pass
/// ([`Error::Corrupt`] otherwise): nothing writes to a damaged file.
///
/// Refuses, changing nothing:
/// * a `busy_timeout` over 2,147,483,647 ms: [`Error::InvalidInput`] with
///   field `"busy_timeout"`;
/// * a missing path, a symbolic link loop, an unreadable directory or a
///   file this user may not read: [`Error::Io`] with operation
///   `"open database"`;
/// * a path that is not a regular file, has several hard links, or is a
///   SQLite database without postroom's tables: [`Error::InvalidInput`]
///   with field `"database"`;
/// * a file that is not SQLite: [`Error::NotADatabase`];
/// * a schema newer than this library's: [`Error::SchemaTooNew`];
/// * an older or unknown schema version (the engine migrates on open; this
///   does not): [`Error::InvalidInput`] with field `"database"`.
pub fn open_with_timeout(
    path: impl AsRef<Path>,
    access: Access,
    busy_timeout: Duration,
) -> Result<Connection> {
    if access == Access::ReadOnly {
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
        if !crate::platform::may_write(target) {
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
                "{}: its -wal file holds {} bytes and nothing has the database open{}: the \
                 normal state after the application was killed or crashed. Only the engine \
                 should recover them: start the application (its engine recovers at open) and \
                 run this again while it runs; read commands work now",
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
        engine_running: crate::platform::engine_running(
            &path,
            &crate::store::beside(&path, "-postroom"),
        ),
        shm_in_use: crate::platform::shm_in_use(&crate::store::beside(&path, "-shm")),
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
        uri(path, query)?,
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

/// `file:` URI with `query` for an absolute path (see
/// [`crate::platform::uri_path`]).
fn uri(path: &Path, query: &str) -> Result<String> {
    let path = crate::platform::uri_path(path).map_err(|e| Error::io("open database", e))?;
    Ok(format!("file:{path}?{query}"))
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
        // SQLite would say "unable to open database file" of its own URI:
        // a file this user may not read is named and said so. Never by
        // opening it (see `platform::check_readable`).
        Ok(_) => match crate::platform::check_readable(path) {
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => Err(Error::Io {
                op: "open database",
                source: io::Error::new(
                    e.kind(),
                    format!(
                        "{}: permission denied: this user may not read it; run as its owner \
                         (or one its mode lets read it)",
                        path.display()
                    ),
                ),
            }),
            _ => schema::resolve(path),
        },
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
    let missing = crate::store::check::missing_tables(conn)
        .map_err(|e| schema::open_error(path, "read schema", e))?;
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
