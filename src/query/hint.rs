//! Per-query hints in a leading comment: `/* pgmemo cache */`, `/* pgmemo cache ttl=5s */`,
//! `/* pgmemo nocache */`. Words are separated by spaces and values by `=`, never `:` (pgbench,
//! SQLAlchemy's `text()` and other named-parameter layers read `:word` as a bind parameter).

use std::time::Duration;

/// What a query's leading comment asks of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hint {
    /// Cache this query's result, for `ttl` (the configured default when not given).
    Cache { ttl: Option<Duration> },
    /// Never answer this query from the cache, whatever the rules say.
    NoCache,
}

/// One client's last leading comment and what it said: a client's queries mostly carry the
/// same hint, which is then recognized by one comparison instead of being read again.
#[derive(Debug, Default)]
pub struct Memo {
    /// The comment, `/*` to `*/` (empty: none remembered).
    comment: Vec<u8>,
    hint: Option<Hint>,
}

/// Longer comments are read each time rather than kept for every client.
const MAX_MEMO: usize = 256;

impl Memo {
    /// [`parse`], remembering the last comment read.
    pub fn parse(&mut self, sql: &[u8]) -> Option<Hint> {
        let start = sql.iter().position(|b| !b.is_ascii_whitespace())?;
        let text = &sql[start..];
        if !text.starts_with(b"/*") {
            return None;
        }
        if !self.comment.is_empty() && text.starts_with(&self.comment) {
            return self.hint;
        }
        let hint = parse(text);
        let end = comment_end(&text[2..]).map(|e| e + 4);
        match end {
            Some(end) if end <= MAX_MEMO => {
                self.comment.clear();
                self.comment.extend_from_slice(&text[..end]);
                self.hint = hint;
            }
            _ => self.comment.clear(),
        }
        hint
    }
}

/// The hint in the first comment of `sql` (only whitespace before it), if it is one.
pub fn parse(sql: &[u8]) -> Option<Hint> {
    let start = sql.iter().position(|b| !b.is_ascii_whitespace())?;
    let rest = sql[start..].strip_prefix(b"/*")?;
    // Run on every query a rule or hint may choose: the common answers (no comment, another
    // comment) are given before any text is split.
    if !rest.trim_ascii_start().starts_with(b"pgmemo") {
        return None;
    }
    let end = comment_end(rest)?;
    let body = std::str::from_utf8(&rest[..end]).ok()?;
    let mut words = body.split_ascii_whitespace();
    if words.next()? != "pgmemo" {
        return None;
    }
    match words.next()? {
        "nocache" => Some(Hint::NoCache),
        "cache" => {
            let mut ttl = None;
            for word in words {
                let (name, value) = word.split_once('=')?;
                match name {
                    "ttl" => ttl = Some(ttl_value(value)?),
                    _ => return None,
                }
            }
            Some(Hint::Cache { ttl })
        }
        _ => None,
    }
}

/// Where `*/` starts in `text`.
fn comment_end(text: &[u8]) -> Option<usize> {
    memchr::memmem::find(text, b"*/")
}

/// A ttl's value: whole seconds (`60s`, the usual spelling) read directly, anything else as
/// the configuration reads durations.
fn ttl_value(value: &str) -> Option<Duration> {
    let seconds = value
        .strip_suffix('s')
        .filter(|n| !n.is_empty() && n.len() <= 8 && n.bytes().all(|b| b.is_ascii_digit()));
    match seconds {
        Some(n) => Some(Duration::from_secs(n.parse().ok()?))
            .filter(|d| d.as_secs() <= crate::config::cache::MAX_DURATION_SECS),
        None => crate::config::cache::parse_duration(value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The memo answers as `parse` does, for the same comment again, another comment, no
    /// comment, and an unfinished one.
    #[test]
    fn the_memo_agrees_with_parse() {
        let mut memo = Memo::default();
        for sql in [
            &b"/* pgmemo cache ttl=60s */ SELECT 1"[..],
            b"/* pgmemo cache ttl=60s */ SELECT 2",
            b"  /* pgmemo cache ttl=60s */SELECT 3",
            b"/* pgmemo cache ttl=61s */ SELECT 1",
            b"/* pgmemo nocache */ SELECT 1",
            b"SELECT 1",
            b"/* pgmemo nocache */ SELECT 1",
            b"/* other */ SELECT 1",
            b"/* pgmemo cache",
            b"/* pgmemo cache */",
            b"/* pgmemo cache ttl=60s */ SELECT 1",
            b"/* pgmemo cache ttl=60s * / */ SELECT 1",
        ] {
            assert_eq!(
                memo.parse(sql),
                parse(sql),
                "{}",
                String::from_utf8_lossy(sql)
            );
        }
    }

    #[test]
    fn hints() {
        assert_eq!(
            parse(b"/* pgmemo cache */ SELECT 1"),
            Some(Hint::Cache { ttl: None })
        );
        assert_eq!(
            parse(b"  /* pgmemo cache ttl=5s */SELECT 1"),
            Some(Hint::Cache {
                ttl: Some(Duration::from_secs(5))
            })
        );
        assert_eq!(parse(b"/* pgmemo nocache */ SELECT 1"), Some(Hint::NoCache));
        assert_eq!(parse(b"SELECT 1 /* pgmemo cache */"), None);
        assert_eq!(parse(b"/* pgmemo:cache */ SELECT 1"), None);
        assert_eq!(parse(b"/* pgmemo cache ttl=forever */ SELECT 1"), None);
        assert_eq!(parse(b"/* pgmemo cache"), None);
        assert_eq!(parse(b"/* a * b */ SELECT 1"), None);
        assert_eq!(parse(b"/*pgmemo nocache*/SELECT 1"), Some(Hint::NoCache));
        assert_eq!(parse(b"/* pgmemocache */ SELECT 1"), None);
        assert_eq!(parse(b"/* pgmemo cache ttl=99999999s */ SELECT 1"), None);
        assert_eq!(
            parse(b"/* pgmemo cache ttl=1.5s */ SELECT 1"),
            Some(Hint::Cache {
                ttl: Some(Duration::from_millis(1500))
            })
        );
        assert_eq!(
            parse(b"/* pgmemo cache ttl=2m */ SELECT 1"),
            Some(Hint::Cache {
                ttl: Some(Duration::from_secs(120))
            })
        );
        // The integer path agrees with the configuration's reading of durations.
        for n in ["0s", "1s", "60s", "31536000s", "31536001s", "007s", "s"] {
            assert_eq!(ttl_value(n), crate::config::cache::parse_duration(n), "{n}");
        }
    }
}
