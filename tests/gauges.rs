//! The live gauges (issue 36, item 6) reach a recording `metrics`
//! recorder: each consumer's backlog and its oldest row's age, rows waiting
//! for a retry, dead letters and the oldest's age, the watermarks' gaps,
//! the WAL's size; and an idle engine reads nothing for them.
//!
//! The global recorder is set once per process: the tests share one and
//! run one at a time (`SERIAL`), each with consumers of its own names. Each
//! engine runs on a `ManualClock`, so the ages move when the test moves it,
//! whatever the machine's load. The gauges follow a change within about a
//! second (the checkpointer's watch); every wait is bounded at 30 s.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use metrics::{
    Counter, Gauge, GaugeFn, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use postroom::{handler_fn, Failure, ManualClock, Message, Outcome, Postroom, Receipt};

/// A gauge's last value (as `f64` bits) and how many times it was set.
#[derive(Default)]
struct Level {
    value: AtomicU64,
    sets: AtomicU64,
}
impl GaugeFn for Level {
    fn increment(&self, value: f64) {
        self.set(f64::from_bits(self.value.load(Ordering::Relaxed)) + value);
    }
    fn decrement(&self, value: f64) {
        self.increment(-value);
    }
    fn set(&self, value: f64) {
        self.value.store(value.to_bits(), Ordering::Relaxed);
        self.sets.fetch_add(1, Ordering::Relaxed);
    }
}

/// Gauges by `name{label=value,…}`; counters and histograms are dropped.
#[derive(Clone, Default)]
struct Recording {
    gauges: Arc<Mutex<HashMap<String, Arc<Level>>>>,
}

fn id(key: &Key) -> String {
    let labels: Vec<String> = key
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    if labels.is_empty() {
        key.name().to_owned()
    } else {
        format!("{}{{{}}}", key.name(), labels.join(","))
    }
}

impl Recorder for Recording {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::noop()
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        let mut map = self.gauges.lock().unwrap();
        Gauge::from_arc(Arc::clone(map.entry(id(key)).or_default()))
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

impl Recording {
    fn level(&self, name: &str) -> Option<Arc<Level>> {
        self.gauges.lock().unwrap().get(name).cloned()
    }
    fn gauge(&self, name: &str) -> Option<f64> {
        self.level(name)
            .map(|l| f64::from_bits(l.value.load(Ordering::Relaxed)))
    }
    fn sets(&self, name: &str) -> u64 {
        self.level(name)
            .map_or(0, |l| l.sets.load(Ordering::Relaxed))
    }
    /// Waits up to 30 s for the gauge to satisfy `ok`; returns its value.
    fn wait_for(&self, name: &str, what: &str, ok: impl Fn(f64) -> bool) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let value = self.gauge(name);
            if let Some(v) = value.filter(|v| ok(*v)) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{name} never became {what} in 30 s: {value:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    fn wait_eq(&self, name: &str, want: f64) {
        self.wait_for(name, &want.to_string(), |v| v == want);
    }
}

static RECORDER: OnceLock<Recording> = OnceLock::new();
static SERIAL: Mutex<()> = Mutex::new(());

/// The process's recorder, and this test's turn.
fn recorder() -> (&'static Recording, MutexGuard<'static, ()>) {
    let turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rec = RECORDER.get_or_init(|| {
        let rec = Recording::default();
        metrics::set_global_recorder(rec.clone()).expect("the only recorder of this binary");
        rec
    });
    (rec, turn)
}

const START_MS: i64 = 1_700_000_000_000;

#[test]
fn the_backlog_its_age_and_the_rows_waiting_for_a_retry_follow_the_queue() {
    let (rec, _turn) = recorder();
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(START_MS);
    let open = Arc::new(AtomicBool::new(false));
    let gate = Arc::clone(&open);
    let room = Postroom::builder()
        .clock(clock.clone())
        .backoff(Duration::from_secs(60), Duration::from_secs(60))
        .max_attempts(100)
        .consumer(
            "gq",
            handler_fn(move |_, _| {
                if gate.load(Ordering::SeqCst) {
                    Ok(())
                } else {
                    Err(Failure::retry("closed"))
                }
            }),
        )
        .open(dir.path().join("app.db"))
        .unwrap();
    rec.wait_eq("postroom_backlog{consumer=gq}", 0.0);

    for i in 0..3 {
        let msg = Message::new("s", format!("m{i}"), "x");
        assert_eq!(room.receive("gq", msg).unwrap(), Receipt::Accepted);
    }
    rec.wait_eq("postroom_backlog{consumer=gq}", 3.0);
    // Each is tried once and waits out its backoff (30 to 60 s, on a clock
    // that does not move by itself).
    rec.wait_eq("postroom_waiting_for_retry{consumer=gq}", 3.0);
    assert_eq!(rec.gauge("postroom_backlog{consumer=gq}"), Some(3.0));
    // The oldest's age grows with the clock, without a commit.
    clock.advance(Duration::from_secs(20));
    let age = rec.wait_for(
        "postroom_oldest_backlog_seconds{consumer=gq}",
        "at least 20",
        |v| v >= 20.0,
    );
    assert!(age < 30.0, "{age}");

    // Drained: past the backoff, the handler succeeds.
    open.store(true, Ordering::SeqCst);
    clock.advance(Duration::from_secs(120));
    rec.wait_eq("postroom_backlog{consumer=gq}", 0.0);
    rec.wait_eq("postroom_waiting_for_retry{consumer=gq}", 0.0);
    rec.wait_eq("postroom_oldest_backlog_seconds{consumer=gq}", 0.0);
    room.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn a_dead_letter_is_counted_with_its_age_and_an_idle_engine_reads_nothing() {
    let (rec, _turn) = recorder();
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(START_MS);
    let room = Postroom::builder()
        .clock(clock.clone())
        .consumer("gd", handler_fn(|_, _| Err(Failure::reject("refused"))))
        .open(dir.path().join("app.db"))
        .unwrap();
    rec.wait_eq("postroom_dead_letters{consumer=gd}", 0.0);
    assert!(matches!(
        room.deliver("gd", Message::new("s", "bad", "x")).unwrap(),
        Outcome::Dead { .. }
    ));
    rec.wait_eq("postroom_dead_letters{consumer=gd}", 1.0);
    clock.advance(Duration::from_secs(90));
    let age = rec.wait_for(
        "postroom_oldest_dead_letter_seconds{consumer=gd}",
        "at least 90",
        |v| v >= 90.0,
    );
    assert!(age < 100.0, "{age}");

    // Idle: the dead count is not read (so not set) again. Windows of 3 s
    // (over two checks each); one counts once the window before it saw no
    // commit either, so that a refresh owed to an earlier commit is done.
    let dead = "postroom_dead_letters{consumer=gd}";
    let mut quiet_before = false;
    let mut checked = false;
    for _ in 0..8 {
        let (batches, sets) = (room.stats().unwrap().batches_committed, rec.sets(dead));
        std::thread::sleep(Duration::from_secs(3));
        let quiet = room.stats().unwrap().batches_committed == batches;
        if quiet && quiet_before {
            assert_eq!(rec.sets(dead), sets, "an idle engine read the gauges again");
            checked = true;
            break;
        }
        quiet_before = quiet;
    }
    assert!(checked, "the engine never stayed idle for two windows");
    assert_eq!(rec.gauge(dead), Some(1.0));
    room.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn a_gap_in_a_sequence_stream_shows_until_it_is_filled() {
    let (rec, _turn) = recorder();
    let dir = tempfile::tempdir().unwrap();
    let room = Postroom::builder()
        .consumer("gs", handler_fn(|_, _| Ok(())))
        .open(dir.path().join("app.db"))
        .unwrap();
    let change = |seq: u64| Message::new("s", format!("c{seq}"), "x").with_sequence(seq);
    for seq in [1, 2, 4, 7] {
        assert!(room.deliver("gs", change(seq)).unwrap().should_ack());
    }
    rec.wait_eq("postroom_watermark_gaps{consumer=gs}", 3.0);
    for seq in [3, 5, 6] {
        assert!(room.deliver("gs", change(seq)).unwrap().should_ack());
    }
    rec.wait_eq("postroom_watermark_gaps{consumer=gs}", 0.0);
    room.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn the_wal_bytes_follow_the_file() {
    let (rec, _turn) = recorder();
    let dir = tempfile::tempdir().unwrap();
    let room = Postroom::builder()
        .consumer("gw", handler_fn(|_, _| Ok(())))
        .open(dir.path().join("app.db"))
        .unwrap();
    for i in 0..20 {
        let msg = Message::new("s", format!("w{i}"), vec![7u8; 4096]);
        assert!(room.deliver("gw", msg).unwrap().should_ack());
    }
    let bytes = rec.wait_for("postroom_wal_bytes", "over 0", |v| v > 0.0);
    assert!(bytes >= 4096.0, "{bytes}");
    room.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn a_row_failed_inline_waits_for_its_redelivery_in_the_live_gauges() {
    let (rec, _turn) = recorder();
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(START_MS);
    let open = Arc::new(AtomicBool::new(false));
    let gate = Arc::clone(&open);
    let room = Postroom::builder()
        .clock(clock.clone())
        .consumer(
            "gr",
            handler_fn(move |_, _| {
                if gate.load(Ordering::SeqCst) {
                    Ok(())
                } else {
                    Err(Failure::retry("closed"))
                }
            }),
        )
        .open(dir.path().join("app.db"))
        .unwrap();
    let waiting = "postroom_waiting_for_redelivery{consumer=gr}";
    rec.wait_eq(waiting, 0.0);
    // Failed inline: no worker retries it; only its redelivery does. Set
    // live (no stats() call anywhere in this test).
    let msg = || Message::new("s", "r1", "x");
    assert!(matches!(
        room.deliver("gr", msg()).unwrap(),
        Outcome::Failed { .. }
    ));
    rec.wait_eq(waiting, 1.0);
    clock.advance(Duration::from_secs(45));
    let age = rec.wait_for(
        "postroom_oldest_waiting_for_redelivery_seconds{consumer=gr}",
        "at least 45",
        |v| v >= 45.0,
    );
    assert!(age < 60.0, "{age}");
    // Its redelivery succeeds: nothing waits any more.
    open.store(true, Ordering::SeqCst);
    assert!(room.deliver("gr", msg()).unwrap().should_ack());
    rec.wait_eq(waiting, 0.0);
    rec.wait_eq(
        "postroom_oldest_waiting_for_redelivery_seconds{consumer=gr}",
        0.0,
    );
    room.shutdown(Duration::from_secs(10)).unwrap();
}
