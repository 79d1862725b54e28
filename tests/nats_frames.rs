//! What the NATS client library cannot parse, against a real nats-server
//! (tests/support/nats_server.rs): a publisher that writes the protocol by
//! hand (`HPUB` on a plain TCP socket, as any client may) stores messages
//! whose header blocks async-nats refuses (a value that is not UTF-8, a
//! line without `:`, a name with a space) or reads as a protocol status
//! (`NATS/1.0 100`, `404`, `408`, `503`), or whose subject is not UTF-8,
//! between good ones. Each must end as
//! one dead letter with its raw bytes and the reason, acknowledged for good
//! (AckTerm), and nothing behind it may wait for more than the consumer's
//! ack wait or so: the good messages are all applied, once each.

mod common;
#[path = "support/nats_server.rs"]
mod nats_server;
#[path = "support/server.rs"]
mod server;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use common::*;
use nats_server::NatsServer;
use postroom::nats::{async_nats, ensure_stream, NatsIntake};
use postroom::{handler_fn, Message, Postroom};

/// One stored message as the wire carries it: subject, header block (empty
/// for none), payload.
type Frame = (Vec<u8>, Vec<u8>, Vec<u8>);

/// Publishes `frames` with `HPUB`/`PUB` on a raw socket and waits for the
/// server's `PONG` (everything before it was processed).
fn publish_frames(port: u16, frames: &[Frame]) {
    let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("INFO "), "{line}");
    let mut w = stream;
    w.write_all(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true}\r\n")
        .unwrap();
    for (subject, headers, payload) in frames {
        if headers.is_empty() {
            w.write_all(b"PUB ").unwrap();
            w.write_all(subject).unwrap();
            write!(w, " {}\r\n", payload.len()).unwrap();
        } else {
            w.write_all(b"HPUB ").unwrap();
            w.write_all(subject).unwrap();
            write!(
                w,
                " {} {}\r\n",
                headers.len(),
                headers.len() + payload.len()
            )
            .unwrap();
            w.write_all(headers).unwrap();
        }
        w.write_all(payload).unwrap();
        w.write_all(b"\r\n").unwrap();
    }
    w.write_all(b"PING\r\n").unwrap();
    loop {
        line.clear();
        assert!(reader.read_line(&mut line).unwrap() > 0, "server closed");
        assert!(!line.starts_with("-ERR"), "server refused a frame: {line}");
        if line.starts_with("PONG") {
            break;
        }
    }
}

/// The subjects and header blocks async-nats cannot hand on as a message,
/// each with a word the dead letter's reason must carry.
fn malformed() -> Vec<(Vec<u8>, Vec<u8>, &'static str)> {
    let good = b"hop.orders".to_vec();
    let block = |b: &[u8]| b.to_vec();
    vec![
        (
            good.clone(),
            block(b"NATS/1.0\r\nX-Bad: \xff\xfe\r\n\r\n"),
            "UTF-8",
        ),
        (
            good.clone(),
            block(b"NATS/1.0\r\nno colon here\r\n\r\n"),
            "':'",
        ),
        (
            good.clone(),
            block(b"NATS/1.0\r\nBad Name: v\r\n\r\n"),
            "name",
        ),
        (
            good.clone(),
            block(b"NATS/1.0 100 Idle Heartbeat\r\n\r\n"),
            "status",
        ),
        (
            good.clone(),
            block(b"NATS/1.0 404 No Messages\r\n\r\n"),
            "status",
        ),
        (
            good.clone(),
            block(b"NATS/1.0 408 Request Timeout\r\n\r\n"),
            "status",
        ),
        (good.clone(), block(b"NATS/1.0 503\r\n\r\n"), "status"),
        // The server stores a subject of any bytes; the client's reader
        // drops its connection on one that is not UTF-8.
        (b"hop.\xff\xfe".to_vec(), Vec::new(), "subject"),
    ]
}

/// Device B: every message it applies is a row of `effects`, no
/// uniqueness constraint (twice shows as two rows).
fn device_b(db: &std::path::Path) -> Arc<Postroom> {
    let room = Postroom::builder()
        .poll_interval(Duration::from_millis(20))
        .consumer(
            "b",
            handler_fn(|tx, msg: &Message| {
                tx.execute(
                    "INSERT INTO effects (payload) VALUES (?1)",
                    [String::from_utf8_lossy(msg.payload()).into_owned()],
                )?;
                Ok(())
            }),
        )
        .open(db)
        .unwrap();
    room.transaction(|tx| {
        Ok(tx.execute_batch("CREATE TABLE IF NOT EXISTS effects (payload TEXT NOT NULL)")?)
    })
    .unwrap();
    Arc::new(room)
}

/// The consumer's ack floor and acks pending.
fn consumer_state(url: &str) -> (u64, usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = async_nats::connect(url).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream("HOP").await.unwrap();
        let mut c: async_nats::jetstream::consumer::PullConsumer =
            stream.get_consumer("b").await.unwrap();
        let info = c.info().await.unwrap();
        (info.ack_floor.stream_sequence, info.num_ack_pending)
    })
}

fn run(queued: bool, restart: bool) {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = NatsServer::start(&dir.path().join("nats")) else {
        return;
    };
    let url = server.url();
    ensure_stream(&url, "HOP", &["hop.>"]).unwrap();
    let b_db = dir.path().join("b.db");
    let b = device_b(&b_db);
    let start = || {
        let mut builder = NatsIntake::builder(&url, Arc::clone(&b), "b", "HOP", "b")
            .ack_wait(Duration::from_secs(2))
            .batch(16);
        if queued {
            builder = builder.queued();
        }
        let intake = builder.start().unwrap();
        assert!(intake.wait_bound(Duration::from_secs(30)));
        intake
    };
    let mut intake = start();
    // good-0, bad, good-1, bad, ..., good-N: every bad one between two
    // good ones, the good ones with the hop contract's id and one ordering
    // key, so their order is checked too.
    let bad = malformed();
    let good_frame = |i: usize| -> Frame {
        (
            b"hop.orders".to_vec(),
            format!("NATS/1.0\r\npostroom-id: g-{i}\r\npostroom-key: K\r\n\r\n").into_bytes(),
            format!("good-{i}").into_bytes(),
        )
    };
    let mut frames: Vec<Frame> = vec![good_frame(0)];
    for (i, (subject, headers, _)) in bad.iter().enumerate() {
        frames.push((
            subject.clone(),
            headers.clone(),
            format!("bad-{i}").into_bytes(),
        ));
        frames.push(good_frame(i + 1));
    }
    publish_frames(server.port, &frames);
    let good = bad.len() + 1;
    let stored = frames.len() as u64;
    if restart {
        // Stopped while the first malformed one is pending: the next
        // intake's restart barrier is above it.
        eventually(60, "the first good message applied", || {
            raw(&b_db)
                .query_row("SELECT count(*) FROM effects", [], |r| r.get::<_, i64>(0))
                .unwrap()
                >= 1
        });
        intake.shutdown(Duration::from_secs(10)).unwrap();
        intake = start();
    }
    // Every message ends once: a good one applied, a malformed one a dead
    // letter, except that a server may pass a status line on as a plain
    // header (nats-server 2.15 does; 2.9 delivers it as stored), when the
    // client reads the message and it is applied like any foreign one.
    let settled = || {
        let applied: Vec<String> = column(&raw(&b_db), "SELECT payload FROM effects");
        let dead = b.dead_letters(Some("b"), 100).unwrap();
        (applied, dead)
    };
    // Each malformed one costs about two ack waits (found, then confirmed
    // stuck) and its successor's redelivery: some 60 s in all here.
    eventually(
        300,
        "every message applied or dead-lettered, the floor at the end",
        || {
            let (applied, dead) = settled();
            applied.len() + dead.len() >= frames.len() && consumer_state(&url) == (stored, 0)
        },
    );
    let (applied, dead) = settled();
    for i in 0..good {
        let n = applied
            .iter()
            .filter(|p| **p == format!("good-{i}"))
            .count();
        assert_eq!(n, 1, "good-{i} applied {n} times: {applied:?}");
    }
    let order: Vec<String> = applied
        .iter()
        .filter(|p| p.starts_with("good-"))
        .cloned()
        .collect();
    let in_order: Vec<String> = (0..good).map(|i| format!("good-{i}")).collect();
    assert_eq!(order, in_order, "key K applied out of order");
    for (i, (_, headers, word)) in bad.iter().enumerate() {
        let payload = format!("bad-{i}");
        let as_dead: Vec<_> = dead
            .iter()
            .filter(|d| d.message.payload() == payload.as_bytes())
            .collect();
        let as_applied = applied.iter().filter(|p| **p == payload).count();
        if *word == "status" && as_applied == 1 && as_dead.is_empty() {
            println!("{payload}: the server passed its status line on; applied");
            continue;
        }
        assert_eq!(
            (as_dead.len(), as_applied),
            (1, 0),
            "{payload}: one dead letter, never applied: {dead:#?} {applied:?}"
        );
        let d = as_dead[0];
        let reason = d.last_error.clone().unwrap_or_default();
        assert!(reason.contains(word), "{payload}: {reason}");
        let kept = d
            .message
            .headers()
            .get(postroom::nats::RAW_HEADERS)
            .unwrap_or_else(|| panic!("{payload}: raw headers not kept: {d:#?}"));
        assert_eq!(
            base64::engine::general_purpose::STANDARD
                .decode(kept)
                .unwrap(),
            *headers,
            "{payload}: the header block as stored"
        );
    }
    assert_eq!(
        applied.len() + dead.len(),
        frames.len(),
        "{applied:?} {dead:#?}"
    );
    let stats = intake.stats();
    if !restart {
        assert_eq!(stats.unparsed as usize, dead.len(), "{stats:?}");
    }
    // Nothing comes again: a while later, still the same.
    std::thread::sleep(Duration::from_secs(5));
    let (again, dead_again) = settled();
    assert_eq!((again.len(), dead_again.len()), (applied.len(), dead.len()));
    assert_eq!(consumer_state(&url), (stored, 0));
    intake.shutdown(Duration::from_secs(10)).unwrap();
}

/// An inline intake: every malformed message is a dead letter once, and
/// every good one around them is applied once; the ack floor reaches the
/// end.
#[test]
fn frames_the_client_cannot_parse_are_dead_letters_and_hold_nothing_inline() {
    run(false, false);
}

/// The intake is restarted while they are pending: its successor's
/// restart barrier clears all the same.
#[test]
fn frames_the_client_cannot_parse_hold_nothing_across_an_intake_restart() {
    run(false, true);
}

/// The same through a queued intake.
#[test]
fn frames_the_client_cannot_parse_are_dead_letters_and_hold_nothing_queued() {
    run(true, false);
}

/// What looks like a frame the client cannot parse but is not: a subject
/// that really holds U+FFFD reads, through the stream's message API, as
/// one that was not UTF-8. Its first delivery fails with a retry far later
/// than the ack wait, so the first intake asks it back; that intake stops
/// and a second one, built with a shorter ack wait than the consumer's,
/// finds it pending and not received. Received later all the same, it is
/// applied once and never a dead letter. (Before, the first intake asked
/// it back for the whole retry and the second confirmed it after its own
/// ack wait: a dead letter and a TERM.)
#[test]
fn a_message_asked_back_past_the_ack_wait_is_not_taken_for_unparsable() {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = NatsServer::start(&dir.path().join("nats")) else {
        return;
    };
    let url = server.url();
    ensure_stream(&url, "HOP", &["hop.>"]).unwrap();
    let b_db = dir.path().join("b.db");
    let failed_once = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failed = Arc::clone(&failed_once);
    let b = Postroom::builder()
        .poll_interval(Duration::from_millis(20))
        .backoff(Duration::from_secs(20), Duration::from_secs(20))
        .consumer(
            "b",
            handler_fn(move |tx, msg: &Message| {
                if !failed.swap(true, std::sync::atomic::Ordering::SeqCst) {
                    return Err(postroom::Failure::retry("the first attempt fails"));
                }
                tx.execute(
                    "INSERT INTO effects (payload) VALUES (?1)",
                    [String::from_utf8_lossy(msg.payload()).into_owned()],
                )?;
                Ok(())
            }),
        )
        .open(&b_db)
        .unwrap();
    b.transaction(|tx| Ok(tx.execute_batch("CREATE TABLE effects (payload TEXT NOT NULL)")?))
        .unwrap();
    let b = Arc::new(b);
    let start = |wait: u64| {
        let intake = NatsIntake::builder(&url, Arc::clone(&b), "b", "HOP", "b")
            .ack_wait(Duration::from_secs(wait))
            .start()
            .unwrap();
        assert!(intake.wait_bound(Duration::from_secs(30)));
        intake
    };
    let first = start(4);
    publish_frames(
        server.port,
        &[(
            "hop.\u{fffd}".as_bytes().to_vec(),
            Vec::new(),
            b"fffd".to_vec(),
        )],
    );
    eventually(30, "the first attempt failed and was asked back", || {
        first.stats().not_acked >= 1
    });
    first.shutdown(Duration::from_secs(10)).unwrap();
    let second = start(1);
    // Well past the second intake's own ack wait and the consumer's, short
    // of the retry.
    std::thread::sleep(Duration::from_secs(12));
    let dead = b.dead_letters(Some("b"), 10).unwrap();
    assert!(dead.is_empty(), "taken for unparsable: {dead:#?}");
    eventually(60, "applied after its retry", || {
        !column::<Vec<String>>(&raw(&b_db), "SELECT payload FROM effects").is_empty()
    });
    eventually(30, "acknowledged", || consumer_state(&url) == (1, 0));
    assert_eq!(
        column::<Vec<String>>(&raw(&b_db), "SELECT payload FROM effects"),
        vec!["fffd".to_owned()]
    );
    assert!(b.dead_letters(Some("b"), 10).unwrap().is_empty());
    assert_eq!(second.stats().unparsed, 0);
    second.shutdown(Duration::from_secs(10)).unwrap();
}
