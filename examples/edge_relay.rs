//! Two components on one device, each with its own database, chained
//! exactly-once through the outbox relay.
//!
//! * **A, the sensor gateway** (`gateway.db`): sensors deliver readings to
//!   it inline, and they resend: every reading arrives two or three times
//!   (an ack that timed out, a replay after a reconnect). Its handler logs
//!   the reading and publishes it; A's relay hands the outbox to B with
//!   `InboxSink`, whose message ids are A's stable outbox ids.
//! * **B, the analytics component** (`analytics.db`): its workers
//!   aggregate readings per sensor (in order: A's outbox key, the sensor,
//!   becomes B's ordering key) and publish an alert for each reading over
//!   the threshold; B's relay writes the alerts to stdout with
//!   `NdjsonSink`.
//!
//! ```text
//! cargo run --example edge_relay              # alerts on stdout, summary on stderr
//! cargo run --example edge_relay 2>/dev/null | jq -c '.payload'
//! ```
//!
//! What to look for: stdout is pure NDJSON, one alert per line; each
//! alert's `correlation-id` header is the original reading's id, carried
//! through both components, and its `causation-id` is A's outbox id. The
//! summary on stderr shows the duplicates A absorbed and checks that B
//! aggregated every reading exactly once; the exit status is non-zero
//! otherwise. Shutting A down flushes its relay into B; shutting B down
//! (after its workers drained) flushes the last alerts to stdout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use postroom::{handler_fn, InboxSink, Message, NdjsonSink, Outcome, Outgoing, Postroom};
use rusqlite::OptionalExtension;
use serde::{Deserialize, Serialize};

/// Send + Sync so the sensor threads can return errors too.
type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SENSORS: u32 = 3;
const READINGS_PER_SENSOR: u32 = 200;
const THRESHOLD: f64 = 80.0;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Reading {
    sensor: String,
    seq: u32,
    celsius: f64,
}

#[derive(Debug, Serialize)]
struct Alert<'a> {
    sensor: &'a str,
    seq: u32,
    celsius: f64,
    threshold: f64,
}

/// A deterministic temperature: mostly 40–75 °C, now and then a spike.
fn reading(sensor: u32, seq: u32) -> Reading {
    let mut z = u64::from(sensor) << 32 | u64::from(seq);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    // Tenths of a degree, so the values print as they are stored.
    let tenths = if z % 100 < 5 {
        801 + (z >> 8) % 200
    } else {
        400 + (z >> 8) % 350
    };
    Reading {
        sensor: format!("s{sensor}"),
        seq,
        celsius: tenths as f64 / 10.0,
    }
}

/// The order a sensor sends its readings in: each one twice (the first
/// ack timed out), and every third one once more a few readings later
/// (replayed after a reconnect).
fn transmissions(sensor: u32) -> Vec<Reading> {
    let mut out = Vec::new();
    for seq in 0..READINGS_PER_SENSOR {
        out.push(reading(sensor, seq));
        out.push(reading(sensor, seq));
        if seq % 3 == 0 && seq >= 5 {
            out.push(reading(sensor, seq - 5));
        }
    }
    out
}

fn open_gateway(path: &std::path::Path, analytics: &Arc<Postroom>) -> postroom::Result<Postroom> {
    Postroom::builder()
        .consumer(
            "sensors",
            handler_fn(|tx, msg| {
                let r: Reading = msg.json()?;
                tx.execute(
                    "INSERT INTO raw_readings (sensor, seq, celsius) VALUES (?1, ?2, ?3)",
                    (&r.sensor, r.seq, r.celsius),
                )?;
                tx.publish(Outgoing::json("reading", &r)?.with_key(r.sensor.as_str()))?;
                Ok(())
            }),
        )
        .sink(InboxSink::new(Arc::clone(analytics), "readings"))
        .open(path)
}

fn open_analytics(path: &std::path::Path) -> postroom::Result<Postroom> {
    Postroom::builder()
        .workers(2)
        .consumer(
            "readings",
            handler_fn(|tx, msg| {
                let r: Reading = msg.json()?;
                let last: Option<u32> = tx
                    .query_row(
                        "SELECT last_seq FROM sensor_stats WHERE sensor = ?1",
                        [&r.sensor],
                        |row| row.get(0),
                    )
                    .optional()?;
                if last.is_some_and(|last| last >= r.seq) {
                    // Per-key order is the engine's promise; count a breach.
                    tx.execute(
                        "UPDATE sensor_stats SET out_of_order = out_of_order + 1
                         WHERE sensor = ?1",
                        [&r.sensor],
                    )?;
                }
                tx.execute(
                    "INSERT INTO sensor_stats (sensor, readings, sum_celsius, max_celsius, last_seq)
                     VALUES (?1, 1, ?2, ?2, ?3)
                     ON CONFLICT (sensor) DO UPDATE SET readings = readings + 1,
                         sum_celsius = sum_celsius + excluded.sum_celsius,
                         max_celsius = max(max_celsius, excluded.max_celsius),
                         last_seq = max(last_seq, excluded.last_seq)",
                    (&r.sensor, r.celsius, r.seq),
                )?;
                // `times` would exceed 1 if a reading were aggregated twice.
                tx.execute(
                    "INSERT INTO aggregated (sensor, seq, times) VALUES (?1, ?2, 1)
                     ON CONFLICT (sensor, seq) DO UPDATE SET times = times + 1",
                    (&r.sensor, r.seq),
                )?;
                if r.celsius > THRESHOLD {
                    let alert = Alert {
                        sensor: &r.sensor,
                        seq: r.seq,
                        celsius: r.celsius,
                        threshold: THRESHOLD,
                    };
                    tx.publish(Outgoing::json("alert", &alert)?.with_key(r.sensor.as_str()))?;
                }
                Ok(())
            }),
        )
        .sink(NdjsonSink::new(std::io::stdout()))
        .open(path)
}

fn main() -> Res<()> {
    let tmp = tempfile::tempdir()?;
    let (a_db, b_db) = (
        tmp.path().join("gateway.db"),
        tmp.path().join("analytics.db"),
    );
    eprintln!(
        "postroom edge_relay: {} readings from {SENSORS} sensors, {} -> {}; alerts on stdout",
        SENSORS * READINGS_PER_SENSOR,
        a_db.display(),
        b_db.display()
    );
    let started = Instant::now();

    // B first: A's sink holds it.
    let analytics = Arc::new(open_analytics(&b_db)?);
    analytics.transaction(|tx| {
        tx.execute_batch(
            "CREATE TABLE sensor_stats (sensor TEXT PRIMARY KEY, readings INTEGER NOT NULL,
                 sum_celsius REAL NOT NULL, max_celsius REAL NOT NULL, last_seq INTEGER NOT NULL,
                 out_of_order INTEGER NOT NULL DEFAULT 0);
             CREATE TABLE aggregated (sensor TEXT NOT NULL, seq INTEGER NOT NULL,
                 times INTEGER NOT NULL, PRIMARY KEY (sensor, seq));",
        )?;
        Ok(())
    })?;
    let gateway = open_gateway(&a_db, &analytics)?;
    gateway.transaction(|tx| {
        tx.execute_batch(
            "CREATE TABLE raw_readings (sensor TEXT NOT NULL, seq INTEGER NOT NULL,
                 celsius REAL NOT NULL, PRIMARY KEY (sensor, seq));",
        )?;
        Ok(())
    })?;

    // The sensors, each on its own thread, delivering to A inline.
    let (deliveries, duplicates) = std::thread::scope(|s| -> Res<(u64, u64)> {
        let handles: Vec<_> = (0..SENSORS)
            .map(|sensor| {
                let gateway = &gateway;
                s.spawn(move || -> Res<(u64, u64)> {
                    let (mut sent, mut dup) = (0, 0);
                    for r in transmissions(sensor) {
                        let id = format!("{}-{}", r.sensor, r.seq);
                        let msg = Message::from_json("sensors", id, &r)?;
                        sent += 1;
                        match gateway.deliver("sensors", msg)? {
                            Outcome::Duplicate => dup += 1,
                            Outcome::Processed { .. } => {}
                            other => return Err(format!("unexpected outcome {other:?}").into()),
                        }
                    }
                    Ok((sent, dup))
                })
            })
            .collect();
        let mut totals = (0, 0);
        for h in handles {
            let (sent, dup) = h.join().map_err(|_| "a sensor thread panicked")??;
            totals.0 += sent;
            totals.1 += dup;
        }
        Ok(totals)
    })?;

    // Shutting A down flushes its relay into B.
    let report = gateway.shutdown(Duration::from_secs(10))?;
    drop(gateway);
    let readings = u64::from(SENSORS * READINGS_PER_SENSOR);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let counts = analytics
            .stats()?
            .inbox
            .get("readings")
            .copied()
            .unwrap_or_default();
        if counts.completed + counts.dead >= readings
            && counts.pending + counts.processing + counts.failed == 0
        {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("B did not drain in 30 s: {counts:?}").into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Shutting B down flushes the last alerts to stdout.
    let b_report = analytics.shutdown(Duration::from_secs(10))?;
    let elapsed = started.elapsed();

    let a = rusqlite::Connection::open(&a_db)?;
    let b = rusqlite::Connection::open(&b_db)?;
    let one = |c: &rusqlite::Connection, sql: &str| -> rusqlite::Result<i64> {
        c.query_row(sql, [], |r| r.get(0))
    };
    let logged_in_a = one(&a, "SELECT count(*) FROM raw_readings")?;
    let a_unsent = one(
        &a,
        "SELECT count(*) FROM postroom_outbox WHERE status <> 'sent'",
    )?;
    let rows_in_b = one(&b, "SELECT count(*) FROM aggregated")?;
    let twice_in_b = one(&b, "SELECT count(*) FROM aggregated WHERE times <> 1")?;
    let summed = one(&b, "SELECT coalesce(sum(readings), 0) FROM sensor_stats")?;
    let out_of_order = one(
        &b,
        "SELECT coalesce(sum(out_of_order), 0) FROM sensor_stats",
    )?;
    let b_completed = one(
        &b,
        "SELECT count(*) FROM postroom_inbox WHERE consumer = 'readings' AND status = 'completed'",
    )?;
    let alerts = one(
        &b,
        "SELECT count(*) FROM postroom_outbox WHERE topic = 'alert'",
    )?;
    let alerts_unsent = one(
        &b,
        "SELECT count(*) FROM postroom_outbox WHERE status <> 'sent'",
    )?;
    let expected_alerts = (0..SENSORS)
        .flat_map(|s| (0..READINGS_PER_SENSOR).map(move |q| reading(s, q)))
        .filter(|r| r.celsius > THRESHOLD)
        .count() as i64;

    let readings = readings as i64;
    let row = |what: &str, n: i64| eprintln!("{what:<44} {n:>8}");
    eprintln!();
    row("readings", readings);
    row(
        "deliveries to A (each reading 2-3 times)",
        deliveries as i64,
    );
    row("duplicates absorbed by A", duplicates as i64);
    row("rows in B (readings aggregated)", rows_in_b);
    row("alerts (NDJSON lines on stdout)", alerts);
    eprintln!("{:<44} {:>8.2}", "elapsed, seconds", elapsed.as_secs_f64());
    eprintln!();
    let checks = [
        (
            "A absorbed every repeat",
            logged_in_a == readings && duplicates as i64 == deliveries as i64 - readings,
        ),
        (
            "each reading aggregated exactly once in B",
            rows_in_b == readings
                && twice_in_b == 0
                && summed == readings
                && b_completed == readings,
        ),
        (
            "each sensor's readings aggregated in order",
            out_of_order == 0,
        ),
        (
            "one alert per reading over the threshold, all on stdout",
            alerts == expected_alerts && alerts_unsent == 0,
        ),
        (
            "both relays flushed, clean shutdowns",
            a_unsent == 0 && report.is_clean() && b_report.is_clean(),
        ),
    ];
    let mut ok = true;
    for (what, passed) in checks {
        eprintln!("  [{}] {what}", if passed { "ok" } else { "FAILED" });
        ok &= passed;
    }
    if !ok {
        return Err("edge relay checks failed".into());
    }
    Ok(())
}
