//! The `postroom` operator CLI (feature `cli`), run as a real process on
//! real database files made by a real engine: output, `--json`, exit codes,
//! every bad-file case, mutations the engine then acts on, and a run while
//! the engine still has the database open.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use postroom::{
    handler_fn, sink_fn, Durability, Failure, ManualClock, Message, OutboxMessage, Outcome,
    Outgoing, Postroom, SendResult,
};
use rusqlite::{params, Connection};
use serde_json::Value;

use common::{column, count, eventually, raw, SetOnDrop};

const BIN: &str = env!("CARGO_BIN_EXE_postroom");

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{}", self.stdout))
    }
}

/// Unix ms as the RFC 3339 text the CLI takes (UTC, milliseconds).
fn rfc3339(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days, independent of the CLI's parser.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        tod / 3600,
        tod % 3600 / 60,
        tod % 60,
        ms.rem_euclid(1000)
    )
}

fn cli(db: &Path, args: &[&str]) -> Run {
    let out = Command::new(BIN)
        .arg(db)
        .args(args)
        .output()
        .expect("run the postroom binary");
    Run {
        code: out
            .status
            .code()
            .expect("exit code (not killed by a signal)"),
        stdout: String::from_utf8(out.stdout).expect("UTF-8 stdout"),
        stderr: String::from_utf8(out.stderr).expect("UTF-8 stderr"),
    }
}

/// Runs and asserts the exit code, showing the output when it differs.
fn cli_ok(db: &Path, args: &[&str], code: i32) -> Run {
    let run = cli(db, args);
    assert_eq!(
        run.code, code,
        "postroom {args:?}: exit {}\nstdout:\n{}\nstderr:\n{}",
        run.code, run.stdout, run.stderr
    );
    run
}

/// `postroom check` finds nothing broken (warnings allowed).
fn check_clean(db: &Path) {
    let report = cli_ok(db, &["check", "--json"], 0).json();
    assert_eq!(report["violations_total"], 0, "{report}");
}

fn create_domain(room: &Postroom) {
    room.transaction(|tx| {
        tx.execute_batch("CREATE TABLE IF NOT EXISTS applied (message_id TEXT NOT NULL)")?;
        Ok(())
    })
    .unwrap();
}

/// Applies a message: a domain row and one outbox message, to topic
/// `refused` for id `o-3` (the sink refuses it), else `shipping`.
fn apply(tx: &mut postroom::Tx<'_>, msg: &Message) -> Result<(), Failure> {
    tx.execute("INSERT INTO applied (message_id) VALUES (?1)", [msg.id()])?;
    let topic = if msg.id() == "o-3" {
        "refused"
    } else {
        "shipping"
    };
    tx.publish(Outgoing::new(topic, msg.payload().to_vec()).with_key(msg.id()))?;
    Ok(())
}

/// A sink that sends everything except topic `refused`, which is dead at once.
fn refusing_sink() -> impl postroom::Sink {
    sink_fn(|m: &OutboxMessage| {
        if m.topic == "refused" {
            SendResult::dead("sink refused the topic")
        } else {
            SendResult::Sent
        }
    })
}

const BINARY: &[u8] = &[0xff, 0x00, 0x10, b'A', 0xfe];

/// A database with known contents, engine shut down:
/// * `orders`: o-1 (JSON, header trace=t-1), o-2 (text), o-3 (JSON)
///   completed; each published one outbox row;
/// * `flaky`: f-1 failed once (retryable);
/// * `strict`: s-1 dead (rejected), binary payload;
/// * outbox: 2 sent (`shipping`), 1 dead (`refused`, from o-3);
/// * one conflict: o-1 redelivered with another payload.
fn populated(dir: &Path) -> PathBuf {
    let path = dir.join("app.db");
    let room = Postroom::builder()
        .workers(0)
        .durability(Durability::Normal)
        .consumer("orders", handler_fn(apply))
        .consumer(
            "flaky",
            handler_fn(|_, _| Err(Failure::retry("upstream timeout"))),
        )
        .consumer(
            "strict",
            handler_fn(|_, _| Err(Failure::reject("bad order: missing amount"))),
        )
        .sink(refusing_sink())
        .open(&path)
        .unwrap();
    create_domain(&room);
    let o1 =
        Message::new("shop", "o-1", r#"{"order_id":1,"amount":5}"#).with_header("trace", "t-1");
    assert!(matches!(
        room.deliver("orders", o1).unwrap(),
        Outcome::Processed { .. }
    ));
    for (id, payload) in [("o-2", "plain text order"), ("o-3", r#"{"order_id":3}"#)] {
        let outcome = room
            .deliver("orders", Message::new("shop", id, payload))
            .unwrap();
        assert!(matches!(outcome, Outcome::Processed { .. }), "{outcome:?}");
    }
    let outcome = room
        .deliver("flaky", Message::new("feed", "f-1", "{}"))
        .unwrap();
    assert!(matches!(outcome, Outcome::Failed { .. }), "{outcome:?}");
    let outcome = room
        .deliver("strict", Message::new("feed", "s-1", BINARY.to_vec()))
        .unwrap();
    assert!(matches!(outcome, Outcome::Dead { .. }), "{outcome:?}");
    let outcome = room
        .deliver(
            "orders",
            Message::new("shop", "o-1", r#"{"order_id":1,"amount":999}"#),
        )
        .unwrap();
    assert!(matches!(outcome, Outcome::Conflict { .. }), "{outcome:?}");
    eventually(20, "the relay to settle the outbox", || {
        let s = room.stats().unwrap();
        s.outbox.pending == 0 && s.outbox.sent == 2 && s.outbox.dead == 1
    });
    room.shutdown(Duration::from_secs(10)).unwrap();
    path
}

fn inbox_id(path: &Path, consumer: &str, message_id: &str) -> i64 {
    raw(path)
        .query_row(
            "SELECT id FROM postroom_inbox WHERE consumer = ?1 AND message_id = ?2",
            [consumer, message_id],
            |r| r.get(0),
        )
        .unwrap()
}

fn consumer<'a>(status: &'a Value, name: &str) -> &'a Value {
    status["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer"] == name)
        .unwrap_or_else(|| panic!("consumer {name} in {status}"))
}

/// The whitespace-separated cells of the table line starting with `first`.
fn table_row<'a>(text: &'a str, first: &str) -> Vec<&'a str> {
    text.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|cells| cells.first() == Some(&first))
        .unwrap_or_else(|| panic!("no row {first:?} in:\n{text}"))
}

#[test]
fn status_shows_counts_backlog_attempts_outbox_conflicts_and_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());

    let human = cli_ok(&db, &["status"], 0).stdout;
    // CONSUMER PENDING PROCESSING FAILED DEAD COMPLETED TOTAL OLDEST-PENDING
    assert_eq!(
        table_row(&human, "orders")[..8],
        ["orders", "0", "0", "0", "0", "3", "3", "-"]
    );
    let flaky = table_row(&human, "flaky");
    assert_eq!(flaky[..7], ["flaky", "0", "0", "1", "0", "0", "1"]);
    assert_ne!(flaky[7], "-", "flaky has a message waiting: {human}");
    // f-1 failed inline: it waits for its sender's redelivery, said in words.
    assert!(
        human.contains("flaky: 1 failed awaiting their sender's redelivery (inline), oldest "),
        "{human}"
    );
    assert!(
        !human.contains("orders: "),
        "nothing to say of orders: {human}"
    );
    assert_eq!(
        table_row(&human, "strict")[..7],
        ["strict", "0", "0", "0", "1", "0", "1"]
    );
    // Every line fits a terminal of 80 columns (the names here are short).
    for line in human.lines() {
        assert!(
            line.chars().count() <= 80,
            "{} columns: {line:?}",
            line.len()
        );
    }
    assert!(human.contains("conflicts  1"), "{human}");
    // OUTBOX row: PENDING SENT DEAD OLDEST
    let outbox_line = human
        .lines()
        .skip_while(|l| !l.starts_with("OUTBOX"))
        .nth(1)
        .unwrap();
    assert_eq!(
        outbox_line.split_whitespace().collect::<Vec<_>>(),
        ["0", "2", "1", "-"]
    );

    let s = cli_ok(&db, &["status", "--json"], 0).json();
    assert_eq!(s["schema_version"], postroom::SCHEMA_VERSION);
    assert_eq!(s["conflicts"], 1);
    assert_eq!(s["outbox"]["sent"], 2);
    assert_eq!(s["outbox"]["dead"], 1);
    assert_eq!(s["outbox"]["pending"], 0);
    assert!(s["outbox"]["oldest_pending_ms"].is_null());
    assert!(s["db_bytes"].as_u64().unwrap() > 0);
    assert!(s["wal_bytes"].is_u64());
    let orders = consumer(&s, "orders");
    assert_eq!(orders["completed"], 3);
    assert_eq!(orders["total"], 3);
    assert!(orders["oldest_pending_age_ms"].is_null());
    assert_eq!(
        orders["attempts"],
        serde_json::json!([{"attempts": 1, "rows": 3}])
    );
    let flaky = consumer(&s, "flaky");
    assert_eq!(flaky["failed"], 1);
    assert!(flaky["oldest_pending_age_ms"].as_i64().unwrap() >= 0);
    assert_eq!(consumer(&s, "strict")["dead"], 1);
}

#[test]
fn inbox_list_filters_by_consumer_status_source_time_and_limit() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());

    let all = cli_ok(&db, &["inbox", "list", "--json"], 0).json();
    assert_eq!(all.as_array().unwrap().len(), 5);
    let ids = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| r["message_id"].as_str().unwrap().to_owned())
            .collect()
    };
    // Newest first by default; --oldest-first in receive order.
    assert_eq!(ids(&all), ["s-1", "f-1", "o-3", "o-2", "o-1"]);
    let oldest = cli_ok(&db, &["inbox", "list", "--oldest-first", "--json"], 0).json();
    assert_eq!(ids(&oldest), ["o-1", "o-2", "o-3", "f-1", "s-1"]);

    let orders = cli_ok(&db, &["inbox", "list", "--consumer", "orders", "--json"], 0).json();
    assert_eq!(ids(&orders), ["o-3", "o-2", "o-1"]);
    let dead = cli_ok(&db, &["inbox", "list", "--status", "dead", "--json"], 0).json();
    assert_eq!(ids(&dead), ["s-1"]);
    assert_eq!(dead[0]["status"], "dead");
    assert_eq!(dead[0]["payload_bytes"], BINARY.len());
    let feed = cli_ok(&db, &["inbox", "list", "--source", "feed", "--json"], 0).json();
    assert_eq!(ids(&feed), ["s-1", "f-1"]);
    let limited = cli_ok(&db, &["inbox", "list", "--limit", "2", "--json"], 0).json();
    assert_eq!(ids(&limited), ["s-1", "f-1"]);
    // Keyset paging: the next page starts after the last id shown, and the
    // human listing says how to ask for it.
    let last = limited[1]["id"].as_i64().unwrap().to_string();
    let next = cli_ok(
        &db,
        &["inbox", "list", "--limit", "2", "--after", &last, "--json"],
        0,
    );
    assert_eq!(ids(&next.json()), ["o-3", "o-2"]);
    let human = cli_ok(&db, &["inbox", "list", "--limit", "2"], 0).stdout;
    assert!(
        human.contains(&format!("next page: --after {last}")),
        "{human}"
    );

    // Time range on received_at: [since, until).
    let f1_received = raw(&db)
        .query_row(
            "SELECT received_at FROM postroom_inbox WHERE message_id = 'f-1'",
            [],
            |r| r.get::<_, i64>(0),
        )
        .unwrap();
    raw(&db)
        .execute(
            "UPDATE postroom_inbox SET received_at = ?1 + 1000 WHERE message_id = 's-1'",
            [f1_received],
        )
        .unwrap();
    let since = rfc3339(f1_received + 500);
    let late = cli_ok(&db, &["inbox", "list", "--since", &since, "--json"], 0).json();
    assert_eq!(ids(&late), ["s-1"]);
    let early = cli_ok(&db, &["inbox", "list", "--until", &since, "--json"], 0).json();
    assert_eq!(ids(&early), ["f-1", "o-3", "o-2", "o-1"]);
    // Ages count back from now; unix milliseconds are not a time.
    let recent = cli_ok(&db, &["inbox", "list", "--since", "1h", "--json"], 0).json();
    assert_eq!(recent.as_array().unwrap().len(), 5);
    let run = cli_ok(
        &db,
        &["inbox", "list", "--since", &f1_received.to_string()],
        2,
    );
    assert!(run.stderr.contains("not a time"), "{}", run.stderr);

    let human = cli_ok(&db, &["inbox", "list", "--consumer", "flaky"], 0).stdout;
    let row = table_row(&human, &inbox_id(&db, "flaky", "f-1").to_string());
    assert_eq!(
        row[1..9],
        [
            "flaky",
            "feed",
            "f-1",
            "failed",
            "(waiting",
            "for",
            "redelivery)",
            "1"
        ]
    );
    assert!(human.contains("upstream timeout"), "{human}");
    assert!(human.contains("1 row(s)"), "{human}");
}

#[test]
fn inbox_show_prints_payload_as_json_text_or_hex_with_headers_and_timestamps() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());

    // A failed row keeps its payload; make o-1's JSON payload kept too.
    let o1 = inbox_id(&db, "orders", "o-1");
    raw(&db)
        .execute(
            "UPDATE postroom_inbox SET payload = ?1 WHERE id = ?2",
            params![br#"{"order_id":1,"amount":5}"#.to_vec(), o1],
        )
        .unwrap();
    let human = cli_ok(&db, &["inbox", "show", &o1.to_string()], 0).stdout;
    assert!(human.contains("payload (25 bytes, JSON):"), "{human}");
    assert!(human.contains("  \"amount\": 5"), "pretty-printed: {human}");
    assert!(human.contains("trace: t-1"), "{human}");
    assert!(human.contains("(matches the payload)"), "{human}");
    assert!(human.contains("status           completed"), "{human}");
    let json = cli_ok(&db, &["inbox", "show", &o1.to_string(), "--json"], 0).json();
    assert_eq!(json["payload"]["encoding"], "json");
    assert_eq!(json["payload"]["value"]["amount"], 5);
    assert_eq!(json["headers"]["trace"], "t-1");
    assert_eq!(json["payload_hash_ok"], true);
    assert!(json["processed_at"].as_i64().unwrap() >= json["received_at"].as_i64().unwrap());
    assert_eq!(json["caused_outbox"].as_array().unwrap().len(), 1);

    let s1 = inbox_id(&db, "strict", "s-1").to_string();
    let human = cli_ok(&db, &["inbox", "show", &s1], 0).stdout;
    assert!(human.contains("binary, hex dump"), "{human}");
    assert!(human.contains("00000000  ff 00 10 41 fe"), "{human}");
    assert!(human.contains("bad order: missing amount"), "{human}");
    let json = cli_ok(&db, &["inbox", "show", &s1, "--json"], 0).json();
    assert_eq!(json["payload"]["encoding"], "binary");
    assert_eq!(json["payload"]["base64"], "/wAQQf4=");
    assert_eq!(json["payload"]["value"], Value::Null);
    assert_eq!(json["status"], "dead");
    assert_eq!(json["attempts"], 1);

    // o-2's payload was not kept (completed, keep_payloads off).
    let o2 = inbox_id(&db, "orders", "o-2").to_string();
    let human = cli_ok(&db, &["inbox", "show", &o2], 0).stdout;
    assert!(human.contains("payload: not kept"), "{human}");

    let missing = cli_ok(&db, &["inbox", "show", "999999"], 5);
    assert!(
        missing.stderr.contains("no inbox row with id 999999"),
        "{}",
        missing.stderr
    );
}

#[test]
fn dead_list_shows_inbox_and_outbox_dead_letters() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());

    let inbox = cli_ok(&db, &["dead", "list", "--json"], 0).json();
    let inbox = inbox.as_array().unwrap();
    assert_eq!(inbox.len(), 1);
    assert_eq!(inbox[0]["consumer"], "strict");
    assert_eq!(inbox[0]["message_id"], "s-1");
    assert_eq!(inbox[0]["last_error"], "bad order: missing amount");
    assert_eq!(inbox[0]["payload"]["base64"], "/wAQQf4=");
    let none = cli_ok(&db, &["dead", "list", "--consumer", "orders", "--json"], 0).json();
    assert_eq!(none, serde_json::json!([]));

    let outbox = cli_ok(&db, &["dead", "list", "--outbox", "--json"], 0).json();
    let outbox = outbox.as_array().unwrap();
    assert_eq!(outbox.len(), 1);
    assert_eq!(outbox[0]["topic"], "refused");
    assert_eq!(outbox[0]["key"], "o-3");
    assert_eq!(outbox[0]["last_error"], "sink refused the topic");
    assert_eq!(outbox[0]["payload"]["value"]["order_id"], 3);

    let human = cli_ok(&db, &["dead", "list", "--outbox"], 0).stdout;
    assert!(human.contains("refused"), "{human}");
    assert!(human.contains("1 dead letter(s)"), "{human}");
    let human = cli_ok(&db, &["dead", "list"], 0).stdout;
    let row = table_row(&human, &inbox[0]["id"].to_string());
    assert_eq!(row[1..5], ["strict", "feed", "s-1", "1"]);
}

/// The CLI beside a running engine: reads work, a redrive goes through the
/// engine's write lock by waiting, and the engine's workers then process the
/// redriven message exactly once; the engine keeps its lock throughout.
#[test]
fn redrive_while_the_engine_runs_is_processed_by_its_workers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("live.db");
    let fixed = Arc::new(AtomicBool::new(false));
    let f = Arc::clone(&fixed);
    let room = Postroom::builder()
        .workers(1)
        .poll_interval(Duration::from_millis(20))
        .consumer(
            "orders",
            handler_fn(move |tx, msg| {
                if !f.load(Ordering::SeqCst) {
                    return Err(Failure::reject("price service down"));
                }
                apply(tx, msg)
            }),
        )
        .open(&path)
        .unwrap();
    create_domain(&room);
    let msg = Message::new("shop", "o-9", r#"{"order_id":9}"#);
    assert!(matches!(
        room.deliver("orders", msg.clone()).unwrap(),
        Outcome::Dead { .. }
    ));
    let id = room.dead_letters(None, 10).unwrap()[0].id;

    let s = cli_ok(&path, &["status", "--json"], 0).json();
    assert_eq!(consumer(&s, "orders")["dead"], 1);
    // Not a dead letter: nothing to redrive.
    fixed.store(true, Ordering::SeqCst);
    room.deliver("orders", Message::new("shop", "other2", "x"))
        .unwrap();
    let done_id = inbox_id(&path, "orders", "other2").to_string();
    let not_dead = cli_ok(&path, &["dead", "redrive", &done_id], 5);
    assert!(
        not_dead
            .stderr
            .contains("is not a dead letter (it is completed)"),
        "{}",
        not_dead.stderr
    );

    // The application keeps delivering while the CLI writes: both go
    // through, one writer at a time.
    let stop = AtomicBool::new(false);
    let (run, delivered) = std::thread::scope(|s| {
        let load = s.spawn(|| {
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) || n == 0 {
                let msg = Message::new("load", format!("l-{n}"), "x");
                let outcome = room.deliver("orders", msg).unwrap();
                assert!(matches!(outcome, Outcome::Processed { .. }), "{outcome:?}");
                n += 1;
            }
            n
        });
        // A CLI write that timed out under this load once hung a CI run
        // here: the failed assertion never stopped the load.
        let stopping = SetOnDrop(&stop);
        let run = cli_ok(&path, &["dead", "redrive", &id.to_string(), "--json"], 0).json();
        let cleanup = cli_ok(&path, &["cleanup", "--retention", "1h", "--json"], 0).json();
        assert_eq!(cleanup["inbox_deleted"], 0);
        drop(stopping);
        (run, load.join().unwrap())
    });
    assert_eq!(run["done"], true);
    assert_eq!(run["table"], "inbox");
    eventually(
        20,
        "the engine's workers to process the redriven row",
        || room.stats().unwrap().inbox["orders"].completed == 2 + delivered,
    );
    let conn = raw(&path);
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM applied WHERE message_id = 'o-9'"
        ),
        1
    );
    let (status, attempts): (String, i64) = conn
        .query_row(
            "SELECT status, attempts FROM postroom_inbox WHERE id = ?1",
            [id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((status.as_str(), attempts), ("completed", 1));
    // Redelivered now: a duplicate, applied once.
    assert_eq!(room.deliver("orders", msg).unwrap(), Outcome::Duplicate);
    // The engine's lock is still its own: a second engine is refused.
    assert!(matches!(
        Postroom::builder().open(&path),
        Err(postroom::Error::AlreadyOpen { .. })
    ));
    room.shutdown(Duration::from_secs(10)).unwrap();
    check_clean(&path);
}

#[test]
fn discard_completes_a_dead_letter_without_effects_and_deletes_a_dead_outbox_row() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let s1 = inbox_id(&db, "strict", "s-1").to_string();

    let human = cli_ok(&db, &["dead", "discard", &s1], 0).stdout;
    assert!(human.contains("discarded"), "{human}");
    let again = cli_ok(&db, &["dead", "discard", &s1], 5);
    assert!(again.stderr.contains("it is completed"), "{}", again.stderr);
    let missing = cli_ok(&db, &["dead", "redrive", "424242"], 5);
    assert!(
        missing.stderr.contains("no inbox row with id 424242"),
        "{}",
        missing.stderr
    );
    let row = cli_ok(&db, &["inbox", "show", &s1, "--json"], 0).json();
    assert_eq!(row["status"], "completed");
    assert!(row["payload"].is_null());
    assert!(row["last_error"]
        .as_str()
        .unwrap()
        .starts_with("discarded by operator"));

    let seq = cli_ok(&db, &["dead", "list", "--outbox", "--json"], 0).json()[0]["seq"].to_string();
    cli_ok(&db, &["dead", "discard", "--outbox", &seq, "--json"], 0);
    assert_eq!(
        count(
            &raw(&db),
            "SELECT count(*) FROM postroom_outbox WHERE status = 'dead'"
        ),
        0
    );
    cli_ok(&db, &["dead", "discard", "--outbox", &seq], 5);

    // The engine now answers a redelivery of the discarded message as a
    // duplicate: the rejecting handler does not run again.
    let room = Postroom::builder()
        .workers(0)
        .consumer(
            "strict",
            handler_fn(|_, _| Err(Failure::reject("must not run"))),
        )
        .open(&db)
        .unwrap();
    assert_eq!(
        room.deliver("strict", Message::new("feed", "s-1", BINARY.to_vec()))
            .unwrap(),
        Outcome::Duplicate
    );
    room.shutdown(Duration::from_secs(10)).unwrap();
    check_clean(&db);
}

#[test]
fn an_outbox_redrive_is_sent_by_the_engines_relay() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let seq = cli_ok(&db, &["dead", "list", "--outbox", "--json"], 0).json()[0]["seq"]
        .as_i64()
        .unwrap();
    let human = cli_ok(&db, &["dead", "redrive", "--outbox", &seq.to_string()], 0).stdout;
    assert!(
        human.contains(&format!("outbox row {seq} redriven")),
        "{human}"
    );
    let (status, attempts): (String, i64) = raw(&db)
        .query_row(
            "SELECT status, attempts FROM postroom_outbox WHERE seq = ?1",
            [seq],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((status.as_str(), attempts), ("pending", 0));

    let (tx, rx) = crossbeam_channel::unbounded::<String>();
    let room = Postroom::builder()
        .workers(0)
        .sink(sink_fn(move |m: &OutboxMessage| {
            let _ = tx.send(m.topic.clone());
            SendResult::Sent
        }))
        .open(&db)
        .unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(20)).unwrap(), "refused");
    eventually(20, "the redriven row to be marked sent", || {
        room.stats().unwrap().outbox.sent == 3
    });
    room.shutdown(Duration::from_secs(10)).unwrap();
    check_clean(&db);
}

#[test]
fn conflicts_list_show_and_discard() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());

    let list = cli_ok(&db, &["conflicts", "list", "--json"], 0).json();
    let list = list.as_array().unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["message_id"], "o-1");
    assert_eq!(list[0]["deliveries"], 1);
    assert_ne!(list[0]["stored_hash"], list[0]["payload_hash"]);
    let id = list[0]["id"].to_string();

    let human = cli_ok(&db, &["conflicts", "list"], 0).stdout;
    assert_eq!(table_row(&human, &id)[1..5], ["orders", "shop", "o-1", "1"]);

    let show = cli_ok(&db, &["conflicts", "show", &id, "--json"], 0).json();
    assert_eq!(show["payload"]["value"]["amount"], 999);
    assert_eq!(show["stored"]["status"], "completed");
    assert_eq!(
        show["payload_hash"].as_str().unwrap(),
        blake3::hash(br#"{"order_id":1,"amount":999}"#)
            .to_hex()
            .as_str()
    );
    let human = cli_ok(&db, &["conflicts", "show", &id], 0).stdout;
    assert!(
        human.contains("quarantined payload (27 bytes, JSON):"),
        "{human}"
    );
    assert!(human.contains("\"amount\": 999"), "{human}");
    assert!(human.contains("stored row"), "{human}");
    cli_ok(&db, &["conflicts", "show", "777"], 5);

    // Discarded: gone with its payload, once.
    let done = cli_ok(&db, &["conflicts", "discard", &id, "--json"], 0).json();
    assert_eq!(
        (&done["action"], &done["table"], &done["done"]),
        (&"discard".into(), &"conflicts".into(), &true.into())
    );
    assert_eq!(
        cli_ok(&db, &["conflicts", "list", "--json"], 0).json(),
        serde_json::json!([])
    );
    cli_ok(&db, &["conflicts", "show", &id], 5);
    cli_ok(&db, &["conflicts", "discard", &id], 5);
    check_clean(&db);
}

#[test]
fn cleanup_dry_run_counts_and_the_real_run_deletes_only_expired_rows_in_batches() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("old.db");
    let now = postroom::admin::now_ms();
    let clock = ManualClock::new(now - 10 * 24 * 3600 * 1000);
    let room = Postroom::builder()
        .workers(0)
        .durability(Durability::Normal)
        .clock(clock.clone())
        .retention(Duration::from_secs(365 * 24 * 3600))
        .reaper_interval(Duration::from_secs(3600))
        .consumer("orders", handler_fn(apply))
        .consumer("strict", handler_fn(|_, _| Err(Failure::reject("no"))))
        .sink(refusing_sink())
        .open(&db)
        .unwrap();
    create_domain(&room);
    let old: Vec<Message> = (0..300)
        .map(|i| Message::new("shop", format!("old-{i}"), "x"))
        .collect();
    for msg in old {
        room.deliver("orders", msg).unwrap();
    }
    room.deliver("strict", Message::new("shop", "old-dead", "x"))
        .unwrap();
    // An id reused with another payload: quarantined, last seen 10 days ago.
    room.deliver("orders", Message::new("shop", "old-0", "y"))
        .unwrap();
    eventually(20, "old outbox rows sent", || {
        room.stats().unwrap().outbox.sent == 300
    });
    clock.set(now);
    for i in 0..2 {
        room.deliver("orders", Message::new("shop", format!("new-{i}"), "x"))
            .unwrap();
    }
    eventually(20, "new outbox rows sent", || {
        room.stats().unwrap().outbox.sent == 302
    });
    room.deliver("orders", Message::new("shop", "new-0", "z"))
        .unwrap();
    room.shutdown(Duration::from_secs(10)).unwrap();
    let conn = raw(&db);
    let snapshot = |conn: &Connection| {
        (
            count(conn, "SELECT count(*) FROM postroom_inbox"),
            count(conn, "SELECT count(*) FROM postroom_outbox"),
        )
    };
    assert_eq!(snapshot(&conn), (303, 302));

    let dry = cli_ok(&db, &["cleanup", "--dry-run"], 0).stdout;
    assert!(
        dry.contains("dry run: would delete 300 completed inbox row(s) and 300 sent outbox row(s)"),
        "{dry}"
    );
    let dry = cli_ok(&db, &["cleanup", "--dry-run", "--json"], 0).json();
    assert_eq!(dry["dry_run"], true);
    assert_eq!(dry["inbox_deleted"], 300);
    assert_eq!(dry["transactions"], 0);
    assert_eq!(snapshot(&conn), (303, 302), "a dry run deletes nothing");
    // A shorter retention reaches the new rows too (counted only).
    let all = cli_ok(
        &db,
        &["cleanup", "--dry-run", "--retention", "0s", "--json"],
        0,
    )
    .json();
    assert!(all["inbox_deleted"].as_u64().unwrap() >= 300);

    let real = cli_ok(&db, &["cleanup", "--json"], 0).json();
    assert_eq!(real["dry_run"], false);
    assert_eq!(real["inbox_deleted"], 300);
    assert_eq!(real["outbox_deleted"], 300);
    assert_eq!(real["keys_deleted"], 300);
    // 256 + 44 rows per table, then the 300 inbox key entries, then their
    // notes, each batch its own transaction.
    assert_eq!(real["transactions"], 6);
    assert_eq!(snapshot(&conn), (3, 2));
    assert_eq!(
        (
            count(&conn, "SELECT count(*) FROM postroom_inbox_keys"),
            count(&conn, "SELECT count(*) FROM postroom_retired_keys")
        ),
        (3, 0),
        "the deleted rows' key entries went too"
    );
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM postroom_inbox WHERE status = 'dead'"
        ),
        1,
        "dead letters are kept"
    );
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM postroom_inbox WHERE message_id LIKE 'new-%'"
        ),
        2
    );
    let human = cli_ok(&db, &["cleanup"], 0).stdout;
    assert!(
        human.starts_with("deleted 0 completed inbox row(s) and 0 sent outbox row(s)"),
        "{human}"
    );
    assert!(
        !human.contains("dead letter") && !human.contains("conflict"),
        "{human}"
    );

    // Dead letters and conflicts only when asked, each by its own age.
    let conflicts = |conn: &Connection| {
        column::<Vec<String>>(
            conn,
            "SELECT message_id FROM postroom_conflicts ORDER BY id",
        )
    };
    assert_eq!(conflicts(&conn), ["old-0", "new-0"]);
    let day = "1d";
    let both = ["--dead-retention", day, "--conflict-retention", day];
    let dry = cli_ok(
        &db,
        &[&["cleanup", "--dry-run", "--json"][..], &both].concat(),
        0,
    )
    .json();
    assert_eq!(
        (&dry["dead_deleted"], &dry["conflicts_deleted"]),
        (&1.into(), &1.into())
    );
    // Each cutoff is its own: a day ago, where completed rows' is 7 days ago.
    let day_ago = dry["cutoff_ms"].as_i64().unwrap() + 6 * 24 * 3600 * 1000;
    for cutoff in ["dead_cutoff_ms", "conflicts_cutoff_ms"] {
        let at = dry[cutoff].as_i64().unwrap();
        assert!(
            (day_ago - 60_000..=day_ago + 60_000).contains(&at),
            "{cutoff} {at}"
        );
    }
    let dry = cli_ok(&db, &["cleanup", "--dry-run", "--json"], 0).json();
    assert!(
        dry["dead_deleted"].is_null() && dry["conflicts_deleted"].is_null(),
        "{dry}"
    );
    assert!(dry["dead_cutoff_ms"].is_null(), "{dry}");
    let longer = cli_ok(&db, &["cleanup", "--json", "--dead-retention", "30d"], 0).json();
    assert_eq!(longer["dead_deleted"], 0, "died 10 days ago, kept for 30");
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM postroom_inbox WHERE status = 'dead'"
        ),
        1
    );
    // Deleting dead letters and conflicts is a bulk action like any other:
    // not without --yes when there is no terminal to ask on (the test's
    // stdin is none), and nothing deleted then.
    let refused = cli_ok(&db, &[&["cleanup"][..], &both].concat(), 2);
    assert!(
        refused
            .stderr
            .contains("1 dead letter(s) and 1 conflict(s)")
            && refused.stderr.contains("--yes"),
        "{}",
        refused.stderr
    );
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM postroom_inbox WHERE status = 'dead'"
        ),
        1
    );
    assert_eq!(conflicts(&conn), ["old-0", "new-0"]);
    let human = cli_ok(&db, &[&["cleanup", "--yes"][..], &both].concat(), 0).stdout;
    assert!(
        human.contains("the newest row of the inbox and of the outbox stays"),
        "{human}"
    );
    assert!(
        human.contains("deleted 1 dead letter(s) dead before ")
            && human.contains("deleted 1 conflict(s) last seen before "),
        "{human}"
    );
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM postroom_inbox WHERE status = 'dead'"
        ),
        0
    );
    assert_eq!(
        conflicts(&conn),
        ["new-0"],
        "the conflict seen today is kept"
    );
    check_clean(&db);
}

#[test]
fn check_passes_a_healthy_database_and_finds_a_payload_changed_behind_the_engines_back() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());

    let ok = cli_ok(&db, &["check"], 0).stdout;
    assert!(ok.contains("quick_check: ok"), "{ok}");
    assert!(ok.contains("check: OK"), "{ok}");
    let ok = cli_ok(&db, &["check", "--full", "--json"], 0).json();
    assert_eq!(ok["integrity_check"], "integrity_check");
    assert_eq!(ok["violations_total"], 0);
    assert_eq!(ok["inbox_rows"], 5);
    assert_eq!(ok["outbox_rows"], 3);
    // f-1 and s-1 keep payloads, plus the conflict's.
    assert_eq!(ok["payloads_hashed"], 3);

    let s1 = inbox_id(&db, "strict", "s-1");
    raw(&db)
        .execute(
            "UPDATE postroom_inbox SET payload = x'00' WHERE id = ?1",
            [s1],
        )
        .unwrap();
    let bad = cli_ok(&db, &["check"], 4);
    let row = table_row(&bad.stdout, "payload_digest");
    assert_eq!(row[1..3], ["postroom_inbox", &s1.to_string()]);
    assert!(
        bad.stdout.contains("check: 1 VIOLATION(S)"),
        "{}",
        bad.stdout
    );
    let bad = cli_ok(&db, &["check", "--json"], 4).json();
    assert_eq!(bad["violations_total"], 1);
    assert_eq!(bad["violations"][0]["kind"], "payload_digest");
    assert_eq!(bad["violations"][0]["id"], s1);
    cli_ok(&db, &["check", "--full"], 4);
    let show = cli_ok(&db, &["inbox", "show", &s1.to_string()], 0).stdout;
    assert!(show.contains("DOES NOT MATCH"), "{show}");
}

#[test]
fn check_reports_expired_leases_as_warnings_and_a_cause_that_is_not_completed() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let conn = raw(&db);
    let f1 = inbox_id(&db, "flaky", "f-1");
    conn.execute(
        "UPDATE postroom_inbox SET status = 'processing', lease_until = 1000, lease_token = 7
         WHERE id = ?1",
        [f1],
    )
    .unwrap();
    let warned = cli_ok(&db, &["check", "--json"], 0).json();
    assert_eq!(warned["violations_total"], 0);
    assert_eq!(warned["warnings_total"], 1);
    assert_eq!(warned["warnings"][0]["kind"], "expired_lease");
    assert_eq!(warned["warnings"][0]["id"], f1);
    let s = cli_ok(&db, &["status", "--json"], 0).json();
    assert_eq!(consumer(&s, "flaky")["expired_leases"], 1);

    // o-2 published an outbox row; pretend its inbox row never completed.
    let o2 = inbox_id(&db, "orders", "o-2");
    conn.execute(
        "UPDATE postroom_inbox SET status = 'failed', payload = CAST(?2 AS BLOB), last_error = 'x'
         WHERE id = ?1",
        params![o2, "plain text order"],
    )
    .unwrap();
    let bad = cli_ok(&db, &["check", "--json"], 4).json();
    assert_eq!(bad["violations_total"], 1, "{bad}");
    assert_eq!(bad["violations"][0]["kind"], "cause_not_completed");
    assert_eq!(bad["violations"][0]["table"], "postroom_outbox");
    assert!(bad["violations"][0]["detail"]
        .as_str()
        .unwrap()
        .contains(&format!("inbox row {o2}")));
}

#[test]
fn metrics_prints_prometheus_text_with_help_and_type_for_every_family() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let text = cli_ok(&db, &["metrics"], 0).stdout;
    for line in [
        "# TYPE postroom_inbox_messages gauge",
        "postroom_inbox_messages{consumer=\"orders\",status=\"completed\"} 3",
        "postroom_inbox_messages{consumer=\"flaky\",status=\"failed\"} 1",
        "postroom_inbox_messages{consumer=\"strict\",status=\"dead\"} 1",
        "postroom_inbox_messages{consumer=\"strict\",status=\"pending\"} 0",
        "postroom_outbox_messages{status=\"sent\"} 2",
        "postroom_outbox_messages{status=\"dead\"} 1",
        "postroom_conflicts 1",
        "# TYPE postroom_conflicts gauge",
        "postroom_oldest_pending_seconds{consumer=\"orders\"} 0.000",
        "postroom_inbox_attempts{consumer=\"orders\",attempts=\"1\"} 3",
        "postroom_outbox_oldest_pending_seconds 0.000",
        &format!("postroom_schema_version {}", postroom::SCHEMA_VERSION),
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in:\n{text}"
        );
    }
    // Every sample belongs to a family announced with HELP and TYPE, and
    // its value is a number.
    let mut typed = std::collections::HashSet::new();
    let mut helped = std::collections::HashSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            helped.insert(rest.split(' ').next().unwrap().to_owned());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            typed.insert(rest.split(' ').next().unwrap().to_owned());
        } else {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let name = series.split('{').next().unwrap();
            assert!(typed.contains(name) && helped.contains(name), "{line}");
            value.parse::<f64>().unwrap_or_else(|_| panic!("{line}"));
        }
    }
    assert!(text.contains("postroom_wal_bytes "));
    let flaky_age: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("postroom_oldest_pending_seconds{consumer=\"flaky\"} "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(flaky_age >= 0.0);
}

/// Every bad file: exit code 3, a clear message, and the file untouched
/// (a missing one not created) — for read and write commands alike.
#[test]
fn bad_files_are_refused_with_exit_code_3_and_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let commands: [&[&str]; 5] = [
        &["status"],
        &["check"],
        &["metrics"],
        &["dead", "redrive", "1"],
        &["cleanup"],
    ];

    let missing = dir.path().join("missing.db");
    for args in commands {
        let run = cli_ok(&missing, args, 3);
        assert!(run.stderr.contains("does not exist"), "{}", run.stderr);
        assert!(!missing.exists(), "{args:?} created the file");
    }
    let run = cli_ok(&missing, &["status", "--json"], 3);
    let err: Value = serde_json::from_str(&run.stderr).unwrap();
    assert_eq!(err["exit_code"], 3);
    assert!(err["error"].as_str().unwrap().contains("does not exist"));

    let text = dir.path().join("notes.txt");
    let content = "these are my notes, not a database\n".repeat(100);
    std::fs::write(&text, &content).unwrap();
    for args in commands {
        let run = cli_ok(&text, args, 3);
        assert!(
            run.stderr.contains("is not a SQLite database"),
            "{}",
            run.stderr
        );
    }
    assert_eq!(std::fs::read_to_string(&text).unwrap(), content);

    let plain = dir.path().join("plain.db");
    Connection::open(&plain)
        .unwrap()
        .execute_batch("CREATE TABLE mine (x); INSERT INTO mine VALUES (1);")
        .unwrap();
    for args in commands {
        let run = cli_ok(&plain, args, 3);
        assert!(
            run.stderr.contains("is not a postroom database"),
            "{}",
            run.stderr
        );
    }
    let conn = Connection::open(&plain).unwrap();
    assert_eq!(
        count(
            &conn,
            "SELECT count(*) FROM sqlite_master WHERE name LIKE 'postroom%'"
        ),
        0
    );

    let newer = populated(&dir.path().join("newer").tap_mkdir());
    raw(&newer)
        .execute(
            "UPDATE postroom_meta SET value = '99' WHERE key = 'schema_version'",
            [],
        )
        .unwrap();
    for args in commands {
        let run = cli_ok(&newer, args, 3);
        assert!(
            run.stderr.contains("schema version 99 is newer"),
            "{}",
            run.stderr
        );
    }
    assert_eq!(
        count(&raw(&newer), "SELECT count(*) FROM postroom_inbox"),
        5,
        "nothing changed"
    );

    let a_dir = dir.path().join("a-directory");
    std::fs::create_dir(&a_dir).unwrap();
    cli_ok(&a_dir, &["status"], 3);
}

/// A file whose b-tree pages were overwritten: `check` reports SQLite's
/// findings and exits 3 (a damaged file, not a postroom invariant), and
/// other commands refuse it with 3 too.
#[test]
fn a_damaged_file_is_exit_code_3() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    raw(&db)
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .unwrap();
    let page_size = 4096u64;
    // The inbox table's own pages (dbstat is compiled into the bundled
    // SQLite); the schema and postroom_meta stay readable, so the tool opens
    // the file and SQLite's check is what finds the damage.
    let pages: Vec<u64> = raw(&db)
        .prepare("SELECT pageno FROM dbstat WHERE name = 'postroom_inbox'")
        .unwrap()
        .query_map([], |r| r.get::<_, i64>(0))
        .unwrap()
        .map(|p| p.unwrap() as u64)
        .collect();
    assert!(!pages.is_empty());
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&db).unwrap();
        // A leaf-table page header claiming 5 cells, whose cell pointers
        // and contents are garbage.
        for page in pages {
            f.seek(SeekFrom::Start((page - 1) * page_size)).unwrap();
            let mut junk = vec![0x0d, 0, 0, 0, 5, 0x0f, 0];
            junk.resize(4000, 0xaa);
            f.write_all(&junk).unwrap();
        }
    }
    let check = cli_ok(&db, &["check"], 3);
    assert!(
        check.stdout.contains("quick_check: FAILED"),
        "{}",
        check.stdout
    );
    assert!(
        check.stdout.contains("postroom invariants not checked"),
        "{}",
        check.stdout
    );
    let json = cli_ok(&db, &["check", "--json"], 3).json();
    assert_eq!(json["integrity_ok"], false);
    assert!(!json["integrity_errors"].as_array().unwrap().is_empty());
    let status = cli_ok(&db, &["status"], 3);
    assert!(status.stderr.contains("corrupt"), "{}", status.stderr);
}

trait TapMkdir {
    fn tap_mkdir(self) -> Self;
}

impl TapMkdir for PathBuf {
    fn tap_mkdir(self) -> Self {
        std::fs::create_dir_all(&self).unwrap();
        self
    }
}

/// The operator's lookup by the message id a log line carries, and two
/// actions on a row that is not dead yet: `inbox retry` makes a failed row
/// due now (a real engine's workers then run it), `inbox cancel` makes a
/// failed one a dead letter with the reason, which nothing retries.
#[test]
fn inbox_find_retry_and_cancel_act_on_rows_by_message_id() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let engine = |flaky_fails: bool| {
        Postroom::builder()
            .durability(Durability::Normal)
            .backoff(Duration::from_secs(3600), Duration::from_secs(3600))
            .consumer("orders", handler_fn(apply))
            .consumer(
                "flaky",
                handler_fn(move |_, _| {
                    if flaky_fails {
                        Err(Failure::retry("upstream timeout"))
                    } else {
                        Ok(())
                    }
                }),
            )
            .consumer(
                "strict",
                handler_fn(|_, _| Err(Failure::reject("bad order: missing amount"))),
            )
            .open(&db)
            .unwrap()
    };
    {
        let room = engine(true);
        let outcome = room
            .deliver("flaky", Message::new("feed", "f-2", "{}"))
            .unwrap();
        assert!(matches!(outcome, Outcome::Failed { .. }), "{outcome:?}");
        room.shutdown(Duration::from_secs(10)).unwrap();
    }
    let found = cli_ok(&db, &["inbox", "find", "o-1", "--json"], 0).json();
    let rows = found.as_array().unwrap();
    assert_eq!(rows.len(), 1, "{found}");
    assert_eq!(
        (&rows[0]["consumer"], &rows[0]["source"], &rows[0]["status"]),
        (&"orders".into(), &"shop".into(), &"completed".into())
    );
    let human = cli_ok(&db, &["inbox", "find", "f-1"], 0).stdout;
    assert!(
        human.contains("flaky") && human.contains("1 row(s)"),
        "{human}"
    );
    cli_ok(&db, &["inbox", "find", "o-1", "--consumer", "flaky"], 5);
    cli_ok(&db, &["inbox", "find", "o-1", "--source", "feed"], 5);
    let missing = cli_ok(&db, &["inbox", "find", "never-sent"], 5);
    assert!(missing.stderr.contains("never-sent"), "{}", missing.stderr);

    let f1 = inbox_id(&db, "flaky", "f-1");
    let f2 = inbox_id(&db, "flaky", "f-2");
    let o1 = inbox_id(&db, "orders", "o-1");
    cli_ok(&db, &["inbox", "retry", &o1.to_string()], 5);
    cli_ok(
        &db,
        &["inbox", "cancel", &o1.to_string(), "--reason", "x"],
        5,
    );
    cli_ok(&db, &["inbox", "retry", &f1.to_string()], 0);
    let (due, queued): (Option<i64>, i64) = raw(&db)
        .query_row(
            "SELECT next_attempt_at, queued FROM postroom_inbox WHERE id = ?1",
            [f1],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(
        (due, queued),
        (None, 1),
        "due at once is NULL (no clock can hold it), and the workers' to run"
    );
    cli_ok(
        &db,
        &[
            "inbox",
            "cancel",
            &f2.to_string(),
            "--reason",
            "poison feed",
        ],
        0,
    );
    let conn = raw(&db);
    let (status, error): (String, String) = conn
        .query_row(
            "SELECT status, last_error FROM postroom_inbox WHERE id = ?1",
            [f2],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(status, "dead");
    assert!(
        error.starts_with("cancelled by operator: poison feed")
            && error.contains("upstream timeout"),
        "{error}"
    );
    // The engine's workers take the retried row at once (its backoff is an
    // hour); the cancelled one stays dead.
    let room = engine(false);
    eventually(30, "f-1 retried by the workers", || {
        room.find_message("flaky", "feed", "f-1")
            .unwrap()
            .is_some_and(|r| r.status == postroom::Status::Completed)
    });
    let f1_row = room.find_message("flaky", "feed", "f-1").unwrap().unwrap();
    assert_eq!(f1_row.attempts, 2, "its first attempt stays counted");
    let f2_row = room.find_message("flaky", "feed", "f-2").unwrap().unwrap();
    assert_eq!(f2_row.status, postroom::Status::Dead);
    // A retried inline row's redelivery is answered from the row.
    assert_eq!(
        room.deliver("flaky", Message::new("feed", "f-1", "{}"))
            .unwrap(),
        Outcome::Duplicate
    );
    room.shutdown(Duration::from_secs(10)).unwrap();
}

/// Shell completions and the man page are generated from the parser's
/// own definitions, so they name every command there is; bash completes
/// a subcommand after the database.
#[test]
fn completions_and_the_man_page_come_from_the_parser() {
    let run = |args: &[&str]| Command::new(BIN).args(args).output().unwrap();
    let bash = run(&["--completions", "bash"]);
    assert_eq!(bash.status.code(), Some(0));
    let script = String::from_utf8(bash.stdout).unwrap();
    assert!(
        script.contains("_postroom") && script.contains("retry"),
        "{script}"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("postroom.bash");
    std::fs::write(&file, &script).unwrap();
    let completed = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "source {}; COMP_WORDS=(postroom app.db inbox ''); COMP_CWORD=3; \
             _postroom postroom '' inbox; echo \"${{COMPREPLY[@]}}\"",
            file.display()
        ))
        .output();
    match completed {
        Ok(out) => {
            let words = String::from_utf8_lossy(&out.stdout);
            for sub in ["list", "show", "find", "retry", "cancel"] {
                assert!(
                    words.split_whitespace().any(|w| w == sub),
                    "{sub} in {words:?}"
                );
            }
        }
        Err(e) => eprintln!("no bash to try the script with: {e}"),
    }
    for shell in ["zsh", "fish", "powershell", "elvish"] {
        let out = run(&["--completions", shell]);
        assert_eq!(out.status.code(), Some(0), "{shell}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("inbox"),
            "{shell}"
        );
    }
    let man = run(&["--man"]);
    assert_eq!(man.status.code(), Some(0));
    let page = String::from_utf8(man.stdout).unwrap();
    assert!(
        page.contains(".TH postroom 1") && page.contains("cleanup"),
        "{page}"
    );
    let bad = run(&["--completions", "tcsh"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("bash, elvish, fish"));
}

#[test]
fn usage_errors_exit_with_code_2() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let bad_status = cli_ok(&db, &["inbox", "list", "--status", "sleeping"], 2);
    assert!(
        bad_status.stderr.contains("unknown inbox status")
            && bad_status
                .stderr
                .contains("pending, processing, completed, failed, dead"),
        "lists the valid ones: {}",
        bad_status.stderr
    );
    // The command before the database: the order is said.
    let out = Command::new(BIN)
        .args(["status", &db.to_string_lossy()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "the database comes first, then the command: postroom {} status",
            db.display()
        )),
        "{stderr}"
    );
    cli_ok(
        &db,
        &["dead", "list", "--outbox", "--consumer", "orders"],
        2,
    );
    cli_ok(&db, &["dead", "redrive"], 2);
    cli_ok(&db, &["inbox", "show", "not-a-number"], 2);
    cli_ok(&db, &[], 2);
    let help = cli_ok(&db, &["--help"], 0).stdout;
    assert!(help.contains("Exit codes:"), "{help}");
    assert!(
        help.contains("4  check found broken postroom invariants"),
        "{help}"
    );
}

/// A write lock held past the busy timeout is an operational error (1),
/// and changes nothing.
#[test]
fn a_busy_database_is_exit_code_1() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let s1 = inbox_id(&db, "strict", "s-1").to_string();
    let holder = raw(&db);
    holder.execute_batch("BEGIN IMMEDIATE").unwrap();
    let run = cli_ok(&db, &["dead", "redrive", &s1, "--busy-timeout", "200ms"], 1);
    assert!(run.stderr.contains("busy timeout"), "{}", run.stderr);
    // Reads do not wait for the writer (WAL).
    cli_ok(&db, &["status"], 0);
    holder.execute_batch("ROLLBACK").unwrap();
    assert_eq!(
        count(
            &holder,
            "SELECT count(*) FROM postroom_inbox WHERE status = 'dead'"
        ),
        1
    );
    cli_ok(&db, &["dead", "redrive", &s1], 0);
}

/// The CLI never creates the engine's lock file, and the library side of
/// it opens read connections that refuse writes.
#[test]
fn the_cli_leaves_the_engine_lock_alone_and_read_connections_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let lock = dir.path().join("app.db-postroom");
    std::fs::remove_file(&lock).unwrap();
    for args in [
        &["status"][..],
        &["check", "--full"],
        &["inbox", "list"],
        &["cleanup"],
        &[
            "dead",
            "discard",
            &inbox_id(&db, "strict", "s-1").to_string(),
        ],
    ] {
        cli_ok(&db, args, 0);
        assert!(!lock.exists(), "{args:?} created {}", lock.display());
    }

    let conn = postroom::admin::open(&db, postroom::admin::Access::ReadOnly).unwrap();
    let err = conn.execute("DELETE FROM postroom_inbox", []).unwrap_err();
    assert!(err.to_string().contains("readonly"), "{err}");
    assert!(matches!(
        postroom::admin::redrive(&conn, 1, 0),
        Err(postroom::Error::Sqlite { .. })
    ));
    assert!(matches!(
        postroom::admin::open(dir.path().join("nope.db"), postroom::admin::Access::ReadOnly),
        Err(postroom::Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound
    ));
}

/// Dedupe answers come from `postroom_inbox_keys`; `check` reports any
/// disagreement between it and the inbox, from both sides.
#[test]
fn check_reports_a_key_table_that_disagrees_with_the_inbox() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    assert_eq!(
        cli_ok(&db, &["check", "--json"], 0).json()["violations_total"],
        0
    );
    let o1 = inbox_id(&db, "orders", "o-1");
    let o3 = inbox_id(&db, "orders", "o-3");
    let conn = Connection::open(&db).unwrap();
    conn.execute_batch(&format!(
        "DELETE FROM postroom_inbox_keys WHERE inbox_id = {o1};
         UPDATE postroom_inbox_keys SET completed = 0 WHERE inbox_id = {o3};
         INSERT INTO postroom_inbox_keys VALUES ('orders', 'shop', 'ghost', 9999, zeroblob(16), 1);"
    ))
    .unwrap();
    let bad = cli_ok(&db, &["check", "--json"], 4).json();
    assert_eq!(bad["violations_total"], 3, "{bad}");
    let found: Vec<(String, String, i64)> = bad["violations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            (
                v["kind"].as_str().unwrap().to_string(),
                v["table"].as_str().unwrap().to_string(),
                v["id"].as_i64().unwrap(),
            )
        })
        .collect();
    let key_table = |table: &str, id| ("key_table".to_string(), table.to_string(), id);
    assert_eq!(
        found,
        [
            key_table("postroom_inbox", o1),
            key_table("postroom_inbox", o3),
            key_table("postroom_inbox_keys", 9999)
        ]
    );
}

/// A dropped key trigger is reported by `check` (the engine would refuse
/// to open the file).
#[test]
fn check_reports_a_missing_key_trigger() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    Connection::open(&db)
        .unwrap()
        .execute_batch("DROP TRIGGER postroom_inbox_key_delete")
        .unwrap();
    let bad = cli_ok(&db, &["check", "--json"], 4).json();
    assert_eq!(bad["violations_total"], 1, "{bad}");
    assert_eq!(bad["violations"][0]["kind"], "key_table");
    assert_eq!(
        bad["violations"][0]["detail"],
        "trigger postroom_inbox_key_delete is missing"
    );
}

/// A busy timeout SQLite cannot take (it counts milliseconds in a C int)
/// is a usage error, not a panic with a backtrace (exit 101).
#[test]
fn a_busy_timeout_past_what_sqlite_takes_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let run = cli_ok(&db, &["status", "--busy-timeout", "2147484s"], 2);
    assert!(run.stderr.contains("busy-timeout"), "{}", run.stderr);
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    cli_ok(&db, &["status", "--busy-timeout", "2147483s"], 0);
}

// ---------------------------------------------------------------- never makes things worse

/// Entry point of the child processes. Not a test: it only does something
/// when started by `spawn_child`, and is ignored otherwise.
#[test]
#[ignore = "entry point for child processes of the CLI tests"]
fn child_main() {
    let Some((role, db)) = common::child_role() else {
        return;
    };
    common::report("");
    assert_eq!(role, "deliver-then-wait", "unknown child role");
    let room = Postroom::builder()
        .workers(0)
        .consumer("orders", handler_fn(apply))
        .open(&db)
        .unwrap();
    let deliver = |n: u64| {
        let msg = Message::new("shop", format!("late-{n}"), format!("{{\"n\":{n}}}"));
        let outcome = room.deliver("orders", msg);
        if !matches!(outcome, Ok(Outcome::Processed { .. })) {
            common::report(&format!("FAILED {outcome:?}"));
        }
    };
    for n in 0..50 {
        deliver(n);
    }
    common::report("READY");
    // Busy until killed: an idle engine truncates its WAL.
    for n in 50.. {
        deliver(n);
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Every file beside `db` (name and bytes), to compare before and after.
fn files_of(db: &Path) -> Vec<(String, Vec<u8>)> {
    let dir = db.parent().unwrap();
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    files.sort();
    files
}

fn file_names(files: &[(String, Vec<u8>)]) -> Vec<&str> {
    files.iter().map(|(n, _)| n.as_str()).collect()
}

/// Every command that only reads, with the arguments it needs here.
const READ_COMMANDS: &[&[&str]] = &[
    &["status"],
    &["status", "--json"],
    &["metrics"],
    &["check"],
    &["check", "--full"],
    &["inbox", "list"],
    &["outbox", "list"],
    &["dead", "list"],
    &["dead", "list", "--outbox"],
    &["conflicts", "list"],
    &["cleanup", "--dry-run", "--retention", "0s"],
    &["dead", "redrive", "--all", "--dry-run"],
    &["dead", "discard", "--outbox", "--all", "--dry-run"],
    &["top", "--iterations", "1"],
];

/// After a kill -9 left a WAL, no read command checkpoints it or deletes
/// it: the database, the WAL and the `-shm` keep their bytes, and the
/// reads see the killed engine's last commits (they are in the WAL).
#[test]
fn read_commands_leave_a_killed_engines_files_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    // Before the kill: a read-write connection of the test's own, closed
    // last, would checkpoint the killed engine's WAL away.
    let s1 = inbox_id(&db, "strict", "s-1").to_string();
    let mut child = common::spawn_child("deliver-then-wait", &db, &[]);
    let lines = common::lines_of(&mut child);
    common::wait_for(&lines, "READY");
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let before = files_of(&db);
    assert!(
        file_names(&before).contains(&"app.db-wal"),
        "the kill left a WAL: {:?}",
        file_names(&before)
    );
    for args in READ_COMMANDS {
        let run = cli(&db, args);
        assert!(
            run.code == 0 || (args[0] == "check" && run.code == 4),
            "postroom {args:?}: exit {}\n{}",
            run.code,
            run.stderr
        );
        assert!(
            files_of(&db) == before,
            "postroom {args:?} changed the files: {:?} -> {:?}",
            file_names(&before),
            file_names(&files_of(&db))
        );
    }
    // Write commands refuse a WAL nothing has open (closing a read-write
    // connection would checkpoint it and delete it), changing nothing.
    let wal_bytes = std::fs::metadata(dir.path().join("app.db-wal"))
        .unwrap()
        .len();
    assert!(wal_bytes > 0, "the killed engine left commits in its WAL");
    for args in [
        &["dead", "redrive", &s1][..],
        &["conflicts", "discard", "999999"],
        &["cleanup", "--retention", "0s"],
    ] {
        let run = cli_ok(&db, args, 3);
        assert!(
            run.stderr
                .contains("the normal state after the application was killed")
                && run.stderr.contains("start the application"),
            "says what this is and what to run: {}",
            run.stderr
        );
        assert!(
            files_of(&db) == before,
            "postroom {args:?} changed the files"
        );
    }
    // A damaged WAL: SQLite silently stops reading at a bad checksum, so
    // `check` reads the frames itself and warns; reads say so.
    let damaged = dir.path().join("damaged");
    std::fs::create_dir(&damaged).unwrap();
    for name in ["app.db", "app.db-wal", "app.db-shm"] {
        std::fs::copy(dir.path().join(name), damaged.join(name)).unwrap();
    }
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut wal = std::fs::OpenOptions::new()
            .write(true)
            .open(damaged.join("app.db-wal"))
            .unwrap();
        // The second frame's page (32-byte header, 24-byte frame headers).
        wal.seek(SeekFrom::Start(32 + (24 + 4096) + 24 + 100))
            .unwrap();
        wal.write_all(&[0x5a; 8]).unwrap();
    }
    let check = cli_ok(&damaged.join("app.db"), &["check", "--json"], 0).json();
    assert!(check["wal_damaged_frames"].as_u64().unwrap() > 0, "{check}");
    assert_eq!(check["warnings"][0]["kind"], "wal_damage", "{check}");
    let status = cli_ok(&damaged.join("app.db"), &["status"], 0);
    assert!(
        status.stderr.contains("the -wal file is damaged"),
        "{}",
        status.stderr
    );
    // An empty database file beside the WAL: SQLite would delete the WAL
    // at open; the read refuses and leaves it.
    let copy = dir.path().join("copy");
    std::fs::create_dir(&copy).unwrap();
    for name in ["app.db-wal", "app.db-shm"] {
        std::fs::copy(dir.path().join(name), copy.join(name)).unwrap();
    }
    std::fs::write(copy.join("app.db"), b"").unwrap();
    let copied = files_of(&copy.join("app.db"));
    cli_ok(&copy.join("app.db"), &["status"], 3);
    assert!(
        files_of(&copy.join("app.db")) == copied,
        "the WAL beside an empty file survives"
    );
    // The killed engine's commits (50 before READY, more after) were read.
    let status = cli_ok(&db, &["status", "--json"], 0).json();
    let completed = consumer(&status, "orders")["completed"].as_u64().unwrap();
    assert!(completed >= 53, "{status}");
    // And the operator is told who should recover the WAL.
    let run = cli_ok(&db, &["status"], 0);
    assert!(
        run.stderr.contains("no engine has the database open"),
        "{}",
        run.stderr
    );
}

/// A database this user may not read: exit 3 (bad database, as
/// documented), naming the file and "permission denied", not SQLite's
/// "unable to open" of an internal URI. Run as an unprivileged user: as
/// `nobody` through `setpriv` when the test runs as root (CI does), else
/// as the test's own user on a file of mode 000.
#[cfg(unix)]
#[test]
fn an_unreadable_database_is_a_bad_database_that_says_permission_denied() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let db = populated(dir.path());
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false);
    let run_as_user = |args: &[&str]| -> Run {
        let out = if root {
            // Where nobody may run it: the build directory may be under
            // a home only root enters.
            let bin = dir.path().join("postroom-bin");
            if !bin.exists() {
                std::fs::copy(BIN, &bin).unwrap();
                std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
            Command::new("setpriv")
                .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
                .arg(&bin)
                .arg(&db)
                .args(args)
                .output()
                .expect("run setpriv")
        } else {
            Command::new(BIN).arg(&db).args(args).output().unwrap()
        };
        Run {
            code: out.status.code().expect("exit code"),
            stdout: String::from_utf8(out.stdout).unwrap(),
            stderr: String::from_utf8(out.stderr).unwrap(),
        }
    };
    std::fs::set_permissions(
        &db,
        std::fs::Permissions::from_mode(if root { 0o600 } else { 0o000 }),
    )
    .unwrap();
    for args in [&["status"][..], &["dead", "list"], &["cleanup"]] {
        let run = run_as_user(args);
        assert_eq!(run.code, 3, "postroom {args:?}: {}", run.stderr);
        assert!(
            run.stderr.contains("permission denied") && run.stderr.contains("app.db"),
            "postroom {args:?}: {}",
            run.stderr
        );
        assert!(
            !run.stderr.contains("immutable") && !run.stderr.contains("file:"),
            "postroom {args:?}: an internal URI: {}",
            run.stderr
        );
    }
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(run_as_user(&["status"]).code, 0, "readable again");
}

/// On a write-protected database with no WAL (an engine shut down
/// cleanly), reads create no `-wal` or `-shm`; and a user who may not
/// write the file or its directory can read it.
// Unix modes and symbolic links.
#[cfg(unix)]
#[test]
fn read_commands_create_no_file_and_work_for_a_user_without_write_access() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o444)).unwrap();
    let before = files_of(&db);
    assert_eq!(
        file_names(&before),
        ["app.db", "app.db-postroom"],
        "a clean shutdown leaves no WAL"
    );
    for args in READ_COMMANDS {
        let run = cli(&db, args);
        assert_eq!(run.code, 0, "postroom {args:?}: {}", run.stderr);
        assert!(
            files_of(&db) == before,
            "postroom {args:?}: {:?}",
            file_names(&files_of(&db))
        );
    }
    // Another user, with read access only (the test runs as root in CI).
    let root = std::process::Command::new("id").arg("-u").output().unwrap();
    if String::from_utf8_lossy(&root.stdout).trim() != "0" {
        eprintln!("skipped the other-user half: not root");
        return;
    }
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(BIN)
        .arg(&db)
        .args(["status", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(consumer(&status, "orders")["completed"], 3);
    assert!(files_of(&db) == before);
}

/// Damage the inbox table's pages (the schema stays readable).
fn damage_inbox(db: &Path) {
    raw(db)
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .unwrap();
    let pages: Vec<u64> = raw(db)
        .prepare("SELECT pageno FROM dbstat WHERE name = 'postroom_inbox'")
        .unwrap()
        .query_map([], |r| r.get::<_, i64>(0))
        .unwrap()
        .map(|p| p.unwrap() as u64)
        .collect();
    use std::io::{Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new().write(true).open(db).unwrap();
    for page in pages {
        f.seek(SeekFrom::Start((page - 1) * 4096)).unwrap();
        let mut junk = vec![0x0d, 0, 0, 0, 5, 0x0f, 0];
        junk.resize(4000, 0xaa);
        f.write_all(&junk).unwrap();
    }
}

/// Write commands run the engine's integrity check first and refuse a
/// damaged file with exit code 3, changing nothing; listing commands that
/// meet the damage say so (exit 3), not a partial list.
#[test]
fn write_commands_refuse_a_damaged_database_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let s1 = inbox_id(&db, "strict", "s-1").to_string();
    damage_inbox(&db);
    let before = files_of(&db);
    for args in [
        &["cleanup", "--retention", "0s"][..],
        &["dead", "redrive", &s1],
        &["dead", "discard", &s1],
        &["dead", "redrive", "--outbox", "--all", "--yes"],
        &["conflicts", "discard", "1"],
    ] {
        let run = cli_ok(&db, args, 3);
        assert!(run.stderr.contains("corrupt"), "{args:?}: {}", run.stderr);
        assert!(
            files_of(&db) == before,
            "postroom {args:?} changed the file"
        );
    }
    let run = cli_ok(&db, &["inbox", "list"], 3);
    assert!(run.stdout.is_empty(), "no partial list: {}", run.stdout);
}

/// A write-protected file or directory (refused even when root could
/// write it: the mode says what the owner meant) and a read-only
/// filesystem (EROFS) are exit code 3 for a write command, changing
/// nothing.
// Unix modes and symbolic links.
#[cfg(unix)]
#[test]
fn a_read_only_database_is_exit_code_3_for_write_commands() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let made = populated(dir.path());
    let s1 = inbox_id(&made, "strict", "s-1").to_string();
    std::fs::set_permissions(&made, std::fs::Permissions::from_mode(0o444)).unwrap();
    let before = files_of(&made);
    for args in [
        &["dead", "redrive", &s1][..],
        &["dead", "discard", "--all", "--yes"],
        &["cleanup", "--retention", "1s"],
    ] {
        let run = cli_ok(&made, args, 3);
        assert!(run.stderr.contains("read-only"), "{args:?}: {}", run.stderr);
        assert!(
            files_of(&made) == before,
            "postroom {args:?} changed a 0444 file"
        );
    }
    std::fs::set_permissions(&made, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o555)).unwrap();
    let run = cli_ok(&made, &["dead", "redrive", &s1], 3);
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    assert!(run.stderr.contains("read-only"), "{}", run.stderr);

    let Some(fs) = common::Tmpfs::mount(16 * 1024 * 1024) else {
        return;
    };
    let db = fs.path().join("app.db");
    std::fs::copy(&made, &db).unwrap();
    fs.remount_read_only();
    for args in [
        &["dead", "redrive", &s1][..],
        &["cleanup", "--retention", "0s"],
    ] {
        let run = cli_ok(&db, args, 3);
        assert!(run.stderr.contains("read-only"), "{args:?}: {}", run.stderr);
    }
    // Reads still work on it.
    cli_ok(&db, &["status"], 0);
}

/// A symbolic link loop is a bad database path (3), not an operational
/// error; under `--json` even usage errors are the documented JSON object.
// Unix modes and symbolic links.
#[cfg(unix)]
#[test]
fn a_symlink_loop_is_exit_code_3_and_json_usage_errors_are_json() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.db");
    let b = dir.path().join("b.db");
    std::os::unix::fs::symlink(&b, &a).unwrap();
    std::os::unix::fs::symlink(&a, &b).unwrap();
    let run = cli_ok(&a, &["status"], 3);
    assert!(run.stderr.contains("a.db"), "{}", run.stderr);

    let db = populated(dir.path());
    let run = cli_ok(&db, &["inbox", "list", "--status", "sleeping", "--json"], 2);
    let err: Value = serde_json::from_str(run.stderr.trim()).expect("a JSON error object");
    assert_eq!(err["exit_code"], 2);
    assert!(err["error"].as_str().unwrap().contains("sleeping"), "{err}");
    let run = cli_ok(&db, &["--json", "no-such-command"], 2);
    let err: Value = serde_json::from_str(run.stderr.trim()).expect("a JSON error object");
    assert_eq!(err["exit_code"], 2);
}

/// Output that cannot be written (a full disk) is exit code 1 with the
/// reason, not a silent success.
// /dev/full: Linux.
#[cfg(target_os = "linux")]
#[test]
fn a_failed_output_write_is_exit_code_1() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let out = Command::new(BIN)
        .arg(&db)
        .arg("status")
        .stdout(std::fs::File::create("/dev/full").unwrap())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("writing the output"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What a sender controls (message ids, errors, header names and values,
/// text payloads) cannot drive the terminal or forge lines in human
/// output; `--json` carries it exactly.
#[test]
fn control_characters_from_senders_are_escaped_for_people_and_exact_in_json() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let evil_id = "s-9\x1b[2J\rFORGED";
    let room = Postroom::builder()
        .workers(0)
        .consumer(
            "strict",
            handler_fn(|_, _| Err(Failure::reject("boom\x1b]0;title\x07\nok line"))),
        )
        .open(&db)
        .unwrap();
    let payload = b"text \x1b[2J payload\nsecond line".to_vec();
    let outcome = room
        .deliver("strict", Message::new("feed", evil_id, payload))
        .unwrap();
    assert!(matches!(outcome, Outcome::Dead { .. }), "{outcome:?}");
    room.shutdown(Duration::from_secs(5)).unwrap();
    let s1 = inbox_id(&db, "strict", evil_id);
    // Header names the engine would refuse, as an older or hostile writer
    // could have stored them.
    raw(&db)
        .execute(
            "UPDATE postroom_inbox SET headers = ?1 WHERE id = ?2",
            params![
                r#"{"x-\u001b[31m":"v\u001b[0m\r\n","bidi":"abc\u202ecba"}"#,
                s1
            ],
        )
        .unwrap();
    for args in [
        vec!["inbox", "show", &s1.to_string()[..]],
        vec!["inbox", "list"],
        vec!["dead", "list"],
        vec!["dead", "redrive", "--all", "--dry-run"],
    ] {
        let run = cli_ok(&db, &args, 0);
        assert!(
            !run.stdout.contains('\x1b'),
            "{args:?}: raw ESC in\n{}",
            run.stdout
        );
        assert!(!run.stdout.contains('\r'), "{args:?}: raw CR");
        assert!(
            !run.stdout.contains('\u{202e}'),
            "{args:?}: raw bidi override"
        );
        assert!(
            run.stdout.contains("\\u{1b}"),
            "{args:?}: escaped\n{}",
            run.stdout
        );
    }
    let show = cli_ok(&db, &["inbox", "show", &s1.to_string()], 0).stdout;
    assert!(
        show.contains("payload\nsecond line"),
        "payload newlines kept:\n{show}"
    );
    let json = cli_ok(&db, &["inbox", "show", &s1.to_string(), "--json"], 0).json();
    assert_eq!(json["message_id"], evil_id);
    assert_eq!(json["headers"]["x-\u{1b}[31m"], "v\u{1b}[0m\r\n");
    assert_eq!(
        json["payload"]["value"],
        "text \x1b[2J payload\nsecond line"
    );
}

/// `--json` keeps a payload as stored: numbers past a double, duplicate
/// keys and key order, and the exact bytes in base64 for a replay.
#[test]
fn json_output_carries_payloads_exactly() {
    use base64::Engine as _;
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let s1 = inbox_id(&db, "strict", "s-1").to_string();
    let stored = br#"{"z":1,"big":123456789012345678901234567890,"a":1,"a":2}"#;
    raw(&db)
        .execute(
            "UPDATE postroom_inbox SET payload = ?1 WHERE id = ?2",
            params![stored.to_vec(), s1],
        )
        .unwrap();
    let run = cli_ok(&db, &["dead", "list", "--json"], 0);
    assert!(
        run.stdout.contains("123456789012345678901234567890"),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains(r#""a":1,"a":2"#), "{}", run.stdout);
    let rows = run.json();
    let b64 = rows[0]["payload"]["base64"].as_str().unwrap();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap();
    assert_eq!(bytes, stored);
    let human = cli_ok(&db, &["inbox", "show", &s1], 0).stdout;
    assert!(
        human.contains("\"big\": 123456789012345678901234567890"),
        "{human}"
    );
    assert!(human.contains("\"a\": 1,\n  \"a\": 2"), "{human}");
}

// ---------------------------------------------------------------- what operators can now do

/// A populated database plus key `k-1`'s two pending rows: the first
/// backing off after failures, the second held back by it.
fn with_held_back_key(dir: &Path) -> (PathBuf, i64, i64) {
    let db = populated(dir);
    let conn = raw(&db);
    let future = postroom::admin::now_ms() + 3_600_000;
    let mut seqs = Vec::new();
    for (id, attempts, next) in [("k-first", 2, future), ("k-second", 0, 0)] {
        conn.execute(
            "INSERT INTO postroom_outbox (message_id, topic, key, payload, status, attempts,
                 last_error, created_at, next_attempt_at)
             VALUES (?1, 'billing', 'k-1', x'7b7d', 'pending', ?2, ?3, 1, ?4)",
            params![id, attempts, (attempts > 0).then_some("broker down"), next],
        )
        .unwrap();
        seqs.push(conn.last_insert_rowid());
    }
    (db, seqs[0], seqs[1])
}

#[test]
fn outbox_list_and_show_say_which_key_holds_the_rest_back_and_why() {
    let dir = tempfile::tempdir().unwrap();
    let (db, first, second) = with_held_back_key(dir.path());
    let all = cli_ok(&db, &["outbox", "list", "--json"], 0).json();
    let seqs: Vec<i64> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["seq"].as_i64().unwrap())
        .collect();
    assert_eq!(seqs.len(), 5);
    assert!(
        seqs.windows(2).all(|w| w[0] > w[1]),
        "newest first: {seqs:?}"
    );
    let pending = cli_ok(&db, &["outbox", "list", "--status", "pending", "--json"], 0).json();
    assert_eq!(pending.as_array().unwrap().len(), 2);
    let keyed = cli_ok(
        &db,
        &["outbox", "list", "--key", "k-1", "--oldest-first", "--json"],
        0,
    )
    .json();
    assert_eq!(keyed[0]["seq"], first);
    assert_eq!(keyed[0]["last_error"], "broker down");
    assert!(keyed[0]["next_attempt_at"].is_i64(), "{keyed}");
    let shipping = cli_ok(&db, &["outbox", "list", "--topic", "shipping", "--json"], 0).json();
    assert_eq!(shipping.as_array().unwrap().len(), 2);

    let show = cli_ok(&db, &["outbox", "show", &second.to_string(), "--json"], 0).json();
    assert_eq!(show["held_back_by"]["seq"], first, "{show}");
    assert_eq!(show["held_back_by"]["last_error"], "broker down");
    let human = cli_ok(&db, &["outbox", "show", &second.to_string()], 0).stdout;
    assert!(
        human.contains(&format!("held back by     seq {first} of the same key")),
        "{human}"
    );
    assert!(human.contains("broker down"), "{human}");
    let holder = cli_ok(&db, &["outbox", "show", &first.to_string(), "--json"], 0).json();
    assert_eq!(holder["holding_back"], 1);
    assert!(holder["held_back_by"].is_null());
    let human = cli_ok(&db, &["outbox", "list"], 0).stdout;
    assert!(human.contains("NEXT TRY / SENT"), "{human}");
    cli_ok(&db, &["outbox", "show", "424242"], 5);
}

/// Several dead letters of two consumers with two errors.
fn with_dead_letters(dir: &Path) -> PathBuf {
    let path = dir.join("dead.db");
    let room = Postroom::builder()
        .workers(0)
        .consumer(
            "a",
            handler_fn(|_, m| Err(Failure::reject(format!("bad {}", m.payload().len())))),
        )
        .consumer(
            "b",
            handler_fn(|_, _| Err(Failure::reject("timeout talking to bank"))),
        )
        .open(&path)
        .unwrap();
    for n in 0..4 {
        room.deliver(
            "a",
            Message::new("s", format!("a-{n}"), "x".repeat(n % 2 + 1)),
        )
        .unwrap();
        room.deliver("b", Message::new("s", format!("b-{n}"), "y"))
            .unwrap();
    }
    room.shutdown(Duration::from_secs(5)).unwrap();
    path
}

#[test]
fn bulk_redrive_and_discard_dry_run_first_and_need_a_confirmation() {
    let dir = tempfile::tempdir().unwrap();
    let db = with_dead_letters(dir.path());
    let dead = |db: &Path| {
        count(
            &raw(db),
            "SELECT count(*) FROM postroom_inbox WHERE status = 'dead'",
        )
    };
    assert_eq!(dead(&db), 8);

    // Listed newest first, a page at a time.
    let ids = |v: &Value| -> Vec<i64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| r["id"].as_i64().unwrap())
            .collect()
    };
    let first = cli_ok(&db, &["dead", "list", "--limit", "3", "--json"], 0).json();
    let first = ids(&first);
    assert!(
        first.windows(2).all(|w| w[0] > w[1]),
        "newest first: {first:?}"
    );
    let after = first[2].to_string();
    let human = cli_ok(&db, &["dead", "list", "--limit", "3"], 0).stdout;
    assert!(
        human.contains(&format!("next page: --after {after}")),
        "{human}"
    );
    let next = cli_ok(
        &db,
        &["dead", "list", "--limit", "3", "--after", &after, "--json"],
        0,
    )
    .json();
    assert!(ids(&next).iter().all(|id| *id < first[2]), "{next}");
    assert_eq!(ids(&next).len(), 3);

    // Dry run: what it would do, nothing done.
    let dry = cli_ok(
        &db,
        &[
            "dead",
            "redrive",
            "--consumer",
            "a",
            "--error",
            "bad 2",
            "--dry-run",
            "--json",
        ],
        0,
    )
    .json();
    assert_eq!(dry["matched"], 2, "{dry}");
    assert_eq!(dry["dry_run"], true);
    let human = cli_ok(&db, &["dead", "redrive", "--error", "bank", "--dry-run"], 0).stdout;
    assert!(
        human.contains("would redrive 4 inbox dead letter(s)"),
        "{human}"
    );
    // In the order `dead list` shows them: newest first.
    let ids_of = |text: &str| -> Vec<i64> {
        text.lines()
            .filter(|l| l.split_whitespace().count() > 5)
            .filter_map(|l| l.split_whitespace().next()?.parse().ok())
            .collect()
    };
    let listed = cli_ok(&db, &["dead", "list", "--error", "bank"], 0).stdout;
    assert_eq!(ids_of(&human).len(), 4, "{human}");
    assert_eq!(ids_of(&human), ids_of(&listed), "{human}\n{listed}");
    assert_eq!(dead(&db), 8);

    // No terminal to confirm on and no --yes: refused, nothing done.
    let run = cli_ok(&db, &["dead", "redrive", "--consumer", "b"], 2);
    assert!(run.stderr.contains("--yes"), "{}", run.stderr);
    assert_eq!(dead(&db), 8);
    // Neither an id nor a selection: a usage error.
    cli_ok(&db, &["dead", "redrive"], 2);

    let done = cli_ok(
        &db,
        &["dead", "redrive", "--consumer", "b", "--yes", "--json"],
        0,
    )
    .json();
    assert_eq!(done["done"], 4, "{done}");
    assert_eq!(done["skipped"], 0);
    assert_eq!(dead(&db), 4);
    assert_eq!(
        count(&raw(&db), "SELECT count(*) FROM postroom_inbox WHERE consumer = 'b' AND status = 'pending' AND attempts = 0"),
        4
    );
    let human = cli_ok(&db, &["dead", "discard", "--all", "--yes"], 0).stdout;
    assert!(
        human.contains("discard: 4 inbox dead letter(s) done"),
        "{human}"
    );
    assert_eq!(dead(&db), 0);
}

#[test]
fn top_refreshes_with_rates_and_json_frames() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let run = cli_ok(&db, &["top", "--iterations", "2", "--interval", "100ms"], 0);
    assert_eq!(
        run.stdout.matches("postroom top").count(),
        2,
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("rates/s    received 0.0"),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains("relay lag  none"), "{}", run.stdout);
    assert!(
        !run.stdout.contains('\x1b'),
        "no screen control when not a terminal"
    );
    let run = cli_ok(
        &db,
        &["top", "--iterations", "2", "--interval", "50ms", "--json"],
        0,
    );
    let frames: Vec<Value> = run
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(frames.len(), 2);
    assert!(frames[0]["rates"].is_null());
    assert_eq!(frames[1]["rates"]["completed_per_sec"], 0.0);
    assert_eq!(frames[1]["status"]["outbox"]["sent"], 2);
}

#[test]
fn help_names_every_command_with_the_database_and_one_default() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("x.db");
    let top = cli_ok(&db, &["--help"], 0).stdout;
    for name in [
        "status",
        "top",
        "inbox",
        "outbox",
        "dead",
        "conflicts",
        "cleanup",
        "check",
        "metrics",
    ] {
        assert!(top.contains(&format!("\n  {name} ")), "{name} in\n{top}");
    }
    for (args, usage) in [
        (&["inbox", "list", "--help"][..], "postroom <DB> inbox list"),
        (&["outbox", "show", "--help"], "postroom <DB> outbox show"),
        (&["dead", "redrive", "--help"], "postroom <DB> dead redrive"),
        (&["top", "--help"], "postroom <DB> top"),
    ] {
        let help = cli_ok(&db, args, 0).stdout;
        assert!(help.contains(usage), "{usage} in\n{help}");
    }
    let cleanup = cli_ok(&db, &["cleanup", "--help"], 0).stdout;
    assert!(cleanup.contains("[default: 7d]"), "{cleanup}");
    assert!(!cleanup.contains("(default: 7 days)"), "{cleanup}");
}

/// An immutable read (no WAL when it opened) cannot see an engine that
/// opens meanwhile; `admin::read` notices the files changed and reads
/// again, through the engine's WAL.
#[test]
fn an_immutable_read_runs_again_when_an_engine_opened_meanwhile() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let mut engine = None;
    let mut calls = 0;
    let (completed, view) = postroom::admin::read(&db, Duration::from_secs(5), |conn, view| {
        calls += 1;
        if engine.is_none() {
            assert!(view.immutable, "no WAL beside a cleanly shut down database");
            let room = Postroom::builder()
                .workers(0)
                .consumer("orders", handler_fn(apply))
                .open(&db)?;
            room.deliver("orders", Message::new("shop", "o-new", "{}"))?;
            engine = Some(room);
        }
        Ok(count(
            conn,
            "SELECT count(*) FROM postroom_inbox WHERE status = 'completed'",
        ))
    })
    .unwrap();
    assert_eq!(calls, 2, "read again after the engine opened");
    assert!(!view.immutable, "the second read goes through the WAL");
    assert_eq!(view.engine_running, Some(true));
    assert_eq!(completed, 4, "the engine's commit is seen");
    engine.unwrap().shutdown(Duration::from_secs(5)).unwrap();
}

/// A row whose text rotted is listed lossily, not an error that hides
/// every other row.
#[test]
fn a_row_with_rotted_text_does_not_hide_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let s1 = inbox_id(&db, "strict", "s-1");
    raw(&db)
        .execute(
            "UPDATE postroom_inbox SET last_error = CAST(x'6162ff' AS TEXT) WHERE id = ?1",
            [s1],
        )
        .unwrap();
    let all = cli_ok(&db, &["inbox", "list", "--json"], 0).json();
    assert_eq!(all.as_array().unwrap().len(), 5);
    let dead = cli_ok(&db, &["dead", "list"], 0).stdout;
    assert!(dead.contains("ab\u{fffd}"), "{dead}");
}

/// `top` stops when its reader does (`| head`), rather than refresh for
/// nobody until killed.
#[test]
fn top_stops_when_its_reader_goes_away() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let mut child = Command::new(BIN)
        .arg(&db)
        .args(["top", "--interval", "100ms"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let status = common::wait_or_kill(&mut child, 10, "top to stop after its reader left");
    assert!(status.success(), "{status:?}");
}

/// `check` verifies what the engine relies on beyond the rows: postroom's
/// triggers as the schema ships them (a missing or edited one is a
/// violation, someone else's trigger on a postroom table a warning), the
/// sequence watermarks' invariants, and that the file is the one its
/// instance id was given to (a copy is a warning: the next open re-mints).
#[test]
fn check_verifies_triggers_watermarks_and_the_files_identity() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let room = Postroom::builder()
        .workers(0)
        .consumer("c", handler_fn(|_, _| Ok(())))
        .open(&db)
        .unwrap();
    for seq in [1, 2, 4] {
        room.deliver(
            "c",
            Message::new("dev", format!("m-{seq}"), "p").with_sequence(seq),
        )
        .unwrap();
    }
    room.shutdown(Duration::from_secs(10)).unwrap();
    drop(room);
    let kinds = |report: &Value, list: &str| -> Vec<String> {
        report[list]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["kind"].as_str().unwrap().to_owned())
            .collect()
    };
    let clean = cli_ok(&db, &["check", "--json"], 0).json();
    assert_eq!(clean["warnings_total"], 0, "{clean}");

    // A copy of the file: a warning, the original stays clean.
    let copy = dir.path().join("copy.db");
    std::fs::copy(&db, &copy).unwrap();
    let copied = cli_ok(&copy, &["check", "--json"], 0).json();
    assert_eq!(kinds(&copied, "warnings"), ["identity"], "{copied}");

    let conn = raw(&db);
    // Someone else's trigger on a postroom table: a warning.
    conn.execute_batch(
        "CREATE TRIGGER app_audit AFTER INSERT ON postroom_outbox BEGIN SELECT 1; END;",
    )
    .unwrap();
    let foreign = cli_ok(&db, &["check", "--json"], 0).json();
    assert_eq!(kinds(&foreign, "warnings"), ["trigger"], "{foreign}");
    // A watermark trigger edited to do nothing: a violation.
    conn.execute_batch(
        "DROP TRIGGER postroom_inbox_seq_seen;
         CREATE TRIGGER postroom_inbox_seq_seen AFTER INSERT ON postroom_inbox
         WHEN 0 BEGIN SELECT 1; END;",
    )
    .unwrap();
    let altered = cli_ok(&db, &["check", "--json"], 4).json();
    assert_eq!(kinds(&altered, "violations"), ["trigger"], "{altered}");
    conn.execute_batch("DROP TRIGGER postroom_inbox_seq_seen; DROP TRIGGER app_audit;")
        .unwrap();
    let missing = cli_ok(&db, &["check", "--json"], 4).json();
    assert_eq!(kinds(&missing, "violations"), ["trigger"], "{missing}");
    assert!(
        missing["violations"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("postroom_inbox_seq_seen"),
        "{missing}"
    );
    conn.execute_batch(postroom::SCHEMA_SQL).unwrap();
    check_clean(&db);

    // The watermarks contradicting themselves: each a violation.
    let (w, listed): (i64, i64) = conn
        .query_row(
            "SELECT settled_below, (SELECT count(*) FROM postroom_watermark_settled)
             FROM postroom_watermarks",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((w, listed), (3, 1));
    for (tamper, undo) in [
        (
            "UPDATE postroom_watermarks SET settled_below = 0",
            "UPDATE postroom_watermarks SET settled_below = 3",
        ),
        (
            "UPDATE postroom_watermark_settled SET seq = 3",
            "UPDATE postroom_watermark_settled SET seq = 4",
        ),
        (
            "UPDATE postroom_watermark_settled SET seq = 9",
            "UPDATE postroom_watermark_settled SET seq = 4",
        ),
        (
            "UPDATE postroom_watermark_settled SET stream = 'elsewhere'",
            "UPDATE postroom_watermark_settled SET stream = 'dev'",
        ),
    ] {
        conn.execute_batch(tamper).unwrap();
        let bad = cli_ok(&db, &["check", "--json"], 4).json();
        assert!(
            kinds(&bad, "violations").iter().all(|k| k == "watermark"),
            "{tamper}: {bad}"
        );
        conn.execute_batch(undo).unwrap();
    }
    check_clean(&db);
    // A retained row below the watermark that has not settled: a warning.
    conn.execute_batch(
        "UPDATE postroom_inbox SET status = 'pending', processed_at = NULL WHERE seq = 1",
    )
    .unwrap();
    let unsettled = cli_ok(&db, &["check", "--json"], 0).json();
    assert_eq!(kinds(&unsettled, "warnings"), ["watermark"], "{unsettled}");
}

/// Runs the CLI with stdout read on a thread, at most `max_bytes` of it
/// kept (the rest is drained, so the child never blocks on a full pipe),
/// and the child killed after `secs`: a view that would print gigabytes
/// fails the test instead of filling the machine. Returns the exit code
/// (`None`: killed), the bytes it printed in all, what was kept, and how
/// long it ran.
fn cli_bounded(
    db: &Path,
    args: &[&str],
    secs: u64,
    max_bytes: usize,
) -> (Option<i32>, usize, String, Duration) {
    use std::io::Read;
    let started = std::time::Instant::now();
    let mut child = Command::new(BIN)
        .arg(db)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run the postroom binary");
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let (mut kept, mut total, mut buf) = (Vec::new(), 0usize, vec![0u8; 64 * 1024]);
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            total += n;
            let room = max_bytes.saturating_sub(kept.len());
            kept.extend_from_slice(&buf[..n.min(room)]);
        }
        (total, kept)
    });
    let deadline = started + Duration::from_secs(secs);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let elapsed = started.elapsed();
    let (total, kept) = reader.join().unwrap();
    (
        status,
        total,
        String::from_utf8_lossy(&kept).into_owned(),
        elapsed,
    )
}

#[test]
fn hostile_payloads_are_shown_bounded_and_json_stays_exact() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    let f1 = inbox_id(&db, "flaky", "f-1");
    // 200 KB of nested arrays: valid JSON, 100,000 levels deep.
    let depth = 100_000;
    let nested = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
    raw(&db)
        .execute(
            "UPDATE postroom_inbox SET payload = ?1 WHERE id = ?2",
            params![nested.as_bytes(), f1],
        )
        .unwrap();
    // Generous bounds for a busy machine; the view takes milliseconds.
    let (code, total, shown, took) =
        cli_bounded(&db, &["inbox", "show", &f1.to_string()], 10, 4 << 20);
    assert_eq!(
        code,
        Some(0),
        "killed or failed after {took:?}, {total} bytes printed"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert!(total < 4 << 20, "{total} bytes for a 200 KB payload");
    eprintln!("inbox show, 200 KB of nested arrays: {total} bytes in {took:?}");
    assert!(shown.contains("payload (200000 bytes, JSON):"), "{shown}");
    assert!(shown.contains("… truncated"), "no truncation marker");
    // The exact payload is one flag away, linear and without recursion.
    let (code, total, json, took) = cli_bounded(
        &db,
        &["inbox", "show", &f1.to_string(), "--json"],
        10,
        4 << 20,
    );
    assert_eq!(code, Some(0), "--json: killed or failed after {took:?}");
    assert!(total < 4 << 20, "--json: {total} bytes");
    assert!(json.contains(&nested), "--json keeps the payload exactly");
    eprintln!("inbox show --json, the same: {total} bytes in {took:?}");

    // Wide rather than deep: a 1 MB flat array, and 1 MB of text lines.
    for (what, payload) in [
        ("JSON", format!("[{}1]", "1,".repeat(500_000))),
        ("text", "a line of text\n".repeat(70_000)),
    ] {
        raw(&db)
            .execute(
                "UPDATE postroom_inbox SET payload = ?1 WHERE id = ?2",
                params![payload.as_bytes(), f1],
            )
            .unwrap();
        let (code, total, shown, took) =
            cli_bounded(&db, &["inbox", "show", &f1.to_string()], 10, 4 << 20);
        assert_eq!(code, Some(0), "{what}: killed or failed after {took:?}");
        assert!(total < 512 << 10, "{what}: {total} bytes shown");
        assert!(shown.contains("… truncated"), "{what}: no marker");
    }
}

#[test]
fn rows_only_a_redelivery_revives_are_shown_waiting_for_redelivery_with_their_age() {
    let dir = tempfile::tempdir().unwrap();
    let db = populated(dir.path());
    // f-1 failed inline: no worker retries it, only its sender can.
    let f1 = inbox_id(&db, "flaky", "f-1").to_string();

    let status = cli_ok(&db, &["status", "--json"], 0).json();
    let flaky = status["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer"] == "flaky")
        .unwrap()
        .clone();
    assert_eq!(flaky["failed"], 1, "{flaky}");
    assert_eq!(flaky["waiting_for_redelivery"], 1, "{flaky}");
    assert!(
        flaky["oldest_waiting_for_redelivery_age_ms"]
            .as_i64()
            .unwrap()
            >= 0,
        "{flaky}"
    );
    let human = cli_ok(&db, &["status"], 0).stdout;
    assert!(
        human.contains("awaiting their sender's redelivery"),
        "{human}"
    );
    let row = table_row(&human, "flaky");
    assert_eq!(row[1..6], ["0", "0", "1", "0", "0"], "{human}");
    let top = cli_ok(&db, &["top", "--iterations", "1"], 0).stdout;
    assert!(top.contains("awaiting their sender's redelivery"), "{top}");

    let listed = cli_ok(
        &db,
        &["inbox", "list", "--waiting-for-redelivery", "--json"],
        0,
    )
    .json();
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["message_id"], "f-1");
    assert_eq!(listed[0]["waiting_for_redelivery"], true);
    let human = cli_ok(&db, &["inbox", "list", "--consumer", "flaky"], 0).stdout;
    assert!(human.contains("failed (waiting for redelivery)"), "{human}");
    let shown = cli_ok(&db, &["inbox", "show", &f1], 0).stdout;
    assert!(shown.contains("when its sender redelivers it"), "{shown}");

    let metrics = cli_ok(&db, &["metrics"], 0).stdout;
    assert!(
        metrics.contains("postroom_waiting_for_redelivery{consumer=\"flaky\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("postroom_oldest_waiting_for_redelivery_seconds{consumer=\"flaky\"}"),
        "{metrics}"
    );

    // Retention never deletes it, however old: it keeps its payload until
    // its sender redelivers it.
    raw(&db)
        .execute(
            "UPDATE postroom_inbox SET received_at = 1000, updated_at = 1000 WHERE id = ?1",
            [f1.parse::<i64>().unwrap()],
        )
        .unwrap();
    let cleaned = cli_ok(&db, &["cleanup", "--retention", "0s", "--json"], 0).json();
    assert!(
        cleaned["inbox_deleted"].as_u64().unwrap() >= 1,
        "completed rows went: {cleaned}"
    );
    let listed = cli_ok(
        &db,
        &["inbox", "list", "--waiting-for-redelivery", "--json"],
        0,
    )
    .json();
    assert_eq!(listed[0]["message_id"], "f-1", "{listed}");
    assert_eq!(listed[0]["payload_bytes"], 2, "{listed}");

    // Received again (queued): the workers own it now, so it no longer
    // waits for anyone.
    raw(&db)
        .execute(
            "UPDATE postroom_inbox SET queued = 1 WHERE id = ?1",
            [f1.parse::<i64>().unwrap()],
        )
        .unwrap();
    let listed = cli_ok(
        &db,
        &["inbox", "list", "--waiting-for-redelivery", "--json"],
        0,
    )
    .json();
    assert_eq!(listed.as_array().unwrap().len(), 0, "{listed}");
    let status = cli_ok(&db, &["status", "--json"], 0).json();
    let flaky = status["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer"] == "flaky")
        .unwrap()
        .clone();
    assert_eq!(
        (&flaky["failed"], &flaky["waiting_for_redelivery"]),
        (&Value::from(1), &Value::from(0))
    );
}
