//! What a scenario's own code sees: [`App`], where its setup registers the
//! consumers and the sink at every process life, and [`Check`], the
//! read-only view its effects, invariants and outcome query; and the
//! [`World`] of stand-in services that lives on across a seed's crashes.
//!
//! Invariants: `Check` reads through a read-only connection (a check cannot
//! write); what `App` registers is wrapped so the run's faults can act in
//! it, and is registered afresh at every reopen (handlers' memory is lost
//! as in a restart).

use super::*;

/// What lives on across the crashes of one seed: the other systems.
#[derive(Default)]
pub(super) struct World {
    pub(super) services: Mutex<BTreeMap<String, Service>>,
    pub(super) downstream: Downstream,
    pub(super) downstream_used: AtomicBool,
}

impl World {
    pub(super) fn service(&self, name: &str) -> Service {
        lock(&self.services)
            .entry(name.to_owned())
            .or_insert_with(|| Service::new(name))
            .clone()
    }
}

/// What your setup registers, once per process life of a seed: at the
/// first open and again at every reopen after a simulated crash, so
/// in-memory state of handlers and sinks is lost as in a real restart.
pub struct App<'a> {
    pub(super) dir: &'a Path,
    pub(super) world: &'a World,
    pub(super) consumers: Vec<(String, bool, Register)>,
    /// The names of the effectful consumers.
    pub(super) effectful: BTreeSet<String>,
    pub(super) sink: Option<Box<dyn Sink>>,
}

impl App<'_> {
    /// An inline consumer: the broker stand-in calls
    /// [`Postroom::deliver`] and acknowledges on
    /// [`Outcome::should_ack`](crate::Outcome::should_ack).
    pub fn consumer(&mut self, name: &str, handler: impl Handler) -> &mut Self {
        let owned = name.to_owned();
        self.consumers.push((
            owned.clone(),
            false,
            Box::new(move |b: Builder, armed: &Arc<Armed>| {
                b.consumer(
                    owned,
                    Crashable {
                        inner: handler,
                        armed: armed.clone(),
                    },
                )
            }),
        ));
        self
    }

    /// A queued consumer: [`Postroom::receive`], processed by a worker.
    pub fn queued_consumer(&mut self, name: &str, handler: impl Handler) -> &mut Self {
        self.consumer(name, handler);
        if let Some(last) = self.consumers.last_mut() {
            last.1 = true;
        }
        self
    }

    /// An effectful consumer ([`EffectHandler`]), queued. A
    /// crash-before-commit fault lands after its external step, which then
    /// runs again on the redelivery (with the same idempotency key).
    pub fn effectful_consumer(&mut self, name: &str, handler: impl EffectHandler) -> &mut Self {
        let owned = name.to_owned();
        self.effectful.insert(owned.clone());
        self.consumers.push((
            owned.clone(),
            true,
            Box::new(move |b: Builder, armed: &Arc<Armed>| {
                b.effectful_consumer(
                    owned,
                    CrashableEffect {
                        inner: handler,
                        armed: armed.clone(),
                    },
                )
            }),
        ));
        self
    }

    /// Your sink, built for this process life (hand it
    /// [`App::downstream`] where it has its destination's ack).
    pub fn sink(&mut self, sink: impl Sink) -> &mut Self {
        self.sink = Some(Box::new(sink));
        self
    }

    /// The stand-in external service `name`: the same one across the
    /// crashes of a seed, a fresh one for each seed.
    pub fn service(&self, name: &str) -> Service {
        self.world.service(name)
    }

    /// The stand-in destination of your sink. Once asked for, the verdict
    /// demands that everything your sink answered `Sent` for reached it.
    pub fn downstream(&self) -> Downstream {
        self.world.downstream_used.store(true, Ordering::Relaxed);
        self.world.downstream.clone()
    }

    /// This seed's temporary directory (the database is `app.db` in it):
    /// the place for files your handlers write outside the database.
    pub fn dir(&self) -> &Path {
        self.dir
    }
}

/// What your `effects`, `invariant` and `outcome` closures read: a
/// read-only connection to the seed's database, the stand-ins, the
/// directory.
pub struct Check<'a> {
    pub(super) conn: &'a Connection,
    pub(super) world: &'a World,
    pub(super) dir: &'a Path,
    pub(super) now_ms: i64,
}

impl Check<'_> {
    /// A read-only connection to the database.
    pub fn conn(&self) -> &Connection {
        self.conn
    }

    /// `SELECT count(*) …`-style shorthand: the first column of the first
    /// row as a count (0 for no row or NULL). Panics on an SQL error, with
    /// the statement: this is test code.
    pub fn count<P: rusqlite::Params>(&self, sql: &str, params: P) -> u64 {
        // Cached: an invariant runs the same statements after every step.
        match self
            .conn
            .prepare_cached(sql)
            .and_then(|mut stmt| stmt.query_row(params, |r| r.get::<_, Option<i64>>(0)))
            .optional()
        {
            Ok(n) => n.flatten().unwrap_or(0).max(0) as u64,
            Err(e) => panic!("postroom testkit: {sql:?} failed: {e}"),
        }
    }

    /// The stand-in service `name` (as the handlers saw it).
    pub fn service(&self, name: &str) -> Service {
        self.world.service(name)
    }

    /// The stand-in downstream.
    pub fn downstream(&self) -> Downstream {
        self.world.downstream.clone()
    }

    /// The seed's directory.
    pub fn dir(&self) -> &Path {
        self.dir
    }

    /// The engine's clock now, in unix milliseconds (the scenario's
    /// manual clock, not the wall clock): render stored times relative to
    /// it.
    pub fn now_ms(&self) -> i64 {
        self.now_ms
    }
}
