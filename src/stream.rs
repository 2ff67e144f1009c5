//! One byte-stream type for every connection pgmemo holds.
//!
//! A client connection may be plain or upgraded to TLS after `SSLRequest`, and so may a
//! server connection; the code above only wants to read and write bytes. An enum (rather
//! than `Box<dyn AsyncRead + AsyncWrite>`) keeps the plain-TCP hot path free of a virtual
//! call and an allocation, and lets callers still reach the socket for addresses and options.
//! A server may also be reached over a Unix socket (a `host` that is a directory, as libpq
//! takes it); TLS is never negotiated there, as libpq does not either.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

/// A connection to a client or a server, in plain TCP or TLS, or to a server over a Unix
/// socket.
#[derive(Debug)]
pub enum Stream {
    /// Plain TCP, either side.
    Tcp(TcpStream),
    /// A Unix-domain socket (never encrypted). Boxed: unboxed it made every stream, and so
    /// every idle client's session, 8 bytes larger (past its allocator size class).
    Unix(Box<UnixStream>),
    /// A client connection where pgmemo is the TLS server. Boxed: the TLS state is large and
    /// would otherwise make every plain stream as big.
    ServerTls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
    /// A server connection where pgmemo is the TLS client.
    ClientTls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

/// One read(2) of at most `room` bytes into `spare`, for [`Stream::try_read_buf_socket`]:
/// `n` bytes read; a read that left room (`drained`) answers `WouldBlock`, for the runtime to
/// clear the readiness it saw before it, as its own `poll_read` does.
#[inline(always)]
fn read_socket(
    fd: std::os::fd::RawFd,
    spare: *mut libc::c_void,
    room: usize,
    n: &mut usize,
    drained: &mut bool,
) -> io::Result<()> {
    // SAFETY: `spare` is the start of a buffer's spare room of `room` bytes, borrowed by
    // the caller for the call; read(2) writes at most `room` bytes there.
    let got = unsafe { libc::read(fd, spare, room) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    *n = got as usize;
    if 0 < *n && *n < room {
        *drained = true;
        return Err(io::ErrorKind::WouldBlock.into());
    }
    Ok(())
}

/// Applies the same expression to whichever stream is inside, pinned (all are `Unpin`).
macro_rules! delegate {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            Stream::Tcp(t) => {
                let $s = Pin::new(t);
                $e
            }
            Stream::Unix(u) => {
                let $s = Pin::new(&mut **u);
                $e
            }
            Stream::ServerTls(t) => {
                let $s = Pin::new(&mut **t);
                $e
            }
            Stream::ClientTls(t) => {
                let $s = Pin::new(&mut **t);
                $e
            }
        }
    };
}

impl Stream {
    /// Whether the bytes are encrypted.
    #[inline]
    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::ServerTls(_) | Stream::ClientTls(_))
    }

    /// Whether this is a Unix-domain socket (no IP addresses, no TLS).
    #[inline]
    pub fn is_unix(&self) -> bool {
        matches!(self, Stream::Unix(_))
    }

    /// The underlying TCP socket, for addresses and socket options; None over a Unix socket.
    /// Reading or writing it directly would corrupt a TLS stream.
    #[inline]
    pub fn tcp(&self) -> Option<&TcpStream> {
        match self {
            Stream::Tcp(t) => Some(t),
            Stream::Unix(_) => None,
            Stream::ServerTls(t) => Some(t.get_ref().0),
            Stream::ClientTls(t) => Some(t.get_ref().0),
        }
    }

    /// Reads what the socket holds without waiting (`WouldBlock` when nothing arrived), from
    /// the reactor's cached readiness. Plain sockets only: on a TLS stream the bytes would be
    /// taken from under the TLS layer, so it is only used to peek at idle connections.
    #[inline]
    pub fn try_read_socket(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(u) => u.try_read(buf),
            Stream::Tcp(t) => t.try_read(buf),
            Stream::ServerTls(t) => t.get_ref().0.try_read(buf),
            Stream::ClientTls(t) => t.get_ref().0.try_read(buf),
        }
    }

    /// Whether the runtime has seen the socket readable (or closed) since its readiness was
    /// last cleared, without a poll (which would register the waker). Always true for TLS.
    #[inline]
    pub fn seen_readable(&self) -> bool {
        match self {
            Stream::Tcp(t) => t.try_io(Interest::READABLE, || Ok(())).is_ok(),
            Stream::Unix(u) => u.try_io(Interest::READABLE, || Ok(())).is_ok(),
            Stream::ServerTls(_) | Stream::ClientTls(_) => true,
        }
    }

    /// Reads what a plain socket (TCP or Unix) holds into `buf`'s spare room without the
    /// runtime's poll (its cooperative budget and the set-up of a read: ~65 instructions a
    /// read, callgrind), for the first read after the runtime saw the socket readable,
    /// which a poll would only confirm. As the runtime's `poll_read` does, a read that leaves
    /// room (the socket drained) clears the readiness seen before it, so that the next look
    /// waits for the runtime to see the socket readable again; so does a read that would
    /// block (`WouldBlock`: poll then, which registers the waker). None for TLS, whose bytes
    /// go through its session.
    #[inline]
    pub fn try_read_buf_socket(&self, buf: &mut bytes::BytesMut) -> Option<io::Result<usize>> {
        use std::os::fd::AsRawFd;
        let room = buf.capacity() - buf.len();
        if room == 0 {
            return None; // (a read of nothing would look like the end)
        }
        let spare = buf.spare_capacity_mut().as_mut_ptr().cast();
        // Read inside the runtime's `try_io`, which clears the readiness it saw when the
        // read says `WouldBlock`: the socket had nothing, or (`drained`) the read left room.
        let (mut n, mut drained) = (0, false);
        let result = match self {
            Stream::Tcp(t) => t.try_io(Interest::READABLE, || {
                read_socket(t.as_raw_fd(), spare, room, &mut n, &mut drained)
            }),
            Stream::Unix(u) => u.try_io(Interest::READABLE, || {
                read_socket(u.as_raw_fd(), spare, room, &mut n, &mut drained)
            }),
            Stream::ServerTls(_) | Stream::ClientTls(_) => return None,
        };
        match result {
            Ok(()) => {}
            Err(_) if drained => {}
            Err(e) => return Some(Err(e)),
        }
        // SAFETY: read(2) wrote these `n` bytes (at most `room`) right after `buf`'s own.
        unsafe { buf.set_len(buf.len() + n) };
        Some(Ok(n))
    }

    /// Writes to a plain socket (TCP or Unix) without the runtime's poll: as much as it takes
    /// now, or `WouldBlock` (poll it then, which registers the waker). None for TLS, whose
    /// bytes go through its session.
    #[inline]
    pub fn try_write_socket(&self, buf: &[u8]) -> Option<io::Result<usize>> {
        match self {
            Stream::Tcp(t) => Some(t.try_write(buf)),
            Stream::Unix(u) => Some(u.try_write(buf)),
            Stream::ServerTls(_) | Stream::ClientTls(_) => None,
        }
    }

    /// Registers the socket with the event loop of the calling thread instead of the one it
    /// was registered with (see workers.rs): a duplicate of its descriptor joins this loop,
    /// and the old descriptor leaves its loop and is closed. The connection, TLS state
    /// included, stays as it was; only the thread its readiness wakes changes.
    pub fn move_to_this_thread(&mut self) -> io::Result<()> {
        if let Stream::Unix(u) = self {
            let fd = u.as_fd().try_clone_to_owned()?;
            **u = UnixStream::from_std(std::os::unix::net::UnixStream::from(fd))?;
            return Ok(());
        }
        let tcp = match self {
            Stream::Unix(_) => unreachable!("moved above"),
            Stream::Tcp(t) => t,
            Stream::ServerTls(t) => t.get_mut().0,
            Stream::ClientTls(t) => t.get_mut().0,
        };
        let fd = tcp.as_fd().try_clone_to_owned()?;
        *tcp = TcpStream::from_std(std::net::TcpStream::from(fd))?;
        Ok(())
    }

    /// Readiness to read, polled without a buffer (see crate::buffers). A TLS stream may
    /// hold decrypted bytes its socket no longer shows, so it is always ready to be read.
    #[inline]
    pub fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Stream::Tcp(t) => t.poll_read_ready(cx),
            Stream::Unix(u) => u.poll_read_ready(cx),
            _ => Poll::Ready(Ok(())),
        }
    }

    /// The remote address of the socket; an error over a Unix socket, which has none.
    #[inline]
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp().ok_or_else(no_ip)?.peer_addr()
    }

    /// The local address of the socket; an error over a Unix socket, which has none.
    #[inline]
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp().ok_or_else(no_ip)?.local_addr()
    }
}

fn no_ip() -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        "a Unix socket has no IP address",
    )
}

impl AsFd for Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Tcp(t) => t.as_fd(),
            Stream::Unix(u) => u.as_fd(),
            Stream::ServerTls(t) => t.get_ref().0.as_fd(),
            Stream::ClientTls(t) => t.get_ref().0.as_fd(),
        }
    }
}

impl AsyncRead for Stream {
    #[inline]
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_read(cx, buf))
    }
}

impl AsyncWrite for Stream {
    #[inline]
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        delegate!(self, s => s.poll_write(cx, buf))
    }

    #[inline]
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        delegate!(self, s => s.poll_write_vectored(cx, bufs))
    }

    #[inline]
    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Tcp(t) => t.is_write_vectored(),
            Stream::Unix(u) => u.is_write_vectored(),
            Stream::ServerTls(t) => t.is_write_vectored(),
            Stream::ClientTls(t) => t.is_write_vectored(),
        }
    }

    #[inline]
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_flush(cx))
    }

    #[inline]
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_shutdown(cx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A read without the runtime's poll leaves the socket's readiness as the runtime's own
    /// read does: cleared once drained (so that the next look waits for the runtime to see
    /// bytes again) or when nothing was there; kept when the room filled up (more may wait).
    #[tokio::test]
    async fn a_read_without_a_poll_keeps_readiness_as_a_polled_read_does() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, server) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let mut client = client.unwrap();
        let server = Stream::Tcp(server.unwrap().0);
        let Stream::Tcp(tcp) = &server else {
            unreachable!()
        };

        client.write_all(b"hello world").await.unwrap();
        tcp.readable().await.unwrap();
        assert!(server.seen_readable());
        // Room for part of it: the room fills, the socket still has bytes, readiness stays.
        let mut buf = bytes::BytesMut::with_capacity(4);
        let room = buf.capacity();
        let n = server.try_read_buf_socket(&mut buf).unwrap().unwrap();
        assert_eq!((n, &buf[..]), (room, &b"hello world"[..room]));
        assert!(server.seen_readable(), "more may wait: still readable");
        // Room for the rest: drained, readiness cleared.
        buf.reserve(64);
        let n = server.try_read_buf_socket(&mut buf).unwrap().unwrap();
        assert_eq!((n, &buf[..]), (11 - room, &b"hello world"[..]));
        assert!(!server.seen_readable(), "drained: no longer seen readable");
        let again = server.try_read_buf_socket(&mut buf).unwrap();
        assert_eq!(again.unwrap_err().kind(), io::ErrorKind::WouldBlock);

        // Bytes again, then the end.
        client.write_all(b"!").await.unwrap();
        tcp.readable().await.unwrap();
        assert_eq!(server.try_read_buf_socket(&mut buf).unwrap().unwrap(), 1);
        assert_eq!(&buf[..], b"hello world!");
        drop(client);
        tcp.readable().await.unwrap();
        assert_eq!(server.try_read_buf_socket(&mut buf).unwrap().unwrap(), 0);
        // Nothing read when the runtime has not seen the socket readable: no system call.
        let (other, _peer) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let other = Stream::Tcp(other.unwrap());
        let mut empty = bytes::BytesMut::with_capacity(16);
        let none = other.try_read_buf_socket(&mut empty).unwrap();
        assert_eq!(none.unwrap_err().kind(), io::ErrorKind::WouldBlock);
        assert!(empty.is_empty());
    }

    #[tokio::test]
    async fn plain_stream_passes_bytes_and_addresses() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, server) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let mut client = Stream::Tcp(client.unwrap());
        let mut server = Stream::Tcp(server.unwrap().0);
        assert!(!client.is_tls());
        assert_eq!(client.peer_addr().unwrap(), addr);
        assert_eq!(server.local_addr().unwrap(), addr);
        assert_eq!(server.peer_addr().unwrap(), client.local_addr().unwrap());

        let bufs = [io::IoSlice::new(b"hel"), io::IoSlice::new(b"lo")];
        let mut written = 0;
        while written < 5 {
            // write_vectored may write part; the test only needs all five bytes across.
            written += if written == 0 {
                client.write_vectored(&bufs).await.unwrap()
            } else {
                client.write(&b"hello"[written..]).await.unwrap()
            };
        }
        client.flush().await.unwrap();
        let mut got = [0u8; 5];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");

        client.shutdown().await.unwrap();
        assert_eq!(
            server.read(&mut got).await.unwrap(),
            0,
            "EOF after shutdown"
        );
    }

    /// What the relay's unpolled client reads rest on (`Session::poll_client_read`): a read
    /// shorter than the room drains the socket and clears its readiness, and readiness the
    /// runtime sees later shows without a poll.
    #[tokio::test]
    async fn a_drained_socket_reads_as_unready_until_the_runtime_sees_more() {
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let (mut ours, mut theirs) = (Stream::Unix(Box::new(ours)), Stream::Unix(Box::new(theirs)));
        let mut buf = [0u8; 64];
        theirs.write_all(b"one").await.unwrap();
        std::future::poll_fn(|cx| ours.poll_read_ready(cx))
            .await
            .unwrap();
        assert!(ours.seen_readable(), "seen readable, not polled again");
        assert_eq!(ours.read(&mut buf).await.unwrap(), 3);
        assert!(!ours.seen_readable(), "a short read drained it");
        theirs.write_all(b"two").await.unwrap();
        std::future::poll_fn(|cx| ours.poll_read_ready(cx))
            .await
            .unwrap();
        assert!(ours.seen_readable());
        assert_eq!(ours.read(&mut buf).await.unwrap(), 3);
        assert!(!ours.seen_readable());
        drop(theirs);
        std::future::poll_fn(|cx| ours.poll_read_ready(cx))
            .await
            .unwrap();
        assert!(ours.seen_readable(), "a hang-up shows as readable");
        assert_eq!(ours.read(&mut buf).await.unwrap(), 0, "closed");
    }

    /// What `Session::poll_client_read` tells a Pending that registered the waker by
    /// (`Session::registration_stays`): budget is left after it; a Pending for the task's spent
    /// cooperative budget, which registers nothing, leaves none.
    #[tokio::test]
    async fn a_pending_for_the_spent_budget_leaves_no_budget() {
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let (ours, mut theirs) = (Stream::Unix(Box::new(ours)), Stream::Unix(Box::new(theirs)));
        std::future::poll_fn(|cx| {
            assert!(ours.poll_read_ready(cx).is_pending(), "nothing to read");
            assert!(tokio::task::coop::has_budget_remaining(), "registered");
            std::task::Poll::Ready(())
        })
        .await;
        theirs.write_all(b"x").await.unwrap();
        std::future::poll_fn(|cx| ours.poll_read_ready(cx))
            .await
            .unwrap();
        let spent = std::future::poll_fn(|cx| {
            // Readable: every poll spends budget until the runtime's says Pending.
            for _ in 0..10_000 {
                if ours.poll_read_ready(cx).is_pending() {
                    return std::task::Poll::Ready(Some(tokio::task::coop::has_budget_remaining()));
                }
            }
            std::task::Poll::Ready(None)
        })
        .await;
        assert_eq!(spent, Some(false), "a Pending for the spent budget");
    }
}
