//! Shutdown requests from outside the process, for `handle_signals`: SIGINT
//! and SIGTERM on unix (`signal-hook`'s iterator), the console's Ctrl-C,
//! Ctrl-Break, close, logoff and shutdown events on Windows (`ctrlc`, whose
//! console handler takes every event).
//!
//! Invariants: [`Listener::wait`] blocks until a request comes or the
//! listener's [`Closer`] closes it (then `None`); [`after_shutdown`] then
//! does what the request would have done without postroom (the default
//! action: the process ends). On Windows the console handler can be set
//! once per process, so one handler is set on first use and fans each
//! event out to every open listener; an application that set its own
//! `ctrlc` handler first gets an error from `handle_signals`. Windows
//! ends a process soon after its handler returns for a close, logoff or
//! shutdown event, so for those the engine's shutdown is best effort; for
//! Ctrl-C and Ctrl-Break it runs to completion.

use std::io;

/// What asked the process to stop, as logged.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request(imp::Raw);

impl std::fmt::Display for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        imp::describe(self.0, f)
    }
}

/// Waits for shutdown requests; see the module docs.
pub(crate) struct Listener(imp::Listener);

/// Closes a [`Listener`] from another thread: its `wait` returns `None`.
pub(crate) struct Closer(imp::Closer);

impl std::fmt::Debug for Closer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Closer")
    }
}

impl Listener {
    /// Starts listening (installs the handlers on first use).
    pub(crate) fn new() -> io::Result<Listener> {
        imp::Listener::new().map(Listener)
    }

    pub(crate) fn closer(&self) -> Closer {
        Closer(self.0.closer())
    }

    /// The next request, or `None` once closed.
    pub(crate) fn wait(&mut self) -> Option<Request> {
        self.0.wait().map(Request)
    }
}

impl Closer {
    pub(crate) fn close(&self) {
        self.0.close()
    }
}

/// Does what `request` would have done without postroom: ends the process
/// (the default action of the signal; on Windows, exit with
/// `STATUS_CONTROL_C_EXIT`, as a console process ended by Ctrl-C does).
pub(crate) fn after_shutdown(request: Request) {
    imp::after_shutdown(request.0)
}

#[cfg(unix)]
mod imp {
    use std::io;

    use signal_hook::consts::{SIGINT, SIGTERM};

    pub(super) type Raw = i32;

    pub(super) fn describe(raw: Raw, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match raw {
            SIGINT => f.write_str("SIGINT"),
            SIGTERM => f.write_str("SIGTERM"),
            other => write!(f, "signal {other}"),
        }
    }

    pub(super) struct Listener(signal_hook::iterator::Signals);
    pub(super) struct Closer(signal_hook::iterator::Handle);

    impl Listener {
        pub(super) fn new() -> io::Result<Listener> {
            signal_hook::iterator::Signals::new([SIGINT, SIGTERM]).map(Listener)
        }
        pub(super) fn closer(&self) -> Closer {
            Closer(self.0.handle())
        }
        pub(super) fn wait(&mut self) -> Option<Raw> {
            self.0.forever().next()
        }
    }

    impl Closer {
        pub(super) fn close(&self) {
            self.0.close()
        }
    }

    pub(super) fn after_shutdown(raw: Raw) {
        let _ = signal_hook::low_level::emulate_default_handler(raw);
    }
}

#[cfg(windows)]
mod imp {
    use std::io;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Mutex, OnceLock};

    use crossbeam_channel::{Receiver, Sender};

    /// The console delivers no kind through `ctrlc`: every event is a stop.
    #[derive(Debug, Clone, Copy)]
    pub(super) struct Raw;

    pub(super) fn describe(_raw: Raw, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("console Ctrl-C, Ctrl-Break or close event")
    }

    /// Every open listener's sender; the console handler tells each.
    /// Each open listener's id and sender.
    type Registered = Vec<(u64, Sender<()>)>;

    fn listeners() -> std::sync::MutexGuard<'static, Registered> {
        static LISTENERS: OnceLock<Mutex<Registered>> = OnceLock::new();
        LISTENERS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// The handler's installation, once per process: its outcome is kept,
    /// so a second engine is told the same.
    fn install() -> io::Result<()> {
        static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();
        INSTALLED
            .get_or_init(|| {
                ctrlc::try_set_handler(|| {
                    // A closed listener's sender was removed; a full one has
                    // a request waiting already.
                    for (_, tx) in listeners().iter() {
                        let _ = tx.try_send(());
                    }
                })
                .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(|e| {
                io::Error::other(format!(
                    "the console's Ctrl-C handler: {e} (one handler per process: an \
                     application that sets its own should not ask postroom to handle signals)"
                ))
            })
    }

    pub(super) struct Listener {
        id: u64,
        events: Receiver<()>,
        closed: Receiver<()>,
        close: Sender<()>,
    }
    pub(super) struct Closer(Sender<()>);

    impl Listener {
        pub(super) fn new() -> io::Result<Listener> {
            install()?;
            static NEXT: AtomicU64 = AtomicU64::new(0);
            let id = NEXT.fetch_add(1, Ordering::Relaxed);
            let (tx, events) = crossbeam_channel::bounded(1);
            listeners().push((id, tx));
            let (close, closed) = crossbeam_channel::bounded(1);
            Ok(Listener {
                id,
                events,
                closed,
                close,
            })
        }
        pub(super) fn closer(&self) -> Closer {
            Closer(self.close.clone())
        }
        pub(super) fn wait(&mut self) -> Option<Raw> {
            crossbeam_channel::select! {
                recv(self.events) -> got => got.ok().map(|()| Raw),
                recv(self.closed) -> _ => None,
            }
        }
    }

    impl Drop for Listener {
        fn drop(&mut self) {
            listeners().retain(|(id, _)| *id != self.id);
        }
    }

    impl Closer {
        pub(super) fn close(&self) {
            let _ = self.0.try_send(());
        }
    }

    pub(super) fn after_shutdown(_raw: Raw) {
        const STATUS_CONTROL_C_EXIT: u32 = 0xC000_013A;
        std::process::exit(STATUS_CONTROL_C_EXIT as i32)
    }
}
