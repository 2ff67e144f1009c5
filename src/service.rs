//! Telling the service manager how pgmemo is doing: systemd's readiness protocol
//! (`sd_notify(3)`), as PgBouncer speaks it under `Type=notify`.
//!
//! With `NOTIFY_SOCKET` in the environment (systemd sets it for a `Type=notify` service),
//! pgmemo sends `READY=1` once it listens, with `MAINPID=` its process ID: after an online
//! restart that is the new process, which systemd then follows as the service's main
//! process (the unit needs `NotifyAccess=all` for that, see docs/operations.md).
//! `STOPPING=1` goes when a shutdown begins. Without the variable nothing is sent.
//!
//! Written here rather than with a crate: it is one datagram to a Unix socket, whose address
//! may be in the abstract namespace (`@name`).

use std::os::unix::net::UnixDatagram;

/// Sends `state` (lines of `KEY=VALUE`) to the service manager, if there is one. Failures
/// are logged, never fatal: a service manager that does not listen cannot be helped.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(&path, state) {
        tracing::warn!(error = %e, socket = ?path, "cannot notify the service manager");
    }
}

fn send(path: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::linux::net::SocketAddrExt as _;
    use std::os::unix::ffi::OsStrExt as _;
    use std::os::unix::net::SocketAddr;
    let bytes = path.as_bytes();
    let addr = match bytes.strip_prefix(b"@") {
        Some(name) => SocketAddr::from_abstract_name(name)?,
        None => SocketAddr::from_pathname(std::path::Path::new(path))?,
    };
    let socket = UnixDatagram::unbound()?;
    socket.send_to_addr(state.as_bytes(), &addr)?;
    Ok(())
}

/// pgmemo listens and serves: `READY=1` with its process ID as the main one.
pub fn ready() {
    notify(&format!(
        "READY=1\nMAINPID={}\nSTATUS=serving",
        std::process::id()
    ));
}

/// A shutdown began.
pub fn stopping() {
    notify("STOPPING=1");
}
