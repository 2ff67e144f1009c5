//! `general.auth_hba_file` with `auth_type = "hba"`: which authentication each connection
//! gets, from a file in PostgreSQL's `pg_hba.conf` format, as PgBouncer 1.25 reads it (its
//! "HBA file format"): the first line that matches the connection's kind, database, user and
//! address decides.
//!
//! - kinds: `local` (the Unix socket), `host`, `hostssl`, `hostnossl`;
//! - databases: `all`, `sameuser`, `replication` (as in PostgreSQL, a physical replication
//!   connection matches only this keyword, and a logical one, `replication=database`, matches
//!   as a connection to its database), names, comma-separated, `"quoted"` (a quoted keyword is
//!   a name), `@file` (the names in that file, relative to the HBA file's directory);
//! - users: `all`, names, `@file`;
//! - addresses: `all`, an IPv4 or IPv6 address with a `/prefix`, or an address and a mask in
//!   two fields;
//! - methods: `trust`, `reject`, `md5`, `scram-sha-256` (what `auth_type` offers, as
//!   PgBouncer); `md5` means SCRAM for a user whose secret is a SCRAM verifier, as everywhere;
//!   `peer` on `local` lines: the operating-system user of the socket's peer must be the user
//!   it logs in as; `cert` on `hostssl` lines: the client's certificate (checked against
//!   `tls_ca_file`) must name the user in its Common Name; either with `map=NAME`, a map of
//!   `auth_ident_file` (see [`super::ident`]) saying which system names log in as which users.
//!
//! What pgmemo cannot honour is refused when the file is read, with its line, rather than
//! skipped (a skipped `reject` line would let in whom it was written to keep out): an `@file`
//! inside an `@file`, `+group`, `samerole`, `samehost`, `samenet`, host names, `peer` on a
//! `host` line, `cert` on a line that is not `hostssl`, and the methods pgmemo does not have
//! (`password`, `ldap`, `pam`, ...).
//! The file (and its `@file` lists) is read with the configuration, so RELOAD and SIGHUP read
//! it again.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use super::ident::IdentMaps;
use super::ConfigError;

/// What a line of the file lets a connection do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HbaMethod {
    Trust,
    Reject,
    Md5,
    ScramSha256,
    /// The client's operating-system user (of the Unix socket's peer) must be the user it
    /// logs in as.
    Peer,
    /// The client's TLS certificate (checked against `tls_ca_file`) must name the user in its
    /// Common Name.
    Cert,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Local,
    Host,
    HostSsl,
    HostNoSsl,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Name {
    All,
    SameUser,
    Replication,
    Named(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    line: usize,
    kind: Kind,
    databases: Vec<Name>,
    users: Vec<Name>,
    /// None: any address (`all`, and `local` lines).
    network: Option<(IpAddr, u8)>,
    method: HbaMethod,
    /// `map=NAME` of `auth_ident_file` (peer and cert lines).
    map: Option<String>,
}

/// The rules of the HBA file, in order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Hba {
    /// The file, as the configuration names it (made absolute against the config file).
    pub path: Option<PathBuf>,
    rules: Vec<Rule>,
    /// `general.auth_ident_file`'s maps, which the rules' `map=` options name.
    idents: IdentMaps,
}

/// How a connection arrived, for [`Hba::method`].
#[derive(Debug, Clone, Copy)]
pub enum Arrival {
    /// On pgmemo's Unix socket.
    Local,
    /// Over TCP from this address, with TLS or not.
    Tcp { addr: IpAddr, tls: bool },
}

impl Hba {
    /// Reads and checks the HBA file at `path`, with the ident file at `ident` (its maps,
    /// which `map=` options name); an error names the file and the line.
    pub fn load(path: &Path, ident: Option<&Path>) -> Result<Hba, ConfigError> {
        let idents = match ident {
            Some(ident) => IdentMaps::load(ident)?,
            None => IdentMaps::default(),
        };
        let dir = path.parent().unwrap_or(Path::new(""));
        let mut hba = read_file("general.auth_hba_file", path, |text| {
            Hba::parse_in(text, dir, idents)
        })?;
        hba.path = Some(path.to_owned());
        Ok(hba)
    }

    /// The rules of `text`; the first line that cannot be honoured, with what is wrong.
    /// `@file` lists are read relative to the working directory.
    pub fn parse(text: &str) -> Result<Hba, (usize, String)> {
        Hba::parse_in(text, Path::new(""), IdentMaps::default())
    }

    /// [`Hba::parse`], `@file` lists read relative to `dir` (the HBA file's), `map=` options
    /// naming maps of `idents`.
    fn parse_in(text: &str, dir: &Path, idents: IdentMaps) -> Result<Hba, (usize, String)> {
        let mut rules = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let fields = fields(line).map_err(|m| (i + 1, m))?;
            if fields.is_empty() {
                continue;
            }
            let rule = rule(i + 1, &fields, dir).map_err(|m| (i + 1, m))?;
            if let Some(map) = rule.map.as_deref().filter(|m| !idents.has(m)) {
                return Err((
                    i + 1,
                    format!("ident map \"{map}\" is not in auth_ident_file"),
                ));
            }
            rules.push(rule);
        }
        Ok(Hba {
            path: None,
            rules,
            idents,
        })
    }

    /// Whether the rule of line `line` (a `peer` or `cert` one) lets the client known to the
    /// system as `system` (its operating-system user, its certificate's Common Name) log in as
    /// `user`: through its ident map, or, without one, when the two names are the same.
    pub fn lets_in(&self, line: usize, system: &str, user: &str) -> bool {
        match self
            .rules
            .iter()
            .find(|r| r.line == line)
            .and_then(|r| r.map.as_deref())
        {
            Some(map) => self.idents.allows(map, system, user),
            None => system == user,
        }
    }

    /// Whether a line logs in with client certificates.
    pub fn uses_cert(&self) -> bool {
        self.rules.iter().any(|r| r.method == HbaMethod::Cert)
    }

    /// The method of the first rule that matches, and its line; None when none does.
    /// `physical`: a physical replication connection (matched by `replication` lines only).
    pub fn method(
        &self,
        arrival: Arrival,
        database: &str,
        user: &str,
        physical: bool,
    ) -> Option<(HbaMethod, usize)> {
        self.rules
            .iter()
            .find(|r| r.matches(arrival, database, user, physical))
            .map(|r| (r.method, r.line))
    }
}

/// Reads the file at `path` that setting `key` names and parses it with `parse`; an error
/// names the file, and the line `parse` gives.
pub(super) fn read_file<T>(
    key: &str,
    path: &Path,
    parse: impl FnOnce(&str) -> Result<T, (usize, String)>,
) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::invalid(key, format!("cannot read {}: {e}", path.display())))?;
    parse(&text).map_err(|(line, message)| {
        ConfigError::invalid(key, format!("{}, line {line}: {message}", path.display()))
    })
}

impl Rule {
    fn matches(&self, arrival: Arrival, database: &str, user: &str, physical: bool) -> bool {
        let kind = match (self.kind, arrival) {
            (Kind::Local, Arrival::Local) => true,
            (Kind::Host, Arrival::Tcp { .. }) => true,
            (Kind::HostSsl, Arrival::Tcp { tls, .. }) => tls,
            (Kind::HostNoSsl, Arrival::Tcp { tls, .. }) => !tls,
            _ => false,
        };
        let address = match (self.network, arrival) {
            (None, _) => true,
            (Some((net, prefix)), Arrival::Tcp { addr, .. }) => in_network(addr, net, prefix),
            (Some(_), Arrival::Local) => false,
        };
        let database_ok = self.databases.iter().any(|d| match d {
            Name::Replication => physical,
            _ if physical => false,
            Name::All => true,
            Name::SameUser => database == user,
            Name::Named(n) => n == database,
        });
        let user_ok = self.users.iter().any(|u| match u {
            Name::All => true,
            Name::Named(n) => n == user,
            Name::SameUser | Name::Replication => false,
        });
        kind && address && database_ok && user_ok
    }
}

/// Whether `addr` is in `net`/`prefix` (an IPv4 address mapped into IPv6 counts as IPv4).
fn in_network(addr: IpAddr, net: IpAddr, prefix: u8) -> bool {
    let addr = match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
        v4 => v4,
    };
    match (addr, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

/// A field of a line: its comma-separated elements, each with whether it was quoted (then it
/// is a name, never a keyword).
pub(super) type Field = Vec<(String, bool)>;

/// The fields of one line: split at blanks, elements at commas, `"..."` quoting (with `""`
/// for a quote inside), `#` starting a comment outside quotes.
pub(super) fn fields(line: &str) -> Result<Vec<Field>, String> {
    let mut out: Vec<Field> = Vec::new();
    let mut chars = line.chars().peekable();
    let mut current: Option<Field> = None;
    while let Some(c) = chars.next() {
        if c == '#' {
            break;
        }
        if c.is_whitespace() {
            out.extend(current.take());
            continue;
        }
        let field = current.get_or_insert_with(|| vec![(String::new(), false)]);
        match c {
            ',' => field.push((String::new(), false)),
            '"' => {
                let element = field.last_mut().expect("a field has an element");
                element.1 = true;
                loop {
                    match chars.next() {
                        Some('"') if chars.peek() == Some(&'"') => {
                            chars.next();
                            element.0.push('"');
                        }
                        Some('"') => break,
                        Some(c) => element.0.push(c),
                        None => return Err("a quote is not closed".into()),
                    }
                }
            }
            c => field.last_mut().expect("a field has an element").0.push(c),
        }
    }
    out.extend(current);
    Ok(out)
}

/// The names of a database or user field (`keywords`: the words that are not names there);
/// an `@file` element is read from `dir` (None: `@file` lists are not read, as in one).
fn names(
    elements: &Field,
    what: &str,
    keywords: &[&str],
    dir: Option<&Path>,
) -> Result<Vec<Name>, String> {
    let mut names = Vec::new();
    for (part, quoted) in elements {
        let name = match (*quoted, part.as_str()) {
            (false, "all") if keywords.contains(&"all") => Name::All,
            (false, "sameuser") if keywords.contains(&"sameuser") => Name::SameUser,
            (false, "replication") if keywords.contains(&"replication") => Name::Replication,
            (false, p @ ("samerole" | "samegroup")) => {
                return Err(format!(
                    "{p} is not supported (pgmemo does not know roles' groups)"
                ))
            }
            (false, p) if p.starts_with('@') => {
                let Some(dir) = dir else {
                    return Err(format!("{p}: an @file list cannot name another"));
                };
                names.extend(names_file(&dir.join(&p[1..]), what, keywords)?);
                continue;
            }
            (false, p) if p.starts_with('+') => {
                return Err(format!("{p}: +group is not supported"))
            }
            (_, "") => return Err(format!("an empty {what} name")),
            (_, p) => Name::Named(p.to_owned()),
        };
        names.push(name);
    }
    Ok(names)
}

/// The names an `@file` element stands for: the file's names, separated by spaces, commas
/// or lines (`#` comments, `"quoted"` names), as PostgreSQL and PgBouncer read it.
fn names_file(path: &Path, what: &str, keywords: &[&str]) -> Result<Vec<Name>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the {what} list {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let at = |m: String| format!("{}, line {}: {m}", path.display(), i + 1);
        for field in fields(line).map_err(at)? {
            let elements: Field = field
                .into_iter()
                .filter(|(t, q)| *q || !t.is_empty())
                .collect();
            out.extend(names(&elements, what, keywords, None).map_err(at)?);
        }
    }
    if out.is_empty() {
        return Err(format!("the {what} list {} names no one", path.display()));
    }
    Ok(out)
}

/// One rule from a line's fields; `@file` lists are read from `dir`.
fn rule(line: usize, fields: &[Field], dir: &Path) -> Result<Rule, String> {
    // A field that is not a list: its text (a comma in it kept).
    let word = |i: usize| fields.get(i).map(join);
    let kind = match word(0).as_deref() {
        Some("local") => Kind::Local,
        Some("host") => Kind::Host,
        Some("hostssl") => Kind::HostSsl,
        Some("hostnossl") => Kind::HostNoSsl,
        Some(other) => {
            return Err(format!(
                "connection type {other:?}: pgmemo knows local, host, hostssl and hostnossl"
            ))
        }
        None => return Err("no connection type".into()),
    };
    let list = |i: usize, what: &str, keywords: &[&str]| -> Result<Vec<Name>, String> {
        let elements = fields.get(i).ok_or(format!("no {what} field"))?;
        names(elements, what, keywords, Some(dir))
    };
    let databases = list(1, "database", &["all", "sameuser", "replication"])?;
    let users = list(2, "user", &["all"])?;
    let (network, method_at) = match kind {
        Kind::Local => (None, 3),
        _ => address(fields)?,
    };
    let method = match word(method_at).as_deref() {
        Some("trust") => HbaMethod::Trust,
        Some("reject") => HbaMethod::Reject,
        Some("md5") => HbaMethod::Md5,
        Some("scram-sha-256") => HbaMethod::ScramSha256,
        Some("peer") if kind == Kind::Local => HbaMethod::Peer,
        Some("peer") => {
            return Err("method \"peer\" is for local lines only (the Unix socket)".into())
        }
        Some("cert") if kind == Kind::HostSsl => HbaMethod::Cert,
        Some("cert") => return Err("method \"cert\" is for hostssl lines only".into()),
        Some(other) => {
            return Err(format!(
                "method {other:?} is not supported: pgmemo has trust, reject, md5, \
                 scram-sha-256, peer and cert"
            ))
        }
        None => return Err("no authentication method".into()),
    };
    let mut map = None;
    for option in fields.iter().skip(method_at + 1).map(join) {
        match option.strip_prefix("map=") {
            Some(name) if matches!(method, HbaMethod::Peer | HbaMethod::Cert) => {
                map = Some(name.to_owned())
            }
            // PostgreSQL's words.
            Some(_) => {
                return Err(
                    "authentication option \"map\" is only valid for authentication methods \
                     peer and cert"
                        .into(),
                )
            }
            None => {
                return Err(format!(
                    "option {option:?} after the method is not supported"
                ))
            }
        }
    }
    Ok(Rule {
        line,
        kind,
        databases,
        users,
        network,
        method,
        map,
    })
}

/// A host line's address (`all`, `ADDR/PREFIX`, or `ADDR MASK`) and where its method is.
fn address(fields: &[Field]) -> Result<(Option<(IpAddr, u8)>, usize), String> {
    let text = fields.get(3).map(join).ok_or("no address field")?;
    let text = text.as_str();
    if text == "all" {
        return Ok((None, 4));
    }
    let bits = |a: &IpAddr| if a.is_ipv4() { 32 } else { 128 };
    if let Some((addr, prefix)) = text.split_once('/') {
        let addr: IpAddr = addr.parse().map_err(|_| bad_address(text))?;
        let prefix: u8 = prefix.parse().map_err(|_| bad_address(text))?;
        if prefix > bits(&addr) {
            return Err(bad_address(text));
        }
        return Ok((Some((addr, prefix)), 4));
    }
    let addr: IpAddr = text.parse().map_err(|_| bad_address(text))?;
    let mask = fields.get(4).map(join).unwrap_or_default();
    let mask: IpAddr = mask
        .parse()
        .map_err(|_| format!("address {text} needs a /prefix or a mask after it"))?;
    // The mask's leading ones, and all its ones: a mask is contiguous when they are equal.
    let (ones, all) = match mask {
        IpAddr::V4(m) => (u32::from(m).leading_ones(), u32::from(m).count_ones()),
        IpAddr::V6(m) => (u128::from(m).leading_ones(), u128::from(m).count_ones()),
    };
    if mask.is_ipv4() != addr.is_ipv4() || ones != all {
        return Err(format!("mask {mask} does not fit address {text}"));
    }
    Ok((Some((addr, ones as u8)), 5))
}

/// A field's text as written but for its quotes.
fn join(field: &Field) -> String {
    let parts: Vec<&str> = field.iter().map(|(t, _)| t.as_str()).collect();
    parts.join(",")
}

fn bad_address(text: &str) -> String {
    format!("address {text:?}: pgmemo reads all, ADDRESS/PREFIX or ADDRESS MASK (no host names, samehost or samenet)")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(addr: &str, tls: bool) -> Arrival {
        Arrival::Tcp {
            addr: addr.parse().unwrap(),
            tls,
        }
    }

    #[test]
    fn the_first_matching_line_decides() {
        let method = |hba: &Hba, a, d, u| hba.method(a, d, u, false).map(|(m, _)| m);
        let hba = Hba::parse(
            "# comment\n\
             local all all trust\n\
             hostssl app web 10.0.0.0/8 scram-sha-256   # web from the VPC, over TLS\n\
             host app,\"all\" web 10.0.0.0 255.0.0.0 reject\n\
             host sameuser all ::1/128 md5\n\
             host all \"ann\",bob 127.0.0.1/32 trust\n\
             hostnossl all all 0.0.0.0/0 reject\n",
        )
        .unwrap();
        use HbaMethod::*;
        assert_eq!(method(&hba, Arrival::Local, "app", "x"), Some(Trust));
        assert_eq!(
            method(&hba, tcp("10.1.2.3", true), "app", "web"),
            Some(ScramSha256)
        );
        assert_eq!(
            hba.method(tcp("10.1.2.3", true), "app", "web", false)
                .unwrap()
                .1,
            3
        );
        assert_eq!(
            method(&hba, tcp("10.1.2.3", false), "app", "web"),
            Some(Reject)
        );
        // "all" quoted is a database named all.
        assert_eq!(
            method(&hba, tcp("10.1.2.3", false), "all", "web"),
            Some(Reject)
        );
        assert_eq!(
            method(&hba, tcp("10.1.2.3", false), "other", "web"),
            Some(Reject)
        );
        assert_eq!(method(&hba, tcp("::1", false), "bob", "bob"), Some(Md5));
        assert_eq!(method(&hba, tcp("::1", false), "app", "bob"), None);
        assert_eq!(
            method(&hba, tcp("127.0.0.1", true), "app", "ann"),
            Some(Trust)
        );
        assert_eq!(
            method(&hba, tcp("::ffff:127.0.0.1", true), "app", "bob"),
            Some(Trust)
        );
        assert_eq!(method(&hba, tcp("127.0.0.1", true), "app", "carl"), None);
        assert_eq!(method(&hba, tcp("192.168.0.1", true), "app", "carl"), None);
    }

    #[test]
    fn peer_and_cert_lines_name_their_ident_map() {
        let idents = IdentMaps::parse("ops alice app\nops root all\n").unwrap();
        let hba = Hba::parse_in(
            "local app all peer map=ops\nlocal all all peer\nhostssl all all all cert map=ops\n",
            Path::new(""),
            idents.clone(),
        )
        .unwrap();
        // Line 1's map: alice as app, root as anyone; not alice as herself.
        assert!(hba.lets_in(1, "alice", "app"));
        assert!(hba.lets_in(1, "root", "reports"));
        assert!(!hba.lets_in(1, "alice", "alice"));
        // Line 2 has no map: only one's own name.
        assert!(hba.lets_in(2, "alice", "alice"));
        assert!(!hba.lets_in(2, "alice", "app"));
        assert!(hba.lets_in(3, "alice", "app"));
        // No line (auth_type = "cert" without an HBA file): one's own name.
        assert!(hba.lets_in(0, "app", "app") && !hba.lets_in(0, "alice", "app"));
        for (text, says) in [
            (
                "local all all peer map=nomap\n",
                "ident map \"nomap\" is not in",
            ),
            (
                "host all all all md5 map=ops\n",
                "only valid for authentication methods",
            ),
            (
                "local all all peer clientcert=1\n",
                "\"clientcert=1\" after the method",
            ),
        ] {
            let (_, message) = Hba::parse_in(text, Path::new(""), idents.clone()).unwrap_err();
            assert!(message.contains(says), "{text}: {message}");
        }
    }

    #[test]
    fn physical_replication_matches_replication_lines_only() {
        let hba = Hba::parse(
            "host all all 10.0.0.0/8 md5\n\
             host replication rep 10.0.0.0/8 scram-sha-256\n\
             host \"replication\" all 10.0.0.0/8 trust\n",
        )
        .unwrap();
        let method = |d, u, physical| {
            hba.method(tcp("10.1.2.3", false), d, u, physical)
                .map(|(m, _)| m)
        };
        // Physical: `all` does not match it, the keyword does (a quoted one is a name).
        assert_eq!(
            method("replication", "rep", true),
            Some(HbaMethod::ScramSha256)
        );
        assert_eq!(method("replication", "other", true), None);
        // (Its database name is not looked at, as in PostgreSQL.)
        assert_eq!(method("app", "rep", true), Some(HbaMethod::ScramSha256));
        // Logical and plain connections match as connections to their database.
        assert_eq!(method("replication", "rep", false), Some(HbaMethod::Md5));
        assert_eq!(method("app", "rep", false), Some(HbaMethod::Md5));
    }

    #[test]
    fn at_file_lists_are_read_next_to_the_hba_file() {
        let dir = std::env::temp_dir().join(format!("pgmemo-hba-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("dbs"), "app, \"all\"  # the apps\nreports\n").unwrap();
        std::fs::write(dir.join("nested"), "@dbs\n").unwrap();
        std::fs::write(
            dir.join("hba.conf"),
            "host @dbs all all md5\nlocal all all peer\nhost all all all reject\n",
        )
        .unwrap();
        let hba = Hba::load(&dir.join("hba.conf"), None).unwrap();
        let method = |d| {
            hba.method(tcp("10.0.0.1", false), d, "u", false)
                .map(|(m, _)| m)
        };
        assert_eq!(method("app"), Some(HbaMethod::Md5));
        assert_eq!(method("reports"), Some(HbaMethod::Md5));
        assert_eq!(method("all"), Some(HbaMethod::Md5));
        assert_eq!(method("other"), Some(HbaMethod::Reject));
        assert_eq!(
            hba.method(Arrival::Local, "app", "u", false)
                .map(|(m, _)| m),
            Some(HbaMethod::Peer)
        );
        std::fs::write(dir.join("hba.conf"), "host @nested all all md5\n").unwrap();
        let nested = Hba::load(&dir.join("hba.conf"), None)
            .unwrap_err()
            .to_string();
        assert!(
            nested.contains("line 1") && nested.contains("cannot name another"),
            "{nested}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn what_pgmemo_cannot_honour_is_refused_with_its_line() {
        for (text, says) in [
            ("host all all all peer", "local lines only"),
            ("host all all 10.0.0.0/8 password", "method \"password\""),
            ("host all +admins all md5", "+group"),
            (
                "host @no_such_file all all md5",
                "cannot read the database list",
            ),
            ("host samerole all all md5", "samerole"),
            ("host all all samenet md5", "samenet"),
            ("host all all db.example.com md5", "host names"),
            ("host all all 10.0.0.0/33 md5", "10.0.0.0/33"),
            ("host all all 10.0.0.0 255.0.255.0 md5", "does not fit"),
            ("host all all 10.0.0.0 md5", "needs a /prefix"),
            ("hostgssenc all all all md5", "hostgssenc"),
            ("host all all all ldap ldapserver=x", "method \"ldap\""),
            (
                "host all all all md5 extra",
                "after the method is not supported",
            ),
            ("host \"all all all md5", "quote"),
            ("host all", "no user field"),
        ] {
            let (line, message) =
                Hba::parse(&format!("local all all trust\n{text}\n")).unwrap_err();
            assert_eq!(line, 2, "{text}");
            assert!(message.contains(says), "{text}: {message}");
        }
    }
}
