//! The test harness shared by pgmemo's integration tests.
//!
//! - [`cluster`]: one throwaway PostgreSQL per test binary, with a role per authentication
//!   method (see `cluster.rs` for names and passwords).
//! - [`RawClient`]: a wire-protocol client that sends exactly the [`Frontend`] messages a test
//!   chooses and returns every [`Backend`] message as sent.
//! - [`differential`] and [`assert_same`]: run one script of [`Step`]s against PostgreSQL and
//!   through pgmemo and compare the [`normalize`]d transcripts.
//! - [`scenarios`]: the reusable scripts that cover the protocol's tricky corners.
//!
//! Use it from a test file with `mod common;` and `use common::*;`. Each test binary compiles
//! this module anew and uses only part of it, hence the `dead_code` and `unused_imports`
//! allowances.
#![allow(dead_code, unused_imports)]

pub mod client;
pub mod cluster;
pub mod differential;
pub mod memory;
pub mod proxy;
pub mod raw;
pub mod scenarios;
pub mod valkey;
pub mod write_forms;

pub use client::*;
pub use cluster::*;
pub use differential::*;
pub use memory::*;
pub use proxy::*;
pub use raw::*;
pub use scenarios::scenarios;
pub use valkey::Valkey;

/// A pgmemo (or other) process a test started, its stderr in a file; killed and reaped when
/// dropped if it is still running. Test files add their own ways of waiting for it.
pub struct LoggedChild {
    pub child: std::process::Child,
    pub log: std::path::PathBuf,
}

impl LoggedChild {
    /// Starts `cmd` with no stdin or stdout and its stderr into `log`, without the
    /// environment's pgmemo configuration (`PGMEMO_CONFIG`, `PGMEMO_UPSTREAM`).
    pub fn start(cmd: &mut std::process::Command, log: std::path::PathBuf) -> LoggedChild {
        use std::process::Stdio;
        let file = std::fs::File::create(&log).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .env_remove("PGMEMO_CONFIG")
            .env_remove("PGMEMO_UPSTREAM")
            .spawn()
            .unwrap_or_else(|e| panic!("could not start {cmd:?}: {e}"));
        LoggedChild { child, log }
    }

    /// What it wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends it `signal`.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(
            unsafe { libc::kill(self.child.id() as libc::pid_t, signal) },
            0
        );
    }

    /// Its exit status, if it has exited.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().unwrap()
    }
}

impl Drop for LoggedChild {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A directory of the test's own under the system's temporary directory, made empty, removed
/// when dropped; `prefix` and the process id keep test binaries and runs apart.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new(prefix: &str, name: &str) -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("pgmemo-{prefix}-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl std::ops::Deref for TempDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago (bind port 0, read it, let it go). Racy
/// by nature: bind it soon.
pub fn free_port() -> u16 {
    // pgmemo's own picker: a port it hands out is never given to a cluster started later.
    pgmemo::demo::free_port().expect("binding 127.0.0.1:0")
}

/// xorshift64*: small and deterministic, for the property tests' random choices (a seed
/// replays a failure).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// True with probability `percent` %.
    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}
