//! Tests of the test harness itself, against PostgreSQL alone.
//!
//! A differential test is only as good as its determinism: if two connections to the same
//! PostgreSQL could disagree, a pgmemo test would fail for nothing. So every scenario is run
//! on two direct connections here and the transcripts must be identical; the scenarios are
//! also checked to exercise what their names promise.

mod common;

use common::*;

/// Runs every scenario twice, directly against PostgreSQL, all scenarios concurrently.
async fn run_all_twice() -> Vec<(&'static str, Vec<Vec<String>>)> {
    let addr = cluster().addr();
    let mut tasks = tokio::task::JoinSet::new();
    for (name, script) in scenarios() {
        tasks.spawn(async move {
            let transcripts = differential(
                &[addr, addr],
                PGMEMO_USER,
                Some(PGMEMO_PASS),
                TEST_DB,
                &script,
            )
            .await;
            (name, transcripts)
        });
    }
    let mut results = Vec::new();
    while let Some(result) = tasks.join_next().await {
        results.push(result.expect("scenario task panicked"));
    }
    results.sort_by_key(|(name, _)| *name);
    results
}

/// What each scenario's transcript must contain, so that a scenario cannot silently stop
/// testing what it is named after.
const MUST_CONTAIN: &[(&str, &[&str])] = &[
    (
        "simple_queries",
        &["ParameterStatus application_name=", "C=\"23505\""],
    ),
    (
        "multi_statement_error",
        &["C=\"22012\"", "C=\"42P01\"", "C=\"42601\""],
    ),
    (
        "transaction_error_rollback",
        &[
            "ReadyForQuery E",
            "C=\"25P02\"",
            "CommandComplete \"ROLLBACK\"",
        ],
    ),
    (
        "extended_pipeline_unnamed",
        &[
            "ParameterDescription [25]",
            "DataRow [\"again\"]",
            "DataRow [NULL]",
        ],
    ),
    (
        "unnamed_parse_again",
        &[
            "DataRow [\"42\"",
            "C=\"22P02\"",
            "DataRow [\"6\", \"parse again\"]",
            "C=\"25P02\"",
            "CommandComplete \"DISCARD ALL\"",
        ],
    ),
    (
        "pipeline_error_skips_to_sync",
        &["DataRow [\"3\"]", "C=\"26000\"", "C=\"08P01\""],
    ),
    ("flush_without_sync", &["CloseComplete", "C=\"42601\""]),
    ("portal_suspended", &["PortalSuspended", "C=\"34000\""]),
    (
        "copy_in_simple",
        &[
            "CopyInResponse",
            "CommandComplete \"COPY 3\"",
            "C=\"22P02\"",
        ],
    ),
    (
        "copy_in_extended",
        &["CopyInResponse", "CommandComplete \"COPY 2\""],
    ),
    (
        "copy_in_extended_early_sync",
        &["CommandComplete \"COPY 3\"", "DataRow [\"60\"]"],
    ),
    (
        "copy_out",
        &[
            "CopyOutResponse format=1",
            "CopyDone",
            "CommandComplete \"COPY 2\"",
        ],
    ),
    (
        "copy_fail",
        &["client gave up", "C=\"57014\"", "DataRow [\"0\"]"],
    ),
    ("empty_query", &["EmptyQueryResponse", "NoData"]),
    ("notices", &["NoticeResponse", "S=\"WARNING\"", "noisy 2"]),
    ("large_values", &["<20000000 bytes", "DataRow [\"5000000\""]),
    ("binary_formats", &["0x00000007", "C=\"22P03\""]),
    (
        "named_statements",
        &["C=\"42P05\"", "C=\"26000\"", "C=\"34000\""],
    ),
    (
        "function_call",
        &[
            "FunctionCallResponse 0x00000005",
            "FunctionCallResponse \"42\"",
        ],
    ),
    (
        "listen_notify",
        &["NotificationResponse pid=<pid>", "from a function"],
    ),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_scenario_is_deterministic_against_postgres() {
    let mut failures = Vec::new();
    for (name, transcripts) in run_all_twice().await {
        let [first, second] = &transcripts[..] else {
            unreachable!("two targets give two transcripts")
        };
        if let Some(diff) = diff(first, second) {
            failures.push(format!("{name}: {diff}"));
        }
        if first.last().map(String::as_str) != Some("!! connection closed") {
            failures.push(format!(
                "{name}: did not end with the server closing after Terminate:\n{}",
                first.join("\n")
            ));
        }
        if let Some(line) = first
            .iter()
            .find(|l| l.contains("FATAL") || l.contains("timeout"))
        {
            failures.push(format!("{name}: unexpected {line}"));
        }
        let expected = MUST_CONTAIN
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, e)| *e)
            .unwrap_or_else(|| panic!("scenario {name} has no MUST_CONTAIN entry"));
        for needle in expected {
            if !first.iter().any(|line| line.contains(needle)) {
                failures.push(format!(
                    "{name}: transcript lacks {needle:?}:\n{}",
                    first.join("\n")
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[tokio::test]
async fn each_role_authenticates_with_its_method() {
    let addr = cluster().addr();
    for (user, password) in [
        (PGMEMO_USER, Some(PGMEMO_PASS)),
        (SCRAM_USER, Some(SCRAM_PASS)),
        (MD5_USER, Some(MD5_PASS)),
        (TRUST_USER, None),
    ] {
        let client = RawClient::connect(addr, user, TEST_DB, password, &[])
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        assert!(client.backend_key().is_some());
        assert!(client
            .parameters()
            .iter()
            .any(|(k, v)| k == "session_authorization" && v == user));
        client.terminate().await.unwrap();
    }
    let methods = cluster().psql(
        "postgres",
        "SELECT user_name[1], auth_method FROM pg_hba_file_rules \
         WHERE user_name[1] IN ('md5_user', 'scram_user', 'trust_user') ORDER BY 1",
    );
    assert_eq!(
        methods,
        "md5_user|md5\nscram_user|scram-sha-256\ntrust_user|trust\n"
    );
    let stored = cluster().psql(
        "postgres",
        "SELECT rolname, left(rolpassword, 3) FROM pg_authid \
         WHERE rolname IN ('md5_user', 'scram_user') ORDER BY 1",
    );
    assert_eq!(stored, "md5_user|md5\nscram_user|SCR\n");
}

#[tokio::test]
async fn a_wrong_password_is_refused() {
    let addr = cluster().addr();
    for user in [SCRAM_USER, MD5_USER, PGMEMO_USER] {
        let err = RawClient::connect(addr, user, TEST_DB, Some("wrong"), &[])
            .await
            .err()
            .unwrap_or_else(|| panic!("{user} logged in with a wrong password"));
        assert!(format!("{err:#}").contains("28P01"), "{err:#}");
    }
}

#[tokio::test]
async fn startup_messages_are_equal_after_normalization() {
    let addr = cluster().addr();
    let mut startups = Vec::new();
    for _ in 0..2 {
        let client = RawClient::through(addr, &[("application_name", "selftest")])
            .await
            .unwrap();
        startups.push(normalize(client.startup_messages()));
        client.terminate().await.unwrap();
    }
    assert_same(&startups[0], &startups[1]);
    assert!(startups[0].contains(&"BackendKeyData pid=<pid> key=<key>".to_string()));
    assert!(startups[0].contains(&"ParameterStatus application_name=\"selftest\"".to_string()));
}

#[tokio::test]
async fn a_malformed_message_ends_the_session_comparably() {
    let addr = cluster().addr();
    let script = [
        Step::Send(vec![Frontend::Raw(b"?\0\0\0\x04".to_vec())]),
        Step::Expect(1),
    ];
    let transcripts = differential(&[addr, addr], TRUST_USER, None, TEST_DB, &script).await;
    assert_all_same(&transcripts);
    let last = &transcripts[0][transcripts[0].len() - 2..];
    assert!(last[0].contains("S=\"FATAL\""), "{last:?}");
    assert_eq!(last[1], "!! connection closed");
}

#[test]
fn assert_same_reports_the_first_difference() {
    let a = vec!["x".to_string(), "y".to_string()];
    let b = vec!["x".to_string(), "z".to_string()];
    let report = diff(&a, &b).expect("they differ");
    assert!(report.contains("line 2"), "{report}");
    assert!(
        report.contains("direct:  y") && report.contains("proxied: z"),
        "{report}"
    );
    assert!(diff(&a, &a).is_none());
}

#[test]
fn psql_reports_errors_with_stderr() {
    let err = cluster().try_psql(TEST_DB, "SELECT 1/0").unwrap_err();
    assert!(err.to_string().contains("division by zero"), "{err}");
    assert!(cluster()
        .url("a b", Some("p@ss"), TEST_DB)
        .contains("a%20b:p%40ss@127.0.0.1:"));
}
