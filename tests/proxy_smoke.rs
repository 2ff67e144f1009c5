//! The smallest end-to-end check: a query through pgmemo in each pool mode.

mod common;
use common::*;
use pgmemo::config::PoolMode;

#[tokio::test]
async fn a_query_runs_through_pgmemo_in_both_modes() {
    for mode in [PoolMode::Transaction, PoolMode::Session] {
        let proxy = pgmemo(mode, 2).await;
        let mut client = RawClient::through(proxy.local_addr(), &[])
            .await
            .expect("login through pgmemo");
        client
            .send(&[Frontend::query("SELECT 40 + 2")])
            .await
            .unwrap();
        let replies = client.recv_until_ready(1).await.unwrap();
        let row = replies.iter().find_map(|m| m.data_row()).expect("a row");
        assert_eq!(row[0].as_deref(), Some(&b"42"[..]), "{mode:?}");
        proxy.shutdown().await;
    }
}
