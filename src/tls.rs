//! TLS setup for both sides of the proxy.
//!
//! Towards clients pgmemo is a TLS server with a certificate from the config
//! ([`load_acceptor`]). Towards PostgreSQL it is a TLS client whose checks follow libpq's
//! `sslmode` ([`ServerTlsMode`], [`server_connector`]), and it performs PostgreSQL's
//! `SSLRequest` negotiation itself ([`connect_server_tls`]), because PostgreSQL does not
//! start TLS on connect but after an 8-byte request and a one-byte answer.
//!
//! Every config is built with the ring provider passed explicitly, so nothing depends on a
//! process-wide default provider having been installed.

use std::io;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme,
    SupportedProtocolVersion,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::stream::Stream;

/// PostgreSQL's `SSLRequest`: length 8, then the magic code 80877103 (1234 << 16 | 5679).
pub const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The TLS versions a `tls_protocols` value allows (see [`crate::config::tls_protocols`]).
pub fn versions(protocols: &str) -> anyhow::Result<Vec<&'static SupportedProtocolVersion>> {
    let (v12, v13) = crate::config::tls_protocols(protocols).map_err(anyhow::Error::msg)?;
    let pick = [
        (v13, &rustls::version::TLS13),
        (v12, &rustls::version::TLS12),
    ];
    Ok(pick
        .into_iter()
        .filter(|(on, _)| *on)
        .map(|(_, v)| v)
        .collect())
}

/// Builds the acceptor for client connections from a PEM certificate chain (leaf first) and
/// a PEM private key (PKCS#8, PKCS#1 RSA or SEC1 EC). With `client_ca` (`tls_ca_file`), each
/// client is asked for a certificate that chains to one of its certificates (a client
/// without one is let through unless `require_certificate`); without, none is asked. It offers
/// the TLS versions `protocols` allows (`tls_protocols`).
///
/// Errors name the file and the config option it came from.
pub fn load_acceptor(
    cert_file: &Path,
    key_file: &Path,
    client_ca: Option<&Path>,
    require_certificate: bool,
    protocols: &str,
) -> anyhow::Result<TlsAcceptor> {
    let certs = read_certs(cert_file).with_context(|| cert_context(cert_file))?;
    if certs.is_empty() {
        anyhow::bail!("{}: no certificate found", cert_context(cert_file));
    }
    let key = read_key(key_file)
        .with_context(|| key_context(key_file))?
        .ok_or_else(|| anyhow::anyhow!("{}: no private key found", key_context(key_file)))?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&versions(protocols)?)?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let context = || format!("tls_ca_file {}", ca.display());
            let mut roots = RootCertStore::empty();
            for cert in read_certs(ca).with_context(context)? {
                roots.add(cert).with_context(context)?;
            }
            if roots.is_empty() {
                anyhow::bail!("{}: no certificate found", context());
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider(),
            );
            let verifier = match require_certificate {
                true => verifier,
                false => verifier.allow_unauthenticated(),
            };
            builder.with_client_cert_verifier(verifier.build().with_context(context)?)
        }
    };
    let config = builder.with_single_cert(certs, key).with_context(|| {
        format!(
            "{} and {} do not form a usable certificate and key",
            cert_context(cert_file),
            key_context(key_file)
        )
    })?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The Common Name of the certificate a TLS client presented (checked against
/// `tls_ca_file` by the handshake, or the client would not be here); None for a client
/// without one, or one whose name is not text.
pub fn client_certificate_name(stream: &Stream) -> Option<String> {
    let Stream::ServerTls(tls) = stream else {
        return None;
    };
    let leaf = tls.get_ref().1.peer_certificates()?.first()?;
    let (_, cert) = x509_parser::parse_x509_certificate(leaf).ok()?;
    let name = cert.subject().iter_common_name().next()?.as_str().ok()?;
    Some(name.to_owned())
}

fn cert_context(path: &Path) -> String {
    format!("tls_cert_file {}", path.display())
}

fn key_context(path: &Path) -> String {
    format!("tls_key_file {}", path.display())
}

/// Every certificate in a PEM file, in order (rustls-pki-types' PEM reader: other sections,
/// such as a key kept in the same file, are skipped).
fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, pem::Error> {
    CertificateDer::pem_file_iter(path)?.collect()
}

/// The first private key in a PEM file (PKCS#8, PKCS#1 RSA or SEC1 EC); None when it holds
/// none.
fn read_key(path: &Path) -> Result<Option<PrivateKeyDer<'static>>, pem::Error> {
    match PrivateKeyDer::from_pem_file(path) {
        Ok(key) => Ok(Some(key)),
        Err(pem::Error::NoItemsFound) => Ok(None),
        Err(e) => Err(e),
    }
}

pub use crate::config::ServerTlsMode;

/// Builds the connector for server connections in `mode`; `None` for `Disable`.
///
/// For `VerifyFull` the roots are the certificates in `ca_file` (PEM) if given, else the
/// Mozilla roots from `webpki-roots`; `ca_file` is ignored by the other modes. With
/// `identity`, the (certificate, key) PEM files of a client certificate presented to the
/// servers (libpq's `sslcert` and `sslkey`; PgBouncer's `server_tls_cert_file` and
/// `server_tls_key_file`), for a server whose pg_hba.conf asks for one (`cert`,
/// `clientcert=verify-ca/full`). It offers the TLS versions `protocols` allows
/// (`server_tls_protocols`).
pub fn server_connector(
    mode: ServerTlsMode,
    ca_file: Option<&Path>,
    identity: Option<(&Path, &Path)>,
    protocols: &str,
) -> anyhow::Result<Option<TlsConnector>> {
    let config = client_config(mode, ca_file, identity, protocols)?;
    Ok(config.map(|config| TlsConnector::from(Arc::new(config))))
}

/// The rustls client configuration for `mode` (libpq's sslmode meanings), with a client
/// certificate and its key (PEM files) when given, and the TLS versions `protocols` allows;
/// `None` for `Disable`. Also what a client needs to talk to pgmemo the way libpq would.
pub fn client_config(
    mode: ServerTlsMode,
    ca_file: Option<&Path>,
    identity: Option<(&Path, &Path)>,
    protocols: &str,
) -> anyhow::Result<Option<ClientConfig>> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&versions(protocols)?)?;
    let identity = identity.map(read_identity).transpose()?;
    let config = match mode {
        ServerTlsMode::Disable => return Ok(None),
        ServerTlsMode::Prefer | ServerTlsMode::Require => {
            let builder = builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate { provider }));
            match identity {
                Some((certs, key)) => builder.with_client_auth_cert(certs, key)?,
                None => builder.with_no_client_auth(),
            }
        }
        ServerTlsMode::VerifyFull => {
            let mut roots = RootCertStore::empty();
            match ca_file {
                Some(path) => {
                    let context = || format!("server_tls_ca_file {}", path.display());
                    let certs = read_certs(path).with_context(context)?;
                    if certs.is_empty() {
                        anyhow::bail!("{}: no certificate found", context());
                    }
                    for cert in certs {
                        roots.add(cert).with_context(context)?;
                    }
                }
                None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
            }
            let builder = builder.with_root_certificates(roots);
            match identity {
                Some((certs, key)) => builder.with_client_auth_cert(certs, key)?,
                None => builder.with_no_client_auth(),
            }
        }
    };
    Ok(Some(config))
}

/// A client certificate chain and its private key, read from their PEM files.
fn read_identity(
    (cert, key): (&Path, &Path),
) -> anyhow::Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    let context = || format!("server_tls_cert_file {}", cert.display());
    let certs = read_certs(cert).with_context(context)?;
    if certs.is_empty() {
        anyhow::bail!("{}: no certificate found", context());
    }
    let context = || format!("server_tls_key_file {}", key.display());
    let key = read_key(key)
        .with_context(context)?
        .ok_or_else(|| anyhow::anyhow!("{}: no private key found", context()))?;
    Ok((certs, key))
}

/// Accepts any certificate, as libpq's `sslmode=require` does, but still checks that the
/// server's handshake signatures are made with the key of the certificate it sent, so the
/// session keys are really shared with whoever holds that key.
#[derive(Debug)]
struct AnyCertificate {
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Asks a PostgreSQL server on a fresh connection to switch to TLS and, if it agrees, performs
/// the handshake with `host` as the server name (a DNS name or an IP address; `[v6]`
/// brackets are allowed).
///
/// A server that answers `N` (no TLS configured) leaves the same connection usable in
/// plaintext, so `Ok(Stream::Tcp)` is returned: in `prefer` mode the caller carries on with
/// it, in `require`/`verify-full` it must check [`Stream::is_tls`] and give up.
pub async fn connect_server_tls(
    mut stream: TcpStream,
    connector: &TlsConnector,
    host: &str,
) -> io::Result<Stream> {
    stream.write_all(&SSL_REQUEST).await?;
    // Exactly one byte, read unbuffered: anything the server (or a man in the middle) sent
    // after the 'S' must go into the TLS handshake and fail it, never be taken as protocol
    // data (CVE-2021-23222).
    let mut answer = [0u8; 1];
    stream.read_exact(&mut answer).await?;
    match answer[0] {
        b'S' => {
            let host = host
                .strip_prefix('[')
                .and_then(|h| h.strip_suffix(']'))
                .unwrap_or(host);
            let name = ServerName::try_from(host.to_owned()).map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("invalid TLS server name \"{host}\": {e}"),
                )
            })?;
            let tls = connector.connect(name, stream).await?;
            Ok(Stream::ClientTls(Box::new(tls)))
        }
        b'N' => Ok(Stream::Tcp(stream)),
        // 'E' would be an ErrorResponse from a pre-7.x server; anything else is not
        // PostgreSQL.
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("server answered SSLRequest with unexpected byte 0x{other:02x}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use tokio::io::{AsyncRead, AsyncWrite};
    use tokio::net::TcpListener;

    /// A temporary directory removed on drop (the `tempfile` crate is not a dependency).
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static N: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "pgmemo-tls-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A self-signed certificate for "localhost" and 127.0.0.1, written as cert.pem/key.pem.
    fn write_cert(dir: &TempDir) -> (PathBuf, PathBuf) {
        let ck = rcgen::generate_simple_self_signed(vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
        ])
        .unwrap();
        let cert = dir.0.join("cert.pem");
        let key = dir.0.join("key.pem");
        std::fs::write(&cert, ck.cert.pem()).unwrap();
        std::fs::write(&key, ck.key_pair.serialize_pem()).unwrap();
        (cert, key)
    }

    /// Plays a PostgreSQL server for one connection: answers the SSLRequest with `answer`
    /// and, for 'S', completes the TLS handshake; then echoes "pong" for "ping".
    async fn fake_server(listener: TcpListener, acceptor: TlsAcceptor, answer: u8) {
        let (mut tcp, _) = listener.accept().await.unwrap();
        let mut request = [0u8; 8];
        tcp.read_exact(&mut request).await.unwrap();
        assert_eq!(request, SSL_REQUEST);
        tcp.write_all(&[answer]).await.unwrap();
        let mut stream = if answer == b'S' {
            match acceptor.accept(tcp).await {
                Ok(tls) => Stream::ServerTls(Box::new(tls)),
                Err(_) => return, // the client rejected us; the test checks its side
            }
        } else {
            Stream::Tcp(tcp)
        };
        ping_pong(&mut stream, b"ping", b"pong").await;
    }

    async fn ping_pong<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, expect: &[u8], reply: &[u8]) {
        let mut got = vec![0u8; expect.len()];
        s.read_exact(&mut got).await.unwrap();
        assert_eq!(got, expect);
        s.write_all(reply).await.unwrap();
        s.flush().await.unwrap();
    }

    /// Connects through `connect_server_tls` to a fake server answering `answer`.
    async fn connect(
        acceptor: TlsAcceptor,
        connector: &TlsConnector,
        host: &str,
        answer: u8,
    ) -> (io::Result<Stream>, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(fake_server(listener, acceptor, answer));
        let tcp = TcpStream::connect(addr).await.unwrap();
        (connect_server_tls(tcp, connector, host).await, server)
    }

    async fn ping(stream: &mut Stream) {
        stream.write_all(b"ping").await.unwrap();
        stream.flush().await.unwrap();
        let mut got = [0u8; 4];
        stream.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong");
    }

    #[tokio::test]
    async fn require_mode_handshakes_and_carries_bytes() {
        let dir = TempDir::new("require");
        let (cert, key) = write_cert(&dir);
        let acceptor = load_acceptor(&cert, &key, None, false, "secure").unwrap();
        let connector = server_connector(ServerTlsMode::Require, None, None, "secure")
            .unwrap()
            .unwrap();
        // The certificate does not name this host, and require does not care.
        let (stream, server) = connect(acceptor, &connector, "db.example.com", b'S').await;
        let mut stream = stream.unwrap();
        assert!(stream.is_tls());
        assert!(matches!(stream, Stream::ClientTls(_)));
        assert_eq!(
            stream.peer_addr().unwrap(),
            stream.tcp().unwrap().peer_addr().unwrap()
        );
        ping(&mut stream).await;
        server.await.unwrap();
    }

    /// `tls_protocols` / `server_tls_protocols`: a side limited to TLS 1.3 and one limited
    /// to TLS 1.2 find no version in common; `secure` speaks either.
    #[tokio::test]
    async fn the_tls_versions_offered_are_those_the_settings_allow() {
        let dir = TempDir::new("versions");
        let (cert, key) = write_cert(&dir);
        let shake = |server: &'static str, client: &'static str| {
            let (cert, key) = (cert.clone(), key.clone());
            async move {
                let acceptor = load_acceptor(&cert, &key, None, false, server).unwrap();
                let connector = server_connector(ServerTlsMode::Require, None, None, client)
                    .unwrap()
                    .unwrap();
                let (stream, server) = connect(acceptor, &connector, "localhost", b'S').await;
                let ok = stream.is_ok();
                if let Ok(mut stream) = stream {
                    ping(&mut stream).await;
                }
                server.await.unwrap();
                ok
            }
        };
        assert!(shake("secure", "tlsv1.2").await);
        assert!(shake("tlsv1.2", "secure").await);
        assert!(shake("tlsv1.3", "tlsv1.1,tlsv1.3").await);
        assert!(!shake("tlsv1.3", "tlsv1.2").await);
        assert!(!shake("tlsv1.2", "tlsv1.3").await);
        assert!(versions("tlsv1.0").is_err());
    }

    #[tokio::test]
    async fn verify_full_checks_the_host_name() {
        let dir = TempDir::new("verify");
        let (cert, key) = write_cert(&dir);
        let connector = server_connector(ServerTlsMode::VerifyFull, Some(&cert), None, "secure")
            .unwrap()
            .unwrap();

        for host in ["localhost", "127.0.0.1"] {
            let acceptor = load_acceptor(&cert, &key, None, false, "secure").unwrap();
            let (stream, server) = connect(acceptor, &connector, host, b'S').await;
            let mut stream = stream.unwrap_or_else(|e| panic!("{host}: {e}"));
            assert!(stream.is_tls());
            ping(&mut stream).await;
            server.await.unwrap();
        }

        let acceptor = load_acceptor(&cert, &key, None, false, "secure").unwrap();
        let (stream, server) = connect(acceptor, &connector, "otherhost", b'S').await;
        let err = stream.expect_err("a certificate for another name is rejected");
        assert!(err.to_string().contains("certificate"), "{err}");
        server.await.unwrap();

        // Without the CA file the Mozilla roots do not know our self-signed certificate.
        let public_roots = server_connector(ServerTlsMode::VerifyFull, None, None, "secure")
            .unwrap()
            .unwrap();
        let acceptor = load_acceptor(&cert, &key, None, false, "secure").unwrap();
        let (stream, server) = connect(acceptor, &public_roots, "localhost", b'S').await;
        assert!(stream.is_err());
        server.await.unwrap();
    }

    #[tokio::test]
    async fn refused_ssl_request_continues_in_plaintext() {
        let dir = TempDir::new("refused");
        let (cert, key) = write_cert(&dir);
        let acceptor = load_acceptor(&cert, &key, None, false, "secure").unwrap();
        let connector = server_connector(ServerTlsMode::Prefer, None, None, "secure")
            .unwrap()
            .unwrap();
        let (stream, server) = connect(acceptor, &connector, "localhost", b'N').await;
        let mut stream = stream.unwrap();
        assert!(!stream.is_tls());
        ping(&mut stream).await;
        server.await.unwrap();
    }

    #[tokio::test]
    async fn unexpected_ssl_answer_is_an_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 8];
            tcp.read_exact(&mut request).await.unwrap();
            tcp.write_all(b"E").await.unwrap();
        });
        let connector = server_connector(ServerTlsMode::Require, None, None, "secure")
            .unwrap()
            .unwrap();
        let tcp = TcpStream::connect(addr).await.unwrap();
        let err = connect_server_tls(tcp, &connector, "localhost")
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        server.await.unwrap();
    }

    #[test]
    fn load_errors_name_the_file() {
        let dir = TempDir::new("errors");
        let (cert, key) = write_cert(&dir);
        let missing = dir.0.join("missing-key.pem");
        let err = format!(
            "{:#}",
            load_acceptor(&cert, &missing, None, false, "secure")
                .err()
                .unwrap()
        );
        assert!(err.contains("tls_key_file"), "{err}");
        assert!(err.contains("missing-key.pem"), "{err}");

        // A key file holding only a certificate, and a certificate file holding only a key.
        let err = format!(
            "{:#}",
            load_acceptor(&cert, &cert, None, false, "secure")
                .err()
                .unwrap()
        );
        assert!(err.contains("no private key found"), "{err}");
        let err = format!(
            "{:#}",
            load_acceptor(&key, &key, None, false, "secure")
                .err()
                .unwrap()
        );
        assert!(err.contains("tls_cert_file"), "{err}");
        assert!(err.contains("no certificate found"), "{err}");

        let err = server_connector(ServerTlsMode::VerifyFull, Some(&key), None, "secure")
            .err()
            .unwrap();
        assert!(
            format!("{err:#}").contains("no certificate found"),
            "{err:#}"
        );
        assert!(
            server_connector(ServerTlsMode::Disable, None, None, "secure")
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn tls_mode_parses_like_sslmode() {
        assert_eq!(ServerTlsMode::default(), ServerTlsMode::Disable);
        for (text, mode) in [
            ("disable", ServerTlsMode::Disable),
            ("prefer", ServerTlsMode::Prefer),
            ("require", ServerTlsMode::Require),
            ("verify-full", ServerTlsMode::VerifyFull),
        ] {
            assert_eq!(text.parse::<ServerTlsMode>().unwrap(), mode);
        }
        assert!("verify_full".parse::<ServerTlsMode>().is_err());
        // The config file goes through serde with the same spellings.
        use serde::de::{value::StrDeserializer, Deserialize};
        let de = StrDeserializer::<serde::de::value::Error>::new("verify-full");
        assert_eq!(
            ServerTlsMode::deserialize(de).unwrap(),
            ServerTlsMode::VerifyFull
        );
        assert!("allow".parse::<ServerTlsMode>().is_err());
    }
}
