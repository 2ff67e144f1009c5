//! What demo mode shows a first-time user: a small sample schema with data in the private
//! PostgreSQL, a banner with three things to try (statements prepared once and shared, the
//! speed against PostgreSQL directly, a cached query), and, with `--demo-bench`, a 10-second
//! pgbench comparison through pgmemo and directly.

use crate::demo::LocalPostgres;
use anyhow::{anyhow, Context};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};

/// The sample schema: products and their orders, enough rows for the queries of the banner
/// to do real work.
const SAMPLE_SQL: &str = "
CREATE TABLE products (
    id int PRIMARY KEY,
    name text NOT NULL,
    price numeric(10, 2) NOT NULL
);
INSERT INTO products
    SELECT i, 'product ' || i, round((1 + (i * 37) % 9900 / 100.0)::numeric, 2)
    FROM generate_series(1, 10000) AS i;
CREATE TABLE orders (
    id bigint PRIMARY KEY,
    product_id int NOT NULL REFERENCES products,
    quantity int NOT NULL,
    ordered_at timestamptz NOT NULL
);
INSERT INTO orders
    SELECT i, 1 + (i * 7919) % 10000, 1 + i % 5, '2026-01-01'::timestamptz + i * interval '1 minute'
    FROM generate_series(1, 200000) AS i;
CREATE INDEX orders_product ON orders (product_id);
ANALYZE;
";

/// Loads the sample schema into database `postgres` and pgbench's tables (scale 1).
pub fn load_sample(cluster: &LocalPostgres) -> anyhow::Result<()> {
    cluster.psql("postgres", SAMPLE_SQL)?;
    let out = pgbench(
        cluster.host(),
        cluster.bin_dir(),
        cluster.port(),
        &["-i", "-s", "1", "-q"],
    )?;
    if !out.status.success() {
        return Err(anyhow!(
            "pgbench -i failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// The banner printed once pgmemo listens at `addr` in front of `cluster`.
pub fn banner(addr: SocketAddr, cluster: &LocalPostgres) -> String {
    let (host, port, direct) = (addr.ip(), addr.port(), cluster.port());
    let psql = format!("psql -h {host} -p {port} -U postgres");
    format!(
        "pgmemo is proxying a private PostgreSQL on {addr} (transaction pooling), with a sample \
         schema (products, orders) and pgbench's tables.\n\
         Connect:        {psql} postgres\n\
         Admin console:  {psql} pgmemo\n\
         \n\
         Three things to try:\n\
         1. Statements are prepared once and shared by every client. Run a query twice (psql \
         sends it as text; pgmemo runs it as a prepared statement from the second time), then \
         look at what pgmemo prepared:\n\
         \x20     {psql} postgres -c \"SELECT name, price FROM products WHERE id = 42\" -c \"SELECT name, price FROM products WHERE id = 43\"\n\
         \x20     {psql} pgmemo -c \"SHOW PREPARED_STATEMENTS\" -c \"SHOW AUTOPREPARE\"\n\
         2. Speed against PostgreSQL directly (or start pgmemo with --demo-bench for a 10-second \
         comparison):\n\
         \x20     pgbench -h {host} -p {port} -U postgres -S -c 8 -T 10 postgres      # through pgmemo\n\
         \x20     pgbench -h {host} -p {direct} -U postgres -S -c 8 -T 10 postgres      # directly\n\
         3. The result cache answers hinted reads from memory, until a write to their tables:\n\
         \x20     {psql} postgres -c \"/* pgmemo cache ttl=60s */ SELECT p.name, sum(o.quantity) FROM orders o JOIN products p ON p.id = o.product_id GROUP BY p.name ORDER BY 2 DESC LIMIT 5\"\n\
         \x20     (run it twice: the first run stores the result, the second is answered from \
         memory)\n\
         \x20     {psql} pgmemo -c \"SHOW CACHE\"\n\
         \n\
         Press Ctrl-C to stop; the private PostgreSQL is removed on exit."
    )
}

/// A point read of the sample schema with a cache hint, for `--demo-bench`.
const CACHED_READ: &str = "\\set id random(1, 1000)\n\
    /* pgmemo cache ttl=60s */ SELECT name, price FROM products WHERE id = :id;\n";

/// One `--demo-bench` comparison: what ran, and its TPS through pgmemo and directly.
pub struct Comparison {
    pub what: &'static str,
    pub through: f64,
    pub direct: f64,
}

/// `pgbench -c 8 -j 2 -T 10`, select-only and then a hinted point read (cached by pgmemo),
/// each through pgmemo at `addr` and directly against the private PostgreSQL at `host:port`
/// (whose tools are in `bin_dir`).
pub fn compare(
    host: &str,
    port: u16,
    bin_dir: &Path,
    addr: SocketAddr,
) -> anyhow::Result<Vec<Comparison>> {
    let script = std::env::temp_dir().join(format!("pgmemo-demo-{}.sql", std::process::id()));
    std::fs::write(&script, CACHED_READ).context("writing the pgbench script")?;
    let script_arg = script.to_string_lossy().into_owned();
    let run = |port: u16, workload: &[&str]| -> anyhow::Result<f64> {
        let mut args = vec!["-n", "-c", "8", "-j", "2", "-T", "10"];
        args.extend_from_slice(workload);
        let out = pgbench(host, bin_dir, port, &args)?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("tps = "))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|tps| tps.parse().ok())
            .ok_or_else(|| {
                anyhow!(
                    "pgbench printed no TPS: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )
            })
    };
    let mut out = Vec::new();
    for (what, workload) in [
        ("pgbench -S (select-only, simple protocol)", vec!["-S"]),
        (
            "a hinted point read of products (/* pgmemo cache ttl=60s */)",
            vec!["-f", script_arg.as_str()],
        ),
    ] {
        out.push(Comparison {
            what,
            through: run(addr.port(), &workload)?,
            direct: run(port, &workload)?,
        });
    }
    let _ = std::fs::remove_file(&script);
    Ok(out)
}

fn pgbench(
    host: &str,
    bin_dir: &Path,
    port: u16,
    args: &[&str],
) -> anyhow::Result<std::process::Output> {
    let bin = bin_dir.join("pgbench");
    Command::new(if bin.is_file() { bin } else { "pgbench".into() })
        .args(args)
        .args(["-h", host, "-U", "postgres", "postgres"])
        .arg("-p")
        .arg(port.to_string())
        .env_remove("PGDATABASE")
        .env_remove("PGSERVICE")
        .stdin(Stdio::null())
        .output()
        .context("running pgbench")
}
