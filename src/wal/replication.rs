//! The streaming replication sub-protocol inside CopyBoth: the server's XLogData and primary
//! keepalive messages, and the standby status update pgmemo answers with.

use super::Lsn;
use bytes::{BufMut, BytesMut};
use std::time::{SystemTime, UNIX_EPOCH};

/// What the server sent in one CopyData.
#[derive(Debug, PartialEq, Eq)]
pub enum FromServer<'a> {
    /// WAL data: here one pgoutput message. `wal_end`: the server's current end of WAL.
    XLogData {
        start: Lsn,
        wal_end: Lsn,
        data: &'a [u8],
    },
    /// The server's position; it wants a status update at once when `reply` is set.
    Keepalive { wal_end: Lsn, reply: bool },
}

/// Reads a CopyData payload from the server.
pub fn parse(payload: &[u8]) -> Option<FromServer<'_>> {
    let u64_at = |at: usize| -> Option<u64> {
        Some(u64::from_be_bytes(
            payload.get(at..at + 8)?.try_into().ok()?,
        ))
    };
    match payload.first()? {
        b'w' => Some(FromServer::XLogData {
            start: Lsn(u64_at(1)?),
            wal_end: Lsn(u64_at(9)?),
            data: payload.get(25..)?,
        }),
        b'k' => Some(FromServer::Keepalive {
            wal_end: Lsn(u64_at(1)?),
            reply: *payload.get(17)? != 0,
        }),
        _ => None,
    }
}

/// Microseconds from 1970 to 2000-01-01, PostgreSQL's epoch.
const PG_EPOCH_OFFSET_US: u64 = 946_684_800_000_000;

/// Now, in microseconds since PostgreSQL's epoch.
pub fn pg_now() -> i64 {
    let since_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    since_unix.saturating_sub(PG_EPOCH_OFFSET_US) as i64
}

/// Appends a CopyData with a standby status update: everything up to `applied` is written,
/// flushed and applied (the server may then recycle that WAL); `reply`: the server answers
/// with a keepalive at once.
pub fn status_update(out: &mut BytesMut, applied: Lsn, reply: bool) {
    crate::protocol::write_message(out, b'd', |b| {
        b.put_u8(b'r');
        for _ in 0..3 {
            b.put_u64(applied.0);
        }
        b.put_i64(pg_now());
        b.put_u8(u8::from(reply));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_xlogdata_and_keepalives() {
        let mut w = vec![b'w'];
        w.extend(1u64.to_be_bytes());
        w.extend(9u64.to_be_bytes());
        w.extend(0i64.to_be_bytes());
        w.extend(b"Bpayload");
        assert_eq!(
            parse(&w),
            Some(FromServer::XLogData {
                start: Lsn(1),
                wal_end: Lsn(9),
                data: b"Bpayload"
            })
        );
        let mut k = vec![b'k'];
        k.extend(42u64.to_be_bytes());
        k.extend(0i64.to_be_bytes());
        k.push(1);
        assert_eq!(
            parse(&k),
            Some(FromServer::Keepalive {
                wal_end: Lsn(42),
                reply: true
            })
        );
        assert_eq!(parse(b"k\0\0"), None);
        assert_eq!(parse(b"x"), None);
    }

    #[test]
    fn status_update_layout() {
        let mut out = BytesMut::new();
        status_update(&mut out, Lsn(0x0102), true);
        assert_eq!(out[0], b'd');
        assert_eq!(out.len(), 1 + 4 + 1 + 8 * 4 + 1);
        assert_eq!(out[5], b'r');
        assert_eq!(&out[6..14], &0x0102u64.to_be_bytes());
        assert_eq!(out[out.len() - 1], 1);
        assert!(pg_now() > 0);
    }
}
