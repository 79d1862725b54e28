//! A real nats-server with JetStream on a free localhost port, for the NATS
//! tests and the nats_bridge demo (crates/postroom-demos; included by
//! `#[path]`, with support/server.rs at the includer's crate root): the
//! `nats-server` binary on PATH (Debian's package installs it in
//! /usr/sbin), one child process per test, its JetStream store in the
//! test's temp dir. `kill` stops it with SIGKILL (the store keeps what the
//! server wrote: the page cache survives a process kill); `start` brings it
//! back on the same port with the same store.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::Duration;

use crate::server::{free_port, installed, wait_listening};

pub struct NatsServer {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// The nats-server binary: on PATH, else /usr/sbin (not on a non-root
/// user's PATH); `None` when it is not installed.
pub fn nats_server_path() -> Option<PathBuf> {
    installed("nats-server", &["/usr/sbin", "/usr/bin"])
}

impl NatsServer {
    /// Starts a server with its store under `dir`; `None` (with a line
    /// saying so) when nats-server is not installed and
    /// `POSTROOM_REQUIRE_NATS` is not set (CI sets it: there a missing
    /// server fails the test).
    pub fn start(dir: &Path) -> Option<NatsServer> {
        if nats_server_path().is_none() {
            assert!(
                std::env::var_os("POSTROOM_REQUIRE_NATS").is_none(),
                "nats-server is not installed (apt-get install nats-server)"
            );
            println!("nats-server is not installed: skipped (apt-get install nats-server)");
            return None;
        }
        std::fs::create_dir_all(dir).unwrap();
        let mut server = NatsServer {
            port: free_port(),
            dir: dir.to_path_buf(),
            child: None,
        };
        server.up();
        println!("nats-server on 127.0.0.1:{}", server.port);
        Some(server)
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Brings the server (back) up on its port and waits until it accepts.
    pub fn up(&mut self) {
        let bin = nats_server_path().expect("nats-server");
        let log = std::fs::File::create(self.dir.join("nats-server.log")).unwrap();
        let child = Command::new(bin)
            .args(["-a", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .args(["-js", "-sd"])
            .arg(self.dir.join("store"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        wait_listening(
            &[self.port],
            Duration::from_secs(30),
            || {},
            || {
                format!(
                    "nats-server did not listen within 30 s: {}",
                    std::fs::read_to_string(self.dir.join("nats-server.log")).unwrap_or_default()
                )
            },
        );
    }

    /// SIGKILLs the server and waits for it to be gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills it, waits `outage`, brings it back.
    pub fn restart(&mut self, outage: Duration) {
        self.kill();
        thread::sleep(outage);
        self.up();
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}
