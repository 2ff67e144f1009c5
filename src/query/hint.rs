//! Per-query hints, in any comment of the statement: `/* pgmemo cache */`,
//! `/* pgmemo cache ttl=5s */`, `/* pgmemo nocache */`, the same in a `--` comment, or as the
//! `pgmemo` key of a sqlcommenter comment (`/*pgmemo='cache%20ttl%3D5s',traceparent='...'*/`,
//! the value URL-encoded and single-quoted, as Django, SQLAlchemy, Spring and OpenTelemetry
//! write theirs). Words are separated by spaces and values by `=`, never `:` (pgbench,
//! SQLAlchemy's `text()` and other named-parameter layers read `:word` as a bind parameter).
//!
//! Where the comments are is the lexer's reading ([`super::lexer::Lexed::comment_spans`]): a
//! hint's words inside a string, a quoted name or a dollar-quoted body are not a comment, and
//! are not read. Comments are not part of a query's shape or cache key, so a comment that
//! changes with every request (a trace id) leaves both alone.
//!
//! `/* pgmemo primary */` (or `pgmemo='primary'`) is not the cache's: it sends the statement
//! to the primary when the database has replicas, whatever routing would prove
//! ([`asks_primary`]); the cache reads it as no hint.
//!
//! Several hints in one statement: `nocache` wins over `cache` (the safe choice: a
//! `nocache` added by one layer is never overridden by another's `cache`), else the first
//! `cache` wins. A malformed hint (`pgmemo` followed by an unknown word, a bad ttl, nothing) is
//! ignored as if it were not there, and said so ([`Hints::malformed`]) for the cache to count
//! and log it.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;

/// What a query's comments ask of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hint {
    /// Cache this query's result, for `ttl` (the configured default when not given).
    Cache { ttl: Option<Duration> },
    /// Never answer this query from the cache, whatever the rules say.
    NoCache,
}

/// Why a comment that names pgmemo is not a hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Malformed {
    /// `pgmemo` with no word after it, or one that is neither `cache` nor `nocache`.
    UnknownWord,
    /// A `cache` option other than `ttl=<duration>`, or a ttl that is not a duration of at
    /// most a year (`ttl=abc`, `ttl=-1`).
    BadOption,
    /// A sqlcommenter `pgmemo` value that is not single-quoted URL-encoded text.
    BadValue,
}

impl Malformed {
    pub fn as_str(self) -> &'static str {
        match self {
            Malformed::UnknownWord => "pgmemo followed by neither cache nor nocache",
            Malformed::BadOption => "a cache option other than ttl=<duration>",
            Malformed::BadValue => "a sqlcommenter value that is not quoted URL-encoded text",
        }
    }
}

/// What all the comments of a statement say.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Hints {
    /// The hint that counts, if any (see the module's rules for several).
    pub hint: Option<Hint>,
    /// The first malformed hint, ignored.
    pub malformed: Option<Malformed>,
}

/// The hints in the comments of `sql`, which the lexer found at `spans` (byte ranges of
/// `sql`, see [`super::lexer::Lexed::comment_spans`]). A statement without comments costs
/// one comparison; a comment that does not name pgmemo, one search of its bytes.
#[inline]
pub fn read(sql: &[u8], spans: &[(u32, u32)]) -> Hints {
    let mut hints = Hints::default();
    for comment in comments(sql, spans) {
        hints.add(comment_hint(comment));
    }
    hints
}

/// The comments of `sql` at `spans`.
fn comments<'a>(sql: &'a [u8], spans: &'a [(u32, u32)]) -> impl Iterator<Item = &'a [u8]> {
    spans
        .iter()
        .filter_map(|&(start, end)| sql.get(start as usize..end as usize))
}

impl Hints {
    /// Adds what one more comment says, in text order: `nocache` wins, else the first
    /// `cache`; the first malformed hint is kept to be said.
    fn add(&mut self, said: Option<Result<Hint, Malformed>>) {
        match said {
            None => {}
            Some(Err(why)) => {
                self.malformed.get_or_insert(why);
            }
            Some(Ok(Hint::NoCache)) => self.hint = Some(Hint::NoCache),
            Some(Ok(hint)) => {
                self.hint.get_or_insert(hint);
            }
        }
    }
}

/// One client's last hint comment and what it said: a client's queries mostly carry the same
/// hint (a framework's, a script's), which is then recognized by one comparison instead of
/// being read again (reading `/* pgmemo cache ttl=60s */` costs ~150 instructions, callgrind).
/// Only hints are kept: a comment that changes with every request (a trace id) is not one.
#[derive(Debug, Default)]
pub struct Memo {
    /// The comment, as the lexer delimits it (empty: none remembered).
    comment: Vec<u8>,
    said: Option<Result<Hint, Malformed>>,
}

/// Longer comments are read each time rather than kept for every client.
const MAX_MEMO: usize = 256;

impl Memo {
    /// [`read`], remembering the last hint comment read.
    #[inline]
    pub fn read(&mut self, sql: &[u8], spans: &[(u32, u32)]) -> Hints {
        let mut hints = Hints::default();
        for comment in comments(sql, spans) {
            hints.add(self.comment_hint(comment));
        }
        hints
    }

    fn comment_hint(&mut self, comment: &[u8]) -> Option<Result<Hint, Malformed>> {
        if !self.comment.is_empty() && comment == &self.comment[..] {
            return self.said;
        }
        let said = comment_hint(comment);
        if said.is_some() && comment.len() <= MAX_MEMO {
            self.comment.clear();
            self.comment.extend_from_slice(comment);
            self.said = said;
        }
        said
    }
}

/// The hints in the text of a statement of the extended protocol (it may use `$n`): read
/// once per statement. A text that never names pgmemo is not lexed.
pub fn read_statement(sql: &[u8]) -> Hints {
    if memchr::memmem::find(sql, b"pgmemo").is_none() {
        return Hints::default();
    }
    let mut lexed = super::lexer::Lexed::default();
    match super::lexer::comments(sql, &mut lexed) {
        Ok(()) => read(sql, &lexed.comment_spans),
        // Where its comments are is not known: it is not cached either way (the lexer refuses
        // what is not a single query or DML statement, or what it cannot read).
        Err(_) => Hints::default(),
    }
}

/// The text of a statement of the extended protocol with each comment as one space (what
/// PostgreSQL reads it as), when it has comments: statements that differ only in a comment
/// (a trace id, a request id appended per request by sqlcommenter or Rails' QueryLogs) have
/// one result, so the result cache keys them alike. None: no comment, or where they are is
/// not known (the lexer refuses the text): the text as it is then.
pub fn without_comments(sql: &[u8]) -> Option<Box<[u8]>> {
    if memchr::memmem::find(sql, b"/*").is_none() && memchr::memmem::find(sql, b"--").is_none() {
        return None;
    }
    let mut lexed = super::lexer::Lexed::default();
    super::lexer::comments(sql, &mut lexed).ok()?;
    if lexed.comment_spans.is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(sql.len());
    let mut at = 0;
    for &(start, end) in &lexed.comment_spans {
        let (start, end) = (start as usize, end as usize);
        out.extend_from_slice(sql.get(at..start)?);
        out.push(b' ');
        at = end;
    }
    out.extend_from_slice(sql.get(at..)?);
    Some(out.into_boxed_slice())
}

/// Logs a malformed hint of the query whose (normalized) text is `text`, once per shape or
/// statement: `warned` is the flag kept with it.
pub fn warn_once(warned: &AtomicBool, why: Malformed, text: &[u8]) {
    if !warned.load(Relaxed) && !warned.swap(true, Relaxed) {
        tracing::warn!(
            query = %String::from_utf8_lossy(text),
            "malformed pgmemo hint ignored ({}); the query runs as with no hint",
            why.as_str()
        );
    }
}

/// The hint in one comment (`/* ... */` or `-- ...`, as the lexer delimits it): None when it
/// is not one, an error when it names pgmemo as a hint does but says nothing readable.
pub fn comment_hint(comment: &[u8]) -> Option<Result<Hint, Malformed>> {
    match pgmemo_words(comment)? {
        Ok(words) => words_hint(&words),
        Err(why) => Some(Err(why)),
    }
}

/// The words a comment gives pgmemo: after `pgmemo` (`/* pgmemo cache ttl=5s */`), or the
/// decoded value of a sqlcommenter `pgmemo` key. None: the comment gives pgmemo nothing; an
/// error: a sqlcommenter `pgmemo` value that cannot be read.
fn pgmemo_words(comment: &[u8]) -> Option<Result<std::borrow::Cow<'_, [u8]>, Malformed>> {
    let body = if let Some(block) = comment.strip_prefix(b"/*") {
        block.strip_suffix(b"*/").unwrap_or(block)
    } else {
        comment.strip_prefix(b"--").unwrap_or(comment)
    };
    if !names_pgmemo(body) {
        return None;
    }
    let body = body.trim_ascii();
    if let Some(words) = body.strip_prefix(b"pgmemo") {
        if words.is_empty() || words[0].is_ascii_whitespace() {
            return Some(Ok(std::borrow::Cow::Borrowed(words)));
        }
    }
    sqlcommenter_words(body).map(|w| w.map(std::borrow::Cow::Owned))
}

/// Whether a comment of `sql` (at `spans`, as the lexer found them) is `/* pgmemo primary */`
/// or a sqlcommenter `pgmemo='primary'`.
pub fn asks_primary(sql: &[u8], spans: &[(u32, u32)]) -> bool {
    comments(sql, spans).any(comment_asks_primary)
}

/// [`asks_primary`] for a statement of the extended protocol (or a text the lexer refused
/// to read as a query: then any `pgmemo primary` in it counts).
pub fn statement_asks_primary(sql: &[u8]) -> bool {
    if !names_pgmemo(sql) {
        return false;
    }
    let mut lexed = super::lexer::Lexed::default();
    match super::lexer::comments(sql, &mut lexed) {
        Ok(()) => asks_primary(sql, &lexed.comment_spans),
        Err(_) => memchr::memmem::find(sql, b"pgmemo primary").is_some(),
    }
}

fn comment_asks_primary(comment: &[u8]) -> bool {
    matches!(pgmemo_words(comment), Some(Ok(words)) if words.trim_ascii() == b"primary")
}

/// Whether `text` has `pgmemo` in it: a `p` found by memchr, then compared (~5x cheaper
/// than `memmem::find` on a comment's few bytes, whose searcher is built at every call:
/// ~175 instructions a query with a request id comment, callgrind).
#[inline]
fn names_pgmemo(text: &[u8]) -> bool {
    memchr::memchr_iter(b'p', text).any(|at| text[at..].starts_with(b"pgmemo"))
}

/// The words after `pgmemo`: `cache [ttl=<duration>]` or `nocache`; None for `primary`,
/// which is routing's (see [`asks_primary`]), not the cache's.
fn words_hint(words: &[u8]) -> Option<Result<Hint, Malformed>> {
    let Ok(words) = std::str::from_utf8(words) else {
        return Some(Err(Malformed::UnknownWord));
    };
    if words.trim_ascii() == "primary" {
        return None;
    }
    Some(cache_words_hint(words))
}

fn cache_words_hint(words: &str) -> Result<Hint, Malformed> {
    let mut words = words.split_ascii_whitespace();
    match words.next() {
        Some("nocache") if words.next().is_none() => Ok(Hint::NoCache),
        Some("cache") => {
            let mut ttl = None;
            for word in words {
                match word.split_once('=') {
                    Some(("ttl", value)) if ttl.is_none() => {
                        ttl = Some(ttl_value(value).ok_or(Malformed::BadOption)?);
                    }
                    _ => return Err(Malformed::BadOption),
                }
            }
            Ok(Hint::Cache { ttl })
        }
        _ => Err(Malformed::UnknownWord),
    }
}

/// A sqlcommenter comment (`key='value',key='value'`, keys and values URL-encoded, a quote in
/// a value escaped as `\'`): the decoded value of its `pgmemo` key, if it has one. A comment
/// that is not in that form is not a hint.
fn sqlcommenter_words(body: &[u8]) -> Option<Result<Vec<u8>, Malformed>> {
    let mut rest = body;
    loop {
        let eq = rest.iter().position(|&b| b == b'=')?;
        let key = rest[..eq].trim_ascii();
        let after = rest[eq + 1..].trim_ascii_start();
        let is_pgmemo = key == b"pgmemo";
        let Some(value) = after.strip_prefix(b"'") else {
            return is_pgmemo.then_some(Err(Malformed::BadValue));
        };
        // The closing quote: the first one not escaped by a backslash.
        let mut i = 0;
        let close = loop {
            match value.get(i)? {
                b'\\' => i += 2,
                b'\'' => break i,
                _ => i += 1,
            }
        };
        if is_pgmemo {
            return Some(url_decode(&value[..close]).ok_or(Malformed::BadValue));
        }
        rest = value[close + 1..].trim_ascii_start().strip_prefix(b",")?;
    }
}

/// A sqlcommenter value: `\'` and `\\` unescaped, then `%XX` (and `+`, a space) decoded.
fn url_decode(value: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(value.len());
    let mut i = 0;
    while i < value.len() {
        match value[i] {
            b'\\' => {
                out.push(*value.get(i + 1)?);
                i += 2;
            }
            b'%' => {
                let hex = std::str::from_utf8(value.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    Some(out)
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
    use crate::query::lexer::{generalize, Lexed};

    /// The hints of a simple query, read where the lexer found its comments.
    fn hints(sql: &str) -> Hints {
        let mut lexed = Lexed::default();
        generalize(sql.as_bytes(), &mut lexed).expect("lexed");
        read(sql.as_bytes(), &lexed.comment_spans)
    }

    fn hint(sql: &str) -> Option<Hint> {
        let h = hints(sql);
        assert_eq!(h.malformed, None, "{sql}");
        h.hint
    }

    fn malformed(sql: &str) -> Malformed {
        let h = hints(sql);
        assert_eq!(h.hint, None, "{sql}");
        h.malformed.expect(sql)
    }

    const CACHE: Option<Hint> = Some(Hint::Cache { ttl: None });

    fn ttl(secs: u64) -> Option<Hint> {
        Some(Hint::Cache {
            ttl: Some(Duration::from_secs(secs)),
        })
    }

    /// The memo answers as `read` does, for the same comment again, another comment, no
    /// comment, a malformed one, and a trace id that changes.
    #[test]
    fn the_memo_agrees_with_read() {
        let mut memo = Memo::default();
        for sql in [
            "/* pgmemo cache ttl=60s */ SELECT 1",
            "/* pgmemo cache ttl=60s */ SELECT 2",
            "SELECT 3 /* pgmemo cache ttl=60s */",
            "/* pgmemo cache ttl=61s */ SELECT 1",
            "/* pgmemo nocache */ SELECT 1",
            "SELECT 1",
            "/* pgmemo nocache */ SELECT 1 /* pgmemo cache */",
            "/* other */ SELECT 1",
            "/* pgmemo cache ttl=abc */ SELECT 1",
            "/* pgmemo cache ttl=abc */ SELECT 1",
            "SELECT 1 /*pgmemo='cache',traceparent='00-1-1-01'*/",
            "SELECT 1 /*pgmemo='cache',traceparent='00-2-1-01'*/",
            "/* pgmemo cache ttl=60s */ SELECT 1 -- pgmemo nocache",
        ] {
            let mut lexed = Lexed::default();
            generalize(sql.as_bytes(), &mut lexed).unwrap();
            assert_eq!(
                memo.read(sql.as_bytes(), &lexed.comment_spans),
                read(sql.as_bytes(), &lexed.comment_spans),
                "{sql}"
            );
        }
    }

    #[test]
    fn primary_is_routing_s_hint_not_the_cache_s() {
        let asks = |sql: &str| {
            let mut lexed = super::super::lexer::Lexed::default();
            super::super::lexer::comments(sql.as_bytes(), &mut lexed).unwrap();
            asks_primary(sql.as_bytes(), &lexed.comment_spans)
        };
        assert!(asks("/* pgmemo primary */ SELECT 1"));
        assert!(asks("SELECT 1 -- pgmemo primary"));
        assert!(asks("SELECT 1 /*traceparent='00-1',pgmemo='primary'*/"));
        assert!(!asks("SELECT '/* pgmemo primary */'"));
        assert!(!asks("/* pgmemo nocache */ SELECT 1"));
        assert!(!asks("/* pgmemo primary please */ SELECT 1"));
        assert!(statement_asks_primary(b"SELECT $1 /* pgmemo primary */"));
        assert!(!statement_asks_primary(b"SELECT $1"));
        // The cache reads it as no hint, not a malformed one.
        assert_eq!(hints("/* pgmemo primary */ SELECT 1"), Hints::default());
        assert_eq!(hints("SELECT 1 /*pgmemo='primary'*/"), Hints::default());
    }

    #[test]
    fn leading_hints() {
        assert_eq!(hint("/* pgmemo cache */ SELECT 1"), CACHE);
        assert_eq!(hint("  /* pgmemo cache ttl=5s */SELECT 1"), ttl(5));
        assert_eq!(hint("/* pgmemo nocache */ SELECT 1"), Some(Hint::NoCache));
        assert_eq!(hint("/*pgmemo nocache*/SELECT 1"), Some(Hint::NoCache));
        assert_eq!(hint("/* a * b */ SELECT 1"), None);
        assert_eq!(hint("/* pgmemocache */ SELECT 1"), None);
        assert_eq!(hint("/* pgmemo:cache */ SELECT 1"), None);
        assert_eq!(hint("/* app:orders, see pgmemo */ SELECT 1"), None);
        assert_eq!(
            hint("/* pgmemo cache ttl=1.5s */ SELECT 1"),
            Some(Hint::Cache {
                ttl: Some(Duration::from_millis(1500))
            })
        );
        assert_eq!(hint("/* pgmemo cache ttl=2m */ SELECT 1"), ttl(120));
        // The integer path agrees with the configuration's reading of durations.
        for n in ["0s", "1s", "60s", "31536000s", "31536001s", "007s", "s"] {
            assert_eq!(ttl_value(n), crate::config::cache::parse_duration(n), "{n}");
        }
    }

    #[test]
    fn hints_anywhere_in_the_comments() {
        assert_eq!(hint("SELECT 1 /* pgmemo cache */"), CACHE);
        assert_eq!(hint("SELECT /* pgmemo cache ttl=7s */ 1 FROM t"), ttl(7));
        assert_eq!(hint("SELECT 1 -- pgmemo cache ttl=3s"), ttl(3));
        assert_eq!(hint("-- pgmemo nocache\nSELECT 1"), Some(Hint::NoCache));
        assert_eq!(hint("SELECT 1; /* pgmemo cache */"), CACHE);
        assert_eq!(hint("SELECT 1 /* app='x' */ /* pgmemo cache */"), CACHE);
    }

    /// sqlcommenter's form: keys and values URL-encoded, values single-quoted, `\'` a quote.
    #[test]
    fn sqlcommenter_keys() {
        let traceparent = "traceparent='00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'";
        assert_eq!(
            hint(&format!("SELECT 1 /*pgmemo='cache ttl=5s',{traceparent}*/")),
            ttl(5)
        );
        assert_eq!(
            hint(&format!(
                "SELECT 1 /*{traceparent},pgmemo='cache%20ttl%3D5s'*/"
            )),
            ttl(5)
        );
        assert_eq!(
            hint("SELECT 1 /*controller='users', pgmemo='cache+ttl%3d9s', route='%2Fu'*/"),
            ttl(9)
        );
        assert_eq!(hint("SELECT 1 /*pgmemo='nocache'*/"), Some(Hint::NoCache));
        assert_eq!(hint("SELECT 1 /*pgmemo='cache'*/"), CACHE);
        assert_eq!(hint("SELECT 1 /*app='it\\'s',pgmemo='cache'*/"), CACHE);
        // Another key that names pgmemo, or a value that does: not a hint.
        assert_eq!(hint("SELECT 1 /*pgmemo_x='cache',app='pgmemo'*/"), None);
        // Not in sqlcommenter's form: not read as it.
        assert_eq!(hint("SELECT 1 /*app=x pgmemo='cache'*/"), None);
    }

    /// The hint's words inside a string, a quoted name or a dollar-quoted body are no
    /// comment: the lexer says where comments are.
    #[test]
    fn never_inside_strings() {
        for sql in [
            "SELECT '/* pgmemo cache */' FROM t",
            "SELECT '-- pgmemo cache' FROM t",
            "SELECT $$/* pgmemo cache */$$ FROM t",
            "SELECT $x$ -- pgmemo cache\n $x$ FROM t",
            "SELECT 1 AS \"/* pgmemo cache */\"",
            "SELECT E'\\' /* pgmemo cache */' FROM t",
            "SELECT 'a'' /*pgmemo=''cache''*/' FROM t",
        ] {
            assert_eq!(hints(sql), Hints::default(), "{sql}");
        }
    }

    /// Two hints: `nocache` wins, else the first.
    #[test]
    fn several_hints() {
        assert_eq!(
            hint("/* pgmemo cache ttl=5s */ SELECT 1 /* pgmemo cache ttl=9s */"),
            ttl(5)
        );
        assert_eq!(
            hint("/* pgmemo cache */ SELECT 1 /*pgmemo='nocache'*/"),
            Some(Hint::NoCache)
        );
        assert_eq!(
            hint("/* pgmemo nocache */ SELECT 1 -- pgmemo cache"),
            Some(Hint::NoCache)
        );
    }

    #[test]
    fn malformed_hints_are_ignored_and_said() {
        use Malformed::*;
        assert_eq!(malformed("/* pgmemo cahce */ SELECT 1"), UnknownWord);
        assert_eq!(malformed("/* pgmemo */ SELECT 1"), UnknownWord);
        assert_eq!(malformed("SELECT 1 -- pgmemo nocache please"), UnknownWord);
        assert_eq!(malformed("SELECT 1 /* pgmemo cache ttl=abc */"), BadOption);
        assert_eq!(malformed("SELECT 1 /* pgmemo cache ttl=-1 */"), BadOption);
        assert_eq!(malformed("SELECT 1 /* pgmemo cache ttl:5s */"), BadOption);
        assert_eq!(
            malformed("SELECT 1 /* pgmemo cache ttl=99999999s */"),
            BadOption
        );
        assert_eq!(
            malformed("SELECT 1 /* pgmemo cache ttl=1s ttl=2s */"),
            BadOption
        );
        assert_eq!(
            malformed("SELECT 1 /*pgmemo='cache%20ttl%3Dabc'*/"),
            BadOption
        );
        assert_eq!(malformed("SELECT 1 /*pgmemo='cache%2'*/"), BadValue);
        assert_eq!(malformed("SELECT 1 /*pgmemo=cache*/"), BadValue);
        // A malformed hint does not hide a good one.
        let h = hints("/* pgmemo cache ttl=abc */ SELECT 1 /* pgmemo nocache */");
        assert_eq!(
            (h.hint, h.malformed),
            (Some(Hint::NoCache), Some(BadOption))
        );
    }

    /// A statement of the extended protocol (with `$n`) is read the same way.
    #[test]
    fn statements_with_parameters() {
        assert_eq!(
            read_statement(b"SELECT * FROM t WHERE id = $1 /* pgmemo cache ttl=5s */").hint,
            ttl(5)
        );
        assert_eq!(
            read_statement(b"SELECT '/* pgmemo cache */' FROM t WHERE id = $1"),
            Hints::default()
        );
        assert_eq!(
            read_statement(b"SELECT $1 -- pgmemo nocache").hint,
            Some(Hint::NoCache)
        );
    }
}
