//! Prepared statements follow schema changes as PostgreSQL's do: a Parse after a change is
//! answered with the schema as it is now, never from a server statement prepared before it.
//!
//! Each database has a schema epoch, part of every registry key
//! ([`super::StatementKey::epoch`]). DDL sent through pgmemo (a statement that starts with
//! `CREATE`, `ALTER` or `DROP`) bumps it when it is sent, and again when the client is back
//! outside a transaction (other sessions see the change only once it is committed): later
//! Parses make new statements, with new server names, prepared afresh on whichever server runs
//! them. Statements bound before keep their server copies and get PostgreSQL's own answers
//! (0A000 when the result type changed), as on a direct connection.
//!
//! A temporary object is visible only to the session that made it and may hide a table of the
//! same name: a client that may hold one parses in a private context (shared with nobody)
//! until a session-state probe shows its temporary objects gone.
//!
//! DDL made outside pgmemo, or inside functions, is not seen: the first use of a statement
//! that fails for it retires the statement (`Registry::retire`), so later Parses get a fresh
//! one.

use crate::query::facts::Ddl;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// One client's view of its database's schema changes.
#[derive(Debug, Default)]
pub struct SchemaWatch {
    /// The database's epoch, shared by all its clients (see `Registry::schema_epoch`).
    epoch: Arc<AtomicU32>,
    /// DDL was sent since the client was last idle: the epoch moves again when it is.
    uncommitted: bool,
    /// The client may hold temporary objects: it parses in a private context.
    temp: bool,
    /// [`SchemaWatch::temp`] changed since the context was last worked out.
    pub context_dirty: bool,
}

impl SchemaWatch {
    pub fn new(epoch: Arc<AtomicU32>) -> SchemaWatch {
        SchemaWatch {
            epoch,
            ..Default::default()
        }
    }

    /// The epoch a Parse now belongs to.
    #[inline]
    pub fn epoch(&self) -> u32 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Whether the client parses in a private context.
    pub fn is_private(&self) -> bool {
        self.temp
    }

    /// `ddl` is being sent.
    #[inline]
    pub fn note(&mut self, ddl: Ddl) {
        if ddl.shared {
            self.epoch.fetch_add(1, Ordering::AcqRel);
            self.uncommitted = true;
        }
        if ddl.temp {
            // A new private context at each: a statement parsed before this temporary object
            // was made may name what it hides (PostgreSQL does not plan such a statement
            // again, and a Parse after it would read the temporary one).
            self.temp = true;
            self.context_dirty = true;
        }
    }

    /// A ReadyForQuery arrived; `idle`: nothing of the client's in flight and no transaction
    /// open.
    #[inline]
    pub fn ready(&mut self, idle: bool) {
        if self.uncommitted && idle {
            self.uncommitted = false;
            self.epoch.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// A probe showed whether the client's session holds temporary objects.
    pub fn temp_found(&mut self, found: bool) {
        if self.temp && !found {
            self.temp = false;
            self.context_dirty = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_epoch_moves_when_sent_and_when_committed() {
        let epoch = Arc::new(AtomicU32::new(0));
        let mut a = SchemaWatch::new(epoch.clone());
        let b = SchemaWatch::new(epoch.clone());
        a.note(crate::query::facts::ddl(b"ALTER TABLE t ADD COLUMN c int"));
        assert_eq!(b.epoch(), 1);
        a.ready(false);
        assert_eq!(b.epoch(), 1, "still in its transaction");
        a.ready(true);
        assert_eq!(b.epoch(), 2, "committed");
        a.ready(true);
        assert_eq!(b.epoch(), 2);
        a.note(crate::query::facts::ddl(b"CREATE TEMP TABLE t (a int)"));
        assert_eq!(b.epoch(), 2, "temporary objects concern the client alone");
        assert!(a.is_private() && a.context_dirty);
        a.context_dirty = false;
        a.temp_found(true);
        assert!(a.is_private() && !a.context_dirty);
        a.temp_found(false);
        assert!(!a.is_private() && a.context_dirty);
    }
}
