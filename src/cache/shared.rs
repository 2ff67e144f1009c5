//! The shared tier: a second tier of the result cache on Valkey or Redis (`[cache.shared]`),
//! shared by every pgmemo instance of a fleet, so that an instance misses in its own memory
//! and still answers without PostgreSQL when another instance stored the result.
//!
//! Exact, as the instance's own store is, through WAL positions every instance derives alike:
//! - **Written** when an instance stores a result it filled (`store.rs`), without making the
//!   client wait (a task of its own sends it): the result's bytes and a position `P` of the
//!   primary's WAL its query saw whole: the instance's WAL follower's applied position when
//!   the query was sent (every commit up to there was decoded, and visible on the server, so
//!   its snapshot had it). Under the fleet's name, pgmemo's version and the cache's key (the
//!   client's context, the normalized text and literals), for the entry's TTL.
//! - **Read** on a miss in the instance's memory, before the query goes to the server (one
//!   round trip, at most `timeout`). The instance serves the bytes only if no write it knows
//!   of, to anything the result depends on, may have committed after `P`: for its own
//!   dependencies of the query (the same tables, rows and columns every instance derives from
//!   the same query), the last bump's time ([`super::versions::Versions::last_bumped`]) is
//!   covered by a primary position its follower read after it
//!   ([`crate::wal::Follower::covering_after`]), and that position is at most `P`. A write
//!   this instance has not decoded yet is one its own entries would not know of either.
//!   Then the result is stored in its memory, as a fill from the server would be (same
//!   checks: nothing it depends on changed since the lookup began, nothing unsettled).
//!
//! Nothing is ever deleted there: an instance judges an entry by its position, and the TTL
//! ends it. Valkey unreachable or slow: the query goes to the server (errors and timeouts
//! are counted, `SHOW CACHE SHARED`).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};

use crate::config::cache::SharedTier;

/// The first byte of an entry's value, and its format's version.
const MAGIC: [u8; 2] = [b'P', 1];

/// Publishes waiting for the task that sends them; past this they are dropped (counted).
const QUEUE: usize = 4096;

/// A result to write to the shared tier.
struct Publish {
    key: Vec<u8>,
    value: Bytes,
    ttl: Duration,
}

/// The shared tier of the process.
pub struct Shared {
    valkey: super::valkey::Valkey,
    /// Connected at the first use, in the runtime.
    conn: tokio::sync::OnceCell<super::valkey::Conn>,
    publish: OnceLock<tokio::sync::mpsc::Sender<Publish>>,
    /// Keys start with it: the fleet's name and pgmemo's version (the key's format).
    prefix: Vec<u8>,
    timeout: Duration,
    pub stats: Arc<SharedStats>,
}

/// What `SHOW CACHE SHARED` shows.
#[derive(Default)]
pub struct SharedStats {
    /// Lookups that found an entry this instance served.
    pub hits: AtomicU64,
    /// Lookups that found nothing.
    pub misses: AtomicU64,
    /// Entries found that this instance could not serve (a write it knows of may have
    /// committed after the entry's position).
    pub refused: AtomicU64,
    /// Lookups or writes that failed, or took longer than `timeout`.
    pub errors: AtomicU64,
    pub timeouts: AtomicU64,
    /// Entries written, and their bytes; writes dropped because too many were waiting.
    pub writes: AtomicU64,
    pub bytes_written: AtomicU64,
    pub dropped: AtomicU64,
    /// Lookup round trips, microseconds.
    latency: parking_lot::Mutex<crate::stats::Samples>,
    /// The fleet's decoder (see `wal::fleet`): entries this instance published as a leader,
    /// entries it read as a reader, and how long after they were sent (microseconds).
    pub stream_published: AtomicU64,
    pub stream_read: AtomicU64,
    pub stream_lag: parking_lot::Mutex<crate::stats::Samples>,
}

impl SharedStats {
    /// (p50, p99) of the lookups' round trips, microseconds.
    pub fn latency(&self) -> Option<(u64, u64)> {
        self.latency.lock().percentiles()
    }

    /// (p50, p99) of the fleet's stream's lag as read here, microseconds.
    pub fn stream_lag(&self) -> Option<(u64, u64)> {
        self.stream_lag.lock().percentiles()
    }
}

impl Shared {
    /// The tier `config` names (its URL was checked when the file was read).
    pub fn new(config: &SharedTier) -> Result<Shared, String> {
        let valkey = super::valkey::Valkey::new(config)?;
        let mut prefix = config.name.as_bytes().to_vec();
        prefix.extend_from_slice(b":pgmemo-");
        prefix.extend_from_slice(env!("CARGO_PKG_VERSION").as_bytes());
        prefix.push(b':');
        Ok(Shared {
            valkey,
            conn: tokio::sync::OnceCell::new(),
            publish: OnceLock::new(),
            prefix,
            timeout: config.timeout,
            stats: Arc::default(),
        })
    }

    /// Where the tier is.
    pub fn valkey(&self) -> &super::valkey::Valkey {
        &self.valkey
    }

    /// What the tier's keys start with.
    pub fn prefix(&self) -> &[u8] {
        &self.prefix
    }

    /// The lookups' connection (made at the first, then kept).
    async fn conn(&self) -> Option<super::valkey::Conn> {
        let made = self
            .conn
            .get_or_try_init(|| self.valkey.lasting(Duration::from_secs(1)))
            .await;
        match made {
            Ok(conn) => Some(conn.clone()),
            Err(e) => {
                tracing::debug!(error = %e, "result cache: the shared tier's connection");
                self.stats.errors.fetch_add(1, Relaxed);
                None
            }
        }
    }

    fn key(&self, key: &[u8]) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.prefix.len() + key.len());
        k.extend_from_slice(&self.prefix);
        k.extend_from_slice(key);
        k
    }

    /// The entry under the cache's `key`, within `timeout`: its position, its reply, and how
    /// much longer it lives there (GET and PTTL in one round trip).
    pub async fn get(&self, key: &[u8]) -> Option<(u64, Bytes, Duration)> {
        let started = crate::clock::Moment::now();
        let key = self.key(key);
        let mut asked = redis::pipe();
        asked.cmd("GET").arg(&key).cmd("PTTL").arg(&key);
        let asked = async {
            let Some(mut conn) = self.conn().await else {
                return Ok(None);
            };
            asked
                .query_async::<(Option<Vec<u8>>, i64)>(&mut conn)
                .await
                .map(Some)
        };
        let (got, ttl_ms) = match crate::timer::timeout(self.timeout, asked).await {
            Ok(Ok(Some(got))) => got,
            Ok(Ok(None)) => return None,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "result cache: shared tier lookup");
                self.stats.errors.fetch_add(1, Relaxed);
                return None;
            }
            Err(_) => {
                self.stats.timeouts.fetch_add(1, Relaxed);
                return None;
            }
        };
        self.stats
            .latency
            .lock()
            .add(crate::clock::Moment::now().micros_since(started));
        // PTTL: -2 gone (expired between the two), -1 no expiry (never written so).
        let found = got.and_then(|v| decode(&v)).filter(|_| ttl_ms > 0);
        let Some((position, reply)) = found else {
            self.stats.misses.fetch_add(1, Relaxed);
            return None;
        };
        Some((position, reply, Duration::from_millis(ttl_ms as u64)))
    }

    /// Writes the result of `key`, which its query saw whole up to `position`, for `ttl`;
    /// returns at once (a task sends it).
    pub fn put(&self, key: &[u8], position: u64, reply: &[u8], ttl: Duration) {
        let Some(sender) = self.sender() else {
            return;
        };
        let publish = Publish {
            key: self.key(key),
            value: encode(position, reply),
            ttl,
        };
        if sender.try_send(publish).is_err() {
            self.stats.dropped.fetch_add(1, Relaxed);
        }
    }

    /// The queue of the task that writes entries, started at the first write.
    fn sender(&self) -> Option<&tokio::sync::mpsc::Sender<Publish>> {
        if let Some(sender) = self.publish.get() {
            return Some(sender);
        }
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        Some(self.publish.get_or_init(|| {
            let (sender, receiver) = tokio::sync::mpsc::channel(QUEUE);
            runtime.spawn(write_entries(
                self.valkey.clone(),
                receiver,
                self.stats.clone(),
            ));
            sender
        }))
    }
}

/// The task that writes entries, one `SET ... PX` each, in order, on a connection of its own
/// (made when there is none).
async fn write_entries(
    valkey: super::valkey::Valkey,
    mut entries: tokio::sync::mpsc::Receiver<Publish>,
    stats: Arc<SharedStats>,
) {
    let mut conn = None;
    while let Some(p) = entries.recv().await {
        if conn.is_none() {
            conn = valkey.lasting(Duration::from_secs(1)).await.ok();
        }
        let Some(conn) = conn.as_mut() else {
            stats.errors.fetch_add(1, Relaxed);
            continue;
        };
        let ttl_ms = p.ttl.as_millis().max(1) as u64;
        let bytes = p.value.len() as u64;
        let set = redis::cmd("SET")
            .arg(p.key)
            .arg(&p.value[..])
            .arg("PX")
            .arg(ttl_ms)
            .query_async::<()>(conn)
            .await;
        match set {
            Ok(()) => {
                stats.writes.fetch_add(1, Relaxed);
                stats.bytes_written.fetch_add(bytes, Relaxed);
            }
            Err(e) => {
                tracing::debug!(error = %e, "result cache: shared tier write");
                stats.errors.fetch_add(1, Relaxed);
            }
        }
    }
}

/// An entry's value: [`MAGIC`], the position (8 bytes, big-endian), the reply.
fn encode(position: u64, reply: &[u8]) -> Bytes {
    let mut v = BytesMut::with_capacity(10 + reply.len());
    v.put_slice(&MAGIC);
    v.put_u64(position);
    v.put_slice(reply);
    v.freeze()
}

/// The (position, reply) of an entry's value; None for anything else.
fn decode(value: &[u8]) -> Option<(u64, Bytes)> {
    if value.get(..2)? != MAGIC {
        return None;
    }
    let position = u64::from_be_bytes(value.get(2..10)?.try_into().ok()?);
    Some((position, Bytes::copy_from_slice(&value[10..])))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_reads_back_as_written_and_nothing_else_reads() {
        let v = encode(0x16_B374_D848, b"T...D...C...");
        assert_eq!(
            decode(&v),
            Some((0x16_B374_D848, Bytes::from_static(b"T...D...C...")))
        );
        assert_eq!(decode(b"P"), None);
        assert_eq!(decode(b"X\x01\0\0\0\0\0\0\0\0"), None);
        assert_eq!(decode(b"P\x02\0\0\0\0\0\0\0\0"), None);
    }
}
