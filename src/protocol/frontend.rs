//! Messages a client (frontend) sends: tags, borrowed views of the ones pgmemo inspects, and
//! builders for the ones pgmemo itself sends to servers.

use super::{put_cstr, write_empty_message, write_message, Reader};
use bytes::{BufMut, BytesMut};

pub const BIND: u8 = b'B';
pub const CLOSE: u8 = b'C';
pub const COPY_DATA: u8 = b'd';
pub const COPY_DONE: u8 = b'c';
pub const COPY_FAIL: u8 = b'f';
pub const DESCRIBE: u8 = b'D';
pub const EXECUTE: u8 = b'E';
pub const FLUSH: u8 = b'H';
pub const FUNCTION_CALL: u8 = b'F';
pub const PARSE: u8 = b'P';
/// PasswordMessage, SASLInitialResponse and SASLResponse all share this tag.
pub const PASSWORD: u8 = b'p';
pub const QUERY: u8 = b'Q';
pub const SYNC: u8 = b'S';
pub const TERMINATE: u8 = b'X';

/// Whether `tag` is a message a client may send after startup. Anything else is a protocol
/// violation that PostgreSQL answers with 08P01 and a disconnect.
pub fn is_known(tag: u8) -> bool {
    matches!(
        tag,
        BIND | CLOSE
            | COPY_DATA
            | COPY_DONE
            | COPY_FAIL
            | DESCRIBE
            | EXECUTE
            | FLUSH
            | FUNCTION_CALL
            | PARSE
            | QUERY
            | SYNC
            | TERMINATE
    )
}

/// PostgreSQL's limit on the length of the messages that are always short
/// (`PQ_SMALL_MESSAGE_LIMIT`); a longer one is a broken or hostile stream.
pub const SMALL_MESSAGE_LIMIT: usize = 10_000;

/// The largest length field accepted for a message of type `tag`, given the configured limit
/// for the ones that may be long (Query, Parse, Bind, CopyData, FunctionCall): the others are
/// held to [`SMALL_MESSAGE_LIMIT`] as PostgreSQL does, so pgmemo refuses what PostgreSQL
/// would refuse instead of forwarding it and losing the server connection.
pub fn max_message_len(tag: u8, limit: usize) -> usize {
    match tag {
        QUERY | PARSE | BIND | COPY_DATA | FUNCTION_CALL => limit,
        _ => limit.min(SMALL_MESSAGE_LIMIT),
    }
}

/// Parse: `name`, `query`, parameter type OIDs.
#[derive(Debug, Clone, Copy)]
pub struct Parse<'a> {
    pub name: &'a [u8],
    pub query: &'a [u8],
    /// The raw parameter count and OIDs (network order), kept as bytes so the message can be
    /// rebuilt under another name without decoding them.
    pub param_types: &'a [u8],
}

impl<'a> Parse<'a> {
    // Every message view here is read with `parse`; the Parse message is no exception.
    #[allow(clippy::self_named_constructors)]
    pub fn parse(body: &'a [u8]) -> Option<Self> {
        let mut r = Reader::new(body);
        let name = r.cstr()?;
        let query = r.cstr()?;
        let param_types = r.remaining();
        let mut check = Reader::new(param_types);
        let n = check.i16()?;
        if n < 0 || check.remaining().len() != n as usize * 4 {
            return None;
        }
        Some(Parse {
            name,
            query,
            param_types,
        })
    }

    pub fn encode(&self, name: &[u8], out: &mut BytesMut) {
        write_message(out, PARSE, |b| {
            put_cstr(b, name);
            put_cstr(b, self.query);
            b.extend_from_slice(self.param_types);
        });
    }
}

/// Bind: only the names are decoded; the rest (formats, values) is carried as bytes.
#[derive(Debug, Clone, Copy)]
pub struct Bind<'a> {
    pub portal: &'a [u8],
    pub statement: &'a [u8],
    pub rest: &'a [u8],
}

impl<'a> Bind<'a> {
    pub fn parse(body: &'a [u8]) -> Option<Self> {
        let mut r = Reader::new(body);
        let portal = r.cstr()?;
        let statement = r.cstr()?;
        Some(Bind {
            portal,
            statement,
            rest: r.remaining(),
        })
    }
}

/// Describe and Close share a shape: a kind byte (`S` statement, `P` portal) and a name.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub kind: u8,
    pub name: &'a [u8],
}

impl<'a> Target<'a> {
    pub fn parse(body: &'a [u8]) -> Option<Self> {
        let mut r = Reader::new(body);
        let kind = r.u8()?;
        let name = r.cstr()?;
        if !matches!(kind, b'S' | b'P') || !r.is_empty() {
            return None;
        }
        Some(Target { kind, name })
    }
}

/// Execute: portal and row limit (0 = all rows).
#[derive(Debug, Clone, Copy)]
pub struct Execute<'a> {
    pub portal: &'a [u8],
    pub max_rows: i32,
}

impl<'a> Execute<'a> {
    pub fn parse(body: &'a [u8]) -> Option<Self> {
        let mut r = Reader::new(body);
        let portal = r.cstr()?;
        let max_rows = r.i32()?;
        Some(Execute { portal, max_rows })
    }
}

/// The SQL text of a simple Query message.
pub fn query_text(body: &[u8]) -> Option<&[u8]> {
    Reader::new(body).cstr()
}

/// The SQL text of the whole Query message `msg` whose text is `text_len` bytes long (as
/// [`query_text`] found it).
#[inline]
pub fn query_text_of(msg: &[u8], text_len: usize) -> &[u8] {
    &super::body(msg)[..text_len]
}

pub fn query(out: &mut BytesMut, sql: &str) {
    write_message(out, QUERY, |b| put_cstr(b, sql.as_bytes()));
}

/// `sql` in the extended protocol with `params` bound as text (declared `text`, OID 25):
/// Parse, Bind, Execute and Sync of the unnamed statement and portal, text results.
pub fn query_with_params(out: &mut BytesMut, sql: &str, params: &[&str]) {
    write_message(out, PARSE, |b| {
        put_cstr(b, b"");
        put_cstr(b, sql.as_bytes());
        b.put_i16(params.len() as i16);
        for _ in params {
            b.put_u32(25);
        }
    });
    write_message(out, BIND, |b| {
        put_cstr(b, b"");
        put_cstr(b, b"");
        b.put_i16(0);
        b.put_i16(params.len() as i16);
        for p in params {
            b.put_i32(p.len() as i32);
            b.extend_from_slice(p.as_bytes());
        }
        b.put_i16(0);
    });
    write_message(out, EXECUTE, |b| {
        put_cstr(b, b"");
        b.put_i32(0);
    });
    sync(out);
}

pub fn sync(out: &mut BytesMut) {
    write_empty_message(out, SYNC);
}

pub fn terminate(out: &mut BytesMut) {
    write_empty_message(out, TERMINATE);
}

/// PasswordMessage with a cleartext password or an md5 response.
pub fn password(out: &mut BytesMut, password: &[u8]) {
    write_message(out, PASSWORD, |b| put_cstr(b, password));
}

pub fn sasl_initial_response(out: &mut BytesMut, mechanism: &str, data: &[u8]) {
    write_message(out, PASSWORD, |b| {
        put_cstr(b, mechanism.as_bytes());
        b.put_i32(data.len() as i32);
        b.extend_from_slice(data);
    });
}

pub fn sasl_response(out: &mut BytesMut, data: &[u8]) {
    write_message(out, PASSWORD, |b| b.extend_from_slice(data));
}

/// The startup packet pgmemo sends to a server (protocol 3.0).
pub fn startup(out: &mut BytesMut, params: &[(&str, &str)]) {
    let at = out.len();
    out.put_u32(0);
    out.put_i32(super::startup::PROTOCOL_3_0);
    for (k, v) in params {
        put_cstr(out, k.as_bytes());
        put_cstr(out, v.as_bytes());
    }
    out.put_u8(0);
    let len = (out.len() - at) as u32;
    out[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

/// Why a SASLInitialResponse does not parse: PostgreSQL's message for the first thing wrong,
/// and the mechanism when it could be read (PostgreSQL rejects an unknown mechanism before it
/// reads the rest, so that error comes first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SaslInitialError<'a> {
    pub mechanism: Option<&'a str>,
    pub message: &'static str,
}

/// A SASLInitialResponse body: mechanism name and the client-first message (empty when the
/// client sent length -1), read the way PostgreSQL reads it.
pub fn parse_sasl_initial(body: &[u8]) -> Result<(&str, &[u8]), SaslInitialError<'_>> {
    let mut r = Reader::new(body);
    let fail = |mechanism, message| Err(SaslInitialError { mechanism, message });
    let Some(raw) = r.cstr() else {
        return fail(None, "invalid string in message");
    };
    // Not UTF-8 is not a mechanism PostgreSQL knows either.
    let mechanism = std::str::from_utf8(raw).unwrap_or("");
    let data = match r.i32() {
        Some(-1) => &[][..],
        Some(len) if len >= 0 => match r.bytes(len as usize) {
            Some(data) => data,
            None => return fail(Some(mechanism), "insufficient data left in message"),
        },
        _ => return fail(Some(mechanism), "insufficient data left in message"),
    };
    if !r.is_empty() {
        return fail(Some(mechanism), "invalid message format");
    }
    Ok((mechanism, data))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::frame;

    #[test]
    fn parse_roundtrip_with_new_name() {
        let mut out = BytesMut::new();
        write_message(&mut out, PARSE, |b| {
            put_cstr(b, b"s1");
            put_cstr(b, b"SELECT $1");
            b.put_i16(1);
            b.put_u32(23);
        });
        let p = Parse::parse(&out[5..]).unwrap();
        assert_eq!(p.name, b"s1");
        assert_eq!(p.query, b"SELECT $1");
        let mut renamed = BytesMut::new();
        p.encode(b"pgmemo_s1", &mut renamed);
        let (_, len) = frame(&renamed, 1000).unwrap().unwrap();
        assert_eq!(len, renamed.len());
        let q = Parse::parse(&renamed[5..]).unwrap();
        assert_eq!(q.name, b"pgmemo_s1");
        assert_eq!(q.param_types, p.param_types);
    }

    #[test]
    fn parse_rejects_bad_param_count() {
        let body = b"s\0SELECT 1\0\x00\x02\x00\x00\x00\x17";
        assert!(Parse::parse(body).is_none());
    }

    #[test]
    fn describe_target() {
        assert_eq!(Target::parse(b"Sname\0").unwrap().name, b"name");
        assert!(Target::parse(b"Xname\0").is_none());
        assert!(Target::parse(b"S").is_none());
    }
}
