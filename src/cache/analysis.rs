//! What a statement reads and writes, from PostgreSQL's own parser (pg_query), once per
//! statement shape on the cold path.
//!
//! Two questions: may its result be cached at all (a single read-only query that calls nothing
//! time- or session-dependent: the catalog then settles functions and relations, see
//! [`super::catalog`]), and what must be invalidated when it runs (the tables it writes, the
//! functions it calls, DDL, session state). The tree is walked as JSON, every object of it, so
//! no node type is skipped: an expression nested anywhere is seen.

use serde_json::Value;

/// Why a query's result is not cached; counted per reason in SHOW CACHE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bypass {
    /// PostgreSQL's parser refused it (the server will say why).
    ParseError,
    /// Not a single SELECT / VALUES / TABLE / WITH query.
    NotSelect,
    SelectInto,
    /// `FOR UPDATE` / `FOR SHARE` and friends.
    Locking,
    /// A data-modifying WITH.
    ModifyingCte,
    /// Reads the clock or who/where the session is (`now()`, `CURRENT_DATE`, `'today'`,
    /// `current_setting()`, `pg_backend_pid()`, ...).
    TimeOrSession,
    /// Calls a volatile function (`random()`, `nextval()`, `clock_timestamp()`, ...).
    Volatile,
    /// Calls a function defined in the database that is not immutable (it may read tables
    /// pgmemo cannot see).
    UserFunction,
    /// Names a function or relation the catalog does not know.
    Unknown,
    /// Reads a temporary table.
    Temporary,
    Unlogged,
    /// Reads a system catalog (or information_schema): changed by DDL pgmemo may not see.
    SystemCatalog,
    /// Reads a foreign table, a sequence or another relation whose content pgmemo cannot follow.
    NotATable,
    /// Reads a table whose row-level security policies depend on a setting.
    RowSecurity,
    /// The catalog could not be read.
    CatalogUnavailable,
    /// The client changed its role or a setting that is not part of the key.
    SessionState,
    /// A transaction block is open.
    InTransaction,
    /// `/* pgmemo nocache */`.
    Hint,
    /// Larger than max_result_bytes.
    TooLarge,
    /// Something else than rows and their completion came back (an error, a notice, ...).
    NotPlainResult,
    /// No rows, and the rule does not cache empty results.
    Empty,
    /// A table it read was written while it ran.
    WrittenMeanwhile,
    /// Its key missed for the first time lately (`admit_after = 2`): stored the next time.
    FirstMiss,
    /// `cache.invalidation = "wal"` and the database's replication stream is not (yet) up
    /// and caught up: writes by others could be missed.
    WalBehind,
}

pub const BYPASS_REASONS: [Bypass; 24] = [
    Bypass::ParseError,
    Bypass::NotSelect,
    Bypass::SelectInto,
    Bypass::Locking,
    Bypass::ModifyingCte,
    Bypass::TimeOrSession,
    Bypass::Volatile,
    Bypass::UserFunction,
    Bypass::Unknown,
    Bypass::Temporary,
    Bypass::Unlogged,
    Bypass::SystemCatalog,
    Bypass::NotATable,
    Bypass::RowSecurity,
    Bypass::CatalogUnavailable,
    Bypass::SessionState,
    Bypass::InTransaction,
    Bypass::Hint,
    Bypass::TooLarge,
    Bypass::NotPlainResult,
    Bypass::Empty,
    Bypass::WrittenMeanwhile,
    Bypass::FirstMiss,
    Bypass::WalBehind,
];

impl Bypass {
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Bypass::ParseError => "syntax error",
            Bypass::NotSelect => "not a single query",
            Bypass::SelectInto => "SELECT INTO",
            Bypass::Locking => "FOR UPDATE/SHARE",
            Bypass::ModifyingCte => "data-modifying WITH",
            Bypass::TimeOrSession => "time or session function",
            Bypass::Volatile => "volatile function",
            Bypass::UserFunction => "non-immutable user function",
            Bypass::Unknown => "unknown relation or function",
            Bypass::Temporary => "temporary table",
            Bypass::Unlogged => "unlogged table",
            Bypass::SystemCatalog => "system catalog",
            Bypass::NotATable => "foreign table or sequence",
            Bypass::RowSecurity => "row security on a setting",
            Bypass::CatalogUnavailable => "catalog unavailable",
            Bypass::SessionState => "role or setting changed",
            Bypass::InTransaction => "in a transaction block",
            Bypass::Hint => "nocache hint",
            Bypass::TooLarge => "larger than max_result_bytes",
            Bypass::NotPlainResult => "error or notice",
            Bypass::Empty => "empty result",
            Bypass::WrittenMeanwhile => "written while it ran",
            Bypass::FirstMiss => "first miss (admitted on the next)",
            Bypass::WalBehind => "WAL stream not caught up",
        }
    }
}

/// A relation as the query names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelName {
    pub schema: Option<Box<str>>,
    pub name: Box<str>,
}

/// What a cacheable query reads, for the catalog to settle.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reads {
    pub relations: Vec<RelName>,
    /// Functions called (the name without schema: checked against every function of that
    /// name, the strictest wins).
    pub functions: Vec<Box<str>>,
}

/// How far a statement's effects reach, for invalidation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum Flush {
    #[default]
    None,
    /// Everything cached for the database, but not its catalog (`EXECUTE` of an SQL-level
    /// prepared statement: a query or DML).
    Data,
    /// Everything cached for the database (DDL, `DO`, `CALL`, an unknown statement).
    Database,
    /// Everything cached (roles and grants changed).
    All,
}

/// What running a statement may change.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Effects {
    /// Relations written (by name; every schema's relation of that name is bumped).
    pub writes: Vec<Box<str>>,
    /// Functions called: one defined in the database and volatile may write anything.
    pub calls: Vec<Box<str>>,
    pub flush: Flush,
    /// It changes the client's role or a setting not in the key, or creates a temporary
    /// table: caching stays off for that client.
    pub session_state: bool,
}

impl Effects {
    pub fn is_none(&self) -> bool {
        !self.changes_data() && !self.session_state
    }

    /// Whether running it may change what is cached.
    pub fn changes_data(&self) -> bool {
        !(self.writes.is_empty() && self.calls.is_empty() && self.flush == Flush::None)
    }
}

/// Everything decided about one statement text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Analysis {
    pub effects: Effects,
    pub read: Result<Reads, Bypass>,
}

/// Settings whose value is part of the key, or that cannot change a query's result: a SET of
/// any other turns caching off for the client.
const HARMLESS_SETTINGS: &[&str] = &[
    "application_name",
    "datestyle",
    "intervalstyle",
    "timezone",
    "time zone",
    "client_encoding",
    "standard_conforming_strings",
    "search_path",
    "statement_timeout",
    "lock_timeout",
    "idle_in_transaction_session_timeout",
    "idle_session_timeout",
    "transaction_isolation",
    "transaction_read_only",
    "transaction_deferrable",
    "default_transaction_isolation",
    "default_transaction_read_only",
    "default_transaction_deferrable",
    "work_mem",
    "maintenance_work_mem",
    "client_min_messages",
    "log_min_duration_statement",
    "log_statement",
    "synchronous_commit",
    "jit",
];

/// Builtin functions that are stable or immutable but answer differently by time, by
/// server connection or by setting: never cached.
const TIME_OR_SESSION_FUNCTIONS: &[&str] = &[
    "now",
    "transaction_timestamp",
    "statement_timestamp",
    "clock_timestamp",
    "timeofday",
    "age",
    "current_setting",
    "set_config",
    "inet_client_addr",
    "inet_client_port",
    "inet_server_addr",
    "inet_server_port",
    "current_query",
    "txid_current",
    "txid_current_snapshot",
    "localtimestamp",
    "localtime",
];

/// Analyzes `sql` (one Query message's text or one Parse's).
pub fn analyze(sql: &str) -> Analysis {
    let Ok(parsed) = pg_query::parse(sql, 0) else {
        // The server refuses it too; nothing runs.
        return Analysis {
            effects: Effects::default(),
            read: Err(Bypass::ParseError),
        };
    };
    let Ok(tree) = serde_json::to_value(&parsed.protobuf) else {
        return Analysis {
            effects: Effects {
                flush: Flush::Database,
                ..Effects::default()
            },
            read: Err(Bypass::ParseError),
        };
    };
    let stmts = tree["stmts"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let mut effects = Effects::default();
    let mut walker = Walker::default();
    for stmt in stmts {
        statement_effects(&stmt["stmt"]["node"], &mut effects);
        walker.walk(&stmt["stmt"]["node"]);
    }
    effects.writes.append(&mut walker.writes);
    effects.calls = walker.functions.clone();
    if walker.functions.iter().any(|f| &**f == "set_config") {
        effects.session_state = true;
    }
    effects.writes.sort();
    effects.writes.dedup();
    effects.calls.sort();
    effects.calls.dedup();
    let read = reads(stmts, walker);
    Analysis { effects, read }
}

/// The part of a statement's effects its kind decides (the walk adds DML targets and calls).
fn statement_effects(node: &Value, effects: &mut Effects) {
    let Some((kind, inner)) = node.as_object().and_then(|o| o.iter().next()) else {
        effects.flush = effects.flush.max(Flush::Database);
        return;
    };
    match kind.as_str() {
        "SelectStmt" => {
            if !inner["into_clause"].is_null() {
                effects.flush = effects.flush.max(Flush::Database);
            }
        }
        "InsertStmt" | "UpdateStmt" | "DeleteStmt" | "MergeStmt" | "TruncateStmt" | "CopyStmt"
        | "TransactionStmt" | "VariableShowStmt" | "PrepareStmt" | "DeallocateStmt"
        | "ListenStmt" | "UnlistenStmt" | "NotifyStmt" | "LockStmt" | "VacuumStmt"
        | "CheckPointStmt" | "ClosePortalStmt" | "FetchStmt" | "LoadStmt"
        | "ConstraintsSetStmt" => {}
        "ExplainStmt" | "DeclareCursorStmt" => {
            // The query inside is walked with the rest (EXPLAIN ANALYZE runs it).
            statement_effects(&inner["query"]["node"], effects);
        }
        "VariableSetStmt" => {
            let name = inner["name"]
                .as_str()
                .unwrap_or_default()
                .to_ascii_lowercase();
            let reset_all = inner["kind"].as_i64() == Some(6)
                || inner["kind"].as_str() == Some("VAR_RESET_ALL");
            if reset_all || !HARMLESS_SETTINGS.contains(&name.as_str()) {
                effects.session_state = true;
            }
        }
        "DiscardStmt" => effects.session_state = true,
        "ExecuteStmt" => effects.flush = effects.flush.max(Flush::Data),
        "CreateStmt" | "CreateTableAsStmt" => {
            let relation = if kind == "CreateStmt" {
                &inner["relation"]
            } else {
                &inner["into"]["rel"]
            };
            let temp = relation["relpersistence"].as_str() == Some("t")
                || relation["schemaname"].as_str() == Some("pg_temp");
            if temp {
                effects.session_state = true;
            }
            effects.flush = effects.flush.max(Flush::Database);
        }
        "GrantStmt"
        | "GrantRoleStmt"
        | "AlterRoleStmt"
        | "AlterRoleSetStmt"
        | "CreateRoleStmt"
        | "DropRoleStmt"
        | "ReassignOwnedStmt"
        | "DropOwnedStmt"
        | "AlterDefaultPrivilegesStmt" => {
            effects.flush = Flush::All;
        }
        // DDL, DO, CALL, EXECUTE of an SQL-level statement, anything else: what it changes
        // is not known here.
        _ => effects.flush = effects.flush.max(Flush::Database),
    }
}

fn reads(stmts: &[Value], walker: Walker) -> Result<Reads, Bypass> {
    let [stmt] = stmts else {
        return Err(Bypass::NotSelect);
    };
    let node = &stmt["stmt"]["node"];
    let Some(select) = node.get("SelectStmt") else {
        return Err(Bypass::NotSelect);
    };
    if !select["into_clause"].is_null() {
        return Err(Bypass::SelectInto);
    }
    if walker.modifies {
        return Err(Bypass::ModifyingCte);
    }
    if walker.locking {
        return Err(Bypass::Locking);
    }
    if walker.time_or_session
        || walker
            .functions
            .iter()
            .any(|f| TIME_OR_SESSION_FUNCTIONS.contains(&&**f) || f.starts_with("pg_"))
    {
        return Err(Bypass::TimeOrSession);
    }
    let relations = walker
        .relations
        .into_iter()
        .filter(|r| r.schema.is_some() || !walker.ctes.contains(&r.name))
        .collect();
    Ok(Reads {
        relations,
        functions: walker.functions,
    })
}

/// What the walk over a statement's tree found.
#[derive(Default)]
struct Walker {
    relations: Vec<RelName>,
    writes: Vec<Box<str>>,
    functions: Vec<Box<str>>,
    ctes: Vec<Box<str>>,
    modifies: bool,
    locking: bool,
    time_or_session: bool,
}

impl Walker {
    fn walk(&mut self, value: &Value) {
        match value {
            Value::Array(items) => items.iter().for_each(|i| self.walk(i)),
            Value::Object(fields) => {
                for (key, inner) in fields {
                    self.node(key, inner);
                }
            }
            _ => {}
        }
    }

    fn node(&mut self, key: &str, inner: &Value) {
        match key {
            "RangeVar" => {
                let rel = rel_name(inner);
                if !self.relations.contains(&rel) {
                    self.relations.push(rel);
                }
            }
            "InsertStmt" | "UpdateStmt" | "DeleteStmt" | "MergeStmt" => {
                self.modifies = true;
                self.write(&inner["relation"]);
            }
            "TruncateStmt" => {
                for r in inner["relations"].as_array().into_iter().flatten() {
                    self.write(&r["node"]["RangeVar"]);
                }
            }
            "CopyStmt" if inner["is_from"].as_bool() == Some(true) => {
                self.write(&inner["relation"]);
            }
            "CommonTableExpr" => {
                if let Some(name) = inner["ctename"].as_str() {
                    self.ctes.push(name.into());
                }
            }
            "locking_clause" if inner.as_array().is_some_and(|a| !a.is_empty()) => {
                self.locking = true;
            }
            "FuncCall" => {
                let name = inner["funcname"]
                    .as_array()
                    .and_then(|parts| parts.last())
                    .and_then(|p| p["node"]["String"]["sval"].as_str());
                if let Some(name) = name {
                    let name: Box<str> = name.into();
                    if !self.functions.contains(&name) {
                        self.functions.push(name);
                    }
                }
            }
            "SqlvalueFunction" => {
                // CURRENT_DATE .. LOCALTIMESTAMP(n) are ops 1..=9 (the role and schema ones are
                // in the key).
                let op = inner["op"].as_i64().unwrap_or(0);
                let named = inner["op"].as_str().unwrap_or("");
                if (1..=9).contains(&op) || named.contains("DATE") || named.contains("TIME") {
                    self.time_or_session = true;
                }
            }
            "AConst" => {
                // 'now', 'today', 'tomorrow', 'yesterday' read as a date/time are the clock.
                let value = inner["val"]["Sval"]["sval"]
                    .as_str()
                    .or(inner["sval"]["sval"].as_str());
                if let Some(s) = value {
                    let s = s.trim().to_ascii_lowercase();
                    if matches!(s.as_str(), "now" | "today" | "tomorrow" | "yesterday") {
                        self.time_or_session = true;
                    }
                }
            }
            _ => {}
        }
        self.walk(inner);
    }

    fn write(&mut self, relation: &Value) {
        if let Some(name) = relation["relname"].as_str() {
            self.writes.push(name.into());
        }
    }
}

fn rel_name(v: &Value) -> RelName {
    let schema = v["schemaname"].as_str().filter(|s| !s.is_empty());
    RelName {
        schema: schema.map(Into::into),
        name: v["relname"].as_str().unwrap_or_default().into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(sql: &str) -> Result<Reads, Bypass> {
        analyze(sql).read
    }

    #[test]
    fn plain_selects_are_candidates() {
        let r = read("SELECT abalance FROM pgbench_accounts WHERE aid = 5").unwrap();
        assert_eq!(&*r.relations[0].name, "pgbench_accounts");
        let r =
            read("WITH x AS (SELECT * FROM s.t) SELECT lower(a) FROM x JOIN u ON true").unwrap();
        let names: Vec<_> = r.relations.iter().map(|r| &*r.name).collect();
        assert!(names.contains(&"t") && names.contains(&"u") && !names.contains(&"x"));
        assert_eq!(r.functions, vec!["lower".into()] as Vec<Box<str>>);
        assert!(read("VALUES (1), (2)").is_ok());
    }

    #[test]
    fn what_is_never_cached() {
        assert_eq!(read("SELECT * FROM t FOR UPDATE"), Err(Bypass::Locking));
        assert_eq!(
            read("SELECT * FROM (SELECT * FROM t FOR SHARE) s"),
            Err(Bypass::Locking)
        );
        assert_eq!(
            read("WITH d AS (DELETE FROM t RETURNING *) SELECT * FROM d"),
            Err(Bypass::ModifyingCte)
        );
        assert_eq!(read("SELECT now()"), Err(Bypass::TimeOrSession));
        assert_eq!(
            read("SELECT CASE WHEN a THEN current_date END FROM t"),
            Err(Bypass::TimeOrSession)
        );
        assert_eq!(read("SELECT 'today'::date"), Err(Bypass::TimeOrSession));
        assert_eq!(read("SELECT pg_backend_pid()"), Err(Bypass::TimeOrSession));
        assert_eq!(read("SELECT 1 INTO t2"), Err(Bypass::SelectInto));
        assert_eq!(read("UPDATE t SET a = 1"), Err(Bypass::NotSelect));
        assert_eq!(read("SELECT 1; SELECT 2"), Err(Bypass::NotSelect));
        assert_eq!(read("SELEC 1"), Err(Bypass::ParseError));
    }

    #[test]
    fn effects() {
        let e = analyze("UPDATE a SET x = f(1) WHERE id IN (SELECT id FROM b)").effects;
        assert_eq!(e.writes, vec!["a".into()] as Vec<Box<str>>);
        assert_eq!(e.calls, vec!["f".into()] as Vec<Box<str>>);
        assert_eq!(e.flush, Flush::None);
        let e = analyze("WITH d AS (DELETE FROM s.t RETURNING *) SELECT * FROM d").effects;
        assert_eq!(e.writes, vec!["t".into()] as Vec<Box<str>>);
        assert_eq!(analyze("TRUNCATE a, b").effects.writes.len(), 2);
        assert_eq!(
            analyze("COPY a FROM STDIN").effects.writes,
            vec!["a".into()] as Vec<Box<str>>
        );
        assert!(analyze("COPY a TO STDOUT").effects.is_none());
        assert_eq!(
            analyze("ALTER TABLE a ADD b int").effects.flush,
            Flush::Database
        );
        assert_eq!(analyze("GRANT SELECT ON a TO r").effects.flush, Flush::All);
        assert_eq!(analyze("DO $$ BEGIN END $$").effects.flush, Flush::Database);
        assert!(analyze("SET ROLE r").effects.session_state);
        assert!(analyze("SET extra_float_digits = 0").effects.session_state);
        assert!(!analyze("SET search_path = a").effects.session_state);
        assert!(analyze("CREATE TEMP TABLE x (a int)").effects.session_state);
        assert!(
            analyze("SELECT set_config('a.b', '1', false)")
                .effects
                .session_state
        );
        assert!(analyze("BEGIN").effects.is_none());
        assert!(analyze("SELECT 1").effects.is_none());
    }
}
