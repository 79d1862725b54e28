//! The engine file beside the database (`<db>-postroom`): it holds the
//! engine's exclusive lock and the in-flight marker.
//!
//! The marker is how a handler that kills the process (abort, OOM kill,
//! segfault, `kill -9`) still gets its attempt counted. Just before a
//! handler runs, the message is written here with one `pwrite` and no fsync;
//! right after it returns, the marker is cleared the same way. A write
//! without fsync survives the death of the process (it sits in the kernel's
//! page cache), which is all it must survive, and costs no fsync on the hot
//! path. On the next open, a valid marker whose attempt did not commit means
//! the process died inside that handler: recovery records a failed attempt,
//! and after `max_attempts` of them the message is dead-lettered instead of
//! crash-looping the application.
//!
//! Invariant: a marker is valid only if its checksum matches, so a torn
//! write is ignored rather than misread. After power loss the file can hold
//! a stale marker (one the kernel wrote back while that handler ran, whose
//! attempt then committed). Recovery tells those apart by the database:
//! an attempt that committed left its row with that many attempts, or
//! completed. The one thing it cannot tell by the database is a committed
//! attempt whose row retention has since deleted; so the marker carries
//! the batch's clock, and recovery ignores a marker with no row that is
//! older than retention (see `delivery::recover_inflight`). Recovery clears
//! the file and syncs it, so a marker or claim slot of an earlier process
//! cannot come back with a later power cut.
//!
//! Queued work has its attempt counted when it is claimed, so after a crash
//! recovery must tell claims whose user code was running (counted: that
//! code may be what killed the process) from claims still waiting their
//! turn (handed back, uncounted: otherwise a crash-looping poison message
//! would dead-letter whatever was claimed beside it). The file's first
//! 4 KiB are slots for that: slot 0 names the claim whose transactional
//! step runs on the writer, slot n the claim whose external step runs on
//! worker n. The inline marker follows at [`RECORD_OFFSET`].
//!
//! The engine's exclusivity rests on two `flock`s, both released
//! explicitly (`LOCK_UN`, which acts on the open file description) when
//! the last handle goes, never by `close` alone: a child process that
//! another thread of the app forks shares every description until it
//! execs, so a lock released only by closing outlives the engine
//! ([`Held`]).
//! * the engine file's, as before (older builds look only there);
//! * the database file's own ([`DatabaseLock`]), which holds while the
//!   engine runs whatever is deleted beside the database: the lock is on
//!   the database's inode, which the engine keeps open. It is
//!   taken through a descriptor this process never closes, because closing
//!   any descriptor of a file drops the process's POSIX (`fcntl`) locks on
//!   it, SQLite's own. `flock` and `fcntl` locks are independent on local
//!   Linux filesystems, and SQLite's unix VFS takes only `fcntl` locks; on
//!   a network filesystem, where the kernel emulates `flock` with `fcntl`,
//!   it is not taken (only the engine file's lock holds there).
//!
//! The second half of those 4 KiB (past the last worker's slot) holds the
//! *slow-handler record*: the handler that has held the writer past the
//! `slow_handler` threshold, written by the engine's watcher when it
//! notices and cleared when the handler returns, so `postroom status` and
//! `top` can name it ([`read_slow_handler`]). Not on the hot path: written
//! only for a slow handler. Recovery reads claim slots only below it.
//!
//! The file is as long as the largest marker only while that marker's
//! handler runs: a marker over [`KEEP_BYTES`] (a large payload) is cut off
//! when the handler returns, and recovery cuts the file back to the slots
//! at every open, so one 256 MiB message costs its size neither on disk
//! nor in memory afterwards, nor a read of it at each open.

use std::collections::HashMap;
use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::{Error, Result};
use crate::message::Message;
use crate::platform::{self, FileId};
use crate::store::text::headers_json;

/// Version 2 added the batch's clock; a version-1 marker left by an older
/// release is ignored (at most one attempt goes uncounted on upgrade).
const MAGIC: &[u8; 8] = b"PRMINFL2";
/// Where the inline marker starts; the claim slots come before it.
const RECORD_OFFSET: u64 = 4096;
const SLOT_BYTES: u64 = 32;
/// Claim slots: the writer's and one per worker.
pub(crate) const SLOTS: usize = (RECORD_OFFSET / SLOT_BYTES) as usize;

// One slot per worker, and one for the writer's inline and batch handlers.
const _: () = assert!(crate::config::MAX_WORKERS < SLOTS);
const SLOT_MAGIC: &[u8; 8] = b"PRMCLM01";
/// Where the slow-handler record starts: past every claim slot.
const SLOW_OFFSET: u64 = (crate::config::MAX_WORKERS as u64 + 1) * SLOT_BYTES;
const SLOW_MAGIC: &[u8; 8] = b"PRMSLOW1";
/// The record's room; a longer message id is cut (on a char boundary).
const SLOW_BYTES: usize = (RECORD_OFFSET - SLOW_OFFSET) as usize;
const _: () = assert!(SLOW_BYTES >= 1024);
/// A marker larger than this is garbage (payloads are capped well below).
const MAX_RECORD: u64 = 300 * 1024 * 1024;
/// A marker larger than this is not kept once its handler has returned:
/// the file is cut back to its slots and the encoding buffer dropped, so
/// one large message does not cost its size on disk and in memory for the
/// life of the database (up to 256 MiB on a device, and as much read at
/// every open).
const KEEP_BYTES: usize = 64 * 1024;
/// The file's length with no marker: the slots and a cleared magic.
const CLEARED_LEN: u64 = RECORD_OFFSET + 8;

/// Records which handler is running, so a crash inside it can be counted.
pub(crate) trait InflightLog {
    /// Called just before the handler runs.
    fn begin(
        &mut self,
        consumer: &str,
        msg: &Message,
        hash: &[u8; 32],
        prior_attempts: u32,
        at_ms: i64,
    ) -> io::Result<()>;
    /// Called as soon as the handler has returned (or panicked).
    fn end(&mut self) -> io::Result<()>;
}

/// An [`InflightLog`] that records nothing: for queued attempts (their
/// claim already counted them) and for driving the state machine directly.
#[derive(Debug, Default)]
pub(crate) struct NoInflightLog;

impl InflightLog for NoInflightLog {
    fn begin(&mut self, _: &str, _: &Message, _: &[u8; 32], _: u32, _: i64) -> io::Result<()> {
        Ok(())
    }
    fn end(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A handler that was running when its process died.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Inflight {
    pub consumer: String,
    pub msg: Message,
    pub hash: [u8; 32],
    pub prior_attempts: u32,
    /// The batch's clock (the engine's `now`) when the handler started.
    pub at_ms: i64,
}

/// A claim whose user code was running when its process died.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StartedClaim {
    pub row_id: i64,
    /// The lease token it ran under: a slot left stale by a power cut names
    /// an earlier lease of the row, and must not count the current one.
    pub token: i64,
}

/// What an engine holds while it runs: the engine file, locked, and the
/// database file's lock. Shared by the writer's [`EngineFile`] and every
/// worker's [`ClaimSlot`], and released when the last of them goes (a
/// worker still running past a shutdown's deadline keeps the engine's
/// claim, so it keeps the locks).
#[derive(Debug)]
struct Held {
    file: File,
    database: OnceLock<DatabaseLock>,
}

impl Drop for Held {
    fn drop(&mut self) {
        // `LOCK_UN` on the description, not just `close`: a child forked
        // meanwhile shares the description until it execs, and would keep
        // the lock after this engine is gone.
        let _ = self.file.unlock();
        // `database` releases its own lock as it drops, after this.
    }
}

/// The locked engine file. Dropping it (with every [`ClaimSlot`])
/// releases the locks.
#[derive(Debug)]
pub(crate) struct EngineFile {
    held: Arc<Held>,
    buf: Vec<u8>,
    path: PathBuf,
    /// This engine created it: a refused open removes it ([`Self::discard`]).
    created: bool,
}

impl EngineFile {
    /// The engine file's path for a database path.
    pub fn path_for(db: &Path) -> PathBuf {
        crate::store::beside(db, "-postroom")
    }

    /// Opens (creating with mode 0600) and locks the engine file of `db`,
    /// failing with [`Error::AlreadyOpen`] when another engine holds it. The
    /// lock is the kernel's (`flock`): it goes away with the process that
    /// held it. `db` is the canonical path (see `schema::resolve`), so
    /// every route to the file meets this one lock.
    ///
    /// A refused open unlinks the engine file it created ([`Self::discard`])
    /// while holding its lock; a file locked here is only kept if it is
    /// still the one at the path, else the lock is taken again.
    ///
    /// An engine file made by root for another user's database is given the
    /// database's owner, as SQLite does with `-wal` and `-shm`: otherwise one
    /// run as root would lock the application out.
    pub fn lock(db: &Path) -> Result<EngineFile> {
        let path = Self::path_for(db);
        let mut in_use = None;
        for _ in 0..100 {
            let (file, created) = match open_engine_file(&path) {
                Ok(Some(opened)) => opened,
                Ok(None) => continue,
                // Held for a moment (see `platform::engine_running`): again
                // shortly, for about a second in all.
                Err(e @ Error::FileInUse { .. }) => {
                    in_use = Some(e);
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    continue;
                }
                Err(e) => return Err(e),
            };
            match file.try_lock() {
                Ok(()) => {}
                Err(TryLockError::WouldBlock) => {
                    return Err(Error::AlreadyOpen {
                        path: db.to_path_buf(),
                    })
                }
                Err(TryLockError::Error(e)) => return Err(Error::io("lock engine file", e)),
            }
            let locked = platform::file_id(&file).map_err(|e| Error::io("lock engine file", e))?;
            match platform::path_id(&path) {
                Ok(now) if now == locked => {}
                // Unlinked by a refused open after we opened it: again.
                _ => continue,
            }
            let engine_file = EngineFile {
                held: Arc::new(Held {
                    file,
                    database: OnceLock::new(),
                }),
                buf: Vec::new(),
                path,
                created,
            };
            platform::give_database_owner(&engine_file.held.file, db)
                .map_err(|e| Error::io("give the engine file the database's owner", e))?;
            return Ok(engine_file);
        }
        if let Some(in_use) = in_use {
            return Err(in_use);
        }
        Err(Error::io(
            "lock engine file",
            io::Error::other(format!(
                "{} kept being removed while it was being locked",
                path.display()
            )),
        ))
    }

    /// Also locks the database file itself ([`DatabaseLock`]), once it
    /// exists: [`Error::AlreadyOpen`] when another engine, in this process
    /// or another, has it, even if every file beside it was deleted.
    pub fn lock_database(&mut self, db: &Path) -> Result<()> {
        if self.held.database.get().is_some() {
            return Ok(());
        }
        if let Some(lock) = DatabaseLock::acquire(db)? {
            // Only this engine's open thread reaches it, once.
            let _ = self.held.database.set(lock);
        }
        Ok(())
    }

    /// Gives up the engine file after a refused open: one this open
    /// created is unlinked (still locked, see [`Self::lock`]), so a refusal
    /// leaves no file behind.
    pub fn discard(self) {
        if !self.created {
            return;
        }
        match std::fs::remove_file(&self.path) {
            // Windows refuses to delete a file open without shared delete,
            // as the engine file is: let go of it first. Another engine
            // that opened it meanwhile holds it the same way, so then the
            // removal fails and its file stays.
            Err(e) if platform::is_sharing_violation(&e) => {
                let path = self.path.clone();
                drop(self);
                let _ = std::fs::remove_file(path);
            }
            _ => {}
        }
    }

    /// The marker left by the previous engine, if it is valid.
    pub fn read(&mut self) -> io::Result<Option<Inflight>> {
        let len = self.held.file.metadata()?.len();
        let head_len = MAGIC.len() + 4;
        if len < RECORD_OFFSET + (head_len + 32) as u64 || len > MAX_RECORD {
            return Ok(None);
        }
        // The head first: only a marker's own bytes are read, not whatever
        // an older build left past a cleared one (see `KEEP_BYTES`).
        let mut head = vec![0; head_len];
        platform::read_exact_at(&self.held.file, &mut head, RECORD_OFFSET)?;
        let body_len = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        let record = (head_len + 32) as u64 + u64::from(body_len);
        if &head[..MAGIC.len()] != MAGIC || record > len - RECORD_OFFSET {
            return Ok(None);
        }
        let mut bytes = vec![0; record as usize]; // at most MAX_RECORD
        platform::read_exact_at(&self.held.file, &mut bytes, RECORD_OFFSET)?;
        Ok(decode(&bytes))
    }

    /// Invalidates the marker and every claim slot, durably: one fsync per
    /// engine open, so a power cut cannot bring back what recovery dealt with.
    pub fn clear(&mut self) -> io::Result<()> {
        platform::write_all_at(&self.held.file, &[0u8; CLEARED_LEN as usize], 0)?;
        // What a large marker (this build's, cut short by a crash, or an
        // older build's, never cut) left past the slots.
        self.held.file.set_len(CLEARED_LEN)?;
        self.held.file.sync_data()
    }

    /// The claims whose user code was running when the previous process
    /// died (valid slots only).
    pub fn started_claims(&self) -> io::Result<Vec<StartedClaim>> {
        let len = self.held.file.metadata()?.len();
        // The slots only: the slow-handler record after them holds user
        // bytes (ids), which must never read as a claim.
        let mut table = vec![0u8; SLOW_OFFSET.min(len) as usize];
        platform::read_exact_at(&self.held.file, &mut table, 0)?;
        Ok(table
            .chunks_exact(SLOT_BYTES as usize)
            .filter_map(decode_slot)
            .collect())
    }

    /// A handle on the slow-handler record (see the module docs), for the
    /// engine's watcher thread.
    pub fn slow_record(&self) -> io::Result<SlowRecord> {
        Ok(SlowRecord {
            file: self.held.file.try_clone()?,
        })
    }

    /// A handle on claim slot `index` (1.. for workers) that another thread
    /// can write through; it keeps the engine's locks while it lives.
    pub fn slot(&self, index: usize) -> ClaimSlot {
        ClaimSlot {
            held: Arc::clone(&self.held),
            index,
        }
    }
}

impl InflightLog for EngineFile {
    fn begin(
        &mut self,
        consumer: &str,
        msg: &Message,
        hash: &[u8; 32],
        prior_attempts: u32,
        at_ms: i64,
    ) -> io::Result<()> {
        encode(&mut self.buf, consumer, msg, hash, prior_attempts, at_ms);
        platform::write_all_at(&self.held.file, &self.buf, RECORD_OFFSET)
    }

    fn end(&mut self) -> io::Result<()> {
        platform::write_all_at(&self.held.file, &[0u8; 8], RECORD_OFFSET)?;
        if self.buf.capacity() > KEEP_BYTES {
            self.buf = Vec::new();
            self.held.file.set_len(CLEARED_LEN)?;
        }
        Ok(())
    }
}

/// A database file's identity on this machine.
type FileKey = FileId;

/// A descriptor on a database file, kept for the life of the process, and
/// whether an engine of this process holds its lock.
#[derive(Debug)]
struct Registered {
    file: Arc<File>,
    held: bool,
}

/// Every database file this process has locked, by identity. Entries are
/// never removed: closing their descriptors would drop SQLite's `fcntl`
/// locks on the file (the app's connections' too). One descriptor per
/// database file the process ever opened an engine on; and since the
/// descriptor keeps the inode alive, its number cannot be reused by
/// another file while the process lives.
fn registry() -> std::sync::MutexGuard<'static, HashMap<FileKey, Registered>> {
    static REGISTRY: OnceLock<Mutex<HashMap<FileKey, Registered>>> = OnceLock::new();
    REGISTRY
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// The `flock` on the database file itself: one engine per database even
/// when every file beside it was deleted (see the module docs). Dropping
/// it releases the lock (`LOCK_UN`); the descriptor stays open.
#[derive(Debug)]
pub(crate) struct DatabaseLock {
    key: FileKey,
    file: Arc<File>,
}

impl DatabaseLock {
    /// Locks the existing database file `db`: `None` on a network
    /// filesystem (see the module docs), [`Error::AlreadyOpen`] when an
    /// engine of this process or another holds it.
    pub fn acquire(db: &Path) -> Result<Option<DatabaseLock>> {
        let err = |e| Error::io("lock database file", e);
        if !platform::may_lock_database_file(db) {
            return Ok(None);
        }
        for _ in 0..100 {
            let key = platform::path_id(db).map_err(err)?;
            let mut registry = registry();
            let file = match registry.get(&key) {
                Some(found) if found.held => {
                    return Err(Error::AlreadyOpen {
                        path: db.to_path_buf(),
                    })
                }
                Some(found) => Arc::clone(&found.file),
                None => {
                    let file = Arc::new(File::open(db).map_err(err)?);
                    let opened = platform::file_id(&file).map_err(err)?;
                    // Kept even when it is not the file `key` names (replaced
                    // in between): it may not be closed either.
                    match registry.entry(opened) {
                        std::collections::hash_map::Entry::Vacant(slot) => {
                            slot.insert(Registered {
                                file: Arc::clone(&file),
                                held: false,
                            });
                        }
                        // The path was swapped back to a file already
                        // registered (`key` was not): this second descriptor
                        // of it may not be closed either, or the process's
                        // POSIX locks on it (SQLite's) would go. Leaked, as
                        // every registered descriptor is.
                        std::collections::hash_map::Entry::Occupied(_) => {
                            std::mem::forget(file);
                            continue;
                        }
                    }
                    if opened != key {
                        continue;
                    }
                    file
                }
            };
            match file.try_lock() {
                Ok(()) => {}
                Err(TryLockError::WouldBlock) => {
                    return Err(Error::AlreadyOpen {
                        path: db.to_path_buf(),
                    })
                }
                Err(TryLockError::Error(e)) => return Err(err(e)),
            }
            // Still the file at the path (not replaced after the `stat`)?
            if platform::path_id(db).is_ok_and(|now| now == key) {
                if let Some(entry) = registry.get_mut(&key) {
                    entry.held = true;
                }
                return Ok(Some(DatabaseLock { key, file }));
            }
            let _ = file.unlock();
        }
        Err(err(io::Error::other(format!(
            "{} kept being replaced while it was being locked",
            db.display()
        ))))
    }
}

impl Drop for DatabaseLock {
    fn drop(&mut self) {
        let mut registry = registry();
        // `LOCK_UN` on the description: a child forked meanwhile shares it.
        let _ = self.file.unlock();
        if let Some(entry) = registry.get_mut(&self.key) {
            entry.held = false;
        }
    }
}

/// Opens the engine file at `path`, creating it (mode 0600) if missing:
/// the file and whether this call created it, or `None` when it vanished
/// between the two attempts.
fn open_engine_file(path: &Path) -> Result<Option<(File, bool)>> {
    let mut options = OpenOptions::new();
    platform::engine_file(options.read(true).write(true));
    match options.clone().create_new(true).open(path) {
        Ok(file) => return Ok(Some((file, true))),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(crate::store::schema::cannot_create(
                path,
                "create engine file",
                e,
            ))
        }
    }
    match options.open(path) {
        Ok(file) => Ok(Some((file, false))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        // Windows: another process has it open unshared (a sharing probe
        // of `postroom status` for a moment, or an antivirus scan).
        Err(e) if platform::is_sharing_violation(&e) => Err(Error::FileInUse {
            path: path.to_path_buf(),
        }),
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => Err(Error::ReadOnly {
            path: path.to_path_buf(),
        }),
        Err(e) => Err(crate::store::schema::cannot_create(
            path,
            "open engine file",
            e,
        )),
    }
}

/// Marks which claimed row's user code is running (see the module docs).
pub(crate) trait ClaimMarks {
    /// Just before user code runs for the claim `(row_id, token)`.
    fn started(&mut self, row_id: i64, token: i64) -> io::Result<()>;
    /// As soon as it returned.
    fn finished(&mut self) -> io::Result<()>;
}

/// Slot 0, the writer's: queued transactional steps.
impl ClaimMarks for EngineFile {
    fn started(&mut self, row_id: i64, token: i64) -> io::Result<()> {
        platform::write_all_at(&self.held.file, &encode_slot(row_id, token), 0)
    }
    fn finished(&mut self) -> io::Result<()> {
        platform::write_all_at(&self.held.file, &[0u8; SLOT_BYTES as usize], 0)
    }
}

/// A worker's claim slot: its own bytes of the engine file, written with
/// positioned writes (no file offset, so no lock is shared).
#[derive(Debug)]
pub(crate) struct ClaimSlot {
    held: Arc<Held>,
    index: usize,
}

impl ClaimMarks for ClaimSlot {
    fn started(&mut self, row_id: i64, token: i64) -> io::Result<()> {
        let at = self.index as u64 * SLOT_BYTES;
        platform::write_all_at(&self.held.file, &encode_slot(row_id, token), at)
    }
    fn finished(&mut self) -> io::Result<()> {
        let at = self.index as u64 * SLOT_BYTES;
        platform::write_all_at(&self.held.file, &[0u8; SLOT_BYTES as usize], at)
    }
}

/// The slow-handler record's handle (see the module docs).
#[derive(Debug)]
pub(crate) struct SlowRecord {
    file: File,
}

/// A handler that has held the writer past the `slow_handler` threshold,
/// as the engine file records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlowHandler {
    /// The consumer whose handler runs.
    pub consumer: String,
    /// The message it handles (cut to fit the record when very long).
    pub message_id: String,
    /// When it started, in unix ms.
    pub since_ms: i64,
}

impl SlowRecord {
    /// Records `slow` as the handler holding the writer.
    pub fn write(&mut self, slow: &SlowHandler) -> io::Result<()> {
        let mut body = Vec::with_capacity(SLOW_BYTES);
        body.extend_from_slice(&slow.since_ms.to_le_bytes());
        put_bytes(&mut body, slow.consumer.as_bytes());
        // What is left, less the id's length and the checksum.
        let room = SLOW_BYTES.saturating_sub(SLOW_MAGIC.len() + body.len() + 4 + 32);
        let mut cut = slow.message_id.len().min(room);
        while !slow.message_id.is_char_boundary(cut) {
            cut -= 1;
        }
        put_bytes(&mut body, &slow.message_id.as_bytes()[..cut]);
        let mut record = Vec::with_capacity(SLOW_BYTES);
        record.extend_from_slice(SLOW_MAGIC);
        record.extend_from_slice(&body);
        record.extend_from_slice(blake3::hash(&body).as_bytes());
        platform::write_all_at(&self.file, &record, SLOW_OFFSET)
    }

    /// The handler has returned.
    pub fn clear(&mut self) -> io::Result<()> {
        platform::write_all_at(&self.file, &[0u8; 8], SLOW_OFFSET)
    }
}

/// The slow handler a running engine of `db` records, if any: `None` when
/// there is none, no engine file, or the record is torn.
pub fn read_slow_handler(db: &Path) -> io::Result<Option<SlowHandler>> {
    let file = match File::open(EngineFile::path_for(db)) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut bytes = vec![0u8; SLOW_BYTES];
    let mut read = 0;
    while read < bytes.len() {
        match platform::read_at(&file, &mut bytes[read..], SLOW_OFFSET + read as u64)? {
            0 => break,
            n => read += n,
        }
    }
    Ok(decode_slow(&bytes[..read]))
}

fn decode_slow(bytes: &[u8]) -> Option<SlowHandler> {
    let rest = bytes.strip_prefix(SLOW_MAGIC.as_slice())?;
    let mut cur = Cursor(rest);
    let since_ms = i64::from_le_bytes(cur.take(8)?.try_into().ok()?);
    let consumer = String::from_utf8(cur.bytes()?.to_vec()).ok()?;
    let message_id = String::from_utf8(cur.bytes()?.to_vec()).ok()?;
    let body_len = rest.len() - cur.0.len();
    if cur.take(32)? != blake3::hash(&rest[..body_len]).as_bytes() {
        return None;
    }
    Some(SlowHandler {
        consumer,
        message_id,
        since_ms,
    })
}

fn slot_check(row_id: i64, token: i64) -> [u8; 8] {
    let sum = blake3::hash(&[row_id.to_le_bytes(), token.to_le_bytes()].concat());
    sum.as_bytes()[..8].try_into().expect("8 bytes")
}

fn encode_slot(row_id: i64, token: i64) -> [u8; SLOT_BYTES as usize] {
    let mut slot = [0u8; SLOT_BYTES as usize];
    slot[..8].copy_from_slice(SLOT_MAGIC);
    slot[8..16].copy_from_slice(&row_id.to_le_bytes());
    slot[16..24].copy_from_slice(&token.to_le_bytes());
    slot[24..].copy_from_slice(&slot_check(row_id, token));
    slot
}

fn decode_slot(slot: &[u8]) -> Option<StartedClaim> {
    if &slot[..8] != SLOT_MAGIC {
        return None;
    }
    let row_id = i64::from_le_bytes(slot[8..16].try_into().ok()?);
    let token = i64::from_le_bytes(slot[16..24].try_into().ok()?);
    (slot[24..32] == slot_check(row_id, token)).then_some(StartedClaim { row_id, token })
}

fn put_bytes(buf: &mut Vec<u8>, bytes: &[u8]) {
    buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    buf.extend_from_slice(bytes);
}

fn encode(
    buf: &mut Vec<u8>,
    consumer: &str,
    msg: &Message,
    hash: &[u8; 32],
    prior: u32,
    at_ms: i64,
) {
    buf.clear();
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&[0; 4]); // body length, filled in below
    let body_start = buf.len();
    buf.extend_from_slice(&prior.to_le_bytes());
    buf.extend_from_slice(&at_ms.to_le_bytes());
    buf.extend_from_slice(hash);
    put_bytes(buf, consumer.as_bytes());
    put_bytes(buf, msg.source.as_bytes());
    put_bytes(buf, msg.id.as_bytes());
    put_bytes(
        buf,
        headers_json(&msg.headers).unwrap_or_default().as_bytes(),
    );
    match &msg.ordering_key {
        Some(k) => {
            buf.push(1);
            put_bytes(buf, k.as_bytes());
        }
        None => buf.push(0),
    }
    put_bytes(buf, &msg.payload);
    // A sequenced message's number, so that the row recovery records for
    // it carries it (the watermark waits for that row). Nothing for a
    // message without one: its marker is as before sequences existed.
    if let (Some(seq), Some(stream)) = (msg.sequence, msg.sequence_stream()) {
        buf.push(1);
        buf.extend_from_slice(&seq.to_le_bytes());
        put_bytes(buf, stream.as_bytes());
    }
    let body_len = (buf.len() - body_start) as u32;
    buf[MAGIC.len()..body_start].copy_from_slice(&body_len.to_le_bytes());
    let sum = blake3::hash(&buf[body_start..]);
    buf.extend_from_slice(sum.as_bytes());
}

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn string(&mut self) -> Option<String> {
        String::from_utf8(self.bytes()?.to_vec()).ok()
    }
}

fn decode(bytes: &[u8]) -> Option<Inflight> {
    let mut c = Cursor(bytes);
    if c.take(MAGIC.len())? != MAGIC {
        return None;
    }
    let body = c.bytes()?;
    if c.take(32)? != blake3::hash(body).as_bytes() {
        return None;
    }
    let mut b = Cursor(body);
    let prior_attempts = b.u32()?;
    let at_ms = i64::from_le_bytes(b.take(8)?.try_into().ok()?);
    let hash: [u8; 32] = b.take(32)?.try_into().ok()?;
    let consumer = b.string()?;
    let source = b.string()?;
    let id = b.string()?;
    let headers_text = b.string()?;
    let ordering_key = match b.take(1)?[0] {
        0 => None,
        _ => Some(b.string()?),
    };
    let payload = b.bytes()?.to_vec();
    let (sequence, sequence_stream) = match b.take(1) {
        None => (None, None),
        Some([1]) => {
            let seq = u64::from_le_bytes(b.take(8)?.try_into().ok()?);
            (Some(seq), Some(b.string()?))
        }
        Some(_) => return None,
    };
    let headers = if headers_text.is_empty() {
        Default::default()
    } else {
        serde_json::from_str(&headers_text).ok()?
    };
    Some(Inflight {
        consumer,
        msg: Message {
            source,
            id,
            payload,
            headers,
            ordering_key,
            sequence,
            sequence_stream,
        },
        hash,
        prior_attempts,
        at_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slow_handler_record_round_trips_and_never_reads_as_a_claim() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("t.db");
        let file = EngineFile::lock(&db).unwrap();
        let mut record = file.slow_record().unwrap();
        assert_eq!(read_slow_handler(&db).unwrap(), None);
        let slow = SlowHandler {
            consumer: "c".into(),
            message_id: "x".repeat(5000),
            since_ms: 1234,
        };
        record.write(&slow).unwrap();
        let back = read_slow_handler(&db).unwrap().expect("recorded");
        assert_eq!((back.consumer.as_str(), back.since_ms), ("c", 1234));
        assert!(back.message_id.len() > 1000 && back.message_id.len() < SLOW_BYTES);
        // User bytes that happen to form a valid claim slot, in the
        // record's room: recovery never reads them as a claim.
        platform::write_all_at(&file.held.file, &encode_slot(7, 9), SLOW_OFFSET + 64).unwrap();
        assert_eq!(file.started_claims().unwrap(), vec![]);
        platform::write_all_at(&file.held.file, &encode_slot(7, 9), 0).unwrap();
        assert_eq!(file.started_claims().unwrap().len(), 1);
        record.clear().unwrap();
        assert_eq!(read_slow_handler(&db).unwrap(), None);
    }

    #[test]
    fn marker_round_trips_and_rejects_damage() {
        let msg = Message::new("src", "id-1", b"payload".to_vec())
            .with_header("h", "v")
            .with_ordering_key("k");
        let hash = *blake3::hash(msg.payload()).as_bytes();
        let mut buf = Vec::new();
        encode(&mut buf, "c", &msg, &hash, 3, -5);
        let back = decode(&buf).expect("valid marker");
        assert_eq!(back.consumer, "c");
        assert_eq!(back.at_ms, -5);
        assert_eq!(back.msg, msg);
        assert_eq!(back.prior_attempts, 3);
        assert_eq!(back.hash, hash);

        // Trailing bytes from an older, longer marker are ignored.
        let mut longer = buf.clone();
        longer.extend_from_slice(&[7; 100]);
        assert_eq!(decode(&longer), Some(back));

        for i in 0..buf.len() {
            let mut bad = buf.clone();
            bad[i] ^= 0x40;
            assert!(decode(&bad).is_none(), "flipped byte {i} was accepted");
        }
        for n in 0..buf.len() {
            assert!(
                decode(&buf[..n]).is_none(),
                "torn write of {n} bytes accepted"
            );
        }
    }

    /// A sequenced message's marker carries its number and stream, so the
    /// row recovery records holds them (the watermark waits for it); an
    /// unsequenced one's bytes are as before sequences existed.
    #[test]
    fn a_sequenced_markers_number_round_trips() {
        let plain = Message::new("src", "id-1", b"p".to_vec());
        let hash = *blake3::hash(plain.payload()).as_bytes();
        let mut before = Vec::new();
        encode(&mut before, "c", &plain, &hash, 0, 1);
        for msg in [
            plain.clone().with_sequence(41),
            plain
                .clone()
                .with_sequence_in("stream-a", crate::MAX_SEQUENCE),
        ] {
            let mut buf = Vec::new();
            encode(&mut buf, "c", &msg, &hash, 0, 1);
            let back = decode(&buf).expect("valid marker");
            assert_eq!(back.msg.sequence(), msg.sequence());
            assert_eq!(back.msg.sequence_stream(), msg.sequence_stream());
            assert!(buf.len() > before.len());
        }
        let back = decode(&before).expect("valid marker");
        assert_eq!(back.msg, plain);
        assert_eq!(back.msg.sequence(), None);
    }

    #[test]
    fn claim_slots_and_the_marker_live_side_by_side() {
        let dir = tempfile::tempdir().unwrap();
        let mut file = EngineFile::lock(&dir.path().join("x.db")).unwrap();
        let msg = Message::new("s", "m", vec![9u8; 10_000]);
        let hash = *blake3::hash(msg.payload()).as_bytes();
        InflightLog::begin(&mut file, "c", &msg, &hash, 0, 1).unwrap();
        let mut worker = file.slot(3);
        worker.started(42, 7).unwrap();
        ClaimMarks::started(&mut file, 41, 7).unwrap();
        let claim = |row_id, token| StartedClaim { row_id, token };
        assert_eq!(
            file.started_claims().unwrap(),
            vec![claim(41, 7), claim(42, 7)]
        );
        assert_eq!(file.read().unwrap().unwrap().msg, msg);
        worker.finished().unwrap();
        assert_eq!(file.started_claims().unwrap(), vec![claim(41, 7)]);
        file.clear().unwrap();
        assert!(file.started_claims().unwrap().is_empty());
        assert!(file.read().unwrap().is_none());
    }

    /// A large marker is read whole after a crash (its handler never
    /// returned), the file is cut back to the slots by recovery's clear
    /// and by the handler's return, and what lies past a cleared marker
    /// (an older build left the file at its largest) is not read.
    #[test]
    fn a_large_marker_is_read_after_a_crash_and_its_room_given_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut file = EngineFile::lock(&dir.path().join("x.db")).unwrap();
        let len = |f: &EngineFile| f.held.file.metadata().unwrap().len();
        let msg = Message::new("s", "m", vec![9u8; 4 * KEEP_BYTES]);
        let hash = *blake3::hash(msg.payload()).as_bytes();
        InflightLog::begin(&mut file, "c", &msg, &hash, 2, 1).unwrap();
        assert!(len(&file) > 4 * KEEP_BYTES as u64);
        // Trailing bytes past a valid marker change nothing.
        let end = len(&file);
        platform::write_all_at(&file.held.file, &[1u8; 100], end).unwrap();
        assert_eq!(file.read().unwrap().unwrap().msg, msg);
        file.clear().unwrap();
        assert_eq!(len(&file), CLEARED_LEN);
        assert!(file.read().unwrap().is_none());

        InflightLog::begin(&mut file, "c", &msg, &hash, 0, 1).unwrap();
        InflightLog::end(&mut file).unwrap();
        assert_eq!(len(&file), CLEARED_LEN);
        assert_eq!(file.buf.capacity(), 0);
        // A small marker keeps its buffer and the file as it is.
        let small = Message::new("s", "n", "x");
        InflightLog::begin(&mut file, "c", &small, &hash, 0, 1).unwrap();
        InflightLog::end(&mut file).unwrap();
        assert!(file.buf.capacity() > 0);
        // A cleared marker with the rest of an old large one behind it.
        file.held.file.set_len(64 * 1024 * 1024).unwrap();
        assert!(file.read().unwrap().is_none());
    }

    /// The database file's lock: refused to a second holder in this
    /// process (one descriptor, so `flock` alone would let it in), taken
    /// again once released, and kept through the engine file's deletion.
    #[test]
    fn the_database_lock_holds_whatever_is_deleted_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("x.db");
        std::fs::write(&db, b"").unwrap();
        let mut first = EngineFile::lock(&db).unwrap();
        first.lock_database(&db).unwrap();
        let slot = first.slot(1);
        if let Err(e) = std::fs::remove_file(EngineFile::path_for(&db)) {
            // Windows: the engine file is held without shared delete, so
            // nothing can remove it, and its lock alone is the engine's
            // (the database file is never locked there).
            assert!(platform::is_sharing_violation(&e), "{e:?}");
            assert!(matches!(
                EngineFile::lock(&db),
                Err(Error::AlreadyOpen { .. })
            ));
            assert!(DatabaseLock::acquire(&db).unwrap().is_none());
            drop((first, slot));
            EngineFile::lock(&db).unwrap();
            return;
        }
        let mut second = EngineFile::lock(&db).unwrap();
        assert!(matches!(
            second.lock_database(&db),
            Err(Error::AlreadyOpen { .. })
        ));
        second.discard();
        assert!(!EngineFile::path_for(&db).exists());
        // A worker's slot keeps the locks after the writer's handle goes.
        drop(first);
        assert!(matches!(
            DatabaseLock::acquire(&db),
            Err(Error::AlreadyOpen { .. })
        ));
        drop(slot);
        let again = DatabaseLock::acquire(&db).unwrap().unwrap();
        drop(again);
        // One descriptor for the file, however often it was locked.
        let key = platform::path_id(&db).unwrap();
        assert!(registry().get(&key).is_some_and(|r| !r.held));
    }

    #[test]
    fn second_lock_is_refused_and_released_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("x.db");
        let first = EngineFile::lock(&db).unwrap();
        assert!(matches!(
            EngineFile::lock(&db),
            Err(Error::AlreadyOpen { .. })
        ));
        drop(first);
        EngineFile::lock(&db).unwrap();
    }
}
