//! Crash tests: a real child process (this test binary, re-executed) is
//! killed with SIGKILL or aborts itself; the parent re-opens the database
//! and checks that nothing acknowledged was lost and nothing applied twice.
//!
//! `POSTROOM_CRASH_KILLS` sets the number of kills of the randomized test
//! (default 300), `POSTROOM_QUEUED_KILLS`, `POSTROOM_RELAY_KILLS` and
//! `POSTROOM_SEQUENCED_KILLS` those of the queued, relay and sequence
//! watermark tests (default 100 each); `POSTROOM_SEED` replays a run.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::thread;
use std::time::Duration;

use common::*;
use postroom::{
    handler_fn, EffectContext, EffectHandler, Failure, InboxSink, ManualClock, Message, Outcome,
    Postroom, Tx,
};
use std::sync::Arc;

/// Entry point of the child processes. Not a test: it only does something
/// when started by `spawn_child`, and is ignored otherwise.
#[test]
#[ignore = "entry point for child processes of the crash tests"]
fn child_main() {
    let Some((role, db)) = child_role() else {
        return;
    };
    // libtest has printed "test child_main ... " without a newline; end
    // that line so every protocol line starts a line of its own.
    report("");
    match role.as_str() {
        "hang-in-handler" => child_hang_in_handler(&db),
        "crash-loop" => child_crash_loop(&db),
        "stream" => child_stream(&db),
        "queued" => child_queued(&db),
        "relay" => child_relay(&db),
        "queued-poison" => child_queued_poison(&db),
        "sequenced" => child_sequenced(&db),
        other => panic!("unknown child role {other}"),
    }
}

/// What the children said: what they were about to hand to the engine
/// (`SEND ` lines, written before the call) and what the engine told them
/// to acknowledge (`ACK ` lines, written after it). A message sent and
/// never acknowledged is one the children's broker would redeliver.
#[derive(Debug, Default)]
struct Heard {
    sent: BTreeSet<String>,
    acked: BTreeSet<String>,
}

impl Heard {
    /// Sent and never acknowledged: what a broker redelivers.
    fn unacked(&self) -> Vec<String> {
        self.sent.difference(&self.acked).cloned().collect()
    }
}

/// Rows that only a redelivery revives (failed, and no worker retries
/// them), as `consumer message_id`.
const WAITING_FOR_REDELIVERY: &str = "SELECT consumer || ' ' || message_id FROM postroom_inbox
     WHERE status = 'failed' AND queued = 0";

/// Starts child `role` on `db` `kills` times, each with its own seed, and
/// SIGKILLs it at a random moment: up to `max_us` after it said READY, or,
/// one time in eight when `early`, while it is still opening (schema,
/// recovery). Returns everything the children acknowledged (what followed
/// `ACK ` on their lines).
fn kill_randomly(
    role: &str,
    db: &Path,
    rng: &mut Rng,
    kills: u64,
    max_us: u64,
    early: bool,
) -> Vec<String> {
    kill_randomly_heard(role, db, rng, kills, max_us, early)
        .acked
        .into_iter()
        .collect()
}

/// [`kill_randomly`], also returning what the children sent.
fn kill_randomly_heard(
    role: &str,
    db: &Path,
    rng: &mut Rng,
    kills: u64,
    max_us: u64,
    early: bool,
) -> Heard {
    let mut heard = Heard::default();
    for k in 0..kills {
        let mut child = spawn_child(role, db, &[("POSTROOM_SEED", rng.next_u64().to_string())]);
        let lines = lines_of(&mut child);
        if early && rng.below(8) == 0 {
            thread::sleep(Duration::from_micros(rng.below(20_000)));
        } else {
            wait_for(&lines, "READY");
            thread::sleep(Duration::from_micros(rng.below(max_us)));
        }
        child.kill().unwrap();
        let status = child.wait().unwrap();
        assert!(
            was_killed(&status) || status.success(),
            "{role} kill {k}: {status:?}"
        );
        for (_, line) in lines.iter() {
            if let Some(acked) = line.strip_prefix("ACK ") {
                heard.acked.insert(acked.to_owned());
            } else if let Some(sent) = line.strip_prefix("SEND ") {
                heard.sent.insert(sent.to_owned());
            }
        }
    }
    heard
}

// ---------------------------------------------------------------------------
// Seed test 1: crash after the business logic, before the status update.

fn child_hang_in_handler(db: &Path) {
    let room = Postroom::builder()
        .workers(0)
        .consumer(
            "orders",
            handler_fn(|tx, msg| {
                apply(tx, msg)?;
                // The domain write is done; COMMIT has not happened. Tell the
                // parent, which kills us right here.
                report("IN-HANDLER");
                thread::sleep(Duration::from_secs(60));
                Ok(())
            }),
        )
        .open(db)
        .unwrap();
    create_domain(&room);
    room.deliver("orders", Message::new("broker", "evt-1", "pay"))
        .unwrap();
    unreachable!("the parent kills this process inside the handler");
}

#[test]
fn sigkill_between_the_handlers_write_and_commit_then_redelivery_applies_once() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let mut child = spawn_child("hang-in-handler", &db, &[]);
    let lines = lines_of(&mut child);
    wait_for(&lines, "IN-HANDLER");
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    assert!(was_killed(&status), "{status:?}");

    let room = Postroom::builder()
        .workers(0)
        .consumer("orders", handler_fn(apply))
        .open(&db)
        .unwrap();
    let conn = raw(&db);
    assert_eq!(
        applied_count(&conn, "evt-1"),
        0,
        "the uncommitted write is gone"
    );
    // The attempt that died was counted, and the row is due at once.
    let (status, attempts, error, payload) = inbox_row(&conn, "orders", "broker", "evt-1").unwrap();
    assert_eq!((status.as_str(), attempts), ("failed", 1));
    assert!(error.unwrap().contains("process died"));
    assert_eq!(payload.as_deref(), Some(&b"pay"[..]));

    let msg = Message::new("broker", "evt-1", "pay");
    assert_eq!(
        room.deliver("orders", msg.clone()).unwrap(),
        Outcome::Processed { attempts: 2 }
    );
    assert_eq!(room.deliver("orders", msg).unwrap(), Outcome::Duplicate);
    assert_eq!(applied_count(&conn, "evt-1"), 1);
    assert_eq!(count(&conn, "SELECT count(*) FROM postroom_outbox"), 1);
    integrity_ok(&conn);
}

// ---------------------------------------------------------------------------
// A handler that kills the process is counted: no endless crash loop.

const CRASH_LOOP_MAX_ATTEMPTS: u32 = 3;

fn child_crash_loop(db: &Path) {
    let room = Postroom::builder()
        // Inline only: workers would otherwise retry the failed row too.
        .workers(0)
        .max_attempts(CRASH_LOOP_MAX_ATTEMPTS)
        .consumer(
            "c",
            handler_fn(|tx, msg| {
                if msg.id() == "poison" {
                    report("ABORTING");
                    std::process::abort();
                }
                apply(tx, msg)
            }),
        )
        .open(db)
        .unwrap();
    create_domain(&room);
    for id in ["a", "poison", "b"] {
        let outcome = room.deliver("c", Message::new("s", id, "x")).unwrap();
        report(&format!("OUTCOME {id} {outcome:?}"));
    }
    report("DONE");
}

#[test]
fn a_handler_that_aborts_the_process_is_dead_lettered_after_max_attempts() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let mut aborts = 0;
    let mut finished = None;
    for run in 0..10 {
        let mut child = spawn_child("crash-loop", &db, &[]);
        let lines = lines_of(&mut child);
        let status = wait_or_kill(&mut child, 120, "crash-loop child");
        let said: Vec<String> = lines.iter().map(|(_, line)| line).collect();
        if status.success() {
            finished = Some(said);
            break;
        }
        assert!(was_aborted(&status), "run {run}: {status:?} {said:?}");
        assert!(said.contains(&"ABORTING".to_string()), "{said:?}");
        aborts += 1;
    }
    assert_eq!(
        aborts, CRASH_LOOP_MAX_ATTEMPTS,
        "one abort per attempt, then dead"
    );
    let said = finished.expect("the application stopped crash-looping");
    assert!(
        said.iter().any(|l| l.starts_with("OUTCOME poison Dead")),
        "{said:?}"
    );
    assert!(
        said.contains(&"OUTCOME b Processed { attempts: 1 }".to_string()),
        "{said:?}"
    );
    assert!(
        said.contains(&"OUTCOME a Duplicate".to_string()),
        "{said:?}"
    );

    let conn = raw(&db);
    let (status, attempts, error, payload) = inbox_row(&conn, "c", "s", "poison").unwrap();
    assert_eq!(
        (status.as_str(), attempts),
        ("dead", i64::from(CRASH_LOOP_MAX_ATTEMPTS))
    );
    assert!(error.unwrap().contains("process died"));
    assert_eq!(
        payload.as_deref(),
        Some(&b"x"[..]),
        "the dead letter keeps its payload"
    );
    assert_eq!(applied_count(&conn, "a"), 1);
    assert_eq!(applied_count(&conn, "b"), 1);
    assert_eq!(applied_count(&conn, "poison"), 0);
    integrity_ok(&conn);
}

// ---------------------------------------------------------------------------
// Randomized: kill -9 a delivering child at random moments, many times.

/// Distinct message ids in the randomized test; deliveries pick among them,
/// so most ids are delivered several times (duplicates) across children.
const STREAM_IDS: u64 = 400;

fn stream_room(db: &Path) -> Postroom {
    Postroom::builder()
        // Crash attempts are counted; the point here is exactly-once, so
        // give every message room to be killed in many times.
        .max_attempts(1_000_000)
        .backoff(Duration::from_millis(1), Duration::from_millis(1))
        .consumer(
            "c",
            handler_fn(|tx, msg| {
                apply(tx, msg)?;
                // Some work after the domain write, so that kills land
                // inside handlers too, not only in commits.
                thread::sleep(Duration::from_micros(300));
                // Every 7th message fails its first attempt: failed rows are
                // part of what crashes must not disturb.
                let n: u64 = msg.id()[1..].parse().unwrap();
                if n.is_multiple_of(7) && tx.attempt() == 1 {
                    return Err(Failure::retry_after("flaky", Duration::ZERO));
                }
                Ok(())
            }),
        )
        .open(db)
        .unwrap()
}

fn child_stream(db: &Path) {
    let seed = env_u64("POSTROOM_SEED").unwrap();
    let room = stream_room(db);
    create_domain(&room);
    report("READY");
    let mut rng = Rng::new(seed);
    for _ in 0..100_000 {
        let id = format!("m{}", rng.below(STREAM_IDS));
        let outcome = room
            .deliver(
                "c",
                Message::new("s", id.clone(), format!("payload of {id}")),
            )
            .unwrap();
        if outcome.should_ack() {
            report(&format!("ACK {id}"));
        }
    }
    report("DONE");
}

#[test]
fn random_sigkills_lose_nothing_acknowledged_and_apply_nothing_twice() {
    let kills = env_u64("POSTROOM_CRASH_KILLS").unwrap_or(300);
    let seed = seed();
    eprintln!("random_sigkills: {kills} kills, POSTROOM_SEED={seed}");
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let mut rng = Rng::new(seed);
    // Anywhere from while it is still opening (schema, recovery) to a few
    // dozen commits in.
    let acked: BTreeSet<String> = kill_randomly("stream", &db, &mut rng, kills, 30_000, true)
        .into_iter()
        .collect();
    assert!(
        !acked.is_empty(),
        "no child acknowledged anything; the test proves nothing"
    );

    // Recovery: open, then redeliver every id until it may be acked.
    let room = stream_room(&db);
    create_domain(&room);
    for n in 0..STREAM_IDS {
        let id = format!("m{n}");
        let mut tries = 0;
        loop {
            let outcome = room
                .deliver(
                    "c",
                    Message::new("s", id.clone(), format!("payload of {id}")),
                )
                .unwrap();
            if outcome.should_ack() {
                assert!(
                    matches!(outcome, Outcome::Processed { .. } | Outcome::Duplicate),
                    "{id}: {outcome:?}"
                );
                break;
            }
            tries += 1;
            assert!(tries < 100, "{id} never became ackable: {outcome:?}");
            thread::sleep(Duration::from_millis(2));
        }
    }
    let conn = raw(&db);
    integrity_ok(&conn);
    let mut lost = BTreeSet::new();
    let mut duplicated = BTreeSet::new();
    for n in 0..STREAM_IDS {
        let id = format!("m{n}");
        match applied_count(&conn, &id) {
            1 => {}
            0 => {
                lost.insert(id);
            }
            _ => {
                duplicated.insert(id);
            }
        }
    }
    assert!(
        lost.is_empty() && duplicated.is_empty(),
        "seed {seed}: lost {lost:?}, duplicated {duplicated:?}"
    );
    for id in &acked {
        assert_eq!(
            applied_count(&conn, id),
            1,
            "seed {seed}: acknowledged {id}"
        );
    }
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM postroom_inbox WHERE status = 'completed'"
        ),
        STREAM_IDS as i64
    );
    assert_eq!(
        count(&conn, "SELECT count(*) FROM (SELECT cause_message_id FROM postroom_outbox GROUP BY cause_message_id HAVING count(*) = 1)"),
        STREAM_IDS as i64,
        "one outbox row per message"
    );
    // Attempts beyond the one that committed (and the planned flaky one)
    // are kills that landed while a handler ran and were counted.
    let planned = STREAM_IDS + STREAM_IDS.div_ceil(7);
    let crash_attempts = count(&conn, "SELECT sum(attempts) FROM postroom_inbox") - planned as i64;
    eprintln!(
        "random_sigkills: {kills} kills survived, {} distinct ids acknowledged before a kill, \
         {crash_attempts} kills landed inside a handler and were counted",
        acked.len()
    );
    assert!(crash_attempts >= 0);
}

// ---------------------------------------------------------------------------
// Queued mode: kill -9 while workers are mid-handler, of both kinds.

/// Distinct ids in the queued test, received by both consumers.
const QUEUED_IDS: u64 = 600;

/// An effectful consumer: the "external call" hands its attempt number to
/// the transactional step, which records it.
struct Charge;

impl EffectHandler for Charge {
    type Output = u32;
    fn effect(&self, ctx: &EffectContext<'_>, _msg: &Message) -> Result<u32, Failure> {
        thread::sleep(Duration::from_micros(300));
        Ok(ctx.attempt())
    }
    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, attempt: u32) -> Result<(), Failure> {
        tx.execute(
            "INSERT INTO applied (consumer, message_id, payload) VALUES ('fx', ?1, ?2)",
            rusqlite::params![msg.id(), attempt.to_string()],
        )?;
        Ok(())
    }
}

fn queued_room(db: &Path, workers: usize) -> Postroom {
    Postroom::builder()
        .workers(workers)
        .max_attempts(1_000_000)
        .poll_interval(Duration::from_millis(5))
        .backoff(Duration::from_millis(1), Duration::from_millis(1))
        .consumer(
            "tx",
            handler_fn(|tx, msg| {
                apply(tx, msg)?;
                thread::sleep(Duration::from_micros(300));
                Ok(())
            }),
        )
        .effectful_consumer("fx", Charge)
        .open(db)
        .unwrap()
}

fn child_queued(db: &Path) {
    let seed = env_u64("POSTROOM_SEED").unwrap();
    let room = queued_room(db, 2);
    create_domain(&room);
    report("READY");
    let mut rng = Rng::new(seed);
    for _ in 0..10_000 {
        let batch: Vec<Message> = (0..rng.below(20) + 1)
            .map(|_| {
                let id = format!("q{}", rng.below(QUEUED_IDS));
                Message::new("s", id.clone(), format!("payload of {id}"))
            })
            .collect();
        for consumer in ["tx", "fx"] {
            // Said before the call: a kill inside it leaves these sent and
            // never acknowledged, which a broker would redeliver.
            for msg in &batch {
                report(&format!("SEND {consumer} {}", msg.id()));
            }
            let receipts = room.receive_batch(consumer, batch.clone()).unwrap();
            for (msg, receipt) in batch.iter().zip(receipts) {
                assert!(receipt.should_ack());
                report(&format!("ACK {consumer} {}", msg.id()));
            }
        }
        thread::sleep(Duration::from_millis(1));
    }
    report("DONE");
}

#[test]
fn random_sigkills_while_workers_run_lose_nothing_and_apply_nothing_twice() {
    let kills = env_u64("POSTROOM_QUEUED_KILLS").unwrap_or(100);
    let seed = seed();
    eprintln!("queued_sigkills: {kills} kills, POSTROOM_SEED={seed}");
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let mut rng = Rng::new(seed);
    let heard = kill_randomly_heard("queued", &db, &mut rng, kills, 40_000, true);
    let pair = |line: &String| {
        let (consumer, id) = line.split_once(' ').unwrap();
        (consumer.to_owned(), id.to_owned())
    };
    let acked: BTreeSet<(String, String)> = heard.acked.iter().map(pair).collect();
    assert!(
        !acked.is_empty(),
        "nothing was acknowledged; the test proves nothing"
    );

    let room = queued_room(&db, 2);
    let conn = raw(&db);
    // The broker's redelivery: every message sent and never acknowledged
    // (a kill inside `receive_batch`) comes again. Only that revives a
    // message recovery counted while its receipt was uncommitted (processed
    // in the receipt's own transaction): it waits, failed and not queued,
    // for exactly this. Acknowledged ones are the workers' to finish.
    let unacked: Vec<(String, String)> = heard.unacked().iter().map(pair).collect();
    // Recovery ran at open. A row waiting for a redelivery must be one the
    // broker will redeliver: an acknowledged one would wait for ever.
    let waiting: Vec<String> = column(&conn, WAITING_FOR_REDELIVERY);
    for line in &waiting {
        assert!(
            !acked.contains(&pair(line)),
            "seed {seed}: acknowledged {line} waits for a redelivery that never comes"
        );
    }
    for (consumer, id) in &unacked {
        let receipt = room
            .receive(
                consumer,
                Message::new("s", id.clone(), format!("payload of {id}")),
            )
            .unwrap();
        assert!(receipt.should_ack(), "{consumer}/{id}: {receipt:?}");
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let left = count(
            &conn,
            "SELECT count(*) FROM postroom_inbox WHERE status IN ('pending', 'processing', 'failed')",
        );
        if left == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "seed {seed}: {left} messages never finished: {:?}",
            column::<Vec<String>>(
                &conn,
                "SELECT consumer || '/' || message_id || ' ' || status || ' queued=' || queued
                     || ' attempts=' || attempts || ' ' || coalesce(last_error, '')
                 FROM postroom_inbox WHERE status != 'completed' LIMIT 10"
            )
        );
        thread::sleep(Duration::from_millis(20));
    }
    room.shutdown(Duration::from_secs(10)).unwrap();
    integrity_ok(&conn);
    let mut lost = Vec::new();
    for (consumer, id) in &acked {
        let (status, ..) = inbox_row(&conn, consumer, "s", id)
            .unwrap_or_else(|| panic!("seed {seed}: acknowledged {consumer}/{id} was lost"));
        if status != "completed" {
            lost.push(format!("{consumer}/{id}: {status}"));
        }
    }
    assert!(lost.is_empty(), "seed {seed}: {lost:?}");
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM postroom_inbox WHERE status != 'completed'"
        ),
        0
    );
    // Every stored message's transactional step applied exactly once.
    let twice = count(
        &conn,
        "SELECT count(*) FROM (SELECT consumer, message_id FROM applied
                              GROUP BY consumer, message_id HAVING count(*) > 1)",
    );
    let missing = count(
        &conn,
        "SELECT count(*) FROM postroom_inbox i WHERE NOT EXISTS (
             SELECT 1 FROM applied a WHERE a.consumer = i.consumer AND a.message_id = i.message_id)",
    );
    assert_eq!(
        (twice, missing),
        (0, 0),
        "seed {seed}: applied twice / not applied"
    );
    // Nothing stored that was never sent.
    let sent: BTreeSet<(String, String)> = heard.sent.iter().map(pair).collect();
    let stored: Vec<String> = column(
        &conn,
        "SELECT consumer || ' ' || message_id FROM postroom_inbox",
    );
    for line in &stored {
        assert!(sent.contains(&pair(line)), "seed {seed}: {line} never sent");
    }
    let reclaimed = count(
        &conn,
        "SELECT count(*) FROM postroom_inbox WHERE attempts > 1",
    );
    eprintln!(
        "queued_sigkills: {kills} kills survived, {} acknowledged receipts, {} redelivered \
         ({} of them waiting for it), {} messages, {reclaimed} needed more than one attempt",
        acked.len(),
        unacked.len(),
        waiting.len(),
        count(&conn, "SELECT count(*) FROM postroom_inbox")
    );
}

// ---------------------------------------------------------------------------
// The relay: kill -9 between the sink's hand-over and mark-sent.

/// Service B: records each message it gets; publishes nothing.
fn downstream(db: &Path) -> Arc<Postroom> {
    let room = Postroom::builder()
        .poll_interval(Duration::from_millis(5))
        .consumer("b", handler_fn(record_as_b))
        .open(db)
        .unwrap();
    create_domain(&room);
    Arc::new(room)
}

/// Service A: applies and publishes; its relay delivers into B's inbox.
fn upstream(db: &Path, b: &Arc<Postroom>) -> Postroom {
    let room = Postroom::builder()
        .relay_poll(Duration::from_millis(10))
        .relay_batch(16)
        .consumer("a", handler_fn(apply))
        .sink(InboxSink::new(Arc::clone(b), "b"))
        .open(db)
        .unwrap();
    create_domain(&room);
    room
}

fn b_path(db: &Path) -> std::path::PathBuf {
    db.with_file_name("b.db")
}

fn child_relay(db: &Path) {
    let seed = env_u64("POSTROOM_SEED").unwrap();
    let b = downstream(&b_path(db));
    let a = upstream(db, &b);
    report("READY");
    let mut rng = Rng::new(seed);
    for _ in 0..100_000 {
        let id = format!("r{}", rng.below(STREAM_IDS));
        // Said before the call: see `Heard`.
        report(&format!("SEND {id}"));
        if a.deliver("a", Message::new("s", id.clone(), id.clone()))
            .unwrap()
            .should_ack()
        {
            report(&format!("ACK {id}"));
        }
    }
    report("DONE");
}

#[test]
fn random_sigkills_around_the_relay_deliver_every_outbox_row_exactly_once_downstream() {
    let kills = env_u64("POSTROOM_RELAY_KILLS").unwrap_or(100);
    let seed = seed();
    eprintln!("relay_sigkills: {kills} kills, POSTROOM_SEED={seed}");
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("a.db");
    let mut rng = Rng::new(seed);
    let heard = kill_randomly_heard("relay", &db, &mut rng, kills, 30_000, false);
    let acked = &heard.acked;
    assert!(
        !acked.is_empty(),
        "nothing was acknowledged; the test proves nothing"
    );

    let b = downstream(&b_path(&db));
    let a = upstream(&db, &b);
    // The broker's redelivery of what A never acknowledged: a message whose
    // handler a kill interrupted was counted by recovery (failed, attempt
    // 1) and waits for exactly this; inline delivery has no retry of its
    // own.
    let unacked = heard.unacked();
    // Recovery ran at open: a row waiting for a redelivery must be one the
    // broker will redeliver (see the queued test).
    let waiting: Vec<String> = column(&raw(&db), WAITING_FOR_REDELIVERY);
    for line in &waiting {
        let (_, id) = line.split_once(' ').unwrap();
        assert!(
            !acked.contains(id),
            "seed {seed}: acknowledged {line} waits for a redelivery that never comes"
        );
    }
    for id in &unacked {
        let mut tries = 0;
        loop {
            let outcome = a
                .deliver("a", Message::new("s", id.clone(), id.clone()))
                .unwrap();
            if outcome.should_ack() {
                break;
            }
            tries += 1;
            assert!(tries < 100, "{id} never became ackable: {outcome:?}");
            thread::sleep(Duration::from_millis(2));
        }
    }
    let (a_conn, b_conn) = (raw(&db), raw(&b_path(&db)));
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let unsent = count(
            &a_conn,
            "SELECT count(*) FROM postroom_outbox WHERE status != 'sent'",
        );
        let unfinished = count(
            &b_conn,
            "SELECT count(*) FROM postroom_inbox WHERE status != 'completed'",
        );
        if unsent == 0 && unfinished == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{unsent} unsent, {unfinished} unfinished"
        );
        thread::sleep(Duration::from_millis(20));
    }
    a.shutdown(Duration::from_secs(10)).unwrap();
    b.shutdown(Duration::from_secs(10)).unwrap();
    integrity_ok(&a_conn);
    integrity_ok(&b_conn);
    let checked = check_effects(&a_conn, "a", &heard.sent, acked);
    assert!(checked.ok(), "seed {seed}: A: {checked:?}");
    assert_eq!(
        count(
            &a_conn,
            "SELECT count(*) FROM postroom_inbox WHERE status != 'completed'"
        ),
        0,
        "seed {seed}: every message A stored completed"
    );
    // Every committed outbox row of A applied exactly once in B.
    let outbox_ids: Vec<String> = column(&a_conn, "SELECT message_id FROM postroom_outbox");
    assert_eq!(
        outbox_ids.len() as i64,
        count(&a_conn, "SELECT count(*) FROM postroom_inbox")
    );
    for id in &outbox_ids {
        assert_eq!(
            applied_count(&b_conn, id),
            1,
            "seed {seed}: outbox row {id} in B"
        );
    }
    assert_eq!(
        count(&b_conn, "SELECT count(*) FROM applied"),
        outbox_ids.len() as i64
    );
    eprintln!(
        "relay_sigkills: {kills} kills survived; {} outbox rows, each applied once downstream; \
         {} acknowledged ids, {} redelivered ({} of them waiting for it)",
        outbox_ids.len(),
        acked.len(),
        unacked.len(),
        waiting.len()
    );
}

// ---------------------------------------------------------------------------
// Queued crash loop: only the claim that was running is counted.

fn child_queued_poison(db: &Path) {
    let _room = Postroom::builder()
        .max_attempts(3)
        .workers(2)
        .poll_interval(Duration::from_millis(10))
        .consumer(
            "c",
            handler_fn(|tx, msg| {
                if msg.id() == "poison" {
                    report("POISON RUNNING");
                    thread::sleep(Duration::from_secs(60)); // killed in here
                }
                apply(tx, msg)
            }),
        )
        .open(db)
        .unwrap();
    thread::sleep(Duration::from_secs(60));
}

/// A poison message that kills the process every time is dead after
/// `max_attempts` restarts; a message claimed beside it, which only waited
/// behind it, is handed back uncounted each time and is processed once the
/// poison is out of the way (found by review: it used to die with it).
#[test]
fn a_queued_poison_crash_loop_dead_letters_the_poison_not_its_neighbours() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    {
        let room = Postroom::builder()
            .workers(0)
            .consumer("c", handler_fn(apply))
            .open(&db)
            .unwrap();
        create_domain(&room);
        room.receive_batch(
            "c",
            vec![
                Message::new("s", "poison", "p"),
                Message::new("s", "innocent", "i"),
            ],
        )
        .unwrap();
    }
    for run in 0..3 {
        let mut child = spawn_child("queued-poison", &db, &[]);
        let lines = lines_of(&mut child);
        wait_for(&lines, "POISON RUNNING");
        child.kill().unwrap(); // SIGKILL inside the poison's handler
        let status = child.wait().unwrap();
        assert!(was_killed(&status), "run {run}: {status:?}");
    }
    let room = Postroom::builder()
        .max_attempts(3)
        .poll_interval(Duration::from_millis(10))
        .consumer("c", handler_fn(apply))
        .open(&db)
        .unwrap();
    let conn = raw(&db);
    let poison = inbox_row(&conn, "c", "s", "poison").unwrap();
    assert_eq!((poison.0.as_str(), poison.1), ("dead", 3), "{poison:?}");
    assert!(poison.2.unwrap().contains("process died"));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while applied_count(&conn, "innocent") == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the innocent message never ran"
        );
        thread::sleep(Duration::from_millis(10));
    }
    let innocent = inbox_row(&conn, "c", "s", "innocent").unwrap();
    assert_eq!(
        (innocent.0.as_str(), innocent.1),
        ("completed", 1),
        "{innocent:?}"
    );
    room.shutdown(Duration::from_secs(5)).unwrap();
}

// ---------------------------------------------------------------------------
// Sequence watermarks: kill -9 while sequenced messages arrive out of order.

/// Distinct sequenced messages: `q{n}` is sequence n + 1 of stream `s`.
const SEQUENCED_IDS: u64 = 200;

fn sequenced(n: u64) -> Message {
    Message::new("s", format!("q{n}"), format!("payload of q{n}")).with_sequence(n + 1)
}

/// As [`stream_room`], with a handler that takes longer after its domain
/// write, so that many kills land inside it: the attempt is recovered from
/// the in-flight marker, which must carry the message's number.
fn sequenced_room(db: &Path) -> Postroom {
    Postroom::builder()
        .max_attempts(1_000_000)
        .backoff(Duration::from_millis(1), Duration::from_millis(1))
        .consumer(
            "c",
            handler_fn(|tx, msg| {
                apply(tx, msg)?;
                thread::sleep(Duration::from_millis(3));
                let n: u64 = msg.id()[1..].parse().unwrap();
                if n.is_multiple_of(7) && tx.attempt() == 1 {
                    return Err(Failure::retry_after("flaky", Duration::ZERO));
                }
                Ok(())
            }),
        )
        .open(db)
        .unwrap()
}

fn child_sequenced(db: &Path) {
    let seed = env_u64("POSTROOM_SEED").unwrap();
    let room = sequenced_room(db);
    create_domain(&room);
    report("READY");
    let mut rng = Rng::new(seed);
    for _ in 0..100_000 {
        // Mostly near the low end, so the watermark has something to do,
        // in random order, so there are gaps.
        let bound = rng.below(SEQUENCED_IDS) + 1;
        let n = rng.below(bound);
        if n % 10 == 9 {
            // Held back until the end: gaps the watermark must wait at,
            // with settled sequences listed above them.
            continue;
        }
        let outcome = room.deliver("c", sequenced(n)).unwrap();
        if outcome.should_ack() {
            report(&format!("ACK q{n}"));
        }
    }
    report("DONE");
}

/// What the file holds must bear out its watermark: every sequence up to
/// it has a settled row, the next one has none, each listed sequence has
/// a settled row, and every settled row above it is listed. Returns the
/// watermark.
fn watermark_is_borne_out(conn: &rusqlite::Connection, when: &str) -> i64 {
    let w = count(
        conn,
        "SELECT coalesce((SELECT settled_below - 1 FROM postroom_watermarks
                          WHERE consumer = 'c' AND stream = 's'), 0)",
    );
    let settled_up_to = |hi: i64| {
        conn.query_row(
            "SELECT count(*) FROM postroom_inbox
             WHERE consumer = 'c' AND seq_stream = 's' AND seq BETWEEN 1 AND ?1
               AND status IN ('completed', 'dead')",
            [hi],
            |r| r.get::<_, i64>(0),
        )
        .unwrap()
    };
    assert_eq!(
        settled_up_to(w),
        w,
        "{when}: the watermark {w} passed an unsettled message"
    );
    assert_eq!(
        settled_up_to(w + 1),
        w,
        "{when}: sequence {} settled but the watermark stayed at {w}",
        w + 1
    );
    assert_eq!(
        count(
            conn,
            "SELECT count(*) FROM postroom_watermark_settled l
             WHERE NOT EXISTS (SELECT 1 FROM postroom_inbox i
                               WHERE i.consumer = l.consumer AND i.seq_stream = l.stream
                                 AND i.seq = l.seq AND i.status IN ('completed', 'dead'))"
        ),
        0,
        "{when}: a listed sequence has no settled row"
    );
    assert_eq!(
        conn.query_row(
            "SELECT count(*) FROM postroom_inbox i
             WHERE consumer = 'c' AND seq_stream = 's' AND seq > ?1
               AND status IN ('completed', 'dead')
               AND NOT EXISTS (SELECT 1 FROM postroom_watermark_settled l
                               WHERE l.consumer = 'c' AND l.stream = 's' AND l.seq = i.seq)",
            [w],
            |r| r.get::<_, i64>(0),
        )
        .unwrap(),
        0,
        "{when}: a settled sequence above the watermark is not listed"
    );
    w
}

/// SIGKILLs while sequenced messages arrive out of order (some failing
/// their first attempt, kills landing in handlers and commits): after
/// every kill the file's watermark is borne out by its rows (it never
/// passed a message that had not settled). Then, after retention has
/// deleted every row, each message is redelivered: those that settled are
/// answered by the watermark, the others run, and each is applied exactly
/// once.
#[test]
fn random_sigkills_never_move_the_watermark_past_an_unsettled_message() {
    let kills = env_u64("POSTROOM_SEQUENCED_KILLS").unwrap_or(100);
    let seed = seed();
    eprintln!("sequenced sigkills: {kills} kills, POSTROOM_SEED={seed}");
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let mut rng = Rng::new(seed);
    let mut acked = BTreeSet::new();
    for k in 0..kills {
        acked.extend(kill_randomly("sequenced", &db, &mut rng, 1, 60_000, true));
        if db.exists() {
            let conn = raw(&db);
            let has_schema = count(
                &conn,
                "SELECT count(*) FROM sqlite_master WHERE name = 'postroom_watermarks'",
            ) == 1;
            if has_schema {
                watermark_is_borne_out(&conn, &format!("kill {k}"));
            }
        }
    }
    assert!(
        !acked.is_empty(),
        "nothing acknowledged: the test proves nothing"
    );

    // Three weeks later, retention has deleted every completed row (but
    // the newest); the sender replays everything.
    let clock = ManualClock::new(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
            + 21 * 24 * 3600 * 1000,
    );
    let room = Postroom::builder()
        .clock(clock)
        .workers(0)
        .max_attempts(1_000_000)
        .consumer("c", handler_fn(apply))
        .open(&db)
        .unwrap();
    let conn = raw(&db);
    let w = watermark_is_borne_out(&conn, "after the kills");
    // Attempts beyond the planned ones (every 7th fails its first) are
    // kills inside a handler, recovered from the in-flight marker with the
    // message's number.
    let killed_in_handler = count(
        &conn,
        "SELECT count(*) FROM postroom_inbox
         WHERE attempts > 1 + (CAST(substr(message_id, 2) AS INTEGER) % 7 = 0)",
    );
    room.cleanup().unwrap();
    assert!(
        w < 10,
        "sequence 10 was held back, yet the watermark is {w}"
    );
    let listed = count(&conn, "SELECT count(*) FROM postroom_watermark_settled");
    let mut by_sequence = 0;
    for n in 0..SEQUENCED_IDS {
        let outcome = room.deliver("c", sequenced(n)).unwrap();
        match outcome {
            Outcome::DuplicateBySequence { .. } => by_sequence += 1,
            // Held back: never settled, so never taken for a duplicate.
            Outcome::Processed { .. } if n % 10 == 9 => {}
            // Not delivered before the kills, or the newest row.
            Outcome::Processed { .. } | Outcome::Duplicate => {}
            other => panic!("q{n}: {other:?}"),
        }
    }
    assert!(
        by_sequence >= w + listed - 1,
        "{by_sequence}, {w} + {listed} settled"
    );
    for n in 0..SEQUENCED_IDS {
        let id = format!("q{n}");
        assert_eq!(applied_count(&conn, &id), 1, "seed {seed}: {id}");
    }
    for id in &acked {
        assert_eq!(
            applied_count(&conn, id),
            1,
            "seed {seed}: acknowledged {id}"
        );
    }
    let streams = room.stats().unwrap().sequences;
    assert_eq!(streams.len(), 1);
    assert_eq!(streams[0].watermark, SEQUENCED_IDS, "{streams:?}");
    eprintln!(
        "sequenced sigkills: {kills} kills survived, watermark {w} and {listed} listed after \
         them, {killed_in_handler} rows with an attempt killed in its handler, {} ids \
         acknowledged before a kill, {by_sequence} answered by the watermark after retention",
        acked.len()
    );
}
