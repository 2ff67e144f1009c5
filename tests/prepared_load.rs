//! Load on prepared statements in transaction mode: [`CLIENTS`] client connections, each
//! using [`STATEMENTS`] distinct statements in random pipelines, over a pool of
//! [`POOL_SIZE`] server connections that may keep at most [`MAX_PREPARED`] statements each.
//!
//! Every client is a [`RawClient`] that knows exactly which replies PostgreSQL gives to each
//! pipeline it sends (ParseComplete, BindComplete, CloseComplete, ParameterDescription,
//! RowDescription, every DataRow value, CommandComplete, an ErrorResponse and the messages
//! skipped after it, ReadyForQuery) and compares them with what it gets. Each client names
//! statement `k` differently (`q<(7k + client) mod 200>`), so the same name means different
//! SQL in different clients. Pipelines mix first Parses, Close and re-Parse of a name in the
//! same pipeline, Describe, the unnamed statement, Close, and now and then an error that makes
//! PostgreSQL skip the rest of the pipeline (the Parses before it stay, the ones after it
//! never happened). Now and then a client also asks its current server how many statements it
//! holds (`pg_prepared_statements`), which must never exceed the limit.
//!
//! pgmemo also keeps one statement of its own on a server once a transaction block may open
//! there, the guard `pgmemo_s0`. It counts toward the limit and in SHOW SERVERS like any other;
//! `server_statements_never_exceed_the_limit` checks that on a small limit.
//!
//! Each client first parses all the statements in one pipeline; then the load runs in two
//! equal phases. The test process (pgmemo runs in it) reports its VmRSS and its heap in use
//! before the clients connect, with them connected, after each phase and after they leave;
//! the test asserts a generous bound on the growth of VmRSS, and that the second phase, which
//! does the same work again from the same state, adds little heap. At the end every server connection is held at
//! once and its `pg_prepared_statements` count is compared with the limit and with pgmemo's
//! own count in `SHOW SERVERS`.

mod common;

use common::*;
use pgmemo::config::{AuthType, PoolMode};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Client connections, all open at once.
const CLIENTS: usize = 1000;
/// Distinct statements (texts) the clients use.
const STATEMENTS: usize = 200;
/// Server connections in pgmemo's pool.
const POOL_SIZE: u32 = 10;
/// `max_prepared_statements`: well below [`STATEMENTS`], so that servers evict all the time.
const MAX_PREPARED: u32 = 64;
/// Pipelines per client in each of the two phases.
const ROUNDS_PER_PHASE: usize = 20;
/// Every this many pipelines, a client asks its server for its statement count.
const COUNT_EVERY: usize = 4;
/// Mismatches kept in full for the failure message.
const KEEP_PROBLEMS: usize = 5;
/// pgmemo's own statement on a server (see the module documentation).
const GUARD: &str = "pgmemo_s0";
/// Counts the statements on the current server besides the guard, and the guard.
const COUNT_STATEMENTS: &str = "SELECT count(*) FILTER (WHERE name <> 'pgmemo_s0'), \
     count(*) FILTER (WHERE name = 'pgmemo_s0') FROM pg_prepared_statements";

fn statement_sql(k: usize) -> String {
    format!("SELECT $1::int8 * {k} + {k} AS v{k}, 'k{k}'::text AS t")
}

/// Client `c`'s name for statement `k`: a different permutation of the same names per client.
fn statement_name(c: usize, k: usize) -> String {
    format!("q{}", (k * 7 + c) % STATEMENTS)
}

// ---------------------------------------------------------------------------------------------
// Replies, rendered so that expected and actual compare as strings
// ---------------------------------------------------------------------------------------------

fn be_i16(b: &[u8], at: usize) -> i16 {
    i16::from_be_bytes([b[at], b[at + 1]])
}

fn be_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// One reply as a short string: the type and what this test checks of its content.
fn render(msg: &Backend) -> String {
    match msg.tag {
        b'1' => "ParseComplete".into(),
        b'2' => "BindComplete".into(),
        b'3' => "CloseComplete".into(),
        b'D' => {
            let values: Vec<String> = msg
                .data_row()
                .unwrap_or_default()
                .into_iter()
                .map(|v| match v {
                    Some(v) => String::from_utf8_lossy(&v).into_owned(),
                    None => "NULL".into(),
                })
                .collect();
            format!("DataRow({})", values.join(","))
        }
        b'C' => format!("CommandComplete({})", msg.command_tag().unwrap_or_default()),
        b't' => {
            let b = &msg.body;
            let n = be_i16(b, 0) as usize;
            let oids: Vec<String> = (0..n).map(|i| be_u32(b, 2 + 4 * i).to_string()).collect();
            format!("ParameterDescription({})", oids.join(","))
        }
        b'T' => {
            let b = &msg.body;
            let n = be_i16(b, 0) as usize;
            let mut at = 2;
            let mut names = Vec::new();
            for _ in 0..n {
                let end = at + b[at..].iter().position(|&c| c == 0).unwrap_or(0);
                names.push(String::from_utf8_lossy(&b[at..end]).into_owned());
                at = end + 1 + 18;
            }
            format!("RowDescription({})", names.join(","))
        }
        b'E' => format!(
            "ErrorResponse({} {})",
            msg.field(b'C').unwrap_or_default(),
            msg.field(b'M').unwrap_or_default()
        ),
        b'Z' => format!(
            "ReadyForQuery({})",
            msg.ready_status().unwrap_or(b'?') as char
        ),
        _ => msg.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// One client
// ---------------------------------------------------------------------------------------------

/// Counters shared by all clients.
#[derive(Default)]
struct Totals {
    pipelines: AtomicU64,
    executes: AtomicU64,
    replies_checked: AtomicU64,
    errors_provoked: AtomicU64,
    count_samples: AtomicU64,
    max_count_seen: AtomicU64,
    mismatches: AtomicU64,
    problems: Mutex<Vec<String>>,
}

impl Totals {
    fn problem(&self, p: String) {
        self.mismatches.fetch_add(1, Ordering::Relaxed);
        let mut problems = self.problems.lock().unwrap_or_else(|e| e.into_inner());
        if problems.len() < KEEP_PROBLEMS {
            problems.push(p);
        }
    }
}

/// The failing operation of a pipeline, and PostgreSQL's own replies to it up to its
/// ErrorResponse (asked of PostgreSQL directly at the start of the test: the unnamed
/// statement is planned at Bind with its parameter, so `1 / $1` fails there already).
struct Failing {
    msgs: Vec<Frontend>,
    replies: Vec<String>,
}

async fn failing_operation() -> Failing {
    let msgs = vec![
        Frontend::parse("", "SELECT 1 / $1::int4", &[]),
        Frontend::bind("", "", &[Some("0")]),
        Frontend::execute("", 0),
    ];
    let mut direct = RawClient::direct(&[]).await.expect("connect to PostgreSQL");
    let mut pipeline = msgs.clone();
    pipeline.push(Frontend::Sync);
    direct.send(&pipeline).await.unwrap();
    let mut replies: Vec<String> = direct
        .recv_until_ready(1)
        .await
        .unwrap()
        .iter()
        .map(render)
        .collect();
    assert_eq!(
        replies.pop().as_deref(),
        Some("ReadyForQuery(I)"),
        "{replies:?}"
    );
    assert!(
        replies
            .last()
            .is_some_and(|r| r.starts_with("ErrorResponse(22012")),
        "{replies:?}"
    );
    direct.terminate().await.ok();
    Failing { msgs, replies }
}

struct LoadClient {
    id: usize,
    failing: Arc<Failing>,
    raw: RawClient,
    /// Which of the statements this client has parsed under its name (and not closed).
    parsed: Vec<bool>,
    rng: StdRng,
    rounds: usize,
}

impl LoadClient {
    /// A random pipeline ending in Sync, and the replies PostgreSQL gives to it.
    fn pipeline(&mut self, totals: &Totals) -> (Vec<Frontend>, Vec<String>) {
        let ops = self.rng.gen_range(1..=8);
        // One pipeline in 20 fails at a random operation.
        let fail_at = self
            .rng
            .gen_ratio(1, 20)
            .then(|| self.rng.gen_range(0..ops));
        let mut msgs = Vec::new();
        let mut expect = Vec::new();
        // The bookkeeping as it was when the pipeline failed: what follows never happens.
        let mut at_failure = None;
        for op in 0..ops {
            if Some(op) == fail_at {
                msgs.extend(self.failing.msgs.iter().cloned());
                expect.extend(self.failing.replies.iter().cloned());
                at_failure = Some(self.parsed.clone());
                totals.errors_provoked.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let k = self.rng.gen_range(0..STATEMENTS);
            let name = statement_name(self.id, k);
            let sql = statement_sql(k);
            let x: i64 = self.rng.gen_range(-1_000_000_000..1_000_000_000);
            let xs = x.to_string();
            let row = format!("DataRow({},k{k})", x * k as i64 + k as i64);
            let r = self.rng.gen_range(0..100);
            let mut exp: Vec<String> = Vec::new();
            if !self.parsed[k] {
                msgs.push(Frontend::parse(&name, &sql, &[]));
                exp.push("ParseComplete".into());
                self.parsed[k] = true;
            } else if r < 5 {
                // Close and parse the same name again, in the same pipeline.
                msgs.push(Frontend::close_statement(&name));
                msgs.push(Frontend::parse(&name, &sql, &[]));
                exp.push("CloseComplete".into());
                exp.push("ParseComplete".into());
            }
            if (5..12).contains(&r) {
                msgs.push(Frontend::describe_statement(&name));
                exp.push("ParameterDescription(20)".into());
                exp.push(format!("RowDescription(v{k},t)"));
            }
            if (12..20).contains(&r) {
                // The same text as the unnamed statement.
                msgs.extend([
                    Frontend::parse("", &sql, &[]),
                    Frontend::bind("", "", &[Some(&xs)]),
                    Frontend::execute("", 0),
                ]);
                exp.push("ParseComplete".into());
            } else {
                msgs.extend([
                    Frontend::bind("", &name, &[Some(&xs)]),
                    Frontend::execute("", 0),
                ]);
            }
            exp.push("BindComplete".into());
            exp.push(row);
            exp.push("CommandComplete(SELECT 1)".into());
            if (20..24).contains(&r) {
                msgs.push(Frontend::close_statement(&name));
                exp.push("CloseComplete".into());
                self.parsed[k] = false;
            }
            if at_failure.is_none() {
                expect.extend(exp);
                totals.executes.fetch_add(1, Ordering::Relaxed);
            }
        }
        if let Some(parsed) = at_failure {
            self.parsed = parsed;
        }
        msgs.push(Frontend::Sync);
        expect.push("ReadyForQuery(I)".into());
        (msgs, expect)
    }

    /// Parses all [`STATEMENTS`] under this client's names in one pipeline, so that the
    /// two phases of the load start from the same per-client state.
    async fn parse_all(&mut self) -> anyhow::Result<()> {
        let mut msgs: Vec<Frontend> = (0..STATEMENTS)
            .map(|k| Frontend::parse(&statement_name(self.id, k), &statement_sql(k), &[]))
            .collect();
        msgs.push(Frontend::Sync);
        self.raw.send(&msgs).await?;
        let got: Vec<String> = self
            .raw
            .recv_until_ready(1)
            .await?
            .iter()
            .map(render)
            .collect();
        let mut expect = vec!["ParseComplete".to_string(); STATEMENTS];
        expect.push("ReadyForQuery(I)".into());
        anyhow::ensure!(
            got == expect,
            "client {}: parsing all statements gave {got:?}",
            self.id
        );
        self.parsed = vec![true; STATEMENTS];
        Ok(())
    }

    /// Sends one pipeline and checks every reply.
    async fn round(&mut self, totals: &Totals) -> anyhow::Result<()> {
        let (msgs, expect) = self.pipeline(totals);
        self.raw.send(&msgs).await?;
        let got: Vec<String> = self
            .raw
            .recv_until_ready(1)
            .await?
            .iter()
            .map(render)
            .collect();
        totals.pipelines.fetch_add(1, Ordering::Relaxed);
        totals
            .replies_checked
            .fetch_add(expect.len() as u64, Ordering::Relaxed);
        if got != expect {
            totals.problem(format!(
                "client {} sent {msgs:?}\n  expected {expect:?}\n  got      {got:?}",
                self.id
            ));
        }
        self.rounds += 1;
        if self.rounds.is_multiple_of(COUNT_EVERY) {
            self.count_server_statements(totals).await?;
        }
        Ok(())
    }

    /// Asks the current server how many statements it holds; never more than the limit.
    async fn count_server_statements(&mut self, totals: &Totals) -> anyhow::Result<()> {
        self.raw.send(&[Frontend::query(COUNT_STATEMENTS)]).await?;
        let replies = self.raw.recv_until_ready(1).await?;
        let n: Option<u64> = replies.iter().find_map(|m| {
            let row = m.data_row()?;
            String::from_utf8(row.first()?.clone()?).ok()?.parse().ok()
        });
        totals.count_samples.fetch_add(1, Ordering::Relaxed);
        match n {
            Some(n) => {
                totals.max_count_seen.fetch_max(n, Ordering::Relaxed);
                if n > u64::from(MAX_PREPARED) {
                    totals.problem(format!(
                        "client {}: a server holds {n} statements, more than max_prepared_statements = {MAX_PREPARED}",
                        self.id
                    ));
                }
            }
            None => totals.problem(format!(
                "client {}: {COUNT_STATEMENTS} gave {:?}",
                self.id,
                replies.iter().map(render).collect::<Vec<_>>()
            )),
        }
        Ok(())
    }
}

/// Runs [`ROUNDS_PER_PHASE`] pipelines on every client at once.
async fn phase(clients: Vec<LoadClient>, totals: &Arc<Totals>) -> Vec<LoadClient> {
    let mut tasks = tokio::task::JoinSet::new();
    for mut client in clients {
        let totals = totals.clone();
        tasks.spawn(async move {
            for _ in 0..ROUNDS_PER_PHASE {
                if let Err(e) = client.round(&totals).await {
                    panic!("client {}: {e:#}", client.id);
                }
            }
            client
        });
    }
    let mut clients = Vec::with_capacity(CLIENTS);
    while let Some(done) = tasks.join_next().await {
        clients.push(done.expect("a load client failed"));
    }
    clients
}

/// SHOW SERVERS through the admin console: backend pid → pgmemo's count of statements.
async fn show_servers_statements(addr: std::net::SocketAddr) -> HashMap<i32, u64> {
    let mut admin = RawClient::connect(addr, PGMEMO_USER, "pgmemo", None, &[])
        .await
        .expect("admin console");
    admin
        .send(&[Frontend::query("SHOW SERVERS")])
        .await
        .unwrap();
    let replies = admin.recv_until_ready(1).await.unwrap();
    let desc = replies
        .iter()
        .find(|m| m.tag == b'T')
        .expect("SHOW SERVERS has columns");
    let columns: Vec<String> = render(desc)
        .trim_start_matches("RowDescription(")
        .trim_end_matches(')')
        .split(',')
        .map(str::to_owned)
        .collect();
    let col = |name: &str| {
        columns
            .iter()
            .position(|c| c == name)
            .unwrap_or_else(|| panic!("SHOW SERVERS has no {name} column: {columns:?}"))
    };
    let (pid_col, count_col) = (col("remote_pid"), col("prepared_statements"));
    let text = |v: &Option<Vec<u8>>| String::from_utf8(v.clone().unwrap_or_default()).unwrap();
    let servers = replies
        .iter()
        .filter_map(Backend::data_row)
        .map(|row| {
            (
                text(&row[pid_col]).parse().unwrap(),
                text(&row[count_col]).parse().unwrap(),
            )
        })
        .collect();
    admin.terminate().await.ok();
    servers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_clients_two_hundred_statements_pool_of_ten() {
    raise_nofile(2 * CLIENTS as u64 + 512);
    let mut config = test_config(PoolMode::Transaction, POOL_SIZE);
    // Trust: the test is about statements, not about 1000 SCRAM exchanges.
    config.general.auth_type = AuthType::Trust;
    config.general.max_client_conn = CLIENTS as u32 + 50;
    config.general.prepared_statements = true;
    config.general.max_prepared_statements = MAX_PREPARED;
    let proxy = start_pgmemo(config).await;
    let addr = proxy.local_addr();
    let started = Instant::now();
    let rss_start = proc_status_kib("VmRSS");
    let heap_start = heap_in_use_kib();

    // Connect every client (a few dozen at a time, so that the listen backlog never
    // overflows), have each parse all the statements, and keep them all connected.
    let failing = Arc::new(failing_operation().await);
    let connecting = Arc::new(tokio::sync::Semaphore::new(50));
    let mut tasks = tokio::task::JoinSet::new();
    for id in 0..CLIENTS {
        let connecting = connecting.clone();
        let failing = failing.clone();
        tasks.spawn(async move {
            let _permit = connecting.acquire().await.unwrap();
            let raw = RawClient::connect(addr, PGMEMO_USER, TEST_DB, None, &[])
                .await
                .unwrap_or_else(|e| panic!("client {id}: {e:#}"));
            let mut client = LoadClient {
                id,
                failing,
                raw,
                parsed: vec![false; STATEMENTS],
                rng: StdRng::seed_from_u64(0x5eed_0000 + id as u64),
                rounds: 0,
            };
            client
                .parse_all()
                .await
                .unwrap_or_else(|e| panic!("client {id}: {e:#}"));
            client
        });
    }
    let mut clients = Vec::with_capacity(CLIENTS);
    while let Some(done) = tasks.join_next().await {
        clients.push(done.expect("a client could not connect"));
    }
    let connected_in = started.elapsed();
    let rss_connected = proc_status_kib("VmRSS");
    let heap_connected = heap_in_use_kib();

    let totals = Arc::new(Totals::default());
    let t1 = Instant::now();
    let clients = phase(clients, &totals).await;
    let phase1 = t1.elapsed();
    let rss_phase1 = proc_status_kib("VmRSS");
    let heap_phase1 = heap_in_use_kib();
    let t2 = Instant::now();
    let clients = phase(clients, &totals).await;
    let phase2 = t2.elapsed();
    let rss_phase2 = proc_status_kib("VmRSS");
    let heap_phase2 = heap_in_use_kib();

    // Hold every server at once (an open transaction each) and ask each how many statements
    // it holds; compare with the limit and with pgmemo's own count.
    let mut holders = Vec::new();
    let mut actual = HashMap::new();
    let mut guards = 0;
    for _ in 0..POOL_SIZE {
        let mut c = RawClient::connect(addr, PGMEMO_USER, TEST_DB, None, &[])
            .await
            .unwrap();
        c.send(&[Frontend::query(
            "BEGIN; SELECT pg_backend_pid(), count(*) FILTER (WHERE name <> 'pgmemo_s0'), \
             count(*) FILTER (WHERE name = 'pgmemo_s0') FROM pg_prepared_statements",
        )])
        .await
        .unwrap();
        let replies = c.recv_until_ready(1).await.unwrap();
        let row: Vec<String> = replies
            .iter()
            .find_map(Backend::data_row)
            .expect("a row")
            .into_iter()
            .map(|v| String::from_utf8(v.unwrap()).unwrap())
            .collect();
        // The guard counts toward the limit and in SHOW SERVERS like any statement.
        let (pid, others, guard): (i32, u64, u64) = (
            row[0].parse().unwrap(),
            row[1].parse().unwrap(),
            row[2].parse().unwrap(),
        );
        let count = others + guard;
        guards += usize::from(guard != 0);
        assert!(
            actual.insert(pid, count).is_none(),
            "server {pid} handed out twice while held"
        );
        holders.push(c);
    }
    let reported = show_servers_statements(addr).await;
    for c in &mut holders {
        c.send(&[Frontend::query("COMMIT")]).await.unwrap();
        c.recv_until_ready(1).await.unwrap();
    }

    let clients_len = clients.len();
    for client in clients {
        client.raw.terminate().await.ok();
    }
    for c in holders {
        c.terminate().await.ok();
    }
    proxy.shutdown().await;
    let rss_end = proc_status_kib("VmRSS");
    let heap_end = heap_in_use_kib();
    let hwm = proc_status_kib("VmHWM");

    let pipelines = totals.pipelines.load(Ordering::Relaxed);
    println!(
        "prepared load: {clients_len} clients x {STATEMENTS} statements, pool of {POOL_SIZE}, \
         max_prepared_statements = {MAX_PREPARED}\n\
         connected in {connected_in:.1?}; phase 1 {phase1:.1?}, phase 2 {phase2:.1?} \
         ({:.0} pipelines/s)\n\
         {pipelines} pipelines, {} executes, {} replies checked, {} pipelines failed on purpose, \
         {} mismatches\n\
         server statement counts besides the guard {GUARD}: sampled {} times during the load, \
         max {}; at the end (pid: pg_prepared_statements / SHOW SERVERS) {:?}; \
         the guard on {guards} of {POOL_SIZE} servers\n\
         test process (pgmemo + {clients_len} raw clients with a 64 KiB read buffer each), \
         VmRSS / heap in use: start {:.1} / {:.1} MiB, connected with all statements parsed \
         {:.1} / {:.1} MiB, after phase 1 {:.1} / {:.1} MiB, after phase 2 {:.1} / {:.1} MiB, \
         after shutdown {:.1} / {:.1} MiB; peak VmRSS {:.1} MiB",
        pipelines as f64 / (phase1 + phase2).as_secs_f64(),
        totals.executes.load(Ordering::Relaxed),
        totals.replies_checked.load(Ordering::Relaxed),
        totals.errors_provoked.load(Ordering::Relaxed),
        totals.mismatches.load(Ordering::Relaxed),
        totals.count_samples.load(Ordering::Relaxed),
        totals.max_count_seen.load(Ordering::Relaxed),
        {
            let mut v: Vec<_> = actual
                .iter()
                .map(|(pid, n)| {
                    format!(
                        "{pid}: {n}/{}",
                        reported.get(pid).map_or("?".into(), |r| r.to_string())
                    )
                })
                .collect();
            v.sort();
            v
        },
        mib(rss_start),
        mib(heap_start),
        mib(rss_connected),
        mib(heap_connected),
        mib(rss_phase1),
        mib(heap_phase1),
        mib(rss_phase2),
        mib(heap_phase2),
        mib(rss_end),
        mib(heap_end),
        mib(hwm),
    );

    let problems = totals.problems.lock().unwrap().join("\n");
    assert_eq!(
        totals.mismatches.load(Ordering::Relaxed),
        0,
        "wrong replies or over-full servers under load (first {KEEP_PROBLEMS}):\n{problems}"
    );
    assert_eq!(
        pipelines,
        (CLIENTS * ROUNDS_PER_PHASE * 2) as u64,
        "every pipeline ran"
    );
    for (pid, n) in &actual {
        assert!(
            *n <= u64::from(MAX_PREPARED),
            "server {pid} holds {n} statements, more than {MAX_PREPARED}"
        );
        assert_eq!(
            reported.get(pid),
            Some(n),
            "SHOW SERVERS disagrees with pg_prepared_statements for server {pid}"
        );
    }
    assert_eq!(
        actual.len(),
        POOL_SIZE as usize,
        "the pool used all its servers"
    );
    // Generous bounds. The whole process, clients included, stays within 256 MiB of where it
    // started (it takes about 80 MiB, 62.5 MiB of which are the clients' read buffers). The
    // second phase, the same work again from the same state, adds less than 16 MiB of heap
    // (about 1 MiB measured): memory does not grow with the work done. VmRSS is not used for
    // that: it grows as the clients' read buffers are first touched.
    assert!(
        rss_phase2.saturating_sub(rss_start) < 256 * 1024,
        "VmRSS grew from {:.1} to {:.1} MiB",
        mib(rss_start),
        mib(rss_phase2)
    );
    assert!(
        heap_phase2.saturating_sub(heap_phase1) < 16 * 1024,
        "the second phase grew the heap in use from {:.1} to {:.1} MiB",
        mib(heap_phase1),
        mib(heap_phase2)
    );
}

/// Every statement on a server counts toward `max_prepared_statements`, pgmemo's own
/// included: with a limit of 2 and one server, a client that opens a transaction block and
/// uses three statements leaves at most two on the server, and SHOW SERVERS says how many.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_statements_never_exceed_the_limit() {
    let mut config = test_config(PoolMode::Transaction, 1);
    config.general.auth_type = AuthType::Trust;
    config.general.max_prepared_statements = 2;
    let proxy = start_pgmemo(config).await;
    let addr = proxy.local_addr();
    let mut c = RawClient::connect(addr, PGMEMO_USER, TEST_DB, None, &[])
        .await
        .unwrap();
    c.send(&[Frontend::query("BEGIN")]).await.unwrap();
    c.recv_until_ready(1).await.unwrap();
    for k in 0..3 {
        let name = format!("s{k}");
        c.send(&[
            Frontend::parse(&name, &format!("SELECT {k}"), &[]),
            Frontend::bind("", &name, &[]),
            Frontend::execute("", 0),
            Frontend::Sync,
        ])
        .await
        .unwrap();
        let got: Vec<String> = c
            .recv_until_ready(1)
            .await
            .unwrap()
            .iter()
            .map(render)
            .collect();
        assert_eq!(
            got,
            [
                "ParseComplete".to_string(),
                "BindComplete".into(),
                format!("DataRow({k})"),
                "CommandComplete(SELECT 1)".into(),
                "ReadyForQuery(T)".into()
            ]
        );
    }
    c.send(&[Frontend::query(
        "SELECT count(*), string_agg(name, ',' ORDER BY name) FROM pg_prepared_statements",
    )])
    .await
    .unwrap();
    let replies = c.recv_until_ready(1).await.unwrap();
    let row = replies.iter().find_map(Backend::data_row).expect("a row");
    let text = |v: &Option<Vec<u8>>| String::from_utf8(v.clone().unwrap_or_default()).unwrap();
    let (count, names): (u64, String) = (text(&row[0]).parse().unwrap(), text(&row[1]));
    c.send(&[Frontend::query("COMMIT")]).await.unwrap();
    c.recv_until_ready(1).await.unwrap();
    let reported: Vec<u64> = show_servers_statements(addr).await.into_values().collect();
    c.terminate().await.ok();
    proxy.shutdown().await;
    assert!(
        count <= 2,
        "with max_prepared_statements = 2 the server holds {count} statements: {names}"
    );
    assert_eq!(
        reported,
        [count],
        "SHOW SERVERS prepared_statements against pg_prepared_statements ({names})"
    );
}
