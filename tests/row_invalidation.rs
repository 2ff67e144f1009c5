//! Row-level invalidation (`cache::rows`): a cached point read (a read of one table whose
//! `WHERE` fixes its key) depends on its rows, so a write to another row leaves it a hit,
//! while what a write may have changed is never served: every read here is compared with
//! PostgreSQL's own answer at that moment. Writes through pgmemo (proxy invalidation) and
//! writes made directly (WAL invalidation, both decoders), each kind of write that names its
//! rows and each that does not (a key changed by `SET`, `INSERT` without the key, `ON
//! CONFLICT` on another constraint, cascades, triggers, TRUNCATE, a table without a primary
//! key), composite, text and uuid keys, partitions, collisions of the row counters, and
//! concurrent writers checked by a consistency checker; and random runs of every kind of
//! write between cached reads of every kind, in and out of transaction blocks, each read
//! compared with PostgreSQL. Refresh ahead: a hot key read across its TTL never misses.

mod common;

use common::*;
use pgmemo::config::cache::{Invalidation, Rule, WalPlugin};
use pgmemo::config::{Config, PoolMode};
use pgmemo::Pgmemo;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

const SCHEMA: &str = "
    CREATE TABLE accounts (id int PRIMARY KEY, v int);
    INSERT INTO accounts SELECT g, g FROM generate_series(1, 10) g;
    CREATE TABLE plain (id int, v int);
    INSERT INTO plain VALUES (1, 1), (2, 2);
    -- pgoutput's FOR ALL TABLES publication refuses updates of a table without an identity.
    ALTER TABLE plain REPLICA IDENTITY FULL;
    CREATE TABLE pair (a int, b text, v int, PRIMARY KEY (a, b));
    INSERT INTO pair VALUES (1, 'x', 1), (1, 'y', 2);
    CREATE TABLE tokens (id uuid PRIMARY KEY, v int);
    INSERT INTO tokens VALUES ('a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', 1),
                              ('b0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', 2);
    CREATE TABLE parent (id int PRIMARY KEY);
    CREATE TABLE child (id int PRIMARY KEY, pid int REFERENCES parent ON DELETE CASCADE, v int);
    INSERT INTO parent VALUES (1), (2); INSERT INTO child VALUES (1, 1, 1), (2, 2, 2);
    CREATE TABLE audited (id int PRIMARY KEY, v int);
    INSERT INTO audited VALUES (1, 1);
    CREATE TABLE audit (id int PRIMARY KEY, n int);
    INSERT INTO audit VALUES (1, 0);
    CREATE FUNCTION count_write() RETURNS trigger LANGUAGE plpgsql AS
      $$ BEGIN UPDATE audit SET n = n + 1 WHERE id = 1; RETURN NEW; END $$;
    CREATE TRIGGER audited_count AFTER UPDATE ON audited FOR EACH ROW EXECUTE FUNCTION count_write();
    CREATE TABLE parted (id int PRIMARY KEY, v int) PARTITION BY RANGE (id);
    CREATE TABLE parted_1 PARTITION OF parted FOR VALUES FROM (0) TO (100);
    INSERT INTO parted VALUES (1, 1), (2, 2);
    CREATE TABLE named (name text PRIMARY KEY, v int);
    INSERT INTO named VALUES ('ann', 1), ('bob', 2);
    CREATE VIEW account_view AS SELECT id AS key, v FROM accounts WHERE v >= 0;
    -- Read by a column that is not a key, and column by column (cache::columns). The WAL
    -- shows an UPDATE's columns only with the whole old row.
    CREATE TABLE posts (id serial PRIMARY KEY, user_id int NOT NULL, title text NOT NULL UNIQUE,
                        likes int NOT NULL);
    ALTER TABLE posts REPLICA IDENTITY FULL;
    INSERT INTO posts (user_id, title, likes)
        SELECT u, 'u' || u || '-' || k, k FROM generate_series(1, 3) u, generate_series(1, 2) k
        ORDER BY u, k;
    CREATE TABLE owners (id int PRIMARY KEY, name text, note text);
    ALTER TABLE owners REPLICA IDENTITY FULL;
    INSERT INTO owners SELECT g, 'owner ' || g, '' FROM generate_series(1, 3) g;
    CREATE TABLE scored (id int PRIMARY KEY, likes int,
                         score int GENERATED ALWAYS AS (likes * 2) STORED);
    ALTER TABLE scored REPLICA IDENTITY FULL;
    INSERT INTO scored (id, likes) VALUES (1, 1), (2, 2);";

fn config(invalidation: Invalidation) -> Config {
    let mut config = test_config(PoolMode::Transaction, 2);
    config.cache.enabled = true;
    config.cache.admit_after = 1;
    config.cache.invalidation = invalidation;
    // Tables' versions each have a slot of their own (cache::versions); rows' are hashed into
    // an array, and a read kept by a write stays a hit only if none of its rows' slots is one
    // the write bumped. The hash takes in the database's name, which holds the server's port,
    // so which rows share a slot changes from run to run: eight times the default array makes
    // such a pair eight times rarer (colliding_row_counters_stay_correct checks that sharing
    // stays correct).
    config.cache.row_versions = 1 << 22;
    config.cache.rules = [
        "accounts",
        "plain",
        "pair",
        "tokens",
        "child",
        "audit",
        "parted",
        "named",
        "account_view",
        "posts",
        "scored",
        "owners",
    ]
    .iter()
    .map(|t| cache_rule(t, &format!("FROM {t}")))
    .collect::<Vec<Rule>>();
    config
}

async fn setup(db: &'static str) {
    fresh_db(db).await;
    tokio::task::spawn_blocking(move || cluster().psql(db, SCHEMA))
        .await
        .unwrap();
}

/// The first column of each row of `sql` (simple protocol), joined by `,`: "" for no row.
async fn value(client: &Client, sql: &str) -> String {
    let messages = client
        .simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    messages
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => {
                Some(r.get(0).unwrap_or("NULL").to_owned())
            }
            _ => None,
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Reads `sql` through pgmemo: its value, and whether the cache answered it.
async fn read(proxy: &Pgmemo, client: &Client, sql: &str) -> (String, bool) {
    let before = cache_hits(proxy);
    let v = value(client, sql).await;
    (v, cache_hits(proxy) > before)
}

/// Reads `sql` until the cache answers it; its value.
async fn cached(proxy: &Pgmemo, client: &Client, sql: &str) -> String {
    let first = value(client, sql).await;
    let (second, hit) = read(proxy, client, sql).await;
    assert_eq!(first, second, "{sql}");
    assert!(hit, "{sql} was not answered from the cache");
    second
}

/// The follower of `db` has applied the server's WAL as of now (no-op without one).
async fn caught_up(proxy: &Pgmemo, direct: &Client, db: &str) {
    if proxy.app().cache.follows_wal() {
        let lsn: pgmemo::wal::Lsn = value(direct, "SELECT pg_current_wal_insert_lsn()")
            .await
            .parse()
            .unwrap();
        wait_until("the WAL follower", Duration::from_secs(30), || async {
            proxy
                .app()
                .wal
                .followers()
                .iter()
                .any(|f| f.status().database == db && f.is_ready() && f.applied() >= lsn)
        })
        .await;
    }
}

/// A write and what it must invalidate: the point reads and other reads cached before it
/// give PostgreSQL's answer after it; `kept`: reads of other rows still answered from the
/// cache after it.
struct Case {
    write: &'static str,
    changed: &'static [&'static str],
    kept: &'static [&'static str],
}

const CASES: &[Case] = &[
    // A result that shows its rows' key holds them (cache::columns::HeldRows): for the
    // columns it only shows it depends on those rows, so a like of another user's post
    // leaves it a hit. Without a key shown, or with the column in its ORDER BY, it depends
    // on the column.
    Case {
        write: "UPDATE posts SET likes = 70 WHERE id = 3",
        changed: &[
            "SELECT id, likes FROM posts WHERE user_id = 2 ORDER BY title",
            "SELECT title, likes FROM posts WHERE user_id = 1 ORDER BY title",
            "SELECT id, likes FROM posts WHERE user_id = 1 ORDER BY likes, id",
        ],
        kept: &[
            "SELECT id, likes FROM posts WHERE user_id = 1 ORDER BY title",
            "SELECT p.id, p.likes, o.name FROM posts p JOIN owners o ON o.id = p.user_id \
             WHERE p.user_id = 3 ORDER BY p.title",
        ],
    },
    // `*` and a whole row read every column the catalog lists: a result showing the key
    // holds its rows; a whole row (a composite column) shows no key.
    Case {
        write: "UPDATE posts SET likes = 71 WHERE id = 3",
        changed: &[
            "SELECT * FROM posts WHERE user_id = 2 ORDER BY title",
            "SELECT p.* FROM posts p WHERE user_id = 1",
            "SELECT posts FROM posts WHERE user_id = 1 ORDER BY title",
        ],
        kept: &[
            "SELECT * FROM posts WHERE user_id = 1 ORDER BY title",
            "SELECT p.*, o.name FROM posts p JOIN owners o ON o.id = p.user_id \
             WHERE p.user_id = 3 ORDER BY p.title",
        ],
    },
    // A join ordered by one table's key orders the whole result only when each of its rows
    // gives one row: an owner's several posts tie under `ORDER BY o.id`, and ties come out in
    // the order the rows were met, which an UPDATE of the owner may change.
    Case {
        write: "UPDATE owners SET note = 'x' WHERE id = 1",
        changed: &[
            "SELECT o.id, p.title FROM owners o JOIN posts p ON p.user_id = o.id \
                    WHERE o.id = 1 ORDER BY o.id",
        ],
        kept: &[
            "SELECT p.title, o.name FROM posts p JOIN owners o ON o.id = p.user_id \
                 WHERE p.user_id = 1 ORDER BY p.title",
        ],
    },
    // Column by column: an UPDATE changes what uses the columns it assigns, and the order of
    // a read whose ORDER BY is not total; the rest stays.
    Case {
        write: "UPDATE posts SET likes = 50 WHERE id = 1",
        changed: &[
            "SELECT title, likes FROM posts WHERE user_id = 1 ORDER BY title",
            "SELECT sum(likes) FROM posts WHERE user_id = 2",
            "SELECT title FROM posts WHERE user_id = 1",
            "SELECT string_agg(title, ',') FROM posts WHERE user_id = 1",
        ],
        kept: &[
            "SELECT count(*) FROM posts WHERE user_id = 1",
            "SELECT title FROM posts WHERE user_id = 1 ORDER BY title",
            "SELECT p.title, a.v FROM posts p JOIN accounts a ON a.id = p.user_id \
             WHERE p.user_id = 1 ORDER BY p.title",
        ],
    },
    // A row added names its values: reads of other values stay.
    Case {
        write: "INSERT INTO posts (user_id, title, likes) VALUES (2, 'u2-new', 0)",
        changed: &[
            "SELECT title, likes FROM posts WHERE user_id = 2 ORDER BY title",
            "SELECT count(*) FROM posts WHERE user_id = 2",
            "SELECT count(*) FROM posts",
            "SELECT p.title, a.v FROM posts p JOIN accounts a ON a.id = p.user_id \
             WHERE p.user_id = 2 ORDER BY p.title",
        ],
        kept: &[
            "SELECT title, likes FROM posts WHERE user_id = 1 ORDER BY title",
            "SELECT count(*) FROM posts WHERE user_id = 3",
            "SELECT p.title, a.v FROM posts p JOIN accounts a ON a.id = p.user_id \
             WHERE p.user_id = 1 ORDER BY p.title",
        ],
    },
    Case {
        write: "INSERT INTO posts (user_id, title, likes) VALUES (1, 'u1-x', 1) \
                ON CONFLICT (title) DO UPDATE SET likes = 9",
        changed: &["SELECT count(*) FROM posts WHERE user_id = 1"],
        kept: &["SELECT count(*) FROM posts WHERE user_id = 2"],
    },
    // Assigning the column a read selects by: every value of it.
    Case {
        write: "UPDATE posts SET user_id = 3 WHERE title = 'u1-1'",
        changed: &[
            "SELECT count(*) FROM posts WHERE user_id = 3",
            "SELECT count(*) FROM posts WHERE user_id = 1",
        ],
        kept: &["SELECT count(*) FROM posts WHERE title = 'u2-2'"],
    },
    Case {
        write: "DELETE FROM posts WHERE title = 'u2-1'",
        changed: &[
            "SELECT count(*) FROM posts WHERE user_id = 2",
            "SELECT title FROM posts WHERE user_id = 2 ORDER BY title",
        ],
        kept: &[],
    },
    // A generated column changes with what it is computed from.
    Case {
        write: "UPDATE scored SET likes = 5 WHERE id = 1",
        changed: &[
            "SELECT sum(score) FROM scored",
            "SELECT count(*) FROM scored WHERE score = 2",
        ],
        kept: &[],
    },
    Case {
        write: "UPDATE accounts SET v = 100 WHERE id = 2",
        changed: &[
            "SELECT v FROM accounts WHERE id = 2",
            "SELECT sum(v) FROM accounts",
            "SELECT v FROM accounts WHERE id IN (2, 3) ORDER BY id",
        ],
        kept: &[
            "SELECT v FROM accounts WHERE id = 1",
            "SELECT v FROM accounts WHERE id = 3",
        ],
    },
    Case {
        write: "UPDATE accounts SET v = 5 WHERE id = 4 AND v = 4",
        changed: &["SELECT v FROM accounts WHERE id = 4"],
        kept: &["SELECT v FROM accounts WHERE id = 1"],
    },
    // A read that found no row follows the INSERT of its key.
    Case {
        write: "INSERT INTO accounts (id, v) VALUES (30, 30), (31, 31)",
        changed: &[
            "SELECT v FROM accounts WHERE id = 30",
            "SELECT count(*) FROM accounts",
        ],
        kept: &["SELECT v FROM accounts WHERE id = 1"],
    },
    Case {
        write: "DELETE FROM accounts WHERE id IN (5, 6)",
        changed: &["SELECT v FROM accounts WHERE id = 6"],
        kept: &["SELECT v FROM accounts WHERE id = 1"],
    },
    Case {
        write: "INSERT INTO accounts (id, v) VALUES (7, 0) ON CONFLICT (id) DO UPDATE SET v = 70",
        changed: &["SELECT v FROM accounts WHERE id = 7"],
        kept: &["SELECT v FROM accounts WHERE id = 1"],
    },
    // Rows not named: every point read of the table.
    Case {
        write: "UPDATE accounts SET id = 40 WHERE id = 8",
        changed: &[
            "SELECT v FROM accounts WHERE id = 40",
            "SELECT v FROM accounts WHERE id = 8",
        ],
        kept: &[],
    },
    Case {
        write: "INSERT INTO accounts VALUES (41, 41)",
        changed: &["SELECT v FROM accounts WHERE id = 41"],
        kept: &[],
    },
    Case {
        write: "UPDATE accounts SET v = v + 1 WHERE v = 1",
        changed: &["SELECT v FROM accounts WHERE id = 1"],
        kept: &[],
    },
    Case {
        write: "INSERT INTO accounts (id, v) VALUES (1, 0) ON CONFLICT (id) DO UPDATE SET id = 42",
        changed: &[
            "SELECT v FROM accounts WHERE id = 42",
            "SELECT v FROM accounts WHERE id = 1",
        ],
        kept: &[],
    },
    // Composite, uuid and text keys: the neighbour stays.
    Case {
        write: "UPDATE pair SET v = 10 WHERE a = 1 AND b = 'x'",
        changed: &[
            "SELECT v FROM pair WHERE a = 1 AND b = 'x'",
            "SELECT sum(v) FROM pair WHERE a = 1",
        ],
        kept: &["SELECT v FROM pair WHERE b = 'y' AND a = 1"],
    },
    Case {
        write: "UPDATE tokens SET v = 10 WHERE id = 'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'",
        changed: &["SELECT v FROM tokens WHERE id = 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'"],
        kept: &["SELECT v FROM tokens WHERE id = 'b0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'"],
    },
    // A number written into a text key is stored as the number's text: '1000', not '1e3'.
    Case {
        write: "INSERT INTO named (name, v) VALUES (1e3, 5), (007, 6)",
        changed: &[
            "SELECT v FROM named WHERE name = '1000'",
            "SELECT v FROM named WHERE name = '7'",
        ],
        kept: &[],
    },
    Case {
        write: "UPDATE named SET v = 10 WHERE name = 'ann'",
        changed: &["SELECT v FROM named WHERE name = 'ann'"],
        kept: &["SELECT v FROM named WHERE name = 'bob'"],
    },
    // A cascade reaches rows of another table.
    Case {
        write: "DELETE FROM parent WHERE id = 1",
        changed: &["SELECT v FROM child WHERE id = 1"],
        kept: &[],
    },
    // A trigger writes another table.
    Case {
        write: "UPDATE audited SET v = 2 WHERE id = 1",
        changed: &["SELECT n FROM audit WHERE id = 1"],
        kept: &[],
    },
    // No primary key: by table.
    Case {
        write: "UPDATE plain SET v = 10 WHERE id = 1",
        changed: &["SELECT v FROM plain WHERE id = 1"],
        kept: &[],
    },
    // A partition's rows, read through the leaf and through the root.
    Case {
        write: "UPDATE parted SET v = 10 WHERE id = 1",
        changed: &[
            "SELECT v FROM parted_1 WHERE id = 1",
            "SELECT v FROM parted WHERE id = 1",
        ],
        kept: &[],
    },
    Case {
        write: "UPDATE parted_1 SET v = 20 WHERE id = 2",
        changed: &[
            "SELECT v FROM parted_1 WHERE id = 2",
            "SELECT v FROM parted WHERE id = 2",
        ],
        kept: &["SELECT v FROM parted_1 WHERE id = 1"],
    },
    // A view that projects one table: its key column is the table's.
    Case {
        write: "UPDATE accounts SET v = 90 WHERE id = 9",
        changed: &["SELECT v FROM account_view WHERE key = 9"],
        kept: &["SELECT v FROM account_view WHERE key = 10"],
    },
    Case {
        write: "TRUNCATE accounts",
        changed: &["SELECT v FROM accounts WHERE id = 3"],
        kept: &[],
    },
];

/// Runs [`CASES`], each write made by `writer` (through pgmemo, or directly): the reads it
/// changed give PostgreSQL's answer, the ones it kept are still hits.
async fn run_cases(proxy: &Pgmemo, client: &Client, direct: &Client, writer: &Client, db: &str) {
    for case in CASES {
        for sql in case.changed.iter().chain(case.kept) {
            cached(proxy, client, sql).await;
        }
        writer.batch_execute(case.write).await.unwrap();
        caught_up(proxy, direct, db).await;
        let changed = case.changed.iter().map(|sql| (sql, false));
        for (sql, kept) in changed.chain(case.kept.iter().map(|sql| (sql, true))) {
            let (through, hit) = read(proxy, client, sql).await;
            let write = case.write;
            assert_eq!(through, value(direct, sql).await, "{sql} after {write}");
            // A read of another row is still a hit; what the write changed is not.
            if hit != kept {
                let state = cache_state(proxy).await;
                panic!("{sql} answered by the cache ({hit}) after {write}; {state}");
            }
        }
    }
}

/// What the console shows of the cache and its followers, for a failure's message.
async fn cache_state(proxy: &Pgmemo) -> String {
    let admin = admin_console(proxy.local_addr()).await;
    let mut out = String::new();
    for show in [
        "SHOW CACHE_BYPASSES",
        "SHOW CACHE_WAL",
        "SHOW CACHE_ENTRIES",
        "SHOW CACHE",
    ] {
        let rows = admin_rows(&admin, show).await;
        out.push_str(&format!("\n{show}: {rows:?}"));
    }
    out
}

/// The row figures of SHOW CACHE ROWS.
async fn row_figures(proxy: &Pgmemo) -> std::collections::HashMap<String, String> {
    let admin = admin_console(proxy.local_addr()).await;
    admin_rows(&admin, "SHOW CACHE ROWS").await.remove(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_through_pgmemo_invalidate_their_rows() {
    const DB: &str = "rows_proxy";
    setup(DB).await;
    let proxy = start_pgmemo(config(Invalidation::Proxy)).await;
    let client = connect(&proxy_db_url(&proxy, DB)).await;
    let writer = connect(&proxy_db_url(&proxy, DB)).await;
    let direct = connect(&direct_db_url(DB)).await;
    run_cases(&proxy, &client, &direct, &writer, DB).await;
    let figures = row_figures(&proxy).await;
    for name in ["point_fills", "rows_bumped", "unknown_rows", "column_fills"] {
        assert!(
            figures[name].parse::<u64>().unwrap() > 0,
            "{name}: {figures:?}"
        );
    }
    proxy.shutdown().await;
}

/// The same writes made directly, followed in the WAL by each decoder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_in_the_wal_invalidate_their_rows() {
    for (db, plugin) in [
        ("rows_wal_text", WalPlugin::TestDecoding),
        ("rows_wal_pgoutput", WalPlugin::Pgoutput),
    ] {
        setup(db).await;
        let mut config = config(Invalidation::Wal);
        config.cache.wal_plugin = plugin;
        let proxy = start_pgmemo(config).await;
        let client = connect(&proxy_db_url(&proxy, db)).await;
        let direct = connect(&direct_db_url(db)).await;
        value(&client, "SELECT v FROM accounts WHERE id = 1").await;
        caught_up(&proxy, &direct, db).await;
        run_cases(&proxy, &client, &direct, &direct, db).await;
        let figures = row_figures(&proxy).await;
        // accounts has the default replica identity: its UPDATEs change every read of it.
        for name in ["rows_bumped", "column_fills", "wal_updates_whole"] {
            assert!(
                figures[name].parse::<u64>().unwrap() > 0,
                "{name}: {figures:?}"
            );
        }
        proxy.shutdown().await;
    }
}

/// Two databases with the same table and keys: a write to a row of one leaves the other's
/// cached read of that key a hit, with its own value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_are_per_database() {
    const A: &str = "rows_db_a";
    const B: &str = "rows_db_b";
    setup(A).await;
    setup(B).await;
    let proxy = start_pgmemo(config(Invalidation::Proxy)).await;
    let (a, b) = (
        connect(&proxy_db_url(&proxy, A)).await,
        connect(&proxy_db_url(&proxy, B)).await,
    );
    let sql = "SELECT v FROM accounts WHERE id = 1";
    cached(&proxy, &a, sql).await;
    cached(&proxy, &b, sql).await;
    a.batch_execute("UPDATE accounts SET v = 100 WHERE id = 1")
        .await
        .unwrap();
    assert_eq!(read(&proxy, &a, sql).await, ("100".into(), false));
    assert_eq!(read(&proxy, &b, sql).await, ("1".into(), true));
    proxy.shutdown().await;
}

/// Extended-protocol reads and writes (text and binary parameters) name the same rows as
/// simple ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameters_name_rows_as_literals_do() {
    const DB: &str = "rows_params";
    setup(DB).await;
    let proxy = start_pgmemo(config(Invalidation::Proxy)).await;
    let client = connect(&proxy_db_url(&proxy, DB)).await;
    let direct = connect(&direct_db_url(DB)).await;
    let (proxy_ref, client_ref) = (&proxy, &client);
    let get = |id: i32| {
        let (proxy, client) = (proxy_ref, client_ref);
        async move {
            let before = cache_hits(proxy);
            let row = client
                .query_one("SELECT v FROM accounts WHERE id = $1", &[&id])
                .await
                .unwrap();
            (row.get::<_, i32>(0), cache_hits(proxy) > before)
        }
    };
    get(1).await;
    get(2).await;
    assert!(get(1).await.1 && get(2).await.1, "both cached");
    // A binary int8 parameter for an int4 key, and a simple write.
    client
        .execute("UPDATE accounts SET v = 20 WHERE id = $1::int8", &[&2i64])
        .await
        .unwrap();
    assert_eq!(get(2).await, (20, false));
    assert!(get(1).await.1, "row 1 was not written");
    client
        .batch_execute("UPDATE accounts SET v = 10 WHERE id = 1")
        .await
        .unwrap();
    assert_eq!(get(1).await, (10, false));
    assert!(get(2).await.1, "row 2 was not written");
    let direct_v: i32 = direct
        .query_one("SELECT v FROM accounts WHERE id = 1", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(direct_v, 10);
    proxy.shutdown().await;
}

/// Rows, monotonic versions of each, and the check that a read through pgmemo is never older
/// than what was committed before it was sent: through pgmemo, once committed; directly,
/// once pgmemo's WAL follower applied the commit (its position at the read's sending).
struct Checker {
    /// Per row: the last value committed through pgmemo, and the last value a writer
    /// started to write.
    committed: Vec<AtomicI64>,
    started: Vec<AtomicI64>,
    /// Per row written directly: each value committed, with the WAL position after it.
    direct: Vec<std::sync::Mutex<Vec<(i64, pgmemo::wal::Lsn)>>>,
    stale: AtomicU64,
    reads: AtomicU64,
}

/// Rows 1..=ROWS are updated (v grows); rows ROWS+1..=2*ROWS are inserted and deleted
/// alternately (v is the sequence number of the insert, which is odd; a delete's is even,
/// and 0 is the absence they start with).
const ROWS: i64 = 8;

impl Checker {
    fn new() -> Checker {
        Checker {
            committed: (0..=2 * ROWS).map(|_| AtomicI64::new(0)).collect(),
            started: (0..=2 * ROWS).map(|_| AtomicI64::new(0)).collect(),
            direct: (0..=2 * ROWS).map(|_| Default::default()).collect(),
            stale: AtomicU64::new(0),
            reads: AtomicU64::new(0),
        }
    }

    /// Judges a read of row `id` sent after `before` was committed: its value (None: no
    /// row) must be at least as new.
    /// What of row `id` was committed (and, for a direct write, applied by the follower at
    /// `applied`) before a read sent now.
    fn before(&self, id: i64, applied: pgmemo::wal::Lsn) -> i64 {
        let direct = self.direct[id as usize].lock().unwrap();
        let seen = direct
            .iter()
            .filter(|(_, lsn)| *lsn <= applied)
            .map(|(v, _)| *v)
            .max();
        seen.unwrap_or(0)
            .max(self.committed[id as usize].load(SeqCst))
    }

    fn judge(&self, id: i64, before: i64, got: Option<i64>) {
        self.reads.fetch_add(1, SeqCst);
        let started = self.started[id as usize].load(SeqCst);
        let ok = if id <= ROWS {
            got.is_some_and(|v| v >= before && v <= started)
        } else {
            // Odd numbers are inserts (the row has v = n), even ones deletes.
            match got {
                Some(v) => v % 2 == 1 && v >= before && v <= started,
                None => before % 2 == 0 || started > before,
            }
        };
        if !ok {
            eprintln!("stale: row {id} read {got:?} after {before} committed ({started} started)");
            self.stale.fetch_add(1, SeqCst);
        }
    }
}

/// One writer: `n` writes over the rows of `ids`, through `client` (`direct`: to PostgreSQL,
/// each commit noted with its WAL position).
async fn write_rows(
    checker: Arc<Checker>,
    client: Client,
    direct: bool,
    ids: Vec<i64>,
    n: usize,
    seed: u64,
) {
    let mut rng = Rng(seed);
    for _ in 0..n {
        let id = *rng.pick(&ids);
        let slot = id as usize;
        let next = checker.started[slot].load(SeqCst) + 1;
        checker.started[slot].store(next, SeqCst);
        let sql = if id <= ROWS {
            format!("UPDATE accounts SET v = {next} WHERE id = {id}")
        } else if next % 2 == 1 {
            format!("INSERT INTO accounts (id, v) VALUES ({id}, {next})")
        } else {
            format!("DELETE FROM accounts WHERE id = {id}")
        };
        client.batch_execute(&sql).await.unwrap();
        if direct {
            let lsn = value(&client, "SELECT pg_current_wal_insert_lsn()").await;
            let lsn = lsn.parse().unwrap();
            checker.direct[slot].lock().unwrap().push((next, lsn));
        } else {
            checker.committed[slot].store(next, SeqCst);
        }
    }
}

/// Readers read every row, cached, while writers write (each row has one writer): through
/// pgmemo, and directly (followed in the WAL), with `row_versions` counters.
async fn check_consistency(db: &'static str, row_versions: u32) -> Arc<Checker> {
    fresh_db(db).await;
    let schema = format!(
        "CREATE TABLE accounts (id int PRIMARY KEY, v int);
         INSERT INTO accounts SELECT g, 0 FROM generate_series(1, {ROWS}) g;"
    );
    tokio::task::spawn_blocking(move || cluster().psql(db, &schema))
        .await
        .unwrap();
    let mut config = config(Invalidation::Wal);
    config.cache.row_versions = row_versions;
    let proxy = start_pgmemo(config).await;
    let direct = connect(&direct_db_url(db)).await;
    let first = connect(&proxy_db_url(&proxy, db)).await;
    value(&first, "SELECT v FROM accounts WHERE id = 1").await;
    caught_up(&proxy, &direct, db).await;
    let checker = Arc::new(Checker::new());
    let mut writers = Vec::new();
    // Through pgmemo: odd rows; directly: even rows.
    for (through_pgmemo, parity) in [(true, 1), (false, 0)] {
        let client = if through_pgmemo {
            connect(&proxy_db_url(&proxy, db)).await
        } else {
            connect(&direct_db_url(db)).await
        };
        let ids: Vec<i64> = (1..=2 * ROWS).filter(|i| i % 2 == parity).collect();
        let seed = 7 + parity as u64;
        let writer = write_rows(checker.clone(), client, !through_pgmemo, ids, 300, seed);
        writers.push(tokio::spawn(writer));
    }
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut readers = Vec::new();
    for r in 0..3u64 {
        let client = connect(&proxy_db_url(&proxy, db)).await;
        let (checker, done) = (checker.clone(), done.clone());
        let follower = proxy
            .app()
            .wal
            .followers()
            .into_iter()
            .find(|f| f.status().database == db)
            .expect("the follower");
        readers.push(tokio::spawn(async move {
            let mut rng = Rng(100 + r);
            // While the writers write, and at least 50 reads each however fast they were
            // (under load they may be done before a reader has read much).
            let mut reads = 0;
            while !done.load(SeqCst) || reads < 50 {
                reads += 1;
                let id = 1 + rng.below(2 * ROWS as usize) as i64;
                let before = checker.before(id, follower.applied());
                let got = value(&client, &format!("SELECT v FROM accounts WHERE id = {id}")).await;
                checker.judge(id, before, (!got.is_empty()).then(|| got.parse().unwrap()));
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    done.store(true, SeqCst);
    for r in readers {
        r.await.unwrap();
    }
    proxy.shutdown().await;
    checker
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_never_make_a_read_stale() {
    let checker = check_consistency("rows_concurrent", 0).await;
    assert!(checker.reads.load(SeqCst) > 100);
    assert_eq!(checker.stale.load(SeqCst), 0, "stale reads");
}

/// With four row counters nearly every row shares one: only more misses, never a stale read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colliding_row_counters_stay_correct() {
    let checker = check_consistency("rows_collisions", 4).await;
    assert!(checker.reads.load(SeqCst) > 100);
    assert_eq!(checker.stale.load(SeqCst), 0, "stale reads");
}

/// An entry read continuously across several TTLs is refreshed ahead of its expiry by one
/// query each time, while every other read is a hit: the key never misses after its first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_is_refreshed_before_it_expires() {
    const DB: &str = "rows_refresh";
    setup(DB).await;
    let mut config = config(Invalidation::Proxy);
    for rule in &mut config.cache.rules {
        // Each entry is refreshed by a read in the last half second of its second.
        rule.ttl = Duration::from_secs(1);
        rule.refresh_at = 0.5;
    }
    let proxy = start_pgmemo(config).await;
    let client = connect(&proxy_db_url(&proxy, DB)).await;
    let stats = || {
        proxy
            .app()
            .cache
            .rule_stats()
            .into_iter()
            .find(|r| r.name == "accounts")
            .unwrap()
    };
    let sql = "SELECT v FROM accounts WHERE id = 1";
    let start = Instant::now();
    let mut reads = 0u64;
    while start.elapsed() < Duration::from_millis(2600) {
        assert_eq!(value(&client, sql).await, "1");
        reads += 1;
    }
    let s = stats();
    let (misses, refreshes, stores) = (
        s.misses.get(),
        s.refreshes.load(SeqCst),
        s.stores.load(SeqCst),
    );
    assert_eq!(misses, 1, "only the first read missed ({reads} reads)");
    assert!(refreshes >= 2, "refreshed each TTL: {refreshes}");
    // Each refresh ran one query, whose result was stored.
    assert_eq!(stores, 1 + refreshes);
    assert_eq!(s.hits.get() + misses + refreshes, reads);
    let admin = admin_console(proxy.local_addr()).await;
    let row = admin_rows(&admin, "SHOW CACHE")
        .await
        .into_iter()
        .find(|r| r["rule"] == "accounts")
        .unwrap();
    assert_eq!(row["refreshes"], refreshes.to_string());
    proxy.shutdown().await;
}

/// What each group of `items` holds: the writer of a group writes `v = k` at its k-th write,
/// so the group's largest `v` is the last write to it; judged like [`Checker`], by group.
struct GroupChecker {
    committed: Vec<AtomicI64>,
    started: Vec<AtomicI64>,
    direct: Vec<std::sync::Mutex<Vec<(i64, pgmemo::wal::Lsn)>>>,
    stale: AtomicU64,
    reads: AtomicU64,
}

const GROUPS: usize = 4;

impl GroupChecker {
    fn before(&self, g: usize, applied: pgmemo::wal::Lsn) -> i64 {
        let direct = self.direct[g].lock().unwrap();
        let seen = direct
            .iter()
            .filter(|(_, lsn)| *lsn <= applied)
            .map(|(k, _)| *k);
        seen.max().unwrap_or(0).max(self.committed[g].load(SeqCst))
    }

    fn judge(&self, sql: &str, g: usize, before: i64, got: i64) {
        self.reads.fetch_add(1, SeqCst);
        let started = self.started[g].load(SeqCst);
        if got < before || got > started {
            eprintln!("stale: {sql} read {got} after {before} committed ({started} started)");
            self.stale.fetch_add(1, SeqCst);
        }
    }
}

/// One group's writer: updates of its rows' `v`, inserts of rows into it, deletes of its
/// row with the smallest `v` (never its largest), through `client` (`direct`: to PostgreSQL,
/// each commit noted with its WAL position).
async fn write_group(checker: Arc<GroupChecker>, client: Client, direct: bool, g: usize) {
    let mut rng = Rng(31 + g as u64);
    // (id, v) of the group's rows, as this writer made them.
    let mut rows: Vec<(i64, i64)> = vec![(g as i64 * 1000, 0), (g as i64 * 1000 + 1, 0)];
    let mut next_id = g as i64 * 1000 + 2;
    for k in 1..=200i64 {
        checker.started[g].store(k, SeqCst);
        let sql = match rng.below(10) {
            0..=4 => {
                let at = rng.below(rows.len());
                rows[at].1 = k;
                format!("UPDATE items SET v = {k} WHERE id = {}", rows[at].0)
            }
            5..=7 => {
                rows.push((next_id, k));
                next_id += 1;
                format!(
                    "INSERT INTO items (id, grp, v) VALUES ({}, {g}, {k})",
                    next_id - 1
                )
            }
            _ => {
                // The row with the smallest v goes, and v = k is set on another: the
                // group's largest is then k again.
                rows.sort_by_key(|r| r.1);
                let gone = rows.remove(0);
                let last = rows.len() - 1;
                rows[last].1 = k;
                format!(
                    "DELETE FROM items WHERE id = {}; UPDATE items SET v = {k} WHERE id = {}",
                    gone.0, rows[last].0
                )
            }
        };
        client.batch_execute(&sql).await.unwrap();
        if direct {
            let lsn = value(&client, "SELECT pg_current_wal_insert_lsn()").await;
            checker.direct[g]
                .lock()
                .unwrap()
                .push((k, lsn.parse().unwrap()));
        } else {
            checker.committed[g].store(k, SeqCst);
        }
        if rows.len() < 2 {
            rows.push((next_id, 0));
            let sql = format!("INSERT INTO items (id, grp, v) VALUES ({next_id}, {g}, 0)");
            next_id += 1;
            client.batch_execute(&sql).await.unwrap();
        }
    }
}

/// Readers read groups by value (`WHERE grp = $g`: an aggregate, and rows in key order)
/// while one writer per group writes, half through pgmemo, half directly (followed in the
/// WAL): every read is at least as new as what was committed before it was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_never_make_a_read_by_value_stale() {
    const DB: &str = "values_concurrent";
    fresh_db(DB).await;
    let mut schema = String::from("CREATE TABLE items (id int PRIMARY KEY, grp int, v int);");
    for g in 0..GROUPS {
        let id = g * 1000;
        schema += &format!(
            "INSERT INTO items VALUES ({id}, {g}, 0), ({}, {g}, 0);",
            id + 1
        );
    }
    tokio::task::spawn_blocking(move || cluster().psql(DB, &schema))
        .await
        .unwrap();
    let mut config = config(Invalidation::Wal);
    config.cache.rules = vec![cache_rule("items", "FROM items")];
    let proxy = start_pgmemo(config).await;
    let direct = connect(&direct_db_url(DB)).await;
    let first = connect(&proxy_db_url(&proxy, DB)).await;
    value(&first, "SELECT max(v) FROM items WHERE grp = 0").await;
    caught_up(&proxy, &direct, DB).await;
    let checker = Arc::new(GroupChecker {
        committed: (0..GROUPS).map(|_| AtomicI64::new(0)).collect(),
        started: (0..GROUPS).map(|_| AtomicI64::new(0)).collect(),
        direct: (0..GROUPS).map(|_| Default::default()).collect(),
        stale: AtomicU64::new(0),
        reads: AtomicU64::new(0),
    });
    let mut writers = Vec::new();
    for g in 0..GROUPS {
        let through = g % 2 == 1;
        let client = if through {
            connect(&proxy_db_url(&proxy, DB)).await
        } else {
            connect(&direct_db_url(DB)).await
        };
        writers.push(tokio::spawn(write_group(
            checker.clone(),
            client,
            !through,
            g,
        )));
    }
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut readers = Vec::new();
    for r in 0..3u64 {
        let client = connect(&proxy_db_url(&proxy, DB)).await;
        let (checker, done) = (checker.clone(), done.clone());
        let follower = proxy.app().wal.followers().into_iter();
        let follower = follower
            .into_iter()
            .find(|f| f.status().database == DB)
            .expect("the follower");
        readers.push(tokio::spawn(async move {
            let mut rng = Rng(200 + r);
            let mut reads = 0;
            while !done.load(SeqCst) || reads < 50 {
                reads += 1;
                let g = rng.below(GROUPS);
                let before = checker.before(g, follower.applied());
                let sql = match rng.below(3) {
                    0 => format!("SELECT max(v) FROM items WHERE grp = {g}"),
                    1 => format!("SELECT v FROM items WHERE grp = {g} ORDER BY id"),
                    // Its rows held by key (cache::columns::HeldRows): `v` followed by row.
                    _ => format!("SELECT v, id FROM items WHERE grp = {g} ORDER BY id"),
                };
                let got = value(&client, &sql).await;
                let max = got
                    .split(',')
                    .map(|v| v.parse::<i64>().unwrap())
                    .max()
                    .unwrap();
                checker.judge(&sql, g, before, max);
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    done.store(true, SeqCst);
    for r in readers {
        r.await.unwrap();
    }
    let hits = cache_hits(&proxy);
    proxy.shutdown().await;
    assert!(checker.reads.load(SeqCst) > 100);
    assert!(hits > 0, "no read was answered from the cache");
    assert_eq!(checker.stale.load(SeqCst), 0, "stale reads");
}

/// The schema of the random runs: posts read by key, by value (user, tag, likes), in order
/// and not, alone and joined with their users. The tables are never vacuumed or analyzed
/// meanwhile, so a read without ORDER BY keeps its plan and gives rows in the order the
/// writes left them, which a cached entry must follow too.
const RANDOM_SCHEMA: &str = "
    CREATE TABLE users (id int PRIMARY KEY, name text NOT NULL, team int NOT NULL)
        WITH (autovacuum_enabled = off);
    INSERT INTO users SELECT g, 'n' || g, g % 2 FROM generate_series(1, 5) g;
    CREATE TABLE posts (id serial PRIMARY KEY, user_id int NOT NULL, title text NOT NULL UNIQUE,
                        likes int NOT NULL, tag text) WITH (autovacuum_enabled = off);
    ALTER TABLE posts REPLICA IDENTITY FULL;
    INSERT INTO posts (user_id, title, likes, tag)
        SELECT 1 + g % 5, 'p' || g, g % 3, (ARRAY['a', 'b', NULL])[1 + g % 3]
        FROM generate_series(1, 14) g;
    SELECT setval('posts_id_seq', 100);
    CREATE FUNCTION bump(i int) RETURNS void LANGUAGE sql
        AS 'UPDATE posts SET likes = likes + 5 WHERE id = i';";

/// A statement of the random runs: its text and, for the extended protocol, its parameters
/// (none: sent as a simple query).
struct Statement {
    sql: String,
    params: Vec<Param>,
}

enum Param {
    Int(i32),
    Text(String),
}

impl Statement {
    fn simple(sql: String) -> Statement {
        Statement {
            sql,
            params: Vec::new(),
        }
    }

    fn extended(sql: &str, params: Vec<Param>) -> Statement {
        Statement {
            sql: sql.to_owned(),
            params,
        }
    }

    /// The same statement with a `nocache` hint: always run on the server.
    fn uncached(&self) -> Statement {
        Statement {
            sql: format!("/* pgmemo nocache */ {}", self.sql),
            params: self
                .params
                .iter()
                .map(|p| match p {
                    Param::Int(v) => Param::Int(*v),
                    Param::Text(v) => Param::Text(v.clone()),
                })
                .collect(),
        }
    }

    fn params(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
        self.params
            .iter()
            .map(|p| match p {
                Param::Int(v) => v as &(dyn tokio_postgres::types::ToSql + Sync),
                Param::Text(v) => v as &(dyn tokio_postgres::types::ToSql + Sync),
            })
            .collect()
    }

    /// Runs it through `client`: every row, each column as text (extended statements select
    /// text columns), rows joined by `;`; the error's text if it fails.
    async fn run(&self, client: &Client) -> String {
        if self.params.is_empty() {
            return match client.simple_query(&self.sql).await {
                Ok(messages) => messages
                    .iter()
                    .filter_map(|m| match m {
                        tokio_postgres::SimpleQueryMessage::Row(r) => Some(
                            (0..r.len())
                                .map(|c| r.get(c).unwrap_or("NULL"))
                                .collect::<Vec<_>>()
                                .join(","),
                        ),
                        _ => None,
                    })
                    .collect::<Vec<_>>()
                    .join(";"),
                Err(e) => format!("error: {e}"),
            };
        }
        match client.query(&self.sql, &self.params()).await {
            Ok(rows) => rows
                .iter()
                .map(|r| {
                    (0..r.len())
                        .map(|c| r.get::<_, Option<String>>(c).unwrap_or("NULL".into()))
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .collect::<Vec<_>>()
                .join(";"),
            Err(e) => format!("error: {e}"),
        }
    }
}

impl std::fmt::Debug for Statement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let params: Vec<String> = self
            .params
            .iter()
            .map(|p| match p {
                Param::Int(v) => v.to_string(),
                Param::Text(v) => format!("{v:?}"),
            })
            .collect();
        write!(f, "{} {params:?}", self.sql)
    }
}

/// One of the random run's reads, its holes filled from `rng`.
fn random_read(rng: &mut Rng) -> Statement {
    let u = 1 + rng.below(6);
    let l = rng.below(4);
    match rng.below(39) {
        // Reads whose results hold their rows by key (cache::columns::HeldRows), the last
        // three by `*` or a whole row (every column the catalog lists).
        36 => Statement::simple(format!(
            "SELECT * FROM posts WHERE user_id = {u} ORDER BY title"
        )),
        37 => Statement::simple(format!(
            "SELECT p.*, u.name FROM posts p JOIN users u ON u.id = p.user_id \
             WHERE p.user_id = {u} ORDER BY p.title"
        )),
        38 => Statement::simple(format!(
            "SELECT posts FROM posts WHERE user_id = {u} ORDER BY id"
        )),
        30 => Statement::simple(format!(
            "SELECT id, likes, tag FROM posts WHERE user_id = {u} ORDER BY title"
        )),
        31 => Statement::simple(format!(
            "SELECT p.id, p.likes, u.id, u.name FROM posts p JOIN users u ON u.id = p.user_id \
             WHERE p.user_id = {u} ORDER BY p.title"
        )),
        32 => Statement::simple(format!(
            "SELECT id, likes FROM posts WHERE user_id = {u} ORDER BY title LIMIT 2"
        )),
        33 => Statement::simple(format!(
            "SELECT id, likes AS l FROM posts WHERE user_id = {u} ORDER BY l, id LIMIT 2"
        )),
        34 => Statement::simple("SELECT id, likes FROM posts ORDER BY 2 DESC, 1 LIMIT 3".into()),
        35 => Statement::extended(
            "SELECT id::text, likes::text FROM posts WHERE user_id = $1 ORDER BY title",
            vec![Param::Int(u as i32)],
        ),
        24 => Statement::extended(
            "SELECT title FROM posts WHERE user_id = $1 ORDER BY title",
            vec![Param::Int(u as i32)],
        ),
        25 => Statement::extended(
            "SELECT count(*)::text FROM posts WHERE user_id = $1",
            vec![Param::Int(u as i32)],
        ),
        26 => Statement::extended(
            "SELECT id::text, likes::text FROM posts WHERE likes = $1",
            vec![Param::Int(l as i32)],
        ),
        27 => Statement::extended(
            "SELECT title, tag FROM posts WHERE user_id = $1 AND tag = $2 ORDER BY id",
            vec![Param::Int(u as i32), Param::Text(["a", "b"][l % 2].into())],
        ),
        _ => Statement::simple(random_simple_read(rng)),
    }
}

/// One of the random run's reads sent as simple queries.
fn random_simple_read(rng: &mut Rng) -> String {
    let u = 1 + rng.below(6);
    let v = 1 + rng.below(6);
    let i = 1 + rng.below(20);
    let l = rng.below(4);
    let t = ["a", "b", "c"][rng.below(3)];
    let team = rng.below(2);
    match rng.below(24) {
        0 => format!("SELECT title, likes FROM posts WHERE user_id = {u} ORDER BY title"),
        1 => format!("SELECT title FROM posts WHERE user_id = {u}"),
        2 => format!("SELECT count(*) FROM posts WHERE user_id = {u}"),
        3 => format!("SELECT sum(likes), max(likes) FROM posts WHERE user_id = {u}"),
        4 => format!("SELECT * FROM posts WHERE id = {i}"),
        5 => format!("SELECT title FROM posts WHERE tag = '{t}' ORDER BY id"),
        6 => format!("SELECT count(*) FROM posts WHERE tag = '{t}' AND user_id = {u}"),
        7 => format!(
            "SELECT p.title, u.name FROM posts p JOIN users u ON u.id = p.user_id \
             WHERE p.user_id = {u} ORDER BY p.title"
        ),
        8 => format!(
            "SELECT u.name, count(*) FROM users u JOIN posts p ON p.user_id = u.id \
             WHERE u.team = {team} GROUP BY u.name ORDER BY u.name"
        ),
        9 => format!("SELECT id, likes FROM posts WHERE likes = {l}"),
        10 => format!("SELECT id FROM posts WHERE user_id IN ({u}, {v}) ORDER BY id"),
        11 => format!(
            "SELECT title FROM posts WHERE user_id = {u} AND likes > {l} ORDER BY likes, id"
        ),
        12 => format!("SELECT name FROM users WHERE team = {team}"),
        13 => "SELECT count(*) FROM posts".to_owned(),
        14 => "SELECT title FROM posts ORDER BY likes DESC, id LIMIT 3".to_owned(),
        15 => format!("SELECT DISTINCT user_id FROM posts WHERE tag = '{t}' ORDER BY 1"),
        16 => format!(
            "SELECT p.id FROM posts p, users u WHERE p.user_id = u.id AND u.name = 'n{u}' \
             ORDER BY p.id"
        ),
        17 => format!("SELECT title FROM posts WHERE user_id = {u} ORDER BY id LIMIT 1"),
        18 => format!("SELECT min(title) FROM posts WHERE user_id = {u}"),
        19 => format!("SELECT likes, user_id FROM posts WHERE title = 'p{i}'"),
        20 => format!("SELECT id FROM posts WHERE user_id = {u} AND tag IS NULL"),
        21 => format!("SELECT id, title FROM posts WHERE user_id = '{u}' ORDER BY title"),
        22 => "SELECT user_id, count(*) FROM posts GROUP BY user_id ORDER BY user_id".to_owned(),
        _ => format!("SELECT u.name FROM users u WHERE u.id = {u}"),
    }
}

/// One of the random run's writes (`n` a number no title has yet).
fn random_write(rng: &mut Rng, n: usize) -> Statement {
    let u = 1 + rng.below(6) as i32;
    let i = 1 + rng.below(20) as i32;
    let l = rng.below(4) as i32;
    // Most writes change one row's shown columns, as an application's do; the broad ones
    // (a column every read filters by, a function, a whole table) would otherwise leave few
    // cached results for the narrow ones to test.
    if rng.chance(50) {
        return match rng.below(6) {
            0 | 1 => Statement::simple(format!(
                "UPDATE posts SET likes = likes + {} WHERE id = {i}",
                1 + l
            )),
            2 => Statement::extended(
                "UPDATE posts SET likes = $1 WHERE id = $2",
                vec![Param::Int(l * 10), Param::Int(i)],
            ),
            3 => Statement::simple(format!(
                "UPDATE posts SET tag = '{}' WHERE id = {i}",
                ["a", "b", "c"][l as usize % 3]
            )),
            4 => Statement::simple(format!("UPDATE users SET name = 'n{n}' WHERE id = {u}")),
            _ => Statement::simple(format!("DELETE FROM posts WHERE id = {i}")),
        };
    }
    match rng.below(34) {
        26 => Statement::extended(
            "UPDATE posts SET user_id = $1 WHERE id = $2",
            vec![Param::Int(u), Param::Int(i)],
        ),
        27 | 28 => Statement::extended(
            "INSERT INTO posts (user_id, title, likes) VALUES ($1, $2, $3)",
            vec![Param::Int(u), Param::Text(format!("p{n}")), Param::Int(l)],
        ),
        29 => Statement::extended(
            "DELETE FROM posts WHERE user_id = $1 AND likes = $2",
            vec![Param::Int(u), Param::Int(l)],
        ),
        30 => Statement::extended(
            "UPDATE posts SET tag = $1 WHERE id = $2",
            vec![
                Param::Text(["a", "b", "c"][l as usize % 3].into()),
                Param::Int(i),
            ],
        ),
        31 => Statement::simple(format!("SELECT bump({i})")),
        32 => Statement::simple(format!(
            "WITH moved AS (UPDATE posts SET user_id = {u} WHERE id = {i} RETURNING id) \
             SELECT count(*) FROM moved"
        )),
        _ => Statement::simple(random_simple_write(rng, n)),
    }
}

/// One of the random run's writes sent as simple queries.
fn random_simple_write(rng: &mut Rng, n: usize) -> String {
    let u = 1 + rng.below(6);
    let i = 1 + rng.below(20);
    let l = rng.below(4);
    let t = ["a", "b", "c"][rng.below(3)];
    let team = rng.below(2);
    match rng.below(26) {
        0 | 1 => format!("UPDATE posts SET likes = likes + 1 WHERE id = {i}"),
        2 => format!("UPDATE posts SET user_id = {u} WHERE id = {i}"),
        3 => format!("UPDATE posts SET tag = '{t}' WHERE id = {i}"),
        4 => format!("UPDATE posts SET tag = NULL WHERE user_id = {u}"),
        5 | 22 | 23 => format!(
            "INSERT INTO posts (user_id, title, likes, tag) VALUES ({u}, 'p{n}', {l}, '{t}')"
        ),
        6 | 24 => format!("INSERT INTO posts (user_id, title, likes) VALUES ({u}, 'p{n}', {l})"),
        7 => format!("DELETE FROM posts WHERE id = {i}"),
        8 => format!("DELETE FROM posts WHERE user_id = {u} AND likes > {l}"),
        9 => format!("UPDATE posts SET likes = 0 WHERE user_id = {u}"),
        10 => format!("UPDATE users SET name = 'n{n}' WHERE id = {u}"),
        11 => format!("UPDATE users SET team = {team} WHERE id = {u}"),
        12 => format!(
            "INSERT INTO users VALUES ({u}, 'n{u}', {team}) \
             ON CONFLICT (id) DO UPDATE SET name = excluded.name"
        ),
        13 => format!(
            "UPDATE posts p SET likes = p.likes + 1 FROM users u \
             WHERE u.id = p.user_id AND u.team = {team}"
        ),
        14 => format!(
            "INSERT INTO posts (user_id, title, likes) \
             SELECT user_id, title || 'c{n}', likes FROM posts WHERE id = {i}"
        ),
        15 => format!(
            "INSERT INTO posts (id, user_id, title, likes) VALUES ({i}, {u}, 'p{n}', 1) \
             ON CONFLICT (id) DO UPDATE SET likes = excluded.likes + 10, user_id = excluded.user_id"
        ),
        16 => format!("UPDATE posts SET title = 'p{n}' WHERE id = {i}"),
        17 => format!("DELETE FROM users WHERE id = {u}"),
        18 => format!("UPDATE posts SET likes = likes WHERE id = {i}"),
        19 => format!(
            "WITH moved AS (DELETE FROM posts WHERE id = {i} RETURNING *) \
             INSERT INTO posts SELECT * FROM moved"
        ),
        20 => format!("UPDATE posts SET user_id = user_id + 1 WHERE tag = '{t}'"),
        21 => format!("DELETE FROM posts WHERE title = 'p{i}'"),
        _ => format!("BEGIN; UPDATE posts SET likes = 7 WHERE user_id = {u}; ROLLBACK"),
    }
}

/// A random run of reads and writes, one at a time: every read through pgmemo equals
/// PostgreSQL's answer to it at that moment. Writes go through pgmemo (`wal`: false, two
/// clients, the reader's own among them) or directly, followed in the WAL. Returns the hits,
/// and those of extended-protocol reads.
async fn random_run(
    db: &'static str,
    wal: Option<WalPlugin>,
    seed: u64,
    steps: usize,
) -> (u64, u64) {
    fresh_db(db).await;
    tokio::task::spawn_blocking(move || cluster().psql(db, RANDOM_SCHEMA))
        .await
        .unwrap();
    let mut config = config(if wal.is_some() {
        Invalidation::Wal
    } else {
        Invalidation::Proxy
    });
    if let Some(plugin) = wal {
        config.cache.wal_plugin = plugin;
    }
    config.cache.rules = vec![
        cache_rule("posts", "FROM posts"),
        cache_rule("users", "FROM users"),
    ];
    let proxy = start_pgmemo(config).await;
    let reader = connect(&proxy_db_url(&proxy, db)).await;
    let writer = connect(&proxy_db_url(&proxy, db)).await;
    let direct = connect(&direct_db_url(db)).await;
    value(&reader, "SELECT count(*) FROM posts").await;
    caught_up(&proxy, &direct, db).await;
    let mut rng = Rng(seed);
    // The reads come from a set small enough to repeat, as an application's do.
    let reads: Vec<Statement> = (0..40).map(|_| random_read(&mut rng)).collect();
    let mut writes: Vec<Statement> = Vec::new();
    let (mut hits_seen, mut extended_hits) = (0, 0);
    for step in 0..steps {
        if rng.chance(5) {
            // A transaction block of the reader's: its reads after its own write are what
            // the same reads give on its server in that transaction (sent with `nocache`);
            // before any write, or in a block of reads only, what PostgreSQL gives anyone.
            reader.batch_execute("BEGIN").await.unwrap();
            let mut wrote = false;
            for _ in 0..4 {
                if rng.chance(30) {
                    let write = random_write(&mut rng, 1000 + step);
                    write.run(&reader).await;
                    writes.push(write);
                    wrote = true;
                    continue;
                }
                let read = &reads[rng.below(reads.len())];
                let got = read.run(&reader).await;
                let want = if wrote {
                    read.uncached().run(&reader).await
                } else {
                    read.run(&direct).await
                };
                if got != want {
                    let recent = &writes[writes.len().saturating_sub(8)..];
                    panic!(
                        "step {step} (seed {seed}, {db}), in a block: {read:?}\n \
                         through pgmemo: {got}\n PostgreSQL:    {want}\n \
                         after the writes (last 8): {recent:#?}"
                    );
                }
            }
            let end = if rng.chance(50) { "COMMIT" } else { "ROLLBACK" };
            reader.batch_execute(end).await.unwrap();
            if wal.is_some() {
                caught_up(&proxy, &direct, db).await;
            }
            continue;
        }
        if rng.chance(25) {
            let write = random_write(&mut rng, 1000 + step);
            let through = match (wal.is_some(), rng.chance(50)) {
                (true, _) => &direct,
                (false, true) => &reader,
                (false, false) => &writer,
            };
            // A write may fail (a key or title taken): PostgreSQL's answer either way.
            write.run(through).await;
            if wal.is_some() {
                caught_up(&proxy, &direct, db).await;
            }
            writes.push(write);
            continue;
        }
        let read = &reads[rng.below(reads.len())];
        let before = cache_hits(&proxy);
        let got = read.run(&reader).await;
        let hit = cache_hits(&proxy) > before;
        hits_seen += u64::from(hit);
        extended_hits += u64::from(hit && !read.params.is_empty());
        let want = read.run(&direct).await;
        if got != want {
            let recent = &writes[writes.len().saturating_sub(8)..];
            panic!(
                "step {step} (seed {seed}, {db}): {read:?}\n through pgmemo: {got}\n \
                 PostgreSQL:    {want}\n after the writes (last 8): {recent:#?}"
            );
        }
    }
    let held: u64 = row_figures(&proxy).await["held_fills"].parse().unwrap();
    proxy.shutdown().await;
    eprintln!(
        "{db}: seed {seed:#x}, {hits_seen} hits, {extended_hits} of extended reads, \
         {held} results stored by the rows they hold"
    );
    assert!(held > 0, "no result was stored by the rows it holds");
    (hits_seen, extended_hits)
}

/// More seeds by hand: `PGMEMO_RANDOM_SEEDS=FIRST..END` runs those instead of the random
/// tests' own (each in its own database), e.g. after a change to what reads depend on.
fn more_seeds() -> Option<std::ops::Range<u64>> {
    let range = std::env::var("PGMEMO_RANDOM_SEEDS").ok()?;
    let (first, end) = range
        .split_once("..")
        .expect("PGMEMO_RANDOM_SEEDS=FIRST..END");
    Some(first.parse().expect("a seed")..end.parse().expect("a seed"))
}

/// Random writes of every kind the cache attributes (by key, by value, by column, joined,
/// rolled back, writable CTEs, ON CONFLICT) between cached reads of every kind it keeps apart:
/// no read is ever answered with what PostgreSQL would not answer, and the reads still hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_writes_never_leave_a_cached_read_stale() {
    let mut extended_hits = 0;
    let mut runs = vec![
        ("rows_random_1", 0x5eed_0001),
        ("rows_random_2", 0x5eed_0002),
        ("rows_random_3", 0x5eed_0005),
        ("rows_random_4", 0x5eed_0006),
    ];
    if let Some(seeds) = more_seeds() {
        runs = seeds
            .map(|seed| (&*format!("rows_random_s{seed}").leak(), 0x5eed_0000 + seed))
            .collect();
    }
    for (db, seed) in runs {
        let (hits, extended) = random_run(db, None, seed, 1500).await;
        assert!(
            hits > 100,
            "only {hits} hits in {db}: the run did not test the cache"
        );
        extended_hits += extended;
    }
    assert!(extended_hits > 20, "{extended_hits} hits of extended reads");
}

/// The same, with the writes made directly and followed in the WAL by test_decoding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_writes_in_the_wal_never_leave_a_cached_read_stale() {
    random_wal_runs(WalPlugin::TestDecoding, ("rows_random_text", 0x5eed_0003)).await;
}

/// The same, followed by pgoutput (a test of its own: the two run side by side).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_writes_in_the_wal_never_leave_a_cached_read_stale_pgoutput() {
    random_wal_runs(WalPlugin::Pgoutput, ("rows_random_pgoutput", 0x5eed_0004)).await;
}

/// The random runs of the WAL tests with `plugin`: the one given, or those of the seeds asked
/// for that fall to this decoder (even seeds test_decoding, odd pgoutput).
async fn random_wal_runs(plugin: WalPlugin, default: (&'static str, u64)) {
    let mut runs = vec![default];
    if let Some(seeds) = more_seeds() {
        runs = seeds
            .filter(|seed| {
                [WalPlugin::TestDecoding, WalPlugin::Pgoutput][*seed as usize % 2] == plugin
            })
            .map(|seed| (&*format!("rows_random_w{seed}").leak(), 0x5eed_0000 + seed))
            .collect();
    }
    for (db, seed) in runs {
        let (hits, _) = random_run(db, Some(plugin), seed, 600).await;
        assert!(
            hits > 50,
            "only {hits} hits in {db}: the run did not test the cache"
        );
    }
}
