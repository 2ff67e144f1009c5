//! What the database's catalog says, read on the cold path through a server connection:
//!
//! - per database, a [`Snapshot`] of every function's volatility and of what a write to a
//!   table reaches besides the table (user triggers and rules: anything; cascading foreign
//!   keys: the referencing tables; inheritance and partitions: the whole tree; a view: its base
//!   tables). Loaded when the first cacheable query of the database is analyzed, and again
//!   after DDL (a snapshot older than the database's last flush is not trusted: writes then
//!   invalidate the whole database).
//! - per cacheable query and search_path, [`resolve_sql`]: which relations its names are
//!   (through views and partitions down to the tables), and whether all of them may be cached.

use super::rows::{KeyType, OneRow, PointPlan, RowKey};
use crate::params::quote_literal;
use crate::query::analysis::RelName;
use crate::query::analysis::{analyze, Bypass, Reads};
use crate::query::point::{Bound, ReadFilter};
use std::sync::Arc;

/// The snapshot's maps are read for every write a cached block makes and every lookup that
/// checks one (a table's reach, its row key): hashed with foldhash, not the default SipHash,
/// which cost ~100 instructions a name there (callgrind, bench/cache_tx.sql).
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
type HashSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

/// A table's key columns by place (from the snapshot's `k` rows); None: a type not followed.
type KeyColumns = Vec<(u32, Option<(Box<str>, KeyType)>)>;
/// A key column's table OID (as text) and column number.
type KeyAttnum = (String, Option<i16>);

/// What a database's functions and tables do, as of one moment.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// The database's version when the snapshot was read.
    pub generation: u64,
    functions: HashMap<Box<str>, Function>,
    /// Tables whose writes fire user triggers or rules: they may write anything.
    anything: HashSet<Box<str>>,
    /// A write to the key also changes these tables.
    reaches: HashMap<Box<str>, Vec<Box<str>>>,
    /// Relations whose reading may write (see [`SNAPSHOT_SQL`]'s `r` rows).
    reading_writes: HashSet<Box<str>>,
    /// Each table's row key (see [`super::rows`]); None when two tables of that name have
    /// different ones, or one of its columns is of a type not followed by row.
    row_keys: HashMap<Box<str>, Option<Arc<RowKey>>>,
    /// What the tables of each name say about their columns (see [`TableColumns`]).
    columns: HashMap<Box<str>, TableColumns>,
    /// The tables with a row key of one column, the only table of their name: the table's
    /// OID and the column's number, as a RowDescription names the column that shows it.
    result_keys: HashMap<Box<str>, (u32, i16)>,
    /// Names of functions (and, as `operator NAME`, operators) one of which returns a set.
    set_returning: HashSet<Box<str>>,
    /// Names every function of which is an aggregate.
    aggregates: HashSet<Box<str>>,
}

/// What the tables of one name say about their columns, for column-level dependencies
/// (see `cache::columns`): only what holds for every table of that name.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TableColumns {
    /// The columns of a type whose values are followed, with it.
    pub followed: Vec<(Box<str>, KeyType)>,
    /// Unique keys whose columns are all `NOT NULL`.
    pub unique: Vec<Vec<Box<str>>>,
    /// Unique keys with a nullable column: equalities on all their columns still name at
    /// most one row (`=` is never true of NULL).
    pub unique_nullable: Vec<Vec<Box<str>>>,
    /// A column is generated: an `UPDATE` may change more columns than it assigns.
    pub generated: bool,
    /// Every column (with two tables of the name, of both): what `*` reads.
    pub all: Vec<Box<str>>,
}

/// Every function of one name, merged: the strictest wins.
#[derive(Debug, Default, Clone, Copy)]
struct Function {
    volatile: bool,
    user_not_immutable: bool,
    user_volatile: bool,
}

/// One query returning the whole snapshot, a row kind in the first column: `f` a function
/// (or, as `operator NAME`, an operator: the function it runs), `w` a table whose writes may
/// write anything (user triggers, rules; column defaults, check constraints and domains that
/// call a volatile function of the database), `e` a write to the first table reaching the
/// second, `r` a relation whose reading may write (a view's query or a row-level security
/// policy that calls a volatile function or operator of the database), `k` a column of a
/// table's row key (see [`super::rows`]: its replica identity index, else its primary key):
/// the table, the column, its type OID, whether its collation is deterministic, and its
/// place in the key and the table's OID (two tables of one name in two schemas); `c` a
/// column (its values are followed when of a type [`super::rows::KeyType`] knows): the
/// table, the column, its type and collation as for `k`, the table's OID; `q` a unique key of a table
/// (the table, its columns joined by `,`, whether all are `NOT NULL`, the table's OID);
/// `g` a table with a generated column; `n` every table (its name and OID: two of one name);
/// `s` a function (or `operator NAME`) name one of whose functions returns a set; `a` a
/// function name all of whose functions are aggregates.
pub const SNAPSHOT_SQL: &str = "\
WITH vol(classid, oid) AS (SELECT 'pg_proc'::regclass, p.oid FROM pg_proc p \
   WHERE p.oid >= 16384 AND p.provolatile = 'v' \
 UNION ALL SELECT 'pg_operator'::regclass, o.oid FROM pg_operator o JOIN pg_proc p ON p.oid = o.oprcode \
   WHERE p.oid >= 16384 AND p.provolatile = 'v'), \
 voldep AS (SELECT d.classid, d.objid FROM pg_depend d JOIN vol ON d.refclassid = vol.classid \
   AND d.refobjid = vol.oid), \
 voltypes AS (SELECT k.contypid AS oid FROM voldep JOIN pg_constraint k \
   ON voldep.classid = 'pg_constraint'::regclass AND voldep.objid = k.oid WHERE k.contypid <> 0 \
   UNION SELECT voldep.objid FROM voldep WHERE voldep.classid = 'pg_type'::regclass) \
SELECT 'f', p.proname::text, bool_or(p.provolatile = 'v')::text, \
 bool_or(p.oid >= 16384 AND p.provolatile <> 'i')::text, \
 bool_or(p.oid >= 16384 AND p.provolatile = 'v')::text FROM pg_proc p GROUP BY p.proname \
UNION ALL SELECT 'f', 'operator ' || o.oprname::text, bool_or(p.provolatile = 'v')::text, \
 bool_or(p.oid >= 16384 AND p.provolatile <> 'i')::text, \
 bool_or(p.oid >= 16384 AND p.provolatile = 'v')::text FROM pg_operator o \
 JOIN pg_proc p ON p.oid = o.oprcode GROUP BY o.oprname \
UNION ALL SELECT 's', p.proname::text, '', '', '' FROM pg_proc p WHERE p.proretset \
 GROUP BY p.proname \
UNION ALL SELECT 's', 'operator ' || o.oprname::text, '', '', '' FROM pg_operator o \
 JOIN pg_proc p ON p.oid = o.oprcode WHERE p.proretset GROUP BY o.oprname \
UNION ALL SELECT 'a', p.proname::text, '', '', '' FROM pg_proc p GROUP BY p.proname \
 HAVING bool_and(p.prokind = 'a') \
UNION ALL SELECT DISTINCT 'w', c.relname::text, '', '', '' FROM voldep \
 JOIN pg_attrdef a ON voldep.classid = 'pg_attrdef'::regclass AND voldep.objid = a.oid \
 JOIN pg_class c ON c.oid = a.adrelid \
UNION ALL SELECT DISTINCT 'w', c.relname::text, '', '', '' FROM voldep \
 JOIN pg_constraint k ON voldep.classid = 'pg_constraint'::regclass AND voldep.objid = k.oid \
 JOIN pg_class c ON c.oid = k.conrelid \
UNION ALL SELECT DISTINCT 'w', c.relname::text, '', '', '' FROM voltypes \
 JOIN pg_attribute at ON at.atttypid = voltypes.oid AND NOT at.attisdropped \
 JOIN pg_class c ON c.oid = at.attrelid \
UNION ALL SELECT DISTINCT 'r', c.relname::text, '', '', '' FROM voldep \
 JOIN pg_rewrite r ON voldep.classid = 'pg_rewrite'::regclass AND voldep.objid = r.oid \
 JOIN pg_class c ON c.oid = r.ev_class \
UNION ALL SELECT DISTINCT 'r', c.relname::text, '', '', '' FROM voldep \
 JOIN pg_policy pol ON voldep.classid = 'pg_policy'::regclass AND voldep.objid = pol.oid \
 JOIN pg_class c ON c.oid = pol.polrelid \
UNION ALL SELECT 'w', c.relname::text, '', '', '' FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid \
 WHERE NOT t.tgisinternal \
UNION ALL SELECT 'w', c.relname::text, '', '', '' FROM pg_rewrite r JOIN pg_class c ON c.oid = r.ev_class \
 WHERE r.rulename <> '_RETURN' \
UNION ALL SELECT 'e', p.relname::text, ch.relname::text, '', '' FROM pg_constraint k \
 JOIN pg_class p ON p.oid = k.confrelid JOIN pg_class ch ON ch.oid = k.conrelid \
 WHERE k.contype = 'f' AND (k.confdeltype IN ('c', 'n', 'd') OR k.confupdtype IN ('c', 'n', 'd')) \
UNION ALL SELECT 'e', p.relname::text, ch.relname::text, '', '' FROM pg_inherits i \
 JOIN pg_class p ON p.oid = i.inhparent JOIN pg_class ch ON ch.oid = i.inhrelid \
UNION ALL SELECT 'e', ch.relname::text, p.relname::text, '', '' FROM pg_inherits i \
 JOIN pg_class p ON p.oid = i.inhparent JOIN pg_class ch ON ch.oid = i.inhrelid \
UNION ALL SELECT DISTINCT 'e', v.relname::text, b.relname::text, '', '' FROM pg_rewrite r \
 JOIN pg_class v ON v.oid = r.ev_class JOIN pg_depend d ON d.classid = 'pg_rewrite'::regclass \
 AND d.objid = r.oid AND d.refclassid = 'pg_class'::regclass JOIN pg_class b ON b.oid = d.refobjid \
 WHERE b.oid <> v.oid AND r.rulename = '_RETURN' \
UNION ALL SELECT 'k', c.relname::text, a.attname::text, \
 a.atttypid::text || ' ' || coalesce(co.collisdeterministic, true)::text, \
 k.ord::text || ' ' || c.oid::text || ' ' || a.attnum::text FROM pg_class c JOIN pg_index i ON i.indrelid = c.oid \
 AND ((c.relreplident IN ('d', 'f') AND i.indisprimary) OR (c.relreplident = 'i' AND i.indisreplident)) \
 CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) \
 JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum \
 LEFT JOIN pg_collation co ON co.oid = a.attcollation \
 WHERE c.relkind IN ('r', 'p') AND c.relnamespace <> 'pg_catalog'::regnamespace \
 AND i.indisunique AND i.indimmediate AND i.indexprs IS NULL AND i.indpred IS NULL \
UNION ALL SELECT 'c', c.relname::text, a.attname::text, \
 a.atttypid::text || ' ' || coalesce(co.collisdeterministic, true)::text, c.oid::text \
 FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 \
 AND NOT a.attisdropped \
 LEFT JOIN pg_collation co ON co.oid = a.attcollation \
 WHERE c.relkind IN ('r', 'p') AND c.relnamespace <> 'pg_catalog'::regnamespace \
UNION ALL SELECT 'q', c.relname::text, string_agg(a.attname::text, ',' ORDER BY k.ord), \
 bool_and(a.attnotnull)::text, c.oid::text FROM pg_class c JOIN pg_index i ON i.indrelid = c.oid \
 CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) \
 JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum \
 WHERE c.relkind IN ('r', 'p') AND c.relnamespace <> 'pg_catalog'::regnamespace \
 AND i.indisunique AND i.indimmediate AND i.indexprs IS NULL AND i.indpred IS NULL \
 GROUP BY c.oid, c.relname, i.indexrelid \
UNION ALL SELECT DISTINCT 'g', c.relname::text, '', '', '' FROM pg_attribute a \
 JOIN pg_class c ON c.oid = a.attrelid WHERE a.attgenerated <> '' AND NOT a.attisdropped \
UNION ALL SELECT 'n', c.relname::text, '', '', c.oid::text FROM pg_class c \
 WHERE c.relkind IN ('r', 'p') AND c.relnamespace <> 'pg_catalog'::regnamespace";

impl Snapshot {
    /// Builds a snapshot from the rows of [`SNAPSHOT_SQL`].
    pub fn from_rows(generation: u64, rows: &[Vec<Option<String>>]) -> Snapshot {
        let mut s = Snapshot {
            generation,
            ..Snapshot::default()
        };
        let col = |row, i| column(row, i).unwrap_or_default();
        let mut keys: HashMap<Box<str>, Vec<(String, KeyColumns)>> = HashMap::default();
        // name → per table OID: its followed columns, its unique keys (NOT NULL, and the
        // others).
        type Followed = Vec<(Box<str>, KeyType)>;
        type Keys = Vec<Vec<Box<str>>>;
        type OfOid = (String, Followed, Keys, Keys);
        let mut tables_columns: HashMap<Box<str>, Vec<OfOid>> = HashMap::default();
        // Each key column's table OID and column number, by table name.
        let mut attnums: HashMap<Box<str>, Vec<KeyAttnum>> = HashMap::default();
        for row in rows {
            match col(row, 0) {
                "f" => {
                    let f = s.functions.entry(col(row, 1).into()).or_default();
                    f.volatile |= col(row, 2) == "true";
                    f.user_not_immutable |= col(row, 3) == "true";
                    f.user_volatile |= col(row, 4) == "true";
                }
                "w" => {
                    s.anything.insert(col(row, 1).into());
                }
                "s" => {
                    s.set_returning.insert(col(row, 1).into());
                }
                "a" => {
                    s.aggregates.insert(col(row, 1).into());
                }
                "r" => {
                    s.reading_writes.insert(col(row, 1).into());
                }
                "k" => {
                    let (ty, place) = (col(row, 3), col(row, 4));
                    let (oid, deterministic) = ty.split_once(' ').unwrap_or_default();
                    let (place, of) = place.split_once(' ').unwrap_or_default();
                    let (table, attnum) = of.split_once(' ').unwrap_or((of, ""));
                    attnums
                        .entry(col(row, 1).into())
                        .or_default()
                        .push((table.to_owned(), attnum.parse().ok()));
                    let key_type = oid
                        .parse()
                        .ok()
                        .and_then(|oid| KeyType::of(oid, deterministic == "true"));
                    let key_column = key_type.map(|t| (col(row, 2).into(), t));
                    let tables = keys.entry(col(row, 1).into()).or_default();
                    let at = match tables.iter().position(|(t, _)| t == table) {
                        Some(at) => at,
                        None => {
                            tables.push((table.to_owned(), Vec::new()));
                            tables.len() - 1
                        }
                    };
                    tables[at]
                        .1
                        .push((place.parse().unwrap_or(u32::MAX), key_column));
                }
                "c" | "q" | "n" => {
                    let (table, name) = (col(row, 4), col(row, 1));
                    let of = tables_columns.entry(name.into()).or_default();
                    let at = of.iter().position(|(t, ..)| t == table).unwrap_or_else(|| {
                        of.push((table.to_owned(), Vec::new(), Vec::new(), Vec::new()));
                        of.len() - 1
                    });
                    if col(row, 0) == "c" {
                        let all = &mut s.columns.entry(name.into()).or_default().all;
                        if !all.iter().any(|c| **c == *col(row, 2)) {
                            all.push(col(row, 2).into());
                        }
                        let (oid, deterministic) = col(row, 3).split_once(' ').unwrap_or_default();
                        if let Some(ty) = oid
                            .parse()
                            .ok()
                            .and_then(|oid| KeyType::of(oid, deterministic == "true"))
                        {
                            of[at].1.push((col(row, 2).into(), ty));
                        }
                    } else if col(row, 0) == "q" {
                        let key = col(row, 2).split(',').map(Into::into).collect();
                        match col(row, 3) {
                            "true" => of[at].2.push(key),
                            _ => of[at].3.push(key),
                        }
                    }
                }
                "g" => {
                    s.columns.entry(col(row, 1).into()).or_default().generated = true;
                }
                "e" => {
                    let to: Box<str> = col(row, 2).into();
                    let list = s.reaches.entry(col(row, 1).into()).or_default();
                    if !list.contains(&to) {
                        list.push(to);
                    }
                }
                _ => {}
            }
        }
        for (name, mut tables) in tables_columns {
            let of = s.columns.entry(name).or_default();
            let (_, first, unique, unique_nullable) = tables.swap_remove(0);
            of.followed = first
                .into_iter()
                .filter(|c| tables.iter().all(|(_, other, ..)| other.contains(c)))
                .collect();
            // Two tables of one name: which one a read names is not known here.
            if tables.is_empty() {
                of.unique = unique;
                of.unique_nullable = unique_nullable;
            }
        }
        s.settle_keys(keys, attnums);
        s
    }

    /// Each table name's row key (the same for every table of the name, or none) and, for a
    /// key of one column of the only table of its name, where a result shows it.
    fn settle_keys(
        &mut self,
        keys: HashMap<Box<str>, Vec<(String, KeyColumns)>>,
        attnums: HashMap<Box<str>, Vec<KeyAttnum>>,
    ) {
        for (name, tables) in keys {
            let key = |mut columns: KeyColumns| {
                columns.sort_by_key(|(place, _)| *place);
                let columns = columns
                    .into_iter()
                    .map(|(_, c)| c)
                    .collect::<Option<Vec<_>>>()?;
                Some(Arc::new(RowKey { columns }))
            };
            let mut found = tables.into_iter().map(|(_, columns)| key(columns));
            let first = found.next().flatten();
            // Two tables of one name: the same key, or none followed.
            let same = found.all(|k| k.is_some() && k == first);
            self.row_keys.insert(name, first.filter(|_| same));
        }
        for (name, columns) in attnums {
            // One table of the name, a key of one column.
            if let [(oid, Some(attnum))] = columns.as_slice() {
                if let Ok(oid) = oid.parse() {
                    self.result_keys.insert(name, (oid, *attnum));
                }
            }
        }
    }

    /// What the tables named `table` say about their columns; None: no such table.
    pub fn table_columns(&self, table: &str) -> Option<&TableColumns> {
        self.columns.get(table)
    }

    /// The row key of the tables named `table` (see [`super::rows`]), if followed.
    pub fn row_key(&self, table: &str) -> Option<&Arc<RowKey>> {
        self.row_keys.get(table)?.as_ref()
    }

    /// The table's OID and its one-column row key's column number, when `table` names one
    /// table and its key (see [`Snapshot::row_key`]) has one column: how the column that shows
    /// the key is found in a result's RowDescription.
    pub fn result_key(&self, table: &str) -> Option<(u32, i16)> {
        let key = self.row_key(table)?;
        (key.columns.len() == 1)
            .then(|| self.result_keys.get(table).copied())
            .flatten()
    }

    /// The tables a write to `table` changes (itself first, then what cascades, triggers,
    /// inheritance and views reach, transitively); None if it may change anything.
    pub fn reached_by_write(&self, table: &str) -> Option<Vec<Box<str>>> {
        let mut seen: Vec<Box<str>> = vec![table.into()];
        let mut i = 0;
        while i < seen.len() {
            if self.anything.contains(&seen[i]) {
                return None;
            }
            if let Some(next) = self.reaches.get(&seen[i]) {
                for t in next {
                    if !seen.contains(t) {
                        seen.push(t.clone());
                    }
                }
            }
            i += 1;
            if seen.len() > 10_000 {
                return None;
            }
        }
        Some(seen)
    }

    /// Whether some relation's reading may write (see [`Snapshot::reading_may_write`]).
    pub fn has_reading_writes(&self) -> bool {
        !self.reading_writes.is_empty()
    }

    /// Whether reading any of `relations` may write to the database: one of them, or a
    /// relation it reads through (a view's tables, a partitioned table's partitions), calls
    /// a volatile function or operator of the database in a view's query or a policy.
    pub fn reading_may_write(&self, relations: &[Box<str>]) -> bool {
        if self.reading_writes.is_empty() {
            return false;
        }
        let mut seen: Vec<&str> = relations.iter().map(|r| &**r).collect();
        let mut i = 0;
        while i < seen.len() {
            if self.reading_writes.contains(seen[i]) {
                return true;
            }
            for next in self.reaches.get(seen[i]).into_iter().flatten() {
                if !seen.contains(&&**next) {
                    seen.push(next);
                }
            }
            i += 1;
            if seen.len() > 10_000 {
                return true;
            }
        }
        false
    }

    /// Whether calling `name` may write to the database (a volatile function defined in it,
    /// or one the snapshot does not know).
    pub fn call_may_write(&self, name: &str) -> bool {
        self.functions.get(name).is_none_or(|f| f.user_volatile)
    }

    /// Why calling these functions makes a result uncacheable, if it does.
    pub fn functions_bypass(&self, names: &[Box<str>]) -> Option<Bypass> {
        for name in names {
            match self.functions.get(name) {
                None => return Some(Bypass::Unknown),
                Some(f) if f.volatile => return Some(Bypass::Volatile),
                Some(f) if f.user_not_immutable => return Some(Bypass::UserFunction),
                Some(_) => {}
            }
        }
        None
    }
}

/// Column `i` of a catalog row (None: NULL, or no such column).
pub(super) fn column(row: &[Option<String>], i: usize) -> Option<&str> {
    row.get(i)?.as_deref()
}

/// A double-quoted identifier (one name: unlike `params::quote_name`, a `.` in it is kept).
fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// The query that resolves the relations `reads` names under `search_path` (None: the
/// server's own), with everything they reach through views, partitions and row-level
/// security policies (the tables a policy's expressions read: a write to one of them changes
/// which rows the policy lets through).
pub fn resolve_sql(reads: &Reads, search_path: Option<&str>) -> String {
    let names: Vec<String> = reads
        .relations
        .iter()
        .map(|r| {
            let name = match &r.schema {
                Some(schema) => format!("{}.{}", quote_ident(schema), quote_ident(&r.name)),
                None => quote_ident(&r.name),
            };
            quote_literal(&name)
        })
        .collect();
    let mut sql = String::new();
    if let Some(path) = search_path {
        sql.push_str(&format!(
            "SELECT 'p', set_config('search_path', {}, true); ",
            quote_literal(path)
        ));
    }
    sql.push_str(&format!(
        "WITH RECURSIVE edges(parent, child) AS ( \
           SELECT r.ev_class, d.refobjid FROM pg_rewrite r JOIN pg_depend d \
             ON d.classid = 'pg_rewrite'::regclass AND d.objid = r.oid \
             AND d.refclassid = 'pg_class'::regclass \
           WHERE r.rulename = '_RETURN' AND d.refobjid <> r.ev_class \
           UNION ALL SELECT inhparent, inhrelid FROM pg_inherits \
           UNION ALL SELECT p.polrelid, d.refobjid FROM pg_policy p JOIN pg_depend d \
             ON d.classid = 'pg_policy'::regclass AND d.objid = p.oid \
             AND d.refclassid = 'pg_class'::regclass \
           WHERE d.refobjid <> p.polrelid), \
         named(name, oid) AS (SELECT n, to_regclass(n) FROM unnest(ARRAY[{}]::text[]) n), \
         closure(oid) AS (SELECT oid FROM named WHERE oid IS NOT NULL \
           UNION SELECT e.child FROM closure c JOIN edges e ON e.parent = c.oid) \
         SELECT 'r', c.relname::text, c.relkind::text, c.relpersistence::text, n.nspname::text, \
           c.relrowsecurity::text, \
           CASE WHEN c.relkind IN ('v', 'm') THEN pg_get_viewdef(c.oid) END, \
           (SELECT string_agg(coalesce(pg_get_expr(p.polqual, p.polrelid), 'true') || ' AND ' || \
              coalesce(pg_get_expr(p.polwithcheck, p.polrelid), 'true'), ' AND ') \
            FROM pg_policy p WHERE p.polrelid = c.oid) \
         FROM closure JOIN pg_class c ON c.oid = closure.oid \
           JOIN pg_namespace n ON n.oid = c.relnamespace \
         UNION ALL SELECT 'u', name, NULL, NULL, NULL, NULL, NULL, NULL FROM named WHERE oid IS NULL",
        names.join(", ")
    ));
    sql
}

/// The tables a cacheable query depends on, or why it may not be cached, from the rows of
/// [`resolve_sql`] and the database's snapshot.
pub fn resolved(
    reads: &Reads,
    rows: &[Vec<Option<String>>],
    snapshot: &Snapshot,
) -> Result<Vec<Box<str>>, Bypass> {
    let col = column;
    let mut tables: Vec<Box<str>> = Vec::new();
    let mut functions: Vec<Box<str>> = reads.functions.clone();
    for row in rows {
        match col(row, 0) {
            Some("u") => return Err(Bypass::Unknown),
            Some("r") => {}
            _ => continue,
        }
        let relname = col(row, 1).unwrap_or_default();
        match col(row, 2) {
            Some("r" | "p" | "v" | "m") => {}
            _ => return Err(Bypass::NotATable),
        }
        match col(row, 3) {
            Some("t") => return Err(Bypass::Temporary),
            Some("u") => return Err(Bypass::Unlogged),
            _ => {}
        }
        if matches!(
            col(row, 4),
            Some("pg_catalog" | "information_schema" | "pg_toast")
        ) {
            return Err(Bypass::SystemCatalog);
        }
        // A view's own functions count as the query's (pg_depend does not list builtins).
        if let Some(definition) = col(row, 6) {
            match analyze(definition).read {
                Ok(inner) => functions.extend(inner.functions),
                Err(why) => return Err(why),
            }
        }
        // Row security: the role is in the key, so policies on the role are followed; one
        // that reads a setting (a tenant id in a custom GUC) is not.
        if col(row, 5) == Some("true") {
            if let Some(policy) = col(row, 7) {
                match analyze(&format!("SELECT {policy}")).read {
                    Ok(inner) => functions.extend(inner.functions),
                    Err(Bypass::TimeOrSession) => return Err(Bypass::RowSecurity),
                    Err(why) => return Err(why),
                }
            }
        }
        let relname: Box<str> = relname.into();
        if !tables.contains(&relname) {
            tables.push(relname);
        }
    }
    functions.sort();
    functions.dedup();
    if let Some(why) = snapshot.functions_bypass(&functions) {
        return Err(why);
    }
    Ok(tables)
}

/// Whether a read that resolved to `tables` returns at most one row whatever the data (see
/// [`OneRow`]): by `LIMIT 1`, by having no `FROM`, by being an aggregate without `GROUP BY`,
/// or by binding a unique key of its one table; never when a function it calls (anywhere:
/// the names are not told apart by place) may return a set.
pub fn one_row(reads: &Reads, tables: &[Box<str>], snapshot: &Snapshot) -> OneRow {
    let count = &reads.rows;
    if count.limited {
        return OneRow::Always;
    }
    if !count.plain
        || reads
            .functions
            .iter()
            .any(|f| snapshot.set_returning.contains(f))
    {
        return OneRow::Never;
    }
    let aggregate = count.certain_aggregate
        || count
            .aggregate_calls
            .iter()
            .any(|f| snapshot.aggregates.contains(f));
    if count.no_from || aggregate {
        return OneRow::Always;
    }
    let (Some(filter), [table]) = (&reads.filter, tables) else {
        return OneRow::Never;
    };
    let Some(columns) = snapshot
        .table_columns(table)
        .filter(|_| filter.relation.name == *table)
    else {
        return OneRow::Never;
    };
    for key in columns.unique.iter().chain(&columns.unique_nullable) {
        let mut params = Vec::new();
        let bound = key.iter().all(|name| {
            let Some(&(_, ty)) = columns.followed.iter().find(|(c, _)| c == name) else {
                return false;
            };
            let Some(bound) = filter.columns.iter().find(|b| b.column == *name) else {
                return false;
            };
            let [source] = bound.values.as_slice() else {
                return false;
            };
            match (&source.origin, source.cast) {
                (_, Some(cast)) => crate::query::point::same_family(cast, ty.family()),
                (crate::query::point::Origin::Param(n), None) => {
                    params.push((*n, ty));
                    true
                }
                (crate::query::point::Origin::Const { .. }, None) => true,
            }
        });
        if bound && !key.is_empty() {
            return OneRow::ByKey(params.into());
        }
    }
    OneRow::Never
}

/// The point plan (see [`super::rows`]) of a read by `filter` that resolved to `tables`
/// (with the rows of [`resolve_sql`]): a read of one table by its row key, or of a view that
/// is a plain projection of one table by the columns behind that table's row key.
pub fn point_plan(
    filter: &ReadFilter,
    tables: &[Box<str>],
    rows: &[Vec<Option<String>>],
    snapshot: &Snapshot,
) -> Option<PointPlan> {
    let named = &filter.relation.name;
    match tables {
        [table] => PointPlan::new(filter, table, snapshot.row_key(table)?),
        [_, _] if tables.contains(named) => {
            let definition = rows.iter().find_map(|row| {
                let view = column(row, 0) == Some("r")
                    && column(row, 1) == Some(&**named)
                    && column(row, 2) == Some("v");
                view.then(|| column(row, 6)).flatten()
            })?;
            let crate::query::Parsed::Tree(tree) = crate::query::parse(definition) else {
                return None;
            };
            let crate::query::point::Projection {
                table: base,
                columns,
            } = crate::query::point::view_projection(&tree)?;
            if base == *named || !tables.contains(&base) {
                return None;
            }
            let through = ReadFilter {
                relation: RelName {
                    schema: None,
                    name: base.clone(),
                },
                columns: filter
                    .columns
                    .iter()
                    .filter_map(|b| {
                        let (_, column) = columns.iter().find(|(v, _)| *v == b.column)?;
                        Some(Bound {
                            column: column.clone(),
                            values: b.values.clone(),
                        })
                    })
                    .collect(),
            };
            PointPlan::new(&through, &base, snapshot.row_key(&base)?)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(cols: &[&str]) -> Vec<Option<String>> {
        cols.iter().map(|c| Some(c.to_string())).collect()
    }

    #[test]
    fn writes_reach_cascades_and_stop_at_triggers() {
        let s = Snapshot::from_rows(
            0,
            &[
                row(&["f", "lower", "false", "false", "false"]),
                row(&["f", "f", "true", "true", "true"]),
                row(&["e", "parent", "child", "", ""]),
                row(&["e", "child", "grandchild", "", ""]),
                row(&["w", "audited", "", "", ""]),
            ],
        );
        assert_eq!(
            s.reached_by_write("parent").unwrap(),
            vec!["parent".into(), "child".into(), "grandchild".into()] as Vec<Box<str>>
        );
        assert!(s.reached_by_write("audited").is_none());
        assert!(s.call_may_write("f"));
        assert!(!s.call_may_write("lower"));
        assert!(s.call_may_write("created_later"));
        assert_eq!(s.functions_bypass(&["lower".into()]), None);
        assert_eq!(s.functions_bypass(&["f".into()]), Some(Bypass::Volatile));
    }

    #[test]
    fn columns_say_only_what_every_table_of_the_name_has() {
        let s = Snapshot::from_rows(
            0,
            &[
                row(&["n", "posts", "", "", "10"]),
                row(&["c", "posts", "user_id", "23 true", "10"]),
                row(&["c", "posts", "title", "25 true", "10"]),
                row(&["c", "posts", "icu", "25 false", "10"]),
                row(&["q", "posts", "title", "true", "10"]),
                row(&["q", "posts", "user_id,title", "true", "10"]),
                row(&["q", "posts", "slug", "false", "10"]),
                // Two tables named t: the columns both have alike, no unique key.
                row(&["n", "t", "", "", "20"]),
                row(&["n", "t", "", "", "21"]),
                row(&["c", "t", "a", "23 true", "20"]),
                row(&["c", "t", "a", "23 true", "21"]),
                row(&["c", "t", "b", "23 true", "20"]),
                row(&["c", "t", "b", "20 true", "21"]),
                row(&["c", "t", "stamp", "1184 true", "21"]),
                row(&["q", "t", "a", "true", "20"]),
                row(&["n", "g", "", "", "30"]),
                row(&["g", "g", "", "", ""]),
            ],
        );
        let posts = s.table_columns("posts").unwrap();
        assert_eq!(
            posts.followed,
            vec![
                ("user_id".into(), KeyType::Integer(4)),
                ("title".into(), KeyType::Text)
            ]
        );
        assert_eq!(posts.unique.len(), 2);
        // A nullable unique key: for a point read's one row, not for the rows a result holds.
        assert_eq!(
            posts.unique_nullable,
            vec![vec!["slug".into()]] as Vec<Vec<Box<str>>>
        );
        assert!(!posts.generated);
        // What `*` reads: every column, followed or not; of both tables of one name.
        assert_eq!(posts.all, ["user_id", "title", "icu"].map(Box::<str>::from));
        let t = s.table_columns("t").unwrap();
        assert_eq!(t.all, ["a", "b", "stamp"].map(Box::<str>::from));
        assert_eq!(t.followed, vec![("a".into(), KeyType::Integer(4))]);
        assert!(t.unique.is_empty());
        assert!(s.table_columns("g").unwrap().generated);
        assert!(s.table_columns("missing").is_none());
    }

    #[test]
    fn row_keys_in_their_order_and_only_when_one_per_name() {
        let s = Snapshot::from_rows(
            0,
            &[
                row(&["k", "pair", "b", "25 true", "2 100"]),
                row(&["k", "pair", "a", "23 true", "1 100"]),
                row(&["k", "icu", "name", "25 false", "1 101"]),
                row(&["k", "twice", "id", "23 true", "1 102"]),
                row(&["k", "twice", "id", "20 true", "1 103"]),
                row(&["k", "same", "id", "23 true", "1 104"]),
                row(&["k", "same", "id", "23 true", "1 105"]),
            ],
        );
        let pair = s.row_key("pair").unwrap();
        assert_eq!(
            pair.columns,
            vec![
                ("a".into(), KeyType::Integer(4)),
                ("b".into(), KeyType::Text)
            ]
        );
        assert!(s.row_key("icu").is_none(), "a nondeterministic collation");
        assert!(s.row_key("twice").is_none(), "two tables, two keys");
        assert!(s.row_key("same").is_some());
        assert!(s.row_key("missing").is_none());
    }

    #[test]
    fn resolve_sql_quotes_names() {
        let reads = analyze("SELECT * FROM \"We'ird\" JOIN s.t ON true")
            .read
            .unwrap();
        let sql = resolve_sql(&reads, Some("a, b"));
        assert!(sql.contains("E'\"We''ird\"'"), "{sql}");
        assert!(sql.contains("E'\"s\".\"t\"'"), "{sql}");
        assert!(sql.starts_with("SELECT 'p', set_config('search_path', E'a, b', true); "));
    }
}
