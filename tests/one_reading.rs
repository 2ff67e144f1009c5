//! A simple query's text is lexed once per message, however many features read it: the result
//! cache (its key and its shape's decision) and autoprepare (its statement and Bind) share the
//! session's one reading (`query::Reader`). The lexer counts its passes in debug builds
//! (`query::lexer::PASSES`); this file holds one test, so no other test's pgmemo lexes in
//! the same process while it counts. The count exists in debug builds only: `cargo test
//! --release` builds this file empty.
#![cfg(debug_assertions)]

mod common;

use common::*;
use pgmemo::config::PoolMode;
use std::sync::atomic::Ordering::Relaxed;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_simple_query_is_lexed_once() {
    fresh_db("one_reading").await;
    let mut config = test_config(PoolMode::Transaction, 2);
    config.cache.enabled = true;
    config.cache.admit_after = 1;
    config.cache.rules = vec![cache_rule("numbers", "generate_series")];
    config.general.autoprepare_threshold = 1;
    let proxy = start_pgmemo(config).await;
    let mut client = RawClient::connect(
        proxy.local_addr(),
        PGMEMO_USER,
        "one_reading",
        Some(PGMEMO_PASS),
        &[],
    )
    .await
    .expect("login through pgmemo");
    // Misses (each text new to the cache, stored), then hits of the first tier and of the
    // second, and queries the cache does not want but autoprepare runs as statements.
    let mut queries: Vec<String> = (0..40)
        .map(|i| format!("SELECT count(*) FROM generate_series(1, {i})"))
        .collect();
    queries.extend((0..40).map(|i| format!("SELECT count(*) FROM generate_series(1, {i})")));
    queries.extend((0..40).map(|i| format!("SELECT {i} + 1, 'text {i}'")));
    for sql in &queries {
        client.send(&[Frontend::query(sql)]).await.unwrap();
        let replies = client.recv_until_ready(1).await.unwrap();
        assert!(!replies.iter().any(Backend::is_error), "{sql}: {replies:?}");
    }
    let passes = pgmemo::query::lexer::PASSES.load(Relaxed);
    let rule = proxy
        .app()
        .cache
        .rule_stats()
        .into_iter()
        .find(|r| r.name == "numbers")
        .expect("the rule's counters");
    let (hits, misses) = (rule.hits.get(), rule.misses.get());
    let autoprepared = autoprepared(&proxy);
    println!(
        "{} queries: {passes} lexer passes, cache hits {hits} misses {misses}, autoprepared {autoprepared}",
        queries.len()
    );
    assert!(hits >= 40, "the second round was answered from the cache");
    assert!(autoprepared > 0, "the last round was autoprepared");
    assert!(
        passes <= queries.len() as u64,
        "{passes} lexer passes for {} queries: a query was read twice",
        queries.len()
    );
    client.terminate().await.unwrap();
}
