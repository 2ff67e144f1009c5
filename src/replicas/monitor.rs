//! A set's monitor: every [`EVERY`], the primary's WAL position and each replica's replay
//! position, read over connections of its own, give each replica its lag and say whether it
//! is up; the catalog of what replicas may run is read from one of them when it is older
//! than [`super::catalog::CATALOG_REFRESH`] (before it stops being trusted).
//!
//! The primary's position is read twice: its WAL's (for the replicas' lag) and a position
//! past every commit inserted before the question (see [`super::Replicas::covering_after`]:
//! what a result cache fill on a replica waits for).
//!
//! The positions read here are what routing trusts without asking: a replica whose monitor
//! connection fails is marked down (no reads, its position forgotten) until it answers again
//! as a standby. A session that needs a position past what is known asks the replica itself
//! (see `Session::acquire_replica`).

use std::sync::{Arc, Weak};
use std::time::Duration;

use super::catalog::{Catalog, CATALOG_SQL};
use super::{Replica, Replicas};
use crate::lsn;
use crate::server::ServerConn;

/// How often positions are read.
pub const EVERY: Duration = Duration::from_millis(100);

/// After a failed connection to a server, how long before the next attempt.
const RETRY: Duration = Duration::from_secs(1);

/// The primary's position (NULL on a server that is in recovery: no longer the primary).
const PRIMARY_SQL: &str =
    "SELECT CASE WHEN pg_catalog.pg_is_in_recovery() THEN NULL ELSE pg_catalog.pg_current_wal_lsn() END";

/// A replica's replay position (NULL on a server that is not in recovery: promoted, no
/// standby any more).
const REPLICA_SQL: &str =
    "SELECT CASE WHEN pg_catalog.pg_is_in_recovery() THEN pg_catalog.pg_last_wal_replay_lsn() END";

pub(super) fn start(set: &Arc<Replicas>) {
    let weak = Arc::downgrade(set);
    tokio::spawn(run(weak));
}

/// One connection the monitor keeps, and when it may try again after a failure.
#[derive(Default)]
struct Link {
    conn: Option<ServerConn>,
    retry_at: Option<std::time::Instant>,
}

impl Link {
    /// The first column of `sql`'s first row on this link's server (connecting first when
    /// needed); Err when the server could not be reached or failed the query.
    async fn ask(
        &mut self,
        target: &crate::server::ServerTarget,
        sql: &str,
    ) -> Result<Option<String>, ()> {
        if self.conn.is_none() {
            if self
                .retry_at
                .is_some_and(|at| std::time::Instant::now() < at)
            {
                return Err(());
            }
            match ServerConn::connect(target).await {
                Ok(conn) => self.conn = Some(conn),
                Err(e) => {
                    tracing::debug!(host = %target.host, port = target.port, error = %e, "replica monitor: no connection");
                    self.retry_at = Some(std::time::Instant::now() + RETRY);
                    return Err(());
                }
            }
        }
        match self.rows(sql, RETRY).await {
            Some(rows) => Ok(rows
                .into_iter()
                .next()
                .and_then(|row| row.into_iter().next().flatten())),
            None => {
                self.retry_at = Some(std::time::Instant::now() + RETRY);
                Err(())
            }
        }
    }

    /// `sql`'s rows on this link's server, if connected, within `within`; None (and the
    /// connection dropped) when it failed.
    async fn rows(&mut self, sql: &str, within: Duration) -> Option<Vec<Vec<Option<String>>>> {
        let conn = self.conn.as_mut()?;
        match crate::timer::timeout(within, conn.internal_query(sql)).await {
            Ok(Ok(rows)) => Some(rows),
            _ => {
                self.conn = None;
                None
            }
        }
    }
}

async fn run(weak: Weak<Replicas>) {
    let mut primary = Link::default();
    let mut replicas: Vec<(Weak<Replica>, Link)> = Vec::new();
    let mut tick = crate::timer::interval(EVERY);
    loop {
        tick.tick().await;
        let Some(set) = weak.upgrade() else { return };
        if set.retired.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let Some(pool) = set.primary.upgrade() else {
            return;
        };
        let members = set.members();
        if members.is_empty() {
            continue;
        }
        // The links follow the members (a reload may change them).
        replicas.retain(|(r, _)| members.iter().any(|m| Weak::ptr_eq(r, &Arc::downgrade(m))));
        for m in members.iter() {
            if !replicas
                .iter()
                .any(|(r, _)| Weak::ptr_eq(r, &Arc::downgrade(m)))
            {
                replicas.push((Arc::downgrade(m), Link::default()));
            }
        }
        let target = pool.settings().target.clone();
        let sent = crate::clock::Moment::now();
        if let Ok(Some(at)) = primary.ask(&target, PRIMARY_SQL).await {
            if let Some(at) = lsn::parse(&at) {
                set.note_primary(at, set.now_us());
                // A position past every commit inserted before `sent` (asynchronous ones
                // too): what fills on replicas wait for.
                if let Some(rows) = primary.rows(lsn::COMMIT_POSITION_SQL, RETRY).await {
                    set.covering.note_answer(sent, &rows);
                }
            }
        }
        for (replica, link) in replicas.iter_mut() {
            let Some(replica) = replica.upgrade() else {
                continue;
            };
            let target = replica.pool.settings().target.clone();
            let state = replica.state();
            match link.ask(&target, REPLICA_SQL).await {
                Ok(Some(at)) => match lsn::parse(&at) {
                    Some(at) => {
                        if replica.found_up(state, at) {
                            note_lag(&set, &replica);
                        }
                    }
                    None => replica.mark_down(),
                },
                // Promoted (or a server that is no standby): no reads as a replica.
                Ok(None) => replica.mark_down(),
                Err(()) => replica.mark_down(),
            }
            let due = set
                .catalog
                .load()
                .as_ref()
                .is_none_or(|c| c.is_due(set.now_us()));
            if due && replica.is_up() {
                let read_at = set.now_us();
                if let Some(rows) = link.rows(CATALOG_SQL, Duration::from_secs(10)).await {
                    set.catalog
                        .store(Some(Arc::new(Catalog::from_rows(&rows, read_at))));
                }
            }
        }
    }
}

/// A replica's lag from its replay position just read: bytes behind the primary's position
/// known, and how long ago the primary passed what it has replayed.
fn note_lag(set: &Replicas, replica: &Replica) {
    let replayed = replica.replayed();
    let bytes = set.primary_lsn().saturating_sub(replayed);
    let us = set.behind_since(replayed, set.now_us());
    replica
        .lag_bytes
        .store(bytes, std::sync::atomic::Ordering::Relaxed);
    replica
        .lag_us
        .store(us, std::sync::atomic::Ordering::Relaxed);
}
