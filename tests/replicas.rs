//! Reads on streaming replicas, with read-your-writes by WAL position (docs/replicas.md).
//!
//! A real primary and a real streaming standby (`pg_basebackup -R -X stream`, second port),
//! both started here, and pgmemo in front of them with the standby as a replica. Where a
//! statement ran is told by the statement itself (`current_setting('port')`: the server's
//! own port, a STABLE function that routing allows), and a statement that writes could not
//! run on the standby at all (it refuses: 25006): success is the primary's.

mod common;

use common::first_value as value;
use common::*;
use pgmemo::config::{AuthType, Config, PoolMode, Upstream};
use pgmemo::demo::{LocalPostgres, LocalPostgresOptions};
use pgmemo::Pgmemo;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::Client;

/// A client that sets `pgmemo.report_read_lsn` (at connect or by SET) is told its floor, a
/// ParameterStatus `pgmemo.read_lsn`, ahead of the ReadyForQuery of each write that raised
/// it, in either protocol: the value `SHOW pgmemo.read_lsn` gives, which another client
/// given it as `pgmemo.min_read_lsn` reads the write at on the replica. Reads report nothing;
/// a client that did not ask is told nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_asks_is_told_its_floor_with_each_write() {
    let (primary, standby) = primary_and_standby().await;
    let proxy = pgmemo_with_replica(&primary, &standby).await;
    let addr = proxy.local_addr();
    let raw = |params: &'static [(&'static str, &'static str)]| async move {
        RawClient::connect(addr, "postgres", "postgres", None, params)
            .await
            .expect("a raw client")
    };
    let mut asker = raw(&[("pgmemo.report_read_lsn", "on")]).await;
    let replies = exchange(
        &mut asker,
        &[Frontend::query("INSERT INTO items VALUES (200, 'told')")],
    )
    .await;
    let told = read_lsn_reports(&replies);
    assert_eq!(told.len(), 1, "one report for the write: {replies:?}");
    let told = told[0].clone();
    let shown = exchange(&mut asker, &[Frontend::query("SHOW pgmemo.read_lsn")]).await;
    let shown = shown.iter().find_map(|m| m.data_row()).expect("a row");
    assert_eq!(shown[0].as_deref(), Some(told.as_bytes()));
    let read = exchange(
        &mut asker,
        &[Frontend::query("SELECT v FROM items WHERE id = 200")],
    )
    .await;
    assert!(read_lsn_reports(&read).is_empty(), "a read reports nothing");
    // The extended protocol's write, as a driver sends it.
    let replies = exchange(
        &mut asker,
        &[
            Frontend::parse("", "UPDATE items SET v = 'told again' WHERE id = 200", &[]),
            Frontend::bind("", "", &[]),
            Frontend::execute("", 0),
            Frontend::Sync,
        ],
    )
    .await;
    let again = read_lsn_reports(&replies);
    assert_eq!(again.len(), 1, "{replies:?}");
    let lsn = |s: &str| {
        let (hi, lo) = s.split_once('/').expect("an LSN");
        (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
    };
    assert!(lsn(&again[0]) > lsn(&told));
    // Carried to another client: it reads the write on the replica.
    let other = connect(&url_of(&proxy)).await;
    other
        .simple_query(&format!("SET pgmemo.min_read_lsn = '{}'", again[0]))
        .await
        .unwrap();
    assert_eq!(
        value(
            &other,
            "SELECT v || ' on ' || current_setting('port') FROM items WHERE id = 200"
        )
        .await,
        format!("told again on {}", standby.port())
    );
    // Not asked: nothing told, until it asks.
    let mut quiet = raw(&[]).await;
    let replies = exchange(
        &mut quiet,
        &[Frontend::query("INSERT INTO items VALUES (201, 'quiet')")],
    )
    .await;
    assert!(read_lsn_reports(&replies).is_empty(), "{replies:?}");
    exchange(
        &mut quiet,
        &[Frontend::query("SET pgmemo.report_read_lsn = yes")],
    )
    .await;
    let replies = exchange(
        &mut quiet,
        &[Frontend::query(
            "UPDATE items SET v = 'heard' WHERE id = 201",
        )],
    )
    .await;
    assert_eq!(read_lsn_reports(&replies).len(), 1, "{replies:?}");
}

/// A client that turns `pgmemo.report_read_lsn` on or off in the same work as its write, or
/// just ahead of it (pipelined: the write goes behind the question for the SET's position),
/// is told its floor as it now asked: when on, the last report ahead of the write's last
/// ReadyForQuery is the floor `SHOW pgmemo.read_lsn` then gives; when off, none. By `SET` in
/// the write's query, by a `SET` or `set_config` sent with it, and `RESET` to turn it off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_asks_along_with_its_write_is_told_its_floor() {
    let (primary, standby) = primary_and_standby().await;
    let proxy = pgmemo_with_replica(&primary, &standby).await;
    let mut client = RawClient::connect(proxy.local_addr(), "postgres", "postgres", None, &[])
        .await
        .expect("a raw client");
    exchange(
        &mut client,
        &[Frontend::query("INSERT INTO items VALUES (300, 'asked')")],
    )
    .await;
    for round in 0..60 {
        let write = format!("UPDATE items SET v = 'round {round}' WHERE id = 300");
        let turn_on: Vec<Frontend> = match round % 3 {
            0 => vec![Frontend::query(&format!(
                "SET pgmemo.report_read_lsn = on; {write}"
            ))],
            1 => vec![
                Frontend::query("SET pgmemo.report_read_lsn = on"),
                Frontend::query(&write),
            ],
            _ => vec![
                Frontend::parse(
                    "",
                    "SELECT pg_catalog.set_config('pgmemo.report_read_lsn', 'on', false)",
                    &[],
                ),
                Frontend::bind("", "", &[]),
                Frontend::execute("", 0),
                Frontend::Sync,
                Frontend::query(&write),
            ],
        };
        let ready = 1 + usize::from(round % 3 != 0);
        client.send(&turn_on).await.expect("sent");
        let replies = client.recv_until_ready(ready).await.expect("the replies");
        let told = read_lsn_reports(&replies);
        let shown = exchange(&mut client, &[Frontend::query("SHOW pgmemo.read_lsn")]).await;
        let shown = shown.iter().find_map(|m| m.data_row()).expect("a row");
        let shown = String::from_utf8(shown[0].clone().expect("a value")).expect("text");
        assert_eq!(told.last(), Some(&shown), "round {round}: {replies:?}");
        // Off again, with a write sent behind it: nothing told.
        client
            .send(&[
                Frontend::query("RESET pgmemo.report_read_lsn"),
                Frontend::query(&format!(
                    "UPDATE items SET v = 'round {round} again' WHERE id = 300"
                )),
            ])
            .await
            .expect("sent");
        let replies = client.recv_until_ready(2).await.expect("the replies");
        assert!(
            replies.iter().all(|m| m.tag != b'E') && read_lsn_reports(&replies).is_empty(),
            "round {round}: {replies:?}"
        );
    }
}

/// A client that writes again at once, before pgmemo's question for the position of its
/// last write is answered (it goes behind the question, on the same server), has that write
/// in its floor too: `SHOW pgmemo.read_lsn`, also sent at once, waits for what is in flight
/// and is past the position the second write ran at. Each round: an INSERT, an UPDATE
/// returning its own WAL position (alternately in either protocol), the SHOW.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_sent_while_the_last_ones_position_is_asked_for_counts_too() {
    const ROUNDS: i64 = 1_000;
    let (primary, standby) = primary_and_standby().await;
    let proxy = pgmemo_with_replica(&primary, &standby).await;
    let mut client = RawClient::connect(proxy.local_addr(), "postgres", "postgres", None, &[])
        .await
        .expect("a raw client");
    let lsn = |s: &[u8]| {
        let s = std::str::from_utf8(s).expect("text");
        let (hi, lo) = s.split_once('/').expect("an LSN");
        (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
    };
    let first_value = |replies: &[Backend]| -> Vec<u8> {
        let row = replies.iter().find_map(|m| m.data_row());
        let row = row.unwrap_or_else(|| panic!("a row: {replies:?}"));
        row[0].clone().expect("a value")
    };
    let mut behind = Vec::new();
    for id in 10_000..10_000 + ROUNDS {
        exchange(
            &mut client,
            &[Frontend::query(&format!(
                "INSERT INTO items VALUES ({id}, 'a')"
            ))],
        )
        .await;
        let update = format!(
            "UPDATE items SET v = 'b' WHERE id = {id} RETURNING pg_current_wal_insert_lsn()::text"
        );
        let messages = if id % 2 == 0 {
            vec![Frontend::query(&update)]
        } else {
            vec![
                Frontend::parse("", &update, &[]),
                Frontend::bind("", "", &[]),
                Frontend::execute("", 0),
                Frontend::Sync,
            ]
        };
        let ran_at = lsn(&first_value(&exchange(&mut client, &messages).await));
        let shown = exchange(&mut client, &[Frontend::query("SHOW pgmemo.read_lsn")]).await;
        let floor = lsn(&first_value(&shown));
        if floor < ran_at {
            behind.push((id, floor, ran_at));
        }
    }
    assert!(behind.is_empty(), "floors behind the write: {behind:?}");
}

/// Sends `messages` and reads the replies up to the ReadyForQuery, which must come last.
async fn exchange(client: &mut RawClient, messages: &[Frontend]) -> Vec<Backend> {
    client.send(messages).await.expect("sent");
    let replies = client.recv_until_ready(1).await.expect("the replies");
    assert_eq!(replies.last().map(|m| m.tag), Some(b'Z'), "{replies:?}");
    replies
}

/// The values of the ParameterStatus `pgmemo.read_lsn` messages among `replies`.
fn read_lsn_reports(replies: &[Backend]) -> Vec<String> {
    replies
        .iter()
        .filter_map(Backend::parameter_status)
        .filter(|(name, _)| name == "pgmemo.read_lsn")
        .map(|(_, value)| value)
        .collect()
}

/// The primary stops: reads go on on the replica, for the clients connected and for new ones
/// (their login needs no server once the pool knows its defaults); a write gets the error of
/// the primary's refused connection at once. The primary back, writes work again, and a
/// client's read after its write sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_down_leaves_reads_on_the_replica() {
    let (mut primary, standby) = primary_and_standby().await;
    let proxy = pgmemo_with_replica(&primary, &standby).await;
    let url = url_of(&proxy);
    let reader = connect(&url).await;
    let replica_port = standby.port().to_string();
    assert_eq!(
        value(&reader, "SELECT v FROM items WHERE id = 3").await,
        "v3"
    );
    primary = off_runtime(primary, |pg| pg.stop_server("immediate")).await;
    for _ in 0..20 {
        assert_eq!(
            value(&reader, "SELECT v FROM items WHERE id = 3").await,
            "v3"
        );
        assert_eq!(
            value(&reader, "SELECT current_setting('port')").await,
            replica_port
        );
    }
    let newcomer = connect(&url).await;
    assert_eq!(
        value(&newcomer, "SELECT v FROM items WHERE id = 4").await,
        "v4"
    );
    let writer = connect(&url).await;
    let err = writer
        .simple_query("UPDATE items SET v = 'w' WHERE id = 5")
        .await
        .expect_err("no primary to write on");
    let db = err.as_db_error().expect("a server's error");
    assert_eq!(db.code().code(), "08006", "{db:?}");
    assert!(
        db.message()
            .starts_with("pgmemo could not connect to server"),
        "{db:?}"
    );
    // The reader is not the writer's: it goes on.
    assert_eq!(
        value(&reader, "SELECT v FROM items WHERE id = 3").await,
        "v3"
    );
    primary = off_runtime(primary, |pg| {
        pg.restart("fast").expect("the primary starts again")
    })
    .await;
    let writer = connect(&url).await;
    wait_until("writes to work again", Duration::from_secs(30), || async {
        writer
            .simple_query("UPDATE items SET v = 'back' WHERE id = 5")
            .await
            .is_ok()
    })
    .await;
    assert_eq!(
        value(&writer, "SELECT v FROM items WHERE id = 5").await,
        "back"
    );
    drop(primary);
}

/// A primary that lets its superuser replicate over TCP, and a streaming standby of it. The
/// primary commits as production servers do (`synchronous_commit = on`: a commit is flushed,
/// and so sent to the standby, before it returns; the test clusters' default, off, leaves
/// it to the WAL writer, up to 200 ms later).
async fn primary_and_standby() -> (LocalPostgres, LocalPostgres) {
    tokio::task::spawn_blocking(|| {
        let primary = LocalPostgres::start(LocalPostgresOptions {
            // (Logical: the result cache's WAL invalidation follows the primary.)
            settings: vec![
                ("synchronous_commit".into(), "on".into()),
                ("wal_level".into(), "logical".into()),
            ],
            hba: vec![
                "local replication all trust".into(),
                "host replication all 127.0.0.1/32 trust".into(),
            ],
            ..LocalPostgresOptions::default()
        })
        .expect("a primary");
        primary
            .psql(
                "postgres",
                "CREATE TABLE items (id bigint PRIMARY KEY, v text); \
                 CREATE UNLOGGED TABLE scratch (id int); \
                 CREATE SEQUENCE seq; \
                 CREATE FUNCTION bump() RETURNS bigint VOLATILE LANGUAGE sql \
                   AS 'INSERT INTO items VALUES (-1, NULL) ON CONFLICT (id) DO UPDATE SET v = \
                   coalesce(items.v, '''') || ''x'' RETURNING id'; \
                 CREATE VIEW item_ids AS SELECT id FROM items; \
                 INSERT INTO items SELECT i, 'v' || i FROM generate_series(1, 10) i;",
            )
            .expect("the schema");
        let standby = primary.standby().expect("a standby");
        (primary, standby)
    })
    .await
    .unwrap()
}

/// pgmemo in transaction mode in front of `primary`, with `standby` as its replica, clients
/// trusted as `postgres`, `replica_wait` 50 ms (the default).
async fn pgmemo_with_replica(primary: &LocalPostgres, standby: &LocalPostgres) -> Pgmemo {
    pgmemo_waiting(primary, standby, Duration::from_millis(50)).await
}

/// [`pgmemo_with_replica`] with another `replica_wait`.
async fn pgmemo_waiting(
    primary: &LocalPostgres,
    standby: &LocalPostgres,
    replica_wait: Duration,
) -> Pgmemo {
    pgmemo_configured(primary, standby, replica_wait, |_| {}).await
}

/// [`pgmemo_waiting`], its configuration changed by `change`.
async fn pgmemo_configured(
    primary: &LocalPostgres,
    standby: &LocalPostgres,
    replica_wait: Duration,
    change: impl FnOnce(&mut Config),
) -> Pgmemo {
    let mut config = Config::for_upstream(Upstream {
        host: "127.0.0.1".into(),
        port: primary.port(),
        user: "postgres".into(),
        replicas: vec![("127.0.0.1".into(), standby.port())],
        ..Default::default()
    });
    config.general.listen = "127.0.0.1:0".into();
    config.general.pool_mode = PoolMode::Transaction;
    config.general.default_pool_size = 8;
    config.general.auth_type = AuthType::Trust;
    config.general.admin_users = vec!["postgres".into()];
    config.general.replica_wait = replica_wait;
    change(&mut config);
    let proxy = start_pgmemo(config).await;
    // Routing starts once the replica's monitor has read its position and its catalog.
    let client = connect(&url_of(&proxy)).await;
    let port = standby.port().to_string();
    wait_until(
        "reads to reach the replica",
        Duration::from_secs(30),
        || async { value(&client, "SELECT current_setting('port')").await == port },
    )
    .await;
    proxy
}

fn url_of(proxy: &Pgmemo) -> String {
    format!("postgresql://postgres@{}/postgres", proxy.local_addr())
}

/// The port of the server that ran `sql` (which must return it in its first column).
async fn ran_on(client: &Client, sql: &str) -> u16 {
    value(client, sql).await.parse().expect("a port")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_that_provably_only_read_go_to_the_replica_and_everything_else_to_the_primary() {
    let (primary, standby) = primary_and_standby().await;
    // Where a read goes, whatever the load: a replica slow to replay the client's last write
    // (the suite runs on two cores) is waited for rather than passed over.
    let proxy = pgmemo_waiting(&primary, &standby, Duration::from_secs(30)).await;
    let client = connect(&url_of(&proxy)).await;
    let (p, s) = (primary.port(), standby.port());
    let port = "current_setting('port')";

    // Simple protocol.
    let cases: &[(&str, u16)] = &[
        (&format!("SELECT {port} FROM items WHERE id = 1"), s),
        (&format!("SELECT {port}, count(*) FROM items"), s),
        (&format!("SELECT {port}, now() FROM item_ids LIMIT 1"), s),
        (&format!("SELECT {port}, random()"), p),
        (&format!("SELECT {port}, nextval('seq')"), p),
        (&format!("SELECT {port}, bump()"), p),
        (
            &format!("SELECT {port} FROM items WHERE id = 1 FOR UPDATE"),
            p,
        ),
        (
            &format!("SELECT {port} FROM items WHERE id = 1 FOR SHARE"),
            p,
        ),
        (
            &format!("SELECT {port} FROM scratch UNION ALL SELECT {port}"),
            p,
        ),
        (
            &format!("WITH d AS (DELETE FROM items WHERE id = 1000 RETURNING id) SELECT {port}"),
            p,
        ),
        (&format!("SELECT {port}, pg_advisory_xact_lock(1)"), p),
        (&format!("SELECT {port}, set_config('a.b', 'c', true)"), p),
        (&format!("/* pgmemo primary */ SELECT {port} FROM items"), p),
        (&format!("SELECT {port} FROM items /*pgmemo='primary'*/"), p),
        (&format!("/* pgmemo nocache */ SELECT {port} FROM items"), s),
    ];
    for (sql, want) in cases {
        assert_eq!(ran_on(&client, sql).await, *want, "{sql}");
    }

    // Extended protocol (tokio-postgres prepares each statement, unnamed or named).
    let read = client
        .prepare(&format!("SELECT {port} FROM items WHERE id = $1"))
        .await
        .unwrap();
    for _ in 0..3 {
        let row = client.query_one(&read, &[&1i64]).await.unwrap();
        assert_eq!(row.get::<_, String>(0), s.to_string(), "a prepared read");
    }
    let hinted = format!("SELECT {port} FROM items WHERE id = $1 /* pgmemo primary */");
    let hinted = client.prepare(&hinted).await.unwrap();
    for _ in 0..2 {
        let row = client.query_one(&hinted, &[&1i64]).await.unwrap();
        assert_eq!(
            row.get::<_, String>(0),
            p.to_string(),
            "a prepared read, hinted"
        );
    }
    let locking = format!("SELECT {port} FROM items WHERE id = $1 FOR UPDATE");
    let row = client.query_one(&locking, &[&1i64]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), p.to_string(), "{locking}");
    let write = "INSERT INTO items VALUES ($1, 'x') RETURNING current_setting('port')";
    let row = client.query_one(write, &[&100i64]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), p.to_string(), "a write, extended");

    // A transaction block stays on the primary, reads included.
    client.simple_query("BEGIN").await.unwrap();
    assert_eq!(
        ran_on(&client, &format!("SELECT {port}")).await,
        p,
        "in a block"
    );
    client.simple_query("COMMIT").await.unwrap();

    // A client with session state it is pinned for (a temporary table) stays on its server.
    let pinned = connect(&url_of(&proxy)).await;
    pinned
        .simple_query("CREATE TEMP TABLE mine (a int)")
        .await
        .unwrap();
    assert_eq!(
        ran_on(&pinned, &format!("SELECT {port} FROM items LIMIT 1")).await,
        p,
        "a pinned client"
    );
}

/// A read-only transaction block runs whole on the replica, as PgDog runs it: `BEGIN READ
/// ONLY` (or a `BEGIN` under the client's `default_transaction_read_only`), not SERIALIZABLE
/// (which a standby refuses), in either protocol, and also when the result cache kept the
/// `BEGIN`; everything in it stays there, a write fails as it fails in a read-only block on
/// the primary, and it reads the client's own writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_blocks_run_whole_on_the_replica() {
    let (primary, standby) = primary_and_standby().await;
    let (p, s) = (primary.port(), standby.port());
    let port = "SELECT current_setting('port')";
    // Not proven to only read: alone, it goes to the primary.
    let unproven = "SELECT current_setting('port'), random()";
    let direct = connect(&format!("postgresql://postgres@127.0.0.1:{p}/postgres")).await;
    for cache in [false, true] {
        let proxy = pgmemo_configured(&primary, &standby, Duration::from_secs(30), |c| {
            c.cache.enabled = cache;
        })
        .await;
        let client = connect(&url_of(&proxy)).await;
        assert_eq!(ran_on(&client, unproven).await, p, "{unproven} alone");
        for (begin, want) in [
            ("BEGIN READ ONLY", s),
            ("begin transaction read only", s),
            (
                "START TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY",
                s,
            ),
            ("BEGIN READ ONLY ISOLATION LEVEL READ COMMITTED", s),
            ("BEGIN READ ONLY ISOLATION LEVEL SERIALIZABLE", p),
            ("BEGIN", p),
            ("BEGIN READ WRITE", p),
            ("BEGIN READ ONLY; SELECT 1", p),
        ] {
            client.simple_query(begin).await.unwrap();
            assert_eq!(
                ran_on(&client, unproven).await,
                want,
                "{begin} (cache {cache})"
            );
            assert_eq!(ran_on(&client, port).await, want, "{begin} (cache {cache})");
            client.simple_query("COMMIT").await.unwrap();
        }

        // A block made read-only by its first statement: the BEGIN waits for it.
        for (begin, set, want) in [
            ("BEGIN", "SET TRANSACTION READ ONLY", s),
            (
                "BEGIN ISOLATION LEVEL REPEATABLE READ",
                "SET TRANSACTION READ ONLY",
                s,
            ),
            (
                "START TRANSACTION",
                "set transaction isolation level read committed, read only;",
                s,
            ),
            (
                "BEGIN",
                "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE, READ ONLY",
                p,
            ),
            ("BEGIN", "SET TRANSACTION READ WRITE", p),
            ("BEGIN", "SELECT 1", p),
        ] {
            client.simple_query(begin).await.unwrap();
            client.simple_query(set).await.unwrap();
            assert_eq!(
                ran_on(&client, unproven).await,
                want,
                "{begin}; {set} (cache {cache})"
            );
            client.simple_query("COMMIT").await.unwrap();
        }
        // In the extended protocol; and a block that never ran anything.
        client.execute("BEGIN", &[]).await.unwrap();
        client
            .execute("SET TRANSACTION READ ONLY", &[])
            .await
            .unwrap();
        let row = client.query_one(unproven, &[]).await.unwrap();
        assert_eq!(
            row.get::<_, String>(0),
            s.to_string(),
            "extended SET (cache {cache})"
        );
        client.execute("COMMIT", &[]).await.unwrap();
        client.simple_query("BEGIN").await.unwrap();
        client.simple_query("COMMIT").await.unwrap();

        // The extended protocol (tokio-postgres prepares, then binds: two units).
        client.execute("BEGIN READ ONLY", &[]).await.unwrap();
        let row = client.query_one(unproven, &[]).await.unwrap();
        assert_eq!(
            row.get::<_, String>(0),
            s.to_string(),
            "extended (cache {cache})"
        );
        client.execute("COMMIT", &[]).await.unwrap();

        // A write fails as in a read-only block on the primary; the client is fine after.
        let write = "INSERT INTO items VALUES (900, 'no')";
        let error = |e: tokio_postgres::Error| {
            let e = e.as_db_error().expect("a server error").clone();
            (e.code().code().to_owned(), e.message().to_owned())
        };
        client.simple_query("BEGIN READ ONLY").await.unwrap();
        let through = error(client.simple_query(write).await.unwrap_err());
        client.simple_query("ROLLBACK").await.unwrap();
        direct.simple_query("BEGIN READ ONLY").await.unwrap();
        let expected = error(direct.simple_query(write).await.unwrap_err());
        direct.simple_query("ROLLBACK").await.unwrap();
        assert_eq!(through, expected);
        assert_eq!(ran_on(&client, unproven).await, p, "after the block");

        // The client's default makes its blocks read-only, unless one says READ WRITE.
        for (set, reset) in [
            (
                "SET default_transaction_read_only = on",
                "RESET default_transaction_read_only",
            ),
            (
                "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
                "SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE",
            ),
        ] {
            client.simple_query(set).await.unwrap();
            for (begin, want) in [("BEGIN", s), ("BEGIN READ WRITE", p)] {
                client.simple_query(begin).await.unwrap();
                assert_eq!(ran_on(&client, unproven).await, want, "{begin} after {set}");
                client.simple_query("COMMIT").await.unwrap();
            }
            client.simple_query(reset).await.unwrap();
            client.simple_query("BEGIN").await.unwrap();
            assert_eq!(ran_on(&client, unproven).await, p, "BEGIN after {reset}");
            client.simple_query("COMMIT").await.unwrap();
        }

        // A write pipelined behind the block's end goes to the primary.
        client.simple_query("BEGIN READ ONLY").await.unwrap();
        assert_eq!(ran_on(&client, unproven).await, s, "(cache {cache})");
        let id = if cache { 3_000 } else { 3_001 };
        let insert =
            format!("INSERT INTO items VALUES ({id}, 'after') RETURNING current_setting('port')");
        let (commit, inserted) =
            tokio::join!(client.simple_query("COMMIT"), client.simple_query(&insert));
        commit.unwrap();
        let inserted = inserted.unwrap_or_else(|e| panic!("{insert}: {e}"));
        assert_eq!(
            rows(&inserted)[0].0,
            p.to_string(),
            "{insert} (cache {cache})"
        );

        // A block reads what the client wrote just before.
        let base = if cache { 2_000 } else { 1_000 };
        for id in base..base + 20 {
            client
                .simple_query(&format!("INSERT INTO items VALUES ({id}, 'w{id}')"))
                .await
                .unwrap();
            client.simple_query("BEGIN READ ONLY").await.unwrap();
            // One row whether or not it sees the row written, and where it ran.
            let read = format!(
                "SELECT v, current_setting('port'), pg_last_wal_replay_lsn()::text \
                 FROM (VALUES (1)) one LEFT JOIN items ON id = {id}"
            );
            let rows = client.simple_query(&read).await.unwrap();
            client.simple_query("COMMIT").await.unwrap();
            let row = rows
                .iter()
                .find_map(|m| match m {
                    tokio_postgres::SimpleQueryMessage::Row(r) => Some(
                        (0..3)
                            .map(|i| r.get(i).map(str::to_owned))
                            .collect::<Vec<_>>(),
                    ),
                    _ => None,
                })
                .expect("a row");
            if row[..2] != [Some(format!("w{id}")), Some(s.to_string())] {
                let floor = value(&client, "SHOW pgmemo.read_lsn").await;
                panic!("{read} (cache {cache}): {row:?}; the client's floor now {floor}");
            }
        }
        proxy.shutdown().await;
    }
}

/// With the result cache and WAL invalidation, a miss is filled on the replica once it has
/// replayed every commit the result's versions include, never before: with the standby's
/// replay paused, a row written directly on the primary (once pgmemo's follower decoded it)
/// or through pgmemo by another client is read new, not filled stale from the replica;
/// replay resumed, misses fill there again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_fill_goes_to_a_replica_only_once_it_has_every_commit_the_result_shows() {
    let (primary, standby) = primary_and_standby().await;
    let proxy = pgmemo_configured(&primary, &standby, Duration::from_millis(50), |c| {
        c.cache.enabled = true;
        c.cache.admit_after = 1;
        c.cache.invalidation = pgmemo::config::cache::Invalidation::Wal;
        c.cache.rules = vec![cache_rule("items", "FROM items WHERE")];
    })
    .await;
    let url = url_of(&proxy);
    let reader = connect(&url).await;
    let writer = connect(&url).await;
    let direct = connect(&primary.url("postgres", None, "postgres")).await;
    let direct_standby = connect(&standby.url("postgres", None, "postgres")).await;
    let console = connect(&format!(
        "postgresql://postgres@{}/pgmemo",
        proxy.local_addr()
    ))
    .await;
    let replica_reads = || async {
        let rows = console.simple_query("SHOW REPLICAS").await.unwrap();
        rows.iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get("reads").map(str::to_owned),
                _ => None,
            })
            .and_then(|n| n.parse::<u64>().ok())
            .expect("the replica's reads")
    };
    let follower = || wal_follower(&proxy, "postgres");
    let read = |id: i64| {
        let reader = &reader;
        async move {
            let rows = reader
                .simple_query(&format!("SELECT v FROM items WHERE id = {id}"))
                .await
                .unwrap();
            rows.iter().find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            })
        }
    };
    // Misses of keys never read fill on the replica once its monitor read a position after
    // the follower's start.
    read(1).await;
    wait_until(
        "the follower to catch up",
        Duration::from_secs(30),
        || async { follower().is_some_and(|f| f.is_ready()) },
    )
    .await;
    let fresh = AtomicU64::new(1_000);
    let fills_reach_the_replica = || async {
        let before = replica_reads().await;
        read(fresh.fetch_add(1, Relaxed) as i64).await;
        replica_reads().await > before
    };
    wait_until(
        "a fill on the replica",
        Duration::from_secs(30),
        fills_reach_the_replica,
    )
    .await;
    for id in 1..=10 {
        assert_eq!(read(id).await, Some(format!("v{id}")), "cached");
    }
    // Replay paused: what is written now is not on the replica.
    direct_standby
        .simple_query("SELECT pg_wal_replay_pause()")
        .await
        .unwrap();
    for id in 1..=5 {
        direct
            .simple_query(&format!(
                "UPDATE items SET v = 'direct {id}' WHERE id = {id}"
            ))
            .await
            .unwrap();
    }
    let written = value(&direct, "SELECT pg_current_wal_lsn()::text").await;
    let written: pgmemo::wal::Lsn = written.parse().unwrap();
    wait_until(
        "the follower to decode the writes",
        Duration::from_secs(30),
        || async { follower().is_some_and(|f| f.is_ready() && f.applied() >= written) },
    )
    .await;
    for id in 6..=10 {
        writer
            .simple_query(&format!(
                "UPDATE items SET v = 'through {id}' WHERE id = {id}"
            ))
            .await
            .unwrap();
    }
    let before = replica_reads().await;
    for id in 1..=10 {
        let want = if id <= 5 { "direct" } else { "through" };
        assert_eq!(
            read(id).await,
            Some(format!("{want} {id}")),
            "read while replay is paused"
        );
        // Read again: the fill was stored, and it was right.
        assert_eq!(read(id).await, Some(format!("{want} {id}")));
    }
    assert_eq!(
        replica_reads().await,
        before,
        "no fill went to the paused replica"
    );
    direct_standby
        .simple_query("SELECT pg_wal_replay_resume()")
        .await
        .unwrap();
    wait_until(
        "fills on the replica again",
        Duration::from_secs(30),
        fills_reach_the_replica,
    )
    .await;
}

/// SHOW REPLICAS and SHOW SERVERS say where reads went, and how far behind the replica is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_each_replica_its_lag_and_the_reads_it_took() {
    let (primary, standby) = primary_and_standby().await;
    let proxy = pgmemo_with_replica(&primary, &standby).await;
    let client = connect(&url_of(&proxy)).await;
    for _ in 0..5 {
        value(&client, "SELECT v FROM items WHERE id = 2").await;
    }
    let console = connect(&format!(
        "postgresql://postgres@{}/pgmemo",
        proxy.local_addr()
    ))
    .await;
    let table = |rows: Vec<tokio_postgres::SimpleQueryMessage>| {
        rows.into_iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => Some(r),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let replicas = table(console.simple_query("SHOW REPLICAS").await.unwrap());
    assert_eq!(replicas.len(), 1);
    let r = &replicas[0];
    assert_eq!(r.get("port"), Some(standby.port().to_string().as_str()));
    assert_eq!(r.get("state"), Some("up"));
    assert!(r.get("replay_lsn").unwrap().contains('/'));
    let reads: u64 = r.get("reads").unwrap().parse().unwrap();
    assert!(reads >= 5, "{reads} reads counted");
    assert!(r.get("lag_bytes").unwrap().parse::<u64>().is_ok());
    let databases = table(console.simple_query("SHOW DATABASES").await.unwrap());
    let postgres = databases.iter().find(|d| d.get("name") == Some("postgres"));
    assert_eq!(
        postgres.and_then(|d| d.get("replicas")),
        Some(format!("127.0.0.1:{}", standby.port()).as_str())
    );
    let servers = table(console.simple_query("SHOW SERVERS").await.unwrap());
    let role_of = |port: u16| {
        servers
            .iter()
            .filter(|s| s.get("port") == Some(port.to_string().as_str()))
            .map(|s| s.get("role").unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert!(
        !role_of(standby.port()).is_empty(),
        "the replica's servers are listed"
    );
    assert!(role_of(standby.port()).iter().all(|r| r == "replica"));
    assert!(role_of(primary.port()).iter().all(|r| r == "primary"));
    let metrics = pgmemo::metrics::render(proxy.app());
    let labels = format!(
        "database=\"postgres\",user=\"postgres\",host=\"127.0.0.1\",port=\"{}\"",
        standby.port()
    );
    assert!(
        metrics.contains(&format!("pgmemo_replica_up{{{labels}}} 1")),
        "{metrics}"
    );
    assert!(metrics.contains(&format!("pgmemo_replica_lag_bytes{{{labels}}} ")));
    let reads = format!("pgmemo_replica_reads_total{{{labels}}} ");
    let counted: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix(&reads))
        .and_then(|n| n.parse().ok())
        .expect("the reads counted");
    assert!(counted >= 5);
}

/// A RELOAD that drops the replica: reads go to the primary, for the clients connected
/// before it as for new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_without_the_replica_sends_every_read_to_the_primary() {
    let (primary, standby) = primary_and_standby().await;
    let proxy = pgmemo_with_replica(&primary, &standby).await;
    let before = connect(&url_of(&proxy)).await;
    let read = "SELECT current_setting('port') FROM items LIMIT 1";
    assert_eq!(ran_on(&before, read).await, standby.port());
    let mut config = (**proxy.app().config.load()).clone();
    config.upstream.as_mut().unwrap().replicas.clear();
    proxy.app().reload(config).expect("the reload");
    for _ in 0..5 {
        assert_eq!(
            ran_on(&before, read).await,
            primary.port(),
            "a client from before"
        );
    }
    let after = connect(&url_of(&proxy)).await;
    assert_eq!(ran_on(&after, read).await, primary.port(), "a new client");
}

/// Eight clients each write rows through pgmemo and read each at once, and read rows other
/// clients wrote, given the position they were told (`SHOW pgmemo.read_lsn` by the writer,
/// `SET pgmemo.min_read_lsn` by the reader). Halfway, the standby's replay is paused for a
/// while: reads must then wait or go to the primary, never see the past.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_always_reads_its_own_writes_and_what_it_was_told_of() {
    const CLIENTS: i64 = 8;
    const WRITES: i64 = 10_000;
    let (primary, standby) = primary_and_standby().await;
    let proxy = pgmemo_with_replica(&primary, &standby).await;
    let url = url_of(&proxy);
    let direct_standby = connect(&standby.url("postgres", None, "postgres")).await;
    let violations = Arc::new(AtomicU64::new(0));
    let told_violations = Arc::new(AtomicU64::new(0));
    let on_replica = Arc::new(AtomicU64::new(0));
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<(i64, String)>();
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    let sport = standby.port().to_string();
    let done = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let told_violations = told_violations.clone();
            let (url, violations, on_replica, tx, rx, sport, done) = (
                url.clone(),
                violations.clone(),
                on_replica.clone(),
                tx.clone(),
                rx.clone(),
                sport.clone(),
                done.clone(),
            );
            tokio::spawn(async move {
                let me = connect(&url).await;
                let mut id = 1_000 + c;
                while id < 1_000 + WRITES {
                    me.simple_query(&format!("INSERT INTO items VALUES ({id}, 'w')"))
                        .await
                        .unwrap();
                    let got = me
                        .simple_query(&format!(
                            "SELECT current_setting('port'), v FROM items WHERE id = {id}"
                        ))
                        .await
                        .unwrap();
                    let row = rows(&got);
                    match row.first() {
                        Some((port, Some(v))) if v == "w" => {
                            if *port == sport {
                                on_replica.fetch_add(1, Relaxed);
                            }
                        }
                        _ => {
                            violations.fetch_add(1, Relaxed);
                        }
                    }
                    // Now and then, tell another client about this row, with the position it
                    // must see, and check a row another one told about.
                    if id % 10 == c {
                        let at = value(&me, "SHOW pgmemo.read_lsn").await;
                        tx.send((id, at)).unwrap();
                    }
                    let told = rx.lock().await.try_recv().ok();
                    if let Some((other, at)) = told {
                        let reader = connect(&url).await;
                        reader
                            .simple_query(&format!("SET pgmemo.min_read_lsn = '{at}'"))
                            .await
                            .unwrap();
                        let got = reader
                            .simple_query(&format!("SELECT v FROM items WHERE id = {other}"))
                            .await
                            .unwrap();
                        if rows(&got).is_empty() {
                            told_violations.fetch_add(1, Relaxed);
                        }
                    }
                    done.fetch_add(1, Relaxed);
                    id += CLIENTS;
                }
            })
        })
        .collect();
    // Halfway, the standby stops replaying for a while.
    wait_until("half the writes", Duration::from_secs(300), || async {
        done.load(Relaxed) >= (WRITES / 2) as u64
    })
    .await;
    direct_standby
        .simple_query("SELECT pg_wal_replay_pause()")
        .await
        .unwrap();
    let paused_at = done.load(Relaxed);
    wait_until(
        "writes while replay is paused",
        Duration::from_secs(120),
        || async { done.load(Relaxed) >= paused_at + 200 },
    )
    .await;
    direct_standby
        .simple_query("SELECT pg_wal_replay_resume()")
        .await
        .unwrap();
    for c in clients {
        c.await.unwrap();
    }
    assert_eq!(
        violations.load(Relaxed),
        0,
        "reads that missed the client's own write"
    );
    assert_eq!(
        told_violations.load(Relaxed),
        0,
        "reads that missed a write at the position they were told"
    );
    // Not vacuous: most reads of a row just written still went to the replica.
    let share = on_replica.load(Relaxed) as f64 / WRITES as f64;
    eprintln!("reads of a row just written that went to the replica: {share:.3}");
    assert!(
        share > 0.5,
        "only {share:.2} of the reads went to the replica"
    );
}

/// A commit that is not flushed when it returns (`synchronous_commit = off`, for the session
/// or for one transaction) is waited for past its own record, not the flush position: the
/// client still reads its write, from the primary if the replica does not have it in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_asynchronous_commit_is_read_back_all_the_same() {
    let (primary, standby) = primary_and_standby().await;
    let proxy = pgmemo_with_replica(&primary, &standby).await;
    let session_off = connect(&url_of(&proxy)).await;
    session_off
        .simple_query("SET synchronous_commit = off")
        .await
        .unwrap();
    let local_off = connect(&url_of(&proxy)).await;
    let mut missed = 0;
    for id in 0..200i64 {
        let (client, write) = if id % 2 == 0 {
            (
                &session_off,
                format!("INSERT INTO items VALUES ({}, 'a')", 5_000 + id),
            )
        } else {
            (
                &local_off,
                format!(
                    "BEGIN; SET LOCAL synchronous_commit = off; \
                     INSERT INTO items VALUES ({}, 'a'); COMMIT",
                    5_000 + id
                ),
            )
        };
        client.simple_query(&write).await.unwrap();
        let got = client
            .simple_query(&format!("SELECT v FROM items WHERE id = {}", 5_000 + id))
            .await
            .unwrap();
        if rows(&got).is_empty() {
            missed += 1;
        }
    }
    assert_eq!(missed, 0, "asynchronous commits not read back");
}

/// Writes of every kind are read back at once: prepared (extended protocol), a block of
/// separate statements (the position asked behind the INSERT says nothing: the block goes
/// on; behind the COMMIT it counts), and COPY FROM STDIN (nothing may follow it in the same
/// write: the position is asked once the server is idle).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_of_every_kind_are_read_back() {
    use futures_util::SinkExt;
    let (primary, standby) = primary_and_standby().await;
    let proxy = pgmemo_with_replica(&primary, &standby).await;
    let client = connect(&url_of(&proxy)).await;
    let insert = client
        .prepare("INSERT INTO items VALUES ($1, 'p')")
        .await
        .unwrap();
    let read = client
        .prepare("SELECT count(*) FROM items WHERE id = $1")
        .await
        .unwrap();
    let sport = standby.port().to_string();
    let (mut missed, mut on_replica) = (0, 0);
    for i in 0..60i64 {
        let id = 20_000 + i;
        match i % 3 {
            0 => {
                client.execute(&insert, &[&id]).await.unwrap();
            }
            1 => {
                client.simple_query("BEGIN").await.unwrap();
                client
                    .simple_query(&format!("INSERT INTO items VALUES ({id}, 'b')"))
                    .await
                    .unwrap();
                client.simple_query("COMMIT").await.unwrap();
            }
            _ => {
                let sink = client
                    .copy_in::<_, bytes::Bytes>("COPY items (id, v) FROM STDIN")
                    .await
                    .unwrap();
                futures_util::pin_mut!(sink);
                sink.send(bytes::Bytes::from(format!("{id}\tc\n")))
                    .await
                    .unwrap();
                assert_eq!(sink.finish().await.unwrap(), 1);
            }
        }
        let n: i64 = client.query_one(&read, &[&id]).await.unwrap().get(0);
        let port = value(&client, "SELECT current_setting('port')").await;
        if n != 1 {
            missed += 1;
        }
        if port == sport {
            on_replica += 1;
        }
    }
    assert_eq!(missed, 0, "writes not read back");
    assert!(
        on_replica > 30,
        "only {on_replica} of 60 reads on the replica"
    );
}

/// The rows of a simple query's reply: its first column, and its second.
fn rows(messages: &[tokio_postgres::SimpleQueryMessage]) -> Vec<(String, Option<String>)> {
    messages
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some((
                r.get(0).unwrap_or_default().to_string(),
                r.try_get(1).ok().flatten().map(str::to_string),
            )),
            _ => None,
        })
        .collect()
}

/// The replica stops under a read load, and comes back: clients whose read was running on it
/// at that moment may get an error; no other does, reads go on on the primary meanwhile, and
/// back on the replica once it is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_stops_and_comes_back_costs_only_the_reads_in_flight_on_it() {
    const CLIENTS: usize = 6;
    let (primary, mut standby) = primary_and_standby().await;
    let proxy = pgmemo_with_replica(&primary, &standby).await;
    let url = url_of(&proxy);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // 0 before the standby stops, 1 once it is stopping, 2 once it is started again: when
    // each client's errors came, for the failure's report.
    let phase = Arc::new(AtomicU64::new(0));
    let reads = Arc::new(AtomicU64::new(0));
    // When each error and each step came, for the failure's report.
    let started = std::time::Instant::now();
    let readers: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (url, stop, phase, reads) =
                (url.clone(), stop.clone(), phase.clone(), reads.clone());
            tokio::spawn(async move {
                let mut me = connect(&url).await;
                let mut errors = Vec::new();
                while !stop.load(Relaxed) {
                    match me.simple_query("SELECT v FROM items WHERE id = 3").await {
                        Ok(_) => {
                            reads.fetch_add(1, Relaxed);
                        }
                        Err(e) => {
                            // The read in flight on the replica as it stopped: this client's
                            // one allowed error. It connects again and goes on.
                            errors.push(format!(
                                "phase {} at {:?}: {e:?}",
                                phase.load(Relaxed),
                                started.elapsed()
                            ));
                            me = connect(&url).await;
                        }
                    }
                }
                errors
            })
        })
        .collect();
    let after = |n: u64| {
        let reads = reads.clone();
        async move {
            let from = reads.load(Relaxed);
            wait_until("reads to go on", Duration::from_secs(60), || async {
                reads.load(Relaxed) >= from + n
            })
            .await;
        }
    };
    after(500).await;
    let mut steps = vec![("stopping", started.elapsed())];
    phase.store(1, Relaxed);
    standby = off_runtime(standby, |pg| pg.stop_server("fast")).await;
    steps.push(("stopped", started.elapsed()));
    after(2_000).await;
    steps.push(("starting", started.elapsed()));
    standby = off_runtime(standby, |pg| {
        pg.restart("fast").expect("the standby starts again")
    })
    .await;
    steps.push(("started", started.elapsed()));
    phase.store(2, Relaxed);
    let client = connect(&url).await;
    let port = standby.port().to_string();
    wait_until(
        "reads to reach the replica again",
        Duration::from_secs(30),
        || async { value(&client, "SELECT current_setting('port')").await == port },
    )
    .await;
    after(500).await;
    stop.store(true, Relaxed);
    let mut all = Vec::new();
    for r in readers {
        all.push(r.await.unwrap());
    }
    // Each client's errors, shown whole if one had more than its read in flight.
    assert!(
        all.iter().all(|errors| errors.len() <= 1),
        "a client failed more than once: {all:#?}\nsteps: {steps:?}"
    );
}
