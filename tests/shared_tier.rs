//! The result cache's shared tier (`[cache.shared]`, issue 59) on a real Valkey stand-in
//! (Debian's `redis-server`, started here on a free port): three pgmemo instances, one
//! PostgreSQL. An instance's first read of a key another stored is a shared-tier hit; a
//! write made directly or through an instance is never read back stale from the shared tier
//! once the reading instance's follower has decoded it, and at once on the instance that
//! wrote; with Valkey gone every read still goes right, and caching there resumes when it is
//! back. Each test waits for followers' positions, never for a time.

mod common;

use common::first_value as value;
use common::*;
use pgmemo::config::cache::{Invalidation, SharedTier};
use pgmemo::config::{Config, PoolMode};
use pgmemo::Pgmemo;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;
use tokio_postgres::Client;

const DB: &str = "shared_tier";

fn config(valkey: &Valkey) -> Config {
    let mut config = test_config(PoolMode::Transaction, 4);
    config.cache.enabled = true;
    config.cache.admit_after = 1;
    config.cache.invalidation = Invalidation::Wal;
    config.cache.rules = vec![cache_rule("kv", "FROM kv WHERE")];
    config.cache.shared = Some(SharedTier {
        url: valkey.url(),
        // Generous: the test binary is a debug build on a busy machine.
        timeout: Duration::from_secs(2),
        name: "test".into(),
    });
    config
}

/// `proxy`'s shared tier's counters: (hits, refused, writes).
fn shared(proxy: &Pgmemo) -> (u64, u64, u64) {
    let s = &proxy.app().cache.shared().expect("a shared tier").stats;
    (
        s.hits.load(Relaxed),
        s.refused.load(Relaxed),
        s.writes.load(Relaxed),
    )
}

fn follower(proxy: &Pgmemo) -> Option<std::sync::Arc<pgmemo::wal::Follower>> {
    wal_follower(proxy, DB)
}

/// Starts `proxy`'s follower (a read through it) and waits until it serves and has read a
/// primary position after that: its instance may then judge shared entries.
async fn warm_up(proxy: &Pgmemo, client: &Client) {
    value(client, "SELECT v FROM kv WHERE id = 0").await;
    wait_until(
        "the follower to catch up",
        Duration::from_secs(30),
        || async { follower(proxy).is_some_and(|f| f.is_ready()) },
    )
    .await;
    let ready = pgmemo::clock::Moment::now();
    wait_until("a position read", Duration::from_secs(30), || async {
        follower(proxy).is_some_and(|f| f.covering_after(ready).is_some())
    })
    .await;
}

/// Waits until `proxy`'s follower has applied the server's WAL as of now.
async fn wait_applied(proxy: &Pgmemo, direct: &Client) {
    wait_wal_applied(proxy, direct, DB).await;
}

fn read(id: i64) -> String {
    format!("SELECT v FROM kv WHERE id = {id}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_shares_its_results_and_never_serves_one_a_write_it_knows_of_is_missing() {
    fresh_db(DB).await;
    tokio::task::spawn_blocking(|| {
        cluster().psql(
            DB,
            "CREATE TABLE kv (id int PRIMARY KEY, v text);
             INSERT INTO kv SELECT g, 'v' || g FROM generate_series(0, 20) g;",
        )
    })
    .await
    .unwrap();
    let mut valkey = tokio::task::spawn_blocking(|| Valkey::start("fleet"))
        .await
        .unwrap();
    let (a, b, c) = (
        start_pgmemo(config(&valkey)).await,
        start_pgmemo(config(&valkey)).await,
        start_pgmemo(config(&valkey)).await,
    );
    let (ca, cb, cc) = (
        connect(&proxy_db_url(&a, DB)).await,
        connect(&proxy_db_url(&b, DB)).await,
        connect(&proxy_db_url(&c, DB)).await,
    );
    let direct = connect(&direct_db_url(DB)).await;
    for (proxy, client) in [(&a, &ca), (&b, &cb), (&c, &cc)] {
        warm_up(proxy, client).await;
    }
    // A fills ten keys; they reach the shared tier. (A's follower first applies the WAL
    // the others' streams' starts wrote: the position A's entries carry is then past what B
    // has read since its start, and B may serve them.)
    wait_applied(&a, &direct).await;
    let writes = shared(&a).2;
    for id in 1..=10 {
        assert_eq!(value(&ca, &read(id)).await, format!("v{id}"));
    }
    wait_until(
        "A's fills in the shared tier",
        Duration::from_secs(30),
        || async { shared(&a).2 >= writes + 10 },
    )
    .await;
    // B never read them: its first reads are shared-tier hits.
    let (hits, ..) = shared(&b);
    for id in 1..=10 {
        assert_eq!(value(&cb, &read(id)).await, format!("v{id}"));
    }
    assert_eq!(
        shared(&b).0,
        hits + 10,
        "B's first reads came from the shared tier"
    );
    let metrics = pgmemo::metrics::render(b.app());
    assert!(
        metrics.contains(&format!("pgmemo_cache_shared_hits_total {}", shared(&b).0)),
        "{metrics}"
    );

    // A write made directly: once C's follower decoded it, C does not serve A's entry.
    direct
        .batch_execute("UPDATE kv SET v = 'direct' WHERE id = 3")
        .await
        .unwrap();
    wait_applied(&c, &direct).await;
    let (_, refused, _) = shared(&c);
    assert_eq!(value(&cc, &read(3)).await, "direct");
    assert_eq!(
        shared(&c).1,
        refused + 1,
        "C refused A's entry of the row written"
    );
    assert_eq!(
        value(&cc, &read(3)).await,
        "direct",
        "and cached the new one"
    );
    // B had it in its own memory: its follower invalidated it; what it gets now is new.
    wait_applied(&b, &direct).await;
    assert_eq!(value(&cb, &read(3)).await, "direct");

    // A write through B: B reads it back at once, whatever the shared tier holds.
    cb.batch_execute("UPDATE kv SET v = 'through b' WHERE id = 5")
        .await
        .unwrap();
    assert_eq!(value(&cb, &read(5)).await, "through b");
    // C, which never read row 5, once its follower decoded the write.
    wait_applied(&c, &direct).await;
    assert_eq!(value(&cc, &read(5)).await, "through b");

    // Valkey gone: reads still go right (to the server); back, results are shared again.
    tokio::task::block_in_place(|| valkey.stop());
    for id in 11..=15 {
        assert_eq!(value(&ca, &read(id)).await, format!("v{id}"));
        assert_eq!(value(&cc, &read(id)).await, format!("v{id}"));
    }
    let errors = |p: &Pgmemo| {
        let s = &p.app().cache.shared().unwrap().stats;
        s.errors.load(Relaxed) + s.timeouts.load(Relaxed)
    };
    assert!(errors(&c) > 0, "C counted the shared tier's failures");
    tokio::task::block_in_place(|| valkey.restart());
    let writes = shared(&a).2;
    wait_until(
        "A writes to Valkey again",
        Duration::from_secs(30),
        || async {
            for id in 16..=20 {
                value(&ca, &read(id)).await;
            }
            shared(&a).2 > writes
        },
    )
    .await;
    assert!(tokio::task::block_in_place(|| valkey.keys()) > 0);
}

/// `[cache.shared]` needs WAL invalidation: refused at load, saying why.
#[test]
fn the_shared_tier_needs_wal_invalidation() {
    let toml = "[upstream]\nhost = \"127.0.0.1\"\nuser = \"u\"\npassword = \"p\"\n\n[cache]\nenabled = true\n\n\
                [cache.shared]\nurl = \"redis://127.0.0.1:6379/0\"\n";
    let e = Config::from_toml_str(toml)
        .expect_err("refused")
        .to_string();
    assert!(e.contains("cache.invalidation = \"wal\""), "{e}");
    let good = "[upstream]\nhost = \"127.0.0.1\"\nuser = \"u\"\npassword = \"p\"\n\n[cache]\nenabled = true\n\
                invalidation = \"wal\"\n\n[cache.shared]\nurl = \"redis://127.0.0.1:6379/0\"\n\
                timeout = \"50ms\"\n";
    let c = Config::from_toml_str(good).expect("accepted");
    let shared = c.cache.shared.expect("the tier");
    assert_eq!(shared.timeout, Duration::from_millis(50));
    assert_eq!(shared.name, "pgmemo");
    let bad_url = good.replace("redis://", "http://");
    let e = Config::from_toml_str(&bad_url)
        .expect_err("refused")
        .to_string();
    assert!(e.contains("cache.shared.url"), "{e}");
}
