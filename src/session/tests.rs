//! The session's unit tests: what its small parts answer, and the size of what every idle
//! client keeps.

#[cfg(test)]
mod readable_at {
    use super::super::{Readable, ReadableAt};

    #[test]
    fn an_answer_holds_for_its_settings_version_only() {
        assert_eq!(ReadableAt::default().at(0), None, "never worked out");
        for version in [0, 1, 41, u64::MAX >> 3] {
            for (standard_strings, autoprepare) in
                [(false, false), (false, true), (true, false), (true, true)]
            {
                let answer = Readable {
                    standard_strings,
                    autoprepare,
                };
                let known = ReadableAt::new(version, answer);
                assert_eq!(known.at(version), Some(answer));
                assert_eq!(known.at(version + 1), None);
                assert_eq!(known.at(version.wrapping_sub(1)), None);
            }
        }
    }
}

#[cfg(test)]
mod footprint {
    use super::super::*;
    use std::mem::size_of;

    /// The size of what `f` returns (a future, for an async fn).
    fn returned<A, B, F>(_: fn(A, B) -> F) -> usize {
        size_of::<F>()
    }

    /// An idle client is mostly these allocations (plus tokio's task cell and socket
    /// registration): each stays within an allocator size class (mimalloc's 224, 256 and 640
    /// bytes), so that the memory per idle client does not creep. A field that crosses a
    /// class costs every client the class step (32 to 128 bytes): put rare state behind a box.
    #[test]
    fn an_idle_clients_allocations_stay_in_their_size_classes() {
        assert!(
            size_of::<Session>() <= 640,
            "Session is {} bytes",
            size_of::<Session>()
        );
        let task = returned(crate::connection::serve_client);
        assert!(task <= 256, "the session's task future is {task} bytes");
        // An Arc's allocation: two counts and the value.
        let info = 16 + size_of::<crate::app::ClientInfo>();
        assert!(info <= 224, "ClientInfo's Arc is {info} bytes");
    }
}

#[cfg(test)]
mod reset_query {
    use super::super::is_discard_all;

    #[test]
    fn discard_all_is_recognized_however_it_is_spelt() {
        for yes in ["DISCARD ALL", "discard all;", " /* reset */ Discard\n ALL "] {
            assert!(is_discard_all(yes), "{yes}");
        }
        for no in [
            "",
            "DISCARD PLANS",
            "RESET ALL",
            "DISCARD ALL; SELECT 1",
            "DEALLOCATE ALL",
        ] {
            assert!(!is_discard_all(no), "{no}");
        }
    }
}

#[cfg(test)]
mod writes {
    use super::super::poll_write_some;
    use crate::stream::Stream;
    use bytes::BytesMut;
    use std::future::poll_fn;
    use std::task::Poll;
    use tokio::io::AsyncReadExt;

    /// A write the socket cannot take at once (the peer not reading yet) leaves the rest in
    /// the buffer and wakes the task when the socket drains: the unpolled first try must not
    /// lose the wake-up, or the task would hang here.
    #[tokio::test]
    async fn a_write_that_would_block_resumes_when_the_peer_reads() {
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let mut stream = Stream::Unix(Box::new(ours));
        let sent: Vec<u8> = (0..4 << 20).map(|i: u32| (i % 251) as u8).collect();
        let mut buf = BytesMut::from(&sent[..]);
        poll_fn(|cx| Poll::Ready(poll_write_some(&mut stream, &mut buf, cx)))
            .await
            .unwrap();
        assert!(!buf.is_empty(), "a socket pair does not take 4 MiB at once");
        let reader = tokio::spawn(async move {
            let mut theirs = theirs;
            let mut got = vec![0; 4 << 20];
            theirs.read_exact(&mut got).await.unwrap();
            got
        });
        let written = poll_fn(|cx| match poll_write_some(&mut stream, &mut buf, cx) {
            Err(e) => Poll::Ready(Err(e)),
            Ok(()) if buf.is_empty() => Poll::Ready(Ok(())),
            Ok(()) => Poll::Pending,
        });
        tokio::time::timeout(std::time::Duration::from_secs(30), written)
            .await
            .expect("the writer was woken as the peer read")
            .unwrap();
        assert!(reader.await.unwrap() == sent, "every byte, in order");
    }
}

mod own_loop {
    use super::super::single_threaded_runtime;

    /// The client's registration is trusted to stay (`Session::client_on_own_loop`) only on
    /// a single-threaded runtime: on a multi-threaded one the I/O driver may run on another
    /// thread between marking the socket readable and taking its waker.
    #[test]
    fn only_a_single_threaded_runtime_runs_its_driver_between_polls() {
        let single = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        assert!(single.block_on(async { single_threaded_runtime() }));
        let multi = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_io()
            .build()
            .unwrap();
        assert!(!multi.block_on(async { single_threaded_runtime() }));
        assert!(
            !multi
                .block_on(async { tokio::spawn(async { single_threaded_runtime() }).await })
                .unwrap(),
            "in a task of a multi-threaded runtime"
        );
        assert!(!single_threaded_runtime(), "outside any runtime");
    }
}
