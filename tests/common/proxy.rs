//! Starting pgmemo in-process for a test, in front of the shared cluster.

use super::cluster::*;
use pgmemo::config::{AuthType, Config, PoolMode, Upstream};
use pgmemo::Pgmemo;
use std::net::SocketAddr;

/// A configuration that serves every database of the test cluster, logging into it as the
/// `pgmemo` role, with clients authenticating as `pgmemo`/`pgmemo_pass` (SCRAM by default),
/// on a free loopback port. Tests adjust fields before [`start_pgmemo`].
pub fn test_config(mode: PoolMode, pool_size: u32) -> Config {
    let c = cluster();
    let mut config = Config::for_upstream(Upstream {
        host: "127.0.0.1".into(),
        port: c.port(),
        user: PGMEMO_USER.into(),
        password: Some(PGMEMO_PASS.into()),
        ..Default::default()
    });
    config.general.listen = "127.0.0.1:0".into();
    config.general.pool_mode = mode;
    config.general.default_pool_size = pool_size;
    config.general.auth_type = AuthType::ScramSha256;
    config.general.admin_users = vec![PGMEMO_USER.into()];
    // Tests compare pinned clients with dedicated sessions on pools of one or two: every
    // server may be pinned. The bound (default 0.5) has its own tests (tests/pinning.rs).
    config.general.max_pinned_fraction = 1.0;
    // PGMEMO_TEST_WORKERS=N runs every test's pgmemo with N workers (see docs/development.md, "Tests").
    if let Some(n) = std::env::var("PGMEMO_TEST_WORKERS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        config.general.workers = n;
    }
    config
}

/// Makes every database of `config` log into the server as the fixed role `pgmemo` (with the
/// upstream's password), whatever the client's user: `[databases."*"] user = "pgmemo"`, or
/// `user = "pgmemo"` on each listed database when there is no `"*"` (adding one would serve
/// names the test did not list). By default each client logs into PostgreSQL as its own
/// role; this is for tests whose clients log in to pgmemo as users PostgreSQL does not have,
/// or rely on what `pgmemo` may do there.
pub fn log_in_as_pgmemo(config: &mut Config) {
    use pgmemo::config::WILDCARD_DATABASE;
    if config.databases.is_empty() {
        config
            .databases
            .insert(WILDCARD_DATABASE.into(), Default::default());
    }
    let star = config.databases.contains_key(WILDCARD_DATABASE);
    for (name, db) in &mut config.databases {
        if !star || name == WILDCARD_DATABASE {
            db.user.get_or_insert_with(|| PGMEMO_USER.into());
        }
    }
}

/// `proxy`'s WAL follower of the server database named `db` (SHOW CACHE WAL's `database`),
/// once started.
pub fn wal_follower(proxy: &Pgmemo, db: &str) -> Option<std::sync::Arc<pgmemo::wal::Follower>> {
    proxy
        .app()
        .wal
        .followers()
        .into_iter()
        .find(|f| f.status().database == db)
}

/// Waits until `proxy`'s WAL follower of `db` serves and has applied the server's WAL as of
/// now (after the caller's committed write). The insert position: the test cluster runs with
/// `synchronous_commit = off`, so the write position may not include the commit yet.
pub async fn wait_wal_applied(proxy: &Pgmemo, direct: &tokio_postgres::Client, db: &str) {
    let lsn: pgmemo::wal::Lsn = super::first_value(direct, "SELECT pg_current_wal_insert_lsn()")
        .await
        .parse()
        .unwrap();
    super::wait_until(
        "the WAL follower to apply the write",
        std::time::Duration::from_secs(30),
        || async { wal_follower(proxy, db).is_some_and(|f| f.is_ready() && f.applied() >= lsn) },
    )
    .await;
}

/// Starts pgmemo with `config` on the current tokio runtime; it stops with the runtime.
pub async fn start_pgmemo(config: Config) -> Pgmemo {
    config.validate().expect("test config must be valid");
    Pgmemo::start(config).await.expect("pgmemo starts")
}

/// pgmemo in `mode` with `pool_size` servers: the common case.
pub async fn pgmemo(mode: PoolMode, pool_size: u32) -> Pgmemo {
    start_pgmemo(test_config(mode, pool_size)).await
}

/// A libpq-style URL for a client connecting through pgmemo at `addr`.
pub fn proxy_url(addr: SocketAddr, user: &str, password: Option<&str>, db: &str) -> String {
    match password {
        Some(p) => format!("postgresql://{user}:{p}@{}:{}/{db}", addr.ip(), addr.port()),
        None => format!("postgresql://{user}@{}:{}/{db}", addr.ip(), addr.port()),
    }
}

/// A `[[cache.rules]]` entry named `name` for queries whose normalized text contains
/// `contains`, with a TTL far beyond any test.
pub fn cache_rule(name: &str, contains: &str) -> pgmemo::config::cache::Rule {
    pgmemo::config::cache::Rule {
        name: name.into(),
        database: None,
        user: None,
        query: None,
        query_hash: None,
        query_contains: Some(contains.into()),
        ttl: std::time::Duration::from_secs(600),
        cache_empty: true,
        max_result_bytes: 1024 * 1024,
        transactions: true,
        refresh_at: 0.8,
    }
}

/// The result cache's hits, over every rule (and hints).
pub fn cache_hits(proxy: &Pgmemo) -> u64 {
    proxy
        .app()
        .cache
        .rule_stats()
        .iter()
        .map(|r| r.hits.get())
        .sum()
}

/// Every reason the result cache gives for not answering or storing a query
/// (`SHOW CACHE_BYPASSES`), with how often it was counted.
pub fn cache_bypasses(proxy: &Pgmemo) -> Vec<(&'static str, u64)> {
    pgmemo::query::analysis::BYPASS_REASONS
        .iter()
        .zip(&proxy.app().cache.bypasses)
        .map(|(why, n)| (why.as_str(), n.get()))
        .collect()
}

/// How often the result cache counted bypass reason `reason` (see [`cache_bypasses`]).
pub fn cache_bypassed(proxy: &Pgmemo, reason: &str) -> u64 {
    cache_bypasses(proxy)
        .into_iter()
        .find(|(why, _)| *why == reason)
        .map(|(_, n)| n)
        .expect("a bypass reason")
}

/// Simple queries pgmemo ran as autoprepared statements, over every pool (sessions add theirs
/// between transactions, or when they end in session mode).
pub fn autoprepared(proxy: &Pgmemo) -> u64 {
    proxy
        .app()
        .pools()
        .iter()
        .map(|p| p.stats.snapshot().autoprepared)
        .sum()
}

/// pgmemo's URL for database `db`, as the `pgmemo` role.
pub fn proxy_db_url(proxy: &Pgmemo, db: &str) -> String {
    proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), db)
}

/// PostgreSQL's own URL for database `db`, as the `pgmemo` role.
pub fn direct_db_url(db: &str) -> String {
    cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), db)
}
