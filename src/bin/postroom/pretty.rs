//! Payloads for people: pretty JSON re-indented as stored, UTF-8 text, or
//! a hex dump, bounded whatever the payload. Invariant: linear in what it
//! shows, without recursion, and never reparses JSON (large numbers,
//! duplicate keys and key order show as stored); `--json` output never
//! comes through here.

use std::fmt::Write as _;

use postroom::admin::Payload;

/// For people: pretty-printed JSON, or the text, or a hex dump (offset,
/// 16 bytes in hex, and their printable ASCII). JSON is re-indented
/// without being reparsed: large numbers and duplicate keys show as
/// stored.
///
/// Bounded, whatever the payload: about [`PRETTY_MAX_BYTES`] of output
/// at most, JSON nested deeper than [`PRETTY_MAX_DEPTH`] levels shown
/// as `[…]` / `{…}`, each cut said on a last line starting
/// `… truncated`. Linear in what it shows, without recursion, so a
/// hostile payload (100,000 nested arrays) costs the operator's machine
/// nothing. The exact bytes are in the serialization (`--json`).
pub fn pretty(payload: &Payload) -> String {
    let bytes = payload.as_bytes();
    let limit = PRETTY_MAX_BYTES;
    let total = bytes.len();
    let (mut s, cut) = match payload.encoding() {
        "json" => reindent(&String::from_utf8_lossy(bytes), PRETTY_MAX_DEPTH, limit),
        "text" => {
            let text = String::from_utf8_lossy(bytes);
            let mut end = text.len().min(limit);
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            let cut = Cut {
                size: end < text.len(),
                deep: false,
            };
            (text[..end].to_owned(), cut)
        }
        _ => {
            let mut s = String::new();
            let mut size = false;
            for (n, chunk) in bytes.chunks(16).enumerate() {
                if s.len() >= limit {
                    size = true;
                    break;
                }
                let _ = write!(s, "{:08x}  ", n * 16);
                for i in 0..16 {
                    match chunk.get(i) {
                        Some(b) => {
                            let _ = write!(s, "{b:02x} ");
                        }
                        None => s.push_str("   "),
                    }
                }
                s.push(' ');
                for &b in chunk {
                    s.push(if b.is_ascii_graphic() || b == b' ' {
                        char::from(b)
                    } else {
                        '.'
                    });
                }
                s.push('\n');
            }
            (s, Cut { size, deep: false })
        }
    };
    if (cut.deep || cut.size) && !s.ends_with('\n') {
        s.push('\n');
    }
    if cut.deep {
        let _ = writeln!(
            s,
            "… truncated: nesting deeper than {PRETTY_MAX_DEPTH} levels is shown as […] or \
             {{…}}; --json gives the payload exactly"
        );
    }
    if cut.size {
        let _ = writeln!(
            s,
            "… truncated after {} bytes of output (the payload has {total} bytes); --json \
             gives the payload exactly",
            limit
        );
    }
    s
}

/// About how many bytes [`pretty`] shows (a line may run past).
const PRETTY_MAX_BYTES: usize = 64 * 1024;

/// How deep [`pretty`] shows nested JSON.
const PRETTY_MAX_DEPTH: usize = 32;

/// What [`pretty`] left out.
#[derive(Debug, Clone, Copy, Default)]
struct Cut {
    /// Stopped at the size limit.
    size: bool,
    /// Elided values nested past the depth limit.
    deep: bool,
}

/// Valid JSON text re-indented by two spaces per level, every token kept
/// as stored: numbers past what a double holds, duplicate keys, key order
/// and string escapes come out as they went in (a reparse would change
/// them). One pass, no recursion: an array or object that would open level
/// `max_depth + 1` is shown as `[…]` / `{…}` and skipped, so indentation
/// costs at most `2 * max_depth` bytes a line; output stops once it holds
/// `max_bytes`.
fn reindent(text: &str, max_depth: usize, max_bytes: usize) -> (String, Cut) {
    let mut out = String::with_capacity(text.len().min(max_bytes) * 2);
    let mut cut = Cut::default();
    let mut depth = 0usize;
    let (mut in_string, mut escaped) = (false, false);
    let newline = |out: &mut String, depth: usize| {
        out.push('\n');
        out.push_str(&"  ".repeat(depth));
    };
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if out.len() >= max_bytes {
            cut.size = true;
            break;
        }
        if in_string {
            out.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            '{' | '[' => {
                out.push(c);
                while chars.peek().is_some_and(|c| c.is_ascii_whitespace()) {
                    chars.next();
                }
                if matches!(chars.peek(), Some('}' | ']')) {
                    out.extend(chars.next());
                } else if depth >= max_depth {
                    // Too deep to show: the value's inside is skipped
                    // whole (strings included), in one pass.
                    cut.deep = true;
                    out.push('…');
                    skip_value_rest(&mut chars);
                    out.push(if c == '{' { '}' } else { ']' });
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(c);
            }
            ',' => {
                out.push(c);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            c if c.is_ascii_whitespace() => {}
            c => out.push(c),
        }
    }
    (out, cut)
}

/// Consumes the rest of an array or object whose opening bracket was just
/// read, up to and including its closing bracket. Iterative: a count of
/// open brackets, not a recursion.
fn skip_value_rest(chars: &mut impl Iterator<Item = char>) {
    let mut open = 1usize;
    let (mut in_string, mut escaped) = (false, false);
    for c in chars {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' | '[' => open += 1,
            '}' | ']' => {
                open -= 1;
                if open == 0 {
                    return;
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pretty_json_is_cut_at_depth_and_size_and_strings_are_never_misread() {
        // Small JSON comes out whole and re-indented, as stored.
        let small = Payload(br#"{"a":[1,2],"b":"x]"}"#.to_vec());
        assert_eq!(
            pretty(&small),
            "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": \"x]\"\n}"
        );
        // Past the depth limit a value is elided whole: brackets inside its
        // strings do not end it early, and what follows it is shown.
        let (shown, cut) = reindent(r#"[[["a]]]\"", [1]], "after"], 2]"#, 2, 1 << 20);
        assert!(cut.deep && !cut.size, "{shown}");
        assert!(shown.contains("[…]"), "{shown}");
        assert!(shown.contains("\"after\""), "{shown}");
        assert!(!shown.contains("a]]]"), "{shown}");
        // The size limit stops the pass; the marker says so.
        let wide = Payload(format!("[{}1]", "1,".repeat(100_000)).into_bytes());
        let shown = pretty(&wide);
        assert!(shown.len() < PRETTY_MAX_BYTES + 1024, "{}", shown.len());
        assert!(
            shown.ends_with("--json gives the payload exactly\n"),
            "{shown}"
        );
        // Deep nesting: linear, no recursion, both markers where both apply.
        let deep = Payload(format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes());
        let shown = pretty(&deep);
        assert!(shown.len() < 4096, "{}", shown.len());
        assert!(
            shown.contains("… truncated: nesting deeper than 32 levels"),
            "{shown}"
        );
    }
}
