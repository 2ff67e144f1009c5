//! Authentication on both sides of pgmemo, and TLS on both sides.
//!
//! Clients → pgmemo: SCRAM-SHA-256 and md5 with users whose secret is a plain password, an md5
//! hash or a SCRAM verifier; a wrong password gets 28P01 after the full exchange, the same
//! whether or not the user exists. pgmemo → PostgreSQL: SCRAM, md5, cleartext and trust, and
//! logging in as the client with the client's password. TLS: clients with `sslmode=require`
//! and with full verification against a certificate made by the test, `client_tls = require`
//! refusing plain text, and `server_tls = require | verify-full` towards a PostgreSQL with
//! `ssl = on`.

mod common;

use common::*;
use pgmemo::config::{
    AuthType, ClientTlsMode, Config, DatabaseConfig, PoolMode, ServerTlsMode, Upstream, UserConfig,
};
use pgmemo::demo::{LocalPostgres, LocalPostgresOptions};
use pgmemo::Pgmemo;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use tokio_postgres_rustls::MakeRustlsConnect;

// ---------------------------------------------------------------------------------------------
// Users
// ---------------------------------------------------------------------------------------------

/// Secret: the password itself.
const ALICE: (&str, &str) = ("alice", "alice_pw");
/// Secret: md5 hash.
const BOB: (&str, &str) = ("bob", "bob_pw");
/// Secret: SCRAM verifier.
const CAROL: (&str, &str) = ("carol", "carol_pw");

fn md5_secret(user: &str, password: &str) -> String {
    use md5::{Digest, Md5};
    let digest = Md5::digest(format!("{password}{user}").as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("md5{hex}")
}

fn scram_secret(password: &str) -> String {
    postgres_protocol::password::scram_sha_256(password.as_bytes())
}

fn user(secret: String) -> UserConfig {
    UserConfig {
        password: Some(secret),
        ..UserConfig::default()
    }
}

/// pgmemo in front of the test cluster with the users above; an md5
/// hash cannot answer SCRAM, so bob exists only when clients authenticate with md5.
fn auth_config(auth: AuthType) -> Config {
    let mut config = test_config(PoolMode::Transaction, 2);
    // Its users are no PostgreSQL roles: they log into the server as the fixed role pgmemo.
    log_in_as_pgmemo(&mut config);
    config.general.auth_type = auth;
    config.general.admin_users = vec![];
    config.users = BTreeMap::from([
        (ALICE.0.to_string(), user(ALICE.1.to_string())),
        (CAROL.0.to_string(), user(scram_secret(CAROL.1))),
    ]);
    if auth == AuthType::Md5 {
        config
            .users
            .insert(BOB.0.to_string(), user(md5_secret(BOB.0, BOB.1)));
    }
    config
}

/// The authentication request codes of a login (10 SASL, 11 continue, 12 final, 5 md5, 0 ok).
fn auth_codes(login: &Login) -> Vec<i32> {
    login
        .messages
        .iter()
        .filter(|m| m.tag == b'R')
        .map(|m| i32::from_be_bytes(m.body[..4].try_into().unwrap()))
        .collect()
}

async fn try_login(addr: SocketAddr, user: &str, password: &str) -> Login {
    let packet = startup_packet(
        protocol_version(3, 0),
        &[("user", user), ("database", TEST_DB)],
    );
    RawClient::login(addr, &packet, user, Some(password))
        .await
        .unwrap_or_else(|e| panic!("login attempt as {user}: {e:#}"))
}

/// Runs `sql` on a logged-in client and returns the first column of the first row.
async fn scalar(client: &mut RawClient, sql: &str) -> String {
    client.send(&[Frontend::query(sql)]).await.unwrap();
    let replies = client.recv_until_ready(1).await.unwrap();
    if let Some(e) = replies.iter().find(|m| m.is_error()) {
        panic!("{sql}: {e}");
    }
    let row = replies.iter().find_map(|m| m.data_row()).expect("a row");
    String::from_utf8(row[0].clone().expect("not null")).unwrap()
}

#[tokio::test]
async fn clients_authenticate_with_scram() {
    let proxy = start_pgmemo(auth_config(AuthType::ScramSha256)).await;
    let addr = proxy.local_addr();
    for (name, password) in [ALICE, CAROL] {
        let mut login = try_login(addr, name, password).await;
        assert!(login.ready, "{name}: {:?}", login.messages);
        assert_eq!(auth_codes(&login), [10, 11, 12, 0], "{name}");
        let offered = &login.messages[0].body[4..];
        assert_eq!(offered, b"SCRAM-SHA-256\0\0", "{name}");
        // pgmemo serves the client as its own user, from the server role `pgmemo`.
        assert_eq!(
            scalar(&mut login.client, "SELECT current_user").await,
            PGMEMO_USER
        );
        assert_eq!(
            scalar(&mut login.client, "SHOW session_authorization").await,
            PGMEMO_USER
        );
        // A real driver too.
        let (client, connection) = tokio_postgres::connect(
            &proxy_url(addr, name, Some(password), TEST_DB),
            tokio_postgres::NoTls,
        )
        .await
        .unwrap_or_else(|e| panic!("tokio-postgres as {name}: {e}"));
        let task = tokio::spawn(connection);
        let row = client.query_one("SELECT 1 + 1", &[]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), 2);
        drop(client);
        task.await.unwrap().unwrap();
    }
    proxy.shutdown().await;
}

#[tokio::test]
async fn clients_authenticate_with_md5() {
    let proxy = start_pgmemo(auth_config(AuthType::Md5)).await;
    let addr = proxy.local_addr();
    for (name, password) in [ALICE, BOB] {
        let mut login = try_login(addr, name, password).await;
        assert!(login.ready, "{name}: {:?}", login.messages);
        assert_eq!(auth_codes(&login), [5, 0], "{name}");
        assert_eq!(scalar(&mut login.client, "SELECT 'md5 ok'").await, "md5 ok");
        let (client, connection) = tokio_postgres::connect(
            &proxy_url(addr, name, Some(password), TEST_DB),
            tokio_postgres::NoTls,
        )
        .await
        .unwrap_or_else(|e| panic!("tokio-postgres as {name}: {e}"));
        let task = tokio::spawn(connection);
        client.simple_query("SELECT 1").await.unwrap();
        drop(client);
        task.await.unwrap().unwrap();
    }
    // As in PostgreSQL, a user whose secret is a SCRAM verifier is asked for SCRAM even where
    // md5 is configured: a verifier cannot check an md5 answer.
    let mut login = try_login(addr, CAROL.0, CAROL.1).await;
    assert!(login.ready, "carol: {:?}", login.messages);
    assert_eq!(auth_codes(&login), [10, 11, 12, 0]);
    assert_eq!(
        scalar(&mut login.client, "SELECT 'scram ok'").await,
        "scram ok"
    );
    proxy.shutdown().await;
}

/// (severity, SQLSTATE, message) of the error that ended a login, with the user's name in the
/// message replaced, so that answers for different users compare.
fn refusal(login: &Login, user: &str) -> (String, String, String) {
    let (severity, code, message) = login.expect_error();
    (
        severity,
        code,
        message.replace(&format!("\"{user}\""), "\"<user>\""),
    )
}

#[tokio::test]
async fn a_wrong_password_gets_the_same_answer_whether_the_user_exists_or_not() {
    // PostgreSQL's own answers, as the reference: a SCRAM user with a wrong password, and a
    // user that does not exist (PostgreSQL runs a mock SCRAM exchange for it).
    let direct_wrong = try_login(cluster().addr(), SCRAM_USER, "wrong").await;
    let direct_nobody = try_login(cluster().addr(), "nobody", "wrong").await;
    assert_eq!(auth_codes(&direct_wrong), [10, 11]);
    assert_eq!(auth_codes(&direct_nobody), [10, 11]);
    let reference = refusal(&direct_wrong, SCRAM_USER);
    assert_eq!(reference.1, "28P01");
    assert_eq!(refusal(&direct_nobody, "nobody"), reference);

    for auth in [AuthType::ScramSha256, AuthType::Md5] {
        let proxy = start_pgmemo(auth_config(auth)).await;
        let addr = proxy.local_addr();
        let expected_codes: &[i32] = match auth {
            AuthType::Md5 => &[5],
            _ => &[10, 11],
        };
        let mut answers = Vec::new();
        for (name, password) in [(ALICE.0, "wrong"), ("nobody", "wrong"), ("nobody", ALICE.1)] {
            let mut login = try_login(addr, name, password).await;
            assert!(
                !login.ready,
                "{auth:?} {name}: let in with a wrong password"
            );
            // The whole exchange runs before the refusal, for unknown users too.
            assert_eq!(auth_codes(&login), expected_codes, "{auth:?} {name}");
            assert_eq!(refusal(&login, name), reference, "{auth:?} {name}");
            answers.push(normalize(&login.messages[login.messages.len() - 1..]));
            let after = login.client.recv_until_closed().await.unwrap();
            assert!(after.is_empty(), "{after:?}");
        }
        // A driver sees 28P01 too.
        let error = tokio_postgres::connect(
            &proxy_url(addr, ALICE.0, Some("wrong"), TEST_DB),
            tokio_postgres::NoTls,
        )
        .await
        .err()
        .expect("refused");
        assert_eq!(
            error.code(),
            Some(&tokio_postgres::error::SqlState::INVALID_PASSWORD),
            "{error}"
        );
        proxy.shutdown().await;
    }
}

/// With `auth_type = trust` only known users log in (the upstream role here, there being no
/// `[users]`); any other name gets PostgreSQL's answer for a name that is no role, and is not
/// logged in as the upstream role.
#[tokio::test]
async fn trust_lets_in_only_known_users() {
    let mut config = test_config(PoolMode::Transaction, 1);
    config.general.auth_type = AuthType::Trust;
    let proxy = start_pgmemo(config).await;
    let mut known = try_login(proxy.local_addr(), PGMEMO_USER, "").await;
    assert!(known.ready, "{:?}", known.messages);
    assert_eq!(
        scalar(&mut known.client, "SELECT current_user").await,
        PGMEMO_USER
    );
    let mut stranger = try_login(proxy.local_addr(), "stranger", "").await;
    assert!(!stranger.ready, "a user pgmemo does not know was let in");
    assert_eq!(
        stranger.expect_error(),
        (
            "FATAL".to_string(),
            "28000".to_string(),
            "role \"stranger\" does not exist".to_string()
        )
    );
    assert!(stranger
        .client
        .recv_until_closed()
        .await
        .unwrap()
        .is_empty());
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// pgmemo → PostgreSQL
// ---------------------------------------------------------------------------------------------

/// pgmemo logging into the server as `server_user` (from a `[databases."*"]` entry); the
/// client logs in to pgmemo as `pgmemo`.
fn server_login_config(server_user: &str, password: Option<&str>) -> Config {
    let mut config = test_config(PoolMode::Transaction, 1);
    config.databases = BTreeMap::from([(
        "*".to_string(),
        DatabaseConfig {
            user: Some(server_user.to_string()),
            password: password.map(str::to_string),
            ..DatabaseConfig::default()
        },
    )]);
    config
}

#[tokio::test]
async fn pgmemo_logs_into_the_server_with_each_method() {
    let cases = [
        ("scram-sha-256", SCRAM_USER, Some(SCRAM_PASS)),
        ("md5", MD5_USER, Some(MD5_PASS)),
        ("password (cleartext)", PASSWORD_USER, Some(PASSWORD_PASS)),
        ("trust", TRUST_USER, None),
    ];
    for (method, server_user, password) in cases {
        // The method really is the one pg_hba.conf asks of this role.
        let hba = cluster().psql(
            TEST_DB,
            &format!(
                "SELECT auth_method FROM pg_hba_file_rules WHERE '{server_user}' = ANY(user_name)"
            ),
        );
        assert_eq!(hba.trim(), method.split(' ').next().unwrap(), "{method}");
        let proxy = start_pgmemo(server_login_config(server_user, password)).await;
        let mut client = RawClient::through(proxy.local_addr(), &[])
            .await
            .unwrap_or_else(|e| panic!("{method}: {e:#}"));
        assert_eq!(
            scalar(&mut client, "SELECT current_user").await,
            server_user,
            "{method}"
        );
        proxy.shutdown().await;
    }
}

#[tokio::test]
async fn pgmemo_logs_in_as_the_client_when_no_server_user_is_configured() {
    // No [upstream] user: the client's own name and (plain) password go to the server.
    let mut config = test_config(PoolMode::Transaction, 1);
    config.general.admin_users = vec![];
    config.upstream = None;
    config.databases = BTreeMap::from([(
        "*".to_string(),
        DatabaseConfig {
            host: Some("127.0.0.1".into()),
            port: Some(cluster().port()),
            ..DatabaseConfig::default()
        },
    )]);
    config.users = BTreeMap::from([
        (SCRAM_USER.to_string(), user(SCRAM_PASS.to_string())),
        (MD5_USER.to_string(), user(MD5_PASS.to_string())),
    ]);
    let proxy = start_pgmemo(config).await;
    for (name, password) in [(SCRAM_USER, SCRAM_PASS), (MD5_USER, MD5_PASS)] {
        let mut client = RawClient::connect(proxy.local_addr(), name, TEST_DB, Some(password), &[])
            .await
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert_eq!(scalar(&mut client, "SELECT current_user").await, name);
    }
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_wrong_server_password_reaches_the_client_as_postgresql_said_it() {
    let proxy = start_pgmemo(server_login_config(MD5_USER, Some("not the password"))).await;
    let direct = try_login(cluster().addr(), MD5_USER, "not the password").await;
    let through = try_login(proxy.local_addr(), PGMEMO_USER, PGMEMO_PASS).await;
    assert!(!through.ready);
    assert_eq!(through.expect_error(), direct.expect_error());
    assert_eq!(through.expect_error().1, "28P01");
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// TLS
// ---------------------------------------------------------------------------------------------

/// A certificate authority and a server certificate for "localhost" that it signed, as PEM
/// files in a directory of their own.
struct Certs {
    dir: PathBuf,
    ca_pem: String,
    /// The CA, to sign client certificates with ([`Certs::client`]).
    ca: (rcgen::Certificate, rcgen::KeyPair),
    cert_file: PathBuf,
    key_file: PathBuf,
    ca_file: PathBuf,
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

static CERT_DIRS: AtomicU32 = AtomicU32::new(0);

impl Certs {
    fn generate() -> Certs {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
        let n = CERT_DIRS.fetch_add(1, Ordering::Relaxed);
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, format!("pgmemo test CA {n}"));
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        let cert = params.signed_by(&key, &ca, &ca_key).unwrap();

        let dir = std::env::temp_dir().join(format!("pgmemo-tls-test-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let cert_file = write("server.crt", &cert.pem());
        let key_file = write("server.key", &key.serialize_pem());
        let ca_file = write("ca.crt", &ca.pem());
        Certs {
            ca_pem: ca.pem(),
            ca: (ca, ca_key),
            dir,
            cert_file,
            key_file,
            ca_file,
        }
    }

    /// A client certificate whose Common Name is `name`, signed by this CA: (chain, key).
    fn client(&self, name: &str) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        use rcgen::{CertificateParams, DnType, KeyPair};
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.signed_by(&key, &self.ca.0, &self.ca.1).unwrap();
        let key = PrivateKeyDer::try_from(key.serialize_der()).unwrap();
        (vec![cert.der().clone()], key)
    }

    /// [`Certs::client`] written as PEM files in this directory: (certificate, key).
    fn client_files(&self, name: &str) -> (PathBuf, PathBuf) {
        use rcgen::{CertificateParams, DnType, KeyPair};
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.signed_by(&key, &self.ca.0, &self.ca.1).unwrap();
        let files = (
            self.dir.join(format!("{name}.crt")),
            self.dir.join(format!("{name}.key")),
        );
        std::fs::write(&files.0, cert.pem()).unwrap();
        std::fs::write(&files.1, key.serialize_pem()).unwrap();
        files
    }

    fn roots(&self) -> RootCertStore {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        roots
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// libpq's `sslmode=require`: encrypted, certificate not checked.
fn tls_require() -> MakeRustlsConnect {
    let config = pgmemo::tls::client_config(ServerTlsMode::Require, None, None, "secure")
        .unwrap()
        .expect("require has a TLS config");
    MakeRustlsConnect::new(config)
}

/// libpq's `sslmode=verify-full`: the certificate must chain to `roots` and name the host.
fn tls_verify_full(roots: RootCertStore) -> MakeRustlsConnect {
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    MakeRustlsConnect::new(config)
}

fn tls_config(certs: &Certs, mode: ClientTlsMode) -> Config {
    let mut config = test_config(PoolMode::Transaction, 2);
    config.general.tls_cert_file = Some(certs.cert_file.clone());
    config.general.tls_key_file = Some(certs.key_file.clone());
    config.general.client_tls = mode;
    config
}

/// Connects with tokio-postgres over TLS to `host` (a name for the certificate check) at the
/// proxy's port, runs a query, and reports whether pgmemo saw the client as a TLS client.
async fn tls_query(
    proxy: &Pgmemo,
    host: &str,
    tls: MakeRustlsConnect,
) -> Result<bool, tokio_postgres::Error> {
    let url = format!(
        "host={host} port={} user={PGMEMO_USER} password={PGMEMO_PASS} dbname={TEST_DB} \
         sslmode=require",
        proxy.local_addr().port()
    );
    let (client, connection) = tokio_postgres::connect(&url, tls).await?;
    let task = tokio::spawn(connection);
    let row = client.query_one("SELECT 'over tls'::text", &[]).await?;
    assert_eq!(row.get::<_, String>(0), "over tls");
    let tls_clients = proxy.app().clients().iter().filter(|c| c.tls()).count();
    drop(client);
    task.await.unwrap()?;
    Ok(tls_clients == 1)
}

/// Connects over TLS to pgmemo as `PGMEMO_USER` without a password, presenting `client`
/// (a certificate and its key) or none, and reads `current_user`.
async fn cert_login(
    proxy: &Pgmemo,
    certs: &Certs,
    client: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
) -> Result<String, String> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(certs.roots());
    let config = match client {
        Some((chain, key)) => builder.with_client_auth_cert(chain, key).unwrap(),
        None => builder.with_no_client_auth(),
    };
    let url = format!(
        "host=localhost port={} user={PGMEMO_USER} dbname={TEST_DB} sslmode=require",
        proxy.local_addr().port()
    );
    let (client, connection) = tokio_postgres::connect(&url, MakeRustlsConnect::new(config))
        .await
        .map_err(|e| match e.as_db_error() {
            Some(db) => format!("{} {}", db.code().code(), db.message()),
            None => format!("{e:?}"),
        })?;
    let task = tokio::spawn(connection);
    let rows = client.query_one("SELECT current_user::text", &[]).await;
    task.abort();
    Ok(rows.map_err(|e| e.to_string())?.get(0))
}

/// TLS with client certificates checked against the test CA, and `auth`.
fn cert_config(certs: &Certs, mode: ClientTlsMode, auth: AuthType) -> Config {
    let mut config = tls_config(certs, mode);
    config.general.tls_ca_file = Some(certs.ca_file.clone());
    config.general.auth_type = auth;
    config
}

/// A certificate that names `PGMEMO_USER` logs in as it, without a password.
async fn own_certificate_logs_in(proxy: &Pgmemo, certs: &Certs) {
    let own = certs.client(PGMEMO_USER);
    let user = cert_login(proxy, certs, Some(own)).await;
    assert_eq!(user.unwrap(), PGMEMO_USER);
}

/// `auth_type = "cert"` (with `client_tls = "verify-ca"`): the client's certificate, signed
/// by `tls_ca_file`'s CA, must name the user; and an HBA file's `cert` line for TLS clients
/// next to password lines for the others.
#[tokio::test]
async fn certificate_logins() {
    let certs = Certs::generate();
    let config = cert_config(&certs, ClientTlsMode::VerifyCa, AuthType::Cert);
    let proxy = start_pgmemo(config).await;
    own_certificate_logs_in(&proxy, &certs).await;
    assert_eq!(
        cert_login(&proxy, &certs, Some(certs.client("mallory"))).await,
        Err(format!(
            "28000 certificate authentication failed for user \"{PGMEMO_USER}\""
        ))
    );
    // verify-ca: no certificate, or one another CA signed, fails the handshake.
    let none = cert_login(&proxy, &certs, None).await.unwrap_err();
    assert!(none.contains("CertificateRequired"), "{none}");
    let other = Certs::generate();
    let foreign = cert_login(&proxy, &certs, Some(other.client(PGMEMO_USER)))
        .await
        .unwrap_err();
    assert!(
        foreign.contains("UnknownCA") || foreign.contains("BadCertificate"),
        "{foreign}"
    );
    proxy.shutdown().await;

    // auth_type = "hba": TLS clients by certificate, the others by password.
    let hba = certs.dir.join("hba.conf");
    std::fs::write(
        &hba,
        "hostssl all all all cert\nhost all all all scram-sha-256\n",
    )
    .unwrap();
    let mut config = cert_config(&certs, ClientTlsMode::Allow, AuthType::Hba);
    config.general.auth_hba_file = Some(hba.clone());
    config.read_auth_file().unwrap();
    let proxy = start_pgmemo(config).await;
    own_certificate_logs_in(&proxy, &certs).await;
    assert_eq!(
        cert_login(&proxy, &certs, None).await,
        Err("28000 connection requires a valid client certificate".to_string())
    );
    let mut plain = RawClient::connect(
        proxy.local_addr(),
        PGMEMO_USER,
        TEST_DB,
        Some(PGMEMO_PASS),
        &[],
    )
    .await
    .expect("a plain-text client logs in with its password");
    assert_eq!(scalar(&mut plain, "SELECT 'plain'").await, "plain");
    proxy.shutdown().await;

    // A cert line with an ident map: the certificates its map names log in as its users, a
    // certificate of the user's own name no longer does.
    let ident = certs.dir.join("ident.conf");
    std::fs::write(&ident, format!("apps web-app {PGMEMO_USER}\n")).unwrap();
    std::fs::write(&hba, "hostssl all all all cert map=apps\n").unwrap();
    let mut config = cert_config(&certs, ClientTlsMode::Allow, AuthType::Hba);
    config.general.auth_hba_file = Some(hba);
    config.general.auth_ident_file = Some(ident);
    config.read_auth_file().unwrap();
    let proxy = start_pgmemo(config).await;
    let mapped = cert_login(&proxy, &certs, Some(certs.client("web-app"))).await;
    assert_eq!(mapped.unwrap(), PGMEMO_USER);
    assert_eq!(
        cert_login(&proxy, &certs, Some(certs.client(PGMEMO_USER))).await,
        Err(format!(
            "28000 certificate authentication failed for user \"{PGMEMO_USER}\""
        ))
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn tls_clients_with_require_and_verify_full() {
    let certs = Certs::generate();
    let proxy = start_pgmemo(tls_config(&certs, ClientTlsMode::Allow)).await;

    assert!(tls_query(&proxy, "localhost", tls_require()).await.unwrap());
    assert!(
        tls_query(&proxy, "localhost", tls_verify_full(certs.roots()))
            .await
            .unwrap()
    );
    // Verification is real: another CA's roots, or a host the certificate does not name, fail.
    let other = Certs::generate();
    let error = tls_query(&proxy, "localhost", tls_verify_full(other.roots()))
        .await
        .expect_err("a certificate from an unknown CA must be refused");
    assert!(format!("{error:?}").contains("UnknownIssuer"), "{error:?}");
    let error = tls_query(&proxy, "127.0.0.1", tls_verify_full(certs.roots()))
        .await
        .expect_err("a certificate for another name must be refused");
    assert!(
        format!("{error:?}").contains("NotValidForName"),
        "{error:?}"
    );

    // client_tls = allow: plain text is fine too.
    let mut plain = RawClient::through(proxy.local_addr(), &[])
        .await
        .expect("plain-text client");
    assert_eq!(scalar(&mut plain, "SELECT 'plain'").await, "plain");
    proxy.shutdown().await;
}

#[tokio::test]
async fn client_tls_require_refuses_plain_text() {
    let certs = Certs::generate();
    let proxy = start_pgmemo(tls_config(&certs, ClientTlsMode::Require)).await;
    let packet = startup_packet(
        protocol_version(3, 0),
        &[("user", PGMEMO_USER), ("database", TEST_DB)],
    );
    let mut refused = RawClient::login(proxy.local_addr(), &packet, PGMEMO_USER, Some(PGMEMO_PASS))
        .await
        .unwrap();
    assert!(!refused.ready);
    let (severity, code, message) = refused.expect_error();
    assert_eq!(
        (severity.as_str(), code.as_str()),
        ("FATAL", "28000"),
        "{message}"
    );
    assert!(
        auth_codes(&refused).is_empty(),
        "no password asked in plain text"
    );
    assert!(refused.client.recv_until_closed().await.unwrap().is_empty());
    // Bytes after the SSLRequest, before the answer, are refused (CVE-2021-23214).
    let mut eager = RawClient::open(proxy.local_addr()).await.unwrap();
    let mut bytes = startup_request(80877103, b"");
    bytes.extend(&packet);
    eager.send_raw(&bytes).await.unwrap();
    let answer = eager.recv_raw_until_closed().await.unwrap();
    assert!(
        String::from_utf8_lossy(&answer).contains("received unencrypted data after SSL request"),
        "{answer:?}"
    );
    // TLS clients are welcome.
    assert!(
        tls_query(&proxy, "localhost", tls_verify_full(certs.roots()))
            .await
            .unwrap()
    );
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// pgmemo → PostgreSQL over TLS
// ---------------------------------------------------------------------------------------------

/// A second PostgreSQL with `ssl = on`, its certificate signed by [`Certs`]' CA, started once
/// for this test binary. (The shared cluster keeps `ssl = off`, so that refusals can be
/// tested against it.)
struct TlsServer {
    pg: LocalPostgres,
    certs: Certs,
}

static TLS_SERVER: OnceLock<std::sync::Mutex<Option<TlsServer>>> = OnceLock::new();

extern "C" fn stop_tls_server() {
    let _ = std::panic::catch_unwind(|| {
        if let Some(server) = TLS_SERVER.get() {
            let mut guard = server.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(mut server) = guard.take() {
                server.pg.stop();
            }
        }
    });
}

/// Makes `path` the server OS user's, so that PostgreSQL accepts it as its key file.
fn give_to_postgres(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return; // PostgreSQL runs as us
    }
    let pw = std::process::Command::new("id")
        .args(["-u", "postgres"])
        .output()
        .expect("id -u postgres");
    let uid: u32 = String::from_utf8_lossy(&pw.stdout).trim().parse().unwrap();
    std::os::unix::fs::chown(path, Some(uid), None).unwrap();
}

/// (port, CA file) of the TLS-enabled PostgreSQL.
fn tls_server() -> (u16, PathBuf) {
    let server = TLS_SERVER.get_or_init(|| {
        let certs = Certs::generate();
        give_to_postgres(&certs.dir, 0o755);
        give_to_postgres(&certs.cert_file, 0o644);
        give_to_postgres(&certs.key_file, 0o600);
        let pg = LocalPostgres::start(LocalPostgresOptions {
            superuser: SUPERUSER.to_string(),
            superuser_password: Some(SUPERUSER_PASS.to_string()),
            settings: vec![
                ("ssl".into(), "on".into()),
                (
                    "ssl_cert_file".into(),
                    certs.cert_file.display().to_string(),
                ),
                ("ssl_key_file".into(), certs.key_file.display().to_string()),
            ],
            ..LocalPostgresOptions::default()
        })
        .unwrap_or_else(|e| panic!("PostgreSQL with ssl = on: {e}"));
        // SAFETY: `stop_tls_server` is an `extern "C"` function that does not unwind.
        unsafe { libc::atexit(stop_tls_server) };
        std::sync::Mutex::new(Some(TlsServer { pg, certs }))
    });
    let guard = server.lock().unwrap();
    let server = guard.as_ref().expect("running");
    (server.pg.port(), server.certs.ca_file.clone())
}

const SERVER_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

fn server_tls_config(host: &str, port: u16, mode: ServerTlsMode, ca: Option<PathBuf>) -> Config {
    let mut config = test_config(PoolMode::Transaction, 1);
    config.upstream = Some(Upstream {
        host: host.to_string(),
        port,
        user: SUPERUSER.to_string(),
        password: Some(SUPERUSER_PASS.to_string()),
        ..Default::default()
    });
    config.general.admin_users = vec![];
    config.general.server_tls = mode;
    config.general.server_tls_ca_file = ca;
    config.general.server_connect_timeout = SERVER_CONNECT_TIMEOUT;
    config
}

/// Logs in through pgmemo (as the implicit upstream user) and asks the server whether the
/// connection it serves pgmemo on is encrypted.
async fn server_side_ssl(proxy: &Pgmemo) -> Result<String, String> {
    let packet = startup_packet(
        protocol_version(3, 0),
        &[("user", SUPERUSER), ("database", "postgres")],
    );
    let mut login = RawClient::login(proxy.local_addr(), &packet, SUPERUSER, Some(SUPERUSER_PASS))
        .await
        .map_err(|e| format!("{e:#}"))?;
    if !login.ready {
        let (severity, code, message) = login.expect_error();
        return Err(format!("{severity} {code} {message}"));
    }
    Ok(scalar(
        &mut login.client,
        "SELECT ssl::text FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
    )
    .await)
}

#[tokio::test]
async fn server_tls_require_and_verify_full() {
    let (port, ca_file) = tokio::task::spawn_blocking(tls_server).await.unwrap();
    for (mode, host, ca) in [
        (ServerTlsMode::Require, "127.0.0.1", None),
        (ServerTlsMode::Prefer, "127.0.0.1", None),
        (
            ServerTlsMode::VerifyFull,
            "localhost",
            Some(ca_file.clone()),
        ),
    ] {
        let proxy = start_pgmemo(server_tls_config(host, port, mode, ca)).await;
        assert_eq!(
            server_side_ssl(&proxy).await.as_deref(),
            Ok("true"),
            "{mode:?}"
        );
        proxy.shutdown().await;
    }
    // Without server_tls the same server is used in plain text.
    let proxy = start_pgmemo(server_tls_config(
        "127.0.0.1",
        port,
        ServerTlsMode::Disable,
        None,
    ))
    .await;
    assert_eq!(server_side_ssl(&proxy).await.as_deref(), Ok("false"));
    proxy.shutdown().await;

    // verify-full checks: a CA that did not sign the certificate, a name it does not carry.
    let other = Certs::generate();
    for (host, ca, what) in [
        ("localhost", other.ca_file.clone(), "unknown CA"),
        ("127.0.0.1", ca_file.clone(), "wrong host name"),
    ] {
        let proxy = start_pgmemo(server_tls_config(
            host,
            port,
            ServerTlsMode::VerifyFull,
            Some(ca),
        ))
        .await;
        let error = server_side_ssl(&proxy).await.expect_err(what);
        assert!(error.starts_with("FATAL 08006"), "{what}: {error}");
        proxy.shutdown().await;
    }
}

#[tokio::test]
async fn server_tls_require_refuses_a_server_without_tls() {
    // The shared cluster has ssl = off.
    let mut config = server_tls_config("127.0.0.1", cluster().port(), ServerTlsMode::Require, None);
    config.upstream = Some(Upstream {
        host: "127.0.0.1".into(),
        port: cluster().port(),
        user: SUPERUSER.to_string(),
        password: Some(SUPERUSER_PASS.to_string()),
        ..Default::default()
    });
    let proxy = start_pgmemo(config).await;
    let started = std::time::Instant::now();
    let error = server_side_ssl(&proxy).await.expect_err("must refuse");
    assert!(error.starts_with("FATAL 08006"), "{error}");
    assert!(error.contains("TLS"), "{error}");
    // A clear error within server_connect_timeout, not a hang.
    assert!(started.elapsed() < SERVER_CONNECT_TIMEOUT + std::time::Duration::from_secs(2));
    // With prefer, the same server is fine in plain text.
    let mut config = server_tls_config("127.0.0.1", cluster().port(), ServerTlsMode::Prefer, None);
    config.upstream.as_mut().unwrap().port = cluster().port();
    let prefer = start_pgmemo(config).await;
    assert_eq!(server_side_ssl(&prefer).await.as_deref(), Ok("false"));
    prefer.shutdown().await;
    proxy.shutdown().await;
}

/// The upstream's own `sslmode` (and `sslrootcert`) choose TLS for its server, whatever
/// `general.server_tls` says, as libpq would read the same URL.
#[tokio::test]
async fn the_upstream_urls_sslmode_chooses_server_tls() {
    let (port, ca_file) = tokio::task::spawn_blocking(tls_server).await.unwrap();
    let user = format!("{SUPERUSER}:{SUPERUSER_PASS}");
    for url in [
        format!("postgresql://{user}@127.0.0.1:{port}/postgres?sslmode=require"),
        format!(
            "host=localhost port={port} user={SUPERUSER} password={SUPERUSER_PASS} \
             sslmode=verify-full sslrootcert={}",
            ca_file.display()
        ),
    ] {
        let mut config = server_tls_config("127.0.0.1", port, ServerTlsMode::Disable, None);
        config.upstream = Some(pgmemo::config::parse_upstream_url(&url).unwrap());
        let proxy = start_pgmemo(config).await;
        assert_eq!(
            server_side_ssl(&proxy).await.as_deref(),
            Ok("true"),
            "{url}"
        );
        proxy.shutdown().await;
    }
    // sslmode=require towards the shared cluster (ssl = off) is refused, as with server_tls.
    let mut config = server_tls_config("127.0.0.1", port, ServerTlsMode::Disable, None);
    let url = format!(
        "postgresql://{user}@127.0.0.1:{}/postgres?sslmode=require",
        cluster().port()
    );
    config.upstream = Some(pgmemo::config::parse_upstream_url(&url).unwrap());
    let proxy = start_pgmemo(config).await;
    let error = server_side_ssl(&proxy).await.expect_err("must refuse");
    assert!(
        error.starts_with("FATAL 08006") && error.contains("TLS"),
        "{error}"
    );
    proxy.shutdown().await;
}

/// A server whose pg_hba.conf logs pgmemo in by certificate (`hostssl ... cert`):
/// `server_tls_cert_file` / `server_tls_key_file` (PgBouncer's), or a connection string's
/// `sslcert` / `sslkey`, present it; without one, or with another name's, the server's own
/// refusal reaches the client.
#[tokio::test]
async fn a_client_certificate_for_servers_that_ask_for_one() {
    let certs = Certs::generate();
    give_to_postgres(&certs.dir, 0o755);
    give_to_postgres(&certs.cert_file, 0o644);
    give_to_postgres(&certs.key_file, 0o600);
    give_to_postgres(&certs.ca_file, 0o644);
    let pg = tokio::task::spawn_blocking({
        let (cert, key, ca) = (
            certs.cert_file.display().to_string(),
            certs.key_file.display().to_string(),
            certs.ca_file.display().to_string(),
        );
        move || {
            LocalPostgres::start(LocalPostgresOptions {
                hba: vec!["hostssl all certuser 127.0.0.1/32 cert".into()],
                settings: vec![
                    ("ssl".into(), "on".into()),
                    ("ssl_cert_file".into(), cert),
                    ("ssl_key_file".into(), key),
                    ("ssl_ca_file".into(), ca),
                ],
                ..LocalPostgresOptions::default()
            })
            .unwrap()
        }
    })
    .await
    .unwrap();
    pg.psql("postgres", "CREATE ROLE certuser LOGIN").unwrap();
    let own = certs.client_files("certuser");
    let other = certs.client_files("someone");
    // Clients log in to pgmemo as pgmemo; pgmemo logs into the server as certuser.
    let config = |identity: Option<&(PathBuf, PathBuf)>, in_string: bool| {
        let mut config = test_config(PoolMode::Transaction, 1);
        config.upstream = Some(Upstream {
            host: "127.0.0.1".into(),
            port: pg.port(),
            user: PGMEMO_USER.into(),
            password: Some(PGMEMO_PASS.into()),
            ..Default::default()
        });
        config.general.server_tls = ServerTlsMode::Require;
        config.general.server_connect_timeout = SERVER_CONNECT_TIMEOUT;
        let mut db = pgmemo::config::DatabaseConfig {
            dbname: Some("postgres".into()),
            user: Some("certuser".into()),
            ..Default::default()
        };
        match (identity, in_string) {
            // What `connstring = "... sslcert=CERT sslkey=KEY"` reads into.
            // (Options travel with the host they were given with.)
            (Some((cert, key)), true) => {
                db.host = Some("127.0.0.1".into());
                db.port = Some(pg.port());
                db.options.tls_identity = Some((cert.clone(), key.clone()));
            }
            (Some((cert, key)), false) => {
                config.general.server_tls_cert_file = Some(cert.clone());
                config.general.server_tls_key_file = Some(key.clone());
            }
            (None, _) => {}
        }
        config.databases.insert("certdb".into(), db);
        config
    };
    let who = |proxy: &Pgmemo| {
        let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), "certdb");
        async move {
            let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .map_err(|e| {
                    e.as_db_error()
                        .map_or(e.to_string(), |d| d.message().to_owned())
                })?;
            tokio::spawn(conn);
            let row = client
                .query_one("SELECT current_user || ' ' || ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[])
                .await
                .map_err(|e| e.as_db_error().map_or(e.to_string(), |d| d.message().to_owned()))?;
            Ok::<String, String>(row.get(0))
        }
    };
    for in_string in [false, true] {
        let proxy = start_pgmemo(config(Some(&own), in_string)).await;
        assert_eq!(
            who(&proxy).await,
            Ok("certuser true".to_owned()),
            "{in_string}"
        );
        proxy.shutdown().await;
    }
    let proxy = start_pgmemo(config(None, false)).await;
    let refused = who(&proxy).await.unwrap_err();
    assert!(
        refused.contains("connection requires a valid client certificate"),
        "{refused}"
    );
    proxy.shutdown().await;
    let proxy = start_pgmemo(config(Some(&other), false)).await;
    assert_eq!(
        who(&proxy).await,
        Err("certificate authentication failed for user \"certuser\"".to_owned())
    );
    proxy.shutdown().await;
}
