//! The planner's autoprepared queries: a simple query run as Parse (when the server lacks its
//! statement), Bind, Describe, Execute and Sync, its replies shown as PostgreSQL answers the
//! simple query; and the probe that prepares a new statement on the side first.

use super::{Plan, Planner};
use crate::protocol::frontend as fe;
use crate::replies::{Action, Entry, Expected};
use crate::statements::{Effect, Statement};
use std::sync::Arc;

impl Planner<'_> {
    /// A simple query run as an autoprepared statement (see [`crate::autoprepare`]): Bind of
    /// the statement to the unnamed portal with the literals' values, Describe of the portal,
    /// Execute, Sync, the replies shown as PostgreSQL answers the simple query. None: the
    /// query goes to the server as it is.
    ///
    /// Only with nothing of the client's in flight (so the session knows the transaction
    /// state, and one query's error translation is pending at a time) and outside an aborted
    /// block. A statement no server has accepted yet is prepared on the side first
    /// ([`Planner::probe`]) while this query goes to the server as it is.
    pub(super) fn autoprepared(&mut self) -> Option<Plan> {
        let ap = self.client.autoprepare.take()?;
        if self.replies.has_pending_work() || self.replies.in_batch() || self.may_be_aborted() {
            self.stats.autoprepare_passed += 1;
            ap.global.count_pass(crate::autoprepare::Pass::Busy);
            return None;
        }
        let text = self.message.text?;
        self.stmts.refresh_context(self.registry);
        let statement = match ap.client.statement(
            ap.global,
            self.registry,
            text,
            ap.reader,
            (self.stmts.context, self.stmts.schema.epoch()),
            ap.threshold,
        ) {
            Ok(statement) => statement,
            Err(pass) => {
                self.stats.autoprepare_passed += 1;
                ap.global.count_pass(pass);
                return None;
            }
        };
        if !statement.types_checked()
            || (!statement.is_validated() && !self.server.prepared.has_current(&statement))
        {
            self.probe(statement, ap.client.modifies);
            self.stats.autoprepare_passed += 1;
            ap.global.count_pass(crate::autoprepare::Pass::Probing);
            return None;
        }
        // Every simple query drops the client's unnamed statement, even one that fails.
        let unnamed = self.stmts.set(b"", None).map(|statement| Effect::Unbound {
            name: Box::default(),
            statement,
        });
        if self.server.prepared.has_current(&statement) {
            self.stats.prepare_cache_hit += 1;
        } else {
            self.stats.prepare_cache_miss += 1;
            self.write_parse(&statement);
            self.replies.push_entry(Entry {
                expected: Expected::Parse,
                action: Action::AsSimpleQuery,
                effect: Some(Effect::Prepared(statement.clone())),
            });
        }
        // The first statement of an implicit transaction: after 0A000 the query is planned
        // again (the statement re-prepared), invisibly.
        let retry = self.server.status == b'I'
            && self.client.retry.can_start()
            && !self.replies.has_pending_work();
        if retry {
            self.client.retry.start_query();
        }
        let generation = statement.generation();
        let lexed = ap.reader.lexed().expect("statement() read the text");
        ap.client.write_bind(
            lexed,
            statement.server_name.as_bytes(),
            &mut self.server.wbuf,
        );
        crate::autoprepare::write_run(&mut self.server.wbuf);
        ap.client.executed();
        self.stats.autoprepared += 1;
        self.replies.push_known(Entry {
            expected: Expected::Bind,
            action: Action::AsSimpleQuery,
            effect: Some(Effect::Uses {
                statement,
                name: None,
                generation,
                retry,
            }),
        });
        // A SELECT whose plan may be checked after an error (see
        // `ClientAutoprepare::checks_plan`): the check needs the query's text, kept for the
        // retry, and runs after its Sync, which in a block the error aborted would refuse its
        // Parse (25P02).
        ap.client.checks_plan = retry && !ap.client.modifies;
        self.replies.push_known(Entry {
            expected: Expected::Describe,
            action: if ap.client.modifies || ap.client.checks_plan {
                Action::AsSimpleQueryHeld
            } else {
                Action::AsSimpleQuery
            },
            effect: None,
        });
        self.replies.push_known(Entry {
            expected: Expected::Execute,
            action: Action::Forward,
            effect: None,
        });
        self.replies.push_known(Entry {
            expected: Expected::Sync,
            action: Action::Forward,
            effect: unnamed,
        });
        Some(Plan::Done)
    }

    /// Prepares an autoprepared statement that no server has accepted yet, on its own and
    /// silently, before the client's query (which then goes to the server as it is): if
    /// PostgreSQL accepts it, the client's next query of its shape runs prepared; if not, the
    /// shape is never tried again ([`Effect::Probe`]). In a transaction block the Parse runs
    /// inside a savepoint that is rolled back and released after it, so a Parse PostgreSQL
    /// refuses never aborts the client's transaction. Pipelined: no round trip is added.
    ///
    /// A statement with a parameter whose type the server infers (a string literal's) is
    /// also checked: the query `autoprepare::parameter_types_sql` follows the Parse, before
    /// the Sync (PostgreSQL skips it if the Parse fails), and the statement runs prepared only
    /// once its row came ([`Effect::CheckTypes`]); a statement already on this server (a
    /// driver's Parse of the same text) is only checked. `writes`: the statement writes
    /// (an assignment may apply an interval column's typmod to a parameter).
    pub(super) fn probe(&mut self, statement: Arc<Statement>, writes: bool) {
        let in_block = self.server.status == b'T';
        let parse = !self.server.prepared.has_current(&statement);
        if in_block {
            fe::query(&mut self.server.wbuf, "SAVEPOINT pgmemo_probe");
            self.replies.push(Expected::Internal);
        }
        if parse {
            self.stats.prepare_cache_miss += 1;
            self.write_parse(&statement);
            self.replies.push_entry(Entry {
                expected: Expected::Parse,
                action: Action::Silent,
                effect: Some(Effect::Probe(statement.clone())),
            });
        }
        if !statement.types_checked() {
            let sql = crate::autoprepare::parameter_types_sql(&statement.server_name, writes);
            fe::query(&mut self.server.wbuf, &sql);
            self.replies.push_entry(Entry {
                expected: Expected::Internal,
                action: Action::Silent,
                effect: Some(Effect::CheckTypes {
                    statement,
                    passed: false,
                }),
            });
        }
        if parse {
            fe::sync(&mut self.server.wbuf);
            self.replies.push_entry(Entry {
                expected: Expected::Sync,
                action: Action::Silent,
                effect: None,
            });
        }
        if in_block {
            fe::query(
                &mut self.server.wbuf,
                "ROLLBACK TO SAVEPOINT pgmemo_probe; RELEASE SAVEPOINT pgmemo_probe",
            );
            self.replies.push(Expected::Internal);
        }
    }
}
