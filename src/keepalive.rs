//! TCP keepalive and user timeout on client and server sockets: PgBouncer's `tcp_keepalive`,
//! `tcp_keepidle`, `tcp_keepintvl`, `tcp_keepcnt` and `tcp_user_timeout`.
//!
//! A peer that vanishes without closing its connection (a pulled cable, a dead VM, a
//! firewall that forgot the flow) leaves a socket that would wait forever; keepalive probes
//! find it, and the user timeout bounds how long unacknowledged data may wait. Set with
//! `setsockopt` when a socket is accepted or connected; zero leaves the system's value.
//! The per-probe settings exist on Linux only; elsewhere only `SO_KEEPALIVE` is set.

use std::io;
use std::os::fd::AsRawFd;
use std::time::Duration;

/// What is set on each socket; zero durations and counts leave the system's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Keepalive {
    /// `SO_KEEPALIVE`.
    pub enabled: bool,
    /// `TCP_KEEPIDLE`: idle time before the first probe (whole seconds).
    pub idle: Duration,
    /// `TCP_KEEPINTVL`: time between probes (whole seconds).
    pub interval: Duration,
    /// `TCP_KEEPCNT`: unanswered probes before the connection is dropped.
    pub count: u32,
    /// `TCP_USER_TIMEOUT`: how long sent data may stay unacknowledged (milliseconds).
    pub user_timeout: Duration,
}

/// Sets `k` on `socket`.
pub fn apply(socket: &impl AsRawFd, k: &Keepalive) -> io::Result<()> {
    let fd = socket.as_raw_fd();
    set(
        fd,
        libc::SOL_SOCKET,
        libc::SO_KEEPALIVE,
        i32::from(k.enabled),
    )?;
    #[cfg(target_os = "linux")]
    {
        if k.enabled {
            let secs = |d: Duration| d.as_secs().clamp(1, i32::MAX as u64) as i32;
            if !k.idle.is_zero() {
                set(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, secs(k.idle))?;
            }
            if !k.interval.is_zero() {
                set(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, secs(k.interval))?;
            }
            if k.count > 0 {
                let count = k.count.min(i32::MAX as u32) as i32;
                set(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, count)?;
            }
        }
        if !k.user_timeout.is_zero() {
            let ms = k.user_timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
            set(fd, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, ms)?;
        }
    }
    Ok(())
}

/// What `socket` has now, as [`apply`] sets it (for tests and diagnostics; Linux).
#[cfg(target_os = "linux")]
pub fn read(socket: &impl AsRawFd) -> io::Result<Keepalive> {
    let fd = socket.as_raw_fd();
    Ok(Keepalive {
        enabled: get(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE)? != 0,
        idle: Duration::from_secs(get(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE)? as u64),
        interval: Duration::from_secs(get(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL)? as u64),
        count: get(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT)? as u32,
        user_timeout: Duration::from_millis(
            get(fd, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT)? as u64
        ),
    })
}

fn set(fd: i32, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: `fd` is a live socket borrowed from its owner for the call; the option value
    // is a c_int on the stack, its size passed along.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(target_os = "linux")]
fn get(fd: i32, level: i32, name: i32) -> io::Result<i32> {
    let mut value: i32 = 0;
    let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
    // SAFETY: as in `set`; the kernel writes at most `len` bytes into `value`.
    let rc =
        unsafe { libc::getsockopt(fd, level, name, (&mut value as *mut i32).cast(), &mut len) };
    if rc == 0 {
        Ok(value)
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Set on a real connected socket and read back with getsockopt.
    #[test]
    fn the_settings_are_read_back_from_a_real_socket() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let k = Keepalive {
            enabled: true,
            idle: Duration::from_secs(37),
            interval: Duration::from_secs(7),
            count: 4,
            user_timeout: Duration::from_millis(2500),
        };
        apply(&tcp, &k).unwrap();
        assert_eq!(read(&tcp).unwrap(), k);
        let off = Keepalive::default();
        apply(&tcp, &off).unwrap();
        assert!(!read(&tcp).unwrap().enabled);
    }
}
