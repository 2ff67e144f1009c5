//! The lookup path: what the cache does with a query, answered from the first tier (a simple
//! query's text exactly as sent, in the client's context: [`ResultCache::raw_hit`]) or the
//! second (its normalized text and literals, [`ResultCache::lookup`], or an extended-protocol
//! [`Batch`], [`ResultCache::lookup_statement`]). It decides which rule or hint chooses the
//! query, whether the client may be answered now (idle, or in a READ COMMITTED block that has
//! not written what the query reads; the WAL caught up), and whether the key is stored: a
//! [`Lookup`] for the session. It leaves which tables a query reads to `plans.rs`, the fetch
//! others wait for to `flights.rs`, and a miss's capture to `store.rs`. Whatever is in doubt
//! is passed to the server, counted as a bypass, rather than answered.

use super::client::{ClientCache, FirstTierMisses};
use super::invalidation::statement_analysis;
use super::key::KeyRef;
use super::plans::Plan;
use super::store::{Miss, Spares, MAX_KEPT_BUFFER};
use super::{auto, rows, Entry, Lookup, ResultCache, RuleStats, Shape, Transaction, Where};
use crate::config::cache::CacheConfig;
use crate::query::analysis::{Analysis, Bypass};
use crate::query::hint;
use crate::query::lexer;
use crate::query::shapes::ShapeStats;
use crate::query::Reader;
use std::hash::BuildHasher;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Texts remembered by the first tier ([`ResultCache::raw`]).
pub(super) const RAW_ENTRIES: usize = 65_536;

impl ResultCache {
    /// The first tier: the entry stored for exactly this text in the client's context, if
    /// it is still valid and its rule (or hints) still chooses it. The caller has checked
    /// that the client may be answered from the cache now (idle, or `in_block`: in a READ
    /// COMMITTED block that has run nothing on a server; context current, caching not off,
    /// the WAL caught up).
    pub fn raw_hit(
        &self,
        client: &mut ClientCache,
        sql: &[u8],
        in_block: bool,
    ) -> Option<Arc<Entry>> {
        client.raw_key_valid = false;
        if client.caching_off()
            || client.temp
            || client.nonstandard_strings
            || client.context_of.is_none()
        {
            return None;
        }
        raw_key(&mut client.raw_key, &client.context, sql);
        let probe = client.first_tier_misses.probe();
        let entry = probe.then(|| self.raw.get(&client.raw_key[..])).flatten();
        if client.raw_key.capacity() > MAX_KEPT_BUFFER {
            // Not kept, so not remembered either.
            client.raw_key = Vec::new();
        } else {
            // Learnt at a second-tier hit even when not probed.
            client.raw_key_valid = true;
        }
        let entry = entry?.upgrade()?;
        let now = Instant::now();
        // A refresh due is claimed in the second tier (see `decide`).
        if entry.expires <= now || entry.refresh_due(now) || !self.versions.unchanged(&entry.seen) {
            return None;
        }
        if !entry.rule.chooses.load(Relaxed) || (in_block && !entry.rule.in_blocks.load(Relaxed)) {
            return None;
        }
        client.first_tier_misses = FirstTierMisses::default();
        entry.hits.fetch_add(1, Relaxed);
        entry.rule.hits.add(1);
        if let Some(shape) = &entry.shape {
            shape.stats.cache_figures().raw_hits.add(1);
        }
        Some(entry)
    }

    /// After a hit in the second tier on the Query whose first-tier lookup just missed
    /// ([`ResultCache::raw_hit`]): its text answers from the first tier from now on. (Done at
    /// a hit, not when the entry is stored: most entries of a workload with a low hit ratio
    /// are never read, and the first tier's insert and eviction would cost every store.)
    pub fn remember_raw(&self, client: &mut ClientCache, entry: &Arc<Entry>) {
        if std::mem::take(&mut client.raw_key_valid) {
            self.raw
                .insert(client.raw_key[..].into(), Arc::downgrade(entry));
        }
    }

    /// Looks up a simple query whose text `sql` was just noted (`shape`; `reader`, the
    /// session's reading of it). `may_wait`: whether waiting for another client's fetch is
    /// still allowed (once per query).
    pub fn lookup(
        &self,
        client: &mut ClientCache,
        at: &Where<'_>,
        sql: &[u8],
        reader: &Reader,
        shape: &Arc<Shape>,
        may_wait: bool,
    ) -> Lookup {
        let (Some(lexed), Some(analysis)) = (reader.lexed(), shape.analysis()) else {
            return Lookup::Pass;
        };
        client.build_key(lexed);
        let hints = client.hint.read(sql, &lexed.comment_spans);
        self.decide(
            client,
            at,
            Candidate {
                hints,
                hint_warned: &shape.hint_warned,
                text: &lexed.text,
                display: shape.display(),
                hash: lexed.shape,
                query_hash: shape.query_hash,
                analysis,
                extended: false,
                shape: Some(shape),
                values: rows::Values::Lexed(lexed),
                portal: Portal::Ended,
            },
            may_wait,
        )
    }

    /// Looks up an extended-protocol `batch` that runs `statement`: keyed by the statement
    /// (by its text and parameter types when it has comments, which are not part of the key:
    /// statements that differ only in a per-request comment share entries), whether the
    /// portal is described, the Execute's row limit and the Bind's formats, values and
    /// result formats.
    pub fn lookup_statement(
        &self,
        client: &mut ClientCache,
        at: &Where<'_>,
        statement: &crate::statements::Statement,
        batch: &Batch<'_>,
        may_wait: bool,
    ) -> Lookup {
        let analysis = statement_analysis(statement);
        client.key.clear();
        client.key.extend_from_slice(&client.context);
        match &statement.cache_text {
            None => {
                client.key.push(b'E');
                client.key.extend_from_slice(&statement.id.to_le_bytes());
            }
            Some(text) => push_text(&mut client.key, text, &statement.key.param_types),
        }
        push_execution(&mut client.key, batch);
        let hash = lexer::hasher().hash_one(&statement.key.query[..]) ^ 1;
        let shape = statement.shape(&self.shapes);
        let looked_up = self.decide(
            client,
            at,
            Candidate {
                hints: *statement
                    .cache_hints
                    .get_or_init(|| hint::read_statement(&statement.key.query)),
                hint_warned: &statement.hint_warned,
                text: &statement.key.query,
                display: None,
                hash,
                query_hash: shape.map_or(hash, |s| s.query_hash),
                analysis,
                extended: true,
                shape,
                values: rows::Values::Bind {
                    rest: batch.bind.rest,
                    types: &statement.key.param_types,
                },
                portal: if !batch.bind.portal.is_empty() {
                    Portal::Named
                } else if batch.max_rows != 0 {
                    Portal::Limited
                } else {
                    Portal::Ended
                },
            },
            may_wait,
        );
        if let (Lookup::Hit(_), Some(shape)) = (&looked_up, shape) {
            // A call the server never sees (the planner counts the others).
            shape.stats.calls.fetch_add(1, Relaxed);
        }
        if let (Lookup::Miss, None, Some(_)) = (&looked_up, &statement.cache_text, self.shared()) {
            // The statement's number means nothing to another instance: its text does.
            if let Some(fill) = client.fill.as_mut() {
                let mut key = client.context.clone();
                push_text(&mut key, &statement.key.query, &statement.key.param_types);
                push_execution(&mut key, batch);
                fill.set_shared_key(key.into());
            }
        }
        looked_up
    }

    /// What `query`'s comments ask, once a malformed hint among them is counted and logged
    /// (it is ignored).
    fn hint(&self, query: &Candidate<'_>) -> Option<hint::Hint> {
        if let Some(why) = query.hints.malformed {
            self.count(Bypass::MalformedHint);
            hint::warn_once(query.hint_warned, why, query.text);
        }
        query.hints.hint
    }

    /// What chooses `query` for caching, with whose counters: its hint (`nocache` counted
    /// as a bypass), else the first rule that matches it. None: nothing does.
    fn choose<'r>(
        &self,
        cfg: &CacheConfig,
        rules: &'r [Arc<RuleStats>],
        hint: Option<hint::Hint>,
        at: &Where<'_>,
        query: &Candidate<'_>,
    ) -> Option<(Chosen, usize, &'r Arc<RuleStats>)> {
        match hint {
            Some(hint::Hint::NoCache) => {
                self.count(Bypass::Hint);
                None
            }
            Some(hint::Hint::Cache { ttl }) => Some((
                Chosen::by_section(cfg, ttl.unwrap_or(cfg.default_ttl)),
                cfg.rules.len(),
                rules.get(cfg.rules.len())?,
            )),
            None => {
                // Rules match the text as a string; a hint needs none of it.
                let text = std::str::from_utf8(query.text).unwrap_or_default();
                let found = cfg
                    .rules
                    .iter()
                    .position(|r| r.matches(at.name, at.user, text, query.query_hash));
                let Some(i) = found else {
                    // Else auto mode's choice (see `auto`), after the rules.
                    let chosen = cfg.mode == crate::config::cache::CacheMode::Auto
                        && query.shape.is_some_and(|s| auto::chosen(s));
                    if !chosen {
                        return None;
                    }
                    let place = cfg.rules.len() + 1;
                    return Some((
                        Chosen::by_section(cfg, cfg.default_ttl),
                        place,
                        rules.get(place)?,
                    ));
                };
                let r = &cfg.rules[i];
                Some((
                    Chosen {
                        ttl: r.ttl,
                        cache_empty: r.cache_empty,
                        max_result_bytes: r.max_result_bytes,
                        transactions: r.transactions,
                        refresh_at: r.refresh_at,
                    },
                    i,
                    rules.get(i)?,
                ))
            }
        }
    }

    /// Whether a rule or hint wants `query`, whether it may be cached, and whether its key
    /// (in `client.key`) is stored.
    fn decide(
        &self,
        client: &mut ClientCache,
        at: &Where<'_>,
        query: Candidate<'_>,
        may_wait: bool,
    ) -> Lookup {
        let generation = self.generation.load(std::sync::atomic::Ordering::Acquire);
        if client.settings.as_ref().is_none_or(|s| s.0 != generation) {
            client.settings = Some((generation, self.config.load_full(), self.rules.load_full()));
        }
        let Some((_, cfg, rules)) = &client.settings else {
            return Lookup::Pass;
        };
        let hint = if cfg.hints { self.hint(&query) } else { None };
        let Some((rule, place, stats)) = self.choose(cfg, rules, hint, at, &query) else {
            return Lookup::Pass;
        };
        let figures = query.shape.map(|s| &s.stats);
        if let Some(f) = figures {
            ShapeStats::note(&f.chosen, (place + 1).min(u16::MAX as usize) as u16);
        }
        let bypass = |why: Bypass| {
            self.count(why);
            stats.bypasses.add(1);
            if let Some(f) = figures {
                ShapeStats::note(&f.bypass, (why.index() + 1) as u16);
            }
            Lookup::Pass
        };
        if let Some(why) = client.not_served() {
            return bypass(why);
        }
        // A read before the block's isolation is asked (the question takes a snapshot).
        let reads = match &query.analysis.read {
            Ok(reads) => reads,
            Err(why) => return bypass(*why),
        };
        let in_block = match in_block(at, &rule, query.portal) {
            Ok(in_block) => in_block,
            Err(Some(why)) => return bypass(why),
            Err(None) => return Lookup::Isolation,
        };
        if at.wal_behind {
            return bypass(Bypass::WalBehind);
        }
        let plan = match self.plan_or_resolve(client, at, &query, reads) {
            Ok(plan) => plan,
            Err(resolve) => return Lookup::Resolve(resolve),
        };
        if let Err(why) = &plan.slots {
            return bypass(*why);
        }
        if in_block {
            if let Some(why) = self.not_in_this_block(at, client, &query, &plan) {
                return bypass(why);
            }
        }
        let key = KeyRef::new(&client.key);
        let refresh = match self.stored(&key, &mut client.spares, stats, may_wait) {
            Stored::Valid(entry) => {
                // Not run: the read (whose functions the plan found harmless) writes nothing.
                if client
                    .pending
                    .last()
                    .is_some_and(|p| Arc::ptr_eq(p, query.analysis))
                {
                    client.pending.pop();
                }
                return hit(entry, stats, figures);
            }
            Stored::Refresh => true,
            Stored::Absent => false,
        };
        let key_hash = key.hash;
        let flight = client.spares.flight.take().unwrap_or_default();
        if refresh {
            // Its flight started with the claim.
            stats.refreshes.fetch_add(1, Relaxed);
        } else if let Err(running) = self.flights.start(key_hash, &flight) {
            client.spares.flight = Some(flight);
            return if may_wait {
                Lookup::Wait(running)
            } else {
                // Waited once already: run it without filling.
                Lookup::Pass
            };
        } else {
            stats.misses.add(1);
            if let Some(f) = figures {
                ShapeStats::note(&f.bypass, 0);
                f.cache_figures().misses.add(1);
            }
        }
        // A refresh is stored whatever the admission says: its key is read.
        let admit_after = if refresh { 1 } else { cfg.admit_after };
        self.start_fill(
            client,
            admit_after,
            (at.database, &query.values),
            Miss {
                key_hash,
                flight,
                chosen: rule,
                // A reference taken for a fill only: on a hit, taking one would write a count
                // that every worker's hits write.
                stats: stats.clone(),
                plan,
                extended: query.extended,
                in_block,
                shape: query.shape.cloned(),
            },
        );
        Lookup::Miss
    }

    /// Why a read in a READ COMMITTED block may not be answered there: the block wrote what
    /// it reads, or its Execute's row limit may leave rows in its portal (see [`Portal`]).
    fn not_in_this_block(
        &self,
        at: &Where<'_>,
        client: &ClientCache,
        query: &Candidate<'_>,
        plan: &Plan,
    ) -> Option<Bypass> {
        if self.block_wrote(at.database, &client.pending, query.analysis, &plan.tables) {
            return Some(Bypass::WrittenInTransaction);
        }
        let types = match query.values {
            rows::Values::Bind { types, .. } => types,
            _ => &[],
        };
        (query.portal == Portal::Limited && !plan.one_row.holds(types))
            .then_some(Bypass::RowLimitInBlock)
    }

    /// The entry stored for `key`: valid, valid but to be refreshed by this client (claimed,
    /// its flight started with `spares`' flight), or none (an invalid one is removed).
    fn stored(
        &self,
        key: &KeyRef<'_>,
        spares: &mut Spares,
        stats: &RuleStats,
        may_wait: bool,
    ) -> Stored {
        let Some(entry) = self.store.get(key) else {
            return Stored::Absent;
        };
        let now = Instant::now();
        if entry.expires <= now || !self.versions.unchanged(&entry.seen) {
            if self.store.remove(key).is_some() {
                stats.invalidations.fetch_add(1, Relaxed);
            }
            return Stored::Absent;
        }
        // A read late in its life refreshes it: this client's query runs (once, on one
        // client: it claims the entry) and the others keep getting hits meanwhile.
        if may_wait && entry.refresh_due(now) && !entry.refreshing.swap(true, Relaxed) {
            let flight = spares.flight.get_or_insert_default();
            if self.flights.start(key.hash, flight).is_ok() {
                return Stored::Refresh;
            }
            entry.refreshing.store(false, Relaxed);
        }
        Stored::Valid(entry)
    }
}

/// Whether a query chosen by `rule` (leaving `portal`) is looked up in a transaction block
/// (`Ok(true)`), outside one (`Ok(false)`), or not: `Err(Some(why))`, counted (a named
/// portal, which outlives the Sync in a block, among them); `Err(None)`: the block's isolation
/// must be asked first ([`Lookup::Isolation`]).
fn in_block(at: &Where<'_>, rule: &Chosen, portal: Portal) -> Result<bool, Option<Bypass>> {
    match at.transaction {
        Transaction::Idle => Ok(false),
        Transaction::Block { .. } if portal == Portal::Named => {
            Err(Some(Bypass::NamedPortalInBlock))
        }
        Transaction::Block { .. } if !rule.transactions => Err(Some(Bypass::InTransaction)),
        Transaction::Block { read_committed } => match read_committed {
            Some(true) => Ok(true),
            Some(false) => Err(Some(Bypass::Isolation)),
            None if at.wal_behind => Err(Some(Bypass::WalBehind)),
            None => Err(None),
        },
        Transaction::Busy => Err(Some(Bypass::InTransaction)),
    }
}

/// Counts a hit on `entry` (chosen by the rule of `stats`; of a shape with `figures`).
#[inline]
fn hit(entry: Arc<Entry>, stats: &RuleStats, figures: Option<&ShapeStats>) -> Lookup {
    entry.hits.fetch_add(1, Relaxed);
    stats.hits.add(1);
    if let Some(f) = figures {
        ShapeStats::note(&f.bypass, 0);
        f.cache_figures().hits.add(1);
    }
    Lookup::Hit(entry)
}

/// What the store holds for a key (see [`ResultCache::stored`]).
enum Stored {
    Valid(Arc<Entry>),
    Refresh,
    Absent,
}

/// A query the cache is asked about.
pub(super) struct Candidate<'a> {
    /// What its comments ask (read from the client's text: the lexer's comments).
    hints: hint::Hints,
    /// Whether a malformed hint of its shape or statement was logged.
    hint_warned: &'a std::sync::atomic::AtomicBool,
    /// What rules match: the normalized text (simple queries) or the statement's text.
    pub(super) text: &'a [u8],
    /// The same, shareable (for the entry), when it is at hand.
    pub(super) display: Option<&'a Arc<str>>,
    /// Its plans' key (with the search_path's), apart for the two protocols.
    pub(super) hash: u64,
    /// What a rule's `query_hash` matches: its shape's, the same for both protocols.
    query_hash: u64,
    pub(super) analysis: &'a Arc<Analysis>,
    extended: bool,
    /// Its shape (a simple query's, or its statement's), whose figures (SHOW QUERIES) the
    /// decision adds to.
    shape: Option<&'a Arc<Shape>>,
    /// Its values (which rows a point read reads).
    values: rows::Values<'a>,
    /// What it leaves of its portal, which in a transaction block outlives the Sync.
    portal: Portal,
}

/// What a query leaves of its portal. In a transaction block the Sync does not close it: a
/// hit's is made again on the server if the client uses it (see
/// `Session::portal_left_by_hit`), which holds only for a portal run to its end.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Portal {
    /// None (a simple query), or the unnamed one run to its end.
    Ended,
    /// The unnamed one, run to a row limit: at its end only if the read returns at most one
    /// row (see [`rows::OneRow`]).
    Limited,
    /// A named one: not answered in a block.
    Named,
}

/// An extended-protocol batch the cache may answer without a server: `[Parse ""] Bind
/// [Describe portal] Execute Sync`, all of it already read. The Execute's row limit is part
/// of the key (asyncpg's `fetchrow` and `fetchval` ask for one row): its reply ends in
/// PortalSuspended when rows are left, which the Sync makes final, as it closes the portal
/// outside a transaction block. In a block the portal outlives the Sync: a row-limited batch
/// is answered there only for a read that returns at most one row (see [`Portal`]).
pub struct Batch<'a> {
    pub parse: Option<crate::protocol::frontend::Parse<'a>>,
    pub bind: crate::protocol::frontend::Bind<'a>,
    pub describe: bool,
    /// The Execute's row limit, 0 for all rows (PostgreSQL reads a negative one as 0).
    pub max_rows: i32,
    /// Bytes of the whole batch.
    pub len: usize,
}

/// Reads the batch at the start of `input`, if it is one the cache handles.
pub fn batch(input: &[u8]) -> Option<Batch<'_>> {
    use crate::protocol::frontend::{self as fe, Bind, Execute, Parse, Target};
    // A message not all there, or with an impossible length, ends the batch: the session's
    // own framing deals with it.
    let mut messages = crate::protocol::messages(input);
    let mut next = || messages.next();
    let (mut tag, mut body) = next()?;
    let mut parse = None;
    if tag == fe::PARSE {
        let p = Parse::parse(body)?;
        if !p.name.is_empty() {
            return None;
        }
        parse = Some(p);
        (tag, body) = next()?;
    }
    if tag != fe::BIND {
        return None;
    }
    let bind = Bind::parse(body)?;
    if parse.is_some() && !bind.statement.is_empty() {
        return None;
    }
    (tag, body) = next()?;
    let mut describe = false;
    if tag == fe::DESCRIBE {
        let d = Target::parse(body)?;
        if d.kind != b'P' || d.name != bind.portal {
            return None;
        }
        describe = true;
        (tag, body) = next()?;
    }
    if tag != fe::EXECUTE {
        return None;
    }
    let e = Execute::parse(body)?;
    if e.portal != bind.portal {
        return None;
    }
    let max_rows = e.max_rows.max(0);
    let (tag, body) = next()?;
    if tag != fe::SYNC || !body.is_empty() {
        return None;
    }
    Some(Batch {
        parse,
        bind,
        describe,
        max_rows,
        len: messages.at,
    })
}

/// The first tier's key of a simple query's text in a client's context, written to `key`.
fn raw_key(key: &mut Vec<u8>, context: &[u8], sql: &[u8]) {
    key.clear();
    key.extend_from_slice(context);
    key.push(0xff); // no UTF-8 text holds it: the context's end, unambiguously
    key.extend_from_slice(sql);
}

/// A normalized query text without the `;` that may end it (and the blanks around): `SELECT
/// 1;` and `SELECT 1` get the same replies, and share an entry (pgbench sends the `;`, most
/// drivers do not).
pub(super) fn statement_text(text: &[u8]) -> &[u8] {
    let trimmed = text.trim_ascii_end();
    trimmed
        .strip_suffix(b";")
        .map_or(trimmed, |t| t.trim_ascii_end())
}

/// How the chosen rule or hint caches.
#[derive(Debug, Clone, Copy)]
pub(super) struct Chosen {
    pub(super) ttl: Duration,
    pub(super) cache_empty: bool,
    pub(super) max_result_bytes: usize,
    /// Answered and filled inside READ COMMITTED transaction blocks (see [`Transaction`]).
    transactions: bool,
    /// The part of the TTL after which a read refreshes the entry.
    pub(super) refresh_at: f64,
}

impl Chosen {
    /// How a hint or auto mode caches, which no rule shapes: the `[cache]` section's
    /// defaults, with `ttl`.
    fn by_section(cfg: &CacheConfig, ttl: Duration) -> Chosen {
        Chosen {
            ttl,
            cache_empty: true,
            max_result_bytes: cfg.max_result_bytes,
            transactions: true,
            refresh_at: cfg.refresh_at,
        }
    }
}

/// A statement's key by its text and parameter types (`e`, each with its length).
fn push_text(key: &mut Vec<u8>, text: &[u8], types: &[u8]) {
    key.push(b'e');
    for part in [text, types] {
        key.extend_from_slice(&(part.len() as u32).to_le_bytes());
        key.extend_from_slice(part);
    }
}

/// The rest of a batch's key: whether its portal is described, the Execute's row limit, the
/// Bind's formats, values and result formats.
fn push_execution(key: &mut Vec<u8>, batch: &Batch<'_>) {
    key.push(u8::from(batch.describe));
    key.extend_from_slice(&batch.max_rows.to_le_bytes());
    key.extend_from_slice(batch.bind.rest);
}

#[cfg(test)]
mod tests {
    use super::super::client::FirstTierMisses;
    use super::super::{ClientCache, Entry, ResultCache, RuleStats};
    use super::statement_text;
    use crate::config::cache::CacheConfig;
    use bytes::Bytes;
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn entry() -> Arc<Entry> {
        let rule = RuleStats::default();
        rule.chooses.store(true, Relaxed);
        Arc::new(Entry {
            reply: Bytes::from_static(b"reply"),
            expires: Instant::now() + Duration::from_secs(60),
            seen: Default::default(),
            rule: Arc::new(rule),
            text: "".into(),
            tables: Arc::new([]),
            database: "db".into(),
            hits: Default::default(),
            shape: None,
            refresh_at: Instant::now() + Duration::from_secs(48),
            refreshing: Default::default(),
        })
    }

    /// An enabled cache and a client with its context.
    fn cache_and_client() -> (ResultCache, Box<ClientCache>) {
        let cache = ResultCache::new(
            &CacheConfig {
                enabled: true,
                ..Default::default()
            },
            Arc::new(crate::query::shapes::Shapes::new(100)),
        );
        let mut client = ClientCache::new(false, &Arc::from("db"));
        client.set_context(
            1,
            0,
            "db",
            (None, true),
            [Some("role"), None, None],
            &["role"],
        );
        (cache, client)
    }

    /// The first tier learns a text at its first hit in the second tier, and only the text
    /// that its last lookup keyed.
    #[test]
    fn the_first_tier_learns_the_text_it_was_asked_for() {
        let (cache, mut client) = cache_and_client();
        let (one, two) = (entry(), entry());
        assert!(cache.raw_hit(&mut client, b"SELECT 1", false).is_none());
        cache.remember_raw(&mut client, &one);
        let hit = cache
            .raw_hit(&mut client, b"SELECT 1", false)
            .expect("learnt");
        assert!(Arc::ptr_eq(&hit, &one));
        // A later message that did not ask the first tier teaches it nothing.
        client.forget_message();
        cache.remember_raw(&mut client, &two);
        let hit = cache
            .raw_hit(&mut client, b"SELECT 1", false)
            .expect("still known");
        assert!(Arc::ptr_eq(&hit, &one));
        // Another context does not see it.
        client.set_context(
            2,
            0,
            "db",
            (None, true),
            [Some("other role"), None, None],
            &["other role"],
        );
        assert!(cache.raw_hit(&mut client, b"SELECT 1", false).is_none());
    }

    /// After a streak of first-tier misses a client probes one text in `EVERY`, and still
    /// learns; a hit at a probe brings every text back to the first tier.
    #[test]
    fn a_client_whose_texts_keep_missing_probes_the_first_tier_less_often() {
        let (cache, mut client) = cache_and_client();
        let (streak, every) = (FirstTierMisses::STREAK, FirstTierMisses::EVERY);
        for i in 0..streak {
            assert!(cache
                .raw_hit(&mut client, format!("SELECT {i}").as_bytes(), false)
                .is_none());
        }
        let one = entry();
        assert!(cache.raw_hit(&mut client, b"SELECT 1", false).is_none());
        cache.remember_raw(&mut client, &one);
        let unprobed = (0..every)
            .take_while(|_| cache.raw_hit(&mut client, b"SELECT 1", false).is_none())
            .count();
        assert_eq!(unprobed, usize::from(every) - 2, "learnt while not probed");
        for _ in 0..2 * streak {
            let hit = cache
                .raw_hit(&mut client, b"SELECT 1", false)
                .expect("probed again");
            assert!(Arc::ptr_eq(&hit, &one));
        }
    }

    /// A text too long for the client to keep its first-tier key is looked up, not learnt.
    #[test]
    fn the_first_tier_does_not_learn_a_key_it_did_not_keep() {
        let (cache, mut client) = cache_and_client();
        let long = vec![b'x'; super::MAX_KEPT_BUFFER + 1];
        assert!(cache.raw_hit(&mut client, &long, false).is_none());
        cache.remember_raw(&mut client, &entry());
        assert_eq!(cache.raw.len(), 0);
    }

    #[test]
    fn a_final_semicolon_is_not_part_of_the_key() {
        assert_eq!(statement_text(b"SELECT $1;"), b"SELECT $1");
        assert_eq!(statement_text(b"SELECT $1 ; \n"), b"SELECT $1");
        assert_eq!(statement_text(b"SELECT $1"), b"SELECT $1");
        assert_eq!(statement_text(b"SELECT 1 AS \";\""), b"SELECT 1 AS \";\"");
    }
}
