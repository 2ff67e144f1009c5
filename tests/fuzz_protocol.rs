//! Protocol-level differential fuzzing: mutated streams of frontend messages (from the
//! `frontend` seed corpus of `tests/fuzz.rs`) are sent after login to PostgreSQL directly and
//! through pgmemo, and what comes back must be the same.
//!
//! Each stream (its whole messages) is followed by Sync and a query that marks its end: valid
//! messages are answered, a malformed one ends the session with PostgreSQL's error.
//! `PGMEMO_FUZZ_STREAMS=N` sets the count, `PGMEMO_FUZZ_SEED=S` replays a run.

mod common;
#[allow(dead_code)]
#[path = "fuzz/harness.rs"]
mod harness;

use common::*;
use pgmemo::config::PoolMode;

/// The whole messages at the start of `input` (up to the first one cut short or with an
/// impossible length, or Terminate: `tests/bad_input.rs` covers those, and either would leave the servers
/// waiting for bytes that never come), then Sync and a query whose row marks the end.
fn stream(input: &[u8]) -> Vec<u8> {
    let mut at = 0;
    while let Ok(Some((tag, len))) = pgmemo::protocol::frame(
        &input[at..],
        pgmemo::protocol::frontend::max_message_len(tag_at(input, at), 1 << 20),
    ) {
        if tag == b'X' {
            // Replies before a Terminate: tests/differential.rs
            // (`messages_before_a_terminate_are_answered_as_by_postgres`). After a batch left
            // open, what PostgreSQL sends depends on what it had flushed.
            break;
        }
        at += len;
    }
    let mut bytes = input[..at].to_vec();
    bytes.extend_from_slice(&tagged(b'S', b""));
    bytes.extend_from_slice(&tagged(b'Q', b"SELECT 'end of stream'\0"));
    bytes
}

fn tag_at(input: &[u8], at: usize) -> u8 {
    input.get(at).copied().unwrap_or(0)
}

/// Every reply to `stream(input)`, up to the end marker's ReadyForQuery or the server
/// hanging up.
async fn replies(mut client: RawClient, input: &[u8]) -> Vec<String> {
    client.send_raw(&stream(input)).await.unwrap();
    let mut msgs = Vec::new();
    let mut ended = false;
    loop {
        match client.recv().await {
            Ok(msg) => {
                let ready = msg.ready_status().is_some();
                ended |= msg
                    .data_row()
                    .is_some_and(|row| row[0].as_deref() == Some(&b"end of stream"[..]));
                msgs.push(msg);
                if ready && ended {
                    break;
                }
            }
            Err(e) if format!("{e:#}") == "connection closed" => break,
            Err(e) => {
                let mut lines = summary(&msgs);
                lines.push(format!("!! {e:#}"));
                return lines;
            }
        }
    }
    summary(&msgs)
}

/// The messages [`normalize`]d, errors as (severity, SQLSTATE, message): an error pgmemo
/// raises itself names no PostgreSQL source file and line.
fn summary(msgs: &[Backend]) -> Vec<String> {
    let mut normalizer = Normalizer::default();
    msgs.iter()
        .map(|m| match m.is_error() {
            true => format!("{:?}", error_triple(m)),
            false => normalizer.line(m),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_message_streams_match_postgres() {
    let mut config = test_config(PoolMode::Transaction, 2);
    config.cache.enabled = true;
    let proxy = start_pgmemo(config).await;
    let streams = harness::env("PGMEMO_FUZZ_STREAMS").unwrap_or(200);
    let seed = harness::env("PGMEMO_FUZZ_SEED").unwrap_or(37);
    let mut rng = harness::Rng(seed);
    let pool = harness::seeds("frontend");
    let mut input = Vec::new();
    for i in 0..pool.len() as u64 + streams {
        if (i as usize) < pool.len() {
            input.clone_from(&pool[i as usize]);
        } else {
            harness::mutate(
                &mut rng,
                &pool,
                &[b"\0", b"S", b"P", b"B", b"E", b"Q"],
                &mut input,
            );
        }
        let direct = replies(RawClient::direct(&[]).await.unwrap(), &input).await;
        let proxied = RawClient::through(proxy.local_addr(), &[]).await.unwrap();
        let proxied = replies(proxied, &input).await;
        if let Some(diff) = diff(&direct, &proxied) {
            let path = harness::save("protocol", "diff", &input);
            panic!(
                "stream {i} (seed {seed}) {}: {diff}\nwritten to {}",
                harness::show(&input),
                path.display()
            );
        }
    }
}
