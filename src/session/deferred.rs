//! A transaction of cache hits takes no server. In transaction mode, with the result cache
//! following the client, a `BEGIN` that opens a READ COMMITTED block is answered here and
//! kept: the block's reads the cache holds are answered in it (ReadyForQuery `T`), and a
//! `COMMIT` or `ROLLBACK` of a block that never needed a server is answered here too. The
//! first statement that needs a server takes one, and the `BEGIN` goes ahead of it in the
//! same write (its replies swallowed): the transaction starts on the server then, so
//! `now()` is the time of that statement's block on the server, not of the client's `BEGIN`.
//!
//! Only blocks the cache may answer in are kept: READ COMMITTED by the `BEGIN`'s options, the
//! client's `default_transaction_isolation`, or the pool's (read with the setting functions,
//! see `read_setting_functions`), and not `READ WRITE` (which a standby refuses at the
//! `BEGIN`, where the client must see it). A block whose reads were answered here gets
//! `BEGIN ...; SELECT` on the server: it has run a query, as the client saw, so a later
//! `SET TRANSACTION` fails as PostgreSQL fails it.
//!
//! A pool with replicas keeps a `BEGIN` too, cache or not, when its first statement may still
//! make the block read-only (`SET TRANSACTION READ ONLY`): not `READ ONLY` already (routed at
//! once), not `READ WRITE`, not SERIALIZABLE. Where the block goes is decided when its first
//! statement takes a server (see `session::replicas`).

use super::Session;
use crate::protocol::backend as be;
use crate::protocol::body;
use crate::protocol::frontend as fe;
use crate::query::block::{self, Control, Isolation};
use crate::replies::{Action, Entry, Expected};
use crate::server::ServerConn;
use bytes::Buf;

/// Longer texts are no transaction control the session reads.
pub(super) const MAX_CONTROL_LEN: usize = 128;

/// A `BEGIN` the session answered and holds back (see the module's documentation).
pub(super) struct KeptBlock {
    /// What goes to the server ahead of the block's first statement that needs one.
    pub(super) begin: Box<str>,
    /// The modes it names.
    pub(super) modes: block::Modes,
    /// A statement of the block was answered from the cache: the block has run a query, as
    /// far as the client can tell.
    pub(super) answered: bool,
    /// The `BEGIN` came in the extended protocol: its unnamed portal is the client's until the
    /// block runs a statement.
    pub(super) portal: bool,
}

impl Session {
    /// A Query that opens a block the session keeps without a server, or ends one it kept:
    /// answered here. True: answered, the message consumed.
    #[inline]
    pub(super) fn transaction_control(
        &mut self,
        tag: u8,
        len: usize,
        query_text_len: Option<usize>,
    ) -> bool {
        if tag != fe::QUERY || self.server.is_some() || !self.state.enabled || !self.may_keep() {
            return false;
        }
        match query_text_len {
            Some(n)
                if n <= MAX_CONTROL_LEN
                    && may_be_control(fe::query_text_of(&self.client.rbuf, n)) =>
            {
                self.answer_control(len, n)
            }
            _ => false,
        }
    }

    /// [`Session::transaction_control`] for a text that may be one.
    #[inline(never)]
    fn answer_control(&mut self, len: usize, text_len: usize) -> bool {
        let text = fe::query_text_of(&self.client.rbuf, text_len);
        let Some(control) = block::read(text) else {
            return false;
        };
        let begin = begin_text(&control, text);
        let status = match self.keep_or_end_block(control, begin, false) {
            Some(status) => status,
            None => return false,
        };
        // A simple query drops the client's unnamed statement, as PostgreSQL's does.
        if let Some(stmts) = self.plan.stmts.as_mut() {
            stmts.set(b"", None);
        }
        be::command_complete(&mut self.client.wbuf, control.tag());
        be::ready_for_query(&mut self.client.wbuf, status);
        self.client.rbuf.advance(len);
        self.stats.query_count += 1;
        self.stats.bytes_received += len as u64;
        true
    }

    /// Opens a block the session keeps (`control` a `BEGIN` that may be kept: not in a kept
    /// block, READ COMMITTED, not READ WRITE; `begin` what goes to the server later, None
    /// for a `COMMIT` or `ROLLBACK`) or ends
    /// one (a `COMMIT` or `ROLLBACK` of a kept block): the ReadyForQuery status after it, or
    /// None (the statement goes to a server). `portal`: the `BEGIN` came in the extended
    /// protocol and its unnamed portal is the client's (see [`Session::begin_kept_block`]).
    fn keep_or_end_block(
        &mut self,
        control: Control,
        begin: Option<Box<str>>,
        portal: bool,
    ) -> Option<u8> {
        let deferred = self.keeps_block();
        match control {
            Control::Begin { modes, .. } if !deferred => {
                if modes.read_write || !self.replies.is_empty() {
                    return None;
                }
                let read_committed = self.begins_read_committed(modes.isolation);
                let for_cache = read_committed && self.caching();
                if !for_cache && !self.may_become_read_only(modes) {
                    return None;
                }
                if let Some(cache) = self.cache.as_deref_mut() {
                    // Answered in only when READ COMMITTED.
                    cache.read_committed = Some(read_committed);
                }
                self.kept = Some(Box::new(KeptBlock {
                    begin: begin?,
                    modes,
                    answered: false,
                    portal,
                }));
                Some(b'T')
            }
            Control::Commit | Control::Rollback if deferred => {
                self.kept = None;
                if let Some(cache) = self.cache.as_deref_mut() {
                    cache.read_committed = None;
                }
                self.stats.xact_count += 1;
                Some(b'I')
            }
            _ => None,
        }
    }

    /// An extended-protocol unit at the head of the client's input (a Parse or a Bind: `tag`)
    /// that opens a block the session keeps or ends one it kept, as
    /// [`Session::transaction_control`] does for a Query: `[Parse] Bind [Describe] Execute` of
    /// the unnamed portal, its statement's text a `BEGIN`, `COMMIT` or `ROLLBACK` the
    /// session reads. Answered here as PostgreSQL would (ParseComplete, BindComplete, NoData,
    /// CommandComplete); the ReadyForQuery comes with the client's Sync (see
    /// `Session::server_for`), or with the cache's answer to the batch that follows in the same
    /// Sync. True: answered, the unit consumed.
    #[inline]
    pub(super) fn extended_control(&mut self, tag: u8, len: usize) -> bool {
        if !matches!(tag, fe::PARSE | fe::BIND)
            || self.server.is_some()
            || !self.state.enabled
            // A Parse's text is looked at here, inline: the unit's reading is a call that
            // costs ~60 instructions a hit by the extended protocol even when the text's
            // first letter already says no.
            || (tag == fe::PARSE && !parse_may_be_control(body(&self.client.rbuf[..len])))
            || !self.may_keep()
        {
            return false;
        }
        self.answer_extended_control()
    }

    /// [`Session::extended_control`] for a Parse or Bind with no server held.
    #[inline(never)]
    fn answer_extended_control(&mut self) -> bool {
        let Some(unit) = control_unit(&self.client.rbuf) else {
            return false;
        };
        let Some(stmts) = self.plan.stmts.as_mut() else {
            return false;
        };
        let statement = match &unit.parse {
            Some(p) => stmts.statement_for_parse(&self.app.registry, p),
            None if stmts.is_stale(unit.statement) => return false,
            None => match stmts.get(unit.statement) {
                Some(s) => s.clone(),
                None => return false,
            },
        };
        let (parsed, described, len) = (unit.parse.is_some(), unit.described, unit.len);
        // BEGIN or START TRANSACTION, COMMIT, ROLLBACK and the like (read once per statement),
        // before the exact reading.
        if !(statement.starts_transaction || statement.ends_transaction)
            || !statement.is_validated()
            || statement.param_count != 0
            || statement.hidden.is_some()
            || statement.key.query.len() > MAX_CONTROL_LEN
        {
            return false;
        }
        let Some(control) = block::read(&statement.key.query) else {
            return false;
        };
        let begin = begin_text(&control, &statement.key.query);
        if self.keep_or_end_block(control, begin, true).is_none() {
            return false;
        }
        if let Some(stmts) = self.plan.stmts.as_mut() {
            if parsed && !stmts.is_bound_to(b"", &statement) {
                stmts.set(b"", Some(statement.clone()));
            }
            if stmts.has_tracked_portals() {
                stmts.forget_portal(b"");
            }
        }
        let out = &mut self.client.wbuf;
        if parsed {
            crate::protocol::write_empty_message(out, be::PARSE_COMPLETE);
        }
        crate::protocol::write_empty_message(out, be::BIND_COMPLETE);
        if described {
            crate::protocol::write_empty_message(out, be::NO_DATA);
        }
        be::command_complete(out, control.tag());
        self.client.rbuf.advance(len);
        self.stats.query_count += 1;
        self.stats.bytes_received += len as u64;
        true
    }

    /// Whether the client is in a block the session keeps without a server.
    #[inline]
    pub(super) fn keeps_block(&self) -> bool {
        self.kept.is_some()
    }

    /// Whether a feature may keep the client's `BEGIN`: the result cache (see `caching`), or
    /// replicas (see `replicas`).
    #[inline]
    fn may_keep(&self) -> bool {
        self.caching() || self.reads.is_some()
    }

    /// The transaction status PostgreSQL would report to the client now, with no server
    /// held: `T` in a block the session keeps, else `I`.
    #[inline]
    pub(super) fn status_without_server(&self) -> u8 {
        if self.keeps_block() {
            b'T'
        } else {
            b'I'
        }
    }

    /// Whether a block begun with `isolation` (None: not named) is READ COMMITTED.
    fn begins_read_committed(&self, isolation: Option<Isolation>) -> bool {
        match isolation {
            Some(level) => level == Isolation::ReadCommitted,
            None => match self.params.settings.get("default_transaction_isolation") {
                Some(own) => own.eq_ignore_ascii_case("read committed"),
                None => self.pool.read_committed_default() == Some(true),
            },
        }
    }

    /// As `server` is taken for a block the session kept: its `BEGIN` goes first (after what
    /// brings the server in line with the client), replies swallowed.
    pub(super) fn begin_kept_block(&mut self, server: &mut ServerConn) {
        let Some(kept) = self.kept.take() else {
            return;
        };
        let KeptBlock {
            begin,
            answered,
            portal,
            ..
        } = *kept;
        if let Some(cache) = self.cache.as_deref_mut() {
            if !answered && cache.fill.is_none() {
                // Its first statement on the server (not a read the cache fills) may still
                // set the isolation (`SET TRANSACTION`): asked at the next read the cache
                // would answer.
                cache.read_committed = None;
            }
        }
        if portal && !answered && uses_unnamed_portal(&self.client.rbuf) {
            // What takes the server uses the BEGIN's portal, which only an extended-protocol
            // BEGIN leaves on the server, as the client's left it.
            extended_begin(&mut server.wbuf, &mut self.replies, &begin);
            server.status = b'T';
            return;
        }
        if answered {
            fe::query(&mut server.wbuf, &format!("{begin}; SELECT"));
        } else {
            fe::query(&mut server.wbuf, &begin);
        }
        // pgmemo's own query, not the client's work in flight (autoprepare runs the block's
        // statement behind it); an error of it, which PostgreSQL never gives to a BEGIN it
        // can read, would still reach the client.
        self.replies.push_entry(Entry {
            expected: Expected::Internal,
            action: Action::Skip,
            effect: None,
        });
        // What the statement behind it is planned for: a block (its ReadyForQuery says so
        // again).
        server.status = b'T';
    }
}

/// Whether a Query's text may be a transaction control statement: its first letter is one
/// that starts `BEGIN`, `START`, `COMMIT`, `END`, `ROLLBACK` or `ABORT` (and not `SELECT`,
/// `SET` or `SHOW`), read before anything else is.
#[inline]
fn may_be_control(text: &[u8]) -> bool {
    let mut letters = text
        .iter()
        .skip_while(|b| b.is_ascii_whitespace())
        .map(u8::to_ascii_lowercase);
    match letters.next() {
        Some(b'b' | b'c' | b'e' | b'r' | b'a') => true,
        Some(b's') => letters.next() == Some(b't'),
        _ => false,
    }
}

/// Whether a Parse (its body) may be of a transaction-control statement that a unit of
/// [`control_unit`] reads: of the unnamed statement (its text starts after its empty name),
/// its text's first letters those of one.
#[inline]
fn parse_may_be_control(body: &[u8]) -> bool {
    body.first() == Some(&0) && may_be_control(&body[1..])
}

/// What goes to a server later for a `BEGIN`'s text: trimmed, without its final `;`. None
/// for the other statements (a `COMMIT` or `ROLLBACK` needs no copy of its text).
fn begin_text(control: &Control, text: &[u8]) -> Option<Box<str>> {
    if !matches!(control, Control::Begin { .. }) {
        return None;
    }
    let begin = std::str::from_utf8(text).unwrap_or("BEGIN").trim_ascii();
    Some(begin.strip_suffix(';').unwrap_or(begin).into())
}

/// A transaction-control unit of the extended protocol, read by [`control_unit`].
struct ControlUnit<'a> {
    /// The unnamed statement's Parse, when the unit has one.
    parse: Option<fe::Parse<'a>>,
    /// The statement the Bind names (empty after a Parse).
    statement: &'a [u8],
    /// The unit has a Describe of the portal.
    described: bool,
    /// Bytes of the whole unit.
    len: usize,
}

/// Reads `[Parse] Bind [Describe portal] Execute` at the start of `input`, all there: a Parse
/// of the unnamed statement with no parameter types whose text may be a transaction control
/// statement, a Bind of the unnamed portal with no parameters (and at most one result format,
/// 0 or 1), a Describe and an Execute of that portal. None for anything else, which
/// goes its usual way.
fn control_unit(input: &[u8]) -> Option<ControlUnit<'_>> {
    let mut messages = crate::protocol::messages(input);
    let mut next = || messages.next();
    let (mut tag, mut body) = next()?;
    let mut parse = None;
    if tag == fe::PARSE {
        // A look at the text's first letter before anything else (every Parse comes here):
        // the unnamed statement's text starts after its empty name, and the look stops at
        // the text's end, a NUL. Reading the message finds that end first (~150 instructions
        // a Parse of a SELECT).
        if !parse_may_be_control(body) {
            return None;
        }
        let p = fe::Parse::parse(body)?;
        if p.query.len() > MAX_CONTROL_LEN || p.param_types != [0, 0] {
            return None;
        }
        parse = Some(p);
        (tag, body) = next()?;
    }
    if tag != fe::BIND {
        return None;
    }
    let bind = fe::Bind::parse(body)?;
    if !bind.portal.is_empty()
        || (parse.is_some() && !bind.statement.is_empty())
        || !plain_bind(bind.rest)
    {
        return None;
    }
    (tag, body) = next()?;
    let mut described = false;
    if tag == fe::DESCRIBE {
        let d = fe::Target::parse(body)?;
        if d.kind != b'P' || !d.name.is_empty() {
            return None;
        }
        described = true;
        (tag, body) = next()?;
    }
    let e = fe::Execute::parse(body).filter(|_| tag == fe::EXECUTE)?;
    // Any row limit: PostgreSQL runs a transaction statement's portal to its end whatever the
    // limit (pgjdbc sends 1 for COMMIT and ROLLBACK).
    if !e.portal.is_empty() {
        return None;
    }
    Some(ControlUnit {
        parse,
        statement: bind.statement,
        described,
        len: messages.at,
    })
}

/// A Bind's formats and values (after its names) for a statement without parameters or
/// rows, as drivers send it: no parameter formats, no values, no result format or one that is
/// text or binary.
fn plain_bind(rest: &[u8]) -> bool {
    matches!(rest, [0, 0, 0, 0, 0, 0] | [0, 0, 0, 0, 0, 1, 0, 0 | 1])
}

/// What a client's message (`tag`, `body`) does with the client's unnamed portal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum UnnamedPortal {
    /// Uses it: an Execute of it, or a Describe or Close of it.
    Uses,
    /// Replaces it: a Bind of it (or one too malformed to read), or a Query.
    Replaces,
    /// Neither.
    Other,
}

pub(super) fn unnamed_portal(tag: u8, body: &[u8]) -> UnnamedPortal {
    let uses = match tag {
        fe::EXECUTE => fe::Execute::parse(body).is_some_and(|e| e.portal.is_empty()),
        fe::DESCRIBE | fe::CLOSE => {
            fe::Target::parse(body).is_some_and(|t| t.kind == b'P' && t.name.is_empty())
        }
        fe::BIND if fe::Bind::parse(body).is_none_or(|b| b.portal.is_empty()) => {
            return UnnamedPortal::Replaces;
        }
        fe::QUERY => return UnnamedPortal::Replaces,
        _ => false,
    };
    if uses {
        UnnamedPortal::Uses
    } else {
        UnnamedPortal::Other
    }
}

/// Whether the client's messages at the start of `input` (those there, up to a Sync) use the
/// unnamed portal before they bind it: an Execute, or a Describe or Close of the portal, before
/// a Bind of it or a Query (which drops it).
fn uses_unnamed_portal(input: &[u8]) -> bool {
    let mut at = 0;
    while let Ok(Some((tag, len))) = crate::protocol::frame(&input[at..], usize::MAX) {
        let body = &input[at + 5..at + len];
        at += len;
        match unnamed_portal(tag, body) {
            UnnamedPortal::Uses => return true,
            UnnamedPortal::Replaces => return false,
            UnnamedPortal::Other => {}
        }
        if !matches!(
            tag,
            fe::EXECUTE | fe::DESCRIBE | fe::CLOSE | fe::BIND | fe::PARSE | fe::FLUSH
        ) {
            return false;
        }
    }
    false
}

/// A kept block's `BEGIN` in the extended protocol, ahead of the client's message that uses
/// its portal (see [`run_unnamed`]).
fn extended_begin(
    out: &mut bytes::BytesMut,
    replies: &mut crate::replies::ReplyQueue,
    begin: &str,
) {
    run_unnamed(out, replies, begin.as_bytes(), &[0, 0], &[0, 0, 0, 0, 0, 0]);
}

/// Leaves the client's unnamed portal on a server as a batch of its would have: Parse of
/// `query` (with `param_types`, as a Parse carries them) as the unnamed statement, Bind of the
/// unnamed portal (`bind`: the Bind after its two names, values and formats), Execute of every
/// row, then a Close of the statement (pgmemo leaves no unnamed statement on a server; the
/// client's is tracked), every reply swallowed but an error.
pub(super) fn run_unnamed(
    out: &mut bytes::BytesMut,
    replies: &mut crate::replies::ReplyQueue,
    query: &[u8],
    param_types: &[u8],
    bind: &[u8],
) {
    use crate::protocol::{put_cstr, write_message};
    fe::Parse {
        name: b"",
        query,
        param_types,
    }
    .encode(b"", out);
    write_message(out, fe::BIND, |m| {
        put_cstr(m, b"");
        put_cstr(m, b"");
        m.extend_from_slice(bind);
    });
    write_message(out, fe::EXECUTE, |m| {
        put_cstr(m, b"");
        m.extend_from_slice(&0i32.to_be_bytes());
    });
    write_message(out, fe::CLOSE, |m| {
        m.extend_from_slice(b"S");
        put_cstr(m, b"");
    });
    for expected in [
        Expected::Parse,
        Expected::Bind,
        Expected::Execute,
        Expected::Close,
    ] {
        replies.push_entry(Entry {
            expected,
            action: Action::Skip,
            effect: None,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;

    fn parse(out: &mut BytesMut, name: &str, sql: &str) {
        fe::Parse {
            name: name.as_bytes(),
            query: sql.as_bytes(),
            param_types: &[0, 0],
        }
        .encode(name.as_bytes(), out);
    }

    fn bind(out: &mut BytesMut, portal: &str, statement: &str, rest: &[u8]) {
        crate::protocol::write_message(out, fe::BIND, |m| {
            crate::protocol::put_cstr(m, portal.as_bytes());
            crate::protocol::put_cstr(m, statement.as_bytes());
            m.extend_from_slice(rest);
        });
    }

    fn execute(out: &mut BytesMut, portal: &str, max_rows: i32) {
        crate::protocol::write_message(out, fe::EXECUTE, |m| {
            crate::protocol::put_cstr(m, portal.as_bytes());
            m.extend_from_slice(&max_rows.to_be_bytes());
        });
    }

    fn target(out: &mut BytesMut, tag: u8, kind: u8, name: &str) {
        crate::protocol::write_message(out, tag, |m| {
            m.extend_from_slice(&[kind]);
            crate::protocol::put_cstr(m, name.as_bytes());
        });
    }

    const PLAIN: &[u8] = &[0, 0, 0, 0, 0, 0];

    #[test]
    fn reads_a_control_unit() {
        let mut b = BytesMut::new();
        parse(&mut b, "", "BEGIN");
        bind(&mut b, "", "", PLAIN);
        execute(&mut b, "", 1);
        let len = b.len();
        fe::sync(&mut b);
        let unit = control_unit(&b).expect("a unit");
        assert!(unit.parse.is_some() && !unit.described && unit.len == len);
        let mut b = BytesMut::new();
        parse(&mut b, "", "\n  Start Transaction");
        bind(&mut b, "", "", PLAIN);
        execute(&mut b, "", 0);
        let unit = control_unit(&b).expect("a unit");
        assert_eq!(
            unit.parse.expect("its Parse").query,
            b"\n  Start Transaction"
        );
        // Bind and Describe of a named statement, no Parse.
        let mut b = BytesMut::new();
        bind(&mut b, "", "S_1", &[0, 0, 0, 0, 0, 1, 0, 0]);
        target(&mut b, fe::DESCRIBE, b'P', "");
        execute(&mut b, "", 0);
        let unit = control_unit(&b).expect("a unit");
        assert!(unit.parse.is_none() && unit.described && unit.statement == b"S_1");
    }

    /// Writes a message.
    type Write = dyn Fn(&mut BytesMut);

    /// Parse, Bind and Execute of the unnamed BEGIN, one of them (`at`) replaced by `other`.
    fn with(at: usize, other: &Write) -> BytesMut {
        let mut b = BytesMut::new();
        for i in 0..3 {
            match i {
                _ if i == at => other(&mut b),
                0 => parse(&mut b, "", "BEGIN"),
                1 => bind(&mut b, "", "", PLAIN),
                _ => execute(&mut b, "", 0),
            }
        }
        fe::sync(&mut b);
        b
    }

    #[test]
    fn leaves_other_units_alone() {
        let cases: [(usize, &Write, &str); 10] = [
            (0, &|b| parse(b, "s", "BEGIN"), "a named statement's Parse"),
            (0, &|b| parse(b, "", ""), "an empty text"),
            (
                0,
                &|b| parse(b, "", " s"),
                "a text that ends at its first letter",
            ),
            (0, &|b| parse(b, "", "SELECT 1"), "no transaction control"),
            (1, &|b| bind(b, "p", "", PLAIN), "a named portal"),
            (
                1,
                &|b| bind(b, "", "", &[0, 0, 0, 1, 0, 0, 0, 1, b'x', 0, 0]),
                "a parameter",
            ),
            (
                1,
                &|b| bind(b, "", "", &[0, 0, 0, 0, 0, 2, 0, 0, 0, 0]),
                "two result formats",
            ),
            (
                1,
                &|b| bind(b, "", "x", PLAIN),
                "another statement than the Parse's",
            ),
            (
                2,
                &|b| target(b, fe::DESCRIBE, b'S', ""),
                "a Describe of the statement",
            ),
            (2, &|b| execute(b, "p", 0), "another portal"),
        ];
        for (at, other, what) in cases {
            assert!(control_unit(&with(at, other)).is_none(), "{what}");
        }
        assert!(control_unit(&with(3, &|_| {})).is_some());
        // Not all there.
        let mut b = BytesMut::new();
        parse(&mut b, "", "BEGIN");
        bind(&mut b, "", "", PLAIN);
        assert!(control_unit(&b).is_none());
    }

    #[test]
    fn finds_the_unnamed_portal_used_before_it_is_bound() {
        let mut b = BytesMut::new();
        parse(&mut b, "", "SELECT 1");
        execute(&mut b, "", 0);
        assert!(uses_unnamed_portal(&b));
        let mut b = BytesMut::new();
        target(&mut b, fe::CLOSE, b'P', "");
        assert!(uses_unnamed_portal(&b));
        let mut b = BytesMut::new();
        target(&mut b, fe::CLOSE, b'S', "");
        target(&mut b, fe::DESCRIBE, b'P', "");
        assert!(uses_unnamed_portal(&b));
        let mut b = BytesMut::new();
        parse(&mut b, "", "SELECT 1");
        bind(&mut b, "", "", PLAIN);
        execute(&mut b, "", 0);
        assert!(!uses_unnamed_portal(&b));
        let mut b = BytesMut::new();
        fe::query(&mut b, "SELECT 1");
        execute(&mut b, "", 0);
        assert!(!uses_unnamed_portal(&b));
        let mut b = BytesMut::new();
        fe::sync(&mut b);
        execute(&mut b, "", 0);
        assert!(!uses_unnamed_portal(&b));
    }
}
