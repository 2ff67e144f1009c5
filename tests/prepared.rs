//! Prepared statements in transaction mode, compared with PostgreSQL.
//!
//! Every test runs one script of protocol messages three times: directly against PostgreSQL
//! (one connection per script client), and through pgmemo in transaction mode with a pool of
//! one and of two server connections. The transcripts must be identical (see
//! [`common::normalize`] for the few values that legitimately differ per connection).
//!
//! What makes these scripts hard for a pooler is that a client's next transaction may run on a
//! server that has never seen its statements. [`Act::Move`] forces that on the pgmemo side:
//!
//! - pool of two: a helper client opens a transaction (`BEGIN`) and so holds the server the
//!   script's last transaction used (the pool hands out its most recently returned server
//!   first); the script's next transaction must run on the other server. [`Act::Back`]
//!   commits, and the first server is free again.
//! - pool of one: the helper runs `DEALLOCATE ALL` through pgmemo, so the one server has lost
//!   every statement and the script's statements must be prepared again.
//!
//! On the direct side both are no-ops: the script runs on its one connection, as an
//! application would without a pooler. So any difference is pgmemo's. (Where pgmemo is meant
//! to do better than one PostgreSQL connection — a statement that recovers after DDL —
//! [`Act::DirectOnly`] gives the direct connection the same fresh statement first.)
//!
//! At the end, a property test generates random message sequences (Parse, Bind, Describe,
//! Execute, Close, Sync, Flush, bad SQL, unknown names) and checks the same equality while a
//! helper keeps moving the client between servers.

mod common;

use common::Frontend as F;
use common::*;
use pgmemo::config::{Config, PoolMode};
use pgmemo::Pgmemo;
use std::net::SocketAddr;

// ---------------------------------------------------------------------------------------------
// Scripts
// ---------------------------------------------------------------------------------------------

/// One step of a script. Client numbers index the script's clients (0 when there is one).
#[derive(Debug, Clone)]
enum Act {
    /// The client sends these messages in one write.
    Send(usize, Vec<F>),
    /// The client reads through this many ReadyForQuery.
    Expect(usize, usize),
    /// The client reads exactly this many messages (replies that end without ReadyForQuery).
    RecvN(usize, usize),
    /// pgmemo only: the next transaction runs where the client's statements are not prepared
    /// (see the module documentation). Only between transactions.
    Move,
    /// pgmemo only: undoes [`Act::Move`] (the helper's transaction ends).
    Back,
    /// Direct only, not recorded: the client sends these messages and reads through this many
    /// ReadyForQuery. For the few places where pgmemo is meant to do better than one
    /// PostgreSQL connection (a statement that recovers after DDL), this puts the direct
    /// connection into the state pgmemo promises.
    DirectOnly(usize, Vec<F>, usize),
    /// pgmemo only: every server connection has at most this many prepared statements
    /// (`pg_prepared_statements`, counted by a helper client on each server). Only between
    /// transactions.
    AtMost(i64),
}

/// A script and the tables it needs.
#[derive(Debug, Clone, Default)]
struct Script {
    clients: usize,
    /// Run directly before each run of the script (not recorded): creates the script's
    /// tables afresh, so each run starts from the same state.
    setup: Option<String>,
    acts: Vec<Act>,
}

impl Script {
    fn new() -> Script {
        Script {
            clients: 1,
            ..Script::default()
        }
    }

    fn clients(mut self, n: usize) -> Script {
        self.clients = n;
        self
    }

    fn setup(mut self, sql: &str) -> Script {
        self.setup = Some(sql.to_string());
        self
    }

    fn act(mut self, act: Act) -> Script {
        self.acts.push(act);
        self
    }

    /// Client `c` sends `msgs` and reads one ReadyForQuery per Sync and simple Query in them
    /// (right unless an error makes PostgreSQL skip a Query before a Sync).
    fn on(self, c: usize, msgs: Vec<F>) -> Script {
        let ready = msgs
            .iter()
            .filter(|m| matches!(m, F::Sync | F::Query(_)))
            .count();
        self.send(c, msgs).expect(c, ready)
    }

    /// [`Script::on`] for client 0.
    fn go(self, msgs: Vec<F>) -> Script {
        self.on(0, msgs)
    }

    fn send(self, c: usize, msgs: Vec<F>) -> Script {
        self.act(Act::Send(c, msgs))
    }

    fn expect(self, c: usize, ready: usize) -> Script {
        self.act(Act::Expect(c, ready))
    }

    fn recv(self, c: usize, n: usize) -> Script {
        self.act(Act::RecvN(c, n))
    }

    fn moved(self) -> Script {
        self.act(Act::Move)
    }

    fn back(self) -> Script {
        self.act(Act::Back)
    }

    fn direct_only(self, c: usize, msgs: Vec<F>, ready: usize) -> Script {
        self.act(Act::DirectOnly(c, msgs, ready))
    }

    fn at_most(self, n: i64) -> Script {
        self.act(Act::AtMost(n))
    }
}

// Message shorthands.

fn q(sql: &str) -> F {
    F::query(sql)
}

fn p(name: &str, sql: &str) -> F {
    F::parse(name, sql, &[])
}

/// Bind statement `name` into the unnamed portal with text parameters.
fn b(name: &str, params: &[&str]) -> F {
    let params: Vec<Option<&str>> = params.iter().map(|v| Some(*v)).collect();
    F::bind("", name, &params)
}

/// Bind statement `name` into `portal` with text parameters.
fn bp(portal: &str, name: &str, params: &[&str]) -> F {
    let params: Vec<Option<&str>> = params.iter().map(|v| Some(*v)).collect();
    F::bind(portal, name, &params)
}

/// Execute the unnamed portal, all rows.
fn e() -> F {
    F::execute("", 0)
}

fn ds(name: &str) -> F {
    F::describe_statement(name)
}

fn dp(name: &str) -> F {
    F::describe_portal(name)
}

fn cs(name: &str) -> F {
    F::close_statement(name)
}

use F::{Flush as H, Sync as S};

// ---------------------------------------------------------------------------------------------
// Running scripts
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Target {
    Direct,
    /// pgmemo at this address with this many servers.
    Pgmemo(SocketAddr, u32),
}

async fn connect(addr: SocketAddr) -> RawClient {
    RawClient::through(addr, &[])
        .await
        .unwrap_or_else(|e| panic!("connecting to {addr}: {e:#}"))
}

/// Sends one simple query and returns its replies; panics on a failed read.
async fn simple(client: &mut RawClient, sql: &str) -> Vec<Backend> {
    client.send(&[q(sql)]).await.expect("send");
    client
        .recv_until_ready(1)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e:#}"))
}

/// Runs SQL directly and insists that it worked.
async fn run_directly(sql: &str) {
    let mut admin = connect(cluster().addr()).await;
    let replies = simple(&mut admin, sql).await;
    assert!(!replies.iter().any(Backend::is_error), "{sql}: {replies:?}");
    let _ = admin.terminate().await;
}

/// The helper clients that move a script's client between servers and count statements.
struct Helpers {
    pool_size: u32,
    holder: RawClient,
    checker: RawClient,
    holding: bool,
}

impl Helpers {
    async fn connect(addr: SocketAddr, pool_size: u32) -> Helpers {
        Helpers {
            pool_size,
            holder: connect(addr).await,
            checker: connect(addr).await,
            holding: false,
        }
    }

    async fn move_client(&mut self) {
        assert!(!self.holding, "Move twice without Back");
        if self.pool_size == 1 {
            simple(&mut self.holder, "DEALLOCATE ALL").await;
        } else {
            let replies = simple(&mut self.holder, "BEGIN").await;
            assert_eq!(replies.last().and_then(Backend::ready_status), Some(b'T'));
            self.holding = true;
        }
    }

    async fn back(&mut self) {
        if self.holding {
            simple(&mut self.holder, "COMMIT").await;
            self.holding = false;
        }
    }

    /// The number of statements prepared on the server the checker's next query runs on,
    /// pgmemo's guard statement `pgmemo_s0` included (it lets pgmemo answer exactly in aborted
    /// transaction blocks; it must be what pgmemo means it to be).
    async fn count_here(&mut self) -> i64 {
        let replies = simple(
            &mut self.checker,
            "SELECT count(*), \
                    count(*) FILTER (WHERE name = 'pgmemo_s0' AND statement = 'SHOW server_version') \
                    = count(*) FILTER (WHERE name = 'pgmemo_s0') \
             FROM pg_prepared_statements",
        )
        .await;
        let row = replies
            .iter()
            .find_map(Backend::data_row)
            .unwrap_or_else(|| panic!("no count: {replies:?}"));
        assert_eq!(
            row[1].as_deref(),
            Some(&b"t"[..]),
            "a strange guard: {replies:?}"
        );
        String::from_utf8(row[0].clone().expect("a count"))
            .unwrap()
            .parse()
            .unwrap()
    }

    /// Statement counts of every server (with two, the holder keeps one busy while the
    /// checker counts on the other). The servers' order in the pool is as before.
    async fn counts(&mut self) -> Vec<i64> {
        assert!(!self.holding, "AtMost while a Move is in force");
        let mut counts = vec![self.count_here().await];
        if self.pool_size == 2 {
            simple(&mut self.holder, "BEGIN").await;
            counts.push(self.count_here().await);
            simple(&mut self.holder, "COMMIT").await;
        }
        counts
    }
}

/// A script's clients on one target, and the transcript so far.
struct Runner {
    target: Target,
    clients: Vec<RawClient>,
    /// The transaction status of each client's last ReadyForQuery.
    status: Vec<u8>,
    helpers: Option<Helpers>,
    out: Vec<String>,
    normalizer: Normalizer,
    /// A read or write failed (recorded): the run is over.
    broken: bool,
}

impl Runner {
    async fn connect(target: Target, clients: usize) -> Runner {
        let addr = match target {
            Target::Direct => cluster().addr(),
            Target::Pgmemo(addr, _) => addr,
        };
        let mut connected = Vec::new();
        for _ in 0..clients {
            connected.push(connect(addr).await);
        }
        let helpers = match target {
            Target::Direct => None,
            Target::Pgmemo(addr, pool_size) => Some(Helpers::connect(addr, pool_size).await),
        };
        Runner {
            target,
            status: vec![b'I'; clients],
            clients: connected,
            helpers,
            out: Vec::new(),
            normalizer: Normalizer::default(),
            broken: false,
        }
    }

    fn tag(&self, c: usize) -> String {
        if self.clients.len() > 1 {
            c.to_string()
        } else {
            String::new()
        }
    }

    /// Reads into the transcript until `ready` ReadyForQuery (or `count` messages) arrived.
    async fn read(&mut self, c: usize, ready: Option<usize>, count: Option<usize>) {
        let tag = self.tag(c);
        let (mut seen_ready, mut seen) = (0, 0);
        loop {
            if ready.is_some_and(|r| seen_ready >= r) || count.is_some_and(|n| seen >= n) {
                return;
            }
            match self.clients[c].recv().await {
                Ok(msg) => {
                    self.out
                        .push(format!("{tag}<< {}", self.normalizer.line(&msg)));
                    seen += 1;
                    if let Some(status) = msg.ready_status() {
                        seen_ready += 1;
                        self.status[c] = status;
                    }
                }
                Err(e) => {
                    self.out.push(format!("{tag}!! {e:#}"));
                    self.broken = true;
                    return;
                }
            }
        }
    }

    /// Every client is between transactions.
    fn all_idle(&self) -> bool {
        self.status.iter().all(|&s| s == b'I')
    }

    async fn act(&mut self, act: &Act) {
        if self.broken {
            return;
        }
        match act {
            Act::Send(c, msgs) => {
                let tag = self.tag(*c);
                self.out.extend(msgs.iter().map(|m| format!("{tag}>> {m}")));
                if self.clients[*c].send(msgs).await.is_err() {
                    self.out.push(format!("{tag}!! send failed"));
                    self.broken = true;
                }
            }
            Act::Expect(c, n) => self.read(*c, Some(*n), None).await,
            Act::RecvN(c, n) => self.read(*c, None, Some(*n)).await,
            Act::Move => {
                self.out.push("~~ move".into());
                let idle = self.all_idle();
                if let Some(h) = self.helpers.as_mut() {
                    assert!(idle, "Move in the middle of a transaction");
                    h.move_client().await;
                }
            }
            Act::Back => {
                self.out.push("~~ back".into());
                if let Some(h) = self.helpers.as_mut() {
                    h.back().await;
                }
            }
            Act::DirectOnly(c, msgs, ready) => {
                if matches!(self.target, Target::Direct) {
                    let client = &mut self.clients[*c];
                    client.send(msgs).await.expect("send");
                    let replies = client.recv_until_ready(*ready).await.expect("recv");
                    assert!(
                        !replies.iter().any(Backend::is_error),
                        "direct-only step {msgs:?}: {replies:?}"
                    );
                }
            }
            Act::AtMost(n) => {
                if let Some(h) = self.helpers.as_mut() {
                    let counts = h.counts().await;
                    assert!(
                        counts.iter().all(|c| c <= n),
                        "{:?}: statements per server {counts:?}, limit {n}; so far:\n{}",
                        self.target,
                        self.out.join("\n")
                    );
                }
            }
        }
    }

    /// Terminates every client and returns the transcript.
    async fn finish(mut self) -> Vec<String> {
        if !self.broken {
            for c in 0..self.clients.len() {
                let tag = self.tag(c);
                let client = &mut self.clients[c];
                if client.send(&[F::Terminate]).await.is_ok() {
                    // Anything but the connection closing is a difference worth seeing.
                    if let Ok(rest) = client.recv_until_closed().await {
                        for m in rest {
                            self.out
                                .push(format!("{tag}<< {}", self.normalizer.line(&m)));
                        }
                    }
                }
            }
        }
        if let Some(h) = self.helpers.as_mut() {
            h.back().await;
        }
        self.out
    }
}

/// Runs the script against one target and returns the transcript.
async fn run(script: &Script, target: Target) -> Vec<String> {
    if let Some(sql) = &script.setup {
        run_directly(sql).await;
    }
    let mut runner = Runner::connect(target, script.clients).await;
    for act in &script.acts {
        runner.act(act).await;
    }
    runner.finish().await
}

/// pgmemo in transaction mode with `pool_size` servers, the config adjusted by `tune`.
async fn start(pool_size: u32, tune: fn(&mut Config)) -> Pgmemo {
    let mut config = test_config(PoolMode::Transaction, pool_size);
    tune(&mut config);
    start_pgmemo(config).await
}

fn defaults(_: &mut Config) {}

/// Runs the script directly and through pgmemo with one and two servers; the transcripts
/// must be identical. Returns the direct transcript.
async fn check_with(script: Script, tune: fn(&mut Config)) -> Vec<String> {
    let direct = run(&script, Target::Direct).await;
    for pool_size in [1, 2] {
        let proxy = start(pool_size, tune).await;
        let proxied = run(&script, Target::Pgmemo(proxy.local_addr(), pool_size)).await;
        proxy.shutdown().await;
        if let Some(d) = diff(&direct, &proxied) {
            if std::env::var_os("PREPARED_FULL").is_some() {
                eprintln!(
                    "direct:\n{}\n\nproxied:\n{}",
                    direct.join("\n"),
                    proxied.join("\n")
                );
            }
            panic!("through pgmemo with pool_size {pool_size}: {d}");
        }
    }
    direct
}

async fn check(script: Script) -> Vec<String> {
    check_with(script, defaults).await
}

/// The transcript lines received in reply to the `n`-th send (0-based) of client `tag`.
fn replies_to(transcript: &[String], n: usize) -> Vec<String> {
    let mut sends = 0;
    let mut in_send = false;
    let mut out = Vec::new();
    for line in transcript {
        if line.contains(">> ") {
            if !in_send {
                sends += 1;
                in_send = true;
            }
        } else {
            in_send = false;
            if sends == n + 1 {
                out.push(line.clone());
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The harness itself
// ---------------------------------------------------------------------------------------------

/// The backend pid serving a client's next transaction.
async fn backend_pid(client: &mut RawClient) -> i32 {
    let replies = simple(client, "SELECT pg_backend_pid()").await;
    let row = replies.iter().find_map(Backend::data_row).expect("a row");
    String::from_utf8(row[0].clone().expect("not null"))
        .unwrap()
        .parse()
        .unwrap()
}

/// Act::Move really does put the next transaction on the other server (pool of two).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn move_puts_the_next_transaction_on_the_other_server() {
    let proxy = start(2, defaults).await;
    let addr = proxy.local_addr();
    let mut client = connect(addr).await;
    let mut helpers = Helpers::connect(addr, 2).await;
    let first = backend_pid(&mut client).await;
    helpers.move_client().await;
    let second = backend_pid(&mut client).await;
    assert_ne!(first, second, "Move did not move the client");
    helpers.back().await;
    assert_eq!(
        backend_pid(&mut client).await,
        first,
        "Back did not go back"
    );
    helpers.move_client().await;
    assert_eq!(backend_pid(&mut client).await, second);
    helpers.back().await;
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Statements that follow their client to another server
// ---------------------------------------------------------------------------------------------

/// Statements prepared in one transaction are used in the next on a server that has never
/// seen them: pgmemo prepares them there first, invisibly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_reparse_on_a_new_server() {
    check(
        Script::new()
            .go(vec![
                p("s1", "SELECT $1::int + 1 AS next"),
                p("s2", "SELECT 'two'::text AS t"),
                S,
            ])
            .go(vec![b("s1", &["41"]), e(), S])
            .moved()
            .go(vec![b("s1", &["1"]), e(), b("s2", &[]), e(), S])
            .go(vec![ds("s1"), b("s2", &[]), dp(""), e(), S])
            .back()
            .go(vec![b("s1", &["2"]), e(), S])
            .moved()
            // The server's error names the statement as the client does.
            .go(vec![b("s1", &[]), e(), S])
            .go(vec![b("s1", &["3"]), e(), S])
            .back()
            .moved()
            // Inside a transaction block, too.
            .go(vec![q("BEGIN")])
            .go(vec![b("s2", &[]), e(), b("s1", &["4"]), e(), S])
            .go(vec![q("COMMIT")])
            .back(),
    )
    .await;
}

/// A Describe of a statement is the first use on a new server, alone or before a Flush.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_describe_on_a_new_server() {
    check(
        Script::new()
            .go(vec![p("d1", "SELECT $1::int AS a, $2::text AS b"), S])
            .moved()
            .go(vec![ds("d1"), S])
            .back()
            .moved()
            .send(0, vec![ds("d1"), H])
            .recv(0, 2)
            .go(vec![S])
            .back()
            .moved()
            .go(vec![q("BEGIN")])
            .go(vec![ds("d1"), S])
            .go(vec![q("COMMIT")])
            .back(),
    )
    .await;
}

/// The unnamed statement outlives its transaction as in PostgreSQL, and is dropped where
/// PostgreSQL drops it: by the next unnamed Parse (even a failing one) and by any simple
/// query.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unnamed_statement_across_transactions() {
    check(
        Script::new()
            .go(vec![p("", "SELECT $1::int * 2 AS doubled"), ds(""), S])
            .moved()
            .go(vec![b("", &["21"]), e(), S])
            .back()
            .moved()
            .send(0, vec![p("", "SELECT 'second'::text AS s"), ds(""), H])
            .recv(0, 3)
            .go(vec![S])
            .back()
            .go(vec![b("", &[]), e(), S])
            // A simple query drops the unnamed statement.
            .go(vec![q("SELECT 1")])
            .go(vec![b("", &[]), e(), S])
            .go(vec![p("", "SELECT 3 AS three"), S])
            // So does an unnamed Parse that fails.
            .go(vec![p("", "SELEC 4"), S])
            .go(vec![b("", &[]), e(), S])
            .go(vec![ds(""), S])
            .go(vec![
                p("", "SELECT 5 AS five"),
                b("", &[]),
                e(),
                p("", "SELECT 5 AS five"),
                b("", &[]),
                e(),
                S,
            ])
            .moved()
            .go(vec![b("", &[]), e(), S])
            .back(),
    )
    .await;
}

/// Parse/Describe/Flush, then Bind/Execute/Sync: the batch stays on its server until Sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parse_describe_flush_then_bind_execute_sync() {
    check(
        Script::new()
            .send(0, vec![p("h1", "SELECT $1::text AS echo"), ds("h1"), H])
            .recv(0, 3)
            .go(vec![b("h1", &["x"]), e(), S])
            .moved()
            .send(0, vec![p("h2", "SELECT 2 AS two"), ds("h1"), ds("h2"), H])
            .recv(0, 5)
            .go(vec![b("h2", &[]), e(), b("h1", &["y"]), e(), S])
            .back()
            .moved()
            .send(0, vec![p("", "SELECT 3 AS three"), ds(""), H])
            .recv(0, 3)
            .send(0, vec![b("", &[]), e(), H])
            .recv(0, 3)
            .go(vec![S])
            .back(),
    )
    .await;
}

/// A Parse pgmemo answers itself (the statement is known) followed by Flush: its
/// ParseComplete arrives at once, also when it waits behind replies the server owes (pgmemo
/// holds its own replies back only until the server's come).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locally_answered_parse_then_flush() {
    check(
        Script::new()
            .go(vec![p("f1", "SELECT 1 AS one"), S])
            .moved()
            .send(0, vec![p("f2", "SELECT 1 AS one"), H])
            .recv(0, 1)
            .send(0, vec![b("f2", &[]), e(), H])
            .recv(0, 3)
            .send(0, vec![b("f1", &[]), e(), p("f3", "SELECT 1 AS one"), H])
            .recv(0, 4)
            .go(vec![S])
            .back(),
    )
    .await;
}

/// Two clients sharing one server: the same name with different SQL, the same SQL under
/// different names, interleaved pipelines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_same_names_and_same_sql() {
    check(
        Script::new()
            .clients(2)
            .on(
                0,
                vec![
                    p("s", "SELECT 'client 0' AS who"),
                    p("mine0", "SELECT 42 AS answer"),
                    S,
                ],
            )
            .on(
                1,
                vec![
                    p("s", "SELECT 'client 1' AS who, 1 AS extra"),
                    p("mine1", "SELECT 42 AS answer"),
                    S,
                ],
            )
            .on(0, vec![b("s", &[]), e(), b("mine0", &[]), e(), S])
            .on(1, vec![b("s", &[]), e(), b("mine1", &[]), e(), S])
            // Both pipelines in flight at once.
            .send(0, vec![b("s", &[]), ds("s"), e(), S])
            .send(1, vec![b("s", &[]), ds("s"), e(), S])
            .expect(1, 1)
            .expect(0, 1)
            .moved()
            .on(1, vec![b("mine0", &[]), e(), S])
            .on(1, vec![cs("s"), S])
            .on(0, vec![b("s", &[]), e(), S])
            .on(1, vec![b("s", &[]), e(), S])
            .back()
            // Client 1 takes the name client 0 uses, for the same SQL.
            .on(
                1,
                vec![p("mine0", "SELECT 42 AS answer"), b("mine0", &[]), e(), S],
            )
            .on(1, vec![cs("mine1"), b("mine1", &[]), S])
            .on(0, vec![b("mine0", &[]), e(), b("mine1", &[]), S])
            .on(0, vec![p("s", "SELECT 'client 0' AS who"), S])
            .on(
                1,
                vec![
                    p("s", "SELECT 'client 1 again' AS who"),
                    b("s", &[]),
                    e(),
                    S,
                ],
            ),
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// Errors, exactly as PostgreSQL gives them
// ---------------------------------------------------------------------------------------------

/// A Parse that fails (42P01) registers nothing; once the table exists, the same name works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_parse_then_create_table() {
    check(
        Script::new()
            .setup("DROP TABLE IF EXISTS prep_late_t")
            .go(vec![p("late", "SELECT a FROM prep_late_t"), S])
            .go(vec![b("late", &[]), e(), S])
            .go(vec![q(
                "CREATE TABLE prep_late_t (a int); INSERT INTO prep_late_t VALUES (7)",
            )])
            .go(vec![
                p("late", "SELECT a FROM prep_late_t"),
                b("late", &[]),
                e(),
                S,
            ])
            .moved()
            .go(vec![b("late", &[]), e(), S])
            .back()
            .go(vec![q("DROP TABLE prep_late_t")]),
    )
    .await;
}

/// A second Parse of a name gets 42P05 — after PostgreSQL's own checks of the query.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_named_parse() {
    check(
        Script::new()
            .clients(2)
            .go(vec![p("dup", "SELECT 1 AS one"), S])
            .go(vec![p("dup", "SELECT 1 AS one"), S])
            .go(vec![p("dup", "SELECT 2 AS two"), b("dup", &[]), e(), S])
            .go(vec![p("dup", "SELEC 1"), S])
            .go(vec![p("dup", "SELECT * FROM prep_no_such_t"), S])
            .moved()
            .go(vec![p("dup", "SELECT 1 AS one"), S])
            .back()
            .go(vec![
                p("dup2", "SELECT 3"),
                p("dup2", "SELECT 3"),
                b("dup2", &[]),
                e(),
                S,
            ])
            .go(vec![b("dup2", &[]), e(), b("dup", &[]), e(), S])
            .go(vec![q("BEGIN")])
            .go(vec![p("dup", "SELECT 1 AS one"), S])
            .go(vec![q("ROLLBACK")])
            .go(vec![b("dup", &[]), e(), S])
            // The error arrives before the Sync is sent: pgmemo must still clean up after
            // it, so that no other client (here with a SQL-level DEALLOCATE on the same
            // server) ever sees the client's name on the server.
            .send(0, vec![p("dup", "SELECT 1 AS one"), H])
            .recv(0, 1)
            .go(vec![S])
            .on(1, vec![q("DEALLOCATE dup")])
            .on(1, vec![q("EXECUTE dup")]),
    )
    .await;
}

/// Bind and Describe of names the client does not have; Close of unknown names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_names() {
    check(
        Script::new()
            .go(vec![b("nope", &[]), e(), S])
            .go(vec![ds("nope"), S])
            .go(vec![dp("nope"), S])
            .go(vec![b("", &[]), e(), S])
            .go(vec![ds(""), S])
            .go(vec![
                p("known", "SELECT 1 AS k"),
                b("known", &[]),
                e(),
                b("nope", &[]),
                e(),
                S,
            ])
            .go(vec![q("BEGIN")])
            .go(vec![b("nope", &[]), e(), S])
            .go(vec![q("ROLLBACK")])
            // pgmemo's own server names mean nothing to a client.
            .go(vec![b("pgmemo_s1", &[]), e(), S])
            .go(vec![ds("pgmemo_s2"), S])
            .go(vec![
                p("pgmemo_s1", "SELECT 'mine' AS m"),
                b("pgmemo_s1", &[]),
                e(),
                S,
            ])
            .moved()
            .go(vec![b("pgmemo_s1", &[]), e(), S])
            .go(vec![p("pgmemo_s1", "SELECT 'mine' AS m"), S])
            .back()
            .go(vec![cs("nope"), F::close_portal("nope"), cs(""), S]),
    )
    .await;
}

/// P(bad)/B/E/P(cached)/B/E/S: PostgreSQL answers exactly ErrorResponse, ReadyForQuery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_parse_before_a_cached_one() {
    let pipeline = |bad: &str, cached: &str| {
        vec![
            p(bad, "SELEC bad"),
            b(bad, &[]),
            e(),
            p(cached, "SELECT 1 AS c"),
            b(cached, &[]),
            e(),
            S,
        ]
    };
    let direct = check(
        Script::new()
            .go(vec![p("cached", "SELECT 1 AS c"), S])
            .go(pipeline("", "cached2"))
            .go(vec![b("cached2", &[]), e(), S])
            .moved()
            .go(pipeline("bad", "cached3"))
            .go(vec![b("cached3", &[]), ds("bad"), S])
            .back()
            .go(pipeline("", "")),
    )
    .await;
    let names = |lines: Vec<String>| -> Vec<String> {
        lines
            .iter()
            .map(|l| l.split_whitespace().nth(1).unwrap_or("").to_string())
            .collect()
    };
    assert_eq!(
        names(replies_to(&direct, 1)),
        ["ErrorResponse", "ReadyForQuery"]
    );
}

/// A statement whose table was dropped: the Parse pgmemo injects on a new server fails as
/// the Bind fails on the old one; after the table is created again, both work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_parse_fails_after_drop_table() {
    check(
        Script::new()
            .setup(
                "DROP TABLE IF EXISTS prep_drop_t; CREATE TABLE prep_drop_t (a int); \
                 INSERT INTO prep_drop_t VALUES (1)",
            )
            .go(vec![
                p("sel", "SELECT a FROM prep_drop_t"),
                b("sel", &[]),
                e(),
                S,
            ])
            .go(vec![q("DROP TABLE prep_drop_t")])
            .moved()
            .go(vec![b("sel", &[]), e(), S])
            .back()
            .go(vec![b("sel", &[]), e(), S])
            .go(vec![q(
                "CREATE TABLE prep_drop_t (a int); INSERT INTO prep_drop_t VALUES (2)",
            )])
            .moved()
            .go(vec![b("sel", &[]), e(), S])
            .back()
            .go(vec![b("sel", &[]), e(), S])
            .go(vec![q("DROP TABLE prep_drop_t")]),
    )
    .await;
}

/// In an aborted transaction block, a Bind that needs its statement prepared first gets
/// 25P02, and the statement is still prepared properly once the block is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_transaction_then_bind_needing_a_parse() {
    check(
        Script::new()
            .go(vec![
                p("t1", "SELECT 1 AS one"),
                p("t2", "SELECT 2 AS two"),
                p("t4", "SELECT $1::int AS four"),
                S,
            ])
            .moved()
            .go(vec![q("BEGIN")])
            .go(vec![q("SELECT 1/0")])
            .go(vec![b("t1", &[]), e(), S])
            .go(vec![ds("t2"), S])
            // PostgreSQL checks the parameter count first.
            .go(vec![b("t1", &["1"]), e(), S])
            .go(vec![b("t4", &[]), S])
            .go(vec![b("t4", &["4"]), S])
            .go(vec![p("t3", "SELECT 3 AS three"), S])
            .go(vec![q("ROLLBACK")])
            .go(vec![b("t1", &[]), e(), b("t2", &[]), e(), b("t3", &[]), S])
            .back()
            .go(vec![b("t1", &[]), e(), b("t2", &[]), e(), S]),
    )
    .await;
}

/// Close of unknown names is fine; a name closed can be parsed again in the same pipeline;
/// a Close that an error discards did not happen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_and_reuse_in_one_pipeline() {
    check(
        Script::new()
            .go(vec![cs("never"), cs(""), S])
            .go(vec![
                p("r", "SELECT 1 AS first"),
                b("r", &[]),
                e(),
                cs("r"),
                p("r", "SELECT 2 AS second"),
                b("r", &[]),
                e(),
                S,
            ])
            .go(vec![b("r", &[]), e(), S])
            .moved()
            .go(vec![
                b("r", &[]),
                e(),
                cs("r"),
                cs("r"),
                p("r", "SELECT 3 AS third"),
                ds("r"),
                S,
            ])
            .back()
            .go(vec![b("r", &[]), e(), S])
            // Close and Parse run, then the Bind fails: the new statement stays.
            .go(vec![
                cs("r"),
                p("r", "SELECT 4 AS fourth"),
                b("r", &["extra"]),
                e(),
                S,
            ])
            .go(vec![b("r", &[]), e(), S])
            // The Execute fails: the Close after it never ran.
            .go(vec![
                p("x", "SELECT 1/0 AS boom"),
                b("x", &[]),
                e(),
                cs("x"),
                S,
            ])
            .go(vec![ds("x"), S])
            .moved()
            .go(vec![b("x", &[]), e(), cs("x"), cs("r"), S])
            .back()
            .go(vec![ds("x"), ds("r"), S]),
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// Eviction
// ---------------------------------------------------------------------------------------------

fn limit_one(config: &mut Config) {
    config.general.max_prepared_statements = 1;
}

/// With room for one statement per server, five statements take turns; each server never
/// holds more than one, also when a pipeline that evicts fails halfway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_with_a_limit_of_one() {
    let names = ["e1", "e2", "e3", "e4", "e5"];
    let mut parse: Vec<F> = names
        .iter()
        .enumerate()
        .map(|(i, n)| p(n, &format!("SELECT {} AS n", i + 1)))
        .collect();
    parse.push(p("f", "SELECT 1 / $1::int AS boom"));
    parse.push(S);
    let mut all: Vec<F> = names.iter().flat_map(|n| [b(n, &[]), e()]).collect();
    all.push(S);
    check_with(
        Script::new()
            .go(parse)
            .at_most(1)
            .go(all.clone())
            .at_most(1)
            .moved()
            .go(vec![b("e5", &[]), e(), b("e1", &[]), e(), S])
            .back()
            .at_most(1)
            .go(vec![b("e1", &[]), e(), b("e1", &[]), e(), ds("e2"), S])
            .at_most(1)
            // The statement evicted for f is closed, f prepared, then f fails: what comes
            // after never runs, including the eviction of f for e2.
            .go(vec![
                b("e1", &[]),
                e(),
                b("f", &["0"]),
                e(),
                b("e2", &[]),
                e(),
                S,
            ])
            .at_most(1)
            .go(vec![b("e2", &[]), e(), b("f", &["1"]), e(), S])
            .at_most(1)
            // The error comes before any eviction.
            .go(vec![b("f", &["0"]), e(), b("e3", &[]), e(), S])
            .go(vec![b("e3", &[]), e(), S])
            .at_most(1)
            .moved()
            // (No Bind in the aborted block: with room for one statement, pgmemo keeps no guard
            // statement, and a Bind there of a statement the server lacks gets its 25P02 from
            // the Parse pgmemo injects, with that routine's name and line: see GUARD_NAME.)
            .go(vec![q("BEGIN")])
            .go(all.clone())
            .go(vec![b("f", &["0"]), e(), S])
            .go(vec![q("ROLLBACK")])
            .back()
            .at_most(1)
            .go(all)
            .at_most(1),
        limit_one,
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// SQL-level statement commands
// ---------------------------------------------------------------------------------------------

/// DEALLOCATE name, DEALLOCATE ALL and DISCARD ALL drop protocol-level statements, also
/// when pipelined before a Parse of the same name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deallocate_and_discard() {
    check(
        Script::new()
            .go(vec![p("a1", "SELECT 1 AS a"), p("a2", "SELECT 2 AS b"), S])
            .go(vec![q("DEALLOCATE a1")])
            .go(vec![b("a1", &[]), e(), S])
            .go(vec![b("a2", &[]), e(), S])
            .go(vec![q("DEALLOCATE a1")])
            .go(vec![q("DEALLOCATE ALL")])
            .go(vec![b("a2", &[]), e(), S])
            .go(vec![p("a2", "SELECT 2 AS b"), b("a2", &[]), e(), S])
            .moved()
            .go(vec![q("DISCARD ALL")])
            .go(vec![b("a2", &[]), e(), S])
            .back()
            // Pipelined before a Parse of the same name.
            .go(vec![p("a3", "SELECT 3 AS c"), S])
            .go(vec![
                q("DEALLOCATE a3"),
                p("a3", "SELECT 33 AS c"),
                b("a3", &[]),
                e(),
                S,
            ])
            .go(vec![
                q("DEALLOCATE ALL"),
                p("a3", "SELECT 333 AS c"),
                b("a3", &[]),
                e(),
                S,
            ])
            .go(vec![
                q("DISCARD ALL"),
                p("a3", "SELECT 3333 AS c"),
                b("a3", &[]),
                e(),
                S,
            ])
            .moved()
            .go(vec![
                q("DEALLOCATE PREPARE a3"),
                p("a3", "SELECT 3 AS c"),
                ds("a3"),
                S,
            ])
            .back()
            // In a transaction block DEALLOCATE is not undone by ROLLBACK; DISCARD ALL is
            // refused.
            .go(vec![q("BEGIN")])
            .go(vec![q("DEALLOCATE a3")])
            .go(vec![q("ROLLBACK")])
            .go(vec![b("a3", &[]), e(), S])
            .go(vec![p("a3", "SELECT 3 AS c"), S])
            .go(vec![q("BEGIN")])
            .go(vec![q("DISCARD ALL")])
            .go(vec![q("ROLLBACK")])
            .go(vec![b("a3", &[]), e(), S])
            // In an aborted block DEALLOCATE fails and drops nothing.
            .go(vec![q("BEGIN")])
            .go(vec![q("SELECT 1/0")])
            .go(vec![q("DEALLOCATE a3")])
            .go(vec![q("ROLLBACK")])
            .go(vec![b("a3", &[]), e(), S])
            // An error earlier in the pipeline: the DEALLOCATE is discarded with the rest.
            .send(
                0,
                vec![b("nope", &[]), q("DEALLOCATE a3"), p("a3", "SELECT 4"), S],
            )
            .expect(0, 1)
            .go(vec![b("a3", &[]), e(), S])
            // Quoted names.
            .go(vec![p("MiXed", "SELECT 'm' AS m"), S])
            .go(vec![q("DEALLOCATE mixed")])
            .go(vec![q("DEALLOCATE \"MiXed\"")])
            .go(vec![b("MiXed", &[]), e(), S])
            // Several statements in one query.
            .go(vec![p("a4", "SELECT 4 AS d"), S])
            .go(vec![q("SELECT 1; DEALLOCATE a4")])
            .go(vec![b("a4", &[]), e(), S]),
    )
    .await;
}

/// `DISCARD ALL` and `DEALLOCATE ALL` through Parse/Bind/Execute (psycopg sends them so): the
/// client's named statements (and SQL-level ones) are gone, the unnamed one stays, the same
/// names can be parsed again, also later in the same pipeline; an error before the Execute
/// leaves everything as it was, one after it does not; PostgreSQL refuses DISCARD ALL in a
/// transaction block and after another Execute of the same pipeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extended_discard_all_and_deallocate_all() {
    check(
        Script::new()
            .go(vec![
                p("a1", "SELECT 1 AS a"),
                p("a2", "SELECT 2 AS b"),
                p("", "SELECT 0 AS z"),
                S,
            ])
            .go(vec![p("d", "DISCARD ALL"), b("d", &[]), dp(""), e(), S])
            .go(vec![b("a1", &[]), e(), S])
            .go(vec![b("d", &[]), e(), S])
            .go(vec![b("", &[]), e(), S])
            .go(vec![
                p("a1", "SELECT 11 AS a"),
                b("a1", &[]),
                e(),
                p("d", "DISCARD ALL"),
                S,
            ])
            .moved()
            .go(vec![b("a1", &[]), e(), S])
            .back()
            // Not after another Execute of the same pipeline (25001).
            .go(vec![
                b("a1", &[]),
                e(),
                b("d", &[]),
                e(),
                p("a1", "SELECT 12"),
                S,
            ])
            .go(vec![b("a1", &[]), e(), S])
            // First in its pipeline, with the same names parsed again after it.
            .go(vec![
                b("d", &[]),
                e(),
                p("a1", "SELECT 13 AS a"),
                p("d", "DISCARD ALL"),
                b("a1", &[]),
                e(),
                S,
            ])
            .moved()
            .go(vec![b("a1", &[]), e(), b("a1", &[]), e(), S])
            .back()
            // An error after it: it ran all the same.
            .go(vec![p("a2", "SELECT 2 AS b"), S])
            .go(vec![b("d", &[]), e(), b("nope", &[]), e(), S])
            .go(vec![b("a2", &[]), e(), S])
            .go(vec![b("d", &[]), e(), S])
            // An error before it: nothing happened.
            .go(vec![p("d", "DISCARD ALL"), p("a2", "SELECT 2 AS b"), S])
            .go(vec![
                b("nope", &[]),
                b("d", &[]),
                e(),
                p("a2", "SELECT 22"),
                S,
            ])
            .go(vec![b("a2", &[]), e(), S])
            .moved()
            .go(vec![b("a2", &[]), e(), S])
            .back()
            // In a transaction block: refused (25001), nothing dropped.
            .go(vec![q("BEGIN")])
            .go(vec![b("d", &[]), e(), S])
            .go(vec![q("ROLLBACK")])
            .go(vec![b("a2", &[]), e(), b("d", &[]), dp(""), S])
            // DEALLOCATE ALL runs in a block, and ROLLBACK does not undo it.
            .go(vec![p("da", "DEALLOCATE ALL"), S])
            .go(vec![q("BEGIN")])
            .go(vec![
                b("da", &[]),
                e(),
                p("a2", "SELECT 222 AS b"),
                b("a2", &[]),
                e(),
                S,
            ])
            .go(vec![q("ROLLBACK")])
            .go(vec![b("a2", &[]), e(), S])
            .go(vec![b("da", &[]), e(), S])
            // Unnamed, into a named portal.
            .go(vec![
                p("", "DEALLOCATE ALL"),
                bp("por", "", &[]),
                F::execute("por", 0),
                S,
            ])
            .go(vec![b("a2", &[]), e(), S])
            .go(vec![b("", &[]), e(), S])
            // The server's own statements are gone too: the client's are prepared again.
            .go(vec![p("a3", "SELECT 3 AS c"), b("a3", &[]), e(), S])
            .go(vec![p("", "DISCARD ALL"), b("", &[]), e(), S])
            .go(vec![p("a3", "SELECT 3 AS c"), b("a3", &[]), e(), S])
            .go(vec![p("a4", "SELECT 3 AS c"), b("a4", &[]), e(), S])
            // SQL-level statements too.
            .go(vec![q("PREPARE s1 AS SELECT 5 AS f")])
            .moved()
            .go(vec![p("", "DISCARD ALL"), b("", &[]), e(), S])
            .back()
            .go(vec![q("EXECUTE s1")])
            .go(vec![q("PREPARE s1 AS SELECT 6 AS f")])
            .go(vec![q("EXECUTE s1")]),
    )
    .await;
}

/// SQL `EXECUTE name` and `EXPLAIN [ANALYZE] EXECUTE name` of a protocol-level statement, also
/// on a server that has never seen it: PostgreSQL's answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_execute_and_explain_execute_of_a_protocol_statement() {
    check(
        Script::new()
            .go(vec![p("s1", "SELECT 41 + 1 AS answer"), S])
            .go(vec![q("EXECUTE s1")])
            .moved()
            .go(vec![q("EXPLAIN (COSTS OFF) EXECUTE s1")])
            .back()
            .go(vec![q(
                "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) EXECUTE s1",
            )])
            .moved()
            .go(vec![q("EXPLAIN EXECUTE nosuch")])
            .back(),
    )
    .await;
}

/// `DEALLOCATE name` through Parse/Bind/Execute: of a protocol-level statement (which the
/// server knows under pgmemo's name only), of a SQL-level one, of an unknown name, of pgmemo's
/// own names; in pipelines with errors before and after it, in a transaction block and an
/// aborted one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extended_deallocate_name() {
    check(
        Script::new()
            .go(vec![p("a1", "SELECT 1 AS a"), p("a2", "SELECT 2 AS b"), S])
            .go(vec![p("", "DEALLOCATE a1"), b("", &[]), dp(""), e(), S])
            .go(vec![b("a1", &[]), e(), S])
            .go(vec![b("", &[]), e(), S])
            .go(vec![p("a1", "SELECT 11 AS a"), b("a1", &[]), e(), S])
            .moved()
            .go(vec![
                p("dd", "DEALLOCATE a1"),
                b("dd", &[]),
                e(),
                p("a1", "SELECT 111 AS a"),
                b("a1", &[]),
                e(),
                S,
            ])
            .back()
            .go(vec![b("a1", &[]), e(), S])
            // An error before it: nothing happened.
            .go(vec![b("nope", &[]), b("dd", &[]), e(), S])
            .go(vec![b("a1", &[]), e(), S])
            // An error after it: it ran.
            .go(vec![b("dd", &[]), e(), b("nope", &[]), S])
            .go(vec![b("a1", &[]), e(), S])
            // Twice in one pipeline: the second fails.
            .go(vec![
                p("a1", "SELECT 1 AS a"),
                b("dd", &[]),
                e(),
                b("dd", &[]),
                e(),
                p("a1", "SELECT 2"),
                S,
            ])
            .go(vec![b("a1", &[]), e(), S])
            // In a transaction block: ROLLBACK does not undo it.
            .go(vec![p("a1", "SELECT 1 AS a"), S])
            .go(vec![q("BEGIN")])
            .go(vec![b("dd", &[]), e(), S])
            .go(vec![q("ROLLBACK")])
            .go(vec![b("a1", &[]), e(), S])
            // In an aborted block: refused, nothing dropped.
            .go(vec![p("a1", "SELECT 1 AS a"), S])
            .go(vec![q("BEGIN")])
            .go(vec![bp("keep", "dd", &[]), S])
            .go(vec![q("SELECT 1/0")])
            .go(vec![F::execute("keep", 0), S])
            .go(vec![b("dd", &[]), e(), S])
            .go(vec![q("ROLLBACK")])
            .go(vec![b("a1", &[]), e(), S])
            // Quoted and unknown names.
            .go(vec![p("MiXed", "SELECT 'm' AS m"), S])
            .go(vec![p("", "DEALLOCATE mixed"), b("", &[]), e(), S])
            .go(vec![
                p("", "DEALLOCATE PREPARE \"MiXed\""),
                b("", &[]),
                e(),
                S,
            ])
            .go(vec![b("MiXed", &[]), e(), S])
            // pgmemo's own names are not the client's; a client's statement may have one.
            .go(vec![p("", "DEALLOCATE pgmemo_s1"), b("", &[]), e(), S])
            .go(vec![p("", "DEALLOCATE pgmemo_s0"), b("", &[]), e(), S])
            .go(vec![p("pgmemo_s0", "SELECT 7 AS g"), S])
            .go(vec![q("BEGIN")])
            .go(vec![p("", "DEALLOCATE pgmemo_s0"), b("", &[]), e(), S])
            .go(vec![b("pgmemo_s0", &[]), e(), S])
            .go(vec![q("COMMIT")])
            // A SQL-level statement.
            .go(vec![q("PREPARE s1 AS SELECT 5 AS f")])
            .moved()
            .go(vec![p("", "DEALLOCATE s1"), b("", &[]), e(), S])
            .back()
            .go(vec![q("EXECUTE s1")])
            .go(vec![q("PREPARE s1 AS SELECT 6 AS f")])
            .go(vec![
                b("nope", &[]),
                p("", "DEALLOCATE s1"),
                b("", &[]),
                e(),
                S,
            ])
            .go(vec![q("EXECUTE s1")])
            .go(vec![p("", "DEALLOCATE s1"), b("", &[]), e(), S])
            .go(vec![q("EXECUTE s1")])
            // A portal runs once: executed again, it fails (55000).
            .go(vec![
                p("a5", "SELECT 5 AS e"),
                p("dx", "DEALLOCATE a5"),
                b("dx", &[]),
                e(),
                e(),
                S,
            ])
            .go(vec![b("a5", &[]), e(), S])
            // Described in an aborted block, on a server that lacks it: it returns no rows.
            .go(vec![p("dy", "DEALLOCATE a1"), S])
            .moved()
            .go(vec![q("BEGIN")])
            .go(vec![q("SELECT 1/0")])
            .go(vec![ds("dy"), ds("a1"), S])
            .go(vec![q("ROLLBACK")])
            .back()
            // SQL EXECUTE of a statement that deallocates (itself, or all).
            .go(vec![q("EXECUTE dy")])
            .go(vec![b("a1", &[]), e(), S])
            .go(vec![p("dz", "DEALLOCATE dz"), S])
            .go(vec![q("EXECUTE dz")])
            .go(vec![ds("dz"), S])
            .go(vec![
                p("a1", "SELECT 1 AS a"),
                p("dall", "DEALLOCATE ALL"),
                S,
            ])
            .moved()
            .go(vec![q("EXECUTE dall")])
            .back()
            .go(vec![b("a1", &[]), e(), S])
            .go(vec![b("dy", &[]), e(), S]),
    )
    .await;
}

/// The same text under the search_path a client SETs: statements are keyed by the one in
/// effect (SET LOCAL until its transaction ends, a session-level SET if it commits, through
/// a simple query or Parse/Bind/Execute), and a session-level one follows the client to other
/// servers (and not to other clients).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_search_path() {
    let items = |name: &str| {
        vec![
            p(name, "SELECT v FROM items"),
            ds(name),
            b(name, &[]),
            e(),
            S,
        ]
    };
    check(
        Script::new()
            .clients(2)
            .setup(
                "DROP SCHEMA IF EXISTS prep_sp1 CASCADE; DROP SCHEMA IF EXISTS prep_sp2 CASCADE;
                 CREATE SCHEMA prep_sp1; CREATE SCHEMA prep_sp2;
                 CREATE TABLE prep_sp1.items (v int4); INSERT INTO prep_sp1.items VALUES (1);
                 CREATE TABLE prep_sp2.items (v text); INSERT INTO prep_sp2.items VALUES ('two');",
            )
            .on(0, vec![q("SET search_path = prep_sp1")])
            .on(0, items("s"))
            .on(1, vec![q("SET search_path TO \"prep_sp2\", public")])
            .on(1, items("s"))
            .moved()
            .on(0, vec![b("s", &[]), e(), S])
            .on(1, vec![b("s", &[]), e(), S])
            .on(0, items("s0"))
            .back()
            // SET LOCAL lasts until the transaction ends.
            .on(0, vec![q("BEGIN")])
            .on(0, vec![q("SET LOCAL search_path = prep_sp2")])
            .on(0, items("t"))
            .on(0, vec![q("COMMIT")])
            .on(0, items("u"))
            // Ended by a ROLLBACK pipelined before the Parse.
            .on(0, vec![q("BEGIN")])
            .on(0, vec![q("SET LOCAL search_path = prep_sp2")])
            .on(
                0,
                vec![q("ROLLBACK"), p("w", "SELECT v FROM items"), ds("w"), S],
            )
            // A session-level SET that is rolled back, or fails with its query.
            .on(0, vec![q("BEGIN")])
            .on(0, vec![q("SET search_path = prep_sp2")])
            .on(0, items("x1"))
            .on(0, vec![q("ROLLBACK")])
            .on(0, items("x2"))
            .on(0, vec![q("SET search_path = prep_sp2; SELECT 1/0")])
            .on(0, items("x3"))
            // One that commits in a block.
            .on(1, vec![q("BEGIN")])
            .on(1, vec![q("SET SESSION search_path = prep_sp1")])
            .on(1, vec![q("COMMIT")])
            .on(1, items("y1"))
            // Through Parse/Bind/Execute, pipelined before a Parse.
            .on(
                0,
                vec![
                    p("", "SET search_path = prep_sp2"),
                    b("", &[]),
                    e(),
                    p("z1", "SELECT v FROM items"),
                    ds("z1"),
                    S,
                ],
            )
            .on(
                0,
                vec![
                    p("", "SET search_path = prep_sp1"),
                    b("", &[]),
                    e(),
                    b("nope", &[]),
                    S,
                ],
            )
            .on(0, items("z2"))
            .moved()
            .on(0, items("z3"))
            .on(1, items("y2"))
            .back()
            // RESET: the startup packet's (here the server's default).
            .on(1, vec![q("RESET search_path")])
            .on(1, items("r"))
            .on(0, vec![q("SHOW search_path")])
            .on(1, vec![q("SHOW search_path")])
            // DISCARD ALL: the startup packet's again, here and on other servers.
            .on(0, vec![q("DISCARD ALL")])
            .on(0, vec![q("SHOW search_path")])
            .on(0, items("d1"))
            .moved()
            .on(0, vec![q("SHOW search_path")])
            .on(
                0,
                vec![p("", "SET search_path = prep_sp2"), b("", &[]), e(), S],
            )
            .back()
            .on(0, items("d2"))
            .on(0, vec![p("", "DISCARD ALL"), b("", &[]), e(), S])
            .moved()
            .on(0, vec![q("SHOW search_path")])
            .back()
            .on(0, vec![q("SHOW search_path")]),
    )
    .await;
}

/// SQL PREPARE and EXECUTE in different transactions, on different servers; clients never see
/// each other's statements.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_prepare_and_execute_across_transactions() {
    check(
        Script::new()
            .clients(2)
            .on(0, vec![q("PREPARE sq(int) AS SELECT $1 + 1 AS next")])
            .moved()
            .on(0, vec![q("EXECUTE sq(41)")])
            .back()
            .on(0, vec![q("EXECUTE sq(1)")])
            .on(1, vec![q("EXECUTE sq(1)")])
            .on(1, vec![q("PREPARE sq AS SELECT 'client 1' AS who")])
            .on(1, vec![q("EXECUTE sq")])
            .on(0, vec![q("EXECUTE sq(2)")])
            .moved()
            .on(1, vec![q("EXECUTE sq")])
            .on(0, vec![q("EXECUTE sq(3)")])
            .back()
            // One namespace with the protocol's statements.
            .on(0, vec![b("sq", &["5"]), e(), S])
            .on(0, vec![p("sq", "SELECT 1"), S])
            .on(0, vec![p("proto", "SELECT 'proto' AS p"), S])
            .on(0, vec![q("EXECUTE proto")])
            .on(0, vec![q("PREPARE proto AS SELECT 1")])
            .on(0, vec![q("DEALLOCATE sq")])
            .on(0, vec![q("EXECUTE sq(1)")])
            .moved()
            .on(1, vec![q("DEALLOCATE sq")])
            .on(1, vec![q("EXECUTE sq")])
            .back()
            // PREPARE is not undone by the failure of its query, nor by ROLLBACK.
            .on(0, vec![q("PREPARE kept AS SELECT 'kept' AS k; SELECT 1/0")])
            .on(0, vec![q("BEGIN")])
            .on(0, vec![q("PREPARE kept2(text) AS SELECT $1 AS k2")])
            .on(0, vec![q("ROLLBACK")])
            .moved()
            .on(0, vec![q("EXECUTE kept; EXECUTE kept2('two')")])
            // The protocol sees SQL-level statements: Describe, Bind, Close.
            .on(
                0,
                vec![ds("kept2"), b("kept2", &["bound"]), e(), cs("kept"), S],
            )
            .back()
            .on(0, vec![q("EXECUTE kept")])
            .on(
                0,
                vec![
                    p("kept", "SELECT 'now protocol' AS k"),
                    b("kept", &[]),
                    e(),
                    S,
                ],
            )
            .moved()
            .on(0, vec![q("DEALLOCATE ALL")])
            .on(0, vec![q("EXECUTE kept2('gone')")])
            .back()
            .on(0, vec![q("EXECUTE kept2('gone')")]),
    )
    .await;
}

/// One namespace for both kinds of prepared statements, as in PostgreSQL (asyncpg's
/// test_prepare_explicitly_named): the statement a Parse named `foobar` is the one SQL
/// `EXECUTE foobar` runs — in a simple query, and through Parse/Describe/Bind/Execute, whose
/// Describe of the statement gives foobar's rows (not NoData) — and `EXPLAIN EXECUTE foobar`
/// (also through the protocol) plans, and the one `DEALLOCATE foobar` drops (a Bind of it then
/// fails with 26000); a PREPARE or Parse of a name of the other kind fails with 42P05; the
/// statement `PREPARE x` made is the one a Bind, a Describe and a Close of `x` use. Also on
/// servers that have never seen them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_and_sql_statements_share_one_namespace() {
    check(
        Script::new()
            .go(vec![p("foobar", "SELECT 1 AS one"), S])
            .go(vec![q("EXECUTE foobar")])
            .moved()
            // asyncpg's fetchval('EXECUTE foobar'): described before a server ran anything.
            .send(0, vec![p("", "EXECUTE foobar"), ds(""), H])
            .recv(0, 3)
            .go(vec![b("", &[]), dp(""), e(), S])
            .back()
            .go(vec![
                p("ex", "EXPLAIN (COSTS OFF) EXECUTE foobar"),
                ds("ex"),
                b("ex", &[]),
                e(),
                S,
            ])
            .moved()
            .go(vec![b("ex", &[]), e(), ds("ex"), S])
            .go(vec![
                p("", "EXECUTE foobar"),
                ds(""),
                b("", &[]),
                dp(""),
                e(),
                S,
            ])
            .back()
            .go(vec![q("PREPARE foobar AS SELECT 2")])
            .go(vec![p("foobar", "SELECT 3"), S])
            .go(vec![q("DEALLOCATE foobar")])
            .go(vec![b("foobar", &[]), e(), S])
            .go(vec![q("EXECUTE foobar")])
            .go(vec![p("", "EXECUTE foobar"), ds(""), b("", &[]), e(), S])
            // A SQL-level statement through the protocol.
            .go(vec![q("PREPARE x(int) AS SELECT $1 + 1 AS y")])
            .moved()
            .go(vec![ds("x"), b("x", &["4"]), dp(""), e(), S])
            .go(vec![
                p("", "EXECUTE x(2)"),
                ds(""),
                b("", &[]),
                dp(""),
                e(),
                S,
            ])
            .back()
            .go(vec![p("x", "SELECT 3"), S])
            .go(vec![q("PREPARE x AS SELECT 3")])
            .go(vec![cs("x"), S])
            .go(vec![q("EXECUTE x(1)")])
            .go(vec![b("x", &["1"]), e(), S])
            .go(vec![q("PREPARE x AS SELECT 'again' AS a")])
            .go(vec![p("", "EXECUTE x"), ds(""), b("", &[]), e(), S]),
    )
    .await;
}

/// A SQL-level statement outlives a temporary table it reads, as in PostgreSQL (pg_regress
/// plancache, reduced): PostgreSQL keeps the statement when the table is dropped; an EXECUTE
/// of it analyses it again and fails (42P01, positioned in the query that held the PREPARE)
/// until a table of that name exists again, then works. Through pgmemo the client moves to a
/// server where the statements cannot be prepared again (they read a table that is not
/// there): they stay the client's, with PostgreSQL's answers — an EXECUTE alone, after
/// another statement, in a transaction block, `EXPLAIN EXECUTE`, a Bind of one, a PREPARE or
/// Parse of one's name (42P05), DEALLOCATE alone, among other statements, and through
/// Parse/Bind/Execute — and work again once the table is made again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_statements_outlive_the_tables_they_read() {
    check(
        Script::new()
            .go(vec![q("CREATE TEMP TABLE pcachetest AS SELECT 1 AS q1; \
                 PREPARE prepstmt AS SELECT * FROM pcachetest; \
                 PREPARE prep2(int) AS SELECT q1 + $1 AS r FROM pcachetest; \
                 PREPARE prep3 AS SELECT count(*) AS n FROM pcachetest; \
                 DROP TABLE pcachetest")])
            // (The server's session state is probed after that query: done with it before
            // the move.)
            .go(vec![q("SELECT 'settled' AS s")])
            .moved()
            .go(vec![q("EXECUTE prepstmt")])
            .go(vec![q("SELECT 1 AS a; EXECUTE prepstmt; SELECT 2 AS b")])
            .go(vec![q("EXPLAIN (COSTS OFF) EXECUTE prep2(1)")])
            .go(vec![q("BEGIN")])
            .go(vec![q("SELECT 1 AS a; EXECUTE prep2(1)")])
            .go(vec![q("ROLLBACK")])
            .go(vec![b("prepstmt", &[]), e(), S])
            .go(vec![q("PREPARE prepstmt AS SELECT 1")])
            .go(vec![p("prepstmt", "SELECT 1"), S])
            .go(vec![q("EXECUTE prepstmt")])
            // The table again: the statements work.
            .go(vec![q("CREATE TEMP TABLE pcachetest AS SELECT 2 AS q1")])
            .go(vec![b("prepstmt", &[]), e(), S])
            .go(vec![q("EXECUTE prep2(40)")])
            .back()
            .go(vec![q("EXECUTE prepstmt; EXECUTE prep3")])
            .go(vec![q("DROP TABLE pcachetest")])
            .go(vec![q("SELECT 'settled' AS s")])
            .moved()
            .go(vec![q("EXECUTE prep2(1)")])
            .go(vec![q("DEALLOCATE prepstmt")])
            .go(vec![q("SELECT 1 AS c; DEALLOCATE prep2")])
            .go(vec![p("", "DEALLOCATE prep3"), b("", &[]), e(), S])
            .go(vec![q("EXECUTE prepstmt")])
            .go(vec![q("EXECUTE prep2(1)")])
            .go(vec![q("EXECUTE prep3")])
            .back(),
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// DDL
// ---------------------------------------------------------------------------------------------

/// After ALTER TABLE ADD COLUMN, a `SELECT *` statement prepared before fails with 0A000
/// ("cached plan must not change result type") on a PostgreSQL connection, for good. pgmemo
/// does better, and the direct connection is given what pgmemo promises (the statement
/// prepared afresh, not recorded) before the steps that show it:
/// - the first statement of an implicit transaction, when its batch describes the portal
///   (as libpq does), is prepared again and its batch sent again, invisibly: the client
///   reads the new rows by the new description;
/// - elsewhere the client gets the 0A000, as from PostgreSQL (it may decode rows by a
///   description it cached: no Describe of the portal, a transaction block, an earlier
///   statement in the batch, further pipelined work, a Describe of the statement, which
///   PostgreSQL half answers before it fails), and the next use works — on every server,
///   including one whose copy predates the ALTER.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alter_table_then_execute_select_star() {
    let reprepare = vec![cs("star"), p("star", "SELECT * FROM prep_alter_t"), S];
    let alter = |column: &str| {
        q(&format!(
            "ALTER TABLE prep_alter_t ADD COLUMN {column} int DEFAULT 5"
        ))
    };
    let described = || vec![b("star", &[]), dp(""), e(), S];
    let plain = || vec![b("star", &[]), e(), S];
    check(
        Script::new()
            .setup(
                "DROP TABLE IF EXISTS prep_alter_t; CREATE TABLE prep_alter_t (a int); \
                 INSERT INTO prep_alter_t VALUES (1)",
            )
            .go(vec![
                p("star", "SELECT * FROM prep_alter_t"),
                b("star", &[]),
                e(),
                S,
            ])
            .moved()
            .go(plain())
            .back()
            // Sent again, invisibly.
            .go(vec![alter("b")])
            .direct_only(0, reprepare.clone(), 1)
            .go(described())
            .moved()
            .go(described())
            .back()
            // The rows would not match a description the client cached: like PostgreSQL,
            // pgmemo keeps answering 0A000 (the server's own message) on every server until
            // the client prepares the statement again.
            .go(vec![alter("c")])
            .go(plain())
            .go(plain())
            .moved()
            .go(plain())
            .back()
            .go(reprepare.clone())
            .go(plain())
            .moved()
            .go(plain())
            .back()
            .go(vec![alter("d")])
            .go(vec![ds("star"), b("star", &[]), dp(""), e(), S])
            .direct_only(0, reprepare.clone(), 1)
            .go(vec![ds("star"), b("star", &[]), dp(""), e(), S])
            // In a transaction block (no retry there): the client prepares again, as it must
            // with PostgreSQL too.
            .go(vec![alter("e")])
            .go(vec![q("BEGIN")])
            .go(described())
            .go(vec![q("ROLLBACK")])
            .go(reprepare.clone())
            .go(described())
            // After an earlier statement of the batch.
            .go(vec![alter("f")])
            .go(vec![
                p("one", "SELECT 1 AS one"),
                b("one", &[]),
                e(),
                b("star", &[]),
                dp(""),
                e(),
                S,
            ])
            .go(reprepare.clone())
            .go(described())
            // Pipelined: the second batch was sent before the first failed.
            .go(vec![alter("g")])
            .go([described(), described()].concat())
            .go(reprepare)
            .go(described())
            .go(vec![q("DROP TABLE prep_alter_t")]),
    )
    .await;
}

/// A fresh Parse after a schema change made through pgmemo is answered with the schema as it
/// is now, as on a PostgreSQL connection, even where a server still holds the same text
/// prepared before the change (by this client or another): new parameter types after
/// `ALTER COLUMN ... TYPE`, new columns after `ADD`/`DROP COLUMN` and after a table is dropped
/// and made again with other columns, no `cache lookup failed for type` (XX000) after a type
/// is dropped and made again, no 0A000 for a statement the client has just parsed, also in
/// the transaction that made the change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_parse_after_ddl_sees_the_new_schema() {
    const SQL: &str = "SELECT * FROM ddl_t WHERE a = $1";
    const MOOD: &str = "SELECT $1::ddl_mood::text AS m";
    // Parse under `name`, describe it and its portal, run it with `arg`.
    let fresh =
        |name: &str, arg: &str| vec![p(name, SQL), ds(name), b(name, &[arg]), dp(""), e(), S];
    let mood = |name: &str, arg: &str| vec![p(name, MOOD), b(name, &[arg]), dp(""), e(), S];
    check(
        Script::new()
            .clients(2)
            .setup(
                "DROP TABLE IF EXISTS ddl_t; DROP TYPE IF EXISTS ddl_mood; \
                 CREATE TABLE ddl_t (a int, b int); INSERT INTO ddl_t VALUES (1, 2); \
                 CREATE TYPE ddl_mood AS ENUM ('sad', 'ok')",
            )
            .on(0, fresh("s", "1"))
            .on(1, fresh("s", "1"))
            .on(0, vec![q("ALTER TABLE ddl_t ALTER COLUMN a TYPE text")])
            .on(1, fresh("s2", "1"))
            .on(0, fresh("", "1"))
            .on(1, vec![q("ALTER TABLE ddl_t DROP COLUMN b")])
            .on(0, fresh("s3", "1"))
            .moved()
            .on(1, fresh("s3", "1"))
            .back()
            .on(1, vec![q("ALTER TABLE ddl_t ADD COLUMN c int DEFAULT 7")])
            .on(0, fresh("s4", "1"))
            .on(1, fresh("", "1"))
            // The change and the Parse in one transaction.
            .on(
                0,
                vec![
                    q("BEGIN"),
                    q("ALTER TABLE ddl_t ADD COLUMN d int DEFAULT 8"),
                ],
            )
            .on(0, fresh("s5", "1"))
            .on(0, vec![q("COMMIT")])
            .on(1, fresh("s5", "1"))
            // Extended protocol DDL.
            .on(
                1,
                vec![p("", "ALTER TABLE ddl_t DROP COLUMN c"), b("", &[]), e(), S],
            )
            .on(0, fresh("s6", "1"))
            .on(1, fresh("s6", "1"))
            // Dropped and made again with other columns.
            .on(
                0,
                vec![q("DROP TABLE ddl_t; CREATE TABLE ddl_t (a bool, z text); \
                        INSERT INTO ddl_t VALUES (true, 'z')")],
            )
            .on(1, fresh("s7", "t"))
            .on(0, fresh("s7", "t"))
            // A type dropped and made again under the same name.
            .on(0, mood("m", "ok"))
            .on(1, mood("m", "ok"))
            .on(
                1,
                vec![q(
                    "DROP TYPE ddl_mood; CREATE TYPE ddl_mood AS ENUM ('sad', 'ok', 'happy')",
                )],
            )
            .on(0, mood("m2", "happy"))
            .on(1, mood("m2", "happy"))
            .moved()
            .on(0, mood("", "happy"))
            .back()
            .on(0, vec![q("DROP TABLE ddl_t; DROP TYPE ddl_mood")]),
    )
    .await;
}

/// A temporary table hides a table of the same name for the session that made it only: its
/// client's fresh Parses of a text that other clients share resolve to the temporary table (a
/// private statement, prepared on its own server), and to the shared one again once the
/// temporary table is dropped; the other client's Parses never see it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_temporary_table_hides_a_shared_statement_for_its_client_only() {
    const SQL: &str = "SELECT * FROM ddl_shadow";
    let fresh = |name: &str| vec![p(name, SQL), ds(name), b(name, &[]), dp(""), e(), S];
    check(
        Script::new()
            .clients(2)
            .setup(
                "DROP TABLE IF EXISTS ddl_shadow; CREATE TABLE ddl_shadow (a int); \
                 INSERT INTO ddl_shadow VALUES (1)",
            )
            .on(1, fresh("s"))
            .on(0, fresh("s"))
            .on(
                0,
                vec![q("CREATE TEMP TABLE ddl_shadow (x text, y text); \
                        INSERT INTO ddl_shadow VALUES ('temp', 'row')")],
            )
            .on(0, fresh("s2"))
            .on(0, fresh(""))
            .on(0, vec![q("DROP TABLE ddl_shadow")])
            .on(1, fresh("s2"))
            .on(0, fresh("s3"))
            .on(0, vec![q("DROP TABLE ddl_shadow")]),
    )
    .await;
}

/// A schema change made outside pgmemo is not seen: a fresh Parse of a text that a server
/// holds prepared from before a type was dropped and made again fails once with the server's
/// `cache lookup failed for type` (XX000); the statement is then retired, and the next Parse
/// of the text is prepared afresh and works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_change_outside_pgmemo_recovers_at_the_first_error() {
    const MOOD: &str = "SELECT $1::ddl_out_mood::text AS m";
    run_directly(
        "DROP TYPE IF EXISTS ddl_out_mood; CREATE TYPE ddl_out_mood AS ENUM ('sad', 'ok')",
    )
    .await;
    let proxy = start(1, defaults).await;
    let mut client = connect(proxy.local_addr()).await;
    let run = |name: &str, arg: &str| vec![p(name, MOOD), b(name, &[arg]), e(), S];
    client.send(&run("a", "ok")).await.unwrap();
    let first = client.recv_until_ready(1).await.unwrap();
    assert!(!first.iter().any(Backend::is_error), "{first:?}");
    run_directly("DROP TYPE ddl_out_mood; CREATE TYPE ddl_out_mood AS ENUM ('sad', 'ok', 'happy')")
        .await;
    client.send(&run("b", "happy")).await.unwrap();
    let failed = client.recv_until_ready(1).await.unwrap();
    let error = failed
        .iter()
        .find(|m| m.is_error())
        .expect("the server's error");
    assert_eq!(error.field(b'C').as_deref(), Some("XX000"), "{failed:?}");
    assert!(
        error
            .field(b'M')
            .is_some_and(|m| m.starts_with("cache lookup failed for type")),
        "{failed:?}"
    );
    client.send(&run("c", "happy")).await.unwrap();
    let replies = client.recv_until_ready(1).await.unwrap();
    assert!(!replies.iter().any(Backend::is_error), "{replies:?}");
    let row = replies.iter().find_map(Backend::data_row).expect("a row");
    assert_eq!(row[0].as_deref(), Some(&b"happy"[..]));
    let _ = client.terminate().await;
    proxy.shutdown().await;
    run_directly("DROP TYPE ddl_out_mood").await;
}

// ---------------------------------------------------------------------------------------------
// Portals, sizes, formats, transaction control, COPY
// ---------------------------------------------------------------------------------------------

/// Named portals, Execute with a row limit, Describe of a portal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_portals_and_row_limits() {
    check(
        Script::new()
            .go(vec![
                p("gen", "SELECT g FROM generate_series(1, $1::int) g"),
                S,
            ])
            .moved()
            .go(vec![q("BEGIN")])
            .go(vec![
                bp("cur", "gen", &["5"]),
                dp("cur"),
                F::execute("cur", 2),
                F::execute("cur", 2),
                S,
            ])
            .go(vec![F::execute("cur", 0), F::close_portal("cur"), S])
            .go(vec![dp("cur"), S])
            .go(vec![q("COMMIT")])
            .back()
            .moved()
            .go(vec![bp("p2", "gen", &["3"]), F::execute("p2", 1), S])
            .go(vec![F::execute("p2", 1), S])
            .back()
            .go(vec![
                bp("p3", "gen", &["2"]),
                bp("p4", "gen", &["3"]),
                F::execute("p4", 0),
                F::execute("p3", 1),
                dp("p3"),
                S,
            ]),
    )
    .await;
}

/// Messages larger than 64 KiB, the longest statement names PostgreSQL keeps, binary
/// parameters and results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_long_names_binary_formats() {
    let big_sql = format!(
        "SELECT length($1::text) AS len, '{}'::text AS filler",
        "x".repeat(70_000)
    );
    let big_param = "y".repeat(100_000);
    let name63 = "n".repeat(63);
    let binary = F::Bind {
        portal: String::new(),
        statement: "bin".into(),
        param_formats: vec![1],
        params: vec![Some(7i32.to_be_bytes().to_vec()), Some(vec![0, 1, 2, 255])],
        result_formats: vec![1],
    };
    let mixed = F::Bind {
        portal: String::new(),
        statement: "bin".into(),
        param_formats: vec![0, 1],
        params: vec![Some(b"8".to_vec()), Some(vec![9; 70_000])],
        result_formats: vec![0, 1],
    };
    check(
        Script::new()
            .go(vec![p(&name63, &big_sql), ds(&name63), S])
            .moved()
            .go(vec![b(&name63, &[&big_param]), e(), S])
            .back()
            .go(vec![b(&name63, &["short"]), e(), S])
            .go(vec![
                p("bin", "SELECT $1::int4 + 1 AS n, $2::bytea AS raw"),
                S,
            ])
            .moved()
            .go(vec![binary.clone(), e(), S])
            .go(vec![mixed, e(), S])
            .back()
            .go(vec![binary, e(), cs(&name63), S]),
    )
    .await;
}

/// Names longer than 63 bytes: PostgreSQL keeps only the first 63.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_longer_than_63_bytes() {
    let long = "L".repeat(70);
    let prefix = &long[..63];
    let other = format!("{prefix}other");
    check(
        Script::new()
            .go(vec![p(&long, "SELECT 'long' AS l"), S])
            .go(vec![b(prefix, &[]), e(), S])
            .moved()
            .go(vec![b(&other, &[]), e(), S])
            .back()
            .go(vec![p(&other, "SELECT 1"), S])
            .go(vec![cs(&other), b(&long, &[]), e(), S]),
    )
    .await;
}

/// Transaction control as named statements, also prepared on a new server in the middle of
/// (and in an aborted) transaction block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_control_as_named_statements() {
    check(
        Script::new()
            .go(vec![
                p("begin", "BEGIN"),
                p("commit", "COMMIT"),
                p("rollback", "ROLLBACK"),
                p("sp", "SAVEPOINT sp1"),
                p("rsp", "ROLLBACK TO SAVEPOINT sp1"),
                p("div", "SELECT 1 / $1::int AS q"),
                S,
            ])
            .moved()
            .go(vec![
                b("begin", &[]),
                e(),
                b("div", &["1"]),
                e(),
                b("sp", &[]),
                e(),
                S,
            ])
            .go(vec![b("div", &["0"]), e(), S])
            .go(vec![b("rsp", &[]), e(), S])
            .go(vec![b("div", &["1"]), e(), b("commit", &[]), e(), S])
            .back()
            .moved()
            .go(vec![b("begin", &[]), e(), S])
            .go(vec![b("div", &["0"]), e(), S])
            .go(vec![b("rollback", &[]), e(), S])
            .back()
            .go(vec![b("commit", &[]), e(), S])
            .moved()
            .go(vec![
                b("begin", &[]),
                e(),
                b("div", &["0"]),
                e(),
                b("commit", &[]),
                e(),
                S,
            ])
            .go(vec![b("commit", &[]), e(), S])
            .back(),
    )
    .await;
}

/// COPY FROM STDIN and TO STDOUT through Bind/Execute of a statement pgmemo must prepare on
/// the server first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_through_the_extended_protocol_after_an_injected_parse() {
    check(
        Script::new()
            .setup("DROP TABLE IF EXISTS prep_copy_t; CREATE TABLE prep_copy_t (a int, b text)")
            .go(vec![
                p("cin", "COPY prep_copy_t FROM STDIN"),
                p("cout", "COPY prep_copy_t TO STDOUT"),
                S,
            ])
            .moved()
            // Like libpq: Sync right after Execute; PostgreSQL ignores it during COPY IN.
            .send(0, vec![b("cin", &[]), e(), S])
            .recv(0, 2)
            .send(0, vec![F::copy_data(b"1\tone\n2\ttwo\n"), F::CopyDone, S])
            .expect(0, 1)
            .go(vec![b("cout", &[]), e(), S])
            .back()
            .moved()
            .send(0, vec![b("cin", &[]), e(), H])
            .recv(0, 2)
            .send(
                0,
                vec![
                    F::copy_data(b"3\tthree\n"),
                    F::CopyFail("changed my mind".into()),
                    S,
                ],
            )
            .expect(0, 1)
            .go(vec![b("cout", &[]), e(), S])
            .back()
            .go(vec![q("DROP TABLE prep_copy_t")]),
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// Property: random message sequences
// ---------------------------------------------------------------------------------------------

/// Statement texts and their parameter counts: good ones, and ones that fail at Parse
/// (syntax, missing table), at Bind (planning divides by zero) or at Execute.
const TEXTS: &[(&str, usize)] = &[
    ("SELECT 1 AS one", 0),
    ("SELECT $1::int + 1 AS n", 1),
    ("SELECT $1::text || 'x' AS s, 2 AS two", 1),
    ("SELECT g FROM generate_series(1, 3) g", 0),
    ("VALUES ($1::int), ($2::int)", 2),
    ("SELECT 1/0 AS boom", 0),
    ("SELECT g / (g - 2) FROM generate_series(1, 3) g", 0),
    ("SELEC oops", 0),
    ("SELECT * FROM prep_prop_missing_t", 0),
    // Executed, these change the statements (psycopg sends them so).
    ("DISCARD ALL", 0),
    ("DEALLOCATE ALL", 0),
    ("DEALLOCATE a", 0),
    ("SET search_path = public", 0),
];

const NAMES: &[&str] = &["", "a", "b", "c"];
const PORTALS: &[&str] = &["", "p"];

/// Simple queries sent at the start of a round, before its extended batch. Not `ROLLBACK TO`:
/// when it fails in an aborted block (no such savepoint), PostgreSQL keeps the failed unnamed
/// portal with its statement list in memory it has already reset, and what a later Execute of
/// the unnamed portal answers (25P02 or 55000) depends on how that memory was reused, which
/// any extra message changes. Savepoints are rolled back to in the scripted tests.
const QUERIES: &[&str] = &[
    "SELECT 1",
    "BEGIN",
    "COMMIT",
    "ROLLBACK",
    "SELECT 1/0",
    "DEALLOCATE a",
    "DEALLOCATE ALL",
    "DISCARD ALL",
    "SAVEPOINT sp",
    // SQL-level statements share the namespace with the protocol's.
    "PREPARE a AS SELECT 'sql a' AS s",
    "PREPARE b(int) AS SELECT $1 * 10 AS s",
    "EXECUTE a",
    "EXECUTE b(4)",
    "DEALLOCATE b",
    "SELECT 1; EXECUTE c",
    // Statements are keyed by the search_path in effect.
    "SET LOCAL search_path = pg_catalog, public",
    "SET search_path = public, pg_catalog",
    "RESET search_path",
];

/// One random sequence: rounds of an optional simple query and an extended batch ending in
/// Sync, sometimes with a Move before a round (and a Back after it).
fn random_sequence(rng: &mut Rng) -> Vec<Act> {
    // What the generator believes each name holds, to choose parameters (a belief: failed
    // Parses and resets are not tracked, and wrong counts are wanted now and then anyway).
    let mut params_of = std::collections::HashMap::<&str, usize>::new();
    let mut acts = vec![
        Act::Send(0, vec![q("ROLLBACK; DEALLOCATE ALL")]),
        Act::Expect(0, 1),
    ];
    for _ in 0..1 + rng.below(8) {
        let moved = rng.chance(30);
        if moved {
            acts.push(Act::Move);
        }
        let mut msgs = Vec::new();
        let mut ready = 1;
        if rng.chance(20) {
            let query = QUERIES[rng.below(QUERIES.len())];
            msgs.push(q(query));
            ready += 1;
        }
        // The unnamed portal is used only once this round has bound it: a simple query that
        // fails in a transaction block leaves PostgreSQL's unnamed portal failed, with its
        // statements in memory already reset, and an Execute of it then answers as that
        // memory happens to read (once, PostgreSQL 15.18 closed the connection).
        let mut bound_unnamed = false;
        for _ in 0..rng.below(7) {
            let name = if rng.chance(5) {
                "zz"
            } else {
                *rng.pick(NAMES)
            };
            let mut portal = *rng.pick(PORTALS);
            if !bound_unnamed {
                portal = "p";
            }
            let msg = match rng.below(100) {
                0..=24 => {
                    let (text, n) = *rng.pick(TEXTS);
                    params_of.insert(name, n);
                    p(name, text)
                }
                25..=49 => {
                    let mut n = params_of.get(name).copied().unwrap_or(0);
                    if rng.chance(10) {
                        n = rng.below(3);
                    }
                    let values: Vec<String> = (0..n).map(|i| (i + 5).to_string()).collect();
                    let values: Vec<&str> = values.iter().map(String::as_str).collect();
                    let portal = *rng.pick(PORTALS);
                    bound_unnamed |= portal.is_empty();
                    bp(portal, name, &values)
                }
                50..=69 => F::execute(portal, rng.below(2) as i32),
                70..=77 => ds(name),
                78..=82 => dp(portal),
                83..=89 => cs(name),
                90..=92 => F::close_portal(portal),
                _ => H,
            };
            msgs.push(msg);
        }
        msgs.push(S);
        // Now and then pipelined behind the previous round, in the same write: what the
        // previous round does to the statements is not known when this one arrives.
        let previous = acts
            .len()
            .checked_sub(2)
            .filter(|_| !moved && rng.chance(30));
        match previous.map(|at| acts.split_at_mut(at + 1)) {
            Some((sent, [Act::Expect(0, expected)]))
                if matches!(sent.last(), Some(Act::Send(..))) =>
            {
                *expected += ready;
                if let Some(Act::Send(_, pipeline)) = sent.last_mut() {
                    pipeline.extend(msgs);
                }
            }
            _ => {
                acts.push(Act::Send(0, msgs));
                acts.push(Act::Expect(0, ready));
            }
        }
        if moved {
            acts.push(Act::Back);
        }
    }
    acts
}

fn limit_two(config: &mut Config) {
    config.general.max_prepared_statements = 2;
}

/// Random sequences give the same transcript directly and through pgmemo (pools of one and
/// two, with a per-server limit of two statements, so evictions are frequent), while a helper
/// keeps moving the client to servers that lack its statements.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_sequences_match_postgres() {
    let sequences: usize = std::env::var("PREPARED_SEQUENCES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let seed: u64 = std::env::var("PREPARED_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_0f9e_3779_b97f);
    let one = start(1, limit_two).await;
    let two = start(2, limit_two).await;
    let targets = [
        Target::Direct,
        Target::Pgmemo(one.local_addr(), 1),
        Target::Pgmemo(two.local_addr(), 2),
    ];
    let mut runners = Vec::new();
    for target in targets {
        runners.push(Runner::connect(target, 1).await);
    }
    let mut rng = Rng(seed);
    for i in 0..sequences {
        let acts = random_sequence(&mut rng);
        // A Move only between transactions: the same decision on every target, as long as
        // their transcripts agree (which is checked).
        let runs = runners.iter_mut().map(|runner| {
            let acts = &acts;
            async move {
                runner.out.clear();
                for act in acts {
                    if matches!(act, Act::Move) && !runner.all_idle() {
                        continue;
                    }
                    runner.act(act).await;
                }
            }
        });
        futures_util::future::join_all(runs).await;
        for (runner, label) in runners[1..].iter().zip(["pool_size 1", "pool_size 2"]) {
            if let Some(d) = diff(&runners[0].out, &runner.out) {
                if std::env::var_os("PREPARED_FULL").is_some() {
                    eprintln!("proxied:\n{}", runner.out.join("\n"));
                }
                panic!(
                    "sequence {i} (seed {seed}) through pgmemo, {label}: {d}\n\
                     direct transcript:\n{}",
                    runners[0].out.join("\n")
                );
            }
        }
        assert!(!runners[0].broken, "direct run broke: {:?}", runners[0].out);
    }
    for runner in runners {
        runner.finish().await;
    }
    one.shutdown().await;
    two.shutdown().await;
}

/// A DISCARD ALL that PostgreSQL refuses inside a transaction block, pipelined with a Parse
/// that then runs in the aborted block: nothing pgmemo sends in between may be lost or
/// misread, and a later Describe of a statement the server lacks gets PostgreSQL's own
/// 25P02 from Describe. (Found by the random sequences.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_discard_all_pipelined_in_a_block() {
    check_with(
        Script::new()
            .moved()
            .go(vec![p("c", "SELECT $1::int + 1 AS n"), b("", &[]), S])
            .back()
            .moved()
            .go(vec![p("c", "SELEC oops"), H, S])
            .back()
            .send(
                0,
                vec![
                    q("BEGIN"),
                    S,
                    q("DISCARD ALL"),
                    p("b", "SELECT 1/0 AS boom"),
                    S,
                    S,
                ],
            )
            .expect(0, 5)
            .go(vec![
                ds("c"),
                H,
                p("a", "SELECT g FROM generate_series(1, 3) g"),
                S,
            ])
            .go(vec![b("c", &["1"]), S])
            .go(vec![q("ROLLBACK")])
            .go(vec![b("c", &["1"]), e(), S]),
        limit_two,
    )
    .await;
}

/// pgmemo's own server names (`pgmemo_s<n>`, the guard `pgmemo_s0`) mean nothing to a client
/// that did not prepare them: a second client's SQL `DEALLOCATE` / `EXECUTE` of them (simple
/// queries, several statements in one, pipelined, in a transaction block, through
/// Parse/Bind/Execute) gets PostgreSQL's 26000 and never reaches pgmemo's statements, which
/// the first client's Binds still use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_server_names_are_not_the_clients() {
    let uses = |c: usize, s: Script| {
        s.on(
            c,
            vec![
                b("r1", &[]),
                e(),
                b("r2", &["2"]),
                e(),
                b("r3", &[]),
                e(),
                S,
            ],
        )
    };
    let script = Script::new().clients(2).on(
        0,
        vec![
            p("r1", "SELECT 1 AS one"),
            p("r2", "SELECT $1::int * 2 AS two"),
            p("r3", "SELECT 'three' AS three"),
            b("r1", &[]),
            e(),
            S,
        ],
    );
    let script = uses(0, script)
        .on(1, vec![q("DEALLOCATE pgmemo_s1")])
        .on(1, vec![q("DEALLOCATE PREPARE \"pgmemo_s2\"")])
        .on(1, vec![q("deallocate PGMEMO_S3")])
        .on(1, vec![q("EXECUTE pgmemo_s1")])
        .on(1, vec![q("EXECUTE pgmemo_s2(21)")])
        .on(1, vec![q("DEALLOCATE pgmemo_s0")])
        .on(1, vec![q("EXECUTE pgmemo_s0")])
        // A protocol-level statement of the client's may have such a name.
        .on(1, vec![p("pgmemo_s2", "SELECT 'mine' AS m"), S])
        .on(1, vec![q("DEALLOCATE pgmemo_s2")])
        .on(1, vec![b("pgmemo_s2", &[]), e(), S])
        .on(1, vec![q("SELECT 1 AS x; DEALLOCATE pgmemo_s3")])
        .on(
            1,
            vec![q("SELECT 1 AS x; EXECUTE pgmemo_s1; SELECT 2 AS y")],
        )
        .on(
            1,
            vec![q("SELECT 1 AS x; SELECT 1 +; DEALLOCATE pgmemo_s1")],
        )
        .on(1, vec![q("DEALLOCATE \"pgmemo_s1\"; SELECT 'é' +")])
        .on(1, vec![q("SELECT * FROM pgmemo_s; EXECUTE pgmemo_s1")])
        .on(
            1,
            vec![
                q("DEALLOCATE pgmemo_s1"),
                q("DEALLOCATE pgmemo_s2"),
                q("EXECUTE pgmemo_s3"),
                q("DEALLOCATE pgmemo_s0"),
            ],
        )
        .on(1, vec![q("BEGIN")])
        .on(1, vec![q("DEALLOCATE pgmemo_s1")])
        .on(1, vec![q("DEALLOCATE pgmemo_s2")])
        .on(1, vec![q("ROLLBACK")])
        .on(1, vec![p("", "DEALLOCATE pgmemo_s1"), b("", &[]), e(), S])
        .on(
            1,
            vec![
                p("", "EXECUTE pgmemo_s2(4)"),
                ds(""),
                b("", &[]),
                dp(""),
                e(),
                S,
            ],
        )
        .on(
            1,
            vec![
                p("ex", "EXECUTE pgmemo_s1"),
                b("ex", &[]),
                e(),
                S,
                q("EXECUTE ex"),
                b("ex", &[]),
                e(),
                S,
            ],
        );
    check(uses(0, script).on(0, vec![q("EXECUTE pgmemo_s1")])).await;
}

/// `PREPARE` of a reserved name (`pgmemo_s<n>`) is refused with pgmemo's 42939 where the
/// statement runs (earlier statements of its query run, later ones do not; in a transaction
/// block it aborts the block), through a simple query or Parse/Bind/Execute; nothing is
/// prepared, and pgmemo's statement of that name is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_of_a_reserved_name_is_refused() {
    let script = Script::new()
        .clients(2)
        .on(0, vec![p("r1", "SELECT 1 AS one"), b("r1", &[]), e(), S])
        .on(1, vec![q("PREPARE pgmemo_s1 AS SELECT 'mine' AS m")])
        .on(
            1,
            vec![q(
                "SELECT 1 AS x; PREPARE pgmemo_s1 AS SELECT 2; SELECT 3 AS y",
            )],
        )
        .on(
            1,
            vec![p("", "PREPARE pgmemo_s1 AS SELECT 3"), b("", &[]), e(), S],
        )
        .on(1, vec![q("BEGIN")])
        .on(1, vec![q("PREPARE \"pgmemo_s1\" AS SELECT 4")])
        .on(1, vec![q("ROLLBACK")])
        .on(1, vec![q("EXECUTE pgmemo_s1")])
        // In an aborted block PostgreSQL's 25P02 comes first.
        .on(1, vec![q("BEGIN; SELECT 1/0")])
        .on(1, vec![q("PREPARE pgmemo_s1 AS SELECT 5")])
        .on(1, vec![q("ROLLBACK")])
        .on(0, vec![b("r1", &[]), e(), S]);
    let refused = "ErrorResponse { S=\"ERROR\", V=\"ERROR\", C=\"42939\", M=\"pgmemo: prepared statement name \\\"pgmemo_s1\\\" is reserved (names pgmemo_s followed by digits are pgmemo's own on the server)\" }";
    let want: Vec<String> = [
        refused,
        "ReadyForQuery I",
        "RowDescription [\"x\" table=0 col=0 type=23 len=4 typmod=-1 format=0]",
        "DataRow [\"1\"]",
        "CommandComplete \"SELECT 1\"",
        refused,
        "ReadyForQuery I",
        "ParseComplete",
        "BindComplete",
        refused,
        "ReadyForQuery I",
        "CommandComplete \"BEGIN\"",
        "ReadyForQuery T",
        refused,
        "ReadyForQuery E",
        "CommandComplete \"ROLLBACK\"",
        "ReadyForQuery I",
        "ErrorResponse { S=\"ERROR\", V=\"ERROR\", C=\"26000\", M=\"prepared statement \\\"pgmemo_s1\\\" does not exist\", F=\"prepare.c\", L=\"451\", R=\"FetchPreparedStatement\" }",
        "ReadyForQuery I",
        "CommandComplete \"BEGIN\"",
        "ErrorResponse { S=\"ERROR\", V=\"ERROR\", C=\"22012\", M=\"division by zero\", F=\"int.c\", L=\"869\", R=\"int4div\" }",
        "ReadyForQuery E",
        "ErrorResponse { S=\"ERROR\", V=\"ERROR\", C=\"25P02\", M=\"current transaction is aborted, commands ignored until end of transaction block\", F=\"postgres.c\", L=\"1081\", R=\"exec_simple_query\" }",
        "ReadyForQuery E",
        "CommandComplete \"ROLLBACK\"",
        "ReadyForQuery I",
    ]
    .iter()
    .map(|l| without_source_line(&format!("1<< {l}")))
    .collect();
    for pool_size in [1, 2] {
        let proxy = start(pool_size, defaults).await;
        let out = run(&script, Target::Pgmemo(proxy.local_addr(), pool_size)).await;
        proxy.shutdown().await;
        let second: Vec<String> = out
            .iter()
            .filter(|l| l.starts_with("1<<"))
            .map(|l| without_source_line(l))
            .collect();
        assert_eq!(second, want, "pool_size {pool_size}:\n{}", out.join("\n"));
        let tail = &out[out.len() - 4..];
        assert_eq!(
            tail,
            [
                "0<< BindComplete",
                "0<< DataRow [\"1\"]",
                "0<< CommandComplete \"SELECT 1\"",
                "0<< ReadyForQuery I"
            ],
            "pool_size {pool_size}:\n{}",
            out.join("\n")
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Batches answered without a server
// ---------------------------------------------------------------------------------------------

/// Describe of a statement a server has described, with no server free: a client that
/// prepares and describes as pgx (Parse, Describe, Sync) and asyncpg (Parse, Describe, Flush)
/// do gets the server's
/// ParameterDescription and RowDescription/NoData again, byte for byte what PostgreSQL sends a
/// direct connection (table and type OIDs included), without waiting for the held server.
/// After a table is dropped and made again through pgmemo (same columns, another OID), a name
/// bound before is described by a server again, as PostgreSQL describes it now; and after a
/// change of its result type, as PostgreSQL answers it then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn known_statements_are_described_without_a_server() {
    let table = "CREATE TABLE describe_me (id int PRIMARY KEY, note text)";
    run_directly(&format!("DROP TABLE IF EXISTS describe_me; {table}")).await;
    let select = "SELECT * FROM describe_me WHERE id = $1";
    let insert = "INSERT INTO describe_me VALUES ($1, $2)";
    let batches: Vec<Vec<F>> = vec![
        vec![p("d1", select), ds("d1"), S],
        vec![p("", select), ds(""), S],
        vec![p("d2", insert), ds("d2"), cs("d2"), S],
        vec![ds("d1"), S],
    ];
    let render =
        |replies: &[Backend]| -> Vec<String> { replies.iter().map(|m| m.to_string()).collect() };
    // asyncpg's prepare: Parse, Describe, Flush (no ReadyForQuery until a later Sync).
    let flushed = [p("", select), ds(""), H];
    let mut want = Vec::new();
    let mut direct = connect(cluster().addr()).await;
    for batch in &batches {
        direct.send(batch).await.unwrap();
        want.push(render(&direct.recv_until_ready(1).await.unwrap()));
    }
    direct.send(&flushed).await.unwrap();
    let want_flushed = render(&direct.recv_n(3).await.unwrap());
    direct.send(&[b("", &["1"]), e(), S]).await.unwrap();
    let want_flushed_run = render(&direct.recv_until_ready(1).await.unwrap());

    let proxy = start(1, defaults).await;
    let addr = proxy.local_addr();
    let mut holder = connect(addr).await;
    // A server describes the statements once (through pgmemo, so pgmemo keeps it)...
    holder
        .send(&[p("a", select), ds("a"), p("b", insert), ds("b"), S])
        .await
        .unwrap();
    holder.recv_until_ready(1).await.unwrap();
    // ... then the only server is held in a transaction.
    simple(&mut holder, "BEGIN").await;
    let mut client = connect(addr).await;
    for (batch, want) in batches.iter().zip(&want) {
        client.send(batch).await.unwrap();
        let got = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            client.recv_until_ready(1),
        )
        .await
        .unwrap_or_else(|_| panic!("{batch:?} waited for a server"))
        .unwrap();
        assert_eq!(&render(&got), want, "{batch:?}");
    }
    client.send(&flushed).await.unwrap();
    let got = tokio::time::timeout(std::time::Duration::from_secs(10), client.recv_n(3))
        .await
        .expect("a batch ended by Flush waited for a server")
        .unwrap();
    assert_eq!(render(&got), want_flushed);
    let served = serverless_batches(addr).await;
    assert_eq!(served, batches.len() as u64 + 1, "served: {served}");
    // The rest of the flushed batch runs on the server once it is free.
    client.send(&[b("", &["1"]), e(), S]).await.unwrap();
    simple(&mut holder, "COMMIT").await;
    assert_eq!(
        render(&client.recv_until_ready(1).await.unwrap()),
        want_flushed_run
    );

    // Schema changes made through pgmemo by another client, after both connections bound d1:
    // the table made again (same columns, another OID), then a column added.
    let ddl = [
        format!("DROP TABLE describe_me; {table}"),
        "ALTER TABLE describe_me ADD COLUMN extra int".to_owned(),
    ];
    let later = [ds("d1"), S];
    let mut other = connect(addr).await;
    let mut after_ddl = Vec::new();
    for sql in &ddl {
        let replies = simple(&mut other, sql).await;
        assert!(!replies.iter().any(Backend::is_error), "{sql}: {replies:?}");
        direct.send(&later).await.unwrap();
        let want = render(&direct.recv_until_ready(1).await.unwrap());
        client.send(&later).await.unwrap();
        let got = render(&client.recv_until_ready(1).await.unwrap());
        assert_eq!(got, want, "after {sql}");
        after_ddl.push(want);
    }
    let description = |replies: &[String]| {
        replies
            .iter()
            .find(|m| m.starts_with("RowDescription"))
            .cloned()
    };
    assert!(description(&want[0]).is_some(), "{want:?}");
    assert_ne!(
        description(&want[0]),
        description(&after_ddl[0]),
        "the table OID moved"
    );
    proxy.shutdown().await;
    run_directly("DROP TABLE describe_me").await;
}

/// What a client reads back, message by message: the type, and for ReadyForQuery its status.
fn shape(replies: &[Backend]) -> Vec<String> {
    replies
        .iter()
        .map(|m| match m.ready_status() {
            Some(status) => format!("{} {}", m.name(), status as char),
            None => m.name().to_owned(),
        })
        .collect()
}

/// A Parse of a statement PostgreSQL has accepted, a Close, and the Sync that ends them are
/// answered without a server: while another client holds the pool's only server in a
/// transaction, a second client still prepares (named and unnamed) and closes, with the
/// replies PostgreSQL gives a direct connection, and gets the server for its Bind/Execute once
/// the first commits. Without the local answers its first batch would wait for the server
/// (and the test time out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn known_statements_are_prepared_and_closed_without_a_server() {
    let sql = "SELECT $1::int + 1";
    let batches: Vec<Vec<F>> = vec![
        vec![p("s1", sql), S],
        vec![p("", sql), cs("s1"), S],
        vec![cs("never_prepared"), S],
        vec![p("s2", sql), p("s3", sql), cs("s2"), S],
    ];
    let mut want = Vec::new();
    let mut direct = connect(cluster().addr()).await;
    for batch in &batches {
        direct.send(batch).await.unwrap();
        want.push(shape(&direct.recv_until_ready(1).await.unwrap()));
    }

    let proxy = start(1, defaults).await;
    let addr = proxy.local_addr();
    let mut holder = connect(addr).await;
    // PostgreSQL accepts the statement once (through pgmemo, so pgmemo knows it)...
    holder.send(&[p("first", sql), S]).await.unwrap();
    holder.recv_until_ready(1).await.unwrap();
    // ... then the only server is held in a transaction.
    simple(&mut holder, "BEGIN").await;
    let mut client = connect(addr).await;
    for (batch, want) in batches.iter().zip(&want) {
        client.send(batch).await.unwrap();
        let got = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            client.recv_until_ready(1),
        )
        .await
        .unwrap_or_else(|_| panic!("{batch:?} waited for a server"))
        .unwrap();
        assert_eq!(&shape(&got), want, "{batch:?}");
    }
    let served = serverless_batches(addr).await;
    assert_eq!(served, batches.len() as u64, "served: {served}");

    // A statement PostgreSQL has not seen must reach it: it waits for the held server.
    client.send(&[p("new", "SELECT 'new'"), S]).await.unwrap();
    simple(&mut holder, "COMMIT").await;
    let replies = client.recv_until_ready(1).await.unwrap();
    assert_eq!(shape(&replies), ["ParseComplete", "ReadyForQuery I"]);
    // The statements prepared without a server work on it.
    client.send(&[b("s3", &["41"]), e(), S]).await.unwrap();
    let replies = client.recv_until_ready(1).await.unwrap();
    let row = replies.iter().find_map(Backend::data_row).expect("a row");
    assert_eq!(row[0].as_deref(), Some(&b"42"[..]), "{replies:?}");
    client.send(&[b("", &["1"]), e(), S]).await.unwrap();
    let replies = client.recv_until_ready(1).await.unwrap();
    let row = replies.iter().find_map(Backend::data_row).expect("a row");
    assert_eq!(row[0].as_deref(), Some(&b"2"[..]), "{replies:?}");
    // A closed name is gone, as in PostgreSQL.
    client.send(&[b("s1", &["1"]), e(), S]).await.unwrap();
    let replies = client.recv_until_ready(1).await.unwrap();
    assert_eq!(
        replies.iter().find_map(|m| m.field(b'C')).as_deref(),
        Some("26000"),
        "{replies:?}"
    );
    proxy.shutdown().await;
}

/// A statement's text is read under the settings of the client that parsed it: a date under
/// DateStyle, a timestamptz under TimeZone, an interval under IntervalStyle, backslashes under
/// standard_conforming_strings. Clients that read literals otherwise never share a statement,
/// whether they set the setting at login or later, and one that sets it back shares again:
/// each gets what PostgreSQL gives the same client directly (a shared statement gave the
/// second client the first one's date: 2024-01-02 for '01/02/2024' under DMY).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_are_not_shared_across_literal_settings() {
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let through = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let direct = cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let queries = [
        "SELECT '01/02/2024'::date::text",
        "SELECT '2024-01-02 03:04:05'::timestamptz::text",
        "SELECT '-1 2:00'::interval::text",
        "SELECT 'a\\\\b'::text",
    ];
    let settings = [
        "",
        "SET DateStyle = 'ISO, DMY'",
        "SET TimeZone = 'Asia/Kolkata'",
        "SET IntervalStyle = 'sql_standard'",
        "SET standard_conforming_strings = off",
        "SET DateStyle = 'SQL, DMY'; SET TimeZone = 'America/New_York'",
    ];
    // Each setting through a client of its own, the first (defaults) first, all on one server.
    let mut clients = vec![];
    for set in settings {
        let (a, b) = (
            common::client::connect(&through).await,
            common::client::connect(&direct).await,
        );
        if !set.is_empty() {
            a.batch_execute(set).await.unwrap();
            b.batch_execute(set).await.unwrap();
        }
        clients.push((set, a, b));
    }
    for round in 0..2 {
        for (set, a, b) in &clients {
            for sql in queries {
                // Extended protocol: tokio-postgres prepares each text under its own name.
                let got: String = a.query_one(sql, &[]).await.unwrap().get(0);
                let want: String = b.query_one(sql, &[]).await.unwrap().get(0);
                assert_eq!(got, want, "{sql} after {set:?}, round {round}");
            }
        }
    }
    // A client that changes a setting back reads as the defaults do again.
    let (a, b, _) = (&clients[1].1, &clients[1].2, ());
    for c in [a, b] {
        c.batch_execute("RESET DateStyle").await.unwrap();
    }
    let got: String = a.query_one(queries[0], &[]).await.unwrap().get(0);
    let want: String = b.query_one(queries[0], &[]).await.unwrap().get(0);
    assert_eq!(got, want, "after RESET DateStyle");
    // Set at login (options), not by SET.
    let (a, b) = (
        common::client::connect(&format!("{through}?options=-c%20DateStyle%3DISO%2CDMY")).await,
        common::client::connect(&format!("{direct}?options=-c%20DateStyle%3DISO%2CDMY")).await,
    );
    let got: String = a.query_one(queries[0], &[]).await.unwrap().get(0);
    let want: String = b.query_one(queries[0], &[]).await.unwrap().get(0);
    assert_eq!(got, want, "DateStyle from the startup packet");
    proxy.shutdown().await;
}

/// A transcript line without PostgreSQL's source line (`L="869"`): it moves from version to
/// version (15's int4div is at line 869, 18's at 870), the rest of an error does not.
fn without_source_line(line: &str) -> String {
    match line.find(", L=\"") {
        Some(at) => {
            let end = line[at + 5..]
                .find('"')
                .map_or(line.len(), |e| at + 5 + e + 1);
            format!("{}{}", &line[..at], &line[end..])
        }
        None => line.to_owned(),
    }
}
