//! Named failpoints at every boundary where a crash or an error changes the
//! outcome, for the crash-matrix tests.
//!
//! Compiled in only with the `failpoints` feature; otherwise `hit` is an
//! empty inline function and costs nothing. With the feature, failpoints are
//! armed from the environment, so a child process can be armed before it
//! starts:
//!
//! ```text
//! POSTROOM_FAILPOINTS="writer.before_commit=abort@3;relay.after_send=error@1"
//! ```
//!
//! `NAME=ACTION@N` fires on the N-th hit of `NAME` (counting from 1) and on
//! no other; ACTION is `error` (the operation fails with an I/O error),
//! `panic`, or `abort` (the process dies at once, like `kill -9` at that
//! instant, but deterministic).

use crate::error::Result;

/// Every failpoint, for the crash matrix.
pub const FAILPOINTS: &[&str] = &[
    "schema.migrate",
    "writer.before_begin",
    "writer.before_commit",
    "writer.after_commit",
    "deliver.after_handler",
    "deliver.after_record",
    "receive.after_insert",
    "dispatch.after_claim",
    "process.after_batch",
    "relay.open",
    "relay.after_send",
    "reaper.retention",
    "reaper.retired_keys",
];

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn hit(_name: &'static str) -> Result<()> {
    Ok(())
}

#[cfg(feature = "failpoints")]
pub(crate) fn hit(name: &'static str) -> Result<()> {
    armed::hit(name)
}

#[cfg(feature = "failpoints")]
mod armed {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    use crate::error::{Error, Result};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Action {
        Error,
        Panic,
        Abort,
    }

    struct Armed {
        /// name -> (action, fire on this hit)
        plan: HashMap<String, (Action, u64)>,
        hits: Mutex<HashMap<&'static str, u64>>,
    }

    fn armed() -> &'static Armed {
        static ARMED: OnceLock<Armed> = OnceLock::new();
        ARMED.get_or_init(|| {
            let spec = std::env::var("POSTROOM_FAILPOINTS").unwrap_or_default();
            let plan = spec
                .split(';')
                .filter(|s| !s.trim().is_empty())
                .filter_map(|entry| {
                    let (name, rest) = entry.trim().split_once('=')?;
                    let (action, n) = rest.split_once('@').unwrap_or((rest, "1"));
                    let action = match action {
                        "error" => Action::Error,
                        "panic" => Action::Panic,
                        "abort" => Action::Abort,
                        _ => return None,
                    };
                    Some((name.to_owned(), (action, n.parse().ok()?)))
                })
                .collect();
            Armed {
                plan,
                hits: Mutex::new(HashMap::new()),
            }
        })
    }

    pub(super) fn hit(name: &'static str) -> Result<()> {
        let armed = armed();
        let Some(&(action, fire_on)) = armed.plan.get(name) else {
            return Ok(());
        };
        let n = {
            let mut hits = armed.hits.lock().unwrap_or_else(|p| p.into_inner());
            let n = hits.entry(name).or_insert(0);
            *n += 1;
            *n
        };
        if n != fire_on {
            return Ok(());
        }
        match action {
            Action::Error => Err(Error::io(
                "failpoint",
                std::io::Error::other(format!("failpoint {name} fired")),
            )),
            Action::Panic => panic!("failpoint {name} fired"),
            Action::Abort => {
                eprintln!("failpoint {name}: aborting");
                std::process::abort()
            }
        }
    }
}
