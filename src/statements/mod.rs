//! Prepared statements in transaction mode.
//!
//! A client's statement names live in the client's own map (no lock), each pointing at a shared,
//! immutable [`Statement`] from the global [`Registry`], which is only touched when a Parse
//! misses the client's map. Each server connection carries a [`ServerSet`]: which statements are
//! prepared there, under pgmemo's own never-reused names (`pgmemo_s<n>`), bounded by an LRU.
//! The session's planner renames statements in Bind/Describe, injects a Parse when the server
//! lacks one, and answers Parse/Close locally when the server has nothing to do.

pub mod idle_batch;
pub mod registry;
pub mod schema;
pub mod server_set;

pub use registry::Registry;
pub use server_set::ServerSet;

use crate::protocol::{pg_name, put_cstr, write_message};
use crate::query::command;
use crate::query::shapes::{Shape, Shapes};
use bytes::{Bytes, BytesMut};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// What makes two Parse messages the same statement: their text and parameter types, within one
/// semantic context (database, server role, search_path), interned as a small number.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StatementKey {
    pub context: u32,
    /// The database's schema epoch at the Parse (see [`schema`]): after DDL the same text is
    /// a new statement.
    pub epoch: u32,
    pub query: Bytes,
    /// Parameter count and OIDs exactly as in the Parse message.
    pub param_types: Bytes,
}

impl StatementKey {
    /// How many parameter types the Parse declares (its first field).
    pub fn declared_params(&self) -> usize {
        u16::from_be_bytes([
            self.param_types.first().copied().unwrap_or(0),
            self.param_types.get(1).copied().unwrap_or(0),
        ]) as usize
    }
}

/// One statement, shared by every client and server that uses it. Immutable but for its
/// counters and generation.
#[derive(Debug)]
pub struct Statement {
    pub id: u64,
    pub key: StatementKey,
    /// The name it has on servers: `pgmemo_s<id>`.
    pub server_name: Box<str>,
    /// The same, shareable without allocating (error rewriting on the hot path).
    pub server_name_bytes: Bytes,
    /// A ready Parse message under the server name, so injecting it is one copy.
    parse_message: Bytes,
    /// Bumped when a server reports that the statement's result type changed after DDL
    /// (0A000); servers holding an older generation re-prepare it before the next use.
    generation: AtomicU32,
    /// Set once some server accepted its Parse: until then a client's Parse of it must reach a
    /// server, so that an invalid statement fails where PostgreSQL would fail it.
    validated: AtomicBool,
    /// A server refused its Parse when autoprepare tried it (see `Effect::Probe`): simple
    /// queries of its shape go to servers as they are.
    rejected: AtomicBool,
    /// Autoprepare: the parameter types a server inferred for it were checked and are ones a
    /// literal converts to as its parameter would (see `autoprepare::parameter_types_sql`).
    /// True from the start when its Parse declares every parameter's type: only a type left to
    /// the server (a string literal's, `0`) may be a domain's.
    types_checked: AtomicBool,
    /// Autoprepare: a parameter's inferred type is one a literal does not convert to as a
    /// parameter does (a domain's): [`Statement::is_rejected`] too, for this reason.
    types_refused: AtomicBool,
    /// The server's own 0A000 ("cached plan must not change result type") for this statement,
    /// replayed to clients that prepared it before the change, as PostgreSQL would answer them.
    stale_error: parking_lot::Mutex<Option<Bytes>>,
    /// What a server answered to a Describe of it (ParameterDescription, then RowDescription
    /// or NoData, whole messages) and the generation it described: replayed to clients that
    /// describe it holding no server (see `idle_batch`).
    description: parking_lot::Mutex<Option<(u32, Bytes)>>,
    /// COMMIT, ROLLBACK and the like: the statements PostgreSQL still parses and runs in an
    /// aborted transaction block.
    pub ends_transaction: bool,
    /// BEGIN or START TRANSACTION.
    pub starts_transaction: bool,
    /// `DISCARD ALL`, `DEALLOCATE ALL`, `DEALLOCATE name`, `PREPARE name`, `[EXPLAIN] EXECUTE
    /// name` or `SET search_path`: executing a portal of it changes the client's statements
    /// (and the server's) or their context, or needs a statement on the server under the
    /// client's name, see `planner::Planner::execute`.
    pub tracked: Option<command::Command>,
    /// What executing it may do to the session's state (see `session::state`).
    pub session_touch: crate::query::facts::Touch,
    /// The custom settings it may set (see `session::state::custom_settings`).
    pub custom_settings: crate::query::facts::Custom,
    /// The schema changes it may make (see [`schema`]).
    pub ddl: crate::query::facts::Ddl,
    /// Its text starts with `DROP`, `ALTER` or `CREATE` ([`crate::query::database::leads_with_ddl`]):
    /// a Parse of it may need its database to itself. Read once, for the driver's Parse of
    /// its unnamed statement again (`Session::answer_parse_in_lane`).
    pub leads_with_ddl: bool,
    /// Its text names a reserved statement name (`pgmemo_s<n>`, see
    /// [`command::hide_reserved`]): what its first such statement does instead. An `EXECUTE` or
    /// `PREPARE` of one is then also [`Statement::tracked`], so that its error is shown as
    /// PostgreSQL's about the client's name, or as pgmemo's refusal.
    pub hidden: Option<command::ReservedUse>,
    /// The text servers get: the client's, or (with [`Statement::hidden`]) the one with the
    /// reserved names hidden. A `DEALLOCATE` keeps the client's text in its Parse (its
    /// Execute is planned, see `planner::Planner::execute`), not in placeholders.
    pub server_query: Bytes,
    /// How many parameters PostgreSQL will say it has: as many types as the Parse gives, or
    /// more if the text uses a higher `$n`.
    pub param_count: usize,
    /// Client names currently bound to it.
    pub holders: AtomicUsize,
    /// Servers it is prepared on.
    pub servers: AtomicUsize,
    pub parse_hits: AtomicU64,
    pub server_prepares: AtomicU64,
    pub evictions: AtomicU64,
    /// What executing it may change and whether its result may be cached (result cache),
    /// worked out at its first use there.
    pub cache_analysis: std::sync::OnceLock<Arc<crate::query::analysis::Analysis>>,
    /// The cache hints in its comments, read at its first use there, and whether a
    /// malformed one was logged.
    pub cache_hints: std::sync::OnceLock<crate::query::hint::Hints>,
    pub hint_warned: AtomicBool,
    /// Its text without its comments, when it has some (see
    /// [`crate::query::hint::without_comments`]): the result cache's key.
    pub cache_text: Option<Box<[u8]>>,
    /// With `cache_text`: whether a server accepted a statement of that text (same context,
    /// epoch and parameter types), shared by every statement of it (see
    /// [`Statement::accepted_as_cached`]).
    pub same_text_validated: Option<Arc<AtomicBool>>,
    /// Its shape, whose figures SHOW QUERIES shows: linked at the first execution a client
    /// asks for, not per execution (see [`Statement::shape`]).
    shape: std::sync::OnceLock<Option<Arc<Shape>>>,
}

impl Statement {
    fn new(id: u64, key: StatementKey) -> Statement {
        let server_name = format!("pgmemo_s{id}").into_boxed_str();
        let text = std::str::from_utf8(&key.query).unwrap_or_default();
        let mut tracked = command::tracked_command(text);
        let hidden = command::hide_reserved(&key.query);
        let server_query = hidden
            .as_ref()
            .map_or_else(|| key.query.clone(), |h| Bytes::from(h.text.clone()));
        let hidden = hidden.and_then(|h| h.uses.into_iter().next().map(|(_, used)| used));
        let mut parsed_query = &key.query;
        // (A DEALLOCATE of a reserved name keeps its text: its Execute is planned.)
        if matches!(
            tracked,
            None | Some(command::Command::Prepare { .. } | command::Command::Execute { .. })
        ) {
            if let Some(used) = &hidden {
                // `EXECUTE` / `PREPARE` of a reserved name: hidden from servers.
                parsed_query = &server_query;
                tracked = Some(match used {
                    command::ReservedUse::Missing(name) => {
                        command::Command::Execute { name: name.clone() }
                    }
                    command::ReservedUse::Refused(name) => command::Command::Prepare {
                        name: name.clone(),
                        text: String::new(),
                    },
                });
            }
        }
        let mut msg = BytesMut::with_capacity(key.query.len() + server_name.len() + 16);
        write_message(&mut msg, crate::protocol::frontend::PARSE, |b| {
            put_cstr(b, server_name.as_bytes());
            put_cstr(b, parsed_query);
            b.extend_from_slice(&key.param_types);
        });
        let session_touch = crate::query::facts::touch(&key.query);
        let custom_settings = if session_touch.custom {
            crate::query::facts::custom_settings(&key.query, true)
        } else {
            Default::default()
        };
        let declared = key.declared_params();
        let kind = command::classify_statement(text);
        let all_typed = key
            .param_types
            .get(2..)
            .unwrap_or_default()
            .chunks_exact(4)
            .all(|oid| oid.iter().any(|&b| b != 0));
        Statement {
            id,
            ends_transaction: kind.is_transaction_exit(),
            starts_transaction: kind.is_transaction_start(),
            tracked,
            session_touch,
            custom_settings,
            ddl: crate::query::facts::ddl(&key.query),
            leads_with_ddl: crate::query::database::leads_with_ddl(&key.query),
            hidden,
            server_query,
            // A PREPARE's `$n` are its inner statement's, typed when it runs: PostgreSQL's
            // count for the PREPARE itself is what the Parse declares.
            param_count: if matches!(kind, command::Command::Prepare { .. }) {
                declared
            } else {
                declared.max(command::highest_parameter(text))
            },
            key,
            server_name_bytes: Bytes::copy_from_slice(server_name.as_bytes()),
            server_name,
            parse_message: msg.freeze(),
            generation: AtomicU32::new(0),
            validated: AtomicBool::new(false),
            rejected: AtomicBool::new(false),
            types_checked: AtomicBool::new(all_typed),
            types_refused: AtomicBool::new(false),
            stale_error: parking_lot::Mutex::new(None),
            description: parking_lot::Mutex::new(None),
            holders: AtomicUsize::new(0),
            servers: AtomicUsize::new(0),
            parse_hits: AtomicU64::new(0),
            server_prepares: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            cache_analysis: std::sync::OnceLock::new(),
            cache_hints: std::sync::OnceLock::new(),
            hint_warned: AtomicBool::new(false),
            cache_text: None,
            same_text_validated: None,
            shape: std::sync::OnceLock::new(),
        }
    }

    /// Its shape in `shapes` ([`Shapes::statement`]), looked up at the first call (None: its
    /// text is longer than the lexer reads). A client's execution of it counts there.
    #[inline]
    pub fn shape(&self, shapes: &Shapes) -> Option<&Arc<Shape>> {
        self.shape
            .get_or_init(|| shapes.statement(&self.key.query))
            .as_ref()
    }

    pub fn parse_message(&self) -> &[u8] {
        &self.parse_message
    }

    /// Appends a Close of the server-side statement.
    pub fn encode_close(&self, out: &mut BytesMut) {
        write_message(out, crate::protocol::frontend::CLOSE, |b| {
            b.extend_from_slice(b"S");
            put_cstr(b, self.server_name.as_bytes());
        });
    }

    pub fn generation(&self) -> u32 {
        self.generation.load(Ordering::Acquire)
    }

    /// Marks every server's copy as stale (after 0A000 "cached plan must not change result
    /// type"). Only bumps from the generation the caller saw, so many sessions seeing the same
    /// error bump it once.
    /// Keeps the server's 0A000 message (whole) to answer stale clients with.
    pub fn set_stale_error(&self, message: Bytes) {
        *self.stale_error.lock() = Some(message);
    }

    pub fn stale_error(&self) -> Option<Bytes> {
        self.stale_error.lock().clone()
    }

    /// Keeps a server's description of generation `generation` of the statement.
    pub fn set_description(&self, generation: u32, messages: Bytes) {
        *self.description.lock() = Some((generation, messages));
    }

    /// The description a server gave of the statement's current generation, if one did.
    pub fn description(&self) -> Option<Bytes> {
        let generation = self.generation();
        match &*self.description.lock() {
            Some((g, messages)) if *g == generation => Some(messages.clone()),
            _ => None,
        }
    }

    /// Takes the statement's lock until the result is dropped: for benches/hot_path.rs (see
    /// `Pool::hold_locks`).
    #[doc(hidden)]
    pub fn hold_lock(&self) -> impl Sized + '_ {
        self.stale_error.lock()
    }

    pub fn invalidate(&self, seen: u32) {
        let _ = self.generation.compare_exchange(
            seen,
            seen.wrapping_add(1),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    pub fn is_validated(&self) -> bool {
        self.validated.load(Ordering::Acquire)
    }

    pub fn mark_validated(&self) {
        if !self.validated.load(Ordering::Relaxed) {
            self.validated.store(true, Ordering::Release);
            if let Some(same) = &self.same_text_validated {
                same.store(true, Ordering::Release);
            }
        }
    }

    /// Whether the result cache may answer it: a server accepted it, or another statement
    /// that differs from it only in comments (a per-request trace id: PostgreSQL reads a
    /// comment as a space, so the two are the same statement to it).
    pub fn accepted_as_cached(&self) -> bool {
        self.is_validated()
            || self
                .same_text_validated
                .as_ref()
                .is_some_and(|v| v.load(Ordering::Acquire))
    }

    /// Its key with its comments dropped, when it has any.
    pub fn key_without_comments(&self) -> Option<StatementKey> {
        let text = self.cache_text.as_ref()?;
        Some(StatementKey {
            query: Bytes::copy_from_slice(text),
            ..self.key.clone()
        })
    }

    pub fn is_rejected(&self) -> bool {
        self.rejected.load(Ordering::Relaxed)
    }

    pub fn mark_rejected(&self) {
        self.rejected.store(true, Ordering::Relaxed);
    }

    /// Whether autoprepare may run it as far as its parameter types go: every one declared,
    /// or the server's inference checked ([`Effect::CheckTypes`]). One load, next to
    /// `validated`, on the autoprepared hot path.
    #[inline]
    pub fn types_checked(&self) -> bool {
        self.types_checked.load(Ordering::Acquire)
    }

    /// A server's check found its inferred parameter types fine (the row of
    /// `autoprepare::parameter_types_sql`).
    pub fn mark_types_checked(&self) {
        self.types_checked.store(true, Ordering::Release);
    }

    /// A parameter's inferred type is one a literal does not convert to as a parameter does,
    /// or the server could not say: simple queries of its shape go to servers as they are.
    pub fn refuse_types(&self) {
        self.types_refused.store(true, Ordering::Relaxed);
        self.mark_rejected();
    }

    /// Whether it was rejected for its parameter types ([`Statement::refuse_types`]).
    pub fn types_refused(&self) -> bool {
        self.types_refused.load(Ordering::Relaxed)
    }

    pub fn query_text(&self) -> String {
        String::from_utf8_lossy(&self.key.query).into_owned()
    }

    /// Parameter type OIDs.
    pub fn param_oids(&self) -> Vec<u32> {
        self.key
            .param_types
            .get(2..)
            .unwrap_or_default()
            .chunks_exact(4)
            .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

/// A client name bound by Parse ([`Effect::Bound`]).
#[derive(Debug)]
pub struct NameBound {
    pub name: Box<[u8]>,
    /// What the name was bound to before, brought back if the Parse is undone.
    pub previous: Option<Arc<Statement>>,
    pub statement: Arc<Statement>,
    /// The Parse itself went to the server.
    pub prepared_here: bool,
}

/// Bookkeeping done when a message was planned, settled when its reply (or PostgreSQL's
/// decision to discard it) arrives: kept if it ran, undone if it did not.
#[derive(Debug)]
pub enum Effect {
    /// A client name bound by Parse. Undone: the previous binding comes back (and, when the
    /// Parse itself went to the server, the server does not have the statement after all).
    /// Boxed: a Parse that binds a name is rare next to the Binds an entry is mostly made
    /// for, and unboxed it made every effect (and every reply entry) 8 bytes larger.
    Bound(Box<NameBound>),
    /// A client name dropped by Close, DEALLOCATE, or (the unnamed statement) a simple query.
    /// Undone only when PostgreSQL discarded the message: a simple query that fails has
    /// dropped the unnamed statement all the same, and the others never fail.
    Unbound {
        name: Box<[u8]>,
        statement: Arc<Statement>,
    },
    /// A Parse pgmemo injected on this server. Undone or failed: the server lacks it.
    Prepared(Arc<Statement>),
    /// The first Parse of an autoprepared statement anywhere, sent on its own (with a Sync)
    /// before the query runs as it: done, the statement is validated (once its parameter
    /// types are checked, see [`Effect::CheckTypes`]); failed, it is
    /// [`Statement::is_rejected`] and the query goes to the server as it is.
    Probe(Arc<Statement>),
    /// The query that checks the parameter types a server inferred for an autoprepared
    /// statement (`autoprepare::parameter_types_sql`), sent after its Parse. `passed`: its
    /// row came (one row when every type is fine). Done with it, the types are checked and
    /// the statement validated; done without it (a parameter of a domain type) or failed,
    /// the statement is refused ([`Statement::refuse_types`]). Discarded (the Parse failed,
    /// the server is gone): nothing is learnt.
    CheckTypes {
        statement: Arc<Statement>,
        passed: bool,
    },
    /// A Close pgmemo injected (eviction, or a stale copy). Undone: the server still has it.
    Closed {
        statement: Arc<Statement>,
        generation: u32,
    },
    /// The guard statement was injected on this server. Failed or undone: it is not there.
    Guard,
    /// A Bind or Describe of a statement: failing with 0A000 ("cached plan must not change
    /// result type") marks every server's copy stale.
    Uses {
        statement: Arc<Statement>,
        /// The client's name for it: an error of the server's that names the statement (by
        /// its server name) names it so (`Action::Rename`). None for the unnamed statement
        /// and for an autoprepared query's.
        name: ClientName,
        generation: u32,
        /// The first statement of an implicit transaction: after 0A000 its batch is sent
        /// again (see `planner::Retry`).
        retry: bool,
    },
    /// DISCARD ALL / DEALLOCATE ALL dropped every statement. Undone: restored as it was.
    Reset(Box<ResetSnapshot>),
    /// A client name dropped by the Execute of a `DEALLOCATE name`. Undone unless it ran.
    Deallocated {
        name: Box<[u8]>,
        statement: Arc<Statement>,
    },
    /// A SQL-level statement dropped by the Execute of a `DEALLOCATE name` (or by a simple
    /// query `DEALLOCATE name` pgmemo answers). Undone unless it ran. Boxed, like the other
    /// rare payloads: every reply entry holds an `Option<Effect>` and is moved through the
    /// queue per message.
    SqlDeallocated(Box<DroppedSql>),
    /// A SQL-level statement (name, text) made by the Execute of a `PREPARE name`. Undone
    /// unless it ran (PostgreSQL does not undo a PREPARE that ran when its transaction rolls
    /// back).
    SqlPrepared(Box<(String, String)>),
    /// The search_path as it was before the Execute of a `SET search_path`. Undone unless it
    /// ran.
    SearchPathSet(Box<SearchPath>),
    /// A simple query with SQL-level statement commands (PREPARE, DEALLOCATE, DISCARD ALL).
    /// Applied when the query ends, to the commands that completed (PostgreSQL runs the
    /// statements of a query in order and stops at the first error; PREPARE and DEALLOCATE
    /// are not undone by a rollback).
    Sql(Box<SqlCommands>),
    /// A SQL-level statement pgmemo prepares on a server again so that the server's
    /// SQL-level statements are the client's (at the hold, or right before a use of it).
    /// Done: the server has it; failed (its error kept, see `ServerSet::sql_error`) or
    /// discarded: it does not.
    SqlSync { name: String },
    /// A client's SQL-level statement dropped by a protocol Close. Undone if discarded.
    SqlClosed(Box<DroppedSql>),
    /// Two effects of one message, in the order they happened (a simple query drops the
    /// unnamed statement, then deallocates).
    Both(Box<(Effect, Effect)>),
}

impl Effect {
    /// Whether completing normally needs any work (most effects matter only when undone;
    /// skipping the others keeps the Bind/Execute hot path free of bookkeeping).
    #[inline(always)]
    pub fn matters_when_done(&self) -> bool {
        match self {
            Effect::Prepared(_)
            | Effect::Probe(_)
            | Effect::CheckTypes { .. }
            | Effect::Sql(_)
            | Effect::Reset(_)
            | Effect::SqlSync { .. } => true,
            Effect::Bound(bound) => bound.prepared_here,
            Effect::Both(both) => both.0.matters_when_done() || both.1.matters_when_done(),
            _ => false,
        }
    }

    /// Whether later planning reads what this changes (client names, statements on the
    /// server). A Bind's use of a statement does not count, nor the guard, nor a check of
    /// parameter types (it is never undone).
    pub fn matters_for_planning(&self) -> bool {
        !matches!(
            self,
            Effect::Uses { .. }
                | Effect::Guard
                | Effect::SqlSync { .. }
                | Effect::CheckTypes { .. }
        )
    }

    /// Whether this is undone when its own message fails (not only when PostgreSQL discards
    /// the message): a Parse sent to the server, a reset. A dropped name stays dropped (a
    /// Close or DEALLOCATE pgmemo answers itself cannot fail; a simple query that fails has
    /// dropped the unnamed statement anyway), and a Close never fails.
    pub fn undone_on_failure(&self) -> bool {
        match self {
            // SQL commands are applied only when their query ends.
            Effect::Bound(_)
            | Effect::Prepared(_)
            | Effect::Probe(_)
            | Effect::Reset(_)
            | Effect::Sql(_)
            | Effect::Deallocated { .. }
            | Effect::SqlDeallocated(_)
            | Effect::SqlPrepared(_)
            | Effect::SearchPathSet(_) => true,
            Effect::Both(both) => both.0.undone_on_failure() || both.1.undone_on_failure(),
            _ => false,
        }
    }

    /// A CommandComplete of the simple query this is the effect of: one more of its
    /// statements ran.
    pub fn command_completed(&mut self) {
        match self {
            Effect::Sql(sql) => sql.completed += 1,
            Effect::Reset(snapshot) => snapshot.completed += 1,
            Effect::Both(both) => {
                both.0.command_completed();
                both.1.command_completed();
            }
            _ => {}
        }
    }

    /// `a` then `b`, either of which may be absent.
    pub fn combine(a: Option<Effect>, b: Option<Effect>) -> Option<Effect> {
        match (a, b) {
            (Some(a), Some(b)) => Some(Effect::Both(Box::new((a, b)))),
            (a, b) => a.or(b),
        }
    }
}

/// A value no search_path has: what a client's search_path is when pgmemo cannot tell (a
/// ROLLBACK TO SAVEPOINT after a SET). Each is its own, so statements parsed under it are
/// shared with no one. (A SET that pgmemo cannot read is keyed by its text, `\0` first.)
fn unknown_search_path() -> Box<str> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("\0unknown{}", NEXT.fetch_add(1, Ordering::Relaxed)).into_boxed_str()
}

/// Whether a search_path value is one of [`unknown_search_path`]'s.
pub fn is_unknown_search_path(path: &str) -> bool {
    path.starts_with('\0')
}

/// A client's search_path as far as statement keys go: statements are shared only between
/// clients for whom the same text means the same thing. `SET [SESSION | LOCAL] search_path` and
/// `RESET search_path` change it when they run; a change lasts until the transaction ends, and
/// a session-level one stays if the transaction commits. Values are setting strings as
/// PostgreSQL shows them, `""` for the server's default.
#[derive(Debug, Clone, Default)]
pub struct SearchPath {
    /// The session-level value, once a committed SET changed the startup packet's.
    session: Option<Box<str>>,
    /// The value in effect in the open transaction, when a SET in it changed it.
    current: Option<Box<str>>,
    /// A session-level SET of the open transaction: the session value if it commits.
    pending: Option<Box<str>>,
    /// An error since the open transaction's first change.
    failed: bool,
    /// A ROLLBACK since then (the transaction's, or one to a savepoint).
    rolled_back: bool,
    /// A session value that committed, for the session to carry to other servers.
    carry: Option<Box<str>>,
    /// The client's search_path setting before the first carry (`""`: none), to go back to.
    startup: Option<Box<str>>,
    /// The carried value is the client's only: the server has its default (DISCARD ALL).
    pub carry_to_client_only: bool,
    /// [`ClientStatements::context`] must be worked out again.
    dirty: bool,
}

/// SQL-level prepared statements (`PREPARE name AS ...`): name → the PREPARE statement. The
/// map is boxed when the first is made: few clients use them, and each client holds one.
// The box is the point (a pointer, not a map's 48 bytes, in every client that has none).
#[allow(clippy::box_collection)]
#[derive(Debug, Clone, Default)]
pub struct SqlStatements(Option<Box<HashMap<String, String>>>);

impl SqlStatements {
    pub fn insert(&mut self, name: String, text: String) {
        self.0
            .get_or_insert_with(Default::default)
            .insert(name, text);
    }

    pub fn remove(&mut self, name: &str) -> Option<String> {
        self.0.as_mut()?.remove(name)
    }

    pub fn get(&self, name: &str) -> Option<&String> {
        self.0.as_ref()?.get(name)
    }

    pub fn contains_key(&self, name: &str) -> bool {
        self.0.as_ref().is_some_and(|m| m.contains_key(name))
    }

    pub fn is_empty(&self) -> bool {
        self.0.as_ref().is_none_or(|m| m.is_empty())
    }

    pub fn clear(&mut self) {
        self.0 = None;
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &String)> {
        self.0.iter().flat_map(|m| m.iter())
    }
}

/// A client's [`SearchPath`], boxed once the client first changes it: most clients never
/// do, and an idle client should cost as little memory as possible.
#[derive(Debug, Clone, Default)]
pub struct SearchPathSlot(Option<Box<SearchPath>>);

/// What a client that never changed its search_path has.
static UNCHANGED_SEARCH_PATH: SearchPath = SearchPath {
    session: None,
    current: None,
    pending: None,
    failed: false,
    rolled_back: false,
    carry: None,
    startup: None,
    carry_to_client_only: false,
    dirty: false,
};

impl SearchPathSlot {
    /// [`SearchPath::is_open`], asked for every message: without the unchanged value's
    /// fallback (most clients never change their search_path).
    #[inline]
    pub fn is_open(&self) -> bool {
        self.0.as_deref().is_some_and(SearchPath::is_open)
    }

    /// [`SearchPath::has_carry`], asked for every server message: as [`Self::is_open`].
    #[inline]
    pub fn has_carry(&self) -> bool {
        self.0.as_deref().is_some_and(SearchPath::has_carry)
    }
}

impl std::ops::Deref for SearchPathSlot {
    type Target = SearchPath;
    #[inline]
    fn deref(&self) -> &SearchPath {
        self.0.as_deref().unwrap_or(&UNCHANGED_SEARCH_PATH)
    }
}

impl std::ops::DerefMut for SearchPathSlot {
    fn deref_mut(&mut self) -> &mut SearchPath {
        self.0.get_or_insert_with(Default::default)
    }
}

impl SearchPath {
    /// The client's search_path setting before its first committed SET (see
    /// [`SearchPath::remember_startup`]).
    pub fn startup(&self) -> Option<&str> {
        self.startup.as_deref()
    }

    /// The value in effect, or None for the startup packet's.
    pub fn effective(&self) -> Option<&str> {
        self.current.as_deref().or(self.session.as_deref())
    }

    /// A change in the open transaction that has not ended yet.
    #[inline]
    pub fn is_open(&self) -> bool {
        self.current.is_some()
    }

    /// A SET (`local`: SET LOCAL) to `value` (None: unreadable) ran.
    pub fn set(&mut self, value: Option<&str>, local: bool) {
        if !self.is_open() {
            self.failed = false;
            self.rolled_back = false;
        }
        let value: Box<str> = value.map_or_else(unknown_search_path, Into::into);
        if !local {
            self.pending = Some(value.clone());
        }
        self.current = Some(value);
        self.dirty = true;
    }

    /// The transaction that the changes belong to ended: a session-level value stays if it
    /// committed.
    pub fn end(&mut self, committed: bool) {
        if let (Some(value), true) = (self.pending.take(), committed) {
            self.carry = Some(value.clone());
            self.session = Some(value);
        }
        self.current = None;
        self.failed = false;
        self.rolled_back = false;
        self.dirty = true;
    }

    /// A message from the server while a change is open: the transaction's end (ReadyForQuery
    /// `I`), committed unless an error or a ROLLBACK came since the change.
    pub fn observe(&mut self, tag: u8, body: &[u8], status: u8) {
        use crate::protocol::backend as be;
        match tag {
            be::ERROR_RESPONSE => self.failed = true,
            be::COMMAND_COMPLETE if body.starts_with(b"ROLLBACK") => self.rolled_back = true,
            be::READY_FOR_QUERY if status == b'I' => self.end(!self.failed && !self.rolled_back),
            be::READY_FOR_QUERY if self.rolled_back && status == b'T' => {
                // ROLLBACK TO SAVEPOINT: the changes since it are undone, which pgmemo does
                // not follow.
                self.rolled_back = false;
                self.current = Some(unknown_search_path());
                if self.pending.is_some() {
                    self.pending = self.current.clone();
                }
                self.dirty = true;
            }
            _ => {}
        }
    }

    /// DISCARD ALL ran: back to the startup packet's search_path (PostgreSQL's RESET ALL).
    pub fn discarded(&mut self) {
        let startup = self.startup.clone();
        *self = SearchPath {
            carry: startup.clone(),
            carry_to_client_only: true,
            startup,
            dirty: true,
            ..SearchPath::default()
        };
    }

    /// The client's setting as it was before the first carry.
    pub fn remember_startup(&mut self, setting: Option<&str>) {
        if self.startup.is_none() {
            self.startup = Some(setting.unwrap_or_default().into());
        }
    }

    /// Whether a committed session value waits to be carried (see [`SearchPath::take_carry`]).
    #[inline]
    pub fn has_carry(&self) -> bool {
        self.carry.is_some()
    }

    /// The session value that committed since the last call, to carry to other servers.
    #[inline]
    pub fn take_carry(&mut self) -> Option<Box<str>> {
        self.carry.take()
    }

    /// Undoes changes made since `before` was taken (their message did not run).
    pub fn restore(&mut self, before: SearchPath) {
        *self = SearchPath {
            dirty: true,
            carry: self.carry.take(),
            startup: self.startup.take(),
            ..before
        };
    }
}

/// A client's SQL-level statement that a message drops (`DEALLOCATE`, a protocol Close): what
/// comes back if the message does not run.
#[derive(Debug)]
pub struct DroppedSql {
    pub name: String,
    /// Its PREPARE statement.
    pub text: String,
    /// The server had it (its PREPARE had not failed there, see `ServerSet::sql_error`): it
    /// has it again.
    pub here: bool,
}

/// The statements of a simple query, as far as SQL-level statements go, and how many of them
/// have completed.
#[derive(Debug)]
pub struct SqlCommands {
    pub commands: Vec<command::Command>,
    pub completed: usize,
}

/// What a DISCARD ALL / DEALLOCATE ALL took away, to restore if it did not run.
#[derive(Debug)]
pub struct ResetSnapshot {
    pub names: HashMap<Bytes, Arc<Statement>>,
    pub prepared: Vec<(Arc<Statement>, u32)>,
    /// Whether the server had the guard statement.
    pub guard: bool,
    /// It was DISCARD ALL, which also resets the server's settings.
    pub discard_all: bool,
    /// Among the query's statements, the place of the first that may reset (a `DEALLOCATE
    /// ALL`, or the sole `DISCARD ALL`), if any may: PostgreSQL refuses `DISCARD ALL` in the
    /// implicit block of a multi-statement query. A sole command that failed did not run; in
    /// a multi-statement query it may have run before the failure (see
    /// [`ResetSnapshot::ran`]).
    pub at: Option<usize>,
    /// The query's statements that completed (CommandComplete) before it failed.
    pub completed: usize,
    /// The client's and the server's SQL-level statements, when the reset took them too (an
    /// extended-protocol Execute; a simple query settles those when it ends, see
    /// [`Effect::Sql`]).
    pub sql: Option<Box<SqlSnapshot>>,
}

impl ResetSnapshot {
    /// Whether the reset ran, in a query that failed: not when no statement that may reset
    /// completed; so when more statements completed than came before it. None: unknown (a
    /// comment alone between semicolons is no statement to PostgreSQL, so its place among
    /// them may be lower).
    pub fn ran(&self) -> Option<bool> {
        match self.at {
            None => Some(false),
            Some(_) if self.completed == 0 => Some(false),
            Some(at) if self.completed > at => Some(true),
            Some(_) => None,
        }
    }
}

/// The SQL-level statements of a client and of its server (name → PREPARE statement).
#[derive(Debug)]
pub struct SqlSnapshot {
    pub client: SqlStatements,
    pub server: SqlStatements,
}

/// The guard: a statement pgmemo keeps prepared on a server connection once a transaction
/// block may open there, so that in an aborted block a Bind or Describe of a statement the
/// server lacks can still get PostgreSQL's own 25P02 from Bind or Describe (a Parse injected
/// there would fail in Parse, with other error fields). It counts toward
/// `max_prepared_statements` but is never evicted, and is not prepared when the limit is 1.
/// Its id, 0, is one the statement counter never hands out, and its name matches the
/// `pgmemo_s<n>` pattern that session-mode resets keep.
pub const GUARD_NAME: &[u8] = b"pgmemo_s0";
/// The guard's text: no parameters, and a result, so that Describe in an aborted block
/// refuses it as it refuses any statement that returns rows. A utility statement: its Parse
/// takes no snapshot, so that preparing it first thing in a block (one a `COMMIT AND CHAIN`
/// opened, say) leaves the block's `SET TRANSACTION ISOLATION LEVEL` possible, as it is on
/// PostgreSQL.
pub const GUARD_QUERY: &[u8] = b"SHOW server_version";

/// A portal bound from a tracked statement: its name and the statement.
type TrackedPortal = (Bytes, Arc<Statement>);

/// A client's statement name as a reply entry carries it (`Effect::Uses`), for an error that
/// names the statement: None for the unnamed statement, else shared with the client's map
/// (made once per Parse of a name, not per Bind). 16 bytes, where a `Bytes` takes 32: every
/// reply entry holds room for it.
pub type ClientName = Option<Arc<[u8]>>;

/// One client's statement names (`""` included): the session-local first tier of Parse, and
/// the only map Bind/Describe/Close look at. No lock: only its session touches it. Names are
/// kept as PostgreSQL keeps them ([`pg_name`]).
#[derive(Debug, Default)]
pub struct ClientStatements {
    /// Name → statement, with the statement's generation when the client bound the name: a
    /// client that prepared before a DDL change of the result type keeps getting PostgreSQL's
    /// 0A000 until it prepares again (it may have cached the old row description).
    /// Looked up by every Parse/Bind/Describe: foldhash (randomly seeded per process), not
    /// SipHash, whose cost showed in per-transaction profiles.
    /// The name's [`ClientName`] rides along, for the reply entries of its Binds.
    /// The unnamed statement is not here but in `unnamed`.
    names: HashMap<Bytes, (Arc<Statement>, u32, ClientName), foldhash::fast::RandomState>,
    /// The unnamed statement's binding and the planner's last Parse of it (boxed, made at
    /// the first of either: every session holds the field, see `session::tests::footprint`).
    unnamed: Option<Box<Unnamed>>,
    /// The client's SQL-level statements (`PREPARE name AS ...`): name → the PREPARE
    /// statement, to prepare them again on whichever server the client's next transaction
    /// runs. PostgreSQL keeps them in the same namespace as the protocol's: a name is in one
    /// map or the other, never both.
    pub sql: SqlStatements,
    /// The registry context (database, role, search_path) of this client's next Parse: the
    /// startup packet's search_path or, after a SET of it, the one in effect (see
    /// [`ClientStatements::refresh_context`]).
    pub context: u32,
    /// The context of the startup packet's search_path.
    startup_context: u32,
    /// The search_path in effect, as far as it differs from the startup packet's.
    pub search_path: SearchPathSlot,
    /// The schema changes the client's Parses follow.
    pub schema: schema::SchemaWatch,
    /// Query bytes held by named statements, for the per-client limit.
    bytes: usize,
    /// Portals bound from statements whose execution changes the statements
    /// ([`Statement::tracked`]): portal name → statement. Usually empty, so that Bind and
    /// Execute pay one check (boxed: every client holds the field, few ever use it).
    #[allow(clippy::box_collection)] // 8 bytes in every client, where a Vec takes 24
    portals: Option<Box<Vec<TrackedPortal>>>,
}

/// The unnamed statement, kept apart from the other names.
#[derive(Debug, Default)]
struct Unnamed {
    /// Its binding, as `names` keeps the others': most drivers parse and bind it for every
    /// statement they run, and a lookup of `""` in the map (hashed, probed) cost ~85
    /// instructions, two or three of them a `pgbench -S -M extended` transaction.
    bound: Option<(Arc<Statement>, u32)>,
    /// The planner's last Parse of it, for [`ClientStatements::unnamed_parse_again`].
    last_parse: Option<LastParse>,
}

/// A Parse of the unnamed statement: its body (name, query and parameter types) and the
/// statement it meant (weak: it holds the statement in nobody's name, see
/// [`Registry::purge`]; and while it lives, no other statement has its address).
#[derive(Debug)]
struct LastParse {
    body: Vec<u8>,
    statement: std::sync::Weak<Statement>,
}

impl ClientStatements {
    pub fn new(context: u32, schema: schema::SchemaWatch) -> Self {
        ClientStatements {
            names: HashMap::default(),
            unnamed: None,
            sql: SqlStatements::default(),
            context,
            startup_context: context,
            search_path: SearchPathSlot::default(),
            schema,
            bytes: 0,
            portals: None,
        }
    }

    /// The statement a Parse of the unnamed statement (`body`: the message's, from its name
    /// on) means when it is the client's last one again and the unnamed statement is still
    /// bound to what that one meant, in the same context and schema epoch: what
    /// [`ClientStatements::statement_for_parse`] answers then, without reading the message
    /// (a driver parses its unnamed statement before every execution: the message read and
    /// its key compared cost ~300 instructions of a `pgbench -S -M extended` transaction).
    /// None: ask `statement_for_parse`.
    #[inline]
    pub fn unnamed_parse_again(
        &mut self,
        body: &[u8],
        registry: &Registry,
    ) -> Option<Arc<Statement>> {
        let last = self.unnamed.as_deref()?.last_parse.as_ref()?;
        // (Only a Parse of the unnamed statement is kept: an equal body is one.)
        if last.body != body {
            return None;
        }
        let meant = last.statement.as_ptr();
        self.refresh_context(registry);
        let bound = self.get(b"")?;
        (std::ptr::eq(Arc::as_ptr(bound), meant)
            && bound.key.context == self.context
            && bound.key.epoch == self.schema.epoch())
        .then(|| bound.clone())
    }

    /// The client now reads literals under other settings (`literals`, see
    /// [`registry::literal_settings`]): its next Parses are in the context of those.
    pub fn literals_changed(&mut self, registry: &Registry, literals: String) {
        self.startup_context = registry.literal_context(self.startup_context, literals);
        self.search_path.dirty = true;
    }

    /// Makes [`ClientStatements::context`] follow the search_path in effect and whether the
    /// client may hold temporary objects (cheap when neither has changed).
    #[inline]
    pub fn refresh_context(&mut self, registry: &Registry) {
        if self.search_path.dirty || self.schema.context_dirty {
            self.search_path.dirty = false;
            self.schema.context_dirty = false;
            self.context = if self.schema.is_private() {
                // Its own temporary objects may hide others': shared with nobody.
                registry.private_context()
            } else {
                match self.search_path.effective() {
                    None => self.startup_context,
                    Some(path) => registry.derived_context(self.startup_context, path),
                }
            };
        }
    }

    /// Whether some portal is bound from a tracked statement.
    #[inline]
    pub fn has_tracked_portals(&self) -> bool {
        self.portals.as_ref().is_some_and(|p| !p.is_empty())
    }

    /// The tracked statement `portal` was bound from, if any.
    pub fn tracked_portal(&self, portal: &[u8]) -> Option<&Arc<Statement>> {
        self.portals
            .as_ref()?
            .iter()
            .find(|(p, _)| p.as_ref() == portal)
            .map(|(_, s)| s)
    }

    /// `portal` is bound again (or closed): forgets what it was bound from.
    pub fn forget_portal(&mut self, portal: &[u8]) {
        if let Some(portals) = self.portals.as_mut() {
            portals.retain(|(p, _)| p.as_ref() != portal);
        }
    }

    /// `portal` is bound from the tracked `statement`. Portals end with their transaction,
    /// which pgmemo does not watch here: a forgotten one costs nothing but a Vec entry (its
    /// Execute fails on the server), and only the latest few are kept.
    pub fn bind_tracked_portal(&mut self, portal: &[u8], statement: Arc<Statement>) {
        const KEPT: usize = 16;
        self.forget_portal(portal);
        let portals = self.portals.get_or_insert_with(Default::default);
        if portals.len() >= KEPT {
            portals.remove(0);
        }
        portals.push((Bytes::copy_from_slice(portal), statement));
    }

    /// Whether `name` is one of the client's SQL-level statements.
    pub fn is_sql(&self, name: &[u8]) -> bool {
        !self.sql.is_empty()
            && std::str::from_utf8(pg_name(name)).is_ok_and(|n| self.sql.contains_key(n))
    }

    /// The binding of `name` (as PostgreSQL reads it): the statement, the generation it
    /// had when bound, and the client's name as entries carry it.
    #[inline]
    fn binding(&self, name: &[u8]) -> Option<(&Arc<Statement>, u32, &ClientName)> {
        static UNNAMED: ClientName = None;
        if name.is_empty() {
            let (s, g) = self.unnamed.as_deref()?.bound.as_ref()?;
            return Some((s, *g, &UNNAMED));
        }
        self.names.get(pg_name(name)).map(|(s, g, n)| (s, *g, n))
    }

    /// Every binding: name, statement, the generation it had when bound.
    fn bindings(&self) -> impl Iterator<Item = (&Bytes, &Arc<Statement>, u32)> {
        static UNNAMED: Bytes = Bytes::new();
        let unnamed = self.unnamed.iter().flat_map(|u| &u.bound);
        let unnamed = unnamed.map(|(s, g)| (&UNNAMED, s, *g));
        unnamed.chain(self.names.iter().map(|(n, (s, g, _))| (n, s, *g)))
    }

    #[inline]
    pub fn get(&self, name: &[u8]) -> Option<&Arc<Statement>> {
        self.binding(name).map(|(s, ..)| s)
    }

    /// The binding, with the client's name as entries carry it (a cheap clone, for error
    /// messages), and whether it is stale (see [`ClientStatements::is_stale`]): one lookup
    /// for a Bind's two questions.
    #[inline]
    pub fn get_named(&self, name: &[u8]) -> Option<(&ClientName, &Arc<Statement>, bool)> {
        self.binding(name)
            .map(|(s, generation, n)| (n, s, generation != s.generation()))
    }

    /// Whether the client bound `name` before its statement's result type changed (DDL).
    #[inline]
    pub fn is_stale(&self, name: &[u8]) -> bool {
        self.binding(name)
            .is_some_and(|(s, generation, _)| generation != s.generation())
    }

    /// The client now knows `statement`'s current shape (it was re-described for it).
    pub fn refresh(&mut self, statement: &Arc<Statement>) {
        let unnamed = self.unnamed.iter_mut().flat_map(|u| &mut u.bound);
        let unnamed = unnamed.map(|(s, g)| (&*s, g));
        let named = self.names.values_mut().map(|(s, g, _)| (&*s, g));
        for (s, generation) in unnamed.chain(named) {
            if Arc::ptr_eq(s, statement) {
                *generation = s.generation();
            }
        }
    }

    pub fn len(&self) -> usize {
        self.names.len() + usize::from(self.unnamed_bound())
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty() && !self.unnamed_bound()
    }

    /// Whether the unnamed statement is bound.
    fn unnamed_bound(&self) -> bool {
        self.unnamed.as_ref().is_some_and(|u| u.bound.is_some())
    }

    /// Unbinds the unnamed statement; returns what it was bound to.
    fn take_unnamed(&mut self) -> Option<Arc<Statement>> {
        let (s, _) = self.unnamed.as_deref_mut()?.bound.take()?;
        Some(s)
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The registry statement a Parse of the unnamed statement or of a new name means, in the
    /// client's context as of now: the unnamed statement already bound, if it is the same
    /// text, types and context (a driver re-parsing it every time); else the registry's.
    pub fn statement_for_parse(
        &mut self,
        registry: &Registry,
        p: &crate::protocol::frontend::Parse<'_>,
    ) -> Arc<Statement> {
        self.refresh_context(registry);
        let epoch = self.schema.epoch();
        match self.get(p.name) {
            Some(s)
                if s.key.query == p.query
                    && s.key.param_types == p.param_types
                    && s.key.context == self.context
                    && s.key.epoch == epoch =>
            {
                s.clone()
            }
            _ => {
                let key = StatementKey {
                    context: self.context,
                    epoch,
                    query: Bytes::copy_from_slice(p.query),
                    param_types: Bytes::copy_from_slice(p.param_types),
                };
                registry.get_or_insert(key).0
            }
        }
    }

    /// Keeps the planner's last Parse of the unnamed statement (`body`: the message's, from
    /// its name on) and the statement it meant, for
    /// [`ClientStatements::unnamed_parse_again`].
    pub fn remember_unnamed_parse(&mut self, body: &[u8], statement: &Arc<Statement>) {
        let unnamed = self.unnamed.get_or_insert_with(Default::default);
        let last = unnamed.last_parse.get_or_insert_with(|| LastParse {
            body: Vec::new(),
            statement: Arc::downgrade(statement),
        });
        last.body.clear();
        last.body.extend_from_slice(body);
        last.statement = Arc::downgrade(statement);
    }

    /// Binds `name` (or, with None, removes it); returns the previous binding.
    pub fn set(
        &mut self,
        name: &[u8],
        statement: Option<Arc<Statement>>,
    ) -> Option<Arc<Statement>> {
        let name = pg_name(name);
        let previous = match statement {
            Some(s) => {
                s.holders.fetch_add(1, Ordering::Relaxed);
                self.bytes += s.key.query.len();
                let generation = s.generation();
                if name.is_empty() {
                    let unnamed = self.unnamed.get_or_insert_with(Default::default);
                    unnamed.bound.replace((s, generation)).map(|(p, _)| p)
                } else {
                    let client_name = Some(Arc::from(name));
                    self.names
                        .insert(Bytes::copy_from_slice(name), (s, generation, client_name))
                        .map(|(p, ..)| p)
                }
            }
            // Every simple query unbinds the unnamed statement.
            None if name.is_empty() => self.take_unnamed(),
            None if self.names.is_empty() => None,
            None => self.names.remove(name).map(|(p, ..)| p),
        };
        if let Some(p) = &previous {
            self.forget(p);
        }
        previous
    }

    /// Whether `name` is bound to `statement` as it is now (its generation).
    pub fn is_bound_to(&self, name: &[u8], statement: &Arc<Statement>) -> bool {
        self.binding(name).is_some_and(|(bound, generation, _)| {
            Arc::ptr_eq(bound, statement) && generation == statement.generation()
        })
    }

    fn forget(&mut self, s: &Statement) {
        self.bytes -= s.key.query.len();
        s.holders.fetch_sub(1, Ordering::Relaxed);
    }

    /// The context the client's next Parse gets (what [`ClientStatements::refresh_context`]
    /// would make it), without changing anything.
    fn context_now(&self, registry: &Registry) -> u32 {
        if !self.search_path.dirty && !self.schema.context_dirty {
            self.context
        } else if self.schema.is_private() {
            registry.private_context()
        } else {
            match self.search_path.effective() {
                None => self.startup_context,
                Some(path) => registry.derived_context(self.startup_context, path),
            }
        }
    }

    /// Whether another process can rebuild these statements from their names and texts
    /// (an online restart, see `session::handover`): every one was prepared in the context
    /// the client is in now and is not stale, no search_path change is open, and no portal
    /// of a tracked statement is bound.
    pub fn can_be_carried(&self, registry: &Registry) -> bool {
        let context = self.context_now(registry);
        !self.search_path.is_open()
            && !self.has_tracked_portals()
            && !self.schema.is_private()
            && self
                .bindings()
                .all(|(_, s, generation)| s.key.context == context && generation == s.generation())
    }

    /// The client's names and their statements (see [`ClientStatements::can_be_carried`]).
    pub fn carried_names(&self) -> impl Iterator<Item = (&Bytes, &Arc<Statement>)> {
        self.bindings().map(|(n, s, _)| (n, s))
    }

    /// Rebuilds the statements another process carried over (see
    /// [`ClientStatements::can_be_carried`]): the client's search_path as it SET it (and the
    /// one it had before), its SQL-level statements, and each name's Parse as the client sent
    /// it, bound without a word to the client or a server (the server gets it at first use).
    pub fn restore_carried(
        &mut self,
        registry: &Registry,
        search_path: Option<&str>,
        search_path_startup: Option<&str>,
        sql: Vec<(String, String)>,
        named: impl Iterator<Item = (Bytes, Bytes, Bytes)>,
    ) {
        if search_path.is_some() || search_path_startup.is_some() {
            let slot = &mut *self.search_path;
            slot.session = search_path.map(Into::into);
            slot.startup = search_path_startup.map(Into::into);
            slot.dirty = true;
        }
        for (name, text) in sql {
            self.sql.insert(name, text);
        }
        self.refresh_context(registry);
        let epoch = self.schema.epoch();
        for (name, query, param_types) in named {
            let key = StatementKey {
                context: self.context,
                epoch,
                query,
                param_types,
            };
            let statement = registry.get_or_insert(key).0;
            self.set(&name, Some(statement));
        }
    }

    /// Drops every name (DISCARD ALL, DEALLOCATE ALL), returning them for a possible undo.
    pub fn take_all(&mut self) -> HashMap<Bytes, Arc<Statement>> {
        let names = std::mem::take(&mut self.names);
        let unnamed = self.take_unnamed().map(|s| (Bytes::new(), s));
        self.bytes = 0;
        unnamed
            .into_iter()
            .chain(names.into_iter().map(|(name, (s, ..))| (name, s)))
            .map(|(name, s)| {
                s.holders.fetch_sub(1, Ordering::Relaxed);
                (name, s)
            })
            .collect()
    }

    /// Drops every named statement (DISCARD ALL, DEALLOCATE ALL executed through the extended
    /// protocol, which leave the unnamed statement alone); returns every name, the unnamed one
    /// included, for a possible undo.
    pub fn take_named(&mut self) -> HashMap<Bytes, Arc<Statement>> {
        let names = self.take_all();
        if let Some(unnamed) = names.get(&b""[..]) {
            self.set(b"", Some(unnamed.clone()));
        }
        names
    }

    /// Puts back what [`ClientStatements::take_all`] took, replacing what is there now.
    pub fn restore_all(&mut self, names: HashMap<Bytes, Arc<Statement>>) {
        self.take_all();
        for (name, s) in names {
            self.set(&name, Some(s));
        }
    }
}

impl Drop for ClientStatements {
    fn drop(&mut self) {
        self.take_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A registry with two statements, `SELECT 1` and `SELECT 22`, in context 1.
    fn two_statements() -> (Registry, Arc<Statement>, Arc<Statement>) {
        let r = Registry::new();
        let key = |q: &'static str| StatementKey {
            context: 1,
            epoch: 0,
            query: Bytes::from_static(q.as_bytes()),
            param_types: Bytes::from_static(&[0, 0]),
        };
        let (a, _) = r.get_or_insert(key("SELECT 1"));
        let (b, _) = r.get_or_insert(key("SELECT 22"));
        (r, a, b)
    }

    #[test]
    fn client_names_count_holders_and_bytes() {
        let (_registry, a, b) = two_statements();
        let mut c = ClientStatements::new(1, Default::default());
        assert!(c.set(b"x", Some(a.clone())).is_none());
        assert_eq!(c.set(b"x", Some(b.clone())).unwrap().id, a.id);
        assert_eq!(a.holders.load(Ordering::Relaxed), 0);
        assert_eq!(b.holders.load(Ordering::Relaxed), 1);
        assert_eq!(c.bytes(), 9);
        let saved = c.take_all();
        assert_eq!((c.len(), c.bytes()), (0, 0));
        c.restore_all(saved);
        assert_eq!(c.get(b"x").unwrap().id, b.id);
        drop(c);
        assert_eq!(b.holders.load(Ordering::Relaxed), 0);
    }

    /// The unnamed statement, kept apart from the named ones, is a name like the others:
    /// counted, carried, taken and put back with them, left by `take_named`, stale after a
    /// change of its result type.
    #[test]
    fn the_unnamed_statement_is_a_name_like_the_others() {
        let (r, a, b) = two_statements();
        let mut c = ClientStatements::new(1, Default::default());
        assert!(c.is_empty() && c.get(b"").is_none());
        assert!(c.set(b"", Some(a.clone())).is_none());
        assert!(!c.is_empty());
        c.set(b"n", Some(b.clone()));
        assert_eq!((c.len(), c.bytes()), (2, 17));
        assert_eq!(a.holders.load(Ordering::Relaxed), 1);
        let (name, s, stale) = c.get_named(b"").unwrap();
        assert!(name.is_none() && Arc::ptr_eq(s, &a) && !stale);
        assert_eq!(c.get_named(b"n").unwrap().0.as_deref(), Some(&b"n"[..]));
        assert!(c.is_bound_to(b"", &a) && !c.is_bound_to(b"", &b));
        let mut carried: Vec<_> = c.carried_names().map(|(n, s)| (n.clone(), s.id)).collect();
        carried.sort();
        assert_eq!(
            carried,
            [(Bytes::new(), a.id), (Bytes::from_static(b"n"), b.id)]
        );
        assert!(c.can_be_carried(&r));
        a.invalidate(a.generation());
        assert!(c.is_stale(b"") && c.get_named(b"").unwrap().2 && !c.can_be_carried(&r));
        c.refresh(&a);
        assert!(!c.is_stale(b"") && c.can_be_carried(&r));
        let all = c.take_named();
        assert_eq!(all.len(), 2);
        assert_eq!((c.len(), c.bytes()), (1, 8), "the unnamed statement stays");
        assert_eq!(b.holders.load(Ordering::Relaxed), 0);
        c.restore_all(all);
        assert_eq!(c.len(), 2);
        assert_eq!(c.set(b"", None).unwrap().id, a.id);
        assert_eq!((c.len(), c.bytes()), (1, 9));
        assert_eq!(a.holders.load(Ordering::Relaxed), 0);
        drop(c);
        assert_eq!(b.holders.load(Ordering::Relaxed), 0);
    }

    /// A Parse of the unnamed statement sent again means the statement it meant only while
    /// the unnamed statement is still bound to it, in the same context.
    #[test]
    fn an_unnamed_parse_again_means_the_statement_still_bound() {
        use crate::protocol::frontend::Parse;
        let r = Registry::new();
        let mut c = ClientStatements::new(1, Default::default());
        let body = |name: &str, q: &str| [name.as_bytes(), b"\0", q.as_bytes(), b"\0\0\0"].concat();
        let one = body("", "SELECT 1");
        assert!(
            c.unnamed_parse_again(&one, &r).is_none(),
            "nothing parsed yet"
        );
        let s = c.statement_for_parse(&r, &Parse::parse(&one).unwrap());
        c.remember_unnamed_parse(&one, &s);
        assert!(c.unnamed_parse_again(&one, &r).is_none(), "not bound yet");
        c.set(b"", Some(s.clone()));
        let again = c
            .unnamed_parse_again(&one, &r)
            .expect("bound to what it meant");
        assert!(Arc::ptr_eq(&again, &s));
        assert!(c.unnamed_parse_again(&body("", "SELECT 2"), &r).is_none());
        assert!(c.unnamed_parse_again(&body("n", "SELECT 1"), &r).is_none());
        // Bound to another statement (a Parse undone), then to none (a simple query).
        let two = body("", "SELECT 2");
        let other = c.statement_for_parse(&r, &Parse::parse(&two).unwrap());
        c.remember_unnamed_parse(&two, &other);
        c.set(b"", Some(s.clone()));
        assert!(
            c.unnamed_parse_again(&two, &r).is_none(),
            "{other:?} is not bound"
        );
        assert!(
            c.unnamed_parse_again(&one, &r).is_none(),
            "the last Parse was another"
        );
        c.set(b"", Some(other.clone()));
        assert!(c.unnamed_parse_again(&two, &r).is_some());
        c.context = 2; // another search_path since
        assert!(c.unnamed_parse_again(&two, &r).is_none());
        c.context = 1;
        c.set(b"", None);
        assert!(c.unnamed_parse_again(&two, &r).is_none());
    }

    #[test]
    fn parse_message_carries_the_server_name() {
        let key = StatementKey {
            context: 1,
            epoch: 0,
            query: Bytes::from_static(b"SELECT $1"),
            param_types: Bytes::from_static(&[0, 1, 0, 0, 0, 23]),
        };
        let s = Statement::new(7, key);
        assert_eq!(&*s.server_name, "pgmemo_s7");
        let p = crate::protocol::frontend::Parse::parse(crate::protocol::body(s.parse_message()))
            .unwrap();
        assert_eq!(p.name, b"pgmemo_s7");
        assert_eq!(p.query, b"SELECT $1");
        assert_eq!(s.param_oids(), vec![23]);
        let g = s.generation();
        s.invalidate(g);
        s.invalidate(g);
        assert_eq!(s.generation(), g + 1, "one bump per observed generation");
    }
}
