//! pgmemo in front of a highly available cluster: a primary with a synchronous standby.
//!
//! A committing backend flushes its commit record, waits for its synchronous standby, and
//! only then becomes visible; pgmemo's WAL follower decodes the commit while the backend
//! waits. The standby here is a real one (`pg_receivewal --synchronous`, named in
//! `synchronous_standby_names`), held with SIGSTOP while a write commits, so that the gap is
//! there on every write, not by chance: reads through pgmemo in the gap get what PostgreSQL
//! gives (the old value), and once the write has returned and the follower has passed it,
//! every read gets the new value.

mod common;

use common::first_value as value;
use common::*;
use pgmemo::config::cache::{Invalidation, WalPlugin};
use pgmemo::config::PoolMode;
use pgmemo::demo::{LocalPostgres, LocalPostgresOptions};
use pgmemo::Pgmemo;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::Client;

/// A primary whose commits wait for the standby named `hold`, its WAL decodable, its
/// replication connections trusted.
fn primary() -> LocalPostgres {
    let settings = [
        ("wal_level", "logical"),
        ("synchronous_commit", "on"),
        ("synchronous_standby_names", "hold"),
    ];
    LocalPostgres::start(LocalPostgresOptions {
        settings: settings
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        hba: vec![
            "local replication all trust".into(),
            "host replication all 127.0.0.1/32 trust".into(),
        ],
        ..LocalPostgresOptions::default()
    })
    .expect("a primary")
}

/// A synchronous standby of `pg`'s WAL (`pg_receivewal --synchronous`, application name
/// `hold`): it flushes and answers at once, unless held.
struct SyncStandby {
    child: tokio::process::Child,
    pid: i32,
}

impl SyncStandby {
    async fn start(pg: &LocalPostgres, direct: &Client) -> SyncStandby {
        let dir = pg.socket_dir().join("receivewal");
        std::fs::create_dir_all(&dir).unwrap();
        let conninfo = format!(
            "host=127.0.0.1 port={} user=postgres application_name=hold",
            pg.port()
        );
        let child = tokio::process::Command::new(pg.bin_dir().join("pg_receivewal"))
            .args(["--synchronous", "--no-loop", "-D"])
            .arg(&dir)
            .args(["-d", &conninfo])
            .env_remove("PGSERVICE")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("pg_receivewal");
        let pid = child.id().expect("its pid") as i32;
        wait_until(
            "the standby to be synchronous",
            Duration::from_secs(30),
            || async {
                value(
                    direct,
                    "SELECT count(*) FROM pg_stat_replication \
                 WHERE application_name = 'hold' AND sync_state = 'sync'",
                )
                .await
                    == "1"
            },
        )
        .await;
        SyncStandby { child, pid }
    }

    /// Stops the standby: commits wait for it.
    fn hold(&self) {
        assert_eq!(unsafe { libc::kill(self.pid, libc::SIGSTOP) }, 0);
    }

    fn release(&self) {
        assert_eq!(unsafe { libc::kill(self.pid, libc::SIGCONT) }, 0);
    }
}

impl Drop for SyncStandby {
    fn drop(&mut self) {
        self.release();
        let _ = self.child.start_kill();
    }
}

/// pgmemo in transaction mode (`pool` servers) in front of `upstream` (a URL), caching what
/// reads `table` with WAL invalidation by `plugin`; a client of it that read `read` once, and
/// the follower caught up.
async fn cached_through(
    upstream: &str,
    pool: u32,
    table: &str,
    plugin: WalPlugin,
    read: &str,
) -> (Pgmemo, Client) {
    let mut config = test_config(PoolMode::Transaction, pool);
    config.upstream = Some(pgmemo::config::parse_upstream_url(upstream).unwrap());
    config.general.auth_type = pgmemo::config::AuthType::Trust;
    config.cache.enabled = true;
    config.cache.admit_after = 1;
    config.cache.invalidation = Invalidation::Wal;
    config.cache.wal_plugin = plugin;
    config.cache.rules = vec![cache_rule(table, &format!("FROM {table}"))];
    let proxy = start_pgmemo(config).await;
    let reader = connect(&proxy_url_of(&proxy)).await;
    value(&reader, read).await;
    soon("the follower to catch up", || async {
        follower(&proxy).is_some_and(|f| f.is_ready())
    })
    .await;
    (proxy, reader)
}

fn proxy_url_of(proxy: &Pgmemo) -> String {
    format!("postgresql://postgres@{}/postgres", proxy.local_addr())
}

/// Waits for `cond`, asking every millisecond (a decode takes about that long).
async fn soon<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !cond().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

const READ: &str = "SELECT v FROM kv WHERE k = 1";

/// [`READ`], alone or in a transaction block.
async fn read(client: &Client, in_block: bool) -> String {
    if !in_block {
        return value(client, READ).await;
    }
    client.batch_execute("BEGIN").await.unwrap();
    let v = value(client, READ).await;
    client.batch_execute("COMMIT").await.unwrap();
    v
}

/// Writes per writer (directly, and through pgmemo) and decoder: 1,000 in all.
const WRITES: i64 = 250;

/// Each write commits while the standby is held: the follower decodes it, reads through
/// pgmemo (outside a block and in one) race it and get the old value, as PostgreSQL gives
/// it; the standby is released, the write returns, the follower passes it, and the next reads
/// through pgmemo get the new value. Written directly and through pgmemo (an autocommit
/// statement, whose commit only the WAL tells other pgmemo clients' fills about).
async fn held_commits_are_never_cached_stale(plugin: WalPlugin) {
    let pg = tokio::task::spawn_blocking(primary).await.unwrap();
    let direct = connect(&pg.url("postgres", None, "postgres")).await;
    let standby = SyncStandby::start(&pg, &direct).await;
    direct
        .batch_execute(
            "CREATE TABLE kv (k int PRIMARY KEY, v bigint); INSERT INTO kv VALUES (1, 0), (2, 0)",
        )
        .await
        .unwrap();
    let (proxy, reader) =
        cached_through(&pg.url("postgres", None, "postgres"), 3, "kv", plugin, READ).await;
    let writers = [
        Arc::new(connect(&pg.url("postgres", None, "postgres")).await),
        Arc::new(connect(&proxy_url_of(&proxy)).await),
    ];
    let mut written = 0;
    for (writer, through_pgmemo) in writers.iter().zip([false, true]) {
        for _ in 0..WRITES {
            written += 1;
            let f = follower(&proxy).unwrap();
            let decoded = f.commits.load(Relaxed);
            standby.hold();
            let update = format!("UPDATE kv SET v = {written} WHERE k = 1");
            let writer = writer.clone();
            let write = tokio::spawn(async move { writer.batch_execute(&update).await.unwrap() });
            soon("the write's commit to be decoded", || async {
                f.commits.load(Relaxed) > decoded
            })
            .await;
            let old = (written - 1).to_string();
            assert_eq!(value(&direct, READ).await, old, "PostgreSQL, in the gap");
            for in_block in [false, true, false] {
                let read = read(&reader, in_block).await;
                assert_eq!(
                    read, old,
                    "write {written}, in the gap (in a block: {in_block})"
                );
            }
            standby.release();
            write.await.unwrap();
            wait_passed(&proxy, &direct).await;
            let new = written.to_string();
            for in_block in [false, false, true, true] {
                assert_eq!(
                    read(&reader, in_block).await,
                    new,
                    "write {written} (through pgmemo: {through_pgmemo}), once the follower \
                     passed it (in a block: {in_block})"
                );
            }
        }
    }
    // Each write's second and fourth reads after it, at least.
    let hits = cache_hits(&proxy);
    assert!(
        hits >= 2 * written as u64,
        "{hits} hits: {:?}",
        cache_bypasses(&proxy)
    );
    proxy.shutdown().await;
}

fn follower(proxy: &Pgmemo) -> Option<std::sync::Arc<pgmemo::wal::Follower>> {
    proxy.app().wal.followers().into_iter().next()
}

/// Waits until the follower has applied the server's WAL position as of now.
async fn wait_passed(proxy: &Pgmemo, direct: &Client) {
    let lsn: pgmemo::wal::Lsn = value(direct, "SELECT pg_current_wal_insert_lsn()")
        .await
        .parse()
        .unwrap();
    soon("the follower to pass the write", || async {
        follower(proxy).is_some_and(|f| f.is_ready() && f.applied() >= lsn)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_commits_are_never_cached_stale_test_decoding() {
    held_commits_are_never_cached_stale(WalPlugin::TestDecoding).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_commits_are_never_cached_stale_pgoutput() {
    held_commits_are_never_cached_stale(WalPlugin::Pgoutput).await;
}

/// A primary for failover: its WAL decodable, replication over TCP trusted.
fn failover_primary() -> LocalPostgres {
    LocalPostgres::start(LocalPostgresOptions {
        settings: vec![("wal_level".into(), "logical".into())],
        hba: vec!["host replication all 127.0.0.1/32 trust".into()],
        ..LocalPostgresOptions::default()
    })
    .expect("a primary")
}

/// What one writer saw through pgmemo while the primary failed over.
#[derive(Debug, Default)]
struct Seen {
    /// Writes acknowledged, and after the promotion.
    acknowledged: u64,
    after_promotion: u64,
    /// Statements that failed (those in flight at the switch).
    errors: u64,
    /// Reads of its own row older than its last acknowledged write.
    stale: u64,
    /// Its row's value as last acknowledged.
    last: i64,
}

const WRITERS: i64 = 8;

/// A writer through pgmemo: sets its own row to 1, 2, 3, ... (each an autocommit UPDATE),
/// reading it back through the cache after each write; reconnects when its connection goes.
async fn writer(
    url: String,
    id: i64,
    promoted: Arc<std::sync::atomic::AtomicBool>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    seen: Arc<std::sync::Mutex<Seen>>,
) {
    let mut client = connect(&url).await;
    let mut next = 1;
    while !stop.load(Relaxed) {
        if client.is_closed() {
            match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                Ok((c, conn)) => {
                    tokio::spawn(conn);
                    client = c;
                }
                Err(_) => {
                    seen.lock().unwrap().errors += 1;
                    continue;
                }
            }
        }
        let update = format!("UPDATE counters SET v = {next} WHERE id = {id}");
        match client.batch_execute(&update).await {
            Ok(()) => {
                let mut s = seen.lock().unwrap();
                s.acknowledged += 1;
                s.after_promotion += promoted.load(Relaxed) as u64;
                s.last = next;
            }
            Err(_) => {
                // Its fate is unknown (in flight at the switch): the next write settles it.
                seen.lock().unwrap().errors += 1;
                next += 1;
                continue;
            }
        }
        next += 1;
        let read = format!("SELECT v FROM counters WHERE id = {id}");
        match client.simple_query(&read).await {
            Ok(messages) => {
                let v: i64 = messages
                    .iter()
                    .find_map(|m| match m {
                        tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0)?.parse().ok(),
                        _ => None,
                    })
                    .unwrap_or(-1);
                let mut s = seen.lock().unwrap();
                if v != s.last {
                    s.stale += 1;
                }
            }
            Err(_) => seen.lock().unwrap().errors += 1,
        }
    }
}

/// A primary and its streaming standby (`pg_basebackup`) behind pgmemo, as libpq takes
/// them (`target_session_attrs=read-write` over both hosts), with WAL invalidation: 8
/// writers write and read (cached) through pgmemo; the primary is stopped and the standby
/// promoted. Writes resume on the new primary without a RELOAD, no acknowledged write is
/// lost, no read is older than its writer's last write, errors come only from what was in
/// flight, the WAL follower moves to the new primary (a direct write there invalidates), and
/// SHOW DATABASES and the switchover counter say where the primary is. Then the old primary
/// comes back as a standby of the new one: pgmemo keeps writing to the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_standby_takes_the_writes_and_nothing_stale_is_served() {
    use std::sync::atomic::AtomicBool;
    let old = tokio::task::spawn_blocking(failover_primary).await.unwrap();
    old.psql(
        "postgres",
        "CREATE TABLE counters (id int PRIMARY KEY, v bigint); \
         INSERT INTO counters SELECT i, 0 FROM generate_series(0, 100) i;",
    )
    .unwrap();
    let old_port = old.port();
    let (old, new) = tokio::task::spawn_blocking(move || {
        let standby = old.standby().expect("a standby");
        (old, standby)
    })
    .await
    .unwrap();
    let upstream = format!(
        "postgresql://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        old.port(),
        new.port()
    );
    let read = "SELECT v FROM counters WHERE id = 100";
    let plugin = WalPlugin::TestDecoding;
    let (proxy, reader) = cached_through(&upstream, 4, "counters", plugin, read).await;
    let url = proxy_url_of(&proxy);

    let promoted = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let seen: Vec<_> = (0..WRITERS)
        .map(|_| Arc::new(std::sync::Mutex::new(Seen::default())))
        .collect();
    let writers: Vec<_> = (0..WRITERS)
        .map(|id| {
            let (p, s, seen) = (promoted.clone(), stop.clone(), seen[id as usize].clone());
            tokio::spawn(writer(url.clone(), id, p, s, seen))
        })
        .collect();
    let each_wrote = |n: u64, after: bool| {
        let seen = seen.clone();
        move || {
            let seen = seen.clone();
            async move {
                seen.iter().all(|s| {
                    let s = s.lock().unwrap();
                    (if after {
                        s.after_promotion
                    } else {
                        s.acknowledged
                    }) >= n
                })
            }
        }
    };
    soon("every writer to write", each_wrote(20, false)).await;

    // The primary fails (a clean stop: everything it acknowledged reached the standby) and
    // the standby is promoted.
    let mut old = off_runtime(old, |pg| pg.stop_server("fast")).await;
    let promoting = std::time::Instant::now();
    let new = tokio::task::spawn_blocking(move || new.promote().map(|()| new))
        .await
        .unwrap()
        .expect("promoted");
    promoted.store(true, Relaxed);
    soon("a write through pgmemo after the promotion", || async {
        seen.iter().any(|s| s.lock().unwrap().after_promotion > 0)
    })
    .await;
    eprintln!(
        "first write through pgmemo {:?} after pg_ctl promote began",
        promoting.elapsed()
    );
    soon(
        "every writer to write on the new primary",
        each_wrote(20, true),
    )
    .await;

    // The follower streams from the new primary: a direct write there invalidates.
    let direct = connect(&new.url("postgres", None, "postgres")).await;
    let before = value(&reader, "SELECT v FROM counters WHERE id = 100").await;
    direct
        .batch_execute("UPDATE counters SET v = v + 1 WHERE id = 100")
        .await
        .unwrap();
    wait_passed(&proxy, &direct).await;
    let after = value(&reader, "SELECT v FROM counters WHERE id = 100").await;
    assert_eq!(
        after.parse::<i64>().unwrap(),
        before.parse::<i64>().unwrap() + 1
    );

    let primary = proxy.app().pools()[0].settings().target.primary.clone();
    assert_eq!(primary.switchovers(), 1);
    let admin = admin_console(proxy.local_addr()).await;
    let databases = admin_rows(&admin, "SHOW DATABASES").await;
    let row = databases
        .iter()
        .find(|r| r.get("name").map(String::as_str) == Some("postgres"))
        .expect("the database's row");
    assert_eq!(
        row["port"],
        new.port().to_string(),
        "SHOW DATABASES: the primary"
    );

    // The old primary rejoins as a standby of the new one (first in the host list).
    let (old, new) = tokio::task::spawn_blocking(move || {
        old.follow(&new)
            .expect("the old primary follows the new one");
        (old, new)
    })
    .await
    .unwrap();
    assert_eq!(old.port(), old_port);
    let at = seen
        .iter()
        .map(|s| s.lock().unwrap().acknowledged)
        .collect::<Vec<_>>();
    soon(
        "every writer to write with the old primary back",
        || async {
            seen.iter()
                .zip(&at)
                .all(|(s, n)| s.lock().unwrap().acknowledged >= n + 20)
        },
    )
    .await;
    stop.store(true, Relaxed);
    for w in writers {
        w.await.unwrap();
    }

    // Every acknowledged write is on the new primary, nothing on the old one but its copy.
    let direct = connect(&new.url("postgres", None, "postgres")).await;
    for (id, s) in seen.iter().enumerate() {
        let v: i64 = value(&direct, &format!("SELECT v FROM counters WHERE id = {id}"))
            .await
            .parse()
            .unwrap();
        let s = s.lock().unwrap();
        assert!(v >= s.last, "writer {id}: {v} on the new primary, {s:?}");
        assert_eq!(s.stale, 0, "writer {id}: stale reads, {s:?}");
        assert!(
            s.errors <= 4,
            "writer {id}: errors beyond the switch, {s:?}"
        );
    }
    let standby = connect(&old.url("postgres", None, "postgres")).await;
    assert_eq!(value(&standby, "SELECT pg_is_in_recovery()").await, "t");
    assert_eq!(
        primary.switchovers(),
        1,
        "the old primary came back as a standby"
    );
    proxy.shutdown().await;
}

/// A TCP relay to `to` that can be cut as a network cut does: the connections it carries stay
/// open and carry nothing more; connections made after the cut go through.
struct Relay {
    addr: std::net::SocketAddr,
    /// Connections made before this generation (counted from 1) carry nothing.
    cut_before: Arc<std::sync::atomic::AtomicU64>,
    generation: Arc<std::sync::atomic::AtomicU64>,
}

impl Relay {
    async fn start(to: std::net::SocketAddr) -> Relay {
        use std::sync::atomic::AtomicU64;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut_before = Arc::new(AtomicU64::new(0));
        let generation = Arc::new(AtomicU64::new(0));
        let cut = cut_before.clone();
        let made = generation.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let me = made.fetch_add(1, Relaxed) + 1;
                let cut = cut.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(to).await else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let carries = move || me >= cut.load(Relaxed);
                    let up = relay_half(&mut cr, &mut sw, carries.clone());
                    let down = relay_half(&mut sr, &mut cw, carries);
                    if tokio::join!(up, down) != (false, false) {
                        // Cut: both sockets stay open, silent, until the test ends.
                        std::future::pending::<()>().await;
                    }
                });
            }
        });
        Relay {
            addr,
            cut_before,
            generation,
        }
    }

    /// Cuts every connection made so far.
    fn cut(&self) {
        self.cut_before
            .store(self.generation.load(Relaxed) + 1, Relaxed);
    }
}

/// Copies `from` to `to` while `carries()`: true when it no longer does (cut), false when
/// `from` ended (then `to` is shut down, as the end is passed on).
async fn relay_half(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    carries: impl Fn() -> bool,
) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0; 64 * 1024];
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return false;
                }
                Ok(n) => n,
            },
            _ = tokio::time::sleep(Duration::from_millis(50)) => 0,
        };
        if !carries() {
            return true;
        }
        if n > 0 && to.write_all(&buf[..n]).await.is_err() {
            return false;
        }
    }
}

/// The network between pgmemo and the primary is cut (a relay that stops carrying, its TCP
/// connections left open, as a cut leaves them): the server is no longer heard from, so
/// within seconds the database's cached results are not served; the stream is given up and
/// started again over a new connection, and its start ends the old walsender, which still
/// holds its temporary slot (PostgreSQL would notice only at `wal_sender_timeout`): one
/// pgmemo slot on the server, not two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_off_is_not_served_and_leaves_no_slot_behind() {
    let pg = tokio::task::spawn_blocking(failover_primary).await.unwrap();
    pg.psql(
        "postgres",
        "CREATE TABLE cut (k int PRIMARY KEY, v int); INSERT INTO cut VALUES (1, 1);",
    )
    .unwrap();
    let relay = Relay::start(format!("127.0.0.1:{}", pg.port()).parse().unwrap()).await;
    let upstream = format!("postgresql://postgres@{}/postgres", relay.addr);
    let read = "SELECT v FROM cut WHERE k = 1";
    let (proxy, _reader) = cached_through(&upstream, 2, "cut", WalPlugin::TestDecoding, read).await;
    let f = follower(&proxy).unwrap();
    let connects = f.connects.load(Relaxed);
    let direct = connect(&pg.url("postgres", None, "postgres")).await;
    let slots = "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'pgmemo%'";
    assert_eq!(value(&direct, slots).await, "1");
    // Idle, the stream is kept alive by pgmemo's requests for a keepalive (its replies show
    // as the walsender's reply_time): served all along, never started again.
    let since = value(&direct, "SELECT now()").await;
    let replied = format!(
        "SELECT count(*) FROM pg_stat_replication r \
         JOIN pg_replication_slots s ON s.active_pid = r.pid \
         WHERE s.slot_name LIKE 'pgmemo%' \
         AND r.reply_time > '{since}'::timestamptz + interval '3 s'"
    );
    wait_until(
        "pgmemo to answer while idle",
        Duration::from_secs(10),
        || async { value(&direct, &replied).await == "1" },
    )
    .await;
    assert!(f.is_ready(), "an idle stream that answers is served");
    assert_eq!(f.connects.load(Relaxed), connects, "nor started again");

    relay.cut();
    let cut_at = std::time::Instant::now();
    wait_until(
        "the silent stream not to be served",
        Duration::from_secs(10),
        || async { !f.is_ready() },
    )
    .await;
    eprintln!("not served {:?} after the cut", cut_at.elapsed());
    wait_until("a new stream", Duration::from_secs(40), || async {
        f.connects.load(Relaxed) > connects
    })
    .await;
    eprintln!(
        "reconnecting {:?} after the cut: {}",
        cut_at.elapsed(),
        f.status().phase
    );
    wait_until("a new stream", Duration::from_secs(40), || async {
        f.is_ready()
    })
    .await;
    eprintln!("served again {:?} after the cut", cut_at.elapsed());
    wait_until("the old slot gone", Duration::from_secs(10), || async {
        value(&direct, slots).await == "1"
    })
    .await;
    eprintln!("one slot {:?} after the cut", cut_at.elapsed());
    proxy.shutdown().await;
    eprintln!("shut down {:?} after the cut", cut_at.elapsed());
}
