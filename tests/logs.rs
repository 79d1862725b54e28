//! Log records about one message carry `consumer` and `message_id` as
//! key-values, for structured loggers (the logger is global: one test here).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use log::kv::{Key, Value, VisitSource};
use postroom::{handler_fn, Failure, Message, Postroom};

/// One record's level, text and key-values.
type Captured = (log::Level, String, Vec<(String, String)>);

static RECORDS: Mutex<Vec<Captured>> = Mutex::new(Vec::new());

struct Capture;

struct Pairs(Vec<(String, String)>);
impl<'kvs> VisitSource<'kvs> for Pairs {
    fn visit_pair(&mut self, key: Key<'kvs>, value: Value<'kvs>) -> Result<(), log::kv::Error> {
        self.0.push((key.to_string(), value.to_string()));
        Ok(())
    }
}

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        let mut pairs = Pairs(Vec::new());
        let _ = record.key_values().visit(&mut pairs);
        RECORDS
            .lock()
            .unwrap()
            .push((record.level(), record.args().to_string(), pairs.0));
    }
    fn flush(&self) {}
}

fn carries(pairs: &[(String, String)], consumer: &str, id: &str) -> bool {
    let has = |k: &str, v: &str| pairs.iter().any(|(pk, pv)| pk == k && pv == v);
    has("consumer", consumer) && has("message_id", id)
}

#[test]
fn dead_letters_and_queued_results_name_consumer_and_message_as_key_values() {
    log::set_logger(&Capture).unwrap();
    log::set_max_level(log::LevelFilter::Debug);

    let dir = tempfile::tempdir().unwrap();
    let room = Postroom::builder()
        .consumer("inline", handler_fn(|_, _| Err(Failure::reject("refused"))))
        .consumer("queued", handler_fn(|_, _| Ok(())))
        .open(dir.path().join("app.db"))
        .unwrap();
    room.deliver("inline", Message::new("s", "poison-1", "x"))
        .unwrap();
    room.receive("queued", Message::new("s", "note-1", "y"))
        .unwrap();

    let deadline = Instant::now() + Duration::from_secs(10);
    let found = |level: log::Level, consumer: &str, id: &str| {
        RECORDS
            .lock()
            .unwrap()
            .iter()
            .any(|(l, _, pairs)| *l == level && carries(pairs, consumer, id))
    };
    while !found(log::Level::Debug, "queued", "note-1") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        found(log::Level::Warn, "inline", "poison-1"),
        "no dead-letter warning with key-values: {:?}",
        RECORDS.lock().unwrap()
    );
    assert!(
        found(log::Level::Debug, "queued", "note-1"),
        "no queued result with key-values: {:?}",
        RECORDS.lock().unwrap()
    );
    room.shutdown(Duration::from_secs(5)).unwrap();
}
