//! `cache.mode = "auto"`: pgmemo chooses what to cache itself, beyond the rules and hints.
//! Once a second (the janitor's round, [`ResultCache::choose_automatically`]) it ranks the
//! read shapes of simple queries and prepared statements that the cache may keep (the
//! analysis found a plain read) by their estimated time on the server (SHOW QUERIES'
//! `total_server_ms`: a measured mean
//! times the calls that ran there) and chooses the costliest, at most [`MAX_CHOSEN`] at a
//! time; a shape is a candidate once it was called [`MIN_CALLS`] times and its time was
//! measured. A chosen shape whose lookups keep missing (its tables written too often for
//! its entries to live: a hit ratio under [`RETIRE_RATIO`] over [`RETIRE_LOOKUPS`] lookups)
//! is retired and not chosen again until its figures are reset (a RELOAD that changes
//! `autoprepare_max_shapes` starts the shape table afresh). Rules and hints come first: a
//! rule's settings win, and `/* pgmemo nocache */` keeps a query out. Auto mode needs WAL
//! invalidation (the configuration refuses it otherwise): nobody wrote a rule for these
//! queries, so any writer of their tables may be one pgmemo does not see.
//!
//! Entries the cache stores for auto mode's choice live `default_ttl`, within `max_memory`
//! like every other, counted as the rule `(auto)`.

use super::ResultCache;
use crate::query::shapes::Shape;
use std::sync::atomic::Ordering::Relaxed;

/// The rule counters of auto mode's choices (after the configured rules and the hints').
pub const AUTO: &str = "(auto)";

/// A shape's state in auto mode (`ShapeStats::auto`).
pub const UNCHOSEN: u8 = 0;
pub const CHOSEN: u8 = 1;
pub const RETIRED: u8 = 2;

/// Shapes chosen at once, at most.
pub const MAX_CHOSEN: usize = 64;
/// Calls before a shape is a candidate: a query run once is nothing to reuse.
pub const MIN_CALLS: u64 = 3;
/// Lookups of a chosen shape before its hit ratio is judged, and the ratio under which it
/// is retired.
pub const RETIRE_LOOKUPS: u64 = 50;
pub const RETIRE_RATIO: f64 = 0.2;

/// Whether auto mode chose `shape`.
#[inline]
pub fn chosen(shape: &Shape) -> bool {
    shape.stats.auto.load(Relaxed) == CHOSEN
}

/// Why auto mode chose or retired `shape`, for SHOW QUERIES (None: it did neither).
pub fn state(shape: &Shape) -> Option<&'static str> {
    match shape.stats.auto.load(Relaxed) {
        CHOSEN => Some("chosen: among the costliest reads on the server"),
        RETIRED => Some("retired: its hit ratio stayed low (tables written too often)"),
        _ => None,
    }
}

impl ResultCache {
    /// One round of auto mode: retires the chosen shapes that do not pay, then chooses the
    /// costliest candidates while there is room. Nothing when the cache is off or not in
    /// auto mode.
    pub fn choose_automatically(&self) {
        let config = self.config.load();
        if !config.enabled || config.mode != crate::config::cache::CacheMode::Auto {
            return;
        }
        let mut chosen = 0;
        let mut candidates = Vec::new();
        for shape in self.shapes.iter() {
            let s = &shape.stats;
            match s.auto.load(Relaxed) {
                CHOSEN if pays_not(&shape) => s.auto.store(RETIRED, Relaxed),
                CHOSEN => chosen += 1,
                RETIRED => {}
                _ if is_candidate(&shape) => candidates.push((s.total_us(), shape)),
                _ => {}
            }
        }
        candidates.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (_, shape) in candidates
            .into_iter()
            .take(MAX_CHOSEN.saturating_sub(chosen))
        {
            shape.stats.auto.store(CHOSEN, Relaxed);
        }
    }
}

/// A read the cache may keep, called often enough, whose server time was measured.
fn is_candidate(shape: &Shape) -> bool {
    let s = &shape.stats;
    !shape.is_raw()
        && shape.analysis().is_some_and(|a| a.read.is_ok())
        && s.calls.load(Relaxed) >= MIN_CALLS
        && s.timed.load(Relaxed) > 0
}

/// A chosen shape whose lookups mostly miss.
fn pays_not(shape: &Shape) -> bool {
    let Some(c) = shape.stats.cache.get() else {
        return false;
    };
    let hits = c.hits.get() + c.raw_hits.get();
    let lookups = hits + c.misses.get();
    lookups >= RETIRE_LOOKUPS && (hits as f64) < RETIRE_RATIO * lookups as f64
}
