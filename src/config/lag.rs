//! `max_replica_lag`: how far behind its primary a replica may be and still take reads, as a
//! time (`"10s"`, `"500ms"`, or a number of seconds) or as WAL (`"16MB"`, `"512kB"`, bytes as
//! PostgreSQL writes sizes).

use std::time::Duration;

use serde::Deserialize;

use super::table::{Context, Value};

/// How far behind a replica may be (see the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaLag {
    /// Behind by at most this long: the primary wrote what the replica has not replayed no
    /// longer ago than this.
    Time(Duration),
    /// Behind by at most this much WAL.
    Bytes(u64),
}

impl Default for ReplicaLag {
    fn default() -> Self {
        ReplicaLag::Time(Duration::from_secs(10))
    }
}

/// What the file writes: a number (seconds) or text with a unit.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum RawLag {
    Seconds(f64),
    Text(String),
}

impl ReplicaLag {
    /// Reads `"10s"`, `"250ms"`, `"2min"`, `"16MB"`, `"512kB"`, `"1GB"`, `"8192B"`.
    pub fn parse(text: &str) -> Result<ReplicaLag, String> {
        let text = text.trim();
        let split = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(text.len());
        let (number, unit) = text.split_at(split);
        let wrong = || {
            format!(
                "{text:?}: expected a time (\"10s\", \"500ms\", \"2min\") or an amount of WAL \
                 (\"16MB\", \"512kB\", \"1GB\")"
            )
        };
        let n: f64 = number.parse().map_err(|_| wrong())?;
        if !n.is_finite() || n < 0.0 {
            return Err(wrong());
        }
        let secs = |scale: f64| {
            let s = n * scale;
            (s <= super::table::MAX_DURATION_SECS as f64)
                .then(|| ReplicaLag::Time(Duration::from_secs_f64(s)))
                .ok_or_else(wrong)
        };
        let bytes = |scale: f64| Ok(ReplicaLag::Bytes((n * scale) as u64));
        match unit.trim() {
            "ms" => secs(0.001),
            "s" => secs(1.0),
            "min" => secs(60.0),
            "B" => bytes(1.0),
            "kB" => bytes(1024.0),
            "MB" => bytes(1024.0 * 1024.0),
            "GB" => bytes(1024.0 * 1024.0 * 1024.0),
            _ => Err(wrong()),
        }
    }
}

impl Value for ReplicaLag {
    type Raw = RawLag;
    const KIND: &'static str = "seconds, or text with a unit";
    fn read(raw: RawLag, _: &Context<'_>) -> Result<ReplicaLag, String> {
        match raw {
            RawLag::Seconds(s) => ReplicaLag::parse(&format!("{s}s")),
            RawLag::Text(t) => ReplicaLag::parse(&t),
        }
    }
    fn show(&self) -> String {
        match self {
            ReplicaLag::Time(d) => format!("{}ms", d.as_millis()),
            ReplicaLag::Bytes(b) => format!("{b}B"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_sizes_are_read_with_their_units() {
        assert_eq!(
            ReplicaLag::parse("250ms"),
            Ok(ReplicaLag::Time(Duration::from_millis(250)))
        );
        assert_eq!(
            ReplicaLag::parse("2min"),
            Ok(ReplicaLag::Time(Duration::from_secs(120)))
        );
        assert_eq!(ReplicaLag::parse("16MB"), Ok(ReplicaLag::Bytes(16 << 20)));
        assert_eq!(ReplicaLag::parse("512kB"), Ok(ReplicaLag::Bytes(512 << 10)));
        assert!(ReplicaLag::parse("16 parsecs").is_err());
        assert!(ReplicaLag::parse("-1s").is_err());
        assert!(ReplicaLag::parse("").is_err());
    }
}
