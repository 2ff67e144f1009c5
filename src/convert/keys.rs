//! Every `[pgbouncer]` setting of PgBouncer 1.25 (`bouncer_params[]` in its `main.c`), and
//! what becomes of it in pgmemo: one row each, as pgmemo's own settings table. A row either
//! names the `[general]` key that means the same and how the value is written, says that
//! the converter handles it together with other keys, or says why it is not converted.
//!
//! `docs/migrating-from-pgbouncer.md` shows the same table; a test holds the two together.

/// What becomes of one PgBouncer setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// The same meaning under this `[general]` key, the value written as `Form` says.
    To(&'static str, Form),
    /// Converted with other keys (`listen_addr` and `listen_port` make `listen`); the text
    /// names the pgmemo keys, for the docs.
    Special(&'static str),
    /// pgmemo has nothing like it: why, and what to do instead.
    Not(&'static str),
}

/// How a value is written in pgmemo.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// A whole number, at least 1 (`default_pool_size`) or any (`min_pool_size`).
    Count { min: u32 },
    /// Seconds; what PgBouncer's 0 means.
    Seconds(Zero),
    /// Text as is.
    Text,
    /// PgBouncer's 0/1 as false/true.
    Flag,
}

/// What a 0 of a PgBouncer duration becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Zero {
    /// 0 means "no limit" in PgBouncer; pgmemo's longest duration (one year) is written.
    NoLimit,
    /// 0 means the same in pgmemo.
    Same,
    /// pgmemo has no such value: why.
    Refused(&'static str),
}

use Form::*;
use Rule::*;

const TCP: &str = "pgmemo leaves TCP tuning to the system (sysctl net.ipv4.tcp_*)";
const LOGS: &str = "pgmemo logs to stderr, for journald, Docker or a redirect; \
                    general.log_level and log_format choose what and how";
const NO_TLS_TUNING: &str =
    "pgmemo's TLS (rustls) has its own safe cipher suites; tls_protocols chooses the versions";

/// Every `[pgbouncer]` key PgBouncer 1.25 knows, in its own (alphabetical) order.
pub const PGBOUNCER_KEYS: &[(&str, Rule)] = &[
    ("admin_users", Special("general.admin_users (users with a password only)")),
    ("application_name_add_host", To("general.application_name_add_host", Flag)),
    ("auth_dbname", To("general.auth_dbname", Text)),
    ("auth_file", Special("[users.NAME] password = the file's secret")),
    ("auth_hba_file", To("general.auth_hba_file", Text)),
    ("auth_ident_file", To("general.auth_ident_file", Text)),
    ("auth_ldap_options", Not("pgmemo has no LDAP authentication")),
    ("auth_query", To("general.auth_query", Text)),
    ("auth_type", Special("general.auth_type")),
    ("auth_user", To("general.auth_user", Text)),
    (
        "autodb_idle_timeout",
        Not("pgmemo keeps a pool for each database name it served; its idle servers close after server_idle_timeout"),
    ),
    (
        "cancel_wait_timeout",
        Not("pgmemo forwards a cancel request at once, with its own 5-second limit"),
    ),
    ("client_idle_timeout", To("general.client_idle_timeout", Seconds(Zero::Same))),
    ("client_login_timeout", To("general.client_login_timeout", Seconds(Zero::NoLimit))),
    ("client_tls13_ciphers", Not(NO_TLS_TUNING)),
    ("client_tls_ca_file", To("general.tls_ca_file", Text)),
    ("client_tls_cert_file", To("general.tls_cert_file", Text)),
    ("client_tls_ciphers", Not(NO_TLS_TUNING)),
    ("client_tls_dheparams", Not(NO_TLS_TUNING)),
    ("client_tls_ecdhcurve", Not(NO_TLS_TUNING)),
    ("client_tls_key_file", To("general.tls_key_file", Text)),
    ("client_tls_protocols", To("general.tls_protocols", Text)),
    ("client_tls_sslmode", Special("general.client_tls")),
    ("conffile", Not("pgmemo's file is the --config flag")),
    ("default_pool_size", To("general.default_pool_size", Count { min: 1 })),
    ("disable_pqexec", Not("pgmemo accepts multi-statement simple queries, as PostgreSQL")),
    ("dns_max_ttl", Not("pgmemo resolves host names at each server connect")),
    ("dns_nxdomain_ttl", Not("pgmemo resolves host names at each server connect")),
    ("dns_zone_check_period", Not("pgmemo resolves host names at each server connect")),
    ("idle_transaction_timeout", To("general.idle_transaction_timeout", Seconds(Zero::Same))),
    ("ignore_startup_parameters", Not("pgmemo accepts every startup parameter and carries it to each server the client uses, so none need ignoring")),
    ("job_name", Not("pgmemo has no job name; its log lines say pgmemo")),
    ("listen_addr", Special("general.listen (host part)")),
    ("listen_backlog", Not(TCP)),
    ("listen_port", Special("general.listen (port part)")),
    ("log_connections", To("general.log_connections", Flag)),
    ("log_disconnections", To("general.log_disconnections", Flag)),
    ("log_pooler_errors", Not("general.log_level decides what pgmemo logs")),
    ("log_stats", To("general.log_stats", Flag)),
    ("logfile", Not(LOGS)),
    ("max_client_conn", To("general.max_client_conn", Count { min: 1 })),
    ("max_db_client_connections", To("general.max_db_client_connections", Count { min: 0 })),
    ("max_db_connections", To("general.max_db_connections", Count { min: 0 })),
    ("max_packet_size", Special("general.max_message_size (at most 1 GiB)")),
    ("max_prepared_statements", Special("general.max_prepared_statements; 0 is general.prepared_statements = false")),
    ("max_user_client_connections", To("general.max_user_client_connections", Count { min: 0 })),
    ("max_user_connections", To("general.max_user_connections", Count { min: 0 })),
    ("min_pool_size", To("general.min_pool_size", Count { min: 0 })),
    ("peer_id", Not("pgmemo has no peers; general.workers runs several threads in one process")),
    ("pidfile", Not("pgmemo writes no pid file; systemd (or Docker) tracks the process")),
    ("pkt_buf", Not("pgmemo sizes its buffers itself")),
    ("pool_mode", Special("general.pool_mode (statement becomes transaction)")),
    ("query_timeout", To("general.query_timeout", Seconds(Zero::Same))),
    ("query_wait_notify", To("general.query_wait_notify", Seconds(Zero::Same))),
    ("query_wait_timeout", To("general.query_wait_timeout", Seconds(Zero::NoLimit))),
    ("reserve_pool_size", To("general.reserve_pool_size", Count { min: 0 })),
    (
        "reserve_pool_timeout",
        To(
            "general.reserve_pool_timeout",
            Seconds(Zero::Refused("pgmemo's reserve_pool_timeout must be more than 0; reserve_pool_size = 0 turns the reserve off")),
        ),
    ),
    ("resolv_conf", Not("pgmemo uses the system's resolver")),
    ("sbuf_loopcnt", Not("pgmemo has no such fairness knob")),
    ("scram_iterations", Not("pgmemo's SCRAM uses the iterations of each verifier, 4096 for plain passwords")),
    ("server_check_delay", To("general.server_check_delay", Seconds(Zero::Same))),
    ("server_check_query", Special("general.server_check_query (empty: not converted)")),
    ("server_connect_timeout", To("general.server_connect_timeout", Seconds(Zero::NoLimit))),
    ("server_fast_close", Not("pgmemo closes a server made stale by RECONNECT when its client releases it")),
    ("server_idle_timeout", To("general.server_idle_timeout", Seconds(Zero::NoLimit))),
    (
        "server_lifetime",
        To(
            "general.server_lifetime",
            Seconds(Zero::Refused("pgmemo cannot use a server only once; its lifetime must be above 0")),
        ),
    ),
    ("server_login_retry", Not("pgmemo retries a failed connect within server_connect_timeout")),
    ("server_reset_query", To("general.server_reset_query", Text)),
    ("server_reset_query_always", To("general.server_reset_query_always", Flag)),
    ("server_round_robin", To("general.server_round_robin", Flag)),
    ("server_tls13_ciphers", Not(NO_TLS_TUNING)),
    ("server_tls_ca_file", To("general.server_tls_ca_file", Text)),
    ("server_tls_cert_file", To("general.server_tls_cert_file", Text)),
    ("server_tls_ciphers", Not(NO_TLS_TUNING)),
    ("server_tls_key_file", To("general.server_tls_key_file", Text)),
    ("server_tls_protocols", To("general.server_tls_protocols", Text)),
    ("server_tls_sslmode", Special("general.server_tls (PgBouncer's default prefer is written out)")),
    ("service_name", Not("pgmemo has no service name (Windows only in PgBouncer)")),
    ("so_reuseport", Not("pgmemo runs as one process; general.workers adds threads")),
    ("stats_period", To("general.stats_period", Seconds(Zero::Refused("pgmemo's stats_period must be above 0")))),
    ("stats_users", Special("general.stats_users (users with a password only)")),
    ("suspend_timeout", Not("pgmemo has no SUSPEND: its online restart (--takeover, as PgBouncer's -R) hands idle clients over and lets the old process finish running transactions within shutdown_timeout")),
    ("syslog", Not(LOGS)),
    ("syslog_facility", Not(LOGS)),
    ("syslog_ident", Not(LOGS)),
    ("tcp_defer_accept", Not(TCP)),
    ("tcp_keepalive", To("general.tcp_keepalive", Flag)),
    ("tcp_keepcnt", To("general.tcp_keepcnt", Count { min: 0 })),
    ("tcp_keepidle", To("general.tcp_keepidle", Seconds(Zero::Same))),
    ("tcp_keepintvl", To("general.tcp_keepintvl", Seconds(Zero::Same))),
    ("tcp_socket_buffer", Not(TCP)),
    ("tcp_user_timeout", Not("PgBouncer's is in milliseconds; set general.tcp_user_timeout in seconds (0.5 for 500) by hand")),
    ("track_extra_parameters", Not("pgmemo tracks every parameter a client sets, reported or not")),
    ("transaction_timeout", To("general.transaction_timeout", Seconds(Zero::Same))),
    ("unix_socket_dir", To("general.unix_socket_dir", Text)),
    ("unix_socket_group", To("general.unix_socket_group", Text)),
    ("unix_socket_mode", To("general.unix_socket_mode", Text)),
    ("user", Not("pgmemo does not switch users; run it as that user (systemd User=)")),
    ("verbose", Special("general.log_level (1: debug, 2: trace)")),
];

/// The rule for a `[pgbouncer]` key; None for a key PgBouncer 1.25 does not know.
pub fn rule(key: &str) -> Option<Rule> {
    PGBOUNCER_KEYS
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, rule)| *rule)
}

/// Connection-string keys of `[databases]` entries that pgmemo does not have, and why.
pub const DATABASE_NOT: &[(&str, &str)] = &[
    ("server_lifetime", "pgmemo's server_lifetime is one for all ([general])"),
    ("connect_query", "pgmemo runs no query on new server connections"),
    ("client_encoding", "pgmemo passes the client's own startup parameters to the server; set it there or with ALTER DATABASE ... SET"),
    ("datestyle", "pgmemo passes the client's own startup parameters to the server; set it there or with ALTER DATABASE ... SET"),
    ("timezone", "pgmemo passes the client's own startup parameters to the server; set it there or with ALTER DATABASE ... SET"),
    ("application_name", "pgmemo passes the client's own application_name"),
];

/// `[users]` settings pgmemo does not have, and why.
pub const USER_NOT: &[(&str, &str)] = &[(
    "reserve_pool_size",
    "pgmemo's reserve pool is per database ([databases.NAME]) or general",
)];

/// The reason for a key of a `[databases]` or `[users]` value that pgmemo lacks.
pub fn not_in(table: &[(&str, &'static str)], key: &str) -> Option<&'static str> {
    table.iter().find(|(k, _)| *k == key).map(|(_, why)| *why)
}
