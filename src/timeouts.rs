//! The client timeouts the janitor enforces each second, as PgBouncer's janitor does:
//! `query_timeout`, `idle_transaction_timeout`, `transaction_timeout` and
//! `client_idle_timeout`, each the client's user's own (`[users.NAME]`) over the general one.
//!
//! They read what every client publishes anyway (its state, when it last sent something,
//! when its query and its transaction began: SHOW CLIENTS' columns), so a session pays
//! nothing for them. A client past one is killed with the reason ([`ClientInfo::kill_for`]):
//! its session ends at its next wake, tells the client in PgBouncer's words, and gives back
//! its server as for the console's KILL_CLIENT (a running query is cancelled and its server
//! closed).

use crate::app::{App, ClientInfo, ClientState, KillReason};
use crate::config::ClientTimeouts;
use std::time::Duration;

/// Kills the clients past `query_timeout`, `idle_transaction_timeout`,
/// `transaction_timeout` or `client_idle_timeout`.
pub fn enforce(app: &App) {
    let config = app.config.load();
    let general = config.general_timeouts();
    let per_user = config.any_user_timeouts();
    if general.none() && !per_user {
        return;
    }
    let now_us = app.clock_us();
    let now_secs = app.unix_secs(now_us);
    for client in app.clients() {
        if client.is_killed() {
            continue;
        }
        let limits = if per_user {
            config.user_timeouts(&client.user, general)
        } else {
            general
        };
        if let Some(reason) = past(&client, &limits, now_us, now_secs) {
            tracing::info!(client = %client.addr, "closing a client: {}", setting(reason));
            client.kill_for(reason);
        }
    }
}

/// The timeout `client` is past at `now_us` ([`App::clock_us`], `now_secs` its
/// [`App::unix_secs`]), in PgBouncer's order; None when none.
fn past(
    client: &ClientInfo,
    limits: &ClientTimeouts,
    now_us: u64,
    now_secs: u32,
) -> Option<KillReason> {
    let over = |limit: Duration, age_us: Option<u64>| {
        !limit.is_zero() && age_us.is_some_and(|age| Duration::from_micros(age) > limit)
    };
    if over(limits.query, client.query_age_us(now_us)) {
        return Some(KillReason::QueryTimeout);
    }
    let active = client.state() == ClientState::Active;
    if active
        && over(
            limits.idle_transaction,
            client.idle_in_transaction_us(now_us),
        )
    {
        return Some(KillReason::IdleTransactionTimeout);
    }
    // Not only while it holds a server: the start of a transaction waiting for a server
    // counts as its query's wait does for query_timeout.
    if over(limits.transaction, client.transaction_age_us(now_us)) {
        return Some(KillReason::TransactionTimeout);
    }
    let idle_for = Duration::from_secs(u64::from(now_secs.saturating_sub(client.request_secs())));
    if !limits.client_idle.is_zero()
        && client.state() == ClientState::Idle
        && idle_for >= limits.client_idle
    {
        return Some(KillReason::ClientIdleTimeout);
    }
    None
}

/// The setting behind `reason`, for the log.
fn setting(reason: KillReason) -> &'static str {
    match reason {
        KillReason::QueryTimeout => "query_timeout",
        KillReason::IdleTransactionTimeout => "idle_transaction_timeout",
        KillReason::TransactionTimeout => "transaction_timeout",
        KillReason::ClientIdleTimeout => "client_idle_timeout",
        KillReason::Console => "console",
    }
}
