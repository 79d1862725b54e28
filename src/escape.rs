//! [`Esc`]: a value as it may appear in the engine's own log text.
//!
//! Message ids, consumer names read back from stored rows, topics, and
//! error texts (user code writes those) reach the log text, and a log line
//! is a terminal's or a collector's input: an id holding
//! `"\n[ERROR] postroom: database corrupted"` would forge a line, and an
//! OSC escape would retitle the terminal. Invariant: what goes through
//! [`Esc`] comes out with every control character (C0, DEL, C1: newline,
//! carriage return, tab and ESC included) and every invisible format
//! character (bidirectional overrides and isolates, zero-width marks, the
//! BOM, tag characters: text that reorders or hides its neighbours) written
//! as a `\n`, `\r`, `\t` or `\u{…}` escape, and everything else unchanged.
//! The test is an allowlist of what may pass as is, not a list of known
//! attacks. It formats through the value's own `Display`, without
//! allocating.
//!
//! Key-values handed to a structured logger (`consumer`, `message_id`) stay
//! raw: escaping is that logger's job, and its consumers need the exact
//! value to match on.

use std::fmt::{self, Display, Write};

/// `value`'s `Display`, escaped for log text (see the module doc).
pub(crate) struct Esc<T>(pub T);

impl<T: Display> Display for Esc<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(Escaping(f), "{}", self.0)
    }
}

impl<T: Display> fmt::Debug for Esc<T> {
    /// Quoted, for places that used `{:?}` to mark a name's bounds.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('"')?;
        write!(Escaping(f), "{}", self.0)?;
        f.write_char('"')
    }
}

/// Forwards text, escaping what may not pass as is.
struct Escaping<'a, 'b>(&'a mut fmt::Formatter<'b>);

impl Write for Escaping<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        // Runs of characters that may pass go through in one write.
        let mut start = 0;
        for (i, c) in s.char_indices() {
            if passes(c) {
                continue;
            }
            self.0.write_str(&s[start..i])?;
            match c {
                '\n' => self.0.write_str("\\n")?,
                '\r' => self.0.write_str("\\r")?,
                '\t' => self.0.write_str("\\t")?,
                c => write!(self.0, "{}", c.escape_unicode())?,
            }
            start = i + c.len_utf8();
        }
        self.0.write_str(&s[start..])
    }
}

/// True for what may appear in log text as is: printable ASCII (the
/// backslash included: an escape's own backslash is not doubled, so `\n`
/// typed as text reads as the escape would; the line cannot break either
/// way), and any other character that is neither a control character nor
/// an invisible format character.
pub(crate) fn passes(c: char) -> bool {
    if c.is_ascii() {
        return (' '..='~').contains(&c);
    }
    !c.is_control() && !invisible(c)
}

/// Unicode's format characters (category Cf) and the line and paragraph
/// separators: zero-width and directional marks, bidi embeddings,
/// overrides and isolates, word joiners, invisible operators, the BOM,
/// interlinear annotation marks, tag characters, the soft hyphen.
pub(crate) fn invisible(c: char) -> bool {
    matches!(c,
        '\u{ad}' | '\u{600}'..='\u{605}' | '\u{61c}' | '\u{6dd}' | '\u{70f}' | '\u{890}'..='\u{891}'
        | '\u{8e2}' | '\u{180e}' | '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}'
        | '\u{2060}'..='\u{2064}' | '\u{2066}'..='\u{206f}' | '\u{feff}' | '\u{fff9}'..='\u{fffb}'
        | '\u{110bd}' | '\u{110cd}' | '\u{13430}'..='\u{1343f}' | '\u{1bca0}'..='\u{1bca3}'
        | '\u{1d173}'..='\u{1d17a}' | '\u{e0001}' | '\u{e0020}'..='\u{e007f}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_and_format_characters_are_escaped_and_the_rest_passes() {
        let forged = "m-1\n[ERROR] postroom: corrupted\x1b]0;t\x07\r\t\u{85}\u{202e}x\u{200b}";
        let shown = Esc(forged).to_string();
        assert_eq!(
            shown,
            "m-1\\n[ERROR] postroom: corrupted\\u{1b}]0;t\\u{7}\\r\\t\\u{85}\\u{202e}x\\u{200b}"
        );
        assert!(shown.chars().all(passes));
        assert_eq!(Esc("order-7 ✓ 日本語").to_string(), "order-7 ✓ 日本語");
        assert_eq!(format!("{:?}", Esc("a\nb")), "\"a\\nb\"");
        // Any Display: an error's text is escaped the same way.
        assert_eq!(Esc(format_args!("{}", "e\x1b")).to_string(), "e\\u{1b}");
    }
}
