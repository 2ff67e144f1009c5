//! A throwaway Valkey stand-in for the shared tier's tests: Debian's `redis-server` (installed
//! by scripts/setup-tests), on free ports, no persistence, stopped when dropped. One server
//! over TCP ([`Valkey::start`]), one that asks for a password ([`Valkey::start_with_password`])
//! or TLS ([`Valkey::start_tls`], with a CA of its own), or a cluster of three
//! ([`Valkey::start_cluster`]).

use super::{free_port, LoggedChild, TempDir};

pub struct Valkey {
    /// The (first) server's port.
    pub port: u16,
    dir: TempDir,
    mode: Mode,
    servers: Vec<LoggedChild>,
}

#[derive(Clone)]
enum Mode {
    Plain,
    /// `requirepass`: the default user's password.
    Password(String),
    /// Its CA's certificate file.
    Tls(std::path::PathBuf),
    /// Each node's (port, cluster bus port).
    Cluster(Vec<(u16, u16)>),
}

impl Valkey {
    /// Starts one server; waits until it answers.
    pub fn start(name: &str) -> Valkey {
        let mut valkey = Valkey {
            port: free_port(),
            dir: TempDir::new("valkey", name),
            mode: Mode::Plain,
            servers: Vec::new(),
        };
        valkey.restart();
        valkey
    }

    /// Starts one server whose default user has `password` (`requirepass`); waits until it
    /// answers.
    pub fn start_with_password(name: &str, password: &str) -> Valkey {
        let mut valkey = Valkey {
            port: free_port(),
            dir: TempDir::new("valkey", name),
            mode: Mode::Password(password.into()),
            servers: Vec::new(),
        };
        valkey.restart();
        valkey
    }

    /// Starts one server that speaks TLS only (a certificate for `localhost` signed by a CA
    /// made here: [`Valkey::ca_file`]).
    pub fn start_tls(name: &str) -> Valkey {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
        let dir = TempDir::new("valkey", name);
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "pgmemo test Valkey CA");
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
        std::fs::write(dir.join("server.crt"), cert.pem()).unwrap();
        std::fs::write(dir.join("server.key"), key.serialize_pem()).unwrap();
        std::fs::write(dir.join("ca.crt"), ca.pem()).unwrap();
        let mut valkey = Valkey {
            port: free_port(),
            mode: Mode::Tls(dir.join("ca.crt")),
            dir,
            servers: Vec::new(),
        };
        valkey.restart();
        valkey
    }

    /// Starts a cluster of three servers (no replicas), each with a third of the slots;
    /// waits until the cluster is up.
    pub fn start_cluster(name: &str) -> Valkey {
        let nodes: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
        let mut valkey = Valkey {
            port: nodes[0].0,
            dir: TempDir::new("valkey", name),
            mode: Mode::Cluster(nodes.clone()),
            servers: Vec::new(),
        };
        valkey.restart();
        let mut create = std::process::Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for (port, _) in &nodes {
            create.arg(format!("127.0.0.1:{port}"));
        }
        let out = create
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        valkey.wait("the cluster to be up", |v| {
            nodes.iter().all(|(port, _)| {
                v.cli_on(*port, &["CLUSTER", "INFO"])
                    .contains("cluster_state:ok")
            })
        });
        valkey
    }

    /// The URL pgmemo is given: `redis://127.0.0.1:PORT/0` (`redis://:PASSWORD@...` with a
    /// password), `rediss://localhost:PORT/0`, or a cluster's first node.
    pub fn url(&self) -> String {
        match &self.mode {
            Mode::Plain => format!("redis://127.0.0.1:{}/0", self.port),
            Mode::Password(password) => format!("redis://:{password}@127.0.0.1:{}/0", self.port),
            Mode::Tls(_) => format!("rediss://localhost:{}/0", self.port),
            Mode::Cluster(_) => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    /// Whether it is a cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.mode, Mode::Cluster(_))
    }

    /// The CA certificate file of a TLS server.
    pub fn ca_file(&self) -> Option<std::path::PathBuf> {
        match &self.mode {
            Mode::Tls(ca) => Some(ca.clone()),
            _ => None,
        }
    }

    /// Stops it (its data goes with it).
    pub fn stop(&mut self) {
        for mut server in self.servers.drain(..) {
            let _ = server.child.kill();
            let _ = server.child.wait();
        }
    }

    /// Starts it again on its ports (empty; a cluster's nodes as they were); waits until it
    /// answers.
    pub fn restart(&mut self) {
        self.stop();
        let common = |cmd: &mut std::process::Command| {
            cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args(["--logfile", ""]);
        };
        let mut start = |args: Vec<String>, log: &str| {
            let mut cmd = std::process::Command::new("redis-server");
            cmd.args(&args).current_dir(&*self.dir);
            common(&mut cmd);
            self.servers
                .push(LoggedChild::start(&mut cmd, self.dir.join(log)));
        };
        match self.mode.clone() {
            Mode::Plain => start(vec!["--port".into(), self.port.to_string()], "redis.log"),
            Mode::Password(password) => start(
                vec![
                    "--port".into(),
                    self.port.to_string(),
                    "--requirepass".into(),
                    password,
                ],
                "redis.log",
            ),
            Mode::Tls(_) => start(
                [
                    "--port",
                    "0",
                    "--tls-port",
                    &self.port.to_string(),
                    "--tls-cert-file",
                    "server.crt",
                    "--tls-key-file",
                    "server.key",
                    "--tls-ca-cert-file",
                    "ca.crt",
                    "--tls-auth-clients",
                    "no",
                ]
                .map(String::from)
                .to_vec(),
                "redis.log",
            ),
            Mode::Cluster(nodes) => {
                for (port, bus) in nodes {
                    start(
                        vec![
                            "--port".into(),
                            port.to_string(),
                            "--cluster-enabled".into(),
                            "yes".into(),
                            "--cluster-port".into(),
                            bus.to_string(),
                            "--cluster-config-file".into(),
                            format!("nodes-{port}.conf"),
                        ],
                        &format!("redis-{port}.log"),
                    );
                }
            }
        }
        self.wait("redis-server to answer", Valkey::ping);
    }

    /// Waits (20 s at most) until `ready`.
    fn wait(&self, what: &str, ready: impl Fn(&Valkey) -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !ready(self) {
            assert!(
                std::time::Instant::now() < deadline,
                "{what}: {}",
                self.servers
                    .iter()
                    .map(LoggedChild::log)
                    .collect::<String>()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// What `redis-cli` prints for `args` on the server at `port` (over TLS for a TLS one).
    fn cli_on(&self, port: u16, args: &[&str]) -> String {
        let mut cmd = std::process::Command::new("redis-cli");
        cmd.args(["-h", "127.0.0.1", "-p", &port.to_string()]);
        match &self.mode {
            Mode::Tls(ca) => {
                cmd.args(["--tls", "--sni", "localhost", "--cacert"])
                    .arg(ca);
            }
            Mode::Password(password) => {
                cmd.env("REDISCLI_AUTH", password);
            }
            _ => {}
        }
        let out = cmd.args(args).output().expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Whether every server answers PING.
    pub fn ping(&self) -> bool {
        let ports: Vec<u16> = match &self.mode {
            Mode::Cluster(nodes) => nodes.iter().map(|(p, _)| *p).collect(),
            _ => vec![self.port],
        };
        ports.iter().all(|&p| self.cli_on(p, &["PING"]) == "PONG")
    }

    /// Makes every key it holds expire `ms` milliseconds from now (a script, one round
    /// trip); how many.
    pub fn expire_all(&self, ms: u64) -> u64 {
        let script = "local n = 0 for _, k in ipairs(redis.call('KEYS', '*')) do \
                      n = n + redis.call('PEXPIRE', k, ARGV[1]) end return n";
        self.cli_on(self.port, &["EVAL", script, "0", &ms.to_string()])
            .parse()
            .expect("EVAL's count")
    }

    /// How many keys it holds (DBSIZE).
    pub fn keys(&self) -> u64 {
        self.cli_on(self.port, &["DBSIZE"]).parse().expect("DBSIZE")
    }
}

impl Drop for Valkey {
    fn drop(&mut self) {
        self.stop();
    }
}
