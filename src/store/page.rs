//! One page of an operator's listing, as SQL: keyset paging over an
//! integer key. Invariant: only the constants callers pass in (a column
//! name, parameter numbers) reach the SQL text; the cursor and the limit
//! are bound parameters.

/// One page of a listing: newest first (by row id or `seq`) unless
/// `oldest_first`; the next page starts after the last row shown, named
/// by `after` (keyset paging: stable while rows are added).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Page {
    /// Oldest first instead of newest first.
    pub oldest_first: bool,
    /// Only rows past this id in the listing's order (below it newest
    /// first, above it oldest first): the last id of the previous page.
    pub after: Option<i64>,
    /// At most this many rows.
    pub limit: usize,
}

impl Default for Page {
    fn default() -> Self {
        Page {
            oldest_first: false,
            after: None,
            limit: 100,
        }
    }
}

impl Page {
    /// Every row, oldest first.
    pub fn all() -> Page {
        Page {
            oldest_first: true,
            after: None,
            limit: usize::MAX,
        }
    }

    /// SQL for the page over the integer column `key`, with the bound
    /// parameters `?{after}` (the cursor) and `?{limit}`: a condition to
    /// AND into the WHERE clause, and the ORDER BY … LIMIT tail. Only the
    /// constants passed in reach the SQL text.
    pub(crate) fn sql(&self, key: &str, after: usize, limit: usize) -> (String, String) {
        let (cmp, dir) = if self.oldest_first {
            (">", "ASC")
        } else {
            ("<", "DESC")
        };
        (
            format!("(?{after} IS NULL OR {key} {cmp} ?{after})"),
            format!("ORDER BY {key} {dir} LIMIT ?{limit}"),
        )
    }
}

/// A page's limit as an SQL parameter (`usize::MAX`: no limit).
pub(crate) fn limit_param(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}
