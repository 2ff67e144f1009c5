//! RELOAD and SIGHUP on the real binary, watched from the console as an operator would: a
//! setting that changes at run time is applied; one that needs a restart keeps its running
//! value, named in a NOTICE and the log, and SHOW CONFIG goes on showing what is in effect;
//! a file that does not load is refused with its line, and the old configuration stays.

mod common;

use common::*;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, Client, NoTls, SimpleQueryMessage};

const BIN: &str = env!("CARGO_BIN_EXE_pgmemo");

/// A pgmemo binary running with a config file of its own.
struct Running {
    child: tokio::process::Child,
    dir: PathBuf,
    file: PathBuf,
    addr: std::net::SocketAddr,
}

impl Running {
    async fn start(name: &str, config: &str, port: u16) -> Running {
        let dir =
            std::env::temp_dir().join(format!("pgmemo-reload-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pgmemo.toml");
        std::fs::write(&file, config).unwrap();
        let child = tokio::process::Command::new(BIN)
            .args(["--config", file.to_str().unwrap()])
            .env_remove("PGMEMO_CONFIG")
            .env_remove("PGMEMO_UPSTREAM")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("pgmemo.log")).unwrap())
            .kill_on_drop(true)
            .spawn()
            .expect("start pgmemo");
        let addr = format!("127.0.0.1:{port}").parse().unwrap();
        Running {
            child,
            dir,
            file,
            addr,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgmemo.log")).unwrap_or_default()
    }

    fn url(&self, db: &str) -> String {
        proxy_url(self.addr, PGMEMO_USER, Some(PGMEMO_PASS), db)
    }

    /// A console session, and the notices it receives.
    async fn console(
        &mut self,
    ) -> (
        Client,
        mpsc::UnboundedReceiver<tokio_postgres::error::DbError>,
    ) {
        let deadline = Instant::now() + Duration::from_secs(15);
        let (client, mut conn) = loop {
            match tokio_postgres::connect(&self.url("pgmemo"), NoTls).await {
                Ok(pair) => break pair,
                Err(e) => {
                    assert!(
                        Instant::now() < deadline,
                        "pgmemo did not start: {e}\n{}",
                        self.log()
                    );
                    assert!(
                        self.child.try_wait().unwrap().is_none(),
                        "pgmemo exited:\n{}",
                        self.log()
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(Ok(message)) = std::future::poll_fn(|cx| conn.poll_message(cx)).await {
                if let AsyncMessage::Notice(notice) = message {
                    let _ = tx.send(notice);
                }
            }
        });
        (client, rx)
    }

    fn write(&self, config: &str) {
        std::fs::write(&self.file, config).unwrap();
    }

    fn sighup(&self) {
        let pid = self.child.id().expect("running") as libc::pid_t;
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0);
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// SHOW CONFIG's value of `key`.
async fn setting(admin: &Client, key: &str) -> String {
    let rows = admin.simple_query("SHOW CONFIG").await.unwrap();
    rows.iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(r) if r.get(0) == Some(key) => r.get(1).map(str::to_owned),
            _ => None,
        })
        .unwrap_or_else(|| panic!("SHOW CONFIG has no {key}"))
}

fn config(listen: &str, pool_size: u32, max_prepared: u32, extra: &str) -> String {
    format!(
        "[general]\nlisten = \"{listen}\"\nadmin_users = [\"{PGMEMO_USER}\"]\n\
         default_pool_size = {pool_size}\nmax_prepared_statements = {max_prepared}\n{extra}\n\
         [upstream]\nurl = \"postgresql://{PGMEMO_USER}:{PGMEMO_PASS}@127.0.0.1:{}\"\n",
        cluster().port()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_applies_live_settings_and_names_the_ones_that_need_a_restart() {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut pgmemo = Running::start("restart", &config(&listen, 3, 100, ""), port).await;
    let (admin, mut notices) = pgmemo.console().await;
    assert_eq!(setting(&admin, "default_pool_size").await, "3");

    let other_port = free_port();
    let new_listen = format!("127.0.0.1:{other_port}");
    pgmemo.write(&config(&new_listen, 6, 200, ""));
    admin.simple_query("RELOAD").await.expect("RELOAD");

    // The live setting is applied; the restart ones keep their running values.
    assert_eq!(setting(&admin, "default_pool_size").await, "6");
    assert_eq!(setting(&admin, "listen").await, listen);
    assert_eq!(setting(&admin, "max_prepared_statements").await, "100");
    // One NOTICE per setting that waits for a restart, naming it and both values.
    let mut got = Vec::new();
    for _ in 0..2 {
        let notice = tokio::time::timeout(Duration::from_secs(5), notices.recv())
            .await
            .expect("a NOTICE for each restart setting")
            .unwrap();
        assert_eq!(notice.code().code(), "55P02");
        got.push(notice.message().to_owned());
    }
    got.sort();
    assert_eq!(
        got,
        [
            format!(
                "parameter \"general.listen\" cannot be changed without restarting pgmemo: \
                 keeping \"{listen}\" (the file says \"{new_listen}\")"
            ),
            "parameter \"general.max_prepared_statements\" cannot be changed without \
             restarting pgmemo: keeping \"100\" (the file says \"200\")"
                .to_string(),
        ]
    );
    assert!(
        notices.try_recv().is_err(),
        "more notices than changed restart settings"
    );
    let warned = |log: &str| {
        log.matches("general.listen cannot be changed without restarting")
            .count()
    };
    assert_eq!(warned(&pgmemo.log()), 1, "{}", pgmemo.log());

    // SIGHUP does the same: the live change applied, the restart one logged and kept.
    pgmemo.write(&config(&new_listen, 5, 200, ""));
    pgmemo.sighup();
    let deadline = Instant::now() + Duration::from_secs(10);
    while warned(&pgmemo.log()) < 2 {
        assert!(
            Instant::now() < deadline,
            "SIGHUP logged nothing:\n{}",
            pgmemo.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(setting(&admin, "default_pool_size").await, "5");
    assert_eq!(setting(&admin, "listen").await, listen);

    // pgmemo still listens where it did, and serves.
    let client = connect(&pgmemo.url(TEST_DB)).await;
    assert!(client.simple_query("SELECT 1").await.is_ok());
    assert!(tokio::net::TcpStream::connect(("127.0.0.1", other_port))
        .await
        .is_err());

    // The file back at the running values of the restart settings: no notice.
    pgmemo.write(&config(&listen, 7, 100, ""));
    admin.simple_query("RELOAD").await.expect("RELOAD");
    assert_eq!(setting(&admin, "default_pool_size").await, "7");
    assert!(notices.try_recv().is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_that_does_not_load_is_refused_and_the_old_configuration_stays() {
    let port = free_port();
    let listen = format!("0.0.0.0:{port}");
    let good = config(&listen, 3, 100, "auth_type = \"md5\"");
    let mut pgmemo = Running::start("broken", &good, port).await;
    let (admin, _notices) = pgmemo.console().await;

    let refused = |e: tokio_postgres::Error| {
        let db = e.as_db_error().expect("an ErrorResponse").clone();
        assert_eq!(db.code().code(), "F0000", "{db:?}");
        db.message().to_owned()
    };
    // A syntax error, with its line.
    pgmemo.write("[general]\ndefault_pool_size = 5\nlisten = \n");
    let e = refused(admin.simple_query("RELOAD").await.unwrap_err());
    assert!(
        e.starts_with("RELOAD failed, keeping the old configuration: "),
        "{e}"
    );
    assert!(e.contains("pgmemo.toml, line 3"), "{e}");
    assert_eq!(setting(&admin, "default_pool_size").await, "3");

    // A value out of bounds, with its line and key.
    pgmemo.write(&config(&listen, 0, 100, "auth_type = \"md5\""));
    let e = refused(admin.simple_query("RELOAD").await.unwrap_err());
    assert!(
        e.contains("line 4: general.default_pool_size: must be at least 1"),
        "{e}"
    );
    assert_eq!(setting(&admin, "default_pool_size").await, "3");

    // Trust for a new loopback listen: the running listen is 0.0.0.0, so it is refused.
    let loopback = format!("127.0.0.1:{port}");
    pgmemo.write(&config(&loopback, 4, 100, "auth_type = \"trust\""));
    let e = refused(admin.simple_query("RELOAD").await.unwrap_err());
    assert!(e.contains("general.auth_type: \"trust\""), "{e}");
    assert!(e.contains("running values"), "{e}");
    assert_eq!(setting(&admin, "auth_type").await, "md5");
    assert_eq!(setting(&admin, "default_pool_size").await, "3");

    // SIGHUP with a broken file: logged, the old configuration kept.
    pgmemo.write("[general]\ndefault_pool_size = 5\nlisten = \n");
    pgmemo.sighup();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !pgmemo.log().contains("SIGHUP: reload failed") {
        assert!(
            Instant::now() < deadline,
            "no SIGHUP failure logged:\n{}",
            pgmemo.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(pgmemo.log().contains("line 3"), "{}", pgmemo.log());
    assert_eq!(setting(&admin, "default_pool_size").await, "3");
    let client = connect(&pgmemo.url(TEST_DB)).await;
    assert!(client.simple_query("SELECT 1").await.is_ok());

    // And a good file again is applied.
    pgmemo.write(&config(&listen, 5, 100, "auth_type = \"md5\""));
    admin.simple_query("RELOAD").await.expect("RELOAD");
    assert_eq!(setting(&admin, "default_pool_size").await, "5");
}
