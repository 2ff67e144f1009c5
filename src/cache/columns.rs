//! Column-level dependencies: a read of a table depends on the columns it uses, on the rows
//! it may select, and on their order only when its result shows it — not on every write to
//! the table.
//!
//! What a read uses is read from its text once per shape ([`crate::query::columns`]); what
//! a table has (the types of its columns, its unique keys, generated columns) from the
//! catalog snapshot. A read of tables by name (no view, partition tree or row-level security
//! in between) then depends, per table `t`, on these versions instead of `t`'s any-write one
//! (see [`ColumnVersion`]):
//!
//! - `Whole`: bumped by every write not known column by column (a trigger's, a cascade's,
//!   `TRUNCATE`, `COPY`, `MERGE`, a write through a view, a change in the WAL whose old row is
//!   not shown in full);
//! - `Assigned` of each column it uses: bumped by an `UPDATE` that assigns it;
//! - the rows it may select: a value of a column its `WHERE` fixes by equality (`user_id =
//!   $1`, a slot of the rows' array hashed from (database, table, column, value), bumped by
//!   an `INSERT` or `DELETE` of a row with that value), that column's `UnknownValue` and the
//!   table's `UnknownValues` (rows added or removed whose value pgmemo does not know); or,
//!   without such a column, the table's `RowSet` (any row added or removed);
//! - `Moved`, unless its result is ordered whole (an `ORDER BY` covering a unique `NOT NULL`
//!   key of a table each of whose rows gives at most one row, see [`one_row_each`]) or is
//!   one row of order-blind aggregates: every `UPDATE` bumps it (a row's new version may be
//!   met at another place by the next scan, and ties come out in the order rows were met).
//!
//! An `UPDATE ... SET likes = likes + 1 WHERE id = 7` then leaves a cached `SELECT count(*)
//! FROM posts WHERE user_id = 3` or `SELECT title FROM posts WHERE user_id = 3 ORDER BY
//! title` (title unique) a hit, and an `INSERT` of a post of user 5 leaves every read of
//! user 3's posts one. A table with a generated column is written whole by an `UPDATE`
//! (it may change more than it assigns).

use super::catalog::{column, Snapshot, TableColumns};
use super::rows::{canonical, given, Given, KeyType, Values};
use super::versions::{ColumnVersion, Versions};
use crate::query::columns::ColumnReads;
use crate::query::point::{RowWrite, Rows, Source};
use std::hash::{BuildHasher, Hasher};

/// A read's equality on a column whose values are followed: its rows are those with one of
/// these values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValueFilter {
    table: Box<str>,
    column: Box<str>,
    ty: KeyType,
    values: Vec<Source>,
}

fn slot(database: &str, table: &str, column: &str, what: ColumnVersion) -> u32 {
    Versions::column_slot(database, table, column, what)
}

/// The slot of the rows of `table` whose `column` (of type `ty`) equals `given` (cast to
/// `cast`); None: no canonical form.
fn value_slot(
    versions: &Versions,
    (database, table, column): (&str, &str, &str),
    ty: KeyType,
    cast: Option<crate::query::point::Family>,
    given: Given<'_>,
) -> Option<u32> {
    let mut h = crate::query::lexer::hasher().build_hasher();
    for part in [database, table, column] {
        h.write(part.as_bytes());
        h.write_u8(0);
    }
    h.write_u8(b'v');
    canonical(ty, cast, given, &mut h)?;
    Some(versions.row_slot(h.finish()))
}

/// Whether every relation `rows` (of `catalog::resolve_sql`) resolved is a plain table
/// without row security, and they are exactly the tables the read names: no view,
/// partition tree, inheritance or policy brings in rows the names do not show.
fn plain_tables(reads: &ColumnReads, tables: &[Box<str>], rows: &[Vec<Option<String>>]) -> bool {
    let plain = rows.iter().all(|row| {
        column(row, 0) != Some("r")
            || (column(row, 2) == Some("r") && column(row, 5) != Some("true"))
    });
    plain
        && tables
            .iter()
            .all(|t| reads.tables.iter().any(|u| u.relation.name == *t))
        && reads
            .tables
            .iter()
            .all(|u| tables.contains(&u.relation.name))
}

/// Whether the read's `ORDER BY` orders its whole result by the table at `at`: it covers a
/// unique `NOT NULL` key of it, and each of its rows gives at most one row of the result.
fn ordered_by(reads: &ColumnReads, at: usize, snapshot: &Snapshot) -> bool {
    let u = &reads.tables[at];
    u.columns.is_some()
        && snapshot.table_columns(&u.relation.name).is_some_and(|of| {
            of.unique
                .iter()
                .any(|key| key.iter().all(|c| u.order.contains(c)))
        })
        && one_row_each(reads, at, snapshot)
}

/// Whether each row of the read's table at `at` gives at most one row of its result, which
/// is never one of NULLs for that table: it is alone, or every join is an inner one and
/// every other table is joined by all the columns of one of its unique `NOT NULL` keys
/// equalling columns of it (`p JOIN c ON c.id = p.category_id`). Then an `ORDER BY` that
/// covers a unique key of it orders the whole result, with no ties whose order could follow
/// where its rows were met.
fn one_row_each(reads: &ColumnReads, at: usize, snapshot: &Snapshot) -> bool {
    if reads.tables.len() == 1 {
        return true;
    }
    if !reads.inner_only {
        return false;
    }
    reads.tables.iter().enumerate().all(|(other, u)| {
        other == at
            || snapshot.table_columns(&u.relation.name).is_some_and(|of| {
                of.unique.iter().any(|key| {
                    key.iter().all(|k| {
                        reads.equalities.iter().any(|[l, r]| {
                            (l.0 == other && *l.1 == **k && r.0 == at)
                                || (r.0 == other && *r.1 == **k && l.0 == at)
                        })
                    })
                })
            })
    })
}

/// The slots a read of `tables` (resolved from `reads`) depends on beyond its database's,
/// and the value filters whose slots each execution adds; None when it is not read column
/// by column (it then depends on its tables' any-write versions).
pub fn plan(
    reads: &ColumnReads,
    tables: &[Box<str>],
    rows: &[Vec<Option<String>>],
    snapshot: &Snapshot,
    database: &str,
) -> Option<(Vec<u32>, Vec<ValueFilter>)> {
    if !plain_tables(reads, tables, rows) {
        return None;
    }
    let (mut slots, mut filters) = (Vec::new(), Vec::new());
    let total = reads.one_row || (0..reads.tables.len()).any(|at| ordered_by(reads, at, snapshot));
    for u in &reads.tables {
        let table = &*u.relation.name;
        let Some(columns) = &u.columns else {
            slots.push(Versions::table_slot(database, table));
            continue;
        };
        let of = snapshot.table_columns(table)?;
        slots.push(slot(database, table, "", ColumnVersion::Whole));
        for c in columns {
            slots.push(slot(database, table, c, ColumnVersion::Assigned));
        }
        if !total {
            slots.push(slot(database, table, "", ColumnVersion::Moved));
        }
        let filter = u.filter.iter().find_map(|b| {
            let (_, ty) = of.followed.iter().find(|(c, _)| *c == b.column)?;
            Some(ValueFilter {
                table: table.into(),
                column: b.column.clone(),
                ty: *ty,
                values: b.values.clone(),
            })
        });
        match filter {
            Some(f) => {
                slots.push(slot(
                    database,
                    table,
                    &f.column,
                    ColumnVersion::UnknownValue,
                ));
                slots.push(slot(database, table, "", ColumnVersion::UnknownValues));
                filters.push(f);
            }
            None => slots.push(slot(database, table, "", ColumnVersion::RowSet)),
        }
    }
    slots.sort_unstable();
    slots.dedup();
    Some((slots, filters))
}

/// Pushes the value slots of one execution of a read with `filters`; a filter whose values
/// have no canonical form (or too many) depends on its table's `RowSet` instead. Returns how
/// many did.
pub fn push_value_slots(
    filters: &[ValueFilter],
    versions: &Versions,
    database: &str,
    values: &Values<'_>,
    out: &mut Vec<u32>,
) -> u64 {
    let mut fallbacks = 0;
    for f in filters {
        let before = out.len();
        let named = f.values.len() <= crate::query::point::MAX_VALUES
            && f.values.iter().all(|s| {
                let slot = given(s, values).and_then(|g| {
                    value_slot(versions, (database, &f.table, &f.column), f.ty, s.cast, g)
                });
                slot.map(|slot| out.push(slot)).is_some()
            });
        if !named {
            out.truncate(before);
            out.push(slot(database, &f.table, "", ColumnVersion::RowSet));
            fallbacks += 1;
        }
    }
    fallbacks
}

/// Pushes the value slot (or the column's `UnknownValue`) of each followed column of a row
/// added or removed, `value` giving a column's value by name (None: not known; `Given::Null`
/// names no row a filter selects, so needs none).
fn push_row_values<'v>(
    of: &TableColumns,
    (database, table): (&str, &str),
    versions: &Versions,
    mut value: impl FnMut(&str) -> Option<(Option<crate::query::point::Family>, Given<'v>)>,
    out: &mut Vec<u32>,
) {
    for (c, ty) in &of.followed {
        let slot = match value(c) {
            Some((_, Given::Null)) => continue,
            Some((cast, g)) => value_slot(versions, (database, table, c), *ty, cast, g),
            None => None,
        };
        out.push(
            slot.unwrap_or_else(|| self::slot(database, table, c, ColumnVersion::UnknownValue)),
        );
    }
}

/// Pushes what `write` (a statement through pgmemo, one execution's `values`) changes of
/// its table column by column; `of`: what the catalog says of the table (None: not known,
/// the table is written whole).
pub fn push_write(
    write: &RowWrite,
    of: Option<&TableColumns>,
    versions: &Versions,
    database: &str,
    values: &Values<'_>,
    out: &mut Vec<u32>,
) {
    let table = &*write.table;
    let Some(of) = of else {
        out.push(slot(database, table, "", ColumnVersion::Whole));
        return;
    };
    let assigns = |out: &mut Vec<u32>| {
        if of.generated {
            out.push(slot(database, table, "", ColumnVersion::Whole));
            return;
        }
        out.push(slot(database, table, "", ColumnVersion::Moved));
        for c in &write.sets {
            out.push(slot(database, table, c, ColumnVersion::Assigned));
        }
    };
    match &write.rows {
        // An UPDATE assigns; a DELETE removes rows whose values are not known.
        Rows::Filter(_) if !write.sets.is_empty() => assigns(out),
        Rows::Filter(_) => {
            out.push(slot(database, table, "", ColumnVersion::RowSet));
            out.push(slot(database, table, "", ColumnVersion::UnknownValues));
        }
        Rows::Values {
            columns,
            rows,
            conflict,
        } => {
            out.push(slot(database, table, "", ColumnVersion::RowSet));
            for row in rows {
                push_row_values(
                    of,
                    (database, table),
                    versions,
                    |c| {
                        let at = columns.iter().position(|n| **n == *c)?;
                        let s = row.get(at)?.as_ref()?;
                        Some((s.cast, given(s, values)?))
                    },
                    out,
                );
            }
            if conflict.is_some() {
                assigns(out);
            }
        }
    }
}

/// A change the WAL shows.
pub enum Change<'a> {
    Insert,
    /// The columns whose values differ between the old and the new row, when the old row is
    /// shown in full (`REPLICA IDENTITY FULL`); None: not known.
    Update(Option<Vec<&'a str>>),
    /// Whether the old row is shown in full.
    Delete {
        full: bool,
    },
}

/// Pushes what one change of the WAL changed of `table` column by column; `row` gives a
/// column's text of the row added (INSERT) or removed (DELETE) by name (None: not shown;
/// `Some(None)`: NULL).
pub fn push_change<'r>(
    change: Change<'_>,
    of: Option<&TableColumns>,
    versions: &Versions,
    (database, table): (&str, &str),
    row: impl Fn(&str) -> Option<Option<&'r [u8]>>,
    out: &mut Vec<u32>,
) {
    let Some(of) = of else {
        out.push(slot(database, table, "", ColumnVersion::Whole));
        return;
    };
    match change {
        Change::Update(Some(changed)) if !of.generated => {
            out.push(slot(database, table, "", ColumnVersion::Moved));
            for c in changed {
                out.push(slot(database, table, c, ColumnVersion::Assigned));
            }
        }
        Change::Update(_) => out.push(slot(database, table, "", ColumnVersion::Whole)),
        Change::Delete { full: false } => {
            out.push(slot(database, table, "", ColumnVersion::RowSet));
            out.push(slot(database, table, "", ColumnVersion::UnknownValues));
        }
        Change::Insert | Change::Delete { full: true } => {
            out.push(slot(database, table, "", ColumnVersion::RowSet));
            push_row_values(
                of,
                (database, table),
                versions,
                |c| Some((None, row(c)?.map_or(Given::Null, Given::Text))),
                out,
            );
        }
    }
}
