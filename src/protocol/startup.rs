//! The first packet of a connection: a StartupMessage, or one of the special requests
//! (SSLRequest, GSSENCRequest, CancelRequest) that share its untagged framing.

use super::Reader;

pub const PROTOCOL_3_0: i32 = 3 << 16;
pub const SSL_REQUEST: i32 = 80877103;
pub const GSSENC_REQUEST: i32 = 80877104;
pub const CANCEL_REQUEST: i32 = 80877102;

/// PostgreSQL's MAX_STARTUP_PACKET_LENGTH: the longest startup packet, not counting its
/// length word.
pub const MAX_STARTUP_PACKET: usize = 10000;
/// The longest startup packet PostgreSQL reads, length word included.
pub const MAX_STARTUP_FRAME: usize = MAX_STARTUP_PACKET + 4;

/// What PostgreSQL logs, without a word to the client, of a startup packet whose length is
/// out of range (or a CancelRequest of another length than its own).
pub const INVALID_LENGTH: &str = "invalid length of startup packet";
/// What PostgreSQL logs, without a word to the client, when the connection ends inside a
/// startup packet.
pub const INCOMPLETE: &str = "incomplete startup packet";
/// PostgreSQL's FATAL (08P01) for a StartupMessage whose terminator is not its last byte.
pub const BAD_LAYOUT: &str = "invalid startup packet layout: expected terminator as last byte";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartupPacket {
    Ssl,
    GssEnc,
    Cancel {
        pid: i32,
        secret: i32,
    },
    Startup {
        /// The minor protocol version asked for (3.x).
        minor: i32,
        /// All parameters in order, including `user`, `database` and `_pq_.` options.
        params: Vec<(String, String)>,
        /// Whether the packet ends with its terminator, exactly at its last byte. PostgreSQL
        /// reads the parameters before it refuses one that does not ([`BAD_LAYOUT`]), so a
        /// bad `replication` value among them is what it reports first.
        well_formed: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartupError {
    /// A packet PostgreSQL closes the connection on without a reply, only logging this
    /// (COMMERROR): a length out of range, a CancelRequest of the wrong length.
    Dropped(&'static str),
    /// A protocol major version other than 3 (FATAL 0A000). An SSLRequest or GSSENCRequest
    /// after its answer reads as one too (1234.5679, 1234.5680), as in PostgreSQL.
    UnsupportedProtocol(i32),
}

impl std::fmt::Display for StartupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartupError::Dropped(m) => f.write_str(m),
            StartupError::UnsupportedProtocol(v) => write!(
                f,
                "unsupported frontend protocol {}.{}: server supports 3.0 to 3.0",
                major(*v),
                (*v as u32) & 0xffff
            ),
        }
    }
}

/// The major version of protocol version `v`, read as PostgreSQL reads it (unsigned).
fn major(v: i32) -> u32 {
    (v as u32) >> 16
}

/// Whether PostgreSQL refuses a client asking for protocol version `v` in protocol 2.0's
/// error format, which such a client reads: a major version below 3, except version 0 (0.0),
/// which PostgreSQL's error reporting takes for "not set yet" and answers in the current one.
pub fn refused_in_protocol_2(v: i32) -> bool {
    major(v) < 3 && v != 0
}

/// The length of the startup packet at the front of `buf` if it is complete. A length out of
/// PostgreSQL's range is refused as soon as its four bytes are in, as PostgreSQL refuses it.
pub fn frame(buf: &[u8]) -> Result<Option<usize>, StartupError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if !(8..=MAX_STARTUP_FRAME).contains(&len) {
        return Err(StartupError::Dropped(INVALID_LENGTH));
    }
    Ok((buf.len() >= len).then_some(len))
}

/// Decodes one whole startup packet (including its length field).
pub fn parse(packet: &[u8]) -> Result<StartupPacket, StartupError> {
    let body = packet.get(4..).unwrap_or_default();
    let mut r = Reader::new(body);
    let code = r.i32().ok_or(StartupError::Dropped(INVALID_LENGTH))?;
    match code {
        SSL_REQUEST => Ok(StartupPacket::Ssl),
        GSSENC_REQUEST => Ok(StartupPacket::GssEnc),
        CANCEL_REQUEST => {
            // The code, the process id and the secret key, and nothing more.
            let pid = r.i32();
            let secret = r.i32();
            match (pid, secret, body.len()) {
                (Some(pid), Some(secret), 12) => Ok(StartupPacket::Cancel { pid, secret }),
                _ => Err(StartupError::Dropped(INVALID_LENGTH)),
            }
        }
        v if major(v) == 3 => {
            let (params, well_formed) = parameters(body);
            Ok(StartupPacket::Startup {
                minor: v & 0xffff,
                params,
                well_formed,
            })
        }
        v => Err(StartupError::UnsupportedProtocol(v)),
    }
}

/// The name/value pairs of a StartupMessage's `body` (from its protocol version on), read as
/// PostgreSQL reads them, and whether the terminator is exactly its last byte. PostgreSQL
/// stops at the terminator or at a name with no value after it, and reads a string that runs
/// past the end as ending there (its copy of the packet has a NUL after it).
fn parameters(body: &[u8]) -> (Vec<(String, String)>, bool) {
    let text = |s: &[u8]| String::from_utf8_lossy(s).into_owned();
    let mut params = Vec::new();
    let mut offset = 4;
    while offset < body.len() {
        let name = cstr_at(body, offset);
        if name.is_empty() {
            break;
        }
        let value_at = offset + name.len() + 1;
        if value_at >= body.len() {
            break;
        }
        let value = cstr_at(body, value_at);
        params.push((text(name), text(value)));
        offset = value_at + value.len() + 1;
    }
    (params, offset + 1 == body.len())
}

/// The string at `at` in `buf`: up to its NUL, or to the end of `buf` when it has none.
fn cstr_at(buf: &[u8], at: usize) -> &[u8] {
    let rest = buf.get(at..).unwrap_or_default();
    let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    &rest[..end]
}

/// What a StartupMessage's `replication` parameter asks for, read as PostgreSQL reads it:
/// `database` for a logical replication connection (a walsender connected to a database), a
/// boolean for a physical one or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Replication {
    #[default]
    None,
    Logical,
    Physical,
}

impl Replication {
    /// The parameter's value read; None for a value PostgreSQL refuses (see
    /// [`Replication::invalid`]).
    pub fn parse(value: &str) -> Option<Replication> {
        if value == "database" {
            return Some(Replication::Logical);
        }
        Some(match parse_bool(value)? {
            true => Replication::Physical,
            false => Replication::None,
        })
    }

    /// PostgreSQL's FATAL message and hint for a value [`Replication::parse`] refuses.
    pub fn invalid(value: &str) -> (String, &'static str) {
        (
            format!("invalid value for parameter \"replication\": \"{value}\""),
            "Valid values are: \"false\", 0, \"true\", 1, \"database\".",
        )
    }

    /// The parameter's value for the server, as PostgreSQL would read the client's.
    pub fn parameter(self) -> &'static str {
        match self {
            Replication::None => "false",
            Replication::Logical => "database",
            Replication::Physical => "true",
        }
    }

    /// Its name in PgBouncer's SHOW CLIENTS and SHOW SERVERS.
    pub fn name(self) -> &'static str {
        match self {
            Replication::None => "none",
            Replication::Logical => "logical",
            Replication::Physical => "physical",
        }
    }
}

/// PostgreSQL's `parse_bool`: any prefix of true, false, yes, no (case-insensitive), `on`,
/// `off` and `of`, `1`, `0`.
fn parse_bool(value: &str) -> Option<bool> {
    let v = value.to_ascii_lowercase();
    let prefix_of = |word: &str, min: usize| v.len() >= min && word.starts_with(v.as_str());
    if prefix_of("true", 1) || prefix_of("yes", 1) || prefix_of("on", 2) || v == "1" {
        Some(true)
    } else if prefix_of("false", 1) || prefix_of("no", 1) || prefix_of("off", 2) || v == "0" {
        Some(false)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;

    #[test]
    fn startup_roundtrip() {
        let mut out = BytesMut::new();
        crate::protocol::frontend::startup(&mut out, &[("user", "u"), ("database", "d")]);
        assert_eq!(frame(&out).unwrap(), Some(out.len()));
        match parse(&out).unwrap() {
            StartupPacket::Startup {
                minor,
                params,
                well_formed,
            } => {
                assert!(well_formed);
                assert_eq!(minor, 0);
                assert_eq!(params[0], ("user".into(), "u".into()));
                assert_eq!(params[1], ("database".into(), "d".into()));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn special_requests_and_garbage() {
        let ssl = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
        assert_eq!(parse(&ssl).unwrap(), StartupPacket::Ssl);
        assert!(frame(&[0, 0, 0, 2]).is_err());
        assert!(frame(&[0, 0, 0x7f, 0]).is_err());
        let v2 = [0, 0, 0, 8, 0, 2, 0, 0];
        assert_eq!(
            parse(&v2).unwrap_err(),
            StartupError::UnsupportedProtocol(2 << 16)
        );
        let unterminated = [0, 0, 0, 10, 0, 3, 0, 0, b'u', b's'];
        assert_eq!(
            parse(&unterminated).unwrap(),
            StartupPacket::Startup {
                minor: 0,
                params: vec![],
                well_formed: false
            }
        );
    }

    /// A packet with a body of `body` (the protocol version or request code first).
    fn packet(body: &[u8]) -> Vec<u8> {
        let mut p = ((body.len() + 4) as u32).to_be_bytes().to_vec();
        p.extend_from_slice(body);
        p
    }

    #[test]
    fn lengths_are_checked_as_postgresql_checks_them() {
        // A Terminate message where the startup packet should be: its tag reads as a huge length.
        assert_eq!(
            frame(b"X\0\0\0\x04"),
            Err(StartupError::Dropped(INVALID_LENGTH))
        );
        assert!(frame(&[0, 0, 0, 7]).is_err());
        assert_eq!(frame(&[0, 0, 0, 8]), Ok(None));
        // PostgreSQL's limit leaves out the length word.
        assert_eq!(frame(&(MAX_STARTUP_FRAME as u32).to_be_bytes()), Ok(None));
        let over = (MAX_STARTUP_FRAME as u32 + 1).to_be_bytes();
        assert_eq!(frame(&over), Err(StartupError::Dropped(INVALID_LENGTH)));
    }

    #[test]
    fn a_cancel_request_has_exactly_its_length() {
        let mut body = CANCEL_REQUEST.to_be_bytes().to_vec();
        body.extend([0, 0, 0, 7, 0, 0, 0, 9]);
        let cancel = StartupPacket::Cancel { pid: 7, secret: 9 };
        assert_eq!(parse(&packet(&body)), Ok(cancel));
        let mut long = body.clone();
        long.push(0);
        for wrong in [&body[..8], &long[..]] {
            let got = parse(&packet(wrong));
            assert_eq!(got, Err(StartupError::Dropped(INVALID_LENGTH)), "{wrong:?}");
        }
    }

    #[test]
    fn parameters_are_read_as_postgresql_reads_them() {
        /// The parameters as [`parse`] gives them.
        fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
            p.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        }
        let v3 = PROTOCOL_3_0.to_be_bytes();
        for (body, params, well_formed) in [
            (&b"user\0u\0\0"[..], pairs(&[("user", "u")]), true),
            (&b""[..], pairs(&[]), false),
            (&b"user\0"[..], pairs(&[]), false),
            (&b"user\0u\0\0junk"[..], pairs(&[("user", "u")]), false),
            // A value that runs to the end is read (a bad `replication` is reported first).
            (
                &b"replication\0maybe"[..],
                pairs(&[("replication", "maybe")]),
                false,
            ),
            (&b"user\0\0\0"[..], pairs(&[("user", "")]), true),
        ] {
            let got = parse(&packet(&[&v3[..], body].concat())).unwrap();
            let want = StartupPacket::Startup {
                minor: 0,
                params,
                well_formed,
            };
            assert_eq!(got, want, "{body:?}");
        }
    }

    #[test]
    fn old_versions_are_refused_in_their_format() {
        assert!(refused_in_protocol_2(2 << 16));
        assert!(refused_in_protocol_2(5));
        assert!(!refused_in_protocol_2(0));
        assert!(!refused_in_protocol_2(4 << 16));
        assert!(!refused_in_protocol_2(SSL_REQUEST));
        assert!(!refused_in_protocol_2(-65536));
    }

    #[test]
    fn unsupported_versions_are_named_as_postgresql_names_them() {
        let after_ssl = StartupError::UnsupportedProtocol(SSL_REQUEST).to_string();
        assert!(after_ssl.starts_with("unsupported frontend protocol 1234.5679:"));
        let high = StartupError::UnsupportedProtocol(-65536).to_string();
        assert!(
            high.starts_with("unsupported frontend protocol 65535.0:"),
            "{high}"
        );
    }

    #[test]
    fn replication_is_read_as_postgresql_reads_it() {
        use Replication::*;
        for (value, want) in [
            ("database", Some(Logical)),
            ("true", Some(Physical)),
            ("T", Some(Physical)),
            ("ye", Some(Physical)),
            ("on", Some(Physical)),
            ("1", Some(Physical)),
            ("false", Some(None)),
            ("f", Some(None)),
            ("NO", Some(None)),
            ("of", Some(None)),
            ("0", Some(None)),
            ("o", Option::None),
            ("Database", Option::None),
            ("yes please", Option::None),
            ("", Option::None),
            ("2", Option::None),
        ] {
            assert_eq!(Replication::parse(value), want, "{value:?}");
        }
    }
}
