//! What differs by operating system, through the public API: paths that
//! are long or not ASCII, the engine's lock while the app spawns processes
//! (tests/lock.rs), and on Windows a database file that another process
//! holds open unshared (an antivirus scanner, a backup tool): a typed,
//! retryable error after a bounded wait, never a wedge, and nothing
//! changed. These run on Linux in the suite and on Windows under wine
//! (`.ci/windows.sh`).

mod common;

use std::time::Duration;

use common::*;
use postroom::{handler_fn, Message, Outcome, Postroom};

/// A directory path past Windows' old 260-character limit, each part not
/// ASCII: an engine opens, applies, shuts down and reopens there, and the
/// operator's read path (a `file:` URI) reads it.
#[test]
fn long_paths_that_are_not_ascii_work_for_the_engine_and_the_readers() {
    let dir = tempfile::tempdir().unwrap();
    let mut deep = dir.path().to_path_buf();
    // Wine's GetFinalPathNameByHandleW (what `canonicalize` calls) fails
    // past about 260 UTF-16 units with ERROR_MORE_DATA, where Windows does
    // not; under wine (`.ci/windows.sh` sets POSTROOM_UNDER_WINE) the path
    // stays below that, not ASCII still.
    let under_wine = std::env::var_os("POSTROOM_UNDER_WINE").is_some();
    let parts = if under_wine { 3 } else { 6 };
    for i in 0..parts {
        deep.push(format!("données-日本語-ünïcødé-{i}-{}", "x".repeat(24)));
    }
    std::fs::create_dir_all(&deep).unwrap();
    let db = deep.join("app été #%.db");
    if !under_wine {
        assert!(db.as_os_str().len() > 300, "{}", db.display());
    }
    let open = || {
        Postroom::builder()
            .consumer("c", handler_fn(apply))
            .open(&db)
            .unwrap()
    };
    let room = open();
    create_domain(&room);
    for id in ["m-1", "m-2"] {
        let outcome = room.deliver("c", Message::new("s", id, "x")).unwrap();
        assert!(matches!(outcome, Outcome::Processed { .. }), "{outcome:?}");
    }
    room.shutdown(Duration::from_secs(10)).unwrap();
    let room = open();
    let again = room.deliver("c", Message::new("s", "m-1", "x")).unwrap();
    assert!(matches!(again, Outcome::Duplicate), "{again:?}");
    assert_eq!(room.stats().unwrap().inbox["c"].completed, 2);
    room.shutdown(Duration::from_secs(10)).unwrap();
    // The operator's reads go through a `file:` URI of the path.
    let (conn, _view) = postroom::admin::open_read(&db, Duration::from_secs(5)).unwrap();
    let completed: i64 = conn
        .query_row(
            "SELECT count(*) FROM postroom_inbox WHERE status = 'completed'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(completed, 2);
    assert_eq!(applied_count(&raw(&db), "m-1"), 1);
}

/// Windows: another process holding the database file open without
/// sharing it (an antivirus scanner or backup tool; here a handle with
/// share mode 0, which excludes every other open as theirs do) makes
/// `open` wait up to the busy timeout, then answer `FileInUse`, which is
/// retryable; once the file is let go, the same open succeeds and finds
/// everything as it was.
#[cfg(windows)]
#[test]
fn a_database_held_unshared_by_another_process_is_a_retryable_typed_error() {
    use std::os::windows::fs::OpenOptionsExt;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let open = |timeout| {
        Postroom::builder()
            .consumer("c", handler_fn(apply))
            .busy_timeout(timeout)
            .open(&db)
    };
    let room = open(Duration::from_secs(5)).unwrap();
    create_domain(&room);
    room.deliver("c", Message::new("s", "m-1", "x")).unwrap();
    room.shutdown(Duration::from_secs(10)).unwrap();

    use std::time::Instant;
    let scanner = std::fs::OpenOptions::new()
        .read(true)
        .share_mode(0)
        .open(&db)
        .unwrap();
    let started = Instant::now();
    let refused = open(Duration::from_millis(300));
    let waited = started.elapsed();
    match &refused {
        Err(e @ postroom::Error::FileInUse { .. }) => {
            assert!(e.is_retryable(), "{e}");
            assert!(e.to_string().contains("another process"), "{e}");
        }
        other => panic!("expected FileInUse, got {other:?}"),
    }
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    assert!(waited < Duration::from_secs(60), "{waited:?}");
    drop(scanner);
    let room = open(Duration::from_secs(5)).unwrap();
    let again = room.deliver("c", Message::new("s", "m-1", "x")).unwrap();
    assert!(matches!(again, Outcome::Duplicate), "{again:?}");
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// Windows: the engine file is held without shared delete, so while an
/// engine runs it cannot be deleted or renamed away (which would let a
/// second engine lock a new one), and `postroom status`'s probe tells the
/// engine runs without disturbing it.
#[cfg(windows)]
#[test]
fn the_engine_file_cannot_be_removed_while_an_engine_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let room = Postroom::builder().open(&db).unwrap();
    let engine_file = dir.path().join("app.db-postroom");
    let removed = std::fs::remove_file(&engine_file);
    assert_eq!(removed.unwrap_err().raw_os_error(), Some(32));
    let renamed = std::fs::rename(&engine_file, dir.path().join("elsewhere"));
    assert!(renamed.is_err());
    assert!(matches!(
        Postroom::builder().open(&db),
        Err(postroom::Error::AlreadyOpen { .. })
    ));
    room.shutdown(Duration::from_secs(10)).unwrap();
    Postroom::builder()
        .open(&db)
        .unwrap()
        .shutdown(Duration::from_secs(10))
        .unwrap();
}

/// Once `shutdown` has returned, the engine holds nothing open: the
/// database and every file beside it can be removed (on Windows an open
/// handle refuses that; on unix it would be a leak no test sees), and the
/// directory with them.
#[test]
fn after_shutdown_every_file_can_be_removed() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let room = Postroom::builder()
        .consumer("c", handler_fn(apply))
        .sink(postroom::sink_fn(|_| postroom::SendResult::Sent))
        .open(&db)
        .unwrap();
    create_domain(&room);
    room.deliver("c", Message::new("s", "m-1", "x")).unwrap();
    room.receive("c", Message::new("s", "m-2", "x")).unwrap();
    eventually(60, "the outbox to drain", || {
        let stats = room.stats().unwrap();
        stats.outbox.pending == 0 && stats.outbox.sent == 2
    });
    room.shutdown(Duration::from_secs(10)).unwrap();
    // Linux removes open files, so it asks the kernel instead: no
    // descriptor of this process on a `-wal` or `-shm` here (what an open
    // SQLite connection keeps; the database file itself stays open by
    // design there, see docs/DESIGN.md "What each guarantee rests on").
    let open = wal_and_shm_descriptors(dir.path());
    assert!(open.is_empty(), "still open after shutdown: {open:?}");
    let mut held = Vec::new();
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        if let Err(e) = std::fs::remove_file(&path) {
            held.push(format!("{}: {e}", path.display()));
        }
    }
    assert!(held.is_empty(), "still held after shutdown: {held:?}");
}
