//! The one throwaway PostgreSQL that every test in a test binary shares.
//!
//! Starting a cluster takes a second or two, so a test binary starts one, lazily, on the first
//! call to [`cluster`], and every test uses it. It is set up with one role per authentication
//! method pgmemo must handle, and a database owned by the role pgmemo logs in as. Tests keep
//! out of each other's way by using temp tables or uniquely named objects.
//!
//! Statics are never dropped, so the cluster is stopped and its directory removed by an
//! `atexit` hook instead. A test binary killed by a signal leaves it running; the next
//! [`LocalPostgres::start`] on the machine reaps such orphans.

use std::net::SocketAddr;
use std::sync::{OnceLock, RwLock};

use pgmemo::demo::{DemoError, LocalPostgres, LocalPostgresOptions};

/// The database the tests run in, owned by [`PGMEMO_USER`].
pub const TEST_DB: &str = "pgmemo_test";
/// The superuser role pgmemo logs into the server as (SCRAM).
pub const PGMEMO_USER: &str = "pgmemo";
pub const PGMEMO_PASS: &str = "pgmemo_pass";
/// A role that must authenticate with scram-sha-256.
pub const SCRAM_USER: &str = "scram_user";
pub const SCRAM_PASS: &str = "scram_pass";
/// A role whose password is stored as MD5 and that must authenticate with md5.
pub const MD5_USER: &str = "md5_user";
pub const MD5_PASS: &str = "md5_pass";
/// A role without a password that is trusted.
pub const TRUST_USER: &str = "trust_user";
/// A role that must send its password in clear text (`password` in pg_hba.conf).
pub const PASSWORD_USER: &str = "password_user";
pub const PASSWORD_PASS: &str = "password_pass";
/// The bootstrap superuser, used by [`Cluster::psql`].
pub const SUPERUSER: &str = "postgres";
pub const SUPERUSER_PASS: &str = "postgres_pass";

/// Rules placed before the defaults, which require scram-sha-256 for everyone else.
const HBA: &[&str] = &[
    "host all md5_user 127.0.0.1/32 md5",
    "host all scram_user 127.0.0.1/32 scram-sha-256",
    "host all trust_user 127.0.0.1/32 trust",
    "host all password_user 127.0.0.1/32 password",
];

const SETUP_SQL: &str = "
CREATE ROLE pgmemo LOGIN SUPERUSER PASSWORD 'pgmemo_pass';
CREATE ROLE scram_user LOGIN PASSWORD 'scram_pass';
CREATE ROLE trust_user LOGIN;
CREATE ROLE password_user LOGIN PASSWORD 'password_pass';
SET password_encryption = 'md5';
CREATE ROLE md5_user LOGIN PASSWORD 'md5_pass';
RESET password_encryption;
CREATE DATABASE pgmemo_test OWNER pgmemo;
";

/// The shared test cluster; see the module documentation.
pub struct Cluster {
    /// Behind a lock only so that the exit hook can stop it; tests take the read side.
    pg: RwLock<LocalPostgres>,
    port: u16,
}

static CLUSTER: OnceLock<Cluster> = OnceLock::new();

/// The test binary's cluster, started on first use. Blocks while starting; panics with the
/// reason (missing binaries, the server log) when it cannot start.
pub fn cluster() -> &'static Cluster {
    CLUSTER.get_or_init(|| {
        let cluster = Cluster::start().unwrap_or_else(|e| panic!("test cluster: {e}"));
        // SAFETY: `stop_cluster` is an `extern "C"` function that does not unwind.
        unsafe { libc::atexit(stop_cluster) };
        cluster
    })
}

extern "C" fn stop_cluster() {
    // A panic must not unwind into C; there is nothing useful to do with one at exit.
    let _ = std::panic::catch_unwind(|| {
        if let Some(cluster) = CLUSTER.get() {
            let mut pg = cluster.pg.write().unwrap_or_else(|e| e.into_inner());
            pg.stop();
        }
    });
}

impl Cluster {
    fn start() -> Result<Cluster, DemoError> {
        let pg = LocalPostgres::start(LocalPostgresOptions {
            superuser: SUPERUSER.to_string(),
            superuser_password: Some(SUPERUSER_PASS.to_string()),
            hba: HBA.iter().map(|line| line.to_string()).collect(),
            // WAL invalidation's tests follow the logical replication stream.
            settings: [
                ("wal_level", "logical"),
                ("max_replication_slots", "20"),
                ("max_wal_senders", "20"),
                // PREPARE TRANSACTION (the result cache's isolation tests).
                ("max_prepared_transactions", "10"),
            ]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
            ..LocalPostgresOptions::default()
        })?;
        pg.psql("postgres", SETUP_SQL)?;
        Ok(Cluster {
            port: pg.port(),
            pg: RwLock::new(pg),
        })
    }

    /// The server's TCP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's address, for [`super::RawClient::connect`] and as pgmemo's upstream.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// A `postgresql://` URL for drivers.
    pub fn url(&self, user: &str, password: Option<&str>, db: &str) -> String {
        self.pg().url(user, password, db)
    }

    /// Runs SQL as the superuser with psql and returns its `-At` output; panics on error.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        self.try_psql(db, sql)
            .unwrap_or_else(|e| panic!("psql on test cluster: {e}"))
    }

    /// Like [`Cluster::psql`], for tests that expect an error.
    pub fn try_psql(&self, db: &str, sql: &str) -> Result<String, DemoError> {
        self.pg().psql(db, sql)
    }

    /// The directory of the server's Unix socket.
    pub fn socket_dir(&self) -> std::path::PathBuf {
        self.pg().socket_dir().to_path_buf()
    }

    /// The server's `server_version_num` (150018, 180006...): what a test expects where
    /// PostgreSQL versions differ (`PGMEMO_TEST_PGBIN` picks the version, see
    /// `scripts/postgres`).
    pub fn version_num(&self) -> u32 {
        static VERSION: OnceLock<u32> = OnceLock::new();
        *VERSION.get_or_init(|| {
            let shown = self.psql("postgres", "SHOW server_version_num");
            shown
                .trim()
                .parse()
                .unwrap_or_else(|e| panic!("server_version_num {shown:?}: {e}"))
        })
    }

    /// The server's bin dir, to run `pgbench` or `psql` of the same version.
    pub fn bin_dir(&self) -> std::path::PathBuf {
        self.pg().bin_dir().to_path_buf()
    }

    fn pg(&self) -> std::sync::RwLockReadGuard<'_, LocalPostgres> {
        self.pg.read().unwrap_or_else(|e| e.into_inner())
    }
}

/// A cluster of a test's own, with `settings` in postgresql.conf, for tests that restart or
/// misconfigure their server (the shared [`cluster`] serves every other test); stopped when
/// dropped. Its superuser `postgres` is trusted.
pub fn private_cluster(settings: &[(&str, &str)]) -> LocalPostgres {
    LocalPostgres::start(LocalPostgresOptions {
        settings: settings
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..LocalPostgresOptions::default()
    })
    .expect("a private cluster")
}

/// Runs `f` on a cluster of a test's own off the runtime's threads (pg_ctl waits for the
/// server to stop, start or be promoted) and gives the cluster back.
pub async fn off_runtime(
    mut pg: LocalPostgres,
    f: impl FnOnce(&mut LocalPostgres) + Send + 'static,
) -> LocalPostgres {
    tokio::task::spawn_blocking(move || {
        f(&mut pg);
        pg
    })
    .await
    .unwrap()
}
