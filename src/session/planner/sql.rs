//! The planner's SQL-level statements: `PREPARE`, `EXECUTE`, `DEALLOCATE`, `DISCARD ALL` and
//! `SET search_path` in simple queries (and in the Execute of a portal bound from one), what
//! each does to the client's statement names, and the SQL-level statements carried to the
//! client's next server.

use super::{Plan, Planner, Words, MISSING_NAME};
use crate::params::Vars;
use crate::protocol::backend::{self as be, sqlstate, Severity};
use crate::protocol::frontend as fe;
use crate::protocol::{pg_name, put_cstr, write_message};
use crate::query::command::{self, Command};
use crate::replies::{Action, Entry, ErrorRewrite, Expected, ReplyQueue, Synth};
use crate::server::ServerConn;
use crate::statements::{
    ClientStatements, DroppedSql, Effect, ResetSnapshot, SqlCommands, SqlSnapshot, Statement,
    GUARD_NAME, GUARD_QUERY,
};
use bytes::{Bytes, BytesMut};
use std::sync::Arc;

impl Planner<'_> {
    /// The tracked statement ([`Statement::tracked`]) the portal of the Execute being
    /// planned was bound from, if any.
    pub(super) fn tracked_execute(&self) -> Option<Arc<Statement>> {
        let x = fe::Execute::parse(self.body())?;
        self.stmts.tracked_portal(x.portal).cloned()
    }

    /// An Execute of a portal bound from `DISCARD ALL`, `DEALLOCATE ALL` or `DEALLOCATE name`
    /// (psycopg sends them so). The server runs it; the client's statements (and the server's
    /// set) change as PostgreSQL's would, at once for whatever is planned after it, and are
    /// restored if it fails or is discarded. Whether it fails is PostgreSQL's decision (DISCARD
    /// ALL in a transaction block or a pipeline, an aborted block, a portal that is gone).
    pub(super) fn execute(&mut self) -> Plan {
        let Some(statement) = self.tracked_execute() else {
            return Plan::Forward;
        };
        let Some(command) = statement.tracked.clone() else {
            return Plan::Forward;
        };
        let plan = match command {
            Command::DiscardAll | Command::DeallocateAll if !self.server.prepared.sql_settled() => {
                // What the PREPAREs in flight leave is not known yet.
                Plan::Wait
            }
            Command::DiscardAll | Command::DeallocateAll => {
                // Every named statement, pgmemo's on the server too (the guard included); the
                // unnamed one stays. SQL-level ones too, those whose PREPARE failed here
                // included.
                self.server.prepared.forget_sql_errors();
                let snapshot = ResetSnapshot {
                    names: self.stmts.take_named(),
                    prepared: self.server.prepared.snapshot(),
                    guard: self.server.prepared.has_guard(),
                    discard_all: command == Command::DiscardAll,
                    at: Some(0),
                    completed: 0,
                    sql: Some(Box::new(SqlSnapshot {
                        client: std::mem::take(&mut self.stmts.sql),
                        server: std::mem::take(&mut self.server.prepared.sql),
                    })),
                };
                self.server.prepared.clear();
                self.forward_execute(Some(Effect::Reset(Box::new(snapshot))));
                Plan::Done
            }
            Command::Deallocate { name } => self.execute_deallocate(name.as_bytes()),
            // Of a reserved name (see `Statement::hidden`): the server runs it naming
            // `pgmemo_s`, which it does not have.
            Command::Execute { name } if statement.hidden.is_some() => {
                self.forward_execute_with(None, missing_as(&name));
                Plan::Done
            }
            // Of a protocol-level statement: see `bind_execute`.
            Command::Execute { .. } => Plan::Forward,
            Command::Prepare { name, .. } if statement.hidden.is_some() => {
                self.forward_execute_with(None, refusing(&name));
                Plan::Done
            }
            Command::Prepare { name, text } => self.execute_prepare(name, text),
            Command::SetSearchPath { value, local } => {
                // Statements parsed after it are keyed by the new search_path.
                let before = crate::statements::SearchPath::clone(&self.stmts.search_path);
                self.stmts.search_path.set(value.as_deref(), local);
                self.forward_execute(Some(Effect::SearchPathSet(Box::new(before))));
                Plan::Done
            }
            _ => Plan::Forward,
        };
        // Its command runs to completion at once: an Execute of it again fails on the server
        // (55000, "portal cannot be run"), as it would on PostgreSQL. (If this Execute does not
        // run, the portal is gone or failed with its transaction anyway.)
        if plan != Plan::Wait {
            let msg = self.message.whole;
            if let Some(x) = fe::Execute::parse(crate::protocol::body(msg)) {
                self.stmts.forget_portal(x.portal);
            }
        }
        plan
    }

    /// The Execute of `DEALLOCATE name`: the server runs it, and must find a statement under
    /// that name exactly when PostgreSQL would (the client has one).
    pub(super) fn execute_deallocate(&mut self, name: &[u8]) -> Plan {
        if !self.state_known() {
            return Plan::Wait;
        }
        if self.server.aborted() {
            // In an aborted block the server refuses it (25P02), as PostgreSQL would.
            return Plan::Forward;
        }
        let name = pg_name(name);
        if self.stmts.is_sql(name) {
            // A SQL-level statement: on the server under the client's name, unless its PREPARE
            // failed here: then a placeholder under the name is what the DEALLOCATE drops
            // (closed after the client's next Sync in case the Execute does not run).
            if !self.server.prepared.sql_settled() {
                return Plan::Wait;
            }
            let name = String::from_utf8_lossy(name).into_owned();
            let here = !self.sql_pending(&name);
            if !here && !self.client.cleanup.holds(name.as_bytes()) {
                self.placeholder_until_sync(name.as_bytes(), None);
            }
            self.server.prepared.forget_sql_error(&name);
            let text = self.stmts.sql.remove(&name).unwrap_or_default();
            self.server.prepared.sql.remove(&name);
            let dropped = DroppedSql { name, text, here };
            self.forward_execute(Some(Effect::SqlDeallocated(Box::new(dropped))));
            return Plan::Done;
        }
        // Something of pgmemo's has this name on the server: its own statement (a client may
        // name one `pgmemo_s<n>`), or what a duplicate Parse left until the next Sync.
        let own = self.server.prepared.by_server_name(name);
        let taken = own.is_some()
            || (name == GUARD_NAME && self.server.prepared.has_guard())
            || self.client.cleanup.holds(name);
        match self.stmts.set(name, None) {
            Some(statement) => {
                let mut effect = Effect::Deallocated {
                    name: name.into(),
                    statement,
                };
                if let Some((own, generation)) = own {
                    // The DEALLOCATE drops pgmemo's copy: it is not there for what follows.
                    self.server.prepared.remove(&own);
                    let closed = Effect::Closed {
                        statement: own,
                        generation,
                    };
                    effect = Effect::Both(Box::new((closed, effect)));
                } else if name == GUARD_NAME {
                    self.server.prepared.set_guard(false);
                } else if !taken {
                    // The client's statement is on the server under pgmemo's name: a
                    // placeholder under the client's name is what the DEALLOCATE drops. Closed
                    // after the client's next Sync in case the Execute does not run.
                    self.placeholder_until_sync(name, None);
                }
                self.forward_execute(Some(effect));
            }
            None if taken => {
                // PostgreSQL: 26000, which the server would not say. It says it, from the same
                // lookup, to a Describe of a name no server has.
                write_message(&mut self.server.wbuf, fe::DESCRIBE, |m| {
                    m.extend_from_slice(b"S");
                    put_cstr(m, MISSING_NAME);
                });
                self.replies.push_entry(Entry {
                    expected: Expected::Describe,
                    action: Action::replace_error(ErrorRewrite::Rename {
                        from: Bytes::from_static(MISSING_NAME),
                        to: Bytes::copy_from_slice(name),
                    }),
                    effect: None,
                });
            }
            // The server fails it with PostgreSQL's 26000 (or finds the portal gone).
            None => return Plan::Forward,
        }
        Plan::Done
    }

    /// The Execute of `PREPARE name AS ...`: the server runs it, and the client has a SQL-level
    /// statement that pgmemo prepares on whichever server its later transactions run (and
    /// that no other client finds on this one), unless it fails. It fails exactly when
    /// PostgreSQL's would: the name is taken by one of the client's statements of either kind.
    fn execute_prepare(&mut self, name: String, text: String) -> Plan {
        if !self.state_known() {
            return Plan::Wait;
        }
        if self.server.aborted() {
            // Refused by the server as by PostgreSQL: 25P02.
            return Plan::Forward;
        }
        if self.stmts.is_sql(name.as_bytes()) {
            // Refused with 42P05: the server has the name, or (its PREPARE failed here) a
            // placeholder under it does.
            if !self.server.prepared.sql_settled() {
                return Plan::Wait;
            }
            if !self.sql_pending(&name) || self.client.cleanup.holds(name.as_bytes()) {
                return Plan::Forward;
            }
            self.placeholder_until_sync(name.as_bytes(), None);
            self.forward_execute(None);
            return Plan::Done;
        }
        if self.stmts.get(name.as_bytes()).is_some() {
            // A protocol-level statement, on the server under pgmemo's name: a placeholder
            // under the client's name gets PostgreSQL's 42P05.
            self.placeholder_until_sync(name.as_bytes(), None);
            self.forward_execute(None);
            return Plan::Done;
        }
        self.server.prepared.sql.insert(name.clone(), text.clone());
        self.stmts.sql.insert(name.clone(), text.clone());
        self.forward_execute(Some(Effect::SqlPrepared(Box::new((name, text)))));
        Plan::Done
    }

    /// The Bind of `[EXPLAIN] EXECUTE name`: when the name is one of the client's
    /// protocol-level statements (which the server has under pgmemo's name), a placeholder
    /// under the client's name lets the server run it as PostgreSQL would (closed after the
    /// next Sync). Before the Bind: PostgreSQL reads the statement's result type there. A
    /// SQL-level statement is on the server already (see `sync_sql_statements`), or is
    /// prepared again first (see [`Planner::sql_statement_here`]). False: not known yet
    /// whether the block is aborted (where the placeholder would fail in place of the Bind),
    /// or whether the server has the SQL-level statement.
    pub(super) fn bind_execute(&mut self, name: &str) -> bool {
        if self.stmts.sql.contains_key(name) {
            return self.sql_statement_here(name).is_some();
        }
        let Some(statement) = self.stmts.get(name.as_bytes()).cloned() else {
            return true;
        };
        if !self.state_known() {
            return false;
        }
        if self.server.aborted() || self.client.cleanup.holds(name.as_bytes()) {
            return true;
        }
        self.placeholder_until_sync(name.as_bytes(), Some(&statement));
        true
    }

    /// Prepares a placeholder under the client's `name` on the server, closed after the
    /// client's next Sync (see `Cleanup`): `statement`'s text when the server must run it as
    /// the client's, else the guard's (only the name matters). Its replies are swallowed, but
    /// an error, which stands for the client's message that needed it.
    pub(super) fn placeholder_until_sync(&mut self, name: &[u8], statement: Option<&Statement>) {
        match statement {
            Some(statement) => {
                parse_as(&mut self.server.wbuf, name, statement);
                self.replies.push_entry(Entry {
                    expected: Expected::Parse,
                    action: Action::Skip,
                    effect: None,
                });
            }
            None => self.parse_guard_query(name, Action::Skip, None),
        }
        self.client.cleanup.push(name.into());
    }

    /// Sends the client's Execute as it is, with bookkeeping.
    pub(super) fn forward_execute(&mut self, effect: Option<Effect>) {
        self.forward_execute_with(effect, Action::Forward);
    }

    pub(super) fn forward_execute_with(&mut self, effect: Option<Effect>, action: Action) {
        self.server.wbuf.extend_from_slice(self.message.whole);
        self.replies.push_entry(Entry {
            expected: Expected::Execute,
            action,
            effect,
        });
    }

    /// `DISCARD ALL` / `DEALLOCATE ALL` drop every statement on the server and every name of
    /// the client; `DEALLOCATE name` of a protocol-level statement (the server knows it under
    /// another name), or of a SQL-level one the server lacks, is answered by pgmemo; a
    /// SQL-level statement the query EXECUTEs is prepared first where the server lacks it.
    /// Everything else passes through.
    pub(super) fn query(&mut self, words: u32) -> Plan {
        let statement_words = Words::PREPARE
            | Words::DEALLOCATE
            | Words::DISCARD
            | Words::EXECUTE
            | Words::SEARCH_PATH
            | Words::PGMEMO_S;
        if words & statement_words == 0 {
            if let Some(plan) = self.autoprepared() {
                return plan;
            }
        }
        if self.waits_for_sql_statements(words) {
            return Plan::Wait;
        }
        if self.deallocates_locally(words) && !self.state_known() {
            // Answered locally, unless the session is in an aborted block: not known yet.
            return Plan::Wait;
        }
        // PostgreSQL drops the unnamed statement at the start of every simple query (even one
        // that then fails).
        let unnamed = self
            .stmts
            .get(b"")
            .is_some()
            .then(|| self.stmts.set(b"", None))
            .flatten()
            .map(|statement| Effect::Unbound {
                name: Box::default(),
                statement,
            });
        let effect = self.query_effect(words);
        match effect {
            QueryPlan::Synthesize(effect) => self.replies.push_entry(Entry {
                expected: Expected::Query,
                action: Action::Synthesize(Synth::Deallocate),
                effect: Effect::combine(unnamed, Some(effect)),
            }),
            QueryPlan::Forward {
                effect,
                placeholders,
                hidden,
                prepare_again,
            } => {
                if unnamed.is_none()
                    && effect.is_none()
                    && placeholders.is_empty()
                    && hidden.is_none()
                    && prepare_again.is_empty()
                {
                    return Plan::Forward;
                }
                for name in &prepare_again {
                    self.reprepare_sql(name);
                }
                let bracket = !placeholders.is_empty() && !self.replies.in_batch();
                if bracket {
                    self.placeholders(&placeholders, fe::PARSE);
                }
                let action = match hidden {
                    Some((text, action)) => {
                        write_message(&mut self.server.wbuf, fe::QUERY, |m| put_cstr(m, &text));
                        action
                    }
                    None => {
                        self.server.wbuf.extend_from_slice(self.message.whole);
                        Action::Forward
                    }
                };
                self.replies.push_entry(Entry {
                    expected: Expected::Query,
                    action,
                    effect: Effect::combine(unnamed, effect),
                });
                if bracket {
                    self.placeholders(&placeholders, fe::CLOSE);
                }
            }
        }
        Plan::Done
    }

    /// A query that PREPAREs, EXECUTEs or DEALLOCATEs a name that the server does not have
    /// under the client's name — one of the client's protocol-level statements (the server
    /// knows it under pgmemo's name only), with its statement; or a SQL-level one whose
    /// PREPARE failed here (see [`Planner::sql_pending`]), with None: for PostgreSQL's own
    /// answer (42P05, the statement's rows, a DEALLOCATE that works), the statements are
    /// prepared on the server under the client's names before the query (`tag` PARSE; for
    /// None, the guard's query: only the name matters) and closed after it (`tag` CLOSE;
    /// closing a name that is not there is not an error). Each group is a unit of its own,
    /// between the client's, and silent.
    pub(super) fn placeholders(&mut self, names: &[(String, Option<Arc<Statement>>)], tag: u8) {
        for (name, statement) in names {
            match statement {
                _ if tag != fe::PARSE => write_message(&mut self.server.wbuf, fe::CLOSE, |m| {
                    m.extend_from_slice(b"S");
                    put_cstr(m, name.as_bytes());
                }),
                Some(statement) => parse_as(&mut self.server.wbuf, name.as_bytes(), statement),
                None => write_message(&mut self.server.wbuf, fe::PARSE, |m| {
                    put_cstr(m, name.as_bytes());
                    put_cstr(m, GUARD_QUERY);
                    m.extend_from_slice(&[0, 0]);
                }),
            }
            self.replies.push_entry(Entry {
                expected: if tag == fe::PARSE {
                    Expected::Parse
                } else {
                    Expected::Close
                },
                action: Action::Silent,
                effect: None,
            });
        }
        fe::sync(&mut self.server.wbuf);
        self.replies.push_entry(Entry {
            expected: Expected::Sync,
            action: Action::Silent,
            effect: None,
        });
    }

    /// Whether the message is a simple query that is only `DEALLOCATE` of a statement the
    /// server does not have under the client's name, which pgmemo answers itself: one of the
    /// client's protocol-level statements, or a SQL-level one whose PREPARE failed here.
    pub(super) fn deallocates_locally(&self, words: u32) -> bool {
        if (self.stmts.is_empty() && self.stmts.sql.is_empty()) || words & Words::DEALLOCATE == 0 {
            return false;
        }
        let Some(text) = self.message.text else {
            return false;
        };
        let Ok(text) = std::str::from_utf8(text) else {
            return false;
        };
        matches!(command::classify(text).as_slice(),
            [Command::Deallocate { name }]
                if self.stmts.get(name.as_bytes()).is_some() || self.sql_pending(name))
    }

    /// Whether the client's SQL-level statement `name` is one the server lacks: its PREPARE
    /// failed here (its text reads what this server's session does not have, or did not have
    /// then: a temporary table the client dropped, or made on another server). The client
    /// keeps it, as PostgreSQL keeps a statement whose table went away; pgmemo prepares it
    /// again before each use of it on this server (an EXECUTE, a Bind or Describe of it),
    /// which works once what it reads exists, and until then fails as PostgreSQL's EXECUTE
    /// does (see `ServerSet::sql_error`). Known once the server's SQL-level statements are
    /// ([`crate::statements::ServerSet::sql_settled`]).
    pub(super) fn sql_pending(&self, name: &str) -> bool {
        self.stmts.sql.contains_key(name) && !self.server.prepared.sql.contains_key(name)
    }

    /// Whether the simple query being planned must wait for replies in flight before pgmemo
    /// knows what the client's SQL-level statements it names need: whether the server has
    /// them (a PREPARE of one is in flight: see [`sync_sql_statements`]), and, for one the
    /// server lacks that the query EXECUTEs or DEALLOCATEs, whether the session is in a
    /// transaction block (where it is prepared again in a savepoint) or an aborted one (where
    /// PostgreSQL refuses the query). Cheap for clients without SQL-level statements.
    fn waits_for_sql_statements(&self, words: u32) -> bool {
        let words_naming = Words::PREPARE | Words::DEALLOCATE | Words::EXECUTE | Words::DISCARD;
        if self.stmts.sql.is_empty() || words & words_naming == 0 {
            return false;
        }
        let Some(text) = self.message.text else {
            return false;
        };
        let Ok(text) = std::str::from_utf8(text) else {
            return false;
        };
        let settled = self.server.prepared.sql_settled();
        command::classify(text).iter().any(|c| match c {
            Command::Execute { name } | Command::Deallocate { name }
                if self.stmts.sql.contains_key(name) =>
            {
                !settled || (self.sql_pending(name) && !self.state_known())
            }
            Command::Prepare { name, .. } if self.stmts.sql.contains_key(name) => !settled,
            // (Errors of PREPAREs still in flight would outlive the statements.)
            Command::DeallocateAll | Command::DiscardAll => !settled,
            _ => false,
        })
    }

    /// The client's SQL-level statements the server lacks that the query EXECUTEs
    /// (`commands`, as run): each is prepared again before it (see [`Planner::reprepare_sql`]).
    /// None in an aborted transaction block (PostgreSQL refuses the EXECUTE there, and so does
    /// the server), nor inside an extended-protocol batch.
    fn sql_to_prepare_again(&self, commands: &[Command]) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        if self.stmts.sql.is_empty() || self.certainly_aborted() || self.replies.in_batch() {
            return names;
        }
        for command in commands {
            if let Command::Execute { name } = command {
                if self.sql_pending(name) && !names.contains(name) {
                    names.push(name.clone());
                }
            }
        }
        names
    }

    /// Protocol-level names that the query PREPAREs, EXECUTEs or DEALLOCATEs (`commands`, and
    /// what its EXECUTEs run: `executed`), with their statements; and the SQL-level ones the
    /// server lacks that it PREPAREs or DEALLOCATEs, but does not EXECUTE (`prepare_again`),
    /// with None (see [`Planner::placeholders`]).
    fn named_statements(
        &self,
        commands: &[Command],
        executed: &[Command],
        prepare_again: &[String],
    ) -> Vec<(String, Option<Arc<Statement>>)> {
        let mut placeholders: Vec<(String, Option<Arc<Statement>>)> = Vec::new();
        for command in commands.iter().chain(executed) {
            if let Command::Prepare { name, .. }
            | Command::Execute { name }
            | Command::Deallocate { name } = command
            {
                if placeholders.iter().any(|(n, _)| n == name) {
                    continue;
                }
                if let Some(statement) = self.stmts.get(name.as_bytes()) {
                    if !name.starts_with("pgmemo_s") {
                        placeholders.push((name.clone(), Some(statement.clone())));
                    }
                } else if !matches!(command, Command::Execute { .. })
                    && !prepare_again.contains(name)
                    && self.sql_pending(name)
                {
                    placeholders.push((name.clone(), None));
                }
            }
        }
        placeholders
    }

    /// Reserved names (`pgmemo_s<n>`) are pgmemo's on the server: hidden from it (see
    /// `command::hide_reserved`). PostgreSQL stops at the first statement that fails, and each
    /// hidden one fails: the error, if about `pgmemo_s`, is about the first of them (or of the
    /// client's statements whose hidden text an EXECUTE runs, see `placeholders`). The text to
    /// send instead and how its error is shown, if any name is hidden.
    fn hidden_names(
        &self,
        text: &str,
        words: u32,
        commands: &[Command],
    ) -> Option<(Vec<u8>, Action)> {
        let hidden = if words & Words::PGMEMO_S != 0 {
            command::hide_reserved(text.as_bytes())
        } else {
            None
        };
        let first_hidden = commands.iter().enumerate().find_map(|(i, c)| {
            if let Some((_, used)) = hidden
                .as_ref()
                .and_then(|h| h.uses.iter().find(|(j, _)| *j == i))
            {
                return Some(used.clone());
            }
            match c {
                Command::Execute { name } if !command::is_reserved_name(name.as_bytes()) => {
                    self.stmts.get(name.as_bytes())?.hidden.clone()
                }
                _ => None,
            }
        });
        match (hidden, first_hidden) {
            (Some(h), Some(used)) => Some((h.text, reserved_action(&used))),
            (None, Some(used)) => Some((text.as_bytes().to_vec(), reserved_action(&used))),
            (Some(h), None) => Some((h.text, Action::Forward)),
            (None, None) => None,
        }
    }

    /// What a simple query does to the client's statements.
    pub(super) fn query_effect(&mut self, words: u32) -> QueryPlan {
        let Some(text) = self.message.text else {
            return QueryPlan::plain(None);
        };
        let commands = Words::PREPARE
            | Words::DEALLOCATE
            | Words::DISCARD
            | Words::EXECUTE
            | Words::SEARCH_PATH
            | Words::PGMEMO_S;
        if words & commands == 0 {
            return QueryPlan::plain(None);
        }
        let Ok(text) = std::str::from_utf8(text) else {
            // Another client_encoding: its reserved names are hidden all the same.
            let hidden = (words & Words::PGMEMO_S != 0)
                .then(|| command::hide_reserved(text))
                .flatten()
                .map(|h| {
                    let action = reserved_action(&h.uses[0].1);
                    (h.text, action)
                });
            return QueryPlan::plain(hidden);
        };
        let commands = command::classify(text);
        if let [Command::Deallocate { name }] = commands.as_slice() {
            if let Some(answered) = self.deallocate_here(name) {
                return answered;
            }
        }
        // An EXECUTE of a protocol-level statement whose text is DEALLOCATE runs that
        // DEALLOCATE (placeholders below prepare both names on the server).
        let executed: Vec<Command> = commands
            .iter()
            .map(|c| match c {
                Command::Execute { name } => match self
                    .stmts
                    .get(name.as_bytes())
                    .and_then(|s| s.tracked.clone())
                {
                    Some(t @ (Command::Deallocate { .. } | Command::DeallocateAll)) => t,
                    _ => c.clone(),
                },
                _ => c.clone(),
            })
            .collect();
        let prepare_again = self.sql_to_prepare_again(&executed);
        let placeholders = self.named_statements(&commands, &executed, &prepare_again);
        self.forget_dropped_sql_errors(&executed, &prepare_again);
        let mut effect = None;
        if executed
            .iter()
            .any(|c| matches!(c, Command::DiscardAll | Command::DeallocateAll))
        {
            let snapshot = ResetSnapshot {
                names: self.stmts.take_all(),
                prepared: self.server.prepared.snapshot(),
                guard: self.server.prepared.has_guard(),
                discard_all: commands.contains(&Command::DiscardAll),
                at: executed.iter().position(|c| {
                    *c == Command::DeallocateAll
                        || (*c == Command::DiscardAll && commands.len() == 1)
                }),
                completed: 0,
                sql: None,
            };
            self.server.prepared.clear();
            effect = Some(Effect::Reset(Box::new(snapshot)));
        }
        let hidden = self.hidden_names(text, words, &commands);
        let commands = executed;
        if commands.iter().any(|c| {
            matches!(
                c,
                Command::Prepare { .. }
                    | Command::SetSearchPath { .. }
                    | Command::Deallocate { .. }
                    | Command::DeallocateAll
                    | Command::DiscardAll
            )
        }) {
            let sql = Effect::Sql(Box::new(SqlCommands {
                commands,
                completed: 0,
            }));
            effect = Effect::combine(effect, Some(sql));
        }
        QueryPlan::Forward {
            effect,
            placeholders,
            hidden,
            prepare_again,
        }
    }

    /// A `DEALLOCATE name` alone that pgmemo answers itself: a protocol-level statement of
    /// the client's (renamed on servers), or a SQL-level one the server lacks (its PREPARE
    /// failed there: dropped all the same). Not in an aborted transaction block, where the
    /// server refuses it (25P02) whatever the name, exactly as PostgreSQL would.
    fn deallocate_here(&mut self, name: &str) -> Option<QueryPlan> {
        if self.certainly_aborted() {
            return None;
        }
        if let Some(statement) = self.stmts.set(name.as_bytes(), None) {
            return Some(QueryPlan::Synthesize(Effect::Unbound {
                name: name.as_bytes().into(),
                statement,
            }));
        }
        if !self.sql_pending(name) {
            return None;
        }
        self.server.prepared.forget_sql_error(name);
        let text = self.stmts.sql.remove(name).unwrap_or_default();
        Some(QueryPlan::Synthesize(Effect::SqlDeallocated(Box::new(
            DroppedSql {
                name: name.to_owned(),
                text,
                here: false,
            },
        ))))
    }

    /// A SQL-level statement the query drops (`DEALLOCATE`, `DEALLOCATE ALL`, `DISCARD ALL`)
    /// no longer has an error standing for it (see [`Planner::sql_pending`]), unless it is
    /// prepared again first (`prepare_again`).
    fn forget_dropped_sql_errors(&mut self, executed: &[Command], prepare_again: &[String]) {
        for command in executed {
            match command {
                Command::DeallocateAll | Command::DiscardAll => {
                    self.server.prepared.forget_sql_errors()
                }
                Command::Deallocate { name } if !prepare_again.contains(name) => {
                    self.server.prepared.forget_sql_error(name)
                }
                _ => {}
            }
        }
    }

    /// Prepares the client's SQL-level statement `name` on the server again (its PREPARE
    /// failed here before, see [`Planner::sql_pending`]) right before the client's query that
    /// EXECUTEs it, as PostgreSQL analyses the statement again at the EXECUTE: as a query of
    /// its own, its replies swallowed. If what the statement reads exists now, it is prepared
    /// and the EXECUTE runs it; if it fails again, its error stands for the 26000 the EXECUTE
    /// then gets (see `ServerSet::sql_error`), which is what PostgreSQL's EXECUTE raises,
    /// every field and the position into the PREPARE's query included. In a transaction block
    /// it runs in a savepoint of pgmemo's, rolled back to after it, so that its failure
    /// leaves the block as it was for the client's statements before the EXECUTE (whose own
    /// failure then aborts it, as in PostgreSQL). Only where the block is known not to be
    /// aborted.
    fn reprepare_sql(&mut self, name: &str) {
        let Some(text) = self.stmts.sql.get(name).cloned() else {
            return;
        };
        // (A kept block's BEGIN still in flight: its ReadyForQuery is not in yet.)
        let in_block = self.server.status != b'I' || self.replies.has_query_for_client();
        if in_block {
            fe::query(&mut self.server.wbuf, "SAVEPOINT pgmemo_s");
            self.replies.push(Expected::Internal);
        }
        prepare_sql(self.server, self.replies, name, &text);
        if in_block {
            fe::query(
                &mut self.server.wbuf,
                "ROLLBACK TO SAVEPOINT pgmemo_s; RELEASE SAVEPOINT pgmemo_s",
            );
            self.replies.push(Expected::Internal);
        }
    }

    /// [`Planner::reprepare_sql`] inside an extended-protocol batch, before the client's
    /// message that needs the statement (a Bind or Describe of it, the Bind of an `EXECUTE` of
    /// it): the Parse, Bind and Execute of its PREPARE, as the unnamed statement (pgmemo never
    /// keeps one on a server; closed after it, or after the client's next Sync if it fails)
    /// and a portal of pgmemo's own (closed after it). Their replies are swallowed but an
    /// error, which is then the client's message's, PostgreSQL skipping the rest of the batch:
    /// as when its Bind or Describe of the statement fails analysing it again.
    fn reprepare_sql_in_batch(&mut self, name: &str) {
        let Some(text) = self.stmts.sql.get(name).cloned() else {
            return;
        };
        self.server
            .prepared
            .sql
            .insert(name.to_owned(), text.clone());
        self.server.prepared.sql_sent();
        let out = &mut self.server.wbuf;
        write_message(out, fe::PARSE, |m| {
            put_cstr(m, b"");
            put_cstr(m, text.as_bytes());
            m.extend_from_slice(&[0, 0]);
        });
        write_message(out, fe::BIND, |m| {
            put_cstr(m, REPREPARE_PORTAL);
            put_cstr(m, b"");
            m.extend_from_slice(&[0, 0, 0, 0, 0, 0]); // no formats, values, results
        });
        write_message(out, fe::EXECUTE, |m| {
            put_cstr(m, REPREPARE_PORTAL);
            m.extend_from_slice(&[0, 0, 0, 0]);
        });
        for (kind, target) in [(b"P", REPREPARE_PORTAL), (b"S", &b""[..])] {
            write_message(out, fe::CLOSE, |m| {
                m.extend_from_slice(kind);
                put_cstr(m, target);
            });
        }
        for (expected, effect) in [
            (Expected::Parse, None),
            (Expected::Bind, None),
            (
                Expected::Execute,
                Some(Effect::SqlSync {
                    name: name.to_owned(),
                }),
            ),
            (Expected::Close, None),
            (Expected::Close, None),
        ] {
            self.replies.push_entry(Entry {
                expected,
                action: Action::Skip,
                effect,
            });
        }
        // If it fails, PostgreSQL skips the Closes: the unnamed statement goes after the Sync.
        self.client.cleanup.push(Box::default());
    }

    /// Before a protocol message that uses the client's SQL-level statement `name` (a Bind
    /// or Describe of it, the Bind or Describe of an `EXECUTE` of it): prepares it again first
    /// when the server lacks it (see [`Planner::reprepare_sql_in_batch`]). None: not known yet
    /// whether the server has it (a PREPARE of it is in flight), or, if not, whether the
    /// session is in an aborted transaction block: plan the message again later. Some(false):
    /// the server lacks it in an aborted block, where PostgreSQL refuses the message (25P02),
    /// and the guard can answer so. Some(true): the message can go as it is.
    pub(super) fn sql_statement_here(&mut self, name: &str) -> Option<bool> {
        if !self.server.prepared.sql_settled() {
            return None;
        }
        if !self.sql_pending(name) {
            return Some(true);
        }
        if !self.state_known() {
            return None;
        }
        if self.server.aborted() {
            return Some(!self.server.prepared.has_guard());
        }
        self.reprepare_sql_in_batch(name);
        Some(true)
    }

    /// The Describe of a statement whose text is `[EXPLAIN] EXECUTE name`. PostgreSQL
    /// describes it by the client's statement `name` (its row description, or NoData when the
    /// client has none); a server, by what `name` was on it when the server's copy was
    /// parsed. That copy is shared by every client whose text is the same, and the client's
    /// `name` is on the server under pgmemo's name (a protocol-level statement) or not at all
    /// (a SQL-level one whose PREPARE failed here): so `name` is made the client's on the
    /// server first (a placeholder until the next Sync, or the SQL-level statement prepared
    /// again), and the copy is parsed again after it. False: not known yet whether the
    /// session is in an aborted transaction block (where nothing is sent but the Describe,
    /// which the server answers as PostgreSQL would there), or whether the server has the
    /// SQL-level `name`.
    pub(super) fn describe_execute(&mut self, name: &str, statement: &Arc<Statement>) -> bool {
        if !self.state_known() {
            return false;
        }
        if self.server.aborted() {
            return true;
        }
        if let Some(own) = self.stmts.get(name.as_bytes()).cloned() {
            if !self.client.cleanup.holds(name.as_bytes()) {
                self.placeholder_until_sync(name.as_bytes(), Some(&own));
            }
        } else if self.stmts.sql.contains_key(name) && self.sql_statement_here(name).is_none() {
            return false;
        }
        self.parse_here(statement);
        true
    }
}

/// How a simple query is sent, and what it does to the client's statements.
pub(super) enum QueryPlan {
    /// To the server, after the client's SQL-level statements it EXECUTEs that the server
    /// lacks (`prepare_again`, see [`Planner::reprepare_sql`]), between placeholders for
    /// `placeholders` (see [`Planner::placeholders`]); with reserved statement names hidden,
    /// the text of `hidden`, its errors shown so.
    Forward {
        effect: Option<Effect>,
        placeholders: Vec<(String, Option<Arc<Statement>>)>,
        hidden: Option<(Vec<u8>, Action)>,
        prepare_again: Vec<String>,
    },
    /// Answered by pgmemo (`DEALLOCATE` of a protocol-level statement, or of a SQL-level one
    /// the server lacks).
    Synthesize(Effect),
}

impl QueryPlan {
    /// To the server as it is (or with `hidden`'s text), changing nothing.
    fn plain(hidden: Option<(Vec<u8>, Action)>) -> QueryPlan {
        QueryPlan::Forward {
            effect: None,
            placeholders: Vec::new(),
            hidden,
            prepare_again: Vec::new(),
        }
    }
}

/// The portal pgmemo runs a SQL-level statement's PREPARE in, inside a client's batch (see
/// [`Planner::reprepare_sql_in_batch`]): a name of pgmemo's reserved form, which no client's
/// SQL can take.
const REPREPARE_PORTAL: &[u8] = MISSING_NAME;

/// A client's SQL-level statement whose drop did not happen: the client has it again, and so
/// does the server it was dropped on, if it had it.
pub(super) fn restore_sql_statement(
    stmts: &mut ClientStatements,
    server: Option<&mut ServerConn>,
    dropped: DroppedSql,
) {
    if let Some(server) = server.filter(|_| dropped.here) {
        server
            .prepared
            .sql
            .insert(dropped.name.clone(), dropped.text.clone());
    }
    stmts.sql.insert(dropped.name, dropped.text);
}

/// A Parse of `statement`'s text (as servers get it) under the client's `name`.
fn parse_as(out: &mut BytesMut, name: &[u8], statement: &Statement) {
    write_message(out, fe::PARSE, |m| {
        put_cstr(m, name);
        put_cstr(m, &statement.server_query);
        m.extend_from_slice(&statement.key.param_types);
    });
}

/// A client's SQL-level statement (name, text) whose PREPARE did not run: neither the client
/// nor the server has it.
pub(super) fn forget_sql_statement(
    stmts: &mut ClientStatements,
    server: Option<&mut ServerConn>,
    (name, text): (String, String),
) {
    if let Some(server) = server {
        if server.prepared.sql.get(&name) == Some(&text) {
            server.prepared.sql.remove(&name);
        }
    }
    if stmts.sql.get(&name) == Some(&text) {
        stmts.sql.remove(&name);
    }
}

/// One SQL-level statement command that ran, in a query that `failed` or not.
pub(super) fn apply_sql_command(
    stmts: &mut ClientStatements,
    server: Option<&mut ServerConn>,
    command: Command,
    failed: bool,
) {
    let status = server.as_ref().map_or(b'I', |s| s.status);
    let server_sql = server.map(|s| &mut s.prepared.sql);
    match command {
        Command::SetSearchPath { value, local } => {
            if status == b'I' {
                // The query's transaction has ended: committed, unless the query failed.
                if !failed {
                    stmts.search_path.set(value.as_deref(), local);
                    stmts.search_path.end(true);
                }
            } else {
                // In a transaction block, until it ends (see `SearchPath::observe`).
                stmts.search_path.set(value.as_deref(), local);
            }
        }
        Command::Prepare { name, text } => {
            if let Some(server_sql) = server_sql {
                server_sql.insert(name.clone(), text.clone());
            }
            stmts.sql.insert(name, text);
        }
        Command::Deallocate { name } => {
            if stmts.sql.remove(&name).is_none() {
                // A protocol-level statement (the server had a placeholder).
                stmts.set(name.as_bytes(), None);
            }
            if let Some(server_sql) = server_sql {
                server_sql.remove(&name);
            }
        }
        Command::DeallocateAll | Command::DiscardAll => {
            stmts.sql.clear();
            if let Some(server_sql) = server_sql {
                server_sql.clear();
            }
        }
        // The other statements change none of the client's statements.
        _ => {}
    }
}

/// A session-level search_path the client SET and committed (or, after DISCARD ALL, the startup
/// packet's again): from now on the client's setting (carried to every server its transactions
/// run on, like a startup packet's), and what this server has. `""` is the server's default; a value pgmemo could not read is not carried, but
/// the server is marked as unlike anyone's, so the next client sets its own.
pub fn carry_search_path(
    path: &str,
    state: &mut crate::statements::SearchPath,
    client: &mut Vars,
    server: Option<&mut ServerConn>,
) {
    const NAME: &str = "search_path";
    state.remember_startup(client.get(NAME));
    let client_only = std::mem::take(&mut state.carry_to_client_only);
    let mut server = server.filter(|_| !client_only);
    if let Some(server) = server.as_deref_mut() {
        // Its recorded settings change here, outside the parameter sync.
        server.params_synced_for = None;
    }
    if crate::statements::is_unknown_search_path(path) {
        if let Some(server) = server {
            // A value no client has (settings hold no NUL: the marker's becomes \x01).
            server.settings.set(NAME, &path.replace('\0', "\u{1}"));
        }
        return;
    }
    for settings in std::iter::once(client).chain(server.map(|s| &mut s.settings)) {
        if path.is_empty() {
            settings.remove(NAME);
        } else {
            settings.set(NAME, path);
        }
    }
}

/// Makes the server's SQL-level statements the client's (a transaction runs wherever the pool
/// puts it): DEALLOCATE what another client left there, PREPARE what this client prepared
/// elsewhere — also so that a client never runs another client's statement. Called when the
/// session takes a server, before any of the client's messages; each is a query of its own,
/// whose replies are swallowed. A PREPARE that fails (its text reads a temporary table the
/// client dropped, or made on another server) leaves the statement the client's all the same,
/// as PostgreSQL keeps it: its error stands for the statement's EXECUTEs here, and it is
/// prepared again before each use of it (see [`Planner::sql_pending`]), which works once what
/// it reads exists. Until the replies are in, the planner waits before it plans anything that
/// names a SQL-level statement ([`crate::statements::ServerSet::sql_settled`]).
pub fn sync_sql_statements(
    stmts: &ClientStatements,
    server: &mut ServerConn,
    replies: &mut ReplyQueue,
) {
    // Another client's errors, or this client's from an earlier turn: not this one's.
    server.prepared.forget_sql_errors();
    if stmts.sql.is_empty() && server.prepared.sql.is_empty() {
        return;
    }
    let stale: Vec<String> = server
        .prepared
        .sql
        .iter()
        .filter(|(name, text)| stmts.sql.get(name) != Some(*text))
        .map(|(name, _)| name.clone())
        .collect();
    for name in stale {
        server.prepared.sql.remove(&name);
        fe::query(
            &mut server.wbuf,
            &format!("DEALLOCATE \"{}\"", name.replace('"', "\"\"")),
        );
        replies.push(Expected::Internal);
    }
    for (name, text) in stmts.sql.iter() {
        if server.prepared.sql.contains_key(name) {
            continue;
        }
        prepare_sql(server, replies, name, text);
    }
}

/// Sends the PREPARE of the client's SQL-level statement `name` (`text`, see
/// [`command::classify`]) as a query of its own, its replies swallowed and its outcome
/// settled by [`Effect::SqlSync`]; the server is taken to have it meanwhile.
fn prepare_sql(server: &mut ServerConn, replies: &mut ReplyQueue, name: &str, text: &str) {
    server.prepared.sql.insert(name.to_owned(), text.to_owned());
    server.prepared.sql_sent();
    fe::query(&mut server.wbuf, text);
    replies.push_entry(Entry {
        expected: Expected::Internal,
        action: Action::Forward,
        effect: Some(Effect::SqlSync {
            name: name.to_owned(),
        }),
    });
}

/// The replies to a statement that names the reserved `name` (see `command::ReservedUse`).
pub(super) fn reserved_action(used: &command::ReservedUse) -> Action {
    match used {
        command::ReservedUse::Missing(name) => missing_as(name),
        command::ReservedUse::Refused(name) => refusing(name),
    }
}

/// PostgreSQL's 26000 about [`MISSING_NAME`] is about the client's `name`.
pub(super) fn missing_as(name: &str) -> Action {
    Action::replace_error(ErrorRewrite::Hidden {
        name: Bytes::copy_from_slice(name.as_bytes()),
        refusal: None,
    })
}

/// PostgreSQL's 26000 about [`MISSING_NAME`] is pgmemo's refusal to prepare the reserved
/// `name`.
pub(super) fn refusing(name: &str) -> Action {
    let mut error = BytesMut::new();
    be::error_response(
        &mut error,
        Severity::Error,
        sqlstate::RESERVED_NAME,
        &format!(
            "pgmemo: prepared statement name \"{name}\" is reserved (names pgmemo_s followed by digits are pgmemo's own on the server)"
        ),
    );
    Action::replace_error(ErrorRewrite::Hidden {
        name: Bytes::copy_from_slice(name.as_bytes()),
        refusal: Some(error.freeze()),
    })
}
