//! The engine's counters, gauges and histograms reach whatever `metrics` recorder
//! the application installed: a small recording one here (the global
//! recorder can be set once per process, so this binary has one test).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};
use postroom::{handler_fn, ChannelSink, Failure, Message, Outcome, Outgoing, Postroom, Receipt};

/// Counters and histogram samples by `name{label=value,…}`.
#[derive(Clone, Default)]
struct Recording {
    counters: Arc<Mutex<HashMap<String, Arc<Count>>>>,
    histograms: Arc<Mutex<HashMap<String, Arc<Samples>>>>,
    gauges: Arc<Mutex<HashMap<String, Arc<Level>>>>,
}

/// A gauge's last value, as `f64` bits.
#[derive(Default)]
struct Level(AtomicU64);
impl GaugeFn for Level {
    fn increment(&self, value: f64) {
        self.set(f64::from_bits(self.0.load(Ordering::Relaxed)) + value);
    }
    fn decrement(&self, value: f64) {
        self.increment(-value);
    }
    fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::Relaxed);
    }
}

#[derive(Default)]
struct Count(AtomicU64);
impl CounterFn for Count {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }
    fn absolute(&self, value: u64) {
        self.0.fetch_max(value, Ordering::Relaxed);
    }
}

#[derive(Default)]
struct Samples(Mutex<Vec<f64>>);
impl HistogramFn for Samples {
    fn record(&self, value: f64) {
        self.0.lock().unwrap().push(value);
    }
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
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let mut map = self.counters.lock().unwrap();
        Counter::from_arc(Arc::clone(map.entry(id(key)).or_default()))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        let mut map = self.gauges.lock().unwrap();
        Gauge::from_arc(Arc::clone(map.entry(id(key)).or_default()))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let mut map = self.histograms.lock().unwrap();
        Histogram::from_arc(Arc::clone(map.entry(id(key)).or_default()))
    }
}

impl Recording {
    fn counter(&self, name: &str) -> u64 {
        let map = self.counters.lock().unwrap();
        map.get(name).map_or(0, |c| c.0.load(Ordering::Relaxed))
    }
    fn gauge(&self, name: &str) -> Option<f64> {
        let map = self.gauges.lock().unwrap();
        map.get(name)
            .map(|g| f64::from_bits(g.0.load(Ordering::Relaxed)))
    }
    fn samples(&self, name: &str) -> Vec<f64> {
        let map = self.histograms.lock().unwrap();
        map.get(name)
            .map_or_else(Vec::new, |h| h.0.lock().unwrap().clone())
    }
    /// Waits for a counter moved by a background thread (queued processing,
    /// the relay), up to ten seconds.
    fn wait_for(&self, name: &str, at_least: u64) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let n = self.counter(name);
            if n >= at_least || Instant::now() > deadline {
                return n;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

#[test]
fn counters_and_histograms_move_with_deliveries_processing_and_the_relay() {
    let rec = Recording::default();
    metrics::set_global_recorder(rec.clone()).expect("the only recorder of this binary");

    let dir = tempfile::tempdir().unwrap();
    let (tx, rx) = crossbeam_channel::bounded(16);
    let room = Postroom::builder()
        .consumer(
            "inline",
            handler_fn(|tx, msg| match msg.id() {
                "bad" => Err(Failure::reject("refused")),
                "flaky" => Err(Failure::retry("not yet")),
                _ => {
                    tx.publish(Outgoing::new("out", msg.payload().to_vec()))?;
                    Ok(())
                }
            }),
        )
        .consumer("queued", handler_fn(|_, _| Ok(())))
        .sink(ChannelSink::new(tx))
        .open(dir.path().join("app.db"))
        .unwrap();

    let ok = Message::new("s", "ok", "1");
    assert_eq!(
        room.deliver("inline", ok.clone()).unwrap(),
        Outcome::Processed { attempts: 1 }
    );
    assert_eq!(room.deliver("inline", ok).unwrap(), Outcome::Duplicate);
    assert!(matches!(
        room.deliver("inline", Message::new("s", "ok", "other payload"))
            .unwrap(),
        Outcome::Conflict { .. }
    ));
    assert!(matches!(
        room.deliver("inline", Message::new("s", "bad", "2"))
            .unwrap(),
        Outcome::Dead { .. }
    ));
    assert!(matches!(
        room.deliver("inline", Message::new("s", "flaky", "3"))
            .unwrap(),
        Outcome::Failed { .. }
    ));
    // A refused delivery is no answer: nothing counted, no latency.
    assert!(room.deliver("inline", Message::new("s", "", "4")).is_err());

    assert_eq!(rec.counter("postroom_delivered_total{consumer=inline}"), 1);
    assert_eq!(rec.counter("postroom_duplicates_total{consumer=inline}"), 1);
    assert_eq!(rec.counter("postroom_conflicts_total{consumer=inline}"), 1);
    assert_eq!(rec.counter("postroom_dead_total{consumer=inline}"), 1);
    assert_eq!(rec.counter("postroom_failed_total{consumer=inline}"), 1);
    let latencies = rec.samples("postroom_deliver_seconds{consumer=inline}");
    assert_eq!(
        latencies.len(),
        5,
        "one per answered deliver: {latencies:?}"
    );
    assert!(
        latencies.iter().all(|s| *s > 0.0 && *s < 10.0),
        "{latencies:?}"
    );

    // Queued: the receipt of a repeat counts as a duplicate at once; the
    // processed message once its batch has committed.
    let queued = Message::new("s", "q1", "5");
    assert_eq!(
        room.receive("queued", queued.clone()).unwrap(),
        Receipt::Accepted
    );
    assert_eq!(room.receive("queued", queued).unwrap(), Receipt::Duplicate);
    assert_eq!(rec.counter("postroom_duplicates_total{consumer=queued}"), 1);
    assert_eq!(
        rec.wait_for("postroom_delivered_total{consumer=queued}", 1),
        1
    );

    // The relay: the one published message is sent, with its lag.
    rx.recv_timeout(Duration::from_secs(10)).expect("relayed");
    assert_eq!(rec.wait_for("postroom_outbox_sent_total", 1), 1);
    let lags = rec.samples("postroom_relay_lag_seconds");
    assert_eq!(lags.len(), 1, "{lags:?}");
    assert!(lags[0] >= 0.0 && lags[0] < 10.0, "{lags:?}");

    // Every commit is a group of at least one job.
    let groups = rec.samples("postroom_group_size");
    assert!(groups.len() >= 5, "{groups:?}");
    assert!(groups.iter().all(|g| *g >= 1.0), "{groups:?}");

    // "flaky" failed inline: it waits for its sender's redelivery, which
    // the gauges set by `stats()` show, with its age.
    let stats = room.stats().unwrap();
    assert_eq!(stats.inbox["inline"].waiting_for_redelivery, 1);
    assert_eq!(
        rec.gauge("postroom_waiting_for_redelivery{consumer=inline}"),
        Some(1.0)
    );
    let age = rec
        .gauge("postroom_oldest_waiting_for_redelivery_seconds{consumer=inline}")
        .expect("the oldest's age is set");
    assert!((0.0..600.0).contains(&age), "{age}");
    assert_eq!(
        rec.gauge("postroom_waiting_for_redelivery{consumer=queued}"),
        Some(0.0)
    );

    room.shutdown(Duration::from_secs(5)).unwrap();
}
