//! Shared helpers for the integration tests: a domain schema whose writes
//! are deliberately NOT idempotent (so a double application shows up as a
//! count of 2), raw connections for inspecting the file, a seeded RNG, and
//! the child-process plumbing of the crash tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use postroom::{Failure, Message, Outgoing, Tx};
use rusqlite::{params, Connection, OptionalExtension};

/// Domain table: one row per application of a message. No unique key on
/// purpose: exactly-once must come from postroom, not from the schema.
pub const DOMAIN_SQL: &str = "CREATE TABLE IF NOT EXISTS applied (
    consumer TEXT NOT NULL, message_id TEXT NOT NULL, payload BLOB);";

/// The canonical handler effect: a domain row plus one outbox message.
pub fn apply(tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
    tx.execute(
        "INSERT INTO applied (consumer, message_id, payload) VALUES (?1, ?2, ?3)",
        params![tx.consumer().unwrap_or(""), msg.id(), msg.payload()],
    )?;
    tx.publish(Outgoing::new("applied", msg.id().as_bytes().to_vec()).with_key(msg.source()))?;
    Ok(())
}

/// Service B's handler in the two-service tests: records each message it
/// gets, publishes nothing.
pub fn record_as_b(tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
    tx.execute(
        "INSERT INTO applied (consumer, message_id, payload) VALUES ('b', ?1, ?2)",
        params![msg.id(), msg.payload()],
    )?;
    Ok(())
}

pub fn create_domain(room: &postroom::Postroom) {
    room.transaction(|tx| {
        tx.execute_batch(DOMAIN_SQL)?;
        Ok(())
    })
    .expect("create domain table");
}

/// A plain connection for inspecting the database beside a running engine.
pub fn raw(path: &Path) -> Connection {
    let conn = Connection::open(path).expect("open raw connection");
    conn.busy_timeout(std::time::Duration::from_secs(10))
        .unwrap();
    conn
}

pub fn applied_count(conn: &Connection, message_id: &str) -> i64 {
    conn.query_row(
        "SELECT count(*) FROM applied WHERE message_id = ?1",
        [message_id],
        |r| r.get(0),
    )
    .unwrap()
}

/// The first column of every row `sql` returns.
pub fn column<T: FromIterator<String>>(conn: &Connection, sql: &str) -> T {
    conn.prepare(sql)
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

pub fn count(conn: &Connection, sql: &str) -> i64 {
    conn.query_row(sql, [], |r| r.get(0)).unwrap()
}

/// (status, attempts, last_error, payload) of an inbox row.
pub type InboxRow = (String, i64, Option<String>, Option<Vec<u8>>);

pub fn inbox_row(conn: &Connection, consumer: &str, source: &str, id: &str) -> Option<InboxRow> {
    conn.query_row(
        "SELECT status, attempts, last_error, payload FROM postroom_inbox
         WHERE id = (SELECT inbox_id FROM postroom_inbox_keys
                     WHERE consumer = ?1 AND source = ?2 AND message_id = ?3)",
        [consumer, source, id],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
    )
    .optional()
    .unwrap()
}

/// SQLite's `integrity_check` and postroom's own invariants (key table,
/// status fields, digests, causes) hold; warnings are allowed.
pub fn integrity_ok(conn: &Connection) {
    let report = postroom::admin::check(conn, postroom::admin::CheckDepth::Full).unwrap();
    assert!(report.is_ok(), "{report:#?}");
}

/// SplitMix64: small, seedable, good enough to pick ids and delays.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Seed for randomized tests: `POSTROOM_SEED` to replay, else from the time.
pub fn seed() -> u64 {
    std::env::var("POSTROOM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        })
}

/// A command running `exe`, a program built for the target under test
/// (this test binary re-executed, the `postroom` CLI): through the runner
/// in `POSTROOM_TEST_RUNNER` when that is set, else directly. `.ci/cross.sh`
/// sets it to `qemu-arm-static` for the armv7 run: cargo's runner wraps
/// only the test binary it starts, and without binfmt_misc (a container)
/// the kernel cannot exec the ARM children that binary spawns.
pub fn target_command(exe: impl AsRef<std::ffi::OsStr>) -> Command {
    let runner = std::env::var("POSTROOM_TEST_RUNNER").unwrap_or_default();
    let mut words = runner.split_whitespace();
    match words.next() {
        Some(program) => {
            let mut cmd = Command::new(program);
            cmd.args(words).arg(exe);
            cmd
        }
        None => Command::new(exe),
    }
}

/// Where the manual clocks of the time-dependent tests start (unix ms):
/// 2023-11-14, or `POSTROOM_TEST_START_MS`. `.ci/cross.sh` runs the armv7
/// suite from 2040-01-01, past the end of a 32-bit `time_t` (2038-01-19),
/// so retention, leases, backoff and watermarks are checked there too.
pub fn start_ms() -> i64 {
    std::env::var("POSTROOM_TEST_START_MS")
        .ok()
        .map(|s| {
            s.parse()
                .expect("POSTROOM_TEST_START_MS: unix milliseconds")
        })
        .unwrap_or(1_700_000_000_000)
}

/// Spawns this test binary again as a child that runs `role` (see each
/// test file's `child_main`), with `env` set. Stdout is piped: children
/// report acknowledgements as `ACK <id>` lines.
pub fn spawn_child(role: &str, db: &Path, env: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().expect("current test binary");
    let mut cmd = target_command(exe);
    cmd.args([
        "--exact",
        "child_main",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("POSTROOM_CHILD", role)
    .env("POSTROOM_DB", db)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn child process")
}

/// `path` with `suffix` appended to its file name: `app.db` → `app.db-wal`.
pub fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// A numeric setting from the environment (kill counts, seeds).
pub fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.parse().ok()
}

/// Reads the child's stdout on a thread: every line, in order, with the
/// moment it was read. The channel ends when the child's stdout does.
pub fn lines_of(child: &mut Child) -> std::sync::mpsc::Receiver<(std::time::Instant, String)> {
    use std::io::BufRead;
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send((std::time::Instant::now(), line)).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits (at most a minute) for the child to say `wanted`; returns the
/// lines before it.
pub fn wait_for(
    lines: &std::sync::mpsc::Receiver<(std::time::Instant, String)>,
    wanted: &str,
) -> Vec<String> {
    wait_for_or(lines, wanted, String::new)
}

/// [`wait_for`], whose failure also says what `context` returns then.
pub fn wait_for_or(
    lines: &std::sync::mpsc::Receiver<(std::time::Instant, String)>,
    wanted: &str,
    context: impl Fn() -> String,
) -> Vec<String> {
    let mut seen = Vec::new();
    loop {
        match lines.recv_timeout(std::time::Duration::from_secs(60)) {
            Ok((_, line)) if line == wanted => return seen,
            Ok((_, line)) => seen.push(line),
            Err(e) => panic!(
                "child never said {wanted:?} ({e}); its last lines: {:?} {}",
                &seen[seen.len().saturating_sub(5)..],
                context()
            ),
        }
    }
}

/// The role and database a child was started with, if this process is one.
pub fn child_role() -> Option<(String, PathBuf)> {
    let role = std::env::var("POSTROOM_CHILD").ok()?;
    let db = std::env::var_os("POSTROOM_DB")?;
    Some((role, PathBuf::from(db)))
}

/// Writes a protocol line to the real stdout (not libtest's capture) and
/// flushes, so a parent reading the pipe sees it before any later kill.
pub fn report(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(line.as_bytes()).unwrap();
    out.write_all(b"\n").unwrap();
    out.flush().unwrap();
}

/// What a total-queue checker (after Jepsen's) finds when it compares what
/// a client was told was acknowledged with what the database holds after
/// recovery and a full redelivery.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Checked {
    /// Messages acknowledged to the client.
    pub acked: usize,
    /// Acknowledged, but not applied after recovery. Must be empty.
    pub lost: Vec<String>,
    /// Applied more than once. Must be empty.
    pub duplicated: Vec<String>,
    /// Applied, but never sent. Must be empty.
    pub unexpected: Vec<String>,
    /// Sent and not acknowledged (the client crashed or was refused), yet
    /// applied once after recovery: the at-least-once path working.
    pub recovered: usize,
}

impl Checked {
    pub fn ok(&self) -> bool {
        self.lost.is_empty() && self.duplicated.is_empty() && self.unexpected.is_empty()
    }
}

/// Checks `consumer`'s effects in the `applied` table against what was sent
/// and what was acknowledged.
pub fn check_effects(
    conn: &Connection,
    consumer: &str,
    sent: &std::collections::BTreeSet<String>,
    acked: &std::collections::BTreeSet<String>,
) -> Checked {
    let mut applied: std::collections::BTreeMap<String, i64> = Default::default();
    let mut stmt = conn
        .prepare("SELECT message_id, count(*) FROM applied WHERE consumer = ?1 GROUP BY message_id")
        .unwrap();
    for row in stmt
        .query_map([consumer], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
    {
        let (id, n): (String, i64) = row.unwrap();
        applied.insert(id, n);
    }
    let mut checked = Checked {
        acked: acked.len(),
        ..Checked::default()
    };
    for id in acked {
        if !applied.contains_key(id) {
            checked.lost.push(id.clone());
        }
    }
    for (id, n) in &applied {
        if *n > 1 {
            checked.duplicated.push(id.clone());
        }
        if !sent.contains(id) {
            checked.unexpected.push(id.clone());
        } else if !acked.contains(id) {
            checked.recovered += 1;
        }
    }
    checked
}

/// Polls `f` every 5 ms until it holds (true) or `secs` seconds have
/// passed (false).
fn poll_until(secs: u64, mut f: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while !f() {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    true
}

/// Waits until `f` holds, polling every 5 ms; fails after `secs` seconds,
/// naming `what`.
pub fn eventually(secs: u64, what: &str, f: impl FnMut() -> bool) {
    assert!(poll_until(secs, f), "timed out waiting for {what}");
}

/// Sets the flag when dropped: a thread that loops until it is set stops
/// however the code holding this ends, a failed assertion included, so the
/// failure fails the test instead of leaving a scope waiting forever.
pub struct SetOnDrop<'a>(pub &'a std::sync::atomic::AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Waits for `child` to exit. One still running after `secs` seconds is
/// killed and the test fails, naming `what`, instead of waiting forever.
pub fn wait_or_kill(child: &mut Child, secs: u64, what: &str) -> std::process::ExitStatus {
    let mut status = None;
    if !poll_until(secs, || {
        status = child.try_wait().expect("wait for child");
        status.is_some()
    }) {
        let _ = child.kill();
        let _ = child.wait();
        panic!("{what}: the child still ran after {secs} s; killed");
    }
    status.expect("polled until the child exited")
}

/// Joins `thread`, failing the test (naming `what`) if it has not finished
/// within `secs` seconds, instead of waiting forever for a call that never
/// returns.
pub fn join_within<T>(thread: std::thread::JoinHandle<T>, secs: u64, what: &str) -> T {
    assert!(
        poll_until(secs, || thread.is_finished()),
        "{what}: still running after {secs} s"
    );
    thread.join().expect("the thread panicked")
}

/// Runs `f` on a thread of its own and fails the test if it has not
/// returned within `secs`: an engine call that never answers fails the test
/// instead of hanging it.
pub fn within<T: Send + 'static>(
    secs: u64,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    join_within(std::thread::spawn(f), secs, what)
}

/// A tmpfs mounted on a fresh temporary directory, unmounted when dropped
/// (also when the test panics; the engine on it is declared after it, so
/// it is dropped first).
pub struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// `None` when this process may not mount one (not root, a container
    /// without the capability): the caller skips.
    pub fn mount(bytes: u64) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir.path())
            .stderr(std::process::Stdio::null())
            .status();
        match status {
            Ok(s) if s.success() => Some(Tmpfs { dir }),
            Ok(s) => {
                eprintln!("skipped: cannot mount a tmpfs here (mount: {s})");
                None
            }
            Err(e) => {
                eprintln!("skipped: cannot mount a tmpfs here (no mount command: {e})");
                None
            }
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Makes it read-only: every write fails with `EROFS`, even root's.
    pub fn remount_read_only(&self) {
        let ok = Command::new("mount")
            .args(["-o", "remount,ro"])
            .arg(self.dir.path())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "remount {} read-only", self.dir.path().display());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(self.dir.path())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            // Something still has a file open on it: detach it lazily so
            // the temporary directory can go.
            let _ = Command::new("umount")
                .arg("-l")
                .arg(self.dir.path())
                .status();
        }
    }
}

/// A handler that holds the writer until the test releases it: deliveries
/// made meanwhile queue behind it, and their jobs share the next batch
/// (group commit), which is how the full-disk tests put a big and a small
/// delivery into one transaction.
pub struct WriterGate {
    entered: crossbeam_channel::Receiver<()>,
    release: crossbeam_channel::Sender<()>,
}

impl WriterGate {
    /// The gate, and the handler to register as its consumer.
    pub fn new() -> (WriterGate, impl postroom::Handler) {
        let (release, held) = crossbeam_channel::bounded::<()>(0);
        let (entered_tx, entered) = crossbeam_channel::bounded::<()>(1);
        let handler = postroom::handler_fn(move |_tx, _msg| {
            let _ = entered_tx.send(());
            let _ = held.recv_timeout(std::time::Duration::from_secs(60));
            Ok(())
        });
        (WriterGate { entered, release }, handler)
    }

    /// Delivers `gate_id` to the gate's consumer `gate`, waits until it
    /// holds the writer, delivers each of `others` (consumer, id) from a
    /// thread of its own, gives them 500 ms to queue (on a loaded machine
    /// they may not have: then they run apart and prove less, but pass),
    /// and releases the gate. Returns the others' answers, in order.
    pub fn batch(
        &self,
        room: &std::sync::Arc<postroom::Postroom>,
        gate: (&'static str, String),
        others: Vec<(&'static str, String)>,
    ) -> Vec<postroom::Result<postroom::Outcome>> {
        let deliver = |consumer: &'static str, id: String| {
            let room = std::sync::Arc::clone(room);
            std::thread::spawn(move || room.deliver(consumer, Message::new("s", id, "x")))
        };
        let held = deliver(gate.0, gate.1);
        self.entered
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the gate handler to run");
        let others: Vec<_> = others.into_iter().map(|(c, id)| deliver(c, id)).collect();
        std::thread::sleep(std::time::Duration::from_millis(500));
        self.release.send(()).expect("the gate handler waits");
        assert!(held.join().unwrap().unwrap().should_ack());
        others.into_iter().map(|t| t.join().unwrap()).collect()
    }
}

/// Whether `status` is a child's that `Child::kill` ended: SIGKILL on
/// unix; on Windows `TerminateProcess`, which std calls with exit code 1.
pub fn was_killed(status: &std::process::ExitStatus) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        status.signal() == Some(9)
    }
    #[cfg(windows)]
    {
        status.code() == Some(1)
    }
}

/// Whether `status` is a child's that `std::process::abort` ended: SIGABRT
/// on unix; on Windows the fast-fail status (`STATUS_STACK_BUFFER_OVERRUN`,
/// what Rust's abort raises there) or the C runtime's abort code 3.
pub fn was_aborted(status: &std::process::ExitStatus) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        status.signal() == Some(6)
    }
    #[cfg(windows)]
    {
        matches!(status.code(), Some(3) | Some(-1_073_740_791))
    }
}

/// The `-wal` and `-shm` files under `dir` this process holds a descriptor
/// on (what an open SQLite connection keeps), as Linux's `/proc/self/fd`
/// tells; empty where there is no `/proc` (Linux removes open files, so it
/// asks the kernel instead of trying to delete them).
pub fn wal_and_shm_descriptors(dir: &Path) -> Vec<PathBuf> {
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    fds.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter(|target| target.starts_with(dir))
        .filter(|target| {
            let name = target.to_string_lossy();
            name.ends_with("-wal") || name.ends_with("-shm")
        })
        .collect()
}

/// Runs `run` over `items` on as many threads as there are CPUs, at most 4
/// (or the number in the environment variable `jobs_var`), each taking the
/// next item; the first `Err` stops the others and is returned. What each
/// run answered (`Some`) is gathered, in no particular order.
pub fn in_parallel<T: Sync, R: Send>(
    items: &[T],
    jobs_var: &str,
    run: impl Fn(&T) -> Result<Option<R>, String> + Sync,
) -> Result<Vec<R>, String> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let jobs = std::env::var(jobs_var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get().min(4)))
        .max(1);
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..jobs)
            .map(|_| {
                scope.spawn(|| {
                    let mut got = Vec::new();
                    while !failed.load(Ordering::Relaxed) {
                        let Some(item) = items.get(next.fetch_add(1, Ordering::Relaxed)) else {
                            break;
                        };
                        match run(item) {
                            Ok(answer) => got.extend(answer),
                            Err(e) => {
                                failed.store(true, Ordering::Relaxed);
                                return Err(e);
                            }
                        }
                    }
                    Ok(got)
                })
            })
            .collect();
        let mut all = Vec::new();
        for w in workers {
            all.extend(w.join().unwrap()?);
        }
        Ok(all)
    })
}
