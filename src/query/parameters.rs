//! Which literals of a query shape may become parameters, decided once per shape by
//! PostgreSQL's own parser (libpg_query through the `pg_query` crate) on the cold path.
//!
//! The lexer found every literal; the parse tree says what each one is. A literal becomes a
//! parameter only if the tree has a constant (`A_Const`) starting exactly where the lexer's
//! literal starts, outside the places where a parameter would change the meaning or be refused:
//!
//! - typed literals, `DATE '...'`, `interval '1' day`, `int4 '5'` (a `TypeCast` without a `::`
//!   location: `DATE $1` is a syntax error), and anything inside a type name (`varchar(10)`);
//! - a constant that is a whole `ORDER BY` item (a column ordinal: `ORDER BY $1` sorts by a
//!   constant, silently), and the select list, `GROUP BY`, `HAVING`, `ORDER BY` and
//!   `DISTINCT ON` of any SELECT that groups or is DISTINCT (`a + $1 ... GROUP BY a + $2` fails);
//! - window `PARTITION BY` / `ORDER BY`, the field of `extract(...)`, the operand of `COLLATE`;
//! - a number after a unary minus: PostgreSQL folds the sign into the constant, which then
//!   starts at the `-` (`-2147483648` is an int4; `-$1` with an int8 `$1` is not);
//! - whatever is cast to `interval` with a typmod (`'1'::interval hour`): PostgreSQL reads
//!   such a literal with the typmod, a parameter without it (see `interval_with_fields`).
//!
//! What the tree cannot tell, the type PostgreSQL infers for a string literal's parameter
//! (a domain's, from a column, a function's argument or a cast), the server is asked once per
//! statement when autoprepare prepares it (`autoprepare::parameter_types_sql`).
//!
//! Only a single SELECT (not `SELECT ... INTO`), VALUES, TABLE, INSERT, UPDATE, DELETE or MERGE
//! (with or without WITH) is generalized at all.

use crate::query::lexer::{Kind, Literal};
use serde_json::Value;
use std::collections::HashSet;

/// What was decided for a shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Never generalized; the query goes to the server as it is.
    Never(Never),
    /// Generalized: `forms[i]` says what becomes of literal `i` (of the lexer's, in text
    /// order). `modifies`: the statement writes (DML, or a data-modifying WITH), so
    /// PostgreSQL runs it to completion before it describes its rows to a simple query.
    Generalize { forms: Box<[Form]>, modifies: bool },
}

/// What becomes of one literal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// It stays in the text as it is.
    Verbatim,
    /// It becomes a parameter.
    Param,
    /// A number whose unary minus PostgreSQL folds into the constant (`- 5`, `x = -5`): the
    /// minus `back` bytes before it, and the number, become one parameter, typed by the
    /// negative value as PostgreSQL types it (`-2147483648` is an int4).
    Negated { back: u32 },
}

/// Why a shape is never generalized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Never {
    /// PostgreSQL's parser refused the text: the server will say why.
    ParseError,
    /// Not a single query or DML statement.
    NotDml,
    /// `SELECT ... INTO` creates a table.
    SelectInto,
    /// It reads `pg_cursors`, which lists the portal of a Bind (autoprepare's unnamed one)
    /// and not a simple query's.
    ReadsPortals,
}

impl Never {
    pub fn as_str(self) -> &'static str {
        match self {
            Never::ParseError => "syntax error",
            Never::NotDml => "not a query or DML statement",
            Never::SelectInto => "SELECT INTO",
            Never::ReadsPortals => "reads pg_cursors",
        }
    }
}

/// Decides for the shape of `sql`, whose literals the lexer found.
pub fn decide(sql: &str, literals: &[Literal]) -> Decision {
    decide_parsed(sql, &super::parse(sql), literals)
}

/// [`decide`], from PostgreSQL's parse of `sql` (see [`super::parse`]).
pub fn decide_parsed(sql: &str, parsed: &super::Parsed, literals: &[Literal]) -> Decision {
    let super::Parsed::Tree(tree) = parsed else {
        return Decision::Never(Never::ParseError);
    };
    let stmts = tree["stmts"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let [stmt] = stmts else {
        return Decision::Never(Never::NotDml);
    };
    let node = &stmt["stmt"]["node"];
    let kind = node
        .as_object()
        .and_then(|o| o.keys().next())
        .map(String::as_str);
    let mut modifies = true;
    match kind {
        Some("SelectStmt") => {
            modifies = false;
            if !node["SelectStmt"]["into_clause"].is_null() {
                return Decision::Never(Never::SelectInto);
            }
        }
        Some("InsertStmt" | "UpdateStmt" | "DeleteStmt" | "MergeStmt") => {}
        _ => return Decision::Never(Never::NotDml),
    }
    let mut found = Found::default();
    walk(node, false, &mut found);
    if found.reads_portals {
        return Decision::Never(Never::ReadsPortals);
    }
    let forms = literals
        .iter()
        .map(|l| form(sql.as_bytes(), l, &found.constants))
        .collect();
    Decision::Generalize {
        forms,
        modifies: modifies || found.modifies,
    }
}

fn form(sql: &[u8], literal: &Literal, constants: &HashSet<i64>) -> Form {
    if literal.kind == Kind::Verbatim {
        return Form::Verbatim;
    }
    if constants.contains(&i64::from(literal.start)) {
        return Form::Param;
    }
    if !matches!(literal.kind, Kind::Int4 | Kind::Int8 | Kind::Numeric) {
        return Form::Verbatim;
    }
    // A constant that starts at a `-` right before the number (only whitespace between) is
    // the number negated by the grammar (doNegate reports the constant at the sign).
    let before = &sql[..literal.start as usize];
    let spaces = before
        .iter()
        .rev()
        .take_while(|b| b.is_ascii_whitespace())
        .count();
    let minus = before.len() - spaces;
    if minus > 0 && before[minus - 1] == b'-' && constants.contains(&(minus as i64 - 1)) {
        return Form::Negated {
            back: (before.len() - minus + 1) as u32,
        };
    }
    Form::Verbatim
}

/// What the walk finds.
#[derive(Default)]
struct Found {
    /// Locations of the constants that may become parameters.
    constants: HashSet<i64>,
    /// A data-modifying statement inside (a WITH of a SELECT).
    modifies: bool,
    /// It names `pg_cursors`.
    reads_portals: bool,
}

/// Collects the locations of the constants that may become parameters.
fn walk(value: &Value, excluded: bool, out: &mut Found) {
    match value {
        Value::Array(items) => {
            for item in items {
                walk(item, excluded, out);
            }
        }
        Value::Object(fields) => {
            for (key, inner) in fields {
                node(key, inner, excluded, out);
            }
        }
        _ => {}
    }
}

/// One `"Kind": {...}` pair of the tree (or a plain field, walked through).
fn node(key: &str, inner: &Value, excluded: bool, out: &mut Found) {
    match key {
        "AConst" => {
            if !excluded {
                if let Some(location) = inner["location"].as_i64() {
                    out.constants.insert(location);
                }
            }
        }
        "InsertStmt" | "UpdateStmt" | "DeleteStmt" | "MergeStmt" => {
            out.modifies = true;
            walk(inner, excluded, out);
        }
        "RangeVar" => {
            out.reads_portals |= inner["relname"].as_str() == Some("pg_cursors");
            walk(inner, excluded, out);
        }
        // A type name's modifiers and array bounds are part of the type.
        "TypeName" | "type_name" => {}
        "TypeCast" => {
            // `DATE '...'` has no `::` location: the literal is typed by its syntax.
            let typed_literal = inner["location"].as_i64() == Some(-1);
            walk(
                &inner["arg"],
                excluded || typed_literal || interval_with_fields(&inner["type_name"]),
                out,
            );
        }
        "SortBy" => {
            let ordinal = inner["node"]["node"].get("AConst").is_some();
            walk(&inner["node"], excluded || ordinal, out);
            walk(&inner["use_op"], excluded, out);
        }
        "SelectStmt" => select(inner, excluded, out),
        // A window definition: a node in WINDOW clauses, a plain field in `f() OVER (...)`.
        "WindowDef" | "over" => {
            for (k, v) in inner.as_object().into_iter().flatten() {
                let positional = k == "partition_clause" || k == "order_clause";
                node(k, v, excluded || positional, out);
            }
        }
        "FuncCall" => {
            let is_extract = inner["funcname"]
                .as_array()
                .and_then(|n| n.last())
                .and_then(|n| n["node"]["String"]["sval"].as_str())
                == Some("extract");
            for (k, v) in inner.as_object().into_iter().flatten() {
                if k == "args" && is_extract {
                    let args = v.as_array().map(Vec::as_slice).unwrap_or(&[]);
                    for (i, arg) in args.iter().enumerate() {
                        walk(arg, excluded || i == 0, out);
                    }
                } else {
                    node(k, v, excluded, out);
                }
            }
        }
        "CollateClause" => walk(inner, true, out),
        _ => walk(inner, excluded, out),
    }
}

/// Whether a cast's type is `interval` with a typmod (`interval hour`, `interval(0)`):
/// PostgreSQL reads a literal cast to it with the typmod (parse_coerce.c passes it to
/// `interval_in` for INTERVAL alone), a parameter without it, the typmod applied after, so
/// `'1'::interval hour` is `01:00:00` and `$1::interval hour` with `'1'` is `00:00:00`
/// (PostgreSQL 15, measured). Its literal stays a literal.
fn interval_with_fields(type_name: &Value) -> bool {
    let named_interval = type_name["names"]
        .as_array()
        .and_then(|n| n.last())
        .and_then(|n| n["node"]["String"]["sval"].as_str())
        == Some("interval");
    named_interval
        && type_name["typmods"]
            .as_array()
            .is_some_and(|t| !t.is_empty())
}

fn select(inner: &Value, excluded: bool, out: &mut Found) {
    let non_empty = |k: &str| inner[k].as_array().is_some_and(|a| !a.is_empty());
    let grouped = non_empty("group_clause") || non_empty("distinct_clause");
    for (k, v) in inner.as_object().into_iter().flatten() {
        let tied = grouped
            && matches!(
                k.as_str(),
                "target_list"
                    | "group_clause"
                    | "having_clause"
                    | "sort_clause"
                    | "distinct_clause"
            );
        node(k, v, excluded || tied, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::query::lexer::{generalize, Lexed};

    /// The text the server would get: kept literals verbatim, the others `$?`.
    fn shape(sql: &str) -> String {
        let mut lexed = Lexed::default();
        generalize(sql.as_bytes(), &mut lexed).expect("lexed");
        match decide(sql, &lexed.literals) {
            Decision::Never(n) => format!("never: {}", n.as_str()),
            Decision::Generalize { forms, .. } => {
                let mut s = String::new();
                let mut at = 0;
                for (l, form) in lexed.literals.iter().zip(forms.iter()) {
                    s.push_str(&sql[at..l.start as usize]);
                    match form {
                        Form::Verbatim => s.push_str(&sql[l.start as usize..l.end as usize]),
                        Form::Param => s.push_str("$?"),
                        Form::Negated { back } => {
                            s.truncate(s.len() - *back as usize);
                            s.push_str("$-?");
                        }
                    }
                    at = l.end as usize;
                }
                s.push_str(&sql[at..]);
                s
            }
        }
    }

    #[test]
    fn plain_literals_become_parameters() {
        assert_eq!(
            shape("SELECT * FROM t WHERE a = 1 AND b = 'x' AND c IN (1.5, 2) LIMIT 10 OFFSET 5"),
            "SELECT * FROM t WHERE a = $? AND b = $? AND c IN ($?, $?) LIMIT $? OFFSET $?"
        );
        assert_eq!(
            shape("INSERT INTO t (a, b) VALUES (1, 'x'), (2, 'y') RETURNING a"),
            "INSERT INTO t (a, b) VALUES ($?, $?), ($?, $?) RETURNING a"
        );
        assert_eq!(
            shape("UPDATE t SET a = '1'::int WHERE b = CAST('2' AS int)"),
            "UPDATE t SET a = $?::int WHERE b = CAST($? AS int)"
        );
    }

    #[test]
    fn a_read_of_pg_cursors_runs_as_it_is() {
        for sql in [
            "SELECT name, statement FROM pg_cursors WHERE name = 'c1'",
            "select count(*) from pg_catalog.pg_cursors where is_holdable = true",
        ] {
            assert_eq!(shape(sql), "never: reads pg_cursors", "{sql}");
        }
        assert_eq!(
            shape("SELECT * FROM my_cursors WHERE id = 1"),
            "SELECT * FROM my_cursors WHERE id = $?"
        );
    }

    #[test]
    fn literals_that_must_stay() {
        assert_eq!(
            shape("SELECT DATE '2020-01-01', interval '1' day, int4 '5', x::varchar(10) FROM t"),
            "SELECT DATE '2020-01-01', interval '1' day, int4 '5', x::varchar(10) FROM t"
        );
        assert_eq!(
            shape("SELECT a, 2 FROM t WHERE b > 3 ORDER BY 1, a + 4"),
            "SELECT a, $? FROM t WHERE b > $? ORDER BY 1, a + $?"
        );
        assert_eq!(
            shape("SELECT a + 1, count(*) FROM t WHERE b = 2 GROUP BY a + 1 HAVING count(*) > 3"),
            "SELECT a + 1, count(*) FROM t WHERE b = $? GROUP BY a + 1 HAVING count(*) > 3"
        );
        assert_eq!(
            shape("SELECT DISTINCT ON (a + 1) a FROM t WHERE b = 2 ORDER BY a + 1"),
            "SELECT DISTINCT ON (a + 1) a FROM t WHERE b = $? ORDER BY a + 1"
        );
        assert_eq!(
            shape("SELECT -2147483648, - 5, 3 - 1, x = -1.5, -5^2, - /**/ 5 FROM t"),
            "SELECT $-?, $-?, $? - $?, x = $-?, $-?^$?, - /**/ 5 FROM t"
        );
        assert_eq!(
            shape("SELECT extract('year' FROM ts), 'a' COLLATE \"C\", rank() OVER (PARTITION BY a + 1 ORDER BY 2) FROM t"),
            "SELECT extract('year' FROM ts), 'a' COLLATE \"C\", rank() OVER (PARTITION BY a + 1 ORDER BY 2) FROM t"
        );
    }

    /// A cast to `interval` with fields reads a literal with them, a parameter without them
    /// (`'1'::interval hour` is an hour, `$1::interval hour` bound to `'1'` is zero): the
    /// literal stays; a cast to `interval` alone reads both alike.
    #[test]
    fn literals_cast_to_an_interval_with_fields_stay() {
        assert_eq!(
            shape("SELECT '1'::interval hour, CAST('2' AS interval minute), '3'::interval(0), ARRAY['4']::interval hour[]"),
            "SELECT '1'::interval hour, CAST('2' AS interval minute), '3'::interval(0), ARRAY['4']::interval hour[]"
        );
        assert_eq!(
            shape("SELECT now() - '1 day'::interval, '5'::int"),
            "SELECT now() - $?::interval, $?::int"
        );
    }

    #[test]
    fn statements_that_are_never_generalized() {
        assert_eq!(shape("SELECT 1 INTO t2"), "never: SELECT INTO");
        assert_eq!(shape("SELECT FROM WHERE 1"), "never: syntax error");
        assert_eq!(
            shape("with x as (select 1) select * from x"),
            "with x as (select $?) select * from x"
        );
        assert_eq!(
            shape("WITH d AS (DELETE FROM t WHERE a = 1 RETURNING *) SELECT count(*) FROM d"),
            "WITH d AS (DELETE FROM t WHERE a = $? RETURNING *) SELECT count(*) FROM d"
        );
    }
}
