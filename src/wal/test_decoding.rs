//! The text lines of PostgreSQL's `test_decoding` output plugin (contrib, shipped with
//! PostgreSQL and offered by the managed services), as far as invalidation needs them: where a
//! transaction begins and commits (and when), and which tables each change wrote.
//!
//! It needs no publication. A `FOR ALL TABLES` publication (what pgoutput reads) makes
//! PostgreSQL refuse UPDATE and DELETE on every table without a replica identity (55000
//! "cannot update table ... because it does not have a replica identity and publishes
//! updates"): pgmemo must not change what its users' writes may do, so this is the default
//! decoder and pgoutput the choice of those who have such a publication anyway.

/// One decoded line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// `xid`: the transaction's ID (`include-xids`), when readable.
    Begin {
        xid: Option<u32>,
    },
    /// `timestamp`: microseconds since 2000-01-01 (`include-timestamp`), when readable.
    Commit {
        timestamp: Option<i64>,
    },
    /// A change of these tables, as (schema, name), whose rows are not read (a TRUNCATE).
    Tables(Vec<(String, String)>),
    /// An INSERT, UPDATE or DELETE of one row of a table: its old row's columns (a DELETE's,
    /// an UPDATE's when its key changed or the identity is FULL) and its new row's, as far as
    /// the line shows them (None: not shown, or not readable).
    Change {
        table: (String, String),
        kind: ChangeKind,
        old: Option<Row>,
        new: Option<Row>,
    },
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    Insert,
    Update,
    Delete,
}

/// A row's columns: (name, value in text form; None: NULL). An unchanged TOAST value is
/// left out.
pub type Row = Vec<(String, Option<Vec<u8>>)>;

/// The options pgmemo starts the stream with.
pub const OPTIONS: &str =
    "(\"include-xids\" '1', \"include-timestamp\" '1', \"skip-empty-xacts\" '1')";

pub fn decode(line: &[u8]) -> Line {
    let line = String::from_utf8_lossy(line);
    if line == "BEGIN" {
        return Line::Begin { xid: None };
    }
    if let Some(xid) = line.strip_prefix("BEGIN ") {
        return Line::Begin {
            xid: xid.parse().ok(),
        };
    }
    if line == "COMMIT" || line.starts_with("COMMIT ") {
        let timestamp = line
            .split_once("(at ")
            .and_then(|(_, rest)| rest.strip_suffix(')'))
            .and_then(parse_timestamp);
        return Line::Commit { timestamp };
    }
    if let Some(rest) = line.strip_prefix("table ") {
        let mut tables = Vec::new();
        let mut rest = rest;
        loop {
            let Some((schema, after)) = identifier(rest) else {
                return Line::Other;
            };
            let Some(after) = after.strip_prefix('.') else {
                return Line::Other;
            };
            let Some((name, after)) = identifier(after) else {
                return Line::Other;
            };
            tables.push((schema, name));
            // TRUNCATE names several tables, comma-separated; every other change one.
            match after.strip_prefix(", ") {
                Some(more) => rest = more,
                None => match after.strip_prefix(": ") {
                    Some(change) if tables.len() == 1 => {
                        return change_line(change, tables.pop().expect("one"))
                    }
                    Some(_) => return Line::Tables(tables),
                    None => return Line::Other,
                },
            }
        }
    }
    Line::Other
}

/// The rest of a change's line after its table: `INSERT: <row>`, `UPDATE: [old-key: <row>
/// new-tuple: ]<row>`, `DELETE: <row>` (a row being `(no-tuple-data)` when not shown).
fn change_line(text: &str, table: (String, String)) -> Line {
    let (kind, rest) = if let Some(r) = text.strip_prefix("INSERT: ") {
        (ChangeKind::Insert, r)
    } else if let Some(r) = text.strip_prefix("UPDATE: ") {
        (ChangeKind::Update, r)
    } else if let Some(r) = text.strip_prefix("DELETE: ") {
        (ChangeKind::Delete, r)
    } else {
        return Line::Tables(vec![table]);
    };
    let (old, new) = match kind {
        ChangeKind::Insert => (None, row(rest).map(|(r, _)| r)),
        ChangeKind::Delete => (row(rest).map(|(r, _)| r), None),
        ChangeKind::Update => match rest.strip_prefix("old-key: ") {
            Some(old) => match row(old) {
                Some((old, after)) => {
                    let new = after.strip_prefix("new-tuple: ").and_then(row);
                    (Some(old), new.map(|(r, _)| r))
                }
                None => (None, None),
            },
            None => (None, row(rest).map(|(r, _)| r)),
        },
    };
    Line::Change {
        table,
        kind,
        old,
        new,
    }
}

/// A row as test_decoding prints it (`name[type]:value ...`, a value being `null`,
/// `unchanged-toast-datum`, a quoted literal, or a number), up to its end or to
/// `new-tuple: `; and the text after it. None: `(no-tuple-data)`, or not readable.
fn row(mut text: &str) -> Option<(Row, &str)> {
    let mut row = Row::new();
    loop {
        text = text.trim_start_matches(' ');
        if text.is_empty() || text.starts_with("new-tuple: ") {
            return (!row.is_empty()).then_some((row, text));
        }
        let (name, after) = identifier(text)?;
        let after = after.strip_prefix('[')?;
        let (_, after) = after.split_once("]:")?;
        let (value, after) = if let Some(quoted) = after.strip_prefix('\'') {
            let mut value = Vec::new();
            let bytes = quoted.as_bytes();
            let mut i = 0;
            loop {
                match bytes.get(i)? {
                    b'\'' if bytes.get(i + 1) == Some(&b'\'') => {
                        value.push(b'\'');
                        i += 2;
                    }
                    b'\'' => break,
                    &b => {
                        value.push(b);
                        i += 1;
                    }
                }
            }
            (Some(Some(value)), &quoted[i + 1..])
        } else {
            let end = after.find(' ').unwrap_or(after.len());
            let value = match &after[..end] {
                "null" => Some(None),
                "unchanged-toast-datum" => None,
                v => Some(Some(v.as_bytes().to_vec())),
            };
            (value, &after[end..])
        };
        if let Some(value) = value {
            row.push((name, value));
        }
        text = after;
    }
}

/// An identifier as `quote_identifier` writes it (quoted with `""` inside, or plain), and the
/// text after it.
fn identifier(text: &str) -> Option<(String, &str)> {
    if let Some(quoted) = text.strip_prefix('"') {
        let mut out = String::new();
        let mut chars = quoted.char_indices();
        while let Some((i, c)) = chars.next() {
            if c == '"' {
                if quoted[i + 1..].starts_with('"') {
                    out.push('"');
                    chars.next();
                } else {
                    return Some((out, &quoted[i + 1..]));
                }
            } else {
                out.push(c);
            }
        }
        None
    } else {
        let end = text
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '$'))
            .unwrap_or(text.len());
        (end > 0).then(|| (text[..end].to_string(), &text[end..]))
    }
}

/// `2026-11-23 15:54:31.123456+00` (also `+05:30`, `-08`, no fraction) → microseconds since
/// 2000-01-01 UTC.
fn parse_timestamp(text: &str) -> Option<i64> {
    let (date, time) = text.split_once(' ')?;
    let mut d = date.splitn(3, '-');
    let (y, m, day): (i64, i64, i64) = (
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
    );
    let zone_at = time.rfind(['+', '-'])?;
    let (clock, zone) = time.split_at(zone_at);
    let mut c = clock.splitn(3, ':');
    let (h, min): (i64, i64) = (c.next()?.parse().ok()?, c.next()?.parse().ok()?);
    let seconds = c.next()?;
    let (s, frac) = seconds.split_once('.').unwrap_or((seconds, ""));
    let s: i64 = s.parse().ok()?;
    let micros: i64 = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<6}").get(..6)?.parse().ok()?
    };
    let sign = if zone.starts_with('-') { -1 } else { 1 };
    let mut z = zone[1..].splitn(3, ':');
    let zh: i64 = z.next()?.parse().ok()?;
    let zm: i64 = z.next().map_or(Some(0), |m| m.parse().ok())?;
    // Days from 2000-03-01, the civil-from-days algorithm's era start, shifted to 2000-01-01.
    let (y, m) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days_since_1970 = era * 146_097 + doe - 719_468;
    let days = days_since_1970 - 10_957; // 1970-01-01 → 2000-01-01
    let local = ((days * 24 + h) * 60 + min) * 60 + s;
    let utc = local - sign * (zh * 3600 + zm * 60);
    Some(utc * 1_000_000 + micros)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tables(list: &[(&str, &str)]) -> Line {
        Line::Tables(
            list.iter()
                .map(|(s, n)| (s.to_string(), n.to_string()))
                .collect(),
        )
    }

    #[test]
    fn lines() {
        assert_eq!(decode(b"BEGIN"), Line::Begin { xid: None });
        assert_eq!(decode(b"BEGIN 734"), Line::Begin { xid: Some(734) });
        assert_eq!(
            decode(b"COMMIT 734 (at 2000-01-01 00:00:01.5+00)"),
            Line::Commit {
                timestamp: Some(1_500_000)
            }
        );
        assert_eq!(decode(b"COMMIT"), Line::Commit { timestamp: None });
        assert_eq!(
            decode(b"COMMIT (at 2000-01-01 00:00:01.5+00)"),
            Line::Commit {
                timestamp: Some(1_500_000)
            }
        );
        let t = |s: &str, n: &str| (s.to_string(), n.to_string());
        let col = |n: &str, v: Option<&str>| (n.to_string(), v.map(|v| v.as_bytes().to_vec()));
        assert_eq!(
            decode(b"table public.t: UPDATE: id[integer]:1 v[integer]:2"),
            Line::Change {
                table: t("public", "t"),
                kind: ChangeKind::Update,
                old: None,
                new: Some(vec![col("id", Some("1")), col("v", Some("2"))])
            }
        );
        assert_eq!(
            decode(b"table \"My Schema\".\"a\"\"b\": INSERT: x[text]:'table x.y: ''q''' n[integer[]]:null"),
            Line::Change {
                table: t("My Schema", "a\"b"),
                kind: ChangeKind::Insert,
                old: None,
                new: Some(vec![col("x", Some("table x.y: 'q'")), col("n", None)])
            }
        );
        assert_eq!(
            decode(b"table public.t: UPDATE: old-key: id[uuid]:'a' new-tuple: id[uuid]:'b' big[text]:unchanged-toast-datum"),
            Line::Change {
                table: t("public", "t"),
                kind: ChangeKind::Update,
                old: Some(vec![col("id", Some("a"))]),
                new: Some(vec![col("id", Some("b"))])
            }
        );
        assert_eq!(
            decode(b"table public.t: DELETE: (no-tuple-data)"),
            Line::Change {
                table: t("public", "t"),
                kind: ChangeKind::Delete,
                old: None,
                new: None
            }
        );
        assert_eq!(
            decode(b"table public.a, public.b: TRUNCATE: cascade"),
            tables(&[("public", "a"), ("public", "b")])
        );
        assert_eq!(
            decode(b"message: transactional: 1 prefix: x, sz: 1 content:y"),
            Line::Other
        );
        assert_eq!(decode(b"table broken"), Line::Other);
        assert_eq!(decode(b""), Line::Other);
    }

    #[test]
    fn timestamps() {
        assert_eq!(parse_timestamp("2000-01-01 00:00:00+00"), Some(0));
        assert_eq!(
            parse_timestamp("2000-01-02 01:00:00.000001+01"),
            Some(86_400_000_000 + 1)
        );
        assert_eq!(
            parse_timestamp("1999-12-31 19:00:00-05"),
            Some(0),
            "a negative offset"
        );
        assert_eq!(
            parse_timestamp("2026-11-23 15:54:31.123456+05:30"),
            Some(
                // 2026-11-23 10:24:31.123456 UTC
                (9823 * 86_400 + 10 * 3600 + 24 * 60 + 31) * 1_000_000 + 123_456
            )
        );
        assert_eq!(parse_timestamp("yesterday"), None);
    }
}
