//! The messages of PostgreSQL's `pgoutput` logical decoding plugin (protocol version 1), as
//! far as invalidation needs them: which relations each transaction wrote, which rows (the
//! columns of each change, for their key: see `cache::rows`), and when it committed.
//!
//! Written by hand: the format is small and fixed (PostgreSQL's "Logical Replication Message
//! Formats"), and the crates that decode it come with their own connection handling.

use super::Lsn;

/// One decoded pgoutput message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Begin {
        final_lsn: Lsn,
        /// The transaction's (top-level) ID.
        xid: u32,
    },
    Commit {
        commit_lsn: Lsn,
        end_lsn: Lsn,
        /// Microseconds since 2000-01-01 (PostgreSQL's epoch).
        timestamp: i64,
    },
    /// A relation's identity and columns, sent before its first change in a session and again
    /// after it changed.
    Relation(Relation),
    /// An INSERT, UPDATE or DELETE of a row of the relation: the old row's columns (a
    /// DELETE's, an UPDATE's when its key changed or the identity is FULL) and the new
    /// row's (an INSERT's, an UPDATE's), by the relation's column order.
    Change {
        relation: u32,
        /// `I`, `U` or `D`.
        kind: u8,
        old: Option<Vec<Column>>,
        /// Whether `old` is the whole old row (`O`: `REPLICA IDENTITY FULL`), not only its
        /// key (`K`: the other columns then read as NULL).
        old_full: bool,
        new: Option<Vec<Column>>,
    },
    Truncate {
        relations: Vec<u32>,
    },
    /// Type, Origin, logical decoding Message and what later protocol versions add: nothing
    /// to do.
    Other(u8),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub id: u32,
    pub namespace: String,
    pub name: String,
    /// (name, type OID, type modifier) of each column, to notice a change of shape.
    pub columns: Vec<(String, u32, i32)>,
}

/// One column of a row in a change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Column {
    Null,
    /// A TOASTed value the change did not carry (unchanged).
    Unchanged,
    /// Its value in text form (or binary, which pgmemo never asks for: not read).
    Text(Vec<u8>),
    Binary,
}

/// Why a message could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed pgoutput message ({0})")]
pub struct Malformed(&'static str);

struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], Malformed> {
        if self.data.len() < n {
            return Err(Malformed(what));
        }
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Ok(head)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, Malformed> {
        Ok(self.take(1, what)?[0])
    }

    fn i16(&mut self, what: &'static str) -> Result<i16, Malformed> {
        let b = self.take(2, what)?;
        Ok(i16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, Malformed> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, Malformed> {
        let b = self.take(8, what)?;
        Ok(u64::from_be_bytes(b.try_into().expect("8 bytes")))
    }

    /// A TupleData: its columns.
    fn tuple(&mut self) -> Result<Vec<Column>, Malformed> {
        let n = self.i16("tuple")?.max(0) as usize;
        let mut columns = Vec::with_capacity(n.min(1600));
        for _ in 0..n {
            columns.push(match self.u8("tuple column")? {
                b'n' => Column::Null,
                b'u' => Column::Unchanged,
                kind @ (b't' | b'b') => {
                    let len = self.u32("tuple value")? as usize;
                    let value = self.take(len, "tuple value")?;
                    if kind == b't' {
                        Column::Text(value.to_vec())
                    } else {
                        Column::Binary
                    }
                }
                _ => return Err(Malformed("tuple column kind")),
            });
        }
        Ok(columns)
    }

    fn string(&mut self, what: &'static str) -> Result<String, Malformed> {
        let end = self
            .data
            .iter()
            .position(|&b| b == 0)
            .ok_or(Malformed(what))?;
        let s = String::from_utf8_lossy(&self.data[..end]).into_owned();
        self.data = &self.data[end + 1..];
        Ok(s)
    }
}

/// Decodes the pgoutput message carried by one XLogData.
pub fn decode(data: &[u8]) -> Result<Message, Malformed> {
    let mut r = Reader { data };
    let tag = r.u8("empty")?;
    Ok(match tag {
        b'B' => {
            let final_lsn = Lsn(r.u64("Begin")?);
            let _timestamp = r.u64("Begin")?;
            Message::Begin {
                final_lsn,
                xid: r.u32("Begin")?,
            }
        }
        b'C' => {
            let _flags = r.u8("Commit")?;
            Message::Commit {
                commit_lsn: Lsn(r.u64("Commit")?),
                end_lsn: Lsn(r.u64("Commit")?),
                timestamp: r.u64("Commit")? as i64,
            }
        }
        b'R' => {
            let id = r.u32("Relation")?;
            let namespace = r.string("Relation namespace")?;
            let name = r.string("Relation name")?;
            let _replica_identity = r.u8("Relation")?;
            let n = r.i16("Relation columns")?.max(0) as usize;
            let mut columns = Vec::with_capacity(n.min(1600));
            for _ in 0..n {
                let _flags = r.u8("column")?;
                let column = r.string("column name")?;
                let type_oid = r.u32("column type")?;
                let typmod = r.u32("column typmod")? as i32;
                columns.push((column, type_oid, typmod));
            }
            Message::Relation(Relation {
                id,
                namespace,
                name,
                columns,
            })
        }
        b'I' | b'U' | b'D' => {
            let relation = r.u32("change")?;
            let (mut old, mut new, mut old_full) = (None, None, false);
            while !r.data.is_empty() {
                match r.u8("change")? {
                    marker @ (b'K' | b'O') if tag != b'I' && old.is_none() && new.is_none() => {
                        old_full = marker == b'O';
                        old = Some(r.tuple()?)
                    }
                    b'N' if tag != b'D' && new.is_none() => new = Some(r.tuple()?),
                    _ => return Err(Malformed("change tuple")),
                }
            }
            Message::Change {
                relation,
                kind: tag,
                old,
                old_full,
                new,
            }
        }
        b'T' => {
            let n = r.u32("Truncate")? as usize;
            let _options = r.u8("Truncate")?;
            let mut relations = Vec::with_capacity(n.min(1 << 16));
            for _ in 0..n {
                relations.push(r.u32("Truncate relation")?);
            }
            Message::Truncate { relations }
        }
        other => Message::Other(other),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cstr(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }

    #[test]
    fn decodes_what_invalidation_needs() {
        let mut begin = vec![b'B'];
        begin.extend(0x10u64.to_be_bytes());
        begin.extend(0i64.to_be_bytes());
        begin.extend(7u32.to_be_bytes());
        assert_eq!(
            decode(&begin),
            Ok(Message::Begin {
                final_lsn: Lsn(0x10),
                xid: 7
            })
        );

        let mut rel = vec![b'R'];
        rel.extend(16384u32.to_be_bytes());
        cstr(&mut rel, "public");
        cstr(&mut rel, "accounts");
        rel.push(b'd');
        rel.extend(2i16.to_be_bytes());
        for (name, oid) in [("id", 23u32), ("owner", 25)] {
            rel.push(1);
            cstr(&mut rel, name);
            rel.extend(oid.to_be_bytes());
            rel.extend((-1i32).to_be_bytes());
        }
        let Ok(Message::Relation(r)) = decode(&rel) else {
            panic!("{:?}", decode(&rel));
        };
        assert_eq!(
            (r.id, r.namespace.as_str(), r.name.as_str()),
            (16384, "public", "accounts")
        );
        assert_eq!(r.columns[1], ("owner".to_string(), 25, -1));

        let mut update = vec![b'U'];
        update.extend(16384u32.to_be_bytes());
        update.extend(b"K\0\x02t\0\0\0\x017n");
        update.extend(b"N\0\x02t\0\0\0\x018u");
        assert_eq!(
            decode(&update),
            Ok(Message::Change {
                relation: 16384,
                kind: b'U',
                old: Some(vec![Column::Text(b"7".to_vec()), Column::Null]),
                old_full: false,
                new: Some(vec![Column::Text(b"8".to_vec()), Column::Unchanged]),
            })
        );
        let mut insert = vec![b'I'];
        insert.extend(16384u32.to_be_bytes());
        insert.extend(b"N\0\x01t\0\0\0\x011");
        assert!(matches!(
            decode(&insert),
            Ok(Message::Change {
                old: None,
                new: Some(_),
                ..
            })
        ));
        let mut delete = vec![b'D'];
        delete.extend(16384u32.to_be_bytes());
        delete.extend(b"N\0\x01t\0\0\0\x011");
        assert!(decode(&delete).is_err(), "a DELETE has no new row");

        let mut truncate = vec![b'T'];
        truncate.extend(2u32.to_be_bytes());
        truncate.push(0);
        truncate.extend(1u32.to_be_bytes());
        truncate.extend(2u32.to_be_bytes());
        assert_eq!(
            decode(&truncate),
            Ok(Message::Truncate {
                relations: vec![1, 2]
            })
        );

        let mut commit = vec![b'C', 0];
        commit.extend(0x20u64.to_be_bytes());
        commit.extend(0x28u64.to_be_bytes());
        commit.extend(5i64.to_be_bytes());
        assert_eq!(
            decode(&commit),
            Ok(Message::Commit {
                commit_lsn: Lsn(0x20),
                end_lsn: Lsn(0x28),
                timestamp: 5
            })
        );
        assert_eq!(decode(b"Yxx"), Ok(Message::Other(b'Y')));
    }

    #[test]
    fn malformed_messages_are_errors_not_panics() {
        assert!(decode(b"").is_err());
        assert!(decode(b"C\0\0").is_err());
        assert!(decode(b"R\0\0\0\x01public").is_err());
        let mut huge = vec![b'T'];
        huge.extend(u32::MAX.to_be_bytes());
        huge.push(0);
        assert!(decode(&huge).is_err());
        for len in 0..40 {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 37 % 251) as u8).collect();
            for tag in [b'B', b'C', b'R', b'I', b'U', b'D', b'T'] {
                let mut m = vec![tag];
                m.extend(&bytes);
                let _ = decode(&m);
            }
        }
    }
}
