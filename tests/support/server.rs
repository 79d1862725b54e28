//! What the test brokers and servers (broker.rs, nats_server.rs) share:
//! a free localhost port, finding an installed binary, and waiting until a
//! started server listens. Each includer of a harness includes this too,
//! once, at its crate root (`#[path = "support/server.rs"] mod server;`):
//! the harnesses use it as `crate::server`.
//!
//! Every wait here is bounded: a server that never listens fails the test
//! with its log, it does not hang it.

#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant};

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a free port")
        .port()
}

/// The binary `name` in a directory on PATH, else in one of `also` (the
/// sbin directories a non-root user's PATH lacks); `None` when there is
/// none.
pub fn installed(name: &str, also: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(also.iter().map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Waits until every one of `ports` on 127.0.0.1 accepts a connection, at
/// most `within`; calls `check` on each round (it panics on a server that
/// exited), and panics with `what()` past the deadline.
pub fn wait_listening(
    ports: &[u16],
    within: Duration,
    mut check: impl FnMut(),
    what: impl Fn() -> String,
) {
    let deadline = Instant::now() + within;
    while ports
        .iter()
        .any(|&port| TcpStream::connect(("127.0.0.1", port)).is_err())
    {
        check();
        assert!(Instant::now() < deadline, "{}", what());
        thread::sleep(Duration::from_millis(20));
    }
}
