//! What the session does with the client's messages: each is framed, shown to the result cache
//! (which may answer it), given a server when it needs one, noted for the session-state and
//! schema watches, planned (statements renamed, injected, autoprepared or answered locally) and
//! forwarded; malformed input ends the session as PostgreSQL ends it.

use super::{planner, End, Readable, ReadableAt, Session, HIGH_WATER};
use crate::app::ClientState;
use crate::buffers;
use crate::pool::CheckoutError;
use crate::protocol::backend::{self as be, sqlstate, Severity};
use crate::protocol::{frame, frontend as fe};
use crate::query::facts;
use crate::replies::{Expected, Synth};
use crate::server::ServerConn;
use bytes::Buf;
use std::pin::Pin;
use std::time::Instant;

impl Session {
    /// Answers a batch of Parse / Describe / Close, ended by a Sync or Flush, that needs no
    /// server, if the client's input starts with one (see [`crate::statements::idle_batch`]).
    pub(super) fn answer_idle_batch(&mut self) -> bool {
        let Some(stmts) = self.stmts.as_mut() else {
            return false;
        };
        buffers::lend(&mut self.client.wbuf);
        let limits = (
            self.statement_limits.max_count,
            self.statement_limits.max_bytes,
            self.max_message,
        );
        let Some(taken) = crate::statements::idle_batch::answer(
            &self.client.rbuf,
            stmts,
            &self.app.registry,
            limits,
            &mut self.client.wbuf,
        ) else {
            return false;
        };
        self.client.rbuf.advance(taken);
        self.stats.bytes_received += taken as u64;
        self.pool
            .stats
            .here()
            .serverless_batches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        true
    }

    /// Plans every complete client message in the read buffer: answered locally, or queued
    /// for the server (taking one first when the session holds none).
    pub(super) async fn handle_client_messages(&mut self) -> Result<(), End> {
        loop {
            if self.violation.is_some() {
                return Ok(()); // nothing after a violation is read
            }
            if self
                .server
                .as_ref()
                .is_some_and(|s| s.wbuf.len() >= HIGH_WATER)
            {
                return Ok(()); // backpressure: let the server drain first
            }
            if self.info.cancels.pending() {
                // A cancel request aimed at the client's work is being passed on: nothing new
                // goes to its server (it could cancel that instead), pgmemo's own queries
                // neither, until it is delivered.
                return Ok(());
            }
            // Like PostgreSQL, judge the type byte first (as soon as it is there), then the
            // length against the limit for that type.
            let Some(&tag) = self.client.rbuf.first() else {
                return Ok(());
            };
            if (self.copy_garbage || (!fe::is_known(tag) && self.replies.in_copy_in()))
                && self.hand_copy_garbage_over()
            {
                return Ok(());
            }
            if !fe::is_known(tag) {
                return self
                    .violated(format!("invalid frontend message type {tag}"))
                    .await;
            }
            let max = fe::max_message_len(tag, self.max_message);
            let (tag, len) = match frame(&self.client.rbuf, max) {
                Ok(Some(f)) => f,
                Ok(None) => return Ok(()),
                Err(e) => return self.violated(e.to_string()).await,
            };
            // A simple query's text, found once (its end is a search for the terminator) for
            // the result cache, the word scan, the session-state watch and the planner.
            let query_text_len = if tag == fe::QUERY {
                fe::query_text(&self.client.rbuf[5..len]).map(<[u8]>::len)
            } else {
                None
            };
            fn text_of(rbuf: &[u8], len: Option<usize>) -> Option<&[u8]> {
                len.map(|n| &rbuf[5..5 + n])
            }
            if let Some(reader) = self.reader.as_deref_mut() {
                reader.forget(); // a reading is of one message only
            }
            if matches!(tag, fe::QUERY | fe::PARSE | fe::BIND) && self.caching() {
                if let Some(c) = self.cache.as_deref_mut() {
                    c.forget_message();
                }
                let answered = match self.cache_client_message(tag, len, query_text_len) {
                    Ok(answered) => answered,
                    Err(slow) => slow.await?,
                };
                if answered {
                    continue; // answered from the result cache
                }
            }
            if self.server.is_none() {
                match tag {
                    fe::TERMINATE => return Err(End::Terminate),
                    // With no server held the session is idle: a lone Sync is answered as
                    // PostgreSQL would, a Flush has nothing to flush, and stray COPY messages
                    // are ignored as PostgreSQL ignores them outside COPY.
                    // A Sync or Flush with a body is malformed: PostgreSQL has to say so.
                    fe::SYNC if len == 5 => {
                        be::ready_for_query(&mut self.client.wbuf, b'I');
                        self.client.rbuf.advance(len);
                        continue;
                    }
                    fe::FLUSH if len == 5 => {
                        self.client.rbuf.advance(len);
                        continue;
                    }
                    fe::COPY_DATA | fe::COPY_DONE | fe::COPY_FAIL => {
                        self.client.rbuf.advance(len);
                        continue;
                    }
                    // Preparing, describing or closing known statements needs no server.
                    fe::PARSE | fe::CLOSE | fe::DESCRIBE if self.answer_idle_batch() => continue,
                    _ => self.acquire_server().await?,
                }
            } else if tag == fe::TERMINATE {
                if self.terminate_waits() {
                    // PostgreSQL answers what came before a Terminate before it reads it: the
                    // Terminate waits (unread: see `may_read_client`) until that is relayed.
                    return Ok(());
                }
                return Err(End::Terminate);
            } else if is_copy_message(tag) && !self.replies.takes_copy_message(tag) {
                // Ignored by PostgreSQL (no COPY IN, or one an error ended while the client was
                // still sending it): not sent, so the error's ReadyForQuery is the end of it.
                self.client.rbuf.advance(len);
                continue;
            } else if self.state.pins != 0 && self.work_done() {
                // A pinned client's next transaction starts on the server it kept: its time
                // counts from here (see `pinned_transaction_done`).
                if let Some(server) = self.server.as_mut() {
                    server.checked_out = Instant::now();
                }
            }
            let autoprepare = if tag == fe::QUERY {
                self.autoprepare_threshold()
            } else {
                None
            };
            if let Some(ap) = self.autoprepare.as_deref_mut() {
                ap.forget_reading(); // a reading is of one message only
            }
            // The words of a simple query that the planner and the session-state watch look
            // for: those of its autoprepare shape (found once per shape) and its string
            // literals, or else those of one pass over its text.
            let query_words = if self.state.enabled || self.stmts.is_some() {
                let text = text_of(&self.client.rbuf, query_text_len);
                let read = match (autoprepare, text) {
                    (Some(_), Some(text)) => self
                        .autoprepare
                        .get_or_insert_with(Default::default)
                        .read_ahead(
                            &self.app.autoprepare,
                            text,
                            self.reader.get_or_insert_with(Default::default),
                        ),
                    _ => None,
                };
                read.or_else(|| text.map(crate::query::words::in_query))
                    .unwrap_or(0)
            } else {
                0
            };
            if self.state.enabled {
                self.note_state(tag, len, query_text_len, query_words);
            }
            if let Some(stmts) = self.stmts.as_mut().filter(|_| query_words != 0) {
                if let Some(text) = text_of(&self.client.rbuf, query_text_len) {
                    stmts
                        .schema
                        .note(crate::query::facts::ddl_found(query_words, text));
                }
            }
            let server = self.server.as_mut().expect("server acquired above");
            self.stats.bytes_received += len as u64;
            // Statement messages are planned (renamed, injected, answered locally), unless
            // PostgreSQL is discarding everything until the next Sync anyway. The Sync itself
            // always is: the planner may have cleanup to send after it. COPY data is no
            // statement (and nothing may be injected into it: see `Planner::prepare_guard`).
            let skipping = (self.replies.is_skipping() && tag != fe::SYNC) || is_copy_message(tag);
            if let Some(stmts) = self.stmts.as_mut().filter(|_| !skipping) {
                let planned = planner::Planner {
                    msg: &self.client.rbuf[..len],
                    query_text: text_of(&self.client.rbuf, query_text_len),
                    server,
                    stmts,
                    replies: &mut self.replies,
                    registry: &self.app.registry,
                    stats: &mut self.stats,
                    limits: self.statement_limits,
                    cleanup: &mut self.cleanup,
                    retry: &mut self.retry,
                    query_words,
                    state: &mut self.state,
                    autoprepare: autoprepare.map(|threshold| crate::autoprepare::Use {
                        global: &self.app.autoprepare,
                        client: self.autoprepare.get_or_insert_with(Default::default),
                        reader: self.reader.get_or_insert_with(Default::default),
                        threshold,
                    }),
                    reported: &self.reported,
                }
                .plan(tag);
                if planned != planner::Plan::Wait {
                    self.wait_flushed = false;
                    self.replanned |= std::mem::take(&mut self.replan);
                }
                match planned {
                    planner::Plan::Done => {
                        self.retry.consumed(&self.client.rbuf[..len]);
                        self.client.rbuf.advance(len);
                        let pending_output = self.client.wbuf.len();
                        self.answer_locally();
                        if pending_output == 0 && !self.client.wbuf.is_empty() {
                            self.local_replies_only = true;
                        }
                        continue;
                    }
                    planner::Plan::Wait => {
                        // Planned again when the server has answered what is in flight,
                        // which a Flush makes it send.
                        self.stats.bytes_received -= len as u64;
                        if !self.wait_flushed {
                            crate::protocol::write_message(&mut server.wbuf, fe::FLUSH, |_| {});
                            self.wait_flushed = true;
                        }
                        self.waiting = true;
                        self.replan = true;
                        return Ok(());
                    }
                    planner::Plan::Forward => {}
                }
            }
            if let Some(expected) = Expected::for_client_message(tag) {
                self.replies.push(expected);
            }
            server.wbuf.extend_from_slice(&self.client.rbuf[..len]);
            self.retry.consumed(&self.client.rbuf[..len]);
            self.client.rbuf.advance(len);
        }
    }

    /// A message of an unknown type while the server waits for COPY data: PostgreSQL reads
    /// it itself, fails the COPY ("unexpected message type during COPY from stdin") and then,
    /// out of step with the client, ends the connection (FATAL 08P01); its replies reach the
    /// client as they are. Everything the client sent from there on goes to the server as it
    /// is. False when no server is held.
    pub(super) fn hand_copy_garbage_over(&mut self) -> bool {
        let Some(server) = self.server.as_mut() else {
            return false;
        };
        self.copy_garbage = true;
        server.wbuf.extend_from_slice(&self.client.rbuf);
        self.client.rbuf.clear();
        true
    }

    /// The client broke the protocol: it is told so and disconnected at once, or, when
    /// messages before the bad one still await replies, once those replies are out.
    /// Boxed: rare, and the session's task need not keep room for the message.
    pub(super) fn violated(
        &mut self,
        message: String,
    ) -> Pin<Box<dyn std::future::Future<Output = Result<(), End>> + Send + '_>> {
        Box::pin(async move {
            if self.replies.is_empty() {
                return Err(self.protocol_violation(message).await);
            }
            self.violation = Some(message.into_boxed_str());
            Ok(())
        })
    }

    /// Boxed: rare, and the session's task need not keep room for the message and its
    /// sending.
    pub(super) fn protocol_violation(
        &mut self,
        message: String,
    ) -> Pin<Box<dyn std::future::Future<Output = End> + Send + '_>> {
        Box::pin(async move {
            tracing::warn!(client = %self.info.addr, "protocol violation: {message}");
            self.client
                .send_error(Severity::Fatal, sqlstate::PROTOCOL_VIOLATION, &message)
                .await;
            End::Protocol(message)
        })
    }

    /// `autoprepare_threshold` if this client's simple queries may be autoprepared: its pool
    /// has autoprepare on and its settings let autoprepare read its text as the server does.
    pub(super) fn autoprepare_threshold(&mut self) -> Option<u64> {
        let threshold = self.pool.autoprepare_threshold()?;
        self.stmts.as_ref()?; // autoprepare runs through the statement planner
        if !self.readable().autoprepare {
            self.stats.autoprepare_passed += 1;
            self.app
                .autoprepare
                .count_pass(crate::autoprepare::Pass::Settings);
            return None;
        }
        Some(threshold)
    }

    /// Takes a server from the pool and makes its session parameters match this client's.
    pub(super) async fn acquire_server(&mut self) -> Result<(), End> {
        self.info.set_state(ClientState::Waiting);
        // Boxed (the session's task keeps no room for a write): replies pgmemo gave itself
        // before the client needed a server are rarely still unsent here.
        if !self.client.wbuf.is_empty() && Box::pin(self.client.flush()).await.is_err() {
            return Err(End::ClientGone);
        }
        // The error's future is made inside the match and awaited after it: awaited inside,
        // the match's checkout result would take room in the session's task. The wait is
        // boxed (the task keeps no room for it either), and a kill ends it.
        let failed = match self.pool.checkout_at_once() {
            Some(server) => self.use_server(server),
            None => match Box::pin(self.pool.checkout_waiting(Some(self.info.killed_flag()))).await
            {
                Ok(server) => self.use_server(server),
                Err(e) => Some(self.checkout_failed(e)),
            },
        };
        match failed {
            None => Ok(()),
            Some(failed) => Err(failed.await),
        }
    }

    /// Holds the server the pool gave, unless the client was killed meanwhile: then it goes
    /// back, and nothing of what the client asked for runs.
    pub(super) fn use_server(
        &mut self,
        server: Box<ServerConn>,
    ) -> Option<Pin<Box<dyn std::future::Future<Output = End> + Send + '_>>> {
        if self.info.is_killed() {
            self.pool.checkin(server);
            return Some(self.shutdown_client());
        }
        self.hold(server);
        None
    }

    /// Tells the client why it got no server. Boxed: rare, and the session's task need not
    /// keep room for the error and its reporting.
    pub(super) fn checkout_failed(
        &mut self,
        e: CheckoutError,
    ) -> Pin<Box<dyn std::future::Future<Output = End> + Send + '_>> {
        Box::pin(async move {
            let msg = e.to_string();
            tracing::warn!(client = %self.info.addr, pool = ?self.pool.key, "{msg}");
            self.report_checkout_error(e).await;
            End::NoServer(msg)
        })
    }

    /// Reads what a simple query (its text `query_text_len` bytes long, its words
    /// `query_words`) or, without the statement planner, a Parse may do to the session's
    /// state (see [`state`]).
    pub(super) fn note_state(
        &mut self,
        tag: u8,
        len: usize,
        query_text_len: Option<usize>,
        query_words: u32,
    ) {
        let standard = self.standard_strings();
        let body = &self.client.rbuf[5..len];
        let text = match tag {
            fe::QUERY => query_text_len.map(|n| &body[..n]),
            fe::PARSE if self.stmts.is_none() => fe::Parse::parse(body).map(|p| p.query),
            // Its statement was read with standard strings: probed after, whatever it does.
            fe::BIND if !standard => {
                self.state.touched = true;
                None
            }
            _ => None,
        };
        if let Some(text) = text {
            let mut touch = if tag == fe::QUERY {
                facts::touch_found(query_words, text)
            } else {
                facts::touch(text)
            };
            if !standard {
                // Backslashes in plain strings: where a statement starts is read by PostgreSQL's
                // parser alone, so every text is probed after and read for settings.
                touch.probe = true;
                touch.custom = true;
            }
            self.state.note(touch);
            self.state.note_calls(text);
            if touch.custom {
                self.state
                    .note_custom(&facts::custom_settings(text, standard));
            }
        }
    }

    /// Whether the client's standard_conforming_strings is on (see [`Readable`]).
    pub(super) fn standard_strings(&mut self) -> bool {
        self.readable().standard_strings
    }

    /// How pgmemo may read the client's text, worked out once per `params_version`.
    pub(super) fn readable(&mut self) -> Readable {
        if let Some(readable) = self.readable.at(self.params_version) {
            return readable;
        }
        let readable = Readable {
            standard_strings: self.reported.is("standard_conforming_strings", "on"),
            autoprepare: crate::autoprepare::settings_allow(&self.reported),
        };
        self.readable = ReadableAt::new(self.params_version, readable);
        readable
    }

    /// Writes the replies pgmemo gives itself (ParseComplete, CloseComplete, ...) that have
    /// reached the head of the queue, i.e. whose turn it is in PostgreSQL's order.
    pub(super) fn answer_locally(&mut self) {
        while let Some(synth) = self.replies.pop_synthesized() {
            match synth {
                Synth::ParseComplete => crate::protocol::write_message(
                    &mut self.client.wbuf,
                    be::PARSE_COMPLETE,
                    |_| {},
                ),
                Synth::CloseComplete => crate::protocol::write_message(
                    &mut self.client.wbuf,
                    be::CLOSE_COMPLETE,
                    |_| {},
                ),
                Synth::Replies(replies) => self.client.wbuf.extend_from_slice(&replies),
                Synth::Deallocate => {
                    let status = self.server.as_ref().map_or(b'I', |s| s.status);
                    be::command_complete(&mut self.client.wbuf, "DEALLOCATE");
                    be::ready_for_query(&mut self.client.wbuf, status);
                    self.stats.query_count += 1;
                }
            }
        }
        self.settle(None, None, false);
    }
}

/// CopyData, CopyDone and CopyFail: the client's side of a COPY FROM STDIN, never planned.
#[inline]
pub(super) fn is_copy_message(tag: u8) -> bool {
    matches!(tag, fe::COPY_DATA | fe::COPY_DONE | fe::COPY_FAIL)
}
