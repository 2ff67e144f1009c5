//! Real drivers through pgmemo, in transaction and session mode: tokio-postgres and sqlx
//! (Rust), psycopg 3 (Python, `tests/drivers/psycopg_check.py`) and pgbench.
//!
//! What a driver may do in transaction mode is limited the way it is with any transaction
//! pooler until pgmemo keeps prepared statements working there (the next issue): a statement
//! prepared with one Sync and executed after another may land on another server. So in
//! transaction mode the tests use, outside explicit transactions, only what runs in one
//! Sync: simple queries and single-round-trip unnamed statements (tokio-postgres
//! `query_typed`, psycopg with `prepare_threshold=None`, pgbench `-M extended`); inside a
//! transaction the server is held from BEGIN to COMMIT, so everything works there. Session
//! mode gets the drivers' defaults, named prepared statements included.

mod common;

use common::*;
use futures_util::{SinkExt, StreamExt};
use pgmemo::config::PoolMode;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::Row as _;
use std::time::Duration;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, SimpleQueryMessage};

const MODES: [PoolMode; 2] = [PoolMode::Transaction, PoolMode::Session];

fn mode_name(mode: PoolMode) -> &'static str {
    match mode {
        PoolMode::Transaction => "transaction",
        PoolMode::Session => "session",
    }
}

/// The rows of a simple query (all statements), as text.
async fn simple_rows(client: &Client, sql: &str) -> Vec<Vec<Option<String>>> {
    let msgs = client
        .simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    msgs.iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => {
                Some((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect())
            }
            _ => None,
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// tokio-postgres
// ---------------------------------------------------------------------------------------------

/// Simple queries, typed parameters, transactions (commit and rollback), COPY IN and OUT,
/// and named prepared statements in session mode, with every value checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokio_postgres_through_pgmemo() {
    for mode in MODES {
        let proxy = pgmemo(mode, 3).await;
        let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
        let client = connect(&url).await;
        let table = format!("drv_tp_{}", mode_name(mode));

        // Simple queries, several statements in one.
        let rows = simple_rows(&client, "SELECT 1 AS a, 'x' AS b; SELECT NULL::int, 2 + 2").await;
        assert_eq!(
            rows,
            vec![
                vec![Some("1".into()), Some("x".into())],
                vec![None, Some("4".into())]
            ],
            "{mode:?}"
        );
        client
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS {table}; CREATE TABLE {table} (id int PRIMARY KEY, name text, data bytea)"
            ))
            .await
            .unwrap();

        // Typed parameters, binary results, in one round trip (unnamed statement).
        let bytes: Vec<u8> = (0..=255u8).collect();
        let row = client
            .query_typed_one(
                "SELECT $1::int4 + 1, $2::text || '!', $3::float8 * 2, $4::bytea, $5::bool, $6::int8",
                &[
                    (&41i32, Type::INT4),
                    (&"héllo", Type::TEXT),
                    (&1.25f64, Type::FLOAT8),
                    (&bytes, Type::BYTEA),
                    (&true, Type::BOOL),
                    (&None::<i64>, Type::INT8),
                ],
            )
            .await
            .unwrap();
        assert_eq!(row.get::<_, i32>(0), 42);
        assert_eq!(row.get::<_, String>(1), "héllo!");
        assert_eq!(row.get::<_, f64>(2), 2.5);
        assert_eq!(row.get::<_, Vec<u8>>(3), bytes);
        assert!(row.get::<_, bool>(4));
        assert_eq!(row.get::<_, Option<i64>>(5), None);

        // A typed-parameter error leaves the connection usable.
        let err = client
            .query_typed("SELECT 1 / $1::int4", &[(&0i32, Type::INT4)])
            .await
            .expect_err("division by zero");
        assert_eq!(err.code().map(|c| c.code()), Some("22012"), "{mode:?}");

        // A transaction that rolls back leaves nothing; one that commits keeps its rows.
        // Inside a transaction, named statements work in both modes.
        let mut client = client;
        {
            let tx = client.transaction().await.unwrap();
            let insert = tx
                .prepare(&format!("INSERT INTO {table} (id, name) VALUES ($1, $2)"))
                .await
                .unwrap();
            for i in 0..10 {
                tx.execute(&insert, &[&i, &format!("n{i}")]).await.unwrap();
            }
            let n: i64 = tx
                .query_one(&format!("SELECT count(*) FROM {table}"), &[])
                .await
                .unwrap()
                .get(0);
            assert_eq!(n, 10);
            tx.rollback().await.unwrap();
        }
        let rows = simple_rows(&client, &format!("SELECT count(*) FROM {table}")).await;
        assert_eq!(
            rows[0][0].as_deref(),
            Some("0"),
            "{mode:?}: rollback kept rows"
        );
        {
            let tx = client.transaction().await.unwrap();
            let insert = tx
                .prepare(&format!(
                    "INSERT INTO {table} (id, name, data) VALUES ($1, $2, $3)"
                ))
                .await
                .unwrap();
            for i in 0..20i32 {
                tx.execute(&insert, &[&i, &format!("n{i}"), &vec![i as u8; i as usize]])
                    .await
                    .unwrap();
            }
            tx.commit().await.unwrap();
        }
        let row = client
            .query_typed_one(
                &format!("SELECT count(*), sum(id)::int8, sum(length(data))::int8 FROM {table} WHERE id < $1"),
                &[(&100i32, Type::INT4)],
            )
            .await
            .unwrap();
        assert_eq!(
            (
                row.get::<_, i64>(0),
                row.get::<_, i64>(1),
                row.get::<_, i64>(2)
            ),
            (20, 190, 190)
        );

        // COPY IN and OUT. tokio-postgres prepares the COPY statement in its own round trip,
        // so in transaction mode it needs a transaction around it to stay on one server.
        let copy_in = format!("COPY {table} (id, name) FROM STDIN");
        let copy_out =
            format!("COPY (SELECT id, name FROM {table} WHERE id >= 1000 ORDER BY id) TO STDOUT");
        let data: String = (1000..1500).map(|i| format!("{i}\tcopied {i}\n")).collect();
        let tx = client.transaction().await.unwrap();
        let sink = tx.copy_in::<_, bytes::Bytes>(&copy_in).await.unwrap();
        futures_util::pin_mut!(sink);
        for chunk in data.as_bytes().chunks(1000) {
            sink.send(bytes::Bytes::copy_from_slice(chunk))
                .await
                .unwrap();
        }
        assert_eq!(sink.finish().await.unwrap(), 500);
        let stream = tx.copy_out(&copy_out).await.unwrap();
        futures_util::pin_mut!(stream);
        let mut out = Vec::new();
        while let Some(chunk) = stream.next().await {
            out.extend_from_slice(&chunk.unwrap());
        }
        assert_eq!(String::from_utf8(out).unwrap(), data, "{mode:?}: COPY OUT");
        tx.commit().await.unwrap();

        if mode == PoolMode::Session {
            // Named prepared statements, prepared once and executed many times, outside any
            // transaction, and COPY without a transaction.
            let stmt = client
                .prepare("SELECT $1::int4 * 3, name FROM drv_tp_session WHERE id = $1")
                .await
                .unwrap();
            for i in 0..20i32 {
                let row = client.query_one(&stmt, &[&i]).await.unwrap();
                assert_eq!(row.get::<_, i32>(0), i * 3);
                assert_eq!(row.get::<_, String>(1), format!("n{i}"));
            }
            let other = client.prepare("SELECT $1::text || $2::text").await.unwrap();
            let row = client.query_one(&other, &[&"a", &"b"]).await.unwrap();
            assert_eq!(row.get::<_, String>(0), "ab");
            // The first statement is still there after the second was prepared.
            let row = client.query_one(&stmt, &[&7i32]).await.unwrap();
            assert_eq!(row.get::<_, i32>(0), 21);
            let n = client
                .execute("DELETE FROM drv_tp_session WHERE id >= $1", &[&1000i32])
                .await
                .unwrap();
            assert_eq!(n, 500);
            let sink = client.copy_in::<_, bytes::Bytes>(&copy_in).await.unwrap();
            futures_util::pin_mut!(sink);
            sink.send(bytes::Bytes::from(data.clone())).await.unwrap();
            assert_eq!(sink.finish().await.unwrap(), 500);
        }

        // Many clients at once, each checking each of its own answers.
        let mut tasks = Vec::new();
        for t in 0..16i32 {
            let url = url.clone();
            tasks.push(tokio::spawn(async move {
                let client = connect(&url).await;
                for i in 0..25i32 {
                    let row = client
                        .query_typed_one(
                            "SELECT $1::int4 * 1000 + $2::int4, $3::text",
                            &[
                                (&t, Type::INT4),
                                (&i, Type::INT4),
                                (&format!("t{t}i{i}"), Type::TEXT),
                            ],
                        )
                        .await
                        .unwrap();
                    assert_eq!(row.get::<_, i32>(0), t * 1000 + i);
                    assert_eq!(row.get::<_, String>(1), format!("t{t}i{i}"));
                    let rows = simple_rows(&client, &format!("SELECT {t}, {i}")).await;
                    assert_eq!(rows, vec![vec![Some(t.to_string()), Some(i.to_string())]]);
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        client
            .batch_execute(&format!("DROP TABLE {table}"))
            .await
            .unwrap();
        drop(client);
        proxy.shutdown().await;
    }
}

// ---------------------------------------------------------------------------------------------
// sqlx
// ---------------------------------------------------------------------------------------------

/// A PgPool of 8 connections shared by 16 tasks. Transaction mode: no statement cache,
/// `raw_sql` outside transactions and unnamed statements inside them; session mode: sqlx's
/// defaults (cached named statements) everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_pool_through_pgmemo() {
    for mode in MODES {
        // Session mode needs a server per sqlx connection.
        let size = if mode == PoolMode::Session { 8 } else { 4 };
        let proxy = pgmemo(mode, size).await;
        let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
        let mut opts: PgConnectOptions = url.parse().unwrap();
        if mode == PoolMode::Transaction {
            opts = opts.statement_cache_capacity(0);
        }
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(opts)
            .await
            .unwrap();
        let table = format!("drv_sqlx_{}", mode_name(mode));
        sqlx::raw_sql(&format!(
            "DROP TABLE IF EXISTS {table}; CREATE TABLE {table} (task int, i int, label text, PRIMARY KEY (task, i))"
        ))
        .execute(&pool)
        .await
        .unwrap();

        let mut tasks = Vec::new();
        for t in 0..16i32 {
            let pool = pool.clone();
            let table = table.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..20i32 {
                    let label = format!("task {t} item {i}");
                    if mode == PoolMode::Transaction {
                        // Outside a transaction: the simple protocol only.
                        let row =
                            sqlx::raw_sql(&format!("SELECT {t} * 100 + {i} AS v, 'x{t}' AS s"))
                                .fetch_one(&pool)
                                .await
                                .unwrap();
                        assert_eq!(row.get::<i32, _>(0), t * 100 + i);
                        assert_eq!(row.get::<String, _>(1), format!("x{t}"));
                        // Inside a transaction: parameters, unnamed statements.
                        let mut tx = pool.begin().await.unwrap();
                        sqlx::query(&format!("INSERT INTO {table} VALUES ($1, $2, $3)"))
                            .bind(t)
                            .bind(i)
                            .bind(&label)
                            .persistent(false)
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                        let row = sqlx::query(&format!(
                            "SELECT label, $3::int8 * 2 FROM {table} WHERE task = $1 AND i = $2"
                        ))
                        .bind(t)
                        .bind(i)
                        .bind(i64::from(t) << 32)
                        .persistent(false)
                        .fetch_one(&mut *tx)
                        .await
                        .unwrap();
                        assert_eq!(row.get::<String, _>(0), label);
                        assert_eq!(row.get::<i64, _>(1), (i64::from(t) << 32) * 2);
                        tx.commit().await.unwrap();
                    } else {
                        let row = sqlx::query("SELECT $1::int4 * 100 + $2::int4, $3::text")
                            .bind(t)
                            .bind(i)
                            .bind(&label)
                            .fetch_one(&pool)
                            .await
                            .unwrap();
                        assert_eq!(row.get::<i32, _>(0), t * 100 + i);
                        assert_eq!(row.get::<String, _>(1), label);
                        let mut tx = pool.begin().await.unwrap();
                        sqlx::query(&format!("INSERT INTO {table} VALUES ($1, $2, $3)"))
                            .bind(t)
                            .bind(i)
                            .bind(&label)
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                        tx.commit().await.unwrap();
                        let got: String = sqlx::query_scalar(&format!(
                            "SELECT label FROM {table} WHERE task = $1 AND i = $2"
                        ))
                        .bind(t)
                        .bind(i)
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                        assert_eq!(got, label);
                    }
                }
                // A rolled-back insert leaves nothing behind.
                let mut tx = pool.begin().await.unwrap();
                sqlx::query(&format!(
                    "INSERT INTO {table} VALUES ($1, 999, 'rolled back')"
                ))
                .bind(t)
                .persistent(mode == PoolMode::Session)
                .execute(&mut *tx)
                .await
                .unwrap();
                tx.rollback().await.unwrap();
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let row = sqlx::raw_sql(&format!(
            "SELECT count(*), count(DISTINCT task), sum(i)::int8, count(*) FILTER (WHERE i = 999) FROM {table}"
        ))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(row.get::<i64, _>(0), 16 * 20, "{mode:?}");
        assert_eq!(row.get::<i64, _>(1), 16);
        assert_eq!(row.get::<i64, _>(2), 16 * 190);
        assert_eq!(row.get::<i64, _>(3), 0);
        sqlx::raw_sql(&format!("DROP TABLE {table}"))
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
        proxy.shutdown().await;
    }
}

// ---------------------------------------------------------------------------------------------
// psycopg 3
// ---------------------------------------------------------------------------------------------

/// Whether `python3 -c "import psycopg"` works. Without it the test fails under CI (the
/// setup installs psycopg there) and is skipped, loudly, elsewhere.
async fn psycopg_available() -> bool {
    let ok = tokio::process::Command::new("python3")
        .args(["-c", "import psycopg"])
        .output()
        .await
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "python3 with psycopg 3 is required under CI: pip install \"psycopg[binary]\""
        );
        eprintln!(
            "SKIPPED psycopg driver test: `python3 -c 'import psycopg'` failed; \
             install it with: pip install \"psycopg[binary]\""
        );
    }
    ok
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psycopg3_through_pgmemo() {
    if !psycopg_available().await {
        return;
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/drivers/psycopg_check.py"
    );
    for mode in MODES {
        let proxy = pgmemo(mode, 4).await;
        let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
        let out = tokio::process::Command::new("python3")
            .arg(script)
            .arg(&url)
            .arg(mode_name(mode))
            .output()
            .await
            .expect("run python3");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "psycopg_check.py in {mode:?} mode failed ({}):\n{stdout}\n{stderr}",
            out.status
        );
        assert!(stdout.contains("psycopg check OK"), "{stdout}\n{stderr}");
        proxy.shutdown().await;
    }
}

// ---------------------------------------------------------------------------------------------
// pgbench
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbench_simple_and_extended_through_pgmemo() {
    let db = "drv_pgbench";
    pgbench_database(db).await;

    let proxy = pgmemo(PoolMode::Transaction, 4).await;
    let port = proxy.local_addr().port();
    for protocol in ["simple", "extended"] {
        let out = pgbench(
            &["-S", "-M", protocol, "-c", "8", "-j", "2", "-t", "300", db],
            port,
            PGMEMO_USER,
            PGMEMO_PASS,
        )
        .await;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "pgbench -M {protocol} through pgmemo: {}\n{stdout}\n{stderr}",
            out.status
        );
        assert!(
            stdout.contains("number of failed transactions: 0 "),
            "pgbench -M {protocol}:\n{stdout}\n{stderr}"
        );
        assert!(
            stdout.contains("number of transactions actually processed: 2400/2400"),
            "pgbench -M {protocol}:\n{stdout}\n{stderr}"
        );
    }
    proxy.shutdown().await;
}
