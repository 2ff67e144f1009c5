//! PostgreSQL's md5 password challenge, both sides.
//!
//! The server sends a random 4-byte salt; the client answers
//! `"md5" + hex(md5(hex(md5(password + user)) + salt))`. The inner hash is exactly what
//! `pg_authid` stores for md5 users, so the server can check the answer from either the
//! clear-text password or the stored hash.

use ::md5::{Digest, Md5};

use super::{constant_time_eq, Secret};

/// A fresh random salt for an `AuthenticationMD5Password` challenge.
pub fn md5_salt() -> [u8; 4] {
    rand::random()
}

/// Checks a client's `PasswordMessage` payload against the challenge `salt`.
///
/// `response` may carry the message's terminating NUL. Works for [`Secret::Plain`] and
/// [`Secret::Md5`]; a SCRAM verifier cannot answer an md5 challenge, and an unknown user
/// (`None`) never matches.
pub fn md5_verify(user: &str, secret: Option<&Secret>, salt: [u8; 4], response: &[u8]) -> bool {
    let response = response.strip_suffix(b"\0").unwrap_or(response);
    let expected = match secret {
        Some(Secret::Plain(password)) => md5_client_response(user, password, salt),
        Some(Secret::Md5(stored)) => salted_response(&stored.as_bytes()[3..], salt),
        Some(Secret::Scram(_)) | None => return false,
    };
    constant_time_eq(expected.as_bytes(), response)
}

/// The client's answer to an md5 challenge, for pgmemo logging into PostgreSQL.
pub fn md5_client_response(user: &str, password: &str, salt: [u8; 4]) -> String {
    postgres_protocol::authentication::md5_hash(user.as_bytes(), password.as_bytes(), salt)
}

/// [`md5_client_response`], or when `password` is itself an md5 hash (`pg_authid`'s md5
/// secret) the answer made from that hash: what lets pgmemo log into PostgreSQL as a user
/// whose stored secret is all it knows.
pub fn md5_response_for(user: &str, password: &str, salt: [u8; 4]) -> String {
    match Secret::parse(password) {
        Secret::Md5(stored) => salted_response(&stored.as_bytes()[3..], salt),
        _ => md5_client_response(user, password, salt),
    }
}

/// The outer step: `"md5" + hex(md5(inner_hex + salt))`.
fn salted_response(inner_hex: &[u8], salt: [u8; 4]) -> String {
    let digest = Md5::new()
        .chain_update(inner_hex)
        .chain_update(salt)
        .finalize();
    let mut out = String::with_capacity(35);
    out.push_str("md5");
    for byte in digest {
        out.push(char::from(HEX[usize::from(byte >> 4)]));
        out.push(char::from(HEX[usize::from(byte & 0xf)]));
    }
    out
}

const HEX: &[u8; 16] = b"0123456789abcdef";

#[cfg(test)]
mod tests {
    use super::*;

    /// Produced by PostgreSQL 15.18: `SET password_encryption = 'md5';
    /// CREATE ROLE bob PASSWORD 'pencil'`.
    const PG15_BOB_PENCIL: &str = "md5e4f70fb0b8f2745aa7a69557c80cbd0c";

    #[test]
    fn stored_hash_matches_postgres() {
        assert_eq!(
            postgres_protocol::password::md5(b"pencil", "bob"),
            PG15_BOB_PENCIL
        );
    }

    #[test]
    fn verify_plain_and_md5_secrets() {
        let salt = [0x2a, 0x3d, 0x8f, 0xe0];
        let answer = md5_client_response("bob", "pencil", salt);
        let with_nul = format!("{answer}\0");
        let plain = Secret::Plain("pencil".into());
        let hashed = Secret::parse(PG15_BOB_PENCIL);
        assert!(matches!(hashed, Secret::Md5(_)));

        for secret in [&plain, &hashed] {
            assert!(md5_verify("bob", Some(secret), salt, answer.as_bytes()));
            assert!(md5_verify("bob", Some(secret), salt, with_nul.as_bytes()));
            // Wrong password, wrong salt, garbage.
            let wrong = md5_client_response("bob", "pencil2", salt);
            assert!(!md5_verify("bob", Some(secret), salt, wrong.as_bytes()));
            assert!(!md5_verify("bob", Some(secret), [0; 4], answer.as_bytes()));
            assert!(!md5_verify("bob", Some(secret), salt, b""));
            assert!(!md5_verify("bob", Some(secret), salt, b"md5"));
            assert!(!md5_verify(
                "bob",
                Some(secret),
                salt,
                &answer.as_bytes()[..34]
            ));
        }
    }

    #[test]
    fn plain_secret_is_salted_with_the_user_name() {
        // The stored md5 hash already contains the user it was made for; a clear-text
        // password gets the user name from the login.
        let salt = md5_salt();
        let answer = md5_client_response("bob", "pencil", salt);
        let plain = Secret::Plain("pencil".into());
        assert!(!md5_verify("alice", Some(&plain), salt, answer.as_bytes()));
    }

    #[test]
    fn verify_rejects_unknown_user_and_scram_secret() {
        let salt = md5_salt();
        let answer = md5_client_response("bob", "pencil", salt);
        assert!(!md5_verify("bob", None, salt, answer.as_bytes()));
        let scram = Secret::Scram(crate::auth::ScramVerifier::generate("pencil"));
        assert!(!md5_verify("bob", Some(&scram), salt, answer.as_bytes()));
    }

    #[test]
    fn client_response_matches_known_value() {
        // The value postgres-protocol's own test checks against libpq.
        assert_eq!(
            md5_client_response("md5_user", "password", [0x2a, 0x3d, 0x8f, 0xe0]),
            "md562af4dd09bbb41884907a838a3233294"
        );
    }

    #[test]
    fn salts_differ() {
        // Four random bytes colliding eight times in a row would mean a broken generator.
        let first = md5_salt();
        assert!((0..8).any(|_| md5_salt() != first));
    }
}
