//! Which statements are prepared on one server connection, as an LRU bounded by
//! `max_prepared_statements`. It travels with the connection through the pool.

use super::Statement;
use lru::LruCache;
use std::sync::atomic::Ordering;
use std::sync::Arc;

struct Prepared {
    statement: Arc<Statement>,
    /// The statement's generation when it was prepared here.
    generation: u32,
}

pub struct ServerSet {
    prepared: LruCache<u64, Prepared>,
    limit: usize,
    /// Whether the guard statement ([`super::GUARD_NAME`]) is prepared here. It counts
    /// toward the limit but is never a victim: pgmemo's own, one per server.
    guard: bool,
    /// SQL-level statements prepared here under their clients' names (name → PREPARE
    /// statement): those of the last client whose transaction ran here.
    pub sql: super::SqlStatements,
    /// PREPAREs of the client's SQL-level statements in flight here (pgmemo's, made again on
    /// this server: see `planner::sync_sql_statements`): until their replies are in, whether
    /// [`ServerSet::sql`] really has them is not known.
    sql_unsettled: u32,
    /// The client's SQL-level statements whose PREPARE failed here (its text names what this
    /// server's session lacks, a dropped temporary table): name → PostgreSQL's error (a whole
    /// ErrorResponse). The client still has each (PostgreSQL keeps a statement whose table
    /// went away), and the server's 26000 about one is shown as this error, which is what
    /// PostgreSQL's EXECUTE raises analysing it again. Boxed: rare.
    #[allow(clippy::box_collection)] // 8 bytes in every server, where a Vec takes 24
    sql_errors: Option<Box<Vec<(String, bytes::Bytes)>>>,
}

impl ServerSet {
    pub fn new(limit: usize) -> ServerSet {
        ServerSet {
            prepared: LruCache::unbounded(),
            limit: limit.max(1),
            guard: false,
            sql: super::SqlStatements::default(),
            sql_unsettled: 0,
            sql_errors: None,
        }
    }

    /// A PREPARE of a client's SQL-level statement is sent here: until it is answered
    /// ([`ServerSet::sql_answered`]), the server's SQL-level statements are not known.
    pub fn sql_sent(&mut self) {
        self.sql_unsettled += 1;
    }

    /// Whether every PREPARE of a client's SQL-level statement sent here has been answered:
    /// then [`ServerSet::sql`] is what the server has.
    #[inline]
    pub fn sql_settled(&self) -> bool {
        self.sql_unsettled == 0
    }

    /// A PREPARE of the client's SQL-level statement `name` sent here was answered: it is
    /// here (`error` None), or it failed with `error` (a whole ErrorResponse; None when it
    /// never ran), and the server lacks it.
    pub fn sql_answered(&mut self, name: &str, prepared: bool, error: Option<bytes::Bytes>) {
        self.sql_unsettled = self.sql_unsettled.saturating_sub(1);
        if prepared {
            self.forget_sql_error(name);
            return;
        }
        self.sql.remove(name);
        if let Some(error) = error {
            self.forget_sql_error(name);
            self.sql_errors
                .get_or_insert_with(Default::default)
                .push((name.to_owned(), error));
        }
    }

    /// Whether some SQL-level statement's PREPARE failed here (see [`ServerSet::sql_error`]).
    #[inline]
    pub fn has_sql_errors(&self) -> bool {
        self.sql_errors.is_some()
    }

    /// The error the last PREPARE of the client's SQL-level statement `name` failed with here,
    /// if it failed.
    pub fn sql_error(&self, name: &[u8]) -> Option<&bytes::Bytes> {
        self.sql_errors
            .as_ref()?
            .iter()
            .find(|(n, _)| n.as_bytes() == name)
            .map(|(_, error)| error)
    }

    /// What the server's error `body` (an ErrorResponse's) stands for: when it is PostgreSQL's
    /// 26000 about one of the client's SQL-level statements whose PREPARE failed here, the
    /// error of that PREPARE, which PostgreSQL's own EXECUTE (or Bind, or Describe) of the
    /// statement raises analysing it again.
    pub fn sql_error_for(&self, body: &[u8]) -> Option<&bytes::Bytes> {
        let (mut code, mut message) = (None, None);
        for (field, value) in crate::protocol::backend::fields(body) {
            match field {
                b'C' => code = Some(value),
                b'M' => message = Some(value),
                _ => {}
            }
        }
        if code? != b"26000" {
            return None;
        }
        let name = message?
            .strip_prefix(b"prepared statement \"")?
            .strip_suffix(b"\" does not exist")?;
        self.sql_error(name)
    }

    /// The client drops (or the server prepares) `name`: its error no longer stands for it.
    pub fn forget_sql_error(&mut self, name: &str) {
        if let Some(errors) = self.sql_errors.as_mut() {
            errors.retain(|(n, _)| n != name);
            if errors.is_empty() {
                self.sql_errors = None;
            }
        }
    }

    /// Forgets every SQL-level statement's error (another client's turn, DEALLOCATE ALL).
    #[inline]
    pub fn forget_sql_errors(&mut self) {
        // Mostly there are none: tested inline, without the call that drops them (at every
        // hold of a server).
        if self.sql_errors.is_some() {
            self.sql_errors = None;
        }
    }

    pub fn has_guard(&self) -> bool {
        self.guard
    }

    pub fn set_guard(&mut self, prepared: bool) {
        self.guard = prepared;
    }

    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit.max(1);
    }

    /// Whether `statement` is prepared here and current; marks it recently used.
    #[inline]
    pub fn has_current(&mut self, statement: &Statement) -> bool {
        // The most recently used already (a client running one statement over and over):
        // found without hashing, and nothing to move.
        if let Some((&id, p)) = self.prepared.peek_mru() {
            if id == statement.id {
                return p.generation == statement.generation();
            }
        }
        match self.prepared.get(&statement.id) {
            Some(p) => p.generation == statement.generation(),
            None => false,
        }
    }

    /// Whether a (possibly stale) copy exists under the statement's server name.
    pub fn contains(&self, statement: &Statement) -> bool {
        self.prepared.contains(&statement.id)
    }

    /// Records that `statement` is (about to be) prepared here.
    pub fn insert(&mut self, statement: Arc<Statement>) {
        statement.servers.fetch_add(1, Ordering::Relaxed);
        let generation = statement.generation();
        if let Some(old) = self.prepared.put(
            statement.id,
            Prepared {
                statement,
                generation,
            },
        ) {
            old.statement.servers.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Records a copy prepared at an older generation (an undone Close puts it back).
    pub fn insert_with_generation(&mut self, statement: Arc<Statement>, generation: u32) {
        statement.servers.fetch_add(1, Ordering::Relaxed);
        if let Some(old) = self.prepared.put(
            statement.id,
            Prepared {
                statement,
                generation,
            },
        ) {
            old.statement.servers.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The generation of the copy prepared here, if any.
    pub fn generation_of(&self, statement: &Statement) -> Option<u32> {
        self.prepared.peek(&statement.id).map(|p| p.generation)
    }

    /// Everything prepared here, with generations (for a reset that may need undoing).
    pub fn snapshot(&self) -> Vec<(Arc<Statement>, u32)> {
        self.prepared
            .iter()
            .rev()
            .map(|(_, p)| (p.statement.clone(), p.generation))
            .collect()
    }

    /// Whether a statement with this server-side name is prepared here.
    pub fn has_server_name(&self, name: &[u8]) -> bool {
        (self.guard && name == super::GUARD_NAME)
            || self
                .prepared
                .iter()
                .any(|(_, p)| p.statement.server_name.as_bytes() == name)
    }

    /// The statement prepared here under this server-side name, if any (not the guard).
    pub fn by_server_name(&self, name: &[u8]) -> Option<(Arc<Statement>, u32)> {
        self.prepared
            .iter()
            .find(|(_, p)| p.statement.server_name.as_bytes() == name)
            .map(|(_, p)| (p.statement.clone(), p.generation))
    }

    /// Forgets `statement` (closed, or its Parse never ran); returns whether it was there.
    pub fn remove(&mut self, statement: &Statement) -> bool {
        match self.prepared.pop(&statement.id) {
            Some(p) => {
                p.statement.servers.fetch_sub(1, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// The least recently used statement to close when one more must fit, if the set is full.
    /// It stays recorded until [`ServerSet::remove`]: the caller decides when the Close ran.
    pub fn victim(&self, keep: &Statement) -> Option<Arc<Statement>> {
        if self.len() < self.limit {
            return None;
        }
        self.prepared
            .iter()
            .rev()
            .map(|(_, p)| &p.statement)
            .find(|s| s.id != keep.id)
            .cloned()
    }

    /// Everything was deallocated on the server (DISCARD ALL, DEALLOCATE ALL), the guard
    /// too. (SQL-level statements are forgotten by whoever runs the reset: see
    /// [`ServerSet::sql`].)
    pub fn clear(&mut self) {
        while let Some((_, p)) = self.prepared.pop_lru() {
            p.statement.servers.fetch_sub(1, Ordering::Relaxed);
        }
        self.guard = false;
    }

    /// Statements prepared here, the guard included.
    pub fn len(&self) -> usize {
        self.prepared.len() + usize::from(self.guard)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The least recently used statement, if the set is full.
    pub fn lru_if_full(&self) -> Option<Arc<Statement>> {
        if self.len() < self.limit {
            return None;
        }
        self.prepared.peek_lru().map(|(_, p)| p.statement.clone())
    }
}

impl Drop for ServerSet {
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::statements::{Registry, StatementKey};
    use bytes::Bytes;

    fn stmt(r: &Registry, q: &'static str) -> Arc<Statement> {
        r.get_or_insert(StatementKey {
            context: 1,
            epoch: 0,
            query: Bytes::from_static(q.as_bytes()),
            param_types: Bytes::from_static(&[0, 0]),
        })
        .0
    }

    #[test]
    fn lru_victim_is_least_recently_used() {
        let r = Registry::new();
        let (a, b, c) = (stmt(&r, "a"), stmt(&r, "b"), stmt(&r, "c"));
        let mut set = ServerSet::new(2);
        assert!(set.victim(&a).is_none());
        set.insert(a.clone());
        set.insert(b.clone());
        assert!(set.has_current(&a)); // a is now most recent
        assert_eq!(set.victim(&c).unwrap().id, b.id);
        set.remove(&b);
        set.insert(c.clone());
        assert_eq!(set.len(), 2);
        assert_eq!(b.servers.load(Ordering::Relaxed), 0);
        assert_eq!(a.servers.load(Ordering::Relaxed), 1);
    }

    /// A client's SQL-level statement whose PREPARE failed here keeps its error until it is
    /// prepared here, or dropped.
    #[test]
    fn failed_sql_statements_keep_their_error() {
        let mut set = ServerSet::new(4);
        set.sql
            .insert("a".into(), "PREPARE a AS SELECT * FROM t".into());
        set.sql.insert("b".into(), "PREPARE b AS SELECT 1".into());
        set.sql_sent();
        set.sql_sent();
        assert!(!set.sql_settled());
        set.sql_answered("a", false, Some(Bytes::from_static(b"E...")));
        set.sql_answered("b", true, None);
        assert!(set.sql_settled());
        assert!(!set.sql.contains_key("a") && set.sql.contains_key("b"));
        assert_eq!(set.sql_error(b"a").map(|e| &e[..]), Some(&b"E..."[..]));
        assert!(set.sql_error(b"b").is_none());
        let missing = |name: &str| {
            let message = format!("prepared statement \"{name}\" does not exist");
            crate::protocol::backend::error_body(&[
                (b'S', "ERROR"),
                (b'C', "26000"),
                (b'M', message.as_str()),
            ])
        };
        assert_eq!(
            set.sql_error_for(&missing("a")).map(|e| &e[..]),
            Some(&b"E..."[..])
        );
        assert!(set.sql_error_for(&missing("b")).is_none());
        assert!(set.sql_error_for(&missing("ab")).is_none());
        set.sql_sent();
        set.sql_answered("a", true, None);
        assert!(!set.has_sql_errors());
        set.sql_sent();
        set.sql_answered("a", false, None);
        assert!(!set.has_sql_errors(), "not run: no error to show");
    }

    #[test]
    fn stale_generation_is_not_current() {
        let r = Registry::new();
        let a = stmt(&r, "a");
        let mut set = ServerSet::new(4);
        set.insert(a.clone());
        a.invalidate(a.generation());
        assert!(!set.has_current(&a));
        assert!(set.contains(&a));
        set.clear();
        assert_eq!(a.servers.load(Ordering::Relaxed), 0);
    }
}
