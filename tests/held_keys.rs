//! A held key costs O(1) (issue 32): a head row that waits out a long
//! backoff, with thousands of rows of its key behind it, holds back its own
//! key only. Other keys' messages are processed (transactional and
//! effectful consumers) and relayed meanwhile, and once the head goes
//! through, its key's backlog follows in order.
//!
//! That the due queries do not walk the backlog is checked deterministically
//! (SQLite VM steps at 0 and 100,000 held rows) by the unit tests in
//! `store::queue` and `store::outbox`; these tests check the behaviour end
//! to end, with bounds generous enough for a busy machine.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use postroom::{
    handler_fn, sink_fn, EffectContext, EffectHandler, Failure, ManualClock, Message,
    OutboxMessage, Outgoing, Postroom, SendResult, Tx,
};

/// Rows of the held key behind its head.
const BEHIND: usize = 3_000;

const HOUR: Duration = Duration::from_secs(3600);

fn builder(clock: &ManualClock) -> postroom::Builder {
    Postroom::builder()
        .clock(clock.clone())
        .poll_interval(Duration::from_millis(10))
        .relay_poll(Duration::from_millis(20))
}

/// Records a message in `applied` (in the order handled: rowid order).
fn record(tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
    tx.execute(
        "INSERT INTO applied (consumer, message_id, payload) VALUES (?1, ?2, ?3)",
        rusqlite::params![tx.consumer().unwrap_or(""), msg.id(), msg.payload()],
    )?;
    Ok(())
}

/// The message ids `consumer` applied, in the order applied.
fn applied(conn: &rusqlite::Connection, consumer: &str) -> Vec<String> {
    let mut stmt = conn
        .prepare("SELECT message_id FROM applied WHERE consumer = ?1 ORDER BY rowid")
        .unwrap();
    let rows = stmt.query_map([consumer], |r| r.get(0)).unwrap();
    rows.map(Result::unwrap).collect()
}

/// The effectful twin of the transactional handler: its external step
/// fails the held head.
struct Held(Arc<AtomicBool>);

impl EffectHandler for Held {
    type Output = ();

    fn effect(&self, _ctx: &EffectContext<'_>, msg: &Message) -> Result<(), Failure> {
        if msg.id() == "doc-1/head" && self.0.load(Ordering::SeqCst) {
            return Err(Failure::retry_after("the document is locked", HOUR));
        }
        Ok(())
    }

    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, (): ()) -> Result<(), Failure> {
        record(tx, msg)
    }
}

/// The ids a held key's backlog is received under, head first.
fn backlog() -> Vec<String> {
    let mut ids = vec!["doc-1/head".to_owned()];
    ids.extend((0..BEHIND).map(|i| format!("doc-1/{i:05}")));
    ids
}

/// Queued processing, transactional (`tx`) and effectful (`fx`): the head
/// of `doc-1` fails with `retry_after(1 h)`; the other keys' messages
/// received after its backlog are processed while it waits; an hour later
/// the backlog is processed in receive order.
#[test]
fn other_keys_are_processed_while_a_held_key_waits_with_its_backlog() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let clock = ManualClock::new(1_000_000);
    let held = Arc::new(AtomicBool::new(true));
    let h2 = Arc::clone(&held);
    let room = builder(&clock)
        .consumer(
            "tx",
            handler_fn(move |tx: &mut Tx<'_>, msg: &Message| {
                if msg.id() == "doc-1/head" && h2.load(Ordering::SeqCst) {
                    return Err(Failure::retry_after("the document is locked", HOUR));
                }
                record(tx, msg)
            }),
        )
        .effectful_consumer("fx", Held(Arc::clone(&held)))
        .open(&db)
        .unwrap();
    create_domain(&room);
    let conn = raw(&db);
    let failed = |consumer: &str| {
        room.stats()
            .unwrap()
            .inbox
            .get(consumer)
            .map_or(0, |c| c.failed)
    };
    for consumer in ["tx", "fx"] {
        let msgs: Vec<_> = backlog()
            .into_iter()
            .map(|id| Message::new("editor", id, "edit").with_ordering_key("doc-1"))
            .collect();
        for chunk in msgs.chunks(500) {
            room.receive_batch(consumer, chunk.to_vec()).unwrap();
        }
    }
    eventually(60, "both heads failed once", || {
        failed("tx") == 1 && failed("fx") == 1
    });
    // Other keys, and messages without a key, received behind the backlog.
    let mut others = Vec::new();
    for i in 0..10 {
        let key = Message::new("editor", format!("other/{i}"), "edit")
            .with_ordering_key(format!("doc-{}", i + 2));
        let unkeyed = Message::new("editor", format!("loose/{i}"), "edit");
        others.push(key.id().to_owned());
        others.push(unkeyed.id().to_owned());
        for consumer in ["tx", "fx"] {
            room.receive_batch(consumer, vec![key.clone(), unkeyed.clone()])
                .unwrap();
        }
    }
    for consumer in ["tx", "fx"] {
        eventually(120, "the other keys processed", || {
            applied(&conn, consumer).len() == others.len()
        });
        let mut got = applied(&conn, consumer);
        got.sort();
        let mut want = others.clone();
        want.sort();
        assert_eq!(got, want, "{consumer}: only the other keys ran");
    }
    // The head's hour passes: the backlog follows, in order.
    held.store(false, Ordering::SeqCst);
    clock.advance(HOUR + Duration::from_secs(1));
    for consumer in ["tx", "fx"] {
        eventually(300, "the held key's backlog processed", || {
            applied(&conn, consumer).len() == others.len() + BEHIND + 1
        });
        let doc1: Vec<String> = applied(&conn, consumer)
            .into_iter()
            .filter(|id| id.starts_with("doc-1/"))
            .collect();
        assert_eq!(doc1, backlog(), "{consumer}: doc-1 in receive order");
    }
    room.shutdown(Duration::from_secs(30)).unwrap();
    let report = postroom::admin::check(&conn, postroom::admin::CheckDepth::Full).unwrap();
    assert!(report.is_ok(), "{report:?}");
}

/// The relay: the destination of key `doc-1` is unavailable for an hour
/// from its first row on; rows of other keys committed after its backlog
/// reach the sink meanwhile, and the backlog follows in order once it is
/// back.
#[test]
fn other_keys_are_relayed_while_a_held_key_waits_with_its_backlog() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let down = Arc::new(AtomicBool::new(true));
    let calls = Arc::new(AtomicU64::new(0));
    let got = Arc::new(Mutex::new(Vec::new()));
    let (d2, c2, g2) = (Arc::clone(&down), Arc::clone(&calls), Arc::clone(&got));
    let room = builder(&clock)
        .sink(sink_fn(move |m: &OutboxMessage| {
            if m.key.as_deref() == Some("doc-1") && d2.load(Ordering::SeqCst) {
                c2.fetch_add(1, Ordering::SeqCst);
                return SendResult::unavailable("the archive is offline", HOUR);
            }
            g2.lock()
                .unwrap()
                .push(String::from_utf8(m.payload.clone()).unwrap());
            SendResult::Sent
        }))
        .open(dir.path().join("app.db"))
        .unwrap();
    let publish = |rows: Vec<(Option<String>, String)>| {
        room.transaction(move |tx| {
            for (key, payload) in rows {
                let out = Outgoing::new("docs", payload.into_bytes());
                tx.publish(match key {
                    Some(key) => out.with_key(key),
                    None => out,
                })?;
            }
            Ok(())
        })
        .unwrap();
    };
    publish(vec![(Some("doc-1".to_owned()), "doc-1/head".to_owned())]);
    eventually(60, "the head handed over once", || {
        calls.load(Ordering::SeqCst) >= 1
    });
    let ids = backlog();
    for chunk in ids[1..].chunks(500) {
        publish(
            chunk
                .iter()
                .map(|id| (Some("doc-1".to_owned()), id.clone()))
                .collect(),
        );
    }
    let mut others = Vec::new();
    for i in 0..10 {
        others.push(format!("other/{i}"));
        others.push(format!("loose/{i}"));
        publish(vec![
            (Some(format!("doc-{}", i + 2)), format!("other/{i}")),
            (None, format!("loose/{i}")),
        ]);
    }
    eventually(120, "the other keys relayed", || {
        got.lock().unwrap().len() == others.len()
    });
    assert_eq!(
        *got.lock().unwrap(),
        others,
        "only the other keys, in order"
    );
    down.store(false, Ordering::SeqCst);
    clock.advance(HOUR + Duration::from_secs(1));
    eventually(300, "the held key's backlog relayed", || {
        got.lock().unwrap().len() == others.len() + ids.len()
    });
    assert_eq!(
        got.lock().unwrap()[others.len()..],
        ids[..],
        "doc-1 in order"
    );
    room.shutdown(Duration::from_secs(30)).unwrap();
}
