//! Two postroom devices bridged through a real MQTT broker: device A
//! publishes orders through its outbox (`MqttSink`), device B — a child
//! process — takes them into its inbox (`MqttIntake`) and applies each to
//! its own table. Midway the broker is stopped and started again, and
//! later device B is SIGKILLed and started again. At the end every order
//! must have been applied on B exactly once, each customer's in order (the
//! scenario: `postroom_demos::bridge`).
//!
//! Uses mosquitto when it is on PATH (started on a free localhost port with
//! a generated config), else rumqttd embedded in this process.
//!
//! ```text
//! cargo run -p postroom-demos --example mqtt_bridge
//! ```

use std::sync::Arc;
use std::time::Duration;

use postroom::mqtt::rumqttc::MqttOptions;
use postroom::mqtt::{MqttIntake, MqttSink};
use postroom::Postroom;
use postroom_demos::bridge::{self, Intake, Link, Res, Words};
use postroom_demos::broker::Broker;

fn options(client_id: &str, port: u16) -> MqttOptions {
    let mut o = MqttOptions::new(client_id, "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(5));
    o
}

/// Device B's intake: subscribed to every order.
fn intake(address: &str, room: Arc<Postroom>) -> Res<Box<dyn Intake>> {
    let intake = MqttIntake::builder(options("device-b", address.parse()?), room, "shipping")
        .subscribe("shop/#")
        .start()?;
    if !intake.wait_subscribed(Duration::from_secs(20)) {
        return Err("device B: no SUBACK".into());
    }
    Ok(Box::new(intake))
}

fn main() -> Res<()> {
    if let Some(device_b) = bridge::device_b_if_asked(intake) {
        return device_b;
    }
    let dir = tempfile::tempdir()?;
    let mut broker = Broker::start(&dir.path().join("broker"));
    let port = broker.port;
    let server = format!("broker: {:?}", broker.kind);
    let open_a = |db: &std::path::Path| {
        Postroom::builder()
            .relay_poll(Duration::from_millis(20))
            .sink(
                MqttSink::new(options("device-a", port))
                    .source("device-a")
                    .topic_prefix("shop/")
                    .backoff(Duration::from_millis(50), Duration::from_millis(500)),
            )
            .open(db)
    };
    bridge::run(Link {
        dir: dir.path().to_path_buf(),
        address: port.to_string(),
        server: &mut broker,
        open_a: &open_a,
        words: Words {
            server,
            outage: "stopping the broker for 1 s",
            ack: "PUBACK",
            acked_all: "all PUBACKed",
            server_down: "broker",
            redelivered: "redelivered with DUP",
            connects: "connections",
        },
    })
}
