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

mod common;

use common::*;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_pgmemo");
const REPO: &str = env!("CARGO_MANIFEST_DIR");

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

/// A pgmemo process, its stderr in a file, stopped with SIGINT by [`LoggedChild::stop`] (and
/// killed and reaped on drop).
type Running = LoggedChild;

impl LoggedChild {
    fn start_cmd(mut cmd: Command, log: PathBuf) -> Running {
        cmd.env_remove("PGMEMO_LOG");
        LoggedChild::start(&mut cmd, log)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn assert_running(&mut self) {
        if let Some(status) = self.exit_status() {
            panic!("pgmemo exited ({status}):\n{}", self.log());
        }
    }

    /// SIGINT (the unit's KillSignal), then the exit status (pgmemo shuts down safely on it).
    fn stop(&mut self) -> std::process::ExitStatus {
        if let Some(status) = self.exit_status() {
            return status;
        }
        self.signal(libc::SIGINT);
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = self.exit_status() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "pgmemo did not exit after SIGINT:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
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
    let dir = TempDir::new("install-test", "check");
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
    let dir = TempDir::new("install-test", "nofile");
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
    let mut pgmemo = Running::start_cmd(cmd, dir.0.join("pgmemo.log"));
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

// ---------------------------------------------------------------------------------------------
// The Debian package
// ---------------------------------------------------------------------------------------------

/// packaging/pgmemo.1, which the Debian package installs, is what clap_mangen renders from
/// today's command line. After a change to the flags, regenerate it with
/// `PGMEMO_BLESS=1 cargo test --test install man_page_is_current`.
#[test]
fn man_page_is_current() {
    use clap::CommandFactory;
    let mut page = Vec::new();
    clap_mangen::Man::new(pgmemo::cli::Cli::command())
        .render(&mut page)
        .unwrap();
    let path = Path::new(REPO).join("packaging/pgmemo.1");
    if std::env::var_os("PGMEMO_BLESS").is_some() {
        std::fs::write(&path, &page).unwrap();
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == page,
        "{} is stale; regenerate it with \
         PGMEMO_BLESS=1 cargo test --test install man_page_is_current",
        path.display()
    );
    let page = text(&page);
    assert!(page.starts_with(".ie \\n(.g .ds Aq"), "{page}");
    for needle in [
        ".TH pgmemo 1",
        "\\-\\-config",
        "\\-\\-upstream",
        "\\-\\-check",
    ] {
        assert!(page.contains(needle), "the man page lacks {needle:?}");
    }
}

const PACKAGE: &str = "pgmemo";

/// Purges the installed package when dropped, whatever happened in between.
struct Installed;

impl Drop for Installed {
    fn drop(&mut self) {
        let out = run(Command::new("dpkg").args(["--purge", PACKAGE]));
        if !out.status.success() {
            eprintln!("dpkg --purge {PACKAGE}: {}", text(&out.stderr));
        }
    }
}

/// The processes whose program is `exe`.
fn processes_of(exe: &Path) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == exe))
        .collect()
}

/// Builds the .deb with `cargo deb` into `dir` and returns its path.
///
/// `cargo deb` builds release, which `scripts/test` has built before the tests: the variables
/// cargo sets for this test binary (`CARGO_MANIFEST_DIR`, `CARGO_PKG_*`, ...) are removed, or
/// build scripts that watch them (ring's) would see a change and the fat-LTO release binary be
/// linked again (2 minutes here, and again at the next plain `cargo build --release`).
fn build_deb(dir: &Path) -> PathBuf {
    let mut cargo = Command::new(env!("CARGO"));
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        let set_by_cargo_for_a_crate = [
            "CARGO_MANIFEST_DIR",
            "CARGO_MANIFEST_PATH",
            "CARGO_CRATE_NAME",
            "CARGO_PRIMARY_PACKAGE",
            "CARGO_TARGET_TMPDIR",
            "CARGO_RUSTC_CURRENT_DIR",
        ]
        .contains(&key.as_ref())
            || key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_BIN_");
        if set_by_cargo_for_a_crate {
            cargo.env_remove(key.as_ref());
        }
    }
    let out = run(cargo
        .current_dir(REPO)
        // --fast: lighter compression, the same files (7 s less CPU).
        .args(["deb", "--locked", "--fast", "--output"])
        .arg(dir));
    assert!(
        out.status.success(),
        "cargo deb failed (is cargo-deb installed? scripts/setup-tests installs it):\n{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .unwrap_or_else(|| panic!("no .deb in {}", dir.display()))
}

/// The packaged example configuration, pointed at the test's PostgreSQL (for [upstream] and
/// [databases.app]) and a free port; everything else as shipped (SCRAM, the users alice and
/// bob, transaction pooling).
fn adapt_example(example: &str, pg_port: u16, listen_port: u16) -> String {
    let replacements = [
        (
            "listen = \"127.0.0.1:6432\"".to_string(),
            format!("listen = \"127.0.0.1:{listen_port}\""),
        ),
        (
            "url = \"postgresql://app:app-secret@127.0.0.1:5432\"".to_string(),
            format!("url = \"postgresql://{PGMEMO_USER}:{PGMEMO_PASS}@127.0.0.1:{pg_port}\""),
        ),
        (
            "\nport = 5432\n".to_string(),
            format!("\nport = {pg_port}\n"),
        ),
    ];
    let mut config = example.to_string();
    for (from, to) in replacements {
        assert_eq!(
            config.matches(&from).count(),
            1,
            "the example config no longer has exactly one {from:?}"
        );
        config = config.replace(&from, &to);
    }
    config
}

/// The package as an operator gets it: `cargo deb`, `dpkg -i`, nothing started, the unit
/// valid, the example configuration adapted to this machine, and the installed binary serving
/// psql with it (alice's SCRAM login, as the example declares her).
#[test]
fn debian_package_installs_and_serves_a_query() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "dpkg -i needs root (CI runs as root)"
    );
    let dir = TempDir::new("install-test", "deb");
    let deb = build_deb(&dir.0);
    let exe = Path::new("/usr/bin/pgmemo");
    let before = processes_of(exe);

    let out = run(Command::new("dpkg").arg("-i").arg(&deb));
    let _installed = Installed;
    assert!(
        out.status.success(),
        "dpkg -i {}:\n{}\n{}",
        deb.display(),
        text(&out.stdout),
        text(&out.stderr)
    );
    // Installing starts nothing.
    assert_eq!(
        processes_of(exe),
        before,
        "dpkg -i started pgmemo:\n{}",
        text(&out.stdout)
    );

    let out = run(Command::new(exe).arg("--version"));
    assert_eq!(
        text(&out.stdout).trim(),
        format!("pgmemo {}", env!("CARGO_PKG_VERSION"))
    );
    let files = text(&run(Command::new("dpkg").args(["-L", PACKAGE])).stdout);
    for file in [
        "/usr/bin/pgmemo",
        "/lib/systemd/system/pgmemo.service",
        "/etc/pgmemo/pgmemo.toml",
        "/usr/share/doc/pgmemo/examples/pgmemo.example.toml",
        "/usr/share/doc/pgmemo/copyright",
        "/usr/share/doc/pgmemo/LICENSE-MIT",
        "/usr/share/doc/pgmemo/LICENSE-APACHE",
    ] {
        assert!(files.lines().any(|l| l == file), "{file} not in\n{files}");
    }
    assert!(
        files
            .lines()
            .any(|l| l.starts_with("/usr/share/man/man1/pgmemo.1")),
        "no man page in\n{files}"
    );
    // The user the unit runs as, and the configuration readable by it only.
    let out = run(Command::new("getent").args(["passwd", "pgmemo"]));
    assert!(out.status.success(), "no pgmemo user");
    let out = run(Command::new("stat").args(["-c", "%U:%G %a", "/etc/pgmemo/pgmemo.toml"]));
    assert_eq!(text(&out.stdout).trim(), "root:pgmemo 640");

    // systemd reads the installed unit without a complaint (--man=no: whether man-db is on
    // the machine is not the unit's business; the page is checked above).
    let out = run(Command::new("systemd-analyze").args([
        "verify",
        "--man=no",
        "/lib/systemd/system/pgmemo.service",
    ]));
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "systemd-analyze verify:\n{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );

    // The packaged example, adapted, checked and run. alice logs into PostgreSQL as herself
    // by pass-through: the server stores the example's verifier for her.
    let c = cluster();
    c.psql("postgres", "CREATE DATABASE app");
    let port = free_port();
    let example =
        std::fs::read_to_string("/usr/share/doc/pgmemo/examples/pgmemo.example.toml").unwrap();
    let alice_verifier = example
        .split("[users.alice]\npassword = \"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("the example gives alice a verifier");
    c.psql(
        "postgres",
        &format!("DROP ROLE IF EXISTS alice; CREATE ROLE alice LOGIN PASSWORD '{alice_verifier}'"),
    );
    let config = dir.0.join("pgmemo.toml");
    std::fs::write(&config, adapt_example(&example, c.port(), port)).unwrap();
    let out = run(Command::new(exe)
        .arg("--config")
        .arg(&config)
        .arg("--check"));
    assert!(
        out.status.success() && text(&out.stdout).contains("configuration OK"),
        "{}",
        text(&out.stderr)
    );
    let mut cmd = Command::new(exe);
    cmd.arg("--config").arg(&config);
    let mut pgmemo = Running::start_cmd(cmd, dir.0.join("pgmemo.log"));
    let psql = c.bin_dir().join("psql");
    let url = format!("postgresql://alice@127.0.0.1:{port}/app");
    let query = || {
        run(Command::new(&psql)
            .args([
                "-X",
                "-At",
                "-d",
                &url,
                "-c",
                "SELECT 'served by ' || current_database() || ' as ' || current_user",
            ])
            .env("PGPASSWORD", "alice-secret")
            .env("PGCONNECT_TIMEOUT", "5"))
    };
    let mut last = None;
    wait_for(
        "the packaged pgmemo to serve psql",
        Duration::from_secs(20),
        || {
            pgmemo.assert_running();
            let out = query();
            let ok = out.status.success();
            last = Some(out);
            ok
        },
    );
    let out = last.unwrap();
    assert_eq!(
        text(&out.stdout).trim(),
        "served by app as alice",
        "{}",
        pgmemo.log()
    );
    assert!(
        pgmemo.log().contains("open files limit"),
        "{}",
        pgmemo.log()
    );
    assert!(pgmemo.stop().success(), "{}", pgmemo.log());
}
