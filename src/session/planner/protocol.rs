//! The planner's protocol-level statements: Parse (answered locally when the name or the
//! registry already has it), Bind and Describe (renamed, the statement prepared first when the
//! server lacks it), Close (answered locally), Sync (cleanup after it), and the guard that keeps
//! an aborted block's answers PostgreSQL's.

use super::{Plan, Planner};
use crate::protocol::backend::{self as be, sqlstate};
use crate::protocol::frontend::{self as fe, Bind, Parse, Target};
use crate::protocol::{body, pg_name, put_cstr, write_message};
use crate::query::command::Command;
use crate::replies::{Action, Entry, ErrorRewrite, Expected, Synth};
use crate::statements::{DroppedSql, Effect, NameBound, Statement, GUARD_NAME, GUARD_QUERY};
use bytes::{Bytes, BytesMut};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

impl Planner<'_> {
    pub(super) fn parse(&mut self) -> bool {
        let msg = self.message.whole;
        // The client's last Parse of the unnamed statement again: the statement it meant.
        let (name, statement) = match self.stmts.unnamed_parse_again(body(msg), self.registry) {
            Some(statement) => (&b""[..], statement),
            None => match self.parse_anew(msg) {
                Ok(read) => read,
                Err(planned) => return planned,
            },
        };
        // Send the Parse only when PostgreSQL has never accepted this statement: an invalid
        // one must fail here, as it would without pgmemo. Otherwise the server gets it when it
        // is first used.
        let must_parse = !statement.is_validated() && !self.server.prepared.has_current(&statement);
        if !must_parse && self.may_be_aborted() {
            return self.probe_parse(name, statement);
        }
        // The name bound to this very statement again (a driver's unnamed statement, parsed
        // before every execution): whether this Parse runs, fails or is discarded, the
        // client's statements stay as they are, so it carries nothing to keep or undo, and
        // later batches need not wait for its outcome.
        let effect = (must_parse || !self.stmts.is_bound_to(name, &statement)).then(|| {
            let previous = self.stmts.set(name, Some(statement.clone()));
            Effect::Bound(Box::new(NameBound {
                name: name.into(),
                previous,
                statement: statement.clone(),
                prepared_here: must_parse,
            }))
        });
        if must_parse {
            self.stats.prepare_cache_miss += 1;
            self.write_parse(&statement);
            self.replies.push_entry(Entry {
                expected: Expected::Parse,
                action: renaming_errors(&statement, Bytes::copy_from_slice(name)),
                effect,
            });
        } else {
            statement
                .parse_hits
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.replies.push_entry(Entry {
                expected: Expected::Parse,
                action: Action::Synthesize(Synth::ParseComplete),
                effect,
            });
        }
        true
    }

    /// A Parse read from its message: its name and the statement it means, or what became
    /// of it when it is planned already (answered, failed here) or goes as it is (Err).
    fn parse_anew<'m>(&mut self, msg: &'m [u8]) -> Result<(&'m [u8], Arc<Statement>), bool> {
        // A malformed Parse goes to the server as is, for PostgreSQL's own error.
        let Some(p) = Parse::parse(body(msg)) else {
            return Err(false);
        };
        if std::str::from_utf8(p.name).is_err()
            && self.client.reported.is("client_encoding", "UTF8")
        {
            // PostgreSQL refuses the name before it reads the rest (22021, quoting the bad
            // bytes) and creates nothing: the Parse goes as it is, for that error.
            return Err(false);
        }
        if self.stmts.is_sql(p.name) {
            // The name of one of the client's SQL-level statements, which the server has
            // under that name: PostgreSQL's own 42P05 (after its checks of the query). Unless
            // its PREPARE failed here: then as for a duplicate protocol-level name.
            let pending = std::str::from_utf8(pg_name(p.name)).is_ok_and(|n| self.sql_pending(n));
            return Err(pending && self.duplicate_parse(p.name));
        }
        if !p.name.is_empty() && self.stmts.get(p.name).is_some() {
            return Err(self.duplicate_parse(p.name));
        }
        if !p.name.is_empty()
            && (self.stmts.len() >= self.client.limits.max_count
                || self.stmts.bytes() + p.query.len() > self.client.limits.max_bytes)
        {
            let message = format!(
                "pgmemo: too many prepared statements for this client (limits: {} statements, {} bytes of query text)",
                self.client.limits.max_count, self.client.limits.max_bytes
            );
            self.fail_here(Expected::Parse, sqlstate::PROGRAM_LIMIT_EXCEEDED, &message);
            return Err(true);
        }
        let statement = self.stmts.statement_for_parse(self.registry, &p);
        if p.name.is_empty() {
            self.stmts.remember_unnamed_parse(body(msg), &statement);
        }
        Ok((p.name, statement))
    }

    /// A Parse pgmemo would answer itself, but the session may be in an aborted transaction
    /// block, where PostgreSQL refuses every Parse (25P02) except of COMMIT, ROLLBACK and the
    /// like. The server decides: it gets the client's Parse under the unnamed name (pgmemo
    /// never keeps an unnamed statement on a server, so nothing is lost), followed by a Close
    /// of it; the client's name is bound only if the Parse succeeds.
    pub(super) fn probe_parse(&mut self, name: &[u8], statement: Arc<Statement>) -> bool {
        let p = Parse::parse(body(self.message.whole)).expect("parsed by the caller");
        p.encode(b"", &mut self.server.wbuf);
        let previous = self.stmts.set(name, Some(statement.clone()));
        self.replies.push_entry(Entry {
            expected: Expected::Parse,
            action: Action::Forward,
            effect: Some(Effect::Bound(Box::new(NameBound {
                name: name.into(),
                previous,
                statement,
                prepared_here: false,
            }))),
        });
        write_message(&mut self.server.wbuf, fe::CLOSE, |m| {
            m.extend_from_slice(b"S");
            put_cstr(m, b"");
        });
        self.replies.push_entry(Entry {
            expected: Expected::Close,
            action: Action::Skip,
            effect: None,
        });
        true
    }

    /// A Parse of a name the client already has. PostgreSQL answers 42P05 — after checking
    /// the query, so a bad query gets its syntax error instead. The server is made to give that
    /// exact answer: the client's Parse is sent twice under the client's name (the first
    /// swallowed), and the name is closed again after the client's next Sync.
    pub(super) fn duplicate_parse(&mut self, name: &[u8]) -> bool {
        if self.server.prepared.has_server_name(name) {
            // The name is one of pgmemo's own on this server: PostgreSQL already answers 42P05.
            return false;
        }
        self.server.wbuf.extend_from_slice(self.message.whole);
        self.replies.push_entry(Entry {
            expected: Expected::Parse,
            action: Action::Skip,
            effect: None,
        });
        self.server.wbuf.extend_from_slice(self.message.whole);
        self.replies.push(Expected::Parse);
        self.client.cleanup.push(name.into());
        true
    }

    pub(super) fn bind(&mut self) -> Plan {
        let msg = self.message.whole;
        let Some(b) = Bind::parse(body(msg)) else {
            return Plan::Forward;
        };
        if self.stmts.has_tracked_portals() {
            self.stmts.forget_portal(b.portal);
        }
        let Some((client_name, statement, stale)) = self
            .stmts
            .get_named(b.statement)
            .map(|(n, s, stale)| (n.clone(), s.clone(), stale))
        else {
            if self.stmts.is_sql(b.statement) {
                return self.use_sql_statement(b.statement, |out| {
                    // PostgreSQL's 25P02 from Bind, bound from the guard (see `refuse_bind`).
                    write_message(out, fe::BIND, |m| {
                        put_cstr(m, b.portal);
                        put_cstr(m, GUARD_NAME);
                        m.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
                    });
                    Expected::Bind
                });
            }
            return self.unknown_statement(b.statement, Expected::Bind, |out, name| {
                write_message(out, fe::BIND, |m| {
                    put_cstr(m, b.portal);
                    put_cstr(m, name);
                    m.extend_from_slice(b.rest);
                })
            });
        };
        match self.in_aborted_block(&statement) {
            None => return Plan::Wait,
            Some(true) => {
                self.refuse_bind(&b, &statement);
                return Plan::Done;
            }
            Some(false) => {}
        }
        if let (Some(Command::Execute { name }), None) = (&statement.tracked, &statement.hidden) {
            if !self.bind_execute(name) {
                return Plan::Wait;
            }
        }
        self.client.state.note(statement.session_touch);
        self.client.state.note_calls(&statement.key.query);
        if statement.session_touch.custom {
            self.client.state.note_custom(&statement.custom_settings);
        }
        self.stmts.schema.note(statement.ddl);
        if stale {
            // The client prepared this before a DDL change of its result type and may decode
            // rows by the description it got then: PostgreSQL keeps refusing such a statement
            // until the client prepares it again, and so does pgmemo (even on a server that
            // would happily prepare the new shape).
            match statement.stale_error() {
                Some(genuine) => self.fail_here_with(Expected::Bind, genuine),
                None => self.fail_here(
                    Expected::Bind,
                    "0A000",
                    "cached plan must not change result type",
                ),
            }
            return Plan::Done;
        }
        if statement.starts_transaction {
            if !self.server.prepared.has_guard() {
                self.prepare_guard();
            }
            self.replies.note_block_opener();
        }
        if statement.tracked.is_some() {
            self.stmts.bind_tracked_portal(b.portal, statement.clone());
        }
        self.count_call(&statement);
        let retry = self.retry_point();
        self.forward_renamed(statement, client_name, Expected::Bind, retry, |m, name| {
            put_cstr(m, b.portal);
            put_cstr(m, name);
            m.extend_from_slice(b.rest);
        })
    }

    /// SHOW QUERIES: a client's Bind of `statement` is a call of its shape (one relaxed add).
    /// About one in `TIMED_EVERY` is timed on the server, as simple queries are: from here to
    /// the next ReadyForQuery the client is sent (`Reader::timed`), when nothing of the
    /// client's runs before it; a second Bind in its batch (before its Sync) ends the timing,
    /// which would measure both.
    #[inline]
    fn count_call(&mut self, statement: &Statement) {
        let Some(shape) = statement.shape(self.client.shapes) else {
            return;
        };
        let calls = shape.stats.calls.fetch_add(1, Relaxed) + 1;
        let Some(reading) = self.client.timing.as_deref_mut() else {
            return;
        };
        if let Some(timed) = reading.as_deref_mut().map(|r| &mut r.timed) {
            if timed.is_some() {
                if !self.replies.syncs_queued() {
                    *timed = None;
                }
                return;
            }
        }
        if self.replies.has_pending_work() || !shape.stats.time_call(calls) {
            return;
        }
        let reader = reading.get_or_insert_with(Default::default);
        reader.timed = Some(crate::query::Timed::new(shape.clone()));
    }

    /// Sends a Bind or Describe under the statement's server name, preparing it there first
    /// if needed; errors that name it are shown with the client's name.
    pub(super) fn forward_renamed(
        &mut self,
        statement: Arc<Statement>,
        client_name: crate::statements::ClientName,
        expected: Expected,
        retry: bool,
        body: impl FnOnce(&mut BytesMut, &[u8]),
    ) -> Plan {
        self.ensure_prepared(&statement);
        let generation = statement.generation();
        let tag = if expected == Expected::Bind {
            fe::BIND
        } else {
            fe::DESCRIBE
        };
        write_message(&mut self.server.wbuf, tag, |m| {
            body(m, statement.server_name.as_bytes())
        });
        self.replies.push_entry(Entry {
            expected,
            action: Action::Rename,
            effect: Some(Effect::Uses {
                statement,
                name: client_name,
                generation,
                retry,
            }),
        });
        Plan::Done
    }

    /// A Bind that PostgreSQL would refuse in an aborted transaction block, of a statement
    /// the server lacks. The server refuses it too, binding the guard (see [`GUARD_NAME`]):
    /// with no parameters for 25P02, or, when the client's parameter count is wrong (which
    /// PostgreSQL checks first), with a wrong count for the guard, the error's message then
    /// being PostgreSQL's message about the client's statement.
    pub(super) fn refuse_bind(&mut self, b: &Bind, statement: &Statement) {
        let supplied = bind_param_count(b.rest);
        let required = statement.param_count;
        let rewrite = (supplied != Some(required)).then(|| {
            let supplied = supplied.unwrap_or_default();
            ErrorRewrite::Message(Bytes::from(format!(
                "bind message supplies {supplied} parameters, but prepared statement \"{}\" requires {required}",
                String::from_utf8_lossy(b.statement)
            )))
        });
        write_message(&mut self.server.wbuf, fe::BIND, |m| {
            put_cstr(m, b.portal);
            put_cstr(m, GUARD_NAME);
            if rewrite.is_some() {
                // Formats none, one NULL value: "supplies 1 parameters, but ... requires 0".
                m.extend_from_slice(&[0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff, 0, 0]);
            } else {
                m.extend_from_slice(&[0, 0, 0, 0, 0, 0]); // no formats, values, results
            }
        });
        self.replies.push_entry(Entry {
            expected: Expected::Bind,
            action: match rewrite {
                Some(rewrite) => Action::replace_error(rewrite),
                None => Action::Forward,
            },
            effect: None,
        });
    }

    pub(super) fn describe(&mut self) -> Plan {
        let msg = self.message.whole;
        let Some(t) = Target::parse(body(msg)) else {
            return Plan::Forward;
        };
        if t.kind != b'S' {
            return Plan::Forward; // portals are per transaction: their names pass through
        }
        let Some((client_name, statement)) = self
            .stmts
            .get_named(t.name)
            .map(|(n, s, _)| (n.clone(), s.clone()))
        else {
            if self.stmts.is_sql(t.name) {
                return self.use_sql_statement(t.name, |out| {
                    // PostgreSQL's 25P02 from Describe, describing the guard.
                    write_message(out, fe::DESCRIBE, |m| {
                        m.extend_from_slice(b"S");
                        put_cstr(m, GUARD_NAME);
                    });
                    Expected::Describe
                });
            }
            return self.unknown_statement(t.name, Expected::Describe, |out, name| {
                write_message(out, fe::DESCRIBE, |m| {
                    m.extend_from_slice(b"S");
                    put_cstr(m, name);
                })
            });
        };
        match self.in_aborted_block(&statement) {
            None => return Plan::Wait,
            Some(true) => {
                if let Some(replies) = no_rows_description(&statement) {
                    // PostgreSQL describes a statement that returns no rows in an aborted
                    // block too: its parameters, no row.
                    self.replies.push_entry(Entry {
                        expected: Expected::Describe,
                        action: Action::Synthesize(Synth::Replies(Box::new(replies))),
                        effect: None,
                    });
                    return Plan::Done;
                }
                // PostgreSQL refuses to describe a statement that returns rows (25P02): so
                // does the server, describing the guard.
                write_message(&mut self.server.wbuf, fe::DESCRIBE, |m| {
                    m.extend_from_slice(b"S");
                    put_cstr(m, GUARD_NAME);
                });
                self.replies.push(Expected::Describe);
                return Plan::Done;
            }
            Some(false) => {}
        }
        if let (Some(Command::Execute { name }), None) = (&statement.tracked, &statement.hidden) {
            if !self.describe_execute(name, &statement) {
                return Plan::Wait;
            }
        }
        // Not a retry point: PostgreSQL sends the ParameterDescription before it finds out
        // that the result type changed.
        let retry = false;
        // PostgreSQL describes the statement as it is now and accepts it afterwards: a client
        // that asked knows the new shape.
        self.stmts.refresh(&statement);
        self.forward_renamed(
            statement,
            client_name,
            Expected::Describe,
            retry,
            |m, name| {
                m.extend_from_slice(b"S");
                put_cstr(m, name);
            },
        )
    }

    /// A Bind or Describe of the client's SQL-level statement `name`, which the server has
    /// under that name: it goes as it is, after the statement's PREPARE when that failed here
    /// before (see [`Planner::sql_statement_here`]). In an aborted transaction block where
    /// the server lacks it, `refuse` writes the message that gets PostgreSQL's 25P02 from the
    /// guard instead, and says what it expects.
    fn use_sql_statement(
        &mut self,
        name: &[u8],
        refuse: impl FnOnce(&mut BytesMut) -> Expected,
    ) -> Plan {
        let Ok(name) = std::str::from_utf8(pg_name(name)) else {
            return Plan::Forward;
        };
        match self.sql_statement_here(name) {
            None => Plan::Wait,
            Some(true) => Plan::Forward,
            Some(false) => {
                let expected = refuse(&mut self.server.wbuf);
                self.replies.push(expected);
                Plan::Done
            }
        }
    }

    pub(super) fn close(&mut self) -> bool {
        let msg = self.message.whole;
        let Some(t) = Target::parse(body(msg)) else {
            return false;
        };
        if t.kind != b'S' {
            if self.stmts.has_tracked_portals() {
                self.stmts.forget_portal(t.name);
            }
            return false;
        }
        if self.stmts.is_sql(t.name) {
            // A SQL-level statement: it is on the server under the client's name (or its
            // PREPARE failed here, and closing a name the server lacks is no error).
            let name = String::from_utf8_lossy(pg_name(t.name)).into_owned();
            let text = self.stmts.sql.remove(&name).unwrap_or_default();
            let here = self.server.prepared.sql.remove(&name).is_some();
            self.server.prepared.forget_sql_error(&name);
            self.server.wbuf.extend_from_slice(msg);
            self.replies.push_entry(Entry {
                expected: Expected::Close,
                action: Action::Forward,
                effect: Some(Effect::SqlClosed(Box::new(DroppedSql { name, text, here }))),
            });
            return true;
        }
        // Closing an unknown name is not an error in PostgreSQL.
        let effect = self
            .stmts
            .set(t.name, None)
            .map(|statement| Effect::Unbound {
                name: t.name.into(),
                statement,
            });
        self.replies.push_entry(Entry {
            expected: Expected::Close,
            action: Action::Synthesize(Synth::CloseComplete),
            effect,
        });
        true
    }

    /// Forwards the Sync, then closes the names a duplicate Parse left on the server.
    pub(super) fn sync(&mut self) -> bool {
        self.server.wbuf.extend_from_slice(self.message.whole);
        self.replies.push(Expected::Sync);
        if let Some(names) = self.client.cleanup.take() {
            for name in names {
                write_message(&mut self.server.wbuf, fe::CLOSE, |m| {
                    m.extend_from_slice(b"S");
                    put_cstr(m, &name);
                });
                self.replies.push_entry(Entry {
                    expected: Expected::Close,
                    action: Action::Skip,
                    effect: None,
                });
            }
            fe::sync(&mut self.server.wbuf);
            self.replies.push_entry(Entry {
                expected: Expected::Sync,
                action: Action::Skip,
                effect: None,
            });
        }
        true
    }

    /// Sends a Parse of the guard's query (a statement that does nothing) under `name`, its
    /// reply handled as `action` says.
    pub(super) fn parse_guard_query(
        &mut self,
        name: &[u8],
        action: Action,
        effect: Option<Effect>,
    ) {
        write_message(&mut self.server.wbuf, fe::PARSE, |m| {
            put_cstr(m, name);
            put_cstr(m, GUARD_QUERY);
            m.extend_from_slice(&[0, 0]);
        });
        self.replies.push_entry(Entry {
            expected: Expected::Parse,
            action,
            effect,
        });
    }

    /// Prepares the guard statement (see [`GUARD_NAME`]) if this is a safe moment: between
    /// the client's units of work (no batch open), unless the block is known to be aborted.
    /// A Sync follows, so that the Parse is a unit of its own (inside a transaction block a
    /// Sync commits nothing); if an earlier unit still in flight leaves the block aborted,
    /// the Parse fails, silently, and the guard is not there.
    pub(super) fn prepare_guard(&mut self) {
        if self.replies.in_batch()
            || self.replies.in_copy_in()
            || self.certainly_aborted()
            || self.server.prepared.limit() < 2
        {
            // (With room for one statement only, the client's statements need it.)
            return;
        }
        // The guard counts toward the limit: make room if the set is full.
        if let Some(victim) = self.server.prepared.lru_if_full() {
            self.evict(victim);
        }
        self.parse_guard_query(GUARD_NAME, Action::Silent, Some(Effect::Guard));
        fe::sync(&mut self.server.wbuf);
        self.replies.push_entry(Entry {
            expected: Expected::Sync,
            action: Action::Silent,
            effect: None,
        });
        self.server.prepared.set_guard(true);
    }
}

/// What PostgreSQL answers to a Describe of `statement` in an aborted block if it returns no
/// rows (it refuses one that does): ParameterDescription and NoData. From a server's own
/// description of it when there is one; else when its text certainly returns no rows (not an
/// `EXECUTE`, whose rows are the executed statement's) and every parameter's type is
/// declared. None: it returns rows, or that is not known here.
fn no_rows_description(statement: &Statement) -> Option<Bytes> {
    const NO_DATA: [u8; 5] = [be::NO_DATA, 0, 0, 0, 4];
    if let Some(described) = statement.description() {
        return described.ends_with(&NO_DATA).then_some(described);
    }
    let all_declared = statement.key.declared_params() == statement.param_count
        && statement
            .key
            .param_types
            .get(2..)?
            .chunks(4)
            .all(|oid| oid != [0, 0, 0, 0]);
    let text = std::str::from_utf8(&statement.key.query).ok()?;
    if !all_declared || !crate::query::describes_no_rows(text) {
        return None;
    }
    let mut replies = BytesMut::new();
    write_message(&mut replies, be::PARAMETER_DESCRIPTION, |m| {
        m.extend_from_slice(&statement.key.param_types)
    });
    replies.extend_from_slice(&NO_DATA);
    Some(replies.freeze())
}

/// The number of parameter values in a Bind (after its names), if the message says.
pub(super) fn bind_param_count(rest: &[u8]) -> Option<usize> {
    let formats = u16::from_be_bytes(rest.get(..2)?.try_into().ok()?) as usize;
    let at = 2 + 2 * formats;
    Some(u16::from_be_bytes(rest.get(at..at + 2)?.try_into().ok()?) as usize)
}

/// Replies pass through, but an error that names the statement names it as the client does.
#[inline]
pub(super) fn renaming_errors(statement: &Statement, client_name: Bytes) -> Action {
    Action::replace_error(ErrorRewrite::Rename {
        from: statement.server_name_bytes.clone(),
        to: client_name,
    })
}
