//! Authentication math for both of pgmemo's roles.
//!
//! Towards clients pgmemo plays the PostgreSQL server (it checks an md5 response or runs the
//! server side of SCRAM-SHA-256); towards PostgreSQL it plays the client. Everything here is
//! pure computation over byte slices: the session code reads and writes the protocol messages
//! and feeds their payloads to these functions and state machines, so the math can be tested
//! without sockets.
//!
//! Secrets are stored the way PostgreSQL stores them in `pg_authid.rolpassword`, so a
//! `userlist` copied from `SELECT rolname, rolpassword FROM pg_authid` works unchanged.

use std::fmt;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

mod md5;
mod scram;

pub use self::md5::{md5_client_response, md5_response_for, md5_salt, md5_verify};
pub use self::scram::{ScramClient, ScramKeys, ScramServer, SCRAM_SHA_256};

/// Iteration count PostgreSQL uses by default (`scram_iterations`), also used for the mock
/// exchange so that an unknown user looks like a default-configured one.
pub const SCRAM_DEFAULT_ITERATIONS: u32 = 4096;

/// Salt length PostgreSQL uses when it builds a SCRAM secret.
pub const SCRAM_DEFAULT_SALT_LEN: usize = 16;

/// Why an authentication exchange ended without success.
///
/// The two cases need different answers to the peer: a wrong password is the ordinary
/// `28P01 password authentication failed` (the same text whether or not the user exists),
/// while a malformed message is a protocol violation (`08P01`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The proof or response did not verify, the user is unknown, or the stored secret cannot
    /// be used with the chosen method. Deliberately one variant for all of these, so that
    /// callers cannot accidentally tell a client which one it was.
    #[error("password authentication failed")]
    WrongPassword,
    /// The peer sent something that is not a valid message of the exchange. The text is the
    /// primary message PostgreSQL uses for the same problem (e.g. "malformed SCRAM message").
    #[error("{0}")]
    Protocol(String),
}

/// A user's stored password, in one of the three forms `pg_authid.rolpassword` can hold.
#[derive(Clone, PartialEq, Eq)]
pub enum Secret {
    /// The clear-text password. Usable with every method, and the only form that lets
    /// pgmemo log into PostgreSQL as this user.
    Plain(String),
    /// `"md5" + hex(md5(password + username))`, exactly as stored by PostgreSQL. Usable for
    /// md5 authentication only.
    Md5(String),
    /// A SCRAM-SHA-256 verifier. Usable for SCRAM authentication only.
    Scram(ScramVerifier),
}

impl Secret {
    /// Classifies a stored password the way PostgreSQL's `get_password_type` does: `md5`
    /// followed by 32 lowercase hex digits is an md5 hash, a string that parses as a SCRAM
    /// secret is one, and anything else is a clear-text password.
    pub fn parse(s: &str) -> Secret {
        if is_md5_hash(s) {
            Secret::Md5(s.to_owned())
        } else if let Some(verifier) = ScramVerifier::parse(s) {
            Secret::Scram(verifier)
        } else {
            Secret::Plain(s.to_owned())
        }
    }
}

// Never print a password or key material into a log by accident.
impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Secret::Plain(_) => f.write_str("Plain(<redacted>)"),
            Secret::Md5(_) => f.write_str("Md5(<redacted>)"),
            Secret::Scram(v) => f.debug_tuple("Scram").field(v).finish(),
        }
    }
}

/// `md5` + 32 lowercase hex digits, the only md5 form PostgreSQL recognises.
fn is_md5_hash(s: &str) -> bool {
    s.len() == 35
        && s.starts_with("md5")
        && s[3..]
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// What the server keeps to check SCRAM-SHA-256 proofs without knowing the password
/// (RFC 5802 §3): the salt and iteration count are sent to the client, StoredKey checks its
/// proof and ServerKey signs the server's answer.
///
/// Its text form is PostgreSQL's: `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`
/// with standard padded base64.
#[derive(Clone, PartialEq, Eq)]
pub struct ScramVerifier {
    /// PBKDF2 iteration count.
    pub iterations: u32,
    /// Raw salt bytes (PostgreSQL uses 16).
    pub salt: Vec<u8>,
    /// `H(HMAC(SaltedPassword, "Client Key"))`.
    pub stored_key: [u8; 32],
    /// `HMAC(SaltedPassword, "Server Key")`.
    pub server_key: [u8; 32],
}

impl ScramVerifier {
    /// Derives the verifier for `password`, as `CREATE ROLE ... PASSWORD` would with this salt
    /// and iteration count.
    ///
    /// PostgreSQL first normalises the password with SASLprep. That is the identity for ASCII
    /// passwords (which are used as is, control characters included); a non-ASCII password is
    /// used as its raw UTF-8 bytes here, which matches PostgreSQL whenever SASLprep leaves it
    /// unchanged (NFKC-normal text without non-ASCII spaces or zero-width characters). To get
    /// an exact verifier for any password with a fresh random salt, use
    /// [`ScramVerifier::generate`].
    pub fn from_password(password: &str, salt: &[u8], iterations: u32) -> ScramVerifier {
        let mut salted = [0u8; 32];
        pbkdf2::pbkdf2_hmac::<Sha256>(password.as_bytes(), salt, iterations.max(1), &mut salted);
        let client_key = hmac_sha256(&salted, &[b"Client Key"]);
        ScramVerifier {
            iterations,
            salt: salt.to_vec(),
            stored_key: Sha256::digest(client_key).into(),
            server_key: hmac_sha256(&salted, &[b"Server Key"]),
        }
    }

    /// Derives a verifier with a random 16-byte salt and 4096 iterations, applying SASLprep
    /// exactly as PostgreSQL and libpq do (via `postgres_protocol`).
    pub fn generate(password: &str) -> ScramVerifier {
        let text = postgres_protocol::password::scram_sha_256(password.as_bytes());
        // The library's output is always well-formed; the fallback only exists so that a
        // future change there can never turn into a panic here.
        ScramVerifier::parse(&text).unwrap_or_else(|| {
            let salt: [u8; SCRAM_DEFAULT_SALT_LEN] = rand::random();
            ScramVerifier::from_password(password, &salt, SCRAM_DEFAULT_ITERATIONS)
        })
    }

    /// Parses PostgreSQL's text form; `None` if it is not exactly that (the caller then
    /// treats the string as a clear-text password, as PostgreSQL does).
    pub fn parse(s: &str) -> Option<ScramVerifier> {
        let rest = s.strip_prefix("SCRAM-SHA-256$")?;
        let (iterations, rest) = rest.split_once(':')?;
        let (salt, keys) = rest.split_once('$')?;
        let (stored_key, server_key) = keys.split_once(':')?;
        let iterations: u32 = iterations.parse().ok().filter(|&i| i > 0)?;
        Some(ScramVerifier {
            iterations,
            salt: BASE64.decode(salt).ok()?,
            stored_key: BASE64.decode(stored_key).ok()?.try_into().ok()?,
            server_key: BASE64.decode(server_key).ok()?.try_into().ok()?,
        })
    }
}

impl fmt::Display for ScramVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SCRAM-SHA-256${}:{}${}:{}",
            self.iterations,
            BASE64.encode(&self.salt),
            BASE64.encode(self.stored_key),
            BASE64.encode(self.server_key)
        )
    }
}

impl fmt::Debug for ScramVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScramVerifier")
            .field("iterations", &self.iterations)
            .field("salt", &BASE64.encode(&self.salt))
            .finish_non_exhaustive()
    }
}

/// HMAC-SHA-256 over the concatenation of `parts`.
pub(crate) fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC accepts keys of any length");
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

/// Compares two byte strings in time that depends only on their lengths, so that a client
/// cannot learn a secret byte by byte from how long a rejection takes.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // black_box keeps the optimiser from turning the fold into an early-exit loop.
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_parse_classifies_like_postgres() {
        let md5 = postgres_protocol::password::md5(b"pw", "alice");
        assert_eq!(Secret::parse(&md5), Secret::Md5(md5.clone()));
        // Upper-case hex or a wrong length is a clear-text password to PostgreSQL.
        let upper = format!("md5{}", md5[3..].to_uppercase());
        assert_eq!(Secret::parse(&upper), Secret::Plain(upper.clone()));
        assert_eq!(Secret::parse("md5abc"), Secret::Plain("md5abc".into()));

        let scram = postgres_protocol::password::scram_sha_256(b"pw");
        assert!(matches!(Secret::parse(&scram), Secret::Scram(_)));
        // Something that only looks like a SCRAM secret is a password.
        let broken = "SCRAM-SHA-256$4096:c2FsdA==$short:short";
        assert_eq!(Secret::parse(broken), Secret::Plain(broken.into()));
        assert_eq!(Secret::parse("hunter2"), Secret::Plain("hunter2".into()));
    }

    #[test]
    fn verifier_text_round_trips_and_matches_postgres() {
        let text = postgres_protocol::password::scram_sha_256(b"correct horse");
        let parsed = ScramVerifier::parse(&text).expect("postgres_protocol output parses");
        assert_eq!(parsed.iterations, 4096);
        assert_eq!(parsed.salt.len(), 16);
        assert_eq!(parsed.to_string(), text);

        // Deriving with the same salt reproduces PostgreSQL's verifier bit for bit.
        let derived = ScramVerifier::from_password("correct horse", &parsed.salt, 4096);
        assert_eq!(derived, parsed);
        assert_eq!(derived.to_string(), text);
        assert_ne!(
            ScramVerifier::from_password("correct horsE", &parsed.salt, 4096),
            parsed
        );
    }

    /// Produced by PostgreSQL 15.18: `CREATE ROLE alice PASSWORD 'pencil'`.
    pub(crate) const PG15_ALICE_PENCIL: &str = "SCRAM-SHA-256$4096:Hdt68OdUUPJQYbkoBwuxwQ==$\
        HdW7NG5EIFvLRfOYM3IP3etzD0eDaQrE0Ln7bcbGINw=:Zv9bk+XwtCsVgxfrQ7zMcwxLluLMpiouIxjwOyHP/eA=";

    #[test]
    fn verifier_from_postgres_round_trips_and_is_reproduced() {
        let v = ScramVerifier::parse(PG15_ALICE_PENCIL).expect("PostgreSQL's verifier parses");
        assert_eq!(v.iterations, 4096);
        assert_eq!(v.to_string(), PG15_ALICE_PENCIL);
        assert_eq!(ScramVerifier::from_password("pencil", &v.salt, 4096), v);
        assert_eq!(Secret::parse(PG15_ALICE_PENCIL), Secret::Scram(v));
    }

    #[test]
    fn verifier_parse_rejects_malformed() {
        let good = ScramVerifier::generate("pw").to_string();
        assert!(ScramVerifier::parse(&good).is_some());
        for bad in [
            "",
            "SCRAM-SHA-256$",
            &good.replace("SCRAM-SHA-256", "SCRAM-SHA-1"),
            &good.replace("$4096:", "$0:"),
            &good.replace("$4096:", "$-1:"),
            &good.replace("$4096:", "$x:"),
            &good[..good.len() - 4],
            &format!("{good}AAAA"),
        ] {
            assert_eq!(ScramVerifier::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn debug_does_not_leak_secrets() {
        let shown = format!("{:?}", Secret::Plain("hunter2".into()));
        assert!(!shown.contains("hunter2"), "{shown}");
        let v = ScramVerifier::generate("pw");
        let shown = format!("{:?}", Secret::Scram(v.clone()));
        assert!(!shown.contains(&BASE64.encode(v.stored_key)), "{shown}");
    }

    #[test]
    fn constant_time_eq_compares() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(constant_time_eq(b"", b""));
    }
}
