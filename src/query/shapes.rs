//! The shapes of the simple queries every session sends, in one table shared by all of them.
//!
//! A shape is a query's text with its literals as `$n` (the lexer's reading, see
//! [`super::lexer`]) and its literals' kinds. What pgmemo derives from a shape is derived once,
//! kept in its entry and shared by every feature that reads queries: the words the session
//! looks for in its text ([`Shape::words`]), and, from one parse by PostgreSQL's own parser,
//! both what it reads and writes (the result cache's [`Analysis`]) and which of its literals
//! may become parameters (autoprepare's [`Decision`]). Autoprepare's counters of the shape
//! live in the entry too.
//!
//! A text the lexer refuses is its own shape, keyed by its raw text ([`Shapes::raw`]): the
//! result cache still analyzes it; autoprepare never runs it.
//!
//! A prepared statement of the extended protocol has a shape of its own ([`Shapes::statement`],
//! linked once per statement): its text with comments dropped, as the lexer reads it. Its
//! [`Shape::query_hash`] is the hash of that text alone, as a simple query's is of its
//! generalized text alone (not of its literals' kinds): `SELECT .. WHERE id = $1` sent
//! extended and `SELECT .. WHERE id = 5` sent simple have one `query_hash`, which SHOW QUERIES
//! shows as one row and a cache rule's `query_hash` matches whichever protocol sends it.

use super::analysis::{self, Analysis};
use super::lexer::{self, Kind, Lexed, Literal};
use super::parameters::{self, Decision, Form, Never};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

/// One query shape and what was derived from it.
#[derive(Debug)]
pub struct Shape {
    /// Its place in the shape table (of the text and the literals' kinds).
    pub hash: u64,
    /// What SHOW QUERIES, SHOW AUTOPREPARE and the metrics name it by, and a cache rule's
    /// `query_hash` matches: [`query_hash`] of its text only, the same for the simple and the
    /// extended protocol.
    pub query_hash: u64,
    /// The lexer's generalized text as it was (bytes), every literal a parameter, then its
    /// literals' kinds (a raw text's: its bytes): what the hash was taken of, compared on every lookup. The
    /// hash has a fixed seed (SHOW AUTOPREPARE and cache rules name shapes by it), so a client
    /// could craft a text that collides with another's shape; without the comparison that
    /// text would be run with the other shape's decision (which literals stay in the text).
    key: Box<[u8]>,
    /// Where the text ends in `key`.
    text_len: u32,
    /// A text the lexer refused, keyed as it is ([`Shapes::raw`]).
    raw: bool,
    /// A prepared statement's shape ([`Shapes::statement`]): never a simple query's, never
    /// autoprepared.
    extended: bool,
    /// Which of the words the session looks for in every simple query (`words::query`) the
    /// generalized text holds: the scan of a query of this shape then reads only its string
    /// literals.
    pub words: u32,
    /// Derived at the first use that needs PostgreSQL's parser.
    derived: OnceLock<Derived>,
    /// Autoprepare: the server refused its statement (it runs as sent from then on).
    pub rejected: AtomicBool,
    /// Autoprepare: and the reason was its parameter types (see
    /// `autoprepare::parameter_types_sql`), not the server's refusal of its Parse.
    pub types_refused: AtomicBool,
    /// Autoprepare: queries of this shape seen, and run through a prepared statement.
    pub seen: AtomicU64,
    pub executions: AtomicU64,
    /// What SHOW QUERIES shows of it.
    pub stats: ShapeStats,
    /// Result cache: a malformed hint in a query of this shape was logged (once per shape).
    pub hint_warned: AtomicBool,
}

/// A shape's figures for SHOW QUERIES: how often it runs, how long the server takes, what the
/// result cache made of it.
#[derive(Debug, Default)]
pub struct ShapeStats {
    /// Simple queries of the shape the sessions read (each once); for a prepared
    /// statement's shape, its executions (Binds a server ran, and those the cache answered).
    pub calls: AtomicU64,
    /// Of those, the ones whose time on the server was measured (about one in
    /// [`TIMED_EVERY`], see [`ShapeStats::time_this_call`]), and that time in microseconds.
    pub timed: AtomicU64,
    pub timed_us: AtomicU64,
    /// The rows (returned, or written) of the timed calls, as their CommandCompletes count.
    pub timed_rows: AtomicU64,
    /// Result cache: what it did with the shape's queries, once it looked one up.
    pub cache: OnceLock<Box<CacheFigures>>,
    /// Why the cache last passed it by: the reason's index in `analysis::BYPASS_REASONS` + 1
    /// (0: it did not).
    pub bypass: AtomicU16,
    /// What last chose it for the cache: the rule's place among the cache's rule counters
    /// + 1 (0: nothing did yet).
    pub chosen: AtomicU16,
    /// Auto mode's choice of it (`cache::auto`): unchosen, chosen or retired.
    pub auto: AtomicU8,
}

/// What the result cache did with one shape's queries. Striped: every hit of a hot shape
/// writes them, on every worker.
#[derive(Debug, Default)]
pub struct CacheFigures {
    /// Answered after the lexer read the text (the second tier), and by its exact text (the
    /// first tier, which reads nothing: these are calls too).
    pub hits: crate::workers::StripedCounter,
    pub raw_hits: crate::workers::StripedCounter,
    /// Run to fill it.
    pub misses: crate::workers::StripedCounter,
}

/// About one simple query of a shape in this many is timed on the server (see
/// [`ShapeStats::timed`]): the mean is measured, the total estimated from it and the calls.
pub const TIMED_EVERY: u64 = 8;

impl ShapeStats {
    /// Whether the call of the shape at hand (counted already) is to be timed: its first, and
    /// then whenever fewer than one in [`TIMED_EVERY`] of its calls were. Per shape, not per
    /// client: a client's queries repeat in periods (BEGIN, a read, COMMIT) that a fixed
    /// stride of its own would alias with, never timing some shapes.
    #[inline]
    pub fn time_this_call(&self) -> bool {
        self.time_call(self.calls.load(Relaxed))
    }

    /// [`ShapeStats::time_this_call`] for the call that made the calls `calls`.
    #[inline]
    pub fn time_call(&self, calls: u64) -> bool {
        self.timed.load(Relaxed) * TIMED_EVERY < calls
    }

    /// The mean time on the server, in microseconds (None: never measured).
    pub fn mean_us(&self) -> Option<f64> {
        let timed = self.timed.load(Relaxed);
        (timed > 0).then(|| self.timed_us.load(Relaxed) as f64 / timed as f64)
    }

    /// The estimated total time on the server, in microseconds: the mean times the calls
    /// that ran on a server (not those the cache answered).
    pub fn total_us(&self) -> f64 {
        let answered = self.cache.get().map_or(0, |c| c.hits.get());
        let ran = self.calls.load(Relaxed).saturating_sub(answered);
        self.mean_us().unwrap_or(0.0) * ran as f64
    }

    /// The estimated rows of all its calls (returned, or written): the timed calls' mean
    /// times every call, the cache's hits too (they return the same rows).
    pub fn total_rows(&self) -> f64 {
        let timed = self.timed.load(Relaxed);
        if timed == 0 {
            return 0.0;
        }
        self.timed_rows.load(Relaxed) as f64 / timed as f64 * self.all_calls() as f64
    }

    /// Every query of the shape: those read, and those the cache's first tier answered
    /// unread.
    pub fn all_calls(&self) -> u64 {
        self.calls.load(Relaxed) + self.cache.get().map_or(0, |c| c.raw_hits.get())
    }

    /// The result cache's figures, made at its first lookup of the shape.
    pub fn cache_figures(&self) -> &CacheFigures {
        self.cache.get_or_init(Default::default)
    }

    /// Notes `value` in `cell` (`bypass` or `chosen`) unless it holds it already (a read, not
    /// a write, when it does: the shape's cache line stays shared between workers).
    pub fn note(cell: &AtomicU16, value: u16) {
        if cell.load(Relaxed) != value {
            cell.store(value, Relaxed);
        }
    }

    /// One call timed on the server: `us` microseconds, `rows` rows.
    pub fn note_timed(&self, us: u64, rows: u64) {
        self.timed.fetch_add(1, Relaxed);
        self.timed_us.fetch_add(us, Relaxed);
        self.timed_rows.fetch_add(rows, Relaxed);
    }
}

/// What one parse of a shape's text says.
#[derive(Debug)]
pub struct Derived {
    /// The generalized text, when it is UTF-8: shown, and kept with cache entries.
    pub text: Option<Arc<str>>,
    /// What it reads and writes (None: the text is not UTF-8, and nothing of it is cached).
    pub analysis: Option<Arc<Analysis>>,
    /// Which literals become parameters when autoprepare runs it.
    pub decision: Decision,
}

impl Shape {
    /// The generalized text (as SHOW AUTOPREPARE shows it).
    pub fn text(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.key[..self.text_len as usize])
    }

    /// Whether this is the shape of `lexed` (not only one with the same hash).
    fn is_of(&self, lexed: &Lexed) -> bool {
        let (text, kinds) = self.key.split_at(self.text_len as usize);
        !self.raw
            && !self.extended
            && text == &lexed.text[..]
            && kinds.len() == lexed.literals.len()
            && kinds
                .iter()
                .zip(&lexed.literals)
                .all(|(&k, l)| k == l.kind.code())
    }

    /// What one parse of `sql` (a query of this shape, whose literals the lexer found) says:
    /// parsed at the first call, the same answer at every later one.
    pub fn derived(&self, sql: &[u8], literals: &[Literal]) -> &Derived {
        self.derived.get_or_init(|| {
            let text = std::str::from_utf8(&self.key[..self.text_len as usize])
                .ok()
                .map(Arc::from);
            match std::str::from_utf8(sql) {
                Ok(sql) => {
                    let parsed = super::parse(sql);
                    let raw = self.is_raw();
                    let mut analysis = analysis::analyze_parsed(sql, &parsed);
                    if !raw {
                        analysis.bind_literals(&literal_places(literals));
                    }
                    Derived {
                        text,
                        analysis: Some(Arc::new(analysis)),
                        decision: if raw {
                            Decision::Never(Never::NotDml)
                        } else {
                            parameters::decide_parsed(sql, &parsed, literals)
                        },
                    }
                }
                Err(_) => Derived {
                    text,
                    analysis: None,
                    decision: Decision::Never(Never::ParseError),
                },
            }
        })
    }

    /// What it reads and writes, once derived (None: not yet, or the text is not UTF-8). A
    /// prepared statement's shape is derived here, at the first call (SHOW QUERIES, auto
    /// mode): the session never needs it.
    pub fn analysis(&self) -> Option<&Arc<Analysis>> {
        if self.extended {
            return self.derived_statement().analysis.as_ref();
        }
        self.derived.get()?.analysis.as_ref()
    }

    /// A prepared statement's shape's [`Derived`]: its text analyzed (it has parameters
    /// already; autoprepare has nothing to decide).
    #[cold]
    fn derived_statement(&self) -> &Derived {
        self.derived.get_or_init(|| {
            let text = std::str::from_utf8(&self.key[..self.text_len as usize]).ok();
            Derived {
                text: text.map(Arc::from),
                analysis: text.map(|t| Arc::new(analysis::analyze(t))),
                decision: Decision::Never(Never::NotDml),
            }
        })
    }

    /// The generalized text, shareable, once derived (None: not yet, or not UTF-8).
    pub fn display(&self) -> Option<&Arc<str>> {
        self.derived.get()?.text.as_ref()
    }

    /// The autoprepare decision, once derived.
    pub fn decision(&self) -> Option<&Decision> {
        self.derived.get().map(|d| &d.decision)
    }

    /// Whether this is a raw text's shape (one the lexer refused).
    pub fn is_raw(&self) -> bool {
        self.raw
    }

    /// Whether this is a prepared statement's shape ([`Shapes::statement`]).
    pub fn is_extended(&self) -> bool {
        self.extended
    }

    pub fn is_rejected(&self) -> bool {
        self.rejected.load(Relaxed)
    }

    /// Parameters of the statement it runs as, once decided.
    pub fn parameters(&self) -> Option<usize> {
        match self.decision()? {
            Decision::Generalize { forms, .. } => {
                Some(forms.iter().filter(|f| **f != Form::Verbatim).count())
            }
            Decision::Never(_) => None,
        }
    }
}

type ShapeTable = quick_cache::sync::Cache<u64, Arc<Shape>>;

/// The shapes seen by every session, bounded (`autoprepare_max_shapes`).
pub struct Shapes {
    /// Resized in place by a reload (not swapped): every query looks a shape up here.
    table: ShapeTable,
    max: AtomicU64,
}

impl Shapes {
    pub fn new(max: usize) -> Shapes {
        Shapes {
            table: ShapeTable::new(max.max(1)),
            max: AtomicU64::new(max as u64),
        }
    }

    /// Applies a new bound (RELOAD): the table starts afresh when it changed.
    pub fn set_max(&self, max: usize) {
        if self.max.swap(max as u64, Relaxed) != max as u64 {
            self.table.clear();
            self.table.set_capacity(max.max(1) as u64);
        }
    }

    /// Every remembered shape.
    pub fn iter(&self) -> impl Iterator<Item = Arc<Shape>> + '_ {
        self.table.iter().map(|(_, s)| s)
    }

    /// The shape of `lexed`, remembered at its first sight. `same_as`: a shape known to be
    /// of a reading with `lexed`'s text and literal kinds (the reading of the text before it,
    /// which `lexed` read again): when the table gives that very shape, it is `lexed`'s
    /// without comparing the texts.
    #[inline]
    pub fn get(&self, lexed: &Lexed, same_as: Option<&Arc<Shape>>) -> Arc<Shape> {
        match self.table.get(&lexed.shape) {
            Some(shape) if same_as.is_some_and(|s| Arc::ptr_eq(s, &shape)) => {
                debug_assert!(shape.is_of(lexed));
                shape
            }
            Some(shape) if shape.is_of(lexed) => shape,
            known => self.remember(lexed, known.is_some()),
        }
    }

    /// [`Shapes::get`] at a shape's first sight (or for a text whose hash `collides` with
    /// another's shape): made, and kept unless it collides.
    #[cold]
    #[inline(never)]
    fn remember(&self, lexed: &Lexed, collides: bool) -> Arc<Shape> {
        let make = || {
            let mut key = Vec::with_capacity(lexed.text.len() + lexed.literals.len());
            key.extend_from_slice(&lexed.text);
            key.extend(lexed.literals.iter().map(|l| l.kind.code()));
            new_shape(lexed.shape, key, lexed.text.len(), Of::Lexed)
        };
        // A different text with the same hash keeps the place it took first; this one is
        // counted and decided on its own, unshared.
        if collides {
            return make();
        }
        // Two sessions meeting a new shape at once get the same one (a second made and put
        // in place of the first would lose the first one's calls).
        let shape = self
            .table
            .get_or_insert_with(&lexed.shape, || Ok::<_, std::convert::Infallible>(make()));
        match shape {
            Ok(shape) if shape.is_of(lexed) => shape,
            _ => make(),
        }
    }

    /// The shape of a text the lexer refused: the text itself.
    pub fn raw(&self, sql: &[u8]) -> Arc<Shape> {
        let hash = lexer::hasher().hash_one(sql);
        let known = self.table.get(&hash);
        let collides = match known {
            Some(shape) if shape.raw && *shape.key == *sql => return shape,
            Some(_) => true,
            None => false,
        };
        let make = || new_shape(hash, sql.to_vec(), sql.len(), Of::Raw);
        if collides {
            return make();
        }
        match self
            .table
            .get_or_insert_with(&hash, || Ok::<_, std::convert::Infallible>(make()))
        {
            Ok(shape) if shape.raw && *shape.key == *sql => shape,
            _ => make(),
        }
    }

    /// The shape of a prepared statement whose text is `sql` (None: longer than the lexer
    /// reads). Once per statement (the statement keeps it, see `Statement::shape`), never
    /// per execution. Its text is the lexer's reading with comments dropped, as a simple
    /// query's; a text with literals of its own (`.. status = 'a' AND id = $1`) or one the
    /// lexer refuses is kept as it is: it never reads as a simple query's generalized text,
    /// whose literals are all `$n` in order, and its hash is not one of theirs.
    pub fn statement(&self, sql: &[u8]) -> Option<Arc<Shape>> {
        if sql.len() > lexer::MAX_TEXT {
            return None;
        }
        let mut lexed = Lexed::default();
        let text = match lexer::comments(sql, &mut lexed) {
            Ok(()) if lexed.params == 0 => lexed.text,
            _ => sql.to_vec(),
        };
        // Its place in the table: apart from a simple query's of the same text.
        let hash = query_hash(&text) ^ EXTENDED;
        let collides = match self.table.get(&hash) {
            Some(shape) if shape.extended && *shape.key == *text => return Some(shape),
            Some(_) => true,
            None => false,
        };
        let len = text.len();
        if collides {
            return Some(new_shape(hash, text, len, Of::Extended));
        }
        let shape = self.table.get_or_insert_with(&hash, || {
            Ok::<_, std::convert::Infallible>(new_shape(hash, text.clone(), len, Of::Extended))
        });
        Some(match shape {
            Ok(shape) if shape.extended && *shape.key == *text => shape,
            _ => new_shape(hash, text, len, Of::Extended),
        })
    }
}

/// The hash a shape is named by (SHOW QUERIES' `query_hash`, a cache rule's): of its
/// generalized text only, with the shapes' fixed seed. A shape without literals (and every
/// prepared statement's) has it as its table hash too.
pub fn query_hash(text: &[u8]) -> u64 {
    let mut h = lexer::hasher().build_hasher();
    std::hash::Hasher::write(&mut h, text);
    std::hash::Hasher::finish(&h)
}

/// Set in a prepared statement's shape's table hash ([`Shapes::statement`]).
const EXTENDED: u64 = 0x5a5a_0e0e_7777_0001;

/// What a shape is of.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Of {
    /// A simple query the lexer read.
    Lexed,
    /// A simple query's text the lexer refused.
    Raw,
    /// A prepared statement's text.
    Extended,
}

fn new_shape(hash: u64, key: Vec<u8>, text_len: usize, of: Of) -> Arc<Shape> {
    let words = super::words::in_query(&key[..text_len]);
    Arc::new(Shape {
        hash,
        query_hash: query_hash(&key[..text_len]),
        key: key.into(),
        text_len: text_len as u32,
        raw: of == Of::Raw,
        extended: of == Of::Extended,
        words,
        derived: OnceLock::new(),
        rejected: AtomicBool::new(false),
        types_refused: AtomicBool::new(false),
        seen: AtomicU64::new(0),
        executions: AtomicU64::new(0),
        stats: ShapeStats::default(),
        hint_warned: AtomicBool::new(false),
    })
}

/// Each literal's start in the text, and its `$n` when it is a parameter (see
/// [`analysis::Analysis::bind_literals`]).
fn literal_places(literals: &[Literal]) -> Vec<(u32, Option<u16>)> {
    let mut n = 0u16;
    literals
        .iter()
        .map(|l| {
            let param = (l.kind != Kind::Verbatim).then(|| {
                n = n.saturating_add(1);
                n
            });
            (l.start, param)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lexed(sql: &str) -> Lexed {
        let mut l = Lexed::default();
        lexer::generalize(sql.as_bytes(), &mut l).unwrap();
        l
    }

    /// A text whose hash equals another shape's (the seed is fixed: a client can search for
    /// one) is not run with that shape's decision: same text and literal kinds, or its own.
    #[test]
    fn a_colliding_hash_does_not_share_a_shape() {
        let shapes = Shapes::new(100);
        let a = lexed("SELECT 1, 2");
        let first = shapes.get(&a, None);
        assert!(Arc::ptr_eq(
            &shapes.get(&lexed("SELECT 3, 4"), None),
            &first
        ));
        // Another text, and the same text with other kinds, given a's hash.
        for sql in ["SELECT x FROM t ORDER BY 1, 2", "SELECT 1, '2'"] {
            let mut b = lexed(sql);
            assert_ne!(b.shape, a.shape);
            b.shape = a.shape;
            let second = shapes.get(&b, None);
            assert!(!Arc::ptr_eq(&first, &second), "{sql}");
            assert!(second.is_of(&b) && !first.is_of(&b));
        }
        // A raw text given a's hash neither.
        let raw = shapes.raw(b"SELECT 1, 2");
        assert!(!Arc::ptr_eq(&first, &raw) && raw.is_raw());
        // The first keeps its place.
        assert!(Arc::ptr_eq(&shapes.get(&a, None), &first));
    }

    /// A prepared statement's shape and a simple query's of the same generalized text have
    /// one `query_hash` (not one place in the table: autoprepare never finds the statement's);
    /// comments are not part of it; a statement with a literal of its own keeps it.
    #[test]
    fn a_statement_and_its_simple_twin_share_a_query_hash() {
        let shapes = Shapes::new(100);
        let simple = shapes.get(&lexed("SELECT v FROM t WHERE id = 5 /* a */"), None);
        let extended = shapes
            .statement(b"SELECT v FROM t WHERE id = $1 /* b */")
            .unwrap();
        assert!(!Arc::ptr_eq(&simple, &extended));
        assert!(extended.is_extended() && !simple.is_extended());
        assert_eq!(simple.query_hash, extended.query_hash);
        assert_eq!(extended.text(), simple.text());
        assert_ne!(
            simple.hash, simple.query_hash,
            "the table's hash has the kinds"
        );
        let again = shapes
            .statement(b"SELECT v FROM t WHERE id = $1 /* c */")
            .unwrap();
        assert!(Arc::ptr_eq(&again, &extended), "one shape per text");
        // A literal of its own: kept, another query than the simple one.
        let own = shapes
            .statement(b"SELECT v FROM t WHERE id = $1 AND k = 'a'")
            .unwrap();
        assert_eq!(own.text(), "SELECT v FROM t WHERE id = $1 AND k = 'a'");
        let twin = shapes.get(&lexed("SELECT v FROM t WHERE id = 1 AND k = 'a'"), None);
        assert_ne!(own.query_hash, twin.query_hash);
        // A text the lexer refuses is kept as sent, with a simple raw text's query_hash.
        let begin = shapes.statement(b"BEGIN").unwrap();
        assert_eq!(begin.query_hash, shapes.raw(b"BEGIN").query_hash);
        // Without literals, a simple shape's table hash is its query_hash.
        let plain = shapes.get(&lexed("SELECT now()"), None);
        assert_eq!(plain.hash, plain.query_hash);
        // The analysis of a statement's shape is made when asked.
        let read = extended.analysis().expect("UTF-8").read.as_ref().unwrap();
        assert_eq!(&*read.relations[0].name, "t");
    }

    /// One parse gives both the result cache's analysis and autoprepare's decision.
    #[test]
    fn one_parse_derives_the_analysis_and_the_decision() {
        let shapes = Shapes::new(100);
        let sql = "SELECT abalance FROM pgbench_accounts WHERE aid = 5";
        let l = lexed(sql);
        let shape = shapes.get(&l, None);
        assert!(shape.decision().is_none(), "derived only when asked");
        let derived = shape.derived(sql.as_bytes(), &l.literals);
        assert!(matches!(derived.decision, Decision::Generalize { .. }));
        let analysis = derived.analysis.as_ref().expect("UTF-8 text");
        assert!(analysis.read.is_ok(), "a plain read may be cached");
        assert_eq!(
            derived.text.as_deref(),
            Some("SELECT abalance FROM pgbench_accounts WHERE aid = $1")
        );
        // A later query of the shape gets the same, not parsed again.
        let again = shape.derived(
            b"SELECT abalance FROM pgbench_accounts WHERE aid = 6",
            &l.literals,
        );
        assert!(std::ptr::eq(derived, again));
    }
}
