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

pub use client::*;
pub use cluster::*;
pub use differential::*;
pub use memory::*;
pub use proxy::*;
pub use raw::*;
pub use scenarios::scenarios;

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
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("binding 127.0.0.1:0")
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
