//! Mutational fuzzing of every parser that bytes from the network (or the config file) reach,
//! on stable Rust and without a server.
//!
//! Each target starts from its committed seed corpus (`tests/fuzz/corpus/<corpus>/`: real
//! traffic shapes, and every input that ever crashed a parser), mutates it (bit flips, byte
//! inserts and deletes, splices, dictionary tokens, corrupted length fields) and feeds each
//! input to the parser, checking that it neither panics nor hangs and that the target's
//! invariants hold. Inputs whose outcome is new to the run join the pool that later inputs are
//! mutated from: a cheap stand-in for coverage guidance.
//!
//! A normal test run tries a few thousand inputs per target. `PGMEMO_FUZZ_ITERATIONS=N` sets
//! the count for long runs (`cargo test --release --test fuzz` with `-- --nocapture` prints
//! the rate) and `PGMEMO_FUZZ_SEED=S` replays a run. A failing input is written to
//! `target/fuzz-crashes/<target>/`; once fixed, it belongs in the corpus.

#[path = "fuzz/harness.rs"]
mod harness;

use bytes::BytesMut;
use harness::{fuzz, Outcome};
use pgmemo::auth::{ScramServer, ScramVerifier, Secret};
use pgmemo::protocol::frontend::{self as fe, Bind, Execute, Parse, Target};
use pgmemo::protocol::startup::{self, StartupPacket};
use pgmemo::protocol::{frame, DEFAULT_MAX_MESSAGE_SIZE};
use pgmemo::query::hint::{self, Hint};
use pgmemo::query::lexer::{generalize, rebuild, Kind, Lexed};
use pgmemo::query::parameters::{decide, Decision};

const PROTOCOL: &[&[u8]] = &[
    b"\0",
    b"P",
    b"B",
    b"D",
    b"E",
    b"C",
    b"S",
    b"H",
    b"X",
    b"Q",
    b"p",
    b"d",
    b"c",
    b"f",
    b"F",
    b"user\0",
    b"database\0",
    b"options\0",
    b"-c app.x=1 --search_path=a\\ b\0",
    b"_pq_.x\0",
    b"application_name\0",
    b"SCRAM-SHA-256\0",
    b"\x00\x03\x00\x00",
    b"\x04\xd2\x16\x2f",
    b"\x04\xd2\x16\x30",
    b"\x04\xd2\x16\x2e",
];

const SQL: &[&[u8]] = &[
    b"'",
    b"''",
    b"\"",
    b"$$",
    b"$a$",
    b"$1",
    b"E'",
    b"e'\\'",
    b"\\x41",
    b"\\u00e9",
    b"U&'",
    b"U&\"",
    b" UESCAPE '!'",
    b"B'",
    b"X'",
    b"N'",
    b"/*",
    b"*/",
    b"--",
    b"\n",
    b"\\",
    b"::",
    b"1e10",
    b".5",
    b"0x1F",
    b"0b101",
    b"0o17",
    b"1_000",
    b"-",
    b"+",
    b";",
    b"(",
    b")",
    b",",
    b"SELECT ",
    b"INSERT INTO t VALUES (",
    b" INTO ",
    b"WITH x AS (",
    b"SET app.x = ",
    b"set_config('a.b', ",
    b"RESET ALL",
    b"DISCARD ALL",
    b"LOAD ",
    b"/* pgmemo cache ttl=5s */",
    b"/*pgmemo='cache%20ttl%3D5s',traceparent='00-1-2-01'*/",
    b"-- pgmemo nocache\n",
    b"pgmemo=",
    b" pgmemo ",
    b"nocache",
    b"ttl=",
    b"\xc3\xa9",
    b"\xff",
    b"\0",
];

const SCRAM: &[&[u8]] = &[
    b"n,,",
    b"y,,",
    b"p=tls-server-end-point,,",
    b"n=",
    b"r=",
    b"c=biws",
    b"c=eSws",
    b"p=",
    b"=2C",
    b"=3D",
    b",",
    b"=",
    b"a=",
    b"m=",
    b"x=",
    b"@@NONCE@@",
];

const TOML: &[&[u8]] = &[
    b"[cache]\n",
    b"[[cache.rules]]\n",
    b"[databases.x]\n",
    b"[users.u]\n",
    b"[general]\n",
    b" = ",
    b"\"",
    b"'''",
    b"\n",
    b"ttl = \"5s\"\n",
    b"1e400",
    b"-1",
    b"9223372036854775807",
    b"nan",
    b"inf",
    b"true",
    b"[",
    b"]",
    b"{",
    b"}",
    b"query_contains = \"x\"\n",
    b"query_hash = ",
    b"url = \"postgresql://u:p@h:1/d?sslmode=require\"\n",
    b"password = \"SCRAM-SHA-256$",
    b"md5",
];

/// The startup packet and the special requests that share its framing, fed as a connection's
/// first bytes.
#[test]
fn startup_packet() {
    fuzz("startup", "startup", PROTOCOL, 200_000, |buf| {
        let len = match startup::frame(buf) {
            Ok(None) => return Outcome::of(0, buf.len().min(8)),
            Err(e) => {
                let declared = u32::from_be_bytes(buf[..4].try_into().unwrap()) as usize;
                assert!(!(8..=startup::MAX_STARTUP_FRAME).contains(&declared));
                return Outcome::of(1, e.to_string().len());
            }
            Ok(Some(len)) => len,
        };
        assert!((8..=startup::MAX_STARTUP_FRAME).contains(&len) && len <= buf.len());
        assert_eq!(
            len,
            u32::from_be_bytes(buf[..4].try_into().unwrap()) as usize
        );
        match startup::parse(&buf[..len]) {
            Ok(StartupPacket::Startup { minor, params, .. }) => {
                for (key, value) in &params {
                    if key == "options" {
                        let _ = pgmemo::params::parse_options(value);
                    }
                }
                // What pgmemo writes to a server reads back as the same parameters.
                let clean = params
                    .iter()
                    .all(|(k, v)| !k.is_empty() && !k.contains('\0') && !v.contains('\0'));
                if minor == 0 && clean {
                    let pairs: Vec<(&str, &str)> = params
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect();
                    let mut out = BytesMut::new();
                    fe::startup(&mut out, &pairs);
                    let again = startup::frame(&out).ok().flatten();
                    if out.len() <= startup::MAX_STARTUP_FRAME {
                        assert_eq!(again, Some(out.len()));
                        assert_eq!(
                            startup::parse(&out),
                            Ok(StartupPacket::Startup {
                                minor,
                                params: params.clone(),
                                well_formed: true,
                            })
                        );
                    }
                }
                Outcome::of(2, params.len())
            }
            Ok(other) => Outcome::of(3, format!("{other:?}").len()),
            Err(e) => Outcome::of(4, e.to_string().len()),
        }
    });
}

/// A stream of frontend messages after startup: framing with the per-type limits, every view
/// pgmemo takes of a message, and the cache's reading of an extended-protocol batch.
#[test]
fn frontend_messages() {
    fuzz("frontend", "frontend", PROTOCOL, 200_000, |buf| {
        let mut at = 0;
        let mut outcome = Outcome::default();
        if let Some(batch) = pgmemo::cache::batch(buf) {
            assert!(batch.len <= buf.len());
            outcome.add(99, batch.describe as usize);
        }
        loop {
            let rest = &buf[at..];
            let tag = rest.first().copied().unwrap_or(0);
            let max = fe::max_message_len(tag, DEFAULT_MAX_MESSAGE_SIZE);
            let (tag, len) = match frame(rest, max) {
                Ok(Some(found)) => found,
                Ok(None) => {
                    outcome.add(0, rest.len().min(5));
                    break;
                }
                Err(_) => {
                    let declared = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
                    assert!(!(4..=max).contains(&declared));
                    outcome.add(1, 0);
                    break;
                }
            };
            // The declared length is honoured: the message is exactly its length field + 1.
            assert_eq!(
                len,
                u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize + 1
            );
            assert!(len <= rest.len() && len <= max + 1);
            let body = &rest[5..len];
            at += len;
            outcome.add(tag as usize, message(tag, body));
        }
        outcome
    });
}

/// Reads one message body as pgmemo would; what it found, for the outcome.
fn message(tag: u8, body: &[u8]) -> usize {
    match tag {
        fe::PARSE => match Parse::parse(body) {
            Some(p) => {
                // Rebuilt under another name, it reads back the same.
                let mut out = BytesMut::new();
                p.encode(b"renamed", &mut out);
                let (_, len) = frame(&out, usize::MAX).unwrap().unwrap();
                assert_eq!(len, out.len());
                let again = Parse::parse(&out[5..]).expect("a rebuilt Parse reads back");
                assert_eq!(again.name, b"renamed");
                assert_eq!((again.query, again.param_types), (p.query, p.param_types));
                1 + (p.param_types.len() - 2) / 4
            }
            None => 0,
        },
        fe::BIND => Bind::parse(body).map_or(0, |b| 1 + b.rest.len().min(8)),
        fe::DESCRIBE | fe::CLOSE => Target::parse(body).map_or(0, |t| t.kind as usize),
        fe::EXECUTE => Execute::parse(body).map_or(0, |e| 1 + (e.max_rows == 0) as usize),
        fe::QUERY => match fe::query_text(body) {
            Some(text) => {
                assert!(!text.contains(&0));
                let found = pgmemo::query::words::in_query(text);
                let _ = pgmemo::query::facts::touch_found(found, text);
                1 + (found.count_ones() as usize)
            }
            None => 0,
        },
        fe::PASSWORD => match fe::parse_sasl_initial(body) {
            Ok((mechanism, data)) => 1 + mechanism.len().min(16) + data.len().min(4),
            Err(e) => 100 + e.message.len(),
        },
        tag => fe::is_known(tag) as usize,
    }
}

/// The server side of SCRAM-SHA-256: the client-first message, then (after a NUL in the
/// input) the client-final one, where `@@NONCE@@` stands for the nonce the server chose so
/// that mutations get past the nonce check.
#[test]
fn scram_exchange() {
    let verifier = ScramVerifier::from_password("pencil", b"0123456789abcdef", 4096);
    fuzz("scram", "scram", SCRAM, 20_000, |buf| {
        let (first, last) = match buf.iter().position(|&b| b == 0) {
            Some(at) => (&buf[..at], Some(&buf[at + 1..])),
            None => (buf, None),
        };
        let secret = Secret::Scram(verifier.clone());
        let mut server = ScramServer::new("alice", Some(&secret));
        let server_first = match server.handle_client_first("SCRAM-SHA-256", first) {
            Ok(reply) => reply,
            Err(e) => return Outcome::of(0, format!("{e:?}").len()),
        };
        let text = std::str::from_utf8(&server_first).expect("server-first is text");
        let nonce = text
            .strip_prefix("r=")
            .and_then(|t| t.split(',').next())
            .expect("server-first starts with the nonce");
        let Some(last) = last else {
            return Outcome::of(1, nonce.len());
        };
        let last = harness::replace(last, b"@@NONCE@@", nonce.as_bytes());
        match server.handle_client_final(&last) {
            Ok(reply) => Outcome::of(2, reply.len()),
            Err(e) => Outcome::of(3, format!("{e:?}").len()),
        }
    });
}

/// The lexer that generalizes simple queries: putting each parameter literal's token back in
/// place of its `$n` gives a text of the same shape with the same values.
#[test]
fn lexer() {
    let mut out = Lexed::default();
    let mut again = Lexed::default();
    fuzz("lexer", "sql", SQL, 200_000, |sql| {
        if let Err(refusal) = generalize(sql, &mut out) {
            assert!(out.text.is_empty() || refusal != pgmemo::query::lexer::Refusal::TooLarge);
            return Outcome::of(0, refusal as usize);
        }
        let params = out.parameters().count();
        assert_eq!(params, out.params);
        let mut end = 0;
        let mut gen_end = 0;
        for l in &out.literals {
            assert!(l.start as usize >= end && l.start < l.end && l.end as usize <= sql.len());
            assert!(l.gen_start >= gen_end && l.gen_start <= l.gen_end);
            assert!(l.gen_end as usize <= out.text.len());
            assert!(l.position <= l.end_position);
            end = l.end as usize;
            gen_end = l.gen_end;
        }
        let rebuilt = rebuild(sql, &out);
        generalize(&rebuilt, &mut again).unwrap_or_else(|e| {
            panic!(
                "{:?} rebuilt as {:?} is refused: {e:?}",
                String::from_utf8_lossy(sql),
                String::from_utf8_lossy(&rebuilt)
            )
        });
        assert_eq!(
            again.text,
            out.text,
            "rebuilt as {:?}",
            String::from_utf8_lossy(&rebuilt)
        );
        assert_eq!(again.shape, out.shape);
        let values = |x: &Lexed| -> Vec<(Kind, Vec<u8>)> {
            x.parameters()
                .map(|l| (l.kind, x.value(l).to_vec()))
                .collect()
        };
        assert_eq!(values(&again), values(&out));
        Outcome::of(
            1 + params.min(8),
            out.literals.len().min(8) + 8 * out.comments.len().min(4),
        )
    });
}

/// Shape analysis (PostgreSQL's parser) of what the lexer generalized: one form per literal.
#[test]
fn shape() {
    let mut out = Lexed::default();
    fuzz("shape", "sql", SQL, 20_000, |sql| {
        if generalize(sql, &mut out).is_err() {
            return Outcome::of(0, 0);
        }
        let Ok(text) = std::str::from_utf8(sql) else {
            return Outcome::of(1, 0);
        };
        match decide(text, &out.literals) {
            Decision::Never(never) => Outcome::of(2, never as usize),
            Decision::Generalize { forms, modifies } => {
                assert_eq!(forms.len(), out.literals.len());
                Outcome::of(3 + modifies as usize, forms.len().min(8))
            }
        }
    });
}

/// Cache hints in any comment: the lexer's comments are in the text and are comments, and
/// what they say is read without panicking, as a statement's text too.
#[test]
fn hints() {
    let mut out = Lexed::default();
    fuzz("hint", "hint", SQL, 200_000, |sql| {
        let hints = match generalize(sql, &mut out) {
            Ok(()) => {
                for &(start, end) in &out.comment_spans {
                    let comment = &sql[start as usize..end as usize];
                    assert!(
                        comment.starts_with(b"/*") || comment.starts_with(b"--"),
                        "{:?}",
                        String::from_utf8_lossy(sql)
                    );
                }
                hint::read(sql, &out.comment_spans)
            }
            Err(_) => hint::read_statement(sql),
        };
        if let Some(Hint::Cache { ttl: Some(ttl) }) = hints.hint {
            assert!(ttl.as_secs() <= 366 * 24 * 3600);
        }
        Outcome::of(
            match hints.hint {
                None => 0,
                Some(Hint::NoCache) => 1,
                Some(Hint::Cache { ttl: None }) => 2,
                Some(Hint::Cache { ttl: Some(_) }) => 3,
            },
            hints.malformed.map_or(0, |m| m as usize + 1),
        )
    });
}

/// The result cache's statement analysis (PostgreSQL's parser) of a query's text.
#[test]
fn analysis() {
    fuzz("analysis", "sql", SQL, 20_000, |sql| {
        let text = String::from_utf8_lossy(sql);
        let analysis = pgmemo::query::analysis::analyze(&text);
        let e = &analysis.effects;
        let mut outcome = Outcome::of(
            e.writes.len().min(4) + 4 * e.calls.len().min(4) + 16 * e.reads.len().min(4),
            e.session_state as usize + 2 * e.temp as usize + 4 * e.drops_temp as usize,
        );
        let read = format!("{:?}", analysis.read.as_ref().err());
        outcome.add(read.len(), e.changes_data() as usize);
        outcome
    });
}

/// Session state: the words that make pgmemo look closer, and the custom settings a text
/// sets (PostgreSQL's parser, under both settings of standard_conforming_strings).
#[test]
fn session_state() {
    fuzz("state", "sql", SQL, 20_000, |sql| {
        let found = pgmemo::query::words::in_query(sql);
        let touch = pgmemo::query::facts::touch(sql);
        let mut outcome = Outcome::of(found.count_ones() as usize, format!("{touch:?}").len());
        for standard in [true, false] {
            let custom = pgmemo::query::facts::custom_settings(sql, standard);
            for name in &custom.names {
                assert_eq!(
                    name.to_ascii_lowercase(),
                    **name,
                    "names are folded as PostgreSQL does"
                );
            }
            outcome.add(custom.names.len().min(4), custom.unnamed as usize);
        }
        outcome
    });
}

/// TOML configuration loading, cache rules included; a loaded rule is matched against text.
#[test]
fn config() {
    fuzz("config", "config", TOML, 20_000, |toml| {
        let text = String::from_utf8_lossy(toml);
        match pgmemo::config::Config::from_toml_str(&text) {
            Ok(config) => {
                config.validate().expect("a loaded config stays valid");
                for rule in &config.cache.rules {
                    let _ = rule.matches("app", "alice", "SELECT 1", 0);
                }
                Outcome::of(
                    1,
                    config.cache.rules.len().min(4) + 4 * config.users.len().min(4),
                )
            }
            Err(e) => Outcome::of(0, e.to_string().len()),
        }
    });
}
