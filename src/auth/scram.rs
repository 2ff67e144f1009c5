//! SCRAM-SHA-256 (RFC 5802, RFC 7677) as PostgreSQL speaks it, both sides.
//!
//! [`ScramServer`] follows PostgreSQL's `auth-scram.c` message for message, including its
//! differences from the RFC: the user name inside the exchange is ignored (the startup
//! packet's is used), channel binding is not offered, and a user without a usable verifier
//! gets a *mock* exchange that fails only at the very end, so that a client cannot probe which
//! roles exist. [`ScramClient`] is the side pgmemo uses to log into PostgreSQL; it wraps
//! `postgres_protocol`'s implementation.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
use sha2::{Digest, Sha256};
use std::sync::OnceLock;

use super::{
    constant_time_eq, hmac_sha256, AuthError, ScramVerifier, Secret, SCRAM_DEFAULT_ITERATIONS,
    SCRAM_DEFAULT_SALT_LEN,
};

/// The SASL mechanism name, as sent in `AuthenticationSASL` and `SASLInitialResponse`.
pub const SCRAM_SHA_256: &str = "SCRAM-SHA-256";

/// Raw bytes of the server's part of the nonce; base64 makes it 24 characters, like
/// PostgreSQL's.
const SERVER_NONCE_LEN: usize = 18;

/// The server side of one SCRAM-SHA-256 exchange with a client.
///
/// The session code sends `AuthenticationSASL` with [`ScramServer::mechanisms`], passes the
/// `SASLInitialResponse` to [`handle_client_first`](ScramServer::handle_client_first) and
/// answers with `AuthenticationSASLContinue`, then passes the `SASLResponse` to
/// [`handle_client_final`](ScramServer::handle_client_final) and answers with
/// `AuthenticationSASLFinal` + `AuthenticationOk`, or with an error. (If a client sends a
/// `SASLInitialResponse` without data, PostgreSQL sends an empty `AuthenticationSASLContinue`
/// and treats the next `SASLResponse` as the client-first-message; do the same.)
///
/// Any error ends the exchange: later calls return a protocol error.
pub struct ScramServer {
    /// The real verifier, or a mock one when `doomed`.
    verifier: ScramVerifier,
    /// The exchange is played to the end but must fail: unknown user, or no SCRAM-capable
    /// secret.
    doomed: bool,
    state: ServerState,
    /// The client's ClientKey, recovered from its proof once the exchange succeeded.
    client_key: Option<[u8; 32]>,
}

enum ServerState {
    AwaitingClientFirst,
    AwaitingClientFinal(Box<FirstExchange>),
    Finished,
}

/// What the final step needs to remember from the first one.
struct FirstExchange {
    /// `n` or `y`; the client-final-message must echo it in `c=`.
    cbind_flag: u8,
    client_first_bare: Vec<u8>,
    /// Client nonce followed by server nonce, as sent in the server-first-message.
    nonce: Vec<u8>,
    server_first: Vec<u8>,
}

impl ScramServer {
    /// After a successful exchange, the keys that let pgmemo log into PostgreSQL as this
    /// user without its password (PgBouncer's SCRAM pass-through): the ClientKey recovered
    /// from the client's proof (ClientProof XOR ClientSignature) and the verifier's ServerKey.
    pub fn keys(&self) -> Option<ScramKeys> {
        Some(ScramKeys {
            client_key: self.client_key?,
            server_key: self.verifier.server_key,
        })
    }

    /// Starts an exchange for `user` (the name from the startup packet).
    ///
    /// `secret` is the user's stored secret, `None` if the user does not exist. A clear-text
    /// password is turned into a verifier with a fresh salt here, which costs one PBKDF2
    /// derivation (4096 HMACs); store [`Secret::Scram`] to avoid it. An md5 secret cannot
    /// serve SCRAM, so that user, like an unknown one, gets a mock exchange.
    pub fn new(user: &str, secret: Option<&Secret>) -> ScramServer {
        let verifier = match secret {
            Some(Secret::Scram(v)) => Some(v.clone()),
            Some(Secret::Plain(password)) => Some(ScramVerifier::generate(password)),
            Some(Secret::Md5(_)) | None => None,
        };
        let doomed = verifier.is_none();
        ScramServer {
            verifier: verifier.unwrap_or_else(|| mock_verifier(user)),
            doomed,
            state: ServerState::AwaitingClientFirst,
            client_key: None,
        }
    }

    /// The SASL mechanisms to offer. Channel binding (`-PLUS`) is not offered: pgmemo
    /// terminates TLS itself, so a binding to its certificate would prove nothing about the
    /// server behind it.
    pub fn mechanisms() -> &'static [&'static str] {
        &[SCRAM_SHA_256]
    }

    /// Handles the `SASLInitialResponse` (chosen `mechanism` and client-first-message) and
    /// returns the server-first-message `r=<nonce>,s=<salt>,i=<iterations>`.
    pub fn handle_client_first(
        &mut self,
        mechanism: &str,
        data: &[u8],
    ) -> Result<Vec<u8>, AuthError> {
        match self.client_first(mechanism, data) {
            Ok(first) => {
                let reply = first.server_first.clone();
                self.state = ServerState::AwaitingClientFinal(first);
                Ok(reply)
            }
            Err(e) => {
                self.state = ServerState::Finished;
                Err(e)
            }
        }
    }

    fn client_first(
        &mut self,
        mechanism: &str,
        data: &[u8],
    ) -> Result<Box<FirstExchange>, AuthError> {
        if !matches!(self.state, ServerState::AwaitingClientFirst) {
            return Err(invalid_state());
        }
        if mechanism != SCRAM_SHA_256 {
            return Err(AuthError::Protocol(
                "client selected an invalid SASL authentication mechanism".into(),
            ));
        }
        check_payload(data)?;
        let mut cur = Cursor::new(data);

        // gs2-cbind-flag: "n" (no channel binding) or "y" (client could bind but thinks we
        // cannot; true, we never offer -PLUS). "p=..." asks for binding we did not offer.
        let cbind_flag = cur.next().unwrap_or(0);
        match cbind_flag {
            b'n' | b'y' => {
                let c = cur.next();
                if c != Some(b',') {
                    return Err(malformed(format_args!(
                        "Comma expected, but found character {}.",
                        sanitize(c)
                    )));
                }
            }
            b'p' => {
                return Err(malformed(
                    "The client selected SCRAM-SHA-256 without channel binding, \
                     but the SCRAM message includes channel binding data.",
                ))
            }
            other => {
                return Err(malformed(format_args!(
                    "Unexpected channel-binding flag {}.",
                    sanitize(Some(other))
                )))
            }
        }
        match cur.next() {
            Some(b',') => {}
            Some(b'a') => {
                return Err(AuthError::Protocol(
                    "client uses authorization identity, but it is not supported".into(),
                ))
            }
            c => {
                return Err(malformed(format_args!(
                    "Unexpected attribute {} in client-first-message.",
                    sanitize(c)
                )))
            }
        }

        let client_first_bare = cur.rest().to_vec();
        if cur.peek() == Some(b'm') {
            return Err(AuthError::Protocol(
                "client requires an unsupported SCRAM extension".into(),
            ));
        }
        // The user name is ignored, as in PostgreSQL: libpq sends "n=" and the startup
        // packet's user is authoritative.
        cur.read_attr_value(b'n')?;
        let client_nonce = cur.read_attr_value(b'r')?;
        if !client_nonce.iter().all(|&b| is_printable(b)) {
            return Err(AuthError::Protocol(
                "non-printable characters in SCRAM nonce".into(),
            ));
        }
        // Optional extensions: we support none, so only check their syntax.
        while !cur.is_empty() {
            cur.read_any_attr()?;
        }

        let server_nonce: [u8; SERVER_NONCE_LEN] = rand::random();
        let mut nonce = client_nonce.to_vec();
        nonce.extend_from_slice(BASE64.encode(server_nonce).as_bytes());
        let mut server_first = b"r=".to_vec();
        server_first.extend_from_slice(&nonce);
        server_first.extend_from_slice(
            format!(
                ",s={},i={}",
                BASE64.encode(&self.verifier.salt),
                self.verifier.iterations
            )
            .as_bytes(),
        );
        Ok(Box::new(FirstExchange {
            cbind_flag,
            client_first_bare,
            nonce,
            server_first,
        }))
    }

    /// Handles the `SASLResponse` carrying the client-final-message. On success returns the
    /// server-final-message `v=<ServerSignature>` for `AuthenticationSASLFinal`.
    ///
    /// A proof that does not verify, and every mock exchange, ends in
    /// [`AuthError::WrongPassword`], after the same amount of work either way.
    pub fn handle_client_final(&mut self, data: &[u8]) -> Result<Vec<u8>, AuthError> {
        let first = match std::mem::replace(&mut self.state, ServerState::Finished) {
            ServerState::AwaitingClientFinal(first) => first,
            _ => return Err(invalid_state()),
        };
        check_payload(data)?;
        let mut cur = Cursor::new(data);

        // Without channel binding the c= attribute is just the base64 gs2 header, which must
        // repeat the flag from the first message.
        let cbind = cur.read_attr_value(b'c')?;
        let expected_cbind: &[u8] = if first.cbind_flag == b'n' {
            b"biws" // "n,,"
        } else {
            b"eSws" // "y,,"
        };
        if cbind != expected_cbind {
            return Err(AuthError::Protocol(
                "unexpected SCRAM channel-binding attribute in client-final-message".into(),
            ));
        }
        let nonce = cur.read_attr_value(b'r')?;

        // Skip extensions up to the proof; everything before the comma that precedes "p=" is
        // the client-final-message-without-proof that the signatures cover.
        let (proof_start, proof) = loop {
            let start = cur.offset();
            let (attr, value) = cur.read_any_attr()?;
            if attr == b'p' {
                break (start, value);
            }
        };
        let proof: [u8; 32] = BASE64
            .decode(proof)
            .ok()
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| malformed("Malformed proof in client-final-message."))?;
        if !cur.is_empty() {
            return Err(malformed(
                "Garbage found at the end of client-final-message.",
            ));
        }
        let without_proof = &data[..proof_start - 1];

        if !constant_time_eq(nonce, &first.nonce) {
            return Err(AuthError::Protocol("invalid SCRAM response".into()));
        }

        // ClientKey = ClientProof XOR HMAC(StoredKey, AuthMessage); it is right iff its hash
        // is StoredKey. Computed even for a doomed exchange so that timing reveals nothing.
        let auth_message: [&[u8]; 5] = [
            &first.client_first_bare,
            b",",
            &first.server_first,
            b",",
            without_proof,
        ];
        let client_signature = hmac_sha256(&self.verifier.stored_key, &auth_message);
        let mut client_key = proof;
        for (k, s) in client_key.iter_mut().zip(client_signature) {
            *k ^= s;
        }
        let stored_key = Sha256::digest(client_key);
        let verified = constant_time_eq(&stored_key, &self.verifier.stored_key);
        if !verified || self.doomed {
            return Err(AuthError::WrongPassword);
        }

        self.client_key = Some(client_key);
        let server_signature = hmac_sha256(&self.verifier.server_key, &auth_message);
        Ok(format!("v={}", BASE64.encode(server_signature)).into_bytes())
    }
}

/// A verifier for a user who cannot log in, shaped like a real default one. The salt is
/// derived from the user name and a per-process secret (PostgreSQL's `scram_mock_salt`), so
/// that asking twice for the same unknown user gives the same salt, as a real user would.
fn mock_verifier(user: &str) -> ScramVerifier {
    static MOCK_KEY: OnceLock<[u8; 32]> = OnceLock::new();
    let key = MOCK_KEY.get_or_init(rand::random);
    let digest = Sha256::new()
        .chain_update(user.as_bytes())
        .chain_update(key)
        .finalize();
    ScramVerifier {
        iterations: SCRAM_DEFAULT_ITERATIONS,
        salt: digest[..SCRAM_DEFAULT_SALT_LEN].to_vec(),
        stored_key: [0; 32],
        server_key: [0; 32],
    }
}

/// PostgreSQL rejects empty payloads and payloads with an embedded NUL (its C strings would
/// disagree with the message length).
fn check_payload(data: &[u8]) -> Result<(), AuthError> {
    if data.is_empty() {
        Err(malformed("The message is empty."))
    } else if data.contains(&0) {
        Err(malformed("Message length does not match input length."))
    } else {
        Ok(())
    }
}

/// PostgreSQL's "malformed SCRAM message"; the detail goes to the log only, as it would be
/// an errdetail there.
fn malformed(detail: impl std::fmt::Display) -> AuthError {
    tracing::debug!("malformed SCRAM message: {detail}");
    AuthError::Protocol("malformed SCRAM message".into())
}

fn invalid_state() -> AuthError {
    AuthError::Protocol("invalid SCRAM exchange state".into())
}

/// RFC 5802 `printable`: ASCII 0x21..=0x7e except ','.
fn is_printable(b: u8) -> bool {
    matches!(b, 0x21..=0x2b | 0x2d..=0x7e)
}

/// A byte from the client, safe to put in a log line.
fn sanitize(c: Option<u8>) -> String {
    match c {
        Some(c @ 0x21..=0x7e) => format!("\"{}\"", char::from(c)),
        Some(c) => format!("0x{c:02x}"),
        None => "end of message".into(),
    }
}

/// Reads `attr=value` fields separated by commas, as PostgreSQL's `read_attr_value` and
/// `read_any_attr` do.
struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(data: &'a [u8]) -> Self {
        Cursor { data, pos: 0 }
    }

    fn peek(&self) -> Option<u8> {
        self.data.get(self.pos).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek();
        self.pos += usize::from(c.is_some());
        c
    }

    fn rest(&self) -> &'a [u8] {
        &self.data[self.pos..]
    }

    fn offset(&self) -> usize {
        self.pos
    }

    fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    /// The value up to the next comma (which is consumed) or the end.
    fn value(&mut self) -> &'a [u8] {
        let rest = self.rest();
        let len = rest.iter().position(|&b| b == b',').unwrap_or(rest.len());
        self.pos += (len + 1).min(rest.len());
        &rest[..len]
    }

    fn expect_equals(&mut self, attr: u8) -> Result<(), AuthError> {
        if self.next() == Some(b'=') {
            Ok(())
        } else {
            Err(malformed(format_args!(
                "Expected character \"=\" for attribute {}.",
                sanitize(Some(attr))
            )))
        }
    }

    fn read_attr_value(&mut self, attr: u8) -> Result<&'a [u8], AuthError> {
        let found = self.next();
        if found != Some(attr) {
            return Err(malformed(format_args!(
                "Expected attribute {} but found {}.",
                sanitize(Some(attr)),
                sanitize(found)
            )));
        }
        self.expect_equals(attr)?;
        Ok(self.value())
    }

    fn read_any_attr(&mut self) -> Result<(u8, &'a [u8]), AuthError> {
        let attr = match self.next() {
            Some(a) if a.is_ascii_alphabetic() => a,
            None => return Err(malformed("Attribute expected, but found end of string.")),
            found => {
                return Err(malformed(format_args!(
                    "Attribute expected, but found invalid character {}.",
                    sanitize(found)
                )))
            }
        };
        self.expect_equals(attr)?;
        Ok((attr, self.value()))
    }
}

/// The client side of SCRAM-SHA-256, for pgmemo logging into PostgreSQL.
///
/// Send [`client_first`](ScramClient::client_first) in a `SASLInitialResponse` with mechanism
/// [`SCRAM_SHA_256`], pass the `AuthenticationSASLContinue` data to
/// [`handle_server_first`](ScramClient::handle_server_first) and send its result in a
/// `SASLResponse`, then pass the `AuthenticationSASLFinal` data to
/// [`handle_server_final`](ScramClient::handle_server_final): only when that succeeds has the
/// server proven that it knows the password. Channel binding is not used.
pub struct ScramClient {
    inner: ClientInner,
    /// Kept apart because the inner state machine only hands out its current message.
    client_first: Vec<u8>,
}

enum ClientInner {
    /// With the clear-text password (postgres_protocol's state machine).
    Password(ScramSha256),
    /// With a client's keys (pass-through): the proof is made from the ClientKey, and the
    /// server's signature checked with the ServerKey.
    Keys {
        keys: ScramKeys,
        /// The AuthMessage, once the server-first-message came.
        auth_message: Option<Vec<u8>>,
    },
}

/// What logs into PostgreSQL as a user whose password pgmemo never saw: the ClientKey
/// recovered from that user's proof and the ServerKey of its verifier (PgBouncer's
/// `scram_client_key` / `scram_server_key`).
#[derive(Clone, PartialEq, Eq)]
pub struct ScramKeys {
    pub client_key: [u8; 32],
    pub server_key: [u8; 32],
}

impl std::fmt::Debug for ScramKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScramKeys(<redacted>)")
    }
}

impl ScramClient {
    /// Starts an exchange with the user's clear-text password.
    pub fn new(password: &[u8]) -> ScramClient {
        let inner = ScramSha256::new(password, ChannelBinding::unsupported());
        let client_first = inner.message().to_vec();
        ScramClient {
            inner: ClientInner::Password(inner),
            client_first,
        }
    }

    /// Starts an exchange with a client's keys instead of a password (SCRAM pass-through).
    pub fn with_keys(keys: ScramKeys) -> ScramClient {
        let nonce: [u8; 18] = rand::random();
        let client_first = format!("n,,n=,r={}", BASE64.encode(nonce)).into_bytes();
        ScramClient {
            inner: ClientInner::Keys {
                keys,
                auth_message: None,
            },
            client_first,
        }
    }

    /// The client-first-message (`n,,n=,r=<nonce>`).
    pub fn client_first(&self) -> &[u8] {
        &self.client_first
    }

    /// Handles the server-first-message and returns the client-final-message with the proof.
    pub fn handle_server_first(&mut self, data: &[u8]) -> Result<Vec<u8>, AuthError> {
        let bad = |e: &dyn std::fmt::Display| {
            AuthError::Protocol(format!("invalid SCRAM server-first-message: {e}"))
        };
        let first_bare = self.client_first[3..].to_vec();
        match &mut self.inner {
            ClientInner::Password(inner) => {
                inner.update(data).map_err(|e| bad(&e))?;
                Ok(inner.message().to_vec())
            }
            ClientInner::Keys { keys, auth_message } => {
                let text = std::str::from_utf8(data).map_err(|e| bad(&e))?;
                let nonce = text
                    .split(',')
                    .find_map(|a| a.strip_prefix("r="))
                    .ok_or_else(|| bad(&"no nonce"))?;
                let ours = &first_bare[first_bare.len().min(5)..]; // after "n=,r="
                if !nonce.as_bytes().starts_with(ours) || nonce.len() <= ours.len() {
                    return Err(bad(&"the nonce does not extend ours"));
                }
                let without_proof = format!("c=biws,r={nonce}");
                let message =
                    [&first_bare[..], b",", data, b",", without_proof.as_bytes()].concat();
                let stored_key = Sha256::digest(keys.client_key);
                let signature = hmac_sha256(&stored_key, &[&message]);
                let mut proof = keys.client_key;
                for (p, s) in proof.iter_mut().zip(signature) {
                    *p ^= s;
                }
                *auth_message = Some(message);
                Ok(format!("{without_proof},p={}", BASE64.encode(proof)).into_bytes())
            }
        }
    }

    /// Checks the server-final-message: the server's signature proves it knows the verifier.
    pub fn handle_server_final(&mut self, data: &[u8]) -> Result<(), AuthError> {
        if data == b"e=invalid-proof" {
            return Err(AuthError::WrongPassword);
        }
        let bad = |e: &dyn std::fmt::Display| {
            AuthError::Protocol(format!("invalid SCRAM server-final-message: {e}"))
        };
        match &mut self.inner {
            ClientInner::Password(inner) => inner.finish(data).map_err(|e| bad(&e)),
            ClientInner::Keys { keys, auth_message } => {
                let message = auth_message.as_ref().ok_or_else(|| bad(&"out of order"))?;
                let expected = hmac_sha256(&keys.server_key, &[message]);
                let got = std::str::from_utf8(data)
                    .ok()
                    .and_then(|t| t.strip_prefix("v="))
                    .and_then(|v| BASE64.decode(v).ok())
                    .ok_or_else(|| bad(&"no verifier"))?;
                if constant_time_eq(&got, &expected) {
                    Ok(())
                } else {
                    Err(bad(&"the server's signature does not match"))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a whole exchange: `Ok` only if the server accepted the client's proof and the
    /// client then accepted the server's signature.
    fn exchange(user: &str, secret: Option<&Secret>, password: &str) -> Result<(), AuthError> {
        let mut server = ScramServer::new(user, secret);
        let mut client = ScramClient::new(password.as_bytes());
        let server_first = server.handle_client_first(SCRAM_SHA_256, client.client_first())?;
        let client_final = client.handle_server_first(&server_first)?;
        let server_final = server.handle_client_final(&client_final)?;
        client.handle_server_final(&server_final)
    }

    /// Runs a whole exchange with `client`; the server's keys on success.
    fn run(server: &mut ScramServer, client: &mut ScramClient) -> Result<(), AuthError> {
        let server_first = server.handle_client_first(SCRAM_SHA_256, client.client_first())?;
        let client_final = client.handle_server_first(&server_first)?;
        let server_final = server.handle_client_final(&client_final)?;
        client.handle_server_final(&server_final)
    }

    #[test]
    fn keys_recovered_from_a_proof_log_in_again() {
        let verifier = ScramVerifier::generate("pencil");
        let secret = Secret::Scram(verifier.clone());
        let mut server = ScramServer::new("alice", Some(&secret));
        run(&mut server, &mut ScramClient::new(b"pencil")).unwrap();
        let keys = server.keys().expect("keys after success");
        // A second server holding the same verifier accepts the keys' proof, and the client
        // accepts its signature.
        let mut again = ScramServer::new("alice", Some(&secret));
        run(&mut again, &mut ScramClient::with_keys(keys.clone())).unwrap();
        // Keys of another password fail, as a wrong password does.
        let mut other = ScramServer::new("alice", Some(&secret));
        let mut wrong = keys;
        wrong.client_key[0] ^= 1;
        assert_eq!(
            run(&mut other, &mut ScramClient::with_keys(wrong)),
            Err(AuthError::WrongPassword)
        );
        let mut failed = ScramServer::new("alice", Some(&secret));
        assert!(run(&mut failed, &mut ScramClient::new(b"nope")).is_err());
        assert!(failed.keys().is_none());
    }

    #[test]
    fn round_trip_with_plain_secret() {
        let secret = Secret::Plain("pencil".into());
        exchange("alice", Some(&secret), "pencil").expect("login succeeds");
    }

    #[test]
    fn round_trip_with_postgres_verifier() {
        let secret = Secret::parse(crate::auth::tests::PG15_ALICE_PENCIL);
        assert!(matches!(secret, Secret::Scram(_)));
        exchange("alice", Some(&secret), "pencil").expect("login succeeds");
    }

    #[test]
    fn round_trip_with_non_ascii_plain_password() {
        // SASLprep is applied on both sides by postgres_protocol; a non-breaking space maps
        // to a space, so either spelling logs in.
        let secret = Secret::Plain("pen\u{a0}cil".into());
        exchange("alice", Some(&secret), "pen\u{a0}cil").expect("same password");
        exchange("alice", Some(&secret), "pen cil").expect("SASLprep-equivalent password");
    }

    #[test]
    fn wrong_password_is_rejected() {
        let plain = Secret::Plain("pencil".into());
        let scram = Secret::parse(crate::auth::tests::PG15_ALICE_PENCIL);
        for secret in [&plain, &scram] {
            assert_eq!(
                exchange("alice", Some(secret), "pencil!"),
                Err(AuthError::WrongPassword)
            );
        }
    }

    #[test]
    fn unknown_and_md5_users_fail_like_a_wrong_password() {
        let md5 = Secret::parse(&postgres_protocol::password::md5(b"pencil", "bob"));
        assert!(matches!(md5, Secret::Md5(_)));
        assert_eq!(
            exchange("nobody", None, "pencil"),
            Err(AuthError::WrongPassword)
        );
        assert_eq!(
            exchange("bob", Some(&md5), "pencil"),
            Err(AuthError::WrongPassword)
        );
    }

    /// Splits `r=...,s=...,i=...` into its values.
    fn server_first_fields(msg: &[u8]) -> (String, String, String) {
        let text = std::str::from_utf8(msg).unwrap();
        let fields: Vec<&str> = text.split(',').collect();
        assert_eq!(fields.len(), 3, "{text}");
        let value = |i: usize, key: &str| fields[i].strip_prefix(key).unwrap().to_owned();
        (value(0, "r="), value(1, "s="), value(2, "i="))
    }

    #[test]
    fn mock_exchange_looks_like_a_real_one() {
        let client = ScramClient::new(b"pencil");
        let real = Secret::Plain("pencil".into());
        let real_first = ScramServer::new("alice", Some(&real))
            .handle_client_first(SCRAM_SHA_256, client.client_first())
            .unwrap();
        let mock_first = ScramServer::new("nobody", None)
            .handle_client_first(SCRAM_SHA_256, client.client_first())
            .unwrap();
        let (real_nonce, real_salt, real_iter) = server_first_fields(&real_first);
        let (mock_nonce, mock_salt, mock_iter) = server_first_fields(&mock_first);
        assert_eq!(real_nonce.len(), mock_nonce.len());
        assert_eq!(real_salt.len(), mock_salt.len());
        assert_eq!(BASE64.decode(&mock_salt).unwrap().len(), 16);
        assert_eq!(real_iter, mock_iter);
        assert_ne!(real_nonce, mock_nonce, "server nonces are random");

        // The mock salt is stable per user name, and differs between names.
        let again = ScramServer::new("nobody", None)
            .handle_client_first(SCRAM_SHA_256, client.client_first())
            .unwrap();
        assert_eq!(server_first_fields(&again).1, mock_salt);
        let other = ScramServer::new("nobody2", None)
            .handle_client_first(SCRAM_SHA_256, client.client_first())
            .unwrap();
        assert_ne!(server_first_fields(&other).1, mock_salt);
    }

    #[test]
    fn rfc7677_test_vector() {
        // RFC 7677 §3, with the server nonce forced to the RFC's.
        let client_first = b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO";
        let server_first = "r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,\
                            s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096";
        let client_final = "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,\
                            p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=";
        let salt = BASE64.decode("W22ZaJ0SNY7soEsUEjb6gQ==").unwrap();
        let secret = Secret::Scram(ScramVerifier::from_password("pencil", &salt, 4096));
        let mut server = ScramServer::new("user", Some(&secret));
        server
            .handle_client_first(SCRAM_SHA_256, client_first)
            .unwrap();
        if let ServerState::AwaitingClientFinal(first) = &mut server.state {
            first.nonce = server_first[2..server_first.find(',').unwrap()].into();
            first.server_first = server_first.into();
        }
        assert_eq!(
            server.handle_client_final(client_final.as_bytes()).unwrap(),
            b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
        );
    }

    #[test]
    fn gs2_flags() {
        let secret = Secret::Plain("pencil".into());
        let mut server = ScramServer::new("alice", Some(&secret));
        assert!(server
            .handle_client_first(SCRAM_SHA_256, b"y,,n=,r=abc")
            .is_ok());
        let mut server = ScramServer::new("alice", Some(&secret));
        let err = server
            .handle_client_first(SCRAM_SHA_256, b"p=tls-server-end-point,,n=,r=abc")
            .unwrap_err();
        assert_eq!(err, AuthError::Protocol("malformed SCRAM message".into()));
        let mut server = ScramServer::new("alice", Some(&secret));
        let err = server
            .handle_client_first(SCRAM_SHA_256, b"n,a=bob,n=,r=abc")
            .unwrap_err();
        assert!(matches!(err, AuthError::Protocol(m) if m.contains("authorization identity")));
        let mut server = ScramServer::new("alice", Some(&secret));
        let err = server
            .handle_client_first("SCRAM-SHA-256-PLUS", b"n,,n=,r=abc")
            .unwrap_err();
        assert!(matches!(err, AuthError::Protocol(m) if m.contains("invalid SASL")));
    }

    /// Runs the first step with a real client and returns the server and the client-final.
    fn halfway(flag: &str) -> (ScramServer, String) {
        let secret = Secret::Plain("pencil".into());
        let mut server = ScramServer::new("alice", Some(&secret));
        let mut client = ScramClient::new(b"pencil");
        let first = std::str::from_utf8(client.client_first()).unwrap();
        let first = first.replacen("n,,", flag, 1);
        let server_first = server
            .handle_client_first(SCRAM_SHA_256, first.as_bytes())
            .unwrap();
        let client_final = client.handle_server_first(&server_first).unwrap();
        (server, String::from_utf8(client_final).unwrap())
    }

    #[test]
    fn client_final_must_echo_binding_and_nonce() {
        // The client said "y,," first but its final message says "n,,".
        let (mut server, fin) = halfway("y,,");
        assert!(matches!(
            server.handle_client_final(fin.as_bytes()),
            Err(AuthError::Protocol(m)) if m.contains("channel-binding")
        ));

        let (mut server, fin) = halfway("n,,");
        let tampered = fin.replacen(",r=", ",r=X", 1);
        assert_eq!(
            server.handle_client_final(tampered.as_bytes()),
            Err(AuthError::Protocol("invalid SCRAM response".into()))
        );

        // Extensions before the proof are skipped, but they are covered by the signature, so
        // inserting one invalidates the proof.
        let (mut server, fin) = halfway("n,,");
        let with_ext = fin.replacen(",p=", ",x=ext,p=", 1);
        assert_eq!(
            server.handle_client_final(with_ext.as_bytes()),
            Err(AuthError::WrongPassword)
        );

        // A finished exchange cannot be continued.
        let (mut server, fin) = halfway("n,,");
        assert!(server.handle_client_final(fin.as_bytes()).is_ok());
        assert!(matches!(
            server.handle_client_final(fin.as_bytes()),
            Err(AuthError::Protocol(_))
        ));
    }

    #[test]
    fn malformed_client_messages_are_protocol_errors() {
        let secret = Secret::Plain("pencil".into());
        for bad in [
            &b""[..],
            b"n",
            b"n,",
            b"n,,",
            b"x,,n=,r=abc",
            b"n;,n=,r=abc",
            b"n,,m=ext,n=,r=abc",
            b"n,,r=abc",
            b"n,,n=,r=a\x01bc",
            b"n,,n=,r=abc,1=x",
            b"n,,n=,r=abc,x",
            b"n,,n=,r=a\0bc",
        ] {
            let mut server = ScramServer::new("alice", Some(&secret));
            assert!(
                matches!(
                    server.handle_client_first(SCRAM_SHA_256, bad),
                    Err(AuthError::Protocol(_))
                ),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
            // And the exchange is over.
            assert!(server.handle_client_final(b"c=biws").is_err());
        }

        let (_, fin) = halfway("n,,");
        let proof_at = fin.find(",p=").unwrap();
        for bad in [
            String::new(),
            "c=biws".into(),
            fin[..proof_at].into(),
            format!("{},p=", &fin[..proof_at]),
            format!("{},p=AAAA", &fin[..proof_at]),
            format!("{fin},x=y"),
            format!("{fin}garbage"),
            fin.replacen("c=", "c", 1),
            fin.replacen("c=", "x=", 1),
        ] {
            let (mut server, _) = halfway("n,,");
            assert!(
                matches!(
                    server.handle_client_final(bad.as_bytes()),
                    Err(AuthError::Protocol(_))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn no_input_panics() {
        // Every prefix of valid messages, and some byte noise, on both sides.
        let (_, fin) = halfway("n,,");
        let first = b"n,,n=,r=rOprNGfwEbeRWgbNEkqO".to_vec();
        let mut noise = vec![0u8, 1, b',', b'=', 0xff, b'p', b'r', b'c'];
        noise.extend_from_slice(b"=,p=,r=,c=biws,,==");
        let secret = Secret::Plain("pencil".into());
        for i in 0..=first.len() {
            let mut server = ScramServer::new("alice", Some(&secret));
            let _ = server.handle_client_first(SCRAM_SHA_256, &first[..i]);
        }
        for i in 0..=fin.len() {
            let (mut server, _) = halfway("n,,");
            let _ = server.handle_client_final(&fin.as_bytes()[..i]);
        }
        for i in 0..noise.len() {
            for j in i..=noise.len() {
                let mut server = ScramServer::new("nobody", None);
                let _ = server.handle_client_first(SCRAM_SHA_256, &noise[i..j]);
                let _ = server.handle_client_final(&noise[i..j]);
            }
        }

        let server_first = b"r=NONCE,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096";
        for i in 0..=server_first.len() {
            let mut client = ScramClient::new(b"pencil");
            let _ = client.handle_server_first(&server_first[..i]);
            let _ = client.handle_server_final(&server_first[..i]);
            assert!(!client.client_first().is_empty());
        }
        for i in 0..noise.len() {
            let mut client = ScramClient::new(b"pencil");
            let _ = client.handle_server_first(&noise[i..]);
            let _ = client.handle_server_final(&noise[i..]);
        }
    }

    #[test]
    fn client_detects_a_server_without_the_password() {
        // A server that does not know the real verifier cannot produce a valid signature.
        let mut server = ScramServer::new("alice", Some(&Secret::Plain("pencil".into())));
        let mut client = ScramClient::new(b"pencil");
        let server_first = server
            .handle_client_first(SCRAM_SHA_256, client.client_first())
            .unwrap();
        client.handle_server_first(&server_first).unwrap();
        let forged = format!("v={}", BASE64.encode([7u8; 32]));
        assert!(matches!(
            client.handle_server_final(forged.as_bytes()),
            Err(AuthError::Protocol(_))
        ));

        let mut client = ScramClient::new(b"pencil");
        client.handle_server_first(&server_first).unwrap_err(); // nonce belongs to another client
        let mut client = ScramClient::new(b"pencil");
        let mut server = ScramServer::new("alice", Some(&Secret::Plain("pencil".into())));
        let server_first = server
            .handle_client_first(SCRAM_SHA_256, client.client_first())
            .unwrap();
        client.handle_server_first(&server_first).unwrap();
        assert_eq!(
            client.handle_server_final(b"e=invalid-proof"),
            Err(AuthError::WrongPassword)
        );
    }
}
