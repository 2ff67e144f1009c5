//! Which rows a statement reads or writes, when its text fixes them: the equalities of a
//! `WHERE` (`id = $1`, `id IN (1, 2)`, `a = 1 AND b = $2`) and the rows of an `INSERT ...
//! VALUES`, from PostgreSQL's own parse (pg_query), once per statement shape on the cold path.
//!
//! This module only reads the tree: which columns are bound to which constants or parameters.
//! Whether those columns are a key of the table, and what the values are at run time, is the
//! cache's business (`cache::rows`), with the catalog in hand. Everything here errs on one
//! side: a column whose binding is not certain is left out (a read then depends on its whole
//! table, a write then writes rows pgmemo cannot name).

use super::analysis::{last_name, rel_name, RelName};
use serde_json::Value;

/// The most values an `IN` list or a `VALUES` list may give before the statement is taken
/// as touching rows that are not named (a write) or the whole table (a read).
pub const MAX_VALUES: usize = 256;

/// The type family a cast gives a value (`'7'::int8`): only casts that keep the value as
/// written are followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// An integer type of this many bytes.
    Integer(u8),
    Text,
    Uuid,
}

/// Where a bound value comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The statement's `$n` (1-based): a Bind's value, or a simple query's n-th parameter
    /// literal.
    Param(u16),
    /// A constant of the text: its place (bytes) and its value as PostgreSQL read it (None:
    /// NULL). In a simple query's shape, the lexer then says whether it is one of the
    /// parameters (see [`Bound::bind_literals`]).
    Const {
        location: u32,
        value: Option<Box<str>>,
        /// A number (`7`, `1.5`, `1e3`), not a string: written into a text column it is
        /// the number's text (`1e3` as `1000`), not its spelling.
        number: bool,
    },
}

/// One value a column is bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub origin: Origin,
    /// The family of the type it is cast to, if it is.
    pub cast: Option<Family>,
}

/// A column and the values it equals (one for `=`, several for `IN`: any of them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bound {
    /// The column's name, as PostgreSQL folds it.
    pub column: Box<str>,
    pub values: Vec<Source>,
}

/// A single-table read whose `WHERE` binds columns by equality.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadFilter {
    pub relation: RelName,
    pub columns: Vec<Bound>,
}

/// A write to one table whose rows its text names, as far as it names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowWrite {
    /// The table written (its name, without schema, as the versions name tables).
    pub table: Box<str>,
    pub rows: Rows,
    /// The columns an `UPDATE` (or `ON CONFLICT DO UPDATE`) assigns.
    pub sets: Vec<Box<str>>,
}

/// How a write names its rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rows {
    /// `UPDATE` / `DELETE ... WHERE` these columns equal these values.
    Filter(Vec<Bound>),
    /// `INSERT (columns) VALUES` these rows; a value that is not a constant or a parameter
    /// (an expression, `DEFAULT`) is None. `conflict`: `ON CONFLICT DO UPDATE`'s arbiter
    /// columns (empty: named by constraint, or no column list), else None.
    Values {
        columns: Vec<Box<str>>,
        rows: Vec<Vec<Option<Source>>>,
        conflict: Option<Vec<Box<str>>>,
    },
}

// pg_query's enum values, as its protobuf numbers them.
pub(super) const AEXPR_OP: i64 = 1;
const AEXPR_IN: i64 = 7;
const AND_EXPR: i64 = 1;
const SETOP_NONE: i64 = 1;
const LIMIT_OPTION_COUNT: i64 = 2;
const ONCONFLICT_NONE: i64 = 1;
const ONCONFLICT_NOTHING: i64 = 2;
const ONCONFLICT_UPDATE: i64 = 3;

pub(super) fn empty(v: &Value) -> bool {
    v.is_null() || v.as_array().is_some_and(Vec::is_empty)
}

/// Whether a `SubLink` (a subquery) is anywhere in `v`.
pub(super) fn has_sublink(v: &Value) -> bool {
    has_key(v, "SubLink")
}

/// Whether a node keyed `key` is anywhere in `v`.
fn has_key(v: &Value, key: &str) -> bool {
    match v {
        Value::Object(o) => o.contains_key(key) || o.values().any(|v| has_key(v, key)),
        Value::Array(a) => a.iter().any(|v| has_key(v, key)),
        _ => false,
    }
}

pub(super) fn string_of(node: &Value) -> Option<&str> {
    node["node"]["String"]["sval"].as_str()
}

/// The relation a `RangeVar` names, if it names one.
pub(super) fn relation(range_var: &Value) -> Option<RelName> {
    range_var["relname"].as_str().filter(|n| !n.is_empty())?;
    Some(rel_name(range_var))
}

/// The alias a `RangeVar` has, if any.
pub(super) fn alias(range_var: &Value) -> Option<&str> {
    range_var["alias"]["aliasname"].as_str()
}

/// A single SELECT of one table (`SELECT ... FROM t [alias] WHERE ...`, no subquery, no
/// WITH, no set operation): the columns its WHERE binds.
pub fn read_filter(select: &Value) -> Option<ReadFilter> {
    if select["op"].as_i64() != Some(SETOP_NONE)
        || !empty(&select["with_clause"])
        || has_sublink(select)
    {
        return None;
    }
    let [from] = select["from_clause"].as_array()?.as_slice() else {
        return None;
    };
    let range_var = from["node"].get("RangeVar")?;
    let relation = relation(range_var)?;
    let columns = conjuncts(&select["where_clause"], &relation.name, alias(range_var));
    (!columns.is_empty()).then_some(ReadFilter { relation, columns })
}

/// What a SELECT's text says toward "it returns at most one row" (a row-limited Execute of
/// it in a transaction block may then be answered from the cache: see `cache::rows::OneRow`).
/// The catalog finishes the reading: which names are aggregates, which functions return sets,
/// which columns are a unique key.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RowCount {
    /// `LIMIT 0` or `LIMIT 1` (`FETCH FIRST 1 ROW ONLY`, not `WITH TIES`): at most one row
    /// whatever else it does.
    pub limited: bool,
    /// One query (no set operation) that groups nothing into more rows than it reads: no
    /// `GROUPING SETS`, `ROLLUP` or `CUBE`, no `VALUES` list.
    pub plain: bool,
    /// A plain query with no `FROM`: one row (unless a set-returning function makes more).
    pub no_from: bool,
    /// A plain query without `GROUP BY`: the calls at its top (target list, `HAVING`; not
    /// inside a subquery, not a window call) that make it an aggregate if any of them is one
    /// (one row then). `certain`: one of them can only be an aggregate (`count(*)`,
    /// `DISTINCT`, `ORDER BY` or `FILTER` in its arguments, `WITHIN GROUP`).
    pub aggregate_calls: Vec<Box<str>>,
    pub certain_aggregate: bool,
}

/// How many rows `select` (a `SelectStmt`) returns, as far as its text says (see
/// [`RowCount`]).
pub fn row_count(select: &Value) -> RowCount {
    let limited = select["limit_option"].as_i64() == Some(LIMIT_OPTION_COUNT)
        && select["limit_count"]["node"]["AConst"]["val"]["Ival"]
            .as_object()
            .is_some_and(|v| matches!(v.get("ival").map_or(Some(0), Value::as_i64), Some(0 | 1)));
    let plain = select["op"].as_i64() == Some(SETOP_NONE)
        && empty(&select["values_lists"])
        && !has_key(&select["group_clause"], "GroupingSet");
    let mut count = RowCount {
        limited,
        plain,
        no_from: plain && empty(&select["from_clause"]),
        ..RowCount::default()
    };
    if plain && empty(&select["group_clause"]) {
        for part in [&select["target_list"], &select["having_clause"]] {
            top_calls(part, &mut count);
        }
    }
    count
}

/// The calls in `v` that are not window calls, outside subqueries (see [`RowCount`]).
fn top_calls(v: &Value, count: &mut RowCount) {
    match v {
        Value::Object(o) => {
            for (key, inner) in o {
                match key.as_str() {
                    "SubLink" => {}
                    "FuncCall" => {
                        if inner["over"].is_null() {
                            let certain = inner["agg_star"].as_bool() == Some(true)
                                || inner["agg_distinct"].as_bool() == Some(true)
                                || inner["agg_within_group"].as_bool() == Some(true)
                                || !empty(&inner["agg_order"])
                                || !inner["agg_filter"].is_null();
                            count.certain_aggregate |= certain;
                            if let Some(name) = super::analysis::last_name(&inner["funcname"]) {
                                if !count.aggregate_calls.iter().any(|n| **n == *name) {
                                    count.aggregate_calls.push(name.into());
                                }
                            }
                        }
                        top_calls(inner, count);
                    }
                    _ => top_calls(inner, count),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| top_calls(v, count)),
        _ => {}
    }
}

/// What a view that is a plain projection of one table shows of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Projection {
    pub table: Box<str>,
    /// (view column, table column) for each of the view's columns that is a table column.
    pub columns: Vec<(Box<str>, Box<str>)>,
}

/// A view that is a plain projection of one table (`SELECT t.a, t.b AS c FROM t [WHERE
/// ...]`, as `pg_get_viewdef` writes it: no join, subquery, grouping, DISTINCT, LIMIT or set
/// operation), from the parse of its definition. None: not such a view.
pub fn view_projection(definition: &Value) -> Option<Projection> {
    let select = definition["stmts"][0]["stmt"]["node"].get("SelectStmt")?;
    let plain = select["op"].as_i64() == Some(SETOP_NONE)
        && empty(&select["with_clause"])
        && empty(&select["distinct_clause"])
        && empty(&select["group_clause"])
        && select["having_clause"].is_null()
        && select["limit_count"].is_null()
        && select["limit_offset"].is_null()
        && empty(&select["window_clause"])
        && !has_sublink(select);
    if !plain || definition["stmts"].as_array().map(Vec::len) != Some(1) {
        return None;
    }
    let [from] = select["from_clause"].as_array()?.as_slice() else {
        return None;
    };
    let range_var = from["node"].get("RangeVar")?;
    let table = relation(range_var)?.name;
    let table_alias = alias(range_var);
    let mut columns = Vec::new();
    for target in select["target_list"].as_array()? {
        let target = &target["node"]["ResTarget"];
        let Some(base) = column(&target["val"], &table, table_alias) else {
            continue;
        };
        let name = target["name"]
            .as_str()
            .filter(|n| !n.is_empty())
            .map_or_else(|| base.clone(), Into::into);
        columns.push((name, base));
    }
    Some(Projection { table, columns })
}

/// What an INSERT, UPDATE or DELETE statement (`node`, the statement's node) names of the
/// rows it writes; None: not one of those, or more than its text says may be written
/// (WITH, a subquery, `UPDATE ... FROM`, `DELETE ... USING`, `INSERT ... SELECT`).
pub fn row_write(node: &Value) -> Option<RowWrite> {
    let (kind, inner) = node.as_object()?.iter().next()?;
    if !empty(&inner["with_clause"]) {
        return None;
    }
    let range_var = &inner["relation"];
    let table = relation(range_var)?.name;
    let table_alias = alias(range_var);
    let sets = |list: &Value| -> Vec<Box<str>> {
        list.as_array()
            .map(|l| {
                l.iter()
                    .filter_map(|t| t["node"]["ResTarget"]["name"].as_str())
                    .map(Into::into)
                    .collect()
            })
            .unwrap_or_default()
    };
    match kind.as_str() {
        "UpdateStmt" | "DeleteStmt" => {
            // With `FROM`/`USING` or a subquery in its `WHERE`, its rows are not named, but
            // what it assigns still is (see `query::columns`).
            let named = empty(&inner["from_clause"])
                && empty(&inner["using_clause"])
                && !has_sublink(&inner["where_clause"]);
            let columns = if named {
                conjuncts(&inner["where_clause"], &table, table_alias)
            } else {
                Vec::new()
            };
            Some(RowWrite {
                rows: Rows::Filter(columns),
                sets: sets(&inner["target_list"]),
                table,
            })
        }
        "InsertStmt" => {
            let select = inner["select_stmt"]["node"].get("SelectStmt")?;
            let values = select["values_lists"].as_array()?;
            if values.is_empty() || values.len() > MAX_VALUES || has_sublink(select) {
                return None;
            }
            let columns: Vec<Box<str>> = inner["cols"]
                .as_array()?
                .iter()
                .map(|c| {
                    let target = &c["node"]["ResTarget"];
                    // `INSERT (a.b)`, `INSERT (a[1])`: not a plain column.
                    empty(&target["indirection"])
                        .then(|| target["name"].as_str().map(Into::into))
                        .flatten()
                })
                .collect::<Option<_>>()?;
            let rows = values
                .iter()
                .map(|row| {
                    row["node"]["List"]["items"]
                        .as_array()
                        .map(|items| items.iter().map(source).collect())
                })
                .collect::<Option<Vec<Vec<_>>>>()?;
            let on_conflict = &inner["on_conflict_clause"];
            let (conflict, sets) = match on_conflict["action"].as_i64() {
                None | Some(ONCONFLICT_NONE) | Some(ONCONFLICT_NOTHING) => (None, Vec::new()),
                Some(ONCONFLICT_UPDATE) => {
                    let elems = on_conflict["infer"]["index_elems"].as_array();
                    let arbiters = elems
                        .map(|e| {
                            e.iter()
                                .map(|e| e["node"]["IndexElem"]["name"].as_str())
                                .collect::<Option<Vec<&str>>>()
                                .map(|names| names.into_iter().map(Into::into).collect())
                                .unwrap_or_default()
                        })
                        .unwrap_or_default();
                    (Some(arbiters), sets(&on_conflict["target_list"]))
                }
                Some(_) => return None,
            };
            Some(RowWrite {
                table,
                rows: Rows::Values {
                    columns,
                    rows,
                    conflict,
                },
                sets,
            })
        }
        _ => None,
    }
}

/// The columns of `table` (or its `alias`) that the AND-ed equalities of `clause` bind:
/// `col = value`, `value = col`, `col IN (values)`. Anything else in the clause only narrows
/// the rows further and is not read.
pub(super) fn conjuncts(clause: &Value, table: &str, alias: Option<&str>) -> Vec<Bound> {
    let mut out: Vec<Bound> = Vec::new();
    for e in and_equalities(clause) {
        let found = match e["kind"].as_i64() {
            Some(AEXPR_OP) => column(&e["lexpr"], table, alias)
                .zip(source(&e["rexpr"]).map(|s| vec![s]))
                .or_else(|| {
                    column(&e["rexpr"], table, alias).zip(source(&e["lexpr"]).map(|s| vec![s]))
                }),
            Some(AEXPR_IN) => column(&e["lexpr"], table, alias).zip(
                e["rexpr"]["node"]["List"]["items"]
                    .as_array()
                    .filter(|items| items.len() <= MAX_VALUES)
                    .and_then(|items| items.iter().map(source).collect::<Option<Vec<_>>>()),
            ),
            _ => None,
        };
        let Some((column, values)) = found else {
            continue;
        };
        // `a = 1 AND a = 2`: bound to either (more rows than match, never fewer).
        match out.iter_mut().find(|b| b.column == column) {
            Some(b) => b.values.extend(values),
            None => out.push(Bound { column, values }),
        }
    }
    out
}

/// The `=` comparisons (`AExpr`s: `a = b`, `a IN (...)`) AND-ed at the top of `clause`.
pub(super) fn and_equalities(clause: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    let mut stack = vec![clause];
    while let Some(node) = stack.pop() {
        let node = &node["node"];
        if let Some(b) = node.get("BoolExpr") {
            if b["boolop"].as_i64() == Some(AND_EXPR) {
                stack.extend(b["args"].as_array().into_iter().flatten());
            }
            continue;
        }
        let Some(e) = node.get("AExpr") else {
            continue;
        };
        if let [op] = e["name"].as_array().map(Vec::as_slice).unwrap_or_default() {
            if string_of(op) == Some("=") {
                out.push(e);
            }
        }
    }
    out
}

/// The column of `table` a `ColumnRef` names (`col`, `table.col` or `alias.col`).
fn column(node: &Value, table: &str, alias: Option<&str>) -> Option<Box<str>> {
    let fields = node["node"]["ColumnRef"]["fields"].as_array()?;
    match fields.as_slice() {
        [col] => string_of(col).map(Into::into),
        [qualifier, col] => {
            let q = string_of(qualifier)?;
            let ok = match alias {
                Some(a) => q == a,
                None => q == table,
            };
            ok.then(|| string_of(col).map(Into::into)).flatten()
        }
        _ => None,
    }
}

/// A constant or a parameter, possibly cast to a type that keeps its value as written.
fn source(node: &Value) -> Option<Source> {
    let n = &node["node"];
    if let Some(cast) = n.get("TypeCast") {
        let ty = &cast["type_name"];
        if !empty(&ty["typmods"]) || !empty(&ty["array_bounds"]) {
            return None;
        }
        let family = match last_name(&ty["names"])? {
            "int2" | "smallint" => Family::Integer(2),
            "int4" | "integer" | "int" => Family::Integer(4),
            "int8" | "bigint" => Family::Integer(8),
            "text" | "varchar" => Family::Text,
            "uuid" => Family::Uuid,
            _ => return None,
        };
        let inner = source(&cast["arg"])?;
        if inner.cast.is_some_and(|f| !same_family(f, family)) {
            return None;
        }
        return Some(Source {
            cast: Some(family),
            ..inner
        });
    }
    if let Some(p) = n.get("ParamRef") {
        let number = u16::try_from(p["number"].as_i64()?).ok()?;
        return (number > 0).then_some(Source {
            origin: Origin::Param(number),
            cast: None,
        });
    }
    let c = n.get("AConst")?;
    let location = u32::try_from(c["location"].as_i64()?).ok()?;
    let v = &c["val"];
    let number = v.get("Ival").is_some() || v.get("Fval").is_some();
    let value = if c["isnull"].as_bool() == Some(true) {
        None
    } else {
        Some(if let Some(i) = v["Ival"].as_object() {
            // Protobuf leaves a zero out.
            i.get("ival")
                .and_then(Value::as_i64)
                .unwrap_or(0)
                .to_string()
                .into()
        } else if let Some(s) = v["Sval"]["sval"].as_str() {
            s.into()
        } else if let Some(f) = v["Fval"]["fval"].as_str() {
            f.into()
        } else {
            return None;
        })
    };
    Some(Source {
        origin: Origin::Const {
            location,
            value,
            number,
        },
        cast: None,
    })
}

/// Whether two casts keep a value in one family (`'7'::int2::int8`).
pub fn same_family(a: Family, b: Family) -> bool {
    matches!(
        (a, b),
        (Family::Integer(_), Family::Integer(_))
            | (Family::Text, Family::Text)
            | (Family::Uuid, Family::Uuid)
    )
}

impl Source {
    /// In a simple query's shape: a constant the lexer made its n-th parameter becomes
    /// `$n` (its value differs from one query of the shape to the next); one it kept in the
    /// text stays (every query of the shape has it). None: the lexer has no literal that
    /// starts there (`-1` is `-` and `1` to it, not one constant): not followed.
    fn bind(&mut self, literals: &[(u32, Option<u16>)]) -> Option<()> {
        if let Origin::Const { location, .. } = self.origin {
            let &(_, param) = literals.iter().find(|(start, _)| *start == location)?;
            if let Some(n) = param {
                self.origin = Origin::Param(n);
            }
        }
        Some(())
    }
}

/// Binds the constants of `columns` to a simple query's literals (see [`Source::bind`]):
/// `literals` gives each literal's start and, for a parameter, its `$n`. A column with a
/// value the lexer does not have is dropped.
pub fn bind_columns(columns: &mut Vec<Bound>, literals: &[(u32, Option<u16>)]) {
    columns.retain_mut(|b| b.values.iter_mut().all(|s| s.bind(literals).is_some()));
}

impl RowWrite {
    /// [`bind_columns`] for a write: a VALUES entry the lexer does not have becomes None.
    pub fn bind_literals(&mut self, literals: &[(u32, Option<u16>)]) {
        match &mut self.rows {
            Rows::Filter(columns) => bind_columns(columns, literals),
            Rows::Values { rows, .. } => {
                for value in rows.iter_mut().flatten() {
                    if value.as_mut().is_some_and(|s| s.bind(literals).is_none()) {
                        *value = None;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(sql: &str) -> Value {
        let crate::query::Parsed::Tree(t) = crate::query::parse(sql) else {
            panic!("{sql}");
        };
        t["stmts"][0]["stmt"]["node"].clone()
    }

    fn read(sql: &str) -> Option<ReadFilter> {
        read_filter(&tree(sql)["SelectStmt"])
    }

    fn param(n: u16) -> Source {
        Source {
            origin: Origin::Param(n),
            cast: None,
        }
    }

    fn columns(f: &ReadFilter) -> Vec<(&str, usize)> {
        f.columns
            .iter()
            .map(|b| (&*b.column, b.values.len()))
            .collect()
    }

    #[test]
    fn a_read_binds_the_columns_its_where_fixes() {
        let f = read("SELECT a FROM t WHERE id = $1").unwrap();
        assert_eq!(&*f.relation.name, "t");
        assert_eq!(f.columns[0].values, vec![param(1)]);
        let f = read("SELECT a FROM s.t x WHERE x.id IN (1, $2) AND 3 = k AND v > 2").unwrap();
        assert_eq!(columns(&f), vec![("k", 1), ("id", 2)]);
        let f = read("SELECT * FROM t WHERE id = '7'::int8 AND a = 1 AND a = 2").unwrap();
        assert_eq!(columns(&f), vec![("a", 2), ("id", 1)]);
        assert_eq!(f.columns[1].values[0].cast, Some(Family::Integer(8)));
        // Not bound: another table's qualifier, OR, casts that change a value, a column's
        // expression.
        assert!(read("SELECT a FROM t x WHERE t.id = 1").is_none());
        assert!(read("SELECT a FROM t WHERE id = 1 OR id = 2").is_none());
        assert!(read("SELECT a FROM t WHERE k = 'abc'::varchar(2)").is_none());
        assert!(read("SELECT a FROM t WHERE k = '7.5'::numeric").is_none());
        assert!(read("SELECT a FROM t WHERE id + 0 = 1").is_none());
        assert!(read("SELECT a FROM t WHERE id <> 1").is_none());
        assert!(read("SELECT a FROM t WHERE id NOT IN (1)").is_none());
    }

    #[test]
    fn a_read_of_more_than_one_table_is_not_a_filter() {
        assert!(read("SELECT a FROM t, u WHERE t.id = 1").is_none());
        assert!(read("SELECT a FROM t JOIN u USING (id) WHERE id = 1").is_none());
        assert!(read("SELECT (SELECT count(*) FROM t) FROM t WHERE id = 1").is_none());
        assert!(read("SELECT a FROM t WHERE id = 1 AND EXISTS (SELECT 1 FROM u)").is_none());
        assert!(read("WITH w AS (SELECT 1) SELECT a FROM t WHERE id = 1").is_none());
        assert!(read("SELECT a FROM t WHERE id = 1 UNION SELECT a FROM t WHERE id = 2").is_none());
        assert!(read("SELECT a FROM f(1) WHERE id = 1").is_none());
    }

    #[test]
    fn writes_name_their_rows_as_far_as_their_text_does() {
        let w = row_write(&tree("UPDATE t SET v = 1, w = $2 WHERE id = $1")).unwrap();
        assert_eq!(&*w.table, "t");
        assert_eq!(w.sets, vec!["v".into(), "w".into()] as Vec<Box<str>>);
        assert_eq!(
            w.rows,
            Rows::Filter(vec![Bound {
                column: "id".into(),
                values: vec![param(1)]
            }])
        );
        let w = row_write(&tree("DELETE FROM s.t WHERE id IN ($1, $2)")).unwrap();
        assert!(matches!(&w.rows, Rows::Filter(c) if c[0].values.len() == 2));
        let w = row_write(&tree(
            "INSERT INTO t (id, v) VALUES ($1, now()), (2, DEFAULT) ON CONFLICT (id) DO UPDATE SET v = 1",
        ))
        .unwrap();
        let Rows::Values {
            columns,
            rows,
            conflict,
        } = &w.rows
        else {
            panic!()
        };
        assert_eq!(columns.len(), 2);
        assert_eq!(rows[0][0], Some(param(1)));
        assert_eq!(rows[0][1], None);
        assert_eq!(conflict.as_deref(), Some(&["id".into()] as &[Box<str>]));
        assert_eq!(w.sets, vec!["v".into()] as Vec<Box<str>>);
        // More than the text says: no row named, but what an UPDATE assigns still is.
        for (sql, sets) in [
            ("UPDATE t SET v = 1 FROM u WHERE t.id = u.id", &["v"][..]),
            ("DELETE FROM t USING u WHERE t.id = 1", &[][..]),
            (
                "UPDATE t SET v = 1, w = 2 WHERE id = (SELECT 1)",
                &["v", "w"][..],
            ),
        ] {
            let w = row_write(&tree(sql)).unwrap();
            assert_eq!(w.rows, Rows::Filter(vec![]), "{sql}");
            assert_eq!(
                w.sets.iter().map(|s| &**s).collect::<Vec<_>>(),
                sets,
                "{sql}"
            );
        }
        assert!(row_write(&tree("INSERT INTO t SELECT * FROM u")).is_none());
        assert!(row_write(&tree(
            "WITH x AS (SELECT 1) UPDATE t SET v = 1 WHERE id = 1"
        ))
        .is_none());
        assert!(row_write(&tree("INSERT INTO t (id) VALUES ((SELECT 1))")).is_none());
        // The rows of an UPDATE without a WHERE, or with an OR, are not named: no column.
        let w = row_write(&tree("UPDATE t SET v = 1 WHERE id = 1 OR id = 2")).unwrap();
        assert_eq!(w.rows, Rows::Filter(vec![]));
    }

    #[test]
    fn a_view_that_projects_one_table_maps_its_columns() {
        let def = |sql: &str| {
            let crate::query::Parsed::Tree(t) = crate::query::parse(sql) else {
                panic!("{sql}");
            };
            view_projection(&t)
        };
        let Projection { table, columns } =
            def(" SELECT t.id AS key, t.v, (t.v * 2) AS w FROM t WHERE (t.v > 0);").unwrap();
        assert_eq!(&*table, "t");
        let names: Vec<(&str, &str)> = columns.iter().map(|(a, b)| (&**a, &**b)).collect();
        assert_eq!(names, vec![("key", "id"), ("v", "v")]);
        assert!(def("SELECT DISTINCT t.id FROM t").is_none());
        assert!(def("SELECT t.id FROM t JOIN u ON true").is_none());
        assert!(def("SELECT t.id FROM t LIMIT 1").is_none());
        assert!(def("SELECT t.id FROM t GROUP BY t.id").is_none());
        assert!(def("SELECT t.id FROM t UNION SELECT u.id FROM u").is_none());
    }

    #[test]
    fn a_simple_querys_constants_become_its_parameters() {
        let sql = "SELECT a FROM t WHERE id = 7 AND k = 'x' AND z = -3";
        let mut f = read(sql).unwrap();
        // 7 is $1, 'x' is kept in the text, -3 is `-` and a literal `3` to the lexer.
        let seven = sql.find('7').unwrap() as u32;
        let x = sql.find('\'').unwrap() as u32;
        let three = sql.find('3').unwrap() as u32;
        bind_columns(
            &mut f.columns,
            &[(seven, Some(1)), (x, None), (three, Some(2))],
        );
        let bound: Vec<(&str, &Origin)> = f
            .columns
            .iter()
            .map(|b| (&*b.column, &b.values[0].origin))
            .collect();
        assert_eq!(
            bound,
            vec![
                (
                    "k",
                    &Origin::Const {
                        location: x,
                        value: Some("x".into()),
                        number: false,
                    }
                ),
                ("id", &Origin::Param(1)),
            ]
        );
    }

    fn count(sql: &str) -> RowCount {
        row_count(&tree(sql)["SelectStmt"])
    }

    #[test]
    fn row_counts_read_from_the_text() {
        assert!(count("SELECT a FROM t ORDER BY a LIMIT 1").limited);
        assert!(count("SELECT a FROM t LIMIT 0").limited);
        assert!(count("SELECT a FROM t FETCH FIRST 1 ROW ONLY").limited);
        assert!(!count("SELECT a FROM t ORDER BY a FETCH FIRST 1 ROW WITH TIES").limited);
        assert!(!count("SELECT a FROM t LIMIT 2").limited);
        assert!(!count("SELECT a FROM t LIMIT $1").limited);
        assert!(count("(SELECT a FROM t UNION SELECT b FROM u) LIMIT 1").limited);
        let c = count("SELECT 1 + 2");
        assert!(c.plain && c.no_from);
        assert!(!count("VALUES (1), (2)").no_from);
        assert!(!count("SELECT 1 UNION SELECT 2").plain);
        let c = count("SELECT count(*) FROM t WHERE a = 1");
        assert!(c.certain_aggregate && c.aggregate_calls == ["count".into()] as [Box<str>; 1]);
        let c = count("SELECT abs(max(a)) FROM t");
        assert!(!c.certain_aggregate);
        assert_eq!(
            c.aggregate_calls,
            ["abs".into(), "max".into()] as [Box<str>; 2]
        );
        // A window call, a call in a subquery, GROUP BY: no aggregate of this query.
        assert!(count("SELECT count(*) OVER () FROM t")
            .aggregate_calls
            .is_empty());
        assert!(count("SELECT (SELECT max(b) FROM u) FROM t")
            .aggregate_calls
            .is_empty());
        assert!(count("SELECT count(*) FROM t GROUP BY a")
            .aggregate_calls
            .is_empty());
        assert!(!count("SELECT count(*) FROM t GROUP BY ROLLUP (a)").plain);
        assert!(count("SELECT a, count(*) FROM t GROUP BY a").plain);
    }
}
