//! One WAL decoder for a fleet (`[cache.shared]` `decoder = "one"`, the default): of the
//! pgmemo instances that share a Valkey, one follows each database's WAL (the lease's holder,
//! the *leader*) and publishes each commit's invalidations on a Valkey stream; the others
//! (*readers*) apply them from there. The primary runs one walsender per database, not one
//! per instance.
//!
//! - **The lease.** `SET lease NX PX` names the instance that decodes a database. It renews
//!   the lease every third of `lease` while it still holds it (a script compares), and lets
//!   it go when its stream ends. An instance that finds it held reads the stream.
//! - **What is published.** Each commit once the server shows it visible (see
//!   [`super::visibility`]: a reader that bumps it then never stores a result read before
//!   it), as the portable forms of the slots it bumps
//!   ([`crate::cache::versions::Versions::portable`]; a slot without one, a cell two names
//!   share, makes it a flush of the database), with its transaction ID (an instance that made
//!   it bumped it at its COMMIT already). Every [`super::POSITIONS_EVERY`], and with the last
//!   commit of each batch, the leader's applied position and whether it serves. Every entry
//!   carries the leader's epoch (drawn when it took the lease) and a sequence number.
//! - **A reader** applies the stream's recent entries (back to the first at which the
//!   leader served) and then each new one, and serves once the leader says it serves. What
//!   committed before the entries it read is covered by the first one's `covers` (a position
//!   past every commit published before it): an entry of the shared tier at least that
//!   recent may be served at once (see [`Fleet::replay`]). Its applied position is the
//!   leader's as last read: every commit up to there came before it on the stream and was
//!   applied, so it is the position the reader's shared-tier entries carry. An entry of another epoch, a sequence number skipped
//!   (entries trimmed or lost) or a silent leader ends its reading: its database is flushed
//!   (see `Follower::end_stream`) and it starts again, taking the lease if it is free.
//! - **A new leader** starts a new slot: what committed between the last leader's last
//!   entry and the new slot's start is unknowable, so every reader flushes (the epoch
//!   changed) and serves only once the new leader is caught up. The shared tier needs
//!   nothing more: an instance marks its database bumped when it serves again, covered by
//!   the new leader's entries' `covers`, so an entry from before the new slot is refused.
//! - **Valkey unreachable**: the instance follows the WAL itself (or, with `without_valkey =
//!   "no_caching"`, serves nothing) and joins the fleet again once Valkey answers (its
//!   database flushed once more).
//!
//! Keys: the fleet's name and pgmemo's version (the entries' format), `wal:` or `lease:`,
//! the number of row counters (a row's portable form means the same row only to an instance
//! with as many) and the server database.

use super::{Follower, Lsn, Phase};
use crate::cache::shared::{Shared, SharedStats};
use crate::cache::valkey::Conn;
use crate::cache::{FlushTarget, ResultCache};
use crate::config::cache::{SharedTier, WithoutValkey};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A commit as the fleet's stream tells it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Commit {
    /// Its transaction's ID, as the WAL names it (see `cache::own_commits`).
    pub xid: Option<u32>,
    /// The portable forms of the slots it bumps.
    pub slots: Vec<u64>,
    /// Something it changed is not told slot by slot: the database is flushed.
    pub flush: bool,
    /// Its commit's end (the leader's: see [`Entry::covers`]; not published).
    pub end: u64,
}

impl Commit {
    /// What a commit of `xid` that bumps `slots` (and `flushed` its database) publishes.
    pub fn of(
        versions: &crate::cache::versions::Versions,
        (xid, end): (Option<u32>, Lsn),
        slots: &[u32],
        flushed: bool,
    ) -> Commit {
        let mut flush = flushed;
        let slots = slots
            .iter()
            .filter_map(|&s| {
                let portable = versions.portable(s);
                flush |= portable.is_none();
                portable
            })
            .collect();
        Commit {
            xid,
            slots,
            flush,
            end: end.0,
        }
    }
}

/// One entry of a database's stream.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    /// The leader's, drawn when it took the lease.
    epoch: u64,
    /// 1, 2, ... within the epoch.
    seq: u64,
    /// The leader's applied position (every commit up to it came before on the stream).
    applied: u64,
    /// A position past every commit that came before on the stream, and at least `applied`:
    /// every commit after it comes after (commits are published as they are seen, which
    /// may be out of their order). Where a reader that joins here knows everything from.
    covers: u64,
    /// The leader serves the database's results (it is caught up, and heard its server).
    ready: bool,
    /// The leader had applied everything its server had written (what `cache.max_lag`
    /// measures from).
    confirmed: bool,
    /// When the leader sent it (microseconds since 2000-01-01, its clock).
    sent: i64,
    commit: Option<Commit>,
}

/// An entry's value's first bytes: its format.
const MAGIC: [u8; 2] = [b'W', 2];

impl Entry {
    fn encode(&self) -> Vec<u8> {
        let slots = self.commit.as_ref().map_or(&[][..], |c| &c.slots);
        let mut v = Vec::with_capacity(48 + 8 * slots.len());
        v.extend_from_slice(&MAGIC);
        for n in [self.epoch, self.seq, self.applied, self.covers] {
            v.extend_from_slice(&n.to_be_bytes());
        }
        let c = self.commit.as_ref();
        let flags = u8::from(self.ready)
            | u8::from(self.confirmed) << 1
            | u8::from(c.is_some()) << 2
            | u8::from(c.is_some_and(|c| c.flush)) << 3
            | u8::from(c.is_some_and(|c| c.xid.is_some())) << 4;
        v.push(flags);
        let xid = c.and_then(|c| c.xid).unwrap_or(0);
        v.extend_from_slice(&xid.to_be_bytes());
        v.extend_from_slice(&self.sent.to_be_bytes());
        v.extend_from_slice(&(slots.len() as u32).to_be_bytes());
        for s in slots {
            v.extend_from_slice(&s.to_be_bytes());
        }
        v
    }

    fn decode(v: &[u8]) -> Option<Entry> {
        let mut rest = v;
        let mut take = |n: usize| -> Option<&[u8]> {
            let (bytes, after) = rest.split_at_checked(n)?;
            rest = after;
            Some(bytes)
        };
        if take(2)? != MAGIC {
            return None;
        }
        let [epoch, seq, applied, covers] = [(); 4].map(|_| take(8).map(be_u64));
        let flags = take(1)?[0];
        let xid = u32::from_be_bytes(take(4)?.try_into().ok()?);
        let sent = be_u64(take(8)?) as i64;
        let n = u32::from_be_bytes(take(4)?.try_into().ok()?) as usize;
        if rest.len() != 8 * n {
            return None;
        }
        let slots = rest.chunks_exact(8).map(be_u64).collect();
        let (epoch, seq, applied, covers) = (epoch?, seq?, applied?, covers?);
        let commit = (flags & 4 != 0).then(|| Commit {
            xid: (flags & 16 != 0).then_some(xid),
            slots,
            flush: flags & 8 != 0,
            end: 0,
        });
        Some(Entry {
            epoch,
            seq,
            applied,
            covers,
            ready: flags & 1 != 0,
            confirmed: flags & 2 != 0,
            sent,
            commit,
        })
    }
}

/// What a leader has published in its epoch: its entries are made here.
struct Published {
    epoch: u64,
    /// The last entry's sequence number.
    seq: u64,
    /// The applied position the last batch ended with.
    applied: u64,
    /// The end of every commit published so far, at most (see [`Entry::covers`]).
    end: u64,
}

impl Published {
    fn new(epoch: u64) -> Published {
        Published {
            epoch,
            seq: 0,
            applied: 0,
            end: 0,
        }
    }

    /// The next batch: an entry for each of `commits` (seen after `applied` was read), the
    /// last one with `applied`; a position entry alone when there is none. `(ready,
    /// confirmed)`: whether the leader serves, and had applied all its server had written.
    fn entries(
        &mut self,
        applied: u64,
        (ready, confirmed): (bool, bool),
        commits: Vec<Commit>,
    ) -> Vec<Entry> {
        let last = commits.len();
        let mut entries = Vec::with_capacity(last.max(1));
        let commits = commits.into_iter().map(Some);
        for (i, commit) in commits.chain((last == 0).then_some(None)).enumerate() {
            let at = if i + 1 >= last { applied } else { self.applied };
            let end = commit.as_ref().map_or(0, |c| c.end);
            self.seq += 1;
            entries.push(Entry {
                epoch: self.epoch,
                seq: self.seq,
                applied: at,
                covers: at.max(self.end),
                ready,
                confirmed,
                sent: super::replication::pg_now(),
                commit,
            });
            self.end = self.end.max(end);
        }
        self.applied = applied;
        entries
    }
}

/// Eight bytes, big-endian.
fn be_u64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0, |n, &b| n << 8 | u64::from(b))
}

/// The part an instance plays in a database's decoding, as SHOW CACHE WAL shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// It follows the WAL itself: no fleet's decoder.
    Own,
    /// It follows the WAL itself (or serves nothing) while Valkey is unreachable.
    Unreachable,
    /// The fleet's decoder: this instance, by its name in the lease.
    Leader(String),
    /// It reads the stream of the lease's holder, named.
    Reader(String),
}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Part::Own => f.write_str("own"),
            Part::Unreachable => f.write_str("own (Valkey unreachable)"),
            Part::Leader(me) => write!(f, "leader ({me})"),
            Part::Reader(holder) => write!(f, "reader (leader {holder})"),
        }
    }
}

/// The part an instance takes for a database, with its connection to Valkey.
pub enum Role {
    /// It follows the WAL itself: the fleet's decoder is off, or Valkey is unreachable.
    Own,
    /// It holds the lease: it follows the WAL and publishes.
    Leader(Conn),
    /// Another holds it: it reads the stream.
    Reader(Conn),
}

/// The fleet's decoding, shared by the process's followers.
pub struct Fleet {
    valkey: crate::cache::valkey::Valkey,
    /// Keys start with it (the shared tier's prefix).
    prefix: Vec<u8>,
    lease: Duration,
    without_valkey: WithoutValkey,
    /// This instance in the lease (what SHOW CACHE WAL shows of the leader).
    me: String,
    /// The row counters' number (see the module's documentation).
    rows: usize,
    stats: Arc<SharedStats>,
}

/// How long a question to Valkey about the lease or the stream may take.
const ASK: Duration = Duration::from_secs(2);

/// How long a reader waits on the stream at once (`XREAD BLOCK`).
const BLOCK: Duration = Duration::from_millis(200);

/// A leader not heard for this long is not served from (it publishes every
/// [`super::POSITIONS_EVERY`]); the lease is then looked at on each wait.
const SILENT: Duration = Duration::from_secs(1);

/// Why a role ends when another instance's part changed: not a failure (no backoff).
pub const HANDOVER: &str = "the fleet's decoder changed";

/// The entries a reader that joins applies at most (see [`Fleet::replay`]).
const HISTORY: usize = 10_000;

/// The entries a stream keeps (about 60 bytes each for a commit of a few rows); a reader
/// further behind finds a sequence number skipped and starts again.
const STREAM_LENGTH: u64 = 100_000;

const RENEW: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                     return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end";
const RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                       return redis.call('DEL', KEYS[1]) else return 0 end";

impl Fleet {
    pub fn new(shared: &Shared, tier: &SharedTier, rows: usize) -> Fleet {
        let host = std::env::var("HOSTNAME").unwrap_or_default();
        Fleet {
            valkey: shared.valkey().clone(),
            prefix: shared.prefix().to_vec(),
            lease: tier.lease,
            without_valkey: tier.without_valkey,
            me: format!(
                "{host}:{}:{:08x}",
                std::process::id(),
                rand::random::<u32>()
            ),
            rows,
            stats: shared.stats.clone(),
        }
    }

    fn key(&self, what: &str, database: &str) -> Vec<u8> {
        let mut k = self.prefix.clone();
        k.extend_from_slice(format!("{what}:{}:{database}", self.rows).as_bytes());
        k
    }

    async fn connect(&self) -> Result<Conn, String> {
        self.valkey.connect(ASK + BLOCK).await
    }

    /// The part this instance plays for `database` now: it takes the lease when it is free.
    pub async fn role(&self, database: &str) -> Role {
        let Ok(mut conn) = self.connect().await else {
            return Role::Own;
        };
        let mut set = redis::cmd("SET");
        set.arg(self.key("lease", database))
            .arg(&self.me)
            .arg("NX")
            .arg("PX")
            .arg(self.lease.as_millis() as u64);
        match ask::<Option<String>>(&mut conn, &set).await {
            Ok(Some(_)) => Role::Leader(conn),
            Ok(None) => Role::Reader(conn),
            Err(_) => Role::Own,
        }
    }

    /// Lets the lease of `database` go, if this instance holds it (best effort: it lapses
    /// anyway).
    pub async fn release(&self, conn: &mut Conn, database: &str) {
        let mut eval = redis::cmd("EVAL");
        eval.arg(RELEASE)
            .arg(1)
            .arg(self.key("lease", database))
            .arg(&self.me);
        let _ = ask::<i64>(conn, &eval).await;
    }

    /// Lets the lease of `database` go on a connection of its own (see [`Fleet::release`]).
    pub async fn let_go(&self, database: &str) {
        if let Ok(mut conn) = self.connect().await {
            self.release(&mut conn, database).await;
        }
    }

    /// Without Valkey: whether the instance follows the WAL itself meanwhile.
    pub fn follows_without_valkey(&self) -> bool {
        self.without_valkey == WithoutValkey::OwnFollower
    }

    /// Returns once Valkey answers again (asked every lease).
    pub async fn answers_again(&self) {
        loop {
            crate::timer::sleep(self.lease).await;
            if let Ok(mut conn) = self.connect().await {
                if ask::<String>(&mut conn, &redis::cmd("PING")).await.is_ok() {
                    return;
                }
            }
        }
    }

    /// The leader's side, beside its stream: renews the lease and publishes what the
    /// follower saw. Returns (an error) once the lease is lost or lapsed.
    pub async fn lead(&self, follower: &Follower, mut conn: Conn) -> Result<(), String> {
        let database = &follower.database;
        let stream = self.key("wal", database);
        let lease = self.key("lease", database);
        let mut published = Published::new(rand::random());
        follower.set_role(Part::Leader(self.me.clone()));
        let mut tick = crate::timer::interval(super::POSITIONS_EVERY);
        let mut renew = crate::timer::interval(self.lease / 3);
        let mut renewed = Instant::now();
        loop {
            let ticked = tokio::select! {
                _ = tick.tick() => true,
                _ = follower.progress.seen_commit.notified() => false,
                _ = renew.tick() => {
                    let mut eval = redis::cmd("EVAL");
                    eval.arg(RENEW)
                        .arg(1)
                        .arg(&lease)
                        .arg(&self.me)
                        .arg(self.lease.as_millis() as u64);
                    match ask::<i64>(&mut conn, &eval).await {
                        Ok(1) => renewed = Instant::now(),
                        Ok(_) => return Err(format!("{HANDOVER}: another instance holds the lease")),
                        Err(e) if renewed.elapsed() >= self.lease => {
                            return Err(format!("the fleet's lease lapsed ({e})"))
                        }
                        Err(_) => {}
                    }
                    continue;
                }
            };
            // The position first, then the commits seen by then: every commit up to it is
            // among them or was published before (see `Progress::take_seen`).
            let applied = follower.applied().0;
            let commits = follower.progress.take_seen();
            if commits.is_empty() && !ticked {
                continue;
            }
            let serving = (follower.is_ready(), follower.confirmed_now());
            let entries = published.entries(applied, serving, commits);
            let mut pipe = redis::pipe();
            let count = entries.len() as u64;
            for e in entries {
                pipe.cmd("XADD")
                    .arg(&stream)
                    .arg("MAXLEN")
                    .arg("~")
                    .arg(STREAM_LENGTH)
                    .arg("*")
                    .arg("e")
                    .arg(e.encode())
                    .ignore();
            }
            // A failed write leaves a sequence number out: the readers start again.
            match crate::timer::timeout(ASK, pipe.query_async::<()>(&mut conn)).await {
                Ok(Ok(())) => {
                    self.stats.stream_published.fetch_add(count, Relaxed);
                }
                _ => {
                    self.stats.errors.fetch_add(1, Relaxed);
                }
            }
        }
    }

    /// The reader's side: applies the stream's recent entries ([`Fleet::replay`]), then
    /// each new one, until the leader changes, is silent, or entries are lost; returns Ok
    /// when the lease is free (this instance may take it).
    pub async fn read(
        &self,
        follower: &Follower,
        cache: &ResultCache,
        mut conn: Conn,
    ) -> Result<(), String> {
        let database = &follower.database;
        let stream = self.key("wal", database);
        let lease = self.key("lease", database);
        // Commits through this instance noted from now on were bumped after the history's
        // mark (below): their entries need not bump them again.
        let joined = Instant::now();
        let mut recent = redis::cmd("XREVRANGE");
        recent
            .arg(&stream)
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(HISTORY);
        let recent = entries(ask::<redis::Value>(&mut conn, &recent).await?);
        let mut from = recent
            .first()
            .map_or_else(|| "0-0".to_string(), |(id, _)| id.clone());
        let mut leader = self.replay(follower, cache, recent);
        if leader.is_some() {
            self.name_leader(follower, &mut conn, &lease).await?;
        }
        let mut heard = Instant::now();
        follower.set_phase(Phase::CatchingUp);
        loop {
            let mut read = redis::cmd("XREAD");
            read.arg("COUNT")
                .arg(1000)
                .arg("BLOCK")
                .arg(BLOCK.as_millis() as u64)
                .arg("STREAMS")
                .arg(&stream)
                .arg(&from);
            let got = read_entries(ask::<redis::Value>(&mut conn, &read).await?);
            if got.is_empty() {
                if heard.elapsed() < SILENT {
                    continue;
                }
                if follower.ready.swap(false, Relaxed) {
                    tracing::info!(%database, "WAL invalidation: the fleet's decoder is silent; not serving until it is heard from");
                }
                let holder =
                    ask::<Option<String>>(&mut conn, redis::cmd("GET").arg(&lease)).await?;
                match holder {
                    None => return Ok(()),
                    Some(holder) if heard.elapsed() >= super::SILENT_LIMIT => {
                        return Err(format!("the fleet's decoder {holder} is silent"))
                    }
                    Some(holder) => follower.set_role(Part::Reader(holder)),
                }
                continue;
            }
            heard = Instant::now();
            for (id, value) in got {
                from = id;
                let entry =
                    Entry::decode(&value).ok_or("a malformed entry on the fleet's stream")?;
                match leader {
                    None => {
                        leader = Some((entry.epoch, entry.seq));
                        self.name_leader(follower, &mut conn, &lease).await?;
                    }
                    Some((epoch, _)) if epoch != entry.epoch => {
                        return Err(format!("{HANDOVER}: a new leader"))
                    }
                    Some((_, seq)) if entry.seq != seq + 1 => {
                        return Err(format!(
                            "entries of the fleet's stream were lost ({} after {seq})",
                            entry.seq
                        ))
                    }
                    Some((epoch, _)) => leader = Some((epoch, entry.seq)),
                }
                self.apply(entry, follower, cache, Joining::Live { own_since: joined });
            }
        }
    }

    /// Shows the lease's holder as the reader's leader.
    async fn name_leader(
        &self,
        follower: &Follower,
        conn: &mut Conn,
        lease: &[u8],
    ) -> Result<(), String> {
        let holder = ask::<Option<String>>(conn, redis::cmd("GET").arg(lease)).await?;
        follower.set_role(Part::Reader(holder.unwrap_or_default()));
        Ok(())
    }

    /// Joining the stream: applies its recent entries (`recent`, newest first) of the
    /// current leader back to the first at which it served, and says this instance knows
    /// every commit after that entry's [`Entry::covers`] (the database's mark, see
    /// `Follower::publish`, is covered by it, not by a position read now: entries in the
    /// shared tier from before it joined may be served). The leader's (epoch, last sequence
    /// number) when there is such a run.
    fn replay(
        &self,
        follower: &Follower,
        cache: &ResultCache,
        recent: Vec<(String, Vec<u8>)>,
    ) -> Option<(u64, u64)> {
        let mut run: Vec<Entry> = Vec::new();
        for (_, value) in recent {
            let Some(entry) = Entry::decode(&value) else {
                break;
            };
            if run
                .last()
                .is_some_and(|after| after.epoch != entry.epoch || entry.seq + 1 != after.seq)
            {
                break;
            }
            run.push(entry);
        }
        // From the oldest entry at which the leader served (all it decoded since its slot
        // began is on the stream from there), oldest first.
        let first = run.iter().rposition(|e| e.ready && e.applied > 0)?;
        run.truncate(first + 1);
        run.reverse();
        let newest = run.last()?;
        let (leader, serving) = ((newest.epoch, newest.seq), newest.ready);
        mark_known(follower, &cache.versions, run[0].covers);
        for entry in run {
            // Its commits bumped after the mark; a commit made here before it joined too.
            self.apply(entry, follower, cache, Joining::Replay);
        }
        if serving && !follower.ready.load(Relaxed) {
            follower.serve("reading the fleet's decoder (from its recent entries)");
        }
        Some(leader)
    }

    /// Applies one entry of the leader's (see [`Joining`]).
    fn apply(&self, entry: Entry, follower: &Follower, cache: &ResultCache, joining: Joining) {
        let database = &*follower.database;
        let versions = &cache.versions;
        if let Some(commit) = entry.commit {
            let own = match joining {
                Joining::Replay => false,
                Joining::Live { own_since } => commit.xid.is_some_and(|xid| {
                    cache.own_commits.take_since(database, xid, Some(own_since))
                }),
            };
            let slots: Option<Vec<u32>> = commit
                .slots
                .iter()
                .map(|&p| versions.from_portable(p))
                .collect();
            match slots {
                _ if commit.flush => cache.flush(FlushTarget::Database(database)),
                Some(_) if own => {}
                Some(slots) => versions.bump_slots(&slots),
                None => cache.flush(FlushTarget::Database(database)),
            }
            follower.commits.fetch_add(1, Relaxed);
        }
        self.stats.stream_read.fetch_add(1, Relaxed);
        if joining != Joining::Replay {
            let lag = (super::replication::pg_now() - entry.sent).max(0) as u64;
            self.stats.stream_lag.lock().add(lag);
        }
        follower.applied.fetch_max(entry.applied, Relaxed);
        if entry.confirmed {
            follower.confirmed_ms.store(super::clock_ms(), Relaxed);
        }
        if joining == Joining::Replay {
            // Whether it serves is decided once the replay is done.
        } else if !entry.ready {
            follower.ready.store(false, Relaxed);
        } else if !follower.ready.load(Relaxed) {
            // What committed before the stream's end when it began reading bumped nothing
            // here (see `Follower::publish`); it ends at or before this entry's `covers`.
            mark_known(follower, versions, entry.covers);
            follower.serve("reading the fleet's decoder");
        }
    }
}

/// Marks the follower's database bumped now, and notes that every commit this instance did
/// not learn of from the stream ends at or before `covers` (an entry's, from which on it
/// reads every entry): a shared-tier entry whose position is `covers` or later may be
/// served at once.
fn mark_known(follower: &Follower, versions: &crate::cache::versions::Versions, covers: u64) {
    let mark = crate::clock::Moment::now();
    versions.mark_bumped(versions.database_slot(&follower.database), mark);
    follower
        .covering
        .note_known(crate::clock::Moment::from_nanos(mark.nanos() + 1), covers);
}

/// How a reader applies an entry ([`Fleet::apply`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Joining {
    /// One of the stream's recent entries, read when it joined ([`Fleet::replay`]): what it
    /// bumps is bumped again (a commit made through this instance too: its note may be older
    /// than the reader's mark), and whether the reader serves waits for the replay's end.
    Replay,
    /// A new entry: a commit made through this instance and noted since `own_since` (it
    /// joined) was bumped at its COMMIT already; the leader's serving is followed.
    Live { own_since: Instant },
}

/// One question to Valkey, within [`ASK`] (and the stream's wait).
async fn ask<T: redis::FromRedisValue>(conn: &mut Conn, cmd: &redis::Cmd) -> Result<T, String> {
    match crate::timer::timeout(ASK + BLOCK, cmd.query_async::<T>(conn)).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("Valkey: {e}")),
        Err(_) => Err("Valkey did not answer".into()),
    }
}

/// The (ID, value) of each entry of an `XRANGE` reply, for the entries' one field.
fn entries(reply: redis::Value) -> Vec<(String, Vec<u8>)> {
    use redis::Value;
    fn text(v: Value) -> Option<Vec<u8>> {
        match v {
            Value::BulkString(b) => Some(b),
            Value::SimpleString(s) => Some(s.into_bytes()),
            _ => None,
        }
    }
    let entry = |v: Value| {
        let Value::Array(parts) = v else { return None };
        let mut parts = parts.into_iter();
        let id = String::from_utf8(text(parts.next()?)?).ok()?;
        let Value::Array(fields) = parts.next()? else {
            return None;
        };
        Some((id, text(fields.into_iter().nth(1)?)?))
    };
    match reply {
        Value::Array(items) => items.into_iter().filter_map(entry).collect(),
        _ => Vec::new(),
    }
}

/// The entries of an `XREAD` reply of one stream: `[[stream, entries]]` (RESP2), `{stream:
/// entries}` (RESP3), or nil when none came.
fn read_entries(reply: redis::Value) -> Vec<(String, Vec<u8>)> {
    use redis::Value;
    match reply {
        Value::Array(streams) => streams
            .into_iter()
            .flat_map(|s| match s {
                Value::Array(pair) => pair.into_iter().nth(1).map(entries).unwrap_or_default(),
                _ => Vec::new(),
            })
            .collect(),
        Value::Map(pairs) => pairs.into_iter().flat_map(|(_, e)| entries(e)).collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn commit(end: u64, slots: Vec<u64>) -> Commit {
        Commit {
            xid: None,
            slots,
            flush: false,
            end,
        }
    }

    /// Commits seen out of their order (one held by a synchronous standby): an entry's
    /// `covers` is past every commit published before it, not only its applied position.
    #[test]
    fn an_entry_covers_every_commit_published_before_it() {
        let mut p = Published::new(7);
        // 200 is seen while 150 is not: the applied position stays at 140.
        let first = p.entries(140, (true, false), vec![commit(200, vec![1])]);
        assert_eq!(
            first
                .iter()
                .map(|e| (e.seq, e.applied, e.covers))
                .collect::<Vec<_>>(),
            [(1, 140, 140)]
        );
        let next = p.entries(140, (true, false), Vec::new());
        assert_eq!(
            (next[0].seq, next[0].applied, next[0].covers),
            (2, 140, 200)
        );
        // 150 seen: the position passes both; two commits in one batch, the last with it.
        let both = p.entries(
            210,
            (true, true),
            vec![commit(150, vec![2]), commit(205, vec![3])],
        );
        assert_eq!(
            both.iter()
                .map(|e| (e.seq, e.applied, e.covers))
                .collect::<Vec<_>>(),
            [(3, 140, 200), (4, 210, 210)]
        );
    }

    /// A reader that joins knows every commit after its first replayed entry's `covers`:
    /// an entry of the shared tier with an older position is refused, one with that position
    /// or later is served; a slot a replayed commit bumped waits for a position read after.
    #[test]
    fn a_joining_reader_knows_what_came_after_the_first_entry_it_replays() {
        let cache = ResultCache::new(
            &crate::config::cache::CacheConfig::default(),
            Arc::new(crate::query::shapes::Shapes::new(100)),
        );
        let versions = &cache.versions;
        let follower = Follower::new("h:5432/db", "db", None);
        let fleet = Fleet {
            valkey: crate::cache::valkey::Valkey::One(Box::new(
                redis::Client::open("redis://127.0.0.1:1/0").unwrap(),
            )),
            prefix: Vec::new(),
            lease: Duration::from_secs(3),
            without_valkey: WithoutValkey::OwnFollower,
            me: "test".into(),
            rows: versions.row_versions(),
            stats: Arc::default(),
        };
        let t = versions.table_slot("h:5432/db", "t");
        let mut p = Published::new(9);
        // A commit published before the leader served (not replayed: its end, 200, is past
        // the first served entry's applied position, 140), then a commit of `t`.
        let mut stream = p.entries(0, (false, false), vec![commit(200, vec![5])]);
        stream.extend(p.entries(140, (true, false), Vec::new()));
        let portable = versions.portable(t).unwrap();
        stream.extend(p.entries(260, (true, true), vec![commit(250, vec![portable])]));
        let recent: Vec<(String, Vec<u8>)> = stream
            .iter()
            .rev()
            .map(|e| (format!("{}-0", e.seq), e.encode()))
            .collect();
        let before = crate::clock::Moment::now();
        assert_eq!(fleet.replay(&follower, &cache, recent), Some((9, 3)));
        assert!(follower.is_ready(), "the leader served: so does the reader");
        assert_eq!(follower.applied(), Lsn(260));
        let database = versions.database_slot("h:5432/db");
        // The database's mark is covered by the replay's first entry's `covers` (200), not
        // by its applied position (140): the commit ending at 200 was not replayed.
        assert_eq!(
            follower.covering_after(versions.last_bumped([database].into_iter())),
            Some(200)
        );
        assert!(versions.last_bumped([database].into_iter()) > before);
        // The slot a replayed commit bumped: no position read since.
        assert_eq!(
            follower.covering_after(versions.last_bumped([t].into_iter())),
            None
        );
    }

    #[test]
    fn an_entry_reads_back_as_written() {
        let e = Entry {
            epoch: 7,
            seq: 3,
            applied: 0x16_B374_D848,
            covers: 0x16_B374_D900,
            ready: true,
            confirmed: false,
            sent: 123,
            commit: Some(Commit {
                xid: Some(741),
                slots: vec![1, 1 << 63 | 5],
                flush: false,
                end: 0,
            }),
        };
        assert_eq!(Entry::decode(&e.encode()), Some(e.clone()));
        let position = Entry { commit: None, ..e };
        assert_eq!(Entry::decode(&position.encode()), Some(position.clone()));
        let bytes = position.encode();
        assert_eq!(Entry::decode(&bytes[..bytes.len() - 1]), None);
        assert_eq!(Entry::decode(&[bytes.clone(), vec![0]].concat()), None);
        assert_eq!(Entry::decode(b"P\x01"), None);
    }
}
