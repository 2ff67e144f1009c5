//! Online restart: a new pgmemo process takes over the listening sockets and the idle
//! clients of the one running, so an upgrade or a configuration change that needs a restart
//! drops no client. PgBouncer's old `-R` and pg_doorman do the same (file descriptors passed
//! over a Unix socket); what moves here is decided per session, between its transactions.
//!
//! The steps:
//! 1. Every pgmemo listens on a control socket (`takeover_socket`), mode 0600, and answers
//!    only a peer of its own user (or root).
//! 2. `pgmemo --takeover` connects there and says [`Kind::Hello`]. The old process removes
//!    the control socket's file (the new one binds its own), and sends [`Kind::Listeners`]:
//!    duplicates of its TCP listener, Unix-socket listener and metrics listener. The kernel
//!    keeps one queue per listening socket, so nothing that connects in between is refused:
//!    the new process accepts from here on, the old one stops accepting.
//! 3. The old process stops accepting (`App::begin_handover`; not yet a shutdown: its
//!    janitor and WAL streams go on) and its sessions are handed over: each at its next rest
//!    (see `session::handover`) sends its client's socket and its written-down state
//!    ([`Kind::Client`]); the new process makes a session of it and serves the client's next
//!    message. Clients in a transaction finish it in the old process first; those that
//!    cannot move (TLS, session mode, pinned) stay there until they can or leave. Once no
//!    client is left, or `shutdown_timeout` after the takeover began, the old process shuts
//!    down as at SIGINT (`Pgmemo::wait`).
//!    If the new process goes away before that (the control connection ends), the old one
//!    accepts again on the sockets it kept, serves the clients it still has (those in the
//!    queue to be sent go on here too) and listens for another takeover.
//! 4. Until the old process exits (the control connection closes), cancel requests with a
//!    key the new one does not know go back to it ([`Kind::Cancel`]).
//!
//! The wire: frames of an 8-byte header (kind, number of descriptors, two zero bytes, length
//! of the body, big-endian) sent with the frame's descriptors in one `sendmsg`, then the
//! body. The control connection is blocking I/O on threads of its own: it carries a few
//! messages per client once per restart, never the hot path. The `sendfd` crate does the
//! `SCM_RIGHTS` part.

use crate::app::App;
use anyhow::{bail, Context as _};
use sendfd::{RecvWithFd, SendWithFd};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The version of the messages below; a process speaking another refuses the takeover.
const VERSION: u32 = 1;
/// More descriptors than a frame ever carries (the listeners: three).
const MAX_FDS: usize = 4;
/// A client's written-down session is a few KiB; prepared statements can make it more.
const MAX_BODY: usize = 256 * 1024 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    /// New → old: the version (4 bytes) it speaks.
    Hello = 1,
    /// Old → new: the listening sockets (TCP, then the Unix socket's and the metrics
    /// endpoint's when the body says so: the Unix socket's path, or empty; then `m` or not).
    Listeners = 2,
    /// Old → new: a client's socket and its session (`session::handover`'s text).
    Client = 3,
    /// New → old: a CancelRequest's process ID and secret (4 + 4 bytes).
    Cancel = 4,
    /// Old → new: no takeover (the body says why).
    Refused = 5,
}

impl Kind {
    fn of(byte: u8) -> Option<Kind> {
        Some(match byte {
            1 => Kind::Hello,
            2 => Kind::Listeners,
            3 => Kind::Client,
            4 => Kind::Cancel,
            5 => Kind::Refused,
            _ => return None,
        })
    }
}

/// Sends one frame (blocking).
fn send(stream: &UnixStream, kind: Kind, body: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let len = u32::try_from(body.len()).map_err(|_| io::Error::other("frame too long"))?;
    let mut header = [kind as u8, fds.len() as u8, 0, 0, 0, 0, 0, 0];
    header[4..].copy_from_slice(&len.to_be_bytes());
    let sent = stream.send_with_fd(&header, fds)?;
    let mut writer = stream;
    writer.write_all(&header[sent..])?;
    writer.write_all(body)
}

/// A frame as received: its kind, body and descriptors.
type Frame = (Kind, Vec<u8>, Vec<OwnedFd>);

/// Receives one frame (blocking); None at the end of the connection.
fn recv(stream: &UnixStream) -> io::Result<Option<Frame>> {
    let mut header = [0u8; 8];
    let mut raw: [RawFd; MAX_FDS] = [-1; MAX_FDS];
    let (n, count) = loop {
        match stream.recv_with_fd(&mut header, &mut raw) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => break r?,
        }
    };
    // SAFETY: the kernel gave these descriptors to this process in this message: nothing
    // else owns them.
    let fds: Vec<OwnedFd> = raw[..count]
        .iter()
        .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    if n == 0 {
        return Ok(None);
    }
    let mut reader = stream;
    reader.read_exact(&mut header[n..])?;
    let kind = Kind::of(header[0])
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unknown frame"))?;
    if header[1] as usize != fds.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a frame lost its descriptors",
        ));
    }
    let len = u32::from_be_bytes([header[4], header[5], header[6], header[7]]) as usize;
    if len > MAX_BODY {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "frame too long"));
    }
    let mut body = vec![0; len];
    reader.read_exact(&mut body)?;
    Ok(Some((kind, body, fds)))
}

/// Where the control socket of a pgmemo listening on `port` is (see `takeover_socket`).
pub fn control_path(general: &crate::config::General, port: u16) -> Option<PathBuf> {
    if !general.online_restart {
        return None;
    }
    Some(match (&general.takeover_socket, &general.unix_socket_dir) {
        (Some(path), _) => path.clone(),
        (None, Some(dir)) => dir.join(format!(".s.PGSQL.{port}.takeover")),
        (None, None) => PathBuf::from(format!("/tmp/.s.pgmemo.{port}.takeover")),
    })
}

/// Duplicates of the sockets a running pgmemo listens on, kept to be given to a successor.
pub struct ListenerFds {
    pub tcp: OwnedFd,
    pub unix: Option<(OwnedFd, PathBuf)>,
    pub metrics: Option<OwnedFd>,
}

impl ListenerFds {
    /// Duplicates `tcp`, `unix` and `metrics` (the originals stay with their accept loops).
    pub fn duplicate(
        tcp: &impl AsFd,
        unix: Option<(&impl AsFd, &Path)>,
        metrics: Option<&impl AsFd>,
    ) -> io::Result<ListenerFds> {
        Ok(ListenerFds {
            tcp: tcp.as_fd().try_clone_to_owned()?,
            unix: match unix {
                Some((fd, path)) => Some((fd.as_fd().try_clone_to_owned()?, path.to_owned())),
                None => None,
            },
            metrics: match metrics {
                Some(fd) => Some(fd.as_fd().try_clone_to_owned()?),
                None => None,
            },
        })
    }
}

/// The listening sockets a new process received from the old one, and the connection the
/// old one's clients arrive on.
pub struct Inherited {
    tcp: Option<std::net::TcpListener>,
    unix: Option<(std::os::unix::net::UnixListener, PathBuf)>,
    metrics: Option<std::net::TcpListener>,
    link: UnixStream,
}

/// The listeners of [`Inherited::take_listeners`]: TCP, Unix socket, metrics endpoint.
pub type Listeners = (
    tokio::net::TcpListener,
    Option<crate::listen::UnixSocket>,
    Option<tokio::net::TcpListener>,
);

/// The old process's end: the control socket, its file removed when dropped (unless a
/// successor's file has taken its place).
pub struct ControlSocket {
    file: BoundFile,
}

/// The control socket's path and the inode of the file this process bound there.
#[derive(Clone)]
struct BoundFile {
    path: PathBuf,
    inode: u64,
}

impl BoundFile {
    /// Removes the file if it is still the one this process bound (a successor binds a file
    /// of its own at the same path).
    fn remove(&self) {
        use std::os::unix::fs::MetadataExt as _;
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.ino() == self.inode) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        self.file.remove();
    }
}

/// Listens for a successor on `path` (see the module's header); `fds` are what it will get.
/// A live socket there (another pgmemo on the same path) only turns online restart off for
/// this process, with a warning: it is no reason to refuse to serve.
pub fn listen(app: Arc<App>, path: PathBuf, fds: ListenerFds) -> Option<ControlSocket> {
    serve(app, path, bind, fds)
}

/// Binds the control socket at `path` with `bind` and waits there for a successor; None,
/// with a warning, when it cannot be bound.
fn serve(
    app: Arc<App>,
    path: PathBuf,
    bind: impl FnOnce(&Path) -> anyhow::Result<(tokio::net::UnixListener, u64)>,
    fds: ListenerFds,
) -> Option<ControlSocket> {
    match bind(&path) {
        Ok((listener, inode)) => {
            let file = BoundFile { path, inode };
            tokio::spawn(accept(app, listener, fds, file.clone()));
            Some(ControlSocket { file })
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), "online restart is off: {e:#}");
            None
        }
    }
}

fn bind(path: &Path) -> anyhow::Result<(tokio::net::UnixListener, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    crate::listen::remove_stale(path, "general.takeover_socket")?;
    let listener = std::os::unix::net::UnixListener::bind(path)
        .with_context(|| format!("cannot listen on {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot set the mode of {}", path.display()))?;
    let inode = std::fs::symlink_metadata(path)?.ino();
    listener.set_nonblocking(true)?;
    Ok((tokio::net::UnixListener::from_std(listener)?, inode))
}

/// Waits for a successor; serves the first one that asks as its own user.
async fn accept(
    app: Arc<App>,
    listener: tokio::net::UnixListener,
    fds: ListenerFds,
    file: BoundFile,
) {
    // No takeover once pgmemo stops accepting (any shutdown): the duplicates of the
    // listening sockets close with this task, so nothing is left listening.
    let mut accepting = app.accepting_signal();
    let stream = loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "takeover socket: accept failed");
                    continue;
                }
            },
            _ = accepting.wait_for(|a| !*a) => return,
        };
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        match stream.peer_cred() {
            Ok(cred) if cred.uid() == me || cred.uid() == 0 => break stream,
            Ok(cred) => {
                tracing::warn!(
                    uid = cred.uid(),
                    "takeover socket: refused a process of another user"
                );
            }
            Err(e) => tracing::warn!(error = %e, "takeover socket: cannot read the peer's user"),
        }
    };
    let stream = match stream.into_std().and_then(|s| {
        s.set_nonblocking(false)?;
        Ok(s)
    }) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "takeover socket: cannot use the connection");
            return;
        }
    };
    drop(listener);
    let handle = tokio::runtime::Handle::current();
    let thread = std::thread::Builder::new()
        .name("pgmemo-takeover".into())
        .spawn(move || hand_over(app, stream, fds, file, handle));
    if let Err(e) = thread {
        tracing::warn!(error = %e, "takeover: cannot start its thread");
    }
}

/// The old process's side, from the successor's Hello to the last client handed over.
fn hand_over(
    app: Arc<App>,
    stream: UnixStream,
    fds: ListenerFds,
    file: BoundFile,
    handle: tokio::runtime::Handle,
) {
    match recv(&stream) {
        Ok(Some((Kind::Hello, body, _))) if body == VERSION.to_be_bytes() => {}
        Ok(Some((Kind::Hello, _, _))) => {
            let _ = send(
                &stream,
                Kind::Refused,
                b"another version of the takeover",
                &[],
            );
            return;
        }
        other => {
            tracing::warn!("takeover: the peer did not say hello ({:?})", other.err());
            return;
        }
    }
    if app.is_shutting_down() || app.is_draining() {
        let _ = send(&stream, Kind::Refused, b"this pgmemo is shutting down", &[]);
        return;
    }
    tracing::info!("takeover: a new pgmemo process takes over; handing over the listeners");
    // The successor binds the control socket's path next.
    file.remove();
    let mut body = Vec::new();
    let mut raw = vec![fds.tcp.as_raw_fd()];
    if let Some((fd, path)) = &fds.unix {
        raw.push(fd.as_raw_fd());
        body.extend_from_slice(path.as_os_str().as_encoded_bytes());
    }
    body.push(0);
    if let Some(fd) = &fds.metrics {
        raw.push(fd.as_raw_fd());
        body.push(b'm');
    }
    if let Err(e) = send(&stream, Kind::Listeners, &body, &raw) {
        tracing::warn!(error = %e, "takeover: cannot send the listeners; going on here");
        listen_again(&app, &handle, file, fds);
        return;
    }
    // Cancel requests for the clients still here, from the new process; the end of the
    // connection before this process has handed every client over means it went away.
    match stream.try_clone() {
        Ok(reader) => {
            let app = app.clone();
            let handle = handle.clone();
            let _ = std::thread::Builder::new()
                .name("pgmemo-takeover-cancels".into())
                .spawn(move || read_from_successor(app, reader, handle));
        }
        Err(e) => tracing::warn!(error = %e, "takeover: cancel requests will not come back"),
    }
    // From here on this process accepts no more and hands its sessions over as they rest.
    let (sink, handoffs) = std::sync::mpsc::channel();
    app.begin_handover(sink);
    let mut gone = false;
    while let Ok(handoff) = handoffs.recv() {
        if !gone {
            let sent = send(
                &stream,
                Kind::Client,
                &handoff.state,
                &[handoff.socket.as_raw_fd()],
            );
            match sent {
                Ok(()) => {
                    app.handoff.sent(true);
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "takeover: the new process is gone; the clients stay here");
                    gone = true;
                    app.end_handover();
                }
            }
        }
        // The new process is gone: the client goes on here, as it was.
        app.handoff.sent(false);
        match crate::session::read_carried(&handoff.state) {
            Some(carried) => {
                handle.spawn(crate::connection::resume_client(
                    app.clone(),
                    carried,
                    handoff.socket,
                ));
            }
            None => tracing::warn!("takeover: a client's session could not be read back"),
        }
    }
    // The handover ended before this process shut down: the new process went away, and a
    // later takeover may be tried again.
    if !app.is_shutting_down() {
        listen_again(&app, &handle, file, fds);
    }
}

/// Listens for a successor again after a takeover that did not happen.
fn listen_again(
    app: &Arc<App>,
    handle: &tokio::runtime::Handle,
    file: BoundFile,
    fds: ListenerFds,
) {
    let _runtime = handle.enter();
    // The new process's control socket is at the path: it is gone once that process is,
    // but the end of the control connection can be seen a moment before the kernel has
    // closed the rest of a dying process's sockets. This thread may wait (it is no event
    // loop's): a second at most.
    let retried = |path: &Path| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        loop {
            match bind(path) {
                Err(_) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                bound => return bound,
            }
        }
    };
    let control = serve(app.clone(), file.path, retried, fds);
    if let Some(control) = control {
        tracing::info!(socket = %control.file.path.display(), "takeover: listening for another takeover");
        // Kept for the rest of the process: its file stays when it exits (the next bind
        // replaces a stale one).
        std::mem::forget(control);
    }
}

/// The old process's thread that reads what the new one sends after the listeners: cancel
/// requests for the clients still here. Its end, before this process shuts down, means the
/// new process went away: this one accepts again and keeps the clients it has.
fn read_from_successor(app: Arc<App>, stream: UnixStream, handle: tokio::runtime::Handle) {
    loop {
        match recv(&stream) {
            Ok(Some((Kind::Cancel, body, _))) if body.len() == 8 => {
                let pid = i32::from_be_bytes([body[0], body[1], body[2], body[3]]);
                let secret = i32::from_be_bytes([body[4], body[5], body[6], body[7]]);
                let app = app.clone();
                handle.spawn(async move { app.cancel(pid, secret).await });
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    if !app.is_shutting_down() {
        tracing::warn!(
            "takeover: the new process went away before it had every client; accepting again"
        );
        app.end_handover();
    }
}

/// The new process's first step (`pgmemo --takeover`): asks the pgmemo listening on the
/// control socket at `path` for its listeners. None when no pgmemo answers there (nothing
/// to take over: start as usual).
pub fn take_over(path: &Path) -> anyhow::Result<Option<Inherited>> {
    let link = match UnixStream::connect(path) {
        Ok(link) => link,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
            ) =>
        {
            return Ok(None);
        }
        Err(e) => {
            return Err(e).with_context(|| format!("cannot connect to {}", path.display()));
        }
    };
    // A pgmemo that does not answer within seconds is not going to.
    link.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    send(&link, Kind::Hello, &VERSION.to_be_bytes(), &[])?;
    let (kind, body, mut fds) = recv(&link)
        .with_context(|| format!("no answer from the pgmemo at {}", path.display()))?
        .with_context(|| format!("the pgmemo at {} closed the connection", path.display()))?;
    link.set_read_timeout(None)?;
    match kind {
        Kind::Listeners => {}
        Kind::Refused => bail!(
            "the pgmemo at {} refused the takeover: {}",
            path.display(),
            String::from_utf8_lossy(&body)
        ),
        other => bail!("unexpected {other:?} from the pgmemo at {}", path.display()),
    }
    let nul = body
        .iter()
        .position(|&b| b == 0)
        .context("a malformed listeners frame")?;
    let unix_path = (nul > 0).then(|| {
        use std::os::unix::ffi::OsStrExt as _;
        PathBuf::from(std::ffi::OsStr::from_bytes(&body[..nul]))
    });
    let has_metrics = body.get(nul + 1) == Some(&b'm');
    let wanted = 1 + unix_path.is_some() as usize + has_metrics as usize;
    if fds.len() != wanted {
        bail!("the old pgmemo sent {} sockets, not {wanted}", fds.len());
    }
    let metrics = has_metrics
        .then(|| fds.pop().expect("counted"))
        .map(std::net::TcpListener::from);
    let unix = unix_path.map(|p| {
        let listener = std::os::unix::net::UnixListener::from(fds.pop().expect("counted"));
        (listener, p)
    });
    let tcp = std::net::TcpListener::from(fds.pop().expect("counted"));
    Ok(Some(Inherited {
        tcp: Some(tcp),
        unix,
        metrics,
        link,
    }))
}

impl Inherited {
    /// The listening sockets, on this thread's event loop. `listen`: the configuration's
    /// address, which a takeover cannot change (the old process's socket is kept).
    pub fn take_listeners(&mut self, listen: &str) -> anyhow::Result<Listeners> {
        let tcp = self
            .tcp
            .take()
            .context("the listeners were taken already")?;
        tcp.set_nonblocking(true)?;
        let tcp = tokio::net::TcpListener::from_std(tcp)?;
        let addr = tcp.local_addr()?;
        if listen
            .parse::<std::net::SocketAddr>()
            .is_ok_and(|l| l != addr && l.port() != 0)
        {
            tracing::warn!(%addr, %listen, "general.listen changed: a takeover keeps the old process's socket; restart to listen elsewhere");
        }
        let unix = match self.unix.take() {
            Some((listener, path)) => Some(crate::listen::UnixSocket::inherited(listener, path)?),
            None => None,
        };
        let metrics = match self.metrics.take() {
            Some(l) => {
                l.set_nonblocking(true)?;
                Some(tokio::net::TcpListener::from_std(l)?)
            }
            None => None,
        };
        Ok((tcp, unix, metrics))
    }

    /// The new process's side after it started: makes sessions of the clients the old one
    /// sends (with `serve`, on the event loop of `handle`), and passes it the cancel requests
    /// this one does not know, until it exits.
    pub fn follow<S, F>(self, app: Arc<App>, handle: tokio::runtime::Handle, serve: S)
    where
        S: Fn(Arc<App>, crate::session::Carried, OwnedFd) -> F + Send + 'static,
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let link = self.link;
        // Writes made through the old process are not seen here until it exits.
        app.cache.hold_back(true);
        match link.try_clone() {
            Ok(writer) => {
                let writer = parking_lot::Mutex::new(writer);
                app.handoff
                    .set_predecessor(Some(Box::new(move |pid, secret| {
                        let mut body = pid.to_be_bytes().to_vec();
                        body.extend_from_slice(&secret.to_be_bytes());
                        let _ = send(&writer.lock(), Kind::Cancel, &body, &[]);
                    })));
            }
            Err(e) => tracing::warn!(error = %e, "takeover: cancel requests will not go back"),
        }
        let thread = std::thread::Builder::new()
            .name("pgmemo-takeover".into())
            .spawn(move || {
                let mut taken = 0usize;
                loop {
                    match recv(&link) {
                        Ok(Some((Kind::Client, body, mut fds))) if fds.len() == 1 => {
                            let socket = fds.pop().expect("one");
                            match crate::session::read_carried(&body) {
                                Some(carried) => {
                                    taken += 1;
                                    handle.spawn(serve(app.clone(), carried, socket));
                                }
                                None => tracing::warn!("takeover: a client's session could not be read; its connection is closed"),
                            }
                        }
                        Ok(Some(_)) => {}
                        Ok(None) => break,
                        Err(e) => {
                            tracing::warn!(error = %e, "takeover: the connection to the old process failed");
                            break;
                        }
                    }
                }
                app.handoff.set_predecessor(None);
                app.cache.hold_back(false);
                tracing::info!(clients = taken, "takeover complete: the old process has exited");
            });
        if let Err(e) = thread {
            tracing::warn!(error = %e, "takeover: cannot start its thread");
        }
    }
}
