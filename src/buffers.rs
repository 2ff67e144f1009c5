//! Buffers lent to client connections only while bytes are in flight.
//!
//! Thousands of idle clients are normal behind a pooler. A client that holds its own 8 KiB
//! read buffer (and a write buffer) while it waits for its next query costs memory for
//! nothing, so a plain-TCP client holds no buffer when idle: it waits for its socket to become
//! readable without one, borrows a buffer from this thread's free list to read, and gives it
//! back once everything it read was handled and everything it was sent went out. Borrowing is
//! a pop and a push on a thread-local list, not an allocation, so the hot path stays
//! allocation-free once warm.

use bytes::BytesMut;
use std::cell::RefCell;

/// The size a lent buffer starts with.
pub const SIZE: usize = 8 * 1024;

/// Buffers that grew past this (a large row, a big COPY) are freed rather than kept.
const MAX_KEPT_CAPACITY: usize = 64 * 1024;

/// At most this many free buffers are kept per thread (8 MiB of 8 KiB buffers): enough for
/// the connections that are busy at once; more would only hold memory after a burst.
const MAX_FREE: usize = 1024;

thread_local! {
    static FREE: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
}

/// Drops the first `n` bytes of `buf`, handled or written. All of them, as mostly (a read's
/// last message, a whole write): the buffer is emptied where it stands, which costs less than
/// moving its start (BytesMut's advance keeps the offset in its pointer word: ~20
/// instructions a call, four to six calls a transaction, callgrind) and leaves its whole room
/// to the next read without a reclaim.
#[inline(always)]
pub fn consume(buf: &mut BytesMut, n: usize) {
    if n == buf.len() {
        buf.clear();
    } else {
        bytes::Buf::advance(buf, n);
    }
}

/// Appends `src` to `out`, as `extend_from_slice` does. A message of 4 to 16 bytes (most
/// replies: BindComplete, CommandComplete, ReadyForQuery, a short row) is copied as two
/// overlapping words, without the call to memcpy that a copy of a length unknown to the
/// compiler makes (a relayed reply cost ~45 instructions so, four a `pgbench -S` transaction,
/// callgrind).
#[inline(always)]
pub fn append(out: &mut BytesMut, src: &[u8]) {
    let n = src.len();
    if !(4..=16).contains(&n) {
        out.extend_from_slice(src);
        return;
    }
    out.reserve(n);
    let len = out.len();
    let spare = &mut out.spare_capacity_mut()[..n];
    if n >= 8 {
        write_word::<8>(&mut spare[..8], &src[..8]);
        write_word::<8>(&mut spare[n - 8..], &src[n - 8..]);
    } else {
        write_word::<4>(&mut spare[..4], &src[..4]);
        write_word::<4>(&mut spare[n - 4..], &src[n - 4..]);
    }
    // SAFETY: the two words written above cover the n bytes after `len` (n is at most two
    // words, and each word is at least half of n), within the capacity reserved.
    unsafe { out.set_len(len + n) };
}

/// The first `W` bytes of `src` into the first `W` of `dst`: one load and one store.
#[inline(always)]
fn write_word<const W: usize>(dst: &mut [std::mem::MaybeUninit<u8>], src: &[u8]) {
    let word: [u8; W] = src[..W].try_into().expect("W bytes");
    for (d, b) in dst[..W].iter_mut().zip(word) {
        d.write(b);
    }
}

/// Gives `buf` a buffer if it has none (capacity 0). The test is inlined, the lending not:
/// most calls find a buffer there, and a call costs more than the test (callgrind).
#[inline(always)]
pub fn lend(buf: &mut BytesMut) {
    if buf.capacity() == 0 {
        lend_one(buf);
    }
}

#[inline(never)]
fn lend_one(buf: &mut BytesMut) {
    FREE.with(|free| lend_from(&mut free.borrow_mut(), buf));
}

/// [`lend`] for a client's two buffers at once: one visit to the free list, where one for
/// each cost ~40 instructions more a transaction (callgrind).
#[inline(always)]
pub fn lend_both(read: &mut BytesMut, write: &mut BytesMut) {
    if read.capacity() == 0 || write.capacity() == 0 {
        lend_two(read, write);
    }
}

// The loop is written out here and in `take_back_two`: one helper taking the test and the
// action as function pointers left them uninlined (+100 instructions a transaction).
#[inline(never)]
fn lend_two(read: &mut BytesMut, write: &mut BytesMut) {
    FREE.with(|free| {
        let mut free = free.borrow_mut();
        for buf in [read, write] {
            if buf.capacity() == 0 {
                lend_from(&mut free, buf);
            }
        }
    });
}

fn lend_from(free: &mut Vec<BytesMut>, buf: &mut BytesMut) {
    *buf = free.pop().unwrap_or_else(|| BytesMut::with_capacity(SIZE));
}

/// Takes back the buffers of a client's `read` and `write` that are empty, leaving them
/// without one: both in one visit to the free list (see [`lend_both`]). The test is inlined,
/// as [`lend`]'s.
#[inline(always)]
pub fn take_back_both(read: &mut BytesMut, write: &mut BytesMut) {
    if (read.is_empty() && read.capacity() != 0) || (write.is_empty() && write.capacity() != 0) {
        take_back_two(read, write);
    }
}

#[inline(never)]
fn take_back_two(read: &mut BytesMut, write: &mut BytesMut) {
    FREE.with(|free| {
        let mut free = free.borrow_mut();
        for buf in [read, write] {
            if buf.is_empty() && buf.capacity() != 0 {
                give_back(&mut free, buf);
            }
        }
    });
}

fn give_back(free: &mut Vec<BytesMut>, buf: &mut BytesMut) {
    let mut returned = std::mem::take(buf);
    if returned.capacity() > MAX_KEPT_CAPACITY {
        return;
    }
    // Whole again: reading advances the start of a buffer; reclaiming moves it back without
    // allocating. One that cannot hold SIZE that way (a small one from login) is freed.
    returned.clear();
    if !returned.try_reclaim(SIZE) {
        return;
    }
    if free.len() < MAX_FREE {
        free.push(returned);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_is_extend_from_slice() {
        let src: Vec<u8> = (1..=40).collect();
        for before in [0, 1, 3, 8, 8190] {
            for n in 0..=40 {
                let mut appended = BytesMut::with_capacity(8);
                appended.extend_from_slice(&vec![0xee; before]);
                let mut extended = appended.clone();
                append(&mut appended, &src[..n]);
                extended.extend_from_slice(&src[..n]);
                assert_eq!(appended, extended, "{before} bytes, then {n}");
                // And again, at an offset that leaves room behind.
                append(&mut appended, &src[40 - n..]);
                extended.extend_from_slice(&src[40 - n..]);
                assert_eq!(appended, extended, "{before} bytes, {n}, then {n} more");
            }
        }
    }

    #[test]
    fn lends_and_takes_back_the_same_memory() {
        let mut buf = BytesMut::new();
        lend(&mut buf);
        assert!(buf.capacity() >= SIZE);
        buf.extend_from_slice(b"pending");
        take_back_both(&mut buf, &mut BytesMut::new());
        assert_eq!(&buf[..], b"pending", "a buffer with bytes in it stays");
        let address = buf.as_ptr();
        bytes::Buf::advance(&mut buf, 3); // read and handled: the start moved
        buf.clear();
        take_back_both(&mut buf, &mut BytesMut::new());
        assert_eq!(buf.capacity(), 0);
        lend(&mut buf);
        assert_eq!(
            buf.as_ptr(),
            address,
            "the free list hands the buffer out again"
        );
        assert!(buf.is_empty());
    }

    /// A client's two buffers go back and are lent again together, as each alone would.
    #[test]
    fn both_buffers_at_once() {
        let (mut read, mut write) = (BytesMut::new(), BytesMut::new());
        lend_both(&mut read, &mut write);
        assert!(read.capacity() >= SIZE && write.capacity() >= SIZE);
        assert_ne!(read.as_ptr(), write.as_ptr());
        write.extend_from_slice(b"unsent");
        take_back_both(&mut read, &mut write);
        assert_eq!(
            (read.capacity(), &write[..]),
            (0, &b"unsent"[..]),
            "only the empty one"
        );
        let kept = FREE.with(|free| free.borrow().len());
        write.clear();
        take_back_both(&mut read, &mut write);
        assert_eq!(write.capacity(), 0);
        assert_eq!(FREE.with(|free| free.borrow().len()), kept + 1);
        lend_both(&mut read, &mut write);
        assert!(read.capacity() >= SIZE && write.capacity() >= SIZE);
        assert_eq!(FREE.with(|free| free.borrow().len()), kept - 1);
    }

    #[test]
    fn small_and_grown_buffers_are_freed_not_kept() {
        let mut small = BytesMut::with_capacity(SIZE / 8);
        take_back_both(&mut small, &mut BytesMut::new());
        assert_eq!(small.capacity(), 0);
        assert!(FREE.with(|free| free.borrow().is_empty()));
        let mut big = BytesMut::with_capacity(MAX_KEPT_CAPACITY * 2);
        take_back_both(&mut big, &mut BytesMut::new());
        assert_eq!(big.capacity(), 0);
        // Not kept for the next lend. (Comparing the next lent buffer's address with the big
        // one's failed now and then: the allocator may hand the freed memory out again.)
        assert!(FREE.with(|free| free.borrow().is_empty()));
    }
}
