//! The crash matrix: every failpoint x every action (error, panic, abort)
//! x a few seeds, each in a child process running inline deliveries,
//! queued receipts with workers, and a relay into a second database. After
//! the child ends (or dies), the parent recovers, redelivers everything,
//! and a total-queue checker demands lost = 0, duplicated = 0, and
//! `integrity_check` ok. Needs `--features failpoints`.
//!
//! `POSTROOM_MATRIX_SEEDS` sets how many seeds per cell (default 3).

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use postroom::failpoint::FAILPOINTS;
use postroom::{
    handler_fn, EffectContext, EffectHandler, Error, Failure, InboxSink, Message, Postroom, Tx,
};

const IDS: u64 = 60;

#[test]
#[ignore = "entry point for child processes of the crash matrix"]
fn child_main() {
    let Some((role, db)) = child_role() else {
        return;
    };
    report("");
    match role.as_str() {
        "matrix" => run_workload(&db),
        "relay_open" => relay_after_failed_opens(&db),
        other => panic!("unknown child role {other}"),
    }
}

/// A relay whose first connection attempts fail (`relay.open` armed by the
/// parent) still relays: it keeps trying instead of giving up for the life
/// of the process.
fn relay_after_failed_opens(db: &Path) {
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let room = Postroom::builder()
        .sink(postroom::sink_fn(move |m| {
            let _ = tx.lock().unwrap().send(m.id.clone());
            postroom::SendResult::Sent
        }))
        .open(db)
        .unwrap();
    room.transaction(|tx| {
        tx.publish(postroom::Outgoing::new("t", "x"))?;
        Ok(())
    })
    .unwrap();
    // The relay's first open fails; it tries again 100 ms later.
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(_) => report("RELAYED"),
        Err(_) => report("NOT RELAYED"),
    }
    room.shutdown(Duration::from_secs(5)).unwrap();
}

#[test]
fn a_relay_that_cannot_open_its_connection_keeps_trying() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("a.db");
    let mut child = spawn_child(
        "relay_open",
        &db,
        &[("POSTROOM_FAILPOINTS", "relay.open=error@1".to_owned())],
    );
    let lines = lines_of(&mut child);
    let before = wait_for(&lines, "RELAYED");
    assert!(!before.contains(&"NOT RELAYED".to_owned()), "{before:?}");
    let status = wait_or_kill(&mut child, 30, "relay_open child");
    assert!(status.success(), "{status:?}");
}

fn b_path(db: &Path) -> PathBuf {
    db.with_file_name("b.db")
}

/// Service B: the relay's target; records what it gets.
fn open_b(db: &Path) -> postroom::Result<Arc<Postroom>> {
    let b = Postroom::builder()
        .poll_interval(Duration::from_millis(5))
        .consumer("b", handler_fn(record_as_b))
        .open(db)?;
    b.transaction(|tx| {
        tx.execute_batch(DOMAIN_SQL)?;
        Ok(())
    })?;
    Ok(Arc::new(b))
}

/// An effectful consumer whose external step does nothing: its rows take
/// the claim path (`dispatch.after_claim`), its transactional step
/// records the message as `apply` does.
struct Pass;

impl EffectHandler for Pass {
    type Output = ();
    fn effect(&self, _: &EffectContext<'_>, _: &Message) -> Result<(), Failure> {
        Ok(())
    }
    fn apply(&self, tx: &mut Tx<'_>, msg: &Message, (): ()) -> Result<(), Failure> {
        apply(tx, msg)
    }
}

/// Service A: an inline consumer, a queued consumer, an effectful queued
/// consumer, a relay into B.
fn open_a(db: &Path, b: &Arc<Postroom>) -> postroom::Result<Postroom> {
    let a = Postroom::builder()
        .max_attempts(1_000_000)
        .lease(Duration::from_millis(300))
        .reaper_interval(Duration::from_millis(50))
        .poll_interval(Duration::from_millis(5))
        .relay_poll(Duration::from_millis(10))
        .backoff(Duration::from_millis(1), Duration::from_millis(5))
        .consumer("inline", handler_fn(apply))
        .consumer("queued", handler_fn(apply))
        .effectful_consumer("fx", Pass)
        .sink(InboxSink::new(Arc::clone(b), "b"))
        .open(db)?;
    a.transaction(|tx| {
        tx.execute_batch(DOMAIN_SQL)?;
        Ok(())
    })?;
    Ok(a)
}

/// The child's work. Anything may fail (that is the point); failures are
/// simply not acknowledged, as a broker client would do.
fn run_workload(db: &Path) {
    let seed: u64 = std::env::var("POSTROOM_SEED").unwrap().parse().unwrap();
    let mut rng = Rng::new(seed);
    let Ok(b) = open_b(&b_path(db)) else { return };
    let Ok(a) = open_a(db, &b) else { return };
    report("READY");
    for round in 0..40 {
        let id = format!("i{}", rng.below(IDS));
        report(&format!("SENT inline {id}"));
        match a.deliver("inline", Message::new("s", id.clone(), id.clone())) {
            Ok(o) if o.should_ack() => report(&format!("ACK inline {id}")),
            Ok(_) => {}
            Err(Error::Closed) => break,
            Err(_) => {}
        }
        let batch: Vec<Message> = (0..3)
            .map(|_| {
                let id = format!("q{}", rng.below(IDS));
                Message::new("s", id.clone(), id)
            })
            .collect();
        for m in &batch {
            report(&format!("SENT queued {}", m.id()));
        }
        match a.receive_batch("queued", batch.clone()) {
            Ok(_) => {
                for m in &batch {
                    report(&format!("ACK queued {}", m.id()));
                }
            }
            Err(Error::Closed) => break,
            Err(_) => {}
        }
        let id = format!("f{}", rng.below(IDS));
        report(&format!("SENT fx {id}"));
        match a.receive("fx", Message::new("s", id.clone(), id.clone())) {
            Ok(_) => report(&format!("ACK fx {id}")),
            Err(Error::Closed) => break,
            Err(_) => {}
        }
        if round % 10 == 9 {
            let _ = a.cleanup();
        }
    }
    let _ = a.shutdown(Duration::from_secs(10));
    let _ = b.shutdown(Duration::from_secs(10));
    report("DONE");
}

struct Cell {
    failpoint: &'static str,
    action: &'static str,
    nth: u64,
    seed: u64,
}

/// Runs one cell: the child, then recovery and the checker.
fn run_cell(cell: &Cell) -> (Checked, Checked, String) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("a.db");
    let exe = std::env::current_exe().unwrap();
    let mut child = target_command(exe)
        .args([
            "--exact",
            "child_main",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("POSTROOM_CHILD", "matrix")
        .env("POSTROOM_DB", &db)
        .env("POSTROOM_SEED", cell.seed.to_string())
        .env(
            "POSTROOM_FAILPOINTS",
            format!("{}={}@{}", cell.failpoint, cell.action, cell.nth),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let reader = thread::spawn(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<String>>()
    });
    // A hung child is a failure too: give it a minute, then kill and fail.
    let status = wait_or_kill(
        &mut child,
        60,
        &format!(
            "{}={}@{} seed {}",
            cell.failpoint, cell.action, cell.nth, cell.seed
        ),
    );
    let lines = reader.join().unwrap();
    let how = match status.signal() {
        Some(6) => "aborted".to_string(),
        Some(sig) => format!("signal {sig}"),
        None if status.success() => "exited".into(),
        None => format!("exit {:?}", status.code()),
    };
    let mut sent: [BTreeSet<String>; 3] = Default::default();
    let mut acked: [BTreeSet<String>; 3] = Default::default();
    for line in &lines {
        let (kind, rest) = line.split_once(' ').unwrap_or((line, ""));
        let Some((consumer, id)) = rest.split_once(' ') else {
            continue;
        };
        let i = match consumer {
            "inline" => 0,
            "queued" => 1,
            _ => 2,
        };
        match kind {
            "SENT" => sent[i].insert(id.to_owned()),
            "ACK" => acked[i].insert(id.to_owned()),
            _ => false,
        };
    }

    // Recovery: re-open both, redeliver everything sent, let it all drain.
    let b = open_b(&b_path(&db)).expect("B re-opens");
    let a = open_a(&db, &b).expect("A re-opens");
    let deadline = Instant::now() + Duration::from_secs(60);
    for id in &sent[0] {
        loop {
            match a.deliver("inline", Message::new("s", id.clone(), id.clone())) {
                Ok(o) if o.should_ack() => break,
                // A row stuck after recovery must fail the cell, not hang it.
                Ok(o) => {
                    assert!(Instant::now() < deadline, "{id} never ackable: {o:?}");
                    thread::sleep(Duration::from_millis(2))
                }
                Err(e) => panic!("redelivery of {id}: {e}"),
            }
        }
    }
    let all_queued: Vec<Message> = sent[1]
        .iter()
        .map(|id| Message::new("s", id.clone(), id.clone()))
        .collect();
    a.receive_batch("queued", all_queued).expect("re-receive");
    let all_fx: Vec<Message> = sent[2]
        .iter()
        .map(|id| Message::new("s", id.clone(), id.clone()))
        .collect();
    a.receive_batch("fx", all_fx).expect("re-receive");
    let (a_conn, b_conn) = (raw(&db), raw(&b_path(&db)));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let busy = count(
            &a_conn,
            "SELECT count(*) FROM postroom_inbox WHERE status != 'completed'",
        ) + count(
            &a_conn,
            "SELECT count(*) FROM postroom_outbox WHERE status != 'sent'",
        ) + count(
            &b_conn,
            "SELECT count(*) FROM postroom_inbox WHERE status != 'completed'",
        );
        if busy == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{}: {busy} never finished",
            cell.failpoint
        );
        thread::sleep(Duration::from_millis(10));
    }
    a.shutdown(Duration::from_secs(10)).unwrap();
    b.shutdown(Duration::from_secs(10)).unwrap();
    integrity_ok(&a_conn);
    integrity_ok(&b_conn);
    let inline = check_effects(&a_conn, "inline", &sent[0], &acked[0]);
    let queued = check_effects(&a_conn, "queued", &sent[1], &acked[1]);
    let fx = check_effects(&a_conn, "fx", &sent[2], &acked[2]);
    assert!(
        fx.ok(),
        "{}={}@{}: effectful {fx:?}",
        cell.failpoint,
        cell.action,
        cell.nth
    );
    // Downstream: every outbox row of A applied exactly once in B.
    let outbox_ids: BTreeSet<String> = column(&a_conn, "SELECT message_id FROM postroom_outbox");
    let downstream = check_effects(&b_conn, "b", &outbox_ids, &outbox_ids);
    assert!(
        downstream.ok() && downstream.acked == outbox_ids.len(),
        "{}: downstream {downstream:?}",
        cell.failpoint
    );
    (inline, queued, how)
}

#[test]
fn crash_matrix_every_failpoint_every_action() {
    let seeds: u64 = std::env::var("POSTROOM_MATRIX_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let base = seed();
    eprintln!("crash matrix: POSTROOM_SEED={base}");
    let mut rng = Rng::new(base);
    let mut cells = Vec::new();
    for &failpoint in FAILPOINTS {
        for action in ["error", "panic", "abort"] {
            for s in 0..seeds {
                cells.push(Cell {
                    failpoint,
                    action,
                    // The first seed fires on the first hit, so every
                    // failpoint's abort is sure to fire; later ones later.
                    nth: if s == 0 { 1 } else { 1 + rng.below(4) },
                    seed: rng.next_u64(),
                });
            }
        }
    }
    // The cells are independent (a directory and a child each): run on as
    // many threads as there are CPUs, at most 4. A child spends much of its
    // time in fsync and in the parent's recovery, so even a loaded 2-core
    // machine gets through two at once in about the time of one.
    let aborted_at = in_parallel(&cells, "POSTROOM_MATRIX_JOBS", |cell| {
        let (inline, queued, how) = run_cell(cell);
        let name = format!(
            "{}={}@{} seed {} ({how})",
            cell.failpoint, cell.action, cell.nth, cell.seed
        );
        if !inline.ok() {
            return Err(format!("{name}: inline {inline:?}"));
        }
        if !queued.ok() {
            return Err(format!("{name}: queued {queued:?}"));
        }
        Ok((how == "aborted").then_some(cell.failpoint))
    })
    .unwrap_or_else(|verdict| panic!("{verdict}"));
    let cells = cells.len();
    let aborted = aborted_at.len();
    let fired_somewhere: BTreeSet<&str> = aborted_at.into_iter().collect();
    eprintln!(
        "crash matrix: {cells} cells over {} failpoints, {aborted} children aborted at a \
         failpoint; lost = 0, duplicated = 0, integrity ok in every cell",
        FAILPOINTS.len()
    );
    // Every failpoint is on a path the workload takes: its abort fired.
    let missing: Vec<_> = FAILPOINTS
        .iter()
        .filter(|f| !fired_somewhere.contains(*f))
        .collect();
    assert!(missing.is_empty(), "failpoints never reached: {missing:?}");
}
