//! What a statement reads and writes, from PostgreSQL's own parser (pg_query), once per
//! statement shape on the cold path.
//!
//! Two questions: may its result be cached at all (a single read-only query that calls nothing
//! time- or session-dependent: the catalog then settles functions and relations, see
//! [`crate::cache::catalog`]), and what must be invalidated when it runs (the tables it writes, the
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
    /// A transaction block that failed, or work in flight, or a rule with
    /// `transactions = false`.
    InTransaction,
    /// A REPEATABLE READ or SERIALIZABLE transaction block (one snapshot for the block).
    Isolation,
    /// The transaction block wrote a table it reads (or something pgmemo cannot bound).
    WrittenInTransaction,
    /// `/* pgmemo nocache */`.
    Hint,
    /// A comment that names pgmemo as a hint does but says nothing readable (`/* pgmemo
    /// cahce */`, `ttl=abc`): ignored, the query runs as with no hint (counted even when a
    /// rule then caches it).
    MalformedHint,
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
    /// Runs SQL given as text (`query_to_xml`, `table_to_xml`, `ts_stat`, ...): what it reads
    /// and writes cannot be known.
    RunsSql,
    /// The client's standard_conforming_strings is off: backslashes escape in its plain
    /// strings, and pgmemo's lexer reads them as the standard does.
    NonstandardStrings,
    /// In a transaction block, an Execute with a row limit (asyncpg's `fetchrow`) of a read
    /// that may return more rows: its portal outlives the Sync with rows left to fetch.
    RowLimitInBlock,
    /// In a transaction block, a Bind of a named portal: it outlives the Sync.
    NamedPortalInBlock,
}

pub const BYPASS_REASONS: [Bypass; 31] = [
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
    Bypass::Isolation,
    Bypass::WrittenInTransaction,
    Bypass::Hint,
    Bypass::MalformedHint,
    Bypass::TooLarge,
    Bypass::NotPlainResult,
    Bypass::Empty,
    Bypass::WrittenMeanwhile,
    Bypass::FirstMiss,
    Bypass::WalBehind,
    Bypass::RunsSql,
    Bypass::NonstandardStrings,
    Bypass::RowLimitInBlock,
    Bypass::NamedPortalInBlock,
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
            Bypass::Isolation => "repeatable read or serializable",
            Bypass::WrittenInTransaction => "written in this transaction",
            Bypass::Hint => "nocache hint",
            Bypass::MalformedHint => "malformed hint",
            Bypass::TooLarge => "larger than max_result_bytes",
            Bypass::NotPlainResult => "error or notice",
            Bypass::Empty => "empty result",
            Bypass::WrittenMeanwhile => "written while it ran",
            Bypass::FirstMiss => "first miss (admitted on the next)",
            Bypass::WalBehind => "WAL stream not caught up",
            Bypass::RunsSql => "runs SQL given as text",
            Bypass::NonstandardStrings => "standard_conforming_strings off",
            Bypass::RowLimitInBlock => "row limit in a block, more rows possible",
            Bypass::NamedPortalInBlock => "named portal in a block",
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
    /// A single-table read: the columns its `WHERE` binds (a point read when they are a key
    /// of the table, which the catalog tells).
    pub filter: Option<super::point::ReadFilter>,
    /// The columns of each table it uses (see [`super::columns`]); None: not read that far.
    pub columns: Option<super::columns::ColumnReads>,
    /// What its text says about how many rows it returns (see [`super::point::RowCount`]).
    pub rows: super::point::RowCount,
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
    /// It changes the client's role or a setting not in the key: caching stays off for that
    /// client.
    pub session_state: bool,
    /// It changes a setting not in the key for the transaction at hand only (`SET LOCAL`):
    /// caching stays off for that client until the transaction ends.
    pub transaction_state: bool,
    /// It may create temporary objects (its text names `temp`, `temporary` or `pg_temp`
    /// anywhere, however it does it: `SELECT INTO TEMP`, `CREATE TEMP VIEW`, a `DO` block),
    /// which shadow permanent ones for that client alone: the client is not answered from
    /// the cache while it may hold them.
    pub temp: bool,
    /// It removes the client's temporary objects (`DISCARD TEMP`, `DISCARD ALL`).
    pub drops_temp: bool,
    /// A `DISCARD ALL` alone: once it completes, the session's settings and role are the
    /// ones it started with.
    pub resets_session: bool,
    /// The relations it names: reading one may write (a view or a policy that calls a
    /// volatile function of the database), which only the catalog tells.
    pub reads: Vec<Box<str>>,
    /// A single INSERT, UPDATE or DELETE: the rows of its table its text names (which of
    /// them are a key, and their values, the cache tells at run time).
    pub rows: Option<super::point::RowWrite>,
}

impl Effects {
    pub fn is_none(&self) -> bool {
        !self.changes_data() && !self.session_state && !self.transaction_state
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
    // SET TRANSACTION (the transaction_* above, for the block at hand) and SET SESSION
    // CHARACTERISTICS AS TRANSACTION (the default_transaction_* above): the cache asks the
    // server for the isolation of a block it would answer in.
    "transaction",
    "session characteristics",
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

/// Builtin functions that run SQL given as text, or read a relation named by text: what
/// they read and write is not in the query. Never cached; running one is a write to the
/// whole database.
const RUNS_SQL_FUNCTIONS: &[&str] = &[
    "query_to_xml",
    "query_to_xmlschema",
    "query_to_xml_and_xmlschema",
    "cursor_to_xml",
    "cursor_to_xmlschema",
    "table_to_xml",
    "table_to_xmlschema",
    "table_to_xml_and_xmlschema",
    "schema_to_xml",
    "schema_to_xmlschema",
    "schema_to_xml_and_xmlschema",
    "database_to_xml",
    "database_to_xmlschema",
    "database_to_xml_and_xmlschema",
    "ts_stat",
];

/// Whether `sql` names a temporary object's keyword or schema anywhere (strings, comments and
/// dollar quotes included: a `DO` block's body creates as surely): `temp`, `temporary`, or
/// a word starting with `pg_temp`, in any case, as whole words.
fn mentions_temp(sql: &str) -> bool {
    let bytes = sql.as_bytes();
    let word_byte = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80;
    let mut at = 0;
    while at < bytes.len() {
        if !word_byte(bytes[at]) {
            at += 1;
            continue;
        }
        let start = at;
        while at < bytes.len() && word_byte(bytes[at]) {
            at += 1;
        }
        let word = &bytes[start..at];
        if word.eq_ignore_ascii_case(b"temp")
            || word.eq_ignore_ascii_case(b"temporary")
            || (word.len() >= 7 && word[..7].eq_ignore_ascii_case(b"pg_temp"))
        {
            return true;
        }
    }
    false
}

/// Analyzes `sql` (one Query message's text or one Parse's).
pub fn analyze(sql: &str) -> Analysis {
    analyze_parsed(sql, &super::parse(sql))
}

/// [`analyze`], from PostgreSQL's parse of `sql` (see [`super::parse`]).
pub fn analyze_parsed(sql: &str, parsed: &super::Parsed) -> Analysis {
    let tree = match parsed {
        super::Parsed::Tree(tree) => tree,
        // The server refuses it too; nothing runs.
        super::Parsed::Refused => {
            return Analysis {
                effects: Effects::default(),
                read: Err(Bypass::ParseError),
            }
        }
        super::Parsed::Unreadable => {
            return Analysis {
                effects: Effects {
                    flush: Flush::Database,
                    ..Effects::default()
                },
                read: Err(Bypass::ParseError),
            }
        }
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
    effects.calls.extend(walker.operators.iter().cloned());
    effects.session_state |= walker.set_config_session;
    effects.transaction_state |= walker.set_config_local;
    if walker
        .functions
        .iter()
        .any(|f| RUNS_SQL_FUNCTIONS.contains(&&**f))
    {
        effects.flush = effects.flush.max(Flush::Data);
    }
    effects.resets_session &= stmts.len() == 1;
    // (A DISCARD TEMP or ALL alone names `temp` to drop it.)
    effects.temp |= mentions_temp(sql) && !(stmts.len() == 1 && effects.drops_temp);
    effects.reads = walker.relations.iter().map(|r| r.name.clone()).collect();
    effects.reads.sort();
    effects.reads.dedup();
    effects.writes.sort();
    effects.writes.dedup();
    effects.calls.sort();
    effects.calls.dedup();
    if let [stmt] = stmts {
        effects.rows = super::point::row_write(&stmt["stmt"]["node"]);
    }
    let read = reads(stmts, walker);
    Analysis { effects, read }
}

impl Analysis {
    /// In a simple query's shape: its constants that the lexer made parameters become `$n`
    /// (see [`super::point::Source`]); `literals`: each literal's start, and its `$n` when
    /// it is a parameter.
    pub fn bind_literals(&mut self, literals: &[(u32, Option<u16>)]) {
        if let Ok(read) = &mut self.read {
            if let Some(f) = &mut read.filter {
                super::point::bind_columns(&mut f.columns, literals);
            }
            for t in read.columns.iter_mut().flat_map(|c| &mut c.tables) {
                super::point::bind_columns(&mut t.filter, literals);
            }
        }
        if let Some(w) = &mut self.effects.rows {
            w.bind_literals(literals);
        }
    }
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
        // COMMIT PREPARED (9, from any session) makes a prepared transaction's writes
        // visible: which tables it wrote is not known here.
        "TransactionStmt"
            if inner["kind"].as_i64() == Some(9)
                || inner["kind"].as_str() == Some("TRANS_STMT_COMMIT_PREPARED") =>
        {
            effects.flush = effects.flush.max(Flush::Data);
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
                if inner["is_local"].as_bool() == Some(true) {
                    effects.transaction_state = true;
                } else {
                    effects.session_state = true;
                }
            }
        }
        "DiscardStmt" => {
            // DISCARD ALL is 1, DISCARD TEMP 4: only ALL resets settings and the role (PLANS
            // and SEQUENCES change no result the cache keeps).
            let target = &inner["target"];
            let all = target.as_i64() == Some(1) || target.as_str() == Some("DISCARD_ALL");
            let temp = target.as_i64() == Some(4) || target.as_str() == Some("DISCARD_TEMP");
            effects.session_state = all;
            effects.resets_session = all;
            effects.drops_temp = all || temp;
        }
        "ExecuteStmt" => effects.flush = effects.flush.max(Flush::Data),
        "CreateStmt" | "CreateTableAsStmt" => {
            let relation = if kind == "CreateStmt" {
                &inner["relation"]
            } else {
                &inner["into"]["rel"]
            };
            let temp = relation["relpersistence"].as_str() == Some("t")
                || relation["schemaname"].as_str() == Some("pg_temp");
            // (The client is then not answered from the cache while it may hold it.)
            effects.temp |= temp;
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
    if walker
        .functions
        .iter()
        .any(|f| RUNS_SQL_FUNCTIONS.contains(&&**f))
    {
        return Err(Bypass::RunsSql);
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
    let mut functions = walker.functions;
    functions.extend(walker.operators);
    Ok(Reads {
        relations,
        functions,
        filter: super::point::read_filter(select),
        columns: super::columns::column_reads(select),
        rows: super::point::row_count(select),
    })
}

/// What the walk over a statement's tree found.
#[derive(Default)]
struct Walker {
    relations: Vec<RelName>,
    writes: Vec<Box<str>>,
    functions: Vec<Box<str>>,
    /// Operators used, as `operator NAME` (the catalog knows them by that name too: an
    /// operator runs a function, which may be one of the database's).
    operators: Vec<Box<str>>,
    ctes: Vec<Box<str>>,
    modifies: bool,
    locking: bool,
    time_or_session: bool,
    /// Calls of `set_config`: one whose `is_local` is not the constant true changes the
    /// session's setting; one whose is changes the transaction's.
    set_config_session: bool,
    set_config_local: bool,
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
                if let Some(name) = last_name(&inner["funcname"]) {
                    if name == "set_config" {
                        let args = inner["args"].as_array().map(Vec::as_slice).unwrap_or(&[]);
                        let local = args.len() == 3 && super::facts::is_true(&args[2]);
                        if local {
                            self.set_config_local = true;
                        } else {
                            self.set_config_session = true;
                        }
                    }
                    let name: Box<str> = name.into();
                    if !self.functions.contains(&name) {
                        self.functions.push(name);
                    }
                }
            }
            "AExpr" => {
                // AEXPR_BETWEEN .. AEXPR_NOT_BETWEEN_SYM (11..=14) name the construct; the
                // comparisons they run are `>=` and `<=`. The others name an operator.
                let kind = inner["kind"].as_i64().unwrap_or(1);
                if (11..=14).contains(&kind) {
                    self.operator(">=");
                    self.operator("<=");
                } else {
                    self.operator_named(&inner["name"]);
                }
            }
            "SubLink" => self.operator_named(&inner["oper_name"]),
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

    fn operator_named(&mut self, name: &Value) {
        if let Some(op) = last_name(name) {
            self.operator(op);
        }
    }

    fn operator(&mut self, op: &str) {
        let name: Box<str> = format!("operator {op}").into();
        if !self.operators.contains(&name) {
            self.operators.push(name);
        }
    }

    fn write(&mut self, relation: &Value) {
        if let Some(name) = relation["relname"].as_str() {
            self.writes.push(name.into());
        }
    }
}

/// The last part of a qualified name in a parse tree (`pg_catalog.set_config` → `set_config`,
/// `OPERATOR(pg_catalog.=)` → `=`): a list of String nodes.
pub(crate) fn last_name(parts: &Value) -> Option<&str> {
    parts
        .as_array()
        .and_then(|parts| parts.last())
        .and_then(|p| p["node"]["String"]["sval"].as_str())
}

/// The relation a `RangeVar` names.
pub(crate) fn rel_name(v: &Value) -> RelName {
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
        assert_eq!(
            read("SELECT table_to_xml('t', true, false, '')"),
            Err(Bypass::RunsSql)
        );
        assert_eq!(
            read("SELECT * FROM ts_stat('SELECT v FROM t')"),
            Err(Bypass::RunsSql)
        );
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
        let local = analyze("SET LOCAL extra_float_digits = 0").effects;
        assert!(local.transaction_state && !local.session_state);
        assert!(
            analyze("SET LOCAL app.tenant = 'a'")
                .effects
                .transaction_state
        );
        assert!(
            !analyze("SET LOCAL statement_timeout = 1")
                .effects
                .transaction_state
        );
        assert!(!analyze("SET search_path = a").effects.session_state);
        // The current transaction's characteristics, and the defaults of the next ones
        // (default_transaction_isolation and its kin): the cache reads the isolation where
        // it matters.
        for sql in [
            "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ",
            "SET TRANSACTION READ ONLY, DEFERRABLE",
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE",
        ] {
            assert!(!analyze(sql).effects.session_state, "{sql}");
        }
        let temp = analyze("CREATE TEMP TABLE x (a int)").effects;
        assert!(temp.temp && !temp.session_state);
        assert!(analyze("DISCARD ALL").effects.session_state);
        assert!(analyze("DISCARD ALL").effects.resets_session);
        assert!(!analyze("DISCARD TEMP").effects.resets_session);
        assert!(!analyze("DISCARD ALL; SET ROLE r").effects.resets_session);
        for discard in ["DISCARD TEMP", "DISCARD PLANS", "DISCARD SEQUENCES"] {
            assert!(!analyze(discard).effects.session_state, "{discard}");
        }
        assert!(
            analyze("SELECT set_config('a.b', '1', false)")
                .effects
                .session_state
        );
        for session in [
            "SELECT set_config('a.b', '1', $1)",
            "SELECT set_config('a.b', '1', 'true'::bool)",
            "SELECT set_config('a.b', '1', true), set_config('a.c', '1', false)",
        ] {
            assert!(analyze(session).effects.session_state, "{session}");
        }
        let local = analyze("SELECT set_config('a.b', $1, true)").effects;
        assert!(local.transaction_state && !local.session_state);
        assert!(analyze("BEGIN").effects.is_none());
        assert!(analyze("SELECT 1").effects.is_none());
        // A prepared transaction's writes show at COMMIT PREPARED, whoever sends it.
        assert_eq!(analyze("COMMIT PREPARED 'x'").effects.flush, Flush::Data);
        assert_eq!(analyze("ROLLBACK PREPARED 'x'").effects.flush, Flush::None);
        assert_eq!(
            analyze("PREPARE TRANSACTION 'x'").effects.flush,
            Flush::None
        );
        assert_eq!(analyze("COMMIT").effects.flush, Flush::None);
        // SQL given as text may write anything.
        assert_eq!(
            analyze("SELECT query_to_xml('UPDATE t SET a = 1 RETURNING a', true, false, '')")
                .effects
                .flush,
            Flush::Data
        );
        // Operators run functions: the catalog says which may write.
        let e = analyze("UPDATE t SET a = a ### 1 WHERE b BETWEEN 1 AND 2").effects;
        assert!(e.calls.contains(&"operator ###".into()), "{:?}", e.calls);
        assert!(e.calls.contains(&"operator >=".into()), "{:?}", e.calls);
        assert_eq!(
            analyze("SELECT * FROM v JOIN s.w ON true").effects.reads,
            vec!["v".into(), "w".into()] as Vec<Box<str>>
        );
    }

    #[test]
    fn temporary_objects_however_made() {
        for sql in [
            "SELECT 1 AS a INTO TEMP TABLE p8",
            "select 1 into temporary p8",
            "CREATE TEMP VIEW v AS SELECT 1",
            "CREATE TEMPORARY SEQUENCE s",
            "CREATE TABLE pg_temp.p8 AS SELECT 1",
            "CREATE TABLE \"pg_temp\".p8 (a int)",
            "CREATE TABLE pg_temp_3.p8 (a int)",
            "CREATE LOCAL TEMP TABLE p8 (a int)",
            "DO $$ BEGIN EXECUTE 'CREATE TEMP TABLE p8 (a int)'; END $$",
        ] {
            assert!(analyze(sql).effects.temp, "{sql}");
        }
        for sql in ["SELECT temperature FROM t", "CREATE TABLE p8 (a int)"] {
            assert!(!analyze(sql).effects.temp, "{sql}");
        }
        let discard = analyze("DISCARD TEMP").effects;
        assert!(discard.drops_temp && !discard.temp);
        let both = analyze("DISCARD TEMP; CREATE TEMP TABLE x (a int)").effects;
        assert!(both.drops_temp && both.temp);
        assert!(analyze("DISCARD ALL").effects.drops_temp);
        assert!(!analyze("DISCARD PLANS").effects.drops_temp);
    }
}
