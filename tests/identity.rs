//! An outbox's stream identity stays unique when its database file is
//! copied: the golden-image scenario, where one template database is made
//! once and copied to every device. Each device's outbox numbers its rows
//! from 1; were the copies one stream (`outbox:<instance id>`), a server
//! would answer the second device's rows `DuplicateBySequence` and drop
//! them. Through `InboxSink` and through MQTT with `sequenced()`, against
//! the real mosquitto (tests/support/broker.rs).

#[cfg(feature = "mqtt")]
#[path = "support/broker.rs"]
mod broker;
mod common;
#[path = "support/server.rs"]
mod server;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use postroom::{handler_fn, Failure, InboxSink, Message, Outgoing, Postroom};

/// A template database made once by an engine (as a provisioning step
/// would), then copied file by file to `copies` paths.
fn golden_image(dir: &Path, copies: &[&str]) -> Vec<PathBuf> {
    let template = dir.join("template.db");
    let room = Postroom::builder().open(&template).unwrap();
    room.shutdown(Duration::from_secs(10)).unwrap();
    drop(room);
    assert!(
        !with_suffix(&template, "-wal").exists(),
        "a clean shutdown leaves no WAL"
    );
    copies
        .iter()
        .map(|name| {
            let path = dir.join(name);
            std::fs::copy(&template, &path).unwrap();
            path
        })
        .collect()
}

fn instance_id(db: &Path) -> String {
    raw(db)
        .query_row(
            "SELECT value FROM postroom_meta WHERE key = 'instance_id'",
            [],
            |r| r.get(0),
        )
        .unwrap()
}

/// A device: its consumer publishes one outbox row per message.
fn device(db: &Path, sink: impl postroom::Sink) -> Postroom {
    Postroom::builder()
        .workers(0)
        .relay_poll(Duration::from_millis(5))
        .consumer(
            "checkout",
            handler_fn(|tx, msg: &Message| -> Result<(), Failure> {
                tx.publish(Outgoing::new("order.placed", msg.payload().to_vec()))?;
                Ok(())
            }),
        )
        .sink(sink)
        .open(db)
        .unwrap()
}

/// Each message applied once, by the payloads the devices sent.
fn assert_each_applied_once(server: &Path, expected: usize) {
    let conn = raw(server);
    let payloads: Vec<String> = column(
        &conn,
        "SELECT CAST(payload AS TEXT) FROM applied ORDER BY payload",
    );
    let distinct: std::collections::BTreeSet<&String> = payloads.iter().collect();
    assert_eq!(
        (payloads.len(), distinct.len()),
        (expected, expected),
        "applied: {payloads:?}"
    );
    assert_eq!(count(&conn, "SELECT count(*) FROM postroom_conflicts"), 0);
}

#[test]
fn copies_of_one_database_publish_as_separate_streams_through_an_inbox_sink() {
    let dir = tempfile::tempdir().unwrap();
    let devices = golden_image(dir.path(), &["device-1.db", "device-2.db"]);
    let server = Arc::new(
        Postroom::builder()
            .workers(1)
            .poll_interval(Duration::from_millis(5))
            .consumer(
                "orders",
                handler_fn(|tx, msg: &Message| -> Result<(), Failure> {
                    tx.execute(
                        "INSERT INTO applied (consumer, message_id, payload) VALUES ('orders', ?1, ?2)",
                        rusqlite::params![msg.id(), msg.payload()],
                    )?;
                    Ok(())
                }),
            )
            .open(dir.path().join("server.db"))
            .unwrap(),
    );
    create_domain(&server);
    for (n, db) in devices.iter().enumerate() {
        let room = device(db, InboxSink::new(Arc::clone(&server), "orders"));
        for i in 0..10 {
            room.deliver(
                "checkout",
                Message::new("web", format!("o-{i}"), format!("device-{n}-{i:02}")),
            )
            .unwrap();
        }
        let conn = raw(db);
        eventually(60, "the device's relay handed its rows over", || {
            count(
                &conn,
                "SELECT count(*) FROM postroom_outbox WHERE status != 'pending'",
            ) == 10
        });
        room.shutdown(Duration::from_secs(10)).unwrap();
    }
    let server_conn = raw(server.path());
    eventually(60, "the server settled what it stored", || {
        count(
            &server_conn,
            "SELECT count(*) FROM postroom_inbox WHERE status NOT IN ('completed', 'dead')",
        ) == 0
    });
    assert_each_applied_once(server.path(), 20);
    assert_ne!(instance_id(&devices[0]), instance_id(&devices[1]));
    let streams = server.stats().unwrap().sequences;
    assert_eq!(streams.len(), 2, "{streams:?}");
    Arc::try_unwrap(server)
        .unwrap()
        .shutdown(Duration::from_secs(10))
        .unwrap();
}

/// A file that stays where it is keeps its identity: reopening it does
/// not start a new stream.
#[test]
fn a_database_reopened_in_place_keeps_its_instance_id() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    Postroom::builder()
        .open(&db)
        .unwrap()
        .shutdown(Duration::from_secs(10))
        .unwrap();
    let first = instance_id(&db);
    let moved = dir.path().join("moved.db");
    std::fs::rename(&db, &moved).unwrap();
    Postroom::builder()
        .open(&moved)
        .unwrap()
        .shutdown(Duration::from_secs(10))
        .unwrap();
    assert_eq!(
        instance_id(&moved),
        first,
        "a renamed file is the same file"
    );
}

#[cfg(feature = "mqtt")]
#[test]
fn copies_of_one_database_publish_as_separate_streams_through_a_sequenced_mqtt_intake() {
    use postroom::mqtt::rumqttc::MqttOptions;
    use postroom::mqtt::{MqttIntake, MqttSink};

    let options = |client: &str, port: u16| {
        let mut o = MqttOptions::new(client, "127.0.0.1", port);
        o.set_keep_alive(Duration::from_secs(5));
        o
    };
    let dir = tempfile::tempdir().unwrap();
    let broker = broker::Broker::start(&dir.path().join("broker"));
    println!("broker: {:?}", broker.kind);
    let devices = golden_image(dir.path(), &["device-1.db", "device-2.db"]);
    let server = Arc::new(
        Postroom::builder()
            .poll_interval(Duration::from_millis(20))
            .consumer("orders", handler_fn(apply_order))
            .open(dir.path().join("server.db"))
            .unwrap(),
    );
    create_domain(&server);
    let intake = MqttIntake::builder(
        options("golden-server", broker.port),
        Arc::clone(&server),
        "orders",
    )
    .subscribe("golden/#")
    .sequenced()
    .start()
    .unwrap();
    assert!(intake.wait_subscribed(Duration::from_secs(20)));
    for (n, db) in devices.iter().enumerate() {
        // The same configuration on every device (as an image carries it),
        // except the MQTT client id, which a broker insists on.
        let sink = MqttSink::new(options(&format!("golden-device-{n}"), broker.port))
            .source("device")
            .topic_prefix("golden/")
            .backoff(Duration::from_millis(50), Duration::from_millis(500));
        let room = device(db, sink);
        for i in 0..10 {
            room.deliver(
                "checkout",
                Message::new("web", format!("o-{i}"), format!("device-{n}-{i:02}")),
            )
            .unwrap();
        }
        let conn = raw(db);
        eventually(60, "the device's relay handed its rows over", || {
            count(
                &conn,
                "SELECT count(*) FROM postroom_outbox WHERE status != 'pending'",
            ) == 10
        });
        room.shutdown(Duration::from_secs(10)).unwrap();
    }
    eventually(60, "the intake took every message", || {
        intake.stats().acked >= 20
    });
    let server_conn = raw(server.path());
    eventually(60, "the server applied what it stored", || {
        count(
            &server_conn,
            "SELECT count(*) FROM postroom_inbox WHERE status NOT IN ('completed', 'dead')",
        ) == 0
    });
    println!("intake: {:?}", intake.stats());
    assert_each_applied_once(server.path(), 20);
    intake.shutdown(Duration::from_secs(5)).unwrap();
}

#[cfg(feature = "mqtt")]
fn apply_order(tx: &mut postroom::Tx<'_>, msg: &Message) -> Result<(), Failure> {
    tx.execute(
        "INSERT INTO applied (consumer, message_id, payload) VALUES ('orders', ?1, ?2)",
        rusqlite::params![msg.id(), msg.payload()],
    )?;
    Ok(())
}
