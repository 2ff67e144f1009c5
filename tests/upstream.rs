//! How pgmemo reaches its PostgreSQL: the upstream given as a libpq connection string or URL,
//! with several hosts tried in order (`target_session_attrs=read-write` passing over a
//! read-only one), and a Unix socket directory as the server host, against real servers.

mod common;

use common::*;
use pgmemo::config::{parse_upstream_url, PoolMode};
use std::time::{Duration, Instant};

/// A port nothing listens on: a host that refuses connections.
fn dead_port() -> u16 {
    free_port()
}

/// pgmemo in front of the upstream `upstream` (a URL or connection string for the `pgmemo`
/// role), clients logging in as `pgmemo` as usual.
async fn proxy_for(upstream: &str) -> pgmemo::Pgmemo {
    let mut config = test_config(PoolMode::Transaction, 2);
    config.upstream = Some(parse_upstream_url(upstream).expect("a valid upstream"));
    config.general.server_connect_timeout = Duration::from_millis(500);
    start_pgmemo(config).await
}

/// The first column of the first row of `sql`, as text.
async fn text(client: &tokio_postgres::Client, sql: &str) -> String {
    let rows = client.simple_query(sql).await.unwrap();
    rows.iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => {
                Some(r.get(0).unwrap_or("NULL").to_string())
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("{sql}: no row"))
}

#[tokio::test]
async fn a_unix_socket_directory_is_a_server_host() {
    let dir = cluster().socket_dir();
    let upstream = format!(
        "host={} port={} user=pgmemo password=pgmemo_pass",
        dir.display(),
        cluster().port()
    );
    let proxy = proxy_for(&upstream).await;
    let client = connect(&proxy_db_url(&proxy, "postgres")).await;
    // PostgreSQL has no client address for a connection over its Unix socket.
    assert_eq!(
        text(&client, "SELECT coalesce(inet_client_addr()::text, 'unix')").await,
        "unix"
    );
    // SHOW SERVERS shows such a server as PgBouncer does: addr "unix", the server's port.
    let admin = admin_console(proxy.local_addr()).await;
    let servers = admin_rows(&admin, "SHOW SERVERS").await;
    assert!(!servers.is_empty());
    for s in &servers {
        assert_eq!(s["addr"], "unix", "{s:?}");
        assert_eq!(s["port"], cluster().port().to_string(), "{s:?}");
    }
    // A cancel reaches a server behind a Unix socket too.
    let cancel = client.cancel_token();
    let started = Instant::now();
    let sleeping = tokio::spawn(async move {
        let e = client
            .simple_query("SELECT pg_sleep(30)")
            .await
            .unwrap_err();
        e.as_db_error().map(|d| d.code().code().to_string())
    });
    let direct = connect(&direct_db_url("postgres")).await;
    wait_until("the sleep to run", Duration::from_secs(10), || async {
        text(
            &direct,
            "SELECT count(*) FROM pg_stat_activity \
             WHERE query LIKE '%pg_sleep%' AND pid <> pg_backend_pid() AND state = 'active'",
        )
        .await
            == "1"
    })
    .await;
    cancel.cancel_query(tokio_postgres::NoTls).await.unwrap();
    assert_eq!(sleeping.await.unwrap().as_deref(), Some("57014"));
    assert!(started.elapsed() < Duration::from_secs(20));
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_missing_socket_gives_the_client_libpqs_error() {
    let proxy =
        proxy_for("host=/nonexistent/pgmemo-test port=5999 user=pgmemo password=pgmemo_pass").await;
    let err = tokio_postgres::connect(&proxy_db_url(&proxy, "postgres"), tokio_postgres::NoTls)
        .await
        .err()
        .expect("no server to log in to");
    let db = err.as_db_error().expect("an ErrorResponse from pgmemo");
    assert_eq!(db.code().code(), "08006");
    assert!(
        db.message().contains(
            "connection to server on socket \"/nonexistent/pgmemo-test/.s.PGSQL.5999\" failed: \
             No such file or directory"
        ),
        "{}",
        db.message()
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn several_hosts_are_tried_in_order() {
    let port = cluster().port();
    // The first host refuses connections: the second serves.
    let proxy = proxy_for(&format!(
        "postgresql://pgmemo:pgmemo_pass@127.0.0.1:{},127.0.0.1:{port}/ignored",
        dead_port()
    ))
    .await;
    let client = connect(&proxy_db_url(&proxy, "postgres")).await;
    assert_eq!(
        text(&client, "SELECT inet_server_port()").await,
        port.to_string()
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn read_write_passes_over_a_read_only_server() {
    // A server that refuses writes, as a standby would (PostgreSQL reports
    // default_transaction_read_only at login, which is what libpq reads). Its superuser
    // postgres is trusted; the shared cluster's pgmemo role is a superuser too.
    let read_only =
        tokio::task::spawn_blocking(|| private_cluster(&[("default_transaction_read_only", "on")]))
            .await
            .unwrap();
    read_only
        .psql(
            "postgres",
            "SET default_transaction_read_only = off; \
             CREATE ROLE pgmemo LOGIN SUPERUSER PASSWORD 'pgmemo_pass'",
        )
        .unwrap();
    let (ro, rw) = (read_only.port(), cluster().port());
    let hosts = format!("host=127.0.0.1,127.0.0.1 port={ro},{rw} user=pgmemo password=pgmemo_pass");

    // Without target_session_attrs the first host that logs in is used, read-only or not.
    let any = proxy_for(&hosts).await;
    let client = connect(&proxy_db_url(&any, "postgres")).await;
    assert_eq!(
        text(&client, "SELECT inet_server_port()").await,
        ro.to_string()
    );
    any.shutdown().await;

    // With read-write, the read-only server is passed over.
    let rw_proxy = proxy_for(&format!("{hosts} target_session_attrs=read-write")).await;
    let client = connect(&proxy_db_url(&rw_proxy, "postgres")).await;
    assert_eq!(
        text(&client, "SELECT inet_server_port()").await,
        rw.to_string()
    );
    client
        .simple_query("CREATE TEMP TABLE written (x int)")
        .await
        .unwrap();
    rw_proxy.shutdown().await;

    // With read-write and only read-only servers, the client is told so.
    let none = proxy_for(&format!(
        "host=127.0.0.1 port={ro} user=pgmemo password=pgmemo_pass \
         target_session_attrs=read-write"
    ))
    .await;
    let err = tokio_postgres::connect(&proxy_db_url(&none, "postgres"), tokio_postgres::NoTls)
        .await
        .err()
        .expect("no writable server");
    let db = err.as_db_error().expect("an ErrorResponse from pgmemo");
    assert_eq!(db.code().code(), "08006");
    assert!(
        db.message().contains("session is read-only"),
        "{}",
        db.message()
    );
    none.shutdown().await;
}

/// `load_balance_hosts` (PgBouncer's `round-robin`, libpq's `random` and `disable`): which
/// host a new server connection starts at. Two servers, four session-mode clients each
/// holding a connection of their own: round-robin spreads them two and two, `disable` puts
/// them all on the first host, and round-robin still passes over a host that refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_balance_hosts_spreads_new_connections() {
    let other = tokio::task::spawn_blocking(|| private_cluster(&[]))
        .await
        .unwrap();
    other
        .psql(
            "postgres",
            "CREATE ROLE pgmemo LOGIN SUPERUSER PASSWORD 'pgmemo_pass'",
        )
        .unwrap();
    let (a, b) = (cluster().port(), other.port());
    let ports_of = |upstream: String| async move {
        let mut config = test_config(PoolMode::Session, 4);
        config.upstream = Some(parse_upstream_url(&upstream).expect("a valid upstream"));
        config.general.server_connect_timeout = Duration::from_millis(500);
        let proxy = start_pgmemo(config).await;
        let mut clients = Vec::new();
        let mut ports = Vec::new();
        for _ in 0..4 {
            let client = connect(&proxy_db_url(&proxy, "postgres")).await;
            ports.push(text(&client, "SELECT inet_server_port()").await);
            clients.push(client);
        }
        drop(clients);
        proxy.shutdown().await;
        ports.sort();
        ports
    };
    let hosts = |extra: &str| {
        format!("host=127.0.0.1,127.0.0.1 port={a},{b} user=pgmemo password=pgmemo_pass {extra}")
    };
    let (a, b) = (a.to_string(), b.to_string());
    let mut two_and_two = vec![a.clone(), a.clone(), b.clone(), b.clone()];
    two_and_two.sort();
    assert_eq!(
        ports_of(hosts("load_balance_hosts=round-robin")).await,
        two_and_two
    );
    assert_eq!(
        ports_of(hosts("load_balance_hosts=disable")).await,
        vec![a.clone(); 4]
    );
    assert_eq!(ports_of(hosts("")).await, vec![a.clone(); 4]);
    // random: every connection lands on one of the two (which one is chance).
    let random = ports_of(hosts("load_balance_hosts=random")).await;
    assert!(random.iter().all(|p| *p == a || *p == b), "{random:?}");
    // A host that refuses: its turns go to the next host.
    let dead = dead_port();
    let ports = ports_of(format!(
        "host=127.0.0.1,127.0.0.1 port={dead},{b} user=pgmemo password=pgmemo_pass \
         load_balance_hosts=round-robin"
    ))
    .await;
    assert_eq!(ports, vec![b.clone(); 4]);
}
