//! No read crosses a boundary (issue 31): every read through pgmemo — transaction mode, the
//! result cache on with a rule that matches everything, each client logged into PostgreSQL as
//! its own role — is compared with the same read sent to PostgreSQL directly by the same role
//! with the same settings, after the cache has been seen to answer. One test per class of leak,
//! each with its variants, with proxy and with WAL invalidation where the cache is involved.

mod common;

use common::*;
use pgmemo::config::cache::Invalidation;
use pgmemo::config::{Config, DatabaseConfig, PoolMode, UserConfig};
use pgmemo::Pgmemo;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio_postgres::{Client, SimpleQueryMessage};

type Rows = Vec<Vec<Option<String>>>;

const MODES: [Invalidation; 2] = [Invalidation::Proxy, Invalidation::Wal];

/// Roles the tests log in as (created once per cluster), with their passwords.
const ROLES: [(&str, &str); 3] = [
    ("iso_a", "iso_a_pass"),
    ("iso_b", "iso_b_pass"),
    ("iso_c", "iso_c_pass"),
];

async fn psql(db: &'static str, sql: &str) {
    let sql = sql.to_owned();
    tokio::task::spawn_blocking(move || cluster().psql(db, &sql))
        .await
        .unwrap();
}

/// A fresh database `name` (per mode: a WAL follower keeps a slot on the previous one), with
/// the test roles and `sql` run in it as the superuser.
async fn database(name: &str, mode: Invalidation, sql: &str) -> &'static str {
    static ROLES_MADE: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    let db: &'static str = Box::leak(format!("{name}_{mode:?}").to_lowercase().into_boxed_str());
    tokio::task::spawn_blocking(|| {
        ROLES_MADE.get_or_init(|| {
            let roles: String = ROLES
                .iter()
                .map(|(role, pass)| format!("CREATE ROLE {role} LOGIN PASSWORD '{pass}';"))
                .collect();
            cluster().psql("postgres", &roles);
        })
    })
    .await
    .unwrap();
    fresh_db(db).await;
    psql(db, sql).await;
    db
}

/// pgmemo in transaction mode with `pool_size` servers per pool, the cache on for every
/// query, each client logging into PostgreSQL as its own role.
fn own_roles_config(mode: Invalidation, pool_size: u32) -> Config {
    let mut config = test_config(PoolMode::Transaction, pool_size);
    config.upstream = None;
    config.databases = BTreeMap::from([(
        "*".to_string(),
        DatabaseConfig {
            host: Some("127.0.0.1".into()),
            port: Some(cluster().port()),
            ..DatabaseConfig::default()
        },
    )]);
    config.users = ROLES
        .iter()
        .chain(&[(PGMEMO_USER, PGMEMO_PASS)])
        .map(|(role, pass)| {
            (
                role.to_string(),
                UserConfig {
                    password: Some(pass.to_string()),
                    ..UserConfig::default()
                },
            )
        })
        .collect();
    config.cache.enabled = true;
    config.cache.admit_after = 1;
    config.cache.invalidation = mode;
    // The tenants may not replicate: the follower logs in as a role that may.
    config.cache.replication_user = Some(PGMEMO_USER.into());
    config.cache.replication_password = Some(PGMEMO_PASS.into());
    config.cache.rules = vec![cache_rule("all", "")];
    config
}

fn password(role: &str) -> &'static str {
    ROLES
        .iter()
        .chain(&[(PGMEMO_USER, PGMEMO_PASS)])
        .find(|(r, _)| *r == role)
        .map(|(_, p)| *p)
        .expect("a test role")
}

/// A client of `role` through pgmemo and one straight to PostgreSQL, both with `options`.
async fn pair(proxy: &Pgmemo, role: &str, db: &str, options: &str) -> (Client, Client) {
    let suffix = if options.is_empty() {
        String::new()
    } else {
        format!(
            "?options={}",
            options.replace(' ', "%20").replace('=', "%3D")
        )
    };
    let through = proxy_url(proxy.local_addr(), role, Some(password(role)), db) + &suffix;
    let direct = cluster().url(role, Some(password(role)), db) + &suffix;
    (connect(&through).await, connect(&direct).await)
}

/// The rows of `sql` (or its error's code and message).
async fn rows(client: &Client, sql: &str) -> Result<Rows, String> {
    match client.simple_query(sql).await {
        Ok(messages) => Ok(messages
            .iter()
            .filter_map(|m| match m {
                SimpleQueryMessage::Row(r) => {
                    Some((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect())
                }
                _ => None,
            })
            .collect()),
        Err(e) => Err(e
            .as_db_error()
            .map(|d| format!("{}: {}", d.code().code(), d.message()))
            .unwrap_or_else(|| e.to_string())),
    }
}

/// Reads `sql` through `client` until the cache answers it (with WAL invalidation the
/// database's stream must be up first), and returns what it answered.
async fn cached(proxy: &Pgmemo, client: &Client, sql: &str) -> Result<Rows, String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let before = cache_hits(proxy);
        let answer = rows(client, sql).await;
        if cache_hits(proxy) > before {
            return answer;
        }
        if std::time::Instant::now() > deadline {
            let mut bypasses = cache_bypasses(proxy);
            bypasses.retain(|(_, n)| *n > 0);
            panic!("no cache hit for {sql} in 30 s: {answer:?}, bypasses {bypasses:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `sql` read through pgmemo is what PostgreSQL answers the same role directly.
async fn same(through: &Client, direct: &Client, sql: &str, what: &str) {
    assert_eq!(
        rows(through, sql).await,
        rows(direct, sql).await,
        "{what}: {sql}"
    );
}

// 1. Row-level security whose policies read other tables.

#[tokio::test]
async fn row_security_follows_the_tables_its_policies_read() {
    for mode in MODES {
        let db = database(
            "iso_rls",
            mode,
            "CREATE TABLE members (who name, t int);
             INSERT INTO members VALUES ('iso_a', 1), ('iso_a', 2), ('iso_b', 2);
             CREATE VIEW member_view AS SELECT who, t FROM members;
             CREATE TABLE docs (t int, body text);
             INSERT INTO docs VALUES (1, 'one'), (2, 'two');
             CREATE TABLE notes (t int, body text);
             INSERT INTO notes VALUES (1, 'n1'), (2, 'n2');
             CREATE SCHEMA other;
             CREATE TABLE other.grants (who name, t int);
             INSERT INTO other.grants VALUES ('iso_a', 1);
             CREATE TABLE files (t int, body text);
             INSERT INTO files VALUES (1, 'f1');
             ALTER TABLE docs ENABLE ROW LEVEL SECURITY;
             ALTER TABLE notes ENABLE ROW LEVEL SECURITY;
             ALTER TABLE files ENABLE ROW LEVEL SECURITY;
             CREATE POLICY p ON docs USING (t IN (SELECT t FROM members WHERE who = current_user));
             CREATE POLICY p ON notes USING (t IN (SELECT t FROM member_view WHERE who = current_user));
             CREATE POLICY p ON files USING (EXISTS (SELECT FROM other.grants g WHERE g.who = current_user AND g.t = files.t));
             GRANT SELECT ON docs, notes, files, members, member_view TO PUBLIC;
             GRANT USAGE ON SCHEMA other TO PUBLIC; GRANT SELECT ON other.grants TO PUBLIC;",
        )
        .await;
        let proxy = start_pgmemo(own_roles_config(mode, 2)).await;
        let (a, a_direct) = pair(&proxy, "iso_a", db, "").await;
        let (owner, owner_direct) = pair(&proxy, PGMEMO_USER, db, "").await;
        for (read, revoke) in [
            (
                "SELECT body FROM docs ORDER BY t",
                "DELETE FROM members WHERE who = 'iso_a' AND t = 1",
            ),
            (
                "SELECT body FROM notes ORDER BY t",
                "DELETE FROM members WHERE who = 'iso_a' AND t = 2",
            ),
            ("SELECT body FROM files ORDER BY t", "TRUNCATE other.grants"),
        ] {
            let before = cached(&proxy, &a, read).await;
            assert_eq!(before, rows(&a_direct, read).await, "{read}");
            assert!(!before.as_ref().unwrap().is_empty(), "{read}");
            // Through pgmemo in proxy mode (read-your-writes), on PostgreSQL directly with
            // WAL invalidation (the follower must apply it).
            match mode {
                Invalidation::Proxy => owner.batch_execute(revoke).await.unwrap(),
                Invalidation::Wal => {
                    owner_direct.batch_execute(revoke).await.unwrap();
                    wait_applied(&proxy, &owner_direct, db).await;
                }
            }
            same(&a, &a_direct, read, "after the policy's table changed").await;
        }
    }
}

/// Waits until pgmemo's WAL follower of `db` has applied the server's WAL as of now.
async fn wait_applied(proxy: &Pgmemo, direct: &Client, db: &str) {
    wait_wal_applied(proxy, direct, db).await;
}

// 2. Custom settings, however they are spelt, never stay on a server for the next client.

#[tokio::test]
async fn custom_settings_under_any_spelling_follow_their_client() {
    let db = database(
        "iso_guc",
        Invalidation::Proxy,
        "CREATE TABLE secrets (tenant text, v text);
         INSERT INTO secrets VALUES ('a', 'a-secret'), ('b', 'b-secret');
         ALTER TABLE secrets ENABLE ROW LEVEL SECURITY;
         CREATE POLICY p ON secrets USING (tenant = current_setting('app.tenant', true));
         GRANT SELECT ON secrets TO PUBLIC;
         CREATE FUNCTION use_tenant(text) RETURNS text LANGUAGE sql
           AS $$ SELECT set_config('app.tenant', $1, false) $$;
         CREATE FUNCTION enter(t text) RETURNS void LANGUAGE plpgsql
           AS $$ BEGIN SET app.tenant = 'b'; END $$;",
    )
    .await;
    let read = "SELECT v FROM secrets";
    for set in [
        r#"SET "app.tenant" = 'b'"#,
        r#"SET "App"."Tenant" TO 'b'"#,
        r"SELECT set_config(E'app\x2etenant', 'b', false)",
        r"SELECT set_config(U&'app\002etenant', 'b', false)",
        "SELECT set_config($x$app.tenant$x$, 'b', false)",
        "SELECT set_config('app.' || 'tenant', 'b', false)",
        "SELECT pg_catalog.set_config((SELECT 'app.tenant'), 'b', false)",
        "DO $$ BEGIN PERFORM set_config('app.tenant', 'b', false); END $$",
        // Functions of the database that set it: the text does not name it.
        "SELECT use_tenant('b')",
        "SELECT public.ENTER('x')",
    ] {
        // One server: the next client lands where the setter ran, unless the setter keeps
        // it (pinned); two: the readers alternate between whatever servers are free.
        for pool_size in [1, 2] {
            let mut config = own_roles_config(Invalidation::Proxy, pool_size);
            config.cache.enabled = false;
            let proxy = start_pgmemo(config).await;
            let (setter, setter_direct) = pair(&proxy, "iso_a", db, "").await;
            let mut setter = Some((setter, setter_direct));
            let (s, s_direct) = setter.as_ref().unwrap();
            s.batch_execute(set).await.unwrap();
            s_direct.batch_execute(set).await.unwrap();
            same(s, s_direct, read, set).await;
            let pinned = setter_keeps_server(&proxy);
            if pinned && pool_size == 1 {
                // The setter keeps the only server (settings pgmemo cannot name): a second
                // client would wait for it; when the setter leaves, its server is reset.
                setter = None;
                wait_until("the setter to leave", Duration::from_secs(10), || async {
                    proxy.app().client_count() == 0
                })
                .await;
            }
            for _ in 0..3 {
                let (reader, reader_direct) = pair(&proxy, "iso_a", db, "").await;
                same(&reader, &reader_direct, read, &format!("after {set}")).await;
                same(
                    &reader,
                    &reader_direct,
                    // A placeholder once set on a server reads '' after a reset where a
                    // new connection reads NULL: PostgreSQL cannot remove one. The value is
                    // what must not pass.
                    "SELECT coalesce(current_setting('app.tenant', true), '')",
                    set,
                )
                .await;
            }
            if let Some((s, s_direct)) = &setter {
                // The setter still has its setting, as on its own connection.
                same(s, s_direct, read, &format!("{set}, later")).await;
            }
        }
    }
}

/// Whether some client of pgmemo is pinned to its server.
fn setter_keeps_server(proxy: &Pgmemo) -> bool {
    proxy
        .app()
        .clients()
        .iter()
        .any(|c| c.pins.load(std::sync::atomic::Ordering::Relaxed) != 0)
}

// 3. The search_path as the server expands it: startup values, `$user`, role defaults.

#[tokio::test]
async fn names_resolve_by_the_search_path_each_role_has() {
    for mode in MODES {
        let db = database(
            "iso_path",
            mode,
            "CREATE SCHEMA s; CREATE TABLE s.t (v text); INSERT INTO s.t VALUES ('s');
             CREATE TABLE public.t (v text); INSERT INTO public.t VALUES ('public');
             CREATE SCHEMA iso_b AUTHORIZATION iso_b;
             CREATE TABLE iso_b.base (v text); INSERT INTO iso_b.base VALUES ('b base');
             CREATE VIEW iso_b.t AS SELECT v FROM iso_b.base;
             CREATE SCHEMA c3; CREATE TABLE c3.t (v text); INSERT INTO c3.t VALUES ('c3');
             GRANT USAGE ON SCHEMA s, c3 TO PUBLIC;
             GRANT ALL ON ALL TABLES IN SCHEMA public, s, iso_b, c3 TO PUBLIC;",
        )
        .await;
        psql(
            db,
            &format!("ALTER ROLE iso_c IN DATABASE {db} SET search_path = c3"),
        )
        .await;
        let proxy = start_pgmemo(own_roles_config(mode, 1)).await;
        let read = "SELECT v FROM t";
        // A startup search_path holds whatever other clients of the pool set meanwhile.
        let (startup, startup_direct) = pair(&proxy, "iso_a", db, "-c search_path=s").await;
        let (other, _) = pair(&proxy, "iso_a", db, "").await;
        same(&startup, &startup_direct, read, "startup search_path").await;
        other.batch_execute("SET search_path = s").await.unwrap();
        rows(&other, read).await.unwrap();
        other.batch_execute("RESET search_path").await.unwrap();
        rows(&other, read).await.unwrap();
        same(
            &startup,
            &startup_direct,
            read,
            "startup search_path, later",
        )
        .await;
        same(&startup, &startup_direct, "SHOW search_path", "startup").await;
        // `$user` and a role's default: each role's `t` is its own.
        let (a, a_direct) = pair(&proxy, "iso_a", db, "").await;
        let (b, b_direct) = pair(&proxy, "iso_b", db, "").await;
        let (c, c_direct) = pair(&proxy, "iso_c", db, "").await;
        assert_eq!(cached(&proxy, &a, read).await, rows(&a_direct, read).await);
        assert_eq!(cached(&proxy, &b, read).await, rows(&b_direct, read).await);
        assert_eq!(cached(&proxy, &c, read).await, rows(&c_direct, read).await);
        // A write to the base table of b's view: b's cached `t` follows it.
        match mode {
            Invalidation::Proxy => b
                .batch_execute("UPDATE iso_b.base SET v = 'b changed'")
                .await
                .unwrap(),
            Invalidation::Wal => {
                b_direct
                    .batch_execute("UPDATE iso_b.base SET v = 'b changed'")
                    .await
                    .unwrap();
                wait_applied(&proxy, &b_direct, db).await;
            }
        }
        same(&b, &b_direct, read, "b after its base table changed").await;
        same(&a, &a_direct, read, "a").await;
        same(&c, &c_direct, read, "c").await;
    }
}

// 4. Databases of the same name on two servers.

#[tokio::test]
async fn databases_of_one_name_on_two_servers_stay_apart() {
    let far = tokio::task::spawn_blocking(|| {
        pgmemo::demo::LocalPostgres::start(pgmemo::demo::LocalPostgresOptions {
            superuser: "postgres".into(),
            settings: vec![("wal_level".into(), "logical".into())],
            ..Default::default()
        })
        .expect("a second PostgreSQL")
    })
    .await
    .unwrap();
    let far_port = far.port();
    for mode in MODES {
        let db = database(
            "iso_same",
            mode,
            "CREATE TABLE t (v text); INSERT INTO t VALUES ('near');",
        )
        .await;
        let create = format!(
            "DROP DATABASE IF EXISTS {db} WITH (FORCE); CREATE DATABASE {db}; \
             DO $$ BEGIN CREATE ROLE {PGMEMO_USER} LOGIN SUPERUSER PASSWORD '{PGMEMO_PASS}'; \
             EXCEPTION WHEN duplicate_object THEN NULL; END $$;"
        );
        far.psql("postgres", &create).unwrap();
        far.psql(db, "CREATE TABLE t (v text); INSERT INTO t VALUES ('far');")
            .unwrap();
        let mut config = own_roles_config(mode, 2);
        config.databases = BTreeMap::from([
            (
                "near".to_string(),
                DatabaseConfig {
                    host: Some("127.0.0.1".into()),
                    port: Some(cluster().port()),
                    dbname: Some(db.into()),
                    user: Some(PGMEMO_USER.into()),
                    password: Some(PGMEMO_PASS.into()),
                    ..DatabaseConfig::default()
                },
            ),
            (
                "far".to_string(),
                DatabaseConfig {
                    host: Some("127.0.0.1".into()),
                    port: Some(far_port),
                    dbname: Some(db.into()),
                    user: Some(PGMEMO_USER.into()),
                    password: Some(PGMEMO_PASS.into()),
                    ..DatabaseConfig::default()
                },
            ),
        ]);
        let proxy = start_pgmemo(config).await;
        let url = |name: &str| proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), name);
        let near = connect(&url("near")).await;
        let far_client = connect(&url("far")).await;
        let read = "SELECT v FROM t";
        let want = |v: &str| Ok(vec![vec![Some(v.to_string())]]);
        assert_eq!(cached(&proxy, &near, read).await, want("near"));
        assert_eq!(rows(&far_client, read).await, want("far"));
        assert_eq!(cached(&proxy, &far_client, read).await, want("far"));
        // A write to one is not a write to the other.
        far_client
            .batch_execute("UPDATE t SET v = 'far 2'")
            .await
            .unwrap();
        assert_eq!(rows(&far_client, read).await, want("far 2"));
        assert_eq!(rows(&near, read).await, want("near"));
        // Prepared statements too: each server's own.
        let statement = near.prepare(read).await.unwrap();
        let v: String = near.query_one(&statement, &[]).await.unwrap().get(0);
        assert_eq!(v, "near");
        let statement = far_client.prepare(read).await.unwrap();
        let v: String = far_client.query_one(&statement, &[]).await.unwrap().get(0);
        assert_eq!(v, "far 2");
    }
    drop(far);
}

// 5. standard_conforming_strings off: backslashes escape in plain strings.

#[tokio::test]
async fn strings_are_read_as_the_clients_settings_read_them() {
    for mode in MODES {
        let db = database(
            "iso_scs",
            mode,
            "CREATE TABLE t (v int); INSERT INTO t VALUES (1);
             GRANT ALL ON t TO PUBLIC;",
        )
        .await;
        let proxy = start_pgmemo(own_roles_config(mode, 2)).await;
        let (off, off_direct) =
            pair(&proxy, "iso_a", db, "-c standard_conforming_strings=off").await;
        let (on, on_direct) = pair(&proxy, "iso_a", db, "").await;
        // A warm cache for clients that read strings the standard way.
        cached(&proxy, &on, r"SELECT '\' /* ', 1 -- */")
            .await
            .unwrap();
        cached(&proxy, &on, "SELECT v FROM t").await.unwrap();
        for sql in [
            r"SELECT '\' /* ', 1 -- */",
            r"SELECT '\' /* ', 2 -- */",
            r"SELECT '\' /* ', 2 -- */",
            "SELECT v FROM t",
        ] {
            same(&off, &off_direct, sql, "standard_conforming_strings off").await;
        }
        // A write hidden, for a standard reader, in a comment.
        off.batch_execute(r"SELECT '\' /* '; UPDATE t SET v = v + 1; -- */")
            .await
            .unwrap();
        if mode == Invalidation::Wal {
            wait_applied(&proxy, &on_direct, db).await;
        }
        same(&on, &on_direct, "SELECT v FROM t", "after a hidden write").await;
        // Turned off mid-session.
        on.batch_execute("SET standard_conforming_strings = off")
            .await
            .unwrap();
        on_direct
            .batch_execute("SET standard_conforming_strings = off")
            .await
            .unwrap();
        same(&on, &on_direct, r"SELECT '\' /* ', 3 -- */", "SET off").await;
    }
}

// 6. Temporary objects, however they were made, shadow permanent ones for their client.

#[tokio::test]
async fn temporary_objects_shadow_cached_permanent_ones() {
    for mode in MODES {
        let db = database(
            "iso_temp",
            mode,
            "CREATE TABLE p8 (v int); INSERT INTO p8 VALUES (1);
             GRANT ALL ON p8 TO PUBLIC;",
        )
        .await;
        let read = "SELECT v FROM p8";
        for (how, extended) in [
            ("SELECT 42 AS v INTO TEMP TABLE p8", false),
            ("CREATE TEMP TABLE p8 AS SELECT 42 AS v", true),
            ("CREATE TABLE pg_temp.p8 AS SELECT 42 AS v", false),
            ("CREATE TEMP VIEW p8 AS SELECT 42 AS v", true),
            (
                "DO $$ BEGIN EXECUTE 'CREATE TEMP TABLE p8 AS SELECT 42 AS v'; END $$",
                false,
            ),
        ] {
            let proxy = start_pgmemo(own_roles_config(mode, 2)).await;
            let (other, _) = pair(&proxy, PGMEMO_USER, db, "").await;
            let (temp, temp_direct) = pair(&proxy, PGMEMO_USER, db, "").await;
            cached(&proxy, &other, read).await.unwrap();
            if extended {
                // The extended protocol (psycopg 3 pipelines, JDBC).
                temp.execute(how, &[]).await.unwrap();
                temp_direct.execute(how, &[]).await.unwrap();
            } else {
                temp.batch_execute(how).await.unwrap();
                temp_direct.batch_execute(how).await.unwrap();
            }
            // Another client reads the permanent table again, then the temp one's client.
            cached(&proxy, &other, read).await.unwrap();
            same(&temp, &temp_direct, read, how).await;
            let statement = temp.prepare(read).await.unwrap();
            let v: i32 = temp.query_one(&statement, &[]).await.unwrap().get(0);
            assert_eq!(v, 42, "{how}, extended protocol");
            // Dropped: the permanent table again.
            temp.batch_execute("DISCARD TEMP").await.unwrap();
            temp_direct.batch_execute("DISCARD TEMP").await.unwrap();
            same(&temp, &temp_direct, read, "after DISCARD TEMP").await;
        }
    }
}

// 7. Writes pgmemo does not see in the text.

#[tokio::test]
async fn writes_through_functions_views_operators_and_defaults_invalidate() {
    for mode in MODES {
        let db = database(
            "iso_hidden",
            mode,
            "CREATE TABLE counter (n int); INSERT INTO counter VALUES (0);
             CREATE FUNCTION bump(int) RETURNS int LANGUAGE sql VOLATILE
               AS 'UPDATE counter SET n = n + $1 RETURNING n';
             CREATE FUNCTION bump2(int, int) RETURNS int LANGUAGE sql VOLATILE
               AS 'UPDATE counter SET n = n + $1 + $2 RETURNING n';
             CREATE VIEW v AS SELECT bump(1) AS n;
             CREATE VIEW vv AS SELECT n FROM v;
             CREATE OPERATOR ### (LEFTARG = int, RIGHTARG = int, FUNCTION = bump2);
             CREATE TABLE log (a int, b int DEFAULT bump(1));
             CREATE DOMAIN bumped AS int CHECK (bump(VALUE) IS NOT NULL);
             CREATE TABLE checked (a bumped);",
        )
        .await;
        let proxy = start_pgmemo(own_roles_config(mode, 2)).await;
        let (c, c_direct) = pair(&proxy, PGMEMO_USER, db, "").await;
        let (writer, _) = pair(&proxy, PGMEMO_USER, db, "").await;
        let read = "SELECT n FROM counter";
        for write in [
            "SELECT * FROM v",
            "SELECT n FROM vv",
            "SELECT 1 ### 2",
            "INSERT INTO log (a) VALUES (1)",
            "INSERT INTO checked VALUES (5)",
            "SELECT query_to_xml('SELECT bump(1)', true, false, '')",
        ] {
            cached(&proxy, &c, read).await.unwrap();
            writer.batch_execute(write).await.unwrap();
            // Read at once, WAL follower or not: the writer's own writes are known to pgmemo.
            same(&c, &c_direct, read, write).await;
            same(&writer, &c_direct, read, write).await;
        }
        // Reads through a function that reads by text are never cached.
        let xml = "SELECT table_to_xml('counter', true, false, '')";
        rows(&c, xml).await.unwrap();
        rows(&c, xml).await.unwrap();
        c_direct
            .batch_execute("UPDATE counter SET n = n + 1")
            .await
            .unwrap();
        same(&c, &c_direct, xml, "table_to_xml").await;
        // A prepared transaction's writes show at COMMIT PREPARED, whoever sends it.
        writer
            .batch_execute("BEGIN; UPDATE counter SET n = 1000; PREPARE TRANSACTION 'iso_x'")
            .await
            .unwrap();
        cached(&proxy, &c, read).await.unwrap();
        let (committer, _) = pair(&proxy, PGMEMO_USER, db, "").await;
        committer
            .batch_execute("COMMIT PREPARED 'iso_x'")
            .await
            .unwrap();
        same(&c, &c_direct, read, "after COMMIT PREPARED").await;
    }
}

// Property: random tenants × roles × search_paths × settings × (read, write, DDL).

#[tokio::test]
async fn random_sessions_read_what_postgresql_gives_them() {
    for mode in MODES {
        let db = database(
            "iso_prop",
            mode,
            "CREATE SCHEMA s1; CREATE SCHEMA s2; CREATE SCHEMA iso_b;
             CREATE TABLE public.t (k int PRIMARY KEY, v int);
             CREATE TABLE s1.t (k int PRIMARY KEY, v int);
             CREATE TABLE s2.base (k int PRIMARY KEY, v int);
             CREATE VIEW s2.t AS SELECT k, v * 10 AS v FROM s2.base;
             CREATE TABLE iso_b.t (k int PRIMARY KEY, v int);
             INSERT INTO public.t SELECT g, g FROM generate_series(1, 5) g;
             INSERT INTO s1.t SELECT g, 100 + g FROM generate_series(1, 5) g;
             INSERT INTO s2.base SELECT g, g FROM generate_series(1, 5) g;
             INSERT INTO iso_b.t SELECT g, 200 + g FROM generate_series(1, 5) g;
             CREATE TABLE items (tenant text, v int);
             INSERT INTO items SELECT t, g FROM generate_series(1, 4) g, unnest(ARRAY['a', 'b', 'c']) t;
             ALTER TABLE items ENABLE ROW LEVEL SECURITY;
             CREATE POLICY p ON items USING (tenant = current_setting('app.tenant', true));
             GRANT USAGE ON SCHEMA s1, s2, iso_b TO PUBLIC;
             GRANT SELECT ON ALL TABLES IN SCHEMA public, s1, s2, iso_b TO PUBLIC;",
        )
        .await;
        let proxy = start_pgmemo(own_roles_config(mode, 2)).await;
        // PGMEMO_TEST_SEED=N replays another sequence.
        let seed = std::env::var("PGMEMO_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0x5eed_0031u64);
        let mut rng = Rng(seed ^ mode as u64);
        // Actors: a role and startup options; each has a client through pgmemo and one direct.
        let mut actors = Vec::new();
        for (role, options) in [
            ("iso_a", ""),
            ("iso_a", "-c search_path=s1"),
            ("iso_b", ""),
            ("iso_b", "-c search_path=s2,public"),
            ("iso_c", "-c app.tenant=c"),
            ("iso_c", ""),
        ] {
            actors.push(pair(&proxy, role, db, options).await);
        }
        let (writer, writer_direct) = pair(&proxy, PGMEMO_USER, db, "").await;
        let reads = [
            "SELECT k, v FROM t ORDER BY k",
            "SELECT v FROM t WHERE k = 2",
            "SELECT sum(v) FROM t",
            "SELECT tenant, v FROM items ORDER BY tenant, v",
            "SELECT count(*) FROM items",
            "SELECT v FROM s1.t WHERE k = 3",
        ];
        let settings = [
            "SET search_path = s1",
            "SET search_path = s2, public",
            "SET search_path = \"$user\", public",
            "RESET search_path",
            "SET app.tenant = 'a'",
            "SET \"app.tenant\" = 'b'",
            "SELECT set_config(E'app\\x2etenant', 'c', false)",
            "RESET app.tenant",
            "SET ROLE NONE",
        ];
        let writes = [
            "UPDATE t SET v = v + 1 WHERE k = 2",
            "UPDATE s1.t SET v = v + 1",
            "UPDATE s2.base SET v = v + 1 WHERE k = 3",
            "UPDATE iso_b.t SET v = v + 1 WHERE k = 2",
            "INSERT INTO items VALUES ('a', 9), ('b', 9)",
            "DELETE FROM items WHERE v = 9",
        ];
        let ddl = [
            "CREATE OR REPLACE VIEW s2.t AS SELECT k, v * 10 AS v FROM s2.base",
            "CREATE OR REPLACE VIEW s2.t AS SELECT k, v * 20 AS v FROM s2.base",
        ];
        let mut log = Vec::new();
        for step in 0..300 {
            let actor = rng.below(actors.len());
            let (through, direct) = &actors[actor];
            match rng.below(10) {
                0..=5 => {
                    let sql = *rng.pick(&reads);
                    log.push(format!("{actor}: {sql}"));
                    same(through, direct, sql, &format!("step {step}: {log:#?}")).await;
                }
                6 => {
                    let sql = *rng.pick(&settings);
                    log.push(format!("{actor}: {sql}"));
                    assert_eq!(
                        rows(through, sql).await.is_ok(),
                        rows(direct, sql).await.is_ok(),
                        "{sql}"
                    );
                }
                7 | 8 => {
                    let sql = *rng.pick(&writes);
                    log.push(format!("writer: {sql}"));
                    if mode == Invalidation::Wal && rng.chance(50) {
                        writer_direct.batch_execute(sql).await.unwrap();
                        wait_applied(&proxy, &writer_direct, db).await;
                    } else {
                        writer.batch_execute(sql).await.unwrap();
                    }
                }
                _ => {
                    let sql = *rng.pick(&ddl);
                    log.push(format!("writer: {sql}"));
                    writer.batch_execute(sql).await.unwrap();
                    writer
                        .batch_execute("GRANT SELECT ON s2.t TO PUBLIC")
                        .await
                        .unwrap();
                }
            }
        }
        assert!(
            cache_hits(&proxy) > 0,
            "the cache answered some of the reads"
        );
    }
}
