//! Statement batches answered without a server.
//!
//! Drivers prepare on connect or before each transaction: libpq's `PQprepare` (pgbench
//! `-M prepared`) sends Parse + Sync and waits for the answer, `PQclosePrepared` Close + Sync.
//! When the client holds no server (outside a transaction, in transaction mode), a Parse of a
//! statement PostgreSQL has already accepted in the client's context, a Close of a statement
//! name, and the Sync that ends them change only the client's names in pgmemo: PostgreSQL would
//! answer ParseComplete, CloseComplete and ReadyForQuery 'I'. pgmemo answers them itself, in
//! that order, and takes no server from the pool. A batch may also end with a Flush instead
//! of a Sync (asyncpg prepares with Parse, Describe, Flush and sends the Sync only with its
//! Bind/Execute): PostgreSQL then sends the same replies without the ReadyForQuery, and so does
//! pgmemo; what the client sends next takes a server as usual, and a Parse of the statement is
//! injected there when it runs. Besides a round trip, this saves a checkout that could wait: a
//! client that prepares synchronously while its thread's other clients hold servers
//! mid-transaction (pgbench with more clients than servers) would otherwise stall them all.
//!
//! A Describe of a statement whose current shape a server has described (drivers that prepare
//! send Parse, Describe, Sync: asyncpg, pgx, JDBC's describe) gets that server's
//! ParameterDescription and RowDescription/NoData again. A description is replayed only while
//! it can still be PostgreSQL's: for the statement's generation it was taken at (a result type
//! change seen as 0A000 moves it), while the database's schema epoch is the one the statement
//! was made in (DDL through pgmemo moves it, and a dropped and recreated table would show
//! another table OID), never to a client whose name predates a result type change (PostgreSQL
//! answers it 0A000) and never for statements that exist only for one client (temporary
//! objects) or that pgmemo plans itself (`DEALLOCATE`, hidden names). DDL made outside
//! pgmemo is not seen: as with every statement pgmemo keeps, the 0A000 of the next use on a
//! server is.
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
    /// Replay a server's description.
    Describe(bytes::Bytes),
}

/// Whether `input` starts with whole Parse, Describe and Close messages up to a Sync or
/// Flush: a look at the types alone, so that the usual batch (a Parse before its Bind and
/// Execute, sent by every extended-protocol query) is turned away before anything is read.
#[inline]
pub fn only_statement_messages(input: &[u8]) -> bool {
    let mut at = 0;
    for _ in 0..=MAX_MESSAGES {
        let Some(header) = input.get(at..at + 5) else {
            return false;
        };
        match header[0] {
            fe::SYNC | fe::FLUSH => return true,
            fe::PARSE | fe::DESCRIBE | fe::CLOSE => {}
            _ => return false,
        }
        at += 1 + u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    }
    false
}

/// [`only_statement_messages`] for an input that starts with a Parse of `parse_len` bytes:
/// the type of the message after it is looked at here, inlined, so that the usual batch (a
/// Bind next) costs one comparison, not a call that reads the Parse's header again (~40
/// instructions of a `pgbench -S -M extended` transaction, callgrind).
#[inline(always)]
pub fn only_statement_messages_after_parse(input: &[u8], parse_len: usize) -> bool {
    debug_assert_eq!(input.first(), Some(&fe::PARSE));
    matches!(
        input.get(parse_len),
        Some(&(fe::SYNC | fe::FLUSH | fe::PARSE | fe::DESCRIBE | fe::CLOSE))
    ) && only_statement_messages(input)
}

/// Follows a server's replies to a client's Describe of `statement` (sent at `generation`),
/// one `message` (tag first) at a time: the ParameterDescription waits in `pending` for the
/// RowDescription or NoData that completes it, and the two are kept on the statement.
pub fn observe_description(
    pending: &mut BytesMut,
    statement: &Statement,
    generation: u32,
    message: &[u8],
) {
    match message.first() {
        Some(&be::PARAMETER_DESCRIPTION) => {
            pending.clear();
            pending.extend_from_slice(message);
        }
        Some(&(be::ROW_DESCRIPTION | be::NO_DATA)) if !pending.is_empty() => {
            pending.extend_from_slice(message);
            statement.set_description(generation, pending.split().freeze());
        }
        _ => {}
    }
}

/// If `input` starts with a whole batch pgmemo can answer alone, up to its Sync or Flush (see
/// the module's comment), applies it to `stmts`, writes PostgreSQL's replies to `out`, and
/// returns the number of bytes of `input` it took. Otherwise returns None and changes nothing.
///
/// `max_count` / `max_bytes` are the client's statement limits, `max_message` the
/// configured `max_message_size`; `status` the transaction status a Sync's ReadyForQuery
/// reports (`T` in a block the session keeps without a server).
pub fn answer<'a>(
    input: &'a [u8],
    stmts: &mut ClientStatements,
    registry: &Registry,
    (max_count, max_bytes, max_message): (usize, usize, usize),
    out: &mut BytesMut,
    status: u8,
) -> Option<usize> {
    // Not for other messages, nor while a SET search_path waits for the server's answer.
    if !only_statement_messages(input) || stmts.search_path.is_open() {
        return None;
    }
    let mut steps: Vec<Step> = Vec::new();
    // Names bound or dropped earlier in the batch, newest last: what the client will have
    // when each message runs.
    // (Some(statement) if bound, None if dropped.)
    let bound_in_batch = |steps: &[Step<'a>], name: &[u8]| -> Option<Option<Arc<Statement>>> {
        steps.iter().rev().find_map(|s| match s {
            Step::Parse(n, statement) if *n == name => Some(Some(statement.clone())),
            Step::Close(n) if *n == name => Some(None),
            _ => None,
        })
    };
    let (mut count, mut bytes) = (stmts.len(), stmts.bytes());
    let mut at = 0;
    // Whether the batch ends with a Flush (no ReadyForQuery) rather than a Sync.
    let flushed = loop {
        let rest = &input[at..];
        if rest.len() < 5 || steps.len() >= MAX_MESSAGES {
            return None;
        }
        let tag = rest[0];
        let len = 1 + u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        if len < 5 || len - 1 > fe::max_message_len(tag, max_message) || rest.len() < len {
            return None; // malformed (the usual path reports it) or not all here yet
        }
        let body = crate::protocol::body(&rest[..len]);
        at += len;
        match tag {
            fe::SYNC if body.is_empty() => break false,
            fe::FLUSH if body.is_empty() => break true,
            fe::PARSE => {
                let p = Parse::parse(body)?;
                let taken = match bound_in_batch(&steps, p.name) {
                    Some(bound) => bound.is_some(),
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
            fe::DESCRIBE => {
                let t = Target::parse(body)?;
                if t.kind != b'S' || stmts.is_sql(t.name) {
                    return None; // a portal (none exists here): PostgreSQL's error
                }
                let statement = match bound_in_batch(&steps, t.name) {
                    Some(bound) => bound?,
                    None if stmts.is_stale(t.name) => return None,
                    None => stmts.get(t.name)?.clone(),
                };
                if statement.tracked.is_some()
                    || statement.hidden.is_some()
                    || stmts.schema.is_private()
                    || statement.key.epoch != stmts.schema.epoch()
                {
                    return None;
                }
                steps.push(Step::Describe(statement.description()?));
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
    };
    for step in steps {
        match step {
            Step::Parse(name, statement) => {
                statement
                    .parse_hits
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                stmts.set(name, Some(statement));
                crate::protocol::write_empty_message(out, be::PARSE_COMPLETE);
            }
            Step::Close(name) => {
                // Closing a name the client does not have is not an error in PostgreSQL.
                stmts.set(name, None);
                crate::protocol::write_empty_message(out, be::CLOSE_COMPLETE);
            }
            Step::Describe(messages) => out.extend_from_slice(&messages),
        }
    }
    if !flushed {
        be::ready_for_query(out, status);
    }
    Some(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The look at the message after the Parse answers as the whole look does, for every
    /// batch of up to three messages after a Parse, whole or cut short.
    #[test]
    fn the_look_after_a_parse_is_the_whole_look() {
        let message = |tag: u8| {
            let mut m = vec![tag, 0, 0, 0, 6];
            m.push(b'S');
            m
        };
        let kinds = [
            fe::PARSE,
            fe::BIND,
            fe::DESCRIBE,
            fe::EXECUTE,
            fe::CLOSE,
            fe::SYNC,
            fe::FLUSH,
        ];
        let mut batches = vec![vec![]];
        for _ in 0..3 {
            let longer: Vec<Vec<u8>> = batches
                .iter()
                .flat_map(|b: &Vec<u8>| kinds.iter().map(move |&k| [&b[..], &[k]].concat()))
                .collect();
            batches.extend(longer);
        }
        let parse = message(fe::PARSE);
        for batch in &batches {
            let mut input = parse.clone();
            for &k in batch {
                input.extend_from_slice(&message(k));
            }
            for cut in parse.len()..=input.len() {
                let input = &input[..cut];
                assert_eq!(
                    only_statement_messages_after_parse(input, parse.len()),
                    only_statement_messages(input),
                    "{batch:?} cut at {cut}"
                );
            }
        }
    }
}
