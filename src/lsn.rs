//! WAL positions as PostgreSQL writes them (`pg_lsn`: `16/B374D848`, two hexadecimal halves
//! of a 64-bit byte position) and as pgmemo compares them (`u64`); the question that reads a
//! position past every commit made so far, and the positions so read ([`Covering`]), which
//! the replicas' routing (`replicas`) and the result cache's shared tier (`wal`, `cache`)
//! wait for.

/// A `pg_lsn` text as a byte position; None when it is not one.
pub fn parse(text: &str) -> Option<u64> {
    let (high, low) = text.trim().split_once('/')?;
    let valid = |h: &str| !h.is_empty() && h.len() <= 8 && h.bytes().all(|b| b.is_ascii_hexdigit());
    if !valid(high) || !valid(low) {
        return None;
    }
    let high = u64::from_str_radix(high, 16).ok()?;
    let low = u64::from_str_radix(low, 16).ok()?;
    Some(high << 32 | low)
}

/// What the primary is asked once a client's work is done (see [`commit_position`]): its
/// WAL flush position, its insert position with that position's offset in its segment and
/// the WAL page size, and the session's `synchronous_commit`.
pub const COMMIT_POSITION_SQL: &str = "SELECT pg_catalog.pg_current_wal_flush_lsn(), l, \
     (pg_catalog.pg_walfile_name_offset(l)).file_offset, \
     pg_catalog.current_setting('wal_block_size'), pg_catalog.current_setting('synchronous_commit') \
     FROM (SELECT pg_catalog.pg_current_wal_insert_lsn() AS l) s";

/// A position at or past the commit of everything that committed before the question, from
/// a row of [`COMMIT_POSITION_SQL`]; `maybe_async`: the work may have committed with
/// `synchronous_commit = off` for itself (it named the setting).
///
/// - A synchronous commit (any `synchronous_commit` but `off`) is flushed before it returns:
///   the flush position is past it. It is the position to wait for: the insert position may
///   be far ahead of it, with WAL no commit has flushed yet (hint-bit full-page images that
///   reads write with data checksums, PostgreSQL 18's default), which a replica gets only
///   when the WAL writer runs (`wal_writer_delay`, 200 ms by default).
/// - An asynchronous commit may not be flushed yet: the insert position is past it. An empty
///   page's insert position is given after its header (24 bytes, 40 at the start of a
///   segment), where no record can end; a replica that replayed everything before that page
///   reports the page's start, which is what is returned then.
pub fn commit_position(row: &[Option<String>], maybe_async: bool) -> Option<u64> {
    let flushed = parse(row.first()?.as_deref()?)?;
    let synchronous = row.get(4)?.as_deref()? != "off";
    if synchronous && !maybe_async {
        return Some(flushed);
    }
    let at = parse(row.get(1)?.as_deref()?)?;
    let in_segment: u64 = row.get(2)?.as_deref()?.parse().ok()?;
    let page: u64 = row.get(3)?.as_deref()?.parse().ok().filter(|&p| p > 0)?;
    let header = if in_segment == 40 {
        40
    } else if in_segment % page == 24 {
        24
    } else {
        0
    };
    Some(at - header.min(at))
}

/// Positions of the primary's WAL past every commit inserted before the question that read
/// each was sent (a row of [`COMMIT_POSITION_SQL`] read as an asynchronous commit's,
/// [`commit_position`]), with when that question was sent, oldest first: whatever pgmemo knew
/// had committed at a moment ends at or before the first position read after it (see
/// [`Covering::after`]). What a fill on a replica waits for (`Replicas::covering_after`),
/// and what a shared tier entry's position must reach (`cache::shared`).
#[derive(Default)]
pub struct Covering {
    read: parking_lot::Mutex<std::collections::VecDeque<(u64, u64)>>,
}

/// How many positions a [`Covering`] keeps: read every 100 ms, about a minute.
const COVERING: usize = 600;

impl Covering {
    /// The question sent at `sent` read `lsn`.
    pub fn note(&self, sent: crate::clock::Moment, lsn: u64) {
        let mut c = self.read.lock();
        if let Some(last) = c.back_mut().filter(|(_, l)| *l >= lsn) {
            // Nothing new: the position covers what came before this question too.
            last.0 = last.0.max(sent.nanos());
            return;
        }
        c.push_back((sent.nanos(), lsn));
        if c.len() > COVERING {
            c.pop_front();
        }
    }

    /// Everything pgmemo knew of at `at` is known to end at or before `lsn` (not read from
    /// the server: see `wal::fleet`'s joining reader). Kept in time order: [`Covering::after`]
    /// a moment before `at` finds it, even when a larger position was read before it.
    pub fn note_known(&self, at: crate::clock::Moment, lsn: u64) {
        let mut c = self.read.lock();
        let place = c.partition_point(|&(sent, _)| sent <= at.nanos());
        c.insert(place, (at.nanos(), lsn));
        if c.len() > COVERING {
            c.pop_front();
        }
    }

    /// The rows of [`COMMIT_POSITION_SQL`], asked at `sent`: their position, read as an
    /// asynchronous commit's (past every commit inserted before), is noted.
    pub fn note_answer(&self, sent: crate::clock::Moment, rows: &[Vec<Option<String>>]) {
        if let Some(at) = rows.first().and_then(|row| commit_position(row, true)) {
            self.note(sent, at);
        }
    }

    /// A position past every commit pgmemo knew of at `at`: the first read with a question
    /// sent after it (None: none yet).
    pub fn after(&self, at: crate::clock::Moment) -> Option<u64> {
        let c = self.read.lock();
        c.iter()
            .find(|&&(sent, _)| sent > at.nanos())
            .map(|&(_, lsn)| lsn)
    }

    /// Forgets every position (the server may be another one now).
    pub fn clear(&self) {
        self.read.lock().clear();
    }
}

/// A byte position as PostgreSQL writes a `pg_lsn`.
pub fn format(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_synchronous_commit_waits_for_the_flush_an_asynchronous_one_for_the_insert() {
        let row = |at: &str, off: &str, sync: &str| {
            [
                Some("0/2FFFF00".into()),
                Some(at.into()),
                Some(off.into()),
                Some("8192".into()),
                Some(sync.into()),
            ]
        };
        assert_eq!(
            commit_position(&row("0/3002040", "8256", "on"), false),
            Some(0x2FF_FF00)
        );
        assert_eq!(
            commit_position(&row("0/3002040", "8256", "local"), false),
            Some(0x2FF_FF00)
        );
        assert_eq!(
            commit_position(&row("0/3002040", "8256", "off"), false),
            Some(0x300_2040)
        );
        assert_eq!(
            commit_position(&row("0/3002040", "8256", "on"), true),
            Some(0x300_2040)
        );
        // Asynchronous: an empty page's header is no position (a segment's long header, a
        // page's short one); 40 bytes into a page that is not a segment's first is.
        assert_eq!(
            commit_position(&row("0/3000028", "40", "off"), false),
            Some(0x300_0000)
        );
        assert_eq!(
            commit_position(&row("0/3002018", "8216", "off"), false),
            Some(0x300_2000)
        );
        assert_eq!(
            commit_position(&row("0/3002028", "8232", "off"), false),
            Some(0x300_2028)
        );
        assert_eq!(commit_position(&[Some("0/1".into())], false), None);
    }

    #[test]
    fn positions_read_and_write_as_postgresql_does() {
        assert_eq!(parse("0/16B3748"), Some(0x16B_3748));
        assert_eq!(parse("16/B374D848"), Some(0x16_B374_D848));
        assert_eq!(format(0x16_B374_D848), "16/B374D848");
        assert_eq!(format(0), "0/0");
        assert_eq!(parse(&format(u64::MAX)), Some(u64::MAX));
        assert_eq!(parse(" 0/1 "), Some(1));
        for bad in ["", "0", "/1", "1/", "0/1/2", "g/0", "123456789/0", "-1/0"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_moment_is_covered_by_the_first_position_read_after_it() {
        use crate::clock::Moment;
        let c = Covering::default();
        let at = |n| Moment::from_nanos(n);
        assert_eq!(c.after(at(0)), None);
        c.note(at(10), 100);
        c.note(at(20), 100); // no commit since: the pair is sent later
        c.note(at(30), 250);
        assert_eq!(c.after(at(5)), Some(100));
        assert_eq!(c.after(at(15)), Some(100));
        assert_eq!(c.after(at(20)), Some(250));
        assert_eq!(c.after(at(30)), None);
        c.clear();
        assert_eq!(c.after(at(0)), None);
    }
}
