//! Single flight: the first client that misses on a key fetches it ([`Flight`]), and others
//! missing on it meanwhile wait for that fetch (at most `flight_wait`), then look up again,
//! rather than all running the same query on servers. This file keeps the fetches under way;
//! a lookup starts one (`lookup.rs`) and its fill ends it, stored or not, even when the fill
//! is dropped (`store.rs`). A client waits once: finding the key still fetched after that, it
//! runs the query without filling.

use super::key::KeyIsHash;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

/// A query being fetched for the cache by one client; others missing on its key wait for it.
#[derive(Default)]
pub struct Flight {
    done: tokio::sync::Notify,
    finished: AtomicBool,
    /// Clients that waited for it: their interest admits the result to the store.
    pub(super) waiters: AtomicU64,
}

impl Flight {
    /// Waits until the fetch ends (stored or not), at most `limit`; false if it did not.
    pub async fn wait(&self, limit: Duration) -> bool {
        // SeqCst with `finish`: either it sees this waiter, or this sees it finished.
        self.waiters.fetch_add(1, SeqCst);
        let notified = self.done.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.finished.load(SeqCst) {
            return true;
        }
        crate::timer::timeout(limit, notified).await.is_ok()
    }

    pub(super) fn finish(&self) {
        self.finished.store(true, SeqCst);
        // Most fetches have nobody waiting: no lock in Notify then.
        if self.waiters.load(SeqCst) > 0 {
            self.done.notify_waiters();
        }
    }
}

/// Fetches in progress, by the hash of their key (two keys with one hash only make a client
/// wait for a fetch that is not its own, then look up again), in shards with a lock each. A
/// miss inserts and its end removes microseconds later: papaya (lock-free) allocated a node
/// per insert and reclaimed it by epochs, and grew and copied its table under the churn,
/// ~700 instructions per miss; a shard's lock is uncontended (a one-thread runtime by
/// default, and 64 shards otherwise) and its small table allocates nothing once grown.
pub(super) struct Flights {
    shards: Box<[parking_lot::Mutex<FlightShard>]>,
}

/// The keys are already hashes (foldhash of the key): used as they are.
type FlightShard = std::collections::HashMap<u64, Arc<Flight>, KeyIsHash>;

const FLIGHT_SHARDS: usize = 64;

impl Flights {
    pub(super) fn new() -> Flights {
        Flights {
            shards: (0..FLIGHT_SHARDS)
                .map(|_| parking_lot::Mutex::new(FlightShard::default()))
                .collect(),
        }
    }

    fn shard(&self, key_hash: u64) -> &parking_lot::Mutex<FlightShard> {
        // Middle bits: the shard's table uses the low bits for the bucket and the top ones
        // for its tags.
        &self.shards[(key_hash >> 32) as usize % FLIGHT_SHARDS]
    }

    /// Registers `flight` for `key_hash`, or returns the fetch already running for it.
    pub(super) fn start(&self, key_hash: u64, flight: &Arc<Flight>) -> Result<(), Arc<Flight>> {
        match self.shard(key_hash).lock().entry(key_hash) {
            std::collections::hash_map::Entry::Occupied(running) => Err(running.get().clone()),
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(flight.clone());
                Ok(())
            }
        }
    }

    /// Forgets `flight` if it is still the one registered for `key_hash`.
    pub(super) fn end(&self, key_hash: u64, flight: &Arc<Flight>) {
        let mut shard = self.shard(key_hash).lock();
        if shard.get(&key_hash).is_some_and(|f| Arc::ptr_eq(f, flight)) {
            shard.remove(&key_hash);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::{Flight, Flights};
    use std::sync::Arc;

    #[test]
    fn a_key_has_one_flight_until_it_ends() {
        let flights = Flights::new();
        let (first, second) = (Arc::new(Flight::default()), Arc::new(Flight::default()));
        // Hashes that differ only in the bits that pick the shard, or only in the others.
        let (a, b, c) = (7u64 << 32, 8u64 << 32, (7u64 << 32) | 1);
        assert!(flights.start(a, &first).is_ok());
        let running = flights.start(a, &second).expect_err("a is running");
        assert!(Arc::ptr_eq(&running, &first));
        assert!(flights.start(b, &second).is_ok());
        assert!(flights.start(c, &second).is_ok());
        // Only the flight registered for a key ends it.
        flights.end(a, &second);
        assert!(flights.start(a, &second).is_err());
        flights.end(a, &first);
        assert_eq!(flights.len(), 2);
        assert!(flights.start(a, &second).is_ok());
        for key in [a, b, c] {
            flights.end(key, &second);
        }
        assert_eq!(flights.len(), 0);
    }
}
