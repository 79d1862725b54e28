//! The engine's own log text cannot be forged by what it logs about: a
//! message id, source, consumer or error text holding a newline or a
//! terminal escape comes out escaped, while the key-values a structured
//! logger takes stay raw (the logger is global: one test here).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use log::kv::{Key, Value, VisitSource};
use postroom::{handler_fn, Failure, Message, Postroom};

/// One record's text and key-values.
type Captured = (String, Vec<(String, String)>);

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
            .push((record.args().to_string(), pairs.0));
    }
    fn flush(&self) {}
}

/// What a hostile sender puts in an id: a forged log line, and an OSC
/// sequence that retitles the terminal.
const FORGED_ID: &str = "m-1\n[ERROR] postroom: database corrupted\x1b]0;t\x07";
/// Sources, like names, are refused with control characters.
const FORGED_SOURCE: &str = "src";
const FORGED_REASON: &str = "bad\n[ERROR] x\x1b[2J\u{202e}";

#[test]
fn ids_sources_and_errors_are_escaped_in_log_text_and_raw_in_key_values() {
    log::set_logger(&Capture).unwrap();
    log::set_max_level(log::LevelFilter::Trace);

    let dir = tempfile::tempdir().unwrap();
    let room = Postroom::builder()
        .consumer(
            "inline",
            handler_fn(|_, _| Err(Failure::reject(FORGED_REASON))),
        )
        .consumer("queued", handler_fn(|_, _| Ok(())))
        .open(dir.path().join("app.db"))
        .unwrap();
    // A dead letter (its reason is user text), a conflict (same id, other
    // payload), and a queued result.
    room.deliver("inline", Message::new(FORGED_SOURCE, FORGED_ID, "x"))
        .unwrap();
    room.deliver("inline", Message::new(FORGED_SOURCE, FORGED_ID, "y"))
        .unwrap();
    room.receive("queued", Message::new(FORGED_SOURCE, FORGED_ID, "z"))
        .unwrap();

    let deadline = Instant::now() + Duration::from_secs(20);
    let queued_logged = || {
        RECORDS
            .lock()
            .unwrap()
            .iter()
            .any(|(_, pairs)| pairs.iter().any(|(k, v)| k == "consumer" && v == "queued"))
    };
    while !queued_logged() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    room.shutdown(Duration::from_secs(5)).unwrap();

    let records = RECORDS.lock().unwrap().clone();
    let about_it: Vec<&Captured> = records
        .iter()
        .filter(|(text, _)| text.contains("m-1"))
        .collect();
    // The dead letter, the conflict and the queued result, at least.
    assert!(about_it.len() >= 3, "{records:#?}");
    for (text, _) in &records {
        let raw: Vec<char> = text
            .chars()
            .filter(|&c| c.is_control() || c == '\u{202e}')
            .collect();
        assert!(raw.is_empty(), "raw {raw:?} in log text {text:?}");
        assert!(!text.contains("\n[ERROR]"), "{text:?}");
    }
    assert!(
        records
            .iter()
            .any(|(text, _)| text.contains("bad\\n[ERROR] x")),
        "the reason is there, escaped: {records:#?}"
    );
    // Structured values are the logger's to render: they stay exact.
    assert!(
        records.iter().any(|(_, pairs)| pairs
            .iter()
            .any(|(k, v)| k == "message_id" && v == FORGED_ID)),
        "{records:#?}"
    );
}
