//! The fault wrappers: [`Armed`] names the message a handler fault waits
//! for and records whether it fired; [`Crashable`] and
//! [`CrashableEffect`] act on it inside your handler's transaction (crash
//! before commit, rollback, full disk, a held lease, a real kill); the
//! [`FaultySink`] wraps your sink with the sink faults and logs what it
//! was handed ([`SinkLog`]).
//!
//! Invariants: a fault fires at most once per arming, only for the message
//! armed; a crash is a panic the engine turns into a rollback, so nothing
//! of the transaction commits; the lease-expiry handshake ([`Hold`]) waits
//! bounded.

use super::*;

/// What a fault in your handler's transaction does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// The process dies before the commit.
    Crash,
    /// SQL rolls the whole transaction back.
    Rollback,
    /// The disk is full while your handler runs (the quota is set by the
    /// run). If one of its statements met it, the wrapper lifts the quota
    /// for the rest of the transaction, so what it did (or, having
    /// swallowed the error, did not do) commits as it would in production;
    /// if none did, it adds a page-sized write that surely meets it.
    DiskFull,
    /// In a child process of the real-process mode: tell the parent, and
    /// wait for its SIGKILL, inside the uncommitted transaction.
    Kill,
    /// After an effect handler's external step, hold the worker until the
    /// run has expired its lease (see [`Hold`]).
    Lease,
}

/// The handshake of a lease-expiry fault between the effect wrapper (on a
/// worker thread) and the run: the wrapper holds after the external step
/// until the run has expired the lease, so the expiry lands under the step
/// on every machine, fast or slow, without waiting out a real lease.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) enum Hold {
    /// No step held.
    #[default]
    Idle,
    /// A step is held, its lease still live.
    Holding,
    /// The run has expired the lease (or gave up): the step goes on.
    Released,
}

/// Which message a fault in the handler's transaction waits for, and
/// whether it fired. Shared by the handler wrappers of every process life
/// of a seed.
#[derive(Default)]
pub(super) struct Armed {
    pub(super) target: Mutex<Option<(String, String, Mode)>>,
    pub(super) fired: Mutex<Option<Mode>>,
    /// The file a child process creates when it is ready to be killed.
    pub(super) ready: Mutex<Option<PathBuf>>,
    /// A lease-expiry fault's handshake, and its signal.
    pub(super) hold: Mutex<Hold>,
    pub(super) held: Condvar,
}

impl Armed {
    pub(super) fn arm(&self, msg: &Message, mode: Mode) {
        *lock(&self.target) = Some((msg.source().to_owned(), msg.id().to_owned(), mode));
        *lock(&self.fired) = None;
    }

    /// The armed mode, once, for the armed message, if it is one of `modes`.
    pub(super) fn take(&self, msg: &Message, modes: &[Mode]) -> Option<Mode> {
        let mut target = lock(&self.target);
        let mode = match target.as_ref() {
            Some((s, id, mode)) if s == msg.source() && id == msg.id() && modes.contains(mode) => {
                *mode
            }
            _ => return None,
        };
        *target = None;
        Some(mode)
    }

    /// Whether the armed message was taken by a handler (fired or not).
    pub(super) fn taken(&self) -> bool {
        lock(&self.target).is_none()
    }

    pub(super) fn fire(&self, mode: Mode) {
        *lock(&self.fired) = Some(mode);
    }

    /// On the worker, after the external step: holds until the run has
    /// expired the lease (at most [`WAIT`]).
    pub(super) fn hold_for_expiry(&self) {
        let mut hold = lock(&self.hold);
        *hold = Hold::Holding;
        self.held.notify_all();
        let deadline = Instant::now() + WAIT;
        while *hold == Hold::Holding {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            hold = self
                .held
                .wait_timeout(hold, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        *hold = Hold::Idle;
    }

    /// On the run: waits (at most `wait`) for a step held by
    /// [`hold_for_expiry`](Self::hold_for_expiry); whether one is.
    pub(super) fn await_hold(&self, wait: Duration) -> bool {
        let mut hold = lock(&self.hold);
        let deadline = Instant::now() + wait;
        while *hold != Hold::Holding {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            hold = self
                .held
                .wait_timeout(hold, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    /// On the run: lets a held step go on.
    pub(super) fn release_hold(&self) {
        let mut hold = lock(&self.hold);
        if *hold == Hold::Holding {
            *hold = Hold::Released;
        }
        self.held.notify_all();
    }

    /// Disarms; what fired.
    pub(super) fn disarm(&self) -> Option<Mode> {
        *lock(&self.target) = None;
        lock(&self.fired).take()
    }

    /// Runs `inner` (your handler's transactional part) under the fault
    /// `mode`: the crash after it, the rollback after it, the full disk
    /// during it and, if your code met no full-disk error, in a page-sized
    /// write after it.
    pub(super) fn around(
        &self,
        tx: &mut Tx<'_>,
        mode: Mode,
        inner: impl FnOnce(&mut Tx<'_>) -> Result<(), Failure>,
    ) -> Result<(), Failure> {
        let errors_before = tx.full_disk_errors_for_tests();
        let result = inner(tx);
        if mode == Mode::Kill {
            self.die();
        }
        if mode == Mode::DiskFull && tx.full_disk_errors_for_tests() > errors_before {
            // Your statement met the full disk, and SQLite undid that
            // statement (at times the whole transaction, which the engine
            // then fails): the transaction goes on. Room again for the
            // engine's writes and the commit, as a disk that filled for a
            // moment would have: a handler that swallowed the error commits
            // without its write, one that turned it into a rejection has
            // its message dead-lettered.
            tx.set_max_page_count_for_tests(NO_QUOTA)?;
            self.fire(mode);
            return result;
        }
        if result.is_err() && mode != Mode::Crash {
            // Your code met the fault (or failed by itself): either way it
            // answered first.
            self.fire(mode);
            return result;
        }
        match mode {
            Mode::Crash | Mode::Kill => {
                self.fire(mode);
                Err(Failure::retry(CRASH))
            }
            Mode::Rollback => {
                self.fire(mode);
                tx.execute(
                    "INSERT OR ROLLBACK INTO _testkit_rollback (id) VALUES (1)",
                    [],
                )?;
                Err(Failure::retry(
                    "postroom testkit: the rollback did not happen",
                ))
            }
            // Your code met no full disk (what it wrote fit in pages the
            // file had): a page-sized write after it surely meets it.
            Mode::DiskFull => {
                let page: i64 = tx.query_row("PRAGMA page_size", [], |r| r.get(0))?;
                match tx.execute(
                    "INSERT INTO _testkit_ballast (b) VALUES (zeroblob(?1))",
                    [page * 4],
                ) {
                    Err(e) => {
                        // Room again for the engine's record of the
                        // failure (a claim whose failure cannot be written
                        // would wait out its lease).
                        tx.set_max_page_count_for_tests(NO_QUOTA)?;
                        self.fire(mode);
                        Err(e.into())
                    }
                    // Room after all (freed pages): the fault did not fire.
                    Ok(_) => result,
                }
            }
            // Held in the effect step, never around a transaction.
            Mode::Lease => result,
        }
    }
}

/// Your handler, and around it (when armed for this message) the fault:
/// a crash or a rollback after it (its writes are rolled back as a dead
/// process's would be, whatever it did outside the transaction stays
/// done), or a full disk.
pub(super) struct Crashable<H> {
    pub(super) inner: H,
    pub(super) armed: Arc<Armed>,
}

impl<H: Handler> Handler for Crashable<H> {
    fn handle(&self, tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
        match self.armed.take(
            msg,
            &[Mode::Crash, Mode::Rollback, Mode::DiskFull, Mode::Kill],
        ) {
            None => self.inner.handle(tx, msg),
            Some(mode) => self.armed.around(tx, mode, |tx| self.inner.handle(tx, msg)),
        }
    }
}

/// Your effect handler: the crash after its external step, the rollback
/// and the full disk around its `apply`.
pub(super) struct CrashableEffect<H> {
    pub(super) inner: H,
    pub(super) armed: Arc<Armed>,
}

impl<H: EffectHandler> EffectHandler for CrashableEffect<H> {
    type Output = H::Output;

    fn effect(&self, ctx: &EffectContext<'_>, msg: &Message) -> Result<H::Output, Failure> {
        let lease = self.armed.take(msg, &[Mode::Lease]).is_some();
        let out = self.inner.effect(ctx, msg);
        if lease {
            // Whatever the step answered, its lease expires under it.
            self.armed.hold_for_expiry();
        }
        let out = out?;
        if let Some(Mode::Kill) = self.armed.take(msg, &[Mode::Kill]) {
            self.armed.die();
        }
        if self.armed.take(msg, &[Mode::Crash]).is_some() {
            self.armed.fire(Mode::Crash);
            return Err(Failure::retry(CRASH));
        }
        Ok(out)
    }

    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, output: H::Output) -> Result<(), Failure> {
        match self.armed.take(msg, &[Mode::Rollback, Mode::DiskFull]) {
            None => self.inner.apply(tx, msg, output),
            Some(mode) => self
                .armed
                .around(tx, mode, |tx| self.inner.apply(tx, msg, output)),
        }
    }
}

/// What the sink wrapper saw, across the process lives of a seed.
#[derive(Default)]
pub(super) struct SinkLog {
    /// A sink fault in progress: its kind and the sends it still answers.
    pub(super) failing: Option<(FaultKind, i64)>,
    /// Whether `failing` has answered (and been counted) yet.
    pub(super) answering: bool,
    pub(super) fired: BTreeMap<FaultKind, u64>,
    /// Every message handed to your sink, in order: (seq, id, key).
    pub(super) handed: Vec<(i64, String, Option<String>)>,
    /// Ids your sink answered `Sent`.
    pub(super) sent: BTreeSet<String>,
}

/// Your sink behind the sink faults; after a crash it answers
/// `Unavailable` (the process is gone) and is forgotten, not dropped.
pub(super) struct FaultySink {
    pub(super) inner: Option<Box<dyn Sink>>,
    pub(super) dead: Arc<AtomicBool>,
    pub(super) log: Arc<Mutex<SinkLog>>,
}

impl Sink for FaultySink {
    fn send(&mut self, batch: &[OutboxMessage]) -> Vec<SendResult> {
        let down = |why: &str| {
            batch
                .iter()
                .map(|_| SendResult::unavailable(why, Duration::from_millis(1)))
                .collect()
        };
        if self.dead.load(Ordering::SeqCst) {
            return down("postroom testkit: the process crashed");
        }
        {
            let mut log = lock(&self.log);
            if let Some((kind, left)) = log.failing.take() {
                if left > 0 {
                    if !log.answering {
                        // Counted once per fault, at its first answer.
                        log.answering = true;
                        *log.fired.entry(kind).or_insert(0) += 1;
                    }
                    log.failing = Some((kind, left - 1));
                    return batch
                        .iter()
                        .map(|_| match kind {
                            FaultKind::SinkUnavailable => SendResult::unavailable(
                                "postroom testkit: destination down",
                                Duration::from_millis(100),
                            ),
                            _ => SendResult::retry("postroom testkit: send failed"),
                        })
                        .collect();
                }
            }
        }
        let Some(inner) = self.inner.as_mut() else {
            return down("postroom testkit: no sink");
        };
        let results = inner.send(batch);
        let mut log = lock(&self.log);
        for (i, m) in batch.iter().enumerate() {
            log.handed.push((m.seq, m.id.clone(), m.key.clone()));
            if results.get(i) == Some(&SendResult::Sent) {
                log.sent.insert(m.id.clone());
            }
        }
        results
    }
}

impl Drop for FaultySink {
    fn drop(&mut self) {
        if self.dead.load(Ordering::SeqCst) {
            // A killed process runs no destructors: a sink that flushes
            // its buffer on drop must not be saved by it here.
            if let Some(inner) = self.inner.take() {
                std::mem::forget(inner);
            }
        }
    }
}
