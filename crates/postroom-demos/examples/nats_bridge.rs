//! Two postroom devices bridged through a real NATS JetStream server:
//! device A publishes orders through its outbox (`NatsSink`) into the
//! stream `SHOP`, device B — a child process — pulls them through a durable
//! consumer into its inbox (`NatsIntake`) and applies each to its own
//! table. Midway the server is SIGKILLed and started again on its store,
//! and later device B is SIGKILLed and started again. At the end every
//! order must have been applied on B exactly once, each customer's in
//! order (the scenario: `postroom_demos::bridge`).
//!
//! Needs `nats-server` (Debian: `apt-get install nats-server`), started on
//! a free localhost port with JetStream and its store in a temp dir; the
//! example says so and stops when it is not installed.
//!
//! ```text
//! cargo run -p postroom-demos --example nats_bridge
//! ```

use std::sync::Arc;
use std::time::Duration;

use postroom::nats::{ensure_stream, NatsIntake, NatsSink};
use postroom::Postroom;
use postroom_demos::bridge::{self, Intake, Link, Res, Words};
use postroom_demos::nats_server::NatsServer;

/// Device B's intake: a durable pull consumer `device-b` on the stream.
fn intake(url: &str, room: Arc<Postroom>) -> Res<Box<dyn Intake>> {
    // A short ack wait: what the killed B pulled and never answered comes
    // back after it (nothing behind it is applied first).
    let intake = NatsIntake::builder(url, room, "shipping", "SHOP", "device-b")
        .ack_wait(Duration::from_secs(2))
        .start()?;
    if !intake.wait_bound(Duration::from_secs(30)) {
        return Err("device B: not bound to its consumer".into());
    }
    Ok(Box::new(intake))
}

fn main() -> Res<()> {
    if let Some(device_b) = bridge::device_b_if_asked(intake) {
        return device_b;
    }
    let dir = tempfile::tempdir()?;
    let Some(mut server) = NatsServer::start(&dir.path().join("nats")) else {
        return Ok(());
    };
    let url = server.url();
    ensure_stream(&url, "SHOP", &["shop.>"])?;
    let open_a = |db: &std::path::Path| {
        Postroom::builder()
            .relay_poll(Duration::from_millis(20))
            .sink(
                NatsSink::new(&url)
                    .source("device-a")
                    .subject_prefix("shop.")
                    .ack_timeout(Duration::from_secs(2))
                    .backoff(Duration::from_millis(50), Duration::from_millis(500)),
            )
            .open(db)
    };
    bridge::run(Link {
        dir: dir.path().to_path_buf(),
        address: url.clone(),
        server: &mut server,
        open_a: &open_a,
        words: Words {
            server: format!("nats-server on {url}"),
            outage: "SIGKILL the server, start it again after 1 s",
            ack: "publish-ack",
            acked_all: "all acknowledged by the stream",
            server_down: "server",
            redelivered: "redelivered",
            connects: "bindings",
        },
    })
}
