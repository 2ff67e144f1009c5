//! The command line: the three ways to run pgmemo, and the flags that override the config.
//!
//! The flag names are a contract other tools rely on (issue 2, point 2); do not rename them.
//! Turning flags into a [`Config`] happens here, in one order for every mode: start from the
//! file (`--config`) or from defaults plus `--upstream`, apply the flags, then validate, so
//! that a rule such as "trust only on loopback" judges what will actually run.

use std::fmt;
use std::path::PathBuf;

use clap::Parser;

use crate::config::{parse_host_port, parse_upstream_url, AuthType, Config, ConfigError, PoolMode};

const LONG_ABOUT: &str = "\
pgmemo is a PostgreSQL proxy and connection pooler built for caching statements, plans and \
results. Clients connect to pgmemo as if it were PostgreSQL; pgmemo keeps a pool of server \
connections per (database, user) and lends one out per transaction or per session.

There are three ways to run it, and a converter:

  pgmemo
      Demo mode. With no --upstream and no --config, pgmemo starts a private, throwaway \
PostgreSQL (initdb + pg_ctl, found on PATH or under /usr/lib/postgresql/*/bin) in a temporary \
directory on a free port, proxies to it on 127.0.0.1:6432 and prints the psql command to \
connect. The cluster is removed on Ctrl-C or SIGTERM.

  pgmemo --upstream postgresql://USER[:PASSWORD]@HOST[:PORT]
      Proxy to an existing server. Any database a client asks for is served from the database \
of the same name upstream. Clients log in to pgmemo as USER with PASSWORD (there are no \
other users without a config file), and pgmemo logs them into the server as USER with \
PASSWORD. USER is pgmemo's own role, not a fixed server login: with a config file listing \
other users, each client logs into the server as its own role, as with PgBouncer.

  pgmemo --config FILE.toml
      The full configuration: several databases, users with passwords or SCRAM verifiers, \
per-database and per-user pool settings, TLS, timeouts. Every setting is described in \
pgmemo.example.toml. The file is read again on SIGHUP or the admin command RELOAD.

  pgmemo convert pgbouncer.ini [userlist.txt] -o FILE.toml
      Convert a PgBouncer configuration and its auth file to pgmemo's TOML: every key pgmemo \
has no equivalent for is kept as a comment saying why (see docs/migrating-from-pgbouncer.md).

Command-line flags override the matching settings of the file (and still apply after a \
reload). Each flag can also be given as an environment variable, shown below.";

const AFTER_LONG_HELP: &str = "\
Examples:
  pgmemo
  pgmemo --upstream postgresql://app:secret@db.internal:5432 --pool-size 40
  pgmemo --upstream postgresql://postgres@127.0.0.1:5432 --auth trust
  pgmemo --config /etc/pgmemo/pgmemo.toml --listen 0.0.0.0:6432
  pgmemo --config pgmemo.toml --check
  psql 'postgresql://app:secret@127.0.0.1:6432/app'

The admin console is the database \"pgmemo\" (for --admin-user users):
  psql -h 127.0.0.1 -p 6432 -U admin pgmemo -c 'SHOW POOLS'";

/// pgmemo's command line. Every field is optional: an absent flag leaves the file's setting
/// (or the default) alone.
#[derive(Clone, Parser)]
#[command(
    name = "pgmemo",
    version,
    about = "A PostgreSQL proxy and connection pooler built for caching statements, plans and results",
    long_about = LONG_ABOUT,
    after_long_help = AFTER_LONG_HELP,
)]
pub struct Cli {
    /// The TOML config file: databases, users, pools, TLS, timeouts.
    #[arg(
        long,
        value_name = "FILE",
        env = "PGMEMO_CONFIG",
        long_help = "The TOML config file with the full configuration: databases, users with \
                     passwords or SCRAM verifiers, per-pool settings, TLS, timeouts (see \
                     pgmemo.example.toml). The other flags override what it says. It is read \
                     again on SIGHUP and on the admin command RELOAD."
    )]
    pub config: Option<PathBuf>,

    /// The PostgreSQL server to proxy to: postgresql://USER[:PASSWORD]@HOST[:PORT].
    #[arg(
        long,
        value_name = "URL",
        env = "PGMEMO_UPSTREAM",
        hide_env_values = true,
        long_help = "The PostgreSQL server to proxy to, as \
                     postgresql://USER[:PASSWORD]@HOST[:PORT] (postgres:// works too; HOST \
                     defaults to 127.0.0.1, PORT to 5432, IPv6 as [::1]; percent-encode special \
                     characters in USER and PASSWORD; a /DATABASE part is ignored). Every \
                     database a client asks for is served from the database of the same name \
                     there. Without --config, clients log in to pgmemo as USER with PASSWORD, \
                     and to the server as USER. USER is pgmemo's own role (WAL invalidation's \
                     login), not every client's: each client logs into the server as its own \
                     role unless its database sets user. With --config, replaces the file's \
                     [upstream]. Without --upstream and --config, pgmemo runs its own \
                     throwaway PostgreSQL (demo mode)."
    )]
    pub upstream: Option<String>,

    /// A streaming replica of the upstream that provably read-only work may go to.
    #[arg(
        long = "replica",
        value_name = "URL",
        long_help = "A streaming replica of the upstream, as postgresql://HOST[:PORT] (several \
                     hosts separated by commas) or host=... port=...: hosts and ports only, \
                     logged into as the upstream is. Repeat it for more replicas. Provably \
                     read-only statements outside transaction blocks, and read-only blocks, go \
                     to a replica that has replayed the client's own last write \
                     (docs/replicas.md). Replaces the file's upstream.replicas."
    )]
    pub replica: Vec<String>,

    /// Address clients connect to [default: 127.0.0.1:6432].
    #[arg(
        long,
        value_name = "HOST:PORT",
        env = "PGMEMO_LISTEN",
        value_parser = parse_listen,
        long_help = "The address clients connect to, HOST:PORT (IPv6 as [::1]:6432; port 0 \
                     picks a free port). Overrides general.listen. Default: 127.0.0.1:6432. \
                     Listening on a non-loopback address requires --auth md5 or scram-sha-256."
    )]
    pub listen: Option<String>,

    /// When a client gives its server back [default: transaction].
    #[arg(
        long,
        value_enum,
        value_name = "MODE",
        env = "PGMEMO_POOL_MODE",
        long_help = "When a client gives its server connection back to the pool. transaction: \
                     after each transaction (many clients share few servers; session state \
                     such as SET or LISTEN does not last). session: when the client \
                     disconnects; the server is then reset with DISCARD ALL. Overrides \
                     general.pool_mode. Default: transaction."
    )]
    pub pool_mode: Option<PoolMode>,

    /// Server connections per (database, user) [default: 20].
    #[arg(
        long,
        value_name = "N",
        env = "PGMEMO_POOL_SIZE",
        value_parser = clap::value_parser!(u32).range(1..),
        long_help = "Server connections per (database, user) pool. Overrides \
                     general.default_pool_size; a pool_size set in the file for a database or \
                     user still wins for that database or user. Default: 20."
    )]
    pub pool_size: Option<u32>,

    /// Threads serving clients, each with its own event loop [default: 1].
    #[arg(
        long,
        value_name = "N",
        env = "PGMEMO_WORKERS",
        value_parser = clap::value_parser!(u32).range(1..=64),
        long_help = "Threads serving clients, each with an event loop of its own; a client \
                     goes to the one of the CPU its packets arrive on (between transactions too), \
                     and its server moves to its thread. Overrides general.workers. Default: 1 (like PgBouncer: on a small \
                     machine shared with PostgreSQL one thread forwards at the least CPU per \
                     transaction); more serve more result-cache hits at once."
    )]
    pub workers: Option<u32>,

    /// Most client connections accepted at once [default: 1000].
    #[arg(
        long,
        value_name = "N",
        env = "PGMEMO_MAX_CLIENT_CONN",
        value_parser = clap::value_parser!(u32).range(1..),
        long_help = "The most client connections pgmemo accepts at once; more get FATAL 53300 \
                     (too many connections). Overrides general.max_client_conn. Default: 1000."
    )]
    pub max_client_conn: Option<u32>,

    /// How clients authenticate to pgmemo [default: scram-sha-256].
    #[arg(
        long = "auth",
        value_enum,
        value_name = "METHOD",
        env = "PGMEMO_AUTH",
        long_help = "How clients authenticate to pgmemo. scram-sha-256 and md5 check the \
                     password (from [users], or the --upstream password); trust asks for none \
                     and is refused unless --listen is a loopback address. Overrides \
                     general.auth_type. Default: scram-sha-256."
    )]
    pub auth: Option<AuthType>,

    /// A user allowed to use the admin console (repeatable).
    #[arg(
        long = "admin-user",
        value_name = "NAME",
        env = "PGMEMO_ADMIN_USERS",
        value_delimiter = ',',
        long_help = "A user allowed to connect to the admin console, the database \"pgmemo\" \
                     (SHOW POOLS, SHOW STATS, RELOAD, PAUSE, SHUTDOWN, ...). Repeat the flag for \
                     several users (the environment variable takes a comma-separated list). \
                     Replaces general.admin_users. Default: none."
    )]
    pub admin_users: Vec<String>,

    /// Serve Prometheus metrics on this address [default: off].
    #[arg(
        long,
        value_name = "HOST:PORT",
        env = "PGMEMO_METRICS_LISTEN",
        value_parser = parse_listen,
        long_help = "Serve Prometheus metrics (clients, servers by state, transactions, queries, \
                     bytes, wait time) over HTTP on this address, at /metrics. Overrides \
                     general.metrics_listen. Default: no metrics endpoint."
    )]
    pub metrics_listen: Option<String>,

    /// Turn the result cache on (queries are cached by [[cache.rules]] and hints).
    #[arg(
        long,
        env = "PGMEMO_CACHE",
        long_help = "Turn the result cache on: simple queries chosen by a [[cache.rules]] entry \
                     of the config file or by a /* pgmemo cache ttl=5s */ hint (in any comment) are \
                     answered from memory until a write through pgmemo or their TTL invalidates \
                     them. Overrides cache.enabled. Default: off."
    )]
    pub cache: bool,

    /// Memory of the result cache in MiB [default: 64].
    #[arg(long, value_name = "MIB", env = "PGMEMO_CACHE_MEMORY_MB")]
    pub cache_memory_mb: Option<u32>,

    /// What invalidates cached results: proxy (writes through pgmemo) or wal (also every
    /// write in the database's WAL) [default: proxy].
    #[arg(
        long,
        value_name = "proxy|wal",
        env = "PGMEMO_CACHE_INVALIDATION",
        long_help = "What invalidates cached results. proxy: writes that pass through this \
                     pgmemo (and TTL). wal: also every write the database's logical \
                     replication stream shows, whoever made it (needs wal_level = logical and \
                     a role with the REPLICATION attribute; see docs/result-cache.md, \"Setting \
                     up the server\"). Overrides cache.invalidation. Default: proxy."
    )]
    pub cache_invalidation: Option<crate::config::cache::Invalidation>,

    /// Log filter: error, warn, info, debug, trace [default: info].
    #[arg(
        long,
        value_name = "LEVEL",
        env = "PGMEMO_LOG_LEVEL",
        long_help = "What to log: off, error, warn, info, debug or trace, or tracing directives \
                     such as pgmemo=debug,info. Overrides general.log_level. Default: info."
    )]
    pub log_level: Option<String>,

    /// Log line format: text or json [default: text].
    #[arg(
        long,
        value_name = "FORMAT",
        env = "PGMEMO_LOG_FORMAT",
        long_help = "How log lines are written to stderr: text (colours only when stderr is a \
                     terminal) or json (one JSON object per line: timestamp, level, target and \
                     fields, for log collectors). Overrides general.log_format. Default: text."
    )]
    pub log_format: Option<crate::config::LogFormat>,

    /// Demo mode: also run 10-second pgbench comparisons, through pgmemo and directly.
    #[arg(
        long,
        long_help = "In demo mode (no --upstream or --config), once pgmemo is up: run pgbench \
                     for 10 seconds with 8 clients through pgmemo and then directly against the \
                     private PostgreSQL, select-only (-S) and a point read with a cache hint, \
                     and print the TPS figures. pgmemo keeps running."
    )]
    pub demo_bench: bool,

    /// Online restart: take over the listening sockets and idle clients of the running pgmemo.
    #[arg(
        short = 'R',
        long,
        alias = "reboot",
        long_help = "Online restart, as PgBouncer's -R: connect to the pgmemo running with this \
                     configuration (its takeover_socket), take over its listening sockets, then \
                     its clients as each finishes its transaction, while it exits. Without a \
                     running pgmemo there, start as usual. See docs/operations.md, \"Online \
                     restart\"."
    )]
    pub takeover: bool,

    /// Check the configuration, print any problem and exit.
    #[arg(
        long,
        long_help = "Read and validate the configuration (the file and the flags above), report \
                     the first problem with its key, and exit: status 0 when it is valid, 1 \
                     otherwise. Nothing is started."
    )]
    pub check: bool,

    /// A command other than running the proxy.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// What `pgmemo COMMAND` does instead of running the proxy.
#[derive(Clone, Debug, clap::Subcommand)]
pub enum Command {
    /// Convert a PgBouncer configuration (pgbouncer.ini and its auth file) to pgmemo's TOML.
    #[command(
        long_about = "Convert a PgBouncer configuration to pgmemo's TOML. Reads \
        pgbouncer.ini as PgBouncer 1.25 does (with its %include files) and the auth file \
        (userlist.txt: the second argument, or else the file auth_file names when it can be \
        read), and writes the equivalent pgmemo configuration. Every PgBouncer key pgmemo \
        has no equivalent for becomes a \"# not converted:\" comment saying why; an unknown \
        key a \"# unknown:\" comment and a warning on stderr with its line. A line PgBouncer \
        would refuse, or a malformed auth file line, is an error with its line (exit \
        status 1). Check the result with pgmemo --check --config FILE."
    )]
    Convert {
        /// PgBouncer's configuration file.
        #[arg(value_name = "PGBOUNCER.INI")]
        ini: PathBuf,
        /// PgBouncer's auth file [default: the file auth_file names, when readable].
        #[arg(value_name = "USERLIST.TXT")]
        userlist: Option<PathBuf>,
        /// Write the TOML to FILE instead of stdout.
        #[arg(short, long, value_name = "FILE")]
        output: Option<PathBuf>,
    },
}

/// clap's value parser for `HOST:PORT` flags.
fn parse_listen(s: &str) -> Result<String, String> {
    parse_host_port(s).map(|_| s.to_string())
}

impl fmt::Debug for Cli {
    /// Like a derived Debug, but the upstream URL may hold a password: only its presence shows.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cli")
            .field("config", &self.config)
            .field("upstream", &self.upstream.as_ref().map(|_| "<hidden>"))
            .field("replica", &self.replica)
            .field("listen", &self.listen)
            .field("pool_mode", &self.pool_mode)
            .field("pool_size", &self.pool_size)
            .field("max_client_conn", &self.max_client_conn)
            .field("auth", &self.auth)
            .field("admin_users", &self.admin_users)
            .field("metrics_listen", &self.metrics_listen)
            .field("workers", &self.workers)
            .field("log_level", &self.log_level)
            .field("log_format", &self.log_format)
            .field("cache", &self.cache)
            .field("cache_memory_mb", &self.cache_memory_mb)
            .field("cache_invalidation", &self.cache_invalidation)
            .field("check", &self.check)
            .field("command", &self.command)
            .finish()
    }
}

impl Cli {
    /// The configuration the flags describe, validated; None in demo mode (neither
    /// `--upstream` nor `--config`), where the caller builds one with
    /// [`Config::for_upstream`] once its private PostgreSQL runs, then calls
    /// [`Cli::apply_overrides`] on it (keep a clone of the `Cli` for that).
    pub fn into_config(self) -> Result<Option<Config>, ConfigError> {
        let upstream = self
            .upstream
            .as_deref()
            .map(|url| parse_upstream_url(url).map_err(|e| e.with_key("--upstream")))
            .transpose()?;
        let mut config = match (&self.config, upstream) {
            (None, None) => return Ok(None),
            (None, Some(upstream)) => Config::for_upstream(upstream),
            (Some(path), upstream) => {
                let mut config = Config::parse_file(path)?;
                if upstream.is_some() {
                    config.upstream = upstream;
                }
                config
            }
        };
        if !self.replica.is_empty() {
            let up = config.upstream.as_mut().ok_or_else(|| {
                ConfigError::invalid("--replica", "needs an upstream (--upstream or [upstream])")
            })?;
            up.replicas.clear();
            for url in &self.replica {
                up.replicas
                    .extend(crate::config::parse_replicas("--replica", url)?);
            }
        }
        if let Err(e) = self.apply_overrides(&mut config) {
            // A rule between settings, judged after the flags: point at the line of its key
            // in the file, when the file sets it.
            let text = self.config.as_deref().map(std::fs::read_to_string);
            return Err(match text {
                Some(Ok(text)) => e.at_line_of_key(&text),
                _ => e,
            });
        }
        Ok(Some(config))
    }

    /// Writes the given flags over `config` and validates the result. Call it again on the
    /// configuration read by a RELOAD, so that flags keep overriding the file.
    /// (`--upstream` and `--config` are not applied here: they choose where a configuration
    /// comes from, see [`Cli::into_config`].)
    pub fn apply_overrides(&self, config: &mut Config) -> Result<(), ConfigError> {
        let g = &mut config.general;
        if let Some(listen) = &self.listen {
            g.listen = listen.clone();
        }
        if let Some(mode) = self.pool_mode {
            g.pool_mode = mode;
        }
        if let Some(size) = self.pool_size {
            g.default_pool_size = size;
            g.min_pool_size = g.min_pool_size.min(size);
        }
        if let Some(n) = self.max_client_conn {
            g.max_client_conn = n;
        }
        if let Some(n) = self.workers {
            g.workers = n;
        }
        if let Some(auth) = self.auth {
            g.auth_type = auth;
        }
        if !self.admin_users.is_empty() {
            g.admin_users = self.admin_users.clone();
        }
        if let Some(metrics) = &self.metrics_listen {
            g.metrics_listen = Some(metrics.clone());
        }
        if let Some(level) = &self.log_level {
            g.log_level = level.clone();
        }
        if let Some(format) = self.log_format {
            g.log_format = format;
        }
        if self.cache {
            config.cache.enabled = true;
        }
        if let Some(mb) = self.cache_memory_mb {
            config.cache.max_memory = mb.max(1) as usize * 1024 * 1024;
        }
        if let Some(invalidation) = self.cache_invalidation {
            config.cache.invalidation = invalidation;
        }
        config.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn cli(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("pgmemo").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn no_upstream_and_no_config_is_demo_mode() {
        assert!(cli(&[]).into_config().unwrap().is_none());
        assert!(cli(&["--pool-size", "5"]).into_config().unwrap().is_none());
    }

    #[test]
    fn upstream_mode_takes_defaults_and_flags() {
        let c = cli(&["--upstream", "postgresql://app:pw@db:5433"])
            .into_config()
            .unwrap()
            .unwrap();
        assert_eq!(c.general.listen, "127.0.0.1:6432");
        assert_eq!(c.general.pool_mode, PoolMode::Transaction);
        assert_eq!(c.general.default_pool_size, 20);
        assert_eq!(c.general.auth_type, AuthType::ScramSha256);
        assert_eq!(c.user_secret("app"), Some("pw"));
        let r = c.resolve("anydb", "app").unwrap();
        assert_eq!(
            (r.host.as_str(), r.port, r.dbname.as_str()),
            ("db", 5433, "anydb")
        );

        let c = cli(&[
            "--upstream",
            "postgres://app:pw@db",
            "--listen",
            "0.0.0.0:7000",
            "--pool-mode",
            "session",
            "--pool-size",
            "3",
            "--auth",
            "md5",
            "--admin-user",
            "app",
            "--metrics-listen",
            "127.0.0.1:9187",
            "--log-level",
            "debug",
        ])
        .into_config()
        .unwrap()
        .unwrap();
        let g = &c.general;
        assert_eq!(g.listen, "0.0.0.0:7000");
        assert_eq!(g.pool_mode, PoolMode::Session);
        assert_eq!(g.default_pool_size, 3);
        assert_eq!(g.auth_type, AuthType::Md5);
        assert_eq!(g.admin_users, vec!["app".to_string()]);
        assert_eq!(g.metrics_listen.as_deref(), Some("127.0.0.1:9187"));
        assert_eq!(g.log_level, "debug");
    }

    #[test]
    fn validation_runs_after_the_flags() {
        let e = cli(&[
            "--upstream",
            "postgresql://app:pw@db",
            "--listen",
            "0.0.0.0:6432",
            "--auth",
            "trust",
        ])
        .into_config()
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("general.auth_type: \"trust\""), "{e}");
        assert!(e.contains("0.0.0.0:6432"), "{e}");

        // A flag can also repair what the file would have refused.
        let dir = std::env::temp_dir().join(format!("pgmemo-cli-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pgmemo.toml");
        std::fs::write(
            &path,
            "[general]\nlisten = \"0.0.0.0:6432\"\nauth_type = \"trust\"\n[upstream]\nurl = \"postgresql://app@db\"\n",
        )
        .unwrap();
        let path_arg = path.to_str().unwrap();
        let e = cli(&["--config", path_arg]).into_config().unwrap_err();
        assert_eq!(e.key(), Some("general.auth_type"));
        let c = cli(&["--config", path_arg, "--listen", "127.0.0.1:6432"])
            .into_config()
            .unwrap()
            .unwrap();
        assert_eq!(c.source.as_deref(), Some(path.as_path()));
        assert_eq!(c.general.auth_type, AuthType::Trust);
        // --upstream replaces the file's [upstream].
        let c = cli(&[
            "--config",
            path_arg,
            "--listen",
            "[::1]:1",
            "--upstream",
            "postgresql://u@other:7",
        ])
        .into_config()
        .unwrap()
        .unwrap();
        assert_eq!(c.upstream.unwrap().host, "other");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn demo_mode_applies_the_same_overrides() {
        let cli = cli(&["--pool-size", "4", "--auth", "trust"]);
        let mut c = Config::for_upstream(
            parse_upstream_url("postgresql://postgres@127.0.0.1:5999").unwrap(),
        );
        cli.apply_overrides(&mut c).unwrap();
        assert_eq!(c.general.default_pool_size, 4);
        assert_eq!(c.general.auth_type, AuthType::Trust);
    }

    #[test]
    fn bad_flags_are_refused_by_name() {
        let e = parse_upstream_url("http://x").unwrap_err();
        assert_eq!(e.key(), Some("upstream.url"));
        let e = cli(&["--upstream", "http://user:secret@x"])
            .into_config()
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("--upstream: not a postgresql:// URL"), "{e}");
        assert!(!e.contains("secret"), "{e}");
        for args in [
            &["--pool-size", "0"][..],
            &["--pool-mode", "statement"],
            &["--auth", "password"],
            &["--listen", "6432"],
            &["--metrics-listen", "nope"],
            &["--bogus"],
        ] {
            let argv = std::iter::once("pgmemo").chain(args.iter().copied());
            assert!(Cli::try_parse_from(argv).is_err(), "{args:?} accepted");
        }
        let e = cli(&["--upstream", "postgresql://a:b@h", "--log-level", "loud"])
            .into_config()
            .unwrap_err();
        assert_eq!(e.key(), Some("general.log_level"));
    }

    #[test]
    fn help_documents_every_flag() {
        let help = Cli::command().render_long_help().to_string();
        for needle in [
            "--config",
            "--upstream",
            "--listen",
            "--pool-mode",
            "--pool-size",
            "--auth",
            "--admin-user",
            "--metrics-listen",
            "--log-level",
            "--check",
            "Demo mode",
            "Default: 127.0.0.1:6432",
            "Default: transaction",
            "Default: 20",
            "Default: scram-sha-256",
            "override",
        ] {
            assert!(help.contains(needle), "--help lacks {needle:?}");
        }
    }
}
