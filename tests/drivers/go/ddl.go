package main

// The "ddl" mode: what pgx sees when a DDL changes the result of a statement it has prepared
// and described. The Rust test runs it against PostgreSQL directly and through pgmemo and
// compares the transcripts.
//
// Usage: pgx-check ddl DIRECT_URL URL TABLE
//
// DIRECT_URL reaches PostgreSQL itself (for the DDL); URL is what the clients use. Prints one
// line per step: what each of two clients got for `SELECT * FROM TABLE WHERE id = $1`, by
// column name, before and after the columns a and b swap names, and what a client that
// prepares the statement only after the DDL gets.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

func ddlOutcome(ctx context.Context, c *pgx.Conn, query string) string {
	rows, err := c.Query(ctx, query, 1)
	if err != nil {
		return describeErr(err)
	}
	var out []string
	for rows.Next() {
		values, err := rows.Values()
		if err != nil {
			rows.Close()
			return "scan error: " + err.Error()
		}
		var cols []string
		for i, f := range rows.FieldDescriptions() {
			if i < len(values) {
				cols = append(cols, fmt.Sprintf("%s=%v", f.Name, values[i]))
			}
		}
		out = append(out, strings.Join(cols, " "))
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return describeErr(err)
	}
	return "OK " + strings.Join(out, "; ")
}

func describeErr(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return "ERROR " + pgErr.Code + " " + pgErr.Message
	}
	return "ERROR " + err.Error()
}

func ddlMain(args []string) {
	if len(args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: pgx-check ddl DIRECT_URL URL TABLE")
		os.Exit(2)
	}
	directURL, url, table := args[0], args[1], args[2]
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	must := func(err error) {
		if err != nil {
			fmt.Println("FATAL", err)
			os.Exit(1)
		}
	}
	direct, err := pgx.Connect(ctx, directURL)
	must(err)
	defer direct.Close(ctx)
	_, err = direct.Exec(ctx, "DROP TABLE IF EXISTS "+table+"; CREATE TABLE "+table+
		" (id int, a text, b text); INSERT INTO "+table+" VALUES (1, 'value-of-a', 'value-of-b')")
	must(err)
	query := "SELECT * FROM " + table + " WHERE id = $1"
	var clients []*pgx.Conn
	for i := 0; i < 2; i++ {
		c, err := pgx.Connect(ctx, url)
		must(err)
		defer c.Close(ctx)
		clients = append(clients, c)
	}
	for round := 0; round < 2; round++ {
		for n, c := range clients {
			fmt.Printf("before, round %d, client %d: %s\n", round, n, ddlOutcome(ctx, c, query))
		}
	}
	_, err = direct.Exec(ctx, "ALTER TABLE "+table+" RENAME COLUMN a TO tmp; ALTER TABLE "+table+
		" RENAME COLUMN b TO a; ALTER TABLE "+table+" RENAME COLUMN tmp TO b")
	must(err)
	for round := 0; round < 3; round++ {
		for n, c := range clients {
			fmt.Printf("after, round %d, client %d: %s\n", round, n, ddlOutcome(ctx, c, query))
		}
	}
	late, err := pgx.Connect(ctx, url)
	must(err)
	defer late.Close(ctx)
	fmt.Printf("after, a new client: %s\n", ddlOutcome(ctx, late, query))
}
