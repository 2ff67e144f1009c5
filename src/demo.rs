//! A private, throwaway PostgreSQL cluster.
//!
//! pgmemo needs a real PostgreSQL in three places: `pgmemo` started without an upstream (so the
//! demo works out of the box), the test suite, and the benchmark. All three want the same
//! thing: a cluster nobody else uses, on a free port, in a temp dir that disappears afterwards,
//! tuned for speed rather than durability (`fsync = off`). [`LocalPostgres`] is that cluster.
//!
//! It drives the server's own tools (`initdb`, `pg_ctl`, `psql`) and blocks while they run, so
//! call it before starting an async runtime or from a blocking context.
//!
//! PostgreSQL refuses to run as root, and CI and the development machines run as root. When we
//! are root, the server tools therefore run as the unprivileged `postgres` OS user (created with
//! `useradd` if it is missing), in a temp dir that user owns.

use std::ffi::CString;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::TcpListener;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// The address the cluster listens on; it only ever listens on loopback.
const HOST: &str = "127.0.0.1";

/// The unprivileged OS user the server runs as when we are root.
const SERVER_OS_USER: &str = "postgres";

/// Prefix of the temp dirs, `pgmemo-pg-<pid>-<counter>`; the pid lets a later run recognise
/// and reap the leftovers of a process that was killed before it could clean up.
const DIR_PREFIX: &str = "pgmemo-pg-";

/// How many times a start on a randomly chosen port is retried when another process grabbed
/// the port between our probe and the server's bind.
const PORT_ATTEMPTS: usize = 5;

/// Distinguishes several clusters started by one process.
static COUNTER: AtomicU32 = AtomicU32::new(0);

/// Why a [`LocalPostgres`] could not be found, started or queried.
///
/// Every variant carries enough context (the command, its output, the server log) to act on
/// without rerunning anything by hand.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// No PostgreSQL server installation was found.
    #[error(
        "PostgreSQL server binaries (initdb, pg_ctl) not found on PATH or under \
         /usr/lib/postgresql/*/bin; install them with: apt-get install postgresql"
    )]
    BinariesNotFound,
    /// A file-system or process-spawning operation failed.
    #[error("{context}: {error}")]
    Io {
        /// What we were doing.
        context: String,
        /// The underlying error.
        error: std::io::Error,
    },
    /// A PostgreSQL tool ran but reported failure.
    #[error("{command} failed ({status}){details}")]
    CommandFailed {
        /// The command line, for copy-and-paste.
        command: String,
        /// Its exit status.
        status: String,
        /// Its output and, for server start-up, the tail of the server log.
        details: String,
    },
    /// Anything else, described in words.
    #[error("{0}")]
    Other(String),
}

impl DemoError {
    fn io(context: impl Into<String>, error: std::io::Error) -> Self {
        DemoError::Io {
            context: context.into(),
            error,
        }
    }
}

/// How to set up a [`LocalPostgres`]. `Default` gives a trust-authenticated cluster with the
/// `postgres` superuser on a free port.
#[derive(Debug, Clone)]
pub struct LocalPostgresOptions {
    /// Name of the bootstrap superuser (`initdb -U`).
    pub superuser: String,
    /// The superuser's password, stored as SCRAM. When set, TCP connections from 127.0.0.1
    /// must authenticate with scram-sha-256 instead of being trusted.
    pub superuser_password: Option<String>,
    /// Extra `pg_hba.conf` lines, placed before the default ones so that they win.
    pub hba: Vec<String>,
    /// Extra `postgresql.conf` settings as (name, value); values are given unquoted and are
    /// quoted here, so `("work_mem", "64MB")` is right.
    pub settings: Vec<(String, String)>,
    /// The TCP port; `None` picks a free one.
    pub port: Option<u16>,
}

impl Default for LocalPostgresOptions {
    fn default() -> Self {
        LocalPostgresOptions {
            superuser: "postgres".to_string(),
            superuser_password: None,
            hba: Vec::new(),
            settings: Vec::new(),
            port: None,
        }
    }
}

/// A running, private PostgreSQL cluster that is stopped and deleted when dropped.
///
/// It owns a temp dir holding the data directory, the server log and the Unix socket. The
/// server listens on 127.0.0.1 only.
#[derive(Debug)]
pub struct LocalPostgres {
    /// The temp dir; everything the cluster writes lives under it.
    root: PathBuf,
    /// `root/data`, the cluster's data directory.
    data_dir: PathBuf,
    /// Where `initdb`, `pg_ctl`, `psql` and `pgbench` of the server's version live.
    bin_dir: PathBuf,
    port: u16,
    superuser: String,
    superuser_password: Option<String>,
    /// The (uid, gid) the server tools run as; `None` when we are not root and run them as
    /// ourselves.
    run_as: Option<(u32, u32)>,
    /// Whether `pg_ctl start` succeeded and no stop has been attempted since.
    running: bool,
    /// Whether the temp dir has been removed, which makes [`LocalPostgres::stop`] idempotent.
    removed: bool,
}

impl LocalPostgres {
    /// Finds the directory holding the PostgreSQL server tools.
    ///
    /// `PGMEMO_TEST_PGBIN`, when set, names it (the tests' choice of server version:
    /// `scripts/postgres 18` builds one and prints its directory). Else a directory on `PATH`
    /// that holds both `initdb` and `pg_ctl` wins; if those are symlinks into a real
    /// installation (as `/usr/local/bin/pg_ctl` -> `/usr/lib/postgresql/15/bin`),
    /// the installation's directory is returned so that `psql` and `pgbench` of the same
    /// version sit beside them. Otherwise the highest version under
    /// `/usr/lib/postgresql/*/bin` (Debian's layout, which is not on `PATH`) is used.
    pub fn find_bin_dir() -> Result<PathBuf, DemoError> {
        if let Some(dir) = std::env::var_os("PGMEMO_TEST_PGBIN").filter(|d| !d.is_empty()) {
            let dir = PathBuf::from(dir);
            return if has_server_tools(&dir) {
                Ok(dir)
            } else {
                Err(DemoError::BinariesNotFound)
            };
        }
        if let Some(path) = std::env::var_os("PATH") {
            for dir in std::env::split_paths(&path) {
                if has_server_tools(&dir) {
                    let resolved = std::fs::canonicalize(dir.join("initdb"))
                        .ok()
                        .and_then(|p| p.parent().map(Path::to_path_buf));
                    return Ok(match resolved {
                        Some(real) if has_server_tools(&real) => real,
                        _ => dir,
                    });
                }
            }
        }
        let mut best: Option<(Vec<u32>, PathBuf)> = None;
        if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let Some(version) = parse_version(&name) else {
                    continue;
                };
                let bin = entry.path().join("bin");
                if has_server_tools(&bin) && best.as_ref().is_none_or(|(v, _)| version > *v) {
                    best = Some((version, bin));
                }
            }
        }
        best.map(|(_, bin)| bin).ok_or(DemoError::BinariesNotFound)
    }

    /// Creates, configures and starts a fresh cluster; blocks until it accepts connections.
    ///
    /// On failure everything created so far is removed again, and the error carries the
    /// failing tool's output and the tail of the server log.
    pub fn start(opts: LocalPostgresOptions) -> Result<LocalPostgres, DemoError> {
        let bin_dir = Self::find_bin_dir()?;
        let run_as = server_os_user()?;
        reap_orphans(&bin_dir, run_as);
        let superuser = (opts.superuser.clone(), opts.superuser_password.clone());
        let mut pg = Self::in_new_dir(bin_dir, run_as, superuser)?;
        pg.init(&opts)?;
        pg.start_server(&opts)?;
        Ok(pg)
    }

    /// A cluster with nothing in it yet: a temp dir of its own, owned by the server's OS user
    /// (0700). From here on, dropping it removes the dir (and stops the server once started).
    fn in_new_dir(
        bin_dir: PathBuf,
        run_as: Option<(u32, u32)>,
        (superuser, superuser_password): (String, Option<String>),
    ) -> Result<LocalPostgres, DemoError> {
        let root = std::env::temp_dir().join(format!(
            "{DIR_PREFIX}{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        if root.exists() {
            // Left by an earlier process with our pid; nothing can be using it now.
            let _ = std::fs::remove_dir_all(&root);
        }
        std::fs::create_dir_all(&root)
            .map_err(|e| DemoError::io(format!("creating {}", root.display()), e))?;
        let pg = LocalPostgres {
            data_dir: root.join("data"),
            root,
            bin_dir,
            port: 0,
            superuser,
            superuser_password,
            run_as,
            running: false,
            removed: false,
        };
        std::fs::set_permissions(&pg.root, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| DemoError::io(format!("chmod {}", pg.root.display()), e))?;
        pg.give_to_server_user(&pg.root)?;
        Ok(pg)
    }

    /// The TCP port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The address the server listens on, always `127.0.0.1`.
    pub fn host(&self) -> &str {
        HOST
    }

    /// The directory of the server's Unix socket (`.s.PGSQL.<port>`), a libpq `host`.
    pub fn socket_dir(&self) -> &Path {
        &self.root
    }

    /// The directory of the server's tools, so callers can run `pgbench` or `psql` of the same
    /// version.
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// A `postgresql://` URL for connecting over TCP, with user, password and database name
    /// percent-encoded.
    pub fn url(&self, user: &str, password: Option<&str>, dbname: &str) -> String {
        let mut url = format!("postgresql://{}", percent_encode(user));
        if let Some(password) = password {
            url.push(':');
            url.push_str(&percent_encode(password));
        }
        let _ = write!(url, "@{HOST}:{}/{}", self.port, percent_encode(dbname));
        url
    }

    /// Runs `sql` (any number of statements, split by psql) as the superuser over TCP and
    /// returns psql's unaligned, tuples-only output. Stops at the first error, which is
    /// reported with psql's stderr.
    pub fn psql(&self, dbname: &str, sql: &str) -> Result<String, DemoError> {
        let psql = self.bin_dir.join("psql");
        let program = if psql.is_file() {
            psql
        } else {
            PathBuf::from("psql")
        };
        let mut cmd = Command::new(program);
        cmd.args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-At", "-h", HOST])
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-U")
            .arg(&self.superuser)
            .arg("-d")
            .arg(dbname)
            .args(["-f", "-"]);
        clear_pg_env(&mut cmd);
        cmd.env("PGCLIENTENCODING", "UTF8")
            .env("PGCONNECT_TIMEOUT", "10");
        if let Some(password) = &self.superuser_password {
            cmd.env("PGPASSWORD", password);
        }
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let described = describe(&cmd);
        let mut child = cmd
            .spawn()
            .map_err(|e| DemoError::io(format!("running {described}"), e))?;
        // Feed stdin from another thread: psql may fill its stdout pipe before it has read
        // all of a long script, and we only drain stdout after writing.
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let script = sql.to_string();
        let writer = std::thread::spawn(move || stdin.write_all(script.as_bytes()));
        let output = child
            .wait_with_output()
            .map_err(|e| DemoError::io(format!("waiting for {described}"), e))?;
        let _ = writer.join();
        check(&described, output, "").map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Stops the server (`pg_ctl stop -m fast`) and removes the temp dir. Safe to call more
    /// than once; errors are ignored because there is nobody left to report them to.
    pub fn stop(&mut self) {
        self.stop_running();
        if !self.removed {
            self.removed = true;
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }

    /// Stops the server if it runs (`pg_ctl stop -m fast`, else immediate), keeping its data.
    fn stop_running(&mut self) {
        if self.running {
            self.running = false;
            if !self.pg_ctl_stop("fast") {
                self.pg_ctl_stop("immediate");
            }
        }
    }

    /// Runs `initdb` and writes `postgresql.conf` and `pg_hba.conf`.
    fn init(&mut self, opts: &LocalPostgresOptions) -> Result<(), DemoError> {
        let mut initdb = self.server_command("initdb");
        initdb
            .arg("-D")
            .arg(&self.data_dir)
            .arg("-U")
            .arg(&opts.superuser)
            .args(["--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync"]);
        let pwfile = self.root.join("pwfile");
        if let Some(password) = &opts.superuser_password {
            std::fs::write(&pwfile, format!("{password}\n"))
                .map_err(|e| DemoError::io(format!("writing {}", pwfile.display()), e))?;
            self.give_to_server_user(&pwfile)?;
            initdb.arg(format!("--pwfile={}", pwfile.display()));
        }
        let result = run(&mut initdb);
        let _ = std::fs::remove_file(&pwfile);
        result?;

        let mut conf =
            String::from("\n# Added by pgmemo's LocalPostgres: a fast, private cluster.\n");
        let socket_dir = self.root.display().to_string();
        let base = [
            ("listen_addresses", HOST),
            ("unix_socket_directories", socket_dir.as_str()),
            ("fsync", "off"),
            ("synchronous_commit", "off"),
            ("full_page_writes", "off"),
            ("max_connections", "300"),
            ("shared_buffers", "128MB"),
            ("password_encryption", "scram-sha-256"),
        ];
        let extra = opts.settings.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        for (name, value) in base.into_iter().chain(extra) {
            let _ = writeln!(conf, "{name} = '{}'", value.replace('\'', "''"));
        }
        self.append_conf(&conf)?;

        let host_method = if opts.superuser_password.is_some() {
            "scram-sha-256"
        } else {
            "trust"
        };
        let mut hba = String::from("# Written by pgmemo's LocalPostgres.\n");
        for line in &opts.hba {
            hba.push_str(line);
            hba.push('\n');
        }
        hba.push_str("local all all trust\n");
        let _ = writeln!(hba, "host all all 127.0.0.1/32 {host_method}");
        let hba_path = self.data_dir.join("pg_hba.conf");
        std::fs::write(&hba_path, hba)
            .map_err(|e| DemoError::io(format!("writing {}", hba_path.display()), e))
    }

    /// Starts the server, retrying on a fresh port when a randomly chosen one was taken
    /// between our probe and the server's bind.
    fn start_server(&mut self, opts: &LocalPostgresOptions) -> Result<(), DemoError> {
        let log = self.root.join("log");
        let mut attempt = 0;
        loop {
            attempt += 1;
            self.port = match opts.port {
                Some(port) => port,
                None => free_port()?,
            };
            // Later lines win in postgresql.conf, so a retry just appends the new port.
            self.append_conf(&format!("port = {}\n", self.port))?;
            let _ = std::fs::remove_file(&log);
            let mut pg_ctl = self.server_command("pg_ctl");
            pg_ctl
                .arg("-D")
                .arg(&self.data_dir)
                .arg("-l")
                .arg(&log)
                .args(["-w", "-t", "60", "start"]);
            let described = describe(&pg_ctl);
            let output = pg_ctl
                .output()
                .map_err(|e| DemoError::io(format!("running {described}"), e))?;
            let log_tail = tail(&log, 40);
            if output.status.success() {
                self.running = true;
                return Ok(());
            }
            // pg_ctl may have given up waiting while the server still runs; make sure it
            // does not outlive us.
            self.pg_ctl_stop("immediate");
            let port_taken = log_tail.contains("could not bind")
                || log_tail.contains("Address already in use")
                || log_tail.contains("could not create any TCP/IP sockets");
            if opts.port.is_some() || !port_taken || attempt >= PORT_ATTEMPTS {
                let details = format!("\n--- end of the server log ---\n{log_tail}");
                return check(&described, output, &details).map(|_| ());
            }
        }
    }

    /// Restarts the server in place (`pg_ctl restart -m <mode>`: "fast" or "immediate"), on
    /// the same port and data directory; blocks until it accepts connections again. Tests use
    /// it to check that clients recover from a server restart.
    pub fn restart(&mut self, mode: &str) -> Result<(), DemoError> {
        let log = self.root.join("log");
        let mut pg_ctl = self.server_command("pg_ctl");
        pg_ctl
            .arg("-D")
            .arg(&self.data_dir)
            // With -l the server's output goes to the log, not to pg_ctl's (captured) stdout,
            // which would otherwise stay open as long as the server runs.
            .arg("-l")
            .arg(&log)
            .args(["-w", "-t", "60", "restart", "-m", mode]);
        let result = run(&mut pg_ctl).map(|_| ());
        self.running = result.is_ok();
        result
    }

    /// A streaming standby of this cluster: a base backup (`pg_basebackup -R -X stream`, so a
    /// physical replica following it) in a temp dir of its own, on a free port, started and
    /// accepting read-only connections. This cluster's `pg_hba.conf` must let its superuser
    /// replicate over TCP (`host replication all 127.0.0.1/32 trust` in the `hba` option).
    pub fn standby(&self) -> Result<LocalPostgres, DemoError> {
        let superuser = (self.superuser.clone(), self.superuser_password.clone());
        let mut standby = Self::in_new_dir(self.bin_dir.clone(), self.run_as, superuser)?;
        standby.base_backup_of(self)?;
        standby.start_server(&LocalPostgresOptions::default())?;
        Ok(standby)
    }

    /// Makes this cluster a streaming standby of `primary`, as an operator rejoins an old
    /// primary after a failover: stops it, replaces its data with a fresh base backup of
    /// `primary`, and starts it again on its own port.
    pub fn follow(&mut self, primary: &LocalPostgres) -> Result<(), DemoError> {
        self.stop_running();
        let _ = std::fs::remove_dir_all(&self.data_dir);
        self.base_backup_of(primary)?;
        let port = self.port;
        self.start_server(&LocalPostgresOptions {
            port: Some(port),
            ..LocalPostgresOptions::default()
        })
    }

    /// Promotes a standby to a primary (`pg_ctl promote`, waiting until it is one).
    pub fn promote(&self) -> Result<(), DemoError> {
        let mut pg_ctl = self.server_command("pg_ctl");
        pg_ctl
            .arg("-D")
            .arg(&self.data_dir)
            .args(["-w", "-t", "60", "promote"]);
        run(&mut pg_ctl).map(|_| ())
    }

    /// Stops the server (`pg_ctl stop -m <mode>`: "fast" or "immediate") and keeps its data:
    /// a primary that fails.
    pub fn stop_server(&mut self, mode: &str) {
        if self.running {
            self.running = false;
            self.pg_ctl_stop(mode);
        }
    }

    /// Fills the (absent) data directory with a base backup of `primary` that follows it,
    /// its own socket directory set.
    fn base_backup_of(&self, primary: &LocalPostgres) -> Result<(), DemoError> {
        let mut backup = self.server_command("pg_basebackup");
        backup
            .arg("-D")
            .arg(&self.data_dir)
            .args(["-R", "-X", "stream", "--no-sync", "-h", HOST, "-p"])
            .arg(primary.port.to_string())
            .arg("-U")
            .arg(&primary.superuser);
        if let Some(password) = &primary.superuser_password {
            backup.env("PGPASSWORD", password);
        }
        run(&mut backup)?;
        let socket_dir = self.root.display().to_string();
        self.append_conf(&format!(
            "\n# A standby of port {}.\nunix_socket_directories = '{}'\n",
            primary.port,
            socket_dir.replace('\'', "''")
        ))
    }

    /// Runs `pg_ctl stop -m <mode>` and says whether it succeeded.
    fn pg_ctl_stop(&self, mode: &str) -> bool {
        let mut pg_ctl = self.server_command("pg_ctl");
        pg_ctl
            .arg("-D")
            .arg(&self.data_dir)
            .args(["-w", "-t", "30", "stop", "-m", mode]);
        run(&mut pg_ctl).is_ok()
    }

    fn append_conf(&self, text: &str) -> Result<(), DemoError> {
        let path = self.data_dir.join("postgresql.conf");
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .map_err(|e| DemoError::io(format!("writing {}", path.display()), e))
    }

    /// A command for one of the server tools, run as the server's OS user in the temp dir.
    fn server_command(&self, tool: &str) -> Command {
        server_command(&self.bin_dir, tool, self.run_as, &self.root)
    }

    fn give_to_server_user(&self, path: &Path) -> Result<(), DemoError> {
        if let Some((uid, gid)) = self.run_as {
            std::os::unix::fs::chown(path, Some(uid), Some(gid))
                .map_err(|e| DemoError::io(format!("chown {}", path.display()), e))?;
        }
        Ok(())
    }
}

impl Drop for LocalPostgres {
    fn drop(&mut self) {
        self.stop()
    }
}

/// Whether `dir` holds executable `initdb` and `pg_ctl`.
fn has_server_tools(dir: &Path) -> bool {
    ["initdb", "pg_ctl"].iter().all(|tool| {
        std::fs::metadata(dir.join(tool))
            .map(|m| m.is_file() && m.mode() & 0o111 != 0)
            .unwrap_or(false)
    })
}

/// Parses a directory name such as `15` or `9.6` into comparable numbers.
fn parse_version(name: &str) -> Option<Vec<u32>> {
    name.split('.').map(|part| part.parse().ok()).collect()
}

/// The (uid, gid) to run server tools as: `None` unless we are root, in which case the
/// `postgres` OS user, created first if it does not exist.
fn server_os_user() -> Result<Option<(u32, u32)>, DemoError> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    if let Some(ids) = lookup_user(SERVER_OS_USER) {
        return Ok(Some(ids));
    }
    let mut useradd = Command::new("useradd");
    useradd.args(["--system", "--no-create-home", SERVER_OS_USER]);
    // Another process may have created the user meanwhile, so look again whatever happened.
    let result = run(&mut useradd);
    match lookup_user(SERVER_OS_USER) {
        Some(ids) => Ok(Some(ids)),
        None => Err(DemoError::Other(format!(
            "PostgreSQL refuses to run as root and the OS user {SERVER_OS_USER:?} could not be \
             created: {}",
            result.err().map_or_else(String::new, |e| e.to_string())
        ))),
    }
}

/// Looks up an OS user's (uid, gid) by name.
fn lookup_user(name: &str) -> Option<(u32, u32)> {
    let cname = CString::new(name).ok()?;
    // SAFETY: `passwd` is plain old data; all-zero is a valid (if meaningless) value that
    // getpwnam_r overwrites.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer refers to a live, correctly sized buffer owned by this frame, and
    // getpwnam_r (unlike getpwnam) touches no shared static state.
    let rc = unsafe {
        libc::getpwnam_r(
            cname.as_ptr(),
            &mut pwd,
            buf.as_mut_ptr(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() {
        return None;
    }
    Some((pwd.pw_uid, pwd.pw_gid))
}

/// Builds a command for a server tool in `bin_dir`, run as `run_as` in `cwd`.
///
/// The working directory matters: PostgreSQL's tools look up their own location relative to
/// it and fail when the server user cannot enter it (root's home, say). `PG*` variables are
/// cleared so that a developer's environment cannot redirect the tools to another cluster,
/// and messages are kept in English so that the port-conflict check can read them.
fn server_command(bin_dir: &Path, tool: &str, run_as: Option<(u32, u32)>, cwd: &Path) -> Command {
    let mut cmd = Command::new(bin_dir.join(tool));
    cmd.current_dir(cwd).env("LC_ALL", "C");
    clear_pg_env(&mut cmd);
    if let Some((uid, gid)) = run_as {
        // std also drops root's supplementary groups when it switches uid.
        cmd.uid(uid).gid(gid);
    }
    cmd
}

fn clear_pg_env(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("PG") {
            cmd.env_remove(key);
        }
    }
}

/// Runs a command to completion, turning a non-zero exit into an error with its output.
fn run(cmd: &mut Command) -> Result<Output, DemoError> {
    let described = describe(cmd);
    let output = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| DemoError::io(format!("running {described}"), e))?;
    check(&described, output, "")
}

/// Turns a failed command's output into a [`DemoError::CommandFailed`].
fn check(described: &str, output: Output, extra: &str) -> Result<Output, DemoError> {
    if output.status.success() {
        return Ok(output);
    }
    let mut details = String::new();
    for stream in [&output.stderr, &output.stdout] {
        let text = String::from_utf8_lossy(stream);
        if !text.trim().is_empty() {
            let _ = write!(details, "\n{}", text.trim_end());
        }
    }
    details.push_str(extra);
    Err(DemoError::CommandFailed {
        command: described.to_string(),
        status: output.status.to_string(),
        details,
    })
}

fn describe(cmd: &Command) -> String {
    let mut line = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        line.push(' ');
        line.push_str(&arg.to_string_lossy());
    }
    line
}

/// The last `lines` lines of a file, or a note that it could not be read.
fn tail(path: &Path, lines: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(could not read {}: {e})", path.display()),
    }
}

/// A port that was free a moment ago: bind port 0, read what the kernel chose, let it go.
/// Racy by nature; [`LocalPostgres::start`] retries when the race is lost. A port handed out
/// once in this process is never handed out again: the tests pick pgmemo's ports here too, and
/// a cluster started between such a pick and pgmemo's bind could otherwise get the same port
/// from the kernel and take it first (it did: `tests/convert.rs` then reached PostgreSQL
/// where it meant pgmemo).
pub fn free_port() -> Result<u16, DemoError> {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    loop {
        let port = TcpListener::bind((HOST, 0))
            .and_then(|listener| listener.local_addr())
            .map(|addr| addr.port())
            .map_err(|e| DemoError::io("looking for a free port", e))?;
        if GIVEN.lock().unwrap_or_else(|e| e.into_inner()).insert(port) {
            return Ok(port);
        }
    }
}

/// Stops and removes clusters left in the temp dir by processes that no longer exist (a test
/// run killed by Ctrl-C, say), so that they do not pile up. Best effort: errors are ignored.
fn reap_orphans(bin_dir: &Path, run_as: Option<(u32, u32)>) {
    let temp = std::env::temp_dir();
    let Ok(entries) = std::fs::read_dir(&temp) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(DIR_PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        if pid == std::process::id() as libc::pid_t || process_exists(pid) {
            continue;
        }
        let dir = entry.path();
        let data = dir.join("data");
        if data.join("postmaster.pid").exists() {
            let mut pg_ctl = server_command(bin_dir, "pg_ctl", run_as, &temp);
            pg_ctl
                .arg("-D")
                .arg(&data)
                .args(["-w", "-t", "10", "stop", "-m", "immediate"]);
            let _ = run(&mut pg_ctl);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn process_exists(pid: libc::pid_t) -> bool {
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Percent-encodes everything but RFC 3986 unreserved characters, which is always safe in
/// the user-info and path parts of a URL.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for byte in s.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_encoding_keeps_unreserved_and_escapes_the_rest() {
        assert_eq!(percent_encode("a-b_c.d~e"), "a-b_c.d~e");
        assert_eq!(percent_encode("p@ss:w/rd é"), "p%40ss%3Aw%2Frd%20%C3%A9");
    }

    #[test]
    fn versions_compare_numerically() {
        assert!(parse_version("15").unwrap() > parse_version("9.6").unwrap());
        assert_eq!(parse_version("main"), None);
    }
}
