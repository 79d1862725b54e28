//! One seed's run ([`Run`]): the engine opened on a fresh file, the
//! messages delivered by a broker stand-in under the seed's fault
//! schedule, crashes and reopens, then the verdict; and the helpers it
//! uses (scratch directories, the disk-full quota, bounded retries).
//!
//! Invariants: every wait is bounded (the module's 60 s); a delivery not
//! acknowledged is redelivered within a step budget, past which the run
//! fails as not settled; the checks read through one read-only connection.

use super::*;

/// A fresh directory per seed: under `POSTROOM_TESTKIT_DIR` if set, else
/// in `/dev/shm` where there is one (a memory filesystem: the in-process
/// crashes need no fsync, and the runs are twice as fast), else in the
/// system's temporary directory.
pub(super) fn scratch_dir() -> std::io::Result<tempfile::TempDir> {
    let base = std::env::var_os("POSTROOM_TESTKIT_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            let shm = Path::new("/dev/shm");
            shm.is_dir().then(|| shm.to_owned())
        });
    match base {
        Some(base) => tempfile::Builder::new()
            .prefix("postroom-testkit-")
            .tempdir_in(base)
            .or_else(|_| tempfile::tempdir()),
        None => tempfile::tempdir(),
    }
}

pub(super) fn is_full(e: &crate::Error) -> bool {
    matches!(e, crate::Error::StorageFull { .. })
}

/// Fills the disk: the free pages taken by ballast, then a page quota at
/// the file's size (the engine's test hook; user code cannot set it), so
/// that any write needing a new page fails with `SQLITE_FULL`.
pub(super) fn fill_disk(room: &Postroom) -> Result<(), Violation> {
    let pages = retry(|| {
        room.transaction(|tx| {
            let free: i64 = tx.query_row("PRAGMA freelist_count", [], |r| r.get(0))?;
            if free > 0 {
                let page: i64 = tx.query_row("PRAGMA page_size", [], |r| r.get(0))?;
                tx.execute(
                    "INSERT INTO _testkit_ballast (b) VALUES (zeroblob(?1))",
                    [free * page],
                )?;
            }
            Ok(tx.query_row("PRAGMA page_count", [], |r| r.get::<_, i64>(0))?)
        })
    })
    .map_err(engine("filling the disk"))?;
    let quota = u32::try_from(pages).unwrap_or(NO_QUOTA);
    retry(|| room.set_max_page_count_for_tests(quota))
        .map(drop)
        .map_err(engine("setting the page quota"))
}

/// Makes room again.
pub(super) fn lift_quota(room: &Postroom) -> Result<(), Violation> {
    retry(|| room.set_max_page_count_for_tests(NO_QUOTA))
        .map(drop)
        .map_err(engine("lifting the page quota"))
}

/// Calls `f` until it answers anything but a retryable error (a full
/// disk, a busy database), at most 100 times, 10 ms apart.
pub(super) fn retry<T>(mut f: impl FnMut() -> crate::Result<T>) -> crate::Result<T> {
    let mut tries = 0;
    loop {
        match f() {
            Err(e) if e.is_retryable() && tries < 100 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

pub(super) fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// What one seed's run leaves for the report.
#[derive(Clone)]
pub(super) struct Done {
    pub(super) fired: BTreeMap<FaultKind, u64>,
    pub(super) deliveries: u64,
    pub(super) outcome: Option<String>,
    /// What `detect_wall_clock`'s closure rendered.
    pub(super) times: Option<String>,
    /// (consumer, message id) of the dead letters.
    pub(super) dead: BTreeSet<(String, String)>,
    /// Messages processed again after retention removed their rows.
    pub(super) reprocessed: u64,
}

/// A seed's fault-free, in-order run, made once, when a verdict first
/// needs it.
#[derive(Default)]
pub(super) struct Reference(
    pub(super) Option<Result<Done, Violation>>,
    /// The same under a clock shifted by [`SHIFT_MS`] (wall-clock check).
    pub(super) Option<Result<Done, Violation>>,
);

impl Reference {
    pub(super) fn get(
        &mut self,
        run: impl FnOnce() -> Result<Done, Violation>,
    ) -> Result<Done, Violation> {
        self.0.get_or_insert_with(run).clone()
    }

    pub(super) fn shifted(
        &mut self,
        run: impl FnOnce() -> Result<Done, Violation>,
    ) -> Result<Done, Violation> {
        self.1.get_or_insert_with(run).clone()
    }
}

/// How far the wall-clock check shifts the engine's clock: 1,000 days, 13
/// hours and 7 seconds, so that no rendering in whole days, hours or
/// minutes hides it.
pub(super) const SHIFT_MS: i64 = ((1_000 * 24 + 13) * 3_600 + 7) * 1_000;

/// Which fault kinds the setup admits.
#[derive(Debug, Clone, Copy)]
pub(super) struct Applies {
    pub(super) sink: bool,
    pub(super) effectful: bool,
    pub(super) downstream: bool,
}

impl Applies {
    pub(super) fn admits(self, kind: FaultKind) -> bool {
        (self.sink || !kind.needs_sink())
            && (self.downstream || !kind.needs_downstream())
            && (self.effectful || !kind.needs_effectful())
    }
}

/// One delivery the broker stand-in has queued.
#[derive(Debug, Clone, Copy)]
pub(super) struct Item {
    pub(super) msg: usize,
    /// The id-reuse variant: same id, another payload.
    pub(super) reused: bool,
    /// The message's first delivery, where its faults are attached.
    pub(super) first: bool,
}

/// A retention pass for an acknowledged message, put off until the inbox
/// holds a newer row than the message's: retention never deletes the
/// newest row, so a pass run at once mostly deleted nothing.
pub(super) struct Retained {
    /// Its next delivery, made once the pass removed a row of it.
    again: Item,
    source: String,
    id: String,
    /// The message's inbox rows (one per consumer that stored it) when it
    /// was acknowledged.
    rows: u64,
    /// The newest inbox row then.
    newest: i64,
}

/// One seed's run.
pub(super) struct Run<'s> {
    pub(super) sc: &'s Scenario,
    pub(super) db: PathBuf,
    pub(super) dir: PathBuf,
    pub(super) world: World,
    pub(super) armed: Arc<Armed>,
    pub(super) log: Arc<Mutex<SinkLog>>,
    /// The current process life's sink: set to crash it.
    pub(super) sink_dead: Option<Arc<AtomicBool>>,
    pub(super) clock: ManualClock,
    pub(super) fired: BTreeMap<FaultKind, u64>,
    /// (name, queued), in registration order.
    pub(super) consumers: Vec<(String, bool)>,
    pub(super) has_sink: bool,
    /// The effectful consumers' names.
    pub(super) effectful: BTreeSet<String>,
    pub(super) deliveries: u64,
    /// A lease-expiry fault for the delivery in hand: expire the lease
    /// under the effect step it holds.
    pub(super) lease: bool,
    /// A disk-full fault for the delivery in hand: set the quota first;
    /// cleared once it met a storage error.
    pub(super) disk_full: bool,
    /// A delivery met the full disk (a storage error).
    pub(super) full_met: bool,
    /// (message index, consumer) pairs the engine has answered for.
    pub(super) answered: BTreeSet<(usize, String)>,
    /// Per (source, id): deliveries processed again after a retention
    /// pass removed the message's row.
    pub(super) reprocessed: BTreeMap<(String, String), u64>,
    /// Retention passes put off (see [`Run::retention_due`]).
    pub(super) retained: Vec<Retained>,
    /// After a real kill: the outbox rows the dead child had sent (they
    /// count as handed to the sink; its downstream died with it).
    pub(super) killed: Option<BTreeSet<String>>,
    /// The read-only connection of the checks, kept (see `reader`).
    pub(super) conn: RefCell<Option<Connection>>,
}

pub(super) fn engine(what: &str) -> impl Fn(crate::Error) -> Violation + '_ {
    move |e| Violation::Engine {
        message: format!("{what}: {e}"),
    }
}

impl<'s> Run<'s> {
    pub(super) fn new(sc: &'s Scenario, dir: &Path, seed: u64) -> Run<'s> {
        Run {
            sc,
            db: dir.join("app.db"),
            dir: dir.to_owned(),
            world: World::default(),
            armed: Arc::default(),
            log: Arc::default(),
            sink_dead: None,
            clock: ManualClock::new(1_700_000_000_000 + (seed % 1000) as i64 * 1000),
            fired: BTreeMap::new(),
            consumers: Vec::new(),
            has_sink: false,
            effectful: BTreeSet::new(),
            deliveries: 0,
            lease: false,
            disk_full: false,
            full_met: false,
            answered: BTreeSet::new(),
            reprocessed: BTreeMap::new(),
            retained: Vec::new(),
            killed: None,
            conn: RefCell::new(None),
        }
    }

    pub(super) fn fire(&mut self, kind: FaultKind) {
        *self.fired.entry(kind).or_insert(0) += 1;
    }

    pub(super) fn open(&mut self) -> Result<Postroom, Violation> {
        let mut app = App {
            dir: &self.dir,
            world: &self.world,
            consumers: Vec::new(),
            effectful: BTreeSet::new(),
            sink: None,
        };
        (self.sc.setup)(&mut app);
        let App {
            consumers,
            sink,
            effectful,
            ..
        } = app;
        self.effectful = effectful;
        let queued = consumers.iter().any(|c| c.1);
        let mut b = Postroom::builder()
            .handle_signals(false)
            .durability(Durability::Normal)
            .clock(self.clock.clone())
            .backoff(Duration::ZERO, Duration::ZERO)
            .max_attempts(25)
            .workers(usize::from(queued))
            .poll_interval(Duration::from_millis(2))
            .relay_poll(Duration::from_millis(2))
            .lease(LEASE)
            .retention(RETENTION)
            .dead_retention(None)
            .quick_check_on_open(false)
            .drop_deadline(Duration::from_secs(10));
        self.consumers = consumers.iter().map(|c| (c.0.clone(), c.1)).collect();
        for (_, _, register) in consumers {
            b = register(b, &self.armed);
        }
        if let Some(sink) = sink {
            let dead = Arc::new(AtomicBool::new(false));
            self.sink_dead = Some(dead.clone());
            self.has_sink = true;
            b = b.sink(FaultySink {
                inner: Some(sink),
                dead,
                log: self.log.clone(),
            });
        }
        if let Some(configure) = &self.sc.configure {
            b = configure(b);
        }
        b.open(&self.db).map_err(engine("open"))
    }

    /// The process dies: the sink is forgotten, the engine dropped (its
    /// threads stop; what they had committed stays, nothing else), and a
    /// new process life opens with the real recovery.
    pub(super) fn crash(&mut self, room: Postroom) -> Result<Postroom, Violation> {
        if let Some(dead) = self.sink_dead.take() {
            dead.store(true, Ordering::SeqCst);
        }
        drop(room);
        self.open()
    }

    /// The testkit's tables and yours, in one transaction.
    pub(super) fn schema(&self, room: &Postroom) -> Result<(), Violation> {
        let schema = self.sc.schema.clone();
        room.transaction(move |tx| {
            tx.execute_batch(TESTKIT_SCHEMA)?;
            match &schema {
                Some(schema) => schema(tx),
                None => Ok(()),
            }
        })
        .map_err(engine("schema"))
    }

    /// Runs the messages through the broker stand-in under `schedule`,
    /// then settles, drains and judges.
    pub(super) fn execute(
        &mut self,
        msgs: &[Message],
        schedule: &[Fault],
    ) -> Result<Done, Violation> {
        let mut room = self.open()?;
        self.schema(&room)?;
        let mut queue = self.first_deliveries(msgs.len(), schedule);
        let budget = msgs.len() * 60 + 100;
        let mut steps = 0;
        while let Some(item) = queue.pop_front() {
            steps += 1;
            let msg = if item.reused {
                reused(&msgs[item.msg])
            } else {
                msgs[item.msg].clone()
            };
            if steps > budget {
                return Err(Violation::NotSettled {
                    message_id: msg.id().to_owned(),
                    consumer: "(every consumer)".into(),
                    status: Some("still not acknowledged after many redeliveries".into()),
                });
            }
            let faults: Vec<Fault> = if item.first {
                schedule
                    .iter()
                    .filter(|f| f.step == item.msg)
                    .copied()
                    .collect()
            } else {
                Vec::new()
            };
            self.arm(&faults, &msg);
            let again = Item {
                first: false,
                ..item
            };
            let acked = self.deliver(&room, item.msg, &msg)?;
            let fired = self.disarm();
            if fired == Some(Mode::Crash) {
                self.fire(FaultKind::CrashBeforeCommit);
                room = self.crash(room)?;
                queue.push_front(again);
            } else if !acked {
                queue.push_back(again);
            } else {
                room = self.after_ack(room, &faults, again, &msg, &mut queue)?;
            }
            let after = format!("message #{} ({:?})", item.msg, msg.id());
            self.check_invariants(&after)?;
        }
        self.finish(room, msgs)
    }

    /// The broker stand-in's first queue: every message once, in order but
    /// for the schedule's reorder faults.
    pub(super) fn first_deliveries(
        &mut self,
        messages: usize,
        schedule: &[Fault],
    ) -> VecDeque<Item> {
        let mut order: Vec<usize> = (0..messages).collect();
        for f in schedule.iter().filter(|f| f.kind == FaultKind::Reorder) {
            if let Some(pos) = order.iter().position(|&m| m == f.step) {
                let m = order.remove(pos);
                let to = (pos + f.arg.max(0) as usize).min(order.len());
                order.insert(to, m);
                if to != pos {
                    self.fire(FaultKind::Reorder);
                }
            }
        }
        order
            .into_iter()
            .map(|msg| Item {
                msg,
                reused: false,
                first: true,
            })
            .collect()
    }

    /// Sets up the faults that act before or during `msg`'s delivery: the
    /// clock, the sink, the handler wrappers.
    pub(super) fn arm(&mut self, faults: &[Fault], msg: &Message) {
        for f in faults {
            match f.kind {
                FaultKind::ClockJump => {
                    let now = crate::Clock::now_ms(&self.clock);
                    self.clock.set(now.saturating_add(f.arg));
                    self.fire(FaultKind::ClockJump);
                }
                FaultKind::SinkFails | FaultKind::SinkUnavailable => {
                    let mut log = lock(&self.log);
                    log.failing = Some((f.kind, f.arg));
                    log.answering = false;
                }
                FaultKind::SinkTimeout => self.world.downstream.time_out(f.arg),
                FaultKind::CrashBeforeCommit => self.armed.arm(msg, Mode::Crash),
                FaultKind::SqlRollback => self.armed.arm(msg, Mode::Rollback),
                FaultKind::LeaseExpiry => {
                    self.armed.arm(msg, Mode::Lease);
                    self.lease = true;
                }
                FaultKind::DiskFull => {
                    self.armed.arm(msg, Mode::DiskFull);
                    self.disk_full = true;
                }
                _ => {}
            }
        }
    }

    /// After a delivery: disarms the handler wrappers and counts the
    /// rollback and disk-full faults that fired; which fault fired in a
    /// handler, if any.
    pub(super) fn disarm(&mut self) -> Option<Mode> {
        let fired = self.armed.disarm();
        self.disk_full = false;
        self.lease = false;
        let full_met = std::mem::take(&mut self.full_met);
        match fired {
            Some(Mode::Rollback) => self.fire(FaultKind::SqlRollback),
            Some(Mode::DiskFull) => self.fire(FaultKind::DiskFull),
            // The engine's own write met the full disk before a handler.
            _ if full_met => self.fire(FaultKind::DiskFull),
            _ => {}
        }
        fired
    }

    /// The faults that act once a delivery was acknowledged: crashes,
    /// lost acknowledgements, redeliveries, a reused id, a retention pass.
    /// Returns the engine (another one after a crash).
    pub(super) fn after_ack(
        &mut self,
        mut room: Postroom,
        faults: &[Fault],
        again: Item,
        msg: &Message,
        queue: &mut VecDeque<Item>,
    ) -> Result<Postroom, Violation> {
        self.retention_due(&room, queue)?;
        for f in faults {
            match f.kind {
                FaultKind::CrashAfterCommit => {
                    room = self.crash(room)?;
                    queue.push_front(again);
                }
                FaultKind::LostAck => queue.push_front(again),
                FaultKind::Redeliver => queue.push_back(again),
                FaultKind::ReusedId => queue.push_front(Item {
                    reused: true,
                    ..again
                }),
                FaultKind::CrashInRelay => {
                    self.drain()?;
                    room = self.crash(room)?;
                }
                FaultKind::RetentionPass => {
                    // Counted as fired by retention_due, once it removed a
                    // row of the message.
                    self.settle(&room)?;
                    let (source, id) = (msg.source().to_owned(), msg.id().to_owned());
                    let rows = self.inbox_rows(&source, &id)?;
                    let newest = self.newest_inbox_row()?;
                    self.retained.push(Retained {
                        again,
                        source,
                        id,
                        rows,
                        newest,
                    });
                    continue;
                }
                _ => continue,
            }
            self.fire(f.kind);
        }
        Ok(room)
    }

    /// A message's inbox rows, one per consumer that stored it.
    fn inbox_rows(&self, source: &str, id: &str) -> Result<u64, Violation> {
        self.count(
            "SELECT count(*) FROM postroom_inbox WHERE source = ?1 AND message_id = ?2",
            [source, id],
        )
    }

    /// The newest inbox row's id (0 for none).
    fn newest_inbox_row(&self) -> Result<i64, Violation> {
        Ok(self.count("SELECT coalesce(max(id), 0) FROM postroom_inbox", [])? as i64)
    }

    /// The retention passes put off, once the inbox holds a row newer than
    /// their message's: the clock passes the retention period, a pass
    /// runs, and each message that lost an inbox row to it comes again
    /// (counted as fired). One whose rows all stayed (not completed: a
    /// dead letter, a conflict) fired nothing and does not come again.
    fn retention_due(
        &mut self,
        room: &Postroom,
        queue: &mut VecDeque<Item>,
    ) -> Result<(), Violation> {
        if self.retained.is_empty() {
            return Ok(());
        }
        let newest = self.newest_inbox_row()?;
        if !self.retained.iter().any(|r| newest > r.newest) {
            return Ok(());
        }
        self.settle(room)?;
        self.clock
            .advance(RETENTION.saturating_add(Duration::from_secs(60)));
        retry(|| room.cleanup()).map_err(engine("cleanup"))?;
        let (due, later): (Vec<Retained>, Vec<Retained>) = std::mem::take(&mut self.retained)
            .into_iter()
            .partition(|r| newest > r.newest);
        self.retained = later;
        for r in due {
            let rows = self.inbox_rows(&r.source, &r.id)?;
            if rows < r.rows {
                self.fire(FaultKind::RetentionPass);
                queue.push_back(r.again);
            }
        }
        Ok(())
    }

    /// The end of a seed: settles and drains, counts the sink's faults,
    /// shuts the engine down, and judges.
    pub(super) fn finish(&mut self, room: Postroom, msgs: &[Message]) -> Result<Done, Violation> {
        self.settle(&room)?;
        self.drain()?;
        let fired_sink = std::mem::take(&mut lock(&self.log).fired);
        for (k, n) in fired_sink {
            *self.fired.entry(k).or_insert(0) += n;
        }
        let timeouts = self.world.downstream.take_fired();
        if timeouts > 0 {
            *self.fired.entry(FaultKind::SinkTimeout).or_insert(0) += timeouts;
        }
        room.shutdown(Duration::from_secs(30))
            .map_err(engine("shutdown"))?;
        drop(room);
        self.verdict(msgs)
    }

    /// Hands `msg` (the `index`-th generated) to every consumer; whether
    /// every one acknowledged. A retryable error is no acknowledgement:
    /// the broker redelivers. Under a disk-full fault the quota holds
    /// until a consumer met it (or the last one answered).
    pub(super) fn deliver(
        &mut self,
        room: &Postroom,
        index: usize,
        msg: &Message,
    ) -> Result<bool, Violation> {
        let mut acked = true;
        let consumers = self.consumers.clone();
        let last = consumers.len().saturating_sub(1);
        if self.disk_full {
            fill_disk(room)?;
        }
        for (i, (name, queued)) in consumers.into_iter().enumerate() {
            self.deliveries += 1;
            let gone = self.gone(index, &name, msg)?;
            let fresh = if queued {
                let answer = room.receive(&name, msg.clone());
                if self.disk_full {
                    // Until the worker met the fault (or the receive did).
                    let deadline = Instant::now() + WAIT;
                    while matches!(answer, Ok(crate::Receipt::Accepted))
                        && !self.armed.taken()
                        && Instant::now() < deadline
                    {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                if self.lease
                    && self.effectful.contains(&name)
                    && matches!(answer, Ok(crate::Receipt::Accepted))
                {
                    self.lease = false;
                    self.expire_lease(room)?;
                }
                match answer {
                    Ok(receipt) => Some(matches!(receipt, crate::Receipt::Accepted)),
                    Err(e) if e.is_retryable() => {
                        self.full_met |= self.disk_full && is_full(&e);
                        acked = false;
                        None
                    }
                    Err(e) => return Err(engine("receive")(e)),
                }
            } else {
                match room.deliver(&name, msg.clone()) {
                    Ok(outcome) => {
                        if let crate::Outcome::Failed { retry_after, .. } = &outcome {
                            // The broker redelivers when the engine asked:
                            // time passes (a clock jumped back made it long).
                            self.clock.advance(*retry_after);
                        }
                        acked &= outcome.should_ack();
                        Some(!matches!(
                            outcome,
                            crate::Outcome::Duplicate
                                | crate::Outcome::DuplicateBySequence { .. }
                                | crate::Outcome::Conflict { .. }
                        ))
                    }
                    Err(e) if e.is_retryable() => {
                        self.full_met |= self.disk_full && is_full(&e);
                        acked = false;
                        None
                    }
                    Err(e) => return Err(engine("deliver")(e)),
                }
            };
            if self.disk_full && (fresh.is_none() || self.armed.taken() || i == last) {
                lift_quota(room)?;
                self.disk_full = false;
            }
            if let Some(fresh) = fresh {
                if gone && fresh {
                    *self
                        .reprocessed
                        .entry((msg.source().to_owned(), msg.id().to_owned()))
                        .or_insert(0) += 1;
                }
                self.answered.insert((index, name.clone()));
            }
            if queued {
                self.settle(room)?;
            }
        }
        Ok(acked)
    }

    /// A lease-expiry fault: once the worker holds after the effect step
    /// (at most [`WAIT`]), the leases expire and a reaper pass makes the
    /// row due again; then the step goes on, into the lease fence.
    pub(super) fn expire_lease(&mut self, room: &Postroom) -> Result<(), Violation> {
        if !self.armed.await_hold(WAIT) {
            // The step never ran (the message was not claimed in time):
            // nothing fired; a step arriving late must not hold.
            self.armed.disarm();
            self.armed.release_hold();
            return Ok(());
        }
        let expired = retry(|| room.expire_leases_for_tests());
        self.armed.release_hold();
        if expired.map_err(engine("expiring the lease"))? > 0 {
            self.fire(FaultKind::LeaseExpiry);
        }
        Ok(())
    }

    /// Whether the engine answered for this message and consumer before
    /// and has no row for it now: a retention pass removed it.
    pub(super) fn gone(
        &self,
        index: usize,
        consumer: &str,
        msg: &Message,
    ) -> Result<bool, Violation> {
        if !self.answered.contains(&(index, consumer.to_owned())) {
            return Ok(false);
        }
        let conn = self.reader()?;
        let n: i64 = conn
            .query_row(
                "SELECT count(*) FROM postroom_inbox
                 WHERE consumer = ?1 AND source = ?2 AND message_id = ?3",
                [consumer, msg.source(), msg.id()],
                |r| r.get(0),
            )
            .map_err(|e| Violation::Engine {
                message: format!("reading the inbox: {e}"),
            })?;
        Ok(n == 0)
    }

    /// Waits until no queued message is pending, processing or waiting for
    /// a retry, moving the clock so retries come due.
    pub(super) fn settle(&self, room: &Postroom) -> Result<(), Violation> {
        if !self.consumers.iter().any(|c| c.1) {
            return Ok(());
        }
        let deadline = Instant::now() + WAIT;
        loop {
            let mut busy = 0;
            for (name, _) in self.consumers.iter().filter(|c| c.1) {
                busy += self.count(
                    "SELECT count(*) FROM postroom_inbox WHERE consumer = ?1
                     AND status IN ('pending', 'processing', 'failed')",
                    [name],
                )?;
            }
            if busy == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Violation::Engine {
                    message: format!("{busy} queued messages did not settle in {WAIT:?}"),
                });
            }
            // A claim whose worker gave up (its `apply` met a full disk) is
            // due again once the reaper saw its lease expire: expired now,
            // not a wall-clock lease later (no step runs under it).
            match room.expire_given_up_leases_for_tests() {
                Ok(_) => {}
                Err(e) if e.is_retryable() => {}
                Err(e) => return Err(engine("expiring a given-up lease")(e)),
            }
            self.clock.advance(TICK);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A count through the run's reader: the waits poll it, and
    /// `Postroom::stats` would open a pool connection (another parse of the
    /// whole schema per process life) and count every status.
    pub(super) fn count<P: rusqlite::Params>(
        &self,
        sql: &str,
        params: P,
    ) -> Result<u64, Violation> {
        let conn = self.reader()?;
        conn.prepare_cached(sql)
            .and_then(|mut stmt| stmt.query_row(params, |r| r.get::<_, i64>(0)))
            .map(|n| n.max(0) as u64)
            .map_err(|e| Violation::Engine {
                message: format!("counting ({sql}): {e}"),
            })
    }

    /// Waits until the relay has no pending outbox row.
    pub(super) fn drain(&self) -> Result<(), Violation> {
        if !self.has_sink {
            return Ok(());
        }
        let deadline = Instant::now() + WAIT;
        loop {
            let pending = self.count(
                "SELECT count(*) FROM postroom_outbox WHERE status = 'pending'",
                [],
            )?;
            if pending == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Violation::Engine {
                    message: format!("{pending} outbox rows still pending after {WAIT:?}"),
                });
            }
            self.clock.advance(TICK);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The run's read-only connection, opened at first use and kept: a
    /// connection parses the whole schema (the engine's triggers
    /// included) at its first statement, which per check was a fifth of
    /// a seed's CPU. It holds no transaction between statements, so it
    /// neither pins the WAL nor sees a stale snapshot.
    pub(super) fn reader(&self) -> Result<Ref<'_, Connection>, Violation> {
        if self.conn.borrow().is_none() {
            let conn = Connection::open_with_flags(
                &self.db,
                OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
            )
            .map_err(|e| Violation::Engine {
                message: format!("open a reader: {e}"),
            })?;
            *self.conn.borrow_mut() = Some(conn);
        }
        Ref::filter_map(self.conn.borrow(), Option::as_ref).map_err(|_| Violation::Engine {
            message: "open a reader: no connection".into(),
        })
    }

    pub(super) fn check_invariants(&self, after: &str) -> Result<(), Violation> {
        if self.sc.invariants.is_empty() {
            return Ok(());
        }
        let conn = self.reader()?;
        let check = Check {
            conn: &conn,
            world: &self.world,
            dir: &self.dir,
            now_ms: crate::Clock::now_ms(&self.clock),
        };
        for invariant in &self.sc.invariants {
            invariant(&check).map_err(|message| Violation::Invariant {
                after: after.to_owned(),
                message,
            })?;
        }
        Ok(())
    }

    pub(super) fn verdict(&self, msgs: &[Message]) -> Result<Done, Violation> {
        let conn = self.reader()?;
        let check = Check {
            conn: &conn,
            world: &self.world,
            dir: &self.dir,
            now_ms: crate::Clock::now_ms(&self.clock),
        };
        let sql_err = |e: rusqlite::Error| Violation::Engine {
            message: format!("reading the inbox: {e}"),
        };
        let mut seen: BTreeSet<(&str, &str)> = BTreeSet::new();
        let mut dead = BTreeSet::new();
        for (index, msg) in msgs.iter().enumerate() {
            // A generated repeat of an id is the same message again (or a
            // conflict): judged once, by its first payload.
            if !seen.insert((msg.source(), msg.id())) {
                continue;
            }
            let mut expected = 0;
            // Processed again after retention removed its row: those
            // effects may come again (the known limit), not must.
            let again = self
                .reprocessed
                .get(&(msg.source().to_owned(), msg.id().to_owned()))
                .copied()
                .unwrap_or(0);
            for (consumer, _) in &self.consumers {
                let status: Option<String> = conn
                    .query_row(
                        "SELECT status FROM postroom_inbox
                         WHERE consumer = ?1 AND source = ?2 AND message_id = ?3",
                        [consumer.as_str(), msg.source(), msg.id()],
                        |r| r.get(0),
                    )
                    .optional()
                    .map_err(sql_err)?;
                // No row, but answered before: a retention pass removed
                // it, and retention only removes completed rows.
                let cleaned =
                    status.is_none() && self.answered.contains(&(index, consumer.clone()));
                match status.as_deref() {
                    Some("completed") => expected += 1,
                    None if cleaned => expected += 1,
                    Some("dead") => {
                        dead.insert((consumer.clone(), msg.id().to_owned()));
                    }
                    _ => {
                        return Err(Violation::NotSettled {
                            message_id: msg.id().to_owned(),
                            consumer: consumer.clone(),
                            status,
                        })
                    }
                }
            }
            if let Some(effects) = &self.sc.effects {
                let counted = effects(&check, msg);
                if counted < expected || counted > expected + again {
                    return Err(Violation::EffectsNotOnce {
                        message_id: msg.id().to_owned(),
                        expected,
                        counted,
                    });
                }
            }
        }
        self.check_invariants("the end")?;
        if self.has_sink {
            self.check_relay(&conn)?;
        }
        Ok(Done {
            fired: self.fired.clone(),
            deliveries: self.deliveries,
            outcome: self.sc.outcome.as_ref().map(|o| o(&check)),
            times: self.sc.wall_clock.as_ref().map(|t| t(&check)),
            dead,
            reprocessed: self.reprocessed.values().sum(),
        })
    }

    pub(super) fn check_relay(&self, conn: &Connection) -> Result<(), Violation> {
        let log = lock(&self.log);
        let mut handed: BTreeSet<&str> = log.handed.iter().map(|h| h.1.as_str()).collect();
        if let Some(sent) = &self.killed {
            handed.extend(sent.iter().map(String::as_str));
        }
        let mut stmt = conn
            .prepare("SELECT message_id FROM postroom_outbox ORDER BY seq")
            .map_err(|e| Violation::Engine {
                message: format!("reading the outbox: {e}"),
            })?;
        let ids: Vec<String> = stmt
            .query_map([], |r| r.get(0))
            .and_then(|rows| rows.collect())
            .map_err(|e| Violation::Engine {
                message: format!("reading the outbox: {e}"),
            })?;
        for id in &ids {
            if !handed.contains(id.as_str()) {
                return Err(Violation::NeverHandedToSink {
                    message_id: id.clone(),
                });
            }
        }
        // Per key, the first handing of each row in commit (seq) order.
        let mut last: HashMap<&str, i64> = HashMap::new();
        let mut first_seen: BTreeSet<i64> = BTreeSet::new();
        for (seq, _, key) in &log.handed {
            if !first_seen.insert(*seq) {
                continue;
            }
            if let Some(key) = key {
                if last.get(key.as_str()).is_some_and(|&prev| prev > *seq) {
                    return Err(Violation::OutOfOrder {
                        at: "sink",
                        key: key.clone(),
                    });
                }
                last.insert(key, *seq);
            }
        }
        if self.world.downstream_used.load(Ordering::Relaxed) && self.killed.is_none() {
            let received = self.world.downstream.received();
            let got: BTreeSet<&str> = received.iter().map(|r| r.id.as_str()).collect();
            for id in &log.sent {
                if !got.contains(id.as_str()) {
                    return Err(Violation::LostDownstream {
                        message_id: id.clone(),
                    });
                }
            }
            let seq_of: HashMap<&str, i64> =
                log.handed.iter().map(|h| (h.1.as_str(), h.0)).collect();
            let mut last: HashMap<&str, i64> = HashMap::new();
            let mut first: BTreeSet<&str> = BTreeSet::new();
            for r in &received {
                if !first.insert(r.id.as_str()) {
                    continue;
                }
                let (Some(key), Some(&seq)) = (r.key.as_deref(), seq_of.get(r.id.as_str())) else {
                    continue;
                };
                if last.get(key).is_some_and(|&prev| prev > seq) {
                    return Err(Violation::OutOfOrder {
                        at: "downstream",
                        key: key.to_owned(),
                    });
                }
                last.insert(key, seq);
            }
        }
        Ok(())
    }
}

/// The id-reuse variant of `msg`: same source and id, the payload with a
/// space appended (still the same JSON, another digest).
pub(super) fn reused(msg: &Message) -> Message {
    let mut payload = msg.payload().to_vec();
    payload.push(b' ');
    let mut out = Message::new(msg.source(), msg.id(), payload);
    for (name, value) in msg.headers() {
        out = out.with_header(name.clone(), value.clone());
    }
    out
}
