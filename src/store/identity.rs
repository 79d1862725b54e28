//! The database file's identity on this machine (schema version 6): what
//! tells the file an instance id was given to from a copy of it, so that a
//! copied or restored file numbers its outbox as a new stream
//! (docs/DESIGN.md, "Files and schema").
//!
//! Invariants: the identity is a digest of what a copy changes (inode
//! number where the filesystem keeps it stable, birth time, machine id)
//! and of nothing a rename or a reboot changes; a file whose recorded
//! identity differs from its own gets a new instance id, in the same
//! transaction that records the new identity.

use std::io;
use std::path::Path;

use rusqlite::{Connection, TransactionBehavior};

use crate::error::{Error, Result};

/// Where the file's identity on disk is recorded, beside its instance id.
pub(crate) const FILE_IDENTITY_KEY: &str = "instance_file";

/// The identity of the database file on this machine, as the instance id
/// relies on it: a blake3 of what [`crate::platform::copy_facts`] gives
/// (the file's number on its filesystem where it is stable, its birth time
/// where it means one, the volume where its serial is stable) and the
/// machine's id (where there is one). A copy of the file (another path,
/// another device, a restore from a backup into a new file) differs in at
/// least one of them; the file renamed in place, or the machine rebooted,
/// does not. See docs/DESIGN.md "Files and schema".
pub(crate) fn file_identity(db: &Path) -> io::Result<String> {
    let facts = crate::platform::copy_facts(db)?;
    let mut h = blake3::Hasher::new();
    h.update(b"postroom-file-identity\0");
    if let Some(number) = facts.number {
        h.update(b"ino");
        h.update(&number.to_le_bytes());
    }
    if let Some(volume) = facts.volume {
        h.update(b"volume");
        h.update(&volume.to_le_bytes());
    }
    if let Some(born) = facts.born {
        h.update(b"btime");
        h.update(&born.as_secs().to_le_bytes());
        h.update(&born.subsec_nanos().to_le_bytes());
    }
    if let Some(id) = crate::platform::machine_id() {
        h.update(b"machine");
        h.update(id.as_bytes());
    }
    Ok(h.finalize().to_hex()[..32].to_owned())
}

/// A new instance id, when the file is not the one its id was given to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reminted {
    pub old: Option<String>,
    pub new: String,
}

/// Makes the instance id the file's own: if the file identity recorded
/// beside it ([`FILE_IDENTITY_KEY`]) is not this file's
/// ([`file_identity`]) — the file is a copy, or was made by a build that
/// recorded none — a new id is minted and this file's identity recorded,
/// in one transaction. Without it, copies of one file (a golden image)
/// would be one outbox stream downstream, and the second copy's rows would
/// be answered as duplicates of the first's. Only the engine calls it,
/// holding the database's lock.
pub(crate) fn claim_identity(conn: &mut Connection, db: &Path) -> Result<Option<Reminted>> {
    let identity =
        file_identity(db).map_err(|e| Error::io("read the database file's identity", e))?;
    let read = |conn: &Connection, key: &str| -> rusqlite::Result<Option<String>> {
        conn.query_row(
            "SELECT value FROM postroom_meta WHERE key = ?1",
            [key],
            |r| r.get(0),
        )
        .map(Some)
        .or_else(|e| match e {
            rusqlite::Error::QueryReturnedNoRows => Ok(None),
            e => Err(e),
        })
    };
    let err = |e| Error::sqlite("record the file's identity", e);
    if read(conn, FILE_IDENTITY_KEY).map_err(err)?.as_deref() == Some(identity.as_str()) {
        return Ok(None);
    }
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(err)?;
    let old = read(&tx, "instance_id").map_err(err)?;
    let new: String = tx
        .query_row("SELECT lower(hex(randomblob(16)))", [], |r| r.get(0))
        .map_err(err)?;
    tx.execute(
        "INSERT OR REPLACE INTO postroom_meta (key, value) VALUES ('instance_id', ?1), (?2, ?3)",
        rusqlite::params![new, FILE_IDENTITY_KEY, identity],
    )
    .map_err(err)?;
    tx.commit().map_err(err)?;
    Ok(Some(Reminted { old, new }))
}

/// The file's instance id (schema.sql, `postroom_meta`): empty when the
/// file has none yet. (The NATS intake names it in its durable consumer.)
#[cfg(feature = "nats")]
pub(crate) fn instance_id(conn: &Connection) -> rusqlite::Result<String> {
    conn.query_row(
        "SELECT coalesce((SELECT value FROM postroom_meta WHERE key = 'instance_id'), '')",
        [],
        |r| r.get(0),
    )
}
