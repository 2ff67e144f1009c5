//! Cancel requests through pgmemo land on the statement they were aimed at: one that runs
//! when the request is made, never the client's next statement, nor another client's after the
//! server went back to the pool. Clients cancel with tokio-postgres's `CancelToken`, as
//! applications do, through pgmemo in transaction mode with few servers, running simple
//! queries (autoprepared and not) and prepared statements of the extended protocol.

mod common;

use common::*;
use pgmemo::config::PoolMode;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;
use tokio_postgres::error::SqlState;
use tokio_postgres::{CancelToken, Client, NoTls};

/// One statement a client ran: from its sending to its answer, and whether it was cancelled.
struct Ran {
    sql: String,
    start: Instant,
    end: Instant,
    cancelled: bool,
}

/// One cancel request: from when the client began it to when pgmemo closed its connection
/// (as libpq's PQcancel waits for: by then it has been passed on).
struct Sent {
    begin: Instant,
    done: Instant,
}

/// A random statement that sleeps short (up to 4 ms) or long (20 to 80 ms): a simple query
/// that autoprepare runs as a prepared statement, a prepared statement of the extended
/// protocol (`sleep`), or a simple query of two statements, which runs as it is.
async fn random_statement(
    client: &Client,
    sleep: &tokio_postgres::Statement,
    rng: &mut Rng,
    i: usize,
) -> Ran {
    let ms = if rng.chance(70) {
        rng.below(5)
    } else {
        20 + rng.below(61)
    };
    let seconds = ms as f64 / 1000.0;
    let start = Instant::now();
    let (sql, result) = match rng.below(3) {
        0 => {
            let sql = format!("SELECT pg_sleep({seconds}), {i}");
            let result = client.simple_query(&sql).await.map(drop);
            (sql, result)
        }
        1 => {
            let result = client
                .query(sleep, &[&seconds, &(i as i32)])
                .await
                .map(drop);
            (format!("EXECUTE sleep({seconds}, {i})"), result)
        }
        _ => {
            let sql = format!("SELECT pg_sleep({seconds}); SELECT {i}");
            let result = client.simple_query(&sql).await.map(drop);
            (sql, result)
        }
    };
    let cancelled = match result {
        Ok(()) => false,
        Err(e) if e.code() == Some(&SqlState::QUERY_CANCELED) => true,
        Err(e) => panic!("{sql}: {e:?}"),
    };
    Ran {
        sql,
        start,
        end: Instant::now(),
        cancelled,
    }
}

/// Cancels through pgmemo at `addr` at random moments (0 to 15 ms apart, one at a time) until
/// `stop` is set.
async fn cancel_now_and_then(
    token: CancelToken,
    addr: SocketAddr,
    seed: u64,
    stop: Arc<AtomicBool>,
) -> Vec<Sent> {
    let mut rng = Rng(seed);
    let mut sent = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        // Spreads the requests over the statements' lifetimes (not waiting for anything).
        tokio::time::sleep(Duration::from_micros(rng.below(15_000) as u64)).await;
        let begin = Instant::now();
        let mut tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        token
            .cancel_query_raw(&mut tcp, NoTls)
            .await
            .expect("cancel request");
        let mut rest = Vec::new();
        tcp.read_to_end(&mut rest).await.expect("pgmemo closes");
        sent.push(Sent {
            begin,
            done: Instant::now(),
        });
    }
    sent
}

/// The cancelled statements that no cancel request of the client accounts for: each must
/// overlap a request of its own (begun before the statement's answer, done after it was sent).
/// One request cancels one statement: a second cancelled by the same request is the next
/// statement, hit by a signal that arrived late.
fn unaccounted<'a>(ran: &'a [Ran], sent: &[Sent]) -> Vec<&'a Ran> {
    let mut used = vec![false; sent.len()];
    let mut left = Vec::new();
    for statement in ran.iter().filter(|r| r.cancelled) {
        let request = sent
            .iter()
            .enumerate()
            .position(|(i, c)| !used[i] && c.begin <= statement.end && c.done >= statement.start);
        match request {
            Some(i) => used[i] = true,
            None => left.push(statement),
        }
    }
    left
}

/// Six clients on two servers run short and long statements for a few seconds while each is
/// cancelled at random moments: every 57014 is the answer to a statement that ran when a
/// request of its own client was made, one statement per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancels_land_on_the_statement_they_were_aimed_at() {
    let mut config = test_config(PoolMode::Transaction, 2);
    config.general.autoprepare_threshold = 1;
    let proxy = start_pgmemo(config).await;
    let addr = proxy.local_addr();
    let url = proxy_url(addr, PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let run_for = Duration::from_secs(6);
    let mut clients = Vec::new();
    for c in 0..6u64 {
        let url = url.clone();
        clients.push(tokio::spawn(async move {
            let client = connect(&url).await;
            let sleep = client
                .prepare("SELECT pg_sleep($1::float8), $2::int4")
                .await
                .unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let canceller = tokio::spawn(cancel_now_and_then(
                client.cancel_token(),
                addr,
                c * 7919 + 1,
                stop.clone(),
            ));
            let mut rng = Rng(c * 104_729 + 3);
            let mut ran = Vec::new();
            let until = Instant::now() + run_for;
            while Instant::now() < until {
                let i = ran.len();
                ran.push(random_statement(&client, &sleep, &mut rng, i).await);
            }
            stop.store(true, Ordering::Relaxed);
            let sent = canceller.await.unwrap();
            // Every request has been passed on: nothing is left to cancel what comes next.
            client
                .simple_query("SELECT 'after the cancels'")
                .await
                .unwrap();
            (ran, sent)
        }));
    }
    let (mut statements, mut requests, mut cancelled) = (0, 0, 0);
    let mut failures = Vec::new();
    for (c, client) in clients.into_iter().enumerate() {
        let (ran, sent) = client.await.unwrap();
        statements += ran.len();
        requests += sent.len();
        cancelled += ran.iter().filter(|r| r.cancelled).count();
        for statement in unaccounted(&ran, &sent) {
            // The client's requests made last before the statement's answer, and first after.
            let after = sent.partition_point(|r| r.begin <= statement.end);
            let near: Vec<_> = sent[after.saturating_sub(1)..(after + 1).min(sent.len())]
                .iter()
                .map(|r| {
                    let at = |t: Instant| match t.checked_duration_since(statement.start) {
                        Some(after) => format!("+{after:?}"),
                        None => format!("-{:?}", statement.start - t),
                    };
                    format!("request from {} to {}", at(r.begin), at(r.done))
                })
                .collect();
            failures.push(format!(
                "client {c}: {} cancelled, answered after {:?}; requests around it (from its start): {near:?}",
                statement.sql,
                statement.end - statement.start,
            ));
        }
    }
    println!(
        "{statements} statements, {requests} cancel requests, {cancelled} statements cancelled"
    );
    assert!(
        failures.is_empty(),
        "{} statement(s) cancelled with no request of their own:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        cancelled >= 50 && requests >= 200,
        "too little happened: {requests} requests, {cancelled} cancelled"
    );
    proxy.shutdown().await;
}
