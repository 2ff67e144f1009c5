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
//!   met at another place by the next scan, and ties come out in the order rows were met);
//! - for a column it only shows, when its result holds the table's rows by key (see
//!   [`HeldRows`]): the rows it holds and the table's unknown-rows version, once it is
//!   stored, instead of the column's `Assigned`.
//!
//! An `UPDATE ... SET likes = likes + 1 WHERE id = 7` then leaves a cached `SELECT count(*)
//! FROM posts WHERE user_id = 3` or `SELECT title FROM posts WHERE user_id = 3 ORDER BY
//! title` (title unique) a hit, and an `INSERT` of a post of user 5 leaves every read of
//! user 3's posts one. A table with a generated column is written whole by an `UPDATE`
//! (it may change more than it assigns).

use super::catalog::{column, Snapshot, TableColumns};
use super::rows::{canonical, given, Given, KeyType, RowKey, Values};
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

/// Pushes what a removal of rows whose values are not known changes: the table's row set and
/// its unknown-values version.
fn unknown_rows_removed(versions: &Versions, (database, table): (&str, &str), out: &mut Vec<u32>) {
    out.push(slot(versions, database, table, "", ColumnVersion::RowSet));
    out.push(slot(
        versions,
        database,
        table,
        "",
        ColumnVersion::UnknownValues,
    ));
}

fn slot(
    versions: &Versions,
    database: &str,
    table: &str,
    column: &str,
    what: ColumnVersion,
) -> u32 {
    versions.column_slot(database, table, column, what)
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
    (versions, database): (&Versions, &str),
) -> Option<ColumnPlan> {
    if !plain_tables(reads, tables, rows) {
        return None;
    }
    let (mut slots, mut filters) = (Vec::new(), Vec::new());
    let mut held = Vec::new();
    let total = reads.one_row || (0..reads.tables.len()).any(|at| ordered_by(reads, at, snapshot));
    for u in &reads.tables {
        let table = &*u.relation.name;
        let Some(columns) = &u.columns else {
            slots.push(versions.table_slot(database, table));
            continue;
        };
        let of = snapshot.table_columns(table)?;
        let columns = used_columns(columns, u.star, of)?;
        slots.push(slot(versions, database, table, "", ColumnVersion::Whole));
        for c in &columns {
            slots.push(slot(versions, database, table, c, ColumnVersion::Assigned));
        }
        if let Some(h) = held_rows(reads, u, &columns, snapshot, (versions, database)) {
            held.push(h);
        }
        if !total {
            slots.push(slot(versions, database, table, "", ColumnVersion::Moved));
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
                    versions,
                    database,
                    table,
                    &f.column,
                    ColumnVersion::UnknownValue,
                ));
                slots.push(slot(
                    versions,
                    database,
                    table,
                    "",
                    ColumnVersion::UnknownValues,
                ));
                filters.push(f);
            }
            None => slots.push(slot(versions, database, table, "", ColumnVersion::RowSet)),
        }
    }
    // A column only shown stops counting once the rows held are known, unless its slot is
    // also another's (two hashes met) or the database's.
    let database_slot = versions.database_slot(database);
    for h in &mut held {
        h.shown_only
            .retain(|s| *s != database_slot && slots.iter().filter(|&x| x == s).count() == 1);
        h.unknown_rows_added = h.unknown_rows != database_slot && !slots.contains(&h.unknown_rows);
    }
    for h in &held {
        if h.unknown_rows_added {
            slots.push(h.unknown_rows);
        }
    }
    held.retain(|h| !h.shown_only.is_empty());
    slots.sort_unstable();
    slots.dedup();
    Some(ColumnPlan {
        slots,
        filters,
        held,
    })
}

/// What a read by column depends on (see [`plan`]).
#[derive(Debug)]
pub struct ColumnPlan {
    /// The slots beyond its database's.
    pub slots: Vec<u32>,
    /// The value filters whose slots each execution adds.
    pub filters: Vec<ValueFilter>,
    /// The tables whose rows its result holds by key (see [`HeldRows`]).
    pub held: Vec<HeldRows>,
}

/// A table of a read whose result holds its rows by key: each row of the result is one row
/// of the table (no `GROUP BY`, `DISTINCT`), and the result shows the table's key. Then a
/// column the read only shows (used nowhere else: not in `WHERE`, `JOIN`, `ORDER BY`) changes
/// the result only when it changes in a row the result holds: the result depends on those
/// rows (their slots, read from its RowDescription and DataRows when it is stored, see
/// [`held_slots`]) and on the table's unknown-rows version (writes whose rows pgmemo does not
/// know) instead of on the column's `Assigned`. So `UPDATE posts SET likes = ... WHERE id =
/// 7` leaves a cached entity load of another user's posts a hit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldRows {
    /// The table's OID and its key column's number, as a RowDescription names a column.
    oid: u32,
    attnum: i16,
    table: Box<str>,
    key: std::sync::Arc<RowKey>,
    /// The `Assigned` slots of the columns only shown, which no other dependency shares.
    pub shown_only: Vec<u32>,
    /// The table's unknown-rows slot, and whether the plan has it for this alone.
    pub unknown_rows: u32,
    pub unknown_rows_added: bool,
}

/// The columns of a table a read uses: those it names, and with `star` (`*`, a whole row)
/// every column of the table; None when the catalog lists none (it is not known then).
fn used_columns<'a>(
    named: &'a [Box<str>],
    star: bool,
    of: &'a TableColumns,
) -> Option<Vec<&'a str>> {
    let mut columns: Vec<&str> = named.iter().map(|c| &**c).collect();
    if star {
        if of.all.is_empty() {
            return None;
        }
        for c in &of.all {
            if !columns.contains(&&**c) {
                columns.push(c);
            }
        }
    }
    Some(columns)
}

/// The rows of `u` (a table use of `reads`, using `columns`) its result may hold by key, if
/// any.
fn held_rows(
    reads: &ColumnReads,
    u: &crate::query::columns::TableUse,
    columns: &[&str],
    snapshot: &Snapshot,
    (versions, database): (&Versions, &str),
) -> Option<HeldRows> {
    let table = &*u.relation.name;
    let Some(outside) = &u.outside else {
        return None;
    };
    let once = reads
        .tables
        .iter()
        .filter(|t| *t.relation.name == *table)
        .count()
        == 1;
    if !reads.plain_rows || !once {
        return None;
    }
    let (oid, attnum) = snapshot.result_key(table)?;
    let shown_only: Vec<u32> = columns
        .iter()
        .filter(|c| !outside.iter().any(|o| **o == ***c))
        .map(|c| slot(versions, database, table, c, ColumnVersion::Assigned))
        .collect();
    if shown_only.is_empty() {
        return None;
    }
    Some(HeldRows {
        oid,
        attnum,
        table: table.into(),
        key: snapshot.row_key(table)?.clone(),
        shown_only,
        unknown_rows: versions.unknown_rows_slot(database, table),
        unknown_rows_added: false,
    })
}

/// The most rows of one table a result may hold by key: a longer result keeps depending on
/// the columns it shows.
const MAX_HELD_ROWS: usize = 64;

/// Pushes the slots of the rows of `held`'s table that `reply` (a stored result:
/// RowDescription, DataRows, CommandComplete) holds, read from the column that shows the
/// table's key in text; false (and `out` as it was) when no column shows it in text (a
/// prepared statement's result without its RowDescription, a binary column), a key is NULL,
/// or the result holds more than [`MAX_HELD_ROWS`].
pub fn held_slots(
    held: &HeldRows,
    reply: &[u8],
    versions: &Versions,
    database: &str,
    out: &mut Vec<u32>,
) -> bool {
    use crate::protocol::{messages, Reader};
    let before = out.len();
    let mut at = None;
    for (tag, body) in messages(reply) {
        match tag {
            b'T' => {
                let mut r = Reader::new(body);
                let Some(fields) = r.i16() else {
                    return false;
                };
                for i in 0..fields {
                    let field = (|| {
                        r.cstr()?;
                        let (oid, attnum) = (r.i32()? as u32, r.i16()?);
                        r.bytes(10)?; // type OID, size, modifier
                        Some((oid, attnum, r.i16()?))
                    })();
                    match field {
                        Some((oid, attnum, 0)) if oid == held.oid && attnum == held.attnum => {
                            at = Some(i as usize);
                            break;
                        }
                        Some(_) => {}
                        None => return false,
                    }
                }
            }
            b'D' => {
                let Some(at) = at else {
                    return false;
                };
                let mut r = Reader::new(body);
                let value = (|| {
                    r.i16()?;
                    for _ in 0..at {
                        let len = r.i32()?;
                        r.bytes(usize::try_from(len).unwrap_or(0))?;
                    }
                    let len = usize::try_from(r.i32()?).ok()?;
                    r.bytes(len)
                })();
                let slot = value.and_then(|v| {
                    let (table, key) = (&held.table, &held.key);
                    crate::cache::rows::text_row_slot(versions, database, table, key, |_| {
                        Some(Some(v))
                    })
                });
                match slot {
                    Some(slot) if out.len() - before < MAX_HELD_ROWS => out.push(slot),
                    _ => {
                        out.truncate(before);
                        return false;
                    }
                }
            }
            _ => {}
        }
    }
    at.is_some()
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
            out.push(slot(
                versions,
                database,
                &f.table,
                "",
                ColumnVersion::RowSet,
            ));
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
        out.push(slot.unwrap_or_else(|| {
            self::slot(versions, database, table, c, ColumnVersion::UnknownValue)
        }));
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
        out.push(slot(versions, database, table, "", ColumnVersion::Whole));
        return;
    };
    let assigns = |out: &mut Vec<u32>| {
        if of.generated {
            out.push(slot(versions, database, table, "", ColumnVersion::Whole));
            return;
        }
        out.push(slot(versions, database, table, "", ColumnVersion::Moved));
        for c in &write.sets {
            out.push(slot(versions, database, table, c, ColumnVersion::Assigned));
        }
    };
    match &write.rows {
        // An UPDATE assigns; a DELETE removes rows whose values are not known.
        Rows::Filter(_) if !write.sets.is_empty() => assigns(out),
        Rows::Filter(_) => unknown_rows_removed(versions, (database, table), out),
        Rows::Values {
            columns,
            rows,
            conflict,
        } => {
            out.push(slot(versions, database, table, "", ColumnVersion::RowSet));
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
        out.push(slot(versions, database, table, "", ColumnVersion::Whole));
        return;
    };
    match change {
        Change::Update(Some(changed)) if !of.generated => {
            out.push(slot(versions, database, table, "", ColumnVersion::Moved));
            for c in changed {
                out.push(slot(versions, database, table, c, ColumnVersion::Assigned));
            }
        }
        Change::Update(_) => out.push(slot(versions, database, table, "", ColumnVersion::Whole)),
        Change::Delete { full: false } => unknown_rows_removed(versions, (database, table), out),
        Change::Insert | Change::Delete { full: true } => {
            out.push(slot(versions, database, table, "", ColumnVersion::RowSet));
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
