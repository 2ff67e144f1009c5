//! Messages a server (backend) sends: tags, views of the ones pgmemo reacts to, and builders for
//! the ones pgmemo answers with itself (login, errors, the admin console, synthesized replies).

use super::{put_cstr, write_empty_message, write_message, Reader};
use bytes::{BufMut, BytesMut};

pub const AUTHENTICATION: u8 = b'R';
pub const BACKEND_KEY_DATA: u8 = b'K';
pub const BIND_COMPLETE: u8 = b'2';
pub const CLOSE_COMPLETE: u8 = b'3';
pub const COMMAND_COMPLETE: u8 = b'C';
pub const COPY_BOTH_RESPONSE: u8 = b'W';
pub const COPY_DATA: u8 = b'd';
pub const COPY_DONE: u8 = b'c';
pub const COPY_IN_RESPONSE: u8 = b'G';
pub const COPY_OUT_RESPONSE: u8 = b'H';
pub const DATA_ROW: u8 = b'D';
pub const EMPTY_QUERY_RESPONSE: u8 = b'I';
pub const ERROR_RESPONSE: u8 = b'E';
pub const FUNCTION_CALL_RESPONSE: u8 = b'V';
pub const NEGOTIATE_PROTOCOL_VERSION: u8 = b'v';
pub const NO_DATA: u8 = b'n';
pub const NOTICE_RESPONSE: u8 = b'N';
pub const NOTIFICATION_RESPONSE: u8 = b'A';
pub const PARAMETER_DESCRIPTION: u8 = b't';
pub const PARAMETER_STATUS: u8 = b'S';
pub const PARSE_COMPLETE: u8 = b'1';
pub const PORTAL_SUSPENDED: u8 = b's';
pub const READY_FOR_QUERY: u8 = b'Z';
pub const ROW_DESCRIPTION: u8 = b'T';

/// SQLSTATE codes pgmemo produces itself.
pub mod sqlstate {
    pub const SUCCESSFUL_COMPLETION: &str = "00000";
    pub const PROTOCOL_VIOLATION: &str = "08P01";
    pub const CONNECTION_FAILURE: &str = "08006";
    pub const CANNOT_CONNECT_NOW: &str = "57P03";
    pub const ADMIN_SHUTDOWN: &str = "57P01";
    pub const INVALID_PASSWORD: &str = "28P01";
    pub const INVALID_AUTHORIZATION: &str = "28000";
    pub const INVALID_CATALOG_NAME: &str = "3D000";
    pub const TOO_MANY_CONNECTIONS: &str = "53300";
    pub const CONFIGURATION_LIMIT_EXCEEDED: &str = "53400";
    pub const QUERY_CANCELED: &str = "57014";
    pub const FEATURE_NOT_SUPPORTED: &str = "0A000";
    pub const SYNTAX_ERROR: &str = "42601";
    pub const PROGRAM_LIMIT_EXCEEDED: &str = "54000";
    pub const INTERNAL_ERROR: &str = "XX000";
    pub const RESERVED_NAME: &str = "42939";
    pub const OBJECT_NOT_IN_PREREQUISITE_STATE: &str = "55000";
    pub const INVALID_PARAMETER_VALUE: &str = "22023";
    /// A setting RELOAD cannot change at run time (PostgreSQL's cant_change_runtime_param).
    pub const CANT_CHANGE_RUNTIME_PARAM: &str = "55P02";
    /// The configuration file cannot be used (config_file_error; PgBouncer's RELOAD failure).
    pub const CONFIG_FILE_ERROR: &str = "F0000";
}

/// A FATAL error in protocol 2.0's format (`E`, then the text, NUL-terminated), which is what
/// PostgreSQL sends a client that asked for a protocol older than 3.0, so that it can read it.
pub fn error_response_v2(out: &mut BytesMut, message: &str) {
    out.put_u8(ERROR_RESPONSE);
    out.extend_from_slice(format!("FATAL:  {message}\n").as_bytes());
    out.put_u8(0);
}

/// Severity of an ErrorResponse pgmemo builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Error,
    Fatal,
}

impl Severity {
    fn as_str(self) -> &'static str {
        match self {
            Severity::Error => "ERROR",
            Severity::Fatal => "FATAL",
        }
    }
}

/// ErrorResponse with severity, SQLSTATE and message, in the field order PostgreSQL uses.
pub fn error_response(out: &mut BytesMut, severity: Severity, code: &str, message: &str) {
    error_response_hint(out, severity, code, message, None);
}

/// [`error_response`] with a hint when given (field H, after the message as PostgreSQL
/// places it).
pub fn error_response_hint(
    out: &mut BytesMut,
    severity: Severity,
    code: &str,
    message: &str,
    hint: Option<&str>,
) {
    error_response_detail(out, severity, code, message, None, hint);
}

/// [`error_response`] with a detail and a hint when given (fields D and H, after the message
/// in that order, as PostgreSQL places them).
pub fn error_response_detail(
    out: &mut BytesMut,
    severity: Severity,
    code: &str,
    message: &str,
    detail: Option<&str>,
    hint: Option<&str>,
) {
    write_message(out, ERROR_RESPONSE, |b| {
        let fields = [
            (b'S', severity.as_str()),
            (b'V', severity.as_str()),
            (b'C', code),
            (b'M', message),
        ];
        let optional = [(b'D', detail), (b'H', hint)];
        let optional = optional.into_iter().filter_map(|(f, v)| Some((f, v?)));
        for (field, value) in fields.into_iter().chain(optional) {
            b.put_u8(field);
            put_cstr(b, value.as_bytes());
        }
        b.put_u8(0);
    });
}

/// NoticeResponse of severity NOTICE, in the field order PostgreSQL uses.
pub fn notice_response(out: &mut BytesMut, code: &str, message: &str) {
    write_message(out, NOTICE_RESPONSE, |b| {
        for (field, value) in [
            (b'S', "NOTICE"),
            (b'V', "NOTICE"),
            (b'C', code),
            (b'M', message),
        ] {
            b.put_u8(field);
            put_cstr(b, value.as_bytes());
        }
        b.put_u8(0);
    });
}

/// A ReadyForQuery: six bytes, written at once (each reply pgmemo gives itself ends with one).
#[inline]
pub fn ready_for_query(out: &mut BytesMut, status: u8) {
    out.extend_from_slice(&[READY_FOR_QUERY, 0, 0, 0, 5, status]);
}

pub fn auth_ok(out: &mut BytesMut) {
    write_message(out, AUTHENTICATION, |b| b.put_i32(0));
}

pub fn auth_md5(out: &mut BytesMut, salt: [u8; 4]) {
    write_message(out, AUTHENTICATION, |b| {
        b.put_i32(5);
        b.extend_from_slice(&salt);
    });
}

pub fn auth_sasl(out: &mut BytesMut, mechanisms: &[&str]) {
    write_message(out, AUTHENTICATION, |b| {
        b.put_i32(10);
        for m in mechanisms {
            put_cstr(b, m.as_bytes());
        }
        b.put_u8(0);
    });
}

pub fn auth_sasl_continue(out: &mut BytesMut, data: &[u8]) {
    write_message(out, AUTHENTICATION, |b| {
        b.put_i32(11);
        b.extend_from_slice(data);
    });
}

pub fn auth_sasl_final(out: &mut BytesMut, data: &[u8]) {
    write_message(out, AUTHENTICATION, |b| {
        b.put_i32(12);
        b.extend_from_slice(data);
    });
}

pub fn parameter_status(out: &mut BytesMut, name: &str, value: &str) {
    write_message(out, PARAMETER_STATUS, |b| {
        put_cstr(b, name.as_bytes());
        put_cstr(b, value.as_bytes());
    });
}

pub fn backend_key_data(out: &mut BytesMut, pid: i32, secret: i32) {
    write_message(out, BACKEND_KEY_DATA, |b| {
        b.put_i32(pid);
        b.put_i32(secret);
    });
}

/// NegotiateProtocolVersion: the newest version we speak and the `_pq_.` options we
/// did not recognise, as PostgreSQL answers a client that asks for more than 3.0.
///
/// `newest` is the newest protocol version supported, as a whole version number (3.0 is
/// `3 << 16`): that is what PostgreSQL sends in the field the documentation calls "newest
/// minor protocol version", and what libpq reads.
pub fn negotiate_protocol_version(out: &mut BytesMut, newest: i32, unrecognized: &[String]) {
    write_message(out, NEGOTIATE_PROTOCOL_VERSION, |b| {
        b.put_i32(newest);
        b.put_i32(unrecognized.len() as i32);
        for o in unrecognized {
            put_cstr(b, o.as_bytes());
        }
    });
}

/// RowDescription where every column is `text` (OID 25) in text format: what the admin
/// console returns.
pub fn row_description_text(out: &mut BytesMut, columns: &[&str]) {
    write_message(out, ROW_DESCRIPTION, |b| {
        b.put_i16(columns.len() as i16);
        for c in columns {
            put_cstr(b, c.as_bytes());
            b.put_i32(0); // table oid
            b.put_i16(0); // column number
            b.put_u32(25); // text
            b.put_i16(-1); // type size
            b.put_i32(-1); // type modifier
            b.put_i16(0); // text format
        }
    });
}

pub fn data_row<S: AsRef<str>>(out: &mut BytesMut, values: &[Option<S>]) {
    write_message(out, DATA_ROW, |b| {
        b.put_i16(values.len() as i16);
        for v in values {
            match v {
                Some(v) => {
                    b.put_i32(v.as_ref().len() as i32);
                    b.extend_from_slice(v.as_ref().as_bytes());
                }
                None => b.put_i32(-1),
            }
        }
    });
}

pub fn command_complete(out: &mut BytesMut, tag: &str) {
    write_message(out, COMMAND_COMPLETE, |b| put_cstr(b, tag.as_bytes()));
}

/// The rows a CommandComplete's body (its tag and NUL) counts: the last word of `SELECT 5`,
/// `INSERT 0 5`, `UPDATE 3`, `COPY 2`, ...; None for a tag without a count (`BEGIN`, `SET`).
pub fn command_rows(body: &[u8]) -> Option<u64> {
    let tag = body.strip_suffix(&[0]).unwrap_or(body);
    let last = tag.rsplit(|&b| b == b' ').next()?;
    if last.is_empty() || last.len() > 19 || !last.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(last.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

pub fn empty_query_response(out: &mut BytesMut) {
    write_empty_message(out, EMPTY_QUERY_RESPONSE);
}

/// Every field of an ErrorResponse or NoticeResponse body, in order, as (code, value); stops
/// at the terminator or at the first malformed field.
pub fn fields(body: &[u8]) -> impl Iterator<Item = (u8, &[u8])> {
    let mut r = Reader::new(body);
    std::iter::from_fn(move || {
        let code = r.u8().filter(|&c| c != 0)?;
        Some((code, r.cstr()?))
    })
}

/// The body of an ErrorResponse (its fields after tag and length, as a server's error is
/// kept: [`ErrorFields::parse`] and [`error_with_severity`] read it) from `(field type,
/// value)` pairs: for an error pgmemo raises where a server's would be.
pub fn error_body(fields: &[(u8, &str)]) -> bytes::Bytes {
    let mut b = BytesMut::new();
    for (field, value) in fields {
        b.put_u8(*field);
        put_cstr(&mut b, value.as_bytes());
    }
    b.put_u8(0);
    b.freeze()
}

/// The fields of an ErrorResponse or NoticeResponse that pgmemo looks at.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ErrorFields {
    pub severity: String,
    pub code: String,
    pub message: String,
}

impl ErrorFields {
    pub fn parse(body: &[u8]) -> Option<ErrorFields> {
        let mut r = Reader::new(body);
        let mut fields = ErrorFields::default();
        loop {
            let field = r.u8()?;
            if field == 0 {
                return Some(fields);
            }
            let value = String::from_utf8_lossy(r.cstr()?).into_owned();
            match field {
                b'V' => fields.severity = value,
                b'S' if fields.severity.is_empty() => fields.severity = value,
                b'C' => fields.code = value,
                b'M' => fields.message = value,
                _ => {}
            }
        }
    }

    pub fn is_fatal(&self) -> bool {
        matches!(self.severity.as_str(), "FATAL" | "PANIC")
    }
}

/// Rewrites the severity of an ErrorResponse body (both the localized `S` and the raw `V`
/// field). Used to turn a server's ERROR into the FATAL a client must see when its login fails.
pub fn error_with_severity(out: &mut BytesMut, body: &[u8], severity: Severity) {
    write_message(out, ERROR_RESPONSE, |b| {
        let mut r = Reader::new(body);
        while let Some(field) = r.u8() {
            if field == 0 {
                break;
            }
            let Some(value) = r.cstr() else { break };
            b.put_u8(field);
            if matches!(field, b'S' | b'V') {
                put_cstr(b, severity.as_str().as_bytes());
            } else {
                put_cstr(b, value);
            }
        }
        b.put_u8(0);
    });
}

/// Re-emits an ErrorResponse with the quoted name `from` in its message text replaced by
/// `to`; every other field stays PostgreSQL's.
pub fn error_with_renamed(out: &mut BytesMut, body: &[u8], from: &[u8], to: &[u8]) {
    let mut quoted_from = Vec::with_capacity(from.len() + 2);
    quoted_from.push(b'"');
    quoted_from.extend_from_slice(from);
    quoted_from.push(b'"');
    write_message(out, ERROR_RESPONSE, |b| {
        let mut r = Reader::new(body);
        while let Some(field) = r.u8() {
            if field == 0 {
                break;
            }
            let Some(value) = r.cstr() else { break };
            b.put_u8(field);
            match (
                field,
                value
                    .windows(quoted_from.len())
                    .position(|w| w == quoted_from),
            ) {
                (b'M', Some(at)) => {
                    b.extend_from_slice(&value[..at + 1]);
                    b.extend_from_slice(to);
                    put_cstr(b, &value[at + quoted_from.len() - 1..]);
                }
                _ => put_cstr(b, value),
            }
        }
        b.put_u8(0);
    });
}

pub fn parse_parameter_status(body: &[u8]) -> Option<(&str, &str)> {
    let mut r = Reader::new(body);
    Some((r.str()?, r.str()?))
}

pub fn parse_backend_key_data(body: &[u8]) -> Option<(i32, i32)> {
    let mut r = Reader::new(body);
    Some((r.i32()?, r.i32()?))
}

/// What an Authentication message asks for.
#[derive(Debug)]
pub enum AuthRequest<'a> {
    Ok,
    Cleartext,
    Md5([u8; 4]),
    Sasl(Vec<&'a str>),
    SaslContinue(&'a [u8]),
    SaslFinal(&'a [u8]),
    Other(i32),
}

pub fn parse_auth(body: &[u8]) -> Option<AuthRequest<'_>> {
    let mut r = Reader::new(body);
    Some(match r.i32()? {
        0 => AuthRequest::Ok,
        3 => AuthRequest::Cleartext,
        5 => {
            let s = r.bytes(4)?;
            AuthRequest::Md5([s[0], s[1], s[2], s[3]])
        }
        10 => {
            let mut mechs = Vec::new();
            while let Some(m) = r.str() {
                if m.is_empty() {
                    break;
                }
                mechs.push(m);
            }
            AuthRequest::Sasl(mechs)
        }
        11 => AuthRequest::SaslContinue(r.remaining()),
        12 => AuthRequest::SaslFinal(r.remaining()),
        n => AuthRequest::Other(n),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_command_tags() {
        assert_eq!(command_rows(b"SELECT 5\0"), Some(5));
        assert_eq!(command_rows(b"INSERT 0 12\0"), Some(12));
        assert_eq!(command_rows(b"UPDATE 0\0"), Some(0));
        assert_eq!(command_rows(b"BEGIN\0"), None);
        assert_eq!(command_rows(b"\0"), None);
        assert_eq!(command_rows(b"SELECT 99999999999999999999999\0"), None);
    }

    #[test]
    fn error_roundtrip() {
        let mut out = BytesMut::new();
        error_response(&mut out, Severity::Fatal, "08P01", "bad");
        let f = ErrorFields::parse(&out[5..]).unwrap();
        assert_eq!(f.code, "08P01");
        assert_eq!(f.message, "bad");
        assert!(f.is_fatal());
        let mut again = BytesMut::new();
        error_with_severity(&mut again, &out[5..], Severity::Error);
        let g = ErrorFields::parse(&again[5..]).unwrap();
        assert_eq!(g.severity, "ERROR");
        assert_eq!(g.message, "bad");
    }

    #[test]
    fn error_rename_keeps_other_fields() {
        let mut out = BytesMut::new();
        write_message(&mut out, ERROR_RESPONSE, |b| {
            for (f, v) in [
                (b'S', "ERROR"),
                (b'C', "26000"),
                (b'M', "prepared statement \"pgmemo_missing\" does not exist"),
                (b'R', "FetchPreparedStatement"),
            ] {
                b.put_u8(f);
                put_cstr(b, v.as_bytes());
            }
            b.put_u8(0);
        });
        let mut renamed = BytesMut::new();
        error_with_renamed(&mut renamed, &out[5..], b"pgmemo_missing", b"mine");
        let f = ErrorFields::parse(&renamed[5..]).unwrap();
        assert_eq!(f.message, "prepared statement \"mine\" does not exist");
        assert_eq!(f.code, "26000");
        assert!(renamed.windows(22).any(|w| w == b"FetchPreparedStatement"));
    }

    #[test]
    fn auth_parse() {
        let mut out = BytesMut::new();
        auth_sasl(&mut out, &["SCRAM-SHA-256"]);
        match parse_auth(&out[5..]).unwrap() {
            AuthRequest::Sasl(m) => assert_eq!(m, vec!["SCRAM-SHA-256"]),
            other => panic!("{other:?}"),
        }
    }
}
