//! A client's part of the result cache ([`ClientCache`]): the context its keys start with, the
//! buffers its lookups and fills reuse, what the statements it sent may have written, and the
//! fill it has open. The session passes it what the client gets: the replies of an open fill
//! are captured and stored at their ReadyForQuery (`ClientCache::capture`, see `store.rs`),
//! and what the client's transaction may have written is bumped once the transaction is over,
//! before the client hears so (`ClientCache::settle`, see `invalidation.rs`). Lookups are the
//! cache's (`lookup.rs`). It errs on the server's side: a role, setting or temporary object
//! its keys do not hold turns caching off for the client until it is known to be gone.

use super::invalidation::{Unfinished, FLUSH_DATABASE};
use super::lookup::statement_text;
use super::store::{Fill, Spares};
use super::{own_commits, ResultCache, RuleStats};
use crate::config::cache::CacheConfig;
use crate::protocol::backend as be;
use crate::query::analysis::{Analysis, Bypass};
use crate::query::hint;
use crate::query::lexer::{self, Lexed};
use std::hash::BuildHasher;
use std::sync::Arc;

/// One client's part: buffers, its notes of writes, its fill.
#[derive(Default)]
pub struct ClientCache {
    /// Whether the client's open transaction block is READ COMMITTED (the cache may answer
    /// inside it), once asked; forgotten when the block ends (the session keeps it).
    pub read_committed: Option<bool>,
    /// The statement and the Bind (after its two names) of a block's batch the cache answered:
    /// the client's unnamed portal, which PostgreSQL would hold (run to its end) until the
    /// next Bind of it, a Query or the block's end, and no server has (see
    /// `Session::portal_left_by_hit`).
    pub cached_portal: Option<(Arc<crate::statements::Statement>, Box<[u8]>)>,
    /// Made in the middle of a transaction block (see `session::caching::client_cache`): the
    /// block's earlier statements were not seen, so nothing is answered in it; cleared when
    /// it ends.
    pub blind_block: bool,
    pub(super) key: Vec<u8>,
    pub(super) context: Vec<u8>,
    /// What `context` was built from.
    pub(super) context_of: Option<(u64, u32)>,
    /// The search_path the context was built with (None: the server's default), its hash
    /// with the database and the roles (plans are per search_path and role), and the
    /// database.
    pub(super) search_path: Option<Box<str>>,
    /// That search_path is the client's setting (in its settings of `context_of`'s version),
    /// none of the planner's own (a `SET search_path` it follows): see
    /// [`ClientCache::context_holds`].
    search_path_of_settings: bool,
    pub(super) path_hash: u64,
    pub(super) database: Arc<str>,
    /// The slot of `database`'s catalog version, found at its first lookup (a slot, once
    /// given to a name, is that name's for good: see `Versions`), so that a hit does not hash
    /// the name again.
    catalog_slot: std::cell::Cell<Option<u32>>,
    /// The client changed its role or a setting outside the key: no caching for it.
    pub off: bool,
    /// The client changed a setting outside the key for its transaction (`SET LOCAL`): no
    /// caching for it until it is idle again.
    off_in_transaction: bool,
    /// The client may hold temporary objects (see `analysis::Effects::temp`): not answered
    /// from the cache until the session's state probe finds none, or a `DISCARD` drops them.
    pub temp: bool,
    /// A `DISCARD TEMP` or `ALL` was sent, and nothing that may make a temporary object since:
    /// `temp` is cleared when it completes (it fails in a transaction block, or an aborted
    /// one).
    discard_pending: bool,
    /// The client's standard_conforming_strings is off (kept up to date by the session):
    /// its texts are neither cached nor trusted for what they write.
    pub nonstandard_strings: bool,
    /// The session records every setting the client holds (transaction mode's session-state
    /// watch) and keys its results by all of them: a SET or SET ROLE changes the key instead
    /// of turning caching off.
    pub keys_all_settings: bool,
    /// Session mode: the client has one server for its session, so a `DISCARD ALL` it runs
    /// returns that server to the settings and role the key was built from (its startup
    /// packet's): caching turned off by a SET or SET ROLE turns on again when it completes.
    pub resets_on_discard: bool,
    /// A `DISCARD ALL` was sent (see `resets_on_discard`), and no SET or the like since.
    reset_pending: bool,
    /// What the statements sent since the last settled transaction may change.
    pub(super) pending: Vec<Arc<Analysis>>,
    /// Since `pending` began: an error or a ROLLBACK was seen / a COMMIT was seen /
    /// transactions that ended.
    failed: bool,
    committed: bool,
    ended: u32,
    /// The transaction ID asked for before the block's COMMIT (see [`own_commits`]).
    xid: TransactionId,
    pub fill: Option<Fill>,
    /// What the last fill left for the next.
    pub(super) spares: Spares,
    /// The slots the last fill depended on (a buffer, kept).
    pub(super) slots: Vec<u32>,
    /// The slots of rows the statements sent since the last settled transaction named
    /// (see [`rows`](super::rows)), and the unknown-rows slots of the tables whose rows they
    /// did not.
    pub(super) pending_rows: Vec<u32>,
    /// The first tier's key of the last lookup, and whether it is the Query's at hand
    /// (see [`ResultCache::remember_raw`]).
    pub(super) raw_key: Vec<u8>,
    pub(super) raw_key_valid: bool,
    pub(super) first_tier_misses: FirstTierMisses,
    /// The last hint comment read.
    pub(super) hint: hint::Memo,
    /// The configuration and rules of [`ResultCache`]'s generation in the first field.
    pub(super) settings: Option<(u64, Arc<CacheConfig>, Rules)>,
}

/// What a client's block learnt of its transaction ID (see [`own_commits`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum TransactionId {
    #[default]
    Unknown,
    /// Asked, before the block's COMMIT.
    Asked,
    Known(u64),
}

/// The counters of each rule of the configuration, then the hints'.
type Rules = Arc<Vec<Arc<RuleStats>>>;

impl ClientCache {
    /// Whatever was keyed for the first tier before is not the key of the message at hand.
    pub fn forget_message(&mut self) {
        self.raw_key_valid = false;
    }

    /// A client's part; `keys_all_settings`: see [`ClientCache::keys_all_settings`];
    /// `database`: the server database its queries run in (as keys name it).
    pub fn new(keys_all_settings: bool, database: &Arc<str>) -> Box<ClientCache> {
        Box::new(ClientCache {
            keys_all_settings,
            database: database.clone(),
            ..Default::default()
        })
    }

    /// The slot of `database`'s catalog version (see [`super::plans::catalog_slot`]): the
    /// one kept for the client's database, else found.
    #[inline]
    pub(super) fn catalog_slot(&self, versions: &super::Versions, database: &str) -> u32 {
        if *self.database != *database {
            return super::plans::catalog_slot(versions, database);
        }
        if let Some(slot) = self.catalog_slot.get() {
            return slot;
        }
        let slot = super::plans::catalog_slot(versions, database);
        self.catalog_slot.set(Some(slot));
        slot
    }

    pub(super) fn note(&mut self, analysis: &Arc<Analysis>) {
        let e = &analysis.effects;
        if e.session_state && !self.keys_all_settings {
            self.off = true;
            self.reset_pending = false;
        }
        if e.resets_session && self.resets_on_discard {
            self.reset_pending = true;
        }
        // Keyed by all settings, the key is the one the client had when its transaction
        // began: what the transaction changes (`SET LOCAL ROLE` in a block, a `SET` or
        // `set_config` there, `RESET`) is known only from the probe after it ends, and until
        // then the client's reads go to the server.
        if e.transaction_state || (e.session_state && self.keys_all_settings) {
            self.off_in_transaction = true;
        }
        if e.drops_temp {
            self.discard_pending = true;
        }
        if e.temp {
            self.temp = true;
            self.discard_pending = false;
        }
        if e.changes_data() && !self.pending.iter().any(|p| Arc::ptr_eq(p, analysis)) {
            if self.pending.len() >= 256 {
                self.pending.clear();
                self.pending.push(FLUSH_DATABASE.clone());
            }
            self.pending.push(analysis.clone());
        }
    }

    pub fn needs_context(&self, params_version: u64, statement_context: u32) -> bool {
        self.context_of != Some((params_version, statement_context))
    }

    /// Whether the context was built for this search_path.
    pub fn has_search_path(&self, search_path: Option<&str>) -> bool {
        self.search_path.as_deref() == search_path
    }

    /// Whether the context holds, known without looking up the search_path in the client's
    /// settings (a scan of them, ~100 instructions a hit): built from these settings (their
    /// version) and statement context, with the settings' search_path, and the planner
    /// follows none of its own now (`planner_search_path`: none).
    #[inline]
    pub fn context_holds(
        &self,
        params_version: u64,
        statement_context: u32,
        planner_search_path: Option<&str>,
    ) -> bool {
        planner_search_path.is_none()
            && self.search_path_of_settings
            && !self.needs_context(params_version, statement_context)
    }

    /// Sets the part of keys that comes from the client's context. `of_settings`: the
    /// search_path is the client's setting, not one the planner follows.
    pub fn set_context(
        &mut self,
        params_version: u64,
        statement_context: u32,
        database: &str,
        (search_path, of_settings): (Option<&str>, bool),
        roles: [Option<&str>; 3],
        parts: &[&str],
    ) {
        self.search_path_of_settings = of_settings;
        if &*self.database != database {
            self.database = database.into();
            self.catalog_slot.set(None);
        }
        self.search_path = search_path.map(Into::into);
        // A name resolves by the search_path as the server expands it: `$user` is the current
        // role, and an unset search_path is the role's default (ALTER ROLE ... SET): plans
        // are per role as well.
        self.path_hash = lexer::hasher().hash_one((database, search_path, roles));
        self.context.clear();
        self.context.extend_from_slice(database.as_bytes());
        self.context.push(0);
        self.context
            .extend_from_slice(&statement_context.to_le_bytes());
        for p in parts {
            self.context.extend_from_slice(p.as_bytes());
            self.context.push(0);
        }
        self.context_of = Some((params_version, statement_context));
    }

    pub(super) fn build_key(&mut self, lexed: &Lexed) {
        self.key.clear();
        self.key.extend_from_slice(&self.context);
        self.key.extend_from_slice(statement_text(&lexed.text));
        self.key.push(0);
        for literal in lexed.parameters() {
            let value = lexed.value(literal);
            self.key.push(literal.kind.code());
            self.key
                .extend_from_slice(&(value.len() as u32).to_le_bytes());
            self.key.extend_from_slice(value);
        }
    }

    /// Nothing is answered or filled for the client until it is idle again (its transaction
    /// reads a replica's state, see `session::replicas`).
    pub fn off_for_transaction(&mut self) {
        self.off_in_transaction = true;
    }

    /// Whether the client changed its role or a setting outside the key, for its session or
    /// for the transaction at hand.
    #[inline]
    pub(super) fn caching_off(&self) -> bool {
        self.off || self.off_in_transaction
    }

    /// Why nothing is answered for this client now, whatever the query: a role or setting
    /// outside the key, a temporary table it may hold, backslash-escaping strings.
    pub(super) fn not_served(&self) -> Option<Bypass> {
        if self.caching_off() {
            Some(Bypass::SessionState)
        } else if self.temp {
            Some(Bypass::Temporary)
        } else if self.nonstandard_strings {
            Some(Bypass::NonstandardStrings)
        } else {
            None
        }
    }

    /// Whether anything is pending for server messages to settle (or to end, see
    /// [`ClientCache::off_in_transaction`]).
    #[inline]
    pub fn watching(&self) -> bool {
        !self.pending.is_empty()
            || self.fill.is_some()
            || self.off_in_transaction
            || self.discard_pending
            || self.reset_pending
    }

    /// Takes in the bytes the session appended to the client's output for one server message
    /// while a fill is open; stores the fill at its ReadyForQuery.
    pub fn capture(&mut self, cache: &ResultCache, out: &[u8]) {
        let Some(fill) = self.fill.as_mut() else {
            return;
        };
        let mut at = 0;
        while at < out.len() {
            let Ok(Some((tag, len))) = crate::protocol::frame(&out[at..], usize::MAX) else {
                fill.spoiled = Some(Bypass::NotPlainResult);
                break;
            };
            let message = &out[at..at + len];
            // PortalSuspended ends a batch's Execute with a row limit (see `Batch`).
            let result = matches!(
                tag,
                be::ROW_DESCRIPTION | be::DATA_ROW | be::COMMAND_COMPLETE
            ) || (tag == be::PORTAL_SUSPENDED && fill.extended);
            match tag {
                be::READY_FOR_QUERY => {
                    let status = message.get(5).copied().unwrap_or(b'I');
                    if let Some(fill) = self.fill.take() {
                        self.spares = cache.store_fill(fill, status);
                    }
                    return;
                }
                _ if result && fill.spoiled.is_none() => {
                    fill.rows |= tag == be::DATA_ROW;
                    if fill.reply.len() + len > fill.chosen.max_result_bytes {
                        fill.spoiled = Some(Bypass::TooLarge);
                        fill.reply.clear();
                    } else {
                        fill.reply.extend_from_slice(message);
                    }
                }
                _ if result => {}
                be::PARSE_COMPLETE | be::BIND_COMPLETE if fill.extended => {}
                _ => {
                    fill.spoiled = Some(Bypass::NotPlainResult);
                    fill.reply.clear();
                }
            }
            at += len;
        }
    }

    /// Follows the transaction in the replies the client gets: once nothing is in flight
    /// and no transaction is open (`idle`), what the statements sent meanwhile may have
    /// changed is bumped, unless all of it was one transaction that failed or rolled back.
    /// A COMMIT bumps at once too. Bumps come before the client reads the reply, so its
    /// next query sees its writes (and so does everyone else's). `forwarded`: the message
    /// reached the client; an error or a `ROLLBACK` of pgmemo's own (a savepoint it rolled
    /// back, a statement it prepares again and retries) is not the client's transaction
    /// failing.
    pub fn settle(
        &mut self,
        cache: &ResultCache,
        database: &str,
        tag: u8,
        body: &[u8],
        forwarded: bool,
        idle: bool,
    ) {
        if tag == be::READY_FOR_QUERY && body.first() == Some(&b'I') {
            self.blind_block = false;
            self.off_in_transaction = false;
        }
        if self.discard_pending
            && forwarded
            && tag == be::COMMAND_COMPLETE
            && (body.starts_with(b"DISCARD TEMP\0") || body.starts_with(b"DISCARD ALL\0"))
        {
            self.discard_pending = false;
            self.temp = false;
        }
        if self.reset_pending
            && forwarded
            && tag == be::COMMAND_COMPLETE
            && body.starts_with(b"DISCARD ALL\0")
        {
            self.reset_pending = false;
            self.off = false;
        }
        if self.pending.is_empty() {
            return;
        }
        match tag {
            be::ERROR_RESPONSE if forwarded => {
                self.failed = true;
                if self.xid == TransactionId::Asked {
                    // The question failed (the block with it): never asked again when the
                    // server refuses the function itself.
                    self.xid = TransactionId::Unknown;
                    let code = be::ErrorFields::parse(body).map(|f| f.code);
                    if matches!(code.as_deref(), Some("42501" | "42883")) {
                        cache.own_commits.refused();
                    }
                }
            }
            be::COMMAND_COMPLETE if forwarded && body.starts_with(b"ROLLBACK") => {
                self.failed = true
            }
            be::DATA_ROW if self.xid == TransactionId::Asked => {
                self.xid = match own_commits::xid_in_data_row(body) {
                    Some(xid) => TransactionId::Known(xid),
                    None => TransactionId::Unknown,
                };
            }
            be::COMMAND_COMPLETE if body.starts_with(b"COMMIT") => {
                self.committed = true;
                cache.apply(database, &self.pending, &self.pending_rows);
                // Noted after the bump: the WAL's may be skipped only once this one is done.
                if let TransactionId::Known(xid) = std::mem::take(&mut self.xid) {
                    cache.own_commits.note(database, xid);
                }
            }
            // A statement ran after the ROLLBACK (`ROLLBACK; UPDATE ...` in one query, or in
            // one pipeline): what it wrote may commit, so the writes are not known undone.
            be::COMMAND_COMPLETE if forwarded => self.failed = false,
            be::READY_FOR_QUERY => {
                if body.first() == Some(&b'I') {
                    self.ended += 1;
                    if !idle {
                        // A transaction ended (committed, for all the session knows) with more
                        // of the client's work behind it (a pipeline: `UPDATE; Sync; BEGIN;
                        // Sync`): other clients may read its writes now, however long what
                        // follows stays open. Bumped now, and again when all has ended (what
                        // is pending may include writes still to run).
                        cache.apply(database, &self.pending, &self.pending_rows);
                    }
                }
                if idle {
                    let undone = self.failed && !self.committed && self.ended == 1;
                    if !undone {
                        cache.apply(database, &self.pending, &self.pending_rows);
                    }
                    self.pending.clear();
                    self.pending_rows.clear();
                    self.failed = false;
                    self.committed = false;
                    self.ended = 0;
                    self.xid = TransactionId::Unknown;
                }
            }
            _ => {}
        }
    }

    /// Before a COMMIT of the client's block (with WAL invalidation): whether to ask the
    /// server for the transaction's ID (see [`own_commits`]). Only for a block that wrote,
    /// all of whose statements were seen, none of which failed; once.
    pub fn asks_transaction_id(&mut self) -> bool {
        let asks = self.may_ask_transaction_id();
        if asks {
            self.xid = TransactionId::Asked;
        }
        asks
    }

    /// Whether [`ClientCache::asks_transaction_id`] would ask now (nothing noted): read before
    /// the statement's text is, so that a block that wrote nothing costs no reading.
    pub fn may_ask_transaction_id(&self) -> bool {
        !(self.pending.is_empty()
            || self.blind_block
            || self.failed
            || self.xid != TransactionId::Unknown)
    }

    /// Nothing of a transaction block or a fill is open: the client could go on in another
    /// process (an online restart) with only `off` and `temp` carried.
    pub fn is_at_rest(&self) -> bool {
        self.read_committed.is_none() && self.fill.is_none()
    }

    /// The client left: what it sent may have run to the end without it, so it is bumped
    /// now, and what the caller must bump again once the server it ran on has ended, if that
    /// work may still be running there ([`Unfinished`]).
    pub fn abandon(&mut self, cache: &ResultCache, database: &str) -> Option<Unfinished> {
        self.fill = None;
        if self.pending.is_empty() {
            return None;
        }
        cache.apply(database, &self.pending, &self.pending_rows);
        Some(Unfinished {
            database: database.into(),
            effects: std::mem::take(&mut self.pending),
            rows: std::mem::take(&mut self.pending_rows),
        })
    }
}

/// A client's first-tier probes since its last first-tier hit. A probe that misses costs a
/// few cold cache lines (~0.5 µs of a miss's ~3 on a uniform read of 1,000,000 keys, where the
/// first tier almost never answers: a key it learnt at a hit is seldom read a third time), so
/// after [`FirstTierMisses::STREAK`] misses in a row a client probes one text in
/// [`FirstTierMisses::EVERY`]; the second tier answers the others (the same entries, after the
/// lexer). The first tier still learns at every second-tier hit, so a client whose reads turn
/// hot finds it at its next probe and probes every text again.
#[derive(Default, Clone, Copy)]
pub(super) struct FirstTierMisses(u16);

impl FirstTierMisses {
    pub(super) const STREAK: u16 = 16;
    pub(super) const EVERY: u16 = 8;

    /// Whether to probe for this text; counts it as a miss (a hit resets the count).
    pub(super) fn probe(&mut self) -> bool {
        self.0 += 1;
        if self.0 <= Self::STREAK {
            return true;
        }
        if self.0 < Self::STREAK + Self::EVERY {
            return false;
        }
        self.0 = Self::STREAK;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::ClientCache;
    use std::sync::Arc;

    /// The context holds without a look at the settings' search_path only while it was built
    /// from them, for the same settings and statement context, and the planner follows no
    /// search_path of its own.
    #[test]
    fn a_context_holds_only_for_what_it_was_built_from() {
        let mut client = ClientCache::new(false, &Arc::from("db"));
        assert!(!client.context_holds(1, 0, None), "never built");
        let roles = [Some("role"), None, None];
        client.set_context(1, 0, "db", (Some("s1"), true), roles, &["role"]);
        assert!(client.context_holds(1, 0, None));
        assert!(!client.context_holds(2, 0, None), "other settings");
        assert!(
            !client.context_holds(1, 7, None),
            "another statement context"
        );
        assert!(!client.context_holds(1, 0, Some("s1")), "the planner's own");
        client.set_context(1, 0, "db", (Some("s2"), false), roles, &["role"]);
        assert!(
            !client.context_holds(1, 0, None),
            "built from the planner's search_path: the settings' is looked up"
        );
    }

    /// A hit finds its database's catalog slot without hashing the name again: the slot kept
    /// is the one the name has, for the client's database only, and forgotten when the
    /// client's database changes.
    #[test]
    fn the_catalog_slot_kept_is_the_databases_own() {
        let cache = crate::cache::ResultCache::new(
            &crate::config::cache::CacheConfig::default(),
            Arc::new(crate::query::shapes::Shapes::new(100)),
        );
        let versions = &cache.versions;
        let slot = |db| crate::cache::plans::catalog_slot(versions, db);
        let mut client = ClientCache::new(false, &Arc::from("db1"));
        assert_eq!(client.catalog_slot(versions, "db1"), slot("db1"));
        assert_eq!(client.catalog_slot(versions, "db1"), slot("db1"), "kept");
        assert_eq!(client.catalog_slot.get(), Some(slot("db1")));
        assert_ne!(slot("db1"), slot("db2"));
        assert_eq!(
            client.catalog_slot(versions, "db2"),
            slot("db2"),
            "another database's is looked up"
        );
        assert_eq!(client.catalog_slot.get(), Some(slot("db1")), "not kept");
        client.set_context(1, 0, "db2", (None, true), [None; 3], &[]);
        assert_eq!(
            client.catalog_slot.get(),
            None,
            "forgotten with the database"
        );
        assert_eq!(client.catalog_slot(versions, "db2"), slot("db2"));
    }
}
