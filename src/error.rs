//! The one error type of the crate.

use std::fmt;
use std::io;
use std::path::PathBuf;

use rusqlite::ErrorCode;

/// Everything that can go wrong in postroom.
///
/// Each variant says which operation failed. Whenever an `Err` is returned
/// from a call that would have told you to acknowledge a message, nothing was
/// acknowledged: keep the message and deliver it again later.
/// [`Error::is_retryable`] tells whether trying again may succeed without
/// anybody changing anything.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// An argument was rejected before anything was stored.
    InvalidInput {
        /// Which argument, e.g. `"message id"`.
        field: &'static str,
        /// Why, naming the limit where there is one.
        reason: String,
    },
    /// `deliver` named a consumer that was not registered on the builder.
    UnknownConsumer {
        /// The name that was asked for.
        consumer: String,
    },
    /// The file exists but is not a SQLite database.
    NotADatabase {
        /// The file.
        path: PathBuf,
    },
    /// The database was written by a newer postroom whose schema this
    /// version does not understand. Nothing was changed.
    SchemaTooNew {
        /// The version found in the file.
        found: i64,
        /// The newest version this library knows.
        supported: i64,
    },
    /// The SQLite library linked in (the system's, when the default
    /// `bundled` feature is off) is older than the engine's SQL needs.
    /// Refused at open, before any file is touched.
    SqliteTooOld {
        /// The linked library's version, e.g. `"3.31.1"`.
        found: String,
        /// The oldest version postroom works with
        /// ([`MIN_SQLITE_VERSION`](crate::MIN_SQLITE_VERSION)).
        required: &'static str,
    },
    /// SQLite reports the database as damaged (`quick_check` failed, or
    /// `SQLITE_CORRUPT` while reading).
    Corrupt {
        /// What SQLite said.
        detail: String,
    },
    /// The database file, or the directory it is in, cannot be written
    /// (permissions, an immutable flag, a read-only mount): postroom needs
    /// to write the file and to create its `-wal`, `-shm` and `-postroom`
    /// files beside it. Nothing was changed.
    ReadOnly {
        /// What cannot be written: the database file, its directory, or the
        /// engine file beside it.
        path: PathBuf,
    },
    /// Another process has the database file (or the engine file beside
    /// it) open without sharing it: on Windows, an antivirus scanner, a
    /// backup or sync tool, or a program that opened it exclusively. It was
    /// waited for (the database file up to the busy timeout, the engine
    /// file about a second); nothing was changed. Retryable: try again once
    /// that process lets go of the file.
    FileInUse {
        /// The file held.
        path: PathBuf,
    },
    /// Another engine (in this or another process) has this database open.
    AlreadyOpen {
        /// The database file.
        path: PathBuf,
    },
    /// The disk (or the configured `max_page_count`) is full. Nothing was
    /// stored; retry once space has been freed. The engine meanwhile gives
    /// the WAL's own space back (copies it into the database and truncates
    /// it), so it recovers by itself, without a restart.
    StorageFull {
        /// The operation that needed space.
        op: &'static str,
    },
    /// Another connection held the write lock past the busy timeout.
    Busy {
        /// The operation that waited.
        op: &'static str,
    },
    /// The consumer's backlog (rows stored for queued processing and not
    /// yet settled) has reached its bound (`Builder::backlog_limit`):
    /// nothing of the call was stored. Retryable: pause, and send again
    /// once the workers have drained some (a puller stops pulling; a
    /// broker intake stops reading, acknowledging nothing meanwhile).
    Backlogged {
        /// The consumer.
        consumer: String,
        /// Its backlog as counted (at least `limit`).
        backlog: u64,
        /// Its bound.
        limit: u64,
    },
    /// Strict order (`Builder::strict_order`): an inline `deliver` of a
    /// message whose ordering key has a dead message, or one still
    /// unfinished, received before it. Nothing was run or stored.
    /// Retryable: do not acknowledge it; deliver it again later (the key
    /// is released once the dead message is redriven and processed, or
    /// discarded, and the earlier ones are done).
    KeyHeld {
        /// The consumer.
        consumer: String,
        /// The message's ordering key.
        ordering_key: String,
    },
    /// Any other SQLite error.
    Sqlite {
        /// The operation that failed.
        op: &'static str,
        /// The underlying error.
        source: rusqlite::Error,
    },
    /// User code's SQL rolled the whole transaction back: a trigger's
    /// `RAISE(ROLLBACK)`, an `INSERT OR ROLLBACK` (or SQLite did after an
    /// error user code did not pass on). Nothing of it was stored. Not
    /// retryable as it is: the same code would do the same. Deliveries
    /// never return it: a handler that does this has the attempt counted
    /// as failed ([`Outcome::Failed`](crate::Outcome::Failed), dead after
    /// `max_attempts`), and the other jobs of its group commit run again.
    RolledBack {
        /// The operation whose transaction vanished.
        op: &'static str,
    },
    /// An I/O error outside SQLite (creating the file, the engine's lock file).
    Io {
        /// The operation that failed.
        op: &'static str,
        /// The underlying error.
        source: io::Error,
    },
    /// A [`Postroom::transaction`](crate::Postroom::transaction) closure
    /// returned a failure or panicked; its writes were rolled back.
    Aborted {
        /// What happened.
        reason: String,
    },
    /// Another job's SQL in the same group commit rolled the shared
    /// transaction back (see [`Error::RolledBack`]) after this call's work
    /// had run and before it could commit. Nothing of this call was stored;
    /// it had done nothing wrong: retry.
    GroupRolledBack {
        /// What the other job's error said.
        reason: String,
    },
    /// The engine has been shut down, or its writer thread stopped.
    Closed,
    /// One of the engine's threads died (panicked), so part of its work is
    /// no longer done; the engine refuses new work rather than accept what
    /// nobody would process. Nothing of the refused call was stored. Shut
    /// the engine down and open it again: what it had accepted is kept and
    /// recovered at open.
    Stopped {
        /// The thread's name, e.g. `"postroom-dispatcher"`.
        thread: String,
        /// Why it died (the panic message).
        reason: String,
    },
}

impl Error {
    /// True when trying the same call again later may succeed without anyone
    /// fixing anything: the disk filled up, another process held the lock,
    /// or a transient I/O error occurred.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::StorageFull { .. }
            | Error::Busy { .. }
            | Error::FileInUse { .. }
            | Error::Backlogged { .. }
            | Error::KeyHeld { .. }
            | Error::GroupRolledBack { .. } => true,
            Error::Sqlite { source, .. } => matches!(
                source.sqlite_error_code(),
                Some(ErrorCode::SystemIoFailure | ErrorCode::OutOfMemory)
            ),
            Error::Io { source, .. } => matches!(
                source.kind(),
                io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
            _ => false,
        }
    }

    /// Classifies a SQLite error: full disk, busy and corruption get their
    /// own variants so callers can match on them.
    pub(crate) fn sqlite(op: &'static str, source: rusqlite::Error) -> Error {
        match source.sqlite_error_code() {
            Some(ErrorCode::DiskFull) => Error::StorageFull { op },
            Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => Error::Busy { op },
            Some(ErrorCode::DatabaseCorrupt) => Error::Corrupt {
                detail: source.to_string(),
            },
            _ => Error::Sqlite { op, source },
        }
    }

    pub(crate) fn io(op: &'static str, source: io::Error) -> Error {
        match source.kind() {
            io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded => Error::StorageFull { op },
            _ => Error::Io { op, source },
        }
    }

    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Error {
        Error::InvalidInput {
            field,
            reason: reason.into(),
        }
    }

    /// A copy of this error for each job of a batch whose `COMMIT` failed.
    /// `rusqlite::Error` is not `Clone`; the SQLite codes and message are kept.
    pub(crate) fn duplicate(&self) -> Error {
        match self {
            Error::InvalidInput { field, reason } => Error::InvalidInput {
                field,
                reason: reason.clone(),
            },
            Error::UnknownConsumer { consumer } => Error::UnknownConsumer {
                consumer: consumer.clone(),
            },
            Error::NotADatabase { path } => Error::NotADatabase { path: path.clone() },
            Error::SchemaTooNew { found, supported } => Error::SchemaTooNew {
                found: *found,
                supported: *supported,
            },
            Error::SqliteTooOld { found, required } => Error::SqliteTooOld {
                found: found.clone(),
                required,
            },
            Error::Corrupt { detail } => Error::Corrupt {
                detail: detail.clone(),
            },
            Error::AlreadyOpen { path } => Error::AlreadyOpen { path: path.clone() },
            Error::ReadOnly { path } => Error::ReadOnly { path: path.clone() },
            Error::FileInUse { path } => Error::FileInUse { path: path.clone() },
            Error::StorageFull { op } => Error::StorageFull { op },
            Error::Busy { op } => Error::Busy { op },
            Error::Backlogged {
                consumer,
                backlog,
                limit,
            } => Error::Backlogged {
                consumer: consumer.clone(),
                backlog: *backlog,
                limit: *limit,
            },
            Error::KeyHeld {
                consumer,
                ordering_key,
            } => Error::KeyHeld {
                consumer: consumer.clone(),
                ordering_key: ordering_key.clone(),
            },
            Error::RolledBack { op } => Error::RolledBack { op },
            Error::Sqlite { op, source } => Error::Sqlite {
                op,
                source: match source {
                    rusqlite::Error::SqliteFailure(code, msg) => {
                        rusqlite::Error::SqliteFailure(*code, msg.clone())
                    }
                    other => rusqlite::Error::SqliteFailure(
                        rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ERROR),
                        Some(other.to_string()),
                    ),
                },
            },
            Error::Io { op, source } => Error::Io {
                op,
                source: io::Error::new(source.kind(), source.to_string()),
            },
            Error::GroupRolledBack { reason } => Error::GroupRolledBack {
                reason: reason.clone(),
            },
            Error::Aborted { reason } => Error::Aborted {
                reason: reason.clone(),
            },
            Error::Closed => Error::Closed,
            Error::Stopped { thread, reason } => Error::Stopped {
                thread: thread.clone(),
                reason: reason.clone(),
            },
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidInput { field, reason } => write!(f, "invalid {field}: {reason}"),
            Error::UnknownConsumer { consumer } => {
                write!(
                    f,
                    "unknown consumer {consumer:?}: register it on the builder"
                )
            }
            Error::NotADatabase { path } => {
                write!(f, "{} is not a SQLite database", path.display())
            }
            Error::SchemaTooNew { found, supported } => write!(
                f,
                "database schema version {found} is newer than this postroom supports \
                 ({supported}); upgrade postroom"
            ),
            Error::SqliteTooOld { found, required } => write!(
                f,
                "the linked SQLite is {found}; postroom needs {required} or newer \
                 (enable the `bundled` feature, or link a newer libsqlite3)"
            ),
            Error::Corrupt { detail } => write!(f, "database is corrupt: {detail}"),
            Error::ReadOnly { path } => {
                match path.to_str().and_then(|p| p.strip_suffix("-postroom")) {
                    Some(db) => write!(
                        f,
                        "{} (the engine file beside the database {db}) is read-only or cannot be \
                     created; postroom needs to write it and its directory",
                        path.display()
                    ),
                    None => write!(
                        f,
                        "{} is read-only; postroom needs to write it",
                        path.display()
                    ),
                }
            }
            Error::FileInUse { path } => write!(
                f,
                "{} is held open, unshared, by another process (an antivirus scanner, a backup \
                 or sync tool?); try again once it lets go of the file",
                path.display()
            ),
            Error::AlreadyOpen { path } => write!(
                f,
                "{} is already open by another postroom engine: a process (this one or another) \
                 holds the OS lock on its engine file {}-postroom (on Linux, `fuser` on that file \
                 names it); use that engine, or stop it first",
                path.display(),
                path.display()
            ),
            Error::StorageFull { op } => {
                write!(f, "{op}: database or disk is full; nothing was stored")
            }
            Error::Busy { op } => write!(
                f,
                "{op}: another connection held the database lock past the busy timeout"
            ),
            Error::Backlogged {
                consumer,
                backlog,
                limit,
            } => write!(
                f,
                "consumer {consumer:?} has {backlog} messages waiting for processing, at its \
                 backlog limit of {limit}: nothing was stored; send again once the workers \
                 have drained some"
            ),
            Error::KeyHeld {
                consumer,
                ordering_key,
            } => write!(
                f,
                "consumer {consumer:?} keeps strict order, and ordering key {ordering_key:?} \
                 has a dead or unfinished message before this one: nothing was run or \
                 stored; deliver it again later (redrive or discard the dead letter to \
                 release the key)"
            ),
            Error::Sqlite { op, source } => write!(f, "{op}: {source}"),
            Error::RolledBack { op } => write!(
                f,
                "{op}: the SQL it ran rolled the whole transaction back (a RAISE(ROLLBACK) \
                 trigger or an OR ROLLBACK statement); nothing was stored"
            ),
            Error::Io { op, source } => write!(f, "{op}: {source}"),
            Error::Aborted { reason } => write!(f, "transaction aborted: {reason}"),
            Error::GroupRolledBack { reason } => write!(
                f,
                "another job's SQL rolled back the group commit this call shared ({reason}); \
                 nothing of this call was stored: retry"
            ),
            Error::Closed => f.write_str("postroom engine is shut down"),
            Error::Stopped { thread, reason } => write!(
                f,
                "postroom engine thread {thread} died ({reason}); it takes no more work: \
                 shut it down and open it again (what it accepted is recovered at open)"
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Sqlite { source, .. } => Some(source),
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// `Result` with postroom's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
