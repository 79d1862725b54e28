//! Keeps user code (handlers, transaction closures) from committing
//! anything by itself.
//!
//! Invariant: while user code runs, no commit can happen on the write
//! connection. Two hooks enforce it:
//! * the authorizer (run when a statement is prepared) denies `BEGIN`,
//!   `COMMIT`, `ROLLBACK` and the engine's savepoints, so the common mistake
//!   gets a clear `not authorized` error and changes nothing; it also
//!   denies the pragmas that would change how the engine's commits reach
//!   the disk ([`ENGINE_PRAGMAS`]), which user code could otherwise set
//!   for every later batch on the shared connection;
//! * the commit hook vetoes every commit, which turns it into a rollback.
//!   This catches what the authorizer cannot: the engine's own cached
//!   `COMMIT` fetched through `prepare_cached`, and, after SQLite rolled the
//!   whole transaction back by itself (a full disk, an I/O error), the
//!   auto-committing statements user code would run next. Without it such a
//!   statement would commit half a handler's work on its own.
//!
//! Either way the engine then finds its transaction gone and fails the
//! batch: nothing of it was stored or acknowledged.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rusqlite::hooks::{AuthAction, AuthContext, Authorization};
use rusqlite::Connection;

/// Prefix of the engine's savepoint names.
const ENGINE_SAVEPOINT_PREFIX: &str = "postroom_";

/// Pragmas user code may read but not set (`wal_checkpoint` not even run):
/// durability, the WAL, and the WAL hook that `wal_autocheckpoint` would
/// silently replace.
const ENGINE_PRAGMAS: [&str; 5] = [
    "synchronous",
    "journal_mode",
    "locking_mode",
    "wal_autocheckpoint",
    "wal_checkpoint",
];

/// The authorizer's switch. Cloning shares it.
#[derive(Debug, Clone, Default)]
pub(crate) struct UserCodeGuard(Arc<AtomicBool>);

impl UserCodeGuard {
    /// Installs the authorizer and the commit hook on `conn`.
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
                AuthAction::Pragma {
                    pragma_name,
                    pragma_value,
                } if ENGINE_PRAGMAS
                    .iter()
                    .any(|p| p.eq_ignore_ascii_case(pragma_name))
                    && (pragma_value.is_some()
                        || pragma_name.eq_ignore_ascii_case("wal_checkpoint")) =>
                {
                    Authorization::Deny
                }
                _ => Authorization::Allow,
            }
        }))?;
        let in_user_code = Arc::clone(&guard.0);
        conn.commit_hook(Some(move || in_user_code.load(Ordering::Relaxed)))?;
        Ok(guard)
    }

    /// Runs `f` with transaction control denied and commits vetoed.
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
