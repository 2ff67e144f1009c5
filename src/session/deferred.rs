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

use super::Session;
use crate::protocol::backend as be;
use crate::protocol::frontend as fe;
use crate::query::block::{self, Control, Isolation};
use crate::replies::{Action, Entry, Expected};
use crate::server::ServerConn;
use bytes::Buf;

/// Longer texts are no transaction control the session reads.
const MAX_CONTROL_LEN: usize = 128;

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
        if tag != fe::QUERY || self.server.is_some() || !self.state.enabled || !self.caching() {
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
        let deferred = self.keeps_block();
        let status = match control {
            Control::Begin {
                isolation,
                read_write,
                ..
            } if !deferred => {
                if read_write || !self.replies.is_empty() || !self.begins_read_committed(isolation)
                {
                    return false;
                }
                let begin = std::str::from_utf8(text).unwrap_or("BEGIN").trim_ascii();
                let begin = begin.strip_suffix(';').unwrap_or(begin).into();
                let Some(cache) = self.cache.as_deref_mut() else {
                    return false;
                };
                cache.deferred_begin = Some(begin);
                cache.deferred_answered = false;
                cache.read_committed = Some(true);
                b'T'
            }
            Control::Commit | Control::Rollback if deferred => {
                if let Some(cache) = self.cache.as_deref_mut() {
                    cache.deferred_begin = None;
                    cache.deferred_answered = false;
                    cache.read_committed = None;
                }
                self.stats.xact_count += 1;
                b'I'
            }
            _ => return false,
        };
        be::command_complete(&mut self.client.wbuf, control.tag());
        be::ready_for_query(&mut self.client.wbuf, status);
        self.client.rbuf.advance(len);
        self.stats.query_count += 1;
        self.stats.bytes_received += len as u64;
        true
    }

    /// Whether the client is in a block the session keeps without a server.
    #[inline]
    pub(super) fn keeps_block(&self) -> bool {
        self.cache
            .as_ref()
            .is_some_and(|c| c.deferred_begin.is_some())
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
        let Some(cache) = self.cache.as_deref_mut() else {
            return;
        };
        let Some(begin) = cache.deferred_begin.take() else {
            return;
        };
        if std::mem::take(&mut cache.deferred_answered) {
            fe::query(&mut server.wbuf, &format!("{begin}; SELECT"));
        } else {
            fe::query(&mut server.wbuf, &begin);
            if cache.fill.is_none() {
                // Its first statement on the server (not a read the cache fills) may still
                // set the isolation (`SET TRANSACTION`): asked at the next read the cache
                // would answer.
                cache.read_committed = None;
            }
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
