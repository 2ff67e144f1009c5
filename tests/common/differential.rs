//! Differential testing: run one message script against several servers and compare.
//!
//! "Behave exactly like PostgreSQL" is checked by sending the same frontend messages to
//! PostgreSQL directly and through pgmemo, each on a fresh connection, and asserting that the
//! replies are the same after [`normalize`] has replaced what legitimately differs between two
//! connections. A script is a list of [`Step`]s; [`differential`] turns it into one transcript
//! per target and [`assert_same`] points at the first difference.

use std::collections::HashMap;
use std::net::SocketAddr;

use super::raw::{Backend, Frontend, RawClient, Rewrite};

/// OIDs below this (PostgreSQL's `FirstNormalObjectId`) belong to built-in objects and are the
/// same on every connection; OIDs from here on are objects the scenario created itself.
const FIRST_NORMAL_OBJECT_ID: u32 = 16384;

/// One step of a differential script.
#[derive(Debug, Clone)]
pub enum Step {
    /// Send these messages in one write.
    Send(Vec<Frontend>),
    /// Read messages up to and including this many ReadyForQuery.
    Expect(usize),
    /// Read exactly this many messages, for replies that end without ReadyForQuery (after a
    /// Flush, or the CopyInResponse that starts COPY FROM STDIN).
    RecvN(usize),
}

/// Replaces the values that legitimately differ between two connections to the same server;
/// see [`normalize`].
#[derive(Default)]
pub struct Normalizer {
    oids: HashMap<u32, usize>,
}

impl Rewrite for Normalizer {
    fn pid(&mut self, _pid: i32) -> String {
        "<pid>".to_string()
    }
    fn secret(&mut self, _key: i32) -> String {
        "<key>".to_string()
    }
    fn oid(&mut self, oid: u32) -> String {
        if oid < FIRST_NORMAL_OBJECT_ID {
            return oid.to_string();
        }
        let next = self.oids.len() + 1;
        format!("<oid{}>", self.oids.entry(oid).or_insert(next))
    }
}

impl Normalizer {
    /// Renders one message, numbering user OIDs consistently with earlier calls.
    pub fn line(&mut self, msg: &Backend) -> String {
        let line = msg.render(self);
        let line = unnumber(&line, "pg_temp_");
        unnumber(&line, "pg_toast_temp_")
    }
}

/// Replaces the digits after each occurrence of `prefix` with `<n>`: each backend has its own
/// temp schema, `pg_temp_<backend slot>`, whose number depends on what else is connected.
fn unnumber(line: &str, prefix: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(at) = rest.find(prefix) {
        let after = at + prefix.len();
        let digits = rest[after..].bytes().take_while(u8::is_ascii_digit).count();
        out.push_str(&rest[..after]);
        if digits > 0 {
            out.push_str("<n>");
        }
        rest = &rest[after + digits..];
    }
    out.push_str(rest);
    out
}

/// Renders messages one per line for `assert_eq!`, replacing exactly these values:
///
/// - BackendKeyData: the backend pid and the secret key become `<pid>` and `<key>`;
/// - NotificationResponse: the notifying backend's pid becomes `<pid>`;
/// - RowDescription (table and type OIDs) and ParameterDescription (type OIDs): OIDs of
///   objects created at run time (>= 16384, such as each connection's own temp tables and
///   their row types) become `<oid1>`, `<oid2>`, … numbered by first appearance, so the same
///   table still reads the same within a transcript. Built-in OIDs are kept.
/// - in any message, the number of a temp schema (`pg_temp_3`, `pg_toast_temp_3`) becomes
///   `<n>`, because each backend gets its own (it shows in error fields `s` and `W`).
///
/// Everything else is kept verbatim, in particular every ErrorResponse and NoticeResponse
/// field, including `F` (file), `L` (line) and `R` (routine), which are identical for the
/// same server, and all ParameterStatus values. Values longer than 256 bytes are shown as
/// their length and a 64-bit hash.
pub fn normalize(msgs: &[Backend]) -> Vec<String> {
    let mut normalizer = Normalizer::default();
    msgs.iter().map(|m| normalizer.line(m)).collect()
}

/// Runs `script` against each target on a fresh connection (as `user`, `password`, `db`) and
/// returns one normalized transcript per target, in order.
///
/// A transcript interleaves what was sent (`>> ` lines) with what was received (`<< ` lines,
/// see [`normalize`]). After the script the client sends Terminate and reads until the server
/// closes the connection, so trailing surplus messages are caught too. A failed read (end of
/// stream, timeout) is recorded as a `!! ` line and ends that target's run, so a server that
/// closes the connection early still yields a comparable transcript. Panics only when a
/// connection cannot be established at all.
pub async fn differential(
    targets: &[SocketAddr],
    user: &str,
    password: Option<&str>,
    db: &str,
    script: &[Step],
) -> Vec<Vec<String>> {
    let mut transcripts = Vec::with_capacity(targets.len());
    for &addr in targets {
        let client = RawClient::connect(addr, user, db, password, &[])
            .await
            .unwrap_or_else(|e| panic!("differential: {e:#}"));
        transcripts.push(run_script(client, script).await);
    }
    transcripts
}

/// Runs a script on an established connection and returns its transcript.
pub async fn run_script(mut client: RawClient, script: &[Step]) -> Vec<String> {
    let mut out = Vec::new();
    let mut normalizer = Normalizer::default();
    let terminate = Step::Send(vec![Frontend::Terminate]);
    for step in script.iter().chain([&terminate]) {
        let until = match step {
            Step::Send(msgs) => {
                out.extend(msgs.iter().map(|m| format!(">> {m}")));
                if client.send(msgs).await.is_err() {
                    // The OS error (broken pipe or reset) depends on timing; do not record it.
                    out.push("!! send failed".to_string());
                    return out;
                }
                continue;
            }
            Step::Expect(n) => Until::Ready(*n),
            Step::RecvN(n) => Until::Count(*n),
        };
        if !recv_logged(&mut client, &mut out, &mut normalizer, until).await {
            return out;
        }
    }
    // After Terminate the server closes the connection without a word; anything else it
    // sends first is a difference worth seeing.
    recv_logged(&mut client, &mut out, &mut normalizer, Until::Closed).await;
    out
}

/// When [`recv_logged`] stops reading.
enum Until {
    /// After this many ReadyForQuery.
    Ready(usize),
    /// After this many messages.
    Count(usize),
    /// Only when a read fails.
    Closed,
}

/// Receives until `until` is met, logging each message; on a failed read logs the error and
/// returns false.
async fn recv_logged(
    client: &mut RawClient,
    out: &mut Vec<String>,
    normalizer: &mut Normalizer,
    until: Until,
) -> bool {
    let (mut messages, mut ready) = (0, 0);
    loop {
        let done = match until {
            Until::Ready(n) => ready >= n,
            Until::Count(n) => messages >= n,
            Until::Closed => false,
        };
        if done {
            return true;
        }
        match client.recv().await {
            Ok(msg) => {
                out.push(format!("<< {}", normalizer.line(&msg)));
                messages += 1;
                ready += usize::from(msg.tag == b'Z');
            }
            Err(e) => {
                out.push(format!("!! {e:#}"));
                return false;
            }
        }
    }
}

/// Asserts that two transcripts are equal, and otherwise panics with the first difference
/// and a few lines of context before it.
pub fn assert_same(direct: &[String], proxied: &[String]) {
    if let Some(report) = diff(direct, proxied) {
        panic!("{report}");
    }
}

/// Describes the first difference between two transcripts (with up to six lines of context
/// before it), or `None` when they are equal.
pub fn diff(direct: &[String], proxied: &[String]) -> Option<String> {
    let i = (0..direct.len().max(proxied.len())).find(|&i| direct.get(i) != proxied.get(i))?;
    let mut report = format!(
        "transcripts differ at line {} (direct has {} lines, proxied {}):\n",
        i + 1,
        direct.len(),
        proxied.len()
    );
    for line in &direct[i.saturating_sub(6)..i] {
        report.push_str(&format!("           {line}\n"));
    }
    let show = |line: Option<&String>| line.map_or("<nothing>".to_string(), Clone::clone);
    report.push_str(&format!("  direct:  {}\n", show(direct.get(i))));
    report.push_str(&format!("  proxied: {}\n", show(proxied.get(i))));
    Some(report)
}

/// Asserts that every transcript equals the first (the reference).
pub fn assert_all_same(transcripts: &[Vec<String>]) {
    for other in transcripts.iter().skip(1) {
        assert_same(&transcripts[0], other);
    }
}
