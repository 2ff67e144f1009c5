//! Bad input from one client: malformed or truncated messages, unknown message types, lengths
//! over the limit, start-up packets that are wrong or never finish, messages out of place, an
//! unknown database, and a server that is down.
//!
//! Each case checks what the misbehaving client is told (PostgreSQL's SQLSTATE, compared with
//! what PostgreSQL itself answers to the same bytes where it answers at all) and that it is
//! disconnected when PostgreSQL would disconnect it; and that a *witness*, a second client in
//! the middle of a transaction on the same pgmemo, keeps working before and after, as do new
//! clients.

mod common;

use common::*;
use pgmemo::config::{Config, DatabaseConfig, PoolMode};
use pgmemo::Pgmemo;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::timeout;

/// pgmemo's limit on one client message in these tests.
const MAX_MESSAGE: usize = 4096;
/// PostgreSQL's limit on the messages that are always short (Sync, Describe, ...).
const PG_SMALL_MESSAGE_LIMIT: usize = 10_000;
const LOGIN_TIMEOUT: Duration = Duration::from_millis(500);
const CONNECT_TIMEOUT: Duration = Duration::from_millis(1000);

fn config() -> Config {
    let mut config = test_config(PoolMode::Transaction, 2);
    config.general.max_message_size = MAX_MESSAGE;
    config.general.client_login_timeout = LOGIN_TIMEOUT;
    config.general.server_connect_timeout = CONNECT_TIMEOUT;
    // The result cache reads every Query, Parse and Bind: bad ones must get past it too.
    config.cache.enabled = true;
    config
}

async fn proxy() -> Pgmemo {
    start_pgmemo(config()).await
}

/// A client in the middle of a transaction that must not notice anything.
struct Witness {
    client: RawClient,
    queries: u32,
}

impl Witness {
    async fn start(addr: SocketAddr) -> Witness {
        let mut client = login(addr).await;
        client.send(&[Frontend::query("BEGIN")]).await.unwrap();
        let replies = client.recv_until_ready(1).await.unwrap();
        assert_eq!(replies.last().and_then(|m| m.ready_status()), Some(b'T'));
        let mut witness = Witness { client, queries: 0 };
        witness.check().await;
        witness
    }

    /// One more query in the witness's transaction; it must answer as always.
    async fn check(&mut self) {
        self.queries += 1;
        let n = self.queries.to_string();
        self.client
            .send(&[Frontend::query(&format!("SELECT {n} AS n"))])
            .await
            .expect("witness sends");
        let replies = self
            .client
            .recv_until_ready(1)
            .await
            .expect("witness reads");
        let row = replies
            .iter()
            .find_map(|m| m.data_row())
            .expect("witness row");
        assert_eq!(row[0].as_deref(), Some(n.as_bytes()), "{replies:?}");
        assert_eq!(replies.last().and_then(|m| m.ready_status()), Some(b'T'));
    }

    async fn finish(mut self) {
        self.check().await;
        self.client
            .send(&[Frontend::query("COMMIT")])
            .await
            .unwrap();
        let replies = self.client.recv_until_ready(1).await.unwrap();
        assert_eq!(replies.last().and_then(|m| m.ready_status()), Some(b'I'));
    }
}

async fn login(addr: SocketAddr) -> RawClient {
    RawClient::through(addr, &[])
        .await
        .unwrap_or_else(|e| panic!("login to {addr}: {e:#}"))
}

/// A new client can log in and run a query.
async fn fresh_client_works(addr: SocketAddr) {
    let mut client = login(addr).await;
    client
        .send(&[Frontend::query("SELECT 'fresh'")])
        .await
        .unwrap();
    let replies = client.recv_until_ready(1).await.unwrap();
    let row = replies.iter().find_map(|m| m.data_row()).expect("a row");
    assert_eq!(row[0].as_deref(), Some(&b"fresh"[..]));
}

/// Everything the server sends until it closes the connection.
async fn until_closed(client: &mut RawClient, what: &str) -> Vec<Backend> {
    client
        .recv_until_closed()
        .await
        .unwrap_or_else(|e| panic!("{what}: the connection must be closed: {e:#}"))
}

/// Asserts that `msgs` is exactly one FATAL ErrorResponse with `code`; returns its message.
fn assert_fatal(msgs: &[Backend], code: &str, what: &str) -> String {
    assert_eq!(
        msgs.len(),
        1,
        "{what}: expected one ErrorResponse, got {msgs:?}"
    );
    let (severity, sqlstate, message) = error_triple(&msgs[0]);
    assert!(msgs[0].is_error(), "{what}: {msgs:?}");
    assert_eq!(
        (severity.as_str(), sqlstate.as_str()),
        ("FATAL", code),
        "{what}: {msgs:?}"
    );
    message
}

/// (severity, SQLSTATE, message) of each error; other messages rendered as is.
fn summary(msgs: &[Backend]) -> Vec<String> {
    msgs.iter()
        .map(|m| match m.is_error() {
            true => format!("{:?}", error_triple(m)),
            false => m.to_string(),
        })
        .collect()
}

/// Logs in, sends `bytes` and returns everything up to the server closing the connection.
async fn after_login(addr: SocketAddr, bytes: &[u8], what: &str) -> Vec<Backend> {
    let mut client = login(addr).await;
    client.send_raw(bytes).await.unwrap();
    until_closed(&mut client, what).await
}

// ---------------------------------------------------------------------------------------------
// After login: messages pgmemo must refuse itself
// ---------------------------------------------------------------------------------------------

/// Message types that do not exist, or that are not allowed after login: PostgreSQL sends
/// FATAL 08P01 "invalid frontend message type N" and hangs up; so must pgmemo.
#[tokio::test]
async fn unknown_and_out_of_place_message_types() {
    let proxy = proxy().await;
    let addr = proxy.local_addr();
    let mut witness = Witness::start(addr).await;
    let startup_again = startup_packet(protocol_version(3, 0), &[("user", PGMEMO_USER)]);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("unknown type 'Y'", tagged(b'Y', b"whatever")),
        (
            "Password message after login",
            tagged(b'p', b"pgmemo_pass\0"),
        ),
        ("StartupMessage after login", startup_again),
        ("SSLRequest after login", startup_request(80877103, b"")),
        (
            "type byte 0xff with a huge length",
            vec![0xff, 0x7f, 0xff, 0xff, 0xff],
        ),
        ("unknown type after a good query", {
            let mut b = Vec::new();
            Frontend::query("SELECT 1").encode(&mut b);
            b.extend(tagged(b'!', b""));
            b
        }),
    ];
    for (what, bytes) in cases {
        let direct = after_login(cluster().addr(), &bytes, what).await;
        let proxied = after_login(addr, &bytes, what).await;
        let error = direct.last().expect("PostgreSQL answers");
        assert_eq!(
            error_triple(error).1,
            "08P01",
            "{what}: PostgreSQL says {direct:?}"
        );
        assert_eq!(summary(&direct), summary(&proxied), "{what}");
        witness.check().await;
    }
    fresh_client_works(addr).await;
    witness.finish().await;
    proxy.shutdown().await;
}

/// An unknown message type while the server waits for COPY data: the client gets what
/// PostgreSQL gives it — the COPY fails with an ERROR ("unexpected message type 0x21 during
/// COPY from stdin"), then PostgreSQL, reading the message's length as the next message, ends
/// the connection (FATAL 08P01 "terminating connection because protocol synchronization was
/// lost") — and nothing more; the pool's server is not handed on in the middle of a COPY.
#[tokio::test]
async fn an_unknown_message_type_during_copy_in() {
    let proxy = start_pgmemo(test_config(PoolMode::Transaction, 1)).await;
    let addr = proxy.local_addr();
    let mut bytes = Vec::new();
    Frontend::query("CREATE TEMP TABLE copy_garbage_t (a int)").encode(&mut bytes);
    Frontend::query("COPY copy_garbage_t FROM STDIN").encode(&mut bytes);
    Frontend::copy_data(b"1\n").encode(&mut bytes);
    bytes.extend(tagged(b'!', b""));
    let garbage = tagged(b'!', b"");
    // All in one write, and the bad message alone once the server asked for data.
    for split in [false, true] {
        let mut transcripts = Vec::new();
        for target in [cluster().addr(), addr] {
            let mut client = login(target).await;
            let mut seen = Vec::new();
            if split {
                client
                    .send_raw(&bytes[..bytes.len() - garbage.len()])
                    .await
                    .unwrap();
                seen = client.recv_until_tag(b'G').await.unwrap();
                client.send_raw(&garbage).await.unwrap();
            } else {
                client.send_raw(&bytes).await.unwrap();
            }
            seen.extend(until_closed(&mut client, "garbage during COPY").await);
            transcripts.push(summary(&seen));
        }
        assert_eq!(
            transcripts[0], transcripts[1],
            "directly, then through pgmemo (split: {split})"
        );
        assert!(
            transcripts[0].iter().any(|m| m.contains("08P01")),
            "{:?}",
            transcripts[0]
        );
        fresh_client_works(addr).await;
    }
    proxy.shutdown().await;
}

/// Lengths that cannot be: below 4, over pgmemo's max_message_size, over PostgreSQL's limit
/// for short messages. PostgreSQL hangs up without a word (it only logs "invalid message
/// length"); pgmemo tells the client why, with 08P01, and hangs up too.
#[tokio::test]
async fn impossible_message_lengths() {
    let proxy = proxy().await;
    let addr = proxy.local_addr();
    let mut witness = Witness::start(addr).await;
    let header = |tag: u8, len: u32| {
        let mut b = vec![tag];
        b.extend(len.to_be_bytes());
        b
    };
    let over_limit = {
        let mut b = header(b'Q', (MAX_MESSAGE + 1) as u32);
        b.extend(vec![b'x'; MAX_MESSAGE - 4]);
        b.push(0);
        b
    };
    let cases: Vec<(&str, Vec<u8>, bool)> = vec![
        // (case, bytes, PostgreSQL rejects it too)
        ("length 3", header(b'Q', 3), true),
        ("length 0", header(b'S', 0), true),
        ("length 2^31-1, no body", header(b'Q', 0x7fff_ffff), true),
        (
            "over max_message_size, header only",
            header(b'P', 1 << 20),
            false,
        ),
        ("over max_message_size, whole message", over_limit, false),
        (
            "Sync over PostgreSQL's short-message limit",
            header(b'S', PG_SMALL_MESSAGE_LIMIT as u32 + 1),
            true,
        ),
    ];
    for (what, bytes, postgres_too) in cases {
        let proxied = after_login(addr, &bytes, what).await;
        let message = assert_fatal(&proxied, "08P01", what);
        assert!(message.contains("length"), "{what}: {message}");
        if postgres_too {
            let direct = after_login(cluster().addr(), &bytes, what).await;
            assert_eq!(direct, vec![], "{what}: PostgreSQL hangs up silently");
        }
        witness.check().await;
    }
    // With the default max_message_size (64 MiB), the messages PostgreSQL holds to 10000
    // bytes are still refused by pgmemo itself, not forwarded to cost a server connection.
    let roomy = start_pgmemo(test_config(PoolMode::Transaction, 2)).await;
    for tag in [b'D', b'E', b'C', b'H', b'S', b'X', b'c', b'f'] {
        let what = format!("{:?} of {} bytes", tag as char, PG_SMALL_MESSAGE_LIMIT + 1);
        let bytes = header(tag, PG_SMALL_MESSAGE_LIMIT as u32 + 1);
        let direct = after_login(cluster().addr(), &bytes, &what).await;
        assert_eq!(direct, vec![], "{what}: PostgreSQL hangs up silently");
        let proxied = after_login(roomy.local_addr(), &bytes, &what).await;
        assert_fatal(&proxied, "08P01", &what);
        witness.check().await;
    }
    // At the limit it is a message like any other (here a Sync with a body, which PostgreSQL
    // itself then rejects as malformed).
    let mut at_limit = header(b'S', PG_SMALL_MESSAGE_LIMIT as u32);
    at_limit.extend(vec![0; PG_SMALL_MESSAGE_LIMIT - 4]);
    let mut client = login(roomy.local_addr()).await;
    client.send_raw(&at_limit).await.unwrap();
    let replies = client.recv_until_ready(1).await.unwrap();
    assert_eq!(
        replies[0].field(b'C').as_deref(),
        Some("08P01"),
        "{replies:?}"
    );
    assert_eq!(
        replies[0].field(b'S').as_deref(),
        Some("ERROR"),
        "{replies:?}"
    );
    fresh_client_works(roomy.local_addr()).await;
    roomy.shutdown().await;
    fresh_client_works(addr).await;
    witness.finish().await;
    proxy.shutdown().await;
}

/// A message that stops in the middle (the client sends part of it and closes its side): the
/// session ends quietly, as with PostgreSQL, and nothing is left behind.
#[tokio::test]
async fn truncated_messages() {
    let proxy = proxy().await;
    let addr = proxy.local_addr();
    let mut witness = Witness::start(addr).await;
    let mut full = Vec::new();
    Frontend::query("SELECT 'never complete'").encode(&mut full);
    for (what, in_transaction) in [("outside a transaction", false), ("inside one", true)] {
        for target in [cluster().addr(), addr] {
            let mut client = login(target).await;
            if in_transaction {
                client.send(&[Frontend::query("BEGIN")]).await.unwrap();
                client.recv_until_ready(1).await.unwrap();
            }
            client.send_raw(&full[..full.len() - 5]).await.unwrap();
            client.shutdown_write().await.unwrap();
            let after = until_closed(&mut client, what).await;
            assert_eq!(after, vec![], "{what} ({target})");
        }
        witness.check().await;
    }
    fresh_client_works(addr).await;
    witness.finish().await;
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// After login: malformed messages that PostgreSQL answers itself
// ---------------------------------------------------------------------------------------------

fn be_i16(v: i16) -> Vec<u8> {
    v.to_be_bytes().to_vec()
}

fn be_i32(v: i32) -> Vec<u8> {
    v.to_be_bytes().to_vec()
}

/// Well-framed messages whose contents are wrong: PostgreSQL reports an ERROR (08P01 and
/// others) and carries on; through pgmemo the transcript must be the same, and the session
/// and the server stay usable.
#[tokio::test]
async fn malformed_message_bodies_match_postgres() {
    use Step::{Expect, Send};
    let proxy = proxy().await;
    let addr = proxy.local_addr();
    let mut witness = Witness::start(addr).await;
    let raw = |tag: u8, body: Vec<u8>| Frontend::Raw(tagged(tag, &body));
    let parse_two_types_one_given = {
        let mut b = b"\0SELECT $1, $2\0".to_vec();
        b.extend(be_i16(2));
        b.extend(be_i32(23));
        b
    };
    let bind_negative_count = {
        let mut b = b"\0\0".to_vec();
        b.extend(be_i16(-1));
        b
    };
    let bind_value_past_end = {
        let mut b = b"\0\0".to_vec();
        b.extend(be_i16(0));
        b.extend(be_i16(1));
        b.extend(be_i32(100));
        b.extend(b"short");
        b
    };
    let function_call_short = be_i32(177);
    let scripts: Vec<(&str, Vec<Step>)> = vec![
        (
            "Query without its terminator",
            vec![Send(vec![raw(b'Q', b"SELECT 1".to_vec())]), Expect(1)],
        ),
        (
            "Query with an empty body",
            vec![Send(vec![raw(b'Q', Vec::new())]), Expect(1)],
        ),
        (
            "Query with bytes after the terminator",
            vec![Send(vec![raw(b'Q', b"SELECT 1\0junk".to_vec())]), Expect(1)],
        ),
        (
            "Parse with fewer parameter types than announced",
            vec![
                Send(vec![raw(b'P', parse_two_types_one_given), Frontend::Sync]),
                Expect(1),
            ],
        ),
        (
            "Bind with a negative parameter count",
            vec![
                Send(vec![
                    Frontend::parse("", "SELECT 1", &[]),
                    raw(b'B', bind_negative_count),
                    Frontend::Sync,
                ]),
                Expect(1),
            ],
        ),
        (
            "Bind with a value longer than the message",
            vec![
                Send(vec![
                    Frontend::parse("", "SELECT $1::text", &[]),
                    raw(b'B', bind_value_past_end),
                    Frontend::execute("", 0),
                    Frontend::Sync,
                ]),
                Expect(1),
            ],
        ),
        (
            "Describe of an unknown kind",
            vec![
                Send(vec![raw(b'D', b"Xname\0".to_vec()), Frontend::Sync]),
                Expect(1),
            ],
        ),
        (
            "Close of an unknown kind",
            vec![
                Send(vec![raw(b'C', b"Qname\0".to_vec()), Frontend::Sync]),
                Expect(1),
            ],
        ),
        (
            "Execute with trailing bytes",
            vec![
                Send(vec![
                    Frontend::parse("", "SELECT 1", &[]),
                    Frontend::bind("", "", &[]),
                    raw(b'E', b"\0\0\0\0\0extra".to_vec()),
                    Frontend::Sync,
                ]),
                Expect(1),
            ],
        ),
        (
            "Sync with a body",
            vec![Send(vec![raw(b'S', b"body".to_vec())]), Expect(1)],
        ),
        (
            "Flush with a body, then a query that is skipped, then Sync",
            vec![
                Send(vec![raw(b'H', b"body".to_vec())]),
                Step::RecvN(1),
                Send(vec![Frontend::query("SELECT 'skipped'"), Frontend::Sync]),
                Expect(1),
            ],
        ),
        (
            "FunctionCall cut short",
            vec![Send(vec![raw(b'F', function_call_short)]), Expect(1)],
        ),
        (
            "COPY messages outside COPY are ignored",
            vec![
                Send(vec![
                    Frontend::copy_data(b"stray\n"),
                    Frontend::CopyDone,
                    Frontend::CopyFail("stray".into()),
                    Frontend::query("SELECT 'after strays'"),
                ]),
                Expect(1),
            ],
        ),
    ];
    let mut failures = Vec::new();
    for (what, mut script) in scripts {
        // Each script ends with a query, to show that the session is still usable.
        script.extend([
            Send(vec![Frontend::query("SELECT 'still usable'")]),
            Expect(1),
        ]);
        let runs = differential(
            &[cluster().addr(), addr],
            PGMEMO_USER,
            Some(PGMEMO_PASS),
            TEST_DB,
            &script,
        )
        .await;
        assert!(
            runs[0].iter().any(|l| l.contains("ErrorResponse"))
                || what.starts_with("COPY messages"),
            "{what}: PostgreSQL did not object: {:?}",
            runs[0]
        );
        if let Some(d) = diff(&runs[0], &runs[1]) {
            failures.push(format!("{what}: {d}"));
        }
        witness.check().await;
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    fresh_client_works(addr).await;
    witness.finish().await;
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Start-up
// ---------------------------------------------------------------------------------------------

/// One step of a client that misbehaves before it logs in (see
/// [`malformed_startups_are_answered_as_by_postgres`]).
enum Act {
    /// Sends these bytes.
    Send(Vec<u8>),
    /// Reads the one-byte answer to an SSLRequest or GSSENCRequest before going on, as a
    /// client does.
    Answer,
    /// Closes the sending half: the server reads the end of the stream.
    Close,
}

/// Where a start-up case is sent: over TCP, or over a Unix socket.
enum Target {
    Tcp(SocketAddr),
    Unix(std::path::PathBuf),
}

/// Every byte `target` sends a client that connects and does `acts`, up to its closing the
/// connection (a reset counts as closed); an error when it stays open [`RECV_TIMEOUT`] after
/// the last byte, so that a case never hangs.
async fn startup_transcript(target: &Target, acts: &[Act]) -> Result<Vec<u8>, String> {
    match target {
        Target::Tcp(addr) => {
            let stream = TcpStream::connect(*addr).await.map_err(|e| e.to_string())?;
            act_and_read(stream, acts).await
        }
        Target::Unix(path) => {
            let stream = tokio::net::UnixStream::connect(path)
                .await
                .map_err(|e| e.to_string())?;
            act_and_read(stream, acts).await
        }
    }
}

/// Does `acts` on `stream`, then reads until the server closes it (see
/// [`startup_transcript`]). A server that hung up early stops the acts: what it sent is read.
async fn act_and_read<S>(mut stream: S, acts: &[Act]) -> Result<Vec<u8>, String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    for act in acts {
        let done = match act {
            Act::Send(bytes) => stream.write_all(bytes).await,
            Act::Answer => {
                let read = timeout(RECV_TIMEOUT, stream.read(&mut chunk[..1])).await;
                let read = read.map_err(|_| format!("no answer within {RECV_TIMEOUT:?}"))?;
                read.map(|n| got.extend_from_slice(&chunk[..n]))
            }
            Act::Close => stream.shutdown().await,
        };
        if done.is_err() {
            break;
        }
    }
    loop {
        let read = timeout(RECV_TIMEOUT, stream.read(&mut chunk))
            .await
            .map_err(|_| {
                let got = got.escape_ascii();
                format!("still open after {RECV_TIMEOUT:?}, having sent \"{got}\"")
            })?;
        match read {
            Ok(0) => return Ok(got),
            Ok(n) => got.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(got),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// What a server sent during start-up, in pieces to compare byte for byte: each message
/// (an ErrorResponse without the fields that name PostgreSQL's source: F file, L line, R
/// routine) and each run of bytes outside any message (the answer to an SSLRequest or a
/// GSSENCRequest, a protocol 2.0 error), escaped.
fn startup_pieces(bytes: &[u8]) -> Vec<String> {
    let mut pieces = Vec::new();
    let mut loose = Vec::new();
    let mut rest = bytes;
    while let Some(&tag) = rest.first() {
        let len = match rest.get(1..5) {
            Some(l) => u32::from_be_bytes([l[0], l[1], l[2], l[3]]) as usize,
            None => usize::MAX,
        };
        if !tag.is_ascii_alphabetic() || !(4..rest.len()).contains(&len) {
            loose.push(tag);
            rest = &rest[1..];
            continue;
        }
        if !loose.is_empty() {
            pieces.push(format!("bytes \"{}\"", loose.escape_ascii()));
            loose.clear();
        }
        let mut body = rest[5..len + 1].to_vec();
        if tag == b'E' {
            // Fields are a code and a NUL-terminated value; the body ends with a NUL.
            body = body
                .split_inclusive(|&b| b == 0)
                .filter(|field| !matches!(field.first(), Some(b'F' | b'L' | b'R')))
                .flatten()
                .copied()
                .collect();
        }
        let mut message = vec![tag];
        message.extend((body.len() as u32 + 4).to_be_bytes());
        message.extend(body);
        pieces.push(format!("message \"{}\"", message.escape_ascii()));
        rest = &rest[len + 1..];
    }
    if !loose.is_empty() {
        pieces.push(format!("bytes \"{}\"", loose.escape_ascii()));
    }
    pieces
}

/// `first`, then `second`, in one buffer.
fn joined(first: &[u8], second: &[u8]) -> Vec<u8> {
    [first, second].concat()
}

/// An untagged start-up packet of `body`: its length word, then `body`.
fn with_length(body: &[u8]) -> Vec<u8> {
    joined(&(body.len() as u32 + 4).to_be_bytes(), body)
}

/// A protocol 3.0 StartupMessage whose parameters (and terminator, or not) are `rest`, as is.
fn v3_body(rest: &[u8]) -> Vec<u8> {
    with_length(&joined(&protocol_version(3, 0).to_be_bytes(), rest))
}

/// Start-up packets that are malformed, truncated, of a protocol version PostgreSQL does not
/// speak, or out of place after an SSLRequest or GSSENCRequest: sent to PostgreSQL and to
/// pgmemo, the bytes that come back up to the close are the same, apart from the fields of
/// PostgreSQL's errors that name its source. Where PostgreSQL closes the connection without a
/// word (it only logs "invalid length of startup packet" or "incomplete startup packet"), so
/// does pgmemo: node-postgres, which sends a Terminate where the startup packet should be when
/// a client ends at once, crashed on pgmemo's FATAL. A witness in a transaction keeps working.
///
/// This PostgreSQL is built with GSSAPI and offers GSS encryption over TCP ('G'); pgmemo
/// declines it ('N'), as PostgreSQL does on its Unix socket, where the GSSENCRequest cases
/// are sent to it.
#[tokio::test]
async fn malformed_startups_are_answered_as_by_postgres() {
    use Act::{Answer, Close, Send};
    const SSL: i32 = 80877103;
    const GSSENC: i32 = 80877104;
    const CANCEL: i32 = 80877102;
    let proxy = proxy().await;
    let addr = proxy.local_addr();
    let mut witness = Witness::start(addr).await;
    let v3 = protocol_version(3, 0);
    let user_db = [("user", PGMEMO_USER), ("database", TEST_DB)];
    let good = startup_packet(v3, &user_db);
    let no_user = startup_packet(v3, &[("database", TEST_DB)]);
    let length = |len: u32| len.to_be_bytes().to_vec();
    // At PostgreSQL's limit: 10000 bytes after the length word.
    let longest = {
        let short = startup_packet(v3, &[("application_name", "")]);
        let name = "x".repeat(10_004 - short.len());
        startup_packet(v3, &[("application_name", name.as_str())])
    };
    assert_eq!(longest.len(), 10_004);
    let ssl = startup_request(SSL, b"");
    let gssenc = startup_request(GSSENC, b"");
    let cases: Vec<(&str, Vec<Act>, Option<&str>)> = vec![
        // (case, what the client does, what PostgreSQL's answer holds; None: not a byte)
        (
            "a Terminate where the startup packet should be",
            vec![Send(tagged(b'X', b"")), Close],
            None,
        ),
        ("length 4", vec![Send(length(4))], None),
        ("length 7", vec![Send(vec![0, 0, 0, 7, 0, 3, 0])], None),
        ("length 10005", vec![Send(length(10_005))], None),
        ("length 2^32-1", vec![Send(length(u32::MAX))], None),
        ("length 10004, no user", vec![Send(longest)], Some("28000")),
        ("nothing, then the end", vec![Close], None),
        (
            "half a length, then the end",
            vec![Send(length(8)[..2].to_vec()), Close],
            None,
        ),
        (
            "half a packet, then the end",
            vec![Send(good[..good.len() / 2].to_vec()), Close],
            None,
        ),
        (
            "protocol 2.0",
            vec![Send(startup_packet(protocol_version(2, 0), &user_db))],
            Some("EFATAL:  unsupported frontend protocol 2.0"),
        ),
        (
            "protocol 1.5",
            vec![Send(startup_packet(protocol_version(1, 5), &user_db))],
            Some("unsupported frontend protocol 1.5"),
        ),
        // 0.0 is answered in the current format (PostgreSQL's "not set yet"), 0.5 in 2.0's.
        (
            "protocol 0.0, nothing more",
            vec![Send(with_length(&[0u8; 4]))],
            Some("unsupported frontend protocol 0.0"),
        ),
        (
            "protocol 0.5, nothing more",
            vec![Send(with_length(&[0, 0, 0, 5]))],
            Some("EFATAL:  unsupported frontend protocol 0.5"),
        ),
        (
            "protocol 4.0",
            vec![Send(startup_packet(protocol_version(4, 0), &user_db))],
            Some("0A000"),
        ),
        (
            "protocol 3.99 without a user",
            vec![Send(startup_packet(
                protocol_version(3, 99),
                &[("database", TEST_DB)],
            ))],
            Some("28000"),
        ),
        (
            "protocol 3.99, then the end during authentication",
            vec![
                Send(startup_packet(protocol_version(3, 99), &user_db)),
                Close,
            ],
            Some("SCRAM-SHA-256"),
        ),
        (
            "a CancelRequest four bytes short",
            vec![Send(startup_request(CANCEL, &[0, 0, 0, 0]))],
            None,
        ),
        (
            "a CancelRequest four bytes long",
            vec![Send(startup_request(CANCEL, &[0; 12]))],
            None,
        ),
        (
            "a CancelRequest for no one",
            vec![Send(startup_request(CANCEL, &[0; 8]))],
            None,
        ),
        (
            "a second SSLRequest after 'N'",
            vec![Send(ssl.clone()), Answer, Send(ssl.clone())],
            Some("unsupported frontend protocol 1234.5679"),
        ),
        (
            "an SSLRequest with bytes after its code, then another",
            vec![
                Send(startup_request(SSL, b"more")),
                Answer,
                Send(ssl.clone()),
            ],
            Some("1234.5679"),
        ),
        (
            "SSLRequest and StartupMessage in one write",
            vec![Send(joined(&ssl, &good))],
            Some("received unencrypted data after SSL request"),
        ),
        (
            "SSLRequest, then a Terminate",
            vec![Send(ssl.clone()), Answer, Send(tagged(b'X', b"")), Close],
            Some("N"),
        ),
        (
            "SSLRequest, then no user",
            vec![Send(ssl.clone()), Answer, Send(no_user.clone())],
            Some("28000"),
        ),
        ("no user", vec![Send(no_user.clone())], Some("28000")),
        (
            "an empty user",
            vec![Send(startup_packet(
                v3,
                &[("user", ""), ("database", TEST_DB)],
            ))],
            Some("no PostgreSQL user name specified in startup packet"),
        ),
        (
            "no terminator",
            vec![Send(v3_body(b"user\0pgmemo\0"))],
            Some("invalid startup packet layout"),
        ),
        (
            "bytes after the terminator",
            vec![Send(v3_body(b"user\0pgmemo\0\0junk"))],
            Some("invalid startup packet layout"),
        ),
        (
            "a replication value PostgreSQL does not read",
            vec![Send(startup_packet(
                v3,
                &[("user", PGMEMO_USER), ("replication", "maybe")],
            ))],
            Some("22023"),
        ),
        (
            "a bad replication value, then no terminator",
            vec![Send(v3_body(b"replication\0maybe\0user\0pgmemo"))],
            Some("22023"),
        ),
        // Sent to PostgreSQL over its Unix socket (see above).
        (
            "GSSENCRequest, then no user",
            vec![Send(gssenc.clone()), Answer, Send(no_user.clone())],
            Some("28000"),
        ),
        (
            "a second GSSENCRequest after 'N'",
            vec![Send(gssenc.clone()), Answer, Send(gssenc.clone())],
            Some("unsupported frontend protocol 1234.5680"),
        ),
        (
            "GSSENCRequest and StartupMessage in one write",
            vec![Send(joined(&gssenc, &good))],
            Some("received unencrypted data after GSSAPI encryption request"),
        ),
        (
            "SSLRequest, GSSENCRequest, then a second SSLRequest",
            vec![
                Send(ssl.clone()),
                Answer,
                Send(gssenc.clone()),
                Answer,
                Send(ssl.clone()),
            ],
            Some("1234.5679"),
        ),
    ];
    let socket = cluster()
        .socket_dir()
        .join(format!(".s.PGSQL.{}", cluster().port()));
    let mut failures = Vec::new();
    for (what, acts, postgres_says) in cases {
        let postgres = match what.contains("GSSENCRequest") {
            true => Target::Unix(socket.clone()),
            false => Target::Tcp(cluster().addr()),
        };
        let direct = startup_transcript(&postgres, &acts)
            .await
            .unwrap_or_else(|e| panic!("{what}: PostgreSQL: {e}"));
        let proxied = startup_transcript(&Target::Tcp(addr), &acts)
            .await
            .unwrap_or_else(|e| panic!("{what}: pgmemo: {e}"));
        let direct = as_protocol_3_0_server(direct);
        let direct_text = String::from_utf8_lossy(&direct);
        match postgres_says {
            None => assert!(direct.is_empty(), "{what}: PostgreSQL says {direct_text:?}"),
            Some(s) => assert!(
                direct_text.contains(s),
                "{what}: PostgreSQL says {direct_text:?}"
            ),
        }
        let (direct, proxied) = (startup_pieces(&direct), startup_pieces(&proxied));
        if direct != proxied {
            failures.push(format!(
                "{what}:\n  PostgreSQL: {direct:?}\n  pgmemo:     {proxied:?}"
            ));
        }
        witness.check().await;
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    fresh_client_works(addr).await;
    witness.finish().await;
    proxy.shutdown().await;
}

/// A start-up that never completes is closed by pgmemo after client_login_timeout, without
/// a word (PostgreSQL's authentication_timeout does the same).
#[tokio::test]
async fn a_startup_that_never_completes_is_closed() {
    let proxy = proxy().await;
    let addr = proxy.local_addr();
    let mut witness = Witness::start(addr).await;
    let packet = startup_packet(protocol_version(3, 0), &[("user", PGMEMO_USER)]);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("nothing at all", vec![]),
        ("half a length", packet[..2].to_vec()),
        ("half a packet", packet[..packet.len() / 2].to_vec()),
        ("a whole packet, then no password", packet.clone()),
    ];
    let mut clients = Vec::new();
    for (what, bytes) in cases {
        // Before connecting: pgmemo's clock starts when it accepts the connection.
        let started = Instant::now();
        let mut client = RawClient::open(addr).await.unwrap();
        client.send_raw(&bytes).await.unwrap();
        clients.push((what, client, started));
    }
    // All four wait at once; the witness keeps working meanwhile.
    witness.check().await;
    for (what, mut client, started) in clients {
        let msgs = until_closed(&mut client, what).await;
        let waited = started.elapsed();
        assert!(waited >= LOGIN_TIMEOUT, "{what}: closed after {waited:?}");
        if what.starts_with("a whole packet") {
            // The authentication request went out before the wait began.
            assert_eq!(msgs.len(), 1, "{msgs:?}");
            assert_eq!(msgs[0].tag, b'R');
        } else {
            assert_eq!(msgs, vec![], "{what}");
        }
    }
    witness.check().await;
    fresh_client_works(addr).await;
    witness.finish().await;
    proxy.shutdown().await;
}

/// SSLRequest and GSSENCRequest without TLS configured: 'N', then the start-up goes on in
/// plain text, as with this PostgreSQL (ssl = off). (A PostgreSQL built with GSSAPI offers
/// GSS encryption, 'G'; pgmemo never does.)
#[tokio::test]
async fn encryption_requests_without_tls_are_declined() {
    let proxy = proxy().await;
    for (what, code) in [("SSLRequest", 80877103), ("GSSENCRequest", 80877104)] {
        let targets = match what {
            "SSLRequest" => vec![cluster().addr(), proxy.local_addr()],
            _ => vec![proxy.local_addr()],
        };
        for target in targets {
            let mut client = RawClient::open(target).await.unwrap();
            client.send_raw(&startup_request(code, b"")).await.unwrap();
            assert_eq!(
                client.recv_byte().await.unwrap(),
                b'N',
                "{what} to {target}"
            );
            let packet = startup_packet(
                protocol_version(3, 0),
                &[("user", PGMEMO_USER), ("database", TEST_DB)],
            );
            client.send_raw(&packet).await.unwrap();
            // The server then asks for the password.
            let auth = client.recv().await.unwrap();
            assert_eq!(auth.tag, b'R', "{what} to {target}: {auth:?}");
        }
    }
    proxy.shutdown().await;
}

/// Messages out of place during authentication: PostgreSQL expects a password message and
/// gets something else. Both say so with FATAL 08P01 and hang up.
#[tokio::test]
async fn wrong_messages_during_authentication() {
    let proxy = proxy().await;
    let addr = proxy.local_addr();
    let mut witness = Witness::start(addr).await;
    let packet = startup_packet(
        protocol_version(3, 0),
        &[("user", PGMEMO_USER), ("database", TEST_DB)],
    );
    let mut query = Vec::new();
    Frontend::query("SELECT 1").encode(&mut query);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("a Query instead of SASLInitialResponse", query),
        (
            "SASLInitialResponse with an unknown mechanism",
            tagged(b'p', b"SCRAM-MD4\0\xff\xff\xff\xff"),
        ),
        (
            "SASLInitialResponse cut short",
            tagged(b'p', b"SCRAM-SHA-256\0\0\0\0\x20n,,n=,r="),
        ),
        (
            "SASLInitialResponse with garbage",
            tagged(b'p', b"SCRAM-SHA-256\0\0\0\0\x04junk"),
        ),
    ];
    for (what, bytes) in cases {
        let mut outcomes = Vec::new();
        for target in [cluster().addr(), addr] {
            let mut client = RawClient::open(target).await.unwrap();
            client.send_raw(&packet).await.unwrap();
            let auth = client.recv().await.unwrap();
            assert_eq!(auth.tag, b'R', "{what}");
            client.send_raw(&bytes).await.unwrap();
            let msgs = until_closed(&mut client, what).await;
            assert_fatal(&msgs, "08P01", &format!("{what} ({target})"));
            outcomes.push(summary(&msgs));
        }
        assert_eq!(outcomes[0], outcomes[1], "{what}");
        witness.check().await;
    }
    fresh_client_works(addr).await;
    witness.finish().await;
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Unknown database, server down
// ---------------------------------------------------------------------------------------------

/// A database that does not exist: 3D000, whether pgmemo would serve it from the server
/// (which then refuses it) or does not serve it at all.
#[tokio::test]
async fn unknown_database() {
    let nope = "no_such_database";
    // Served from the server: PostgreSQL's own refusal reaches the client.
    let from_server = proxy().await;
    // Only the test database is configured: pgmemo refuses by itself.
    let mut listed = config();
    listed.databases = BTreeMap::from([(TEST_DB.to_string(), DatabaseConfig::default())]);
    let listed = start_pgmemo(listed).await;
    let mut witness = Witness::start(from_server.local_addr()).await;

    let packet = startup_packet(
        protocol_version(3, 0),
        &[("user", PGMEMO_USER), ("database", nope)],
    );
    let mut direct = RawClient::login(cluster().addr(), &packet, PGMEMO_USER, Some(PGMEMO_PASS))
        .await
        .unwrap();
    let expected = direct.expect_error();
    assert_eq!(expected.1, "3D000");
    assert_eq!(until_closed(&mut direct.client, "direct").await, vec![]);
    for proxy in [&from_server, &listed] {
        let mut attempt =
            RawClient::login(proxy.local_addr(), &packet, PGMEMO_USER, Some(PGMEMO_PASS))
                .await
                .unwrap();
        assert_eq!(attempt.expect_error(), expected);
        assert_eq!(
            until_closed(&mut attempt.client, "through pgmemo").await,
            vec![]
        );
        witness.check().await;
        // Asking again gets the same answer (nothing cached wrongly, no pool left broken).
        let mut again =
            RawClient::login(proxy.local_addr(), &packet, PGMEMO_USER, Some(PGMEMO_PASS))
                .await
                .unwrap();
        assert_eq!(again.expect_error(), expected);
        assert_eq!(until_closed(&mut again.client, "again").await, vec![]);
        fresh_client_works(proxy.local_addr()).await;
    }
    witness.finish().await;
    from_server.shutdown().await;
    listed.shutdown().await;
}

/// A TCP forwarder to the test cluster on a given port, standing in for a server that comes
/// and goes. Stopping it closes the port and every forwarded connection.
struct Forwarder {
    tasks: Arc<parking_lot::Mutex<Vec<JoinHandle<()>>>>,
}

impl Forwarder {
    async fn start(port: u16) -> Forwarder {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap_or_else(|e| panic!("binding the forwarder to port {port}: {e}"));
        let tasks: Arc<parking_lot::Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let registry = tasks.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                let conn = tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(cluster().addr()).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                registry.lock().push(conn);
            }
        });
        tasks.lock().push(accept);
        Forwarder { tasks }
    }

    /// Stops accepting and closes every forwarded connection; returns once all are closed.
    async fn stop(self) {
        let tasks: Vec<JoinHandle<()>> = self.tasks.lock().drain(..).collect();
        for task in tasks {
            task.abort();
            let _ = task.await;
        }
    }
}

/// Logs in to `database` through pgmemo and runs a query; returns the error (severity,
/// SQLSTATE, message) if any step fails, and how long it took.
async fn try_database(
    addr: SocketAddr,
    database: &str,
) -> (Result<(), (String, String, String)>, Duration) {
    let started = Instant::now();
    let packet = startup_packet(
        protocol_version(3, 0),
        &[("user", PGMEMO_USER), ("database", database)],
    );
    let mut login = RawClient::login(addr, &packet, PGMEMO_USER, Some(PGMEMO_PASS))
        .await
        .expect("pgmemo answers the login");
    if !login.ready {
        let error = login.expect_error();
        assert_eq!(until_closed(&mut login.client, database).await, vec![]);
        return (Err(error), started.elapsed());
    }
    login
        .client
        .send(&[Frontend::query("SELECT current_database()")])
        .await
        .unwrap();
    let replies = login.client.recv_until_ready(1).await;
    let result = match replies {
        Ok(msgs) => match msgs.iter().find(|m| m.is_error()) {
            Some(e) => Err(error_triple(e)),
            None => {
                let row = msgs.iter().find_map(|m| m.data_row()).expect("a row");
                assert_eq!(row[0].as_deref(), Some(TEST_DB.as_bytes()));
                Ok(())
            }
        },
        Err(e) => panic!("{database}: no answer: {e:#}"),
    };
    (result, started.elapsed())
}

fn assert_down(outcome: (Result<(), (String, String, String)>, Duration), phase: &str) {
    let (result, took) = outcome;
    let (severity, code, message) = result.expect_err(phase);
    assert_eq!(
        (severity.as_str(), code.as_str()),
        ("FATAL", "08006"),
        "{phase}: {message}"
    );
    assert!(message.contains("connect"), "{phase}: {message}");
    assert!(
        took < CONNECT_TIMEOUT + Duration::from_secs(3),
        "{phase}: the error came after {took:?}"
    );
}

/// A database whose server is down: clients get a clear error within server_connect_timeout
/// (not a hang), clients of other databases are not affected, and pgmemo recovers by itself
/// when the server is back, also after it went away again with connections in the pool.
#[tokio::test]
async fn upstream_down_and_back() {
    let down_port = free_port();
    let mut config = config();
    config.databases = BTreeMap::from([
        ("*".to_string(), DatabaseConfig::default()),
        (
            "flaky".to_string(),
            DatabaseConfig {
                port: Some(down_port),
                dbname: Some(TEST_DB.to_string()),
                ..DatabaseConfig::default()
            },
        ),
    ]);
    let proxy = start_pgmemo(config).await;
    let addr = proxy.local_addr();
    let mut witness = Witness::start(addr).await;

    // Down from the start: the login itself needs a server.
    assert_down(try_database(addr, "flaky").await, "down at first login");
    witness.check().await;
    assert_down(try_database(addr, "flaky").await, "still down");

    // Back: pgmemo connects again by itself.
    let forwarder = Forwarder::start(down_port).await;
    try_database(addr, "flaky").await.0.expect("server back");
    let mut settled = login_to(addr, "flaky").await;
    witness.check().await;

    // Gone again, with a connection idle in the pool: a logged-in client's next query fails
    // cleanly within the timeout. (Whether pgmemo notices that the idle connection died
    // before it hands it out, and then fails to connect, or only when it is used, depends on
    // timing; either way it is a FATAL connection failure.)
    forwarder.stop().await;
    settled
        .send(&[Frontend::query("SELECT current_database()")])
        .await
        .unwrap();
    let started = Instant::now();
    let msgs = until_closed(&mut settled, "query while down").await;
    assert_fatal(&msgs, "08006", "query while down");
    assert!(started.elapsed() < CONNECT_TIMEOUT + Duration::from_secs(3));
    witness.check().await;

    // And back once more.
    let forwarder = Forwarder::start(down_port).await;
    try_database(addr, "flaky")
        .await
        .0
        .expect("server back again");
    fresh_client_works(addr).await;
    witness.finish().await;
    forwarder.stop().await;
    proxy.shutdown().await;
}

async fn login_to(addr: SocketAddr, database: &str) -> RawClient {
    RawClient::connect(addr, PGMEMO_USER, database, Some(PGMEMO_PASS), &[])
        .await
        .unwrap_or_else(|e| panic!("login to {database}: {e:#}"))
}

/// What a server that speaks protocol 3.0 at most (PostgreSQL 15-17) answers where PostgreSQL
/// `direct` (18, which speaks 3.2) said `bytes`: pgmemo speaks 3.0 to its clients and
/// negotiates down to it as those servers do (README, "PostgreSQL versions"). Its refusal
/// names "3.0 to 3.0", its NegotiateProtocolVersion offers 3.0. Unchanged before 18.
fn as_protocol_3_0_server(bytes: Vec<u8>) -> Vec<u8> {
    if cluster().version_num() < 180000 {
        return bytes;
    }
    // The same length: the message's length field stays right.
    let refusal = |mut b: Vec<u8>| {
        let (from, to) = (b"server supports 3.0 to 3.2", b"server supports 3.0 to 3.0");
        if let Some(at) = b.windows(from.len()).position(|w| w == from) {
            b[at..at + to.len()].copy_from_slice(to);
        }
        b
    };
    // NegotiateProtocolVersion: 'v', its length, then the newest version offered (3.2).
    let offer = [b'v', 0, 0, 0];
    match bytes.windows(4).position(|w| w == offer) {
        Some(at) if bytes.get(at + 5..at + 9) == Some(&[0, 3, 0, 2]) => {
            let mut bytes = bytes;
            bytes[at + 8] = 0;
            refusal(bytes)
        }
        _ => refusal(bytes),
    }
}
