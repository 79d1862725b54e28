//! A real MQTT broker on a free localhost port, for the MQTT tests and the
//! mqtt_bridge demo (crates/postroom-demos; included by `#[path]`, with
//! support/server.rs at the includer's crate root):
//! mosquitto when it is on PATH, else rumqttd embedded in this process.
//!
//! mosquitto runs as a child process with a generated config (one
//! listener, anonymous clients, persistence into the broker's temp dir, no
//! per-client queue limit); `restart` stops it with SIGTERM, which saves
//! its sessions and queued messages, and starts it again on the same port.
//!
//! rumqttd cannot be stopped inside a process, so the embedded broker sits
//! behind a small TCP relay on the public port: `stop` closes the relay's
//! listener and cuts every connection, `start` opens it again. Clients see
//! a broker going down and coming back with its sessions, as with
//! mosquitto's persistence.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

pub use crate::server::free_port;
use crate::server::{installed, wait_listening};

/// Which broker a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Mosquitto,
    Embedded,
}

pub struct Broker {
    pub kind: Kind,
    /// Where MQTT 3.1.1 clients connect.
    pub port: u16,
    /// Where MQTT 5 clients connect (mosquitto: the same port).
    pub port_v5: u16,
    dir: PathBuf,
    /// Lines added to mosquitto's config ([`Broker::start_with`]).
    extra: String,
    mosquitto: Option<Child>,
    relays: Vec<Relay>,
}

/// The mosquitto binary on PATH, if any (Debian installs it in /usr/sbin,
/// on root's PATH). `POSTROOM_TEST_BROKER=embedded` ignores it.
pub fn mosquitto_path() -> Option<PathBuf> {
    if std::env::var("POSTROOM_TEST_BROKER").as_deref() == Ok("embedded") {
        return None;
    }
    installed("mosquitto", &[])
}

impl Broker {
    /// Starts a broker, its files under `dir`, and prints which one.
    pub fn start(dir: &Path) -> Broker {
        Self::start_with(dir, "")
    }

    /// [`start`](Broker::start) with `extra` lines in mosquitto's config
    /// (ignored by the embedded broker: a test that needs them checks
    /// `kind`).
    pub fn start_with(dir: &Path, extra: &str) -> Broker {
        std::fs::create_dir_all(dir).unwrap();
        let port = free_port();
        let kind = if mosquitto_path().is_some() {
            Kind::Mosquitto
        } else {
            Kind::Embedded
        };
        let port_v5 = match kind {
            Kind::Mosquitto => port,
            Kind::Embedded => free_port(),
        };
        let mut broker = Broker {
            kind,
            port,
            port_v5,
            dir: dir.to_path_buf(),
            extra: extra.to_owned(),
            mosquitto: None,
            relays: Vec::new(),
        };
        broker.up();
        println!(
            "broker: {} on 127.0.0.1:{port}",
            match kind {
                Kind::Mosquitto => "mosquitto (installed)",
                Kind::Embedded => "rumqttd (embedded; mosquitto is not on PATH)",
            }
        );
        broker
    }

    /// Brings the broker (back) up on its port and waits until it accepts.
    pub fn up(&mut self) {
        match self.kind {
            Kind::Mosquitto => {
                let conf = self.dir.join("mosquitto.conf");
                // Started as root, mosquitto switches to the user
                // `mosquitto`, who cannot write into this process's temp
                // dir: its persistence and log would silently go nowhere.
                let root = {
                    use std::os::unix::fs::MetadataExt;
                    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
                };
                std::fs::write(
                    &conf,
                    format!(
                        "listener {port} 127.0.0.1\nallow_anonymous true\n\
                         persistence true\npersistence_location {dir}/\n\
                         max_queued_messages 0\nlog_dest file {dir}/mosquitto.log\n\
                         log_type all\nset_tcp_nodelay true\n{user}{extra}\n",
                        port = self.port,
                        dir = self.dir.display(),
                        user = if root { "user root\n" } else { "" },
                        extra = self.extra,
                    ),
                )
                .unwrap();
                let child = Command::new(mosquitto_path().unwrap())
                    .arg("-c")
                    .arg(&conf)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start mosquitto");
                self.mosquitto = Some(child);
            }
            Kind::Embedded => {
                let (inner, inner_v5) = embedded_ports();
                self.relays = vec![
                    Relay::start(self.port, inner),
                    Relay::start(self.port_v5, inner_v5),
                ];
            }
        }
        let (mosquitto, dir) = (&mut self.mosquitto, &self.dir);
        let exited = || {
            if let Some(child) = mosquitto.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!(
                        "mosquitto exited ({status}): {}",
                        std::fs::read_to_string(dir.join("mosquitto.log")).unwrap_or_default()
                    );
                }
            }
        };
        wait_listening(
            &[self.port, self.port_v5],
            Duration::from_secs(20),
            exited,
            || "the broker never came up".to_owned(),
        );
    }

    /// Takes the broker down: mosquitto saves its state and exits; the
    /// embedded one's door closes and every connection is cut.
    pub fn down(&mut self) {
        if let Some(mut child) = self.mosquitto.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                }
                thread::sleep(Duration::from_millis(10));
            }
            let _ = child.wait();
        }
        for relay in self.relays.drain(..) {
            relay.stop();
        }
    }

    /// Down for `outage`, then up again on the same port.
    pub fn restart(&mut self, outage: Duration) {
        self.down();
        thread::sleep(outage);
        self.up();
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if thread::panicking() && self.kind == Kind::Mosquitto {
            let log = std::fs::read_to_string(self.dir.join("mosquitto.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("broker log, last lines first:\n{}", tail.join("\n"));
        }
        if let Some(mut child) = self.mosquitto.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        for relay in self.relays.drain(..) {
            relay.stop();
        }
    }
}

/// The MQTT 3.1.1 and 5 ports of the one rumqttd this process runs
/// (started at first use; its threads live as long as the process).
fn embedded_ports() -> (u16, u16) {
    static PORTS: OnceLock<(u16, u16)> = OnceLock::new();
    *PORTS.get_or_init(|| {
        use rumqttd::{Config, ConnectionSettings, RouterConfig, ServerSettings};
        let (port, port_v5) = (free_port(), free_port());
        let server = |name: &str, port: u16| ServerSettings {
            name: name.into(),
            listen: ([127, 0, 0, 1], port).into(),
            tls: None,
            next_connection_delay_ms: 1,
            connections: ConnectionSettings {
                connection_timeout_ms: 60_000,
                max_payload_size: 2 * 1024 * 1024,
                max_inflight_count: 100,
                auth: None,
                external_auth: None,
                dynamic_filters: true,
            },
        };
        let config = Config {
            id: 0,
            router: RouterConfig {
                max_connections: 10_000,
                max_outgoing_packet_count: 200,
                max_segment_size: 100 * 1024 * 1024,
                max_segment_count: 10,
                ..Default::default()
            },
            v4: Some([("1".to_owned(), server("v4", port))].into_iter().collect()),
            v5: Some(
                [("1".to_owned(), server("v5", port_v5))]
                    .into_iter()
                    .collect(),
            ),
            ..Default::default()
        };
        thread::Builder::new()
            .name("rumqttd".into())
            .spawn(move || {
                let mut broker = rumqttd::Broker::new(config);
                if let Err(e) = broker.start() {
                    eprintln!("rumqttd stopped: {e}");
                }
            })
            .unwrap();
        wait_listening(
            &[port, port_v5],
            Duration::from_secs(20),
            || {},
            || "rumqttd never came up".to_owned(),
        );
        (port, port_v5)
    })
}

/// A TCP relay from a public port to the embedded broker's, which can be
/// closed (every connection cut) and opened again.
struct Relay {
    open: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    acceptor: thread::JoinHandle<()>,
}

impl Relay {
    fn start(port: u16, inner: u16) -> Relay {
        let listener = TcpListener::bind(("127.0.0.1", port)).expect("bind the relay port");
        listener.set_nonblocking(true).unwrap();
        let open = Arc::new(AtomicBool::new(true));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (open2, conns2) = (Arc::clone(&open), Arc::clone(&conns));
        let acceptor = thread::Builder::new()
            .name("broker-relay".into())
            .spawn(move || {
                while open2.load(Ordering::Acquire) {
                    let Ok((client, _)) = listener.accept() else {
                        thread::sleep(Duration::from_millis(5));
                        continue;
                    };
                    client.set_nonblocking(false).unwrap();
                    let Ok(server) = TcpStream::connect(("127.0.0.1", inner)) else {
                        continue;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let mut all = conns2.lock().unwrap();
                    all.push(client.try_clone().unwrap());
                    all.push(server.try_clone().unwrap());
                    pipe(client.try_clone().unwrap(), server.try_clone().unwrap());
                    pipe(server, client);
                }
            })
            .unwrap();
        Relay {
            open,
            conns,
            acceptor,
        }
    }

    fn stop(self) {
        self.open.store(false, Ordering::Release);
        let _ = self.acceptor.join(); // drops the listener
        for conn in self.conns.lock().unwrap().drain(..) {
            let _ = conn.shutdown(Shutdown::Both);
        }
    }
}

/// Copies `from` into `to` until either side ends; the copier threads end
/// when `Relay::stop` shuts their sockets down.
fn pipe(mut from: TcpStream, mut to: TcpStream) {
    thread::Builder::new()
        .name("broker-relay-pipe".into())
        .spawn(move || {
            let mut buf = [0u8; 16 * 1024];
            loop {
                match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                }
            }
            let _ = to.shutdown(Shutdown::Both);
            let _ = from.shutdown(Shutdown::Both);
        })
        .unwrap();
}
