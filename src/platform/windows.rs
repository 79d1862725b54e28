//! The windows side of [`crate::platform`].
//!
//! Invariants:
//! * The engine file is opened with a share mode of read and write only:
//!   while an engine holds it, no process can delete, rename or replace
//!   it, so the engine file's lock (`LockFileEx`, through std's
//!   `File::try_lock`) is the one engine per database. Handles std opens
//!   are not inherited by child processes, and a lock goes with its
//!   handle, so a child spawned meanwhile keeps nothing.
//! * The database file itself is never locked by postroom: a Windows lock
//!   is mandatory and would block SQLite's own reads and writes.
//! * Whether a file is held open is told by a *sharing probe*: a read that
//!   shares only reading, which fails with a sharing violation while any
//!   handle has the file open for writing (an engine its engine file,
//!   SQLite a `-shm`). The probe takes no lock and is closed at once; an
//!   open that meets it retries (SQLite's own VFS does, and so does
//!   [`super::engine_file`]'s caller).
//! * The engine file's lock (`LockFileEx` over the whole file) is
//!   mandatory: another process cannot read the file while an engine holds
//!   it, so `postroom status` cannot show the slow-handler record there.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::windows::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use super::FileId;

const FILE_SHARE_READ: u32 = 0x1;
const FILE_SHARE_WRITE: u32 = 0x2;
const FILE_SHARE_DELETE: u32 = 0x4;
/// Opens a directory too (needed for a handle on one).
const FILE_FLAG_BACKUP_SEMANTICS: u32 = 0x0200_0000;
/// `ERROR_SHARING_VIOLATION` and `ERROR_LOCK_VIOLATION`.
const SHARING_VIOLATION: i32 = 32;
const LOCK_VIOLATION: i32 = 33;

/// A handle for reading attributes only: no data access, so it meets no
/// share mode and disturbs no other process's handle.
fn attributes_handle(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .access_mode(0)
        .share_mode(FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE)
        .custom_flags(FILE_FLAG_BACKUP_SEMANTICS)
        .open(path)
}

fn id_of(info: &winapi_util::file::Information) -> FileId {
    FileId {
        volume: info.volume_serial_number(),
        number: info.file_index(),
    }
}

pub(super) fn file_id(file: &File) -> io::Result<FileId> {
    winapi_util::file::information(file).map(|i| id_of(&i))
}

pub(super) fn path_id(path: &Path) -> io::Result<FileId> {
    file_id(&attributes_handle(path)?)
}

pub(super) fn link_count(path: &Path) -> io::Result<u64> {
    winapi_util::file::information(attributes_handle(path)?).map(|i| i.number_of_links())
}

/// NTFS and ReFS keep a file's index for its life; on FAT and exFAT it is
/// its directory entry's place, which a move to another directory changes.
/// The volume's filesystem cannot be asked without `unsafe`, so the index
/// is used everywhere: on FAT such a move re-mints the instance id, the
/// safe direction (docs/DESIGN.md, "Platforms").
pub(super) fn copy_facts(path: &Path) -> io::Result<super::CopyFacts> {
    let id = path_id(path)?;
    Ok(super::CopyFacts {
        number: Some(id.number),
        volume: Some(id.volume),
        born: None,
    })
}

pub(super) fn machine_id() -> Option<String> {
    windows_registry::LOCAL_MACHINE
        .open(r"SOFTWARE\Microsoft\Cryptography")
        .and_then(|key| key.get_string("MachineGuid"))
        .ok()
        .map(|id| id.trim().to_owned())
}

pub(super) fn private(options: &mut OpenOptions) -> &mut OpenOptions {
    options
}

pub(super) fn engine_file(options: &mut OpenOptions) -> &mut OpenOptions {
    options.share_mode(FILE_SHARE_READ | FILE_SHARE_WRITE)
}

pub(super) fn is_sharing_violation(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(SHARING_VIOLATION | LOCK_VIOLATION)
    )
}

pub(super) fn give_database_owner(_file: &File, _db: &Path) -> io::Result<()> {
    Ok(())
}

pub(super) fn read_exact_at(file: &File, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
    while !buf.is_empty() {
        match file.seek_read(buf, offset) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "failed to fill whole buffer",
                ))
            }
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(super) fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    // std answers 0 bytes for `ERROR_HANDLE_EOF`.
    file.seek_read(buf, offset)
}

pub(super) fn write_all_at(file: &File, mut buf: &[u8], mut offset: u64) -> io::Result<()> {
    while !buf.is_empty() {
        match file.seek_write(buf, offset) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "failed to write whole buffer",
                ))
            }
            Ok(n) => {
                buf = &buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(super) fn may_lock_database_file(_path: &Path) -> bool {
    false
}

pub(super) fn held_unshared(path: &Path) -> bool {
    OpenOptions::new()
        .read(true)
        .write(true)
        .share_mode(FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE)
        .open(path)
        .is_err_and(|e| is_sharing_violation(&e))
}

/// Whether some handle has `path` open for writing (an engine its engine
/// file, SQLite a `-shm`): a read that shares only reading is refused
/// then. Needs only read permission; the CLI's own reads share everything,
/// so they never count.
fn held_open(path: &Path) -> Option<bool> {
    match OpenOptions::new()
        .read(true)
        .share_mode(FILE_SHARE_READ)
        .open(path)
    {
        Ok(_) => Some(false),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Some(false),
        Err(e) if is_sharing_violation(&e) => Some(true),
        Err(_) => None,
    }
}

pub(super) fn engine_running(_db: &Path, engine_file: &Path) -> Option<bool> {
    // Only an engine opens the engine file without sharing delete (the
    // CLI's reads of it share everything), and while one does, the file
    // cannot be deleted: its being held open is the engine's lock.
    held_open(engine_file)
}

pub(super) fn shm_in_use(shm: &Path) -> Option<bool> {
    held_open(shm)
}

pub(super) fn filesystem_bytes(path: &Path) -> Option<u64> {
    // `GetDiskFreeSpaceExW` wants a directory.
    let dir = if path.is_dir() { path } else { path.parent()? };
    fs4::total_space(dir).ok()
}

pub(super) fn may_write(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_dir() || !m.permissions().readonly())
}

pub(super) fn check_readable(path: &Path) -> io::Result<()> {
    std::fs::File::open(path).map(drop)
}

pub(super) fn uri_bytes(path: &Path) -> io::Result<Vec<u8>> {
    let text = path.to_str().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: the path is not valid Unicode", path.display()),
        )
    })?;
    // Kept as it is, backslashes and a `\\?\` prefix included (which lifts
    // the 260-character limit): SQLite's Windows VFS drops the `/` before
    // `X:` or `\\?\` (winFullPathname), and the caller percent-encodes the
    // rest, so `\\?\UNC\server\…` needs no authority either.
    Ok(format!("/{text}").into_bytes())
}
