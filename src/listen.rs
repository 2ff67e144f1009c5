//! The Unix socket pgmemo listens on besides TCP (`unix_socket_dir`), as PostgreSQL and
//! PgBouncer do: `<dir>/.s.PGSQL.<port>`, the file libpq looks for when `host` is a directory.
//!
//! The socket file outlives a process that was killed, so a start finds one now and then: as
//! PgBouncer, pgmemo removes a stale one, but unlike PgBouncer (which relies on a lock file)
//! it first tries to connect, and refuses to start when something answers there, rather than
//! take the socket of a running PostgreSQL or pgmemo. The file is removed when the listener is
//! dropped, which the accept loop does when a shutdown begins, but for an online restart's:
//! the new process goes on listening on it.

use crate::stream::Stream;
use anyhow::{bail, Context as _};
use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use tokio::net::UnixListener;

/// A listening Unix socket; its file goes when it is dropped.
pub struct UnixSocket {
    listener: UnixListener,
    path: PathBuf,
    /// The file stays when the socket is dropped: a successor listens on it (an online
    /// restart, see [`crate::takeover`]).
    leave_file: bool,
}

impl UnixSocket {
    /// Listens on `<dir>/.s.PGSQL.<port>` with file mode `mode` (and group `group`, a name
    /// or a number, if given), replacing a stale socket.
    pub fn bind(
        dir: &Path,
        port: u16,
        mode: u32,
        group: Option<&str>,
    ) -> anyhow::Result<UnixSocket> {
        if !dir.is_dir() {
            bail!(
                "general.unix_socket_dir {} is not a directory (it must exist)",
                dir.display()
            );
        }
        let path = dir.join(format!(".s.PGSQL.{port}"));
        remove_stale(&path, "general.unix_socket_dir")?;
        let listener = UnixListener::bind(&path)
            .with_context(|| format!("cannot listen on Unix socket {}", path.display()))?;
        // From here on the file is ours: dropping `socket` removes it if what follows fails.
        let socket = UnixSocket {
            listener,
            path,
            leave_file: false,
        };
        std::fs::set_permissions(&socket.path, std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("cannot set the mode of {}", socket.path.display()))?;
        if let Some(group) = group {
            let gid = group_id(group)?;
            std::os::unix::fs::chown(&socket.path, None, Some(gid)).with_context(|| {
                format!(
                    "cannot give {} to group {group} (general.unix_socket_group): pgmemo's \
                     user must belong to it",
                    socket.path.display()
                )
            })?;
        }
        Ok(socket)
    }

    /// The socket another pgmemo process listened on until now (an online restart).
    pub fn inherited(
        listener: std::os::unix::net::UnixListener,
        path: PathBuf,
    ) -> anyhow::Result<UnixSocket> {
        listener.set_nonblocking(true)?;
        Ok(UnixSocket {
            listener: UnixListener::from_std(listener)?,
            path,
            leave_file: false,
        })
    }

    /// Keeps the socket file when this is dropped: a successor listens on it now.
    pub fn leave_file(&mut self) {
        self.leave_file = true;
    }

    /// The listening socket, for a successor to be given a duplicate.
    pub fn listener(&self) -> &UnixListener {
        &self.listener
    }

    /// The socket file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The next client, as a plain [`Stream`].
    pub async fn accept(&self) -> std::io::Result<Stream> {
        let (unix, _) = self.listener.accept().await?;
        Ok(Stream::Unix(Box::new(unix)))
    }
}

impl Drop for UnixSocket {
    fn drop(&mut self) {
        if !self.leave_file {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Removes a socket file nobody listens on; refuses a live socket, or a file that is no socket.
/// `setting` names what chose the path, for the error (this socket's and the takeover
/// socket's, see [`crate::takeover`]).
pub(crate) fn remove_stale(path: &Path, setting: &str) -> anyhow::Result<()> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        bail!(
            "{} exists and is not a socket: remove it, or choose another {setting} or port",
            path.display()
        );
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        bail!(
            "another process listens on Unix socket {} (a PostgreSQL or pgmemo on the same \
             port?): choose another {setting} or port",
            path.display()
        );
    }
    tracing::info!(path = %path.display(), "removing a stale Unix socket file");
    std::fs::remove_file(path)
        .with_context(|| format!("cannot remove the stale socket file {}", path.display()))
}

/// A group's id, from its number or its name (getgrnam_r).
fn group_id(group: &str) -> anyhow::Result<u32> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    let name = std::ffi::CString::new(group).context("a group name has no NUL byte")?;
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: an all-zero `group` is a valid value to be filled in.
    let mut entry: libc::group = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is to a live local, and `buf`'s length is given with it.
    let r = unsafe {
        libc::getgrnam_r(
            name.as_ptr(),
            &mut entry,
            buf.as_mut_ptr(),
            buf.len(),
            &mut found,
        )
    };
    if r != 0 || found.is_null() {
        bail!("general.unix_socket_group: no group {group:?} on this system");
    }
    Ok(entry.gr_gid)
}
