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

/// The hint in the first comment of `sql` (only whitespace before it), if it is one.
pub fn parse(sql: &[u8]) -> Option<Hint> {
    let start = sql.iter().position(|b| !b.is_ascii_whitespace())?;
    let rest = sql[start..].strip_prefix(b"/*")?;
    let end = rest.windows(2).position(|w| w == b"*/")?;
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
                    "ttl" => ttl = Some(super::config::parse_duration(value)?),
                    _ => return None,
                }
            }
            Some(Hint::Cache { ttl })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
