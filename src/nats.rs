//! stub
#[allow(unused_imports)]
use async_nats::jetstream;
