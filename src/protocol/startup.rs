//! The first packet of a connection: a StartupMessage, or one of the special requests
//! (SSLRequest, GSSENCRequest, CancelRequest) that share its untagged framing.

use super::Reader;

pub const PROTOCOL_3_0: i32 = 3 << 16;
pub const SSL_REQUEST: i32 = 80877103;
pub const GSSENC_REQUEST: i32 = 80877104;
pub const CANCEL_REQUEST: i32 = 80877102;

/// PostgreSQL's MAX_STARTUP_PACKET_LENGTH.
pub const MAX_STARTUP_PACKET: usize = 10000;

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
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartupError {
    /// Bad length or malformed content (08P01 "invalid length of startup packet" etc).
    Invalid(&'static str),
    /// A protocol major version other than 3.
    UnsupportedProtocol(i32),
}

impl std::fmt::Display for StartupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartupError::Invalid(m) => f.write_str(m),
            StartupError::UnsupportedProtocol(v) => write!(
                f,
                "unsupported frontend protocol {}.{}: server supports 3.0 to 3.0",
                v >> 16,
                v & 0xffff
            ),
        }
    }
}

/// The length of the startup packet at the front of `buf` if it is complete.
pub fn frame(buf: &[u8]) -> Result<Option<usize>, StartupError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if !(8..=MAX_STARTUP_PACKET).contains(&len) {
        return Err(StartupError::Invalid("invalid length of startup packet"));
    }
    Ok((buf.len() >= len).then_some(len))
}

/// Decodes one whole startup packet (including its length field).
pub fn parse(packet: &[u8]) -> Result<StartupPacket, StartupError> {
    let mut r = Reader::new(&packet[4..]);
    let code = r
        .i32()
        .ok_or(StartupError::Invalid("invalid length of startup packet"))?;
    match code {
        SSL_REQUEST => Ok(StartupPacket::Ssl),
        GSSENC_REQUEST => Ok(StartupPacket::GssEnc),
        CANCEL_REQUEST => {
            let pid = r.i32();
            let secret = r.i32();
            match (pid, secret) {
                (Some(pid), Some(secret)) => Ok(StartupPacket::Cancel { pid, secret }),
                _ => Err(StartupError::Invalid("invalid length of startup packet")),
            }
        }
        v if v >> 16 == 3 => {
            let mut params = Vec::new();
            loop {
                let key = r.cstr().ok_or(StartupError::Invalid(
                    "invalid startup packet layout: expected terminator as last byte",
                ))?;
                if key.is_empty() {
                    break;
                }
                let value = r.cstr().ok_or(StartupError::Invalid(
                    "invalid startup packet layout: expected terminator as last byte",
                ))?;
                params.push((
                    String::from_utf8_lossy(key).into_owned(),
                    String::from_utf8_lossy(value).into_owned(),
                ));
            }
            Ok(StartupPacket::Startup {
                minor: v & 0xffff,
                params,
            })
        }
        v => Err(StartupError::UnsupportedProtocol(v)),
    }
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
            StartupPacket::Startup { minor, params } => {
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
        assert!(parse(&unterminated).is_err());
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
