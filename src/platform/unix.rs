//! The unix side of [`crate::platform`]: Linux first (what is tested on
//! every change), macOS and the BSDs by the same calls where POSIX has
//! them. Filesystem kinds are told by `statfs`'s magic number on Linux and
//! by its type name elsewhere; `/proc/locks` exists on Linux only, so
//! elsewhere whether an engine runs cannot be told without a lock (`None`).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use super::FileId;

fn id_of(meta: &std::fs::Metadata) -> FileId {
    FileId {
        volume: meta.dev(),
        number: meta.ino(),
    }
}

pub(super) fn file_id(file: &File) -> io::Result<FileId> {
    file.metadata().map(|m| id_of(&m))
}

pub(super) fn path_id(path: &Path) -> io::Result<FileId> {
    std::fs::metadata(path).map(|m| id_of(&m))
}

pub(super) fn link_count(path: &Path) -> io::Result<u64> {
    std::fs::metadata(path).map(|m| m.nlink())
}

/// What kind of filesystem a `statfs` describes, as far as postroom cares.
#[derive(Debug, PartialEq, Eq)]
enum Kind {
    /// FAT or exFAT: inode numbers made up at each mount.
    Fat,
    /// NFS or SMB/CIFS: `flock` emulated with `fcntl`.
    Network,
    Other,
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn kind(fs: &rustix::fs::StatFs) -> Kind {
    const MSDOS: u32 = 0x4d44;
    const EXFAT: u32 = 0x2011_BAB0;
    const NFS: u32 = 0x6969;
    const SMB: u32 = 0x517B;
    const CIFS: u32 = 0xFF53_4D42;
    const SMB2: u32 = 0xFE53_4D42;
    // The field's width and sign differ by architecture; magic numbers are
    // 32 bits.
    #[allow(clippy::unnecessary_cast)]
    match fs.f_type as u32 {
        MSDOS | EXFAT => Kind::Fat,
        NFS | SMB | CIFS | SMB2 => Kind::Network,
        _ => Kind::Other,
    }
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn kind(fs: &rustix::fs::StatFs) -> Kind {
    // macOS and the BSDs name the filesystem (`msdos`, `exfat`, `nfs`,
    // `smbfs`, …) in `f_fstypename`.
    let name: Vec<u8> = fs
        .f_fstypename
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    match name.as_slice() {
        b"msdos" | b"exfat" | b"msdosfs" => Kind::Fat,
        b"nfs" | b"smbfs" | b"afpfs" | b"webdav" | b"cifs" => Kind::Network,
        _ => Kind::Other,
    }
}

pub(super) fn copy_facts(path: &Path) -> io::Result<super::CopyFacts> {
    let meta = std::fs::metadata(path)?;
    let number = match rustix::fs::statfs(path) {
        Ok(fs) if kind(&fs) == Kind::Fat => None,
        _ => Some(meta.ino()),
    };
    let born = meta
        .created()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
    Ok(super::CopyFacts {
        number,
        volume: None,
        born,
    })
}

pub(super) fn machine_id() -> Option<String> {
    ["/etc/machine-id", "/var/lib/dbus/machine-id"]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .map(|id| id.trim().to_owned())
}

pub(super) fn private(options: &mut OpenOptions) -> &mut OpenOptions {
    options.mode(0o600)
}

pub(super) fn engine_file(options: &mut OpenOptions) -> &mut OpenOptions {
    private(options)
}

pub(super) fn is_sharing_violation(_error: &io::Error) -> bool {
    false
}

pub(super) fn give_database_owner(file: &File, db: &Path) -> io::Result<()> {
    let Ok(owner) = std::fs::metadata(db) else {
        return Ok(());
    };
    let mine = file.metadata()?;
    if mine.uid() != 0 || owner.uid() == 0 {
        return Ok(());
    }
    match std::os::unix::fs::fchown(file, Some(owner.uid()), Some(owner.gid())) {
        // Not root after all (a root-owned file left writable).
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => Ok(()),
        other => other,
    }
}

pub(super) fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    file.read_exact_at(buf, offset)
}

pub(super) fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    file.read_at(buf, offset)
}

pub(super) fn write_all_at(file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
    file.write_all_at(buf, offset)
}

/// Linux keeps `flock` and `fcntl` locks apart on local filesystems; the
/// BSDs and macOS keep both in one list per file, where an `flock` (owned
/// by the open file) would meet SQLite's `fcntl` locks (owned by the
/// process), the engine's own included: there it is never taken.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub(super) fn may_lock_database_file(path: &Path) -> bool {
    !rustix::fs::statfs(path).is_ok_and(|fs| kind(&fs) == Kind::Network)
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub(super) fn may_lock_database_file(_path: &Path) -> bool {
    false
}

pub(super) fn held_unshared(_path: &Path) -> bool {
    false
}

pub(super) fn engine_running(db: &Path, engine_file: &Path) -> Option<bool> {
    // The engine file's lock, or the database file's own (which holds when
    // the engine file was deleted; SQLite's locks there are POSIX).
    let flock = |kind: &str| kind == "FLOCK";
    match (locked(engine_file, flock), locked(db, flock)) {
        (Some(true), _) | (_, Some(true)) => Some(true),
        (Some(false), Some(false)) => Some(false),
        _ => None,
    }
}

pub(super) fn shm_in_use(shm: &Path) -> Option<bool> {
    locked(shm, |_| true)
}

/// Whether a lock is held on `file`, whose `/proc/locks` kind (`FLOCK`,
/// `POSIX`, `OFDLCK`) passes `kind`: read from the kernel's table, never by
/// taking a lock (taking even a shared one for a moment could make an
/// engine that opens just then fail). `Some(false)` when the file does not
/// exist; `None` when it cannot be told (no `/proc/locks`: not Linux).
fn locked(file: &Path, kind: impl Fn(&str) -> bool) -> Option<bool> {
    let meta = match std::fs::metadata(file) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Some(false),
        Err(_) => return None,
    };
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    // Linux's `dev_t`: major in bits 8-19 and 32-63, minor in 0-7 and 20-31
    // (glibc's `gnu_dev_major`/`gnu_dev_minor`), as /proc/locks prints it.
    let dev = meta.dev();
    let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0x0000_0fff);
    let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0x0000_00ff);
    let id = format!("{major:02x}:{minor:02x}:{}", meta.ino());
    // `1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF`; blocked waiters
    // (`->`) hold nothing.
    Some(locks.lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.get(1).is_some_and(|k| kind(k)) && fields.contains(&id.as_str())
    }))
}

pub(super) fn filesystem_bytes(path: &Path) -> Option<u64> {
    let fs = rustix::fs::statvfs(path).ok()?;
    fs.f_blocks.checked_mul(fs.f_frsize)
}

pub(super) fn may_write(path: &Path) -> bool {
    let writable_bits = std::fs::metadata(path).is_ok_and(|m| !m.permissions().readonly());
    writable_bits && rustix::fs::access(path, rustix::fs::Access::WRITE_OK).is_ok()
}

pub(super) fn check_readable(path: &Path) -> io::Result<()> {
    rustix::fs::access(path, rustix::fs::Access::READ_OK).map_err(io::Error::from)
}

pub(super) fn uri_bytes(path: &Path) -> io::Result<Vec<u8>> {
    Ok(path.as_os_str().as_bytes().to_vec())
}
