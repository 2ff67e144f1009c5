//! A session driven by hand, for `benches/hot_path.rs`: the session's own code for a client's
//! batch and for the server's replies, timed without sockets or a runtime (see
//! [`BenchSession`]).

use super::Session;
use crate::app::{App, ClientInfo};
use crate::pool::Pool;
use crate::server::ServerConn;
use crate::statements::ClientStatements;
use bytes::BytesMut;
use std::sync::Arc;
use std::task::{Context, Poll};

use super::ClientConn;

/// A session driven by hand instead of by its relay loop, with nothing read from or written to
/// its sockets: for benches/hot_path.rs, which times the session's own code for a client's
/// batch and for the server's replies. Not part of pgmemo's API.
#[doc(hidden)]
pub struct BenchSession(Session);

impl BenchSession {
    /// A logged-in client of `pool` (`info` its entry in the app, `client` its connection) that
    /// holds `server`, with its statement planner on if the pool has it.
    pub fn new(
        app: Arc<App>,
        info: Arc<ClientInfo>,
        pool: Arc<Pool>,
        client: ClientConn,
        server: ServerConn,
    ) -> BenchSession {
        let mut session = Session::new(app, info, pool, client);
        session.params.reported = session.pool.share_reported(session.params.reported.clone());
        session.track_statements();
        session.hold(Box::new(server));
        BenchSession(session)
    }

    /// What the client sent, as read from its socket.
    pub fn client_input(&mut self) -> &mut BytesMut {
        &mut self.0.client.rbuf
    }

    /// What the session has for the client, not yet written to its socket.
    pub fn client_output(&mut self) -> &mut BytesMut {
        &mut self.0.client.wbuf
    }

    /// The server held (its `rbuf` is what it sent, its `wbuf` what it is to be sent).
    pub fn server(&mut self) -> &mut ServerConn {
        self.0
            .server
            .as_mut()
            .expect("a bench session holds its server")
    }

    /// The client's prepared statements, if the planner is on.
    pub fn statements(&self) -> Option<&ClientStatements> {
        self.0.plan.stmts.as_ref()
    }

    /// Plans every complete message of the client's input, as the relay loop does when the
    /// client's socket was readable. Panics if that had to wait (for a server or for replies)
    /// or ended the session.
    pub fn client_messages(&mut self) {
        let planned = {
            let planning = std::pin::pin!(self.0.handle_client_messages());
            let mut cx = Context::from_waker(std::task::Waker::noop());
            std::future::Future::poll(planning, &mut cx)
        };
        match planned {
            Poll::Ready(Ok(())) => assert!(!self.0.plan.waiting, "planning waits for replies"),
            Poll::Ready(Err(end)) => panic!("the session ended: {end:?}"),
            Poll::Pending => panic!("planning waits for a server"),
        }
    }

    /// Routes every complete message of the server's input, as the relay loop does when the
    /// server's socket was readable. Panics if that ended the session.
    pub fn server_messages(&mut self) {
        if let Err(end) = self.0.handle_server_messages() {
            panic!("the session ended: {end:?}");
        }
    }

    /// Drops the replies still expected (and their bookkeeping, unapplied), the batch kept
    /// for a retry, and the server's unsent output: the state after the server has answered a
    /// batch that needed no bookkeeping, without routing its answers.
    pub fn forget_replies(&mut self) {
        let session = &mut self.0;
        session.replies.clear();
        session.replies.drain_outcomes();
        session.plan.retry.forget();
        if let Some(server) = session.server.as_mut() {
            server.wbuf.clear();
        }
    }
}
