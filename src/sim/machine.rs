//! The machine: the engine's state machine on a real SQLite file without
//! threads ([`Machine`]), driving the same functions the writer, the
//! workers, the relay and recovery run, each step in its own transaction,
//! on a manual clock; and the simulated handler and markers it runs with.
//!
//! Invariants: a simulated crash drops the connection without committing
//! and keeps the in-flight marker, then re-opens through the real recovery
//! code; the clock moves only by an operation.

use super::*;

pub(super) struct SimHandler {
    pub(super) plan: Arc<Mutex<Plan>>,
    /// Plans for the coming handler runs, one each, taken before `plan`.
    pub(super) plans: Arc<Mutex<std::collections::VecDeque<Plan>>>,
    pub(super) crashing: Arc<AtomicBool>,
}

impl Handler for SimHandler {
    fn handle(&self, tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
        if let Some(next) = self
            .plans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front()
        {
            *self.plan.lock().unwrap_or_else(|p| p.into_inner()) = next;
        }
        tx.execute(
            "INSERT INTO sim_effects (consumer, message_id) VALUES (?1, ?2)",
            [tx.consumer().unwrap_or(""), msg.id()],
        )?;
        tx.publish(Outgoing::new("sim", msg.payload().to_vec()).with_key(msg.id()))?;
        match *self.plan.lock().unwrap_or_else(|p| p.into_inner()) {
            Plan::Ok => Ok(()),
            Plan::Retry => Err(Failure::retry_after(
                "sim retry",
                Duration::from_millis(RETRY_AFTER_MS as u64),
            )),
            Plan::Reject => Err(Failure::reject("sim reject")),
            Plan::Panic => panic!("sim panic"),
            Plan::RollBack => {
                tx.execute("INSERT OR ROLLBACK INTO sim_strict VALUES (NULL)", [])?;
                Ok(())
            }
            Plan::Crash => {
                self.crashing.store(true, Ordering::SeqCst);
                Err(Failure::retry("sim crash"))
            }
        }
    }
}

/// The in-flight marker of a simulated process: kept across a simulated
/// crash (as the engine file is), not cleared by a handler that "died".
pub(super) struct SimLog<'a> {
    pub(super) marker: &'a mut Option<Inflight>,
    pub(super) crashing: &'a AtomicBool,
}

impl InflightLog for SimLog<'_> {
    fn begin(
        &mut self,
        consumer: &str,
        msg: &Message,
        hash: &[u8; 32],
        prior_attempts: u32,
        at_ms: i64,
    ) -> std::io::Result<()> {
        // The process is dead: nothing after its last handler runs.
        if self.crashing.load(Ordering::SeqCst) {
            return Ok(());
        }
        *self.marker = Some(Inflight {
            consumer: consumer.to_owned(),
            msg: msg.clone(),
            hash: *hash,
            prior_attempts,
            at_ms,
        });
        Ok(())
    }
    fn end(&mut self) -> std::io::Result<()> {
        if !self.crashing.load(Ordering::SeqCst) {
            *self.marker = None;
        }
        Ok(())
    }
}

/// The claim marks of a simulated process: the claim whose user code runs,
/// kept across a simulated crash like the engine file's slots.
pub(super) struct SimClaims<'a> {
    pub(super) started: &'a mut Option<StartedClaim>,
    pub(super) crashing: &'a AtomicBool,
}

impl ClaimMarks for SimClaims<'_> {
    fn started(&mut self, row_id: i64, token: i64) -> std::io::Result<()> {
        *self.started = Some(StartedClaim { row_id, token });
        Ok(())
    }
    fn finished(&mut self) -> std::io::Result<()> {
        if !self.crashing.load(Ordering::SeqCst) {
            *self.started = None;
        }
        Ok(())
    }
}

/// The engine's state machine on a real file, without threads.
pub struct Machine {
    pub(super) path: PathBuf,
    pub(super) conn: Option<(Connection, UserCodeGuard)>,
    pub(super) config: Config,
    pub(super) handler: SimHandler,
    pub(super) plan: Arc<Mutex<Plan>>,
    pub(super) crashing: Arc<AtomicBool>,
    pub(super) marker: Option<Inflight>,
    pub(super) started_claim: Option<StartedClaim>,
    /// What [`Op::ReadRetired`] read, until [`Op::ApplyRetired`]; kept
    /// across a crash, as another process's stale read would be.
    pub(super) read_retired: Option<retired::Retired>,
    pub(super) now_ms: i64,
    pub(super) next_token: i64,
}

impl Machine {
    /// Creates (or re-opens) the database at `path`.
    pub fn open(path: &Path) -> SimResult<Machine> {
        let config = Config {
            // Power loss is not simulated; fsyncs would only slow the run.
            durability: crate::Durability::Normal,
            max_attempts: MAX_ATTEMPTS,
            retry: RetryPolicy {
                initial: Duration::from_millis(200),
                max: Duration::from_millis(1_000),
            },
            ..Config::default()
        };
        let plan = Arc::new(Mutex::new(Plan::Ok));
        let crashing = Arc::new(AtomicBool::new(false));
        let mut machine = Machine {
            path: path.to_path_buf(),
            conn: None,
            config,
            handler: SimHandler {
                plan: Arc::clone(&plan),
                plans: Arc::default(),
                crashing: Arc::clone(&crashing),
            },
            plan,
            crashing,
            marker: None,
            started_claim: None,
            read_retired: None,
            now_ms: START_MS,
            next_token: 1,
        };
        schema::create_private(path).map_err(err)?;
        machine.reopen()?;
        Ok(machine)
    }

    /// Opens the connection and runs crash recovery, as the engine does.
    pub(super) fn reopen(&mut self) -> SimResult<()> {
        let mut conn = schema::open_writer(&self.path, &self.config).map_err(err)?;
        schema::migrate(&mut conn).map_err(err)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS sim_effects (consumer TEXT NOT NULL, message_id TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS sim_strict (x INTEGER NOT NULL);",
        )
        .map_err(err)?;
        let started: Vec<StartedClaim> = self.started_claim.into_iter().collect();
        recover_after_crash(
            &conn,
            &self.config,
            self.now_ms,
            self.marker.as_ref(),
            &started,
        )
        .map_err(err)?;
        self.marker = None;
        self.started_claim = None;
        let guard = UserCodeGuard::install(&mut conn).map_err(err)?;
        self.conn = Some((conn, guard));
        Ok(())
    }

    /// Drops the connection without committing: what a dead process leaves.
    pub(super) fn crash(&mut self) -> SimResult<()> {
        self.conn = None;
        self.crashing.store(false, Ordering::SeqCst);
        self.reopen()
    }

    pub(super) fn conn(&self) -> &Connection {
        &self.conn.as_ref().expect("open").0
    }

    /// Runs `step` in a transaction; commits on `Ok`, rolls back on `Err`.
    /// If the handler "died" in it, crashes instead and returns `None`.
    pub(super) fn in_tx<T>(
        &mut self,
        step: impl FnOnce(&mut Machine) -> crate::Result<T>,
    ) -> SimResult<Option<T>> {
        exec(self.conn(), "BEGIN IMMEDIATE").map_err(err)?;
        let result = step(self);
        if self.crashing.load(Ordering::SeqCst) {
            self.crash()?;
            return Ok(None);
        }
        match result {
            Ok(value) => {
                exec(self.conn(), "COMMIT").map_err(err)?;
                Ok(Some(value))
            }
            Err(e) => {
                let _ = self.conn().execute_batch("ROLLBACK");
                Err(err(e))
            }
        }
    }

    /// Inline delivery. `None`: the process died in the handler.
    pub fn deliver(
        &mut self,
        consumer: &str,
        id: u8,
        variant: u8,
        plan: Plan,
    ) -> SimResult<Option<Outcome>> {
        *self.plan.lock().unwrap_or_else(|p| p.into_inner()) = plan;
        let msg = sim_message(id, variant);
        let hash = hash_of(&msg.payload);
        // As the writer does: a handler that rolled the transaction back
        // has its delivery run again, recording that attempt as failed.
        let mut rolled_back = false;
        loop {
            let step_rolled_back = rolled_back;
            let result = self.in_tx(|m| {
                let (conn, guard) = m.conn.as_ref().expect("open");
                let mut log = SimLog {
                    marker: &mut m.marker,
                    crashing: &m.crashing,
                };
                let mut env = Env {
                    conn,
                    config: &m.config,
                    now_ms: m.now_ms,
                    log: &mut log,
                    guard,
                };
                let step = if step_rolled_back {
                    delivery::Step::RolledBack
                } else {
                    delivery::Step::Run(&m.handler)
                };
                let outcome = delivery::deliver(&mut env, consumer, step, &msg, &hash);
                if matches!(outcome, Err(crate::Error::RolledBack { .. })) && conn.is_autocommit() {
                    rolled_back = true;
                }
                outcome
            });
            if rolled_back && !step_rolled_back {
                continue;
            }
            return result;
        }
    }

    /// Queued receipt of a batch, in one transaction.
    pub fn receive(&mut self, consumer: &str, msgs: &[(u8, u8)]) -> SimResult<Vec<Receipt>> {
        let consumer = consumer.to_owned();
        let msgs: Vec<Message> = msgs.iter().map(|&(id, v)| sim_message(id, v)).collect();
        self.in_tx(move |m| {
            msgs.iter()
                .map(|msg| {
                    queue::receive(m.conn(), &consumer, msg, &hash_of(&msg.payload), m.now_ms)
                        .map_err(|e| crate::Error::sqlite("receive", e))
                })
                .collect()
        })
        .map(Option::unwrap_or_default)
    }

    /// Claims up to `limit` due rows (consumer c0 first, then c1), then
    /// completes each in its own transaction with the next plan. Stops at a
    /// crash. Returns (consumer, id, outcome) per row completed.
    pub fn work(
        &mut self,
        limit: usize,
        plans: &[Plan],
    ) -> SimResult<Vec<(String, String, Outcome)>> {
        let token = self.next_token;
        self.next_token += 1;
        let claims = self
            .in_tx(move |m| {
                let mut claims = Vec::new();
                for consumer in CONSUMERS {
                    let want = limit - claims.len();
                    if want == 0 {
                        break;
                    }
                    claims.extend(
                        queue::claim(
                            m.conn(),
                            queue::Due {
                                consumer,
                                order: crate::config::KeyOrder::DeadReleases,
                                limit: want,
                                now_ms: m.now_ms,
                                max_attempts: MAX_ATTEMPTS,
                            },
                            m.now_ms + LEASE_MS,
                            token,
                        )
                        .map_err(|e| crate::Error::sqlite("claim", e))?,
                    );
                }
                Ok(claims)
            })?
            .unwrap_or_default();
        let mut done = Vec::new();
        for (i, claim) in claims.into_iter().enumerate() {
            let plan = plans
                .get(i % plans.len().max(1))
                .copied()
                .unwrap_or(Plan::Ok);
            *self.plan.lock().unwrap_or_else(|p| p.into_inner()) = plan;
            let outcome = self.in_tx(|m| {
                let Machine {
                    conn,
                    config,
                    handler,
                    started_claim,
                    crashing,
                    now_ms,
                    ..
                } = m;
                let (conn, guard) = conn.as_ref().expect("open");
                let mut marks = SimClaims {
                    started: started_claim,
                    crashing,
                };
                workers::complete_claim(conn, config, guard, *now_ms, &claim, &mut marks, |tx| {
                    handler.handle(tx, &claim.msg)
                })
            })?;
            match outcome {
                None => break, // crashed: the rest stay claimed until recovery
                Some(None) => return Err(format!("lease lost for row {}", claim.row_id)),
                Some(Some(outcome)) => done.push((claim.consumer, claim.msg.id, outcome)),
            }
        }
        Ok(done)
    }

    /// Processes up to `limit` due rows (consumer c0 first, then c1) in one
    /// transaction, as the engine's dispatcher does for transactional
    /// consumers, the n-th handler run with the n-th plan (cycled). Returns
    /// (consumer, id, outcome) per row settled: none after a crash (nothing
    /// of the batch committed); after a handler rolled the transaction
    /// back, only that row's, its attempt counted in a transaction of its
    /// own.
    pub fn process(
        &mut self,
        limit: usize,
        plans: &[Plan],
    ) -> SimResult<Vec<(String, String, Outcome)>> {
        // Enough for every run (a run rolled back is run again).
        *self.handler.plans.lock().unwrap_or_else(|p| p.into_inner()) = (0..limit * (limit + 2))
            .map(|i| {
                plans
                    .get(i % plans.len().max(1))
                    .copied()
                    .unwrap_or(Plan::Ok)
            })
            .collect();
        // As the writer does: a batch a handler rolled back runs again,
        // counting that row's attempt first.
        let mut poisoned = Vec::new();
        let result = loop {
            let before = poisoned.len();
            let result = self.in_tx(|m| {
                let Machine {
                    conn,
                    config,
                    handler,
                    marker,
                    crashing,
                    now_ms,
                    ..
                } = m;
                let (conn, guard) = conn.as_ref().expect("open");
                let mut log = SimLog { marker, crashing };
                let mut env = Env {
                    conn,
                    config,
                    now_ms: *now_ms,
                    log: &mut log,
                    guard,
                };
                let consumers: Vec<(&str, &dyn Handler)> = CONSUMERS
                    .iter()
                    .map(|&c| (c, handler as &dyn Handler))
                    .collect();
                delivery::process_due(&mut env, &consumers, limit, &mut poisoned, &mut Vec::new())
            });
            // Crashed, committed, or failed for another reason.
            if poisoned.len() == before || result.is_ok() {
                break result;
            }
        };
        self.handler
            .plans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        Ok(result?
            .unwrap_or_default()
            .into_iter()
            .map(|p| (p.consumer, p.message_id, p.outcome))
            .collect())
    }

    /// Moves the clock.
    pub fn advance(&mut self, ms: u32) {
        self.now_ms += i64::from(ms);
    }

    /// Sets the clock back.
    pub fn step_back(&mut self, ms: u32) {
        self.now_ms -= i64::from(ms);
    }

    /// Expires leases whose time has passed (the engine's reaper, for rows
    /// this process does not hold).
    pub fn reap(&mut self) -> SimResult<u64> {
        self.in_tx(|m| {
            let mut n = 0;
            for row in queue::leased(m.conn()).map_err(|e| crate::Error::sqlite("leased", e))? {
                if row.lease_until.is_none_or(|u| u < m.now_ms)
                    && queue::expire(
                        m.conn(),
                        row.row_id,
                        row.token,
                        "lease expired",
                        MAX_ATTEMPTS,
                        m.now_ms,
                    )
                    .map_err(|e| crate::Error::sqlite("expire", e))?
                {
                    n += 1;
                }
            }
            Ok(n)
        })
        .map(Option::unwrap_or_default)
    }

    /// One relay pass: fetch due rows, "send" them (failing those whose
    /// seq is a multiple of `fail_every`), record the results.
    pub fn relay(&mut self, fail_every: u8) -> SimResult<usize> {
        let batch: Vec<_> = outbox::fetch_due(self.conn(), self.now_ms, 50)
            .map_err(err)?
            .into_iter()
            .map(|(msg, _)| msg)
            .collect();
        let results = sink::per_message(&batch, |msg| {
            if fail_every > 0 && msg.seq % i64::from(fail_every) == 0 {
                SendResult::Retry {
                    reason: "sim sink down".into(),
                    after: Some(Duration::from_millis(50)),
                }
            } else {
                SendResult::Sent
            }
        });
        let n = batch.len();
        self.in_tx(move |m| {
            relay::record_results(m.conn(), &m.config, m.now_ms, &batch, &results).map(drop)
        })?;
        Ok(n)
    }

    /// Retention of completed inbox rows older than `retention_ms`, then,
    /// with `keys`, of the key entries deleted rows left (`retired.rs`).
    /// Returns rows deleted.
    pub fn cleanup(&mut self, retention_ms: u32, keys: bool) -> SimResult<usize> {
        let cutoff = self.now_ms - i64::from(retention_ms);
        let now = self.now_ms;
        // Small steps, each its own transaction, as the reaper's: what a
        // step notes must hold between them.
        let (mut rows, mut next) = (0, Some(sweep::Walk::new(cutoff, now)));
        while let Some(walk) = next {
            let (n, after) = self
                .in_tx(move |m| {
                    sweep::step(m.conn(), walk, 5).map_err(|e| crate::Error::sqlite("cleanup", e))
                })?
                .unwrap_or_default();
            rows += n;
            next = after;
        }
        if keys {
            let m = RefCell::new(self);
            retired::drain(
                || retired::read(m.borrow().conn()).map_err(err),
                |batch| m.borrow_mut().write_retired(batch),
            )?;
        }
        Ok(rows)
    }

    /// The first half of a drain: reads the retired keys, for
    /// [`Machine::apply_retired`] to delete later.
    pub fn read_retired(&mut self) -> SimResult<()> {
        self.read_retired = retired::read(self.conn()).map_err(err)?;
        Ok(())
    }

    /// The second half: deletes the key entries the last read found (those
    /// still retired) and clears its notes. Returns entries deleted.
    pub fn apply_retired(&mut self) -> SimResult<u64> {
        let mut read = self.read_retired.take();
        retired::drain(|| Ok(read.take()), |batch| self.write_retired(batch))
    }

    /// One batch of a drain, in its own transaction.
    pub(super) fn write_retired(&mut self, batch: retired::Batch) -> SimResult<usize> {
        self.in_tx(move |m| {
            retired::apply(m.conn(), &batch).map_err(|e| crate::Error::sqlite("retired keys", e))
        })
        .map(Option::unwrap_or_default)
    }

    /// Starts `consumer`'s stream `sim` afresh at 1.
    pub fn reset_sequence(&mut self, consumer: &str) -> SimResult<()> {
        let consumer = consumer.to_owned();
        self.in_tx(move |m| {
            crate::store::watermark::reset(m.conn(), &consumer, "sim", 1)
                .map_err(|e| crate::Error::sqlite("reset sequence", e))
        })
        .map(drop)
    }

    /// The process dies between operations and re-opens.
    pub fn crash_reopen(&mut self) -> SimResult<()> {
        self.crash()
    }

    /// The clock.
    pub fn now_ms(&self) -> i64 {
        self.now_ms
    }

    /// Every inbox row: (consumer, id) -> (status, attempts, next_attempt_at).
    pub(super) fn inbox(&self) -> SimResult<BTreeMap<Key, RowState>> {
        let mut stmt = self
            .conn()
            .prepare("SELECT consumer, message_id, status, attempts, next_attempt_at FROM postroom_inbox")
            .map_err(err)?;
        let rows = stmt
            .query_map([], |r| {
                Ok(((r.get(0)?, r.get(1)?), (r.get(2)?, r.get(3)?, r.get(4)?)))
            })
            .map_err(err)?;
        rows.collect::<rusqlite::Result<_>>().map_err(err)
    }

    /// `consumer`'s stream `sim`: settled_below (1 when unknown) and the
    /// sequences listed settled above the watermark.
    pub(super) fn watermark(&self, consumer: &str) -> SimResult<(u64, Vec<u64>)> {
        let below: i64 = self
            .conn()
            .query_row(
                "SELECT coalesce((SELECT settled_below FROM postroom_watermarks
                                  WHERE consumer = ?1 AND stream = 'sim'), 1)",
                [consumer],
                |r| r.get(0),
            )
            .map_err(err)?;
        let mut stmt = self
            .conn()
            .prepare(
                "SELECT seq FROM postroom_watermark_settled
                 WHERE consumer = ?1 AND stream = 'sim' ORDER BY seq",
            )
            .map_err(err)?;
        let mut listed: Vec<u64> = stmt
            .query_map([consumer], |r| r.get::<_, i64>(0))
            .map_err(err)?
            .map(|r| r.map(|s| s as u64))
            .collect::<rusqlite::Result<_>>()
            .map_err(err)?;
        // Past the listing's bound, runs (a model run never gets there).
        let mut runs = self
            .conn()
            .prepare(
                "SELECT lo, hi FROM postroom_watermark_runs
                 WHERE consumer = ?1 AND stream = 'sim' ORDER BY lo",
            )
            .map_err(err)?;
        for run in runs
            .query_map([consumer], |r| {
                Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?))
            })
            .map_err(err)?
        {
            let (lo, hi) = run.map_err(err)?;
            listed.extend(lo as u64..=hi as u64);
        }
        listed.sort_unstable();
        Ok((below as u64, listed))
    }

    /// How many times each (consumer, id) had its effect committed, and how
    /// many outbox rows each caused.
    pub(super) fn effects(&self, sql: &str) -> SimResult<BTreeMap<(String, String), u32>> {
        let mut stmt = self.conn().prepare(sql).map_err(err)?;
        let rows = stmt
            .query_map([], |r| Ok(((r.get(0)?, r.get(1)?), r.get(2)?)))
            .map_err(err)?;
        rows.collect::<rusqlite::Result<_>>().map_err(err)
    }
}
