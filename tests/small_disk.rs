//! A database on a small filesystem (a few MiB of flash on an edge
//! device, here a tmpfs the test mounts): the WAL must stay a small share
//! of it, and once the filesystem has filled, the engine gives the WAL's
//! space back by itself and goes on as soon as space is freed — no restart.
//! Skipped, with the reason printed, where mounting is not permitted.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use postroom::{handler_fn, Error, Message, Postroom};

/// The size of the filesystems these tests mount.
const FS_BYTES: u64 = 4 * 1024 * 1024;
/// The payload size of the report.
const PAYLOAD: usize = 2000;
/// The most WAL these tests allow on such a filesystem: four times the
/// engine's copy-back bound (an eighth of the filesystem). A copy-back
/// cannot pass a frame that a read transaction still sees, so a reader
/// descheduled on a loaded machine lets the writer append past the bound
/// for a while (the large-disk test `the_wal_stays_bounded_while_writes_
/// never_stop` allows a margin too). Without the scaling, the WAL took the
/// whole filesystem.
const WAL_LIMIT: u64 = FS_BYTES / 2;

fn wal_len(db: &Path) -> u64 {
    let mut wal = db.as_os_str().to_owned();
    wal.push("-wal");
    std::fs::metadata(PathBuf::from(wal)).map_or(0, |m| m.len())
}

fn free_bytes(dir: &Path) -> u64 {
    let out = Command::new("df")
        .args(["--output=avail", "-B1"])
        .arg(dir)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .expect("df --output=avail")
}

fn message(id: &str) -> Message {
    Message::new("s", id.to_owned(), vec![b'p'; PAYLOAD])
}

/// The scenario: a 4 MiB filesystem, 2 KB payloads, a ballast file
/// leaving about 1 MiB. Deliver until `StorageFull`, delete the ballast,
/// then deliver many more messages — far more WAL traffic than the whole
/// filesystem holds, so only a WAL that is given back lets them through —
/// with the same engine: every one is acknowledged, nothing acknowledged
/// is lost, and the WAL stays a small share of the filesystem.
#[test]
fn a_small_filesystem_that_fills_recovers_once_space_is_freed() {
    let Some(fs) = Tmpfs::mount(FS_BYTES) else {
        return;
    };
    let path = fs.path().join("app.db");
    let ballast = fs.path().join("ballast");
    let room = Postroom::builder()
        .consumer("c", handler_fn(apply))
        .open(&path)
        .unwrap();
    create_domain(&room);
    let left = 1024 * 1024;
    let ballast_len = free_bytes(fs.path()).saturating_sub(left);
    std::fs::write(&ballast, vec![0u8; ballast_len as usize]).unwrap();

    let mut acked = Vec::new();
    let mut full = None;
    for i in 0..10_000 {
        let id = format!("before{i}");
        match room.deliver("c", message(&id)) {
            Ok(o) => {
                assert!(o.should_ack(), "{id}: {o:?}");
                acked.push(id);
            }
            Err(e @ Error::StorageFull { .. }) => {
                full = Some(e);
                break;
            }
            Err(e) => panic!("{id}: not StorageFull but {e}"),
        }
    }
    let full = full.expect("the filesystem never filled");
    let before = acked.len();
    eprintln!(
        "full after {before} acknowledgements ({full}): WAL {} bytes, database {} bytes",
        wal_len(&path),
        std::fs::metadata(&path).unwrap().len()
    );

    std::fs::remove_file(&ballast).unwrap();
    // Each delivery appends about ten pages to the WAL: 600 of them write
    // several times the filesystem's size.
    let after = 600;
    let mut largest_wal = 0;
    for i in 0..after {
        let id = format!("after{i}");
        match room.deliver("c", message(&id)) {
            Ok(o) => assert!(o.should_ack(), "{id}: {o:?}"),
            Err(e) => panic!(
                "delivery {i} after the ballast was deleted failed: {e} \
                 (WAL {} bytes, database {} bytes, {} bytes free)",
                wal_len(&path),
                std::fs::metadata(&path).unwrap().len(),
                free_bytes(fs.path())
            ),
        }
        acked.push(id);
        if i == 0 {
            // The first commit that found space again also gave the WAL
            // back (copied back and truncated: what is left is that
            // commit's frames at most), rather than let it take the space
            // just freed.
            let wal = wal_len(&path);
            assert!(
                wal <= 128 * 1024,
                "the WAL was not given back after the disk was full: {wal} bytes"
            );
        }
        largest_wal = largest_wal.max(wal_len(&path));
    }
    eprintln!(
        "{after} delivered after freeing space; largest WAL {largest_wal} bytes; \
         database {} bytes",
        std::fs::metadata(&path).unwrap().len()
    );
    assert!(
        largest_wal <= WAL_LIMIT,
        "the WAL grew to {largest_wal} bytes on a {FS_BYTES}-byte filesystem"
    );
    drop(room);
    let conn = raw(&path);
    for id in &acked {
        assert_eq!(
            applied_count(&conn, id),
            1,
            "{id} acknowledged but not stored"
        );
    }
    integrity_ok(&conn);
}

/// Without anything else on the filesystem, the WAL's bound is a share of
/// the filesystem's size, not the fixed thresholds made for large disks
/// (copy-back from 1,000 frames, about 4 MiB: a whole 4 MiB filesystem).
#[test]
fn the_wal_stays_a_small_share_of_a_small_filesystem() {
    let Some(fs) = Tmpfs::mount(FS_BYTES) else {
        return;
    };
    let path = fs.path().join("app.db");
    let room = Postroom::builder()
        .consumer("c", handler_fn(apply))
        .open(&path)
        .unwrap();
    create_domain(&room);
    let mut largest_wal = 0;
    for i in 0..300 {
        let id = format!("m{i}");
        let out = room.deliver("c", message(&id));
        assert!(out.as_ref().is_ok_and(|o| o.should_ack()), "{id}: {out:?}");
        largest_wal = largest_wal.max(wal_len(&path));
    }
    eprintln!("largest WAL {largest_wal} bytes");
    assert!(
        largest_wal <= WAL_LIMIT,
        "the WAL grew to {largest_wal} bytes on a {FS_BYTES}-byte filesystem"
    );
}

/// The same claim as bad_input's
/// `a_full_disk_answers_the_job_that_met_it_not_its_whole_batch`, on a real
/// full filesystem rather than a `max_page_count` quota. A quota is met
/// while a statement allocates pages (inside the job), but a filesystem is
/// met when pages are written: into the WAL at `COMMIT` (or when the page
/// cache spills), after every job of the batch ran, when nobody can say
/// whose writes did not fit: the jobs then commit one by one. (Before, the
/// whole batch was answered `StorageFull { op: "COMMIT" }`: the small
/// delivery batched beside a big one failed with it, in round 0.)
///
/// Each round holds the writer in a handler while the other two callers
/// queue, so their jobs are batched together once it returns.
#[test]
fn on_a_real_full_filesystem_a_big_write_fails_only_itself_not_its_batch() {
    use std::sync::Arc;
    let Some(fs) = Tmpfs::mount(FS_BYTES) else {
        return;
    };
    let path = fs.path().join("app.db");
    let (gate, gate_handler) = WriterGate::new();
    let room = Arc::new(
        Postroom::builder()
            .max_attempts(100)
            .consumer("gate", gate_handler)
            .consumer(
                "big",
                handler_fn(|tx, msg| {
                    // Far more than the space left, far less than the page
                    // cache: nothing is written before COMMIT.
                    tx.execute(
                        "INSERT INTO applied (consumer, message_id, payload) VALUES ('big', ?1, ?2)",
                        rusqlite::params![msg.id(), vec![7u8; 1024 * 1024]],
                    )?;
                    Ok(())
                }),
            )
            .consumer("small", handler_fn(apply))
            .open(&path)
            .unwrap(),
    );
    create_domain(&room);
    let ballast = fs.path().join("ballast");
    let ballast_len = free_bytes(fs.path()).saturating_sub(512 * 1024);
    std::fs::write(&ballast, vec![0u8; ballast_len as usize]).unwrap();
    for round in 0..5 {
        let mut answers = gate
            .batch(
                &room,
                ("gate", format!("g{round}")),
                vec![("big", format!("b{round}")), ("small", format!("s{round}"))],
            )
            .into_iter();
        let (big, small) = (answers.next().unwrap(), answers.next().unwrap());
        match big {
            Err(Error::StorageFull { .. }) => {}
            other => panic!("round {round}: the big delivery: {other:?}"),
        }
        match small {
            Ok(o) => assert!(o.should_ack(), "round {round}: {o:?}"),
            other => {
                panic!("round {round}: the small delivery batched beside the big one: {other:?}")
            }
        }
    }
    drop(room);
    let conn = raw(&path);
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM applied WHERE consumer = 'small'"
        ),
        5
    );
}
