//! Keeps user code (handlers, transaction closures) from ending the
//! engine's transaction.
//!
//! A handler that ran `COMMIT` would commit its half-done work together
//! with every earlier job of the batch, outside the state machine. SQLite's
//! authorizer runs while a statement is prepared; while user code runs, it
//! denies `BEGIN`/`COMMIT`/`ROLLBACK` and the engine's own savepoints, so
//! such a statement fails to prepare (`SQLITE_AUTH`) and nothing happens.
//! The engine's own statements are prepared outside user code and cached.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rusqlite::hooks::{AuthAction, AuthContext, Authorization};
use rusqlite::Connection;

/// Prefix of the engine's savepoint names.
const ENGINE_SAVEPOINT_PREFIX: &str = "postroom_";

/// The authorizer's switch. Cloning shares it.
#[derive(Debug, Clone, Default)]
pub(crate) struct UserCodeGuard(Arc<AtomicBool>);

impl UserCodeGuard {
    /// Installs the authorizer on `conn`.
    pub fn install(conn: &Connection) -> rusqlite::Result<UserCodeGuard> {
        let guard = UserCodeGuard::default();
        let in_user_code = Arc::clone(&guard.0);
        conn.authorizer(Some(move |ctx: AuthContext<'_>| {
            if !in_user_code.load(Ordering::Relaxed) {
                return Authorization::Allow;
            }
            match ctx.action {
                AuthAction::Transaction { .. } => Authorization::Deny,
                AuthAction::Savepoint { savepoint_name, .. }
                    if savepoint_name
                        .to_ascii_lowercase()
                        .starts_with(ENGINE_SAVEPOINT_PREFIX) =>
                {
                    Authorization::Deny
                }
                _ => Authorization::Allow,
            }
        }))?;
        Ok(guard)
    }

    /// Runs `f` with transaction control denied.
    pub fn run<T>(&self, f: impl FnOnce() -> T) -> T {
        struct Reset<'a>(&'a AtomicBool);
        impl Drop for Reset<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Relaxed);
            }
        }
        self.0.store(true, Ordering::Relaxed);
        let _reset = Reset(&self.0);
        f()
    }
}
