//! The client timeouts the janitor enforces each second, as PgBouncer's janitor does:
//! `query_timeout`, `idle_transaction_timeout` and `client_idle_timeout`.
//!
//! They read what every client publishes anyway (its state, when it last sent something,
//! when its query began: SHOW CLIENTS' columns), so a session pays nothing for them. A client
//! past one is killed with the reason ([`ClientInfo::kill_for`]): its session ends at its next
//! wake, tells the client in PgBouncer's words, and gives back its server as for the
//! console's KILL_CLIENT (a running query is cancelled and its server closed).

use crate::app::{App, ClientState, KillReason};
use std::time::Duration;

/// Kills the clients past `query_timeout`, `idle_transaction_timeout` or
/// `client_idle_timeout`.
pub fn enforce(app: &App) {
    let config = app.config.load();
    let (query, idle) = (
        config.general.query_timeout,
        config.general.client_idle_timeout,
    );
    let idle_tx = config.general.idle_transaction_timeout;
    if query.is_zero() && idle.is_zero() && idle_tx.is_zero() {
        return;
    }
    let now_us = app.clock_us();
    let now_secs = app.unix_secs(now_us);
    for client in app.clients() {
        if client.is_killed() {
            continue;
        }
        let query_age = client.query_age_us(now_us).map(Duration::from_micros);
        if !query.is_zero() && query_age.is_some_and(|age| age > query) {
            tracing::info!(client = %client.addr, "closing a client: query_timeout");
            client.kill_for(KillReason::QueryTimeout);
            continue;
        }
        let idle_tx_age = client
            .idle_in_transaction_us(now_us)
            .map(Duration::from_micros);
        if !idle_tx.is_zero()
            && client.state() == ClientState::Active
            && idle_tx_age.is_some_and(|age| age > idle_tx)
        {
            tracing::info!(client = %client.addr, "closing a client: idle_transaction_timeout");
            client.kill_for(KillReason::IdleTransactionTimeout);
            continue;
        }
        let idle_for =
            Duration::from_secs(u64::from(now_secs.saturating_sub(client.request_secs())));
        if !idle.is_zero() && client.state() == ClientState::Idle && idle_for >= idle {
            tracing::info!(client = %client.addr, "closing a client: client_idle_timeout");
            client.kill_for(KillReason::ClientIdleTimeout);
        }
    }
}
