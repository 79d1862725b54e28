//! Opening a database by an odd route: symlinks and hard links to it, paths
//! that are not a database file, read-only places, another user's file.
//! Every refusal is typed, names the path, and leaves the directory as it
//! found it.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use postroom::{handler_fn, Error, Message, Outcome, Postroom};

fn open(path: &Path) -> postroom::Result<Postroom> {
    Postroom::builder()
        .workers(0)
        .consumer("c", handler_fn(|_, _| Ok(())))
        .open(path)
}

/// Every entry under `dir` (not following symlinks) with its size and
/// content digest: what a refused open must leave as it was.
fn listing(dir: &Path) -> BTreeMap<PathBuf, (u64, Option<[u8; 32]>)> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let digest = meta
                .is_file()
                .then(|| *blake3::hash(&std::fs::read(&path).unwrap()).as_bytes());
            if meta.is_dir() {
                todo.push(path.clone());
            }
            out.insert(path, (meta.len(), digest));
        }
    }
    out
}

fn am_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

#[test]
fn a_second_engine_through_a_symlink_is_refused_as_already_open() {
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real");
    std::fs::create_dir(&real).unwrap();
    let db = real.join("app.db");
    let first = open(&db).unwrap();
    let link = dir.path().join("link.db");
    std::os::unix::fs::symlink(&db, &link).unwrap();
    let dir_link = dir.path().join("elsewhere");
    std::os::unix::fs::symlink(&real, &dir_link).unwrap();
    for route in [link.clone(), dir_link.join("app.db")] {
        match open(&route) {
            Err(Error::AlreadyOpen { path }) => assert_eq!(path, route),
            other => panic!("{}: expected AlreadyOpen, got {other:?}", route.display()),
        }
    }
    assert!(!with_suffix(&link, "-postroom").exists());
    assert_eq!(
        first.deliver("c", Message::new("s", "m", "x")).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    first.shutdown(Duration::from_secs(10)).unwrap();
    // Closed, the link opens the same database, with the same engine file.
    let again = open(&link).unwrap();
    assert_eq!(
        again.deliver("c", Message::new("s", "m", "x")).unwrap(),
        Outcome::Duplicate
    );
    drop(again);
    assert!(!with_suffix(&link, "-postroom").exists());
}

/// A hard link is a second name of the same file; SQLite keeps a `-wal`
/// per name, so two names open at once are two logs of one database. A
/// file with more than one link is refused, by any name, while the engine
/// that has it open keeps working; with the extra link gone it opens.
#[test]
fn a_database_with_a_second_hard_link_is_refused_by_either_name() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let first = open(&db).unwrap();
    let other = dir.path().join("other.db");
    std::fs::hard_link(&db, &other).unwrap();
    let before = listing(dir.path());
    for name in [&other, &db] {
        match open(name) {
            Err(
                e @ Error::InvalidInput {
                    field: "database", ..
                },
            ) => {
                let text = e.to_string();
                assert!(text.contains("hard links"), "{text}");
                assert!(text.contains(&name.display().to_string()), "{text}");
            }
            Err(e) => panic!(
                "{}: expected a refusal naming hard links, got {e:?}",
                name.display()
            ),
            Ok(_) => panic!("{}: a second engine opened a hard link", name.display()),
        }
    }
    assert_eq!(listing(dir.path()), before, "a refused open left files");
    assert_eq!(
        first.deliver("c", Message::new("s", "m", "x")).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    drop(first);
    std::fs::remove_file(&other).unwrap();
    let again = open(&db).unwrap();
    assert_eq!(
        again.deliver("c", Message::new("s", "m", "x")).unwrap(),
        Outcome::Duplicate
    );
}

/// `path`'s refusal: an error, and the directory as it was.
fn refused(dir: &Path, path: &Path) -> Error {
    let before = listing(dir);
    let err = match open(path) {
        Err(e) => e,
        Ok(_) => panic!("{} was opened", path.display()),
    };
    assert_eq!(
        listing(dir),
        before,
        "refusing {} ({err}) changed the directory",
        path.display()
    );
    err
}

#[test]
fn refused_opens_leave_no_files_behind() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();

    let text = d.join("notes.txt");
    std::fs::write(&text, b"not a database ".repeat(300)).unwrap();
    assert!(matches!(refused(d, &text), Error::NotADatabase { .. }));

    // A newer schema and a damaged file, from a real engine (its engine
    // file removed: a refusal must not make a new one).
    let made = |name: &str| {
        let path = d.join(name);
        let room = open(&path).unwrap();
        for i in 0..300 {
            room.deliver("c", Message::new("s", format!("m{i}"), vec![b'x'; 500]))
                .unwrap();
        }
        room.shutdown(Duration::from_secs(10)).unwrap();
        std::fs::remove_file(with_suffix(&path, "-postroom")).unwrap();
        path
    };
    let newer = made("newer.db");
    raw(&newer)
        .execute(
            "UPDATE postroom_meta SET value = '99' WHERE key = 'schema_version'",
            [],
        )
        .unwrap();
    assert!(matches!(
        refused(d, &newer),
        Error::SchemaTooNew { found: 99, .. }
    ));
    let corrupt = made("corrupt.db");
    let mut bytes = std::fs::read(&corrupt).unwrap();
    for b in &mut bytes[8 * 4096..12 * 4096] {
        *b = 0xA5;
    }
    std::fs::write(&corrupt, &bytes).unwrap();
    assert!(matches!(refused(d, &corrupt), Error::Corrupt { .. }));

    let fifo = d.join("pipe");
    let made_fifo = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made_fifo.success());
    let err = refused(d, &fifo);
    assert!(
        matches!(
            err,
            Error::InvalidInput {
                field: "database",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string().contains(&fifo.display().to_string()),
        "{err}"
    );
    assert!(err.to_string().contains("not a regular file"), "{err}");

    let dangling = d.join("dangling.db");
    std::os::unix::fs::symlink(d.join("missing.db"), &dangling).unwrap();
    let err = refused(d, &dangling);
    assert!(
        matches!(
            err,
            Error::InvalidInput {
                field: "database",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("missing.db"), "{err}");

    let sub = d.join("sub");
    std::fs::create_dir(&sub).unwrap();
    for path in [sub.clone(), PathBuf::from(format!("{}/", sub.display()))] {
        let err = refused(d, &path);
        assert!(
            matches!(
                err,
                Error::InvalidInput {
                    field: "database",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("is a directory"), "{err}");
        assert!(
            err.to_string().contains(&sub.display().to_string()),
            "{err}"
        );
    }
}

/// Root opening an application's database (an operator's one-off run)
/// must not leave a root-owned engine file that locks the application's
/// user out: it gets the database's owner, as SQLite's `-wal` and `-shm` do.
#[test]
fn an_engine_file_made_by_root_takes_the_databases_owner() {
    if !am_root() {
        eprintln!("skipped: needs root to open another user's database");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    drop(open(&db).unwrap());
    std::fs::remove_file(with_suffix(&db, "-postroom")).unwrap();
    std::os::unix::fs::chown(&db, Some(4321), Some(4322)).unwrap();
    let room = open(&db).unwrap();
    room.deliver("c", Message::new("s", "m", "x")).unwrap();
    for suffix in ["-postroom", "-wal", "-shm"] {
        let meta = std::fs::metadata(with_suffix(&db, suffix)).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid()),
            (4321, 4322),
            "{suffix} is not the database owner's"
        );
    }
}

/// A database on a read-only mount is `ReadOnly`, as documented, and
/// nothing is created.
#[test]
fn a_database_on_a_read_only_mount_is_refused_as_read_only() {
    if !am_root() {
        eprintln!("skipped: mounting a file system needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
        .arg(&mnt)
        .status();
    if !mounted.is_ok_and(|s| s.success()) {
        eprintln!("skipped: cannot mount a tmpfs here");
        return;
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(mnt.clone());
    let db = mnt.join("app.db");
    let room = open(&db).unwrap();
    room.deliver("c", Message::new("s", "m", "x")).unwrap();
    room.shutdown(Duration::from_secs(10)).unwrap();
    for suffix in ["-postroom", "-wal", "-shm"] {
        let _ = std::fs::remove_file(with_suffix(&db, suffix));
    }
    let remount = Command::new("mount")
        .args(["-o", "remount,ro"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(remount.success());
    let err = refused(&mnt, &db);
    assert!(matches!(err, Error::ReadOnly { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&mnt.display().to_string()),
        "{err}"
    );
    let err = refused(&mnt, &mnt.join("new.db"));
    assert!(matches!(err, Error::ReadOnly { .. }), "{err:?}");
}

/// A path under a directory that does not exist: the error names it.
#[test]
fn a_missing_directory_is_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no").join("such");
    let err = refused(dir.path(), &missing.join("app.db"));
    assert!(
        matches!(&err, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains(&dir.path().join("no").display().to_string()),
        "{err}"
    );
}

/// A directory the process may not create files in: `ReadOnly` naming
/// the directory, for a new database and for an existing one (whose
/// `-wal`, `-shm` and engine file cannot be made). Root may write
/// anywhere, so as root the check runs in a child as `nobody`.
#[test]
fn a_read_only_directory_is_named_in_the_error() {
    if am_root() && std::env::var_os("POSTROOM_AS_NOBODY").is_none() {
        let exe = std::env::current_exe().unwrap();
        let status = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&exe)
            .args([
                "--exact",
                "a_read_only_directory_is_named_in_the_error",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("POSTROOM_AS_NOBODY", "1")
            .env("TMPDIR", "/tmp")
            .status();
        match status {
            Ok(s) => assert!(s.success(), "the check run as nobody failed: {s}"),
            Err(e) => eprintln!("skipped: cannot run as nobody (setpriv: {e})"),
        }
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let ro = dir.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    let db = ro.join("app.db");
    drop(open(&db).unwrap());
    std::fs::remove_file(with_suffix(&db, "-postroom")).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    for path in [db.clone(), ro.join("new.db")] {
        let err = refused(&ro, &path);
        match &err {
            Error::ReadOnly { path } => assert_eq!(path, &ro),
            other => panic!("expected ReadOnly naming {}, got {other:?}", ro.display()),
        }
        assert!(err.to_string().contains(&ro.display().to_string()), "{err}");
    }
    // The engine file left by an earlier run: SQLite's -wal cannot be made.
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();
    drop(open(&db).unwrap());
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    match refused(&ro, &db) {
        Error::ReadOnly { path } => assert_eq!(path, ro),
        other => panic!("expected ReadOnly naming {}, got {other:?}", ro.display()),
    }
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// An application database in rollback-journal mode that fails
/// `quick_check` is refused as `Corrupt` before anything is written: its
/// header still says rollback journal (bytes 18 and 19 are 1, WAL's 2).
#[test]
fn a_damaged_rollback_journal_database_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    {
        let conn = rusqlite::Connection::open(&db).unwrap();
        conn.execute_batch(
            "PRAGMA journal_mode = DELETE;
             CREATE TABLE mine (id INTEGER PRIMARY KEY, body BLOB);
             CREATE INDEX mine_body ON mine (body);",
        )
        .unwrap();
        for i in 0..400 {
            conn.execute(
                "INSERT INTO mine (body) VALUES (?1)",
                [format!("{i:0>600}")],
            )
            .unwrap();
        }
    }
    let mut bytes = std::fs::read(&db).unwrap();
    assert_eq!(&bytes[18..20], &[1, 1]);
    let len = bytes.len();
    for b in &mut bytes[len / 2..len / 2 + 3 * 4096] {
        *b = 0x5A;
    }
    std::fs::write(&db, &bytes).unwrap();
    let err = refused(dir.path(), &db);
    assert!(matches!(err, Error::Corrupt { .. }), "{err:?}");
    assert_eq!(
        std::fs::read(&db).unwrap(),
        bytes,
        "the refused file changed"
    );
}

/// The engine relies on postroom's triggers as the schema ships them (the
/// key table, the watermarks): a file where one was edited is refused at
/// open, naming it, as one missing a trigger is. An allowlist (the
/// schema's own SQL), not a list of known ways to break one.
#[test]
fn a_file_whose_trigger_was_edited_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    open(&db)
        .unwrap()
        .shutdown(Duration::from_secs(10))
        .unwrap();
    raw(&db)
        .execute_batch(
            "DROP TRIGGER postroom_inbox_seq_seen;
             CREATE TRIGGER postroom_inbox_seq_seen AFTER INSERT ON postroom_inbox
             WHEN 0 BEGIN SELECT 1; END;",
        )
        .unwrap();
    let err = open(&db).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidInput {
                field: "database",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("postroom_inbox_seq_seen"), "{err}");
    // Restored as the schema ships it, the file opens again.
    raw(&db)
        .execute_batch(&format!(
            "DROP TRIGGER postroom_inbox_seq_seen; {}",
            postroom::SCHEMA_SQL
        ))
        .unwrap();
    open(&db)
        .unwrap()
        .shutdown(Duration::from_secs(10))
        .unwrap();
}
