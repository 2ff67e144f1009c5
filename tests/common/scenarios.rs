//! Reusable differential scripts covering the corners of the protocol a proxy can get wrong.
//!
//! Each scenario is self-contained: it creates what it needs (temp tables, temp functions,
//! named statements on its own connection), so scenarios do not depend on each other and may
//! run concurrently. They run as `pgmemo` in `pgmemo_test` and are deterministic against
//! PostgreSQL itself; `harness_selftest.rs` proves that by running each twice.

use super::differential::Step::{self, Expect, RecvN, Send};
use super::raw::Frontend as F;

/// All scenarios as (name, script).
pub fn scenarios() -> Vec<(&'static str, Vec<Step>)> {
    vec![
        ("simple_queries", simple_queries()),
        ("multi_statement_error", multi_statement_error()),
        ("transaction_error_rollback", transaction_error_rollback()),
        ("extended_pipeline_unnamed", extended_pipeline_unnamed()),
        ("unnamed_parse_again", unnamed_parse_again()),
        (
            "pipeline_error_skips_to_sync",
            pipeline_error_skips_to_sync(),
        ),
        ("flush_without_sync", flush_without_sync()),
        ("portal_suspended", portal_suspended()),
        ("copy_in_simple", copy_in_simple()),
        ("copy_in_extended", copy_in_extended()),
        ("copy_in_extended_early_sync", copy_in_extended_early_sync()),
        ("copy_out", copy_out()),
        ("copy_fail", copy_fail()),
        ("empty_query", empty_query()),
        ("notices", notices()),
        ("large_values", large_values()),
        ("binary_formats", binary_formats()),
        ("named_statements", named_statements()),
        ("function_call", function_call()),
        ("listen_notify", listen_notify()),
    ]
}

/// A simple query and the one ReadyForQuery it ends with.
fn q(sql: &str) -> [Step; 2] {
    [Send(vec![F::query(sql)]), Expect(1)]
}

/// Simple queries of every shape: several columns and types, several rows, a SET that
/// reports a ParameterStatus, a table's column descriptions, a constraint violation.
fn simple_queries() -> Vec<Step> {
    [
        q("SELECT 1 AS one, 'two'::text AS two, NULL::int AS three, 1.5::numeric AS four"),
        q("SELECT g AS n, g * 2 AS doubled FROM generate_series(1, 3) AS g"),
        q("SET application_name = 'pgmemo scenario'"),
        q("SHOW application_name"),
        q("CREATE TEMP TABLE simple_t (id int PRIMARY KEY, v text)"),
        q("INSERT INTO simple_t VALUES (1, 'a'), (2, NULL) RETURNING *"),
        q("SELECT * FROM simple_t ORDER BY id"),
        q("INSERT INTO simple_t VALUES (1, 'duplicate')"),
        q("SELECT 'ünïcödé' AS text, E'tab\\there' AS escaped"),
    ]
    .concat()
}

/// Several statements in one Query: an error stops the rest and rolls back the implicit
/// transaction, and a syntax error rejects the whole string before anything runs.
fn multi_statement_error() -> Vec<Step> {
    [
        q("SELECT 1 AS a; SELECT 1/0 AS b; SELECT 3 AS c"),
        q(
            "CREATE TEMP TABLE multi_t (a int); INSERT INTO multi_t VALUES (1); \
           SELECT 1/0; INSERT INTO multi_t VALUES (2)",
        ),
        q("SELECT count(*) FROM multi_t"),
        q("SELECT 1; BEGIN; SELECT 2; COMMIT; SELECT 3"),
        q("SELECT 1; SELEC 2; SELECT 3"),
    ]
    .concat()
}

/// Errors inside a transaction block: the block is aborted (status E) until ROLLBACK, a
/// savepoint recovers, and COMMIT of an aborted block reports ROLLBACK.
fn transaction_error_rollback() -> Vec<Step> {
    [
        q("BEGIN"),
        q("CREATE TEMP TABLE tx_t (a int)"),
        q("INSERT INTO tx_t VALUES (1)"),
        q("SAVEPOINT s1"),
        q("INSERT INTO tx_t VALUES ('not a number')"),
        q("ROLLBACK TO SAVEPOINT s1"),
        q("SELECT a FROM tx_t"),
        q("SELECT 1/0"),
        q("SELECT 1"),
        q("ROLLBACK"),
        q("SELECT to_regclass('pg_temp.tx_t') IS NULL AS gone"),
        q("BEGIN"),
        q("SELECT 1/0"),
        q("COMMIT"),
    ]
    .concat()
}

/// A driver's Parse of its unnamed statement before every execution, the same text again
/// (pgmemo answers it without the stages when the session is idle, see `session::lane`):
/// again and again, with a Bind that fails, after a SET that a server must be brought in
/// line with, alone or described in a batch that needs no server, pipelined behind another
/// batch, inside a transaction block and an aborted one, after DISCARD ALL.
fn unnamed_parse_again() -> Vec<Step> {
    let sql = "SELECT $1::int * 2 AS twice, current_setting('application_name') AS app";
    let batch = |value: &'static str| {
        vec![
            F::parse("", sql, &[]),
            F::bind("", "", &[Some(value)]),
            F::describe_portal(""),
            F::execute("", 0),
            F::Sync,
        ]
    };
    let once = |value: &'static str| [Send(batch(value)), Expect(1)];
    [
        &once("21")[..],
        &once("1"),
        &once("x"),
        &once("2"),
        &q("SET application_name = 'parse again'"),
        &once("3"),
        &[Send(vec![F::parse("", sql, &[]), F::Sync]), Expect(1)],
        &[
            Send(vec![
                F::parse("", sql, &[]),
                F::describe_statement(""),
                F::Sync,
            ]),
            Expect(1),
        ],
        &[Send([batch("4"), batch("5")].concat()), Expect(2)],
        &q("BEGIN"),
        &once("6"),
        &once("7"),
        &q("SELECT 1/0"),
        &once("8"),
        &q("ROLLBACK"),
        &once("9"),
        &q("DISCARD ALL"),
        &once("10"),
        &once("11"),
    ]
    .concat()
}

/// Extended-protocol pipelines using the unnamed statement and portal, several Syncs in
/// one write, rebinding the unnamed statement after a Sync, and DDL + DML in one pipeline.
fn extended_pipeline_unnamed() -> Vec<Step> {
    vec![
        Send(vec![
            F::parse("", "SELECT $1::int + 1 AS answer", &[]),
            F::bind("", "", &[Some("41")]),
            F::describe_portal(""),
            F::execute("", 0),
            F::Sync,
            F::parse("", "SELECT $1::text AS greeting", &[]),
            F::describe_statement(""),
            F::bind("", "", &[Some("hello")]),
            F::execute("", 0),
            F::Sync,
            F::bind("", "", &[Some("again")]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(3),
        Send(vec![
            F::parse("", "CREATE TEMP TABLE pipe_t (a int)", &[]),
            F::bind("", "", &[]),
            F::execute("", 0),
            F::parse(
                "",
                "INSERT INTO pipe_t SELECT generate_series(1, $1::int)",
                &[],
            ),
            F::bind("", "", &[Some("3")]),
            F::execute("", 0),
            F::parse("", "SELECT sum(a) AS total FROM pipe_t", &[]),
            F::bind("", "", &[]),
            F::describe_portal(""),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
        Send(vec![
            F::parse("", "SELECT $1::int AS maybe", &[]),
            F::bind("", "", &[None]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
        // A Bind with the wrong number of values: PostgreSQL's error names the statement,
        // `""` (pgmemo sent it under its own name); then the statement bound again alone.
        Send(vec![
            F::parse("", "SELECT $1::int AS one_value", &[]),
            F::bind("", "", &[]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
        Send(vec![
            F::bind("", "", &[Some("1"), Some("2")]),
            F::execute("", 0),
            F::Sync,
            F::bind("", "", &[Some("1")]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(2),
    ]
}

/// An error mid-pipeline discards everything up to the next Sync, which still answers;
/// errors at Parse and at Bind; an error in an explicit transaction keeps it aborted across
/// Syncs.
fn pipeline_error_skips_to_sync() -> Vec<Step> {
    let mut steps = vec![
        Send(vec![
            F::parse("", "SELECT 1 AS first", &[]),
            F::bind("", "", &[]),
            F::execute("", 0),
            F::parse("", "SELECT 1 / $1::int AS boom", &[]),
            F::bind("", "", &[Some("0")]),
            F::execute("", 0),
            F::parse("", "SELECT 2 AS skipped", &[]),
            F::bind("", "", &[]),
            F::execute("", 0),
            F::Sync,
            F::parse("", "SELECT 3 AS after_sync", &[]),
            F::bind("", "", &[]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(2),
        Send(vec![
            F::parse("", "SELEC oops", &[]),
            F::bind("", "", &[]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
        Send(vec![
            F::bind("", "no_such_statement", &[]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
        Send(vec![
            F::parse("", "SELECT $1::int AS wrong_arity", &[]),
            F::bind("", "", &[Some("1"), Some("2")]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
    ];
    steps.extend(q("BEGIN"));
    steps.extend([
        Send(vec![
            F::parse("", "SELECT 1 / 0 AS boom", &[]),
            F::bind("", "", &[]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
        Send(vec![
            F::parse("", "SELECT 1 AS still_aborted", &[]),
            F::bind("", "", &[]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
    ]);
    steps.extend(q("ROLLBACK"));
    steps
}

/// Flush asks for replies without ending the pipeline: no ReadyForQuery comes until Sync,
/// and an error after a Flush is reported at once but still skips to the Sync.
fn flush_without_sync() -> Vec<Step> {
    vec![
        Send(vec![
            F::parse("flush_s", "SELECT $1::int AS x", &[]),
            F::describe_statement("flush_s"),
            F::Flush,
        ]),
        RecvN(3),
        Send(vec![
            F::bind("", "flush_s", &[Some("7")]),
            F::execute("", 0),
            F::Flush,
        ]),
        RecvN(3),
        Send(vec![F::Sync]),
        Expect(1),
        Send(vec![F::close_statement("flush_s"), F::Flush]),
        RecvN(1),
        Send(vec![F::parse("", "SELEC 1", &[]), F::Flush]),
        RecvN(1),
        Send(vec![F::bind("", "", &[]), F::execute("", 0), F::Sync]),
        Expect(1),
    ]
}

/// Execute with a row limit suspends the portal (PortalSuspended); a named portal survives
/// Sync inside BEGIN and resumes where it stopped, but dies at the Sync that ends an
/// implicit transaction.
fn portal_suspended() -> Vec<Step> {
    let mut steps = q("BEGIN").to_vec();
    steps.extend([
        Send(vec![
            F::parse("", "SELECT g FROM generate_series(1, 5) AS g", &[]),
            F::bind("cur", "", &[]),
            F::describe_portal("cur"),
            F::execute("cur", 2),
            F::execute("cur", 2),
            F::Sync,
        ]),
        Expect(1),
        Send(vec![F::execute("cur", 2), F::execute("cur", 2), F::Sync]),
        Expect(1),
        Send(vec![F::close_portal("cur"), F::execute("cur", 1), F::Sync]),
        Expect(1),
    ]);
    steps.extend(q("ROLLBACK"));
    steps.extend([
        Send(vec![
            F::parse("susp_s", "SELECT g FROM generate_series(1, 3) AS g", &[]),
            F::bind("implicit_cur", "susp_s", &[]),
            F::execute("implicit_cur", 1),
            F::Sync,
        ]),
        Expect(1),
        Send(vec![F::execute("implicit_cur", 1), F::Sync]),
        Expect(1),
    ]);
    steps
}

/// COPY FROM STDIN by simple query, with a bad row as well.
fn copy_in_simple() -> Vec<Step> {
    [
        &q("CREATE TEMP TABLE copy_in_t (a int, b text)")[..],
        &[
            Send(vec![F::query("COPY copy_in_t FROM STDIN")]),
            RecvN(1),
            Send(vec![
                F::copy_data(b"1\tone\n"),
                F::copy_data(b"2\ttwo\n3\t"),
                F::copy_data(b"three\n"),
                F::CopyDone,
            ]),
            Expect(1),
        ],
        &q("SELECT * FROM copy_in_t ORDER BY a"),
        &[
            Send(vec![F::query("COPY copy_in_t FROM STDIN")]),
            RecvN(1),
            Send(vec![F::copy_data(b"4\tfour\nfive\t5\n"), F::CopyDone]),
            Expect(1),
        ],
        &q("SELECT count(*) FROM copy_in_t"),
    ]
    .concat()
}

/// COPY FROM STDIN by the extended protocol, Flush before the data, Sync after CopyDone.
fn copy_in_extended() -> Vec<Step> {
    let mut steps = q("CREATE TEMP TABLE copy_ext_t (a int, b text)").to_vec();
    steps.extend([
        Send(vec![
            F::parse("", "COPY copy_ext_t FROM STDIN WITH (FORMAT csv)", &[]),
            F::bind("", "", &[]),
            F::execute("", 0),
            F::Flush,
        ]),
        RecvN(3),
        Send(vec![
            F::copy_data(b"1,one\n2,\"two, quoted\"\n"),
            F::CopyDone,
            F::Sync,
        ]),
        Expect(1),
    ]);
    steps.extend(q("SELECT * FROM copy_ext_t ORDER BY a"));
    steps
}

/// Like drivers do, Sync is sent right after Execute of a COPY FROM STDIN: the server
/// ignores Sync and Flush in copy-in mode, so only the Sync after CopyDone is answered. A
/// proxy that counts the first Sync waits for a ReadyForQuery that never comes.
fn copy_in_extended_early_sync() -> Vec<Step> {
    let mut steps = q("CREATE TEMP TABLE copy_sync_t (a int)").to_vec();
    steps.extend([
        Send(vec![
            F::parse("", "COPY copy_sync_t FROM STDIN", &[]),
            F::bind("", "", &[]),
            F::execute("", 0),
            F::Sync,
        ]),
        RecvN(3),
        Send(vec![
            F::copy_data(b"10\n20\n"),
            F::Flush,
            F::Sync,
            F::copy_data(b"30\n"),
            F::CopyDone,
            F::Sync,
        ]),
        Expect(1),
    ]);
    steps.extend(q("SELECT sum(a) FROM copy_sync_t"));
    steps
}

/// COPY TO STDOUT by simple query (text and binary) and by the extended protocol.
fn copy_out() -> Vec<Step> {
    let mut steps = [
        q("COPY (SELECT g, 'row ' || g FROM generate_series(1, 3) AS g) TO STDOUT"),
        q("COPY (SELECT g FROM generate_series(1, 2) AS g) TO STDOUT WITH (FORMAT binary)"),
        q("COPY (SELECT 1 WHERE false) TO STDOUT"),
    ]
    .concat();
    steps.extend([
        Send(vec![
            F::parse(
                "",
                "COPY (SELECT 'a' AS x UNION ALL SELECT 'b') TO STDOUT",
                &[],
            ),
            F::bind("", "", &[]),
            F::describe_portal(""),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
    ]);
    steps
}

/// Aborting COPY FROM STDIN with CopyFail, by simple query and by the extended protocol
/// (where the server then discards messages until Sync).
fn copy_fail() -> Vec<Step> {
    let mut steps = q("CREATE TEMP TABLE copy_fail_t (a int)").to_vec();
    steps.extend([
        Send(vec![F::query("COPY copy_fail_t FROM STDIN")]),
        RecvN(1),
        Send(vec![
            F::copy_data(b"1\n"),
            F::CopyFail("client gave up".to_string()),
        ]),
        Expect(1),
        Send(vec![
            F::parse("", "COPY copy_fail_t FROM STDIN", &[]),
            F::bind("", "", &[]),
            F::execute("", 0),
            F::Flush,
        ]),
        RecvN(3),
        Send(vec![
            F::copy_data(b"2\n"),
            F::CopyFail("extended client gave up".to_string()),
            F::parse("", "SELECT 'discarded' AS never", &[]),
            F::bind("", "", &[]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
    ]);
    steps.extend(q("SELECT count(*) FROM copy_fail_t"));
    steps
}

/// Empty queries answer EmptyQueryResponse, by simple query and by the extended protocol.
fn empty_query() -> Vec<Step> {
    let mut steps = [q(""), q(";"), q("  -- only a comment"), q("SELECT 1;;")].concat();
    steps.extend([
        Send(vec![
            F::parse("", "", &[]),
            F::bind("", "", &[]),
            F::describe_portal(""),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
    ]);
    steps
}

/// NoticeResponse and WARNING from PL/pgSQL, by simple query and by the extended protocol,
/// and client_min_messages suppressing them.
fn notices() -> Vec<Step> {
    let mut steps = [
        q("DO $$ BEGIN RAISE NOTICE 'hello %', 42; END $$"),
        q(
            "DO $$ BEGIN RAISE WARNING 'careful'; RAISE NOTICE 'second' USING DETAIL = 'd', \
           HINT = 'h'; END $$",
        ),
        q(
            "CREATE FUNCTION pg_temp.noisy(n int) RETURNS int LANGUAGE plpgsql AS \
           $$ BEGIN RAISE NOTICE 'noisy %', n; RETURN n; END $$",
        ),
    ]
    .concat();
    steps.extend([
        Send(vec![
            F::parse(
                "",
                "SELECT pg_temp.noisy(g) FROM generate_series(1, 2) AS g",
                &[],
            ),
            F::bind("", "", &[]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
    ]);
    steps.extend(q("SET client_min_messages = warning"));
    steps.extend(q("SELECT pg_temp.noisy(3)"));
    steps
}

/// A 20 MB row by simple query, and a 5 MB parameter by the extended protocol, to catch
/// buffering limits and partial reads and writes.
fn large_values() -> Vec<Step> {
    let big = "y".repeat(5_000_000);
    let mut steps = q("SELECT repeat('x', 20000000) AS big").to_vec();
    steps.extend([
        Send(vec![
            F::parse(
                "",
                "SELECT length($1::text) AS len, md5($1::text) AS sum, $1 AS echo",
                &[25],
            ),
            F::bind("", "", &[Some(&big)]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
    ]);
    steps
}

/// Binary parameter and result formats: all binary, per column, a binary NULL, and a
/// binary value of the wrong length.
fn binary_formats() -> Vec<Step> {
    let sql = "SELECT $1::int4 AS i, $2::text AS t, $3::int8 AS b, $4::bytea AS raw";
    let params = vec![
        Some(7i32.to_be_bytes().to_vec()),
        Some(b"seven".to_vec()),
        Some((1i64 << 40).to_be_bytes().to_vec()),
        Some(vec![0, 1, 2, 255]),
    ];
    let bind = |result_formats: Vec<i16>| F::Bind {
        portal: String::new(),
        statement: "bin_s".to_string(),
        param_formats: vec![1, 0, 1, 1],
        params: params.clone(),
        result_formats,
    };
    vec![
        Send(vec![
            F::parse("bin_s", sql, &[23, 25, 20, 17]),
            bind(vec![1]),
            F::describe_portal(""),
            F::execute("", 0),
            bind(vec![0, 1, 0, 1]),
            F::describe_portal(""),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
        Send(vec![
            F::parse("", "SELECT $1::int4 + 1 AS n", &[23]),
            F::Bind {
                portal: String::new(),
                statement: String::new(),
                param_formats: vec![1],
                params: vec![None],
                result_formats: vec![1],
            },
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
        Send(vec![
            F::parse("", "SELECT $1::int4 AS n", &[23]),
            F::Bind {
                portal: String::new(),
                statement: String::new(),
                param_formats: vec![1],
                params: vec![Some(vec![0, 0, 0, 1, 0])],
                result_formats: vec![],
            },
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
    ]
}

/// Named prepared statements: Describe of statement and portal, reuse across Syncs and
/// portals, a duplicate name, Close, and use after Close.
fn named_statements() -> Vec<Step> {
    vec![
        Send(vec![
            F::parse(
                "stmt_a",
                "SELECT $1::int * 2 AS doubled, $2::text AS label",
                &[],
            ),
            F::describe_statement("stmt_a"),
            F::Sync,
        ]),
        Expect(1),
        Send(vec![
            F::bind("portal_a", "stmt_a", &[Some("21"), Some("first")]),
            F::describe_portal("portal_a"),
            F::execute("portal_a", 0),
            F::bind("", "stmt_a", &[Some("50"), Some("second")]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
        Send(vec![
            F::parse("stmt_b", "SELECT 'b' AS which", &[]),
            F::parse("stmt_a", "SELECT 'again' AS dup", &[]),
            F::Sync,
        ]),
        Expect(1),
        // A Bind with a value too many: PostgreSQL's error names the client's statement.
        Send(vec![
            F::bind("", "stmt_b", &[Some("extra")]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
        Send(vec![
            F::bind("", "stmt_b", &[]),
            F::execute("", 0),
            F::close_statement("stmt_a"),
            F::close_statement("never_existed"),
            F::Sync,
        ]),
        Expect(1),
        Send(vec![F::describe_statement("stmt_a"), F::Sync]),
        Expect(1),
        Send(vec![
            F::bind("", "stmt_a", &[Some("1"), Some("x")]),
            F::execute("", 0),
            F::Sync,
        ]),
        Expect(1),
        Send(vec![F::describe_portal("no_such_portal"), F::Sync]),
        Expect(1),
    ]
}

/// The fast-path function call interface (`int4pl`, OID 177), binary and text, and an
/// unknown function.
fn function_call() -> Vec<Step> {
    vec![
        Send(vec![F::FunctionCall {
            function_oid: 177,
            arg_formats: vec![1],
            args: vec![
                Some(2i32.to_be_bytes().to_vec()),
                Some(3i32.to_be_bytes().to_vec()),
            ],
            result_format: 1,
        }]),
        Expect(1),
        Send(vec![F::FunctionCall {
            function_oid: 177,
            arg_formats: vec![],
            args: vec![Some(b"40".to_vec()), Some(b"2".to_vec())],
            result_format: 0,
        }]),
        Expect(1),
        Send(vec![F::FunctionCall {
            function_oid: 4_000_000_000,
            arg_formats: vec![],
            args: vec![],
            result_format: 0,
        }]),
        Expect(1),
    ]
}

/// LISTEN/NOTIFY on one connection: the notification (with the sender's pid) arrives
/// before ReadyForQuery. Session state, so it needs session pooling through a pooler.
fn listen_notify() -> Vec<Step> {
    [
        q("LISTEN pgmemo_scenario_channel"),
        q("NOTIFY pgmemo_scenario_channel, 'hello'"),
        q("SELECT pg_notify('pgmemo_scenario_channel', 'from a function')"),
        q("UNLISTEN *"),
        q("NOTIFY pgmemo_scenario_channel, 'unheard'"),
    ]
    .concat()
}
