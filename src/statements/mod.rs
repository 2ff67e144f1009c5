//! Prepared statements in transaction mode.
//!
//! A client's statement names live in the client's own map (no lock), each pointing at a shared,
//! immutable [`Statement`] from the global [`Registry`], which is only touched when a Parse
//! misses the client's map. Each server connection carries a [`ServerSet`]: which statements are
//! prepared there, under pgmemo's own never-reused names (`pgmemo_s<n>`), bounded by an LRU.
//! The session's planner renames statements in Bind/Describe, injects a Parse when the server
//! lacks one, and answers Parse/Close locally when the server has nothing to do.

pub mod registry;
pub mod server_set;
pub mod sql;

pub use registry::Registry;
pub use server_set::ServerSet;

use crate::protocol::{put_cstr, write_message};
use bytes::{Bytes, BytesMut};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// What makes two Parse messages the same statement: their text and parameter types, within one
/// semantic context (database, server role, search_path), interned as a small number.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StatementKey {
    pub context: u32,
    pub query: Bytes,
    /// Parameter count and OIDs exactly as in the Parse message.
    pub param_types: Bytes,
}

/// One statement, shared by every client and server that uses it. Immutable but for its
/// counters and generation.
#[derive(Debug)]
pub struct Statement {
    pub id: u64,
    pub key: StatementKey,
    /// The name it has on servers: `pgmemo_s<id>`.
    pub server_name: Box<str>,
    /// A ready Parse message under the server name, so injecting it is one copy.
    parse_message: Bytes,
    /// Bumped when a server reports that the statement's result type changed after DDL
    /// (0A000); servers holding an older generation re-prepare it before the next use.
    generation: AtomicU32,
    /// Set once some server accepted its Parse: until then a client's Parse of it must reach a
    /// server, so that an invalid statement fails where PostgreSQL would fail it.
    validated: AtomicBool,
    /// Client names currently bound to it.
    pub holders: AtomicUsize,
    /// Servers it is prepared on.
    pub servers: AtomicUsize,
    pub parse_hits: AtomicU64,
    pub server_prepares: AtomicU64,
    pub evictions: AtomicU64,
}

impl Statement {
    fn new(id: u64, key: StatementKey) -> Statement {
        let server_name = format!("pgmemo_s{id}").into_boxed_str();
        let mut msg = BytesMut::with_capacity(key.query.len() + server_name.len() + 16);
        write_message(&mut msg, crate::protocol::frontend::PARSE, |b| {
            put_cstr(b, server_name.as_bytes());
            put_cstr(b, &key.query);
            b.extend_from_slice(&key.param_types);
        });
        Statement {
            id,
            key,
            server_name,
            parse_message: msg.freeze(),
            generation: AtomicU32::new(0),
            validated: AtomicBool::new(false),
            holders: AtomicUsize::new(0),
            servers: AtomicUsize::new(0),
            parse_hits: AtomicU64::new(0),
            server_prepares: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    pub fn parse_message(&self) -> &[u8] {
        &self.parse_message
    }

    /// Appends a Close of the server-side statement.
    pub fn encode_close(&self, out: &mut BytesMut) {
        write_message(out, crate::protocol::frontend::CLOSE, |b| {
            b.extend_from_slice(b"S");
            put_cstr(b, self.server_name.as_bytes());
        });
    }

    pub fn generation(&self) -> u32 {
        self.generation.load(Ordering::Acquire)
    }

    /// Marks every server's copy as stale (after 0A000 "cached plan must not change result
    /// type"). Only bumps from the generation the caller saw, so many sessions seeing the same
    /// error bump it once.
    pub fn invalidate(&self, seen: u32) {
        let _ = self.generation.compare_exchange(
            seen,
            seen.wrapping_add(1),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    pub fn is_validated(&self) -> bool {
        self.validated.load(Ordering::Acquire)
    }

    pub fn mark_validated(&self) {
        if !self.validated.load(Ordering::Relaxed) {
            self.validated.store(true, Ordering::Release);
        }
    }

    pub fn query_text(&self) -> String {
        String::from_utf8_lossy(&self.key.query).into_owned()
    }

    /// Parameter type OIDs.
    pub fn param_oids(&self) -> Vec<u32> {
        self.key
            .param_types
            .get(2..)
            .unwrap_or_default()
            .chunks_exact(4)
            .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_message_carries_the_server_name() {
        let key = StatementKey {
            context: 1,
            query: Bytes::from_static(b"SELECT $1"),
            param_types: Bytes::from_static(&[0, 1, 0, 0, 0, 23]),
        };
        let s = Statement::new(7, key);
        assert_eq!(&*s.server_name, "pgmemo_s7");
        let p = crate::protocol::frontend::Parse::parse(&s.parse_message()[5..]).unwrap();
        assert_eq!(p.name, b"pgmemo_s7");
        assert_eq!(p.query, b"SELECT $1");
        assert_eq!(s.param_oids(), vec![23]);
        let g = s.generation();
        s.invalidate(g);
        s.invalidate(g);
        assert_eq!(s.generation(), g + 1, "one bump per observed generation");
    }
}
