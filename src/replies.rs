//! The ordered queue of replies pgmemo expects from a server.
//!
//! Every message pgmemo writes to a server that PostgreSQL answers pushes one [`Expected`]
//! entry; every message the server sends is matched against the head of the queue. This is what
//! lets a session know, message by message, whose reply it is reading (the client's, or a query
//! pgmemo injected itself), when a server is truly idle (queue empty and ReadyForQuery said
//! `I`), and what PostgreSQL discards after an error in an extended-protocol batch (everything
//! up to the next Sync). The prepared-statement planner adds entries whose replies are skipped
//! or synthesized; the rule stays the same: replies leave in the order the requests went in.

use crate::protocol::backend as be;
use std::collections::VecDeque;

/// What one request sent to the server will be answered with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expected {
    /// A simple Query or FunctionCall from the client: everything through ReadyForQuery.
    Query,
    Parse,
    Bind,
    /// Optional ParameterDescription, then RowDescription or NoData.
    Describe,
    /// Rows or COPY traffic, ending in CommandComplete, EmptyQueryResponse or PortalSuspended.
    Execute,
    Close,
    Sync,
    /// A simple query pgmemo sent on its own behalf (parameter sync, reset): its replies are
    /// swallowed through its ReadyForQuery.
    Internal,
    /// Not a reply: marks where the client ended a COPY IN (CopyDone or CopyFail). PostgreSQL
    /// ignores Sync messages that arrive during COPY IN, so when a CopyInResponse shows that a
    /// COPY started, the Syncs queued between it and this marker will never be answered.
    CopyEnd,
}

impl Expected {
    /// The entry for a client message, or None for messages PostgreSQL does not answer
    /// (Flush, CopyData, CopyDone, CopyFail, Terminate).
    pub fn for_client_message(tag: u8) -> Option<Expected> {
        use crate::protocol::frontend as fe;
        Some(match tag {
            fe::QUERY | fe::FUNCTION_CALL => Expected::Query,
            fe::PARSE => Expected::Parse,
            fe::BIND => Expected::Bind,
            fe::DESCRIBE => Expected::Describe,
            fe::EXECUTE => Expected::Execute,
            fe::CLOSE => Expected::Close,
            fe::SYNC => Expected::Sync,
            fe::COPY_DONE | fe::COPY_FAIL => Expected::CopyEnd,
            _ => return None,
        })
    }

    /// Entries that an error in an extended batch makes PostgreSQL skip.
    fn skipped_after_error(self) -> bool {
        matches!(
            self,
            Expected::Parse
                | Expected::Bind
                | Expected::Describe
                | Expected::Execute
                | Expected::Close
                | Expected::CopyEnd
        )
    }
}

/// What to do with one server message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// It belongs to the client.
    Forward,
    /// It answers something pgmemo sent itself.
    Swallow,
}

#[derive(Debug, Default)]
pub struct ReplyQueue {
    entries: VecDeque<Expected>,
}

impl ReplyQueue {
    pub fn new() -> Self {
        ReplyQueue {
            entries: VecDeque::with_capacity(16),
        }
    }

    #[inline]
    pub fn push(&mut self, e: Expected) {
        self.entries.push_back(e);
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Matches one server message against the head of the queue and advances it.
    #[inline]
    pub fn on_server_message(&mut self, tag: u8) -> Route {
        let Some(&head) = self.entries.front() else {
            // Nothing outstanding: asynchronous traffic (NOTIFY in session mode, a FATAL
            // before a shutdown). It is the client's, if anyone's.
            return Route::Forward;
        };
        let route = if head == Expected::Internal {
            Route::Swallow
        } else {
            Route::Forward
        };
        match tag {
            // Asynchronous messages never complete anything.
            be::NOTICE_RESPONSE | be::NOTIFICATION_RESPONSE | be::PARAMETER_STATUS => {}
            be::READY_FOR_QUERY => {
                if matches!(head, Expected::Query | Expected::Internal | Expected::Sync) {
                    self.entries.pop_front();
                }
            }
            be::ERROR_RESPONSE => {
                if head.skipped_after_error() {
                    self.entries.pop_front();
                    while self
                        .entries
                        .front()
                        .is_some_and(|e| e.skipped_after_error())
                    {
                        self.entries.pop_front();
                    }
                }
            }
            be::PARSE_COMPLETE if head == Expected::Parse => {
                self.entries.pop_front();
            }
            be::BIND_COMPLETE if head == Expected::Bind => {
                self.entries.pop_front();
            }
            be::CLOSE_COMPLETE if head == Expected::Close => {
                self.entries.pop_front();
            }
            be::ROW_DESCRIPTION | be::NO_DATA if head == Expected::Describe => {
                self.entries.pop_front();
            }
            be::COMMAND_COMPLETE | be::EMPTY_QUERY_RESPONSE | be::PORTAL_SUSPENDED
                if head == Expected::Execute =>
            {
                self.entries.pop_front();
            }
            be::COPY_IN_RESPONSE => {
                // Syncs sent before the client ended this COPY are ignored by PostgreSQL.
                let end = self
                    .entries
                    .iter()
                    .position(|e| *e == Expected::CopyEnd)
                    .unwrap_or(self.entries.len());
                let mut i = 1;
                let mut end = end;
                while i < end {
                    if self.entries[i] == Expected::Sync {
                        self.entries.remove(i);
                        end -= 1;
                    } else {
                        i += 1;
                    }
                }
            }
            _ => {}
        }
        // Markers carry no reply: drop them once they reach the head.
        while self.entries.front() == Some(&Expected::CopyEnd) {
            self.entries.pop_front();
        }
        route
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipeline_completes_in_order() {
        let mut q = ReplyQueue::new();
        for e in [
            Expected::Parse,
            Expected::Bind,
            Expected::Describe,
            Expected::Execute,
            Expected::Sync,
        ] {
            q.push(e);
        }
        for tag in [
            be::PARSE_COMPLETE,
            be::BIND_COMPLETE,
            be::ROW_DESCRIPTION,
            be::DATA_ROW,
            be::COMMAND_COMPLETE,
        ] {
            assert_eq!(q.on_server_message(tag), Route::Forward);
        }
        assert_eq!(q.len(), 1);
        q.on_server_message(be::READY_FOR_QUERY);
        assert!(q.is_empty());
    }

    #[test]
    fn error_skips_to_sync_but_not_past_it() {
        let mut q = ReplyQueue::new();
        for e in [
            Expected::Parse,
            Expected::Bind,
            Expected::Execute,
            Expected::Sync,
            Expected::Parse,
            Expected::Sync,
        ] {
            q.push(e);
        }
        q.on_server_message(be::ERROR_RESPONSE);
        assert_eq!(q.len(), 3);
        q.on_server_message(be::READY_FOR_QUERY);
        assert_eq!(q.len(), 2);
        q.on_server_message(be::PARSE_COMPLETE);
        q.on_server_message(be::READY_FOR_QUERY);
        assert!(q.is_empty());
    }

    #[test]
    fn internal_query_is_swallowed_and_client_query_forwarded() {
        let mut q = ReplyQueue::new();
        q.push(Expected::Internal);
        q.push(Expected::Query);
        assert_eq!(q.on_server_message(be::COMMAND_COMPLETE), Route::Swallow);
        assert_eq!(q.on_server_message(be::ERROR_RESPONSE), Route::Swallow);
        assert_eq!(q.on_server_message(be::READY_FOR_QUERY), Route::Swallow);
        assert_eq!(q.on_server_message(be::ERROR_RESPONSE), Route::Forward);
        assert_eq!(q.on_server_message(be::READY_FOR_QUERY), Route::Forward);
        assert!(q.is_empty());
    }

    #[test]
    fn syncs_during_copy_in_are_not_expected() {
        let mut q = ReplyQueue::new();
        // B E S (data...) CopyDone S: PostgreSQL ignores the first Sync.
        for tag in [b'B', b'E', b'S', b'c', b'S'] {
            if let Some(e) = Expected::for_client_message(tag) {
                q.push(e);
            }
        }
        q.on_server_message(be::BIND_COMPLETE);
        q.on_server_message(be::COPY_IN_RESPONSE);
        q.on_server_message(be::COMMAND_COMPLETE);
        assert_eq!(q.len(), 1);
        q.on_server_message(be::READY_FOR_QUERY);
        assert!(q.is_empty());
    }

    #[test]
    fn describe_waits_for_row_description() {
        let mut q = ReplyQueue::new();
        q.push(Expected::Describe);
        q.on_server_message(be::PARAMETER_DESCRIPTION);
        assert_eq!(q.len(), 1);
        q.on_server_message(be::NO_DATA);
        assert!(q.is_empty());
    }
}
