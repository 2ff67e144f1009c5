// node-postgres through pgmemo with autoprepare: the application splices values into the
// query text (client.escapeLiteral), so every query is a simple-protocol Query.
//
// Usage: node autoprepare.js URL TABLE [CLIENTS] [ITERATIONS]
// TABLE as for autoprepare_psycopg2.py. Prints MISMATCH/ERROR lines, or "OK ..." and exits 0.
'use strict';
const { Client } = require('pg');

const [url, table] = process.argv.slice(2, 4);
const clients = Number(process.argv[4] || 8);
const iterations = Number(process.argv[5] || 40);
const problems = [];
let checked = 0;

function check(got, want, what) {
  checked++;
  if (JSON.stringify(got) !== JSON.stringify(want)) {
    problems.push(`MISMATCH: ${what}: expected ${JSON.stringify(want)}, got ${JSON.stringify(got)}`);
  }
}

async function worker(w) {
  const c = new Client({ connectionString: url });
  await c.connect();
  try {
    for (let i = 0; i < iterations; i++) {
      const id = (w * 11 + i) % 100 + 1;
      let r = await c.query(`SELECT label, amount::text FROM ${table} WHERE id = ${id}`);
      check(r.rows[0], { label: `item-${id}`, amount: String(id * id) }, 'row by id');
      const s = `it's w${w} \\ i${i} é`;
      r = await c.query(`SELECT ${c.escapeLiteral(s)} || '!' AS t, length(${c.escapeLiteral(s)}) AS n`);
      check(r.rows[0], { t: s + '!', n: [...s].length }, 'escaped string');
      r = await c.query(`SELECT ${i} * 2 + ${w} AS v, ${i}.5::text AS f`);
      check(r.rows[0], { v: i * 2 + w, f: `${i}.5` }, 'numbers');
      await c.query('BEGIN');
      await c.query(`INSERT INTO ${table}_log VALUES (${1000 + w}, ${i}, ${c.escapeLiteral('node ' + i)})`);
      await c.query('COMMIT');
    }
    const r = await c.query(`SELECT count(*)::int AS n FROM ${table}_log WHERE worker = ${1000 + w}`);
    check(r.rows[0].n, iterations, 'committed inserts');
    const prefix = `SELECT * FROM ${table} WHERE id = `;
    try {
      await c.query(`${prefix}'x'`);
      check('no error', '22P02', 'invalid input');
    } catch (e) {
      // PostgreSQL reports the literal's position (1-based characters).
      check([e.code, e.position], ['22P02', String(prefix.length + 1)], 'invalid input error and position');
    }
  } catch (e) {
    problems.push(`ERROR: worker ${w}: ${e.message}`);
  } finally {
    await c.end();
  }
}

(async () => {
  await Promise.all(Array.from({ length: clients }, (_, w) => worker(w)));
  for (const p of problems.slice(0, 50)) console.log(p);
  if (problems.length) process.exit(1);
  console.log(`OK ${checked} values checked, ${clients} clients`);
})();
