// node-postgres through pgmemo in transaction mode, with named queries ({name, text, values}):
// node-postgres sends Parse for a name only the first time the connection uses it and Binds
// it by name afterwards, across transactions and so across server connections.
//
// Usage: node check.js URL TABLE [CLIENTS] [ITERATIONS]
//
// TABLE must exist as (id int primary key, label text, amount int8) with ids 1..100,
// label 'item-<id>' and amount id*id; TABLE_log as (worker int, i int, note text,
// primary key (worker, i)) and empty. Prints "MISMATCH: ..." for every wrong value,
// "ERROR: ..." for every unexpected error, and "OK ..." with exit code 0 when every check
// passed; exits 1 otherwise.
'use strict';

const { Client } = require('pg');

const [url, table, clientsArg, iterationsArg] = process.argv.slice(2);
if (!url || !table) {
  console.error('usage: node check.js URL TABLE [CLIENTS] [ITERATIONS]');
  process.exit(2);
}
const clients = Number(clientsArg || 24);
const iterations = Number(iterationsArg || 30);
// Errors one worker records before giving up, so that a run without prepared-statement
// support ends quickly.
const MAX_ERRORS = 5;

const problems = [];
let checked = 0;

function check(got, want, what) {
  checked++;
  if (got !== want) {
    problems.push(`MISMATCH: ${what}: expected ${JSON.stringify(want)}, got ${JSON.stringify(got)}`);
  }
}

async function one(client, name, text, values) {
  const res = await client.query({ name, text, values });
  if (res.rows.length !== 1) {
    throw new Error(`${name}: expected one row, got ${res.rows.length}`);
  }
  return res.rows[0];
}

async function iteration(client, w, i) {
  // Several parameter types, a NULL among them. int8 comes back as a string.
  const label = `w${w}-i${i}-é`;
  let r = await one(
    client,
    'arith',
    'SELECT $1::int4 * 2 + $2::int4 AS a, $3::text || \'!\' AS b, $4::int8 AS c, $5::float8 / 4 AS d',
    [w, i, label, null, i],
  );
  check(r.a, w * 2 + i, 'arithmetic');
  check(r.b, `${label}!`, 'text');
  check(r.c, null, 'null');
  check(r.d, i / 4, 'float');

  // A row by key, and an aggregate.
  const id = ((w * 7 + i) % 100) + 1;
  r = await one(client, 'by_id', `SELECT label, amount FROM ${table} WHERE id = $1`, [id]);
  check(r.label, `item-${id}`, 'label by id');
  check(r.amount, String(id * id), 'amount by id');
  const n = (i % 100) + 1;
  r = await one(client, 'agg', `SELECT count(*) AS n, sum(amount)::int8 AS s FROM ${table} WHERE id <= $1`, [n]);
  check(r.n, String(n), 'count');
  check(r.s, String((n * (n + 1) * (2 * n + 1)) / 6), 'sum of squares');

  // Eight distinct statements, one per k, used in turn.
  const k = i % 8;
  r = await one(client, `k${k}`, `SELECT $1::int4 + ${k} AS v`, [i]);
  check(r.v, i + k, 'distinct statement');

  // Several rows.
  const len = (i % 5) + 1;
  const rows = await client.query({
    name: 'series',
    text: 'SELECT g, $1::text || g AS s FROM generate_series(1, $2::int4) g',
    values: ['r', len],
  });
  check(rows.rows.length, len, 'series length');
  rows.rows.forEach((row, j) => {
    check(row.g, j + 1, 'series value');
    check(row.s, `r${j + 1}`, 'series text');
  });

  // An expected error now and then; the connection goes on.
  if (i % 10 === 3) {
    let code = null;
    try {
      await client.query({ name: 'div', text: 'SELECT 1 / $1::int4', values: [0] });
    } catch (e) {
      code = e.code;
    }
    check(code, '22012', 'division by zero');
  }

  // A transaction: insert, read back, commit.
  await client.query('BEGIN');
  try {
    const note = `note ${w}/${i}`;
    await client.query({
      name: 'insert',
      text: `INSERT INTO ${table}_log (worker, i, note) VALUES ($1, $2, $3)`,
      values: [w, i, note],
    });
    r = await one(client, 'note', `SELECT note FROM ${table}_log WHERE worker = $1 AND i = $2`, [w, i]);
    check(r.note, note, 'note read back in the transaction');
    r = await one(client, 'by_id', `SELECT label, amount FROM ${table} WHERE id = $1`, [id]);
    check(r.label, `item-${id}`, 'label by id in the transaction');
    await client.query('COMMIT');
  } catch (e) {
    await client.query('ROLLBACK').catch(() => {});
    throw e;
  }
}

async function worker(w) {
  const client = new Client({ connectionString: url });
  client.on('error', () => {});
  try {
    await client.connect();
  } catch (e) {
    problems.push(`ERROR: worker ${w}: connect: ${e.message}`);
    return;
  }
  let errors = 0;
  let committed = 0;
  try {
    for (let i = 0; i < iterations; i++) {
      try {
        await iteration(client, w, i);
        committed++;
      } catch (e) {
        problems.push(`ERROR: worker ${w} iteration ${i}: ${e.code ? `${e.code} ` : ''}${e.message}`);
        if (++errors >= MAX_ERRORS) return;
      }
    }
    const r = await one(client, 'count_log', `SELECT count(*) AS n FROM ${table}_log WHERE worker = $1`, [w]);
    check(r.n, String(committed), `worker ${w}: rows committed`);
  } catch (e) {
    problems.push(`ERROR: worker ${w}: ${e.code ? `${e.code} ` : ''}${e.message}`);
  } finally {
    await client.end().catch(() => {});
  }
}

async function main() {
  const timer = setTimeout(() => {
    console.log('ERROR: timed out after 60 s');
    process.exit(1);
  }, 60000);
  await Promise.all(Array.from({ length: clients }, (_, w) => worker(w)));
  clearTimeout(timer);
  if (problems.length > 0) {
    problems.forEach((p) => console.log(p));
    process.exit(1);
  }
  const version = require('pg/package.json').version;
  console.log(`OK node-postgres ${version}: ${clients} clients x ${iterations} iterations, ${checked} values checked`);
}

main().catch((e) => {
  console.log(`ERROR: ${e.stack || e}`);
  process.exit(1);
});
