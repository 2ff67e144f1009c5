//! The PostgreSQL v3 wire protocol: framing, typed views of the messages pgmemo must look
//! inside, and builders for the messages it writes itself.
//!
//! Everything here works on byte slices of a connection's read buffer. A message is found with
//! [`frame`] (a cheap check that a whole message is buffered, before anything is parsed), looked
//! at through a borrowed view when pgmemo needs its fields, and forwarded as the same bytes when
//! it does not. Nothing on the forwarding path allocates.

pub mod backend;
pub mod frontend;
pub mod startup;

use std::fmt;

/// Default upper bound on a single message from a client (PostgreSQL itself allows 1 GB, but a
/// proxy should not buffer that much for one client without being asked to).
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 64 * 1024 * 1024;

/// Messages from a server are bounded only by PostgreSQL's own limit (1 GB of data plus header).
pub const MAX_BACKEND_MESSAGE_SIZE: usize = 1024 * 1024 * 1024 + 1024;

/// A framing error: the peer sent something that is not a valid message. The connection it came
/// from cannot be trusted to be in sync any more and must be closed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// The length field is below 4 or above the configured maximum.
    BadLength { tag: u8, len: usize, max: usize },
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::BadLength { tag, len, max } if *len > *max => write!(
                f,
                "invalid message length: message of type {:?} is {len} bytes, the limit is {max}",
                *tag as char
            ),
            FrameError::BadLength { tag, len, .. } => write!(
                f,
                "invalid message length {len} for message of type {:?}",
                *tag as char
            ),
        }
    }
}

impl std::error::Error for FrameError {}

/// PostgreSQL keeps the first 63 bytes (NAMEDATALEN - 1) of a statement name: a longer name in
/// Parse, Bind, Describe or Close means the statement named by its first 63 bytes.
pub const MAX_NAME_LEN: usize = 63;

/// The statement name as PostgreSQL stores it.
#[inline]
pub fn pg_name(name: &[u8]) -> &[u8] {
    &name[..name.len().min(MAX_NAME_LEN)]
}

/// A message's header: its type byte and its four-byte length.
pub const HEADER_LEN: usize = 5;

/// The body of the whole message `msg` (header included, as [`frame`] finds it): what follows
/// the type and length. The one place outside the message views that knows the header's size.
#[inline]
pub fn body(msg: &[u8]) -> &[u8] {
    &msg[HEADER_LEN..]
}

/// The complete messages at the start of a buffer, in order, as (tag, body): up to the first
/// that is not all there or has an impossible length (the session's own framing deals with
/// that one). `at`: the bytes read so far.
pub struct Messages<'a> {
    input: &'a [u8],
    pub at: usize,
}

pub fn messages(input: &[u8]) -> Messages<'_> {
    Messages { input, at: 0 }
}

impl<'a> Iterator for Messages<'a> {
    type Item = (u8, &'a [u8]);

    fn next(&mut self) -> Option<(u8, &'a [u8])> {
        let (tag, len) = frame(&self.input[self.at..], usize::MAX).ok()??;
        let body = &self.input[self.at + 5..self.at + len];
        self.at += len;
        Some((tag, body))
    }
}

/// Returns `Ok(Some((tag, len)))` where `len` is the whole message including the tag byte and
/// the length field, `Ok(None)` when more bytes are needed, and an error when the length field
/// is impossible (then the stream is out of sync and must be dropped).
#[inline]
pub fn frame(buf: &[u8], max: usize) -> Result<Option<(u8, usize)>, FrameError> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let tag = buf[0];
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if !(4..=max).contains(&len) {
        return Err(FrameError::BadLength { tag, len, max });
    }
    if buf.len() < len + 1 {
        return Ok(None);
    }
    Ok(Some((tag, len + 1)))
}

/// A cursor over a message body that reads PostgreSQL's field types. Every read checks bounds
/// and returns `None` on a short or malformed body, so a hostile message can never panic us.
#[derive(Clone, Copy)]
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    pub fn remaining(&self) -> &'a [u8] {
        self.buf
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn u8(&mut self) -> Option<u8> {
        let (&b, rest) = self.buf.split_first()?;
        self.buf = rest;
        Some(b)
    }

    pub fn i16(&mut self) -> Option<i16> {
        let b = self.bytes(2)?;
        Some(i16::from_be_bytes([b[0], b[1]]))
    }

    pub fn i32(&mut self) -> Option<i32> {
        let b = self.bytes(4)?;
        Some(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.buf.len() < n {
            return None;
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Some(head)
    }

    /// A NUL-terminated string, without the NUL.
    #[inline]
    pub fn cstr(&mut self) -> Option<&'a [u8]> {
        let end = nul_at(self.buf)?;
        let s = &self.buf[..end];
        self.buf = &self.buf[end + 1..];
        Some(s)
    }

    /// A NUL-terminated string that must be UTF-8 (names and SQL text are, in practice).
    pub fn str(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.cstr()?).ok()
    }
}

/// Where the first NUL of `buf` is. Most strings read so are statement and portal names,
/// mostly empty (the unnamed ones) or a few bytes long: their first eight bytes are tested as
/// one word (a SWAR zero-byte test, ~10 instructions) before memchr's vectorized search, whose
/// set-up alone cost ~40 instructions a call (callgrind: 6 calls per extended batch).
#[inline]
pub fn nul_at(buf: &[u8]) -> Option<usize> {
    const LOW: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    match buf.first_chunk::<8>() {
        Some(head) => {
            let word = u64::from_le_bytes(*head);
            let zeros = word.wrapping_sub(LOW) & !word & HIGH;
            if zeros != 0 {
                // The lowest flagged byte is the first NUL (a borrow only runs upwards).
                Some(zeros.trailing_zeros() as usize / 8)
            } else {
                memchr::memchr(0, &buf[8..]).map(|at| at + 8)
            }
        }
        None => buf.iter().position(|&b| b == 0),
    }
}

/// Appends a message with `tag` to `out`, letting `body` write the payload; the length field is
/// filled in afterwards so callers never count bytes by hand.
#[inline]
pub fn write_message(out: &mut bytes::BytesMut, tag: u8, body: impl FnOnce(&mut bytes::BytesMut)) {
    use bytes::BufMut;
    out.put_u8(tag);
    let len_at = out.len();
    out.put_u32(0);
    body(out);
    let len = (out.len() - len_at) as u32;
    out[len_at..len_at + 4].copy_from_slice(&len.to_be_bytes());
}

/// Appends a message without a body (ParseComplete, BindComplete, NoData...): five bytes,
/// written at once.
#[inline]
pub fn write_empty_message(out: &mut bytes::BytesMut, tag: u8) {
    out.extend_from_slice(&[tag, 0, 0, 0, 4]);
}

/// Appends `s` and a terminating NUL.
#[inline]
pub fn put_cstr(out: &mut bytes::BytesMut, s: &[u8]) {
    out.extend_from_slice(s);
    out.extend_from_slice(&[0]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The messages written at once are the ones `write_message` frames.
    #[test]
    fn messages_written_at_once_are_framed_alike() {
        for tag in [b'1', b'2', b'n', b'3'] {
            let (mut framed, mut at_once) = (bytes::BytesMut::new(), bytes::BytesMut::new());
            write_message(&mut framed, tag, |_| {});
            write_empty_message(&mut at_once, tag);
            assert_eq!(framed, at_once);
        }
        for status in [b'I', b'T', b'E'] {
            let (mut framed, mut at_once) = (bytes::BytesMut::new(), bytes::BytesMut::new());
            write_message(&mut framed, backend::READY_FOR_QUERY, |b| {
                b.extend_from_slice(&[status])
            });
            backend::ready_for_query(&mut at_once, status);
            assert_eq!(framed, at_once);
        }
    }

    #[test]
    fn nul_at_finds_the_first_nul_at_any_position() {
        for len in 0..40 {
            for at in 0..len {
                let mut buf: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
                buf[at] = 0;
                // A later NUL and bytes >= 0x80 do not fool the word test.
                if at + 1 < len {
                    buf[at + 1] = 0x80;
                }
                if at + 3 < len {
                    buf[at + 3] = 0;
                }
                assert_eq!(nul_at(&buf), Some(at), "len {len}, NUL at {at}");
            }
            let none: Vec<u8> = (0..len).map(|i| 0x80 | i as u8).collect();
            assert_eq!(nul_at(&none), None, "len {len}");
        }
    }

    #[test]
    fn frame_needs_whole_message() {
        let msg = [b'Q', 0, 0, 0, 8, b'S', b'E', b'L', 0];
        assert_eq!(frame(&msg[..4], 100), Ok(None));
        assert_eq!(frame(&msg[..8], 100), Ok(None));
        assert_eq!(frame(&msg, 100), Ok(Some((b'Q', 9))));
    }

    #[test]
    fn frame_rejects_impossible_lengths() {
        assert!(frame(&[b'Q', 0, 0, 0, 3], 100).is_err());
        assert!(frame(&[b'Q', 0x7f, 0, 0, 0], 100).is_err());
        assert!(frame(&[b'Q', 0, 0, 0, 4], 100).unwrap().is_some());
    }

    #[test]
    fn reader_never_panics_on_short_input() {
        let mut r = Reader::new(&[1, 2, 3]);
        assert_eq!(r.i32(), None);
        assert_eq!(r.i16(), Some(0x0102));
        assert_eq!(r.cstr(), None);
        assert_eq!(r.u8(), Some(3));
        assert_eq!(r.u8(), None);
    }

    #[test]
    fn write_message_fills_length() {
        let mut out = bytes::BytesMut::new();
        write_message(&mut out, b'Q', |b| put_cstr(b, b"SELECT 1"));
        assert_eq!(frame(&out, 100), Ok(Some((b'Q', out.len()))));
        assert_eq!(&out[5..], b"SELECT 1\0");
    }
}
