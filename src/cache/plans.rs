//! Plans: which tables a cacheable shape reads under one search_path (and, when the catalog
//! allows, which rows or which columns' values), resolved once per shape, search_path and
//! catalog version ([`Plan`]), and the catalog snapshot of each database they are resolved
//! against. A plan missing or older than the database's last DDL is a [`Resolve`] for the
//! session to run on a server before it looks up again. The lookup (`lookup.rs`) asks for
//! plans, the fill (`store.rs`) follows what they resolved, the invalidation
//! (`invalidation.rs`) reads the snapshots. A catalog that cannot be read makes no plan: the
//! query passes, and is resolved again next time.

use super::client::ClientCache;
use super::lookup::Candidate;
use super::versions::Versions;
use super::{catalog, columns, rows, ResultCache, Where};
use crate::query::analysis::{self, Analysis, Bypass};
use catalog::Snapshot;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Which tables a cacheable shape reads under one search_path, or why it is not cacheable.
pub(super) struct Plan {
    /// The database's catalog version it was resolved at.
    catalog: u64,
    /// Database slot first, then the tables' (a point read's: its table's unknown-rows
    /// slot; its rows' are added per execution).
    pub(super) slots: Result<Box<[u32]>, Bypass>,
    pub(super) tables: Arc<[Box<str>]>,
    /// A read of rows its key names (see [`rows`]).
    pub(super) point: Option<rows::PointPlan>,
    /// A read by column (see [`columns`]): its equalities on columns whose values are
    /// followed (their slots are added per execution). None: not read by column.
    pub(super) filters: Option<Vec<columns::ValueFilter>>,
    /// The tables whose rows its results hold by key (see [`columns::HeldRows`]).
    pub(super) held: Box<[columns::HeldRows]>,
    /// Whether it returns at most one row whatever the data (see [`rows::OneRow`]).
    pub(super) one_row: rows::OneRow,
    /// The text it was resolved for: compared on lookup (the map is keyed by hashes, and
    /// two texts whose hashes collide must not share their tables), and shown in `SHOW
    /// CACHE ENTRIES`.
    pub(super) text: Arc<str>,
}

/// A catalog read the cache needs before it can decide.
pub struct Resolve {
    /// Run first when the database's snapshot is missing or stale.
    pub snapshot: bool,
    /// Resolves the query's relations.
    pub sql: String,
    database: Box<str>,
    plan_key: (u64, u64),
    text: Arc<str>,
    analysis: Arc<Analysis>,
    catalog: u64,
}

impl Resolve {
    pub const SNAPSHOT_SQL: &'static str = catalog::SNAPSHOT_SQL;
}

impl ResultCache {
    /// Calls `f` with the current catalog snapshot of `database` (what writes are known by:
    /// tables' row keys, see [`rows`], and columns, see [`columns`]); None: not known yet, or
    /// older than the database's last DDL.
    pub fn with_snapshot<R>(&self, database: &str, f: impl FnOnce(Option<&Snapshot>) -> R) -> R {
        let snapshots = self.snapshots.pin();
        f(snapshots
            .get(database)
            .map(|s| &**s)
            .filter(|s| self.is_current(s, database)))
    }

    /// The plan of `query` (its relations resolved for the client's search_path) at the
    /// database's current catalog version, or the catalog read that makes it.
    pub(super) fn plan_or_resolve(
        &self,
        client: &ClientCache,
        at: &Where<'_>,
        query: &Candidate<'_>,
        reads: &analysis::Reads,
    ) -> Result<Arc<Plan>, Box<Resolve>> {
        let plan_key = (query.hash, client.path_hash);
        let catalog = self
            .versions
            .get(client.catalog_slot(&self.versions, at.database));
        if let Some(plan) = self.current_plan(plan_key, catalog, query.text) {
            return Ok(plan);
        }
        let snapshot = self
            .snapshots
            .pin()
            .get(at.database)
            .is_none_or(|s| s.generation != catalog);
        // The text, as a string, when the shape has no display text of its own.
        let text = || std::str::from_utf8(query.text).unwrap_or_default().into();
        Err(Box::new(Resolve {
            snapshot,
            sql: catalog::resolve_sql(reads, client.search_path.as_deref()),
            database: at.database.into(),
            plan_key,
            text: query.display.cloned().unwrap_or_else(text),
            analysis: query.analysis.clone(),
            catalog,
        }))
    }

    /// The plan resolved for `text` (its hash and search_path in `plan_key`) at the
    /// database's catalog version `catalog`.
    fn current_plan(&self, plan_key: (u64, u64), catalog: u64, text: &[u8]) -> Option<Arc<Plan>> {
        self.plans
            .get(&plan_key)
            .filter(|plan| plan.catalog == catalog && plan.text.as_bytes() == text)
    }

    /// Takes in what a [`Resolve`] read (`Err`: it could not be read, counted and not
    /// remembered: tried again next time). Returns whether it could be read.
    pub fn resolved(
        &self,
        job: Resolve,
        snapshot_rows: Option<&[Vec<Option<String>>]>,
        rows: Result<&[Vec<Option<String>>], ()>,
    ) -> bool {
        if rows.is_err() || (job.snapshot && snapshot_rows.is_none()) {
            self.count(Bypass::CatalogUnavailable);
            return false;
        }
        if let Some(rows) = snapshot_rows {
            let snapshot = Snapshot::from_rows(job.catalog, rows);
            if snapshot.has_reading_writes() {
                self.reading_writes.store(true, Relaxed);
            }
            self.snapshots
                .pin()
                .insert(job.database.clone(), Arc::new(snapshot));
        }
        let snapshots = self.snapshots.pin();
        let snapshot = snapshots.get(&job.database);
        let reads = job.analysis.read.as_ref().ok();
        let tables: Result<Vec<Box<str>>, Bypass> = match (rows, snapshot, reads) {
            (Ok(rows), Some(snapshot), Some(reads)) if snapshot.generation == job.catalog => {
                catalog::resolved(reads, rows, snapshot)
            }
            _ => Err(Bypass::CatalogUnavailable),
        };
        let point = match (
            &tables,
            reads.and_then(|r| r.filter.as_ref()),
            snapshot,
            rows,
        ) {
            (Ok(tables), Some(filter), Some(snapshot), Ok(rows)) => {
                catalog::point_plan(filter, tables, rows, snapshot)
            }
            _ => None,
        };
        // A read not of rows by key may be read column by column (see [`columns`]).
        let by_column = match (
            &tables,
            reads.and_then(|r| r.columns.as_ref()),
            snapshot,
            rows,
        ) {
            (Ok(tables), Some(reads), Some(snapshot), Ok(rows)) if point.is_none() => {
                columns::plan(
                    reads,
                    tables,
                    rows,
                    snapshot,
                    (&self.versions, &job.database),
                )
            }
            _ => None,
        };
        let (column_slots, filters, held) = match by_column {
            Some(p) => (Some(p.slots), Some(p.filters), p.held.into()),
            None => (None, None, Box::default()),
        };
        let slots = tables.as_ref().map(|tables| {
            let table_slot = |t: &str| match point {
                Some(_) => self.versions.unknown_rows_slot(&job.database, t),
                None => self.versions.table_slot(&job.database, t),
            };
            let database = std::iter::once(self.versions.database_slot(&job.database));
            match column_slots {
                Some(slots) => database.chain(slots).collect::<Box<[u32]>>(),
                None => database
                    .chain(tables.iter().map(|t| table_slot(t)))
                    .collect(),
            }
        });
        let slots = slots.map_err(|e| *e);
        let one_row = match (&tables, reads, snapshot) {
            (Ok(tables), Some(reads), Some(snapshot)) => catalog::one_row(reads, tables, snapshot),
            _ => rows::OneRow::Never,
        };
        self.plans.insert(
            job.plan_key,
            Arc::new(Plan {
                catalog: job.catalog,
                slots,
                tables: tables.unwrap_or_default().into(),
                point,
                filters,
                held,
                one_row,
                text: job.text,
            }),
        );
        true
    }

    /// Whether `snapshot` of `database` was read at the database's current catalog version
    /// (one older than the last DDL is not trusted).
    pub(super) fn is_current(&self, snapshot: &Snapshot, database: &str) -> bool {
        snapshot.generation == self.versions.get(catalog_slot(&self.versions, database))
    }
}

/// The slot of a database's catalog version (bumped by DDL; plans and snapshots older than it
/// are read again).
pub(super) fn catalog_slot(versions: &Versions, database: &str) -> u32 {
    versions.table_slot(database, "\0catalog")
}

#[cfg(test)]
mod tests {
    use super::Plan;
    use crate::cache::ResultCache;
    use crate::config::cache::CacheConfig;
    use std::sync::Arc;

    /// Plans are keyed by hashes: a plan serves only the text it was resolved for, so two
    /// texts whose hashes collide never share the tables that invalidate their results.
    #[test]
    fn a_plan_serves_only_its_own_text() {
        let cache = ResultCache::new(
            &CacheConfig::default(),
            Arc::new(crate::query::shapes::Shapes::new(100)),
        );
        let key = (7, 9);
        cache.plans.insert(
            key,
            Arc::new(Plan {
                catalog: 3,
                slots: Ok(Box::new([1, 2])),
                tables: Arc::new(["a".into()]),
                point: None,
                filters: None,
                held: Box::default(),
                one_row: super::rows::OneRow::Never,
                text: "SELECT x FROM a WHERE id = $1".into(),
            }),
        );
        let plan = cache.current_plan(key, 3, b"SELECT x FROM a WHERE id = $1");
        assert_eq!(plan.expect("its text").tables[0].as_ref(), "a");
        assert!(cache
            .current_plan(key, 3, b"SELECT x FROM b WHERE id = $1")
            .is_none());
        // Resolved before the last DDL: stale.
        assert!(cache
            .current_plan(key, 4, b"SELECT x FROM a WHERE id = $1")
            .is_none());
    }

    /// `cache.max_lag` is read by every lookup from what the last configuration set.
    #[test]
    fn max_lag_follows_the_configuration() {
        let mut config = CacheConfig::default();
        let cache = ResultCache::new(&config, Arc::new(crate::query::shapes::Shapes::new(100)));
        assert_eq!(cache.max_lag(), None);
        config.max_lag = Some(std::time::Duration::from_millis(2500));
        cache.reconfigure(&config);
        assert_eq!(
            cache.max_lag(),
            Some(std::time::Duration::from_millis(2500))
        );
        config.max_lag = None;
        cache.reconfigure(&config);
        assert_eq!(cache.max_lag(), None);
    }
}
