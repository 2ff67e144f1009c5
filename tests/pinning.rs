//! Pinned clients cannot starve a pool silently (transaction mode): a pinned client idle past
//! `pinned_idle_timeout` is closed and its server goes to the next client; a statement that
//! would pin more than `max_pinned_fraction` of the pool waits for a slot (PgBouncer's
//! `query_wait_timeout` at most); a client whose state is gone (`DISCARD TEMP`, `DROP TABLE`,
//! `UNLISTEN *`, `CLOSE`) gives its server back at once. Every wait is bounded: a client that
//! waits for a server a pinned client keeps shows up as a timeout.

mod common;

use common::*;
use pgmemo::config::PoolMode;
use std::time::Duration;
use tokio_postgres::{Client, SimpleQueryMessage};

const DB: &str = "pinning";

static SETUP: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

async fn setup() {
    SETUP.get_or_init(|| fresh_db(DB)).await;
}

/// The first value of the first row `sql` returns, failing the test after `limit`: a client
/// that cannot get a server fails rather than waits.
async fn value_within(client: &Client, sql: &str, limit: Duration) -> String {
    let rows = tokio::time::timeout(limit, client.simple_query(sql))
        .await
        .unwrap_or_else(|_| panic!("{sql}: no answer within {limit:?}"))
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    rows.iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(r) => Some(r.get(0).unwrap_or("").to_owned()),
            _ => None,
        })
        .unwrap_or_default()
}

/// SHOW POOLS' `column` for the test database.
async fn pool_column(admin: &Client, column: &str) -> String {
    admin_rows(admin, "SHOW POOLS")
        .await
        .into_iter()
        .find(|r| r["database"] == DB)
        .map(|r| r[column].clone())
        .unwrap_or_default()
}

/// Waits until SHOW POOLS shows `n` pinned servers and clients (the pin is recorded by
/// pgmemo's probe, after the client has its ReadyForQuery; a server is counted from before a
/// statement that may pin it runs).
async fn wait_pinned(admin: &Client, n: usize) {
    wait_until(
        &format!("sv_pinned = cl_pinned = {n}"),
        Duration::from_secs(10),
        || async {
            pool_column(admin, "sv_pinned").await == n.to_string()
                && pool_column(admin, "cl_pinned").await == n.to_string()
        },
    )
    .await;
}

async fn raw_client(addr: std::net::SocketAddr) -> RawClient {
    RawClient::connect(addr, PGMEMO_USER, DB, Some(PGMEMO_PASS), &[])
        .await
        .unwrap()
}

/// Reads `client`'s messages up to an ErrorResponse: its (severity, code, message).
async fn next_error(client: &mut RawClient) -> (String, String, String) {
    loop {
        let msg = client
            .recv()
            .await
            .expect("an error before the connection ends");
        if msg.is_error() {
            let field = |c| msg.field(c).unwrap_or_default();
            return (field(b'V'), field(b'C'), field(b'M'));
        }
    }
}

/// A client pinned by a temporary table that then stays idle is closed after
/// pinned_idle_timeout with PgBouncer's kind of FATAL, and the only server of the pool goes,
/// cleaned, to the client waiting for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_pinned_client_is_closed_and_its_server_reused() {
    setup().await;
    let mut config = test_config(PoolMode::Transaction, 1);
    config.general.pinned_idle_timeout = Duration::from_secs(1);
    let proxy = start_pgmemo(config).await;
    let addr = proxy.local_addr();
    let mut pinned = raw_client(addr).await;
    pinned
        .send(&[Frontend::query("CREATE TEMP TABLE idle_pin (a int)")])
        .await
        .unwrap();
    pinned.recv_until_ready(1).await.unwrap();
    let admin = admin_console(addr).await;
    wait_pinned(&admin, 1).await;
    // The only server is pinned: this client waits until the pinned one is closed (1 s),
    // not for query_wait_timeout (120 s).
    let url = proxy_url(addr, PGMEMO_USER, Some(PGMEMO_PASS), DB);
    let waiting = connect(&url).await;
    let seen = value_within(
        &waiting,
        "SELECT count(*) FROM pg_class WHERE relname = 'idle_pin'",
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(
        seen, "0",
        "the closed client's temporary table was left behind"
    );
    let (severity, code, message) = next_error(&mut pinned).await;
    assert_eq!(
        (severity.as_str(), code.as_str(), message.as_str()),
        ("FATAL", "08P01", "pinned_idle_timeout")
    );
    wait_pinned(&admin, 0).await;
}

/// With max_pinned_fraction 0.5 of a pool of two, one client may pin; a statement that
/// would pin another server waits for a slot, as a client waits for a server, instead of
/// running and closing its client (issue 54): it runs once the pinned client unpins, and
/// the pool serves others meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pin_beyond_the_bound_waits_for_a_slot() {
    setup().await;
    let mut config = test_config(PoolMode::Transaction, 2);
    config.general.max_pinned_fraction = 0.5;
    let proxy = start_pgmemo(config).await;
    let addr = proxy.local_addr();
    let url = proxy_url(addr, PGMEMO_USER, Some(PGMEMO_PASS), DB);
    let admin = admin_console(addr).await;
    let direct = connect(&direct_db_url(DB)).await;
    let first = connect(&url).await;
    first
        .simple_query("CREATE TEMP TABLE first_pin (a int)")
        .await
        .unwrap();
    wait_pinned(&admin, 1).await;

    let mut second = raw_client(addr).await;
    second
        .send(&[Frontend::query(
            "CREATE TEMP TABLE waiting_pin (a int); INSERT INTO waiting_pin VALUES (1)",
        )])
        .await
        .unwrap();
    // It waits: its statement has not run, and the pool serves another client meanwhile.
    let third = connect(&url).await;
    assert_eq!(
        value_within(&third, "SELECT 1", Duration::from_secs(10)).await,
        "1"
    );
    let waiting_pin_exists = "SELECT count(*) FROM pg_class WHERE relname = 'waiting_pin'";
    assert_eq!(
        value_within(&direct, waiting_pin_exists, Duration::from_secs(10)).await,
        "0",
        "the statement that would pin ran before a slot was free"
    );
    // The pinned client unpins: the waiting statement runs, and pins its client.
    first.simple_query("DISCARD TEMP").await.unwrap();
    let replies = tokio::time::timeout(Duration::from_secs(10), second.recv_until_ready(1))
        .await
        .expect("the waiting statement ran once a slot was freed")
        .unwrap();
    assert!(!replies.iter().any(|m| m.is_error()), "{replies:?}");
    assert_eq!(
        replies
            .iter()
            .filter_map(|m| m.command_tag())
            .collect::<Vec<_>>(),
        ["CREATE TABLE", "INSERT 0 1"]
    );
    wait_pinned(&admin, 1).await;
    second
        .send(&[Frontend::query("SELECT count(*) FROM waiting_pin")])
        .await
        .unwrap();
    let rows = second.recv_until_ready(1).await.unwrap();
    assert!(!rows.iter().any(|m| m.is_error()), "{rows:?}");
}

/// A statement waiting for a pin slot past query_wait_timeout gets PgBouncer's error for
/// that wait, and it never ran: nothing of it is left anywhere; the pinned client keeps its
/// state and the pool still serves others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pin_wait_ends_at_query_wait_timeout_and_leaks_nothing() {
    setup().await;
    let mut config = test_config(PoolMode::Transaction, 2);
    config.general.max_pinned_fraction = 0.5;
    config.general.query_wait_timeout = Duration::from_secs(1);
    let proxy = start_pgmemo(config).await;
    let addr = proxy.local_addr();
    let url = proxy_url(addr, PGMEMO_USER, Some(PGMEMO_PASS), DB);
    let admin = admin_console(addr).await;
    let first = connect(&url).await;
    first
        .simple_query("CREATE TEMP TABLE kept_pin (a int)")
        .await
        .unwrap();
    wait_pinned(&admin, 1).await;

    let mut second = raw_client(addr).await;
    second
        .send(&[Frontend::query(
            "CREATE TEMP TABLE refused_pin (a int); INSERT INTO refused_pin VALUES (1)",
        )])
        .await
        .unwrap();
    let (severity, code, message) = next_error(&mut second).await;
    assert_eq!(
        (severity.as_str(), code.as_str()),
        ("FATAL", "08P01"),
        "{message}"
    );
    assert!(message.starts_with("query_wait_timeout"), "{message}");

    let third = connect(&url).await;
    let anywhere = value_within(
        &third,
        "SELECT count(*) FROM pg_class WHERE relname = 'refused_pin'",
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(anywhere, "0", "the refused statement ran");
    assert_eq!(pool_column(&admin, "sv_pinned").await, "1");
    let still = value_within(
        &first,
        "SELECT count(*) FROM kept_pin",
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(still, "0");
}

/// Clients that each connect, pin their server with a temporary table (or LISTEN, or a
/// session advisory lock) and leave, two at a time on a pool of two whose bound is one
/// pinned server, 1,000 in all: none is refused, each waits for the other's slot (pgx's
/// TestConnCopyFrom* through pgmemo: 11 failed with 53400 while the previous test's client,
/// gone already, still counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_pin_and_leave_are_never_refused() {
    setup().await;
    let mut config = test_config(PoolMode::Transaction, 2);
    config.general.max_pinned_fraction = 0.5;
    let proxy = start_pgmemo(config).await;
    let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), DB);
    let pins = [
        "CREATE TEMPORARY TABLE foo (a int2, b int4); INSERT INTO foo VALUES (1, 2)",
        "LISTEN pin_and_leave",
        "SELECT pg_advisory_lock(54)::text",
    ];
    let rounds = |task: usize| {
        let url = url.clone();
        async move {
            for i in 0..500 {
                let client = connect(&url).await;
                // The pin, then a statement on the pinned session (a client closed after
                // its pin got its reply first).
                for sql in [pins[(i + task) % pins.len()], "SELECT 1"] {
                    tokio::time::timeout(Duration::from_secs(30), client.simple_query(sql))
                        .await
                        .unwrap_or_else(|_| panic!("client {task}, round {i}: {sql}: no answer"))
                        .unwrap_or_else(|e| panic!("client {task}, round {i}: {sql}: {e}"));
                }
            }
        }
    };
    let (a, b) = tokio::join!(tokio::spawn(rounds(0)), tokio::spawn(rounds(1)));
    a.unwrap();
    b.unwrap();
    proxy.shutdown().await;
}

/// A client whose pinning state is gone gives its server back at once: on a pool of one,
/// another client runs right after each of DISCARD TEMP, DROP TABLE, UNLISTEN * and CLOSE,
/// while the first stays connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_gone_unpins_at_once() {
    setup().await;
    let mut config = test_config(PoolMode::Transaction, 1);
    // A client left waiting fails this test within seconds rather than minutes.
    config.general.query_wait_timeout = Duration::from_secs(5);
    let proxy = start_pgmemo(config).await;
    let addr = proxy.local_addr();
    let url = proxy_url(addr, PGMEMO_USER, Some(PGMEMO_PASS), DB);
    let admin = admin_console(addr).await;
    let pinned = connect(&url).await;
    let other = connect(&url).await;
    for (pin, unpin) in [
        ("CREATE TEMP TABLE gone (a int)", "DISCARD TEMP"),
        ("CREATE TEMP TABLE gone (a int)", "DROP TABLE gone"),
        ("LISTEN gone", "UNLISTEN *"),
        ("DECLARE gone CURSOR WITH HOLD FOR SELECT 1", "CLOSE gone"),
    ] {
        pinned.simple_query(pin).await.unwrap();
        wait_pinned(&admin, 1).await;
        assert_eq!(pool_column(&admin, "cl_pinned").await, "1", "{pin}");
        pinned.simple_query(unpin).await.unwrap();
        wait_pinned(&admin, 0).await;
        assert_eq!(pool_column(&admin, "cl_pinned").await, "0", "{unpin}");
        assert!(
            admin_rows(&admin, "SHOW CLIENTS")
                .await
                .iter()
                .all(|r| r["pinned"].is_empty()),
            "{unpin}"
        );
        let seen = value_within(&other, "SELECT 1", Duration::from_secs(10)).await;
        assert_eq!(seen, "1", "after {unpin}");
    }
}

/// pgx v5.12's own `TestConnCopyFrom*` tests (each connects, makes a temporary table, COPYs
/// into it and disconnects) through pgmemo in transaction mode with a pool of 2, five times
/// over: every one passes, as directly. Before, 11 of them failed with FATAL 53400
/// (`max_pinned_fraction`): the previous test's pin still counted while its server was being
/// cleaned (issue 54, item 6). Run from pgx's module source, which `scripts/setup-tests`
/// downloads for tests/drivers/go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgx_copy_from_tests_pass_at_pool_two() {
    const PGX: &str = "github.com/jackc/pgx/v5@v5.12.0";
    let modcache = std::process::Command::new("go")
        .args(["env", "GOMODCACHE"])
        .output()
        .expect("go (scripts/setup-tests installs it)");
    let source =
        std::path::PathBuf::from(String::from_utf8(modcache.stdout).unwrap().trim()).join(PGX);
    assert!(
        source.join("copy_from_test.go").is_file(),
        "{} (scripts/setup-tests downloads it)",
        source.display()
    );
    // A writable copy: go test writes nothing there, but the module cache is read-only and
    // pgx's tests are a module of their own.
    let copy = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("pgx-v5.12.0");
    let _ = std::fs::remove_dir_all(&copy);
    let copied = std::process::Command::new("cp")
        .arg("-r")
        .arg(&source)
        .arg(&copy)
        .status()
        .unwrap();
    assert!(copied.success());
    let writable = std::process::Command::new("chmod")
        .args(["-R", "u+w"])
        .arg(&copy)
        .status()
        .unwrap();
    assert!(writable.success());
    fresh_db("pgx_copy_from").await;
    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    let url = proxy_url(
        proxy.local_addr(),
        PGMEMO_USER,
        Some(PGMEMO_PASS),
        "pgx_copy_from",
    );
    let out = tokio::process::Command::new("go")
        .args(["test", "-count=5", "-v", "-run", "TestConnCopyFrom", "."])
        .current_dir(&copy)
        .env("PGX_TEST_DATABASE", &url)
        .output()
        .await
        .expect("go test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let passed = stdout.lines().filter(|l| l.starts_with("--- PASS")).count();
    let failed: Vec<_> = stdout
        .lines()
        .filter(|l| l.starts_with("--- FAIL"))
        .collect();
    assert!(
        out.status.success() && failed.is_empty() && passed >= 5 * 10,
        "{passed} passed, failed: {failed:#?}\n{}\n{}",
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    proxy.shutdown().await;
}
