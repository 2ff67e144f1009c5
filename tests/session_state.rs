//! Session state in transaction mode: several clients interleave their transactions on a pool
//! of one or two servers through pgmemo, and each client's transcript must equal what the same
//! client gets on a dedicated PostgreSQL session (the same steps, in the same order, each
//! client on its own direct connection). Settings, roles and search_path are carried per
//! client; temporary tables, LISTEN, advisory locks and WITH HOLD cursors pin the client to
//! its server until they are gone; nothing of one client is ever seen by another.
//!
//! Every query runs under a timeout: a client waiting for a server that a pinned client never
//! gives back shows up as `TIMEOUT` in its transcript, which then differs from PostgreSQL's.

mod common;

use common::*;
use pgmemo::config::PoolMode;
use std::time::Duration;
use tokio_postgres::{Client, SimpleQueryMessage};

const DB: &str = "session_state";

/// What one statement returned, as text: its rows, or its error.
async fn outcome(client: &Client, sql: &str) -> String {
    outcome_within(client, sql, Duration::from_secs(10)).await
}

/// One statement through the extended protocol (Parse/Bind/Execute/Sync, as tokio-postgres
/// sends it); its columns must be text.
async fn extended(client: &Client, sql: &str) -> String {
    rendered(client.query(sql, &[]).await)
}

fn rendered(result: Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>) -> String {
    match result {
        Err(e) => match e.as_db_error() {
            // tokio-postgres numbers its statements across the process (a DISCARD ALL
            // pipelined before one drops it).
            Some(db) => format!(
                "ERROR {}: {}",
                db.code().code(),
                statement_numbers_hidden(db.message())
            ),
            None => format!("ERROR {e}"),
        },
        Ok(rows) => rows
            .iter()
            .map(|r| {
                (0..r.len())
                    .map(|i| {
                        r.get::<_, Option<String>>(i)
                            .unwrap_or_else(|| "NULL".into())
                    })
                    .collect::<Vec<_>>()
                    .join("|")
            })
            .collect::<Vec<_>>()
            .join(" "),
    }
}

/// `text` with tokio-postgres's statement names (`"s123"`) as `"sN"`.
fn statement_numbers_hidden(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("\"s") {
        out.push_str(&rest[..at + 2]);
        rest = &rest[at + 2..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits > 0 && rest[digits..].starts_with('"') {
            out.push('N');
            rest = &rest[digits..];
        }
    }
    out.push_str(rest);
    out
}

/// `sql` as a step: `x:` runs it through the extended protocol, `p:` runs its statements
/// (separated by ` ;; `) through the extended protocol pipelined (each Bind/Execute with its
/// Sync, all sent before the first reply is read), anything else is a simple query.
async fn step(client: &Client, sql: &str, limit: Duration) -> String {
    let run = async {
        if let Some(one) = sql.strip_prefix("x:") {
            extended(client, one).await
        } else if let Some(many) = sql.strip_prefix("p:") {
            // Prepared one by one first: tokio-postgres sends a statement's Bind when its own
            // Parse is answered, so pipelined prepares would leave the order of execution to
            // timing. Then all Bind/Execute/Sync in one go, in order.
            let mut prepared = Vec::new();
            for text in many.split(" ;; ") {
                prepared.push(client.prepare(text).await.map_err(|e| rendered(Err(e))));
            }
            let runs = prepared.iter().map(|p| async move {
                match p {
                    Ok(statement) => rendered(client.query(statement, &[]).await),
                    Err(failed) => failed.clone(),
                }
            });
            futures_util::future::join_all(runs).await.join(" / ")
        } else {
            simple(client, sql).await
        }
    };
    tokio::time::timeout(limit, run)
        .await
        .unwrap_or_else(|_| "TIMEOUT".into())
}

async fn outcome_within(client: &Client, sql: &str, limit: Duration) -> String {
    step(client, sql, limit).await
}

async fn simple(client: &Client, sql: &str) -> String {
    match tokio::time::timeout(Duration::from_secs(3600), client.simple_query(sql)).await {
        Err(_) => "TIMEOUT".into(),
        Ok(Err(e)) => match e.as_db_error() {
            Some(db) => format!("ERROR {}: {}", db.code().code(), db.message()),
            None => format!("ERROR {e}"),
        },
        Ok(Ok(messages)) => messages
            .iter()
            .map(|m| match m {
                SimpleQueryMessage::Row(r) => (0..r.len())
                    .map(|i| r.get(i).unwrap_or("NULL").to_owned())
                    .collect::<Vec<_>>()
                    .join("|"),
                SimpleQueryMessage::CommandComplete(n) => format!("({n})"),
                _ => String::new(),
            })
            .filter(|piece| !piece.is_empty())
            .collect::<Vec<_>>()
            .join(" "),
    }
}

/// Runs `steps` (client index, SQL) in order over `clients`; returns each client's
/// transcript.
async fn run(clients: &[Client], steps: &[(usize, &str)]) -> Vec<Vec<String>> {
    let mut transcripts = vec![Vec::new(); clients.len()];
    for (i, sql) in steps {
        let out = outcome(&clients[*i], sql).await;
        transcripts[*i].push(format!("{sql} => {out}"));
    }
    transcripts
}

async fn clients(url: &str, n: usize) -> Vec<Client> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(connect(url).await);
    }
    out
}

fn direct_url() -> String {
    cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), DB)
}

/// The steps on dedicated PostgreSQL sessions, then through pgmemo in transaction mode with a
/// pool of `pool_size`: the transcripts must be the same.
async fn same_as_dedicated_sessions(name: &str, pool_size: u32, n: usize, steps: &[(usize, &str)]) {
    let direct = run(&clients(&direct_url(), n).await, steps).await;
    let proxy = pgmemo(PoolMode::Transaction, pool_size).await;
    let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), DB);
    let proxied = run(&clients(&url, n).await, steps).await;
    for (i, (d, p)) in direct.iter().zip(&proxied).enumerate() {
        assert_eq!(d, p, "{name}: client {i} differs from a dedicated session");
    }
}

static SETUP: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

async fn setup() {
    SETUP
        .get_or_init(|| async {
            fresh_db(DB).await;
            tokio::task::spawn_blocking(|| {
                cluster().psql(
                    DB,
                    "DO $$ BEGIN
                       IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'tenant_a') THEN
                         CREATE ROLE tenant_a; CREATE ROLE tenant_b;
                       END IF; END $$;
                     CREATE SCHEMA tenant_a; CREATE SCHEMA tenant_b;
                     CREATE TABLE tenant_a.accounts (owner text); INSERT INTO tenant_a.accounts VALUES ('a');
                     CREATE TABLE tenant_b.accounts (owner text); INSERT INTO tenant_b.accounts VALUES ('b');
                     GRANT USAGE ON SCHEMA tenant_a TO tenant_a; GRANT SELECT ON tenant_a.accounts TO tenant_a;
                     GRANT USAGE ON SCHEMA tenant_b TO tenant_b; GRANT SELECT ON tenant_b.accounts TO tenant_b;",
                );
            })
            .await
            .unwrap();
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_follow_the_client() {
    setup().await;
    let steps: &[(usize, &str)] = &[
        (0, "SET work_mem = '1MB'"),
        (1, "SHOW work_mem"),
        (0, "SHOW work_mem"),
        (1, "SET statement_timeout = '7s'"),
        (0, "SHOW statement_timeout"),
        (1, "SHOW statement_timeout"),
        // Rolled back, failed: nothing recorded.
        (0, "BEGIN; SET statement_timeout = '5s'; ROLLBACK"),
        (0, "SHOW statement_timeout"),
        // (One simple query is one implicit transaction: the error rolls the SET back.)
        (0, "SET work_mem = '9MB'; SELECT 1/0"),
        (0, "BEGIN; SET work_mem = '8MB'; SELECT 1/0"),
        (0, "ROLLBACK"),
        (0, "SHOW work_mem"),
        (0, "SET LOCAL work_mem = '4MB'"),
        (0, "SHOW work_mem"),
        // In a multi-statement query, committed at its end.
        (1, "SET work_mem = '2MB'; SELECT 1"),
        (0, "SHOW work_mem"),
        (1, "SHOW work_mem"),
        (0, "SELECT pg_catalog.set_config('work_mem', '3MB', false)"),
        (1, "SHOW work_mem"),
        (0, "SHOW work_mem"),
        (
            0,
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE",
        ),
        (1, "SHOW transaction_isolation"),
        (0, "SHOW transaction_isolation"),
        (0, "SET application_name = 'client0'"),
        (1, "SHOW application_name"),
        // Custom settings (placeholders, not listed in pg_settings). A placeholder another
        // client's session made reads '' rather than NULL after its RESET: coalesced.
        (0, "SET app.tenant = 'zero'"),
        (
            1,
            "SELECT coalesce(current_setting('app.tenant', true), '')",
        ),
        (1, "SELECT set_config('app.tenant', 'one', false)"),
        (0, "SELECT current_setting('app.tenant')"),
        (1, "SELECT current_setting('app.tenant')"),
        (0, "BEGIN; SET app.tenant = 'rolled back'; ROLLBACK"),
        (0, "SELECT current_setting('app.tenant')"),
        (0, "RESET ALL"),
        (0, "SHOW work_mem"),
        (0, "SHOW transaction_isolation"),
        (1, "SHOW statement_timeout"),
        (1, "DISCARD ALL"),
        (1, "SHOW work_mem"),
        (1, "SHOW statement_timeout"),
    ];
    same_as_dedicated_sessions("settings", 1, 2, steps).await;
}

/// The same through the extended protocol, one statement at a time and pipelined (several
/// Parse/Bind/Execute/Sync sent before the first reply), committed, in a block, rolled back
/// and failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_follow_the_client_through_the_extended_protocol() {
    setup().await;
    let steps: &[(usize, &str)] = &[
        (0, "x:SET work_mem = '3MB'"),
        (1, "x:SHOW work_mem"),
        (0, "x:SHOW work_mem"),
        (1, "p:SET statement_timeout = '9s' ;; SHOW statement_timeout ;; SELECT pg_catalog.set_config('my.x', 'one', false)"),
        (0, "p:SHOW statement_timeout ;; SELECT coalesce(current_setting('my.x', true), '')"),
        (1, "p:SHOW statement_timeout ;; SELECT coalesce(current_setting('my.x', true), '')"),
        // A failure in a pipeline fails its own implicit transaction only.
        (0, "p:SET work_mem = '5MB' ;; SELECT (1/0)::text ;; SHOW work_mem"),
        (1, "x:SHOW work_mem"),
        (0, "x:SHOW work_mem"),
        // In a block: rolled back, then committed.
        (0, "x:BEGIN"),
        (0, "x:SET search_path = tenant_a"),
        (0, "x:SELECT owner FROM accounts"),
        (0, "x:ROLLBACK"),
        (0, "x:SHOW search_path"),
        (0, "p:BEGIN ;; SET ROLE tenant_b ;; SET search_path = tenant_b ;; COMMIT"),
        (1, "x:SELECT current_user::text, current_setting('search_path')"),
        (0, "x:SELECT current_user::text, owner FROM accounts"),
        (1, "x:SET SESSION AUTHORIZATION tenant_a"),
        (0, "x:SELECT current_user::text, session_user::text"),
        (1, "x:SELECT current_user::text, session_user::text"),
        (0, "p:RESET ROLE ;; RESET ALL ;; SHOW work_mem ;; SHOW search_path"),
        (1, "x:RESET SESSION AUTHORIZATION"),
        (1, "x:SELECT current_user::text, current_setting('work_mem')"),
        (0, "x:SELECT current_user::text, current_setting('statement_timeout')"),
    ];
    same_as_dedicated_sessions("extended settings", 1, 2, steps).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_and_search_path_never_leak_between_tenants() {
    setup().await;
    let steps: &[(usize, &str)] = &[
        (0, "SET ROLE tenant_a"),
        (1, "SELECT current_user"),
        (0, "SELECT current_user, session_user"),
        (1, "SET ROLE tenant_b"),
        (0, "SELECT owner FROM tenant_b.accounts"),
        (1, "SELECT owner FROM tenant_b.accounts"),
        (1, "SELECT owner FROM tenant_a.accounts"),
        (2, "SELECT current_user"),
        (0, "SET search_path = tenant_a"),
        (1, "SET search_path = tenant_b"),
        (0, "SELECT owner FROM accounts"),
        (1, "SELECT owner FROM accounts"),
        (2, "SELECT current_user, current_setting('search_path')"),
        (0, "BEGIN; SET ROLE tenant_b; ROLLBACK"),
        (0, "SELECT current_user"),
        (0, "RESET ROLE"),
        (1, "SET SESSION AUTHORIZATION tenant_a"),
        (0, "SELECT current_user, session_user"),
        (1, "SELECT current_user, session_user"),
        (2, "SELECT current_user, session_user"),
        (1, "SET SESSION AUTHORIZATION DEFAULT"),
        (
            1,
            "SELECT current_user, session_user, current_setting('search_path')",
        ),
    ];
    same_as_dedicated_sessions("roles", 1, 3, steps).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn temporary_tables_pin_their_client() {
    setup().await;
    let steps: &[(usize, &str)] = &[
        (0, "CREATE TEMP TABLE scratch (a int)"),
        (0, "INSERT INTO scratch VALUES (1)"),
        (1, "CREATE TEMP TABLE scratch (a int)"),
        (1, "INSERT INTO scratch VALUES (2), (3)"),
        (0, "SELECT a FROM scratch ORDER BY a"),
        (1, "SELECT a FROM scratch ORDER BY a"),
        (0, "DROP TABLE scratch"),
        (
            0,
            "SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()",
        ),
        // ON COMMIT DROP leaves nothing behind: no pin.
        (
            0,
            "BEGIN; CREATE TEMP TABLE gone (a int) ON COMMIT DROP; COMMIT",
        ),
        (1, "DISCARD TEMP"),
        (
            2,
            "SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()",
        ),
        (2, "SELECT 1"),
        (0, "SELECT 2"),
    ];
    // Two servers: while clients 0 and 1 are pinned client 2 has none, and waits until one
    // of them lets go.
    same_as_dedicated_sessions("temp tables", 2, 3, steps).await;
}

/// Not only tables and functions: any object in the session's temporary schema (a domain, a
/// collation, an operator, a statistics object, ...) is per-backend state and pins its
/// client (pg_regress' `domain` and `collate` make such objects). Client 2's block takes the
/// other server while client 0 is pinned; were client 0 not, it would find its objects gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_temporary_object_pins_its_client() {
    setup().await;
    let steps: &[(usize, &str)] = &[
        (0, "CREATE DOMAIN pg_temp.pos AS int CHECK (VALUE > 0)"),
        (2, "BEGIN"),
        (2, "SELECT 1"),
        (0, "SELECT 5::pg_temp.pos"),
        (0, "SELECT (-5)::pg_temp.pos"),
        (2, "COMMIT"),
        (
            0,
            "CREATE COLLATION pg_temp.bytes (provider = libc, locale = 'C')",
        ),
        (0, "DROP DOMAIN pg_temp.pos"),
        (2, "BEGIN"),
        (2, "SELECT 2"),
        (0, "SELECT 'a' < 'B' COLLATE pg_temp.bytes"),
        (2, "COMMIT"),
        (0, "DROP COLLATION pg_temp.bytes"),
        (1, "SELECT 3"),
        (2, "SELECT 4"),
    ];
    same_as_dedicated_sessions("temporary objects", 2, 3, steps).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_locks_and_held_cursors_pin_their_client() {
    setup().await;
    let steps: &[(usize, &str)] = &[
        (0, "SELECT pg_advisory_lock(4242)"),
        (1, "SELECT pg_try_advisory_lock(4242)"),
        (0, "SELECT pg_try_advisory_lock(4242)"),
        (
            0,
            "SELECT pg_advisory_unlock(4242), pg_advisory_unlock(4242)",
        ),
        (1, "SELECT pg_try_advisory_lock(4242)"),
        (1, "SELECT pg_advisory_unlock_all()"),
        (0, "SELECT pg_try_advisory_xact_lock(4242)"),
        // Taken with pg_try_advisory_lock alone: it pins too.
        (1, "SELECT pg_try_advisory_lock(555)"),
        (0, "SELECT pg_try_advisory_lock(555)"),
        (1, "SELECT pg_try_advisory_lock(555)"),
        (0, "SELECT pg_try_advisory_lock(555)"),
        (1, "SELECT pg_advisory_unlock(555), pg_advisory_unlock(555)"),
        (0, "SELECT pg_try_advisory_lock(555)"),
        (0, "SELECT pg_advisory_unlock(555)"),
        (
            0,
            "DECLARE c CURSOR WITH HOLD FOR SELECT g FROM generate_series(1, 5) g",
        ),
        (0, "FETCH 2 FROM c"),
        (1, "SELECT name FROM pg_cursors"),
        (0, "FETCH 2 FROM c"),
        (0, "CLOSE c"),
        (1, "SELECT 1"),
    ];
    same_as_dedicated_sessions("advisory locks and cursors", 2, 2, steps).await;
}

/// A pinned client that goes away leaves a clean server: the next client on a pool of one
/// finds no temporary table, no lock, no setting, no role of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_client_that_leaves_leaves_nothing_behind() {
    leaves_nothing_behind(test_config(PoolMode::Transaction, 1)).await;
}

/// The same without prepared statements and with no server_reset_query: the cleaning of a
/// pinned client's server does not depend on them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_client_leaves_nothing_behind_whatever_the_reset_query() {
    let mut config = test_config(PoolMode::Transaction, 1);
    config.general.prepared_statements = false;
    config.general.server_reset_query = String::new();
    leaves_nothing_behind(config).await;
}

async fn leaves_nothing_behind(config: pgmemo::config::Config) {
    setup().await;
    let proxy = start_pgmemo(config).await;
    let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), DB);
    let (first, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    for sql in [
        "CREATE TEMP TABLE mine (a int)",
        "SELECT pg_advisory_lock(77)",
        "SET work_mem = '5MB'",
        "SET ROLE tenant_a",
        "LISTEN somewhere",
    ] {
        first.simple_query(sql).await.unwrap();
    }
    // Killed: the socket closes without a Terminate.
    task.abort();
    drop(first);
    let second = connect(&url).await;
    let seen = outcome(
        &second,
        "SELECT (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()), \
         (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()), \
         current_setting('work_mem'), current_user, (SELECT count(*) FROM pg_listening_channels())",
    )
    .await;
    assert_eq!(seen, format!("0|0|4MB|{PGMEMO_USER}|0 (1)"));
}

/// LISTEN works in transaction mode: the listening client keeps its server and gets
/// notifications sent by others between its transactions, and its own NOTIFY carries the
/// process ID pgmemo gave it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_notify_in_transaction_mode() {
    setup().await;
    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    let addr = proxy.local_addr();
    let mut listener = RawClient::connect(addr, PGMEMO_USER, DB, Some(PGMEMO_PASS), &[])
        .await
        .unwrap();
    let (own_pid, _) = listener.backend_key().unwrap();
    listener
        .send(&[Frontend::query("LISTEN jobs")])
        .await
        .unwrap();
    listener.recv_until_ready(1).await.unwrap();
    let url = proxy_url(addr, PGMEMO_USER, Some(PGMEMO_PASS), DB);
    // The admin console shows the pin and counts it. (The client has its ReadyForQuery
    // before pgmemo's own check of the session, which records the pin: wait for that.)
    let admin = admin_console(addr).await;
    wait_until(
        "the LISTEN pin in SHOW CLIENTS",
        Duration::from_secs(10),
        || async {
            admin_rows(&admin, "SHOW CLIENTS")
                .await
                .iter()
                .any(|r| r["pinned"] == "listen")
        },
    )
    .await;
    let pools = admin_rows(&admin, "SHOW POOLS").await;
    assert!(
        pools
            .iter()
            .any(|r| r["database"] == DB && r["cl_pinned"] == "1"),
        "{pools:?}"
    );
    let stats = admin_rows(&admin, "SHOW STATS").await;
    assert!(
        stats
            .iter()
            .any(|r| r["database"] == DB && r["pins"] == "1"),
        "{stats:?}"
    );
    // The pinned client's transactions are counted although its server never goes back.
    let xacts = || async {
        admin_rows(&admin, "SHOW STATS")
            .await
            .iter()
            .find(|r| r["database"] == DB)
            .map_or(0, |r| r["total_xact_count"].parse::<u64>().unwrap())
    };
    wait_until(
        "the LISTEN transaction counted",
        Duration::from_secs(10),
        || async { xacts().await >= 1 },
    )
    .await;
    let before = xacts().await;
    for _ in 0..3 {
        listener.send(&[Frontend::query("SELECT 1")]).await.unwrap();
        listener.recv_until_ready(1).await.unwrap();
    }
    wait_until(
        "three more transactions counted",
        Duration::from_secs(10),
        || async { xacts().await == before + 3 },
    )
    .await;
    // Another client's NOTIFY carries the process ID pgmemo gave that client, as drivers'
    // tests compare it (psycopg2's test_notify: the notifier prints its backend_pid and
    // leaves at once), however it notifies; a session connected to PostgreSQL directly, its
    // own process ID.
    for (i, (through_pgmemo, notify)) in [
        (true, "NOTIFY jobs, 'from another client 0'"),
        (true, "SELECT pg_notify('jobs', 'from another client 1')"),
        (false, "NOTIFY jobs, 'from another client 2'"),
    ]
    .into_iter()
    .enumerate()
    {
        let at = if through_pgmemo {
            addr
        } else {
            cluster().addr()
        };
        let mut notifier = RawClient::connect(at, PGMEMO_USER, DB, Some(PGMEMO_PASS), &[])
            .await
            .unwrap();
        let (notifier_pid, _) = notifier.backend_key().unwrap();
        notifier.send(&[Frontend::query(notify)]).await.unwrap();
        notifier.recv_until_ready(1).await.unwrap();
        let _ = notifier.terminate().await;
        let notification = listener.recv_until_tag(b'A').await.unwrap();
        let notification = notification.last().unwrap();
        assert!(
            String::from_utf8_lossy(&notification.body)
                .contains(&format!("from another client {i}")),
            "{notification:?}"
        );
        let other_pid = i32::from_be_bytes(notification.body[..4].try_into().unwrap());
        assert_eq!(
            other_pid, notifier_pid,
            "{notify}: the notifier's process ID"
        );
        assert_ne!(other_pid, own_pid);
    }
    let other = connect(&url).await;
    // Its own NOTIFY: the notification comes with the query's replies.
    listener
        .send(&[Frontend::query("NOTIFY jobs, 'mine'")])
        .await
        .unwrap();
    let replies = listener.recv_until_ready(1).await.unwrap();
    let mine = replies
        .iter()
        .find(|m| m.tag == b'A')
        .expect("own notification");
    assert_eq!(
        i32::from_be_bytes(mine.body[..4].try_into().unwrap()),
        own_pid
    );
    // While it listens it keeps one of the two servers: with the other held by an open
    // transaction, a third client gets none.
    let third = connect(&url).await;
    other.simple_query("BEGIN").await.unwrap();
    // (Bounded by a timeout: it waits for a server that is not given back.)
    assert_eq!(
        outcome_within(&third, "SELECT 3", Duration::from_secs(2)).await,
        "TIMEOUT"
    );
    // UNLISTEN * unpins: the listener's server is free for the third client.
    listener
        .send(&[Frontend::query("UNLISTEN *")])
        .await
        .unwrap();
    listener.recv_until_ready(1).await.unwrap();
    let third = connect(&url).await;
    assert_eq!(outcome(&third, "SELECT 3").await, "3 (1)");
    other.simple_query("COMMIT").await.unwrap();
    let _ = listener.terminate().await;
}

/// `pin_session_state = false` keeps PgBouncer's behaviour: a temporary table stays on the
/// server, where the next client finds it, and nothing is pinned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pin_session_state_off_is_pgbouncers_behaviour() {
    setup().await;
    let mut config = test_config(PoolMode::Transaction, 1);
    config.general.pin_session_state = false;
    let proxy = start_pgmemo(config).await;
    let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), DB);
    let (a, b) = (connect(&url).await, connect(&url).await);
    assert_eq!(
        outcome(&a, "CREATE TEMP TABLE left_behind (x int)").await,
        "(0)"
    );
    assert_eq!(
        outcome(&b, "SELECT count(*) FROM left_behind").await,
        "0 (1)"
    );
    assert_eq!(outcome(&b, "DISCARD ALL").await, "(0)");
}

/// What the clients of [`session_mode_statements_are_each_clients_own`] see: each its own
/// temporary table through a statement of the text the other prepares too, and the statements
/// (names and texts) its session holds.
async fn own_statements_transcript(url: &str) -> Vec<String> {
    let (a, b) = (connect(url).await, connect(url).await);
    a.batch_execute("CREATE TEMP TABLE own_t (v bool); INSERT INTO own_t VALUES (true)")
        .await
        .unwrap();
    b.batch_execute("CREATE TEMP TABLE own_t (v int); INSERT INTO own_t VALUES (7)")
        .await
        .unwrap();
    let mut out = Vec::new();
    for (name, client) in [("a", &a), ("b", &b), ("a", &a)] {
        let value = match client.prepare("SELECT v::text FROM own_t").await {
            Ok(statement) => match client.query_one(&statement, &[]).await {
                Ok(row) => row.get::<_, String>(0),
                Err(e) => format!("ERROR {e}"),
            },
            Err(e) => format!("ERROR {e}"),
        };
        let held: Vec<String> = client
            .query(
                // tokio-postgres numbers its statements across the process.
                "SELECT regexp_replace(name, '[0-9]+$', 'N') || ': ' || statement \
                 FROM pg_catalog.pg_prepared_statements ORDER BY 1",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        out.push(format!("{name}: {value}; holds {held:?}"));
    }
    out
}

/// Session mode behaves as a direct connection: a client's prepared statements go to its own
/// server under its own names, so the same text means its own temporary table, and
/// `pg_prepared_statements` shows exactly the client's statements (`session_shared_statements`
/// off, the default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_statements_are_each_clients_own() {
    setup().await;
    let direct = own_statements_transcript(&direct_url()).await;
    assert!(direct[1].starts_with("b: 7;"), "{direct:?}");
    let proxy = pgmemo(PoolMode::Session, 2).await;
    let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), DB);
    assert_eq!(own_statements_transcript(&url).await, direct);
    proxy.shutdown().await;
}

/// Session mode: the process ID in a client's BackendKeyData is its server's own, so
/// `pg_backend_pid()` and its own notifications agree with it; cancelling with that key still
/// works (the secret is pgmemo's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_shows_the_servers_process_id() {
    setup().await;
    let proxy = pgmemo(PoolMode::Session, 2).await;
    let addr = proxy.local_addr();
    let mut client = RawClient::connect(addr, PGMEMO_USER, DB, Some(PGMEMO_PASS), &[])
        .await
        .unwrap();
    let (pid, secret) = client.backend_key().unwrap();
    client
        .send(&[Frontend::query(
            "LISTEN own; NOTIFY own, 'mine'; SELECT pg_backend_pid()",
        )])
        .await
        .unwrap();
    let replies = client.recv_until_ready(1).await.unwrap();
    let row = replies.iter().find_map(Backend::data_row).expect("a row");
    assert_eq!(row[0].as_deref(), Some(pid.to_string().as_bytes()));
    let notification = replies
        .iter()
        .find(|m| m.tag == b'A')
        .map(|m| m.body.clone());
    let notification = match notification {
        Some(body) => body,
        None => client
            .recv_until_tag(b'A')
            .await
            .unwrap()
            .last()
            .unwrap()
            .body
            .clone(),
    };
    assert_eq!(&notification[..4], &pid.to_be_bytes());
    // A cancel with the key reaches the server running the client's query.
    client
        .send(&[Frontend::query("SELECT pg_sleep(30)")])
        .await
        .unwrap();
    let direct = connect(&direct_url()).await;
    wait_until("the sleep to run", Duration::from_secs(10), || async {
        outcome(
            &direct,
            &format!(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = {pid} \
                 AND query = 'SELECT pg_sleep(30)' AND state = 'active'"
            ),
        )
        .await
            == "1 (1)"
    })
    .await;
    let mut cancel = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut request = Vec::new();
    request.extend_from_slice(&16i32.to_be_bytes());
    request.extend_from_slice(&80877102i32.to_be_bytes());
    request.extend_from_slice(&pid.to_be_bytes());
    request.extend_from_slice(&secret.to_be_bytes());
    tokio::io::AsyncWriteExt::write_all(&mut cancel, &request)
        .await
        .unwrap();
    let replies = client.recv_until_ready(1).await.unwrap();
    let error = replies.iter().find(|m| m.is_error()).expect("cancelled");
    assert_eq!(error.field(b'C').as_deref(), Some("57014"), "{replies:?}");
    proxy.shutdown().await;
}

/// One random step of a client that changes or reads its settings: a statement alone, in a
/// committed or rolled-back block, failing with its implicit transaction, through the
/// extended protocol, or pipelined. A block is followed by a `ROLLBACK` (a failed statement
/// makes the simple query skip its `COMMIT`, and the block would stay open, holding the only
/// server for good).
fn random_step(rng: &mut Rng) -> Vec<String> {
    let n = rng.below(9) + 1;
    let change = match rng.below(14) {
        0 => format!("SET work_mem = '{n}MB'"),
        1 => format!("SET app.t = 'v{n}'"),
        2 => format!("SELECT set_config('app.t', 'w{n}', false)"),
        3 => [
            "SET search_path = tenant_a",
            "SET search_path = tenant_b",
            "SET search_path = public",
        ][n % 3]
            .to_owned(),
        4 => ["SET ROLE tenant_a", "SET ROLE tenant_b"][n % 2].to_owned(),
        5 => "RESET ROLE".to_owned(),
        6 => "RESET work_mem".to_owned(),
        7 => "RESET ALL".to_owned(),
        8 => "DISCARD ALL".to_owned(),
        9 => "SET SESSION AUTHORIZATION tenant_a".to_owned(),
        10 => "RESET SESSION AUTHORIZATION".to_owned(),
        11 => format!("SET statement_timeout = '{n}s'"),
        12 => "SET LOCAL work_mem = '7MB'".to_owned(),
        _ => {
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ".to_owned()
        }
    };
    const OBSERVE: &str = "SELECT current_setting('work_mem'), current_user::text, \
        session_user::text, current_setting('search_path'), \
        coalesce(current_setting('app.t', true), ''), current_setting('statement_timeout'), \
        current_setting('transaction_isolation')";
    let step = match rng.below(9) {
        0 | 1 => change,
        2 => format!("BEGIN; {change}; COMMIT"),
        3 => format!("BEGIN; {change}; ROLLBACK"),
        4 => format!("{change}; SELECT 1/0"),
        5 => format!("x:{change}"),
        6 => format!("p:{change} ;; {OBSERVE}"),
        7 => format!("p:BEGIN ;; {change} ;; {OBSERVE} ;; COMMIT"),
        _ => OBSERVE.to_owned(),
    };
    if step.starts_with("BEGIN") {
        vec![step, "ROLLBACK".to_owned()]
    } else {
        vec![step]
    }
}

/// Property: random interleavings of three clients' setting changes (carried state) over a
/// pool of one and of two servers give every client what a dedicated PostgreSQL session
/// gives it. `SESSION_STATE_SEED` / `SESSION_STATE_SEQUENCES` replay or widen the search.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_interleavings_match_dedicated_sessions() {
    setup().await;
    let sequences: usize = std::env::var("SESSION_STATE_SEQUENCES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24);
    let seed: u64 = std::env::var("SESSION_STATE_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x9e37_79b9_7f4a_7c15);
    let one = pgmemo(PoolMode::Transaction, 1).await;
    let two = pgmemo(PoolMode::Transaction, 2).await;
    let mut rng = Rng(seed);
    for i in 0..sequences {
        let steps: Vec<(usize, String)> = (0..20)
            .flat_map(|_| {
                let client = rng.below(3);
                random_step(&mut rng).into_iter().map(move |s| (client, s))
            })
            .collect();
        let steps: Vec<(usize, &str)> = steps.iter().map(|(c, s)| (*c, s.as_str())).collect();
        let direct = run(&clients(&direct_url(), 3).await, &steps).await;
        for (proxy, label) in [(&one, "pool_size 1"), (&two, "pool_size 2")] {
            let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), DB);
            let proxied = run(&clients(&url, 3).await, &steps).await;
            for (c, (d, p)) in direct.iter().zip(&proxied).enumerate() {
                assert_eq!(
                    d, p,
                    "sequence {i} (seed {seed}), {label}: client {c} differs from a dedicated \
                     session; the steps: {steps:#?}"
                );
            }
        }
    }
    one.shutdown().await;
    two.shutdown().await;
}

/// The `options` startup parameter of a client that connects with random settings, drawn
/// from the values [`random_setting_change`] sets too (another client's SET of the very value
/// a client gives at startup is what lost it, issue 54).
fn random_startup(rng: &mut Rng) -> String {
    let mut options = Vec::new();
    if let Some(path) = rng.pick(&[Some("tenant_a"), Some("tenant_b"), None]) {
        options.push(format!("-c search_path={path}"));
    }
    if let Some(style) = rng.pick(&[Some("German"), Some("SQL"), None]) {
        options.push(format!("-c DateStyle={style}"));
    }
    if let Some(timeout) = rng.pick(&[Some("1234ms"), Some("5s"), None]) {
        options.push(format!("--statement-timeout={timeout}"));
    }
    if let Some(memory) = rng.pick(&[Some("2MB"), None]) {
        options.push(format!("-c work_mem={memory}"));
    }
    if let Some(value) = rng.pick(&[Some("x1"), None]) {
        options.push(format!("-c app.t={value}"));
    }
    options.join(" ")
}

/// A change of one of the settings [`random_startup`] gives, to one of the same values, for
/// the session or the transaction, by SET, set_config or RESET.
fn random_setting_change(rng: &mut Rng) -> String {
    let (name, value) = *rng.pick(&[
        ("search_path", "tenant_a"),
        ("search_path", "tenant_b"),
        ("DateStyle", "German"),
        ("DateStyle", "SQL"),
        ("statement_timeout", "1234ms"),
        ("statement_timeout", "5s"),
        ("work_mem", "2MB"),
        ("app.t", "x1"),
    ]);
    match rng.below(6) {
        0 | 1 => format!("SET {name} = '{value}'"),
        2 => format!("BEGIN; SET LOCAL {name} = '{value}'; {STARTUP_OBSERVE}; COMMIT"),
        3 => format!("SELECT set_config('{name}', '{value}', false)"),
        4 => format!(
            "BEGIN; SELECT set_config('{name}', '{value}', true); {STARTUP_OBSERVE}; COMMIT"
        ),
        // Not of a reported setting given at startup (DateStyle): PostgreSQL resets it to the
        // startup packet's value, which no SQL can make a shared server's reset value
        // (docs/session-state.md, "What differs").
        _ if name == "DateStyle" => format!("SET {name} = '{value}'"),
        _ => format!("RESET {name}"),
    }
}

/// What the settings [`random_startup`] gives show: each one, a date as DateStyle writes it,
/// and which `accounts` table the search_path finds (by its schema-qualified name).
const STARTUP_OBSERVE: &str = "SELECT current_setting('search_path'), \
    current_setting('DateStyle'), date '2026-11-28'::text, \
    current_setting('statement_timeout'), current_setting('work_mem'), \
    coalesce(current_setting('app.t', true), ''), \
    coalesce((SELECT relnamespace::regnamespace::text FROM pg_class \
        WHERE oid = pg_catalog.to_regclass('accounts')), 'none')";

/// Runs `steps` (client index, step) in order over `n` clients of `url`; a step
/// `connect:OPTIONS` (re)connects that client with those startup options. Returns each
/// client's transcript.
async fn run_with_startups(url: &str, n: usize, steps: &[(usize, String)]) -> Vec<Vec<String>> {
    let mut clients: Vec<Option<Client>> = (0..n).map(|_| None).collect();
    let mut transcripts = vec![Vec::new(); n];
    for (i, step) in steps {
        if let Some(options) = step.strip_prefix("connect:") {
            let mut config: tokio_postgres::Config = url.parse().unwrap();
            config.options(options);
            let (client, conn) = config.connect(tokio_postgres::NoTls).await.unwrap();
            tokio::spawn(conn);
            clients[*i] = Some(client);
            transcripts[*i].push(step.clone());
            continue;
        }
        let client = clients[*i].as_ref().expect("connected first");
        let out = outcome(client, step).await;
        transcripts[*i].push(format!("{step} => {out}"));
    }
    transcripts
}

/// Property (issue 54): every setting a client gives at startup is in effect for each of its
/// statements as on a dedicated PostgreSQL session, whatever the other clients sharing its
/// pool (of one and of two servers) SET, SET LOCAL, RESET or set_config meanwhile, to the
/// same values or others, and however often clients log out and in again with other
/// startup settings. `SESSION_STATE_SEED` / `SESSION_STATE_SEQUENCES` replay or widen it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_settings_hold_whatever_other_clients_set() {
    setup().await;
    let sequences: usize = std::env::var("SESSION_STATE_SEQUENCES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let seed: u64 = std::env::var("SESSION_STATE_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_0054_0000_0001);
    let one = pgmemo(PoolMode::Transaction, 1).await;
    let two = pgmemo(PoolMode::Transaction, 2).await;
    let mut rng = Rng(seed);
    for i in 0..sequences {
        let mut steps: Vec<(usize, String)> = (0..3)
            .map(|c| (c, format!("connect:{}", random_startup(&mut rng))))
            .collect();
        for _ in 0..24 {
            let client = rng.below(3);
            let step = match rng.below(8) {
                0 => format!("connect:{}", random_startup(&mut rng)),
                1..=4 => random_setting_change(&mut rng),
                _ => STARTUP_OBSERVE.to_owned(),
            };
            steps.push((client, step));
        }
        let direct = run_with_startups(&direct_url(), 3, &steps).await;
        for (proxy, label) in [(&one, "pool_size 1"), (&two, "pool_size 2")] {
            let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), DB);
            let proxied = run_with_startups(&url, 3, &steps).await;
            for (c, (d, p)) in direct.iter().zip(&proxied).enumerate() {
                assert_eq!(
                    d, p,
                    "sequence {i} (seed {seed}), {label}: client {c} differs from a dedicated \
                     session; the steps: {steps:#?}"
                );
            }
        }
    }
    one.shutdown().await;
    two.shutdown().await;
}

/// Notifications sent while pgmemo works on the listener's server for itself (autoprepare's
/// silent Parse of every new shape, at `autoprepare_threshold = 1`) all reach the listener:
/// one that arrived while pgmemo's own replies were at the head of the queue went with them
/// (pgx's TestListenNotify lost one about once in 800 runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_notification_is_lost_while_pgmemo_works_on_the_server() {
    const NOTES: usize = 400;
    setup().await;
    let mut config = test_config(PoolMode::Transaction, 2);
    config.general.autoprepare_threshold = 1;
    let proxy = start_pgmemo(config).await;
    let addr = proxy.local_addr();
    let mut listener = RawClient::connect(addr, PGMEMO_USER, DB, Some(PGMEMO_PASS), &[])
        .await
        .unwrap();
    listener
        .send(&[Frontend::query("LISTEN lost_notes")])
        .await
        .unwrap();
    listener.recv_until_ready(1).await.unwrap();
    let notifier = tokio::spawn(async move {
        let c = connect(&cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), DB)).await;
        for i in 0..NOTES {
            c.simple_query(&format!("NOTIFY lost_notes, '{i}'"))
                .await
                .unwrap();
        }
    });
    let mut received = 0;
    let mut i = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while received < NOTES {
        assert!(
            std::time::Instant::now() < deadline,
            "{received} of {NOTES} notifications arrived"
        );
        i += 1;
        // A new shape each time (its alias): pgmemo probes it with a Parse of its own first.
        listener
            .send(&[Frontend::query(&format!("SELECT {i} AS c{i}"))])
            .await
            .unwrap();
        received += listener
            .recv_until_ready(1)
            .await
            .unwrap()
            .iter()
            .filter(|m| m.tag == b'A')
            .count();
        if notifier.is_finished() && i % 50 == 0 {
            // Notifications after the last query come while the listener is idle.
            let more = tokio::time::timeout(Duration::from_millis(1), listener.recv()).await;
            received += usize::from(matches!(more, Ok(Ok(m)) if m.tag == b'A'));
        }
    }
    notifier.await.unwrap();
    assert_eq!(received, NOTES);
}

/// A DO block that sets settings changes its client's session, and only its client's: the
/// next client on the same server (a pool of one) does not get them, and the client keeps
/// them on whatever server it lands on (pg_regress's brin_multi through pgmemo: a SET in a
/// DO block stayed on the server for the next client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_set_in_a_do_block_follow_their_client() {
    setup().await;
    let steps: &[(usize, &str)] = &[
        (0, "DO $$ BEGIN SET enable_hashjoin = off; END $$"),
        (1, "SHOW enable_hashjoin"),
        (0, "SHOW enable_hashjoin"),
        (
            1,
            "do $x$ begin set local work_mem = '3MB'; set search_path = tenant_b; end $x$",
        ),
        (
            0,
            "SELECT current_setting('work_mem'), current_setting('search_path')",
        ),
        (
            1,
            "SELECT current_setting('work_mem'), current_setting('search_path')",
        ),
        (
            0,
            "DO LANGUAGE plpgsql $$ BEGIN RESET enable_hashjoin; END $$",
        ),
        (1, "SHOW enable_hashjoin"),
        (0, "SHOW enable_hashjoin"),
    ];
    same_as_dedicated_sessions("DO blocks", 1, 2, steps).await;
}
