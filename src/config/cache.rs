//! `[cache]` and `[[cache.rules]]`: what the operator chose to cache. Nothing is cached unless
//! `enabled` is set and a rule or a query hint asks for it.
//!
//! It lives with the rest of the configuration so that `config` imports nothing from the
//! cache.
//!
//! `[cache]`'s settings are one table, as `[general]`'s (`settings.rs`, macro in `table.rs`):
//! a new setting is one entry below, plus its paragraph in `pgmemo.example.toml`. Their
//! values are checked as they are read. `[[cache.rules]]` is a list of tables, read by hand
//! (`read_rules`) through the same per-key reading.

use std::time::Duration;

use serde::Deserialize;

use super::table::{
    ensure, read_key, settings, Bytes, Context, Form, Mebibytes, Own, TextOrSeconds, Value,
};
pub use super::table::{parse_duration, MAX_DURATION_SECS};
use super::ConfigError;

settings! {
    /// The result cache's settings, part of [`crate::config::Config`]. Generated from the
    /// table below; a RELOAD applies them, but the WAL streams' (`replication_user` to
    /// `create_publication`), which a database's stream keeps from its start.
    [cache] CacheConfig from RawCache, checked on reading, lists {
        /// `[[cache.rules]]`, in the file's order.
        rules: Vec<Rule> = read_rules(Vec<RawRule>),
        /// `[cache.shared]`: the shared tier on Valkey or Redis (None: off).
        shared: Option<SharedTier> = read_shared(Option<RawShared>),
    };

    /// Result caching and the write tracking it needs.
    enabled: bool = false, Live;
    /// Memory the store may take (keys, results and their bookkeeping); the file writes it
    /// in MiB (`max_memory_mb`), the field holds bytes.
    max_memory: usize = 64 << 20, Live, key = "max_memory_mb", as Mebibytes;
    /// Hints in a query's comments (`/* pgmemo cache ttl=5s */`, anywhere) are obeyed.
    hints: bool = true, Live;
    /// A client that misses on a key another client is already fetching waits at most this
    /// long for that result before running its own query.
    flight_wait: Duration = Duration::from_secs(2), Live, as TextOrSeconds;
    /// Used by a hint that gives no value, and by rules that give none.
    default_ttl: Duration = Duration::from_secs(60), Live, as TextOrSeconds;
    /// Results larger than this are not stored (unless a rule says otherwise).
    max_result_bytes: usize = 1 << 20, Live, as Bytes;
    /// Once the store is full, a result is stored when its key misses for this many times
    /// lately (1 or 2; see docs/result-cache.md, "Store"). With 2 (the default) keys read
    /// once cost no store and evict nothing useful; a key other clients waited for is stored
    /// at once. While the store has room every miss is stored.
    admit_after: u32 = 2, Live, range = "1 or 2",
        check = |v, _| ensure((1..=2).contains(v), || "must be 1 or 2".into());
    /// Counters of rows' versions, for row-level invalidation (see `cache::rows`): 8.5
    /// bytes each, taken from `max_memory`. 0 (the default): one per 128 bytes of `max_memory`.
    /// More counters, fewer rows sharing one (a write to a row also invalidates the point
    /// reads of the rows that share its counter).
    row_versions: u32 = 0, Restart;
    /// An entry read past this fraction of its TTL is refreshed by the query of one client,
    /// while the others keep getting hits, so a hot key never expires into a burst of misses
    /// (1: never refreshed early). A rule may set its own.
    refresh_at: f64 = 0.8, Live, range = "0.5 to 1",
        check = |v, _| ensure((0.5..=1.0).contains(v), || "must be between 0.5 and 1".into());
    /// What chooses the queries cached: rules and hints (`rules`, the default), or also pgmemo
    /// itself (`auto`: the read shapes that cost the server most, see docs/result-cache.md),
    /// which needs `invalidation = "wal"` (a write made around pgmemo would be served stale).
    mode: CacheMode = CacheMode::Rules, Live;
    /// What invalidates cached results: writes through this pgmemo (`proxy`, the default),
    /// or also every write the database's WAL shows (`wal`, see docs/result-cache.md).
    invalidation: Invalidation = Invalidation::Proxy, Live;
    /// The role WAL invalidation's replication connections log in as (it needs the
    /// REPLICATION attribute); default: pgmemo's own role, `[upstream]`'s user, unless the
    /// database has a fixed `user` (then that one); without `[upstream]`, the server login of
    /// the pool whose client first used the cache. A database's stream keeps the value it
    /// started with.
    replication_user: Option<String> = None, Restart;
    /// That role's password. A database's stream keeps the value it started with.
    replication_password: Option<String> = None, Restart;
    /// The logical decoding plugin WAL invalidation streams with: `test_decoding` (default:
    /// no publication needed) or `pgoutput`. A database's stream
    /// keeps the value it started with.
    wal_plugin: WalPlugin = WalPlugin::TestDecoding, Restart;
    /// With WAL invalidation: a database's results are not served while its follower last
    /// knew itself caught up longer ago than this. Default: no bound beyond being connected
    /// and caught up.
    max_lag: Option<Duration> = None, Live, as TextOrSeconds;
    /// pgoutput's publication. A database's stream keeps the value it started with.
    publication: String = "pgmemo".into(), Restart;
    /// Create the publication (`FOR ALL TABLES`) when it is missing. A database's stream
    /// keeps the value it started with.
    create_publication: bool = true, Restart;
}

/// What chooses the queries cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheMode {
    /// Rules and hints only.
    #[default]
    Rules,
    /// Rules and hints, and pgmemo's own choice of the costliest read shapes.
    Auto,
}

impl Value for CacheMode {
    type Raw = String;
    const KIND: &'static str = r#""rules" or "auto""#;
    fn read(raw: String, _: &Context<'_>) -> Result<CacheMode, String> {
        match raw.as_str() {
            "rules" => Ok(CacheMode::Rules),
            "auto" => Ok(CacheMode::Auto),
            other => Err(format!("expected \"rules\" or \"auto\", got \"{other}\"")),
        }
    }
    fn show(&self) -> String {
        match self {
            CacheMode::Rules => "rules",
            CacheMode::Auto => "auto",
        }
        .into()
    }
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

/// One `[[cache.rules]]` entry: which queries, for whom, how long.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// A name for SHOW CACHE; default `rule<N>`.
    pub name: String,
    pub database: Option<String>,
    pub user: Option<String>,
    /// The normalized text (literals as `$n`, comments dropped, as SHOW AUTOPREPARE and
    /// SHOW CACHE SHAPES print it). Written with literals, it is normalized as client text is
    /// when the cache takes the rules (`ResultCache::reconfigure`); spacing does not count
    /// ([`same_text`]).
    pub query: Option<String>,
    /// The normalized text's hash, as SHOW QUERIES and SHOW AUTOPREPARE print it (hex): the
    /// same for a simple query and a prepared statement of that text
    /// (`query::shapes::query_hash`).
    pub query_hash: Option<u64>,
    /// A substring of the normalized text.
    pub query_contains: Option<String>,
    pub ttl: Duration,
    /// Store results without rows too. Default true.
    pub cache_empty: bool,
    pub max_result_bytes: usize,
    /// Answer and fill inside READ COMMITTED transaction blocks, for tables the block has not
    /// written (see `cache::Transaction`). Default true.
    pub transactions: bool,
    /// See the section's `refresh_at`, its default.
    pub refresh_at: f64,
}

impl Rule {
    /// Whether this rule applies to a query with normalized text `text` and hash `hash` run
    /// by `user` on `database`.
    pub fn matches(&self, database: &str, user: &str, text: &str, hash: u64) -> bool {
        self.database.as_deref().is_none_or(|d| d == database)
            && self.user.as_deref().is_none_or(|u| u == user)
            && self.query.as_deref().is_none_or(|q| same_text(q, text))
            && self.query_hash.is_none_or(|h| h == hash)
            && self
                .query_contains
                .as_deref()
                .is_none_or(|c| text.contains(c))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRule {
    name: Option<String>,
    database: Option<String>,
    user: Option<String>,
    query: Option<String>,
    query_hash: Option<String>,
    query_contains: Option<String>,
    ttl: Option<<TextOrSeconds as Form<Duration>>::Raw>,
    cache_empty: Option<bool>,
    max_result_bytes: Option<i64>,
    transactions: Option<bool>,
    refresh_at: Option<f64>,
    /// Before `transactions`: hits inside READ ONLY blocks only. Accepted and ignored (every
    /// READ COMMITTED block is answered now), so older files still load.
    #[allow(dead_code)]
    read_only_transactions: Option<bool>,
}

/// `[cache.shared]`: a second tier of the result cache that every pgmemo instance of a fleet
/// shares, on Valkey or Redis (see `cache::shared`). Read at start (a RELOAD keeps it). Its
/// debug form hides the URL's password.
#[derive(Clone, PartialEq)]
pub struct SharedTier {
    /// `redis://[user:password@]host:port/db` or `rediss://` (TLS).
    pub url: String,
    /// How long a lookup waits for the shared tier before the query goes to the server.
    pub timeout: Duration,
    /// The fleet's name: keys start with it (instances share entries only under one name).
    pub name: String,
    /// Who decodes the WAL (see `wal::fleet`).
    pub decoder: Decoder,
    /// How long the decoding instance's lease lasts unrenewed: a new one takes over within
    /// it when the holder is gone.
    pub lease: Duration,
    /// What an instance does while Valkey cannot be reached for the fleet's stream.
    pub without_valkey: WithoutValkey,
    /// `url` names a node of a Valkey (Redis) cluster: the others are found from it.
    pub cluster: bool,
    /// With `rediss://`: the CA certificates (PEM) that sign the server's, instead of the
    /// system's.
    pub ca_file: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for SharedTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedTier")
            .field("url", &url_without_password(&self.url))
            .field("timeout", &self.timeout)
            .field("name", &self.name)
            .field("decoder", &self.decoder)
            .field("lease", &self.lease)
            .field("without_valkey", &self.without_valkey)
            .field("cluster", &self.cluster)
            .field("ca_file", &self.ca_file)
            .finish()
    }
}

/// `url` with the password of its user part (`scheme://user:password@host...`) shown as
/// `<hidden>`.
fn url_without_password(url: &str) -> std::borrow::Cow<'_, str> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.into();
    };
    // The user part ends at the last `@` before the path.
    let authority = rest.split('/').next().unwrap_or(rest);
    let Some(at) = authority.rfind('@') else {
        return url.into();
    };
    match authority[..at].split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:<hidden>{}", &rest[at..]).into(),
        None => url.into(),
    }
}

/// `[cache.shared]`'s `decoder`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Decoder {
    /// One instance of the fleet (the lease's holder) follows each database's WAL and
    /// publishes its invalidations on a stream in Valkey; the others read it.
    #[default]
    One,
    /// Every instance follows the WAL itself.
    Each,
}

/// `[cache.shared]`'s `without_valkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WithoutValkey {
    /// Follow the WAL itself until Valkey answers again.
    #[default]
    OwnFollower,
    /// Serve nothing from the cache until Valkey answers again.
    NoCaching,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawShared {
    url: String,
    timeout: Option<<TextOrSeconds as Form<Duration>>::Raw>,
    name: Option<String>,
    decoder: Option<String>,
    lease: Option<<TextOrSeconds as Form<Duration>>::Raw>,
    without_valkey: Option<String>,
    cluster: Option<bool>,
    ca_file: Option<String>,
}

/// The default of `[cache.shared]`'s `timeout`.
pub const SHARED_TIMEOUT: Duration = Duration::from_millis(20);

/// The default of `[cache.shared]`'s `lease`.
pub const SHARED_LEASE: Duration = Duration::from_secs(3);

/// `[cache.shared]`: the URL's scheme is checked (the connection is made at start), and WAL
/// invalidation is required: an instance serves another's entry only when its own follower
/// knows of no write after the entry's WAL position.
fn read_shared(
    raw: Option<RawShared>,
    cache: &CacheConfig,
    cx: &Context<'_>,
) -> Result<Option<SharedTier>, ConfigError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    if !(raw.url.starts_with("redis://") || raw.url.starts_with("rediss://")) {
        return Err(ConfigError::invalid(
            "cache.shared.url",
            "expected redis://host:port/db or rediss://host:port/db",
        ));
    }
    if cache.invalidation != Invalidation::Wal {
        return Err(ConfigError::invalid(
            "cache.shared",
            "the shared tier needs cache.invalidation = \"wal\": an instance serves another's \
             entry only when its own WAL follower knows of no write after the entry's position",
        ));
    }
    let timeout =
        read_key::<Duration, TextOrSeconds>("cache.shared.timeout", raw.timeout, None, cx)?
            .unwrap_or(SHARED_TIMEOUT);
    let name = raw.name.unwrap_or_else(|| "pgmemo".into());
    if name.is_empty() || name.contains(char::is_whitespace) {
        return Err(ConfigError::invalid(
            "cache.shared.name",
            "a name without spaces",
        ));
    }
    let decoder = read_key::<Decoder, Own>("cache.shared.decoder", raw.decoder, None, cx)?
        .unwrap_or_default();
    let without_valkey = read_key::<WithoutValkey, Own>(
        "cache.shared.without_valkey",
        raw.without_valkey,
        None,
        cx,
    )?
    .unwrap_or_default();
    let lease = read_key::<Duration, TextOrSeconds>("cache.shared.lease", raw.lease, None, cx)?
        .unwrap_or(SHARED_LEASE);
    if lease < Duration::from_millis(300) {
        return Err(ConfigError::invalid(
            "cache.shared.lease",
            "at least 300ms (the leader renews it every third of it)",
        ));
    }
    if raw.ca_file.is_some() && !raw.url.starts_with("rediss://") {
        return Err(ConfigError::invalid(
            "cache.shared.ca_file",
            "only with a rediss:// url (TLS)",
        ));
    }
    Ok(Some(SharedTier {
        url: raw.url,
        timeout,
        name,
        decoder,
        lease,
        without_valkey,
        cluster: raw.cluster.unwrap_or(false),
        ca_file: raw.ca_file.map(Into::into),
    }))
}

/// `[[cache.rules]]`, read through the table's [`read_key`] (each value judged with its key,
/// `cache.rules[0].ttl`, in hand); a rule's `ttl` and `max_result_bytes` default to the
/// section's.
fn read_rules(
    raw: Vec<RawRule>,
    cache: &CacheConfig,
    cx: &Context<'_>,
) -> Result<Vec<Rule>, ConfigError> {
    raw.into_iter()
        .enumerate()
        .map(|(i, r)| r.into_rule(i, cache, cx))
        .collect()
}

impl RawRule {
    fn into_rule(
        self,
        i: usize,
        cache: &CacheConfig,
        cx: &Context<'_>,
    ) -> Result<Rule, ConfigError> {
        let key = |field: &str| format!("cache.rules[{i}].{field}");
        let query_hash = read_key::<u64, Hex>(&key("query_hash"), self.query_hash, None, cx)?;
        if self.query.is_none() && query_hash.is_none() && self.query_contains.is_none() {
            return Err(ConfigError::invalid(
                key("query"),
                "a rule needs query, query_hash or query_contains",
            ));
        }
        let ttl = read_key::<Duration, TextOrSeconds>(&key("ttl"), self.ttl, None, cx)?;
        let max_result_bytes =
            read_key::<usize, Bytes>(&key("max_result_bytes"), self.max_result_bytes, None, cx)?;
        let refresh_at = self.refresh_at.unwrap_or(cache.refresh_at);
        if !(0.5..=1.0).contains(&refresh_at) {
            return Err(ConfigError::invalid(
                key("refresh_at"),
                "must be between 0.5 and 1",
            ));
        }
        Ok(Rule {
            name: self.name.unwrap_or_else(|| format!("rule{}", i + 1)),
            database: self.database,
            user: self.user,
            query: self.query,
            query_hash,
            query_contains: self.query_contains,
            ttl: ttl.unwrap_or(cache.default_ttl),
            cache_empty: self.cache_empty.unwrap_or(true),
            transactions: self.transactions.unwrap_or(true),
            max_result_bytes: max_result_bytes.unwrap_or(cache.max_result_bytes),
            refresh_at,
        })
    }
}

/// Whether two query texts are the same but for their spacing and a `;` at the end (pgbench
/// and many applications end a statement with one, psql does not send it): whitespace counts
/// only as one space between two word characters (`id = $1` is `id=$1`, `SELECT  a` is
/// `SELECT a`, `SELECT ab` is not `SELECT a b`). Quotes are not followed: spacing inside a
/// string literal a rule spells out does not count either (a rule chooses what is cached;
/// the key is exact).
pub fn same_text(a: &str, b: &str) -> bool {
    canonical(ended(a).as_bytes()).eq(canonical(ended(b).as_bytes()))
}

/// `text` without the `;` and whitespace it ends with.
fn ended(text: &str) -> &str {
    text.trim_end_matches(|c: char| c == ';' || c.is_ascii_whitespace())
}

/// The bytes of `text` as [`same_text`] compares them.
fn canonical(text: &[u8]) -> impl Iterator<Item = u8> + '_ {
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80;
    let (mut prev, mut gap) = (None::<u8>, false);
    text.iter()
        .flat_map(move |&b| {
            if b.is_ascii_whitespace() {
                gap = true;
                return [None, None];
            }
            let space = gap && prev.is_some_and(word) && word(b);
            (prev, gap) = (Some(b), false);
            [space.then_some(b' '), Some(b)]
        })
        .flatten()
}

/// A query hash as SHOW AUTOPREPARE prints it: 16 hexadecimal digits, with or without `0x`
/// (a hash of another length names no query: an error, not a rule that never matches).
struct Hex;

impl Form<u64> for Hex {
    type Raw = String;
    const KIND: &'static str = "16 hexadecimal digits";
    fn read(h: String, _: &Context<'_>) -> Result<u64, String> {
        let digits = h.trim_start_matches("0x");
        if digits.len() != 16 {
            return Err(format!(
                "must be the 16 hexadecimal digits SHOW AUTOPREPARE prints (got {})",
                digits.len()
            ));
        }
        u64::from_str_radix(digits, 16).map_err(|_| "must be a hexadecimal hash".into())
    }
    fn show(value: &u64) -> String {
        format!("{value:016x}")
    }
}

impl Value for Invalidation {
    type Raw = String;
    const KIND: &'static str = r#""proxy" or "wal""#;
    fn read(raw: String, _: &Context<'_>) -> Result<Invalidation, String> {
        raw.parse()
    }
    fn show(&self) -> String {
        match self {
            Invalidation::Proxy => "proxy",
            Invalidation::Wal => "wal",
        }
        .into()
    }
}

impl Value for WalPlugin {
    type Raw = String;
    const KIND: &'static str = r#""test_decoding" or "pgoutput""#;
    fn read(raw: String, _: &Context<'_>) -> Result<WalPlugin, String> {
        match raw.as_str() {
            "test_decoding" => Ok(WalPlugin::TestDecoding),
            "pgoutput" => Ok(WalPlugin::Pgoutput),
            other => Err(format!(
                "expected \"test_decoding\" or \"pgoutput\", got \"{other}\""
            )),
        }
    }
    fn show(&self) -> String {
        match self {
            WalPlugin::TestDecoding => "test_decoding",
            WalPlugin::Pgoutput => "pgoutput",
        }
        .into()
    }
}

impl Value for Decoder {
    type Raw = String;
    const KIND: &'static str = r#""one" or "each""#;
    fn read(raw: String, _: &Context<'_>) -> Result<Decoder, String> {
        match raw.as_str() {
            "one" => Ok(Decoder::One),
            "each" => Ok(Decoder::Each),
            other => Err(format!("expected \"one\" or \"each\", got \"{other}\"")),
        }
    }
    fn show(&self) -> String {
        match self {
            Decoder::One => "one",
            Decoder::Each => "each",
        }
        .into()
    }
}

impl Value for WithoutValkey {
    type Raw = String;
    const KIND: &'static str = r#""own_follower" or "no_caching""#;
    fn read(raw: String, _: &Context<'_>) -> Result<WithoutValkey, String> {
        match raw.as_str() {
            "own_follower" => Ok(WithoutValkey::OwnFollower),
            "no_caching" => Ok(WithoutValkey::NoCaching),
            other => Err(format!(
                "expected \"own_follower\" or \"no_caching\", got \"{other}\""
            )),
        }
    }
    fn show(&self) -> String {
        match self {
            WithoutValkey::OwnFollower => "own_follower",
            WithoutValkey::NoCaching => "no_caching",
        }
        .into()
    }
}

/// A relation a rule's `query_contains` names after `FROM` or `JOIN`, as a query's text spells
/// it (the last part of a qualified name): a `quoted` name is the relation's exact name, any
/// other is folded to lower case as PostgreSQL folds it; an `open` name ends the rule's text,
/// so a query naming a longer relation (or a function: `FROM generate_series`) contains it
/// too. What `--check` compares with the catalog (a name no database has: the rule can never
/// match).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainedName {
    pub name: String,
    pub quoted: bool,
    pub open: bool,
}

/// The relations `text` (a rule's `query_contains`) names, read with a small tokenizer: a
/// name is taken only where it certainly is one, after `FROM` or `JOIN` outside parentheses
/// the text opens (`extract(year FROM d)` is no relation), not after `DISTINCT` (`IS DISTINCT
/// FROM x`), `LATERAL` or before a `(` (a function call).
pub fn contained_names(text: &str) -> Vec<ContainedName> {
    #[derive(PartialEq)]
    enum Token {
        Word(String, bool),
        Dot,
        Open,
        Close,
        Other,
    }
    let bytes = text.as_bytes();
    let mut tokens = Vec::new();
    let mut i = 0;
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80;
    while i < bytes.len() {
        let b = bytes[i];
        let start = i;
        i += 1;
        let token = match b {
            b if b.is_ascii_whitespace() => continue,
            b'.' => Token::Dot,
            b'(' => Token::Open,
            b')' => Token::Close,
            b'"' => {
                let mut name = String::new();
                let mut closed = false;
                while i < bytes.len() {
                    match (bytes[i], bytes.get(i + 1)) {
                        (b'"', Some(b'"')) => {
                            name.push('"');
                            i += 2;
                        }
                        (b'"', _) => {
                            i += 1;
                            closed = true;
                            break;
                        }
                        _ => {
                            let ch = text[i..].chars().next().unwrap_or('\0');
                            name.push(ch);
                            i += ch.len_utf8();
                        }
                    }
                }
                match closed {
                    true => Token::Word(name, true),
                    false => Token::Other,
                }
            }
            b'\'' => {
                // A string: what is in it names nothing.
                while i < bytes.len() && bytes[i] != b'\'' {
                    i += 1;
                }
                i += 1;
                Token::Other
            }
            b if word(b) => {
                while i < bytes.len() && word(bytes[i]) {
                    i += 1;
                }
                Token::Word(text[start..i].to_ascii_lowercase(), false)
            }
            _ => Token::Other,
        };
        tokens.push((token, i.min(bytes.len())));
    }
    let is = |t: Option<&(Token, usize)>, w: &str| matches!(t, Some((Token::Word(x, false), _)) if x == w);
    let mut names = Vec::new();
    let mut depth = 0i32;
    for at in 0..tokens.len() {
        match &tokens[at].0 {
            Token::Open => depth += 1,
            Token::Close => depth -= 1,
            _ => {}
        }
        let keyword = is(tokens.get(at), "from") || is(tokens.get(at), "join");
        if !keyword || depth > 0 || (at > 0 && is(tokens.get(at - 1), "distinct")) {
            continue;
        }
        let mut next = at + 1;
        if is(tokens.get(next), "only") {
            next += 1;
        }
        let mut last = match tokens.get(next) {
            Some((Token::Word(w, quoted), end)) if w != "lateral" || *quoted => (w, *quoted, *end),
            _ => continue,
        };
        while let (Some((Token::Dot, _)), Some((Token::Word(w, quoted), end))) =
            (tokens.get(next + 1), tokens.get(next + 2))
        {
            last = (w, *quoted, *end);
            next += 2;
        }
        match tokens.get(next + 1) {
            Some((Token::Open, _)) | Some((Token::Dot, _)) => continue,
            _ => {}
        }
        let (name, quoted, end) = last;
        names.push(ContainedName {
            name: name.clone(),
            quoted,
            open: !quoted && end == bytes.len(),
        });
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_tier_url_shows_no_password() {
        for (url, shown) in [
            ("redis://:pw@h:6379/0", "redis://:<hidden>@h:6379/0"),
            ("rediss://u:p@ss@h/0", "rediss://u:<hidden>@h/0"),
            ("redis://u@h:6379", "redis://u@h:6379"),
            ("redis://h:6379/0", "redis://h:6379/0"),
            ("redis://h/a@b", "redis://h/a@b"),
        ] {
            assert_eq!(url_without_password(url), shown);
        }
    }

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
             [[cache.rules]]\nname = \"h\"\nquery_hash = \"00000000000000ff\"\nttl = 2.5\ncache_empty = false\n",
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
            transactions: true,
            refresh_at: 0.8,
        };
        assert!(rule.matches("app", "u", "SELECT * FROM accounts WHERE id = $1", 1));
        assert!(!rule.matches("other", "u", "SELECT * FROM accounts WHERE id = $1", 1));
        assert!(!rule.matches("app", "u", "SELECT * FROM users", 1));
    }
}

#[cfg(test)]
mod contained {
    use super::*;

    fn names(text: &str) -> Vec<(String, bool, bool)> {
        contained_names(text)
            .into_iter()
            .map(|n| (n.name, n.quoted, n.open))
            .collect()
    }

    #[test]
    fn the_relations_a_rule_text_names() {
        let n = |s: &str, q, o| (s.to_owned(), q, o);
        assert_eq!(names("FROM users"), [n("users", false, true)]);
        assert_eq!(names("FROM users "), [n("users", false, false)]);
        assert_eq!(names("FROM Users WHERE"), [n("users", false, false)]);
        assert_eq!(names("from public.users u"), [n("users", false, false)]);
        assert_eq!(
            names("FROM \"Users\" JOIN posts p ON"),
            [n("Users", true, false), n("posts", false, false)]
        );
        assert_eq!(names("FROM ONLY parted x"), [n("parted", false, false)]);
        assert_eq!(names("FROM \"a\"\"b\" "), [n("a\"b", true, false)]);
        // Not relations, or not certainly.
        for none in [
            "extract(year FROM created)",
            "a IS DISTINCT FROM b",
            "FROM generate_series(1, 3)",
            "FROM (SELECT 1) s",
            "FROM LATERAL f(x)",
            "FROM public.",
            "WHERE name = 'x FROM y'",
            "FROM \"open",
            "SELECT 1",
        ] {
            assert_eq!(names(none), [], "{none}");
        }
    }
}
