//! What the test process (pgmemo runs in it) holds in memory, and its file limit: for the tests
//! that bound pgmemo's memory under load.

/// This process's resident set size (`VmRSS`) or peak (`VmHWM`) in KiB.
pub fn proc_status_kib(field: &str) -> u64 {
    process_status_kib("self", field)
}

/// A field of `/proc/<pid>/status` in KiB (`pid` a number, or `self`).
pub fn process_status_kib(pid: &str, field: &str) -> u64 {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in {path}"))
}

/// Bytes of heap in use, in KiB: glibc's `mallinfo2()`, small chunks in use (`uordblks`) plus
/// the large ones it maps on their own (`hblkhd`: a buffer that grew to megabytes is one).
/// Unlike VmRSS it does not grow when already allocated memory is first touched, such as the
/// 64 KiB read buffer of every `RawClient` filling up over the rounds.
pub fn heap_in_use_kib() -> u64 {
    // SAFETY: mallinfo2 only reads the allocator's statistics.
    let info = unsafe { libc::mallinfo2() };
    (info.uordblks + info.hblkhd) as u64 / 1024
}

pub fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Raises the soft RLIMIT_NOFILE so that both ends of every client connection fit.
pub fn raise_nofile(needed: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed by pointer.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        if lim.rlim_cur < needed {
            lim.rlim_cur = needed.min(lim.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        }
    }
    assert!(
        lim.rlim_cur >= needed,
        "RLIMIT_NOFILE is {} (hard {}); this test needs {needed} file descriptors",
        lim.rlim_cur,
        lim.rlim_max
    );
}
