//! Setting up a JetStream stream for the bridge ([`ensure_stream`]): for
//! examples, tests and first setups. It creates a stream that is missing
//! and leaves one that exists exactly as it is (never reconfigures an
//! operator's stream).

use std::time::Duration;

use async_nats::jetstream;

use super::{connect, runtime};
use crate::error::{Error, Result};

/// Creates the JetStream stream `name` taking `subjects`, file-backed, if
/// it does not exist (one that does is left as it is): for examples, tests
/// and first setups. Production streams are usually made by an operator
/// with the `nats` CLI or a config; see docs/SINKS.md for what they need.
pub fn ensure_stream(url: &str, name: &str, subjects: &[&str]) -> Result<()> {
    let rt = runtime()?;
    rt.block_on(async {
        let client = connect(url, Duration::from_secs(10))
            .await
            .map_err(|e| Error::invalid("nats", e))?;
        let js = jetstream::new(client);
        js.get_or_create_stream(jetstream::stream::Config {
            name: name.to_owned(),
            subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
            storage: jetstream::stream::StorageType::File,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .map(|_| ())
        .map_err(|e| Error::invalid("nats", format!("create the stream {name:?}: {e}")))
    })
}
