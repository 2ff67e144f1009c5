//! What a replica may run: the proof that a statement only reads.
//!
//! A statement goes to a replica only when pgmemo can show it changes nothing and that a hot
//! standby runs it as the primary would. The statement's own analysis (PostgreSQL's parser,
//! once per shape: [`crate::query::analysis`]) says what it writes, whether it locks rows,
//! sets anything or names temporary objects; the catalog read here says what its names are:
//! - every function and operator it calls must be known, and no function of that name
//!   volatile (`nextval`, `set_config`, `pg_advisory_lock`, `random`, a user function that may
//!   write: PostgreSQL refuses writes in a function declared STABLE or IMMUTABLE);
//! - every relation it names must be known and permanent (a standby cannot read unlogged or
//!   temporary tables), and not a view or policy that depends on a volatile function of the
//!   database or on a relation that is not permanent.
//!
//! Names are compared without their schema, the strictest relation or function of a name
//! wins. A name the catalog does not know (created since it was read, a CTE's name) is a
//! reason to send the statement to the primary: unknown is never proof. The catalog is read
//! from a replica by its monitor (see [`super::monitor`]) and read again every
//! [`CATALOG_REFRESH`], trusted for [`CATALOG_TTL`].

use std::collections::HashSet;
use std::time::Duration;

use crate::query::analysis::{Analysis, Bypass, Flush};

/// How long a catalog read is trusted: a relation made unlogged, or a function created
/// volatile, directly on the primary is seen within this.
pub const CATALOG_TTL: Duration = Duration::from_secs(5);

/// How old a catalog read is when the monitor reads it again: well before it stops being
/// trusted, so that reads do not fall back to the primary while the next read is under way
/// (read only once stale, every read for the length of a catalog query went there).
pub const CATALOG_REFRESH: Duration = Duration::from_secs(2);

/// The catalog's names, a kind in the first column: `f` a function or operator (`operator
/// NAME`) name none of whose functions is volatile; `r` a relation name all of whose
/// relations are permanent; `x` a relation name whose reading may write or fail on a standby
/// (a view's or policy's dependence on a volatile function of the database, a view on a
/// relation that is not permanent).
pub const CATALOG_SQL: &str = "\
SELECT 'f', p.proname::text FROM pg_proc p GROUP BY p.proname \
 HAVING NOT bool_or(p.provolatile = 'v') \
UNION ALL SELECT 'f', 'operator ' || o.oprname::text FROM pg_operator o \
 JOIN pg_proc p ON p.oid = o.oprcode GROUP BY o.oprname HAVING NOT bool_or(p.provolatile = 'v') \
UNION ALL SELECT 'r', c.relname::text FROM pg_class c GROUP BY c.relname \
 HAVING bool_and(c.relpersistence = 'p') \
UNION ALL SELECT DISTINCT 'x', c.relname::text FROM pg_depend d \
 JOIN pg_proc p ON d.refclassid = 'pg_proc'::regclass AND d.refobjid = p.oid AND p.provolatile = 'v' \
 JOIN pg_rewrite r ON d.classid = 'pg_rewrite'::regclass AND d.objid = r.oid \
 JOIN pg_class c ON c.oid = r.ev_class \
UNION ALL SELECT DISTINCT 'x', c.relname::text FROM pg_depend d \
 JOIN pg_proc p ON d.refclassid = 'pg_proc'::regclass AND d.refobjid = p.oid AND p.provolatile = 'v' \
 JOIN pg_policy pol ON d.classid = 'pg_policy'::regclass AND d.objid = pol.oid \
 JOIN pg_class c ON c.oid = pol.polrelid \
UNION ALL SELECT DISTINCT 'x', c.relname::text FROM pg_depend d \
 JOIN pg_class b ON d.refclassid = 'pg_class'::regclass AND d.refobjid = b.oid \
 AND b.relpersistence <> 'p' \
 JOIN pg_rewrite r ON d.classid = 'pg_rewrite'::regclass AND d.objid = r.oid \
 JOIN pg_class c ON c.oid = r.ev_class";

/// The names a replica may run, as of one read of the catalog.
#[derive(Debug, Default)]
pub struct Catalog {
    functions: HashSet<Box<str>>,
    relations: HashSet<Box<str>>,
    /// When it was read (the application clock, microseconds).
    pub read_at_us: u64,
}

impl Catalog {
    /// From the rows of [`CATALOG_SQL`].
    pub fn from_rows(rows: &[Vec<Option<String>>], read_at_us: u64) -> Catalog {
        let mut c = Catalog {
            read_at_us,
            ..Catalog::default()
        };
        let mut refused = Vec::new();
        for row in rows {
            let (Some(Some(kind)), Some(Some(name))) = (row.first(), row.get(1)) else {
                continue;
            };
            match kind.as_str() {
                "f" => {
                    c.functions.insert(name.as_str().into());
                }
                "r" => {
                    c.relations.insert(name.as_str().into());
                }
                "x" => refused.push(name.as_str()),
                _ => {}
            }
        }
        for name in refused {
            c.relations.remove(name);
        }
        c
    }

    /// Whether it is too old to be trusted at `now_us`.
    pub fn is_stale(&self, now_us: u64) -> bool {
        now_us.saturating_sub(self.read_at_us) > CATALOG_TTL.as_micros() as u64
    }

    /// Whether it is time to read it again (see [`CATALOG_REFRESH`]).
    pub fn is_due(&self, now_us: u64) -> bool {
        now_us.saturating_sub(self.read_at_us) > CATALOG_REFRESH.as_micros() as u64
    }

    /// Whether a statement of this analysis only reads, and a hot standby runs it as the
    /// primary would (see the module's documentation).
    pub fn only_reads(&self, analysis: &Analysis) -> bool {
        let e = &analysis.effects;
        let changes_nothing = e.writes.is_empty()
            && e.flush == Flush::None
            && !e.session_state
            && !e.transaction_state
            && !e.temp
            && !e.drops_temp
            && !e.resets_session
            && e.rows.is_none();
        // A single SELECT, VALUES or TABLE: no INTO, no row locks, no data-modifying WITH.
        // Reading the clock or the session is fine on a standby (`now()` is the standby's
        // clock, as a primary's would be its own).
        let a_plain_read = matches!(analysis.read, Ok(_) | Err(Bypass::TimeOrSession));
        changes_nothing
            && a_plain_read
            && e.calls.iter().all(|f| self.functions.contains(f))
            && e.reads.iter().all(|r| self.relations.contains(r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::query::analysis::analyze;

    fn catalog() -> Catalog {
        let row = |k: &str, n: &str| vec![Some(k.to_string()), Some(n.to_string())];
        Catalog::from_rows(
            &[
                row("f", "count"),
                row("f", "now"),
                row("f", "lower"),
                row("f", "operator ="),
                row("f", "operator >"),
                row("r", "accounts"),
                row("r", "orders"),
                row("r", "v_safe"),
                row("r", "v_writes"),
                row("x", "v_writes"),
            ],
            0,
        )
    }

    #[test]
    fn plain_reads_of_known_permanent_relations_only_read() {
        let c = catalog();
        for sql in [
            "SELECT * FROM accounts WHERE id = 1",
            "SELECT count(*), now() FROM orders o JOIN accounts a ON a.id = o.id",
            "select lower(name) from accounts where id > 3",
            "SELECT * FROM v_safe",
            "VALUES (1)",
        ] {
            assert!(c.only_reads(&analyze(sql)), "{sql}");
        }
    }

    #[test]
    fn anything_that_may_write_lock_or_fail_on_a_standby_goes_to_the_primary() {
        let c = catalog();
        for sql in [
            "UPDATE accounts SET x = 1",
            "INSERT INTO accounts VALUES (1)",
            "SELECT * FROM accounts FOR UPDATE",
            "SELECT * FROM accounts FOR SHARE",
            "WITH d AS (DELETE FROM accounts RETURNING *) SELECT * FROM d",
            "SELECT nextval('s')",
            "SELECT random() FROM accounts",
            "SELECT set_config('a.b', 'c', false)",
            "SELECT pg_advisory_lock(1)",
            "SELECT * INTO copy FROM accounts",
            "SELECT * FROM unknown_table",
            "SELECT * FROM v_writes",
            "SELECT * FROM pg_temp.t",
            "CREATE TEMP TABLE t (a int)",
            "SET search_path = x",
            "BEGIN",
            "SELECT 1; SELECT 2",
            "DO $$ BEGIN END $$",
            "not sql at all",
        ] {
            assert!(!c.only_reads(&analyze(sql)), "{sql}");
        }
    }
}
