//! quick_cache against moka for the result cache's store (`cargo bench --bench cache_store`):
//! the same workload on each, weighted by bytes with a memory limit, from 2 threads (this
//! machine's cores): a zipf-like hot set of gets (hits) with inserts on misses, and a stream
//! of distinct inserts (all misses, constant eviction). Prints ns per operation per thread and
//! the weight held against the limit. The figures chose quick_cache (see src/cache/mod.rs).

use std::sync::Arc;
use std::time::Instant;

const THREADS: usize = 2;
/// Operations per thread; `cargo test --all-targets` runs this file too (without `--bench`),
/// then only a few, as a smoke test.
fn ops() -> usize {
    if std::env::args().any(|a| a == "--bench") {
        1_000_000
    } else {
        1_000
    }
}
const LIMIT: u64 = 16 * 1024 * 1024;
const VALUE: usize = 100;

trait Store: Send + Sync {
    fn get(&self, key: &[u8]) -> Option<Arc<Vec<u8>>>;
    fn insert(&self, key: Box<[u8]>, value: Arc<Vec<u8>>);
    fn weight(&self) -> u64;
}

#[derive(Clone)]
struct Weight;

impl quick_cache::Weighter<Box<[u8]>, Arc<Vec<u8>>> for Weight {
    fn weight(&self, key: &Box<[u8]>, value: &Arc<Vec<u8>>) -> u64 {
        (key.len() + value.len() + 64) as u64
    }
}

struct Quick(quick_cache::sync::Cache<Box<[u8]>, Arc<Vec<u8>>, Weight>);

impl Store for Quick {
    fn get(&self, key: &[u8]) -> Option<Arc<Vec<u8>>> {
        self.0.get(key)
    }
    fn insert(&self, key: Box<[u8]>, value: Arc<Vec<u8>>) {
        self.0.insert(key, value)
    }
    fn weight(&self) -> u64 {
        self.0.weight()
    }
}

struct Moka(moka::sync::Cache<Box<[u8]>, Arc<Vec<u8>>>);

impl Store for Moka {
    fn get(&self, key: &[u8]) -> Option<Arc<Vec<u8>>> {
        self.0.get(key)
    }
    fn insert(&self, key: Box<[u8]>, value: Arc<Vec<u8>>) {
        self.0.insert(key, value)
    }
    fn weight(&self) -> u64 {
        self.0.run_pending_tasks();
        self.0.weighted_size()
    }
}

/// A key of about the size of a result cache key (context + text + values).
fn key(n: u64) -> Box<[u8]> {
    format!("pgbench\0postgres\0ISO, MDY\0postgres\0UTC\0UTF8\0on\0\0\0SELECT abalance FROM pgbench_accounts WHERE aid = $1\0{n}")
        .into_bytes()
        .into_boxed_slice()
}

/// Skewed keys: n^2 over a uniform draw, cheaply (xorshift), so small keys are hot.
fn hot(state: &mut u64, range: u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    let u = (*state % 1_000_000) as f64 / 1_000_000.0;
    (u * u * u * range as f64) as u64
}

fn run(name: &str, store: Arc<dyn Store>, distinct: bool) {
    let value = Arc::new(vec![7u8; VALUE]);
    let start = Instant::now();
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let store = store.clone();
            let value = value.clone();
            let ops = ops();
            std::thread::spawn(move || {
                let mut state = 0x9e3779b97f4a7c15u64 ^ (t as u64 + 1);
                let mut hits = 0u64;
                for i in 0..ops {
                    let n = if distinct {
                        (t * ops + i) as u64
                    } else {
                        hot(&mut state, 1_000_000)
                    };
                    let k = key(n);
                    if store.get(&k).is_some() {
                        hits += 1;
                    } else {
                        store.insert(k, value.clone());
                    }
                }
                hits
            })
        })
        .collect();
    let hits: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let elapsed = start.elapsed();
    println!(
        "{name:<12} {:<9} {:>6.0} ns/op/thread  hit ratio {:>5.1}%  weight {:.1} MiB of {:.0}",
        if distinct { "distinct" } else { "hot" },
        elapsed.as_nanos() as f64 / ops() as f64,
        100.0 * hits as f64 / (THREADS * ops()) as f64,
        store.weight() as f64 / 1048576.0,
        LIMIT as f64 / 1048576.0
    );
}

// moka's weigher is a closure over the key type itself.
#[allow(clippy::borrowed_box)]
fn weigh(k: &Box<[u8]>, v: &Arc<Vec<u8>>) -> u32 {
    (k.len() + v.len() + 64) as u32
}

fn main() {
    for distinct in [false, true] {
        let quick = Quick(quick_cache::sync::Cache::with_weighter(
            100_000, LIMIT, Weight,
        ));
        run("quick_cache", Arc::new(quick), distinct);
        let moka = Moka(
            moka::sync::Cache::builder()
                .max_capacity(LIMIT)
                .weigher(weigh)
                .build(),
        );
        run("moka", Arc::new(moka), distinct);
    }
}
