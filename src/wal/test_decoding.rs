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
    Begin,
    /// `timestamp`: microseconds since 2000-01-01 (`include-timestamp`), when readable.
    Commit {
        timestamp: Option<i64>,
    },
    /// A change (INSERT, UPDATE, DELETE, TRUNCATE) of these tables, as (schema, name).
    Tables(Vec<(String, String)>),
    Other,
}

/// The options pgmemo starts the stream with.
pub const OPTIONS: &str =
    "(\"include-xids\" '0', \"include-timestamp\" '1', \"skip-empty-xacts\" '1')";

pub fn decode(line: &[u8]) -> Line {
    let line = String::from_utf8_lossy(line);
    if line == "BEGIN" || line.starts_with("BEGIN ") {
        return Line::Begin;
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
                None if after.starts_with(": ") => return Line::Tables(tables),
                None => return Line::Other,
            }
        }
    }
    Line::Other
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
        assert_eq!(decode(b"BEGIN"), Line::Begin);
        assert_eq!(decode(b"BEGIN 734"), Line::Begin);
        assert_eq!(decode(b"COMMIT"), Line::Commit { timestamp: None });
        assert_eq!(
            decode(b"COMMIT (at 2000-01-01 00:00:01.5+00)"),
            Line::Commit {
                timestamp: Some(1_500_000)
            }
        );
        assert_eq!(
            decode(b"table public.t: UPDATE: id[integer]:1 v[integer]:2"),
            tables(&[("public", "t")])
        );
        assert_eq!(
            decode(b"table \"My Schema\".\"a\"\"b\": INSERT: x[text]:'table x.y: '"),
            tables(&[("My Schema", "a\"b")])
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
