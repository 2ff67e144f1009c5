//! Slow and hostile clients cost pgmemo bounded memory (issue 37, item 6), and leave the pool
//! as they found it:
//!
//! - a client that never reads a result of gigabytes: pgmemo stops reading the server once the
//!   client's unsent bytes pass its high-water mark, so PostgreSQL waits (`ClientWrite`) instead
//!   of pgmemo buffering the result;
//! - a client that declares a message of 1 GB: refused from its header (over
//!   `general.max_message_size`), with nothing buffered;
//! - a client that pipelines 100,000 queries and reads nothing: pgmemo stops reading it once the
//!   server's unsent bytes pass the mark; what is in flight is bounded by the sockets' buffers;
//! - thousands of clients that open a transaction, take row locks and go (closing the socket
//!   or sending Terminate): every transaction rolls back, every server is back in the pool, the
//!   heap is back to its level before them.
//!
//! pgmemo runs in the test process, so the heap in use (glibc's statistics) is pgmemo's plus
//! the test's own small clients. Every wait is for a condition PostgreSQL or the admin console
//! shows, never for a time. What other clients' latency is meanwhile is a benchmark, not a test:
//! `bench/hostile.py`.

mod common;

use common::*;
use pgmemo::config::{AuthType, PoolMode};
use pgmemo::Pgmemo;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio_postgres::{Client, SimpleQueryMessage};

const DB: &str = "bounded_memory";

static SETUP: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

/// The heap is the process's: the tests of this file run one at a time, each holding this,
/// so that one test's clients do not count in another's measure.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn setup() {
    SETUP
        .get_or_init(|| async {
            fresh_db(DB).await;
            let direct = connect(&direct_url()).await;
            direct
                .batch_execute(
                    "CREATE TABLE abandon (id int PRIMARY KEY, n int NOT NULL);
                     INSERT INTO abandon SELECT g, 0 FROM generate_series(0, 9) g;",
                )
                .await
                .unwrap();
        })
        .await;
}

fn direct_url() -> String {
    cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), DB)
}

async fn pgmemo(pool_size: u32) -> Pgmemo {
    let mut config = test_config(PoolMode::Transaction, pool_size);
    // Thousands of logins: trust (the user is still checked), so SCRAM's key stretching in a
    // debug build does not make the test about CPU.
    config.general.auth_type = AuthType::Trust;
    start_pgmemo(config).await
}

async fn raw(proxy: &Pgmemo) -> RawClient {
    RawClient::connect(proxy.local_addr(), PGMEMO_USER, DB, None, &[])
        .await
        .unwrap()
}

async fn first_value(client: &Client, sql: &str) -> String {
    client
        .simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(r) => Some(r.get(0).unwrap_or("").to_owned()),
            _ => None,
        })
        .unwrap_or_default()
}

/// The `wait_event` of the backend whose last query contains `marker` (empty when it waits for
/// nothing, None when there is no such backend). A backend blocked writing its last replies
/// shows `ClientWrite` while its state already says idle.
async fn wait_event_of(direct: &Client, marker: &str) -> Option<String> {
    let sql = format!(
        "SELECT coalesce(wait_event, '') FROM pg_stat_activity \
         WHERE query LIKE '%{marker}%' AND pid <> pg_backend_pid()"
    );
    direct
        .simple_query(&sql)
        .await
        .unwrap()
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(r) => Some(r.get(0).unwrap_or("").to_owned()),
            _ => None,
        })
}

/// Waits until the test database's pool is back to normal (see the common helper).
async fn wait_pool_normal(proxy: &Pgmemo, direct: &Client) {
    let admin = admin_console(proxy.local_addr()).await;
    common::wait_pool_normal(&admin, direct, DB).await;
}

fn kib_over(now: u64, base: u64) -> u64 {
    now.saturating_sub(base)
}

/// A client asks for about 3 GB of rows and reads none: PostgreSQL ends up waiting to write to
/// pgmemo, pgmemo's heap grows by its buffers only, another client is served meanwhile, and
/// once the reader goes its server is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_costs_its_buffers_only() {
    let _alone = ONE_AT_A_TIME.lock().await;
    setup().await;
    let proxy = pgmemo(2).await;
    let direct = connect(&direct_url()).await;
    let other = connect(&proxy_url(proxy.local_addr(), PGMEMO_USER, None, DB)).await;
    assert_eq!(first_value(&other, "SELECT 1").await, "1");
    let mut slow = raw(&proxy).await;
    let before = heap_in_use_kib();
    slow.send(&[Frontend::query(
        "SELECT repeat('x', 1000) AS never_read FROM generate_series(1, 3000000)",
    )])
    .await
    .unwrap();
    wait_until(
        "PostgreSQL to wait for pgmemo to read (ClientWrite)",
        Duration::from_secs(60),
        || async { wait_event_of(&direct, "never_read").await.as_deref() == Some("ClientWrite") },
    )
    .await;
    // Served meanwhile, by the pool's other server.
    for i in 0..20 {
        assert_eq!(
            first_value(&other, &format!("SELECT {i}")).await,
            i.to_string()
        );
    }
    let grown = kib_over(heap_in_use_kib(), before);
    eprintln!("a client that never reads: heap grew by {grown} KiB");
    assert!(
        grown < 4 * 1024,
        "pgmemo buffered {grown} KiB for a client that reads nothing"
    );
    drop(slow);
    wait_pool_normal(&proxy, &direct).await;
    assert_eq!(first_value(&other, "SELECT 'after'").await, "after");
    proxy.shutdown().await;
}

/// A Query message declared at 1 GB is refused from its header, as pgmemo's documented
/// `max_message_size` says (PostgreSQL's own limit for a query is 1 GB): the client hears
/// 08P01, its connection closes while it is still sending, and nothing of it was buffered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_of_a_gigabyte_is_refused_unbuffered() {
    let _alone = ONE_AT_A_TIME.lock().await;
    setup().await;
    let proxy = pgmemo(2).await;
    let direct = connect(&direct_url()).await;
    let mut hostile = raw(&proxy).await;
    let chunk = vec![b' '; 1 << 20];
    let before = heap_in_use_kib();
    let mut header = vec![b'Q'];
    header.extend((1i32 << 30).to_be_bytes());
    hostile.send_raw(&header).await.unwrap();
    let mut sent = 0usize;
    while sent < 256 << 20 {
        if hostile.send_raw(&chunk).await.is_err() {
            break;
        }
        sent += chunk.len();
    }
    let grown = kib_over(heap_in_use_kib(), before);
    eprintln!(
        "a message of 1 GB: {} MiB sent before pgmemo closed, heap grew by {grown} KiB",
        sent >> 20
    );
    assert!(
        sent < 256 << 20,
        "pgmemo read 256 MiB of a message it should have refused"
    );
    assert!(grown < 2 * 1024, "pgmemo buffered {grown} KiB of it");
    let error = loop {
        match hostile.recv().await {
            Ok(msg) if msg.is_error() => break msg,
            Ok(_) => continue,
            Err(e) => panic!("the connection ended without an error: {e}"),
        }
    };
    assert_eq!(error.field(b'C').as_deref(), Some("08P01"), "{error}");
    wait_pool_normal(&proxy, &direct).await;
    proxy.shutdown().await;
}

/// A client writes 100,000 queries in one stream and reads no reply (50 MB of replies, more
/// than the sockets' buffers hold): pgmemo stops reading it once its server is behind, the
/// heap grows by a bounded amount (the queries in flight are bounded by the sockets'
/// buffers), and after the client goes its server is back in the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_of_100000_unread_queries_is_held_back() {
    let _alone = ONE_AT_A_TIME.lock().await;
    setup().await;
    let proxy = pgmemo(2).await;
    let direct = connect(&direct_url()).await;
    let mut stream = tokio::net::TcpStream::connect(proxy.local_addr())
        .await
        .unwrap();
    let mut login = vec![];
    let mut body = 196_608i32.to_be_bytes().to_vec();
    for part in ["user", PGMEMO_USER, "database", DB, ""] {
        body.extend(part.as_bytes());
        body.push(0);
    }
    login.extend(((body.len() + 4) as i32).to_be_bytes());
    login.extend(body);
    let mut pipeline = login;
    for i in 0..100_000 {
        Frontend::query(&format!("SELECT {i}, repeat('y', 500) AS piped")).encode(&mut pipeline);
    }
    let total = pipeline.len();
    let before = heap_in_use_kib(); // with the test's own copy of the pipeline
    let writer = tokio::spawn(async move {
        let _ = stream.write_all(&pipeline).await;
        stream // kept open, never read, until the test drops the task
    });
    wait_until(
        "PostgreSQL to wait for pgmemo to read (ClientWrite)",
        Duration::from_secs(60),
        || async { wait_event_of(&direct, "piped").await.as_deref() == Some("ClientWrite") },
    )
    .await;
    let grown = kib_over(heap_in_use_kib(), before);
    eprintln!(
        "a pipeline of 100,000 unread queries ({} KiB): heap grew by {grown} KiB",
        total / 1024
    );
    assert!(
        grown < 8 * 1024,
        "pgmemo holds {grown} KiB for a client that reads nothing"
    );
    writer.abort();
    let _ = writer.await;
    wait_pool_normal(&proxy, &direct).await;
    proxy.shutdown().await;
}

/// Clients that open a transaction, lock a row and go (half close their socket, half say
/// Terminate), many at a time: none of their updates survives, no row stays locked (the
/// next clients would wait), the pool and the heap come back to where they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_transactions_leave_nothing_behind() {
    let total: usize = std::env::var("PGMEMO_TEST_ABANDONED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    const AT_ONCE: usize = 50;
    let _alone = ONE_AT_A_TIME.lock().await;
    setup().await;
    raise_nofile(4 * AT_ONCE as u64 + 512);
    let proxy = pgmemo(4).await;
    let direct = connect(&direct_url()).await;
    let addr = proxy.local_addr();
    let round = |from: usize, to: usize| async move {
        let mut tasks = tokio::task::JoinSet::new();
        for lane in 0..AT_ONCE {
            tasks.spawn(async move {
                for i in (from + lane..to).step_by(AT_ONCE) {
                    let mut c = RawClient::connect(addr, PGMEMO_USER, DB, None, &[])
                        .await
                        .unwrap();
                    c.send(&[
                        Frontend::query("BEGIN"),
                        Frontend::query(&format!(
                            "UPDATE abandon SET n = n + 1 WHERE id = {}",
                            i % 10
                        )),
                    ])
                    .await
                    .unwrap();
                    let replies = c.recv_until_ready(2).await.unwrap();
                    assert!(
                        replies.iter().all(|m| !m.is_error()),
                        "client {i}: {replies:?}"
                    );
                    if i % 2 == 0 {
                        c.terminate().await.unwrap();
                    } // else: dropped, the socket just closes
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.unwrap();
        }
    };
    // Warm up (buffers, the pool's servers, autoprepared statements), then measure.
    round(0, 200).await;
    wait_pool_normal(&proxy, &direct).await;
    let before = heap_in_use_kib();
    round(200, total).await;
    wait_pool_normal(&proxy, &direct).await;
    let grown = kib_over(heap_in_use_kib(), before);
    eprintln!("{total} abandoned transactions: heap grew by {grown} KiB after the warm-up");
    assert_eq!(
        first_value(&direct, "SELECT sum(n) FROM abandon").await,
        "0",
        "an abandoned transaction's update survived"
    );
    assert!(grown < 1024, "{grown} KiB more held after the clients went");
    proxy.shutdown().await;
}
