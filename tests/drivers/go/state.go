package main

// The "state" mode: session state through pgmemo in transaction mode, as pgx uses it. Two
// clients each make a temporary table of the same name with other columns and read their own
// across transactions (pgx's statement cache prepares the same text for both); one LISTENs and
// gets the other's NOTIFY and its own (with its own process ID, as pgx reports it); a
// session-level advisory lock blocks the other client until it is released.
//
// Usage: pgx-check state URL
//
// Prints "MISMATCH: ..." for every wrong value, "ERROR: ..." for every unexpected error, and
// "OK ..." with exit code 0 when every check passed; exits 1 otherwise.

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
)

func must(err error, what string) bool {
	if err != nil {
		report("ERROR", "%s: %v", what, err)
		return false
	}
	return true
}

func stateMain(args []string) {
	if len(args) < 1 {
		fmt.Fprintln(os.Stderr, "usage: pgx-check state URL")
		os.Exit(2)
	}
	url := args[0]
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	a, err := pgx.Connect(ctx, url)
	if !must(err, "connect a") {
		finish()
	}
	defer a.Close(context.Background())
	b, err := pgx.Connect(ctx, url)
	if !must(err, "connect b") {
		finish()
	}
	defer b.Close(context.Background())

	// Temporary tables: the same name, other columns, each client its own.
	_, err = a.Exec(ctx, "CREATE TEMP TABLE pgx_scratch (v int); INSERT INTO pgx_scratch VALUES (1), (2)")
	must(err, "a: create temp table")
	_, err = b.Exec(ctx, "CREATE TEMP TABLE pgx_scratch (v text); INSERT INTO pgx_scratch VALUES ('b')")
	must(err, "b: create temp table")
	for round := 0; round < 5; round++ {
		var sum int
		must(a.QueryRow(ctx, "SELECT sum(v)::int FROM pgx_scratch WHERE v > $1", 0).Scan(&sum), "a: read")
		check(sum, 3+round, fmt.Sprintf("a's temp table, round %d", round))
		var text string
		must(b.QueryRow(ctx, "SELECT string_agg(v, ',') FROM pgx_scratch WHERE v > $1", "").Scan(&text), "b: read")
		check(text, "b", fmt.Sprintf("b's temp table, round %d", round))
		_, err = a.Exec(ctx, "UPDATE pgx_scratch SET v = v + 1 WHERE v = (SELECT max(v) FROM pgx_scratch)")
		must(err, "a: update")
	}

	// LISTEN / NOTIFY: another client's notification, then the listener's own.
	_, err = a.Exec(ctx, "LISTEN pgx_jobs")
	must(err, "a: listen")
	_, err = b.Exec(ctx, "SELECT pg_notify('pgx_jobs', 'from b')")
	must(err, "b: notify")
	wait, stop := context.WithTimeout(ctx, 10*time.Second)
	n, err := a.WaitForNotification(wait)
	stop()
	if must(err, "a: wait for b's notification") {
		check(n.Channel, "pgx_jobs", "channel")
		check(n.Payload, "from b", "payload")
	}
	_, err = a.Exec(ctx, "NOTIFY pgx_jobs, 'own'")
	must(err, "a: own notify")
	wait, stop = context.WithTimeout(ctx, 10*time.Second)
	n, err = a.WaitForNotification(wait)
	stop()
	if must(err, "a: wait for its own notification") {
		check(n.Payload, "own", "own payload")
		check(n.PID, a.PgConn().PID(), "own notification's process ID")
	}

	// Session-level advisory locks hold across transactions and block the other client.
	var got bool
	must(a.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", int64(9001)).Scan(&got), "a: lock")
	check(got, true, "a takes the lock")
	must(b.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", int64(9001)).Scan(&got), "b: try lock")
	check(got, false, "b is refused while a holds it")
	must(a.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", int64(9001)).Scan(&got), "a: lock again")
	check(got, true, "a takes it again (re-entrant)")
	must(a.QueryRow(ctx, "SELECT pg_advisory_unlock($1) AND pg_advisory_unlock($1)", int64(9001)).Scan(&got), "a: unlock")
	check(got, true, "a releases it twice")
	must(b.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", int64(9001)).Scan(&got), "b: lock")
	check(got, true, "b takes it once a released it")
	_, err = b.Exec(ctx, "SELECT pg_advisory_unlock_all()")
	must(err, "b: unlock all")
	finish()
}

func finish() {
	mu.Lock()
	defer mu.Unlock()
	for _, p := range problems {
		fmt.Println(p)
	}
	if len(problems) > 0 {
		os.Exit(1)
	}
	fmt.Printf("OK state: %d checks\n", checked.Load())
	os.Exit(0)
}
