//! WAL positions as PostgreSQL writes them (`pg_lsn`: `16/B374D848`, two hexadecimal halves
//! of a 64-bit byte position) and as pgmemo compares them (`u64`).

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
/// WAL insert position, that position's offset in its segment, and the WAL page size.
pub const COMMIT_POSITION_SQL: &str = "SELECT l, (pg_catalog.pg_walfile_name_offset(l)).file_offset, \
     pg_catalog.current_setting('wal_block_size') FROM (SELECT pg_catalog.pg_current_wal_insert_lsn() AS l) s";

/// The end of the last WAL record written, from a row of [`COMMIT_POSITION_SQL`]: at or
/// past the commit of everything that committed before it was asked (flushed or not: with
/// `synchronous_commit = off` the commit may still be in memory, and a replica then has
/// not got it). PostgreSQL gives the insert position of an empty page after its header (24
/// bytes, 40 at the start of a segment), where no record can end; a replica that replayed
/// everything before that page reports the page's start, which is what is returned then.
pub fn commit_position(row: &[Option<String>]) -> Option<u64> {
    let at = parse(row.first()?.as_deref()?)?;
    let in_segment: u64 = row.get(1)?.as_deref()?.parse().ok()?;
    let page: u64 = row.get(2)?.as_deref()?.parse().ok().filter(|&p| p > 0)?;
    let header = if in_segment == 40 {
        40
    } else if in_segment % page == 24 {
        24
    } else {
        0
    };
    Some(at - header.min(at))
}

/// A byte position as PostgreSQL writes a `pg_lsn`.
pub fn format(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_page_s_header_is_not_a_position_to_wait_for() {
        let row = |at: &str, off: &str| [Some(at.into()), Some(off.into()), Some("8192".into())];
        // At the start of a segment (long header), of a page (short one), and mid-page.
        assert_eq!(commit_position(&row("0/3000028", "40")), Some(0x300_0000));
        assert_eq!(commit_position(&row("0/3002018", "8216")), Some(0x300_2000));
        assert_eq!(commit_position(&row("0/3002040", "8256")), Some(0x300_2040));
        // 40 bytes into a page that is not a segment's first: a record can end there.
        assert_eq!(commit_position(&row("0/3002028", "8232")), Some(0x300_2028));
        assert_eq!(commit_position(&[Some("0/1".into())]), None);
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
}
