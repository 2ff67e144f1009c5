//! Which columns of each table a read uses, and what else about it decides which writes can
//! change its result, from PostgreSQL's own parse (pg_query), once per statement shape on
//! the cold path (see `cache::rows`' column-level dependencies).
//!
//! A read's result can only change by a write to a table it reads when that write
//! - adds or removes rows it may select (an `INSERT`, a `DELETE`): unless its `WHERE` fixes a
//!   column of the table by equality (`user_id = $1`, [`TableUse::filter`]), when only a row
//!   with that value can;
//! - assigns a column it uses (an `UPDATE`'s `SET`): every column named anywhere in it,
//!   [`TableUse::columns`];
//! - moves rows: an `UPDATE` writes a new version of each row it changes, so a read whose
//!   output order is the order PostgreSQL happens to scan rows in (no `ORDER BY` that makes
//!   it total, an aggregate whose result depends on its input's order) may come out
//!   differently — unless its `ORDER BY` covers a unique key of the table
//!   ([`TableUse::order`], checked with the catalog) or it is one row of order-blind
//!   aggregates ([`ColumnReads::one_row`]).
//!
//! `*` and a whole row (`t.*`, `SELECT t FROM t`) use every column the catalog lists for the
//! table ([`TableUse::star`]). Everything else errs on one side: what is not certain is read
//! as "every column and more" (a system column, which every write changes), or the read is
//! not analyzed at all (a subquery, `WITH`, a set operation, a window function, a function in
//! `FROM`, `TABLESAMPLE`, a `NATURAL` join): it then depends on every write to its tables.

use super::analysis::{last_name, RelName};
use super::point::{
    alias, and_equalities, conjuncts, empty, has_sublink, relation, string_of, Bound, AEXPR_OP,
};
use serde_json::Value;

/// One table a read names in `FROM` (a name twice, under two aliases, is two uses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableUse {
    pub relation: RelName,
    /// Its alias in the read, if it has one.
    pub alias_name: Option<Box<str>>,
    /// The columns it uses, as PostgreSQL folds their names; None: every column and more
    /// (a system column, which every write changes).
    pub columns: Option<Vec<Box<str>>>,
    /// It is read whole too (`*`, `t.*`, a whole-row reference `SELECT t FROM t`): it uses
    /// every column of its table beside `columns`, as the catalog lists them.
    pub star: bool,
    /// The AND-ed equalities of the `WHERE` that bind its columns (a column of another
    /// table of the read is never among them: only qualified names count in a join).
    pub filter: Vec<Bound>,
    /// The plain columns of it the `ORDER BY` names, in order (with `DISTINCT ON`, `LIMIT`
    /// or not: a total order decides those too).
    pub order: Vec<Box<str>>,
    /// The columns it uses outside the output list (in `WHERE`, `JOIN`, `ORDER BY`, ...):
    /// those decide which of its rows the result holds and where; the others only what the
    /// result shows of them. None: every column.
    pub outside: Option<Vec<Box<str>>>,
}

/// A read's tables as far as columns go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnReads {
    pub tables: Vec<TableUse>,
    /// The result is one row of aggregates whose value does not depend on the order rows
    /// come in (`count`, `min`, `max`, `bool_and`, `bool_or`, `every`), with no `GROUP BY`.
    pub one_row: bool,
    /// Its joins: whether all are inner joins (or `FROM a, b`), and the equalities between
    /// two tables' qualified columns AND-ed in their `ON` clauses and the `WHERE`, as
    /// (table, column) pairs by place in `tables`. With a total `ORDER BY` on one table's
    /// key they tell whether each of its rows gives at most one row of the result (see
    /// `cache::columns`): otherwise rows of the same key tie, and a sort's ties come out in
    /// an order that depends on where the rows were met.
    pub inner_only: bool,
    pub equalities: Vec<[(usize, Box<str>); 2]>,
    /// Each row of the result is one row of each of its tables (no `GROUP BY`, `HAVING` or
    /// `DISTINCT`): a column only shown changes only the rows of the result that hold the
    /// row it was changed in.
    pub plain_rows: bool,
}

/// Aggregates whose result does not depend on the order of their input (`sum` and `avg` do
/// for floating-point input, and `string_agg`, `array_agg`, ... always).
const ORDER_BLIND: &[&str] = &["count", "min", "max", "bool_and", "bool_or", "every"];

/// Columns every row has that change when a row is written, whatever is assigned.
const SYSTEM_COLUMNS: &[&str] = &["ctid", "xmin", "xmax", "cmin", "cmax", "tableoid", "oid"];

const SETOP_NONE: i64 = 1;
const JOIN_INNER: i64 = 1;

/// The column reads of a single SELECT (`select`: its `SelectStmt`), or None when it is not
/// one this module reads (see the module's documentation).
pub fn column_reads(select: &Value) -> Option<ColumnReads> {
    if select["op"].as_i64() != Some(SETOP_NONE)
        || !empty(&select["with_clause"])
        || !empty(&select["window_clause"])
        || !empty(&select["locking_clause"])
        || !empty(&select["into_clause"])
        || has_sublink(select)
        || has_window_call(select)
    {
        return None;
    }
    let mut tables = Vec::new();
    let mut joins = Joins {
        using: Vec::new(),
        inner_only: true,
        quals: vec![&select["where_clause"]],
    };
    for item in select["from_clause"].as_array()? {
        from_item(item, &mut tables, &mut joins)?;
    }
    if tables.is_empty() {
        return None;
    }
    let mut reads = ColumnReads {
        tables,
        one_row: one_row(select),
        inner_only: joins.inner_only,
        equalities: Vec::new(),
        plain_rows: empty(&select["group_clause"])
            && empty(&select["having_clause"])
            && empty(&select["distinct_clause"]),
    };
    // The column references outside the output list, then those in it: one walk of the
    // statement, whose first part also says what decides which rows are shown.
    let mut refs = Vec::new();
    for (field, v) in select.as_object()? {
        if field != "target_list" {
            column_refs(v, &mut refs);
        }
    }
    let outside = outside_columns(select, &reads, &joins.using, &refs)?;
    column_refs(&select["target_list"], &mut refs);
    for name in joins.using {
        reads.add_everywhere(name);
    }
    let mut pairs = Vec::new();
    for clause in joins.quals {
        column_equalities(clause, &mut pairs);
    }
    for [[lq, lc], [rq, rc]] in pairs {
        let place = |q: &str| reads.tables.iter().position(|t| t.answers_to(q));
        if let (Some(l), Some(r)) = (place(&lq), place(&rq)) {
            reads.equalities.push([(l, lc), (r, rc)]);
        }
    }
    for fields in refs {
        reads.add_ref(fields)?;
    }
    let single = reads.tables.len() == 1;
    for t in &mut reads.tables {
        let (name, alias) = (&*t.relation.name, t.alias_name.as_deref());
        t.filter = conjuncts(&select["where_clause"], name, alias);
        if !single {
            // `col = 1` in a join may be another table's column.
            t.filter
                .retain(|b| qualified_in(&select["where_clause"], &b.column));
        }
    }
    for (t, outside) in reads.tables.iter_mut().zip(outside) {
        t.outside = outside;
    }
    let order = order_columns(select);
    for t in &mut reads.tables {
        t.order = order
            .iter()
            .filter(|fields| match fields.as_slice() {
                [_] => single,
                [q, _] => t.answers_to(q),
                _ => false,
            })
            .filter_map(|fields| fields.last().cloned())
            .collect();
    }
    Some(reads)
}

impl TableUse {
    /// Whether `q` names this use (its alias, or its name when it has none).
    fn answers_to(&self, q: &str) -> bool {
        match &self.alias_name {
            Some(a) => **a == *q,
            None => *self.relation.name == *q,
        }
    }

    fn add(&mut self, column: &str) {
        if SYSTEM_COLUMNS.contains(&column) {
            self.columns = None;
        }
        if let Some(columns) = &mut self.columns {
            if !columns.iter().any(|c| **c == *column) {
                columns.push(column.into());
            }
        }
    }
}

impl ColumnReads {
    fn add_everywhere(&mut self, column: Box<str>) {
        for t in &mut self.tables {
            t.add(&column);
        }
    }

    /// Takes in one `ColumnRef`'s fields (None: `*`); None when it cannot be placed.
    fn add_ref(&mut self, fields: Vec<Option<Box<str>>>) -> Option<()> {
        match fields.as_slice() {
            [None] => self.tables.iter_mut().for_each(|t| t.star = true),
            [Some(c)] => {
                // A whole row (`SELECT t FROM t`, `f(t)`), or a column of that name.
                for t in &mut self.tables {
                    if t.answers_to(c) {
                        t.star = true;
                    }
                }
                self.add_everywhere(c.clone());
            }
            [Some(q), c] => {
                let mut found = false;
                for t in self.tables.iter_mut().filter(|t| t.answers_to(q)) {
                    found = true;
                    match c {
                        Some(c) => t.add(c),
                        None => t.star = true,
                    }
                }
                if !found {
                    // `(composite).field` read as `q.field`: a column `q` of some table.
                    self.add_everywhere(q.clone());
                }
            }
            [Some(_), Some(q), c] => {
                let mut found = false;
                for t in self.tables.iter_mut() {
                    if t.alias_name.is_none() && *t.relation.name == **q {
                        found = true;
                        match c {
                            Some(c) => t.add(c),
                            None => t.star = true,
                        }
                    }
                }
                found.then_some(())?;
            }
            _ => return None,
        }
        Some(())
    }
}

/// The columns of each of `reads`' tables that `select` uses outside its output list
/// ([`TableUse::outside`]; `refs`: its column references there), the join's `USING` columns
/// among them; every
/// column of each when its `ORDER BY` names an output column by its place or its name
/// (`ORDER BY 2`, `ORDER BY l` of `likes AS l`): what is shown then decides the order too.
fn outside_columns(
    select: &Value,
    reads: &ColumnReads,
    using: &[Box<str>],
    refs: &[Vec<Option<Box<str>>>],
) -> Option<Vec<Option<Vec<Box<str>>>>> {
    let names: Vec<&str> = select["target_list"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter_map(|t| t["node"]["ResTarget"]["name"].as_str())
        .collect();
    let sorts = select["sort_clause"].as_array().map(Vec::as_slice);
    let by_output = sorts.unwrap_or_default().iter().any(|s| {
        let node = &s["node"]["SortBy"]["node"]["node"];
        node.get("ColumnRef").is_none()
            || matches!(node["ColumnRef"]["fields"].as_array().map(Vec::as_slice),
                Some([f]) if string_of(f).is_some_and(|f| names.contains(&f)))
    });
    let mut outside = reads.clone();
    for t in &mut outside.tables {
        t.columns = (!by_output).then(Vec::new);
    }
    for name in using {
        outside.add_everywhere(name.clone());
    }
    for fields in refs {
        outside.add_ref(fields.clone())?;
    }
    // A whole row read outside the output list (`WHERE t IS NOT NULL`): every column.
    Some(
        outside
            .tables
            .into_iter()
            .map(|t| t.columns.filter(|_| !t.star))
            .collect(),
    )
}

/// One `FROM` item: a table, or a join of items (its `USING` columns go to `using`); None
/// for anything else.
fn from_item<'v>(item: &'v Value, tables: &mut Vec<TableUse>, joins: &mut Joins<'v>) -> Option<()> {
    let node = &item["node"];
    if let Some(range_var) = node.get("RangeVar") {
        tables.push(TableUse {
            relation: relation(range_var)?,
            alias_name: alias(range_var).map(Into::into),
            columns: Some(Vec::new()),
            star: false,
            filter: Vec::new(),
            order: Vec::new(),
            outside: Some(Vec::new()),
        });
        return Some(());
    }
    let join = node.get("JoinExpr")?;
    if join["is_natural"].as_bool() == Some(true) || !empty(&join["alias"]) {
        return None;
    }
    for name in join["using_clause"].as_array().into_iter().flatten() {
        joins.using.push(string_of(name)?.into());
    }
    joins.inner_only &= join["jointype"].as_i64() == Some(JOIN_INNER);
    joins.quals.push(&join["quals"]);
    from_item(&join["larg"], tables, joins)?;
    from_item(&join["rarg"], tables, joins)
}

/// What the joins of `FROM` say, while it is read.
struct Joins<'v> {
    using: Vec<Box<str>>,
    inner_only: bool,
    quals: Vec<&'v Value>,
}

/// The equalities `a.x = b.y` AND-ed at the top of `clause`, as their two sides' fields.
fn column_equalities(clause: &Value, out: &mut Vec<[[Box<str>; 2]; 2]>) {
    for e in and_equalities(clause) {
        if e["kind"].as_i64() != Some(AEXPR_OP) {
            continue;
        }
        let side = |v: &Value| -> Option<[Box<str>; 2]> {
            match v["node"]["ColumnRef"]["fields"].as_array()?.as_slice() {
                [q, c] => Some([string_of(q)?.into(), string_of(c)?.into()]),
                _ => None,
            }
        };
        if let (Some(l), Some(r)) = (side(&e["lexpr"]), side(&e["rexpr"])) {
            out.push([l, r]);
        }
    }
}

/// Every `ColumnRef` in `v`: its fields (None for `*`).
fn column_refs(v: &Value, out: &mut Vec<Vec<Option<Box<str>>>>) {
    match v {
        Value::Object(o) => {
            if let Some(r) = o.get("ColumnRef") {
                let fields = r["fields"]
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                out.push(
                    fields
                        .iter()
                        .map(|f| {
                            if f["node"].get("AStar").is_some() {
                                None
                            } else {
                                // A field that is neither a name nor `*` cannot be: `*` keeps
                                // the read on the safe side.
                                string_of(f).map(Into::into)
                            }
                        })
                        .collect(),
                );
                return;
            }
            o.values().for_each(|v| column_refs(v, out));
        }
        Value::Array(a) => a.iter().for_each(|v| column_refs(v, out)),
        _ => {}
    }
}

/// Whether a function is called with `OVER` anywhere in `v`.
fn has_window_call(v: &Value) -> bool {
    match v {
        Value::Object(o) => {
            o.get("FuncCall").is_some_and(|f| !empty(&f["over"])) || o.values().any(has_window_call)
        }
        Value::Array(a) => a.iter().any(has_window_call),
        _ => false,
    }
}

/// Every function called in `v`: its last name, lower case as PostgreSQL folds it.
fn calls<'v>(v: &'v Value, out: &mut Vec<Option<&'v str>>) {
    match v {
        Value::Object(o) => {
            if let Some(f) = o.get("FuncCall") {
                // `count` or `pg_catalog.count`: another schema's may be anything.
                let parts = f["funcname"].as_array().map_or(0, Vec::len);
                let builtin = parts == 1
                    || f["funcname"][0]["node"]["String"]["sval"].as_str() == Some("pg_catalog");
                out.push(last_name(&f["funcname"]).filter(|_| builtin));
            }
            o.values().for_each(|v| calls(v, out));
        }
        Value::Array(a) => a.iter().for_each(|v| calls(v, out)),
        _ => {}
    }
}

/// See [`ColumnReads::one_row`]: no `GROUP BY` or `DISTINCT`, and every function of its
/// output and `HAVING` an order-blind aggregate (at least one).
fn one_row(select: &Value) -> bool {
    if !empty(&select["group_clause"]) || !empty(&select["distinct_clause"]) {
        return false;
    }
    let mut found = Vec::new();
    calls(&select["target_list"], &mut found);
    calls(&select["having_clause"], &mut found);
    !found.is_empty()
        && found
            .iter()
            .all(|f| f.is_some_and(|f| ORDER_BLIND.contains(&f)))
}

/// The `ORDER BY` items that are plain column references, in order (their fields).
fn order_columns(select: &Value) -> Vec<Vec<Box<str>>> {
    let items = select["sort_clause"].as_array().map(Vec::as_slice);
    items
        .unwrap_or_default()
        .iter()
        .filter_map(|s| {
            let sort = &s["node"]["SortBy"];
            // `ORDER BY c USING <`: an operator of its own may tie what `=` tells apart.
            if !empty(&sort["use_op"]) {
                return None;
            }
            let fields = sort["node"]["node"]["ColumnRef"]["fields"].as_array()?;
            fields
                .iter()
                .map(|f| string_of(f).map(Into::into))
                .collect::<Option<Vec<Box<str>>>>()
        })
        .collect()
}

/// Whether every `ColumnRef` of `clause` that ends in `column` is qualified (`t.column`).
fn qualified_in(clause: &Value, column: &str) -> bool {
    let mut refs = Vec::new();
    column_refs(clause, &mut refs);
    refs.iter().all(|fields| match fields.as_slice() {
        [Some(c)] => **c != *column,
        _ => true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reads(sql: &str) -> Option<ColumnReads> {
        let crate::query::Parsed::Tree(tree) = crate::query::parse(sql) else {
            panic!("{sql}")
        };
        column_reads(tree["stmts"][0]["stmt"]["node"].get("SelectStmt")?)
    }

    fn columns(t: &TableUse) -> Option<Vec<&str>> {
        let mut c: Vec<&str> = t.columns.as_ref()?.iter().map(|c| &**c).collect();
        c.sort();
        Some(c)
    }

    fn outside(t: &TableUse) -> Option<Vec<&str>> {
        let mut c: Vec<&str> = t.outside.as_ref()?.iter().map(|c| &**c).collect();
        c.sort();
        Some(c)
    }

    #[test]
    fn the_columns_a_read_uses_outside_its_output() {
        let r = reads("SELECT id, likes FROM posts WHERE user_id = $1 ORDER BY title").unwrap();
        assert!(r.plain_rows);
        assert_eq!(outside(&r.tables[0]), Some(vec!["title", "user_id"]));
        let r = reads(
            "SELECT p.id, p.likes, c.id, c.name FROM posts p JOIN categories c \
             ON c.id = p.category_id WHERE p.user_id = 3 ORDER BY p.title LIMIT 5",
        )
        .unwrap();
        assert_eq!(
            outside(&r.tables[0]),
            Some(vec!["category_id", "title", "user_id"])
        );
        assert_eq!(outside(&r.tables[1]), Some(vec!["id"]));
        let r = reads("SELECT a.id, a.v FROM a JOIN b USING (k)").unwrap();
        assert_eq!(outside(&r.tables[0]), Some(vec!["k"]));
        // What is shown decides the order too: by its place, or by its output name.
        for by_output in [
            "SELECT id, likes FROM posts ORDER BY 2 LIMIT 3",
            "SELECT id, likes AS l FROM posts ORDER BY l LIMIT 3",
            "SELECT id, likes FROM posts ORDER BY likes + 1",
        ] {
            assert_eq!(
                outside(&reads(by_output).unwrap().tables[0]),
                None,
                "{by_output}"
            );
        }
        for grouped in [
            "SELECT user_id, count(*) FROM posts GROUP BY user_id",
            "SELECT DISTINCT user_id FROM posts",
            "SELECT count(*) FROM posts HAVING count(*) > 1",
        ] {
            assert!(!reads(grouped).unwrap().plain_rows, "{grouped}");
        }
    }

    #[test]
    fn the_columns_a_read_uses() {
        let r = reads("SELECT title, likes FROM posts WHERE user_id = $1 ORDER BY title").unwrap();
        let [t] = r.tables.as_slice() else { panic!() };
        assert_eq!(columns(t), Some(vec!["likes", "title", "user_id"]));
        assert_eq!(&*t.filter[0].column, "user_id");
        assert_eq!(t.order, vec!["title".into()] as Vec<Box<str>>);
        assert!(!r.one_row);

        let r = reads("SELECT count(*) FROM posts p WHERE p.user_id = 3").unwrap();
        assert!(r.one_row);
        assert!(
            reads("SELECT pg_catalog.max(likes) FROM posts")
                .unwrap()
                .one_row
        );
        assert_eq!(columns(&r.tables[0]), Some(vec!["user_id"]));

        // The whole row, shown: every column the catalog lists, but not more.
        for whole in [
            "SELECT * FROM posts WHERE user_id = 1",
            "SELECT p.* FROM posts p",
            "SELECT posts FROM posts",
            "SELECT row_to_json(p) FROM posts p",
            "SELECT public.posts.* FROM posts",
        ] {
            let t = &reads(whole).unwrap().tables[0];
            assert!(t.star && t.columns.is_some(), "{whole}");
        }
        let t = &reads("SELECT * FROM posts WHERE user_id = 1 ORDER BY title")
            .unwrap()
            .tables[0];
        assert_eq!(outside(t), Some(vec!["title", "user_id"]));
        // Every column and more: a system column; the whole row outside the output list.
        for every in [
            "SELECT ctid, title FROM posts",
            "SELECT *, ctid FROM posts",
            "SELECT title FROM posts WHERE xmin::text = '1'",
        ] {
            assert_eq!(columns(&reads(every).unwrap().tables[0]), None, "{every}");
        }
        for every in [
            "SELECT * FROM posts ORDER BY 2",
            "SELECT title FROM posts p WHERE p IS NOT NULL",
        ] {
            assert_eq!(outside(&reads(every).unwrap().tables[0]), None, "{every}");
        }
        let r = reads("SELECT p.*, u.name FROM posts p JOIN users u ON u.id = p.user_id").unwrap();
        assert!(r.tables[0].star && !r.tables[1].star);
        for not in [
            "SELECT title FROM posts WHERE id IN (SELECT 1)",
            "WITH x AS (SELECT 1) SELECT title FROM posts",
            "SELECT title FROM posts UNION SELECT name FROM users",
            "SELECT title, row_number() OVER () FROM posts",
            "SELECT * FROM generate_series(1, 3)",
            "SELECT title FROM posts NATURAL JOIN users",
            "SELECT title FROM posts TABLESAMPLE SYSTEM (10)",
            "SELECT 1",
        ] {
            assert!(reads(not).is_none(), "{not}");
        }
        // Order-sensitive aggregates, groups.
        for many in [
            "SELECT string_agg(title, ',') FROM posts",
            "SELECT sum(likes) FROM posts",
            "SELECT count(*) FROM posts GROUP BY user_id",
            "SELECT count(*), lower('a') FROM posts",
            "SELECT mine.count(*) FROM posts",
            "SELECT title FROM posts",
        ] {
            assert!(!reads(many).unwrap().one_row, "{many}");
        }
    }

    #[test]
    fn joins_place_qualified_names_and_spread_the_others() {
        let r = reads(
            "SELECT p.title, c.name FROM posts p JOIN categories c ON p.category_id = c.id \
             WHERE p.user_id = $1 AND flag = 2 ORDER BY p.title",
        )
        .unwrap();
        let [p, c] = r.tables.as_slice() else {
            panic!()
        };
        assert_eq!(
            columns(p),
            Some(vec!["category_id", "flag", "title", "user_id"])
        );
        assert_eq!(columns(c), Some(vec!["flag", "id", "name"]));
        // `flag = 2` may be either table's: bound for neither.
        assert_eq!(
            p.filter.iter().map(|b| &*b.column).collect::<Vec<_>>(),
            vec!["user_id"]
        );
        assert!(c.filter.is_empty());
        assert_eq!(p.order, vec!["title".into()] as Vec<Box<str>>);
        assert!(c.order.is_empty());
        assert!(r.inner_only);
        assert_eq!(
            r.equalities,
            vec![[(0, "category_id".into()), (1, "id".into())]]
        );
        let r = reads("SELECT p.title FROM posts p LEFT JOIN categories c ON c.id = p.category_id")
            .unwrap();
        assert!(!r.inner_only);
        let r =
            reads("SELECT p.title FROM posts p, categories c WHERE c.id = p.category_id").unwrap();
        assert!(r.inner_only);
        assert_eq!(r.equalities.len(), 1);

        let r = reads("SELECT title FROM posts JOIN users USING (id)").unwrap();
        assert_eq!(columns(&r.tables[1]), Some(vec!["id", "title"]));
        // An unknown qualifier: a composite column's field.
        let r = reads("SELECT (posts.meta).x FROM posts").unwrap();
        assert_eq!(columns(&r.tables[0]), Some(vec!["meta"]));
        // A name under an alias is not the table's.
        assert!(reads("SELECT public.posts.title FROM posts p").is_none());
    }
}
