//! The relay lane: a client message that only needs relaying skips the stages.
//!
//! Most of an extended-protocol transaction is messages about a portal: `Describe` of it,
//! `Execute`, then `Sync` (and `Flush`). With a server held and none of the features that look
//! at such messages in play, every stage of [`Session::handle_client_messages`] passes them
//! through unchanged: no text to read, nothing the cache answers, no server to take, no
//! statement to rename. Going through the stages anyway cost about 300 instructions a message
//! (callgrind, `python3 bench/budget.py`: 950 of a `pgbench -S -M prepared` transaction's
//! 11,270 for its three portal messages). The lane relays such a message as the stages would
//! have, and says exactly when it may (see [`Session::lane_takes`]); anything else takes the
//! stages.

use super::Session;
use crate::pool::PoolMode;
use crate::protocol::frontend as fe;

impl Session {
    /// Relays the message at the head of the client's input (framed: `tag`, `len` bytes) if
    /// the lane takes it. True: relayed, as the stages would have.
    #[inline]
    pub(super) fn relay_in_lane(&mut self, tag: u8, len: usize, now_us: u64) -> bool {
        if !self.lane_takes(tag) {
            return false;
        }
        if let Some(reader) = self.reading.reader.as_deref_mut() {
            reader.forget(); // a reading is of one message only
        }
        self.info.start_query(now_us);
        self.stats.bytes_received += len as u64;
        self.forward_client_message(tag, len);
        if tag == fe::SYNC && self.plan.stmts.is_some() {
            // The planner's Sync (nothing to clean up after it, see `lane_takes`) ends as any
            // message it plans does: the replies pgmemo gives itself that are due now.
            self.after_planned_locally();
        }
        // What planning any message does to the planner's wait (nothing waits here).
        self.plan.wait_flushed = false;
        self.plan.replanned |= std::mem::take(&mut self.plan.replan);
        true
    }

    /// Whether every stage would pass the message through unchanged:
    /// - a `Describe` of a portal, an `Execute`, a `Sync` or a `Flush`: no text (the result
    ///   cache, the session-state watch, the transaction-id question and the statement
    ///   planner read none of them), no statement name;
    /// - a server held (none to take, no block kept without one), not a replica's and not a
    ///   pinned or session-mode client's (whose transaction's time starts at its first
    ///   message: see `Session::server_for`);
    /// - no portal the result cache left (see `Session::portal_left_by_hit`), no portal
    ///   tracked by the planner (an `Execute` of one is planned), no names to close after a
    ///   `Sync` (`Planner::sync`);
    /// - no guard statement to prepare first: the server has it, or is not in a block, or a
    ///   batch is open (see `Planner::prepare_guard`).
    #[inline]
    fn lane_takes(&self, tag: u8) -> bool {
        let message = match tag {
            fe::EXECUTE | fe::FLUSH => true,
            fe::SYNC => self.plan.cleanup.is_empty(),
            fe::DESCRIBE => self.client.rbuf.get(5) == Some(&b'P'),
            _ => false,
        };
        let Some(server) = self.server.as_deref() else {
            return false;
        };
        message
            && self.reads.is_none()
            && self.state.pins == 0
            && self.mode != PoolMode::Session
            && self
                .cache
                .as_deref()
                .is_none_or(|c| c.cached_portal.is_none())
            && self
                .plan
                .stmts
                .as_ref()
                .is_none_or(|s| !s.has_tracked_portals())
            && (server.prepared.has_guard() || server.status != b'T' || self.replies.in_batch())
    }
}
