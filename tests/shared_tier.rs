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
use pgmemo::config::cache::{Decoder, Invalidation, SharedTier, WithoutValkey};
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
        decoder: Decoder::One,
        lease: LEASE,
        without_valkey: WithoutValkey::OwnFollower,
        cluster: valkey.is_cluster(),
        ca_file: valkey.ca_file(),
    });
    config
}

/// The fleet's lease in these tests.
const LEASE: Duration = Duration::from_secs(1);

/// A fresh database `db` with `kv (id int PRIMARY KEY, v text)` holding `'v' || id` for ids
/// 0 to `last`, and `more` SQL after.
async fn fresh_kv(db: &'static str, last: i32, more: &'static str) {
    fresh_db(db).await;
    tokio::task::spawn_blocking(move || {
        cluster().psql(
            db,
            &format!(
                "CREATE TABLE kv (id int PRIMARY KEY, v text);
                 INSERT INTO kv SELECT g, 'v' || g FROM generate_series(0, {last}) g;
                 {more}"
            ),
        )
    })
    .await
    .unwrap();
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
    warm_up_on(proxy, client, DB).await;
}

/// [`warm_up`] for the database `db`. (Until the instance has read a position after the
/// moment it began to serve, every shared entry is refused; one read only after another
/// instance's fill, once other writes moved the WAL on, refuses that fill.)
async fn warm_up_on(proxy: &Pgmemo, client: &Client, db: &str) {
    value(client, "SELECT v FROM kv WHERE id = 0").await;
    wait_until(
        "the follower to catch up",
        Duration::from_secs(30),
        || async { wal_follower(proxy, db).is_some_and(|f| f.is_ready()) },
    )
    .await;
    let ready = pgmemo::clock::Moment::now();
    wait_until("a position read", Duration::from_secs(30), || async {
        wal_follower(proxy, db).is_some_and(|f| f.covering_after(ready).is_some())
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
    fresh_kv(DB, 20, "CREATE TABLE other (x int);").await;
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
    // B never read them: its first reads are shared-tier hits. (Their entries there expire
    // sooner than the rule's TTL: B's copies expire no later.)
    assert!(tokio::task::block_in_place(|| valkey.expire_all(60_000)) >= 10);
    let (hits, ..) = shared(&b);
    for id in 1..=10 {
        assert_eq!(value(&cb, &read(id)).await, format!("v{id}"));
    }
    assert_eq!(
        shared(&b).0,
        hits + 10,
        "B's first reads came from the shared tier"
    );
    // An instance started now, after the WAL has moved on (the other tests write): its
    // first reads are shared hits too (it knows every commit since the position its
    // reading of the stream begins from, not only since it joined).
    direct
        .batch_execute("INSERT INTO other VALUES (1)")
        .await
        .unwrap();
    let d = start_pgmemo(config(&valkey)).await;
    let cd = connect(&proxy_db_url(&d, DB)).await;
    warm_up(&d, &cd).await;
    assert!(
        follower(&d).unwrap().status().decoder.starts_with("reader"),
        "D reads the stream"
    );
    for id in 1..=10 {
        assert_eq!(value(&cd, &read(id)).await, format!("v{id}"));
    }
    assert_eq!(
        shared(&d).0,
        10,
        "D started late: its first reads were shared hits"
    );
    let entries = admin_rows(&admin_console(b.local_addr()).await, "SHOW CACHE ENTRIES").await;
    let copies: Vec<f64> = entries
        .iter()
        .filter(|e| e["query"].contains("id = ") && !e["query"].ends_with("= 0"))
        .map(|e| e["expires_in"].parse().unwrap())
        .collect();
    assert_eq!(copies.len(), 10, "{entries:?}");
    assert!(
        copies.iter().all(|&s| s <= 60.0),
        "a copy lives no longer than its shared entry: {copies:?}"
    );
    // The extended protocol too (a prepared statement: its number is A's own, its key in the
    // shared tier is its text).
    let writes = shared(&a).2;
    let by_id = "SELECT v FROM kv WHERE id = $1";
    for id in 11..=15 {
        let row = ca.query_one(by_id, &[&id]).await.unwrap();
        assert_eq!(row.get::<_, String>(0), format!("v{id}"));
    }
    wait_until(
        "A's extended fills in the shared tier",
        Duration::from_secs(30),
        || async { shared(&a).2 >= writes + 5 },
    )
    .await;
    // B's first statement is another one: were statements keyed by their numbers there,
    // it would be answered A's results of `by_id`.
    for id in 11..=15 {
        let row = cb
            .query_one("SELECT v || '!' FROM kv WHERE id = $1", &[&id])
            .await
            .unwrap();
        assert_eq!(row.get::<_, String>(0), format!("v{id}!"));
    }
    let (hits, ..) = shared(&b);
    for id in 11..=15 {
        let row = cb.query_one(by_id, &[&id]).await.unwrap();
        assert_eq!(row.get::<_, String>(0), format!("v{id}"));
    }
    assert_eq!(
        shared(&b).0,
        hits + 5,
        "B's first extended reads came from the shared tier"
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

/// A pgmemo process of its own (the binary), for the instance killed with SIGKILL: the same
/// server, cache and shared tier as [`config`]'s.
struct Process {
    child: LoggedChild,
    addr: std::net::SocketAddr,
    _dir: TempDir,
}

impl Process {
    fn start(valkey: &Valkey) -> Process {
        let dir = TempDir::new("shared-tier", "leader");
        let port = free_port();
        let file = dir.join("pgmemo.toml");
        std::fs::write(
            &file,
            format!(
                "[general]\nlisten = \"127.0.0.1:{port}\"\nadmin_users = [\"{PGMEMO_USER}\"]\n\
                 default_pool_size = 4\n\n\
                 [upstream]\nurl = \"postgresql://{PGMEMO_USER}:{PGMEMO_PASS}@127.0.0.1:{}\"\n\n\
                 [cache]\nenabled = true\nadmit_after = 1\ninvalidation = \"wal\"\n\n\
                 [[cache.rules]]\nname = \"kv\"\nquery_contains = \"FROM kv WHERE\"\nttl = 600\n\n\
                 [cache.shared]\nurl = \"{}\"\nname = \"test\"\ntimeout = \"2s\"\nlease = \"{}ms\"\n",
                cluster().port(),
                valkey.url(),
                LEASE.as_millis()
            ),
        )
        .unwrap();
        let child = LoggedChild::start(
            std::process::Command::new(env!("CARGO_BIN_EXE_pgmemo")).args([
                "--config",
                file.to_str().unwrap(),
                "--log-level",
                "info",
            ]),
            dir.join("pgmemo.log"),
        );
        Process {
            child,
            addr: format!("127.0.0.1:{port}").parse().unwrap(),
            _dir: dir,
        }
    }

    fn url(&self) -> String {
        proxy_url(self.addr, PGMEMO_USER, Some(PGMEMO_PASS), DB_FLEET)
    }
}

const DB_FLEET: &str = "shared_fleet";

/// The database's replication slots in use on the server: its walsenders.
async fn walsenders(direct: &Client) -> i64 {
    direct
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE database = $1 AND active",
            &[&DB_FLEET],
        )
        .await
        .unwrap()
        .get(0)
}

/// `proxy`'s part in the fleet's decoding of [`DB_FLEET`], once it serves.
fn decoder(proxy: &Pgmemo) -> Option<String> {
    wal_follower(proxy, DB_FLEET)
        .filter(|f| f.is_ready())
        .map(|f| f.status().decoder)
}

/// One instance decodes the WAL for the fleet: the primary runs one walsender for three
/// instances, the others apply its stream (a write made directly is read new on them once
/// they passed it), and when it is killed with SIGKILL another takes the lease and decodes,
/// and nothing is read stale meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_decodes_for_the_fleet_and_another_takes_over_when_it_is_killed() {
    fresh_kv(DB_FLEET, 20, "").await;
    let valkey = tokio::task::spawn_blocking(|| Valkey::start("one-decoder"))
        .await
        .unwrap();
    let direct = connect(&direct_db_url(DB_FLEET)).await;
    // The leader: the first to follow the database takes the lease.
    let leader = Process::start(&valkey);
    wait_until("the process to listen", Duration::from_secs(60), || async {
        tokio::net::TcpStream::connect(leader.addr).await.is_ok()
    })
    .await;
    let cl = connect(&leader.url()).await;
    let log = || leader.child.log();
    wait_until("the process to decode", Duration::from_secs(60), || async {
        value(&cl, &read(0)).await;
        walsenders(&direct).await == 1 && log().contains("caching on")
    })
    .await;
    let (b, c) = (
        start_pgmemo(config(&valkey)).await,
        start_pgmemo(config(&valkey)).await,
    );
    let (cb, cc) = (
        connect(&proxy_db_url(&b, DB_FLEET)).await,
        connect(&proxy_db_url(&c, DB_FLEET)).await,
    );
    for (proxy, client) in [(&b, &cb), (&c, &cc)] {
        value(client, &read(0)).await;
        wait_until("a reader to serve", Duration::from_secs(30), || async {
            decoder(proxy).is_some_and(|d| d.starts_with("reader"))
        })
        .await;
    }
    assert_eq!(
        walsenders(&direct).await,
        1,
        "one walsender for three instances"
    );
    let read_from_stream = |p: &Pgmemo| {
        p.app()
            .cache
            .shared()
            .unwrap()
            .stats
            .stream_read
            .load(Relaxed)
    };
    assert!(read_from_stream(&b) > 0 && read_from_stream(&c) > 0);

    // Rows cached on both readers, then written directly and through C.
    let cached = |p: &Pgmemo| -> u64 {
        let rules = p.app().cache.rule_stats();
        rules.iter().map(|r| r.hits.get()).sum()
    };
    for id in [3, 5, 7] {
        for (proxy, client) in [(&b, &cb), (&c, &cc)] {
            value(client, &read(id)).await;
            let hits = cached(proxy);
            assert_eq!(value(client, &read(id)).await, format!("v{id}"));
            assert_eq!(cached(proxy), hits + 1, "row {id} is cached");
        }
    }
    direct
        .batch_execute("UPDATE kv SET v = 'direct' WHERE id = 3")
        .await
        .unwrap();
    cc.batch_execute("UPDATE kv SET v = 'through c' WHERE id = 5")
        .await
        .unwrap();
    assert_eq!(value(&cc, &read(5)).await, "through c", "read back at once");
    for (proxy, client) in [(&b, &cb), (&c, &cc)] {
        wait_wal_applied(proxy, &direct, DB_FLEET).await;
        assert_eq!(value(client, &read(3)).await, "direct");
        assert_eq!(value(client, &read(5)).await, "through c");
    }

    // The leader killed: another instance takes the lease and decodes.
    let killed = std::time::Instant::now();
    leader.child.signal(libc::SIGKILL);
    wait_until("a new leader", Duration::from_secs(60), || async {
        decoder(&b).is_some_and(|d| d.starts_with("leader"))
            || decoder(&c).is_some_and(|d| d.starts_with("leader"))
    })
    .await;
    eprintln!("a new leader {:?} after the SIGKILL", killed.elapsed());
    wait_until("one walsender again", Duration::from_secs(60), || async {
        walsenders(&direct).await == 1
    })
    .await;
    direct
        .batch_execute("UPDATE kv SET v = 'after' WHERE id = 7")
        .await
        .unwrap();
    for (proxy, client) in [(&b, &cb), (&c, &cc)] {
        wait_wal_applied(proxy, &direct, DB_FLEET).await;
        assert_eq!(
            value(client, &read(7)).await,
            "after",
            "{:?}",
            decoder(proxy)
        );
        assert_eq!(value(client, &read(3)).await, "direct");
    }
    let show = admin_rows(&admin_console(b.local_addr()).await, "SHOW CACHE SHARED").await;
    assert!(
        show[0]["stream_read"].parse::<u64>().unwrap() > 0,
        "{show:?}"
    );
}

/// With `without_valkey = "no_caching"`, an instance that cannot reach Valkey serves nothing
/// from its cache and opens no walsender of its own (reads go to the server, right); once
/// Valkey answers, it joins the fleet (here, as its decoder) and caches again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_valkey_and_no_caching_an_instance_serves_nothing_until_valkey_is_back() {
    const DB_ALONE: &str = "shared_alone";
    fresh_kv(DB_ALONE, 9, "").await;
    let mut valkey = tokio::task::spawn_blocking(|| Valkey::start("alone"))
        .await
        .unwrap();
    tokio::task::block_in_place(|| valkey.stop());
    let mut config = config(&valkey);
    if let Some(shared) = config.cache.shared.as_mut() {
        shared.without_valkey = WithoutValkey::NoCaching;
    }
    let a = start_pgmemo(config).await;
    let ca = connect(&proxy_db_url(&a, DB_ALONE)).await;
    let direct = connect(&direct_db_url(DB_ALONE)).await;
    let hits = |p: &Pgmemo| -> u64 {
        p.app()
            .cache
            .rule_stats()
            .iter()
            .map(|r| r.hits.get())
            .sum()
    };
    value(&ca, &read(1)).await;
    wait_until(
        "the follower to say why",
        Duration::from_secs(30),
        || async {
            wal_follower(&a, DB_ALONE).is_some_and(|f| f.status().phase.contains("no_caching"))
        },
    )
    .await;
    for _ in 0..5 {
        assert_eq!(value(&ca, &read(1)).await, "v1");
    }
    direct
        .batch_execute("UPDATE kv SET v = 'new' WHERE id = 1")
        .await
        .unwrap();
    assert_eq!(value(&ca, &read(1)).await, "new", "read from the server");
    assert_eq!(hits(&a), 0, "nothing served from the cache");
    let slots: i64 = direct
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE database = $1",
            &[&DB_ALONE],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(slots, 0, "no walsender of its own");
    tokio::task::block_in_place(|| valkey.restart());
    wait_until("caching again", Duration::from_secs(60), || async {
        value(&ca, &read(2)).await;
        hits(&a) > 0
    })
    .await;
    assert!(wal_follower(&a, DB_ALONE).is_some_and(|f| f.leads()));
}

/// `client` of `proxy` reads row `id` (`v`), a miss whose fill `proxy` writes to the shared
/// tier: waits until it is written.
async fn fills(proxy: &Pgmemo, client: &Client, id: i64, v: &str) {
    let writes = shared(proxy).2;
    assert_eq!(value(client, &read(id)).await, v);
    wait_until(
        "the fill in the shared tier",
        Duration::from_secs(30),
        || async { shared(proxy).2 > writes },
    )
    .await;
}

/// An instance whose own follower is behind (`decoder = "each"`, its walsender stopped with
/// SIGSTOP until the follower stops serving) does not serve a shared entry it cannot judge:
/// an entry filled by its peer before a write its peer has applied and it has not is read
/// new from the server. Once it has caught up, an entry its peer (ahead) filled after that
/// write is served to it from the shared tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_behind_serves_a_shared_entry_only_once_it_has_caught_up() {
    const DB_LAG: &str = "shared_lag";
    fresh_kv(DB_LAG, 9, "").await;
    let valkey = tokio::task::spawn_blocking(|| Valkey::start("lag"))
        .await
        .unwrap();
    let each = || {
        let mut config = config(&valkey);
        if let Some(shared) = config.cache.shared.as_mut() {
            shared.decoder = Decoder::Each;
        }
        config
    };
    let direct = connect(&direct_db_url(DB_LAG)).await;
    // C first, alone: the database's only walsender is C's.
    let c = start_pgmemo(each()).await;
    let cc = connect(&proxy_db_url(&c, DB_LAG)).await;
    warm_up_on(&c, &cc, DB_LAG).await;
    let pid: i32 = value(
        &direct,
        &format!(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walsender' \
             AND datname = '{DB_LAG}'"
        ),
    )
    .await
    .parse()
    .unwrap();
    let a = start_pgmemo(each()).await;
    let ca = connect(&proxy_db_url(&a, DB_LAG)).await;
    warm_up_on(&a, &ca, DB_LAG).await;

    // A fills row 3 while it is old; the entry reaches the shared tier.
    fills(&a, &ca, 3, "v3").await;

    // C's stream falls silent: C's follower stops serving.
    let signal = |sig: libc::c_int| {
        // SAFETY: kill(2) on a process id; no memory is involved.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "signal {sig} to {pid}");
    };
    signal(libc::SIGSTOP);
    wait_until(
        "C's follower to stop serving",
        Duration::from_secs(30),
        || async { wal_follower(&c, DB_LAG).is_some_and(|f| !f.is_ready()) },
    )
    .await;
    direct
        .batch_execute("UPDATE kv SET v = 'new' WHERE id IN (2, 3)")
        .await
        .unwrap();
    let lsn: pgmemo::wal::Lsn = value(&direct, "SELECT pg_current_wal_insert_lsn()")
        .await
        .parse()
        .unwrap();
    wait_wal_applied(&a, &direct, DB_LAG).await;

    // C, behind, never read row 3: A's old entry is all the cache could give it.
    let (hits, ..) = shared(&c);
    assert_eq!(value(&cc, &read(3)).await, "new", "C served A's old entry");
    assert_eq!(shared(&c).0, hits, "no shared hit while C is behind");
    assert!(
        wal_follower(&c, DB_LAG).is_some_and(|f| f.applied() < lsn),
        "C was behind when it read"
    );

    // A, ahead, fills row 2 after the write.
    fills(&a, &ca, 2, "new").await;
    let (hits, ..) = shared(&c);
    assert_eq!(value(&cc, &read(2)).await, "new");
    assert_eq!(shared(&c).0, hits, "no shared hit while C is behind");

    // C catches up: A's new entry is served to it, an old one never.
    signal(libc::SIGCONT);
    wait_wal_applied(&c, &direct, DB_LAG).await;
    let caught_up = pgmemo::clock::Moment::now();
    wait_until("C to read a position", Duration::from_secs(30), || async {
        wal_follower(&c, DB_LAG).is_some_and(|f| f.covering_after(caught_up).is_some())
    })
    .await;
    // (A's entry carries A's applied position: past every position C has read once A has
    // applied the WAL as of now.)
    wait_wal_applied(&a, &direct, DB_LAG).await;
    fills(&a, &ca, 4, "v4").await;
    let (hits, ..) = shared(&c);
    assert_eq!(value(&cc, &read(4)).await, "v4");
    assert_eq!(
        shared(&c).0,
        hits + 1,
        "C caught up: A's entry of row 4 served"
    );
    for id in [2, 3] {
        assert_eq!(value(&cc, &read(id)).await, "new");
    }
}

/// Two instances share results and one decoder through `valkey`: B's first reads of what A
/// stored are shared hits; one of them decodes; a direct write is read new on both once
/// applied.
async fn shares_through(valkey: &Valkey, db: &'static str) {
    fresh_kv(db, 9, "").await;
    let (a, b) = (
        start_pgmemo(config(valkey)).await,
        start_pgmemo(config(valkey)).await,
    );
    let (ca, cb) = (
        connect(&proxy_db_url(&a, db)).await,
        connect(&proxy_db_url(&b, db)).await,
    );
    let direct = connect(&direct_db_url(db)).await;
    for (proxy, client) in [(&a, &ca), (&b, &cb)] {
        warm_up_on(proxy, client, db).await;
    }
    wait_wal_applied(&a, &direct, db).await;
    let writes = shared(&a).2;
    for id in 1..=5 {
        assert_eq!(value(&ca, &read(id)).await, format!("v{id}"));
    }
    wait_until("A's fills written", Duration::from_secs(30), || async {
        shared(&a).2 >= writes + 5
    })
    .await;
    let (hits, ..) = shared(&b);
    for id in 1..=5 {
        assert_eq!(value(&cb, &read(id)).await, format!("v{id}"));
    }
    assert_eq!(shared(&b).0, hits + 5, "B's first reads were shared hits");
    let leaders = [&a, &b]
        .iter()
        .filter(|p| wal_follower(p, db).is_some_and(|f| f.leads()))
        .count();
    assert_eq!(leaders, 1, "one decoder for the two");
    direct
        .batch_execute("UPDATE kv SET v = 'direct' WHERE id = 2")
        .await
        .unwrap();
    for (proxy, client) in [(&a, &ca), (&b, &cb)] {
        wait_wal_applied(proxy, &direct, db).await;
        assert_eq!(value(client, &read(2)).await, "direct");
    }
}

/// The shared tier and the fleet's decoder on a Valkey cluster (three nodes: keys, the lease
/// and the stream on whichever node their slot is).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_shares_through_a_valkey_cluster() {
    let valkey = tokio::task::spawn_blocking(|| Valkey::start_cluster("cluster"))
        .await
        .unwrap();
    shares_through(&valkey, "shared_cluster").await;
}

/// The shared tier over TLS (`rediss://`), the server's certificate checked against
/// `ca_file`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_shares_over_tls() {
    let valkey = tokio::task::spawn_blocking(|| Valkey::start_tls("tls"))
        .await
        .unwrap();
    shares_through(&valkey, "shared_tls").await;
}

/// The shared tier on a Valkey that asks for a password (`redis://:PASSWORD@host`): shared
/// as without one. With a wrong password an instance decodes for itself (as without Valkey,
/// `without_valkey = "own_follower"`) and reads are right; the password is in none of what
/// the console shows, nor in the configuration's debug form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_shares_through_a_valkey_that_asks_for_a_password() {
    const PASSWORD: &str = "s3cret-fleet-word";
    let valkey = tokio::task::spawn_blocking(|| Valkey::start_with_password("auth", PASSWORD))
        .await
        .unwrap();
    shares_through(&valkey, "shared_auth").await;
    // A wrong password: refused by Valkey, the instance goes on alone.
    const DB_WRONG: &str = "shared_wrong_password";
    fresh_kv(DB_WRONG, 9, "").await;
    let mut config = config(&valkey);
    let shared = config.cache.shared.as_mut().expect("a shared tier");
    shared.url = shared.url.replace(PASSWORD, "not-the-word");
    assert!(
        !format!("{config:?}").contains("not-the-word"),
        "{config:?}"
    );
    let a = start_pgmemo(config).await;
    let ca = connect(&proxy_db_url(&a, DB_WRONG)).await;
    let direct = connect(&direct_db_url(DB_WRONG)).await;
    wait_until("its own decoder", Duration::from_secs(30), || async {
        value(&ca, &read(1)).await;
        wal_follower(&a, DB_WRONG)
            .filter(|f| f.is_ready())
            .is_some_and(|f| f.status().decoder.contains("Valkey unreachable"))
    })
    .await;
    direct
        .batch_execute("UPDATE kv SET v = 'new' WHERE id = 1")
        .await
        .unwrap();
    wait_wal_applied(&a, &direct, DB_WRONG).await;
    assert_eq!(value(&ca, &read(1)).await, "new");
    let admin = admin_console(a.local_addr()).await;
    for show in ["SHOW CONFIG", "SHOW CACHE SHARED", "SHOW CACHE WAL"] {
        let shown = format!("{:?}", admin_rows(&admin, show).await);
        assert!(
            !shown.contains("not-the-word") && !shown.contains(PASSWORD),
            "{show}: {shown}"
        );
    }
}

const DB_CHECK: &str = "shared_check";

/// One write the checker knows of: key, the value it committed, a primary position past its
/// commit.
type Written = (i32, i64, pgmemo::wal::Lsn);

/// Reads the checker's keys through `proxy` (from `first_key` on) until `done`: a read that
/// returns less than a write the instance had applied when the read was sent is stale.
/// (stale reads described, reads checked).
async fn check_reads(
    proxy: &Pgmemo,
    label: &str,
    first_key: usize,
    written: &std::sync::Mutex<Vec<Written>>,
    done: &std::sync::atomic::AtomicBool,
) -> (Vec<String>, u64) {
    let c = connect(&proxy_db_url(proxy, DB_CHECK)).await;
    let (mut stale, mut checked) = (Vec::new(), 0u64);
    let mut i = first_key;
    while !done.load(Relaxed) {
        let key = (i % 8) as i32;
        i += 1;
        let follower = wal_follower(proxy, DB_CHECK).unwrap();
        // What the instance had applied when the read was sent, and the writes to the key
        // it covers.
        let applied = follower.is_ready().then(|| follower.applied());
        let known: Vec<Written> = written.lock().unwrap().clone();
        let got: i64 = value(&c, &format!("SELECT v FROM kv WHERE id = {key}"))
            .await
            .parse()
            .unwrap();
        let Some(applied) = applied else { continue };
        checked += 1;
        if let Some(&(_, v, at)) = known
            .iter()
            .filter(|&&(k, v, at)| k == key && at <= applied && v > got)
            .max_by_key(|w| w.1)
        {
            stale.push(format!(
                "{label} read {got} of {key} with {applied} applied; {v} was committed by {at}"
            ));
        }
    }
    (stale, checked)
}

/// A consistency checker on three instances sharing one decoder and the shared tier: writers
/// through two instances and directly on PostgreSQL, readers on all three at once. Every
/// read returns at least the value of each write whose commit the reading instance's
/// follower had applied when the read was sent; each writer reads its own write back at once
/// through its instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_readers_on_three_instances_never_read_a_write_they_have_passed_as_missing() {
    use std::sync::{Arc, Mutex};
    const KEYS: i32 = 8;
    const WRITES: usize = 150;
    fresh_db(DB_CHECK).await;
    tokio::task::spawn_blocking(|| {
        cluster().psql(
            DB_CHECK,
            "CREATE TABLE kv (id int PRIMARY KEY, v bigint NOT NULL);
             INSERT INTO kv SELECT g, 0 FROM generate_series(0, 7) g;",
        )
    })
    .await
    .unwrap();
    let valkey = tokio::task::spawn_blocking(|| Valkey::start("check"))
        .await
        .unwrap();
    let proxies = Arc::new([
        start_pgmemo(config(&valkey)).await,
        start_pgmemo(config(&valkey)).await,
        start_pgmemo(config(&valkey)).await,
    ]);
    let direct_url = direct_db_url(DB_CHECK);
    for p in proxies.iter() {
        let c = connect(&proxy_db_url(p, DB_CHECK)).await;
        value(&c, "SELECT v FROM kv WHERE id = 0").await;
        wait_until("an instance to serve", Duration::from_secs(30), || async {
            wal_follower(p, DB_CHECK).is_some_and(|f| f.is_ready())
        })
        .await;
    }
    let written: Arc<Mutex<Vec<Written>>> = Arc::default();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let late = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Writers: through instance 0, through instance 1, and directly.
    let mut writers = Vec::new();
    for (w, url) in [
        proxy_db_url(&proxies[0], DB_CHECK),
        proxy_db_url(&proxies[1], DB_CHECK),
        direct_url.clone(),
    ]
    .into_iter()
    .enumerate()
    {
        let (written, late) = (written.clone(), late.clone());
        writers.push(tokio::spawn(async move {
            let c = connect(&url).await;
            let mut stale = Vec::new();
            for i in 0..WRITES {
                if i == WRITES / 2 {
                    wait_until("the late instance", Duration::from_secs(60), || async {
                        late.load(Relaxed)
                    })
                    .await;
                }
                let key = ((i * 3 + w) % KEYS as usize) as i32;
                let row = c
                    .query_one("UPDATE kv SET v = v + 1 WHERE id = $1 RETURNING v", &[&key])
                    .await
                    .unwrap();
                let v: i64 = row.get(0);
                let at: pgmemo::wal::Lsn = value(&c, "SELECT pg_current_wal_insert_lsn()")
                    .await
                    .parse()
                    .unwrap();
                written.lock().unwrap().push((key, v, at));
                // Its own write, read back at once (simple protocol: the cached path).
                let back: i64 = value(&c, &format!("SELECT v FROM kv WHERE id = {key}"))
                    .await
                    .parse()
                    .unwrap();
                if back < v {
                    stale.push(format!("writer {w} wrote {v} to {key}, read back {back}"));
                }
            }
            stale
        }));
    }
    // Readers: two on each instance, until the writers are done.
    let mut readers = Vec::new();
    for r in 0..6usize {
        let (written, done, proxies) = (written.clone(), done.clone(), proxies.clone());
        readers.push(tokio::spawn(async move {
            let label = format!("instance {}", r % 3);
            check_reads(&proxies[r % 3], &label, r, &written, &done).await
        }));
    }
    // An instance that joins while the writes go on (the writers wait for it to serve half
    // way through): it reads with the others.
    {
        let (written, done, late) = (written.clone(), done.clone(), late.clone());
        let config = config(&valkey);
        readers.push(tokio::spawn(async move {
            wait_until("half the writes", Duration::from_secs(60), || async {
                written.lock().unwrap().len() >= 3 * WRITES / 2 - 3
            })
            .await;
            let d = start_pgmemo(config).await;
            let c = connect(&proxy_db_url(&d, DB_CHECK)).await;
            value(&c, "SELECT v FROM kv WHERE id = 0").await;
            wait_until(
                "the late instance to serve",
                Duration::from_secs(30),
                || async { wal_follower(&d, DB_CHECK).is_some_and(|f| f.is_ready()) },
            )
            .await;
            late.store(true, Relaxed);
            let (stale, reads) = check_reads(&d, "the late instance", 0, &written, &done).await;
            assert!(reads > 0, "the late instance read while the writes went on");
            (stale, reads)
        }));
    }
    let mut stale = Vec::new();
    for w in writers {
        stale.extend(w.await.unwrap());
    }
    done.store(true, Relaxed);
    let mut reads = 0;
    for r in readers {
        let (s, n) = r.await.unwrap();
        stale.extend(s);
        reads += n;
    }
    let hits: u64 = proxies
        .iter()
        .flat_map(|p| p.app().cache.rule_stats())
        .map(|r| r.hits.get())
        .sum();
    let leaders = proxies
        .iter()
        .filter(|p| wal_follower(p, DB_CHECK).is_some_and(|f| f.leads()))
        .count();
    eprintln!(
        "{reads} reads, {hits} hits, {} writes, {} stale",
        written.lock().unwrap().len(),
        stale.len()
    );
    assert!(stale.is_empty(), "{} stale reads: {stale:#?}", stale.len());
    assert!(
        hits > reads / 4,
        "the reads were cached ({hits} hits of {reads})"
    );
    assert_eq!(leaders, 1, "one decoder for the three");
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
    assert_eq!(
        (shared.decoder, shared.lease, shared.without_valkey),
        (
            Decoder::One,
            Duration::from_secs(3),
            WithoutValkey::OwnFollower
        )
    );
    let each =
        format!("{good}decoder = \"each\"\nlease = \"10s\"\nwithout_valkey = \"no_caching\"\n");
    let shared = Config::from_toml_str(&each)
        .expect("accepted")
        .cache
        .shared
        .unwrap();
    let tls = format!(
        "{}cluster = true\nca_file = \"/etc/ca.pem\"\n",
        good.replace("redis://", "rediss://")
    );
    let tls = Config::from_toml_str(&tls)
        .expect("accepted")
        .cache
        .shared
        .unwrap();
    assert!(tls.cluster && tls.ca_file.as_deref() == Some(std::path::Path::new("/etc/ca.pem")));
    assert_eq!(
        (shared.decoder, shared.lease, shared.without_valkey),
        (
            Decoder::Each,
            Duration::from_secs(10),
            WithoutValkey::NoCaching
        )
    );
    for (bad, key) in [
        ("decoder = \"two\"", "cache.shared.decoder"),
        ("lease = \"10ms\"", "cache.shared.lease"),
        ("without_valkey = \"stale\"", "cache.shared.without_valkey"),
        ("ca_file = \"/etc/ca.pem\"", "cache.shared.ca_file"),
    ] {
        let e = Config::from_toml_str(&format!("{good}{bad}\n"))
            .expect_err(bad)
            .to_string();
        assert!(e.contains(key), "{e}");
    }
    let bad_url = good.replace("redis://", "http://");
    let e = Config::from_toml_str(&bad_url)
        .expect_err("refused")
        .to_string();
    assert!(e.contains("cache.shared.url"), "{e}");
}
