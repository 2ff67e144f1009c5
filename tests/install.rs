//! Installing and running pgmemo as an operator would (issue 35, "Install and run").
//!
//! - The Debian package that `cargo deb` builds installs with `dpkg -i`, starts nothing, and
//!   its binary serves a query through its own example configuration, adapted only where the
//!   test's PostgreSQL and port differ; `systemd-analyze verify` accepts the unit it installed.
//! - The man page it ships is the one the command line renders today.
//! - The Dockerfile builds and copies what Cargo's metadata names.
//! - At start the binary raises its soft file limit to the hard limit and logs both, and
//!   `--check` never starts anything, least of all demo mode's private PostgreSQL.
//!
//! The package test needs root (dpkg), cargo-deb (`scripts/setup-tests` installs it) and a
//! release build (`cargo deb` runs it; `scripts/test` builds release before the tests, so it
//! is not built twice).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_pgmemo");
const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// A directory of its own under the system's temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("pgmemo-install-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn run(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("could not run {cmd:?}: {e}"))
}

/// Polls `cond` until it holds or `timeout` passes (then panics naming `what`).
fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A pgmemo process, stopped with SIGTERM (and reaped) on drop, its stderr in a file.
struct Running {
    child: Child,
    log: PathBuf,
}

impl Running {
    fn start(mut cmd: Command, log: PathBuf) -> Running {
        let file = std::fs::File::create(&log).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .env_remove("PGMEMO_CONFIG")
            .env_remove("PGMEMO_UPSTREAM")
            .env_remove("PGMEMO_LOG")
            .spawn()
            .unwrap_or_else(|e| panic!("could not start {cmd:?}: {e}"));
        Running { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("pgmemo exited ({status}):\n{}", self.log());
        }
    }

    /// SIGTERM, then the exit status (pgmemo shuts down gracefully on it).
    fn stop(&mut self) -> std::process::ExitStatus {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "pgmemo did not exit after SIGTERM:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// At start
// ---------------------------------------------------------------------------------------------

/// `pgmemo --check` without a configuration used to start demo mode's private PostgreSQL
/// (initdb and all) before "checking" it. Now it refuses, says why, and runs nothing: a fake
/// `initdb` and `pg_ctl` first on PATH (where demo mode looks first) would leave a mark.
#[test]
fn check_without_a_configuration_starts_nothing() {
    let dir = TempDir::new("check");
    let mark = dir.0.join("initdb-ran");
    for tool in ["initdb", "pg_ctl"] {
        let path = dir.0.join(tool);
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\necho \"$0 $*\" >> '{}'\nexit 1\n",
                mark.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let path = format!(
        "{}:{}",
        dir.0.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    for args in [&["--check"][..], &["--check", "--pool-size", "5"]] {
        let out = run(Command::new(BIN)
            .args(args)
            .env("PATH", &path)
            .env_remove("PGMEMO_CONFIG")
            .env_remove("PGMEMO_UPSTREAM"));
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(
            !out.status.success(),
            "{args:?} succeeded:\n{stdout}\n{stderr}"
        );
        assert!(
            stderr.contains("--check: there is no configuration to check")
                && stderr.contains("--config FILE or --upstream URL"),
            "{args:?}: {stderr}"
        );
        assert!(!stdout.contains("configuration OK"), "{stdout}");
        assert!(
            !mark.exists(),
            "{args:?} ran {}",
            std::fs::read_to_string(&mark).unwrap()
        );
    }
}

/// The soft limit on open files is raised to the hard limit at start, and both are logged:
/// started with a soft limit of 256, the running process's limits show soft = hard.
#[test]
fn the_soft_file_limit_is_raised_to_the_hard_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only the struct passed.
    assert_eq!(
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
        0
    );
    let hard = limit.rlim_max;
    assert!(
        hard > 256,
        "the hard file limit ({hard}) leaves nothing to raise"
    );
    let dir = TempDir::new("nofile");
    let mut cmd = Command::new(BIN);
    cmd.args([
        "--upstream",
        "postgresql://nobody:secret@127.0.0.1:1",
        "--listen",
        "127.0.0.1:0",
        "--log-level",
        "info",
    ]);
    // SAFETY: setrlimit is async-signal-safe; between fork and exec it only lowers the soft
    // limit of the child.
    unsafe {
        cmd.pre_exec(move || {
            let low = libc::rlimit {
                rlim_cur: 256,
                rlim_max: hard,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &low) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let mut pgmemo = Running::start(cmd, dir.0.join("pgmemo.log"));
    wait_for("the file limit's log line", Duration::from_secs(15), || {
        pgmemo.assert_running();
        pgmemo.log().contains("open files limit")
    });
    let log = pgmemo.log();
    let hard_text = if hard == libc::RLIM_INFINITY {
        "unlimited".to_string()
    } else {
        hard.to_string()
    };
    assert!(
        log.contains(&format!(
            "open files limit: soft 256 raised to {hard_text} (hard limit {hard_text})"
        )),
        "{log}"
    );
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", pgmemo.pid())).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap_or_else(|| panic!("no open files line in\n{limits}"));
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(fields[3], fields[4], "soft and hard differ: {line}");
    assert_eq!(fields[4], hard_text, "{line}");
    assert!(pgmemo.stop().success(), "{}", pgmemo.log());
}

// ---------------------------------------------------------------------------------------------
// The Dockerfile
// ---------------------------------------------------------------------------------------------

/// No image can be pulled on the machines that run these tests, so the Dockerfile is not
/// built here; what can be checked without Docker is: the builder builds the binary Cargo
/// names, the runtime stage copies it from where that build puts it, every file copied from
/// the build context exists, the runtime user is not root, and the exposed port is the
/// one the image listens on.
#[test]
fn dockerfile_copies_what_cargo_builds() {
    let dockerfile = std::fs::read_to_string(Path::new(REPO).join("Dockerfile")).unwrap();
    let lines: Vec<&str> = dockerfile
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let stages: Vec<&&str> = lines.iter().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(stages.len(), 2, "a builder and a runtime stage: {stages:?}");
    assert!(
        stages[0].ends_with(" AS build"),
        "the first stage is named build: {}",
        stages[0]
    );
    let bin = env!("CARGO_PKG_NAME");
    assert!(
        Path::new(BIN).file_name().unwrap() == bin,
        "the binary is {BIN}"
    );
    let workdir = lines
        .iter()
        .find_map(|l| l.strip_prefix("WORKDIR "))
        .expect("the builder's WORKDIR");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("RUN cargo build --release --locked")
                && l.contains(&format!("--bin {bin}"))),
        "the builder runs cargo build --release --locked --bin {bin}"
    );
    let copied_bin =
        format!("COPY --from=build {workdir}/target/release/{bin} /usr/local/bin/{bin}");
    assert!(
        lines.contains(&copied_bin.as_str()),
        "the runtime stage copies the binary: {copied_bin}"
    );
    assert!(
        dockerfile.contains(&format!("ENTRYPOINT [\"/usr/local/bin/{bin}\"]")),
        "ENTRYPOINT runs /usr/local/bin/{bin}"
    );
    // Files copied from the build context into the runtime image exist in the repository.
    let runtime = &lines[lines.iter().position(|l| l == stages[1]).unwrap()..];
    for line in runtime.iter().filter(|l| l.starts_with("COPY ")) {
        if line.starts_with("COPY --from=") {
            continue;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        for source in &words[1..words.len() - 1] {
            assert!(
                Path::new(REPO).join(source).exists(),
                "{line}: {source} is not in the repository"
            );
        }
    }
    // Runs as a user created in the runtime stage, not root.
    let user = runtime
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER in the runtime stage");
    assert!(user != "root" && user != "0", "runs as {user}");
    assert!(
        runtime
            .iter()
            .any(|l| l.contains("useradd") && l.contains(user)),
        "the runtime stage creates the user {user}"
    );
    // The image listens on every interface, on the port it exposes.
    let listen = runtime
        .iter()
        .find_map(|l| l.strip_prefix("ENV PGMEMO_LISTEN="))
        .expect("ENV PGMEMO_LISTEN=...");
    let port = listen.rsplit(':').next().unwrap();
    assert!(listen.starts_with("0.0.0.0:"), "{listen}");
    assert!(
        runtime.contains(&format!("EXPOSE {port}").as_str()),
        "EXPOSE {port}"
    );
    // The build context leaves out what the build does not need.
    let ignore = std::fs::read_to_string(Path::new(REPO).join(".dockerignore")).unwrap();
    assert!(ignore.lines().any(|l| l.trim() == "target"), "{ignore}");
}
