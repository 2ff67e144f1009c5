//! Row-level invalidation: which rows a point read depends on, and which rows a write
//! changes, as slots of the row versions (see [`super::versions`]).
//!
//! A table's *row key* is the key its writes are known by in the WAL: its replica identity
//! index, or its primary key (the default identity, and with `REPLICA IDENTITY FULL`); only
//! when every column of it is an integer, a `uuid`, or a `text`/`varchar` of a deterministic
//! collation (equal values are equal bytes). Rows are named by the values of that key:
//!
//! - a read of one table whose `WHERE` binds every key column by equality (see
//!   [`crate::query::point`]) depends on those rows and on the table's unknown-rows version,
//!   not on every write to the table;
//! - a write whose text names the key values of every row it writes (`UPDATE/DELETE ...
//!   WHERE key = ...` that does not assign the key, `INSERT (key, ...) VALUES`) bumps those
//!   rows; the WAL names the rows of every change (`wal`).
//!
//! A value is hashed in one canonical form whoever gives it: a simple query's literal, a
//! Bind's text or binary parameter, the WAL's text. Anything else (a value that is not
//! canonical: `7.0`, `0x10`, non-ASCII text whose bytes depend on the client's encoding, a
//! NULL, a binary value of a type other than the key's) names no row: the read then depends
//! on the whole table, the write bumps the unknown-rows version. Two rows that share a slot
//! only invalidate each other's reads.

use super::versions::Versions;
use crate::protocol::Reader;
use crate::query::point::{Family, Origin, ReadFilter, RowWrite, Rows, Source, MAX_VALUES};
use std::hash::{BuildHasher, Hasher};

/// The type of a key column, as far as hashing its values goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyType {
    /// int2, int4, int8: the byte length of its binary form.
    Integer(u8),
    Text,
    Uuid,
}

const INT2: u32 = 21;
const INT4: u32 = 23;
const INT8: u32 = 20;
const TEXT: u32 = 25;
const VARCHAR: u32 = 1043;
const UUID: u32 = 2950;

impl KeyType {
    /// The key type of a column of type `oid`, compared as bytes (`deterministic`
    /// collation); None: not followed by row.
    pub fn of(oid: u32, deterministic: bool) -> Option<KeyType> {
        match oid {
            INT2 => Some(KeyType::Integer(2)),
            INT4 => Some(KeyType::Integer(4)),
            INT8 => Some(KeyType::Integer(8)),
            TEXT | VARCHAR if deterministic => Some(KeyType::Text),
            UUID => Some(KeyType::Uuid),
            _ => None,
        }
    }

    pub fn family(self) -> Family {
        match self {
            KeyType::Integer(len) => Family::Integer(len),
            KeyType::Text => Family::Text,
            KeyType::Uuid => Family::Uuid,
        }
    }
}

/// A table's row key: its columns in the index's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowKey {
    pub columns: Vec<(Box<str>, KeyType)>,
}

/// A value as it was given.
#[derive(Debug, Clone, Copy)]
pub enum Given<'a> {
    /// In text form (a string literal, a text-format parameter, the WAL).
    Text(&'a [u8]),
    /// A number literal as written (`7`, `007`, `1.5`, `1e3`): PostgreSQL reads it as a
    /// number first, so into a text column it goes as the number's own text.
    Number(&'a [u8]),
    /// A binary-format parameter, with the type OID the statement declared for it (0: the
    /// server infers it: the column's, or the cast's).
    Binary(&'a [u8], u32),
    Null,
}

/// The values of one execution: where a [`Source`]'s `$n` is found.
#[derive(Clone, Copy)]
pub enum Values<'a> {
    /// A simple query's parameter literals, decoded, in `$n` order.
    Lexed(&'a crate::query::lexer::Lexed),
    /// A Bind's parameters (the body after its portal and statement names) and the
    /// statement's declared parameter types (count, then OIDs, as the Parse gave them).
    Bind { rest: &'a [u8], types: &'a [u8] },
    /// None (a statement with no parameters).
    None,
}

impl<'a> Values<'a> {
    /// The value of `$n` (1-based).
    fn param(&self, n: u16) -> Option<Given<'a>> {
        let i = usize::from(n).checked_sub(1)?;
        match *self {
            Values::Lexed(lexed) => {
                let literal = lexed.parameters().nth(i)?;
                use crate::query::lexer::Kind;
                match literal.kind {
                    Kind::Int4 | Kind::Int8 | Kind::Numeric => {
                        Some(Given::Number(lexed.value(literal)))
                    }
                    Kind::Text => Some(Given::Text(lexed.value(literal))),
                    _ => None,
                }
            }
            Values::Bind { rest, types } => bind_param(rest, types, i),
            Values::None => None,
        }
    }
}

/// Parameter `i` of a Bind (`rest`: its format codes, then its values) and its declared type.
fn bind_param<'a>(rest: &'a [u8], types: &[u8], i: usize) -> Option<Given<'a>> {
    let mut r = Reader::new(rest);
    let formats = usize::try_from(r.i16()?).ok()?;
    let mut codes = Reader::new(r.bytes(2 * formats)?);
    let format = match formats {
        0 => 0,
        1 => codes.i16()?,
        _ if i < formats => codes.bytes(2 * i).and_then(|_| codes.i16())?,
        _ => return None,
    };
    if i >= usize::try_from(r.i16()?).ok()? {
        return None;
    }
    for _ in 0..i {
        let len = r.i32()?;
        r.bytes(usize::try_from(len.max(0)).ok()?)?;
    }
    let len = r.i32()?;
    let Ok(len) = usize::try_from(len) else {
        return Some(Given::Null);
    };
    let value = r.bytes(len)?;
    match format {
        0 => Some(Given::Text(value)),
        1 => Some(Given::Binary(value, declared_type(types, i)?)),
        _ => None,
    }
}

/// The type OID the Parse declared for parameter `i` (0-based; `types`: their count, then
/// each OID): 0 when it declared fewer (the server infers the rest); None: malformed.
fn declared_type(types: &[u8], i: usize) -> Option<u32> {
    let mut t = Reader::new(types);
    if usize::try_from(t.i16()?).ok()? > i {
        t.bytes(4 * i)?;
        Some(t.i32()? as u32)
    } else {
        Some(0)
    }
}

/// Whether a read returns at most one row whatever the data. A row-limited Execute of it in a
/// transaction block (asyncpg's `fetchrow` and `fetchval` ask for one row) may then be
/// answered from the cache: its portal has no rows left to fetch in any snapshot, and the
/// session makes it again on the server, run to its end, if the client uses it after (see
/// `Session::portal_left_by_hit`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum OneRow {
    #[default]
    Never,
    Always,
    /// By a unique key (not deferrable, no expression or predicate; nullable columns too: `=`
    /// is never true of NULL) whose columns its `WHERE` binds to one value each. The
    /// parameters among those values (`$n`, with no cast: the comparison is then of the
    /// declared type) must be declared of the column's type family, or left to the server
    /// (which then takes the column's type): `id = $1` with `$1` declared `float8` compares
    /// as float8, where two int8 keys may be equal.
    ByKey(Box<[(u16, KeyType)]>),
}

impl OneRow {
    /// Whether it holds for a statement whose Parse declared `types` (count, then OIDs).
    pub fn holds(&self, types: &[u8]) -> bool {
        match self {
            OneRow::Never => false,
            OneRow::Always => true,
            OneRow::ByKey(params) => params.iter().all(|&(n, ty)| {
                let declared = usize::from(n)
                    .checked_sub(1)
                    .and_then(|i| declared_type(types, i));
                match declared {
                    Some(0) => true,
                    Some(oid) => KeyType::of(oid, true)
                        .is_some_and(|d| crate::query::point::same_family(d.family(), ty.family())),
                    None => false,
                }
            }),
        }
    }
}

/// Feeds the canonical form of `given` (of a column of type `ty`, maybe cast to `cast`) to
/// `h`; None: no canonical form (see the module's documentation).
pub(super) fn canonical(
    ty: KeyType,
    cast: Option<Family>,
    given: Given<'_>,
    h: &mut impl Hasher,
) -> Option<()> {
    if cast.is_some_and(|f| !crate::query::point::same_family(f, ty.family())) {
        return None;
    }
    match (ty, given) {
        (_, Given::Null) => None,
        (KeyType::Integer(_), Given::Text(t) | Given::Number(t)) => {
            let t = std::str::from_utf8(t)
                .ok()?
                .trim_matches([' ', '\t', '\n', '\r', '\x0b', '\x0c']);
            let v: i64 = t.parse().ok()?;
            h.write_u8(b'i');
            h.write_i64(v);
            Some(())
        }
        (KeyType::Integer(len), Given::Binary(b, declared)) => {
            let expected = match (declared, cast) {
                (0, None) => len,
                // Inferred from the cast: `$1::int8`.
                (0, Some(Family::Integer(cast))) => cast,
                (0, Some(_)) => return None,
                (INT2, _) => 2,
                (INT4, _) => 4,
                (INT8, _) => 8,
                _ => return None,
            };
            let v = match (expected, b.len()) {
                (2, 2) => i64::from(i16::from_be_bytes(b.try_into().ok()?)),
                (4, 4) => i64::from(i32::from_be_bytes(b.try_into().ok()?)),
                (8, 8) => i64::from_be_bytes(b.try_into().ok()?),
                _ => return None,
            };
            h.write_u8(b'i');
            h.write_i64(v);
            Some(())
        }
        // An integer written into a text column is its decimal text (`007` is `7`); any other
        // number's text is PostgreSQL's numeric output (`1e3` is `1000`): not followed.
        (KeyType::Text, Given::Number(t)) => {
            let v: i64 = std::str::from_utf8(t).ok()?.parse().ok()?;
            hash_text(v.to_string().as_bytes(), h);
            Some(())
        }
        (KeyType::Text, Given::Text(t) | Given::Binary(t, 0 | TEXT | VARCHAR)) => {
            // Trailing spaces: a varchar(n) column stores 'ab  ' as 'ab' when they are what
            // does not fit.
            if !t.is_ascii() || t.last() == Some(&b' ') {
                return None;
            }
            hash_text(t, h);
            Some(())
        }
        (KeyType::Uuid, Given::Text(t)) => {
            let t = std::str::from_utf8(t).ok()?.trim();
            let t = t
                .strip_prefix('{')
                .and_then(|t| t.strip_suffix('}'))
                .unwrap_or(t);
            let mut bytes = [0u8; 16];
            let mut n = 0;
            for c in t.bytes().filter(|&c| c != b'-') {
                let d = (c as char).to_digit(16)? as u8;
                if n >= 32 {
                    return None;
                }
                bytes[n / 2] |= if n % 2 == 0 { d << 4 } else { d };
                n += 1;
            }
            (n == 32).then_some(())?;
            h.write_u8(b'u');
            h.write(&bytes);
            Some(())
        }
        (KeyType::Uuid, Given::Binary(b, 0 | UUID)) if b.len() == 16 => {
            h.write_u8(b'u');
            h.write(b);
            Some(())
        }
        _ => None,
    }
}

/// Feeds a text value's canonical form (its bytes) to `h`.
fn hash_text(t: &[u8], h: &mut impl Hasher) {
    h.write_u8(b't');
    h.write_usize(t.len());
    h.write(t);
}

/// The row slot of one key, given its columns' values in the key's order.
fn slot_of_key<'v>(
    versions: &Versions,
    database: &str,
    table: &str,
    key: &RowKey,
    mut value: impl FnMut(usize) -> Option<(Option<Family>, Given<'v>)>,
) -> Option<u32> {
    let mut h = crate::query::lexer::hasher().build_hasher();
    h.write(database.as_bytes());
    h.write_u8(0);
    h.write(table.as_bytes());
    h.write_u8(0);
    for (i, (_, ty)) in key.columns.iter().enumerate() {
        let (cast, given) = value(i)?;
        canonical(*ty, cast, given, &mut h)?;
    }
    Some(versions.row_slot(h.finish()))
}

/// The value of a source in one execution.
pub(super) fn given<'v>(source: &'v Source, values: &Values<'v>) -> Option<Given<'v>> {
    match &source.origin {
        Origin::Param(n) => values.param(*n),
        Origin::Const {
            value: Some(v),
            number: true,
            ..
        } => Some(Given::Number(v.as_bytes())),
        Origin::Const { value: Some(v), .. } => Some(Given::Text(v.as_bytes())),
        Origin::Const { value: None, .. } => Some(Given::Null),
    }
}

/// Pushes to `out` the slot of every key whose columns take one of `bound[i]`'s values each
/// (the product of the lists); false (and `out` as it was) when one has no canonical form
/// or there are more than [`MAX_VALUES`].
fn push_product<B: AsRef<[Source]>>(
    versions: &Versions,
    database: &str,
    table: &str,
    key: &RowKey,
    bound: &[B],
    values: &Values<'_>,
    out: &mut Vec<u32>,
) -> bool {
    let total = bound
        .iter()
        .try_fold(1usize, |n, b| n.checked_mul(b.as_ref().len()))
        .unwrap_or(usize::MAX);
    if total == 0 || total > MAX_VALUES {
        return false;
    }
    if total == 1 {
        // One value per column (`id = $1`): the common case, without the product's counters.
        let slot = slot_of_key(versions, database, table, key, |i| {
            let s = &bound[i].as_ref()[0];
            Some((s.cast, given(s, values)?))
        });
        return slot.map(|slot| out.push(slot)).is_some();
    }
    let before = out.len();
    let mut at = [0usize; 32];
    if bound.len() > at.len() {
        return false;
    }
    for _ in 0..total {
        let slot = slot_of_key(versions, database, table, key, |i| {
            let s = &bound[i].as_ref()[at[i]];
            Some((s.cast, given(s, values)?))
        });
        let Some(slot) = slot else {
            out.truncate(before);
            return false;
        };
        out.push(slot);
        // The next combination, the last column fastest.
        for i in (0..bound.len()).rev() {
            at[i] += 1;
            if at[i] < bound[i].as_ref().len() {
                break;
            }
            at[i] = 0;
        }
    }
    true
}

/// A point read: a read of one table whose `WHERE` binds each column of its row key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PointPlan {
    pub table: Box<str>,
    key: RowKey,
    /// The values of each key column, in the key's order.
    bound: Vec<Vec<Source>>,
}

impl PointPlan {
    /// The point plan of a read of `table` (the only table it reads, named as the query
    /// names it: not a view of it) by `filter`, when it binds the whole of `key`.
    pub fn new(filter: &ReadFilter, table: &str, key: &RowKey) -> Option<PointPlan> {
        if &*filter.relation.name != table {
            return None;
        }
        let bound = key
            .columns
            .iter()
            .map(|(name, _)| {
                filter
                    .columns
                    .iter()
                    .find(|b| b.column == *name)
                    .map(|b| b.values.clone())
            })
            .collect::<Option<Vec<_>>>()?;
        Some(PointPlan {
            table: table.into(),
            key: key.clone(),
            bound,
        })
    }

    /// Pushes the slots of the rows this execution reads; false when its values name no
    /// rows (the read then depends on the whole table).
    pub fn push_slots(
        &self,
        versions: &Versions,
        database: &str,
        values: &Values<'_>,
        out: &mut Vec<u32>,
    ) -> bool {
        push_product(
            versions,
            database,
            &self.table,
            &self.key,
            &self.bound,
            values,
            out,
        )
    }
}

/// Pushes the slots of the rows `write` (of a table whose row key is `key`) writes in this
/// execution; false when it writes rows its text does not name.
pub fn push_write_slots(
    write: &RowWrite,
    key: &RowKey,
    versions: &Versions,
    database: &str,
    values: &Values<'_>,
    out: &mut Vec<u32>,
) -> bool {
    let is_key = |c: &str| key.columns.iter().any(|(k, _)| &**k == c);
    if write.sets.iter().any(|c| is_key(c)) {
        return false;
    }
    match &write.rows {
        Rows::Filter(columns) => {
            let mut lists: [&[Source]; 32] = [&[]; 32];
            if key.columns.len() > lists.len() {
                return false;
            }
            for (to, (name, _)) in lists.iter_mut().zip(&key.columns) {
                match columns.iter().find(|b| b.column == *name) {
                    Some(b) => *to = &b.values,
                    None => return false,
                }
            }
            let lists = &lists[..key.columns.len()];
            push_product(versions, database, &write.table, key, lists, values, out)
        }
        Rows::Values {
            columns,
            rows,
            conflict,
        } => {
            if let Some(arbiters) = conflict {
                let same =
                    arbiters.len() == key.columns.len() && arbiters.iter().all(|a| is_key(a));
                if !same {
                    return false;
                }
            }
            let Some(places) = key
                .columns
                .iter()
                .map(|(name, _)| columns.iter().position(|c| c == name))
                .collect::<Option<Vec<usize>>>()
            else {
                return false;
            };
            let slots = rows.iter().map(|row| {
                slot_of_key(versions, database, &write.table, key, |i| {
                    let s = row.get(places[i])?.as_ref()?;
                    Some((s.cast, given(s, values)?))
                })
            });
            push_all(out, slots)
        }
    }
}

/// Pushes every slot of `slots` to `out`, or none (`out` as it was) and false when one is
/// None.
pub fn push_all(out: &mut Vec<u32>, slots: impl Iterator<Item = Option<u32>>) -> bool {
    let before = out.len();
    for slot in slots {
        match slot {
            Some(slot) => out.push(slot),
            None => {
                out.truncate(before);
                return false;
            }
        }
    }
    true
}

/// The slot of the row of `table` (row key `key`) whose column values `column` gives in
/// text form (the WAL's, or a result's DataRow: None for a column it does not carry,
/// `Some(None)` for a NULL).
pub fn text_row_slot<'v>(
    versions: &Versions,
    database: &str,
    table: &str,
    key: &RowKey,
    mut column: impl FnMut(&str) -> Option<Option<&'v [u8]>>,
) -> Option<u32> {
    slot_of_key(versions, database, table, key, |i| {
        let value = column(&key.columns[i].0)?;
        Some((None, value.map_or(Given::Null, Given::Text)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::query::analysis::analyze;

    fn key(cols: &[(&str, KeyType)]) -> RowKey {
        RowKey {
            columns: cols.iter().map(|(n, t)| ((*n).into(), *t)).collect(),
        }
    }

    fn bind(values: &[Option<&[u8]>], formats: &[i16]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&(formats.len() as i16).to_be_bytes());
        for f in formats {
            b.extend_from_slice(&f.to_be_bytes());
        }
        b.extend_from_slice(&(values.len() as i16).to_be_bytes());
        for v in values {
            match v {
                Some(v) => {
                    b.extend_from_slice(&(v.len() as i32).to_be_bytes());
                    b.extend_from_slice(v);
                }
                None => b.extend_from_slice(&(-1i32).to_be_bytes()),
            }
        }
        b.extend_from_slice(&0i16.to_be_bytes());
        b
    }

    fn types(oids: &[u32]) -> Vec<u8> {
        let mut t = (oids.len() as i16).to_be_bytes().to_vec();
        for o in oids {
            t.extend_from_slice(&o.to_be_bytes());
        }
        t
    }

    fn read_slots(sql: &str, k: &RowKey, values: Values<'_>, v: &Versions) -> Option<Vec<u32>> {
        let a = analyze(sql);
        let filter = a.read.unwrap().filter?;
        let plan = PointPlan::new(&filter, "t", k)?;
        let mut out = Vec::new();
        plan.push_slots(v, "db", &values, &mut out).then_some(out)
    }

    fn write_slots(sql: &str, k: &RowKey, values: Values<'_>, v: &Versions) -> Option<Vec<u32>> {
        let a = analyze(sql);
        let w = a.effects.rows?;
        let mut out = Vec::new();
        push_write_slots(&w, k, v, "db", &values, &mut out).then_some(out)
    }

    fn wal(k: &RowKey, v: &Versions, cols: &[(&str, &str)]) -> u32 {
        text_row_slot(v, "db", "t", k, |c| {
            cols.iter()
                .find(|(n, _)| *n == c)
                .map(|(_, v)| Some(v.as_bytes()))
        })
        .unwrap()
    }

    #[test]
    fn every_way_of_giving_a_key_names_the_same_row() {
        let v = Versions::new(1 << 20);
        let id = key(&[("id", KeyType::Integer(4))]);
        let seven = wal(&id, &v, &[("id", "7")]);
        let text = bind(&[Some(b"7")], &[]);
        let binary = bind(&[Some(&7i32.to_be_bytes())], &[1]);
        let binary8 = bind(&[Some(&7i64.to_be_bytes())], &[1]);
        let no_types = types(&[]);
        let int8 = types(&[INT8]);
        let float8 = types(&[701]);
        for (sql, values) in [
            ("SELECT a FROM t WHERE id = 7", Values::None),
            ("SELECT a FROM t WHERE id = ' 7'", Values::None),
            ("SELECT a FROM t WHERE id = '007'::int8", Values::None),
            (
                "SELECT a FROM t WHERE id = $1",
                Values::Bind {
                    rest: &text,
                    types: &no_types,
                },
            ),
            (
                "SELECT a FROM t WHERE id = $1",
                Values::Bind {
                    rest: &binary,
                    types: &no_types,
                },
            ),
            (
                "SELECT a FROM t WHERE id = $1",
                Values::Bind {
                    rest: &binary8,
                    types: &int8,
                },
            ),
        ] {
            assert_eq!(read_slots(sql, &id, values, &v), Some(vec![seven]), "{sql}");
        }
        // Not canonical: no row named.
        for (sql, values) in [
            ("SELECT a FROM t WHERE id = 7.0", Values::None),
            ("SELECT a FROM t WHERE id = '0x7'", Values::None),
            ("SELECT a FROM t WHERE id = NULL", Values::None),
            (
                "SELECT a FROM t WHERE id = $1",
                Values::Bind {
                    rest: &binary8,
                    types: &float8,
                },
            ),
            (
                "SELECT a FROM t WHERE id = $1",
                Values::Bind {
                    rest: &binary8,
                    types: &no_types,
                },
            ),
            (
                "SELECT a FROM t WHERE id = $2",
                Values::Bind {
                    rest: &text,
                    types: &no_types,
                },
            ),
        ] {
            assert_eq!(read_slots(sql, &id, values, &v), None, "{sql}");
        }
        // Writes.
        let update = "UPDATE t SET v = 1 WHERE id = $1";
        assert_eq!(
            write_slots(
                update,
                &id,
                Values::Bind {
                    rest: &text,
                    types: &no_types
                },
                &v
            ),
            Some(vec![seven])
        );
        let insert =
            "INSERT INTO t (v, id) VALUES (1, 7), (2, 8) ON CONFLICT (id) DO UPDATE SET v = 3";
        let eight = wal(&id, &v, &[("id", "8")]);
        assert_eq!(
            write_slots(insert, &id, Values::None, &v),
            Some(vec![seven, eight])
        );
        for sql in [
            "UPDATE t SET id = 8 WHERE id = 7",
            "UPDATE t SET v = 1 WHERE v = 7",
            "INSERT INTO t (v) VALUES (1)",
            "INSERT INTO t (id, v) VALUES (7, 1) ON CONFLICT (v) DO UPDATE SET v = 2",
            "INSERT INTO t (id, v) VALUES (7, 1) ON CONFLICT ON CONSTRAINT c DO UPDATE SET v = 2",
            "INSERT INTO t (id, v) VALUES (7 + 1, 1)",
            "DELETE FROM t",
        ] {
            assert_eq!(write_slots(sql, &id, Values::None, &v), None, "{sql}");
        }
        assert!(write_slots(
            "INSERT INTO t (id) VALUES (7) ON CONFLICT DO NOTHING",
            &id,
            Values::None,
            &v
        )
        .is_some());
    }

    #[test]
    fn composite_uuid_and_text_keys() {
        let v = Versions::new(1 << 20);
        let k = key(&[("a", KeyType::Uuid), ("b", KeyType::Text)]);
        let u = "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11";
        let row = wal(&k, &v, &[("b", "x"), ("a", u)]);
        let read = read_slots(
            "SELECT * FROM t WHERE b IN ('x', 'y') AND a = '{A0EEBC999C0B4EF8BB6D6BB9BD380A11}'",
            &k,
            Values::None,
            &v,
        )
        .unwrap();
        assert_eq!(read.len(), 2);
        assert_eq!(read[0], row);
        assert_ne!(read[1], row);
        // A key column not bound: not a point read.
        assert!(read_slots("SELECT * FROM t WHERE b = 'x'", &k, Values::None, &v).is_none());
        // Non-ASCII text: its bytes depend on the client's encoding.
        assert!(read_slots(
            &format!("SELECT * FROM t WHERE a = '{u}' AND b = 'é'"),
            &k,
            Values::None,
            &v
        )
        .is_none());
    }

    #[test]
    fn a_number_written_into_a_text_key_is_its_decimal_text() {
        let v = Versions::new(1 << 20);
        let k = key(&[("k", KeyType::Text)]);
        let seven = wal(&k, &v, &[("k", "7")]);
        let w = |sql: &str| write_slots(sql, &k, Values::None, &v);
        assert_eq!(w("INSERT INTO t (k) VALUES (007)"), Some(vec![seven]));
        assert_eq!(w("INSERT INTO t (k) VALUES ('7')"), Some(vec![seven]));
        // PostgreSQL stores '007' for the string, '1000' for 1e3, '7.0' for 7.0.
        assert_ne!(w("INSERT INTO t (k) VALUES ('007')"), Some(vec![seven]));
        assert_eq!(w("INSERT INTO t (k) VALUES (1e3)"), None);
        assert_eq!(w("INSERT INTO t (k) VALUES (7.0)"), None);
        // Into a varchar(1), '7 ' is stored as '7'.
        assert_eq!(w("INSERT INTO t (k) VALUES ('7 ')"), None);
    }

    #[test]
    fn a_bind_is_read_with_its_formats() {
        let b = bind(&[Some(b"1"), None, Some(b"abc")], &[0, 1, 0]);
        let t = types(&[0, 23]);
        assert!(matches!(bind_param(&b, &t, 0), Some(Given::Text(b"1"))));
        assert!(matches!(bind_param(&b, &t, 1), Some(Given::Null)));
        assert!(matches!(bind_param(&b, &t, 2), Some(Given::Text(b"abc"))));
        assert!(bind_param(&b, &t, 3).is_none());
        assert!(bind_param(&b[..b.len() - 4], &t, 2).is_none());
    }
}
