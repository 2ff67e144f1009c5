//! Statement batches answered without a server.
//!
//! Drivers prepare on connect or before each transaction: libpq's `PQprepare` (pgbench
//! `-M prepared`) sends Parse + Sync and waits for the answer, `PQclosePrepared` Close + Sync.
//! When the client holds no server (outside a transaction, in transaction mode), a Parse of a
//! statement PostgreSQL has already accepted in the client's context, a Close of a statement
//! name, and the Sync that ends them change only the client's names in pgmemo: PostgreSQL would
//! answer ParseComplete, CloseComplete and ReadyForQuery 'I'. pgmemo answers them itself, in
//! that order, and takes no server from the pool. Besides a round trip, this saves a checkout
//! that could wait: a client that prepares synchronously while its thread's other clients hold
//! servers mid-transaction (pgbench with more clients than servers) would otherwise stall them
//! all.
//!
//! Anything else, or anything whose answer only PostgreSQL can give (a statement not accepted
//! before, so possibly an error; a name already in use, 42P05 after PostgreSQL's own checks of
//! the query; an SQL-level name; a portal; a client over its statement limits; a batch not yet
//! wholly read), is left to the usual path with a server: [`answer`] then changes nothing.

use super::{ClientStatements, Registry, Statement};
use crate::protocol::backend as be;
use crate::protocol::frontend::{self as fe, Parse, Target};
use bytes::BytesMut;
use std::sync::Arc;

/// A batch longer than this many messages is left to the server (the planning below is
/// quadratic in the names of one batch).
const MAX_MESSAGES: usize = 64;

/// One message of an answerable batch.
enum Step<'a> {
    /// Bind `name` to the statement.
    Parse(&'a [u8], Arc<Statement>),
    /// Drop `name`.
    Close(&'a [u8]),
}

/// If `input` starts with a whole batch pgmemo can answer alone (see the module's comment),
/// applies it to `stmts`, writes PostgreSQL's replies to `out`, and returns the number of
/// bytes of `input` it took. Otherwise returns None and changes nothing.
///
/// `max_count` / `max_bytes` are the client's statement limits, `max_message` the
/// configured `max_message_size`.
pub fn answer(
    input: &[u8],
    stmts: &mut ClientStatements,
    registry: &Registry,
    (max_count, max_bytes, max_message): (usize, usize, usize),
    out: &mut BytesMut,
) -> Option<usize> {
    if stmts.search_path.is_open() {
        return None; // a SET search_path still to be settled by the server's answer
    }
    let mut steps: Vec<Step> = Vec::new();
    // Names bound or dropped earlier in the batch, newest last: what the client will have
    // when each message runs.
    let bound_in_batch = |steps: &[Step], name: &[u8]| -> Option<bool> {
        steps.iter().rev().find_map(|s| match s {
            Step::Parse(n, _) if *n == name => Some(true),
            Step::Close(n) if *n == name => Some(false),
            _ => None,
        })
    };
    let (mut count, mut bytes) = (stmts.len(), stmts.bytes());
    let mut at = 0;
    loop {
        let rest = &input[at..];
        if rest.len() < 5 || steps.len() >= MAX_MESSAGES {
            return None;
        }
        let tag = rest[0];
        let len = 1 + u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        if len < 5 || len - 1 > fe::max_message_len(tag, max_message) || rest.len() < len {
            return None; // malformed (the usual path reports it) or not all here yet
        }
        let body = &rest[5..len];
        at += len;
        match tag {
            fe::SYNC if body.is_empty() => break,
            fe::PARSE => {
                let p = Parse::parse(body)?;
                let taken = match bound_in_batch(&steps, p.name) {
                    Some(bound) => bound,
                    None => stmts.get(p.name).is_some(),
                };
                if stmts.is_sql(p.name) || (!p.name.is_empty() && taken) {
                    return None;
                }
                if !p.name.is_empty() {
                    count += 1;
                    bytes += p.query.len();
                    if count > max_count || bytes > max_bytes {
                        return None;
                    }
                }
                // A name bound earlier in this batch is never looked up here (refused above,
                // or the unnamed one, which statement_for_parse only reuses if equal).
                let statement = stmts.statement_for_parse(registry, &p);
                if !statement.is_validated() {
                    return None; // PostgreSQL has not accepted it yet: it may fail
                }
                steps.push(Step::Parse(p.name, statement));
            }
            fe::CLOSE => {
                let t = Target::parse(body)?;
                if t.kind != b'S' || stmts.is_sql(t.name) {
                    return None;
                }
                steps.push(Step::Close(t.name));
            }
            _ => return None,
        }
    }
    for step in steps {
        match step {
            Step::Parse(name, statement) => {
                statement
                    .parse_hits
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                stmts.set(name, Some(statement));
                crate::protocol::write_message(out, be::PARSE_COMPLETE, |_| {});
            }
            Step::Close(name) => {
                // Closing a name the client does not have is not an error in PostgreSQL.
                stmts.set(name, None);
                crate::protocol::write_message(out, be::CLOSE_COMPLETE, |_| {});
            }
        }
    }
    be::ready_for_query(out, b'I');
    Some(at)
}
