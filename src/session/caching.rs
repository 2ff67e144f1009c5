//! The session's side of the result cache (see [`crate::cache`]): it shows the cache every
//! statement the client sends (for what it may write), lets it answer simple queries before a
//! server is taken, reads the catalog for it when it asks, and hands it the replies of the
//! queries it wants to keep.

use super::deferred::{unnamed_portal, UnnamedPortal};
use super::{End, Session};
use crate::cache::{ClientCache, Lookup, Resolve, Transaction, Where};
use crate::protocol::backend as be;
use crate::protocol::frontend as fe;
use crate::server::ServerConn;
use bytes::Buf;
use std::sync::atomic::Ordering::Relaxed;

/// Settings that change how a result is written: part of every key (with the server role,
/// the search_path in effect and the statement context).
const KEYED_REPORTED: [&str; 5] = [
    "DateStyle",
    "IntervalStyle",
    "TimeZone",
    "client_encoding",
    "standard_conforming_strings",
];
const KEYED_UNREPORTED: [&str; 2] = ["extra_float_digits", "bytea_output"];

type Rows = Vec<Vec<Option<String>>>;

/// The built-in large-object functions libpq calls by OID (`lo_initialize`): lo_create,
/// lo_open, lo_close, loread, lowrite, lo_lseek, lo_creat, lo_tell, lo_unlink, lo_truncate,
/// lo_lseek64, lo_tell64, lo_truncate64 (OIDs below 16384 are PostgreSQL's own).
const LARGE_OBJECT_FUNCTIONS: [u32; 13] = [
    715, 952, 953, 954, 955, 956, 957, 958, 964, 1004, 3170, 3171, 3172,
];

/// A cache decision that must wait for another client's fetch or read the catalog first.
pub(super) type SlowLookup<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<bool, End>> + Send + 'a>>;

impl Session {
    /// Whether the result cache follows this client: it is on, and the client's statements
    /// are tracked (the cache needs their texts).
    #[inline]
    pub(super) fn caching(&self) -> bool {
        self.plan.stmts.is_some() && self.app.cache.enabled()
    }

    /// Before a client message is planned: the cache notes what a Query or a Bind may
    /// change, and may answer a Query itself. `Ok(true)`: answered, the message is consumed.
    /// `Err`: the decision needs an await (a wait for another client's fetch, a catalog read),
    /// to be awaited by the caller. `query_text_len`: a Query's text length (None: another
    /// message, or a malformed Query).
    ///
    /// Not itself async: the session's task, which lives as long as its client, would keep
    /// room for this function's locals in every state; only the rare slow paths are boxed
    /// futures (a box per query on the common path cost ~350 instructions).
    pub(super) fn cache_client_message(
        &mut self,
        tag: u8,
        len: usize,
        query_text_len: Option<usize>,
    ) -> Result<bool, SlowLookup<'_>> {
        let nonstandard = !self.standard_strings();
        client_cache(
            &mut self.cache,
            self.state.enabled,
            &self.pool,
            in_server_block(&self.server),
        )
        .nonstandard_strings = nonstandard;
        let batch = matches!(tag, fe::PARSE | fe::BIND)
            .then(|| self.batch_transaction())
            .flatten();
        if let Some(transaction) = batch {
            self.cache_context();
            match self.batch_lookup(transaction, true) {
                Ok(true) => return Ok(true),
                Ok(false) => {}
                Err(step) => {
                    return Err(Box::pin(async move {
                        if self.cached_batch(step).await? {
                            return Ok(true);
                        }
                        match self.cache_note_message(tag, len, query_text_len) {
                            Ok(answered) => Ok(answered),
                            Err(slow) => slow.await,
                        }
                    }))
                }
            }
        }
        self.cache_note_message(tag, len, query_text_len)
    }

    /// The part of [`Session::cache_client_message`] after a batch's lookup: a Bind's
    /// statement noted, a Query looked up.
    fn cache_note_message(
        &mut self,
        tag: u8,
        len: usize,
        query_text_len: Option<usize>,
    ) -> Result<bool, SlowLookup<'_>> {
        // The cache is reached through `self.app`, not a clone of it: the App's reference
        // count is written by every worker.
        match tag {
            fe::BIND => {
                let client = client_cache(
                    &mut self.cache,
                    self.state.enabled,
                    &self.pool,
                    in_server_block(&self.server),
                );
                let bind = fe::Bind::parse(crate::protocol::body(&self.client.rbuf[..len]));
                let found =
                    bind.and_then(|b| Some((self.plan.stmts.as_ref()?.get(b.statement)?, b)));
                if let Some((statement, bind)) = found {
                    self.app.cache.note_statement(client, statement, &bind);
                }
                Ok(false)
            }
            fe::FUNCTION_CALL => {
                // A function called by OID may write anything (what it is is not looked up),
                // but for libpq's large-object calls, which write only pg_largeobject (a
                // system catalog: never cached).
                let oid = self
                    .client
                    .rbuf
                    .get(5..9)
                    .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
                if oid.is_some_and(|oid| LARGE_OBJECT_FUNCTIONS.contains(&oid)) {
                    return Ok(false);
                }
                let client = client_cache(
                    &mut self.cache,
                    self.state.enabled,
                    &self.pool,
                    in_server_block(&self.server),
                );
                self.app.cache.note_unknown_write(client);
                Ok(false)
            }
            fe::QUERY => {
                // A malformed Query (no terminator) is left to the server, for its own error.
                let Some(text_len) = query_text_len else {
                    return Ok(false);
                };
                if let Some(entry) = self.raw_hit(text_len) {
                    let status = self.status_without_server();
                    self.answer_hit(len, &[], &entry.reply, status);
                    return Ok(true);
                }
                let client = client_cache(
                    &mut self.cache,
                    self.state.enabled,
                    &self.pool,
                    in_server_block(&self.server),
                );
                let sql = fe::query_text_of(&self.client.rbuf, text_len);
                let reader = self.reading.reader.get_or_insert_with(Default::default);
                let Some(shape) = self.app.cache.note_query(client, sql, reader) else {
                    return Ok(false);
                };
                // With no server held (idle, or a block kept without one), the first-tier
                // lookup just brought the context up to date. Else the transaction says
                // whether the cache may answer (a block) or not (busy).
                let first_tier = !self.cache_busy();
                let idle = first_tier && !self.keeps_block();
                let transaction = if idle {
                    Transaction::Idle
                } else {
                    if !first_tier {
                        self.cache_context();
                    }
                    self.transaction()
                };
                match self.lookup_query(text_len, &shape, transaction, true) {
                    Lookup::Pass => Ok(false),
                    Lookup::Miss if self.shared_due(idle) => {
                        Err(Box::pin(
                            async move { self.answer_from_shared(len, &[]).await },
                        ))
                    }
                    Lookup::Miss => Ok(false),
                    Lookup::Hit(entry) => {
                        if first_tier {
                            self.remember_raw(&entry);
                        }
                        let status = self.client_status();
                        self.answer_hit(len, &[], &entry.reply, status);
                        Ok(true)
                    }
                    step => Err(Box::pin(async move {
                        self.cached_query(len, text_len, &shape, step, first_tier)
                            .await
                    })),
                }
            }
            _ => Ok(false),
        }
    }

    /// With WAL invalidation, before a `COMMIT` of a block that wrote (all of it seen,
    /// nothing failed, nothing else in flight): asks the server for the transaction's ID in
    /// the same write, so that its WAL need not bump again what its COMMIT bumps (see
    /// [`crate::cache::own_commits`]). The `COMMIT` is a Query, or the Parse or Bind that
    /// begins an extended-protocol one (JDBC's, tokio-postgres'). The question is a simple
    /// query sent ahead of it, its replies swallowed; an error of it (which PostgreSQL does
    /// not give `txid_current_if_assigned()` short of a cancel) reaches the client, whose
    /// COMMIT then rolls back as PostgreSQL's would after an error.
    #[inline]
    pub(super) fn ask_transaction_id(
        &mut self,
        tag: u8,
        len: usize,
        query_text_len: Option<usize>,
    ) {
        if !matches!(tag, fe::QUERY | fe::PARSE | fe::BIND)
            || !self.app.cache.follows_wal()
            || !self.app.cache.own_commits.asks()
        {
            return;
        }
        let (Some(client), Some(server)) = (
            self.cache
                .as_deref_mut()
                .filter(|c| c.watching() && c.may_ask_transaction_id()),
            self.server.as_mut(),
        ) else {
            return;
        };
        if server.status != b'T' || !self.replies.is_empty() {
            return;
        }
        let message = &self.client.rbuf[..len];
        let text = match tag {
            fe::QUERY => query_text_len.map(|n| fe::query_text_of(&self.client.rbuf, n)),
            fe::PARSE => fe::Parse::parse(crate::protocol::body(message)).map(|p| p.query),
            _ => fe::Bind::parse(crate::protocol::body(message))
                .and_then(|b| self.plan.stmts.as_ref()?.get(b.statement))
                .map(|statement| &statement.key.query[..]),
        };
        let is_commit = text.is_some_and(|text| {
            text.len() <= super::deferred::MAX_CONTROL_LEN
                && crate::query::block::read(text) == Some(crate::query::block::Control::Commit)
        });
        if !is_commit || !client.asks_transaction_id() {
            return;
        }
        fe::query(
            &mut server.wbuf,
            "SELECT pg_catalog.txid_current_if_assigned()",
        );
        self.replies.push_entry(crate::replies::Entry {
            expected: crate::replies::Expected::Internal,
            action: crate::replies::Action::Skip,
            effect: None,
        });
    }

    /// With WAL invalidation, whether this client's database's stream is not caught up (the
    /// cache then neither answers nor stores); starts following the database at its first
    /// lookup.
    /// `settings`: the pool's, loaded by the caller.
    fn wal_behind(&self, settings: &crate::pool::PoolSettings) -> bool {
        if !self.app.cache.follows_wal() {
            return false;
        }
        let database = &settings.target.database_id;
        let max_lag = self.app.cache.max_lag();
        !self.app.wal.ready(
            &self.app.cache,
            || {
                let config = self.app.config.load();
                let cache = &config.cache;
                crate::wal::Setup {
                    target: crate::app::App::wal_login(&config, &self.pool.key, &settings.target),
                    plugin: cache.wal_plugin,
                    publication: cache.publication.clone(),
                    create_publication: cache.create_publication,
                    shutdown: self.app.shutdown_signal(),
                    positions: cache.shared.is_some(),
                }
            },
            database,
            max_lag,
        )
    }

    /// The client's transaction as the cache sees it (see [`Transaction`]), when it is not
    /// idle: a block is one the cache may answer in only with nothing in flight, and not
    /// once it failed.
    fn transaction(&self) -> Transaction {
        let quiet = self.replies.is_empty()
            && !self.replies.in_batch()
            && self.cache.as_ref().is_none_or(|c| c.fill.is_none());
        match self.server.as_ref() {
            Some(s)
                if quiet
                    && s.status == b'T'
                    && s.wbuf.is_empty()
                    && s.rbuf.is_empty()
                    && self.cache.as_ref().is_none_or(|c| !c.blind_block) =>
            {
                Transaction::Block {
                    read_committed: self.cache.as_ref().and_then(|c| c.read_committed),
                }
            }
            // A block kept without a server (see `deferred`): READ COMMITTED.
            None if quiet && self.keeps_block() => Transaction::Block {
                read_committed: Some(true),
            },
            _ => Transaction::Busy,
        }
    }

    /// Asks the server whether the client's open block is READ COMMITTED (see
    /// [`Lookup::Isolation`]): once per block, only when a query the cache would answer
    /// comes in one. Whatever set the isolation (`BEGIN ISOLATION LEVEL`, `SET TRANSACTION`,
    /// `default_transaction_isolation` of the client, its role or its database), the server
    /// knows it.
    async fn ask_isolation(&mut self) -> Result<(), End> {
        let Some(server) = self.server.as_mut().filter(|s| s.status == b'T') else {
            return Ok(());
        };
        let rows = server
            .internal_query("SELECT pg_catalog.current_setting('transaction_isolation')")
            .await;
        let read_committed = match rows {
            Ok(rows) => rows
                .first()
                .and_then(|r| r.first())
                .is_some_and(|v| v.as_deref() == Some("read committed")),
            Err(_) if server.broken => return Err(End::ServerGone("transaction probe".into())),
            Err(_) => false,
        };
        if let Some(c) = self.cache.as_deref_mut() {
            c.read_committed = Some(read_committed);
        }
        Ok(())
    }

    /// The Query at the head of the client's input (its text is `text_len` bytes), answered by
    /// the cache's first tier (its exact text seen before, see `ResultCache::raw_hit`), when
    /// the client may be answered from the cache at all now.
    fn raw_hit(&mut self, text_len: usize) -> Option<std::sync::Arc<crate::cache::Entry>> {
        if self.cache_busy() {
            return None;
        }
        self.cache_context();
        if self.wal_behind(&self.pool.settings_now()) {
            return None;
        }
        let in_block = self.keeps_block();
        let client = self.cache.as_deref_mut()?;
        self.app.cache.raw_hit(
            client,
            fe::query_text_of(&self.client.rbuf, text_len),
            in_block,
        )
    }

    /// After a second-tier hit on the Query at hand: its exact text answers from the first
    /// tier from now on (when the first tier was asked for it: idle).
    fn remember_raw(&mut self, entry: &std::sync::Arc<crate::cache::Entry>) {
        if let Some(client) = self.cache.as_deref_mut() {
            self.app.cache.remember_raw(client, entry);
        }
    }

    /// The client's unnamed portal left by a block's hit (see [`ClientCache::cached_portal`])
    /// is replaced by a Query or a Bind of the unnamed portal, as PostgreSQL's is. Called for
    /// every message before anything answers it.
    #[inline]
    pub(super) fn forget_portal_left_by_hit(&mut self, tag: u8, len: usize) {
        let Some(cache) = self.cache.as_deref_mut() else {
            return;
        };
        if cache.cached_portal.is_none() || !matches!(tag, fe::QUERY | fe::BIND) {
            return;
        }
        let body = crate::protocol::body(&self.client.rbuf[..len]);
        if unnamed_portal(tag, body) == UnnamedPortal::Replaces {
            cache.cached_portal = None;
        }
    }

    /// A message that uses the client's unnamed portal left by a block's hit (an Execute, or
    /// a Describe or Close of it), with a server taken: the portal is made on the server
    /// first as the hit's batch would have left it, run to its end (see
    /// [`super::deferred::run_unnamed`]), so that the message gets what PostgreSQL gives
    /// (`SELECT 0`, the row description). Not while PostgreSQL skips to the Sync: it skips
    /// the message too.
    #[inline]
    pub(super) fn portal_left_by_hit(&mut self, tag: u8, len: usize) {
        let Some(cache) = self.cache.as_deref_mut() else {
            return;
        };
        if cache.cached_portal.is_none()
            || !matches!(tag, fe::EXECUTE | fe::DESCRIBE | fe::CLOSE)
            || self.replies.is_skipping()
        {
            return;
        }
        let body = crate::protocol::body(&self.client.rbuf[..len]);
        if unnamed_portal(tag, body) != UnnamedPortal::Uses {
            return;
        }
        let Some(server) = self.server.as_mut() else {
            return;
        };
        if let Some((statement, bind)) = cache.cached_portal.take() {
            super::deferred::run_unnamed(
                &mut server.wbuf,
                &mut self.replies,
                &statement.key.query,
                &statement.key.param_types,
                &bind,
            );
        }
    }

    /// The transaction status PostgreSQL would report to the client now.
    fn client_status(&self) -> u8 {
        match self.server.as_ref() {
            Some(s) => s.status,
            None => self.status_without_server(),
        }
    }

    /// Something is in flight or a transaction is open: the cache cannot answer.
    fn cache_busy(&self) -> bool {
        // An extended batch whose first messages pgmemo answered itself is still open.
        self.replies.in_batch()
            || self.cache.as_ref().is_some_and(|c| c.fill.is_some())
            || !self.replies.is_empty()
            || self
                .server
                .as_ref()
                .is_some_and(|s| s.status != b'I' || !s.wbuf.is_empty())
    }

    /// Brings the client's key context up to date (settings, role, search_path), rebuilt
    /// only when one of them changed.
    #[inline]
    fn cache_context(&mut self) {
        let (planner_search_path, statement_context) = statements_context(&self.plan);
        let holds = self.cache.as_deref().is_some_and(|client| {
            client.context_holds(self.params.version, statement_context, planner_search_path)
        });
        if !holds {
            self.build_cache_context();
        }
    }

    /// [`Session::cache_context`] when the context may have changed (or there is none yet):
    /// out of line, as the common case, a context that holds, needs none of its frame.
    #[inline(never)]
    fn build_cache_context(&mut self) {
        let (planner_search_path, statement_context) = statements_context(&self.plan);
        let client = client_cache(
            &mut self.cache,
            self.state.enabled,
            &self.pool,
            in_server_block(&self.server),
        );
        let search_path = planner_search_path.or_else(|| self.params.settings.get("search_path"));
        if client.needs_context(self.params.version, statement_context)
            || !client.has_search_path(search_path)
        {
            let settings = self.pool.settings();
            let mut parts: Vec<&str> = vec![&settings.target.user];
            parts.extend(
                KEYED_REPORTED
                    .iter()
                    .map(|n| self.params.reported.get(n).unwrap_or("")),
            );
            parts.extend(
                KEYED_UNREPORTED
                    .iter()
                    .map(|n| self.params.settings.get(n).unwrap_or("")),
            );
            parts.push(search_path.unwrap_or(""));
            // With the session-state watch every setting the client holds (its role too) is
            // known after each transaction that could change one: all are in the key.
            let all_settings;
            if client.keys_all_settings {
                let mut pairs: Vec<_> = self.params.settings.iter().collect();
                pairs.sort();
                all_settings = pairs
                    .iter()
                    .map(|(n, v)| format!("{n}\u{1}{v}"))
                    .collect::<Vec<_>>()
                    .join("\u{2}");
                parts.push(&all_settings);
            }
            let roles = [
                Some(settings.target.user.as_str()),
                self.params.settings.get("role"),
                self.params.settings.get("session_authorization"),
            ];
            client.set_context(
                self.params.version,
                statement_context,
                &settings.target.database_id,
                (search_path, planner_search_path.is_none()),
                roles,
                &parts,
            );
        }
    }

    /// Answers an extended-protocol batch (see [`crate::cache::batch`]) from the cache when
    /// it holds its result, exactly as PostgreSQL would have: ParseComplete, BindComplete, the
    /// RowDescription if the portal was described, the rows, CommandComplete and
    /// ReadyForQuery. `Ok(false)`: the batch runs (filling the cache on a miss it wants);
    /// `Err`: a wait or a catalog read must come first (see [`Session::cached_batch`]). The
    /// caller brought the key context up to date.
    /// `transaction`: the client's as the batch sees it ([`Session::batch_transaction`]).
    fn batch_lookup(
        &mut self,
        transaction: Transaction,
        may_wait: bool,
    ) -> Result<bool, BatchStep> {
        // Loaded once for the lookup (each load of the pool's settings costs ~30 instructions).
        let settings = self.pool.settings_now();
        // Asked again each round: a wait or a catalog read may outlast the stream.
        let wal_behind = self.wal_behind(&settings);
        // Borrowed, not cloned: the App's reference count is written by every worker.
        let app = &self.app;
        let cache = &app.cache;
        let Some(batch) = crate::cache::batch(&self.client.rbuf) else {
            return Ok(false);
        };
        let Some(stmts) = self.plan.stmts.as_mut() else {
            return Ok(false);
        };
        let statement = match &batch.parse {
            Some(p) => stmts.statement_for_parse(&app.registry, p),
            None if stmts.is_stale(batch.bind.statement) => return Ok(false),
            None => match stmts.get(batch.bind.statement) {
                Some(s) => s.clone(),
                None => return Ok(false),
            },
        };
        if !statement.accepted_as_cached() || statement.hidden.is_some() {
            return Ok(false);
        }
        let at = Where {
            database: &settings.target.database_id,
            name: &settings.target.dbname,
            user: &self.info.user,
            transaction,
            wal_behind,
        };
        let client = client_cache(
            &mut self.cache,
            self.state.enabled,
            &self.pool,
            in_server_block(&self.server),
        );
        let (parsed, len) = (batch.parse.is_some(), batch.len);
        let found = cache.lookup_statement(client, &at, &statement, &batch, may_wait);
        match found {
            Lookup::Pass => Ok(false),
            Lookup::Miss
                if shared_due(app, Some(&mut *client), transaction == Transaction::Idle) =>
            {
                Err(BatchStep::Shared {
                    len,
                    parsed,
                    statement,
                })
            }
            Lookup::Miss => Ok(false),
            Lookup::Hit(entry) => {
                if transaction != Transaction::Idle {
                    // In a block the portal outlives the Sync (see `portal_left_by_hit`).
                    client.cached_portal = Some((statement.clone(), batch.bind.rest.into()));
                }
                if parsed {
                    parsed_without_server(stmts, &statement);
                }
                let status = self.client_status();
                self.answer_hit(len, opened(parsed), &entry.reply, status);
                Ok(true)
            }
            step => Err(BatchStep::Cache(step)),
        }
    }

    /// A batch's miss looked up in the shared tier (see [`Session::answer_from_shared`]):
    /// answered as a hit in memory is, its statement bound to the unnamed one when the batch
    /// parsed it.
    async fn batch_from_shared(
        &mut self,
        len: usize,
        parsed: bool,
        statement: std::sync::Arc<crate::statements::Statement>,
    ) -> Result<bool, End> {
        if !self.answer_from_shared(len, opened(parsed)).await? {
            return Ok(false);
        }
        if let Some(stmts) = self.plan.stmts.as_mut().filter(|_| parsed) {
            parsed_without_server(stmts, &statement);
        }
        Ok(true)
    }

    /// The client's transaction, when an extended batch may be answered in it: idle, or a
    /// block (see [`Session::transaction`]).
    fn batch_transaction(&self) -> Option<Transaction> {
        if !self.cache_busy() && !self.keeps_block() {
            return Some(Transaction::Idle);
        }
        match self.transaction() {
            Transaction::Busy => None,
            block => Some(block),
        }
    }

    /// [`Session::batch_lookup`]'s loop after a lookup that asked for `step` first.
    async fn cached_batch(&mut self, mut step: BatchStep) -> Result<bool, End> {
        let mut may_wait = true;
        let mut resolves = 0;
        loop {
            let lookup = match step {
                BatchStep::Cache(lookup) => lookup,
                BatchStep::Shared {
                    len,
                    parsed,
                    statement,
                } => return self.batch_from_shared(len, parsed, statement).await,
            };
            if !self
                .cache_step(lookup, &mut may_wait, &mut resolves)
                .await?
            {
                return Ok(false);
            }
            let Some(transaction) = self.batch_transaction() else {
                return Ok(false);
            };
            match self.batch_lookup(transaction, may_wait) {
                Ok(answered) => return Ok(answered),
                Err(next) => step = next,
            }
        }
    }

    /// One lookup of the Query at the head of the client's input (its text is `text_len`
    /// bytes, the cache decided `shape` for it).
    fn lookup_query(
        &mut self,
        text_len: usize,
        shape: &std::sync::Arc<crate::cache::Shape>,
        transaction: Transaction,
        may_wait: bool,
    ) -> Lookup {
        let settings = self.pool.settings_now();
        // Asked again each round: a wait or a catalog read may outlast the stream.
        let wal_behind = self.wal_behind(&settings);
        let at = Where {
            database: &settings.target.database_id,
            name: &settings.target.dbname,
            user: &self.info.user,
            transaction,
            wal_behind,
        };
        let client = client_cache(
            &mut self.cache,
            self.state.enabled,
            &self.pool,
            in_server_block(&self.server),
        );
        let sql = fe::query_text_of(&self.client.rbuf, text_len);
        let reader = self.reading.reader.get_or_insert_with(Default::default);
        self.app
            .cache
            .lookup(client, &at, sql, reader, shape, may_wait)
    }

    /// Answers a Query from the cache when it holds its result; otherwise leaves the query to
    /// run (filling the cache if it is a miss the cache wants). `first`: a first lookup's
    /// wait or catalog read, to do before looking up again; `first_tier`: no server is held
    /// (the client is idle, or in a block kept without one) and the first tier was asked.
    async fn cached_query(
        &mut self,
        len: usize,
        text_len: usize,
        shape: &std::sync::Arc<crate::cache::Shape>,
        first: Lookup,
        first_tier: bool,
    ) -> Result<bool, End> {
        let idle = first_tier && !self.keeps_block();
        let mut step = Some(first);
        let mut may_wait = true;
        let mut resolves = 0;
        loop {
            if let Some(step) = step.take() {
                if !self.cache_step(step, &mut may_wait, &mut resolves).await? {
                    return Ok(false);
                }
            }
            let transaction = if idle {
                Transaction::Idle
            } else {
                self.transaction()
            };
            match self.lookup_query(text_len, shape, transaction, may_wait) {
                Lookup::Pass => return Ok(false),
                Lookup::Miss if self.shared_due(idle) => {
                    return self.answer_from_shared(len, &[]).await
                }
                Lookup::Miss => return Ok(false),
                Lookup::Hit(entry) => {
                    if first_tier {
                        self.remember_raw(&entry);
                    }
                    let status = self.client_status();
                    self.answer_hit(len, &[], &entry.reply, status);
                    return Ok(true);
                }
                next => step = Some(next),
            }
        }
    }

    /// After a miss outside a transaction block, with the shared tier on:
    /// the fill just opened is told the WAL position its query sees whole (see
    /// `cache::shared`); true: look in the shared tier before the query goes to the server.
    fn shared_due(&mut self, idle: bool) -> bool {
        shared_due(&self.app, self.cache.as_deref_mut(), idle)
    }

    /// Looks the miss up in the shared tier (`cache::shared`); answers the client's `len`
    /// bytes from the entry found when this instance may serve it (after the empty messages
    /// of `opened`, as [`Session::answer_hit`]), and stores it here as a fill from the server
    /// would be. False: the query goes to the server.
    async fn answer_from_shared(&mut self, len: usize, opened: &[u8]) -> Result<bool, End> {
        let app = self.app.clone();
        let Some(shared) = app.cache.shared() else {
            return Ok(false);
        };
        let Some(key) = self
            .cache
            .as_ref()
            .and_then(|c| c.fill.as_ref())
            .map(|f| f.shared_key().to_vec())
        else {
            return Ok(false);
        };
        let Some((position, reply, remaining)) = shared.get(&key).await else {
            return Ok(false);
        };
        let Some(fill) = self.cache.as_deref_mut().and_then(|c| c.fill.as_mut()) else {
            return Ok(false);
        };
        let follower = app.wal.follower(fill.database());
        let covering = |at| follower.and_then(|f| f.covering_after(at));
        if !app.cache.serves_shared(fill, position, covering) {
            shared.stats.refused.fetch_add(1, Relaxed);
            return Ok(false);
        }
        shared.stats.hits.fetch_add(1, Relaxed);
        // Not written back: it is there already, for `remaining`.
        fill.saw(0);
        fill.expires_within(remaining);
        let status = self.client_status();
        let from = self.client.wbuf.len();
        self.answer_hit(len, opened, &reply, status);
        if let Some(client) = self.cache.as_deref_mut() {
            client.capture(&app.cache, &self.client.wbuf[from..]);
        }
        Ok(true)
    }

    /// Answers the client's `consumed` bytes of input from a cache entry: the empty messages
    /// of `opened` (ParseComplete, BindComplete), the entry's bytes (`reply`), ReadyForQuery.
    fn answer_hit(&mut self, consumed: usize, opened: &[u8], reply: &[u8], status: u8) {
        crate::buffers::lend(&mut self.client.wbuf);
        let out = &mut self.client.wbuf;
        let before = out.len();
        for &tag in opened {
            crate::protocol::write_empty_message(out, tag);
        }
        out.extend_from_slice(reply);
        be::ready_for_query(out, status);
        if let Some(kept) = self.kept.as_deref_mut() {
            // A block kept without a server has run a query now (see `deferred`).
            kept.answered = true;
        }
        self.stats.bytes_sent += (out.len() - before) as u64;
        self.client.rbuf.advance(consumed);
        self.stats.query_count += 1;
        self.stats.bytes_received += consumed as u64;
    }

    /// A lookup that must wait for another client's fetch, read the catalog or ask the
    /// block's isolation first: does that, and says whether to look up again (a wait happens
    /// once per query, catalog reads at most twice).
    async fn cache_step(
        &mut self,
        step: Lookup,
        may_wait: &mut bool,
        resolves: &mut u32,
    ) -> Result<bool, End> {
        let app = self.app.clone();
        let cache = &app.cache;
        match step {
            Lookup::Wait(flight) => {
                let limit = app.config.load().cache.flight_wait;
                if !flight.wait(limit).await {
                    cache
                        .flight_timeouts
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                *may_wait = false;
                Ok(true)
            }
            Lookup::Resolve(job) => {
                *resolves += 1;
                if *resolves > 2 {
                    return Ok(false);
                }
                let (snapshot, rows) = self.read_catalog(&job).await?;
                Ok(cache.resolved(*job, snapshot.as_deref(), rows.as_deref().map_err(|_| ())))
            }
            Lookup::Isolation => {
                self.ask_isolation().await?;
                Ok(self
                    .cache
                    .as_ref()
                    .is_some_and(|c| c.read_committed.is_some()))
            }
            Lookup::Pass | Lookup::Miss | Lookup::Hit(_) => Ok(false), // answered by the callers
        }
    }

    /// Runs a catalog read for the cache on the session's own server (session mode, nothing
    /// in flight, or the client's open block) or on one lent by the pool for the purpose.
    /// Inside the client's block the read runs in a savepoint that is rolled back: an error
    /// does not fail the block, and the search_path the read sets (`set_config(..., true)`)
    /// does not outlive it.
    async fn read_catalog(
        &mut self,
        job: &Resolve,
    ) -> Result<(Option<Rows>, Result<Rows, ()>), End> {
        const SAVEPOINT: &str = "SAVEPOINT pgmemo_catalog";
        const UNDO: &str = "ROLLBACK TO SAVEPOINT pgmemo_catalog; RELEASE SAVEPOINT pgmemo_catalog";
        let own = self.server.take();
        let held = own.is_some();
        let mut server: Box<ServerConn> = match own {
            Some(s) => s,
            None => match self.pool.checkout(Some(self.info.killed_flag())).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "no server to read the catalog for the result cache");
                    return Ok((None, Err(())));
                }
            },
        };
        let in_block = held && server.status == b'T';
        let guarded = !in_block || server.internal_query(SAVEPOINT).await.is_ok();
        let snapshot = if job.snapshot && guarded {
            match server.internal_query(Resolve::SNAPSHOT_SQL).await {
                Ok(rows) => Some(rows),
                Err(e) => {
                    tracing::warn!(error = %e, "result cache: reading the catalog failed");
                    None
                }
            }
        } else {
            None
        };
        let rows = match guarded {
            true => server.internal_query(&job.sql).await.map_err(|e| {
                tracing::warn!(error = %e, "result cache: resolving relations failed");
            }),
            false => Err(()),
        };
        let undone = !in_block || !guarded || server.internal_query(UNDO).await.is_ok();
        // A block the reads failed (which the savepoint is for) cannot be given back as it was.
        let gone = held && (server.broken || (in_block && !guarded) || !undone);
        if held {
            self.server = Some(server);
        } else {
            self.pool.checkin(server);
        }
        if gone {
            return Err(End::ServerGone("catalog read".into()));
        }
        Ok((snapshot, rows))
    }

    /// The client is gone: what it sent may still commit.
    /// The client's part of the cache, made now if it has none (a session taken over).
    pub(super) fn client_cache_now(&mut self) -> &mut ClientCache {
        client_cache(
            &mut self.cache,
            self.state.enabled,
            &self.pool,
            in_server_block(&self.server),
        )
    }

    /// The client left: see [`ClientCache::abandon`].
    pub(super) fn cache_abandon(&mut self) -> Option<crate::cache::Unfinished> {
        let client = self.cache.as_mut()?;
        client.abandon(&self.app.cache, &self.pool.settings().target.database_id)
    }
}

/// The client's part of the cache (`cache`), made at its first use for the pool's server
/// database; `keys_all_settings`: see [`ClientCache::keys_all_settings`].
///
/// Made in the middle of a transaction block on a server (the cache was off when the block
/// began: a RELOAD, or an online restart's new process holding it back), it did not see the
/// block's statements, so it answers nothing in that block ([`ClientCache::blind_block`]).
#[inline]
fn client_cache<'a>(
    cache: &'a mut Option<Box<ClientCache>>,
    keys_all_settings: bool,
    pool: &crate::pool::Pool,
    in_block: bool,
) -> &'a mut ClientCache {
    cache.get_or_insert_with(|| {
        let settings = pool.settings_now();
        let mut client = ClientCache::new(keys_all_settings, &settings.target.database_id);
        client.resets_on_discard = settings.mode == crate::config::PoolMode::Session;
        client.blind_block = in_block;
        client
    })
}

/// What of the client's statements a key's context is built from: the search_path the
/// planner follows (a `SET search_path` of the client's), and the statements' context.
#[inline]
fn statements_context(plan: &super::Planning) -> (Option<&str>, u32) {
    let stmts = plan.stmts.as_ref();
    (
        stmts.and_then(|s| s.search_path.effective()),
        stmts.map_or(0, |s| s.context),
    )
}

/// Whether the client's server is in a transaction block.
#[inline]
fn in_server_block(server: &Option<Box<crate::server::ServerConn>>) -> bool {
    server.as_ref().is_some_and(|s| s.status != b'I')
}

/// After one server message was routed (its output, if any, at `out[at..]`): the fill in
/// progress takes its bytes, and the transaction's writes are settled when it ends.
#[inline]
pub(super) fn after_server_message(
    client: &mut ClientCache,
    cache: &crate::cache::ResultCache,
    database: &str,
    out: &[u8],
    tag: u8,
    body: &[u8],
    idle: bool,
) {
    if client.fill.is_some() {
        client.capture(cache, out);
    }
    client.settle(cache, database, tag, body, !out.is_empty(), idle);
}

/// What a batch's lookup asks for before it is answered or runs.
enum BatchStep {
    /// A wait, a catalog read, or the block's isolation (see [`Session::cache_step`]).
    Cache(Lookup),
    /// A miss the shared tier may answer (see [`Session::batch_from_shared`]).
    Shared {
        len: usize,
        parsed: bool,
        statement: std::sync::Arc<crate::statements::Statement>,
    },
}

/// The empty messages a batch answered without a server begins with: ParseComplete when it
/// parsed its statement, BindComplete.
fn opened(parsed: bool) -> &'static [u8] {
    if parsed {
        &[be::PARSE_COMPLETE, be::BIND_COMPLETE]
    } else {
        &[be::BIND_COMPLETE]
    }
}

/// A batch answered without a server parsed `statement`: it is the unnamed statement now
/// (usually bound already: a driver's unnamed statement, parsed each time), and its parse
/// is counted as a hit.
fn parsed_without_server(
    stmts: &mut crate::statements::ClientStatements,
    statement: &std::sync::Arc<crate::statements::Statement>,
) {
    if !stmts.is_bound_to(b"", statement) {
        stmts.set(b"", Some(statement.clone()));
    }
    statement.parse_hits.fetch_add(1, Relaxed);
}

/// [`Session::shared_due`], on the session's parts (a batch's lookup holds its statements).
fn shared_due(app: &crate::app::App, cache: Option<&mut ClientCache>, idle: bool) -> bool {
    if !idle || app.cache.shared().is_none() {
        return false;
    }
    let Some(fill) = cache.and_then(|c| c.fill.as_mut()) else {
        return false;
    };
    let Some(follower) = app.wal.follower(fill.database()) else {
        return false;
    };
    fill.saw(follower.applied().0);
    true
}
