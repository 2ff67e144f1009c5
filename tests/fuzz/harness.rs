//! The mutational fuzzer behind `tests/fuzz.rs`: seed corpus, mutations, outcome-guided pool,
//! and the panic and hang checks.

use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Inputs are kept below this size: parsers' limits (10 000-byte startup packets, 64 KiB
/// texts) are reached by length fields and by the lexer's own check, not by huge inputs.
const MAX_INPUT: usize = 16 * 1024;

/// Inputs whose outcome was new, kept to mutate from.
const MAX_POOL: usize = 1024;

/// An input taking longer than this is a hang (bounded work is an invariant of every target).
const HANG: Duration = Duration::from_secs(10);

/// What a target did with an input, reduced to a number: inputs with an outcome not seen
/// before in the run are kept for mutation.
#[derive(Default, Clone, Copy)]
pub struct Outcome(u64);

impl Outcome {
    pub fn of(kind: usize, detail: usize) -> Outcome {
        let mut o = Outcome::default();
        o.add(kind, detail);
        o
    }

    pub fn add(&mut self, kind: usize, detail: usize) {
        self.0 = (self.0 ^ (kind as u64) << 16 ^ detail as u64).wrapping_mul(0x100_0000_01b3);
    }
}

/// xorshift64*: small and deterministic, so a seed replays a run.
pub struct Rng(pub u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

pub fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        v.replace('_', "")
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
    })
}

/// The seed corpus of `corpus`, in name order.
pub fn seeds(corpus: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz/corpus")
        .join(corpus);
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    let seeds: Vec<_> = paths.iter().map(|p| std::fs::read(p).unwrap()).collect();
    assert!(!seeds.is_empty(), "{} has no seeds", dir.display());
    seeds
}

/// Runs `check` on every seed of `corpus` and then on `iterations` mutated inputs
/// (`PGMEMO_FUZZ_ITERATIONS` overrides), failing on the first panic or hang.
pub fn fuzz(
    target: &str,
    corpus: &str,
    dictionary: &[&[u8]],
    iterations: u64,
    mut check: impl FnMut(&[u8]) -> Outcome,
) {
    let iterations = env("PGMEMO_FUZZ_ITERATIONS").unwrap_or(iterations);
    let seed = env("PGMEMO_FUZZ_SEED").unwrap_or_else(|| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        target.hash(&mut h);
        h.finish() | 1
    });
    let mut rng = Rng(seed);
    let mut pool = seeds(corpus);
    let seeded = pool.len();
    let mut seen = std::collections::HashSet::new();

    // A watchdog: an input that does not finish is written out before the run is aborted.
    let current = Arc::new(Mutex::new(Vec::new()));
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let (current, done, stop) = (current.clone(), done.clone(), stop.clone());
        let target = target.to_string();
        std::thread::spawn(move || {
            let mut last = (u64::MAX, Instant::now());
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                let now = done.load(Ordering::Relaxed);
                if now != last.0 {
                    last = (now, Instant::now());
                } else if last.1.elapsed() > HANG {
                    let input = current.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    let path = save(&target, "hang", &input);
                    eprintln!("fuzz {target}: hang on {} (seed {seed})", show(&input));
                    eprintln!("written to {}", path.display());
                    std::process::abort();
                }
            }
        })
    };

    let started = Instant::now();
    let mut input = Vec::new();
    for i in 0..seeded as u64 + iterations {
        if (i as usize) < seeded {
            input.clone_from(&pool[i as usize]);
        } else {
            mutate(&mut rng, &pool, dictionary, &mut input);
        }
        current.lock().unwrap().clone_from(&input);
        match catch_unwind(AssertUnwindSafe(|| check(&input))) {
            Ok(outcome) => {
                if seen.insert(outcome.0) && i as usize >= seeded {
                    if pool.len() < MAX_POOL {
                        pool.push(input.clone());
                    } else {
                        let at = seeded + rng.below(MAX_POOL - seeded);
                        pool[at].clone_from(&input);
                    }
                }
            }
            Err(_) => {
                stop.store(true, Ordering::Relaxed);
                let path = save(target, "crash", &input);
                panic!(
                    "fuzz {target}: input {i} (seed {seed}) panicked: {}\nwritten to {}",
                    show(&input),
                    path.display()
                );
            }
        }
        done.fetch_add(1, Ordering::Relaxed);
    }
    stop.store(true, Ordering::Relaxed);
    watchdog.join().unwrap();
    let secs = started.elapsed().as_secs_f64();
    let total = seeded as u64 + iterations;
    eprintln!(
        "fuzz {target}: {total} inputs in {secs:.1} s ({:.0}/s), {} outcomes, pool {}, seed {seed}",
        total as f64 / secs,
        seen.len(),
        pool.len()
    );
}

/// Writes a failing input under `target/fuzz-crashes/<target>/`.
pub fn save(target: &str, what: &str, input: &[u8]) -> PathBuf {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    input.hash(&mut h);
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target/fuzz-crashes")
        .join(target);
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!("{what}-{:016x}", h.finish()));
    let _ = std::fs::write(&path, input);
    path
}

pub fn show(input: &[u8]) -> String {
    let shown: String = input.escape_ascii().to_string();
    if shown.len() > 2000 {
        format!("{}... ({} bytes)", &shown[..2000], input.len())
    } else {
        format!("b\"{shown}\"")
    }
}

/// `input` with every `from` replaced by `to`.
pub fn replace(input: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(input.len());
    let mut at = 0;
    while at < input.len() {
        if input[at..].starts_with(from) {
            out.extend_from_slice(to);
            at += from.len();
        } else {
            out.push(input[at]);
            at += 1;
        }
    }
    out
}

/// Length-like values that parsers get wrong: zero, just below and above each bound, the
/// sign bit.
const LENGTHS: &[u32] = &[
    0,
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    9,
    16,
    255,
    256,
    9999,
    10000,
    10001,
    0x7fff,
    0x8000,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
];

/// Replaces `input` by a mutation of an input from `pool`: one to four stacked changes.
pub fn mutate(rng: &mut Rng, pool: &[Vec<u8>], dictionary: &[&[u8]], input: &mut Vec<u8>) {
    input.clone_from(&pool[rng.below(pool.len())]);
    for _ in 0..1 + rng.below(4) {
        let len = input.len();
        let at = rng.below(len + 1);
        match rng.below(11) {
            0 if len > 0 => input[at.min(len - 1)] ^= 1 << rng.below(8),
            1 if len > 0 => {
                const BYTES: &[u8] = b"\0\x01\x7f\x80\xff'\"$\\;,=\n ";
                input[at.min(len - 1)] = if rng.below(2) == 0 {
                    BYTES[rng.below(BYTES.len())]
                } else {
                    rng.next() as u8
                };
            }
            2 => {
                for _ in 0..1 + rng.below(4) {
                    input.insert(at, rng.next() as u8);
                }
            }
            3 if len > 0 => {
                let end = (at + 1 + rng.below(16)).min(len);
                input.drain(at.min(len - 1)..end);
            }
            4 if len > 0 => {
                let from = rng.below(len);
                let end = (from + 1 + rng.below(32)).min(len);
                let chunk = input[from..end].to_vec();
                input.splice(at..at, chunk);
            }
            5 => {
                let other = &pool[rng.below(pool.len())];
                if !other.is_empty() {
                    let from = rng.below(other.len());
                    let end = (from + 1 + rng.below(64)).min(other.len());
                    if rng.below(2) == 0 {
                        input.splice(at..at, other[from..end].iter().copied());
                    } else {
                        input.truncate(at);
                        input.extend_from_slice(&other[from..]);
                    }
                }
            }
            6 | 7 if !dictionary.is_empty() => {
                let token = dictionary[rng.below(dictionary.len())];
                if rng.below(2) == 0 || at + token.len() > len {
                    input.splice(at..at, token.iter().copied());
                } else {
                    input[at..at + token.len()].copy_from_slice(token);
                }
            }
            8 if len >= 2 => {
                // A length field: 4 bytes (frames, counts of bytes) or 2 (counts of items).
                let value = match rng.below(3) {
                    0 => LENGTHS[rng.below(LENGTHS.len())],
                    1 => ((len - at) as u32)
                        .wrapping_add(rng.below(9) as u32)
                        .wrapping_sub(4),
                    _ => rng.next() as u32,
                };
                if rng.below(3) == 0 {
                    let at = at.min(len - 2);
                    input[at..at + 2].copy_from_slice(&(value as u16).to_be_bytes());
                } else if len >= 4 {
                    // Most often where a frame's length is: after a tag, or at the start.
                    let at = match rng.below(3) {
                        0 => 0,
                        1 => 1.min(len - 4),
                        _ => at.min(len - 4),
                    };
                    input[at..at + 4].copy_from_slice(&value.to_be_bytes());
                }
            }
            9 => input.truncate(at),
            _ if len > 0 => {
                let b = &mut input[at.min(len - 1)];
                *b = if b.is_ascii_alphabetic() {
                    *b ^ 0x20
                } else {
                    b'0' + rng.below(10) as u8
                };
            }
            _ => input.push(rng.next() as u8),
        }
    }
    input.truncate(MAX_INPUT);
}
