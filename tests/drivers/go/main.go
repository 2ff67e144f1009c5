// pgx v5 through pgmemo in transaction mode, with pgx's default statement cache
// (QueryExecModeCacheStatement: every statement is prepared under a name on first use and
// executed by name afterwards, across transactions and so across server connections).
//
// Usage: go run . URL TABLE [CLIENTS] [ITERATIONS]
// (or go run . ddl ...: see ddl.go; go run . state ...: see state.go)
//
// TABLE must exist as (id int primary key, label text, amount int8) with ids 1..100,
// label 'item-<id>' and amount id*id; TABLE_log as (worker int, i int, note text,
// primary key (worker, i)) and empty. Each round also sends a batch (pgx.Batch: several
// Bind/Execute with one Sync). Prints "MISMATCH: ..." for every wrong value,
// "ERROR: ..." for every unexpected error, and "OK ..." with exit code 0 when every check
// passed; exits 1 otherwise.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime/debug"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

var (
	mu       sync.Mutex
	problems []string
	checked  atomic.Int64
)

func report(kind, format string, args ...any) {
	mu.Lock()
	defer mu.Unlock()
	problems = append(problems, kind+": "+fmt.Sprintf(format, args...))
}

func check[T comparable](got, want T, what string) {
	checked.Add(1)
	if got != want {
		report("MISMATCH", "%s: expected %v, got %v", what, want, got)
	}
}

// maxErrors bounds the errors one worker records before giving up, so that a run without
// prepared-statement support ends quickly.
const maxErrors = 5

func worker(ctx context.Context, url, table string, w, iterations int) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		report("ERROR", "worker %d: connect: %v", w, err)
		return
	}
	defer conn.Close(context.Background())
	errs := 0
	committed := 0
	fail := func(i int, err error) bool {
		report("ERROR", "worker %d iteration %d: %v", w, i, err)
		errs++
		return errs >= maxErrors
	}
	for i := 0; i < iterations; i++ {
		if err := iteration(ctx, conn, table, w, i); err != nil {
			if fail(i, err) {
				return
			}
			if conn.IsClosed() {
				return
			}
		} else {
			committed++
		}
	}
	var n int64
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM "+table+"_log WHERE worker = $1", w).Scan(&n); err != nil {
		fail(iterations, err)
		return
	}
	check(n, int64(committed), fmt.Sprintf("worker %d: rows committed", w))
}

func iteration(ctx context.Context, conn *pgx.Conn, table string, w, i int) error {
	// A statement with several parameter types, a NULL among them.
	var a int32
	var b string
	var c *int64
	var d float64
	label := fmt.Sprintf("w%d-i%d-é", w, i)
	if err := conn.QueryRow(ctx, "SELECT $1::int4 * 2 + $2::int4, $3::text || '!', $4::int8, $5::float8 / 4",
		w, i, label, nil, float64(i)).Scan(&a, &b, &c, &d); err != nil {
		return err
	}
	check(a, int32(w*2+i), "arithmetic")
	check(b, label+"!", "text")
	check(c == nil, true, "null")
	check(d, float64(i)/4, "float")

	// A row by key, and an aggregate.
	id := (w*7+i)%100 + 1
	var got string
	var amount int64
	if err := conn.QueryRow(ctx, "SELECT label, amount FROM "+table+" WHERE id = $1", id).Scan(&got, &amount); err != nil {
		return err
	}
	check(got, fmt.Sprintf("item-%d", id), "label by id")
	check(amount, int64(id*id), "amount by id")
	n := i%100 + 1
	var count, sum int64
	if err := conn.QueryRow(ctx, "SELECT count(*), sum(amount)::int8 FROM "+table+" WHERE id <= $1", n).Scan(&count, &sum); err != nil {
		return err
	}
	check(count, int64(n), "count")
	check(sum, int64(n*(n+1)*(2*n+1)/6), "sum of squares")

	// Eight distinct statements, one per k, used in turn.
	k := i % 8
	var v int32
	if err := conn.QueryRow(ctx, "SELECT $1::int4 + "+strconv.Itoa(k)+" AS k"+strconv.Itoa(k), i).Scan(&v); err != nil {
		return err
	}
	check(v, int32(i+k), "distinct statement")

	// Several rows.
	rows, err := conn.Query(ctx, "SELECT g, $1::text || g FROM generate_series(1, $2::int4) g", "r", i%5+1)
	if err != nil {
		return err
	}
	seen := 0
	for rows.Next() {
		var g int32
		var s string
		if err := rows.Scan(&g, &s); err != nil {
			rows.Close()
			return err
		}
		seen++
		check(g, int32(seen), "series value")
		check(s, "r"+strconv.Itoa(seen), "series text")
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	check(seen, i%5+1, "series length")

	// A batch: pgx prepares the statements it has not cached yet, then sends every Bind and
	// Execute with one Sync.
	batch := &pgx.Batch{}
	for j := 0; j < 3; j++ {
		batch.Queue("SELECT $1::int4 * $2::int4 + 1", i, j)
	}
	batch.Queue("SELECT label, amount FROM "+table+" WHERE id = $1", id)
	results := conn.SendBatch(ctx, batch)
	for j := 0; j < 3; j++ {
		if err := results.QueryRow().Scan(&v); err != nil {
			results.Close()
			return err
		}
		check(v, int32(i*j+1), "batch value")
	}
	if err := results.QueryRow().Scan(&got, &amount); err != nil {
		results.Close()
		return err
	}
	check(got, fmt.Sprintf("item-%d", id), "label by id in a batch")
	if err := results.Close(); err != nil {
		return err
	}

	// An expected error now and then; the connection goes on.
	if i%10 == 3 {
		var x int32
		err := conn.QueryRow(ctx, "SELECT 1 / $1::int4", 0).Scan(&x)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "22012" {
			report("MISMATCH", "division by zero: expected 22012, got %v", err)
		}
		checked.Add(1)
	}

	// Now and then forget every prepared statement (DEALLOCATE ALL and pgx's cache with it):
	// the next uses prepare them again.
	if i%10 == 7 {
		if err := conn.DeallocateAll(ctx); err != nil {
			return err
		}
	}

	// A transaction: insert, read back, commit.
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	note := fmt.Sprintf("note %d/%d", w, i)
	if _, err := tx.Exec(ctx, "INSERT INTO "+table+"_log (worker, i, note) VALUES ($1, $2, $3)", w, i, note); err != nil {
		return err
	}
	if err := tx.QueryRow(ctx, "SELECT note FROM "+table+"_log WHERE worker = $1 AND i = $2", w, i).Scan(&got); err != nil {
		return err
	}
	check(got, note, "note read back in the transaction")
	if err := tx.QueryRow(ctx, "SELECT label, amount FROM "+table+" WHERE id = $1", id).Scan(&got, &amount); err != nil {
		return err
	}
	check(got, fmt.Sprintf("item-%d", id), "label by id in the transaction")
	return tx.Commit(ctx)
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "ddl" {
		ddlMain(os.Args[2:])
		return
	}
	if len(os.Args) > 1 && os.Args[1] == "state" {
		stateMain(os.Args[2:])
		return
	}
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: pgx-check URL TABLE [CLIENTS] [ITERATIONS]")
		os.Exit(2)
	}
	url, table := os.Args[1], os.Args[2]
	clients, iterations := 24, 30
	if len(os.Args) > 3 {
		clients, _ = strconv.Atoi(os.Args[3])
	}
	if len(os.Args) > 4 {
		iterations, _ = strconv.Atoi(os.Args[4])
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for w := 0; w < clients; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			worker(ctx, url, table, w, iterations)
		}(w)
	}
	wg.Wait()
	if len(problems) > 0 {
		for _, p := range problems {
			fmt.Println(p)
		}
		os.Exit(1)
	}
	version := "v5"
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, dep := range info.Deps {
			if dep.Path == "github.com/jackc/pgx/v5" {
				version = dep.Version
			}
		}
	}
	fmt.Printf("OK pgx %s: %d clients x %d iterations, %d values checked\n", version, clients, iterations, checked.Load())
}
