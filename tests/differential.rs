//! pgmemo must answer exactly like PostgreSQL: every scenario of the harness runs against
//! PostgreSQL directly and through pgmemo (transaction mode with one and with two servers,
//! session mode) and the transcripts must be identical. Then what matters most for a pooler:
//! the start-up parameters a client asks for and is told about, settings that must follow a
//! client from server to server, protocol version negotiation, and extended-protocol batches
//! that are not finished yet when their replies have all arrived.

mod common;

use common::*;
use pgmemo::app::ClientState;
use pgmemo::config::PoolMode;
use pgmemo::Pgmemo;
use std::net::SocketAddr;
use tokio::task::JoinSet;

/// Scenarios whose later transactions use what earlier ones left in the session (temp tables,
/// a temp function, named statements, an unreported SET). In transaction mode that only works
/// while the client keeps landing on the same server, which a pool of one guarantees and a
/// larger pool guarantees only to a client that is alone (idle servers are reused last in,
/// first out).
const KEEPS_SESSION_STATE: &[&str] = &[
    "simple_queries",
    "copy_in_simple",
    "copy_in_extended",
    "copy_in_extended_early_sync",
    "copy_fail",
    "notices",
    "named_statements",
];

/// Session state that no pooler can carry in transaction mode.
const SESSION_MODE_ONLY: &[&str] = &["listen_notify"];

/// Runs `script` on a fresh connection as `pgmemo` in the test database with these startup
/// parameters and returns the transcript.
async fn transcript(addr: SocketAddr, params: &[(&str, &str)], script: &[Step]) -> Vec<String> {
    let client = RawClient::through(addr, params)
        .await
        .unwrap_or_else(|e| panic!("connecting to {addr}: {e:#}"));
    run_script(client, script).await
}

/// Runs one scenario directly and through `proxy`; the difference, if any, as a report.
async fn compare(proxy: SocketAddr, label: &str, name: &str, script: &[Step]) -> Option<String> {
    let direct = transcript(cluster().addr(), &[], script).await;
    let proxied = transcript(proxy, &[], script).await;
    diff(&direct, &proxied).map(|d| format!("scenario {name} through pgmemo ({label}): {d}"))
}

/// Runs the scenarios all at once; returns the reports of those that differ.
async fn compare_concurrently(
    proxy: SocketAddr,
    label: &'static str,
    scenarios: Vec<(&'static str, Vec<Step>)>,
) -> Vec<String> {
    let mut tasks = JoinSet::new();
    for (name, script) in scenarios {
        tasks.spawn(async move { compare(proxy, label, name, &script).await });
    }
    let mut failures = Vec::new();
    while let Some(result) = tasks.join_next().await {
        failures.extend(result.expect("scenario task panicked"));
    }
    failures
}

/// Runs the scenarios one after another; returns the reports of those that differ.
async fn compare_one_by_one(
    proxy: SocketAddr,
    label: &str,
    scenarios: Vec<(&'static str, Vec<Step>)>,
) -> Vec<String> {
    let mut failures = Vec::new();
    for (name, script) in scenarios {
        failures.extend(compare(proxy, label, name, &script).await);
    }
    failures
}

fn assert_no_failures(failures: Vec<String>) {
    assert!(
        failures.is_empty(),
        "{} scenario(s) differ:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

/// The backend pid of the server a new client's first query runs on.
async fn server_pid(addr: SocketAddr) -> i32 {
    let mut client = RawClient::through(addr, &[]).await.expect("login");
    backend_pid(&mut client).await
}

fn scenarios_except(excluded: &[&str]) -> Vec<(&'static str, Vec<Step>)> {
    scenarios()
        .into_iter()
        .filter(|(name, _)| !excluded.contains(name))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenarios_match_postgres_in_transaction_mode_with_one_server() {
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let addr = proxy.local_addr();
    let first_pid = server_pid(addr).await;
    // One server for everybody: all scenarios at once interleave their transactions on it,
    // and session state stays where it was made.
    let failures = compare_concurrently(
        addr,
        "transaction mode, pool_size 1",
        scenarios_except(SESSION_MODE_ONLY),
    )
    .await;
    // No scenario left its server in a state that made pgmemo close it.
    let after = server_pid(addr).await;
    proxy.shutdown().await;
    assert_no_failures(failures);
    assert_eq!(after, first_pid, "the one server was replaced");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenarios_match_postgres_in_transaction_mode_with_two_servers() {
    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    let addr = proxy.local_addr();
    let label = "transaction mode, pool_size 2";
    // Scenarios without session state compete for the two servers; those with session state
    // then run alone, so they keep their server.
    let mut excluded = KEEPS_SESSION_STATE.to_vec();
    excluded.extend(SESSION_MODE_ONLY);
    let mut failures = compare_concurrently(addr, label, scenarios_except(&excluded)).await;
    let stateful = scenarios()
        .into_iter()
        .filter(|(name, _)| KEEPS_SESSION_STATE.contains(name))
        .collect();
    failures.extend(compare_one_by_one(addr, label, stateful).await);
    proxy.shutdown().await;
    assert_no_failures(failures);
}

/// A driver's Parse of its unnamed statement again, through a transaction-mode pgmemo with
/// this client alone: no server needs bringing in line with another client's settings, so
/// pgmemo answers most of these Parses in its lane (see `session::lane`), where the runs
/// above mostly take the stages. The same replies as PostgreSQL's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parse_of_the_unnamed_statement_again_matches_postgres() {
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let failures = compare_one_by_one(
        proxy.local_addr(),
        "transaction mode, one client",
        scenarios()
            .into_iter()
            .filter(|(name, _)| *name == "unnamed_parse_again")
            .collect(),
    )
    .await;
    proxy.shutdown().await;
    assert_no_failures(failures);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenarios_match_postgres_in_session_mode() {
    // Fewer servers than scenarios: sessions queue, and servers are reset and reused.
    let proxy = pgmemo(PoolMode::Session, 4).await;
    let mut failures =
        compare_concurrently(proxy.local_addr(), "session mode, pool_size 4", scenarios()).await;
    proxy.shutdown().await;
    // With statements shared between sessions, as transaction mode shares them.
    let mut config = test_config(PoolMode::Session, 4);
    config.general.session_shared_statements = true;
    let proxy = start_pgmemo(config).await;
    failures.extend(
        compare_concurrently(
            proxy.local_addr(),
            "session mode with shared statements, pool_size 4",
            scenarios(),
        )
        .await,
    );
    proxy.shutdown().await;
    assert_no_failures(failures);
}

// ---------------------------------------------------------------------------------------------
// Start-up parameters
// ---------------------------------------------------------------------------------------------

/// Shows every setting the start-up cases touch, and values whose text depends on them.
const SHOW_SETTINGS: &str = "SELECT current_setting('DateStyle') AS datestyle, \
     current_setting('TimeZone') AS timezone, current_setting('search_path') AS search_path, \
     current_setting('statement_timeout') AS statement_timeout, \
     current_setting('IntervalStyle') AS intervalstyle, \
     current_setting('application_name') AS app, current_setting('client_encoding') AS enc, \
     current_setting('extra_float_digits') AS efd, \
     current_setting('default_transaction_read_only') AS default_ro, \
     current_setting('transaction_read_only') AS ro, \
     current_setting('standard_conforming_strings') AS scs, \
     timestamptz '2024-05-06 07:08:09+00' AS ts, date '2024-05-06' AS d, \
     interval '1 day 2 hours' AS iv, 0.1::float8 AS f, 'café' AS t";

fn show_settings() -> Vec<Step> {
    vec![
        Step::Send(vec![Frontend::query(SHOW_SETTINGS)]),
        Step::Expect(1),
    ]
}

/// Start-up parameter sets a client may send; each is tried directly and through pgmemo.
fn startup_cases() -> Vec<Vec<(&'static str, &'static str)>> {
    vec![
        vec![],
        vec![("application_name", "startup_app")],
        vec![("DateStyle", "ISO")],
        vec![("TimeZone", "Europe/Berlin")],
        vec![("search_path", "public, pg_catalog")],
        vec![("options", "-c statement_timeout=5s")],
        vec![("client_encoding", "LATIN1"), ("IntervalStyle", "iso_8601")],
        vec![
            ("application_name", "all_of_them"),
            ("DateStyle", "ISO"),
            ("TimeZone", "Europe/Berlin"),
            ("search_path", "public, pg_catalog"),
            (
                "options",
                "-c statement_timeout=5s --extra-float-digits=1 -c DateStyle=German",
            ),
        ],
        // Values equal to the server's defaults, spelled differently.
        vec![("DateStyle", "iso, mdy"), ("client_encoding", "utf8")],
        // Every other reported parameter a client can set, in effect from its first query.
        vec![("default_transaction_read_only", "on")],
        vec![("options", "-c default_transaction_read_only=true")],
        vec![("standard_conforming_strings", "off")],
    ]
}

/// The start-up messages (ParameterStatus set, BackendKeyData, ReadyForQuery) and a query
/// showing the settings, through pgmemo, must be what PostgreSQL itself says.
async fn check_startup_cases(proxy: SocketAddr, label: &str) -> Vec<String> {
    let mut failures = Vec::new();
    for params in startup_cases() {
        let direct = RawClient::direct(&params).await.expect("direct login");
        let proxied = RawClient::through(proxy, &params)
            .await
            .unwrap_or_else(|e| panic!("login through pgmemo ({label}) with {params:?}: {e:#}"));
        if params.contains(&("DateStyle", "ISO")) && params.len() == 1 {
            // What the case is about: PostgreSQL reports the normalized form.
            assert!(
                direct
                    .parameters()
                    .contains(&("DateStyle".to_string(), "ISO, MDY".to_string())),
                "{:?}",
                direct.parameters()
            );
        }
        let startup_direct = normalize(direct.startup_messages());
        let startup_proxied = normalize(proxied.startup_messages());
        if let Some(d) = diff(&startup_direct, &startup_proxied) {
            failures.push(format!("start-up messages with {params:?} ({label}): {d}"));
        }
        let shown_direct = run_script(direct, &show_settings()).await;
        let shown_proxied = run_script(proxied, &show_settings()).await;
        if let Some(d) = diff(&shown_direct, &shown_proxied) {
            failures.push(format!("settings with {params:?} ({label}): {d}"));
        }
    }
    failures
}

#[tokio::test]
async fn startup_parameters_match_postgres() {
    let tx = pgmemo(PoolMode::Transaction, 1).await;
    let session = pgmemo(PoolMode::Session, 1).await;
    let mut failures = check_startup_cases(tx.local_addr(), "transaction mode, pool_size 1").await;
    failures.extend(check_startup_cases(session.local_addr(), "session mode").await);
    tx.shutdown().await;
    session.shutdown().await;
    assert_no_failures(failures);
}

/// What a login ends with, normalized: the messages after authentication, or the error.
fn login_outcome(login: &Login) -> Vec<String> {
    let after_auth = login
        .messages
        .iter()
        .skip_while(|m| m.tag == b'R' || m.tag == b'v')
        .cloned()
        .collect::<Vec<_>>();
    normalize(&after_auth)
}

#[tokio::test]
async fn invalid_startup_parameters_are_refused_like_postgres() {
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let cases: &[&[(&str, &str)]] = &[
        &[("DateStyle", "bogus")],
        &[("TimeZone", "Mars/Olympus_Mons")],
        &[("no_such_setting", "1")],
        &[("options", "-c statement_timeout=soon")],
        &[("application_name", "fine"), ("IntervalStyle", "klingon")],
    ];
    let mut failures = Vec::new();
    for params in cases {
        let mut all = vec![("user", PGMEMO_USER), ("database", TEST_DB)];
        all.extend(params.iter().copied());
        let packet = startup_packet(protocol_version(3, 0), &all);
        let mut direct =
            RawClient::login(cluster().addr(), &packet, PGMEMO_USER, Some(PGMEMO_PASS))
                .await
                .expect("direct login attempt");
        let mut proxied =
            RawClient::login(proxy.local_addr(), &packet, PGMEMO_USER, Some(PGMEMO_PASS))
                .await
                .expect("login attempt through pgmemo");
        assert!(!direct.ready, "PostgreSQL accepted {params:?}");
        let (severity, _, _) = direct.expect_error();
        assert_eq!(severity, "FATAL", "{params:?}");
        if let Some(d) = diff(&login_outcome(&direct), &login_outcome(&proxied)) {
            failures.push(format!("login with {params:?}: {d}"));
        }
        // Both hang up after the FATAL.
        assert_eq!(direct.client.recv_until_closed().await.unwrap(), vec![]);
        let after = proxied.client.recv_until_closed().await.unwrap();
        assert!(
            after.is_empty(),
            "pgmemo sent more after the FATAL: {after:?}"
        );
    }
    // The failed attempts left the pool's only server usable.
    let mut client = RawClient::through(proxy.local_addr(), &[])
        .await
        .expect("login after the refused ones");
    let replies = query(&mut client, "SHOW DateStyle").await;
    assert!(
        replies.contains(&"DataRow [\"ISO, MDY\"]".to_string()),
        "{replies:?}"
    );
    proxy.shutdown().await;
    assert_no_failures(failures);
}

// ---------------------------------------------------------------------------------------------
// Settings that follow a client from server to server
// ---------------------------------------------------------------------------------------------

/// Sends one simple query and returns the normalized replies through ReadyForQuery.
async fn query(client: &mut RawClient, sql: &str) -> Vec<String> {
    client.send(&[Frontend::query(sql)]).await.unwrap();
    normalize(&client.recv_until_ready(1).await.unwrap())
}

/// Sends messages and returns the normalized replies through `ready` ReadyForQuery.
async fn exchange(client: &mut RawClient, msgs: &[Frontend], ready: usize) -> Vec<String> {
    client.send(msgs).await.unwrap();
    normalize(&client.recv_until_ready(ready).await.unwrap())
}

/// The backend pid serving a client's next transaction.
async fn backend_pid(client: &mut RawClient) -> i32 {
    client
        .send(&[Frontend::query("SELECT pg_backend_pid()")])
        .await
        .unwrap();
    let replies = client.recv_until_ready(1).await.unwrap();
    let row = replies.iter().find_map(|m| m.data_row()).expect("a row");
    let text = String::from_utf8(row[0].clone().expect("not null")).unwrap();
    text.parse().unwrap()
}

/// A client connected both directly and through pgmemo, doing the same things on both.
struct Twin {
    name: &'static str,
    direct: RawClient,
    proxied: RawClient,
}

impl Twin {
    async fn connect(name: &'static str, proxy: SocketAddr, params: &[(&str, &str)]) -> Twin {
        let direct = RawClient::direct(params).await.expect("direct login");
        let proxied = RawClient::through(proxy, params)
            .await
            .expect("login through pgmemo");
        let twin = Twin {
            name,
            direct,
            proxied,
        };
        twin.assert_same_startup();
        twin
    }

    fn assert_same_startup(&self) {
        let direct = normalize(self.direct.startup_messages());
        let proxied = normalize(self.proxied.startup_messages());
        if let Some(d) = diff(&direct, &proxied) {
            panic!("client {}: start-up messages differ: {d}", self.name);
        }
    }

    /// Sends `msgs` on both connections, reads through `ready` ReadyForQuery and asserts
    /// identical replies.
    async fn same(&mut self, msgs: &[Frontend], ready: usize) -> Vec<String> {
        let direct = exchange(&mut self.direct, msgs, ready).await;
        let proxied = exchange(&mut self.proxied, msgs, ready).await;
        if let Some(d) = diff(&direct, &proxied) {
            panic!("client {} after {msgs:?}: {d}", self.name);
        }
        proxied
    }

    async fn same_query(&mut self, sql: &str) -> Vec<String> {
        self.same(&[Frontend::query(sql)], 1).await
    }
}

#[tokio::test]
async fn clients_with_different_settings_share_one_server() {
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let addr = proxy.local_addr();
    let mut a = Twin::connect(
        "a",
        addr,
        &[
            ("application_name", "client_a"),
            ("DateStyle", "SQL, DMY"),
            ("TimeZone", "Asia/Tokyo"),
            ("search_path", "a_schema, public"),
            ("options", "-c statement_timeout=7s -c extra_float_digits=0"),
        ],
    )
    .await;
    let mut b = Twin::connect(
        "b",
        addr,
        &[
            ("application_name", "client_b"),
            ("DateStyle", "German"),
            ("TimeZone", "America/Sao_Paulo"),
            ("IntervalStyle", "postgres_verbose"),
            ("search_path", "b_schema"),
        ],
    )
    .await;
    // The test is only worth something if both really run on one server.
    let pid = backend_pid(&mut a.proxied).await;
    assert_eq!(
        backend_pid(&mut b.proxied).await,
        pid,
        "a pool of 1 has one server"
    );

    let extended = [
        Frontend::parse("", SHOW_SETTINGS, &[]),
        Frontend::bind("", "", &[]),
        Frontend::execute("", 0),
        Frontend::Sync,
    ];
    for round in 0..2 {
        for twin in [&mut a, &mut b] {
            let shown = twin.same_query(SHOW_SETTINGS).await;
            if round == 0 && twin.name == "a" {
                assert!(
                    shown.iter().any(|l| l.contains("\"Asia/Tokyo\"")),
                    "{shown:?}"
                );
            }
        }
        for twin in [&mut a, &mut b] {
            twin.same_query("BEGIN").await;
            twin.same_query(SHOW_SETTINGS).await;
            twin.same_query("COMMIT").await;
        }
        for twin in [&mut a, &mut b] {
            twin.same(&extended, 1).await;
        }
    }
    // Changes of reported parameters by SET are the clients' own from then on.
    let set_a = a.same_query("SET TimeZone = 'UTC'").await;
    assert!(
        set_a.contains(&"ParameterStatus TimeZone=\"UTC\"".to_string()),
        "{set_a:?}"
    );
    b.same_query("SET DateStyle = 'ISO, YMD'").await;
    b.same_query("SET application_name = 'client_b2'").await;
    for _ in 0..2 {
        a.same_query(SHOW_SETTINGS).await;
        b.same_query(SHOW_SETTINGS).await;
        b.same(&extended, 1).await;
        a.same(&extended, 1).await;
    }
    assert_eq!(backend_pid(&mut b.proxied).await, pid);
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_set_outside_a_transaction_follows_the_client_to_another_server() {
    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    let addr = proxy.local_addr();
    let mut a = Twin::connect("a", addr, &[("application_name", "mover")]).await;
    let mut b = Twin::connect("b", addr, &[("TimeZone", "Australia/Perth")]).await;

    let set = a.same_query("SET TimeZone = 'America/New_York'").await;
    assert!(set.contains(&"ParameterStatus TimeZone=\"America/New_York\"".to_string()));
    a.same_query("SET DateStyle = 'Postgres, DMY'").await;
    let first = backend_pid(&mut a.proxied).await;

    // b takes the server a used and keeps it in a transaction, so a must move.
    b.same_query("BEGIN").await;
    assert_eq!(
        backend_pid(&mut b.proxied).await,
        first,
        "the idle server is reused"
    );
    let second = backend_pid(&mut a.proxied).await;
    assert_ne!(first, second, "a must run on the other server now");

    // a's settings came along; b's server was set back to b's own.
    let probe = "SELECT current_setting('TimeZone') AS tz, current_setting('DateStyle') AS ds, \
                 current_setting('application_name') AS app, timestamptz '2024-01-02 03:04:05+00' AS ts";
    let moved = a.same_query(probe).await;
    assert!(
        moved.iter().any(|l| l.contains("America/New_York")),
        "{moved:?}"
    );
    b.same_query(probe).await;
    b.same_query("COMMIT").await;
    // And back: a on either server, b on either server, still their own.
    for _ in 0..2 {
        a.same_query(probe).await;
        b.same_query(probe).await;
    }
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Protocol version negotiation
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn protocol_version_negotiation_matches_postgres() {
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let cases: &[(i32, &[(&str, &str)])] = &[
        (protocol_version(3, 1), &[]),
        (protocol_version(3, 0), &[("_pq_.something", "on")]),
        (
            protocol_version(3, 7),
            &[
                ("_pq_.first", "1"),
                ("application_name", "negotiator"),
                ("_pq_.second", "2"),
            ],
        ),
    ];
    for (version, extra) in cases {
        let mut params = vec![("user", PGMEMO_USER), ("database", TEST_DB)];
        params.extend(extra.iter().copied());
        let packet = startup_packet(*version, &params);
        let mut direct =
            RawClient::login(cluster().addr(), &packet, PGMEMO_USER, Some(PGMEMO_PASS))
                .await
                .expect("direct login");
        let mut proxied =
            RawClient::login(proxy.local_addr(), &packet, PGMEMO_USER, Some(PGMEMO_PASS))
                .await
                .expect("login through pgmemo");
        let case = format!(
            "version {}.{} with {extra:?}",
            version >> 16,
            version & 0xffff
        );
        assert!(
            direct.ready && proxied.ready,
            "{case}: {:?}",
            proxied.messages
        );
        // Everything before the first authentication request is the negotiation.
        let before_auth = |login: &Login| {
            normalize(
                &login
                    .messages
                    .iter()
                    .take_while(|m| m.tag != b'R')
                    .cloned()
                    .collect::<Vec<_>>(),
            )
        };
        let mut negotiated = before_auth(&direct);
        if cluster().version_num() >= 180000 {
            // PostgreSQL 18 speaks protocol 3.2 and negotiates down to it; pgmemo speaks 3.0
            // to clients and negotiates down to that exactly as PostgreSQL 15-17 do: the
            // newest version it speaks, then the `_pq_.` options it did not recognize.
            let mut body = (3i32 << 16).to_be_bytes().to_vec();
            let options: Vec<&str> = extra
                .iter()
                .map(|(k, _)| *k)
                .filter(|k| k.starts_with("_pq_."))
                .collect();
            body.extend((options.len() as i32).to_be_bytes());
            for option in options {
                body.extend(option.as_bytes());
                body.push(0);
            }
            negotiated = normalize(&[Backend { tag: b'v', body }]);
        }
        assert_eq!(negotiated.len(), 1, "{case}: {negotiated:?}");
        assert!(
            negotiated[0].starts_with("NegotiateProtocolVersion"),
            "{negotiated:?}"
        );
        if let Some(d) = diff(&negotiated, &before_auth(&proxied)) {
            panic!("{case}: {d}");
        }
        let mut direct_outcome = login_outcome(&direct);
        if cluster().version_num() >= 180000 {
            // Protocol 3.2's cancel key is 32 bytes where 3.0's is 4: the direct client
            // negotiated 3.2, pgmemo's client 3.0.
            for line in &mut direct_outcome {
                if let Some(at) = line.find(" (trailing ") {
                    line.truncate(at);
                }
            }
        }
        if let Some(d) = diff(&direct_outcome, &login_outcome(&proxied)) {
            panic!("{case}: after authentication: {d}");
        }
        let direct_q = query(
            &mut direct.client,
            "SELECT current_setting('application_name')",
        )
        .await;
        let proxied_q = query(
            &mut proxied.client,
            "SELECT current_setting('application_name')",
        )
        .await;
        assert_same(&direct_q, &proxied_q);
    }
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Extended-protocol batches that are not finished when their replies are in
// ---------------------------------------------------------------------------------------------

/// The state pgmemo has for the client at `client`'s address.
fn client_state(proxy: &Pgmemo, client: &RawClient) -> ClientState {
    let addr = client.local_addr();
    proxy
        .app()
        .clients()
        .into_iter()
        .find(|c| c.addr == addr.into())
        .map(|c| c.state())
        .expect("pgmemo knows the client")
}

/// Creates a fresh regular table (visible to every session) with one int column.
async fn fresh_table(name: &str) {
    let mut admin = RawClient::direct(&[]).await.unwrap();
    let replies = query(
        &mut admin,
        &format!("DROP TABLE IF EXISTS {name}; CREATE TABLE {name} (a int)"),
    )
    .await;
    assert!(
        !replies.iter().any(|l| l.contains("ErrorResponse")),
        "{replies:?}"
    );
}

/// Counts the committed rows of a table, directly.
async fn committed_rows(table: &str) -> String {
    let mut direct = RawClient::direct(&[]).await.unwrap();
    direct
        .send(&[Frontend::query(&format!("SELECT count(*) FROM {table}"))])
        .await
        .unwrap();
    let replies = direct.recv_until_ready(1).await.unwrap();
    let row = replies.iter().find_map(|m| m.data_row()).expect("a row");
    String::from_utf8(row[0].clone().unwrap()).unwrap()
}

fn insert_and_flush(table: &str) -> Vec<Frontend> {
    vec![
        Frontend::parse("", &format!("INSERT INTO {table} VALUES ($1::int)"), &[]),
        Frontend::bind("", "", &[Some("1")]),
        Frontend::execute("", 0),
        Frontend::Flush,
    ]
}

/// Until its Sync, an extended batch is one implicit transaction on one server: all its
/// replies being in does not make the server free for another client.
#[tokio::test]
async fn an_unsynced_batch_keeps_its_server_until_sync() {
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let addr = proxy.local_addr();
    fresh_table("unsynced_commit_t").await;
    let mut a = RawClient::through(addr, &[]).await.unwrap();
    let mut b = RawClient::through(addr, &[]).await.unwrap();

    a.send(&insert_and_flush("unsynced_commit_t"))
        .await
        .unwrap();
    let replies = normalize(&a.recv_n(3).await.unwrap());
    assert_eq!(
        replies,
        [
            "ParseComplete",
            "BindComplete",
            "CommandComplete \"INSERT 0 1\""
        ]
    );
    assert_eq!(
        client_state(&proxy, &a),
        ClientState::Active,
        "the batch is not over before Sync: the client must keep its server"
    );
    // Another client's failing query must not run inside a's open batch (and abort it).
    b.send(&[Frontend::query("SELECT 1/0")]).await.unwrap();
    let synced = exchange(&mut a, &[Frontend::Sync], 1).await;
    assert_eq!(synced, ["ReadyForQuery I"]);
    let failed = normalize(&b.recv_until_ready(1).await.unwrap());
    assert!(
        failed.iter().any(|l| l.contains("C=\"22012\"")),
        "{failed:?}"
    );
    assert_eq!(
        committed_rows("unsynced_commit_t").await,
        "1",
        "a's Sync commits a's insert"
    );
    proxy.shutdown().await;
}

/// After an error PostgreSQL ignores everything up to the next Sync; a server in that state
/// must stay with the client that has to send the Sync.
#[tokio::test]
async fn an_error_before_sync_keeps_the_server_until_sync() {
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let addr = proxy.local_addr();
    let mut a = RawClient::through(addr, &[]).await.unwrap();
    let mut b = RawClient::through(addr, &[]).await.unwrap();

    a.send(&[Frontend::parse("", "SELEC 1", &[]), Frontend::Flush])
        .await
        .unwrap();
    let error = a.recv().await.unwrap();
    assert_eq!(error.field(b'C').as_deref(), Some("42601"), "{error}");
    assert_eq!(client_state(&proxy, &a), ClientState::Active);
    b.send(&[Frontend::query("SELECT 'b ran'")]).await.unwrap();
    let synced = exchange(&mut a, &[Frontend::Sync], 1).await;
    assert_eq!(synced, ["ReadyForQuery I"]);
    let ran = normalize(&b.recv_until_ready(1).await.unwrap());
    assert!(ran.contains(&"DataRow [\"b ran\"]".to_string()), "{ran:?}");
    // The same with pgmemo answering nothing locally: a Flush alone keeps the server too.
    a.send(&[Frontend::parse("", "SELEC 2", &[]), Frontend::Flush])
        .await
        .unwrap();
    a.recv().await.unwrap();
    a.send(&[Frontend::Flush]).await.unwrap();
    assert_eq!(
        exchange(
            &mut a,
            &[Frontend::query("SELECT 'ignored'"), Frontend::Sync],
            1
        )
        .await,
        ["ReadyForQuery I"]
    );
    assert_eq!(query(&mut b, "SELECT 2").await.len(), 4);
    proxy.shutdown().await;
}

/// A client that disconnects in the middle of a batch leaves nothing behind: its uncommitted
/// work is not committed by the next client, and the next client gets a clean server.
#[tokio::test]
async fn a_client_leaving_mid_batch_leaves_nothing_behind() {
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let addr = proxy.local_addr();
    fresh_table("unsynced_leave_t").await;

    // Leaving with an insert done but not synced: PostgreSQL would roll it back.
    let mut a = RawClient::through(addr, &[]).await.unwrap();
    a.send(&insert_and_flush("unsynced_leave_t")).await.unwrap();
    a.recv_n(3).await.unwrap();
    drop(a);
    let mut b = RawClient::through(addr, &[]).await.unwrap();
    let seen = query(&mut b, "SELECT count(*) FROM unsynced_leave_t").await;
    assert!(seen.contains(&"DataRow [\"0\"]".to_string()), "{seen:?}");
    assert_eq!(committed_rows("unsynced_leave_t").await, "0");

    // Leaving after an error, while PostgreSQL skips to the next Sync.
    let mut c = RawClient::through(addr, &[]).await.unwrap();
    c.send(&[Frontend::parse("", "SELEC 1", &[]), Frontend::Flush])
        .await
        .unwrap();
    c.recv().await.unwrap();
    drop(c);
    let ran = query(&mut b, "SELECT 'next client'").await;
    assert!(
        ran.contains(&"DataRow [\"next client\"]".to_string()),
        "{ran:?}"
    );
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// COPY that ends early while the other side is still streaming
// ---------------------------------------------------------------------------------------------

/// Where a COPY test writes: a temp table (which pins a client in transaction mode to its
/// server) or a regular one.
#[derive(Debug, Clone, Copy)]
enum CopyTable {
    Temp,
    Regular,
}

/// One line of COPY text: `n`, a tab, and 100 kB of `x`.
fn big_copy_row(n: usize) -> Frontend {
    let mut line = format!("{n}\t").into_bytes();
    line.resize(line.len() + 100_000, b'x');
    line.push(b'\n');
    Frontend::copy_data(&line)
}

/// COPY FROM STDIN whose third row breaks a NOT NULL constraint, from a client that streams
/// 100 kB rows and reads on the side, as pgx's CopyFrom does. PostgreSQL answers at once
/// (ErrorResponse, ReadyForQuery) and ignores the rest of the COPY's data; the client must see
/// that error while it is still sending, within a second. It sends 4 MB more, then CopyDone
/// (which PostgreSQL does not answer), then extended and simple queries that show the
/// connection is in step (a ParseComplete first: pgx's next query hung there). Returns the
/// transcript (the rows sent are not in it).
async fn copy_in_failing_while_sending(addr: SocketAddr, table: CopyTable) -> Vec<String> {
    let (name, create) = match table {
        CopyTable::Temp => ("copy_flood_temp", "CREATE TEMP TABLE"),
        CopyTable::Regular => ("copy_flood_t", "CREATE TABLE"),
    };
    let mut client = RawClient::through(addr, &[]).await.unwrap();
    if let CopyTable::Regular = table {
        // Left by the last run, or not: outside the transcript.
        query(&mut client, &format!("DROP TABLE IF EXISTS {name}")).await;
    }
    let mut transcript = query(
        &mut client,
        &format!("{create} {name} (a int, b text NOT NULL)"),
    )
    .await;
    let (mut reader, mut writer) = client.split();
    let (seen, mut error_seen) = tokio::sync::watch::channel(false);
    let reading = tokio::spawn(async move {
        let mut replies = Vec::new();
        loop {
            let msg = reader.recv().await.expect("the COPY's replies");
            let ready = msg.tag == b'Z';
            if msg.is_error() {
                seen.send_replace(true);
            }
            replies.push(msg);
            if ready {
                return (reader, replies);
            }
        }
    });
    let copy = format!("COPY {name} FROM STDIN");
    writer.send(&[Frontend::query(&copy)]).await.unwrap();
    for n in 1..=2 {
        writer.send(&[big_copy_row(n)]).await.unwrap();
    }
    writer
        .send(&[Frontend::copy_data(b"3\t\\N\n")])
        .await
        .unwrap();
    let bad_row_sent = std::time::Instant::now();
    // Rows go on until the error is there: 20 MB are far more than the sockets and pgmemo's
    // buffers hold, so PostgreSQL has read the bad row long before.
    let mut n = 4;
    while !*error_seen.borrow_and_update() {
        assert!(
            n < 200,
            "{addr} ({table:?}): no error while 20 MB were sent"
        );
        writer.send(&[big_copy_row(n)]).await.unwrap();
        n += 1;
    }
    let waited = bad_row_sent.elapsed();
    assert!(
        waited < std::time::Duration::from_secs(1),
        "{addr} ({table:?}): the error came {waited:?} after the bad row"
    );
    for _ in 0..40 {
        writer.send(&[big_copy_row(n)]).await.unwrap();
        n += 1;
    }
    writer.send(&[Frontend::CopyDone]).await.unwrap();
    let (reader, replies) = reading.await.expect("the reader");
    let mut client = reader.join(writer);
    transcript.push(format!(">> {copy}, 100 kB rows, CopyDone after the error"));
    transcript.extend(normalize(&replies));
    let counted = format!("SELECT count(*) FROM {name} WHERE a > $1");
    transcript.extend(
        exchange(
            &mut client,
            &[
                Frontend::parse("after_copy", &counted, &[]),
                Frontend::describe_statement("after_copy"),
                Frontend::Sync,
                Frontend::bind("", "after_copy", &[Some("0")]),
                Frontend::execute("", 0),
                Frontend::Sync,
            ],
            2,
        )
        .await,
    );
    transcript.extend(query(&mut client, &format!("SELECT count(*) FROM {name}")).await);
    transcript
}

/// An error during COPY FROM STDIN reaches a client that is still sending (pgx's
/// TestConnCopyFromFailServerSideMidwayAbortsWithoutWaiting, which hung through pgmemo), and
/// the rest of its data and its CopyDone get what PostgreSQL gives them: nothing. In
/// transaction mode pinned (a temp table) and not, and in session mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_error_reaches_a_client_still_sending_as_from_postgres() {
    let tables = [CopyTable::Temp, CopyTable::Regular];
    let mut direct = Vec::new();
    for table in tables {
        direct.push(copy_in_failing_while_sending(cluster().addr(), table).await);
    }
    assert!(
        direct[0].iter().any(|l| l.contains("C=\"23502\"")),
        "{:#?}",
        direct[0]
    );
    for mode in [PoolMode::Transaction, PoolMode::Session] {
        let proxy = pgmemo(mode, 2).await;
        for (table, direct) in tables.into_iter().zip(&direct) {
            let proxied = copy_in_failing_while_sending(proxy.local_addr(), table).await;
            if let Some(report) = diff(direct, &proxied) {
                panic!("{mode:?} mode, {table:?} table: {report}");
            }
        }
        proxy.shutdown().await;
    }
}

/// COPY TO STDOUT of endless rows, cancelled once a megabyte has arrived: PostgreSQL's 57014
/// comes while rows are still streaming, and the connection goes on. Returns the transcript
/// (the rows received are not in it).
async fn copy_out_cancelled(addr: SocketAddr) -> Vec<String> {
    let mut client = RawClient::through(addr, &[]).await.unwrap();
    let key = client.backend_key().expect("BackendKeyData");
    // (A set-returning function in FROM is materialized before its first row: in the select
    // list it streams.)
    let copy = "COPY (SELECT generate_series(1, 1000000000), repeat('x', 1000)) TO STDOUT";
    client.send(&[Frontend::query(copy)]).await.unwrap();
    let mut transcript = vec![format!(">> {copy}, cancelled after 1 MB")];
    let (mut received, mut cancelled) = (0, false);
    loop {
        let msg = client.recv().await.unwrap();
        if msg.tag != b'd' {
            transcript.extend(normalize(std::slice::from_ref(&msg)));
        }
        if msg.tag == b'Z' {
            break;
        }
        received += msg.body.len();
        if received > 1 << 20 && !cancelled {
            cancelled = true;
            cancel_request(addr, key).await.unwrap();
        }
    }
    transcript.extend(query(&mut client, "SELECT 'still in step'").await);
    transcript
}

/// A COPY TO STDOUT cancelled midway ends for the client as it does with PostgreSQL, in
/// transaction and in session mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_copy_out_ends_as_from_postgres() {
    let direct = copy_out_cancelled(cluster().addr()).await;
    assert!(
        direct.iter().any(|l| l.contains("C=\"57014\"")),
        "{direct:#?}"
    );
    for mode in [PoolMode::Transaction, PoolMode::Session] {
        let proxy = pgmemo(mode, 2).await;
        let proxied = copy_out_cancelled(proxy.local_addr()).await;
        if let Some(report) = diff(&direct, &proxied) {
            panic!("{mode:?} mode: {report}");
        }
        proxy.shutdown().await;
    }
}

/// What comes back for messages sent in one write with a Terminate after them: PostgreSQL
/// answers them, then reads the Terminate and closes (pgmemo closed at once: found by
/// tests/fuzz_protocol.rs). A batch left without its Sync gets what PostgreSQL flushed, which
/// is nothing.
async fn until_closed(addr: SocketAddr, msgs: &[Frontend]) -> Vec<String> {
    let mut client = RawClient::through(addr, &[]).await.unwrap();
    client.send(msgs).await.unwrap();
    let mut seen = vec![];
    while let Ok(msg) = client.recv().await {
        seen.push(msg.name().to_owned());
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_before_a_terminate_are_answered_as_by_postgres() {
    let scripts: Vec<Vec<Frontend>> = vec![
        vec![Frontend::query("SELECT 1"), Frontend::Terminate],
        vec![
            Frontend::query("SELECT 1; SELECT 2"),
            Frontend::query("SELECT 1/0"),
            Frontend::Terminate,
        ],
        vec![
            Frontend::parse("", "SELECT $1::int", &[]),
            Frontend::bind("", "", &[Some("7")]),
            Frontend::execute("", 0),
            Frontend::Sync,
            Frontend::Terminate,
        ],
        vec![
            Frontend::parse("", "SELECT 1", &[]),
            Frontend::bind("", "", &[]),
            Frontend::Terminate,
        ],
        vec![
            Frontend::query("BEGIN"),
            Frontend::query("SELECT 1"),
            Frontend::Terminate,
        ],
    ];
    let direct = cluster().addr();
    for (mode, size) in [
        (PoolMode::Transaction, 1),
        (PoolMode::Transaction, 2),
        (PoolMode::Session, 1),
    ] {
        let proxy = pgmemo(mode, size).await;
        for script in &scripts {
            assert_eq!(
                until_closed(proxy.local_addr(), script).await,
                until_closed(direct, script).await,
                "{mode:?}, pool {size}: {script:?}"
            );
        }
        proxy.shutdown().await;
    }
}

/// The first value of the first row `sql` returns, run directly.
async fn first_value(sql: &str) -> String {
    let mut direct = RawClient::direct(&[]).await.unwrap();
    direct.send(&[Frontend::query(sql)]).await.unwrap();
    let replies = direct.recv_until_ready(1).await.unwrap();
    let row = replies.iter().find_map(|m| m.data_row()).expect("a row");
    String::from_utf8(row[0].clone().unwrap()).unwrap()
}

/// A client that hangs up right after its Terminate while a statement of its still runs
/// (asyncpg's `terminate()` after a query that timed out): PostgreSQL runs the statement to its
/// end, then reads the Terminate, and the client's backend keeps nobody waiting meanwhile.
/// Through pgmemo with a pool of one, the next client is answered while the statement still
/// waits (for a lock the test holds), and the statement commits all the same once the lock is
/// let go, as directly. pgmemo kept the server until the statement ended, the Terminate
/// unread and the client's socket no longer watched: asyncpg's test suite left a
/// `pg_sleep(10)` so in test after test, and held a pool of two for minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_after_its_terminate_keeps_no_server() {
    use std::time::Duration;
    const TABLE: &str = "terminate_then_hang_up";
    let waiting = format!(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO {TABLE} %'"
    );
    for mode in [None, Some(PoolMode::Transaction), Some(PoolMode::Session)] {
        fresh_table(TABLE).await;
        let proxy = match mode {
            Some(mode) => Some(pgmemo(mode, 1).await),
            None => None,
        };
        let mut locker = RawClient::direct(&[]).await.unwrap();
        let locked = query(&mut locker, &format!("BEGIN; LOCK {TABLE} IN SHARE MODE")).await;
        assert!(
            !locked.iter().any(|l| l.contains("ErrorResponse")),
            "{locked:?}"
        );
        let addr = proxy.as_ref().map_or(cluster().addr(), |p| p.local_addr());
        let mut gone = RawClient::through(addr, &[]).await.unwrap();
        let insert = format!("INSERT INTO {TABLE} VALUES (1)");
        gone.send(&[Frontend::query(&insert), Frontend::Terminate])
            .await
            .unwrap();
        wait_until("the INSERT waiting", Duration::from_secs(10), || async {
            first_value(&waiting).await == "1"
        })
        .await;
        drop(gone);
        let mut next = RawClient::through(addr, &[]).await.unwrap();
        let replies = query(&mut next, "SELECT 1").await;
        assert!(
            replies.iter().any(|l| l.starts_with("DataRow")),
            "{mode:?}: {replies:?}"
        );
        assert_eq!(
            first_value(&waiting).await,
            "1",
            "{mode:?}: the next client was answered only once the INSERT ended"
        );
        query(&mut locker, "COMMIT").await;
        wait_until("the INSERT committed", Duration::from_secs(15), || async {
            committed_rows(TABLE).await == "1"
        })
        .await;
        if let Some(proxy) = proxy {
            proxy.shutdown().await;
        }
    }
}
