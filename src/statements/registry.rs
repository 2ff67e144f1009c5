//! The global statement registry: one [`Statement`] per distinct (context, text, types), shared
//! by every session. It is read only when a client's Parse misses the client's own map — the
//! cold path — and is a lock-free map, so sessions never wait on each other there either.

use super::{Statement, StatementKey};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Server statement names come from this process-wide counter and are never reused, so a name
/// on a server can never mean two different statements.
static NEXT_STATEMENT_ID: AtomicU64 = AtomicU64::new(1);

pub struct Registry {
    statements: papaya::HashMap<StatementKey, Arc<Statement>>,
    /// (database, server role, search_path, literal settings) → context number. Touched once
    /// per client login, and when a client changes its search_path or how literals read.
    contexts: Mutex<HashMap<ContextKey, u32>>,
    /// Statements that lost their last user since the last purge: a cheap hint that a purge
    /// has work to do (the first phase of the two-phase purge).
    released: AtomicUsize,
    /// Database → its schema epoch (see `schema`). Touched once per client login.
    epochs: Mutex<HashMap<String, Arc<AtomicU32>>>,
    /// The next private context (see [`Registry::private_context`]).
    next_private: AtomicU32,
    /// Per statement key with comments dropped, whether a server accepted a statement of it
    /// (see [`Statement::accepted_as_cached`]); purged with the statements.
    same_text: papaya::HashMap<StatementKey, Arc<std::sync::atomic::AtomicBool>>,
}

/// Private contexts are numbered from here; shared ones count up from 1.
const FIRST_PRIVATE_CONTEXT: u32 = 1 << 31;

/// (database, server role, search_path, literal settings: see [`literal_settings`]).
type ContextKey = (String, String, String, String);

/// The settings that change what a literal in a statement's text means when PostgreSQL parses
/// it (a date under DateStyle, a timestamptz under TimeZone, an interval under IntervalStyle,
/// backslashes under standard_conforming_strings), as the client holds them: part of its
/// statements' context, so that a statement parsed under one client's settings never serves a
/// client reading literals otherwise.
pub const LITERAL_SETTINGS: [&str; 4] = [
    "DateStyle",
    "IntervalStyle",
    "TimeZone",
    "standard_conforming_strings",
];

/// The client's [`LITERAL_SETTINGS`], as one key.
pub fn literal_settings(reported: &crate::params::Vars) -> String {
    let mut key = String::new();
    for value in reported.get_each(LITERAL_SETTINGS) {
        key.push_str(value.unwrap_or(""));
        key.push('\0');
    }
    key
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

impl Registry {
    pub fn new() -> Registry {
        Registry {
            statements: papaya::HashMap::new(),
            contexts: Mutex::new(HashMap::new()),
            released: AtomicUsize::new(0),
            epochs: Mutex::new(HashMap::new()),
            next_private: AtomicU32::new(FIRST_PRIVATE_CONTEXT),
            same_text: papaya::HashMap::new(),
        }
    }

    /// The context number for statements parsed by a client of this database, role,
    /// search_path and literal settings: statements are shared only within one context.
    pub fn context(&self, database: &str, role: &str, search_path: &str, literals: String) -> u32 {
        let mut contexts = self.contexts.lock();
        let next = contexts.len() as u32 + 1;
        *contexts
            .entry((
                database.to_owned(),
                role.to_owned(),
                search_path.to_owned(),
                literals,
            ))
            .or_insert(next)
    }

    /// The context of the same database, role and search_path as `context`, with other
    /// literal settings (a client changed its DateStyle, TimeZone, ...).
    pub fn literal_context(&self, context: u32, literals: String) -> u32 {
        self.changed_context(context, |key| key.3 = literals)
    }

    /// The context of the same database, role and literal settings as `context`, with another
    /// search_path (a client changed its own with SET).
    pub fn derived_context(&self, context: u32, search_path: &str) -> u32 {
        self.changed_context(context, |key| key.2 = search_path.to_owned())
    }

    /// The context whose key is `context`'s with `change` made (`context` itself when it is
    /// unknown, as a private context is).
    fn changed_context(&self, context: u32, change: impl FnOnce(&mut ContextKey)) -> u32 {
        let mut contexts = self.contexts.lock();
        let Some(mut key) = contexts
            .iter()
            .find(|(_, &c)| c == context)
            .map(|(key, _)| key.clone())
        else {
            return context;
        };
        change(&mut key);
        let next = contexts.len() as u32 + 1;
        *contexts.entry(key).or_insert(next)
    }

    /// A context nobody else has: for a client whose temporary objects may give a text a
    /// meaning only in its own session.
    pub fn private_context(&self) -> u32 {
        self.next_private.fetch_add(1, Ordering::Relaxed)
    }

    /// The schema epoch of `database`, shared by all its clients (see `schema`).
    pub fn schema_epoch(&self, database: &str) -> Arc<AtomicU32> {
        self.epochs
            .lock()
            .entry(database.to_owned())
            .or_default()
            .clone()
    }

    /// Takes `statement` out of the registry (a server failed it for a schema change pgmemo
    /// did not see): later Parses of its text make a new statement, prepared afresh. Clients
    /// and servers holding it keep it until they let go.
    pub fn retire(&self, statement: &Arc<Statement>) -> bool {
        self.statements
            .pin()
            .remove_if(&statement.key, |_, s| Arc::ptr_eq(s, statement))
            .is_ok_and(|removed| removed.is_some())
    }

    /// The statement for `key`, created if new. The bool says whether it already existed.
    pub fn get_or_insert(&self, key: StatementKey) -> (Arc<Statement>, bool) {
        let map = self.statements.pin();
        if let Some(s) = map.get(&key) {
            return (s.clone(), true);
        }
        let mut fresh = Statement::new(
            NEXT_STATEMENT_ID.fetch_add(1, Ordering::Relaxed),
            key.clone(),
        );
        fresh.cache_text = crate::query::hint::without_comments(&key.query);
        if let Some(clean) = fresh.key_without_comments() {
            let same = self.same_text.pin();
            fresh.same_text_validated =
                Some(same.get_or_insert_with(clean, Default::default).clone());
        }
        let fresh = Arc::new(fresh);
        match map.try_insert(key, fresh.clone()) {
            Ok(_) => (fresh, false),
            // Another session registered it between our get and insert: use theirs.
            Err(e) => (e.current.clone(), true),
        }
    }

    /// Called when a statement loses a holder or a server; counts toward the next purge.
    pub fn note_released(&self) {
        self.released.fetch_add(1, Ordering::Relaxed);
    }

    /// Drops statements nobody uses (no client name, no server holds them). Phase one is an
    /// atomic check so that calling this often costs nothing when there is nothing to do.
    pub fn purge(&self, min_released: usize) -> usize {
        if self.released.load(Ordering::Relaxed) < min_released {
            return 0;
        }
        self.released.store(0, Ordering::Relaxed);
        let before = self.statements.len();
        // Only the registry's own reference left: no client map or server set holds it.
        self.statements
            .pin()
            .retain(|_, s| Arc::strong_count(s) > 1);
        self.same_text.pin().retain(|_, v| Arc::strong_count(v) > 1);
        before.saturating_sub(self.statements.len())
    }

    /// Takes the registry's lock (its statement map has none) until the result is dropped:
    /// for benches/hot_path.rs, through `App::hold_locks`.
    pub(crate) fn hold_locks(&self) -> impl Sized + '_ {
        self.contexts.lock()
    }

    pub fn len(&self) -> usize {
        self.statements.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every statement, for SHOW PREPARED_STATEMENTS.
    pub fn all(&self) -> Vec<Arc<Statement>> {
        let mut v: Vec<_> = self.statements.pin().values().cloned().collect();
        v.sort_by_key(|s| s.id);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn key(ctx: u32, q: &'static str) -> StatementKey {
        StatementKey {
            context: ctx,
            epoch: 0,
            query: Bytes::from_static(q.as_bytes()),
            param_types: Bytes::from_static(&[0, 0]),
        }
    }

    #[test]
    fn same_key_same_statement_other_context_other_statement() {
        let r = Registry::new();
        let a = r.context("db", "app", "public", "ISO, MDY".into());
        let b = r.context("db", "app", "other", "ISO, MDY".into());
        assert_ne!(a, b);
        assert_eq!(a, r.context("db", "app", "public", "ISO, MDY".into()));
        assert_eq!(r.derived_context(a, "other"), b);
        assert_eq!(r.derived_context(b, "public"), a);
        assert_ne!(r.derived_context(a, "third"), a);
        // Literals read otherwise: another context, which keeps its search_path.
        let dmy = r.literal_context(a, "ISO, DMY".into());
        assert_ne!(dmy, a);
        assert_eq!(r.literal_context(dmy, "ISO, MDY".into()), a);
        assert_eq!(
            r.derived_context(dmy, "other"),
            r.literal_context(b, "ISO, DMY".into())
        );
        let (s1, found1) = r.get_or_insert(key(a, "SELECT 1"));
        let (s2, found2) = r.get_or_insert(key(a, "SELECT 1"));
        let (s3, _) = r.get_or_insert(key(b, "SELECT 1"));
        assert!(!found1 && found2);
        assert_eq!(s1.id, s2.id);
        assert_ne!(s1.id, s3.id);
        assert_ne!(s1.server_name, s3.server_name);
    }

    #[test]
    fn purge_keeps_used_statements_and_names_are_never_reused() {
        let r = Registry::new();
        let (kept, _) = r.get_or_insert(key(1, "SELECT 1"));
        let (dropped, _) = r.get_or_insert(key(1, "SELECT 2"));
        let dropped_id = dropped.id;
        drop(dropped);
        r.note_released();
        assert_eq!(r.purge(2), 0, "below the threshold nothing is scanned");
        assert_eq!(r.purge(1), 1);
        assert_eq!(r.len(), 1);
        assert_eq!(r.all()[0].id, kept.id);
        let (again, found) = r.get_or_insert(key(1, "SELECT 2"));
        assert!(!found);
        assert!(
            again.id > dropped_id,
            "a purged statement's name is not reused"
        );
    }

    #[test]
    fn concurrent_registration_yields_one_statement() {
        let r = Arc::new(Registry::new());
        let ids: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let r = r.clone();
                    s.spawn(move || r.get_or_insert(key(1, "SELECT 42")).0.id)
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(ids.windows(2).all(|w| w[0] == w[1]), "{ids:?}");
    }

    #[test]
    fn a_retired_statement_is_replaced_by_a_fresh_one() {
        let r = Registry::new();
        let (old, _) = r.get_or_insert(key(1, "SELECT 1"));
        assert!(r.retire(&old));
        assert!(!r.retire(&old), "retired once");
        let (fresh, found) = r.get_or_insert(key(1, "SELECT 1"));
        assert!(!found);
        assert_ne!(fresh.server_name, old.server_name);
        assert!(!r.retire(&old), "the fresh statement stays");
        assert_eq!(r.all()[0].id, fresh.id);
        let mut other = key(1, "SELECT 1");
        other.epoch = 1;
        assert_ne!(
            r.get_or_insert(other).0.id,
            fresh.id,
            "another schema epoch"
        );
        assert!(r.private_context() != r.private_context());
    }
}
