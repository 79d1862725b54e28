//! Every fact and call that differs between operating systems, in one
//! place: the rest of the crate has no `cfg(unix)` or `cfg(windows)`.
//!
//! What lives here, with a unix side ([`unix`]: Linux, macOS, the BSDs)
//! and a windows side:
//! * a file's identity ([`FileId`]: `(st_dev, st_ino)`, or the volume
//!   serial number and file index) and its link count;
//! * positioned reads and writes of the engine file (`pread`/`pwrite`, or
//!   `ReadFile`/`WriteFile` at an offset);
//! * how the engine file and the database file are opened and locked: a
//!   private mode and the database's owner on unix; on Windows a share
//!   mode without delete, so nothing can delete or rename the engine file
//!   while an engine holds it;
//! * whether the database file itself may be locked beside SQLite (on
//!   Linux, `flock` and SQLite's `fcntl` locks are independent on local
//!   filesystems; macOS and the BSDs keep both in one list, and on Windows
//!   every lock is a mandatory byte-range lock that would block SQLite's
//!   own I/O, so there it never is);
//! * whether an engine runs on a database, or anything has its `-shm`
//!   open, told without taking a lock (`/proc/locks`, or a sharing probe);
//! * the size of the filesystem, the machine's id, whether a path may be
//!   written, the path as a SQLite `file:` URI;
//! * shutdown signals ([`signals`]: SIGINT and SIGTERM, or the console's
//!   Ctrl-C, Ctrl-Break and close events).
//!
//! Invariants: no `unsafe` here either (the crate forbids it); where std
//! has no stable API, a well-kept crate made for it does the call
//! (`rustix` on unix; `winapi-util`, `fs4`, `windows-registry` and
//! `ctrlc` on Windows). A function that cannot tell says so (`None`)
//! rather than guessing.

#[cfg(unix)]
mod unix;
#[cfg(unix)]
use unix as imp;

#[cfg(windows)]
mod windows;
#[cfg(windows)]
use windows as imp;

pub(crate) mod signals;

use std::fs::{File, OpenOptions};
use std::io;
use std::path::Path;

/// A file's identity on this machine while it exists: two paths or handles
/// with the same `FileId` are the same file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct FileId {
    /// `st_dev`, or the volume serial number.
    pub volume: u64,
    /// `st_ino`, or the file index.
    pub number: u64,
}

/// The identity of an open file.
pub(crate) fn file_id(file: &File) -> io::Result<FileId> {
    imp::file_id(file)
}

/// The identity of the file at `path` (links followed).
pub(crate) fn path_id(path: &Path) -> io::Result<FileId> {
    imp::path_id(path)
}

/// How many names (hard links) the file at `path` has.
pub(crate) fn link_count(path: &Path) -> io::Result<u64> {
    imp::link_count(path)
}

/// What a copy of a file changes and a rename in place or a reboot does
/// not, for the database file's identity (each `None` where it is not
/// such a fact on this platform or filesystem).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CopyFacts {
    /// The inode number or file index, where kept stable across mounts
    /// (not on FAT and exFAT on unix, which make them up at each mount).
    pub number: Option<u64>,
    /// The volume, where its id is stable: Windows' volume serial number
    /// (set at format). Never on unix: `st_dev` changes across reboots for
    /// removable disks, LVM or btrfs.
    pub volume: Option<u64>,
    /// The birth time, where the filesystem keeps a real one: on unix.
    /// Not on Windows, where the creation time is an attribute that copy
    /// and backup tools restore (robocopy, `SetFileTime`) and that wine
    /// emulates from the change time.
    pub born: Option<std::time::Duration>,
}

/// [`CopyFacts`] of the file at `path`.
pub(crate) fn copy_facts(path: &Path) -> io::Result<CopyFacts> {
    imp::copy_facts(path)
}

/// The machine's id (`/etc/machine-id`, or Windows' `MachineGuid`): what
/// tells two clones of one disk image apart. `None` where there is none.
pub(crate) fn machine_id() -> Option<String> {
    imp::machine_id().filter(|id| !id.is_empty())
}

/// Makes a file `options` creates private to its owner (mode 0600 on
/// unix; on Windows the directory's ACL applies, as for SQLite's files).
pub(crate) fn private(options: &mut OpenOptions) -> &mut OpenOptions {
    imp::private(options)
}

/// [`private`], and on Windows a share mode without delete: while an
/// engine holds its engine file, nothing can delete, rename or replace it
/// (a second engine would then lock a new file).
pub(crate) fn engine_file(options: &mut OpenOptions) -> &mut OpenOptions {
    imp::engine_file(options)
}

/// Whether `error`, from opening the engine file, means another process
/// has it open for a moment (a sharing probe, see [`engine_running`]) and
/// the open should be tried again shortly. Never on unix.
pub(crate) fn is_sharing_violation(error: &io::Error) -> bool {
    imp::is_sharing_violation(error)
}

/// Whether another process holds the file at `path` open without sharing
/// reading and writing (on Windows: an antivirus scanner, a backup tool,
/// an exclusive open), so SQLite could not open it. Told by opening it as
/// SQLite does, closed at once. Never on unix, whose opens do not exclude.
pub(crate) fn held_unshared(path: &Path) -> bool {
    imp::held_unshared(path)
}

/// Run as root on unix, gives the engine file `file` the owner of the
/// database file at `db` when another user owns it (as SQLite does with
/// `-wal` and `-shm`), so one run as root does not lock the application
/// out. Nothing to do on Windows.
pub(crate) fn give_database_owner(file: &File, db: &Path) -> io::Result<()> {
    imp::give_database_owner(file, db)
}

/// Reads exactly `buf.len()` bytes at `offset`, without a file position
/// shared with other threads.
pub(crate) fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    imp::read_exact_at(file, buf, offset)
}

/// Reads up to `buf.len()` bytes at `offset`; 0 at the end of the file.
pub(crate) fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    imp::read_at(file, buf, offset)
}

/// Writes all of `buf` at `offset` (one `pwrite` where it fits).
pub(crate) fn write_all_at(file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
    imp::write_all_at(file, buf, offset)
}

/// Whether the engine may take an exclusive lock on the database file
/// itself, beside SQLite's own locks: on local Linux filesystems yes; on
/// NFS or SMB (where the kernel emulates `flock` with `fcntl`, meeting
/// SQLite's byte-range locks), on macOS and the BSDs (one lock list for
/// both kinds) and on Windows (whose locks are mandatory and would block
/// SQLite's reads and writes) no.
pub(crate) fn may_lock_database_file(path: &Path) -> bool {
    imp::may_lock_database_file(path)
}

/// Whether an engine runs on the database at `db`, whose engine file is
/// `engine_file` (its lock held), read without taking a lock; `None` when
/// it cannot be told.
pub(crate) fn engine_running(db: &Path, engine_file: &Path) -> Option<bool> {
    imp::engine_running(db, engine_file)
}

/// Whether any connection has the `-shm` file at `shm` open (as SQLite
/// keeps it while a database is open); `None` when it cannot be told.
pub(crate) fn shm_in_use(shm: &Path) -> Option<bool> {
    imp::shm_in_use(shm)
}

/// The size of the filesystem `path` is on; `None` when it cannot be told.
pub(crate) fn filesystem_bytes(path: &Path) -> Option<u64> {
    imp::filesystem_bytes(path).filter(|&b| b > 0)
}

/// Whether this process may write to `path` (a file or a directory) as
/// far as its mode says: the write bits and `access(2)` on unix (root is
/// told yes for anything but a read-only mount, so the bits say what the
/// owner meant); on Windows the read-only attribute of a file (a
/// directory's is ignored there, as Windows ignores it).
pub(crate) fn may_write(path: &Path) -> bool {
    imp::may_write(path)
}

/// Whether this process may read the file at `path`, without opening it
/// on unix: closing any descriptor of a file there drops every POSIX lock
/// the process holds on it, SQLite's included (see `store::inflight`), so
/// a check that opened and closed the database would let another
/// process's last connection delete the WAL under a live one. On Windows
/// a handle's locks are its own: the file is opened and closed.
pub(crate) fn check_readable(path: &Path) -> io::Result<()> {
    imp::check_readable(path)
}

/// An absolute path as the path of a SQLite `file:` URI, every byte
/// outside a plain set percent-encoded (so `?`, `#`, `%` and non-ASCII
/// stay part of the path). On Windows the path follows a `/` as it is
/// (`/\\?\C:\dir\a.db`, encoded), as SQLite's Windows VFS reads URIs; a
/// path that is not Unicode is refused.
pub(crate) fn uri_path(path: &Path) -> io::Result<String> {
    use std::fmt::Write as _;
    let bytes = imp::uri_bytes(path)?;
    let mut uri = String::with_capacity(bytes.len());
    for &b in bytes.iter() {
        if b.is_ascii_alphanumeric() || b"/._-~+,=@".contains(&b) {
            uri.push(char::from(b));
        } else {
            let _ = write!(uri, "%{b:02X}");
        }
    }
    Ok(uri)
}
