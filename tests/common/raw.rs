//! A raw PostgreSQL wire-protocol client for differential tests.
//!
//! Drivers hide the protocol: they pipeline on their own schedule, retry, and turn messages
//! into rows. To check that pgmemo answers *exactly* like PostgreSQL, a test must choose every
//! frontend message itself and see every backend message as sent. [`RawClient`] does only the
//! start-up and authentication on its own; after that, the test sends [`Frontend`] messages
//! and reads [`Backend`] messages one by one.
//!
//! Every read has a [`RECV_TIMEOUT`], so a proxy that loses a reply fails the test instead of
//! hanging it.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use bytes::{Buf, BytesMut};
use postgres_protocol::authentication::md5_hash;
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long any single read (or the whole start-up) may take before the test fails.
pub const RECV_TIMEOUT: Duration = Duration::from_secs(10);

/// Protocol version 3.0, as sent in the StartupMessage.
const PROTOCOL_VERSION: i32 = 196_608;

/// Backend messages larger than this are treated as a corrupt stream rather than buffered.
const MAX_MESSAGE_LEN: usize = 1 << 30;

/// Values longer than this are rendered as their length and a hash, so that a 20 MB row
/// neither floods a failure message nor makes the comparison any weaker.
const MAX_RENDERED_VALUE: usize = 256;

/// A frontend (client-to-server) message, after start-up.
///
/// Fields follow the protocol documentation's names. Use [`Frontend::Raw`] for bytes that are
/// deliberately not a well-formed message.
#[derive(Clone, PartialEq, Eq)]
pub enum Frontend {
    /// `Q`: a simple query, possibly several statements.
    Query(String),
    /// `P`: prepare `sql` as statement `name` (`""` is the unnamed statement).
    Parse {
        name: String,
        sql: String,
        param_types: Vec<u32>,
    },
    /// `B`: bind `statement` into `portal`. Formats follow the protocol: none means all text,
    /// one applies to all, otherwise one per parameter or column. `None` is SQL NULL.
    Bind {
        portal: String,
        statement: String,
        param_formats: Vec<i16>,
        params: Vec<Option<Vec<u8>>>,
        result_formats: Vec<i16>,
    },
    /// `D`: describe a statement (`kind` `b'S'`) or portal (`b'P'`).
    Describe { kind: u8, name: String },
    /// `E`: execute `portal`, returning at most `max_rows` rows (0 = all).
    Execute { portal: String, max_rows: i32 },
    /// `C`: close a statement (`kind` `b'S'`) or portal (`b'P'`).
    Close { kind: u8, name: String },
    /// `S`: end of an extended-query pipeline; asks for ReadyForQuery.
    Sync,
    /// `H`: asks the server to send what it has buffered, without ending the pipeline.
    Flush,
    /// `d`: COPY data.
    CopyData(Vec<u8>),
    /// `c`: end of COPY data.
    CopyDone,
    /// `f`: abort COPY FROM STDIN with this message.
    CopyFail(String),
    /// `F`: the fast-path function call interface.
    FunctionCall {
        function_oid: u32,
        arg_formats: Vec<i16>,
        args: Vec<Option<Vec<u8>>>,
        result_format: i16,
    },
    /// `X`: close the session.
    Terminate,
    /// Bytes sent exactly as given, for malformed input.
    Raw(Vec<u8>),
}

impl Frontend {
    /// A simple query.
    pub fn query(sql: &str) -> Self {
        Frontend::Query(sql.to_string())
    }

    /// Parse with explicit parameter type OIDs (0 or omitted = let the server infer).
    pub fn parse(name: &str, sql: &str, param_types: &[u32]) -> Self {
        Frontend::Parse {
            name: name.to_string(),
            sql: sql.to_string(),
            param_types: param_types.to_vec(),
        }
    }

    /// Bind with text parameters and text results, the common case.
    pub fn bind(portal: &str, statement: &str, params: &[Option<&str>]) -> Self {
        Frontend::Bind {
            portal: portal.to_string(),
            statement: statement.to_string(),
            param_formats: Vec::new(),
            params: params
                .iter()
                .map(|p| p.map(|s| s.as_bytes().to_vec()))
                .collect(),
            result_formats: Vec::new(),
        }
    }

    /// Describe a prepared statement.
    pub fn describe_statement(name: &str) -> Self {
        Frontend::Describe {
            kind: b'S',
            name: name.to_string(),
        }
    }

    /// Describe a portal.
    pub fn describe_portal(name: &str) -> Self {
        Frontend::Describe {
            kind: b'P',
            name: name.to_string(),
        }
    }

    /// Execute a portal; `max_rows` 0 means all rows.
    pub fn execute(portal: &str, max_rows: i32) -> Self {
        Frontend::Execute {
            portal: portal.to_string(),
            max_rows,
        }
    }

    /// Close a prepared statement.
    pub fn close_statement(name: &str) -> Self {
        Frontend::Close {
            kind: b'S',
            name: name.to_string(),
        }
    }

    /// Close a portal.
    pub fn close_portal(name: &str) -> Self {
        Frontend::Close {
            kind: b'P',
            name: name.to_string(),
        }
    }

    /// One CopyData message.
    pub fn copy_data(data: &[u8]) -> Self {
        Frontend::CopyData(data.to_vec())
    }

    /// Appends the wire encoding of this message to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let (tag, body) = match self {
            Frontend::Raw(bytes) => {
                out.extend_from_slice(bytes);
                return;
            }
            Frontend::Query(sql) => (b'Q', cstr(sql)),
            Frontend::Parse {
                name,
                sql,
                param_types,
            } => {
                let mut b = cstr(name);
                b.extend(cstr(sql));
                b.extend((param_types.len() as i16).to_be_bytes());
                for oid in param_types {
                    b.extend(oid.to_be_bytes());
                }
                (b'P', b)
            }
            Frontend::Bind {
                portal,
                statement,
                param_formats,
                params,
                result_formats,
            } => {
                let mut b = cstr(portal);
                b.extend(cstr(statement));
                put_formats(&mut b, param_formats);
                put_values(&mut b, params);
                put_formats(&mut b, result_formats);
                (b'B', b)
            }
            Frontend::Describe { kind, name } => {
                let mut b = vec![*kind];
                b.extend(cstr(name));
                (b'D', b)
            }
            Frontend::Execute { portal, max_rows } => {
                let mut b = cstr(portal);
                b.extend(max_rows.to_be_bytes());
                (b'E', b)
            }
            Frontend::Close { kind, name } => {
                let mut b = vec![*kind];
                b.extend(cstr(name));
                (b'C', b)
            }
            Frontend::Sync => (b'S', Vec::new()),
            Frontend::Flush => (b'H', Vec::new()),
            Frontend::CopyData(data) => (b'd', data.clone()),
            Frontend::CopyDone => (b'c', Vec::new()),
            Frontend::CopyFail(message) => (b'f', cstr(message)),
            Frontend::FunctionCall {
                function_oid,
                arg_formats,
                args,
                result_format,
            } => {
                let mut b = function_oid.to_be_bytes().to_vec();
                put_formats(&mut b, arg_formats);
                put_values(&mut b, args);
                b.extend(result_format.to_be_bytes());
                (b'F', b)
            }
            Frontend::Terminate => (b'X', Vec::new()),
        };
        out.push(tag);
        out.extend(((body.len() + 4) as i32).to_be_bytes());
        out.extend(body);
    }
}

/// Renders the message compactly, with long values shortened to their length and hash.
impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Frontend::Query(sql) => write!(f, "Query {}", text(sql)),
            Frontend::Parse {
                name,
                sql,
                param_types,
            } => write!(f, "Parse {name:?} {} types={param_types:?}", text(sql)),
            Frontend::Bind {
                portal,
                statement,
                param_formats,
                params,
                result_formats,
            } => write!(
                f,
                "Bind portal={portal:?} statement={statement:?} param_formats={param_formats:?} \
                 params=[{}] result_formats={result_formats:?}",
                values(params)
            ),
            Frontend::Describe { kind, name } => {
                write!(f, "Describe {} {name:?}", *kind as char)
            }
            Frontend::Execute { portal, max_rows } => {
                write!(f, "Execute {portal:?} max_rows={max_rows}")
            }
            Frontend::Close { kind, name } => write!(f, "Close {} {name:?}", *kind as char),
            Frontend::Sync => f.write_str("Sync"),
            Frontend::Flush => f.write_str("Flush"),
            Frontend::CopyData(data) => write!(f, "CopyData {}", value(data)),
            Frontend::CopyDone => f.write_str("CopyDone"),
            Frontend::CopyFail(message) => write!(f, "CopyFail {message:?}"),
            Frontend::FunctionCall {
                function_oid,
                arg_formats,
                args,
                result_format,
            } => write!(
                f,
                "FunctionCall oid={function_oid} arg_formats={arg_formats:?} args=[{}] \
                 result_format={result_format}",
                values(args)
            ),
            Frontend::Terminate => f.write_str("Terminate"),
            Frontend::Raw(bytes) => write!(f, "Raw {}", value(bytes)),
        }
    }
}

impl fmt::Debug for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

fn cstr(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

fn put_formats(b: &mut Vec<u8>, formats: &[i16]) {
    b.extend((formats.len() as i16).to_be_bytes());
    for format in formats {
        b.extend(format.to_be_bytes());
    }
}

fn put_values(b: &mut Vec<u8>, values: &[Option<Vec<u8>>]) {
    b.extend((values.len() as i16).to_be_bytes());
    for v in values {
        match v {
            None => b.extend((-1i32).to_be_bytes()),
            Some(bytes) => {
                b.extend((bytes.len() as i32).to_be_bytes());
                b.extend(bytes);
            }
        }
    }
}

/// One backend (server-to-client) message: its type byte and its body (without the length).
///
/// `Display` (and `Debug`) decode the common message types into one readable line; see
/// [`Backend::render`].
#[derive(Clone, PartialEq, Eq)]
pub struct Backend {
    pub tag: u8,
    pub body: Vec<u8>,
}

/// What [`Backend::render`] should replace because it legitimately differs between two
/// connections; see `normalize` in the differential module for the policy.
pub trait Rewrite {
    /// Replaces a backend process id (BackendKeyData, NotificationResponse).
    fn pid(&mut self, pid: i32) -> String;
    /// Replaces a cancellation secret key (BackendKeyData).
    fn secret(&mut self, key: i32) -> String;
    /// Replaces an object OID (table and type OIDs in descriptions).
    fn oid(&mut self, oid: u32) -> String;
}

/// The identity rewrite, used by `Display`.
struct Verbatim;

impl Rewrite for Verbatim {
    fn pid(&mut self, pid: i32) -> String {
        pid.to_string()
    }
    fn secret(&mut self, key: i32) -> String {
        key.to_string()
    }
    fn oid(&mut self, oid: u32) -> String {
        oid.to_string()
    }
}

impl Backend {
    /// The message's name in the protocol documentation.
    pub fn name(&self) -> &'static str {
        match self.tag {
            b'R' => "Authentication",
            b'K' => "BackendKeyData",
            b'2' => "BindComplete",
            b'3' => "CloseComplete",
            b'C' => "CommandComplete",
            b'd' => "CopyData",
            b'c' => "CopyDone",
            b'G' => "CopyInResponse",
            b'H' => "CopyOutResponse",
            b'W' => "CopyBothResponse",
            b'D' => "DataRow",
            b'I' => "EmptyQueryResponse",
            b'E' => "ErrorResponse",
            b'V' => "FunctionCallResponse",
            b'v' => "NegotiateProtocolVersion",
            b'n' => "NoData",
            b'N' => "NoticeResponse",
            b'A' => "NotificationResponse",
            b't' => "ParameterDescription",
            b'S' => "ParameterStatus",
            b'1' => "ParseComplete",
            b's' => "PortalSuspended",
            b'Z' => "ReadyForQuery",
            b'T' => "RowDescription",
            _ => "Unknown",
        }
    }

    /// Whether this is an ErrorResponse.
    pub fn is_error(&self) -> bool {
        self.tag == b'E'
    }

    /// The (code, value) fields of an ErrorResponse or NoticeResponse, in wire order.
    pub fn fields(&self) -> Option<Vec<(u8, String)>> {
        if self.tag != b'E' && self.tag != b'N' {
            return None;
        }
        let mut r = Reader(&self.body);
        let mut fields = Vec::new();
        loop {
            let code = r.u8()?;
            if code == 0 {
                return Some(fields);
            }
            fields.push((code, r.cstr()?));
        }
    }

    /// One field of an ErrorResponse or NoticeResponse, e.g. `b'C'` for the SQLSTATE.
    pub fn field(&self, code: u8) -> Option<String> {
        self.fields()?
            .into_iter()
            .find(|(c, _)| *c == code)
            .map(|(_, v)| v)
    }

    /// The command tag of a CommandComplete, e.g. `"SELECT 1"`.
    pub fn command_tag(&self) -> Option<String> {
        (self.tag == b'C').then(|| Reader(&self.body).cstr())?
    }

    /// The transaction status of a ReadyForQuery: `b'I'`, `b'T'` or `b'E'`.
    pub fn ready_status(&self) -> Option<u8> {
        (self.tag == b'Z').then(|| self.body.first().copied())?
    }

    /// The name and value of a ParameterStatus.
    pub fn parameter_status(&self) -> Option<(String, String)> {
        if self.tag != b'S' {
            return None;
        }
        let mut r = Reader(&self.body);
        Some((r.cstr()?, r.cstr()?))
    }

    /// The column values of a DataRow; `None` is SQL NULL.
    pub fn data_row(&self) -> Option<Vec<Option<Vec<u8>>>> {
        if self.tag != b'D' {
            return None;
        }
        let mut r = Reader(&self.body);
        let n = r.i16()?;
        (0..n).map(|_| r.value()).collect()
    }

    /// One line describing the message, with pids, secret keys and OIDs passed through
    /// `rewrite`. Falls back to a hex dump when a body does not decode.
    pub fn render(&self, rewrite: &mut dyn Rewrite) -> String {
        self.decode(rewrite)
            .unwrap_or_else(|| format!("{} (undecodable) {}", self.name(), value(&self.body)))
    }

    fn decode(&self, rw: &mut dyn Rewrite) -> Option<String> {
        let mut r = Reader(&self.body);
        let name = self.name();
        let line = match self.tag {
            b'E' | b'N' => {
                let fields: Vec<String> = self
                    .fields()?
                    .into_iter()
                    .map(|(code, v)| format!("{}={v:?}", code as char))
                    .collect();
                format!("{name} {{ {} }}", fields.join(", "))
            }
            b'T' => {
                let n = r.i16()?;
                let mut columns = Vec::new();
                for _ in 0..n {
                    let column = r.cstr()?;
                    let table = r.u32()?;
                    let attnum = r.i16()?;
                    let type_oid = r.u32()?;
                    let len = r.i16()?;
                    let typmod = r.i32()?;
                    let format = r.i16()?;
                    columns.push(format!(
                        "{column:?} table={} col={attnum} type={} len={len} typmod={typmod} \
                         format={format}",
                        rw.oid(table),
                        rw.oid(type_oid)
                    ));
                }
                format!("{name} [{}]", columns.join("; "))
            }
            b't' => {
                let n = r.i16()?;
                let types = (0..n)
                    .map(|_| r.u32().map(|oid| rw.oid(oid)))
                    .collect::<Option<Vec<_>>>()?;
                format!("{name} [{}]", types.join(", "))
            }
            b'D' => format!("{name} [{}]", values(&self.data_row()?)),
            b'C' => format!("{name} {:?}", r.cstr()?),
            b'Z' => format!("{name} {}", r.u8()? as char),
            b'S' => format!("{name} {}={:?}", r.cstr()?, r.cstr()?),
            b'K' => {
                let (pid, key) = (r.i32()?, r.i32()?);
                format!("{name} pid={} key={}", rw.pid(pid), rw.secret(key))
            }
            b'A' => {
                let pid = r.i32()?;
                format!(
                    "{name} pid={} channel={:?} payload={:?}",
                    rw.pid(pid),
                    r.cstr()?,
                    r.cstr()?
                )
            }
            b'G' | b'H' | b'W' => {
                let format = r.u8()?;
                let n = r.i16()?;
                let columns = (0..n).map(|_| r.i16()).collect::<Option<Vec<_>>>()?;
                format!("{name} format={format} columns={columns:?}")
            }
            b'd' => format!("{name} {}", value(&self.body)),
            b'V' => format!("{name} {}", opt_value(&r.value()?)),
            b'R' => {
                let code = r.i32()?;
                format!("{name} code={code} {}", value(std::mem::take(&mut r.0)))
            }
            b'v' => {
                let minor = r.i32()?;
                let n = r.i32()?;
                let options = (0..n).map(|_| r.cstr()).collect::<Option<Vec<_>>>()?;
                format!("{name} minor={minor} unrecognized={options:?}")
            }
            b'1' | b'2' | b'3' | b'c' | b'I' | b'n' | b's' if self.body.is_empty() => {
                name.to_string()
            }
            _ => return None,
        };
        // A decoder that stops early would hide trailing garbage; show it instead.
        let decoded_whole_body = matches!(self.tag, b'E' | b'N' | b'D' | b'd');
        if r.0.is_empty() || decoded_whole_body {
            Some(line)
        } else {
            Some(format!("{line} (trailing {})", value(r.0)))
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render(&mut Verbatim))
    }
}

impl fmt::Debug for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A cursor over a message body; every read returns `None` when the body is too short.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn i16(&mut self) -> Option<i16> {
        self.take(2).map(|b| i16::from_be_bytes([b[0], b[1]]))
    }
    fn i32(&mut self) -> Option<i32> {
        self.take(4)
            .map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u32(&mut self) -> Option<u32> {
        self.i32().map(|v| v as u32)
    }
    fn cstr(&mut self) -> Option<String> {
        let end = self.0.iter().position(|&b| b == 0)?;
        let s = String::from_utf8_lossy(&self.0[..end]).into_owned();
        self.0 = &self.0[end + 1..];
        Some(s)
    }
    /// A length-prefixed value, where length -1 is NULL.
    fn value(&mut self) -> Option<Option<Vec<u8>>> {
        let len = self.i32()?;
        if len < 0 {
            return Some(None);
        }
        self.take(len as usize).map(|b| Some(b.to_vec()))
    }
}

/// Renders a value: quoted text when it is printable UTF-8, `0x…` hex otherwise, and
/// `<N bytes, fnv64 H>` when longer than [`MAX_RENDERED_VALUE`].
pub fn value(bytes: &[u8]) -> String {
    if bytes.len() > MAX_RENDERED_VALUE {
        return format!("<{} bytes, fnv64 {:016x}>", bytes.len(), fnv64(bytes));
    }
    match std::str::from_utf8(bytes) {
        Ok(s) if !s.chars().any(|c| c.is_control() && c != '\n' && c != '\t') => format!("{s:?}"),
        _ => {
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            format!("0x{hex}")
        }
    }
}

fn opt_value(v: &Option<Vec<u8>>) -> String {
    v.as_deref().map_or_else(|| "NULL".to_string(), value)
}

fn values(vs: &[Option<Vec<u8>>]) -> String {
    vs.iter().map(opt_value).collect::<Vec<_>>().join(", ")
}

fn text(s: &str) -> String {
    value(s.as_bytes())
}

/// FNV-1a: a fixed, dependency-free hash, so that rendered long values are stable across
/// runs and builds.
fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Reads one whole backend message from `stream` (bytes already read wait in `buf`), failing on
/// end of stream or after [`RECV_TIMEOUT`].
async fn read_message<R: AsyncRead + Unpin>(stream: &mut R, buf: &mut BytesMut) -> Result<Backend> {
    loop {
        // Check first, parse second: only take a message once all of it is buffered.
        if buf.len() >= 5 {
            let len = i32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
            if len < 4 || len as usize > MAX_MESSAGE_LEN {
                bail!(
                    "corrupt stream: message {:?} with length {len}",
                    buf[0] as char
                );
            }
            let total = 1 + len as usize;
            if buf.len() >= total {
                let tag = buf[0];
                buf.advance(5);
                let body = buf.split_to(total - 5).to_vec();
                return Ok(Backend { tag, body });
            }
            buf.reserve(total - buf.len());
        }
        let read = tokio::time::timeout(RECV_TIMEOUT, stream.read_buf(buf))
            .await
            .map_err(|_| anyhow!("timeout: no message within {RECV_TIMEOUT:?}"))??;
        if read == 0 {
            if buf.is_empty() {
                bail!("connection closed");
            }
            bail!("connection closed inside a message");
        }
    }
}

/// A connection that speaks the wire protocol message by message.
///
/// It owns the socket and a read buffer; [`RawClient::recv`] hands out one whole backend
/// message at a time, so tests never see partial bytes.
pub struct RawClient {
    stream: TcpStream,
    buf: BytesMut,
    startup: Vec<Backend>,
}

impl RawClient {
    /// [`RawClient::connect`] to the test cluster itself (not through pgmemo), as the test
    /// user in the test database.
    pub async fn direct(params: &[(&str, &str)]) -> Result<RawClient> {
        use super::cluster::{cluster, PGMEMO_PASS, PGMEMO_USER, TEST_DB};
        Self::connect(
            cluster().addr(),
            PGMEMO_USER,
            TEST_DB,
            Some(PGMEMO_PASS),
            params,
        )
        .await
    }

    /// [`RawClient::connect`] through pgmemo at `addr`, as the test user in the test
    /// database: the twin of [`RawClient::direct`].
    pub async fn through(addr: SocketAddr, params: &[(&str, &str)]) -> Result<RawClient> {
        use super::cluster::{PGMEMO_PASS, PGMEMO_USER, TEST_DB};
        Self::connect(addr, PGMEMO_USER, TEST_DB, Some(PGMEMO_PASS), params).await
    }

    /// Connects, sends a StartupMessage (`user`, `database` and `params`), answers the
    /// authentication request (trust, cleartext, MD5 or SCRAM-SHA-256; `password` is needed
    /// for all but trust) and reads up to the first ReadyForQuery. The messages read after
    /// AuthenticationOk (ParameterStatus, BackendKeyData, …) are kept in
    /// [`RawClient::startup_messages`].
    pub async fn connect(
        addr: SocketAddr,
        user: &str,
        database: &str,
        password: Option<&str>,
        params: &[(&str, &str)],
    ) -> Result<RawClient> {
        tokio::time::timeout(
            RECV_TIMEOUT,
            Self::connect_inner(addr, user, database, password, params),
        )
        .await
        .map_err(|_| anyhow!("start-up with {addr} took longer than {RECV_TIMEOUT:?}"))?
        .with_context(|| format!("connecting to {addr} as {user:?}, database {database:?}"))
    }

    async fn connect_inner(
        addr: SocketAddr,
        user: &str,
        database: &str,
        password: Option<&str>,
        params: &[(&str, &str)],
    ) -> Result<RawClient> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let mut client = RawClient {
            stream,
            buf: BytesMut::with_capacity(64 * 1024),
            startup: Vec::new(),
        };

        let mut body = PROTOCOL_VERSION.to_be_bytes().to_vec();
        for (k, v) in [("user", user), ("database", database)]
            .iter()
            .chain(params)
        {
            body.extend(cstr(k));
            body.extend(cstr(v));
        }
        body.push(0);
        let mut startup = ((body.len() + 4) as i32).to_be_bytes().to_vec();
        startup.extend(body);
        client.write(&startup).await?;

        client.authenticate(user, password).await?;
        loop {
            let msg = client.recv().await?;
            if msg.is_error() {
                bail!("server refused the session: {msg}");
            }
            let ready = msg.tag == b'Z';
            client.startup.push(msg);
            if ready {
                return Ok(client);
            }
        }
    }

    /// Answers authentication requests until AuthenticationOk.
    async fn authenticate(&mut self, user: &str, password: Option<&str>) -> Result<()> {
        let need_password =
            || password.ok_or_else(|| anyhow!("the server asks for a password and none was given"));
        loop {
            let msg = self.recv().await?;
            if msg.is_error() {
                bail!("authentication failed: {msg}");
            }
            if msg.tag != b'R' {
                bail!("expected an authentication request, got {msg}");
            }
            let mut r = Reader(&msg.body);
            match r.i32() {
                Some(0) => return Ok(()),
                Some(3) => {
                    let password = need_password()?;
                    self.write_message(b'p', &cstr(password)).await?;
                }
                Some(5) => {
                    let salt: [u8; 4] = r
                        .take(4)
                        .and_then(|s| s.try_into().ok())
                        .ok_or_else(|| anyhow!("short MD5 request {msg}"))?;
                    let hash = md5_hash(user.as_bytes(), need_password()?.as_bytes(), salt);
                    self.write_message(b'p', &cstr(&hash)).await?;
                }
                Some(10) => self.scram(need_password()?, r.0).await?,
                _ => bail!("unsupported authentication request {msg}"),
            }
        }
    }

    /// Runs a SCRAM-SHA-256 exchange (without channel binding) after AuthenticationSASL.
    async fn scram(&mut self, password: &str, mechanisms: &[u8]) -> Result<()> {
        let offered = String::from_utf8_lossy(mechanisms);
        if !offered.split('\0').any(|m| m == "SCRAM-SHA-256") {
            bail!("server offers no SCRAM-SHA-256: {offered:?}");
        }
        let mut scram = ScramSha256::new(password.as_bytes(), ChannelBinding::unsupported());
        let mut initial = cstr("SCRAM-SHA-256");
        initial.extend((scram.message().len() as i32).to_be_bytes());
        initial.extend(scram.message());
        self.write_message(b'p', &initial).await?;

        let step = |msg: &Backend, code: i32| -> Result<Vec<u8>> {
            match Reader(&msg.body).i32() {
                Some(c) if c == code && msg.tag == b'R' => Ok(msg.body[4..].to_vec()),
                _ => bail!("SCRAM: expected authentication code {code}, got {msg}"),
            }
        };
        let server_first = step(&self.recv().await?, 11)?;
        scram.update(&server_first)?;
        self.write_message(b'p', scram.message()).await?;
        let server_final = step(&self.recv().await?, 12)?;
        scram.finish(&server_final)?;
        Ok(())
    }

    /// The messages the server sent between AuthenticationOk and the first ReadyForQuery.
    pub fn startup_messages(&self) -> &[Backend] {
        &self.startup
    }

    /// The ParameterStatus values reported at start-up, in the order received.
    pub fn parameters(&self) -> Vec<(String, String)> {
        self.startup
            .iter()
            .filter_map(Backend::parameter_status)
            .collect()
    }

    /// The (pid, secret key) from BackendKeyData, if the server sent one.
    pub fn backend_key(&self) -> Option<(i32, i32)> {
        let msg = self.startup.iter().find(|m| m.tag == b'K')?;
        let mut r = Reader(&msg.body);
        Some((r.i32()?, r.i32()?))
    }

    /// Sends the messages in one write, so that a pipeline arrives as a pipeline.
    pub async fn send(&mut self, msgs: &[Frontend]) -> Result<()> {
        let mut out = Vec::new();
        for msg in msgs {
            msg.encode(&mut out);
        }
        self.write(&out).await
    }

    /// Reads one backend message, failing on end of stream or after [`RECV_TIMEOUT`].
    pub async fn recv(&mut self) -> Result<Backend> {
        read_message(&mut self.stream, &mut self.buf).await
    }

    /// Reads exactly `n` messages.
    pub async fn recv_n(&mut self, n: usize) -> Result<Vec<Backend>> {
        let mut msgs = Vec::with_capacity(n);
        for _ in 0..n {
            msgs.push(self.recv().await?);
        }
        Ok(msgs)
    }

    /// Reads messages up to and including the `n_ready`-th ReadyForQuery.
    pub async fn recv_until_ready(&mut self, n_ready: usize) -> Result<Vec<Backend>> {
        let mut msgs = Vec::new();
        let mut seen = 0;
        while seen < n_ready {
            let msg = self.recv().await?;
            seen += usize::from(msg.tag == b'Z');
            msgs.push(msg);
        }
        Ok(msgs)
    }

    /// Reads messages up to and including the first one with type byte `tag`.
    pub async fn recv_until_tag(&mut self, tag: u8) -> Result<Vec<Backend>> {
        let mut msgs = Vec::new();
        loop {
            let msg = self.recv().await?;
            let done = msg.tag == tag;
            msgs.push(msg);
            if done {
                return Ok(msgs);
            }
        }
    }

    /// Sends Terminate and closes the socket.
    pub async fn terminate(mut self) -> Result<()> {
        self.send(&[Frontend::Terminate]).await?;
        self.stream.shutdown().await?;
        Ok(())
    }

    async fn write_message(&mut self, tag: u8, body: &[u8]) -> Result<()> {
        let mut out = vec![tag];
        out.extend(((body.len() + 4) as i32).to_be_bytes());
        out.extend(body);
        self.write(&out).await
    }

    async fn write(&mut self, bytes: &[u8]) -> Result<()> {
        tokio::time::timeout(RECV_TIMEOUT, self.stream.write_all(bytes))
            .await
            .map_err(|_| anyhow!("timeout: could not send within {RECV_TIMEOUT:?}"))??;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Start-up under the test's control, and connections that misbehave on purpose.
//
// [`RawClient::connect`] always sends a well-formed protocol 3.0 StartupMessage and fails on
// anything unexpected. Tests of NegotiateProtocolVersion, authentication failures and bad
// input need to choose the start-up bytes themselves and see every reply, including the ones
// before AuthenticationOk, and to read until the server hangs up.
// ---------------------------------------------------------------------------------------------

/// The protocol version number for `major.minor`, as sent in a StartupMessage.
pub const fn protocol_version(major: i32, minor: i32) -> i32 {
    (major << 16) | minor
}

/// A StartupMessage asking for protocol `version` with these parameters (`user`, `database`
/// and anything else, in order), length included.
pub fn startup_packet(version: i32, params: &[(&str, &str)]) -> Vec<u8> {
    let mut body = version.to_be_bytes().to_vec();
    for (k, v) in params {
        body.extend(cstr(k));
        body.extend(cstr(v));
    }
    body.push(0);
    let mut packet = ((body.len() + 4) as i32).to_be_bytes().to_vec();
    packet.extend(body);
    packet
}

/// An untagged start-up phase request (SSLRequest, GSSENCRequest, CancelRequest) with `code`
/// and an optional payload.
pub fn startup_request(code: i32, payload: &[u8]) -> Vec<u8> {
    let mut packet = ((8 + payload.len()) as i32).to_be_bytes().to_vec();
    packet.extend(code.to_be_bytes());
    packet.extend(payload);
    packet
}

/// One tagged message with an arbitrary body: `tag`, the correct length, `body`.
pub fn tagged(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    out.extend(((body.len() + 4) as i32).to_be_bytes());
    out.extend(body);
    out
}

/// What happened during a [`RawClient::login`].
pub struct Login {
    /// The connection, positioned after the last message in `messages`.
    pub client: RawClient,
    /// Every message received, from the first (NegotiateProtocolVersion or the first
    /// authentication request) up to ReadyForQuery or the first ErrorResponse.
    pub messages: Vec<Backend>,
    /// Whether the login reached ReadyForQuery.
    pub ready: bool,
}

impl Login {
    /// The ErrorResponse that ended the login, if one did.
    pub fn error(&self) -> Option<&Backend> {
        self.messages.iter().find(|m| m.is_error())
    }

    /// Panics unless the login ended with an ErrorResponse; returns (severity, SQLSTATE,
    /// message).
    pub fn expect_error(&self) -> (String, String, String) {
        let error = self
            .error()
            .unwrap_or_else(|| panic!("expected a login error, got {:?}", self.messages));
        error_triple(error)
    }
}

/// (severity, SQLSTATE, message) of an ErrorResponse or NoticeResponse; empty strings for
/// missing fields.
pub fn error_triple(msg: &Backend) -> (String, String, String) {
    let field = |c| msg.field(c).unwrap_or_default();
    (field(b'S'), field(b'C'), field(b'M'))
}

impl RawClient {
    /// A TCP connection on which nothing has been sent yet.
    pub async fn open(addr: SocketAddr) -> Result<RawClient> {
        let stream = tokio::time::timeout(RECV_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| anyhow!("connecting to {addr} took longer than {RECV_TIMEOUT:?}"))??;
        stream.set_nodelay(true)?;
        Ok(RawClient {
            stream,
            buf: BytesMut::with_capacity(64 * 1024),
            startup: Vec::new(),
        })
    }

    /// Sends `bytes` exactly as given.
    pub async fn send_raw(&mut self, bytes: &[u8]) -> Result<()> {
        self.write(bytes).await
    }

    /// Closes the sending half: the server reads end of stream, and replies can still be read.
    pub async fn shutdown_write(&mut self) -> Result<()> {
        self.stream.shutdown().await?;
        Ok(())
    }

    /// Reads one raw byte (the answer to an SSLRequest or GSSENCRequest).
    pub async fn recv_byte(&mut self) -> Result<u8> {
        if !self.buf.is_empty() {
            return Ok(self.buf.split_to(1)[0]);
        }
        let mut byte = [0u8; 1];
        let n = tokio::time::timeout(RECV_TIMEOUT, self.stream.read(&mut byte))
            .await
            .map_err(|_| anyhow!("timeout: no byte within {RECV_TIMEOUT:?}"))??;
        if n == 0 {
            bail!("connection closed");
        }
        Ok(byte[0])
    }

    /// Reads every message until the server closes the connection, and returns them. Fails
    /// when the connection stays open for [`RECV_TIMEOUT`] after the last message, or ends in
    /// the middle of a message. A reset counts as closed.
    pub async fn recv_until_closed(&mut self) -> Result<Vec<Backend>> {
        let mut msgs = Vec::new();
        loop {
            match self.recv().await {
                Ok(msg) => msgs.push(msg),
                Err(e) => {
                    let text = format!("{e:#}");
                    let reset = e
                        .downcast_ref::<std::io::Error>()
                        .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionReset);
                    if text == "connection closed" || reset {
                        return Ok(msgs);
                    }
                    return Err(e.context(format!("waiting for the server to close; got {msgs:?}")));
                }
            }
        }
    }

    /// Connects, sends `packet` as the start-up packet and answers authentication requests
    /// (cleartext, MD5, SCRAM-SHA-256) with `password`, recording every message received up
    /// to ReadyForQuery or the first ErrorResponse. A connection closed before either is an
    /// error.
    pub async fn login(
        addr: SocketAddr,
        packet: &[u8],
        user: &str,
        password: Option<&str>,
    ) -> Result<Login> {
        let mut client = RawClient::open(addr).await?;
        client.send_raw(packet).await?;
        let mut messages = Vec::new();
        let mut scram: Option<ScramSha256> = None;
        let mut authenticated = false;
        loop {
            let msg = client.recv().await.with_context(|| {
                format!("login to {addr} as {user:?}; received so far: {messages:?}")
            })?;
            let tag = msg.tag;
            let body = msg.body.clone();
            let shown = format!("{msg:?}");
            messages.push(msg.clone());
            if authenticated && tag != b'E' {
                client.startup.push(msg);
            }
            match tag {
                b'Z' => {
                    return Ok(Login {
                        client,
                        messages,
                        ready: true,
                    })
                }
                b'E' => {
                    return Ok(Login {
                        client,
                        messages,
                        ready: false,
                    })
                }
                b'R' => {
                    let mut r = Reader(&body);
                    let code = r.i32().ok_or_else(|| anyhow!("short {shown}"))?;
                    let need = || password.ok_or_else(|| anyhow!("a password is asked for"));
                    match code {
                        0 => authenticated = true,
                        3 => client.write_message(b'p', &cstr(need()?)).await?,
                        5 => {
                            let salt: [u8; 4] = r
                                .take(4)
                                .and_then(|s| s.try_into().ok())
                                .ok_or_else(|| anyhow!("short MD5 request"))?;
                            let hash = md5_hash(user.as_bytes(), need()?.as_bytes(), salt);
                            client.write_message(b'p', &cstr(&hash)).await?;
                        }
                        10 => {
                            let s =
                                ScramSha256::new(need()?.as_bytes(), ChannelBinding::unsupported());
                            let mut initial = cstr("SCRAM-SHA-256");
                            initial.extend((s.message().len() as i32).to_be_bytes());
                            initial.extend(s.message());
                            client.write_message(b'p', &initial).await?;
                            scram = Some(s);
                        }
                        11 => {
                            let s = scram
                                .as_mut()
                                .ok_or_else(|| anyhow!("SASLContinue first"))?;
                            s.update(r.0)?;
                            let reply = s.message().to_vec();
                            client.write_message(b'p', &reply).await?;
                        }
                        12 => {
                            let s = scram.as_mut().ok_or_else(|| anyhow!("SASLFinal first"))?;
                            s.finish(r.0)?;
                        }
                        other => bail!("unsupported authentication request {other}"),
                    }
                }
                _ => {}
            }
        }
    }
}

impl RawClient {
    /// This end's address, which the server sees as the client's address.
    pub fn local_addr(&self) -> SocketAddr {
        self.stream
            .local_addr()
            .expect("a connected socket has a local address")
    }
}

impl RawClient {
    /// Reads raw bytes until the server closes the connection, for answers that are not
    /// protocol 3 messages (a protocol 2.0 error). A reset counts as closed.
    pub async fn recv_raw_until_closed(&mut self) -> Result<Vec<u8>> {
        let mut out = self.buf.split().to_vec();
        let mut chunk = [0u8; 4096];
        loop {
            let read = tokio::time::timeout(RECV_TIMEOUT, self.stream.read(&mut chunk))
                .await
                .map_err(|_| anyhow!("timeout: still open after {RECV_TIMEOUT:?}; got {out:?}"))?;
            match read {
                Ok(0) => return Ok(out),
                Ok(n) => out.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(out),
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// The receiving half of a [`RawClient`] split in two ([`RawClient::split`]): it reads on one
/// task while [`RawWriter`] sends on another, as drivers do that stream COPY data and watch
/// for an error meanwhile (pgx).
pub struct RawReader {
    read: tokio::net::tcp::OwnedReadHalf,
    buf: BytesMut,
    startup: Vec<Backend>,
}

/// The sending half of a [`RawClient`] split in two.
pub struct RawWriter {
    write: tokio::net::tcp::OwnedWriteHalf,
}

impl RawClient {
    /// Splits the connection into a half that reads and a half that sends.
    pub fn split(self) -> (RawReader, RawWriter) {
        let (read, write) = self.stream.into_split();
        let reader = RawReader {
            read,
            buf: self.buf,
            startup: self.startup,
        };
        (reader, RawWriter { write })
    }
}

impl RawReader {
    /// See [`RawClient::recv`].
    pub async fn recv(&mut self) -> Result<Backend> {
        read_message(&mut self.read, &mut self.buf).await
    }

    /// The connection whole again.
    pub fn join(self, writer: RawWriter) -> RawClient {
        let stream = self
            .read
            .reunite(writer.write)
            .expect("the two halves of one connection");
        RawClient {
            stream,
            buf: self.buf,
            startup: self.startup,
        }
    }
}

impl RawWriter {
    /// See [`RawClient::send`].
    pub async fn send(&mut self, msgs: &[Frontend]) -> Result<()> {
        let mut out = Vec::new();
        for msg in msgs {
            msg.encode(&mut out);
        }
        tokio::time::timeout(RECV_TIMEOUT, self.write.write_all(&out))
            .await
            .map_err(|_| anyhow!("timeout: could not send within {RECV_TIMEOUT:?}"))??;
        Ok(())
    }
}

/// Sends a CancelRequest for the BackendKeyData `key` (pid, secret) to `addr` on a connection
/// of its own, and waits until the server closes it, as libpq's PQcancel does: by then the
/// request has been handled.
pub async fn cancel_request(addr: SocketAddr, key: (i32, i32)) -> Result<()> {
    let mut payload = key.0.to_be_bytes().to_vec();
    payload.extend(key.1.to_be_bytes());
    let mut client = RawClient::open(addr).await?;
    client
        .send_raw(&startup_request(80_877_102, &payload))
        .await?;
    let answer = client.recv_raw_until_closed().await?;
    if !answer.is_empty() {
        bail!("a CancelRequest got an answer: {answer:?}");
    }
    Ok(())
}
