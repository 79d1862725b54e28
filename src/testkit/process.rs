//! The real-process mode of a [`Scenario`](super::Scenario)
//! ([`Scenario::real_kills`](super::Scenario::real_kills)): the test binary
//! runs again as a child process, on the seed's directory, with only the
//! test's name (`--exact`) and [`CHILD_VAR`] naming the seed and the kill
//! point; the child delivers the seed's messages up to the kill point and
//! waits there (inside the handler's uncommitted transaction, or after the
//! commit and before the acknowledgement); the parent SIGKILLs it, opens
//! the same file (the engine's real recovery after a real death), delivers
//! the rest and judges.
//!
//! Invariants: the child role goes to the first scenario its test thread
//! runs (the parent refuses real kills from any other, so parent and child
//! agree on the scenario); a child never returns into the test harness (it
//! is killed, or exits with status 3 when it could not reach its kill
//! point, or aborts after two minutes without a parent); the stand-ins
//! ([`Service`](super::Service), [`Downstream`](super::Downstream)) live in
//! memory and die with the child, so after a real kill the verdict judges
//! effects your `effects` reads from files and the database, and counts
//! the child's sent outbox rows as handed to the sink without checking the
//! downstream.

use std::cell::Cell;
use std::process::{Command, Stdio};

use super::*;

/// Set in a child process: `SEED:STEP:BEFORE:DIR`.
pub(super) const CHILD_VAR: &str = "POSTROOM_TESTKIT_CHILD";
/// Replays one real-kill seed (and nothing else).
pub(super) const KILL_VAR: &str = "POSTROOM_TESTKIT_KILL";
/// A fault's `arg` when it is a real kill of a child process.
pub(crate) const REAL_KILL: i64 = 1;
/// Seeds the kill point apart from the in-process schedule.
const KILL_SALT: u64 = 0x6b69_6c6c_2d39;

thread_local! {
    static RUNS: Cell<u32> = const { Cell::new(0) };
}

/// This test thread's count of scenario runs before this one.
pub(super) fn ordinal() -> u32 {
    RUNS.with(|c| {
        let n = c.get();
        c.set(n.saturating_add(1));
        n
    })
}

/// Where the real kill of `seed` lands: before or after the commit of one
/// of its messages.
pub(super) fn kill_point(seed: u64, messages: usize) -> Fault {
    let mut rng = Rng::new(seed ^ KILL_SALT);
    let step = rng.below(messages as u64) as usize;
    let kind = if rng.chance(50) {
        FaultKind::CrashBeforeCommit
    } else {
        FaultKind::CrashAfterCommit
    };
    Fault {
        step,
        kind,
        arg: REAL_KILL,
    }
}

impl Armed {
    /// Tells the parent the kill point is reached, and waits for the
    /// SIGKILL (two minutes at most: then the parent is gone).
    pub(super) fn die(&self) -> ! {
        if let Some(path) = lock(&self.ready).clone() {
            // If this fails the parent times out and says so.
            let _ = std::fs::write(&path, b"ready");
        }
        let until = Instant::now() + Duration::from_secs(120);
        while Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50));
        }
        std::process::abort()
    }
}

/// The test's name, which libtest gives its thread.
fn test_name() -> Option<String> {
    std::thread::current()
        .name()
        .filter(|n| *n != "main")
        .map(str::to_owned)
}

fn failed_engine(message: String) -> Violation {
    Violation::Engine { message }
}

impl Scenario {
    /// The child's side: never returns.
    pub(super) fn run_child(&self, spec: &str) -> ! {
        let why = match self.child(spec) {
            Ok(()) => "the kill point was never reached".to_owned(),
            Err(v) => v.to_string(),
        };
        eprintln!("postroom testkit child: {why}");
        std::process::exit(3)
    }

    fn child(&self, spec: &str) -> Result<(), Violation> {
        let mut parts = spec.splitn(4, ':');
        let mut next = || parts.next().unwrap_or_default();
        let (seed, step, before, dir) = (next(), next(), next(), next());
        let (Ok(seed), Ok(step)) = (seed.parse::<u64>(), step.parse::<usize>()) else {
            return Err(failed_engine(format!("bad {CHILD_VAR}: {spec:?}")));
        };
        let before = before == "1";
        let dir = PathBuf::from(dir);
        let msgs = self.generate(seed);
        let mut run = Run::new(self, &dir, seed);
        *lock(&run.armed.ready) = Some(dir.join("child.ready"));
        let room = run.open()?;
        run.schema(&room)?;
        for (i, msg) in msgs.iter().enumerate().take(step.saturating_add(1)) {
            if i == step && before {
                run.armed.arm(msg, Mode::Kill);
            }
            run.deliver_until_acked(&room, i, msg)?;
            if i == step {
                // After the commit, before the acknowledgement (or a kill
                // before the commit that met no handler: a duplicate).
                run.armed.die();
            }
        }
        Ok(())
    }

    /// The parent's side of one real-kill seed.
    pub(super) fn run_killed(&self, seed: u64, msgs: &[Message]) -> Result<Done, Violation> {
        let test = test_name().ok_or_else(|| {
            failed_engine(
                "real kills run in a #[test]: the child process is the test binary run \
                 again with the test's name"
                    .into(),
            )
        })?;
        let kill = kill_point(seed, msgs.len());
        let io =
            |what: &'static str| move |e: std::io::Error| failed_engine(format!("{what}: {e}"));
        let dir = scratch_dir().map_err(io("a temporary directory"))?;
        let ready = dir.path().join("child.ready");
        let log_path = dir.path().join("child.log");
        let log = std::fs::File::create(&log_path).map_err(io("the child's log"))?;
        let exe = std::env::current_exe().map_err(io("the test binary"))?;
        let spec = format!(
            "{seed}:{}:{}:{}",
            kill.step,
            u8::from(kill.kind == FaultKind::CrashBeforeCommit),
            dir.path().display()
        );
        let mut child = Command::new(exe)
            .args([test.as_str(), "--exact", "--test-threads=1", "--nocapture"])
            .env(CHILD_VAR, spec)
            .env_remove(SEED_VAR)
            .env_remove(KILL_VAR)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().map_err(io("the child's log"))?))
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(io("starting the child process"))?;
        let tail = || {
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            let start = text.len().saturating_sub(2000);
            text.get(start..).unwrap_or_default().to_owned()
        };
        let deadline = Instant::now() + WAIT;
        while !ready.exists() {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(failed_engine(format!(
                    "the child process exited ({status}) before its kill point; its output:\n{}",
                    tail()
                )));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(failed_engine(format!(
                    "the child process did not reach its kill point in {WAIT:?}; its output:\n{}",
                    tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        // SIGKILL on Unix: no destructor, no flush, no unlock but the OS's.
        child.kill().map_err(io("killing the child process"))?;
        child.wait().map_err(io("reaping the child process"))?;
        let mut run = Run::new(self, dir.path(), seed);
        *run.fired.entry(kill.kind).or_insert(0) += 1;
        let room = run.open()?;
        let sent = {
            let conn = run.reader()?;
            let mut stmt = conn
                .prepare("SELECT message_id FROM postroom_outbox WHERE status = 'sent'")
                .map_err(|e| failed_engine(format!("reading the outbox: {e}")))?;
            let ids: rusqlite::Result<BTreeSet<String>> = stmt
                .query_map([], |r| r.get(0))
                .and_then(|rows| rows.collect());
            ids.map_err(|e| failed_engine(format!("reading the outbox: {e}")))?
        };
        run.killed = Some(sent);
        for (i, msg) in msgs.iter().enumerate().skip(kill.step) {
            run.deliver_until_acked(&room, i, msg)?;
        }
        run.settle(&room)?;
        run.drain()?;
        room.shutdown(Duration::from_secs(30))
            .map_err(engine("shutdown"))?;
        drop(room);
        let done = run.verdict(msgs);
        drop(dir);
        done
    }
}

impl Run<'_> {
    /// Delivers until every consumer acknowledged (a bounded number of
    /// times).
    fn deliver_until_acked(
        &mut self,
        room: &Postroom,
        index: usize,
        msg: &Message,
    ) -> Result<(), Violation> {
        for _ in 0..100 {
            if self.deliver(room, index, msg)? {
                return Ok(());
            }
        }
        Err(Violation::NotSettled {
            message_id: msg.id().to_owned(),
            consumer: "(every consumer)".into(),
            status: Some("still not acknowledged after 100 deliveries".into()),
        })
    }
}
