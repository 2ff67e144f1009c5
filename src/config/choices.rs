//! The settings that take one of a few words (`pool_mode = "transaction"`): each is an enum
//! whose names are written once, in `named_enum!`, so that the file, the command line, the
//! error messages and SHOW CONFIG agree.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::table;

/// When a client gives its server connection back to the pool.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum PoolMode {
    /// A client keeps one server for its whole session; the server is reset with
    /// `server_reset_query` before the next client gets it. Everything PostgreSQL offers
    /// works (session `SET`, advisory locks, `LISTEN`, temp tables).
    Session,
    /// A client holds a server from the first message that needs one until ReadyForQuery
    /// says the server is idle outside a transaction; then the server goes back at once.
    /// Many more clients than servers; session state does not survive between transactions.
    #[default]
    Transaction,
}

/// How log lines are written (to stderr).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    /// Human-readable lines, coloured only when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, fields), for log collectors.
    Json,
}

/// How clients prove who they are to pgmemo.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum,
)]
pub enum AuthType {
    /// No password is asked. Refused unless `listen` is a loopback address.
    #[serde(rename = "trust")]
    #[value(name = "trust")]
    Trust,
    /// MD5 challenge-response. As in PostgreSQL, a user whose secret is a SCRAM verifier is
    /// asked for SCRAM-SHA-256 instead. An md5 hash as secret requires this method.
    #[serde(rename = "md5")]
    #[value(name = "md5")]
    Md5,
    /// SCRAM-SHA-256 (the PostgreSQL default since version 14). Secrets must be plain
    /// passwords or SCRAM verifiers; an md5 hash cannot answer a SCRAM exchange.
    #[default]
    #[serde(rename = "scram-sha-256")]
    #[value(name = "scram-sha-256")]
    ScramSha256,
    /// Each connection's method from `auth_hba_file`, a file in `pg_hba.conf`'s format
    /// (PgBouncer's `auth_type = hba`).
    #[serde(rename = "hba")]
    #[value(name = "hba")]
    Hba,
    /// TLS client certificates (PgBouncer's `auth_type = cert`): the client's certificate,
    /// checked against `tls_ca_file`, must name the user in its Common Name; no password.
    #[serde(rename = "cert")]
    #[value(name = "cert")]
    Cert,
}

/// Whether clients connect to pgmemo over TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClientTlsMode {
    /// No TLS: an SSLRequest is answered `N` and the client continues in plaintext.
    #[default]
    Disable,
    /// TLS is offered to clients that ask for it; plaintext clients are accepted too.
    Allow,
    /// Plaintext clients are refused; only TLS connections may log in.
    Require,
    /// As `require`, and a client must present a certificate that chains to `tls_ca_file`.
    VerifyCa,
    /// The same as `verify-ca` (as in PgBouncer: a client has no host name to check).
    VerifyFull,
}

/// Whether pgmemo uses TLS for its connections to PostgreSQL servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ServerTlsMode {
    /// Plaintext only.
    #[default]
    Disable,
    /// TLS when the server offers it, plaintext otherwise; the certificate is not checked.
    Prefer,
    /// TLS or no connection; the certificate is not checked (like libpq's `sslmode=require`).
    Require,
    /// TLS, with the certificate checked against `server_tls_ca_file` (or the well-known
    /// web roots when unset) and the host name.
    VerifyFull,
}

/// One place for the names of each enumerated setting, so that parsing, errors, display
/// and `SHOW CONFIG` agree.
macro_rules! named_enum {
    ($ty:ty, $expected:expr, { $($variant:path => $name:expr),+ $(,)? }) => {
        impl $ty {
            /// The name used in the config file and on the command line.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($variant => $name,)+
                }
            }
        }

        impl FromStr for $ty {
            type Err = String;

            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($name => Ok($variant),)+
                    _ => Err(format!("expected {}, got {:?}", $expected, s)),
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl table::Value for $ty {
            type Raw = String;
            const KIND: &'static str = $expected;
            fn read(raw: String, _: &table::Context<'_>) -> Result<Self, String> {
                raw.parse()
            }
            fn show(&self) -> String {
                self.to_string()
            }
        }
    };
}

named_enum!(LogFormat, r#""text" or "json""#, {
    LogFormat::Text => "text",
    LogFormat::Json => "json",
});
named_enum!(PoolMode, r#""session" or "transaction""#, {
    PoolMode::Session => "session",
    PoolMode::Transaction => "transaction",
});
named_enum!(AuthType, r#""trust", "md5", "scram-sha-256", "hba" or "cert""#, {
    AuthType::Trust => "trust",
    AuthType::Md5 => "md5",
    AuthType::ScramSha256 => "scram-sha-256",
    AuthType::Hba => "hba",
    AuthType::Cert => "cert",
});
named_enum!(ClientTlsMode, r#""disable", "allow", "require", "verify-ca" or "verify-full""#, {
    ClientTlsMode::Disable => "disable",
    ClientTlsMode::Allow => "allow",
    ClientTlsMode::Require => "require",
    ClientTlsMode::VerifyCa => "verify-ca",
    ClientTlsMode::VerifyFull => "verify-full",
});

impl ClientTlsMode {
    /// Whether plaintext clients are refused.
    pub fn requires_tls(self) -> bool {
        matches!(
            self,
            ClientTlsMode::Require | ClientTlsMode::VerifyCa | ClientTlsMode::VerifyFull
        )
    }

    /// Whether a TLS client must present a certificate.
    pub fn requires_certificate(self) -> bool {
        matches!(self, ClientTlsMode::VerifyCa | ClientTlsMode::VerifyFull)
    }
}
named_enum!(ServerTlsMode, r#""disable", "prefer", "require" or "verify-full""#, {
    ServerTlsMode::Disable => "disable",
    ServerTlsMode::Prefer => "prefer",
    ServerTlsMode::Require => "require",
    ServerTlsMode::VerifyFull => "verify-full",
});

/// The TLS versions a `tls_protocols` / `server_tls_protocols` value allows, as PgBouncer
/// reads it: `tlsv1.0` to `tlsv1.3`, `secure` (1.2 and 1.3, the default), `all` and `legacy`
/// (every version), separated by commas or spaces. pgmemo's TLS (rustls) speaks 1.2 and 1.3
/// only: the older ones are allowed without effect, and a value that allows neither of the
/// two is refused. Returns (TLS 1.2, TLS 1.3).
pub fn tls_protocols(value: &str) -> Result<(bool, bool), String> {
    let (mut v12, mut v13, mut any) = (false, false, false);
    for word in value.split([',', ' ', ':']).filter(|w| !w.is_empty()) {
        match word.to_ascii_lowercase().as_str() {
            "secure" | "default" | "all" | "legacy" => (v12, v13) = (true, true),
            "tlsv1.2" => v12 = true,
            "tlsv1.3" => v13 = true,
            "tlsv1.0" | "tlsv1.1" => {}
            other => {
                return Err(format!(
                    "unknown TLS protocol {other:?} (expected tlsv1.0 to tlsv1.3, secure, all \
                     or legacy)"
                ))
            }
        }
        any = true;
    }
    match (any, v12 || v13) {
        (false, _) => Err("name at least one TLS protocol (secure: TLS 1.2 and 1.3)".into()),
        (true, false) => Err("pgmemo speaks TLS 1.2 and 1.3 only: allow tlsv1.2 or tlsv1.3".into()),
        (true, true) => Ok((v12, v13)),
    }
}

#[cfg(test)]
mod tls_protocol_tests {
    use super::tls_protocols;

    #[test]
    fn tls_protocols_are_read_as_pgbouncer_reads_them() {
        assert_eq!(tls_protocols("secure"), Ok((true, true)));
        assert_eq!(tls_protocols("legacy"), Ok((true, true)));
        assert_eq!(tls_protocols("tlsv1.3"), Ok((false, true)));
        assert_eq!(tls_protocols("TLSv1.2, tlsv1.3"), Ok((true, true)));
        assert_eq!(tls_protocols("tlsv1.1 tlsv1.2"), Ok((true, false)));
        assert!(tls_protocols("tlsv1.0,tlsv1.1")
            .unwrap_err()
            .contains("1.2 and 1.3 only"));
        assert!(tls_protocols("sslv3")
            .unwrap_err()
            .contains("unknown TLS protocol"));
        assert!(tls_protocols(" ").is_err());
    }
}
