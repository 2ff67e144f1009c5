//! A throwaway Valkey stand-in for the shared tier's tests: Debian's `redis-server` (installed
//! by scripts/setup-tests), on a free port, no persistence, stopped when dropped.

use super::{free_port, LoggedChild, TempDir};

pub struct Valkey {
    pub port: u16,
    dir: TempDir,
    server: Option<LoggedChild>,
}

impl Valkey {
    /// Starts one; waits until it answers.
    pub fn start(name: &str) -> Valkey {
        let mut valkey = Valkey {
            port: free_port(),
            dir: TempDir::new("valkey", name),
            server: None,
        };
        valkey.restart();
        valkey
    }

    /// `redis://127.0.0.1:PORT/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Stops it (its data goes with it).
    pub fn stop(&mut self) {
        if let Some(mut server) = self.server.take() {
            let _ = server.child.kill();
            let _ = server.child.wait();
        }
    }

    /// Starts it again on its port (empty); waits until it answers.
    pub fn restart(&mut self) {
        self.stop();
        let server = LoggedChild::start(
            std::process::Command::new("redis-server")
                .args(["--port", &self.port.to_string()])
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args(["--logfile", ""])
                .current_dir(&*self.dir),
            self.dir.join("redis.log"),
        );
        self.server = Some(server);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            if self.ping() {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server did not answer: {}",
                self.server
                    .as_ref()
                    .map(LoggedChild::log)
                    .unwrap_or_default()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Whether it answers PING (RESP over a socket of its own).
    pub fn ping(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(2)));
        if s.write_all(b"PING\r\n").is_err() {
            return false;
        }
        let mut buf = [0u8; 7];
        s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }

    /// Makes every key it holds expire `ms` milliseconds from now (a script, one round
    /// trip); how many.
    pub fn expire_all(&self, ms: u64) -> u64 {
        let script = "local n = 0 for _, k in ipairs(redis.call('KEYS', '*')) do \
                      n = n + redis.call('PEXPIRE', k, ARGV[1]) end return n";
        let out = std::process::Command::new("redis-cli")
            .args([
                "-p",
                &self.port.to_string(),
                "EVAL",
                script,
                "0",
                &ms.to_string(),
            ])
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("EVAL's count")
    }

    /// How many keys it holds (DBSIZE).
    pub fn keys(&self) -> u64 {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).expect("connect");
        s.write_all(b"DBSIZE\r\n").unwrap();
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).unwrap();
        let reply = std::str::from_utf8(&buf[..n]).unwrap();
        reply
            .trim_start_matches(':')
            .trim()
            .parse()
            .expect("DBSIZE")
    }
}

impl Drop for Valkey {
    fn drop(&mut self) {
        self.stop();
    }
}
