//! What row-level invalidation costs per statement (`cargo bench --bench row_attribution`):
//! naming the rows of a write through pgmemo (an UPDATE by key, a simple query's literal), of
//! a point read's fill, and of a WAL change (test_decoding's text), each into slots of the row
//! versions. Prints ns per operation. `cargo test --all-targets` runs it with few iterations,
//! as a smoke test.

use pgmemo::cache::rows::{self, KeyType, RowKey, Values};
use pgmemo::cache::versions::Versions;
use pgmemo::query::analysis::analyze;
use pgmemo::query::lexer::{generalize, Lexed};
use std::hint::black_box;
use std::time::Instant;

fn iterations() -> usize {
    if std::env::args().any(|a| a == "--bench") {
        2_000_000
    } else {
        1_000
    }
}

fn time(name: &str, mut f: impl FnMut(usize) -> usize) {
    let n = iterations();
    let start = Instant::now();
    let mut sum = 0;
    for i in 0..n {
        sum += f(i);
    }
    black_box(sum);
    let ns = start.elapsed().as_nanos() as f64 / n as f64;
    println!("{name:<48} {ns:>8.1} ns");
}

fn main() {
    let versions = Versions::new(1 << 19);
    let key = RowKey {
        columns: vec![("aid".into(), KeyType::Integer(4))],
    };
    let update = "UPDATE pgbench_accounts SET abalance = 5 WHERE aid = 77";
    let mut lexed = Lexed::default();
    generalize(update.as_bytes(), &mut lexed).expect("lexed");
    let mut write = analyze(update).effects.rows.expect("a row write");
    // As a shape binds it: the literal 77 is the query's $2.
    let places: Vec<(u32, Option<u16>)> = lexed
        .literals
        .iter()
        .enumerate()
        .map(|(i, l)| (l.start, Some(i as u16 + 1)))
        .collect();
    write.bind_literals(&places);
    let mut out = Vec::with_capacity(8);
    time("UPDATE ... WHERE aid = <literal> (through pgmemo)", |_| {
        out.clear();
        rows::push_write_slots(
            &write,
            &key,
            &versions,
            "db",
            &Values::Lexed(&lexed),
            &mut out,
        );
        out.len()
    });

    let read = "SELECT abalance FROM pgbench_accounts WHERE aid = 77";
    let mut lexed_read = Lexed::default();
    generalize(read.as_bytes(), &mut lexed_read).expect("lexed");
    let mut analysis = analyze(read);
    analysis.bind_literals(&[(lexed_read.literals[0].start, Some(1))]);
    let filter = analysis.read.expect("a read").filter.expect("a filter");
    let plan = rows::PointPlan::new(&filter, "pgbench_accounts", &key).expect("a point read");
    time("SELECT ... WHERE aid = <literal> (a point fill)", |_| {
        out.clear();
        plan.push_slots(&versions, "db", &Values::Lexed(&lexed_read), &mut out);
        out.len()
    });

    let aid = b"77".to_vec();
    time("a WAL change's key (test_decoding's text)", |_| {
        rows::text_row_slot(&versions, "db", "pgbench_accounts", &key, |_| {
            Some(Some(&aid[..]))
        })
        .map_or(0, |s| s as usize)
    });
}
