//! Strict order (issue 36, item 5): with `Builder::strict_order(consumer)`
//! a dead message holds its ordering key. A sync receiver applying edits
//! of one document never applies edit 4 on a base edit 3 never produced:
//! the later edits wait until edit 3 is redriven (then 3, 4, 5 apply in
//! that order, each once) or discarded (then 4 and 5 apply). Other keys
//! keep flowing meanwhile. By default (option off) a dead message releases
//! its key, as before. A bulk redrive runs each key's rows in receive
//! order; an inline `deliver` on a held key runs nothing, stores nothing,
//! and answers the retryable `Error::KeyHeld`.
//!
//! "Not applied while held" is shown without waiting on time: another
//! key's message received after the death is seen applied, and the queued
//! due query takes rows in receive (id) order, so a held row that was not
//! held would have run in that batch or before it. Every wait is bounded
//! at tens of seconds.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use postroom::{
    admin, handler_fn, EffectContext, EffectHandler, Error, Failure, Message, Outcome, Postroom, Tx,
};

const WAIT: u64 = 60;

/// Records the message (the applied order is rowid order).
fn record(tx: &mut Tx<'_>, msg: &Message) -> Result<(), Failure> {
    tx.execute(
        "INSERT INTO applied (consumer, message_id, payload) VALUES (?1, ?2, ?3)",
        rusqlite::params![tx.consumer().unwrap_or(""), msg.id(), msg.payload()],
    )?;
    Ok(())
}

/// The ids `consumer` applied, in the order applied, of those starting
/// with `prefix`.
fn applied(conn: &rusqlite::Connection, consumer: &str, prefix: &str) -> Vec<String> {
    let mut stmt = conn
        .prepare(
            "SELECT message_id FROM applied WHERE consumer = ?1 AND substr(message_id, 1, ?3) = ?2
             ORDER BY rowid",
        )
        .unwrap();
    let rows = stmt
        .query_map(
            rusqlite::params![consumer, prefix, prefix.len() as i64],
            |r| r.get(0),
        )
        .unwrap();
    rows.map(Result::unwrap).collect()
}

/// Edits `first..=last` of document `doc`, keyed by it.
fn edits(doc: &str, first: u32, last: u32) -> Vec<Message> {
    (first..=last)
        .map(|i| Message::new("editor", format!("{doc}/{i}"), "edit").with_ordering_key(doc))
        .collect()
}

fn ids(doc: &str, numbers: &[u32]) -> Vec<String> {
    numbers.iter().map(|i| format!("{doc}/{i}")).collect()
}

/// Fails the edits named in `failing` while `on` is set.
fn failing_handler(
    failing: &'static [&'static str],
    on: Arc<AtomicBool>,
) -> impl Fn(&mut Tx<'_>, &Message) -> Result<(), Failure> + Send + Sync + 'static {
    move |tx: &mut Tx<'_>, msg: &Message| {
        if on.load(Ordering::SeqCst) && failing.iter().any(|f| *f == msg.id()) {
            return Err(Failure::retry("the base edit is missing"));
        }
        record(tx, msg)
    }
}

/// The effectful twin: its external step fails the same edits.
struct FailingEffect {
    failing: &'static [&'static str],
    on: Arc<AtomicBool>,
}

impl EffectHandler for FailingEffect {
    type Output = ();

    fn effect(&self, _ctx: &EffectContext<'_>, msg: &Message) -> Result<(), Failure> {
        if self.on.load(Ordering::SeqCst) && self.failing.iter().any(|f| *f == msg.id()) {
            return Err(Failure::retry("the base edit is missing"));
        }
        Ok(())
    }

    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, (): ()) -> Result<(), Failure> {
        record(tx, msg)
    }
}

/// Quick retries, two attempts, a short poll: a failing edit dies fast.
fn builder() -> postroom::Builder {
    Postroom::builder()
        .max_attempts(2)
        .backoff(Duration::from_millis(1), Duration::from_millis(1))
        .poll_interval(Duration::from_millis(20))
}

fn dead(room: &Postroom, consumer: &str) -> u64 {
    room.stats()
        .unwrap()
        .inbox
        .get(consumer)
        .map_or(0, |c| c.dead)
}

/// The dead letters of `consumer`, as (row id, message id), in id order.
fn dead_letters(room: &Postroom, consumer: &str) -> Vec<(i64, String)> {
    room.dead_letters(Some(consumer), 100)
        .unwrap()
        .into_iter()
        .map(|d| (d.id, d.message.id().to_owned()))
        .collect()
}

/// Receives edits 1..=5 of `doc-1` and 1..=3 of `doc-2` for `consumer`,
/// waits for edit 3 of `doc-1` to die and `doc-2` to apply, then receives
/// `doc-2/4` and waits for it: a batch ran after the death.
fn edit_3_dies(room: &Postroom, conn: &rusqlite::Connection, consumer: &str) {
    let mut msgs = edits("doc-1", 1, 5);
    msgs.extend(edits("doc-2", 1, 3));
    room.receive_batch(consumer, msgs).unwrap();
    eventually(WAIT, "edit 3 dead", || dead(room, consumer) == 1);
    assert_eq!(dead_letters(room, consumer)[0].1, "doc-1/3");
    room.receive_batch(consumer, edits("doc-2", 4, 4)).unwrap();
    eventually(WAIT, "the other document's edits applied", || {
        applied(conn, consumer, "doc-2/").len() == 4
    });
}

/// The words: a dead edit holds its document's later edits until
/// it is redriven, then all apply in order, each once; other documents
/// keep flowing. Transactional and effectful consumers alike; `status`
/// shows the held key and its age meanwhile.
#[test]
fn a_dead_edit_holds_its_documents_later_edits_until_redriven() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let on = Arc::new(AtomicBool::new(true));
    const FAILING: &[&str] = &["doc-1/3"];
    let room = builder()
        .consumer("tx", handler_fn(failing_handler(FAILING, Arc::clone(&on))))
        .effectful_consumer(
            "fx",
            FailingEffect {
                failing: FAILING,
                on: Arc::clone(&on),
            },
        )
        .strict_order("tx")
        .strict_order("fx")
        .open(&db)
        .unwrap();
    create_domain(&room);
    let conn = raw(&db);
    for consumer in ["tx", "fx"] {
        edit_3_dies(&room, &conn, consumer);
        assert_eq!(
            applied(&conn, consumer, "doc-1/"),
            ids("doc-1", &[1, 2]),
            "{consumer}: edits 4 and 5 must wait for edit 3"
        );
    }
    // The operator sees the held key, and how long it has been held.
    let status = admin::status(&conn, &db).unwrap();
    for consumer in ["tx", "fx"] {
        let c = status
            .consumers
            .iter()
            .find(|c| c.consumer == consumer)
            .unwrap();
        assert!(c.strict_order, "{c:?}");
        assert_eq!(c.held_keys, 1, "{c:?}");
        assert!(c.oldest_held_age_ms.is_some(), "{c:?}");
    }
    let cli = std::process::Command::new(env!("CARGO_BIN_EXE_postroom"))
        .arg(&db)
        .arg("status")
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&cli.stdout);
    assert!(cli.status.success(), "{shown}");
    for consumer in ["tx", "fx"] {
        let line = format!("strict order {consumer}: 1 key held by dead letters, oldest ");
        assert!(shown.contains(&line), "{shown}");
    }
    let metrics = admin::prometheus(&status);
    for consumer in ["tx", "fx"] {
        let sample = format!("postroom_strict_held_keys{{consumer=\"{consumer}\"}} 1");
        assert!(metrics.contains(&sample), "{metrics}");
    }
    on.store(false, Ordering::SeqCst);
    for consumer in ["tx", "fx"] {
        let (id, _) = dead_letters(&room, consumer)[0];
        assert!(room.redrive(id).unwrap());
        eventually(WAIT, "the held edits applied", || {
            applied(&conn, consumer, "doc-1/").len() == 5
        });
        assert_eq!(
            applied(&conn, consumer, "doc-1/"),
            ids("doc-1", &[1, 2, 3, 4, 5]),
            "{consumer}: in order, each once"
        );
    }
    let status = admin::status(&conn, &db).unwrap();
    assert!(
        status.consumers.iter().all(|c| c.held_keys == 0),
        "{status:?}"
    );
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// Discarding the dead edit releases its key: the later edits apply, the
/// discarded one never does.
#[test]
fn discarding_the_dead_edit_releases_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let on = Arc::new(AtomicBool::new(true));
    let room = builder()
        .consumer("tx", handler_fn(failing_handler(&["doc-1/3"], on)))
        .strict_order("tx")
        .open(&db)
        .unwrap();
    create_domain(&room);
    let conn = raw(&db);
    edit_3_dies(&room, &conn, "tx");
    assert_eq!(applied(&conn, "tx", "doc-1/"), ids("doc-1", &[1, 2]));
    let (id, _) = dead_letters(&room, "tx")[0];
    assert!(room.discard(id).unwrap());
    eventually(WAIT, "the rest of the document applied", || {
        applied(&conn, "tx", "doc-1/").len() == 4
    });
    assert_eq!(applied(&conn, "tx", "doc-1/"), ids("doc-1", &[1, 2, 4, 5]));
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// Without the option a dead edit releases its key, as before: the later
/// edits apply at once, and a redriven edit lands after them.
#[test]
fn by_default_a_dead_edit_releases_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let on = Arc::new(AtomicBool::new(true));
    let room = builder()
        .consumer(
            "tx",
            handler_fn(failing_handler(&["doc-1/3"], Arc::clone(&on))),
        )
        .open(&db)
        .unwrap();
    create_domain(&room);
    let conn = raw(&db);
    edit_3_dies(&room, &conn, "tx");
    eventually(WAIT, "edits 4 and 5 applied past the dead one", || {
        applied(&conn, "tx", "doc-1/").len() == 4
    });
    on.store(false, Ordering::SeqCst);
    let (id, _) = dead_letters(&room, "tx")[0];
    assert!(room.redrive(id).unwrap());
    eventually(WAIT, "the redriven edit applied", || {
        applied(&conn, "tx", "doc-1/").len() == 5
    });
    assert_eq!(
        applied(&conn, "tx", "doc-1/"),
        ids("doc-1", &[1, 2, 4, 5, 3])
    );
    let status = admin::status(&conn, &db).unwrap();
    assert!(
        status.consumers.iter().all(|c| !c.strict_order),
        "{status:?}"
    );
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// Edits 3, 4 and 5 of `doc-1` dead for consumers `plain` and `strict`,
/// edits 1 and 2 applied: written by an engine without strict order (with
/// it, edit 4 never runs while 3 is dead).
fn three_dead_edits(db: &std::path::Path) {
    let on = Arc::new(AtomicBool::new(true));
    const FAILING: &[&str] = &["doc-1/3", "doc-1/4", "doc-1/5"];
    let room = builder()
        .consumer(
            "plain",
            handler_fn(failing_handler(FAILING, Arc::clone(&on))),
        )
        .consumer("strict", handler_fn(failing_handler(FAILING, on)))
        .open(db)
        .unwrap();
    create_domain(&room);
    for consumer in ["plain", "strict"] {
        room.receive_batch(consumer, edits("doc-1", 1, 5)).unwrap();
        eventually(WAIT, "edits 3, 4 and 5 dead", || dead(&room, consumer) == 3);
    }
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// A bulk redrive (the CLI's `dead redrive --all`, from another process's
/// connection) applies each key's dead rows in receive order, whatever
/// order the ids come in: a redrive changes a row in place, so the key's
/// head is its lowest id. With strict order or without.
#[test]
fn a_bulk_redrive_applies_a_keys_dead_edits_in_receive_order() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    three_dead_edits(&db);
    let room = builder()
        .consumer("plain", handler_fn(record))
        .consumer("strict", handler_fn(record))
        .strict_order("strict")
        .open(&db)
        .unwrap();
    let conn = raw(&db);
    let admin_conn = admin::open(&db, admin::Access::ReadWrite).unwrap();
    let mut ids_to_redrive = admin::dead_select(
        &admin_conn,
        &admin::DeadFilter::default(),
        admin::Page::all(),
    )
    .unwrap();
    assert_eq!(ids_to_redrive.len(), 6);
    ids_to_redrive.reverse();
    let now = admin::now_ms();
    let summary = admin::act_on_dead_letters(
        &admin_conn,
        admin::DeadLetterAction::Redrive,
        false,
        &ids_to_redrive,
        now,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(summary.done, 6);
    for consumer in ["plain", "strict"] {
        eventually(WAIT, "the redriven edits applied", || {
            applied(&conn, consumer, "doc-1/").len() == 5
        });
        assert_eq!(
            applied(&conn, consumer, "doc-1/"),
            ids("doc-1", &[1, 2, 3, 4, 5]),
            "{consumer}"
        );
    }
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// Under strict order even one-by-one redrives, latest first, apply in
/// receive order: a redriven edit waits while an earlier one is dead.
#[test]
fn redriving_one_by_one_latest_first_still_applies_in_order_under_strict_order() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    three_dead_edits(&db);
    let room = builder()
        .consumer("plain", handler_fn(record))
        .consumer("strict", handler_fn(record))
        .strict_order("strict")
        .open(&db)
        .unwrap();
    let conn = raw(&db);
    let dead = dead_letters(&room, "strict");
    assert_eq!(
        dead.iter().map(|(_, m)| m.clone()).collect::<Vec<_>>(),
        ids("doc-1", &[3, 4, 5])
    );
    for (id, _) in dead.iter().rev().take(2) {
        assert!(room.redrive(*id).unwrap());
    }
    // A batch ran after those redrives (another key, received after them).
    room.receive_batch("strict", edits("doc-9", 1, 1)).unwrap();
    eventually(WAIT, "the other key applied", || {
        applied(&conn, "strict", "doc-9/").len() == 1
    });
    assert_eq!(
        applied(&conn, "strict", "doc-1/"),
        ids("doc-1", &[1, 2]),
        "edits 4 and 5 wait for edit 3"
    );
    assert!(room.redrive(dead[0].0).unwrap());
    eventually(WAIT, "the redriven edits applied", || {
        applied(&conn, "strict", "doc-1/").len() == 5
    });
    assert_eq!(
        applied(&conn, "strict", "doc-1/"),
        ids("doc-1", &[1, 2, 3, 4, 5])
    );
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// Inline: a `deliver` on a key a dead message holds runs nothing and
/// stores nothing, answering the retryable `Error::KeyHeld` (the broker
/// redelivers it); other keys are delivered. Once the dead edit is
/// redriven and processed, the redelivery is applied after it.
#[test]
fn an_inline_delivery_on_a_held_key_is_refused_retryably_and_stores_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let on = Arc::new(AtomicBool::new(true));
    let room = builder()
        .max_attempts(1)
        .consumer(
            "tx",
            handler_fn(failing_handler(&["doc-1/2"], Arc::clone(&on))),
        )
        .strict_order("tx")
        .open(&db)
        .unwrap();
    create_domain(&room);
    let conn = raw(&db);
    let [e1, e2, e3] = <[Message; 3]>::try_from(edits("doc-1", 1, 3)).unwrap();
    assert!(matches!(
        room.deliver("tx", e1).unwrap(),
        Outcome::Processed { .. }
    ));
    assert!(matches!(
        room.deliver("tx", e2).unwrap(),
        Outcome::Dead { .. }
    ));
    let refused = room.deliver("tx", e3.clone()).unwrap_err();
    assert!(
        matches!(&refused, Error::KeyHeld { consumer, ordering_key }
            if consumer == "tx" && ordering_key == "doc-1"),
        "{refused:?}"
    );
    assert!(refused.is_retryable());
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM postroom_inbox WHERE message_id = 'doc-1/3'"
        ),
        0,
        "nothing stored"
    );
    let other = Message::new("editor", "doc-2/1", "edit").with_ordering_key("doc-2");
    assert!(matches!(
        room.deliver("tx", other).unwrap(),
        Outcome::Processed { .. }
    ));
    on.store(false, Ordering::SeqCst);
    let (id, _) = dead_letters(&room, "tx")[0];
    assert!(room.redrive(id).unwrap());
    eventually(WAIT, "the redriven edit applied by the workers", || {
        applied(&conn, "tx", "doc-1/").len() == 2
    });
    assert!(matches!(
        room.deliver("tx", e3).unwrap(),
        Outcome::Processed { .. }
    ));
    assert_eq!(applied(&conn, "tx", "doc-1/"), ids("doc-1", &[1, 2, 3]));
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// A consumer named for strict order must be registered.
#[test]
fn strict_order_for_an_unknown_consumer_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let refused = Postroom::builder()
        .strict_order("nobody")
        .open(dir.path().join("app.db"));
    assert!(
        matches!(
            refused,
            Err(Error::InvalidInput {
                field: "strict_order",
                ..
            })
        ),
        "{refused:?}"
    );
}

/// `dead_retention` deletes dead letters on its own, and a deleted dead
/// letter releases its key (nothing else holds it): the document's later
/// edits would apply past the dead one with no operator's say, on a base
/// it never produced. An engine with strict order refuses it at open.
#[test]
fn strict_order_with_dead_retention_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let refused = builder()
        .consumer("tx", handler_fn(record))
        .strict_order("tx")
        .dead_retention(Some(Duration::from_secs(30 * 24 * 3600)))
        .open(dir.path().join("app.db"));
    assert!(
        matches!(
            refused,
            Err(Error::InvalidInput {
                field: "strict_order",
                ..
            })
        ),
        "{:?}",
        refused.map(|_| "opened")
    );
}

/// A bulk redrive larger than one transaction (`admin::CLEANUP_BATCH`)
/// keeps each key's order whatever order its ids come in (newest first,
/// as `admin::Page::default()` lists them): after each transaction, no
/// redriven row of a key has a dead row of its key before it. Otherwise
/// a key's later dead edit, redriven in an earlier transaction, is its
/// key's head and runs (by default order, where the dead one before it
/// does not hold it) before the earlier edit is redriven at all.
#[test]
fn a_bulk_redrive_over_many_transactions_redrives_each_keys_earliest_first() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    {
        let room = builder()
            .consumer(
                "plain",
                handler_fn(|_: &mut Tx<'_>, _: &Message| Err(Failure::reject("no base"))),
            )
            .open(&db)
            .unwrap();
        // doc-1's edits are the first and the last of the batch: their
        // ids are more than a transaction of redrives apart.
        let total = admin::CLEANUP_BATCH + 50;
        let mut msgs = edits("doc-1", 1, 1);
        msgs.extend((0..total - 2).map(|i| Message::new("editor", format!("other-{i}"), "edit")));
        msgs.extend(edits("doc-1", 2, 2));
        room.receive_batch("plain", msgs).unwrap();
        eventually(WAIT, "every edit dead", || {
            dead(&room, "plain") == total as u64
        });
        room.shutdown(Duration::from_secs(10)).unwrap();
    }
    let admin_conn = admin::open(&db, admin::Access::ReadWrite).unwrap();
    let newest_first = admin::dead_select(
        &admin_conn,
        &admin::DeadFilter::default(),
        admin::Page {
            limit: usize::MAX,
            ..admin::Page::default()
        },
    )
    .unwrap();
    assert!(newest_first.len() > admin::CLEANUP_BATCH);
    assert!(newest_first.windows(2).all(|w| w[0] > w[1]));
    let inspect = raw(&db);
    let mut out_of_order = Vec::new();
    let summary = admin::act_on_dead_letters(
        &admin_conn,
        admin::DeadLetterAction::Redrive,
        false,
        &newest_first,
        admin::now_ms(),
        &mut |handled| {
            let n = count(
                &inspect,
                "SELECT count(*) FROM postroom_inbox p JOIN postroom_inbox d
                   ON d.consumer = p.consumer AND d.ordering_key = p.ordering_key
                 WHERE p.status = 'pending' AND d.status = 'dead' AND d.id < p.id",
            );
            if n > 0 {
                out_of_order.push((handled, n));
            }
        },
    )
    .unwrap();
    assert_eq!(summary.done, newest_first.len() as u64);
    assert!(
        out_of_order.is_empty(),
        "after (rows handled, rows redriven ahead of a dead earlier one of their key): \
         {out_of_order:?}"
    );
}
