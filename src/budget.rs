//! The server connections one database or one user may have across all its pools:
//! PgBouncer's `max_db_connections` and `max_user_connections`.
//!
//! A [`Budget`] is a counter shared by the pools of a database (or of a user). A pool takes
//! from it before it opens a server connection and gives back when one closes; both are
//! one atomic operation, and only opening and closing touch it: handing an idle server to a
//! client (the hot path) does not. When the budget is spent, a pool's clients wait in its
//! queue, as PgBouncer's do; the budget then asks its other pools to close an idle server
//! ([`Member::evict_idle`]) and, whenever a connection closes, lets the pools with waiting
//! clients take the freed place ([`Member::dispatch`]).
//!
//! The budget knows its pools only through [`Member`], so this room imports no pool.

use crate::clock::Moment;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

/// Whose budget: a database's (`max_db_connections`) or a user's (`max_user_connections`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BudgetOf {
    Database,
    User,
}

/// What a budget asks of a pool that draws on it.
pub trait Member: Send + Sync {
    /// Hands free capacity to the pool's waiting clients (a place in the budget freed).
    fn dispatch(&self);
    /// When the pool's least recently used idle server was last used; None: none is idle.
    fn oldest_idle(&self) -> Option<Moment>;
    /// Closes the pool's least recently used idle server; whether there was one.
    fn evict_idle(&self) -> bool;
}

/// Server connections counted against one limit.
#[derive(Default)]
pub struct Budget {
    /// The limit; 0: none (the count is still kept, for SHOW DATABASES and SHOW USERS).
    max: AtomicUsize,
    /// Connections open or being opened.
    open: AtomicUsize,
    /// A client waits because this budget is spent: a server checked in idle anywhere in
    /// the budget is closed instead, to make room (see [`Budget::starved`]).
    starved: AtomicBool,
    members: Mutex<Vec<Weak<dyn Member>>>,
}

impl Budget {
    pub fn new(max: usize) -> Arc<Budget> {
        let budget = Budget::default();
        budget.max.store(max, Ordering::Relaxed);
        Arc::new(budget)
    }

    /// A reload's new limit; a higher one lets waiting clients in at once.
    pub fn set_max(&self, max: usize) {
        if self.max.swap(max, Ordering::Relaxed) != max {
            self.wake();
        }
    }

    pub fn max(&self) -> usize {
        self.max.load(Ordering::Relaxed)
    }

    /// Connections open or being opened now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Registers a pool that draws on this budget.
    pub fn join(&self, member: Weak<dyn Member>) {
        let mut members = self.members.lock();
        members.retain(|m| m.strong_count() > 0);
        members.push(member);
    }

    /// Counts one more connection, unless the limit is reached.
    #[must_use]
    pub fn try_take(&self) -> bool {
        let max = self.max.load(Ordering::Relaxed);
        if max == 0 {
            self.open.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        self.open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    /// Gives back a place taken by [`Budget::try_take`] that was never used (no connection
    /// was opened with it): nobody is woken.
    pub fn untake(&self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }

    /// `n` connections closed: their places go to pools with waiting clients, when the
    /// limit kept any waiting.
    pub fn give_back(&self, n: usize) {
        if n == 0 {
            return;
        }
        self.open.fetch_sub(n, Ordering::Relaxed);
        if self.starved.swap(false, Ordering::Relaxed) {
            self.wake();
        }
    }

    /// Whether a client waits because this budget is spent: then a server that becomes
    /// idle in any of its pools is closed rather than kept (one atomic load per check-in).
    #[inline]
    pub fn starved(&self) -> bool {
        self.starved.load(Ordering::Relaxed)
    }

    /// Whether the limit is reached.
    pub fn spent(&self) -> bool {
        let max = self.max.load(Ordering::Relaxed);
        max > 0 && self.open.load(Ordering::Relaxed) >= max
    }

    /// Marks the budget starved (see [`Budget::starved`]) without closing anything now:
    /// for a pool that cannot call other pools where it is.
    pub fn mark_starved(&self) {
        self.starved.store(true, Ordering::Relaxed);
    }

    /// A client of one pool waits because this budget is spent: closes the least recently
    /// used idle server of its other pools, as PgBouncer's `evict_connection`, and marks the
    /// budget starved until a connection closes.
    pub fn make_room(&self) {
        self.starved.store(true, Ordering::Relaxed);
        let members = self.members();
        let oldest = members
            .iter()
            .filter_map(|m| Some((m.oldest_idle()?, m)))
            .min_by_key(|(t, _)| *t);
        if let Some((_, m)) = oldest {
            m.evict_idle();
        }
    }

    /// Lets every pool hand what is free to its waiting clients.
    fn wake(&self) {
        for m in self.members() {
            m.dispatch();
        }
    }

    /// The live members, taken out of the lock so that calling them (which may call back
    /// here) holds none.
    fn members(&self) -> Vec<Arc<dyn Member>> {
        self.members
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_counts_and_refuses() {
        let b = Budget::new(2);
        assert!(b.try_take() && b.try_take());
        assert!(!b.try_take(), "the third is over the limit");
        b.give_back(1);
        assert!(b.try_take());
        assert_eq!(b.open(), 2);
        let unlimited = Budget::new(0);
        assert!((0..100).all(|_| unlimited.try_take()));
        assert_eq!(unlimited.open(), 100);
    }
}

/// The client connections of each database name and each user at once, for PgBouncer's
/// `max_db_client_connections` and `max_user_client_connections`: counted when a client is
/// registered and when it goes (login and logout, never per query). The admin console's
/// clients are never registered, so never counted, as in PgBouncer.
#[derive(Default)]
pub struct ClientCounts(Mutex<ClientTally>);

#[derive(Default)]
struct ClientTally {
    databases: std::collections::HashMap<Arc<str>, u32>,
    users: std::collections::HashMap<Arc<str>, u32>,
}

impl ClientCounts {
    /// Counts a client of `database` and `user` in.
    pub fn add(&self, database: &Arc<str>, user: &Arc<str>) {
        let mut tally = self.0.lock();
        *tally.databases.entry(database.clone()).or_default() += 1;
        *tally.users.entry(user.clone()).or_default() += 1;
    }

    /// Counts a client of `database` and `user` out (a name no longer counted is forgotten).
    pub fn remove(&self, database: &str, user: &str) {
        let mut guard = self.0.lock();
        let tally = &mut *guard;
        for (map, name) in [(&mut tally.databases, database), (&mut tally.users, user)] {
            if let Some(n) = map.get_mut(name) {
                *n -= 1;
                if *n == 0 {
                    map.remove(name);
                }
            }
        }
    }

    /// The clients of database `name` (`BudgetOf::Database`) or user `name` now.
    pub fn get(&self, of: BudgetOf, name: &str) -> u32 {
        let tally = self.0.lock();
        let map = match of {
            BudgetOf::Database => &tally.databases,
            BudgetOf::User => &tally.users,
        };
        map.get(name).copied().unwrap_or(0)
    }
}
