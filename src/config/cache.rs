//! `[cache]` and `[[cache.rules]]`: what the operator chose to cache. Nothing is cached unless
//! `enabled` is set and a rule or a query hint asks for it.
//!
//! It lives with the rest of the configuration so that `config` imports nothing from the
//! cache.

use super::ConfigError;
use serde::Deserialize;
use std::time::Duration;

/// The result cache's settings, part of [`crate::config::Config`]; reloadable.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    /// Result caching and the write tracking it needs. Default false.
    pub enabled: bool,
    /// Memory the stored results may take, in bytes. Default 64 MiB.
    pub max_memory: usize,
    /// Leading-comment hints (`/* pgmemo cache ttl=5s */`) are obeyed. Default true.
    pub hints: bool,
    /// A client that misses on a key another client is already fetching waits at most this
    /// long for that result before running its own query. Default 2 s.
    pub flight_wait: Duration,
    /// Used by a hint that gives no value, and by rules that give none.
    pub default_ttl: Duration,
    /// Results larger than this are not stored (unless a rule says otherwise). Default 1 MiB.
    pub max_result_bytes: usize,
    /// Once the store is full, a result is stored when its key misses for this many times
    /// lately (1 or 2; see `cache::admission`). With 2 (the default) keys read once cost no
    /// store and evict nothing useful; a key other clients waited for is stored at once. While
    /// the store has room every miss is stored.
    pub admit_after: u32,
    pub rules: Vec<Rule>,
    /// What invalidates cached results: writes through this pgmemo (`proxy`, the default),
    /// or also every write the database's WAL shows (`wal`, see `wal`).
    pub invalidation: Invalidation,
    /// The role WAL invalidation's replication connections log in as (it needs the
    /// REPLICATION attribute); default: each pool's server user.
    pub replication_user: Option<String>,
    pub replication_password: Option<String>,
    /// The logical decoding plugin WAL invalidation streams with: `test_decoding` (default:
    /// no publication needed, see `wal::test_decoding`) or `pgoutput`.
    pub wal_plugin: WalPlugin,
    /// With WAL invalidation: a database's results are not served while its follower last
    /// knew itself caught up longer ago than this. Default: no bound beyond being connected
    /// and caught up.
    pub max_lag: Option<Duration>,
    /// pgoutput's publication. Default `pgmemo`.
    pub publication: String,
    /// Create the publication (`FOR ALL TABLES`) when it is missing. Default true.
    pub create_publication: bool,
}

/// The logical decoding plugin of WAL invalidation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WalPlugin {
    #[default]
    TestDecoding,
    Pgoutput,
}

/// What invalidates cached results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Invalidation {
    #[default]
    Proxy,
    Wal,
}

impl std::str::FromStr for Invalidation {
    type Err = String;

    fn from_str(s: &str) -> Result<Invalidation, String> {
        match s {
            "proxy" => Ok(Invalidation::Proxy),
            "wal" => Ok(Invalidation::Wal),
            other => Err(format!("expected \"proxy\" or \"wal\", got \"{other}\"")),
        }
    }
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            enabled: false,
            max_memory: 64 * 1024 * 1024,
            hints: true,
            flight_wait: Duration::from_secs(2),
            default_ttl: Duration::from_secs(60),
            max_result_bytes: 1024 * 1024,
            admit_after: 2,
            rules: Vec::new(),
            invalidation: Invalidation::Proxy,
            replication_user: None,
            replication_password: None,
            wal_plugin: WalPlugin::TestDecoding,
            max_lag: None,
            publication: "pgmemo".into(),
            create_publication: true,
        }
    }
}

/// One `[[cache.rules]]` entry: which queries, for whom, how long.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// A name for SHOW CACHE; default `rule<N>`.
    pub name: String,
    pub database: Option<String>,
    pub user: Option<String>,
    /// The normalized text (literals as `$n`, comments dropped, as SHOW AUTOPREPARE and
    /// SHOW CACHE SHAPES print it), exactly.
    pub query: Option<String>,
    /// The normalized text's hash, as SHOW AUTOPREPARE / SHOW CACHE SHAPES print it (hex).
    pub query_hash: Option<u64>,
    /// A substring of the normalized text.
    pub query_contains: Option<String>,
    pub ttl: Duration,
    /// Store results without rows too. Default true.
    pub cache_empty: bool,
    pub max_result_bytes: usize,
    /// Also answer from the cache inside READ ONLY, READ COMMITTED transaction blocks
    /// (hits only). Default false: nothing is cached inside transaction blocks.
    pub read_only_transactions: bool,
}

impl Rule {
    /// Whether this rule applies to a query with normalized text `text` and hash `hash` run
    /// by `user` on `database`.
    pub fn matches(&self, database: &str, user: &str, text: &str, hash: u64) -> bool {
        self.database.as_deref().is_none_or(|d| d == database)
            && self.user.as_deref().is_none_or(|u| u == user)
            && self.query.as_deref().is_none_or(|q| q == text)
            && self.query_hash.is_none_or(|h| h == hash)
            && self
                .query_contains
                .as_deref()
                .is_none_or(|c| text.contains(c))
    }
}

/// `[cache]` as written in the file.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawCache {
    enabled: Option<bool>,
    max_memory_mb: Option<f64>,
    hints: Option<bool>,
    flight_wait: Option<RawDuration>,
    default_ttl: Option<RawDuration>,
    max_result_bytes: Option<i64>,
    admit_after: Option<i64>,
    invalidation: Option<String>,
    replication_user: Option<String>,
    replication_password: Option<String>,
    wal_plugin: Option<String>,
    max_lag: Option<RawDuration>,
    publication: Option<String>,
    create_publication: Option<bool>,
    #[serde(default)]
    rules: Vec<RawRule>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: Option<String>,
    database: Option<String>,
    user: Option<String>,
    query: Option<String>,
    query_hash: Option<String>,
    query_contains: Option<String>,
    ttl: Option<RawDuration>,
    cache_empty: Option<bool>,
    max_result_bytes: Option<i64>,
    read_only_transactions: Option<bool>,
}

/// A duration as a number of seconds or a string with a unit (`"500ms"`, `"5s"`, `"2m"`).
#[derive(Deserialize)]
#[serde(untagged)]
enum RawDuration {
    Seconds(f64),
    Text(String),
}

pub use super::table::MAX_DURATION_SECS;

impl RawDuration {
    fn resolve(self, key: &str) -> Result<Duration, ConfigError> {
        let d = match self {
            RawDuration::Seconds(s) if (0.0..=MAX_DURATION_SECS as f64).contains(&s) => {
                Some(Duration::from_secs_f64(s))
            }
            RawDuration::Seconds(_) => None,
            RawDuration::Text(t) => parse_duration(&t),
        };
        d.ok_or_else(|| {
            ConfigError::invalid(
                key,
                "must be a duration: seconds, or a number with ms, s, m or h (\"5s\")",
            )
        })
    }
}

/// `500ms`, `5s`, `5`, `2m`, `1h` (as hints and the config write them); at most a year.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: f64 = number.parse().ok()?;
    let scale = match unit.trim() {
        "ms" => 0.001,
        "" | "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => return None,
    };
    let secs = n * scale;
    (secs.is_finite() && (0.0..=MAX_DURATION_SECS as f64).contains(&secs))
        .then(|| Duration::from_secs_f64(secs))
}

impl RawCache {
    pub(crate) fn into_config(self) -> Result<CacheConfig, ConfigError> {
        let d = CacheConfig::default();
        let max_memory = match self.max_memory_mb {
            None => d.max_memory,
            Some(mb) if mb.is_finite() && mb > 0.0 && mb <= 1024.0 * 1024.0 => {
                (mb * 1024.0 * 1024.0) as usize
            }
            Some(_) => {
                return Err(ConfigError::invalid(
                    "cache.max_memory_mb",
                    "must be a number of MiB above 0",
                ))
            }
        };
        let bytes = |key: &str, v: Option<i64>, default: usize| match v {
            None => Ok(default),
            Some(n) if n > 0 => Ok(n as usize),
            Some(_) => Err(ConfigError::invalid(
                key,
                "must be a number of bytes above 0",
            )),
        };
        let default_ttl = match self.default_ttl {
            Some(t) => t.resolve("cache.default_ttl")?,
            None => d.default_ttl,
        };
        let max_result_bytes = bytes(
            "cache.max_result_bytes",
            self.max_result_bytes,
            d.max_result_bytes,
        )?;
        let mut rules = Vec::new();
        for (i, r) in self.rules.into_iter().enumerate() {
            let key = |field: &str| format!("cache.rules[{i}].{field}");
            let query_hash = match r.query_hash {
                None => None,
                Some(h) => Some(u64::from_str_radix(h.trim_start_matches("0x"), 16).map_err(
                    |_| ConfigError::invalid(key("query_hash"), "must be a hexadecimal hash"),
                )?),
            };
            if r.query.is_none() && query_hash.is_none() && r.query_contains.is_none() {
                return Err(ConfigError::invalid(
                    key("query"),
                    "a rule needs query, query_hash or query_contains",
                ));
            }
            rules.push(Rule {
                name: r.name.unwrap_or_else(|| format!("rule{}", i + 1)),
                database: r.database,
                user: r.user,
                query: r.query,
                query_hash,
                query_contains: r.query_contains,
                ttl: match r.ttl {
                    Some(t) => t.resolve(&key("ttl"))?,
                    None => default_ttl,
                },
                cache_empty: r.cache_empty.unwrap_or(true),
                read_only_transactions: r.read_only_transactions.unwrap_or(false),
                max_result_bytes: bytes(
                    &key("max_result_bytes"),
                    r.max_result_bytes,
                    max_result_bytes,
                )?,
            });
        }
        let admit_after = match self.admit_after {
            None => d.admit_after,
            Some(n @ 1..=2) => n as u32,
            Some(_) => return Err(ConfigError::invalid("cache.admit_after", "must be 1 or 2")),
        };
        let invalidation = match self.invalidation {
            None => d.invalidation,
            Some(text) => text
                .parse()
                .map_err(|e: String| ConfigError::invalid("cache.invalidation", e))?,
        };
        let wal_plugin = match self.wal_plugin.as_deref() {
            None => d.wal_plugin,
            Some("test_decoding") => WalPlugin::TestDecoding,
            Some("pgoutput") => WalPlugin::Pgoutput,
            Some(other) => {
                return Err(ConfigError::invalid(
                    "cache.wal_plugin",
                    format!("expected \"test_decoding\" or \"pgoutput\", got \"{other}\""),
                ))
            }
        };
        let max_lag = self
            .max_lag
            .map(|d| d.resolve("cache.max_lag"))
            .transpose()?;
        Ok(CacheConfig {
            invalidation,
            wal_plugin,
            max_lag,
            replication_user: self.replication_user,
            replication_password: self.replication_password,
            publication: self.publication.unwrap_or(d.publication),
            create_publication: self.create_publication.unwrap_or(d.create_publication),
            admit_after,
            enabled: self.enabled.unwrap_or(d.enabled),
            max_memory,
            hints: self.hints.unwrap_or(d.hints),
            flight_wait: match self.flight_wait {
                Some(t) => t.resolve("cache.flight_wait")?,
                None => d.flight_wait,
            },
            default_ttl,
            max_result_bytes,
            rules,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5s"), Some(Duration::from_secs(5)));
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("7"), Some(Duration::from_secs(7)));
        assert_eq!(parse_duration("5 days"), None);
        assert_eq!(parse_duration("s"), None);
    }

    #[test]
    fn cache_section_in_toml() {
        let c = crate::config::Config::from_toml_str(
            "[upstream]\nurl = \"postgresql://u:p@h\"\n[cache]\nenabled = true\nmax_memory_mb = 2\n\
             [[cache.rules]]\nquery_contains = \"FROM t\"\nttl = \"5s\"\n\
             [[cache.rules]]\nname = \"h\"\nquery_hash = \"00ff\"\nttl = 2.5\ncache_empty = false\n",
        )
        .unwrap();
        assert!(c.cache.enabled);
        assert_eq!(c.cache.max_memory, 2 * 1024 * 1024);
        assert_eq!(c.cache.rules[0].name, "rule1");
        assert_eq!(c.cache.rules[0].ttl, Duration::from_secs(5));
        assert_eq!(c.cache.rules[1].query_hash, Some(0xff));
        assert_eq!(c.cache.rules[1].ttl, Duration::from_millis(2500));
        assert!(!c.cache.rules[1].cache_empty);
        let err = crate::config::Config::from_toml_str(
            "[upstream]\nurl = \"postgresql://u:p@h\"\n[[cache.rules]]\nttl = \"5s\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("cache.rules[0].query"), "{err}");
        let err = crate::config::Config::from_toml_str(
            "[upstream]\nurl = \"postgresql://u:p@h\"\n[[cache.rules]]\nquery = \"x\"\nttl = \"forever\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("cache.rules[0].ttl"), "{err}");
    }

    #[test]
    fn rules_match_on_database_user_and_text() {
        let rule = Rule {
            name: "r".into(),
            database: Some("app".into()),
            user: None,
            query: None,
            query_hash: None,
            query_contains: Some("FROM accounts".into()),
            ttl: Duration::from_secs(1),
            cache_empty: true,
            max_result_bytes: 10,
            read_only_transactions: false,
        };
        assert!(rule.matches("app", "u", "SELECT * FROM accounts WHERE id = $1", 1));
        assert!(!rule.matches("other", "u", "SELECT * FROM accounts WHERE id = $1", 1));
        assert!(!rule.matches("app", "u", "SELECT * FROM users", 1));
    }
}
