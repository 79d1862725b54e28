//! postroom's bridge demos (`examples/mqtt_bridge.rs`,
//! `examples/nats_bridge.rs`): two devices through a real MQTT broker or
//! NATS JetStream server, the broker or server restarted and device B
//! SIGKILLed midway, exactly once checked on B's own table.
//!
//! Not published: the demos start their broker or server with the test
//! harnesses of `tests/support/` (included here by `#[path]`, one source
//! for the tests and the demos), which the postroom package does not ship.
//! The scenario both demos run is [`bridge`]; each example adds only its
//! transport.

pub mod bridge;

#[path = "../../../tests/support/broker.rs"]
pub mod broker;

#[path = "../../../tests/support/nats_server.rs"]
pub mod nats_server;
#[path = "../../../tests/support/server.rs"]
mod server;
