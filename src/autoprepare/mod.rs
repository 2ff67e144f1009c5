//! Autoprepare: simple-protocol queries run as shared server-side prepared statements.
//!
//! A `Query` whose text is one SELECT / VALUES / TABLE / WITH / INSERT / UPDATE / DELETE /
//! MERGE is read once by the [`lexer`]: its literals become `$1..$n` and the rest is its
//! *shape*. The first time a shape reaches `autoprepare_threshold` uses, PostgreSQL's own
//! parser decides which literals may be parameters ([`crate::query::parameters`]); the
//! decision is remembered per shape in a bounded table (`query::shapes`, shared with the
//! result cache), so the hot path is the lexer and one lookup. The generalized text with the
//! literals' types then is an ordinary registry statement, the same one a driver's
//! `Parse` of that text and types would get, and the query runs as Bind / Describe / Execute /
//! Sync of it, its replies shown as PostgreSQL answers a simple query (the planner's
//! `autoprepared` and [`simple_error`]).
//!
//! Everything here that is not a plain yes happens before anything reaches a server: a query
//! that is not generalized goes to the server untouched ([`Pass`] says why, counted).

use crate::protocol::{frontend as fe, put_cstr, write_message};
use crate::query::lexer::{self, Kind, Lexed};
pub use crate::query::parameters::Never;
use crate::query::parameters::{Decision, Form};
use crate::query::shapes::{Shape, Shapes};
use crate::query::Reader;
use crate::statements::{Registry, Statement, StatementKey};
use bytes::{BufMut, Bytes, BytesMut};
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Why a query went to the server as it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    Lexer(lexer::Refusal),
    Never(Never),
    /// PostgreSQL refused to prepare the generalized text (a literal whose type it cannot
    /// infer as a parameter, say): remembered, never tried again.
    Rejected,
    /// The client's settings keep autoprepare from reading its text as the server does
    /// (standard_conforming_strings off, a client_encoding other than UTF8).
    Settings,
    /// Other work is in flight (a pipeline, an open extended batch, an aborted transaction).
    Busy,
    /// The shape has not been seen `autoprepare_threshold` times yet.
    Threshold,
    /// The first use of a statement no server has accepted yet: it is prepared on the side
    /// (see the planner's `probe`) while the query runs as it is.
    Probing,
    /// The Bind of the query's statement refused a literal's value (its input function
    /// failed, before anything was planned or run), and the query runs again as it is, for
    /// PostgreSQL's own reply (see `Session::again`).
    Rerun,
    /// The server inferred a parameter's type as one a literal does not convert to as a
    /// parameter does (a domain's; an interval assigned where a column's typmod may apply;
    /// see [`parameter_types_sql`]): remembered, never tried again.
    ParameterType,
    /// A literal kept in the text may read the clock (`timestamp 'now'`, see
    /// [`reads_the_clock`]): this query runs as it is (its shape's others may not).
    ClockLiteral,
}

/// Every reason, in the order of [`Pass::index`] (SHOW AUTOPREPARE_REASONS, Prometheus).
pub const PASS_REASONS: [&str; 17] = [
    "not_dml",
    "multi_statement",
    "parameters",
    "not_understood",
    "too_large",
    "syntax_error",
    "not_dml_parsed",
    "select_into",
    "rejected",
    "settings",
    "busy",
    "threshold",
    "probing",
    "rerun",
    "parameter_type",
    "clock_literal",
    "reads_portals",
];

impl Pass {
    pub fn index(self) -> usize {
        use lexer::Refusal as R;
        match self {
            Pass::Lexer(R::NotDml) => 0,
            Pass::Lexer(R::MultiStatement) => 1,
            Pass::Lexer(R::HasParameters) => 2,
            Pass::Lexer(R::NotUnderstood) => 3,
            Pass::Lexer(R::TooLarge) => 4,
            Pass::Never(Never::ParseError) => 5,
            Pass::Never(Never::NotDml) => 6,
            Pass::Never(Never::SelectInto) => 7,
            Pass::Rejected => 8,
            Pass::Settings => 9,
            Pass::Busy => 10,
            Pass::Threshold => 11,
            Pass::Probing => 12,
            Pass::Rerun => 13,
            Pass::ParameterType => 14,
            Pass::ClockLiteral => 15,
            Pass::Never(Never::ReadsPortals) => 16,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Pass::Lexer(r) => r.as_str(),
            Pass::Never(n) => n.as_str(),
            Pass::Rejected => "refused by the server as a prepared statement",
            Pass::Settings => "client settings keep its text from reading as the server reads it",
            Pass::Busy => "other work in flight",
            Pass::Threshold => "below autoprepare_threshold",
            Pass::Probing => "first use, prepared on the side",
            Pass::Rerun => "a literal the Bind refused, run again as it is",
            Pass::ParameterType => {
                "a literal's parameter would be of a domain type (or an interval with a typmod)"
            }
            Pass::ClockLiteral => "a literal kept in the text may read the clock ('now')",
        }
    }
}

/// Why a shape is not generalized, if it is not.
pub fn never(shape: &Shape) -> Option<Pass> {
    if shape.is_rejected() {
        return Some(rejected(shape));
    }
    match shape.decision()? {
        Decision::Never(n) => Some(Pass::Never(*n)),
        Decision::Generalize { .. } => None,
    }
}

/// Why a rejected shape is: the server refused its statement, or its parameter types.
fn rejected(shape: &Shape) -> Pass {
    if shape.types_refused.load(Relaxed) {
        Pass::ParameterType
    } else {
        Pass::Rejected
    }
}

/// The query that checks the parameter types a server inferred for the statement `name` it
/// has just prepared (see the planner's `probe`): one row when every parameter converts its
/// value as the literal it stands for would, none otherwise, so that a check that fails or is
/// lost never lets the statement run.
///
/// A literal converts to its type while PostgreSQL analyses the query; a domain's constraints
/// are then applied by a `CoerceToDomain` node when the expression is evaluated, that is
/// lazily: `select 'y125'::dom4 where false` returns no row and `insert into t4 select 'y125'
/// where false` is `INSERT 0 0` though dom4's CHECK rejects 'y125', and a failing check has no
/// error position. A parameter of a domain type is converted by `domain_in` at Bind, which
/// applies the constraints then, whether or not the query would ever evaluate the value: the
/// same two queries fail with 23514 as prepared statements, before running (PostgreSQL 15,
/// measured with PREPARE/EXECUTE; the error, 23514 and not a data exception, is not run again
/// as the simple query). Whether a parameter's type is a domain's is known only from the
/// server's inference (an explicit cast, `dom 'lit'`, an INSERT or UPDATE into a column of
/// the domain, a function's argument of it; not a comparison with such a column, which
/// compares as the base type): the statement's own `pg_prepared_statements.parameter_types`
/// against `pg_type.typtype = 'd'`, as that server inferred them.
///
/// `writes`: the statement writes, and an assignment to an `interval` column with a typmod
/// (`interval hour`) reads a literal with the typmod but a parameter without it (`'1'` is an
/// hour as a literal, zero as a parameter): an `interval` parameter is refused then if any
/// column of the database has such a type. (An explicit cast is handled in the tree, see
/// `query::parameters`.) Types whose input function is not immutable (date and time types,
/// `reg*`, enums) convert a parameter at Bind as the simple query converts the literal, in
/// the same transaction and under the same settings: they are fine.
///
/// The statement is found by name in a CTE, so that the function scan's estimate of 1000 rows
/// is not multiplied by the check's cost (which made the plan's cost pass `jit_above_cost`:
/// 9 ms of JIT compilation, measured); 0.07 ms as it is.
pub fn parameter_types_sql(name: &str, writes: bool) -> String {
    let interval = if writes {
        " OR (p.t::oid IN (1186, 1187) AND EXISTS (SELECT FROM pg_catalog.pg_attribute a \
         WHERE a.atttypid IN (1186, 1187) AND a.atttypmod >= 0 AND NOT a.attisdropped))"
    } else {
        ""
    };
    format!(
        "WITH s AS MATERIALIZED (SELECT parameter_types FROM pg_catalog.pg_prepared_statements \
         WHERE name = {}) SELECT 1 FROM s WHERE NOT EXISTS (SELECT FROM \
         pg_catalog.unnest(s.parameter_types) p(t) WHERE (SELECT y.typtype FROM \
         pg_catalog.pg_type y WHERE y.oid = p.t::oid) = 'd'{interval})",
        crate::params::quote_literal(name)
    )
}

/// Autoprepare's view of the shapes every session shares (`query::shapes`), and its counters.
pub struct Autoprepare {
    shapes: Arc<Shapes>,
    /// Queries passed through, by [`Pass::index`].
    pub passed: [AtomicU64; PASS_REASONS.len()],
    /// Autoprepared SELECTs that failed while executing, before their first row, whose plan
    /// was checked ([`write_plan_check`]) instead of running them again.
    pub plan_checks: AtomicU64,
}

impl Autoprepare {
    pub fn new(shapes: Arc<Shapes>) -> Autoprepare {
        Autoprepare {
            shapes,
            passed: Default::default(),
            plan_checks: AtomicU64::new(0),
        }
    }

    /// Reads the simple query `sql` ahead of planning (the session's reading of it, and its
    /// shape looked up) and answers which of the session's words (`words::query`) it contains: its
    /// shape's, found once, and those in its string literals (`set_config('search_path',
    /// ...)` names a setting in one; numbers and bit strings hold no word). Comments are not
    /// read: a word there does nothing. None when the lexer refuses the text: the caller scans
    /// it whole.
    #[inline]
    pub fn read_ahead(&self, sql: &[u8], reader: &mut Reader) -> Option<u32> {
        let (lexed, shape) = reader.shape(sql, &self.shapes).ok()?;
        let words =
            lexed
                .literals
                .iter()
                .filter(|l| l.kind == Kind::Text)
                .fold(shape.words, |words, l| {
                    words | crate::query::words::in_query(&sql[l.start as usize..l.end as usize])
                });
        Some(words)
    }

    pub fn count_pass(&self, pass: Pass) {
        self.passed[pass.index()].fetch_add(1, Relaxed);
    }

    /// The remembered shapes autoprepare may run: those of simple queries the lexer read (a
    /// text it refused is remembered for the result cache only, a prepared statement's for
    /// SHOW QUERIES).
    fn lexed_shapes(&self) -> impl Iterator<Item = Arc<Shape>> + '_ {
        self.shapes
            .iter()
            .filter(|s| !s.is_raw() && !s.is_extended())
    }

    /// Every remembered shape of a simple query, most used first (SHOW AUTOPREPARE).
    pub fn shapes(&self) -> Vec<Arc<Shape>> {
        let mut v: Vec<Arc<Shape>> = self.lexed_shapes().collect();
        v.sort_by_key(|s| std::cmp::Reverse(s.seen.load(Relaxed)));
        v
    }

    pub fn shape_count(&self) -> usize {
        self.lexed_shapes().count()
    }

    /// Shapes remembered as never generalized (the negative cache).
    pub fn never_count(&self) -> usize {
        self.lexed_shapes().filter(|s| never(s).is_some()).count()
    }
}

/// What the planner needs to autoprepare one client's simple query.
pub struct Use<'a> {
    pub global: &'a Autoprepare,
    pub client: &'a mut ClientAutoprepare,
    /// The session's reading of the query (made once, shared with the result cache).
    pub reader: &'a mut Reader,
    /// `autoprepare_threshold` of the client's pool.
    pub threshold: u64,
}

/// A client's autoprepare state: buffers reused from query to query, and the statements its
/// queries ran as (so a repeated query costs no registry lookup).
#[derive(Default)]
pub struct ClientAutoprepare {
    /// The text of the statement the last query runs as.
    text: Vec<u8>,
    /// Its Parse's parameter types (count, then OIDs).
    types: Vec<u8>,
    /// The parameters of that statement, in `$n` order.
    params: Vec<Param>,
    /// Points of `text` whose position in the client's text is known, in order.
    anchors: Vec<Anchor>,
    statements: HashMap<u64, Arc<Statement>, lexer::FixedHash>,
    /// The statement the last query ran as (one of `statements`).
    last: Option<Arc<Statement>>,
    /// The shape `text` and `types` were last built for, when each of its literals became a
    /// plain parameter and its query had no comment: another query of that shape then has
    /// the same text and types, and `last` is theirs (see [`ClientAutoprepare::statement`]).
    built_for: Option<Arc<Shape>>,
    /// The shape of the query in flight.
    shape: Option<Arc<Shape>>,
    /// The query in flight writes: PostgreSQL describes its rows (RowDescription) to a
    /// simple query only once it has run to completion, so the Describe's answer waits in
    /// `held` for the first row or the CommandComplete, and is dropped on an error.
    pub modifies: bool,
    /// The query in flight is a SELECT that is the first statement of an implicit
    /// transaction. With a generic plan PostgreSQL evaluates expressions of constants at run
    /// time that the simple query folds while planning, so an error it would raise before
    /// the RowDescription comes after it (PostgreSQL 15, `SELECT count_call(), $1/$2` with 1
    /// and 0: ErrorResponse at the Bind under its five custom plans, BindComplete,
    /// RowDescription and then the error, count_call having run, under the generic plan;
    /// `SELECT count_call(), 1/0` fails while planning, before its RowDescription, and never
    /// calls count_call). So the RowDescription (and notices) wait in `held` for the first row
    /// or the CommandComplete. An error before then came while the query executed: the query
    /// is never sent again (a volatile function before the error has run), but its plan is
    /// checked ([`write_plan_check`]) to tell whether PostgreSQL's simple query would have
    /// failed while planning (its error instead) or while executing (what is held, then the
    /// error).
    pub checks_plan: bool,
    /// The plan check of the query that failed is in flight: `held` (its RowDescription,
    /// notices and error) waits for its answer (see `Session::settle_plan_check`).
    pub checking: bool,
    /// The next query goes to the server as it is (it is a query whose literal the Bind
    /// refused, run again).
    pub bypass: bool,
    pub held: BytesMut,
}

/// One parameter of an autoprepared statement.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Param {
    /// Its literal, in `lexed.literals`.
    literal: u32,
    /// Where the literal is in the client's query (characters, 1-based): kept here, because
    /// an error reporting it may come back after the session has read the next query.
    position: u32,
    kind: Kind,
    /// The value is the literal's with a minus in front (see [`Form::Negated`]).
    negated: bool,
}

/// A byte of a statement's text whose character position in the client's query is known.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Anchor {
    at: u32,
    position: u32,
    /// For a `$n`: where it ends; everything before that is the literal's position.
    literal_end: u32,
}

/// A client's statements are remembered up to this many; beyond it the map starts afresh.
const MAX_CLIENT_STATEMENTS: usize = 256;

impl ClientAutoprepare {
    /// The statement the simple query `sql` runs as, or why it goes to the server as it is.
    /// `context` is the client's registry context (database, role, search_path) and its
    /// database's schema epoch.
    pub fn statement(
        &mut self,
        global: &Autoprepare,
        registry: &Registry,
        sql: &[u8],
        reader: &mut Reader,
        context: (u32, u32),
        threshold: u64,
    ) -> Result<Arc<Statement>, Pass> {
        self.shape = None;
        self.held.clear();
        if std::mem::take(&mut self.bypass) {
            return Err(Pass::Rerun);
        }
        let (lexed, shape) = reader.shape(sql, &global.shapes).map_err(Pass::Lexer)?;
        let shape = shape.clone();
        if shape.is_rejected() {
            return Err(rejected(&shape));
        }
        let seen = shape.seen.fetch_add(1, Relaxed) + 1;
        if seen < threshold {
            return Err(Pass::Threshold);
        }
        let decision = &shape.derived(sql, &lexed.literals).decision;
        let forms = match decision {
            Decision::Never(n) => return Err(Pass::Never(*n)),
            Decision::Generalize { forms, modifies } => {
                self.modifies = *modifies;
                forms
            }
        };
        // Of the shape built last, every literal a plain parameter and no comment: the same
        // text and types (the shape is its generalized text and its literals' kinds, its
        // forms are decided once), only the literals' positions are the query's own.
        let same = lexed.comments.is_empty()
            && self
                .built_for
                .as_ref()
                .is_some_and(|s| Arc::ptr_eq(s, &shape));
        if same {
            self.move_positions(lexed);
        } else {
            self.built_for = None;
            if !self.build(sql, lexed, forms) {
                return Err(Pass::ClockLiteral);
            }
            // (Whatever follows leaves `last` the statement of this text and types.)
            if lexed.comments.is_empty() && forms.iter().all(|f| *f == Form::Param) {
                self.built_for = Some(shape.clone());
            }
        }
        #[cfg(debug_assertions)]
        if same {
            let mut built = ClientAutoprepare::default();
            assert!(built.build(sql, lexed, forms));
            assert_eq!(
                (&built.text, &built.types, &built.params, &built.anchors),
                (&self.text, &self.types, &self.params, &self.anchors),
                "the positions moved are a build's"
            );
        }
        let (context, epoch) = context;
        let is_its = |s: &Statement| {
            s.key.context == context
                && s.key.epoch == epoch
                && s.key.query == self.text
                && s.key.param_types == self.types
        };
        // The last query's statement first: a client mostly repeats a query (its key compared
        // costs less than hashing it). With the same text and types as at the last build, the
        // last statement is theirs: its context and epoch are what may have changed.
        let last = self.last.as_ref().filter(|s| match same {
            true => s.key.context == context && s.key.epoch == epoch,
            false => is_its(s),
        });
        if let Some(last) = last {
            debug_assert!(is_its(last));
            let statement = last.clone();
            return self.chosen(shape, statement);
        }
        let hash = lexer::hasher().hash_one((&self.text, &self.types, context, epoch));
        let statement = match self.statements.get(&hash) {
            Some(s) if is_its(s) => s.clone(),
            _ => {
                let key = StatementKey {
                    context,
                    epoch,
                    query: Bytes::copy_from_slice(&self.text),
                    param_types: Bytes::copy_from_slice(&self.types),
                };
                let statement = registry.get_or_insert(key).0;
                if self.statements.len() >= MAX_CLIENT_STATEMENTS {
                    self.statements.clear();
                }
                self.statements.insert(hash, statement.clone());
                statement
            }
        };
        self.last = Some(statement.clone());
        self.chosen(shape, statement)
    }

    /// The literals' positions of `lexed`, a query of the shape built last (see `built_for`),
    /// in `params` and `anchors`, which are otherwise as its build would make them: the
    /// first anchor is the text's start; each parameter has two, at its `$n` and after it.
    fn move_positions(&mut self, lexed: &Lexed) {
        for (i, (param, literal)) in self.params.iter_mut().zip(&lexed.literals).enumerate() {
            param.position = literal.position;
            self.anchors[1 + 2 * i].position = literal.position;
            self.anchors[2 + 2 * i].position = literal.end_position;
        }
    }

    /// The query of `shape` runs as `statement`, unless PostgreSQL refused it.
    fn chosen(
        &mut self,
        shape: Arc<Shape>,
        statement: Arc<Statement>,
    ) -> Result<Arc<Statement>, Pass> {
        if statement.is_rejected() {
            let types = statement.types_refused();
            shape.types_refused.store(types, Relaxed);
            shape.rejected.store(true, Relaxed);
            return Err(rejected(&shape));
        }
        self.shape = Some(shape);
        Ok(statement)
    }

    /// Counts one run of the last query's shape through its statement.
    pub fn executed(&self) {
        if let Some(shape) = &self.shape {
            shape.executions.fetch_add(1, Relaxed);
        }
    }

    /// Builds the statement's text and types: the lexer's text, with the literals the shape
    /// keeps put back and the others numbered `$1..$n`. False: a literal kept in the text may
    /// read the clock ([`reads_the_clock`]), and the query is not to run as the statement.
    fn build(&mut self, sql: &[u8], lexed: &Lexed, forms: &[Form]) -> bool {
        let mut clock = false;
        self.text.clear();
        self.types.clear();
        self.params.clear();
        self.anchors.clear();
        self.anchors.push(Anchor {
            at: 0,
            position: 1,
            literal_end: 0,
        });
        let mut comments = lexed.comments.iter().peekable();
        let mut at = 0usize; // in lexed.text
        let mut n = 0usize;
        // Copies lexed.text[at..to], anchoring the comments dropped in it.
        let mut copy = |text: &mut Vec<u8>, anchors: &mut Vec<Anchor>, at: usize, to: usize| {
            let base = text.len();
            while let Some(&&(gen_at, position)) = comments.peek() {
                if gen_at as usize > to {
                    break;
                }
                anchors.push(Anchor {
                    at: (base + gen_at as usize - at) as u32,
                    position,
                    literal_end: 0,
                });
                comments.next();
            }
            text.extend_from_slice(&lexed.text[at..to]);
        };
        for (i, literal) in lexed.literals.iter().enumerate() {
            let (gen_start, gen_end) = (literal.gen_start as usize, literal.gen_end as usize);
            copy(&mut self.text, &mut self.anchors, at, gen_start);
            at = gen_end;
            let mut position = literal.position;
            let negated = match forms[i] {
                Form::Negated { back } => {
                    // The minus (and the spaces after it) go into the parameter.
                    self.text.truncate(self.text.len() - back as usize);
                    position -= back;
                    true
                }
                _ => false,
            };
            let start = self.text.len() as u32;
            if forms[i] == Form::Verbatim {
                let raw = &sql[literal.start as usize..literal.end as usize];
                clock |= match literal.kind {
                    Kind::Text => reads_the_clock(raw) || reads_the_clock(lexed.value(literal)),
                    Kind::Verbatim => reads_the_clock(raw),
                    _ => false,
                };
                // A `$n` may have been spaced from its neighbours; the literal itself need not.
                self.text.extend_from_slice(raw);
                self.anchors.push(Anchor {
                    at: start,
                    position: literal.position,
                    literal_end: 0,
                });
                continue;
            }
            n += 1;
            let end = lexer::push_placeholder(&mut self.text, n, lexed.text.get(gen_end).copied());
            let kind = match (negated, literal.kind) {
                (true, Kind::Int4 | Kind::Int8 | Kind::Numeric) => {
                    lexer::negative_kind(lexed.value(literal))
                }
                _ => literal.kind,
            };
            self.params.push(Param {
                literal: i as u32,
                position: literal.position,
                kind,
                negated,
            });
            self.anchors.push(Anchor {
                at: start,
                position,
                literal_end: end as u32,
            });
            self.anchors.push(Anchor {
                at: end as u32,
                position: literal.end_position,
                literal_end: 0,
            });
        }
        copy(&mut self.text, &mut self.anchors, at, lexed.text.len());
        self.types.put_u16(n as u16);
        for p in &self.params {
            self.types.put_u32(p.kind.type_oid());
        }
        !clock
    }

    /// Writes the Bind of the last query's statement (named `server_name`) to the unnamed
    /// portal: its literals' values in text format, text results.
    /// `lexed`: the reading [`ClientAutoprepare::statement`] was given.
    pub fn write_bind(&self, lexed: &Lexed, server_name: &[u8], out: &mut BytesMut) {
        write_message(out, fe::BIND, |m| {
            put_cstr(m, b"");
            put_cstr(m, server_name);
            m.put_u16(0); // every parameter in text format
            m.put_u16(self.params.len() as u16);
            for p in &self.params {
                let value = lexed.value(&lexed.literals[p.literal as usize]);
                m.put_i32((value.len() + usize::from(p.negated)) as i32);
                if p.negated {
                    m.put_u8(b'-');
                }
                m.extend_from_slice(value);
            }
            m.put_u16(0); // every result column in text format
        });
    }

    /// The position PostgreSQL gives the literal of parameter `n` (1-based) in a simple query.
    fn literal_position(&self, n: usize) -> Option<u32> {
        let p = self.params.get(n.checked_sub(1)?)?;
        Some(p.position)
    }

    /// A position (characters, 1-based) in the statement's text, as a position in the
    /// client's query: the same where no literal or comment came before it, moved by the
    /// length differences of the literals before it, a literal's own where it is in a `$n`.
    fn original_position(&self, position: u32) -> u32 {
        let Some(offset) = char_offset(&self.text, position) else {
            return position;
        };
        let anchor = self
            .anchors
            .iter()
            .rev()
            .find(|a| a.at as usize <= offset)
            .copied()
            .unwrap_or(Anchor {
                at: 0,
                position: 1,
                literal_end: 0,
            });
        if offset < anchor.literal_end as usize {
            return anchor.position;
        }
        anchor.position + chars(&self.text[anchor.at as usize..offset])
    }
}

/// Whether a string literal (its text or its value) may be one of the date and time inputs
/// that read the clock: `now`, `today`, `tomorrow`, `yesterday`, in any case and among other
/// words (`'tomorrow 10:00'`, `' TODAY '`). PostgreSQL converts a literal when it analyses the
/// statement, so one kept in the text of a shared statement (`timestamp 'now'`, `DATE
/// 'today'`: typed literals stay literals) would hold the time its Parse ran at on each server
/// for as long as the statement lives, where the simple query reads it anew each time
/// (PostgreSQL 15: `PREPARE p AS SELECT timestamp 'now'` answers the same time a second
/// later; its documentation warns of these inputs in prepared statements). As a parameter
/// such a literal is read at each Bind, as the simple query reads it: only the ones kept in
/// the text matter. A word that merely contains one (`'unknown'`) keeps its query out too:
/// it runs as it is, which is always right.
fn reads_the_clock(text: &[u8]) -> bool {
    const WORDS: [&[u8]; 4] = [b"now", b"today", b"tomorrow", b"yesterday"];
    WORDS.iter().any(|word| {
        text.windows(word.len())
            .any(|w| w.eq_ignore_ascii_case(word))
    })
}

/// Writes the plan check of a SELECT whose autoprepared run failed while executing, before
/// its first row (see [`ClientAutoprepare::checks_plan`]): Parse of the client's text `sql`
/// as the unnamed statement, Bind of it to the unnamed portal with no Execute, Sync; then
/// Close of the unnamed statement and Sync, since pgmemo leaves no unnamed statement on a
/// server. Nothing of the query runs: the Bind only plans it, as the simple query is
/// planned, folding its constant expressions. Measured on PostgreSQL 15: `select count_call(),
/// 1/0` fails at this Bind with the simple query's ErrorResponse, field for field (22012, no
/// position, int4div), and so does `SELECT 99999999.5::numeric(6,2)` (22003 with its
/// detail); `select count_call() + 1/(select 0)`, which the simple query describes and then
/// fails executing, gets its BindComplete, and count_call (a nextval) was not called. A
/// Parse that fails (an error at a literal) reports the position in `sql`, the client's own
/// text, as the simple query does. The Close answers CloseComplete whether or not the Parse
/// left a statement.
pub fn write_plan_check(out: &mut BytesMut, sql: &[u8]) {
    write_message(out, fe::PARSE, |m| {
        put_cstr(m, b"");
        put_cstr(m, sql);
        m.put_u16(0); // no parameter types: the text has no $n
    });
    write_message(out, fe::BIND, |m| {
        put_cstr(m, b""); // the unnamed portal
        put_cstr(m, b""); // of the unnamed statement
        m.put_u16(0); // no parameter formats
        m.put_u16(0); // no parameters
        m.put_u16(0); // no result formats
    });
    fe::sync(out);
    write_message(out, fe::CLOSE, |m| {
        m.put_u8(b'S');
        put_cstr(m, b"");
    });
    fe::sync(out);
}

/// Writes the Describe (portal), Execute and Sync that follow an autoprepared query's Bind.
pub fn write_run(out: &mut BytesMut) {
    out.extend_from_slice(&RUN);
}

/// The Describe of the unnamed portal, its Execute (every row) and a Sync: the same bytes for
/// every query, so written as one copy instead of put together field by field.
#[rustfmt::skip]
const RUN: [u8; 22] = [
    fe::DESCRIBE, 0, 0, 0, 6, b'P', 0, // the unnamed portal
    fe::EXECUTE, 0, 0, 0, 9, 0, 0, 0, 0, 0, // the unnamed portal, every row
    fe::SYNC, 0, 0, 0, 4,
];

/// Whether the client's settings let autoprepare count the text in characters as the server
/// counts them and read its literals as the lexer does: UTF8 on both sides and
/// standard_conforming_strings on. Settings that change what a literal means (DateStyle,
/// IntervalStyle, TimeZone) need not match the pool's: they are part of the statement's
/// context (see `statements::registry::literal_settings`), so a literal kept in the text is
/// read under the same settings by every client that shares the statement.
pub fn settings_allow(client: &crate::params::Vars) -> bool {
    let [client_encoding, server_encoding, standard_strings] = client.get_each([
        "client_encoding",
        "server_encoding",
        "standard_conforming_strings",
    ]);
    let is =
        |value: Option<&str>, wanted: &str| value.is_some_and(|v| v.eq_ignore_ascii_case(wanted));
    is(client_encoding, "UTF8") && is(server_encoding, "UTF8") && is(standard_strings, "on")
}

/// Writes the server's ErrorResponse `body` (to an autoprepared query's Parse or Bind) as
/// PostgreSQL reports the same error for the simple query: the context line the extended
/// protocol adds about a parameter's value is dropped, and the error gets that literal's
/// position instead; a position in the statement's text becomes one in the client's text.
pub fn simple_error(out: &mut BytesMut, body: &[u8], client: &ClientAutoprepare) {
    let mut fields: Vec<(u8, Vec<u8>)> = crate::protocol::backend::fields(body)
        .map(|(code, value)| (code, value.to_vec()))
        .collect();
    let mut position = None;
    if let Some(i) = fields.iter().position(|(c, _)| *c == b'W') {
        let context = &fields[i].1;
        let line_start = context
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |p| p + 1);
        if let Some(n) = portal_parameter(&context[line_start..]) {
            position = client.literal_position(n);
            if line_start == 0 {
                fields.remove(i);
            } else {
                fields[i].1.truncate(line_start - 1);
            }
        }
    }
    if let Some((_, p)) = fields.iter_mut().find(|(c, _)| *c == b'P') {
        if let Some(at) = std::str::from_utf8(p).ok().and_then(|s| s.parse().ok()) {
            *p = client.original_position(at).to_string().into_bytes();
        }
        position = None;
    }
    write_message(out, crate::protocol::backend::ERROR_RESPONSE, |m| {
        let mut pending = position;
        for (code, value) in &fields {
            // PostgreSQL's order (elog.c): S V C M D H W s t c d n, then P, p q F L R.
            if pending.is_some() && matches!(code, b'p' | b'q' | b'F' | b'L' | b'R') {
                m.put_u8(b'P');
                put_cstr(m, pending.take().unwrap_or_default().to_string().as_bytes());
            }
            m.put_u8(*code);
            put_cstr(m, value);
        }
        if let Some(p) = pending {
            m.put_u8(b'P');
            put_cstr(m, p.to_string().as_bytes());
        }
        m.put_u8(0);
    });
}

/// Whether an ErrorResponse body is an error the same statement raises again with the same
/// values: not a cancel or timeout (57), a serialization failure or deadlock (40), a lack of
/// resources (53), a lock not available (55), a connection (08) or system (58, XX) failure.
pub fn is_repeatable(body: &[u8]) -> bool {
    crate::protocol::backend::fields(body)
        .find(|(code, _)| *code == b'C')
        .is_some_and(|(_, value)| {
            !["08", "40", "53", "55", "57", "58", "XX"]
                .iter()
                .any(|class| value.starts_with(class.as_bytes()))
        })
}

/// Whether an ErrorResponse body is about the value of a Bind's parameter (its context's last
/// line is PostgreSQL's `unnamed portal parameter $N ...`).
pub fn is_parameter_error(body: &[u8]) -> bool {
    crate::protocol::backend::fields(body)
        .find(|(code, _)| *code == b'W')
        .is_some_and(|(_, context)| {
            let line = context
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(context, |p| &context[p + 1..]);
            portal_parameter(line).is_some()
        })
}

/// `unnamed portal parameter $N` or `unnamed portal parameter $N = '...'`: N.
fn portal_parameter(line: &[u8]) -> Option<usize> {
    let rest = line.strip_prefix(b"unnamed portal parameter $")?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    let tail = &rest[digits..];
    if !(tail.is_empty() || tail.starts_with(b" = ")) {
        return None;
    }
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

/// The byte offset of the character at `position` (1-based) in `text`.
fn char_offset(text: &[u8], position: u32) -> Option<usize> {
    let mut seen = 0u32;
    for (i, &b) in text.iter().enumerate() {
        if b & 0xC0 != 0x80 {
            seen += 1;
            if seen == position {
                return Some(i);
            }
        }
    }
    (seen + 1 == position).then_some(text.len())
}

fn chars(text: &[u8]) -> u32 {
    text.iter().filter(|&&b| b & 0xC0 != 0x80).count() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_run_is_describe_execute_sync() {
        let mut built = BytesMut::new();
        write_message(&mut built, fe::DESCRIBE, |m| {
            m.put_u8(b'P');
            put_cstr(m, b"");
        });
        write_message(&mut built, fe::EXECUTE, |m| {
            put_cstr(m, b"");
            m.put_u32(0);
        });
        fe::sync(&mut built);
        let mut run = BytesMut::new();
        write_run(&mut run);
        assert_eq!(run, built);
    }

    /// The plan check is the client's text parsed as the unnamed statement and bound with no
    /// parameters, a Sync, then the unnamed statement closed and a Sync: no Execute.
    #[test]
    fn the_plan_check_binds_without_executing() {
        let mut out = BytesMut::new();
        write_plan_check(&mut out, b"SELECT 1/0");
        let mut expected = Vec::new();
        expected.extend_from_slice(b"P\0\0\0\x12\0SELECT 1/0\0\0\0");
        expected.extend_from_slice(b"B\0\0\0\x0c\0\0\0\0\0\0\0\0");
        expected.extend_from_slice(b"S\0\0\0\x04");
        expected.extend_from_slice(b"C\0\0\0\x06S\0");
        expected.extend_from_slice(b"S\0\0\0\x04");
        assert_eq!(&out[..], &expected[..]);
    }

    /// A text the lexer refused is remembered in the shared table for the result cache only:
    /// SHOW AUTOPREPARE and its counts (the negative cache too) leave it out.
    #[test]
    fn raw_texts_are_not_autoprepare_shapes() {
        let shapes = Arc::new(Shapes::new(100));
        let global = Autoprepare::new(shapes.clone());
        let raw = shapes.raw(b"SET x = 1");
        raw.derived(b"SET x = 1", &[]);
        assert!(global.shapes().is_empty());
        assert_eq!((global.shape_count(), global.never_count()), (0, 0));
    }

    #[test]
    fn read_ahead_finds_the_words_of_the_whole_text_but_comments() {
        use crate::query::words::query as w;
        let global = Autoprepare::new(Arc::new(Shapes::new(100)));
        let mut c = ClientAutoprepare::default();
        let mut r = Reader::default();
        for sql in [
            "SELECT abalance FROM pgbench_accounts WHERE aid = 12345",
            "SELECT set_config('search_path', 'pg_temp', false)",
            "SELECT pg_advisory_lock(1), 'begin', $$listen$$, $t$ unlisten $t$, E'drop\\n'",
            "SELECT 'a'\n 'load', \"Hold\", U&'temp', 1e5, B'101', X'1F', -2.5",
            "UPDATE t SET x = 'create' WHERE y = 'pgmemo_s1' RETURNING 'alter'",
            "WITH q AS (SELECT 'deallocate' AS reset) SELECT * FROM q",
        ] {
            let words = global.read_ahead(sql.as_bytes(), &mut r);
            assert_eq!(
                words,
                Some(crate::query::words::in_query(sql.as_bytes())),
                "{sql}"
            );
            r.forget();
        }
        let sql = "SELECT 1 /* begin */ -- set search_path\n, 'x'";
        assert_eq!(global.read_ahead(sql.as_bytes(), &mut r), Some(0));
        assert_ne!(crate::query::words::in_query(sql.as_bytes()), 0);
        // The planner takes the reading (no second lexing, the same shape).
        let shape = r.shape(sql.as_bytes(), &global.shapes).unwrap().1.clone();
        assert!(r.lexed().is_some());
        let _ = c.statement(
            &global,
            &Registry::default(),
            sql.as_bytes(),
            &mut r,
            (0, 0),
            u64::MAX,
        );
        assert_eq!(shape.seen.load(Relaxed), 1);
        // Refused: no words from the reading, the refusal kept for the planner.
        r.forget();
        let sql = "SET search_path = a";
        assert_eq!(global.read_ahead(sql.as_bytes(), &mut r), None);
        assert!(r.lexed().is_none());
        assert_eq!(
            c.statement(
                &global,
                &Registry::default(),
                sql.as_bytes(),
                &mut r,
                (0, 0),
                1
            )
            .err(),
            Some(Pass::Lexer(lexer::Refusal::NotDml))
        );
        assert_ne!(
            crate::query::words::in_query(sql.as_bytes()) & w::SEARCH_PATH,
            0
        );
    }

    /// A query of the shape built last runs as the same statement with its own literals'
    /// positions (the error positions), as a build of its own gives them (checked against
    /// one in debug builds); another context, a comment, a literal kept in the text or
    /// another shape build afresh.
    #[test]
    fn the_shape_built_last_moves_only_its_positions() {
        let global = Autoprepare::new(Arc::new(Shapes::new(100)));
        let registry = Registry::default();
        let mut c = ClientAutoprepare::default();
        let mut r = Reader::default();
        let mut run = |c: &mut ClientAutoprepare, sql: &str, context: (u32, u32)| {
            r.forget();
            let statement = c
                .statement(&global, &registry, sql.as_bytes(), &mut r, context, 1)
                .unwrap();
            let positions: Vec<u32> = (1..=c.params.len())
                .filter_map(|n| c.literal_position(n))
                .collect();
            (statement, positions, c.built_for.is_some())
        };
        let (first, at, kept) = run(&mut c, "SELECT v FROM t WHERE a = 7 AND b = 'x'", (0, 0));
        assert_eq!((at, kept), (vec![27, 37], true));
        let (again, at, _) = run(
            &mut c,
            "SELECT v FROM t WHERE a = 12345 AND b = 'yy'",
            (0, 0),
        );
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(at, vec![27, 41]);
        assert_eq!(c.literal_position(2), Some(41));
        // Another context: the same text, another statement.
        let (other, _, _) = run(&mut c, "SELECT v FROM t WHERE a = 1 AND b = 'z'", (1, 0));
        assert!(!Arc::ptr_eq(&first, &other));
        // A comment: built afresh, and not kept as the shape built last.
        let (_, at, kept) = run(
            &mut c,
            "SELECT v /* c */ FROM t WHERE a = 1 AND b = 'z'",
            (0, 0),
        );
        assert_eq!((at, kept), (vec![35, 45], false));
        let (back, at, kept) = run(&mut c, "SELECT v FROM t WHERE a = 3 AND b = 'q'", (0, 0));
        assert!(Arc::ptr_eq(&first, &back));
        assert_eq!((at, kept), (vec![27, 37], true));
    }

    fn client_for(sql: &str) -> (ClientAutoprepare, Lexed) {
        let mut c = ClientAutoprepare::default();
        let mut lexed = Lexed::default();
        lexer::generalize(sql.as_bytes(), &mut lexed).unwrap();
        let forms: Vec<Form> = lexed
            .literals
            .iter()
            .map(|l| {
                if l.kind == Kind::Verbatim {
                    Form::Verbatim
                } else {
                    Form::Param
                }
            })
            .collect();
        c.build(sql.as_bytes(), &lexed, &forms);
        (c, lexed)
    }

    #[test]
    fn build_numbers_parameters_and_types() {
        let sql = "SELECT * FROM t WHERE a = 1 AND b = 'x' AND c = U&'y' AND d = 3000000000";
        let (c, lexed) = client_for(sql);
        assert_eq!(
            String::from_utf8_lossy(&c.text),
            "SELECT * FROM t WHERE a = $1 AND b = $2 AND c = U&'y' AND d = $3"
        );
        assert_eq!(c.types, [0, 3, 0, 0, 0, 23, 0, 0, 0, 0, 0, 0, 0, 20]);
        let mut out = BytesMut::new();
        c.write_bind(&lexed, b"pgmemo_s9", &mut out);
        let bind = fe::Bind::parse(crate::protocol::body(&out)).unwrap();
        assert_eq!(bind.statement, b"pgmemo_s9");
    }

    /// A literal kept in the text that may read the clock keeps its query from running as the
    /// statement (it would hold the time of the statement's Parse); as a parameter it is read
    /// at each Bind, and a literal that is no such input is kept as before.
    #[test]
    fn clock_literals_kept_in_the_text_keep_the_query_out() {
        fn built(sql: &str) -> bool {
            let mut lexed = Lexed::default();
            lexer::generalize(sql.as_bytes(), &mut lexed).unwrap();
            let Decision::Generalize { forms, .. } =
                crate::query::parameters::decide(sql, &lexed.literals)
            else {
                panic!("generalized: {sql}");
            };
            ClientAutoprepare::default().build(sql.as_bytes(), &lexed, &forms)
        }
        assert!(!built("SELECT timestamp 'now'"));
        assert!(!built("SELECT * FROM t WHERE d = DATE ' Today '"));
        assert!(!built(
            "SELECT 'tomorrow 10:00'::timestamp, count(*) FROM t GROUP BY 1"
        ));
        assert!(built(
            "SELECT 'now'::timestamptz, now() - '1 day'::interval"
        ));
        assert!(built("SELECT * FROM t WHERE d = DATE '2024-01-01'"));
        assert!(reads_the_clock(b"YESTERDAY allballs"));
        assert!(!reads_the_clock(b"2024-01-01 10:00"));
    }

    #[test]
    fn positions_map_back_to_the_clients_text() {
        let sql = "SELECT 'abcdef' /* x */, nosuch";
        let (c, _) = client_for(sql);
        assert_eq!(String::from_utf8_lossy(&c.text), "SELECT $1 , nosuch");
        let gen = 13; // `nosuch` in the statement's text
        assert_eq!(c.original_position(gen), 26);
        assert_eq!(
            c.original_position(8),
            8,
            "inside $1: the literal's position"
        );
        assert_eq!(c.original_position(3), 3);
    }

    #[test]
    fn bind_errors_become_simple_query_errors() {
        let sql = "SELECT * FROM t WHERE a = 1 AND b = 'zz'";
        let (c, _) = client_for(sql);
        let mut body = Vec::new();
        for (code, value) in [
            (b'S', "ERROR"),
            (b'V', "ERROR"),
            (b'C', "22P02"),
            (b'M', "invalid input syntax for type integer: \"zz\""),
            (b'W', "unnamed portal parameter $2 = '...'"),
            (b'F', "numutils.c"),
        ] {
            body.push(code);
            body.extend_from_slice(value.as_bytes());
            body.push(0);
        }
        body.push(0);
        let mut out = BytesMut::new();
        simple_error(&mut out, &body, &c);
        let fields =
            crate::protocol::backend::ErrorFields::parse(crate::protocol::body(&out)).unwrap();
        assert_eq!(fields.code, "22P02");
        let text = String::from_utf8_lossy(crate::protocol::body(&out)).into_owned();
        assert!(text.contains("\0P37\0Fnumutils.c"), "{text:?}");
        assert!(!text.contains("portal"), "{text:?}");
        assert_eq!(portal_parameter(b"unnamed portal parameter $12"), Some(12));
        assert_eq!(portal_parameter(b"unnamed portal parameter $1x"), None);
    }
}
