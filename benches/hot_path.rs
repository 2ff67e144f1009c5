//! Micro-benchmarks of the per-message work on pgmemo's hot path, without the noise of sockets
//! and PostgreSQL: framing a pipelined client batch, planning it into the reply queue, and
//! routing the server's replies. Run with `cargo bench --bench hot_path`.

use bytes::BytesMut;
use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use pgmemo::protocol::{backend as be, frame, frontend as fe, put_cstr, write_message};
use pgmemo::replies::{Expected, ReplyQueue};

/// What `pgbench -M prepared -S` sends per transaction: Bind, Execute, Sync.
fn prepared_batch() -> BytesMut {
    let mut out = BytesMut::new();
    write_message(&mut out, fe::BIND, |b| {
        put_cstr(b, b"");
        put_cstr(b, b"P_0");
        b.extend_from_slice(&0i16.to_be_bytes());
        b.extend_from_slice(&1i16.to_be_bytes());
        b.extend_from_slice(&5i32.to_be_bytes());
        b.extend_from_slice(b"12345");
        b.extend_from_slice(&0i16.to_be_bytes());
    });
    write_message(&mut out, fe::EXECUTE, |b| {
        put_cstr(b, b"");
        b.extend_from_slice(&0i32.to_be_bytes());
    });
    fe::sync(&mut out);
    out
}

/// The server's answer: BindComplete, DataRow, CommandComplete, ReadyForQuery.
fn server_reply() -> BytesMut {
    let mut out = BytesMut::new();
    write_message(&mut out, be::BIND_COMPLETE, |_| {});
    be::data_row(&mut out, &[Some("4242")]);
    be::command_complete(&mut out, "SELECT 1");
    be::ready_for_query(&mut out, b'I');
    out
}

fn bench_client_batch(c: &mut Criterion) {
    let batch = prepared_batch();
    let mut group = c.benchmark_group("client batch (Bind/Execute/Sync)");
    group.throughput(Throughput::Elements(3));
    group.bench_function("frame + plan + copy to server buffer", |b| {
        let mut queue = ReplyQueue::new();
        let mut server_wbuf = BytesMut::with_capacity(4096);
        b.iter(|| {
            let mut at = 0;
            while let Ok(Some((tag, len))) = frame(&batch[at..], 64 << 20) {
                if let Some(e) = Expected::for_client_message(tag) {
                    queue.push(e);
                }
                server_wbuf.extend_from_slice(&batch[at..at + len]);
                at += len;
            }
            black_box(&server_wbuf);
            server_wbuf.clear();
            queue.clear();
        })
    });
    group.finish();
}

fn bench_server_reply(c: &mut Criterion) {
    let reply = server_reply();
    let mut group = c.benchmark_group("server reply (BindComplete/DataRow/CommandComplete/RFQ)");
    group.throughput(Throughput::Elements(4));
    group.bench_function("frame + route + copy to client buffer", |b| {
        let mut queue = ReplyQueue::new();
        let mut client_wbuf = BytesMut::with_capacity(4096);
        b.iter(|| {
            for e in [Expected::Bind, Expected::Execute, Expected::Sync] {
                queue.push(e);
            }
            let mut at = 0;
            while let Ok(Some((tag, len))) = frame(&reply[at..], 1 << 30) {
                let route = queue.on_server_message(tag);
                black_box(route);
                client_wbuf.extend_from_slice(&reply[at..at + len]);
                at += len;
            }
            assert!(queue.is_empty());
            black_box(&client_wbuf);
            client_wbuf.clear();
        })
    });
    group.finish();
}

fn bench_parse_rename(c: &mut Criterion) {
    let mut msg = BytesMut::new();
    write_message(&mut msg, fe::PARSE, |b| {
        put_cstr(b, b"P_0");
        put_cstr(b, b"SELECT abalance FROM pgbench_accounts WHERE aid = $1;");
        b.extend_from_slice(&0i16.to_be_bytes());
    });
    c.bench_function("Parse: decode and re-encode under a server name", |b| {
        let mut out = BytesMut::with_capacity(256);
        b.iter(|| {
            let p = fe::Parse::parse(&msg[5..]).expect("valid");
            p.encode(b"pgmemo_s1", &mut out);
            black_box(&out);
            out.clear();
        })
    });
}

criterion_group!(
    benches,
    bench_client_batch,
    bench_server_reply,
    bench_parse_rename
);
criterion_main!(benches);
