//! Replication connections (`replication=database` for logical replication, `replication=true`
//! for physical): pg_recvlogical, pg_basebackup, pg_receivewal, a subscription, Debezium.
//!
//! As PgBouncer (1.23 and later) serves them: each gets a server connection of its own,
//! opened for it with its `replication` parameter and its own startup settings (a
//! subscription's `options`, its application_name), taken from its pool's slots and budgets
//! (an idle server is closed to make room), and relayed byte for byte until either side
//! leaves. Nothing of it is read: the walsender's commands and its COPY BOTH stream are the
//! server's business, and the server is never shared or given back. It shows in SHOW CLIENTS
//! and SHOW SERVERS with its kind (`replication` column), its bytes in SHOW STATS, and a
//! CancelRequest with its key reaches its walsender. The console's KILL / KILL_CLIENT and a
//! shutdown close it as PostgreSQL closes a walsender (FATAL 57P01).

use super::{start, ClientConn};
use crate::app::{App, ClientInfo, ClientState};
use crate::pool::Pool;
use crate::protocol::backend::{self as be, sqlstate, Severity};
use crate::server::ServerConn;
use crate::stats::LoginFailure;
use crate::stream::Stream;
use bytes::BytesMut;
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::AsyncWrite;
use tokio_util::io::poll_read_buf;

use super::login::Admitted;

/// How much is read from one side before it is written to the other.
const CHUNK: usize = 64 * 1024;

/// Serves a replication client that logged in, to its end.
pub async fn serve(app: Arc<App>, admitted: Box<Admitted>) {
    let Admitted {
        startup,
        peer,
        local,
    } = *admitted;
    let mut conn = startup.conn;
    let info = app.register_client(
        peer,
        local,
        conn.stream.is_tls(),
        &startup.user,
        &startup.database,
    );
    info.set_replication(startup.replication);
    if let Some(pool) = start::pool_of(&app, &mut conn, &startup.database, &startup.user).await {
        let extra: Vec<(&str, &str)> =
            std::iter::once(("replication", startup.replication.parameter()))
                .chain(startup.params.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .collect();
        info.set_state(ClientState::Waiting);
        // A login's wait, timed from its start (SHOW CLIENTS' wait, SHOW POOLS' maxwait).
        let timed = info.start_wait(app.clock_us());
        let checked_out = pool
            .checkout_dedicated(Some(info.killed_flag()), &extra)
            .await;
        if timed {
            info.end_wait();
        }
        match checked_out {
            Ok(server) => relay(&app, &info, &pool, conn, server).await,
            Err(e) => {
                tracing::info!(client = %info.addr, error = %e, "no server for a replication client");
                app.errors.login_failed(LoginFailure::Server);
                if !start::tell_no_server(&mut conn, e).await {
                    stopped(&mut conn).await;
                }
            }
        }
    }
    app.unregister_client(&info);
}

/// Tells the client of the server it got what PostgreSQL tells a client after its login,
/// then relays the two until one leaves, and closes the server.
async fn relay(
    app: &App,
    info: &ClientInfo,
    pool: &Pool,
    mut client: ClientConn,
    mut server: Box<ServerConn>,
) {
    info.hold(&server);
    // The server is the client's for life: its process ID is the client's (pg_stat_replication's
    // pid), and a cancel request is always passed on (a walsender ignores one between commands).
    app.show_pid(info, server.info.backend_pid);
    info.cancels.running();
    for (k, v) in server.reported().iter() {
        be::parameter_status(&mut client.wbuf, k, v);
    }
    if let Some(name) = server.reported().get("application_name") {
        *info.application_name.lock() = app.intern(name);
    }
    be::backend_key_data(&mut client.wbuf, info.pid(), info.secret);
    be::ready_for_query(&mut client.wbuf, b'I');
    pool.stats.here().client_logins.fetch_add(1, Relaxed);
    if app.config.load().general.log_connections {
        tracing::info!(
            client = %info.addr,
            "login: db={} user={} replication={}",
            info.database,
            info.user,
            info.replication().name()
        );
    }
    // The login's messages, then whatever either side sent ahead (a client's first command
    // right after its startup packet).
    let mut to_client = std::mem::take(&mut client.wbuf);
    to_client.extend_from_slice(&server.rbuf);
    server.rbuf.clear();
    let mut flows = Flows {
        to_server: Flow::new(std::mem::take(&mut client.rbuf)),
        to_client: Flow::new(to_client),
    };
    flows.to_client.framing = Some(Framing::default());
    *info.stop_waker.lock() = Some(poll_fn(|cx| Poll::Ready(cx.waker().clone())).await);
    let end = poll_fn(|cx| {
        if info.is_killed() || app.is_cut_off() || app.is_shutting_down() || app.is_handing_over() {
            return Poll::Ready(End::Stop);
        }
        flows.poll(cx, &mut client.stream, &mut server.stream, pool)
    })
    .await;
    match end {
        // Told only between two messages: one in the middle of a CopyData would be read as
        // the rest of it.
        End::Stop if flows.client_between_messages() => stopped(&mut client).await,
        End::Stop => tracing::info!(client = %info.addr, "replication client closed mid-message"),
        End::ServerGone(e) => {
            tracing::info!(client = %info.addr, error = ?e, "replication server connection ended")
        }
        End::ClientGone(e) => {
            tracing::debug!(client = %info.addr, error = ?e, "replication client left")
        }
    }
    info.cancels.done();
    info.let_go();
    server.info.client_id.store(0, Relaxed);
    pool.release_slot(&server);
    tokio::spawn(server.terminate());
}

/// A client stopped by the console or a shutdown, told as PostgreSQL tells a walsender's.
async fn stopped(client: &mut ClientConn) {
    client
        .send_error(
            Severity::Fatal,
            sqlstate::ADMIN_SHUTDOWN,
            "terminating connection due to administrator command",
        )
        .await;
}

/// Why a relay ended.
enum End {
    Stop,
    ClientGone(Option<io::Error>),
    ServerGone(Option<io::Error>),
}

/// Bytes on their way from one side to the other.
struct Flow {
    buf: BytesMut,
    /// The source has closed (then the flow ends once `buf` is written).
    eof: bool,
    /// Where the bytes written so far leave the message framing (the server's side, which
    /// is framed messages from the login on).
    framing: Option<Framing>,
}

/// Follows the message framing of bytes written (tag, length, body), without reading them.
#[derive(Default)]
struct Framing {
    header: [u8; 5],
    /// Bytes of the header seen.
    have: usize,
    /// Bytes of the current message's body still to come.
    remaining: u64,
}

impl Framing {
    fn advance(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.remaining > 0 {
                let take = self.remaining.min(bytes.len() as u64);
                self.remaining -= take;
                bytes = &bytes[take as usize..];
                continue;
            }
            self.header[self.have] = bytes[0];
            self.have += 1;
            bytes = &bytes[1..];
            if self.have == self.header.len() {
                let len = u32::from_be_bytes([
                    self.header[1],
                    self.header[2],
                    self.header[3],
                    self.header[4],
                ]);
                self.remaining = u64::from(len).saturating_sub(4);
                self.have = 0;
            }
        }
    }

    fn between_messages(&self) -> bool {
        self.have == 0 && self.remaining == 0
    }
}

impl Flow {
    fn new(buf: BytesMut) -> Flow {
        Flow {
            buf,
            eof: false,
            framing: None,
        }
    }

    /// Moves bytes from `from` to `to` until neither can go on; Ready(Err) when a side failed,
    /// Ready(Ok) when `from` closed and everything it sent was written.
    fn poll(
        &mut self,
        cx: &mut Context<'_>,
        from: &mut Stream,
        to: &mut Stream,
        count: &std::sync::atomic::AtomicU64,
    ) -> Poll<Result<(), Side>> {
        loop {
            while !self.buf.is_empty() {
                match Pin::new(&mut *to).poll_write(cx, &self.buf) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Err(Side::To(None))),
                    Poll::Ready(Ok(n)) => {
                        count.fetch_add(n as u64, Relaxed);
                        let written = self.buf.split_to(n);
                        if let Some(framing) = self.framing.as_mut() {
                            framing.advance(&written);
                        }
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(Side::To(Some(e)))),
                    Poll::Pending => return Poll::Pending,
                }
            }
            match Pin::new(&mut *to).poll_flush(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(Side::To(Some(e)))),
                Poll::Pending => return Poll::Pending,
            }
            if self.eof {
                return Poll::Ready(Ok(()));
            }
            self.buf.clear();
            self.buf.reserve(CHUNK);
            match poll_read_buf(Pin::new(&mut *from), cx, &mut self.buf) {
                Poll::Ready(Ok(0)) => self.eof = true,
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(Side::From(Some(e)))),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// Which side of a flow failed.
enum Side {
    From(Option<io::Error>),
    To(Option<io::Error>),
}

/// Both directions of a relay.
struct Flows {
    to_server: Flow,
    to_client: Flow,
}

impl Flows {
    /// Whether everything the server sent has reached the client, ending with a whole
    /// message: a message of pgmemo's may follow.
    fn client_between_messages(&self) -> bool {
        self.to_client.buf.is_empty()
            && self
                .to_client
                .framing
                .as_ref()
                .is_some_and(Framing::between_messages)
    }

    /// Ready when either side has closed or failed (what the other side sent before is
    /// delivered first).
    fn poll(
        &mut self,
        cx: &mut Context<'_>,
        client: &mut Stream,
        server: &mut Stream,
        pool: &Pool,
    ) -> Poll<End> {
        let stats = pool.stats.here();
        if let Poll::Ready(r) = self
            .to_server
            .poll(cx, client, server, &stats.bytes_received)
        {
            return Poll::Ready(match r {
                Ok(()) => End::ClientGone(None),
                Err(Side::From(e)) => End::ClientGone(e),
                Err(Side::To(e)) => End::ServerGone(e),
            });
        }
        if let Poll::Ready(r) = self.to_client.poll(cx, server, client, &stats.bytes_sent) {
            return Poll::Ready(match r {
                Ok(()) => End::ServerGone(None),
                Err(Side::From(e)) => End::ServerGone(e),
                Err(Side::To(e)) => End::ClientGone(e),
            });
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::Framing;

    #[test]
    fn framing_follows_messages_split_anywhere() {
        // A CopyData of 6 body bytes, then a ReadyForQuery.
        let bytes = [b"d\0\0\0\x0aabcdef".as_slice(), b"Z\0\0\0\x05I"].concat();
        for cut in 0..=bytes.len() {
            let mut f = Framing::default();
            f.advance(&bytes[..cut]);
            let between = [0, 11, bytes.len()].contains(&cut);
            assert_eq!(f.between_messages(), between, "cut at {cut}");
            f.advance(&bytes[cut..]);
            assert!(f.between_messages());
        }
    }
}
