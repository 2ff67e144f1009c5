//! Invalidation by the writes pgmemo sees: what each statement a client sends may write
//! ([`ResultCache::note_query`], [`ResultCache::note_statement`]), noted on the client and
//! bumped once its transaction is over (`ClientCache::settle`, [`ResultCache::apply`]), and
//! again, for a client that left with work still running, once that work's server has ended
//! ([`Unfinished`]): the tables, rows and columns it reaches, through the triggers, cascades
//! and functions the catalog snapshot shows; and CACHE FLUSH ([`ResultCache::flush`]). The
//! versions it bumps are [`versions`](super::versions)'; the writes read from the WAL are the
//! `wal` module's. It errs on the side of more: a text not analyzed, a stale snapshot or a
//! table with triggers counts as a write to all of its database's results.

use super::client::ClientCache;
use super::plans::catalog_slot;
use super::{columns, rows, ResultCache, Shape};
use crate::config::cache::CacheConfig;
use crate::query::analysis::{self, Analysis, Bypass, Flush};
use crate::query::Reader;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Texts longer than this are not analyzed for their writes: they invalidate their database.
const MAX_ANALYZED_TEXT: usize = 64 * 1024;

impl ResultCache {
    /// Everything cached becomes stale (entries go lazily, at lookup or eviction).
    fn invalidate_all(&self) {
        self.flushes.fetch_add(1, Relaxed);
        self.versions.bump_all();
    }

    /// Everything cached for `database`, and what pgmemo knows of its catalog, becomes stale.
    fn invalidate_database(&self, database: &str) {
        self.flushes.fetch_add(1, Relaxed);
        self.versions.bump(catalog_slot(&self.versions, database));
        self.versions.bump_database(database);
    }

    /// The slots of `database` as a whole and of its catalog, which every result and plan of
    /// it depends on.
    pub fn database_slots(&self, database: &str) -> [u32; 2] {
        [
            catalog_slot(&self.versions, database),
            self.versions.database_slot(database),
        ]
    }

    /// `CACHE FLUSH`: everything, one database's entries, or what read one table.
    pub fn flush(&self, what: FlushTarget<'_>) {
        match what {
            FlushTarget::All => {
                self.invalidate_all();
                self.store.clear();
                self.raw.clear();
            }
            FlushTarget::Database(db) => {
                self.invalidate_database(db);
                self.store.retain(|_, e| &*e.database != db);
            }
            FlushTarget::Table(db, table) => {
                self.flushes.fetch_add(1, Relaxed);
                self.versions.bump_table(db, table);
                self.store
                    .retain(|_, e| &*e.database != db || !e.tables.iter().any(|t| &**t == table));
            }
        }
        self.admission.shrunk();
    }

    /// The shape of a text, with what was derived for it (once per shape): the lexer's shape
    /// when it read the text, else the text itself. None when it is too long to analyze or
    /// not UTF-8.
    fn shape(&self, sql: &[u8], reader: &mut Reader) -> Option<Arc<Shape>> {
        let shape = match reader.shape(sql, &self.shapes) {
            Ok((lexed, shape)) => {
                shape.derived(sql, &lexed.literals);
                shape.clone()
            }
            Err(_) if sql.len() <= MAX_ANALYZED_TEXT => {
                let shape = self.shapes.raw(sql);
                shape.stats.calls.fetch_add(1, Relaxed);
                shape.derived(sql, &[]);
                shape
            }
            Err(_) => return None,
        };
        shape.analysis()?;
        Some(shape)
    }

    /// Notes what a Query the client sent may change (see [`ClientCache::settle`]); returns
    /// what was decided for its text, for [`ResultCache::lookup`].
    pub fn note_query(
        &self,
        client: &mut ClientCache,
        sql: &[u8],
        reader: &mut Reader,
    ) -> Option<Arc<Shape>> {
        if client.nonstandard_strings {
            // Read by the lexers as the server would not: what it writes is not known, and
            // it is not cached.
            client.note(&FLUSH_DATABASE);
            self.count(Bypass::NonstandardStrings);
            return None;
        }
        let shape = self.shape(sql, reader);
        match shape.as_ref().and_then(|s| Some((s, s.analysis()?))) {
            Some((shape, analysis)) => {
                let values = match reader.lexed() {
                    Some(lexed) if !shape.is_raw() => rows::Values::Lexed(lexed),
                    _ => rows::Values::None,
                };
                self.note(client, analysis, &values)
            }
            None => client.note(&FLUSH_DATABASE),
        }
        shape
    }

    /// Notes a message whose writes are not known (a FunctionCall): all of the database's
    /// results may change.
    pub fn note_unknown_write(&self, client: &mut ClientCache) {
        client.note(&FLUSH_DATABASE);
    }

    /// Notes what executing a statement (bound by `bind`) may change.
    pub fn note_statement(
        &self,
        client: &mut ClientCache,
        statement: &crate::statements::Statement,
        bind: &crate::protocol::frontend::Bind<'_>,
    ) {
        let values = rows::Values::Bind {
            rest: bind.rest,
            types: &statement.key.param_types,
        };
        self.note(client, statement_analysis(statement), &values);
    }

    /// Notes `analysis`, and a write to all of the database's results when reading what it
    /// names may write (the catalog's
    /// [`Snapshot::reading_may_write`](super::catalog::Snapshot::reading_may_write)). A
    /// snapshot older than the database's catalog has nothing to say: the DDL since flushed
    /// the database, and no result of it is stored before the snapshot is read again.
    fn note(&self, client: &mut ClientCache, analysis: &Arc<Analysis>, values: &rows::Values<'_>) {
        client.note(analysis);
        if let Some(write) = &analysis.effects.rows {
            self.note_rows(client, write, values);
        }
        let reads = &analysis.effects.reads;
        // One load on the common path: no database read yet has a view or policy that writes.
        if reads.is_empty() || !self.reading_writes.load(Relaxed) {
            return;
        }
        let snapshots = self.snapshots.pin();
        let writes = snapshots
            .get(&*client.database)
            .is_some_and(|s| self.is_current(s, &client.database) && s.reading_may_write(reads));
        if writes {
            client.note(&FLUSH_DATA);
        }
    }

    /// Notes the rows `write` writes in this execution (`values`), or, when its text does not
    /// name them all by its table's row key, that its table's rows are not known (see
    /// [`rows`]).
    fn note_rows(
        &self,
        client: &mut ClientCache,
        write: &crate::query::point::RowWrite,
        values: &rows::Values<'_>,
    ) {
        if client.pending_rows.len() > MAX_PENDING_ROWS {
            // A long transaction of row writes: all of the database's data instead.
            client.pending_rows.clear();
            client.note(&FLUSH_DATA);
        }
        let (database, pending) = (&*client.database, &mut client.pending_rows);
        self.with_snapshot(database, |snapshot| {
            let table = &*write.table;
            let before = pending.len();
            let named = snapshot.and_then(|s| s.row_key(table)).is_some_and(|key| {
                rows::push_write_slots(write, key, &self.versions, database, values, pending)
            });
            let figures = &self.row_figures;
            if named {
                let n = pending.len() - before;
                figures.rows_bumped.fetch_add(n as u64, Relaxed);
            } else {
                pending.push(self.versions.unknown_rows_slot(database, table));
                figures.unknown_rows.fetch_add(1, Relaxed);
            }
            let of = snapshot.and_then(|s| s.table_columns(table));
            columns::push_write(write, of, &self.versions, database, values, pending)
        });
    }

    /// Bumps what `effects` may have changed in `database`, and the slots of `rows` (see
    /// [`ClientCache::pending_rows`]).
    pub(super) fn apply(&self, database: &str, effects: &[Arc<Analysis>], rows: &[u32]) {
        let reach = self.reach(database, effects, |table, by_row| {
            if by_row {
                // Its rows' slots (or its unknown-rows slot) are among `rows`.
                self.versions.bump_table_writes(database, table);
            } else {
                self.versions.bump_table(database, table);
            }
            false
        });
        self.versions.bump_slots(rows);
        match reach {
            Reach::Tables => {}
            // Data only: the catalog knowledge stays good.
            Reach::Data => {
                self.flushes.fetch_add(1, Relaxed);
                self.versions.bump_database(database);
            }
            Reach::Database => self.invalidate_database(database),
            Reach::All => self.invalidate_all(),
        }
    }

    /// Whether the statements of the client's open block (`pending`) may have written
    /// anything a result read through `slots` depends on: then the block reads its own
    /// writes there, which are nobody else's. `own`: the analysis of the read looked up,
    /// whose functions its plan found harmless (it writes nothing, wherever it ran before).
    pub(super) fn block_wrote(
        &self,
        database: &str,
        pending: &[Arc<Analysis>],
        own: &Arc<Analysis>,
        tables: &[Box<str>],
    ) -> bool {
        if pending.iter().all(|p| Arc::ptr_eq(p, own)) {
            return false;
        }
        let mut wrote = false;
        let reach = self.reach(database, pending, |table, _| {
            wrote = tables.iter().any(|t| **t == *table);
            wrote
        });
        wrote || reach != Reach::Tables
    }

    /// What `effects` may have changed in `database`: each table a write reaches is passed to
    /// `table` (which returns true to stop early: the answer is then [`Reach::Tables`]), with
    /// whether the write is the one its rows were noted for (see [`ClientCache::pending_rows`]:
    /// the statement's own table, not what a write to it reaches), and the answer says
    /// whether more than those tables may have changed.
    fn reach(
        &self,
        database: &str,
        effects: &[Arc<Analysis>],
        mut table: impl FnMut(&str, bool) -> bool,
    ) -> Reach {
        let snapshots = self.snapshots.pin();
        let known = snapshots.get(database);
        let snapshot = known.filter(|s| self.is_current(s, database));
        // A snapshot older than the last DDL: triggers, cascades and functions may have
        // changed, so a write may reach anything. (No snapshot at all: nothing is cached for
        // the database yet beyond what its tables' own versions guard.)
        let stale = known.is_some() && snapshot.is_none();
        let mut whole = false;
        for a in effects {
            let e = &a.effects;
            match e.flush {
                Flush::All => return Reach::All,
                Flush::Database => return Reach::Database,
                Flush::Data => whole = true,
                Flush::None => {}
            }
            let by_row = |t: &str| e.rows.as_ref().is_some_and(|r| *r.table == *t);
            for written in &e.writes {
                match snapshot.map(|s| s.reached_by_write(written)) {
                    Some(Some(reached)) => {
                        let own = by_row(written);
                        if reached
                            .iter()
                            .enumerate()
                            .any(|(i, t)| table(t, own && i == 0))
                        {
                            return Reach::Tables;
                        }
                    }
                    // A table with triggers or rules.
                    Some(None) => whole = true,
                    None => {
                        if table(written, false) {
                            return Reach::Tables;
                        }
                        whole |= stale;
                    }
                }
            }
            match snapshot {
                Some(s) => whole |= e.calls.iter().any(|c| s.call_may_write(c)),
                None => whole |= stale && !e.calls.is_empty(),
            }
        }
        if whole {
            Reach::Data
        } else {
            Reach::Tables
        }
    }
}

/// How far a set of writes reaches (see [`ResultCache::reach`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// The tables passed on, no more.
    Tables,
    /// Any data of the database (its catalog knowledge stays good).
    Data,
    /// Anything of the database.
    Database,
    /// Anything at all.
    All,
}

/// What was decided for a registry statement, made at its first use by the cache.
pub(super) fn statement_analysis(statement: &crate::statements::Statement) -> &Arc<Analysis> {
    statement
        .cache_analysis
        .get_or_init(|| match std::str::from_utf8(&statement.key.query) {
            Ok(text) if text.len() <= MAX_ANALYZED_TEXT => Arc::new(analysis::analyze(text)),
            _ => FLUSH_DATABASE.clone(),
        })
}

/// What CACHE FLUSH removes.
pub enum FlushTarget<'a> {
    All,
    Database(&'a str),
    Table(&'a str, &'a str),
}

/// The most row slots a client's open transaction keeps before its writes count as writes
/// to all of its database's data.
const MAX_PENDING_ROWS: usize = 4096;

/// The row counters of `config`: its `row_versions`, or one per 128 bytes of its memory.
pub(super) fn row_versions(config: &CacheConfig) -> usize {
    match config.row_versions {
        0 => (config.max_memory / 128).max(64),
        n => n as usize,
    }
}

/// What a statement pgmemo cannot analyze may change: anything in its database.
pub(super) static FLUSH_DATABASE: std::sync::LazyLock<Arc<Analysis>> =
    std::sync::LazyLock::new(|| {
        Arc::new(Analysis {
            effects: analysis::Effects {
                flush: Flush::Database,
                ..Default::default()
            },
            read: Err(Bypass::NotSelect),
        })
    });

/// What a statement that may write through something the catalog shows (a view or policy
/// calling a volatile function) may change: every result of its database, not its catalog.
static FLUSH_DATA: std::sync::LazyLock<Arc<Analysis>> = std::sync::LazyLock::new(|| {
    Arc::new(Analysis {
        effects: analysis::Effects {
            flush: Flush::Data,
            ..Default::default()
        },
        read: Err(Bypass::NotSelect),
    })
});

/// What a client that left had sent, still running on its server when it left: a write
/// that commits after the bump made then would leave whatever was read in between stored
/// under versions that predate it. Bumped again once the server's connection has ended
/// (its backend ends its transaction before it exits).
pub struct Unfinished {
    pub(super) database: Box<str>,
    pub(super) effects: Vec<Arc<Analysis>>,
    pub(super) rows: Vec<u32>,
}

impl Unfinished {
    /// The server the work ran on has ended it.
    pub fn ended(self, cache: &ResultCache) {
        cache.apply(&self.database, &self.effects, &self.rows);
    }
}
