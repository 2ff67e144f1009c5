//! Micro-benchmarks of the per-message work on pgmemo's hot path, without the noise of sockets
//! and PostgreSQL. Run with `cargo bench --bench hot_path`.
//!
//! - `session: ...` groups: pgmemo's own session code (`pgmemo::session::BenchSession`, a
//!   session driven by hand) on what `pgbench -M prepared -S` sends per transaction once its
//!   statement is prepared: Bind of `P_0`, Execute, Sync. The session frames the client's
//!   input, plans each message (the client's statement map, the rename to `pgmemo_s<n>`, the
//!   server's LRU, the reply queue) and copies it into the server's write buffer; in the round
//!   trips it also routes the server's replies into the client's write buffer. The server and
//!   client connections are the two ends of one loopback socket; nothing is ever written to
//!   it (the write buffers are cleared instead). The client-only group then drops the
//!   replies still expected (`BenchSession::forget_replies`) instead of routing them; the
//!   "not on server" variants first take `P_0` off the server's set (`ServerSet::remove`).
//!   Both are inside the timings.
//! - **No lock**: while those groups run, another thread holds every lock the session could
//!   reach: the app's (pools map, exclusively; clients; cancel keys; listen address; reloader;
//!   the statement registry's contexts), the pool's (state, servers, defaults, normalized
//!   parameters; its settings are read without a lock), the client's `ClientInfo` (application_name, server) and the
//!   statement's own. pgmemo's locks are `parking_lot` ones, which are not reentrant: had the
//!   measured code taken any of them, the benchmark would wait forever instead of reporting.
//!   The session is in session mode: in transaction mode it would also give the server back
//!   to the pool after each ReadyForQuery and take one before the next Bind, which is not
//!   measured here and does take the pool's lock (once each way, see src/pool.rs).
//! - **Allocations**: a counting global allocator reports the allocations per batch of each
//!   session benchmark, after warm-up, before criterion's own report: none with `P_0` on the
//!   server; one without (the node of the server's LRU for `P_0`, in `ServerSet::insert`).
//! - `autoprepare: ...` groups: the lexer's pass over a simple query's text (generalization,
//!   shape hash, literal values), and the whole hot path of an autoprepared query before it
//!   is written to a server: the pass, the shape lookup, the statement's text and types, the
//!   client's statement map, and the Bind with the literals' values. Allocations per query
//!   are counted as for the session groups (none once the buffers are warm).
//! - The other groups time the framing and reply-queue steps alone.

use bytes::BytesMut;
use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use pgmemo::app::{App, ClientInfo};
use pgmemo::config::{Config, PoolMode, Upstream};
use pgmemo::pool::Pool;
use pgmemo::protocol::{backend as be, frame, frontend as fe, put_cstr, write_message};
use pgmemo::replies::{Expected, ReplyQueue};
use pgmemo::server::ServerConn;
use pgmemo::session::{BenchSession, ClientConn};
use pgmemo::statements::Statement;
use pgmemo::stream::Stream;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::{mpsc, Arc};

/// The system allocator, counting each thread's allocations (and reallocations) to show
/// that the hot path makes none. Per thread, so that the lock holder's allocations (it may
/// make some as it starts waiting) are not counted against the session.
struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn count_allocation() {
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_allocation();
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count_allocation();
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_allocation();
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

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

/// The query of pgbench's `-S` script, as pgbench prepares it as `P_0`.
const SELECT_ONLY: &[u8] = b"SELECT abalance FROM pgbench_accounts WHERE aid = $1;";

/// A session in session mode holding a server, with `P_0` parsed by the client and prepared
/// on the server, as after pgbench's first transaction. The runtime owns the sockets.
struct Fixture {
    _runtime: tokio::runtime::Runtime,
    app: Arc<App>,
    pool: Arc<Pool>,
    info: Arc<ClientInfo>,
    session: BenchSession,
    /// `P_0`'s statement.
    statement: Arc<Statement>,
}

fn fixture() -> Fixture {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .expect("runtime");
    let (server_end, client_end) = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        let (connected, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        (connected.expect("connect"), accepted.expect("accept").0)
    });
    // No server is ever connected to: the session gets the connection above.
    let mut config = Config::for_upstream(Upstream {
        host: "127.0.0.1".into(),
        port: 1,
        user: "bench".into(),
        password: None,
        ..Default::default()
    });
    // Session mode keeps the server; its statements are shared as in transaction mode, so the
    // planner's hot path is what is measured.
    config.general.pool_mode = PoolMode::Session;
    config.general.session_shared_statements = true;
    let app = App::new(config).expect("app");
    let pool = app.pool("bench", "bench").expect("pool");
    let info = app.register_client(
        client_end.peer_addr().expect("address"),
        client_end.local_addr().expect("address"),
        false,
        "bench",
        "bench",
    );
    let client = ClientConn::new(Stream::Tcp(client_end), BytesMut::with_capacity(8192));
    let server = ServerConn::over(Stream::Tcp(server_end)).expect("server connection");
    let mut session = BenchSession::new(app.clone(), info.clone(), pool.clone(), client, server);

    // pgbench's first transaction: Parse P_0, Bind, Execute, Sync, and the server's answers.
    let mut first = BytesMut::new();
    write_message(&mut first, fe::PARSE, |b| {
        put_cstr(b, b"P_0");
        put_cstr(b, SELECT_ONLY);
        b.extend_from_slice(&0i16.to_be_bytes());
    });
    first.extend_from_slice(&prepared_batch());
    session.client_input().extend_from_slice(&first);
    session.client_messages();
    assert!(
        session.server().wbuf.starts_with(b"P"),
        "P_0 parsed on the server"
    );
    session.server().wbuf.clear();
    let mut answer = BytesMut::new();
    write_message(&mut answer, be::PARSE_COMPLETE, |_| {});
    answer.extend_from_slice(&server_reply());
    session.server().rbuf.extend_from_slice(&answer);
    session.server_messages();
    assert_eq!(
        &session.client_output()[..],
        &answer[..],
        "replies passed on"
    );
    session.client_output().clear();
    let statement = session
        .statements()
        .and_then(|s| s.get(b"P_0"))
        .expect("P_0 known")
        .clone();
    assert!(session.server().prepared.has_current(&statement));
    Fixture {
        _runtime: runtime,
        app,
        pool,
        info,
        session,
        statement,
    }
}

/// Every lock the session could reach, held by another thread until dropped.
struct HeldLocks {
    release: Option<mpsc::Sender<()>>,
    holder: Option<std::thread::JoinHandle<()>>,
}

fn hold_every_lock(f: &Fixture) -> HeldLocks {
    let (app, pool, info, statement) = (
        f.app.clone(),
        f.pool.clone(),
        f.info.clone(),
        f.statement.clone(),
    );
    let (held_tx, held) = mpsc::channel();
    let (release, released) = mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        let _app = app.hold_locks();
        let _pool = pool.hold_locks();
        let _application_name = info.application_name.lock();
        let _server = info.server.lock();
        let _statement = statement.hold_lock();
        held_tx.send(()).expect("bench thread waits");
        let _ = released.recv();
    });
    held.recv().expect("locks taken");
    // Taken indeed, by someone else.
    assert!(f.info.server.try_lock().is_none());
    assert!(f.app.listen_addr.try_lock().is_none());
    HeldLocks {
        release: Some(release),
        holder: Some(holder),
    }
}

impl Drop for HeldLocks {
    fn drop(&mut self) {
        drop(self.release.take());
        if let Some(holder) = self.holder.take() {
            holder.join().expect("lock holder");
        }
    }
}

/// Allocations per run of `batch` once warm (on this thread).
fn allocations_per_batch(mut batch: impl FnMut()) -> f64 {
    for _ in 0..1000 {
        batch();
    }
    const RUNS: u64 = 10_000;
    let before = ALLOCATIONS.with(Cell::get);
    for _ in 0..RUNS {
        batch();
    }
    (ALLOCATIONS.with(Cell::get) - before) as f64 / RUNS as f64
}

fn bench_session(c: &mut Criterion) {
    let mut f = fixture();
    let batch = prepared_batch();
    let reply = server_reply();
    let mut miss_reply = BytesMut::new();
    write_message(&mut miss_reply, be::PARSE_COMPLETE, |_| {});
    miss_reply.extend_from_slice(&reply);
    let statement = f.statement.clone();

    // The client's batch only; its replies are then forgotten rather than routed.
    let client_batch = |s: &mut BenchSession| {
        s.client_input().extend_from_slice(&batch);
        s.client_messages();
        black_box(&s.server().wbuf);
        s.forget_replies();
    };
    // The batch and the server's answers.
    let round_trip = |s: &mut BenchSession, answers: &[u8]| {
        s.client_input().extend_from_slice(&batch);
        s.client_messages();
        black_box(&s.server().wbuf);
        s.server().wbuf.clear();
        s.server().rbuf.extend_from_slice(answers);
        s.server_messages();
        black_box(&s.client_output());
        s.client_output().clear();
    };
    // The server loses P_0 (as if another client's statements had evicted it).
    let unprepare = |s: &mut BenchSession| {
        s.server().prepared.remove(&statement);
    };

    // What reaches the server: P_0 under its server name, with its Parse when missing.
    let session = &mut f.session;
    session.client_input().extend_from_slice(&batch);
    session.client_messages();
    let sent = session.server().wbuf.clone();
    assert_eq!(sent[0], fe::BIND);
    let server_name = statement.server_name.as_bytes();
    assert!(sent.windows(server_name.len()).any(|w| w == server_name));
    session.forget_replies();
    unprepare(session);
    session.client_input().extend_from_slice(&batch);
    session.client_messages();
    assert_eq!(session.server().wbuf[0], fe::PARSE);
    session.forget_replies();

    let held = hold_every_lock(&f);
    let session = &mut f.session;
    let allocations = [
        ("hit", allocations_per_batch(|| client_batch(session))),
        (
            "miss",
            allocations_per_batch(|| {
                unprepare(session);
                client_batch(session)
            }),
        ),
        (
            "round trip hit",
            allocations_per_batch(|| round_trip(session, &reply)),
        ),
        (
            "round trip miss",
            allocations_per_batch(|| {
                unprepare(session);
                round_trip(session, &miss_reply)
            }),
        ),
    ];
    for (what, n) in allocations {
        println!("session, {what}: {n} allocations per batch (with every lock held elsewhere)");
    }

    let mut group = c.benchmark_group("session: Bind/Execute/Sync");
    group.throughput(Throughput::Elements(3));
    group.bench_function("P_0 prepared on this server", |b| {
        b.iter(|| client_batch(session))
    });
    group.bench_function("P_0 not on this server (Parse injected)", |b| {
        b.iter(|| {
            unprepare(session);
            client_batch(session)
        })
    });
    group.finish();

    // + BindComplete, DataRow, CommandComplete, ReadyForQuery (and ParseComplete, swallowed).
    let mut group = c.benchmark_group("session round trip: Bind/Execute/Sync + replies");
    group.throughput(Throughput::Elements(7));
    group.bench_function("P_0 prepared on this server", |b| {
        b.iter(|| round_trip(session, &reply))
    });
    group.throughput(Throughput::Elements(8));
    group.bench_function("P_0 not on this server (Parse injected)", |b| {
        b.iter(|| {
            unprepare(session);
            round_trip(session, &miss_reply)
        })
    });
    group.finish();
    drop(held);
}

/// Simple queries as applications send them, with their literals spliced in.
const SIMPLE_QUERIES: [(&str, &str); 3] = [
    (
        "pgbench -S (59 bytes, 1 literal)",
        "SELECT abalance FROM pgbench_accounts WHERE aid = 4242217;",
    ),
    (
        "ORM point select (104 bytes, 4 literals)",
        "SELECT id, name, price FROM items WHERE id = 42 AND name = 'it''s' AND price > 10.5 LIMIT 20",
    ),
    (
        "ORM join with an IN list (262 bytes, 8 literals, a comment)",
        "SELECT o.id, o.amount, i.name FROM orders o JOIN items i ON i.id = o.item_id \
         WHERE o.customer_id = 123456 AND o.status IN ('new', 'paid', 'shipped') \
         AND o.created_at >= '2024-01-01' AND o.amount > 0 ORDER BY o.id DESC LIMIT 50 \
         /*controller='orders',action='index'*/",
    ),
];

fn bench_autoprepare(c: &mut Criterion) {
    use pgmemo::autoprepare::{Autoprepare, ClientAutoprepare};
    use pgmemo::query::lexer;
    let mut group = c.benchmark_group("autoprepare: lexer pass");
    let mut lexed = lexer::Lexed::default();
    for (name, sql) in SIMPLE_QUERIES {
        group.throughput(Throughput::Bytes(sql.len() as u64));
        group.bench_function(name, |b| {
            b.iter(|| lexer::generalize(black_box(sql.as_bytes()), &mut lexed).unwrap())
        });
    }
    group.finish();

    let global = Autoprepare::new(std::sync::Arc::new(pgmemo::query::shapes::Shapes::new(
        1000,
    )));
    let registry = pgmemo::statements::Registry::new();
    let mut client = ClientAutoprepare::default();
    let mut reader = pgmemo::query::Reader::default();
    let mut out = BytesMut::with_capacity(4096);
    let mut run = |sql: &str| {
        reader.forget();
        let statement = client
            .statement(&global, &registry, sql.as_bytes(), &mut reader, (1, 0), 1)
            .expect("generalized");
        let lexed = reader.lexed().expect("read");
        client.write_bind(lexed, statement.server_name.as_bytes(), &mut out);
        pgmemo::autoprepare::write_run(&mut out);
        out.clear();
    };
    for (name, sql) in SIMPLE_QUERIES {
        for _ in 0..100 {
            run(sql); // the shape is decided, the statement registered, buffers grown
        }
        let before = ALLOCATIONS.with(Cell::get);
        for _ in 0..1000 {
            run(sql);
        }
        let n = ALLOCATIONS.with(Cell::get) - before;
        println!(
            "autoprepare, {name}: {} allocations per query",
            n as f64 / 1000.0
        );
    }
    let mut group = c.benchmark_group("autoprepare: query to Bind/Describe/Execute/Sync");
    for (name, sql) in SIMPLE_QUERIES {
        group.throughput(Throughput::Bytes(sql.len() as u64));
        group.bench_function(name, |b| b.iter(|| run(black_box(sql))));
    }
    group.finish();
}

criterion_group!(
    benches,
    bench_autoprepare,
    bench_session,
    bench_client_batch,
    bench_server_reply,
    bench_parse_rename
);
criterion_main!(benches);
